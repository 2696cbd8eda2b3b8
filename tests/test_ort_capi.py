"""The ctypes binding of ORT's C API (workers/ort_capi.py) against onnxruntime's Python API on the
same models: numeric and UTF-8 string models give the same answers, errors the same exception
classes; bytes the Python API cannot carry pass exactly; nothing leaks; a library the binding
does not know is refused cleanly. ``python -m tests.test_ort_capi`` prints the per-call cost ratio."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto as T

from batchgate.workers import ort_capi
from batchgate.workers.engine import from_ort_strings, to_ort_strings
from tests.string_models import write_add_sub, write_identity, write_mixed, write_string_add_sub

EXACT = [b"\xff\xfe", b"a\x00b", b"\x00", b"", b"\x80abc\x00", b"ok\x80", b"\xc3", b"\xed\xa0\x80", b"plain"]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("capi")
    out = {}
    for name, elem in (("f32", T.FLOAT), ("i64", T.INT64), ("u8", T.UINT8), ("f16", T.FLOAT16),
                       ("f64", T.DOUBLE), ("bool", T.BOOL), ("i8", T.INT8)):  # fmt: skip
        write_identity(root, f"id_{name}", elem)
    write_add_sub(root, "add_i32", T.INT32)
    write_add_sub(root, "add_f32", T.FLOAT)
    write_identity(root, "id_str", T.STRING)
    write_string_add_sub(root, "cast")
    write_mixed(root, "mixed")
    for d in root.iterdir():
        out[d.name] = d / "1" / "model.onnx"
    return out


def _py(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _py_run(sess: ort.InferenceSession, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    feeds = {k: to_ort_strings(k, v) if v.dtype == object else v for k, v in feeds.items()}
    return [from_ort_strings(a) if a.dtype == object else a for a in sess.run(None, feeds)]


def strings(values, shape=None) -> np.ndarray:
    a = np.empty(len(values), dtype=object)
    a[:] = list(values)
    return a.reshape(shape or (1, len(values)))


def _same(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, w.dtype, g.shape, w.shape)
        assert g.tolist() == w.tolist()


def test_the_installed_library_is_bound():
    api = ort_capi.load()
    assert api is not None and ort_capi.available()
    assert api.version == ort.__version__
    assert api.path == ort_capi.library_path()


def test_numeric_models_answer_as_the_python_api(models):
    rng = np.random.default_rng(0)
    cases = {
        "id_f32": rng.standard_normal((3, 5)).astype(np.float32),
        "id_i64": rng.integers(-(2**62), 2**62, (2, 4)),
        "id_u8": rng.integers(0, 255, (1, 7)).astype(np.uint8),
        "id_i8": rng.integers(-128, 127, (1, 7)).astype(np.int8),
        "id_f16": rng.standard_normal((2, 3)).astype(np.float16),
        "id_f64": rng.standard_normal((4, 1)),
        "id_bool": rng.integers(0, 2, (2, 6)).astype(np.bool_),
    }
    for name, x in cases.items():
        _same(
            ort_capi.Session(models[name]).run(None, {"INPUT0": x}),
            _py(models[name]).run(None, {"INPUT0": x}),
        )
    # a zero-length dim, and a view that is not contiguous
    empty = np.zeros((1, 0), np.float32)
    _same(ort_capi.Session(models["id_f32"]).run(None, {"INPUT0": empty}), [empty])
    strided = cases["id_f32"][:, ::2]
    _same(ort_capi.Session(models["id_f32"]).run(None, {"INPUT0": strided}), [np.ascontiguousarray(strided)])
    for name, dt in (("add_i32", np.int32), ("add_f32", np.float32)):
        a, b = (rng.integers(-100, 100, (3, 16)).astype(dt) for _ in range(2))
        c, p = ort_capi.Session(models[name]), _py(models[name])
        assert c.input_names == [i.name for i in p.get_inputs()]
        assert c.output_names == [o.name for o in p.get_outputs()]
        _same(c.run(None, {"INPUT0": a, "INPUT1": b}), p.run(None, {"INPUT0": a, "INPUT1": b}))
        _same(c.run(["OUTPUT1"], {"INPUT0": a, "INPUT1": b}), p.run(["OUTPUT1"], {"INPUT0": a, "INPUT1": b}))


def test_utf8_string_models_answer_as_the_python_api(models):
    utf8 = [b"", b"a\x00b", b"\x00", "é".encode(), "日本".encode(), b"plain", "😀".encode()]
    x = strings(utf8 * 2, (2, 7))
    _same(
        ort_capi.Session(models["id_str"]).run(None, {"INPUT0": x}),
        _py_run(_py(models["id_str"]), {"INPUT0": x}),
    )
    nums = strings([str(v).encode() for v in range(-8, 8)], (1, 16))
    feeds = {"INPUT0": nums, "INPUT1": nums[:, ::-1].copy()}
    _same(ort_capi.Session(models["cast"]).run(None, feeds), _py_run(_py(models["cast"]), feeds))
    feeds = {"TEXT": strings(utf8[:3], (3, 1)), "NUM": np.array([[1], [2], [3]], np.int32),
             "OTHER": strings([b"", b"x", b"\x00"], (3, 1))}  # fmt: skip
    _same(ort_capi.Session(models["mixed"]).run(None, feeds), _py_run(_py(models["mixed"]), feeds))
    # from bytes, as from a path
    s = ort_capi.Session(models["mixed"].read_bytes())
    _same(s.run(None, feeds), _py_run(_py(models["mixed"]), feeds))


def test_any_bytes_pass_exactly(models):
    s = ort_capi.Session(models["id_str"])
    big = bytes(range(256)) * 4096  # 1 MiB, every byte value, NULs inside
    for values in (EXACT, [b"\x00"], [b""], [b"", b""], [big, b"x"], [b"n\x00"] * 500 + [b"\xff"] * 500):
        x = strings(values)
        (out,) = s.run(None, {"INPUT0": x})
        assert [type(v) for v in out.reshape(-1)] == [bytes] * len(values)
        assert out.reshape(-1).tolist() == list(values)
    x = strings(["é", bytearray(b"\x00\xff"), memoryview(b"mv"), np.bytes_(b"a\x00")])
    assert s.run(None, {"INPUT0": x})[0].tolist() == [["é".encode(), b"\x00\xff", b"mv", b"a\x00"]]
    # the mixed model: StringConcat and Equal on bytes that are not UTF-8
    feeds = {"TEXT": strings([b"\xff\x00", b"\x80"], (2, 1)), "NUM": np.array([[7], [-1]], np.int32),
             "OTHER": strings([b"\xff\x00", b"\x80\x00"], (2, 1))}  # fmt: skip
    joined, twice, same = ort_capi.Session(models["mixed"]).run(None, feeds)
    assert joined.tolist() == [[b"\xff\x007"], [b"\x80-1"]]
    assert twice.tolist() == [[14], [-2]] and same.tolist() == [[True], [False]]


def test_errors_are_the_python_apis(models):
    c, p = ort_capi.Session(models["cast"]), _py(models["cast"])
    good = strings([b"1"] * 16)

    def both(feeds_c, feeds_p=None):
        errors = []
        for run, feeds in ((c.run, feeds_c), (p.run, feeds_p or feeds_c)):
            with pytest.raises(Exception) as err:
                run(None, feeds)
            errors.append(err.value)
        assert type(errors[0]) is type(errors[1]), errors
        return errors

    wrong_type = {"INPUT0": np.zeros((1, 16), np.int32), "INPUT1": good}
    e, _ = both(wrong_type, {"INPUT0": np.zeros((1, 16), np.int32), "INPUT1": to_ort_strings("", good)})
    assert "INVALID_ARGUMENT" in str(e) and "expected: (tensor(string))" in str(e)
    bad = strings([b"zz"] * 16)
    e, _ = both({"INPUT0": bad, "INPUT1": good}, {"INPUT0": bad.astype(str), "INPUT1": good.astype(str)})
    assert "RUNTIME_EXCEPTION" in str(e) and "Cast" in str(e)
    e, _ = both({"INPUT1": good}, {"INPUT1": good.astype(str)})
    assert isinstance(e, ValueError) and "INPUT0" in str(e)
    for model in ("/nonexistent/model.onnx", b"not a model"):
        errors = []
        for make in (ort_capi.Session, lambda m: ort.InferenceSession(m if isinstance(m, bytes) else str(m))):
            with pytest.raises(Exception) as err:
                make(model)
            errors.append(err.value)
        assert type(errors[0]) is type(errors[1]), errors
    with pytest.raises(ValueError, match="input 'INPUT0': element 1 is a int, not a string"):
        ort_capi.Session(models["id_str"]).run(None, {"INPUT0": strings([b"ok", 3])})  # never bytes(3)
    with pytest.raises(ValueError, match="input 'INPUT0': numpy dtype complex64"):
        ort_capi.Session(models["id_f32"]).run(None, {"INPUT0": np.zeros((1, 2), np.complex64)})


def test_a_library_it_does_not_know_is_refused(monkeypatch, caplog):
    path = ort_capi.library_path()
    monkeypatch.setattr(ort_capi, "API_VERSION", 10**6)  # newer than any library: GetApi answers NULL
    with pytest.raises(OSError, match="does not provide version 1000000 of the C API"):
        ort_capi.Api(path)
    monkeypatch.setattr(ort_capi, "_tried", False)
    monkeypatch.setattr(ort_capi, "_api", None)
    with caplog.at_level(logging.WARNING, logger="batchgate.workers.ort_capi"):
        assert ort_capi.load() is None and not ort_capi.available()
    assert "string tensors pass to models as UTF-8 only" in caplog.text
    # a library that is not ONNX Runtime at all
    monkeypatch.setattr(ort_capi, "API_VERSION", 29)
    monkeypatch.setattr(ort_capi, "_tried", False)
    monkeypatch.setattr(ort_capi, "library_path", lambda: Path(np.__file__))  # not a shared library
    assert ort_capi.load() is None
    monkeypatch.setattr(ort_capi, "_tried", False)
    monkeypatch.setattr(ort_capi, "library_path", lambda: None)
    assert ort_capi.load() is None


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def test_nothing_leaks(models):
    s = ort_capi.Session(models["mixed"])
    rng = np.random.default_rng(1)
    pool = [bytes(rng.integers(0, 256, int(n), dtype=np.uint8)) for n in rng.integers(0, 300, 64)]

    def once(i: int) -> None:
        rows = 1 + i % 8
        text = strings([pool[(i + r) % 64] for r in range(rows)], (rows, 1))
        feeds = {"TEXT": text, "NUM": np.arange(rows, dtype=np.int32).reshape(rows, 1), "OTHER": text}
        joined, _, same = s.run(None, feeds)
        assert same.all() and joined[0, 0].startswith(text[0, 0])
        if i % 10 == 0:  # failing runs release what they made too
            with pytest.raises(Exception):
                s.run(None, {**feeds, "NUM": feeds["NUM"].astype(np.int64)})

    for i in range(2000):
        once(i)
    before = _rss_mib()
    for i in range(20000):  # ~40 MB of strings in and out: a leak of any of it shows
        once(i)
    grown_runs = _rss_mib() - before
    for _ in range(10):
        ort_capi.Session(models["mixed"]).close()
    before = _rss_mib()
    for _ in range(100):
        t = ort_capi.Session(models["mixed"])
        t.run(None, {"TEXT": strings([b"a"], (1, 1)), "NUM": np.ones((1, 1), np.int32),
                     "OTHER": strings([b"b"], (1, 1))})  # fmt: skip
        t.close()
    grown_sessions = _rss_mib() - before
    assert grown_runs < 4, f"RSS grew {grown_runs:.1f} MiB over 20000 runs"
    assert grown_sessions < 4, f"RSS grew {grown_sessions:.1f} MiB over 100 sessions"


def test_threads_share_a_session(models):
    s = ort_capi.Session(models["id_str"])
    errors = []

    def work(k: int) -> None:
        try:
            for i in range(300):
                x = strings([b"%d\x00%d\xff" % (k, i)] * (1 + i % 5))
                assert s.run(None, {"INPUT0": x})[0].tolist() == x.tolist()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def cost_ratio(path: Path, rounds: int = 7, calls: int = 2000) -> tuple[float, float]:
    """Per-call CPU µs of one string model, C API vs the Python API's UTF-8 path (the conversions
    included), interleaved rounds on one thread, best round of each."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    py = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    c = ort_capi.Session(path)
    rng = np.random.default_rng(2)
    xs = [strings([b"w" * int(n) for n in rng.integers(1, 64, 16)], (1, 16)) for _ in range(251)]
    best = {"py": float("inf"), "c": float("inf")}
    for _ in range(rounds):
        for name in best:
            t0 = time.process_time()
            for i in range(calls):
                x = {"INPUT0": xs[i % 251]}
                if name == "c":
                    c.run(None, x)
                else:
                    _py_run(py, x)
            best[name] = min(best[name], (time.process_time() - t0) / calls * 1e6)
    return best["c"], best["py"]


def test_the_c_api_costs_a_small_factor_of_the_python_api(models):
    c_us, py_us = cost_ratio(models["id_str"], rounds=3, calls=500)
    print(
        f"string identity, 16 elements: C API {c_us:.1f} us, Python API {py_us:.1f} us, ratio {c_us / py_us:.2f}"
    )
    assert c_us < 5 * py_us  # measured 1.5-2x (docs/performance.md); far more means a regression


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        write_identity(Path(tmp), "id_str", T.STRING)
        c_us, py_us = cost_ratio(Path(tmp) / "id_str" / "1" / "model.onnx")
    print(f"string identity [1,16]: C API {c_us:.1f} us/call, Python API (UTF-8) {py_us:.1f} us/call, "
          f"ratio {c_us / py_us:.2f}")  # fmt: skip
