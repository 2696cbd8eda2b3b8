"""BYTES tensors reach ONNX models byte for byte, and come back so: NUL bytes, empty strings,
multi-byte UTF-8 and bytes that are not UTF-8 included, over the four encodings (gRPC
raw_input_contents, gRPC typed bytes_contents, REST JSON, REST binary data; JSON carries only
what JSON strings can, i.e. UTF-8), on string models built here with onnx.helper (Identity,
Triton's simple_string shape: Cast string -> int -> string, and a model mixing a string op with
number inputs). String models run through ORT's C API (workers/ort_capi.py); only where that
cannot be loaded are non-UTF-8 bytes refused with INVALID_ARGUMENT naming the input. The result
cache and the batcher keep rows of strings apart."""

from __future__ import annotations

import concurrent.futures
import json
import struct
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from onnx import TensorProto as T

from batchgate.gateway.codec import Codec, deserialize_bytes, serialize_bytes
from batchgate.gateway.errors import GatewayError
from batchgate.proto.inference.v2 import grpc_service_pb2 as pb
from batchgate.proto.inference.v2 import grpc_service_pb2_grpc as pb_grpc
from batchgate.workers import Device, EngineOptions, gpu_count, ort_capi
from batchgate.workers.engine import Engine, from_ort_strings, to_ort_strings
from tests.conftest import start_server
from tests.test_limits import Wire
from tests.string_models import write_identity, write_mixed, write_string_add_sub


TIMEOUT_S = 30.0
ENCODINGS = ["grpc-raw", "grpc-typed", "rest-json", "rest-binary"]
# Every element valid UTF-8: the empty string, NULs anywhere, 2-, 3- and 4-byte sequences, spaces.
NASTY = [b"", b"a\x00b", b"\x00", b"\x00\x00tail", "é".encode(), "日本".encode(), b"plain",
         "😀".encode(), b" sp ace ", b"\x01\x02\x03\x7f"]  # fmt: skip
NOT_UTF8 = [b"\xff\xfe", b"ok\x80", b"\xc3", b"\xed\xa0\x80"]  # bad start, stray continuation, cut, surrogate
# Any bytes: what only the C API carries (the values first).
ANY = [b"\xff\xfe", b"a\x00b", b"\x00", b"", b"\x80abc\x00", *NOT_UTF8[1:], bytes(range(256))]
BINARY_ENCODINGS = ["grpc-raw", "grpc-typed", "rest-binary"]


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("strings") / "repo"
    write_identity(root, "str_identity", T.STRING)
    write_identity(root, "str_cached", T.STRING, extra="response_cache { enable: true }\n")
    # A long batching window: concurrent requests must share an execution.
    window = "dynamic_batching { max_queue_delay_microseconds: 200000 }\n"
    write_identity(root, "str_batch", T.STRING, extra=window)
    write_identity(root, "str_unbatched", T.STRING, max_batch_size=0)
    write_string_add_sub(root, "str_cast")
    write_mixed(root, "str_mixed")
    _write_suffix_model(root / "str_suffix" / "1")
    (root / "str_suffix" / "config.pbtxt").write_text(
        'name: "str_suffix"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 0\n'
        'input [ { name: "x" data_type: TYPE_STRING dims: [ -1 ] } ]\n'
        'output [ { name: "y" data_type: TYPE_STRING dims: [ -1 ] } ]\n'
    )
    return root


def _write_suffix_model(folder: Path) -> Path:
    """y = x ++ b"\\xff": a model whose output is never UTF-8."""
    import onnx
    from onnx import helper

    const = helper.make_tensor("c", T.STRING, [1], [b"\xff"])
    graph = helper.make_graph(
        [helper.make_node("StringConcat", ["x", "c"], ["y"])], "g",
        [helper.make_tensor_value_info("x", T.STRING, ["n"])],
        [helper.make_tensor_value_info("y", T.STRING, ["n"])],
        initializer=[const],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    model.ir_version = 9
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(folder / "model.onnx"))
    return folder / "model.onnx"


@pytest.fixture(scope="module")
def srv(repo, tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("strings-srv"), repo=repo)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def stub(srv):
    with grpc.insecure_channel(srv.grpc_url) as ch:
        yield pb_grpc.GRPCInferenceServiceStub(ch)


# -- the four encodings ----------------------------------------------------------------------------

_KSERVE = {np.dtype(object): "BYTES", np.dtype(np.int32): "INT32", np.dtype(np.bool_): "BOOL"}
_TYPED = {"BYTES": "bytes_contents", "INT32": "int_contents", "BOOL": "bool_contents"}
_NP = {"BYTES": object, "INT32": np.int32, "BOOL": np.bool_}


class Refused(Exception):
    def __init__(self, status: str, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status, self.message = status, message


def _raw(a: np.ndarray) -> bytes:
    return serialize_bytes(a) if a.dtype == object else np.ascontiguousarray(a).tobytes()


def _unraw(datatype: str, data: bytes, shape: list[int]) -> np.ndarray:
    if datatype == "BYTES":
        return deserialize_bytes(data, int(np.prod(shape)), "output").reshape(shape)
    return np.frombuffer(data, dtype=_NP[datatype]).reshape(shape)


def infer(enc: str, srv, stub, model: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Send ``inputs`` in encoding ``enc``; the outputs come back in the same encoding."""
    if enc.startswith("grpc"):
        req = pb.ModelInferRequest(model_name=model)
        for name, a in inputs.items():
            t = req.inputs.add(name=name, datatype=_KSERVE[a.dtype], shape=list(a.shape))
            if enc == "grpc-raw":
                req.raw_input_contents.append(_raw(a))
            else:
                getattr(t.contents, _TYPED[t.datatype]).extend(a.reshape(-1).tolist())
        if enc == "grpc-typed":  # ask for typed outputs too
            for name in _outputs(stub, model):
                req.outputs.add(name=name).parameters["binary_data"].bool_param = False
        try:
            resp = stub.ModelInfer(req, timeout=TIMEOUT_S)
        except grpc.RpcError as exc:
            raise Refused(exc.code().name, exc.details()) from None
        out = {}
        for i, t in enumerate(resp.outputs):
            if resp.raw_output_contents:
                out[t.name] = _unraw(t.datatype, resp.raw_output_contents[i], list(t.shape))
            else:
                values = list(getattr(t.contents, _TYPED[t.datatype]))
                arr = np.empty(len(values), dtype=object) if t.datatype == "BYTES" else None
                if arr is not None:
                    arr[:] = values
                else:
                    arr = np.array(values, dtype=_NP[t.datatype])
                out[t.name] = arr.reshape(list(t.shape))
        return out
    binary = enc == "rest-binary"
    wanted = [{"name": n, "parameters": {"binary_data": binary}} for n in _outputs(stub, model)]
    doc: dict = {"inputs": [], "outputs": wanted}
    chunks = []
    for name, a in inputs.items():
        item = {"name": name, "datatype": _KSERVE[a.dtype], "shape": list(a.shape)}
        if binary:
            data = _raw(a)
            item["parameters"] = {"binary_data_size": len(data)}
            chunks.append(data)
        elif a.dtype == object:
            item["data"] = [v.decode("utf-8", "surrogateescape") for v in a.reshape(-1)]  # JSON strings
        else:
            item["data"] = a.reshape(-1).tolist()
        doc["inputs"].append(item)
    header = json.dumps(doc).encode()
    headers = {"Content-Type": "application/octet-stream" if binary else "application/json"}
    if binary:
        headers["Inference-Header-Content-Length"] = str(len(header))
    url = f"http://127.0.0.1:{srv.http_port}/v2/models/{model}/infer"
    req = urllib.request.Request(url, data=header + b"".join(chunks), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:
            body, hlen = resp.read(), resp.headers.get("Inference-Header-Content-Length")
    except urllib.error.HTTPError as exc:
        raise Refused(str(exc.code), json.loads(exc.read())["error"]) from None
    n = int(hlen) if hlen is not None else len(body)
    answer, rest, out = json.loads(body[:n]), body[n:], {}
    for t in answer["outputs"]:
        if "data" in t:
            data = t["data"]
            if t["datatype"] == "BYTES":
                arr = np.empty(len(data), dtype=object)
                arr[:] = [s.encode() for s in data]
            else:
                arr = np.array(data, dtype=_NP[t["datatype"]])
            out[t["name"]] = arr.reshape(t["shape"])
        else:
            size = t["parameters"]["binary_data_size"]
            out[t["name"]] = _unraw(t["datatype"], rest[:size], t["shape"])
            rest = rest[size:]
    return out


_OUTPUTS: dict[str, list[str]] = {}


def _outputs(stub, model: str) -> list[str]:
    if model not in _OUTPUTS:
        try:
            md = stub.ModelMetadata(pb.ModelMetadataRequest(name=model), timeout=TIMEOUT_S)
        except grpc.RpcError:  # an unknown model: ask for no outputs by name, the infer call refuses it
            return []
        _OUTPUTS[model] = [o.name for o in md.outputs]
    return _OUTPUTS[model]


def strings(values, shape=None) -> np.ndarray:
    a = np.empty(len(values), dtype=object)
    a[:] = list(values)
    return a.reshape(shape or (1, len(values)))


def same(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape, (got.shape, want.shape)
    assert [type(v) for v in got.reshape(-1)] == [type(v) for v in want.reshape(-1)]
    assert got.reshape(-1).tolist() == want.reshape(-1).tolist()


# -- models over the four encodings ---------------------------------------------------------------


@pytest.mark.parametrize("enc", ENCODINGS)
def test_identity_returns_every_byte(enc, srv, stub):
    x = strings(NASTY)
    same(infer(enc, srv, stub, "str_identity", {"INPUT0": x})["OUTPUT0"], x)
    # several rows, and an unbatched model (no batch dim)
    rows = strings(NASTY[:6], (3, 2))
    same(infer(enc, srv, stub, "str_identity", {"INPUT0": rows})["OUTPUT0"], rows)
    flat = strings(NASTY, (len(NASTY),))
    same(infer(enc, srv, stub, "str_unbatched", {"INPUT0": flat})["OUTPUT0"], flat)


@pytest.mark.parametrize("enc", ENCODINGS)
def test_cast_model_adds_and_subtracts_strings(enc, srv, stub):
    a = np.arange(-8, 8, dtype=np.int64)
    b = np.array([3, -1, 0, 2_000_000, 7, -7, 1, 1, 0, 5, 9, -9, 12, 100, -100, 2], dtype=np.int64)
    to_s = lambda v: strings([str(int(x)).encode() for x in v], (1, 16))  # noqa: E731
    out = infer(enc, srv, stub, "str_cast", {"INPUT0": to_s(a), "INPUT1": to_s(b)})
    same(out["OUTPUT0"], to_s(a + b))
    same(out["OUTPUT1"], to_s(a - b))


@pytest.mark.parametrize("enc", ENCODINGS)
def test_mixed_string_and_number_inputs(enc, srv, stub):
    text = strings([b"a\x00b", b"", "é".encode()], (3, 1))
    other = strings([b"a\x00b", b"x", "é".encode()], (3, 1))
    num = np.array([[7], [-1], [0]], dtype=np.int32)
    out = infer(enc, srv, stub, "str_mixed", {"TEXT": text, "NUM": num, "OTHER": other})
    same(out["JOINED"], strings([b"a\x00b7", b"-1", "é0".encode()], (3, 1)))
    np.testing.assert_array_equal(out["TWICE"], num * 2)
    np.testing.assert_array_equal(out["SAME"], np.array([[True], [False], [True]]))


@pytest.mark.parametrize("enc", BINARY_ENCODINGS)
def test_bytes_that_are_not_utf8_reach_the_model_exactly(enc, srv, stub):
    x = strings(ANY)
    same(infer(enc, srv, stub, "str_identity", {"INPUT0": x})["OUTPUT0"], x)
    rows = strings(ANY[:8], (4, 2))
    same(infer(enc, srv, stub, "str_identity", {"INPUT0": rows})["OUTPUT0"], rows)
    flat = strings(ANY, (len(ANY),))
    same(infer(enc, srv, stub, "str_unbatched", {"INPUT0": flat})["OUTPUT0"], flat)
    # string ops see the bytes as sent: concatenation and equality
    text = strings([b"\xff\x00", b"", b"\x80abc\x00"], (3, 1))
    other = strings([b"\xff\x00", b"\xff", b"\x80abc"], (3, 1))
    num = np.array([[1], [-2], [3]], dtype=np.int32)
    out = infer(enc, srv, stub, "str_mixed", {"TEXT": text, "NUM": num, "OTHER": other})
    same(out["JOINED"], strings([b"\xff\x001", b"-2", b"\x80abc\x003"], (3, 1)))
    np.testing.assert_array_equal(out["SAME"], np.array([[True], [False], [False]]))
    # a model output that is not UTF-8 comes back as it is
    same(
        infer(enc, srv, stub, "str_suffix", {"x": strings([b"a", b""], (2,))})["y"],
        strings([b"a\xff", b"\xff"], (2,)),
    )


def test_rest_json_carries_what_json_strings_can(srv, stub):
    """JSON strings are Unicode: UTF-8 in and out (NUL and empty included, the NASTY tests); an
    output that is not UTF-8 is refused as JSON, naming it, and comes back exactly as binary data."""
    url = f"http://127.0.0.1:{srv.http_port}/v2/models/str_suffix/infer"
    tensor = {"name": "x", "datatype": "BYTES", "shape": [2], "data": ["a\u0000", ""]}
    for binary in (False, True):
        doc = {"inputs": [tensor], "outputs": [{"name": "y", "parameters": {"binary_data": binary}}]}
        req = urllib.request.Request(url, data=json.dumps(doc).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        if not binary:
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(req, timeout=TIMEOUT_S)
            assert err.value.code == 400
            assert "output 'y' holds bytes that are not UTF-8" in json.loads(err.value.read())["error"]
            continue
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:
            body, n = resp.read(), int(resp.headers["Inference-Header-Content-Length"])
        out = json.loads(body[:n])["outputs"][0]
        assert out["parameters"]["binary_data_size"] == len(body) - n
        same(_unraw("BYTES", body[n:], out["shape"]), strings([b"a\x00\xff", b"\xff"], (2,)))


def test_rest_json_cannot_smuggle_a_lone_surrogate(srv, stub):
    # JSON strings are Unicode: the only way to name a non-UTF-8 byte there is a lone surrogate escape.
    tensor = {"name": "INPUT0", "datatype": "BYTES", "shape": [1, 1], "data": ["\udcff"]}
    body = json.dumps({"inputs": [tensor]})
    req = urllib.request.Request(
        f"http://127.0.0.1:{srv.http_port}/v2/models/str_identity/infer", data=body.encode(),
        headers={"Content-Type": "application/json"}, method="POST",
    )  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=TIMEOUT_S)
    assert err.value.code == 400
    assert "input 'INPUT0'" in json.loads(err.value.read())["error"]


# -- the cache and the batcher ----------------------------------------------------------------------


def _stats(stub, model):
    return stub.ModelStatistics(pb.ModelStatisticsRequest(name=model), timeout=TIMEOUT_S).model_stats[0]


def test_cache_keys_keep_string_rows_apart(srv, stub):
    """[b'a', b'bc'] and [b'ab', b'c'] concatenate alike; they must not share a cache entry."""
    cases = [[b"a", b"bc"], [b"ab", b"c"], [b"abc", b""], [b"", b"abc"], [b"a\x00", b"bc"], [b"a", b"\x00bc"],
             [b"a\x00"], [b"a"], [b"\xff"], [b"\xfe"], [b"\xff\xfe"], [b"\x80abc\x00"], [b"\x00"], [b""]]  # fmt: skip
    encs = ["grpc-raw", "grpc-typed", "rest-binary"]
    for i, values in enumerate(cases):
        x = strings(values)
        same(infer(encs[i % 3], srv, stub, "str_cached", {"INPUT0": x})["OUTPUT0"], x)
    before = _stats(stub, "str_cached")
    for i, values in enumerate(cases):  # each again, in another encoding: now a hit, and still its own answer
        x = strings(values)
        same(infer(encs[(i + 1) % 3], srv, stub, "str_cached", {"INPUT0": x})["OUTPUT0"], x)
    after = _stats(stub, "str_cached")
    assert after.inference_stats.cache_hit.count - before.inference_stats.cache_hit.count == len(cases)
    assert after.inference_count == before.inference_count  # nothing recomputed
    assert before.inference_stats.cache_miss.count == len(cases)  # the first round: all misses, no collision


def test_batched_string_rows_come_back_to_their_own_requests(srv, stub):
    before = _stats(stub, "str_batch")
    n = 6
    reqs = [strings([b"r%d\x00" % i, NASTY[i], ANY[i], b"x" * i]) for i in range(n)]
    with concurrent.futures.ThreadPoolExecutor(n) as ex:
        outs = list(ex.map(lambda x: infer("grpc-raw", srv, stub, "str_batch", {"INPUT0": x}), reqs))
    for x, out in zip(reqs, outs, strict=True):
        same(out["OUTPUT0"], x)
    after = _stats(stub, "str_batch")
    assert after.inference_count - before.inference_count == n
    assert after.execution_count - before.execution_count < n, "the string rows never shared a batch"


# -- errors Triton's clients match on -----------------------------------------------------------------


def test_unknown_model_and_version_carry_tritons_wording(srv, stub):
    for enc in ("grpc-raw", "rest-json"):
        with pytest.raises(Refused) as err:
            infer(enc, srv, stub, "no_such_model", {"INPUT0": strings([b"x"])})
        assert err.value.status in ("NOT_FOUND", "404")
        assert err.value.message.startswith("Request for unknown model: 'no_such_model' is not found")
        assert "str_identity" not in err.value.message  # the served models are not listed
    with pytest.raises(grpc.RpcError) as err:
        stub.ModelInfer(pb.ModelInferRequest(model_name="str_identity", model_version="7"), timeout=TIMEOUT_S)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert err.value.details().startswith("Request for unknown model: 'str_identity' version 7 is not found")
    with pytest.raises(grpc.RpcError) as err:  # grpc_explicit_int8_content_client.py matches on this
        req = pb.ModelInferRequest(model_name="str_identity", model_version="wrong")
        stub.ModelInfer(req, timeout=TIMEOUT_S)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "failed to get model version from specified version string 'wrong'" in err.value.details()
    long_name = "m" * 5000
    with pytest.raises(grpc.RpcError) as err:
        stub.ModelInfer(pb.ModelInferRequest(model_name=long_name), timeout=TIMEOUT_S)
    assert len(err.value.details()) < 600  # the caller's string is clipped


# -- the engine alone: CPU, and the GPU path (skipped without a device) -------------------------------


def test_conversion_helpers_round_trip():
    x = strings(NASTY, (2, 5))
    s = to_ort_strings("INPUT0", x)
    assert all(isinstance(v, str) for v in s.reshape(-1))
    same(from_ort_strings(s), x)
    with pytest.raises(ValueError, match="input 'INPUT0': element 1 is not a UTF-8 string"):
        to_ort_strings("INPUT0", strings([b"ok", b"\xff"]))
    with pytest.raises(ValueError, match="input 'INPUT0': element 2 is a int, not a string"):
        to_ort_strings("INPUT0", strings([b"ok", "fine", 3]))  # never bytes(3): three NULs
    numpy_scalars = strings([np.bytes_(b"a\x00"), np.str_("b")])
    same(from_ort_strings(to_ort_strings("x", numpy_scalars)), strings([b"a\x00", b"b"]))


def _engine_round_trip(tmp_path: Path, device: Device) -> None:
    root = tmp_path / "repo"
    write_mixed(root, "m")
    write_identity(root, "i", T.STRING)
    engine = Engine(root / "i" / "1" / "model.onnx", device, EngineOptions())
    parts = [{"INPUT0": strings(NASTY[:5])}, {"INPUT0": strings(NASTY[5:])}, {"INPUT0": strings(ANY[:5])}]
    outs, _ = engine.run_batch(parts, [1, 1, 1], True)
    for part, out in zip(parts, outs, strict=True):
        same(out["OUTPUT0"], part["INPUT0"])
    engine = Engine(root / "m" / "1" / "model.onnx", device, EngineOptions())
    feeds = {"TEXT": strings([b"\x00\xffz"], (1, 1)), "NUM": np.array([[4]], np.int32),
             "OTHER": strings([b""], (1, 1))}  # fmt: skip
    (out,), _ = engine.run_batch([feeds], [1], True)
    same(out["JOINED"], strings([b"\x00\xffz4"], (1, 1)))
    assert out["TWICE"].tolist() == [[8]] and out["SAME"].tolist() == [[False]]


def test_engine_strings_cpu(tmp_path):
    _engine_round_trip(tmp_path, Device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(gpu_count() == 0, reason="no CUDA device usable by both onnxruntime-gpu and CuPy")
def test_engine_strings_gpu(tmp_path):
    # String tensors live on the host in onnxruntime (string kernels exist on the CPU only): a GPU
    # worker runs a string model through the C API on the CPU provider, byte for byte as the CPU one.
    _engine_round_trip(tmp_path, Device("gpu", 0))


def test_raw_layout_is_length_prefixed():
    assert serialize_bytes(strings([b"", b"a\x00"])) == struct.pack("<I", 0) + struct.pack("<I", 2) + b"a\x00"


def test_string_rows_of_different_lengths_in_one_window(srv, stub):
    """Requests whose string tensors differ in their variable dim arrive in one batching window:
    none may be padded with a made-up string or fail for its neighbour's shape."""
    reqs = [strings([b"w%d" % i] * (1 + i % 3)) for i in range(6)]
    with concurrent.futures.ThreadPoolExecutor(len(reqs)) as ex:
        outs = list(ex.map(lambda x: infer("grpc-raw", srv, stub, "str_batch", {"INPUT0": x}), reqs))
    for x, out in zip(reqs, outs, strict=True):
        same(out["OUTPUT0"], x)


def test_string_models_run_through_the_c_api_and_others_do_not(tmp_path):
    root = tmp_path / "repo"
    write_identity(root, "s", T.STRING)
    write_identity(root, "n", T.INT32)
    strings_engine = Engine(root / "s" / "1" / "model.onnx", Device("cpu"), EngineOptions())
    assert isinstance(strings_engine._strings, ort_capi.Session) and strings_engine._dynamic is None
    numbers = Engine(root / "n" / "1" / "model.onnx", Device("cpu"), EngineOptions())
    assert numbers._strings is None and numbers._dynamic is not None  # the Python binding, as before
    path = _write_suffix_model(tmp_path / "suffix")
    (out,), _ = Engine(path, Device("cpu"), EngineOptions()).run_batch(
        [{"x": strings([b"a"], (1,))}], [1], False
    )
    same(out["y"], strings([b"a\xff"], (1,)))


def test_without_the_c_api_strings_pass_as_utf8_only(tmp_path, monkeypatch):
    """Where the C library cannot be loaded: the Python binding's UTF-8 road, the codec refusing
    other bytes by name, and a model output that is not UTF-8 failing with a reason."""
    from batchgate.gateway.repository import load_model

    monkeypatch.setattr(ort_capi, "available", lambda: False)
    path = _write_suffix_model(tmp_path / "suffix")
    engine = Engine(path, Device("cpu"), EngineOptions())
    assert engine._strings is None
    with pytest.raises(ValueError, match="string output holding bytes that are not UTF-8"):
        engine.run_batch([{"x": strings([b"a"], (1,))}], [1], False)
    root = tmp_path / "repo"
    write_identity(root, "str_identity", T.STRING)
    (spec,) = load_model(root / "str_identity")
    codec = Wire(Codec(spec))
    for bad in NOT_UTF8:
        req = pb.ModelInferRequest(model_name="str_identity")
        req.inputs.add(name="INPUT0", datatype="BYTES", shape=[1, 3])
        req.raw_input_contents.append(serialize_bytes(strings([b"fine", bad, b""])))
        with pytest.raises(GatewayError) as err:
            codec.decode(req)
        msg = str(err.value)
        assert "input 'INPUT0'" in msg and "element 1" in msg and "not valid UTF-8" in msg, msg
    req = pb.ModelInferRequest(model_name="str_identity")
    req.inputs.add(name="INPUT0", datatype="BYTES", shape=[1, len(NASTY)])
    req.raw_input_contents.append(serialize_bytes(strings(NASTY)))
    arrays, _ = codec.decode(req)
    same(arrays["INPUT0"], strings(NASTY))
    monkeypatch.setattr(ort_capi, "available", lambda: True)
    assert Codec(spec).utf8_inputs == set()  # with the C API nothing is checked
