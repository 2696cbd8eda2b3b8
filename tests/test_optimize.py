"""``batchgate optimize``: variants built, gated, refused and served (gateway/models/optimize/).

Real models (the bundled encoder and ranker), real ONNX Runtime, a real server on loopback. The
variants are built once per module with one timing repeat and no RSS child, to keep it quick.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tc

from batchgate.gateway.models.optimize import (
    Options,
    Thresholds,
    optimize,
    optimize_auto,
    session,
    set_variant,
)
from batchgate.gateway.repository import ConfigError, load_model, report_path, variant_path
from tests.conftest import REPO, ROOT, start_server

CONTROL = {"BATCHGATE_MODEL_CONTROL": "true"}
QUICK = {"timing_repeats": 1, "memory": False}
ENCODER_VARIANTS = ("int8", "optimized", "fp16")


def _copy(name: str, dst: Path, as_name: str | None = None) -> Path:
    """A model folder from the bundled repository (model files copied, so variants can sit beside)."""
    d = dst / (as_name or name)
    shutil.copytree(REPO / name, d)
    if as_name:
        cfg = d / "config.pbtxt"
        cfg.write_text(cfg.read_text().replace(f'name: "{name}"', f'name: "{as_name}"'))
    return d


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """A repository whose encoder has all three variants and whose ranker has INT8, gated."""
    repo = tmp_path_factory.mktemp("variants")
    enc = _copy("encoder", repo)
    for v in ENCODER_VARIANTS:
        r = optimize(enc, Options(v, **QUICK))
        assert r.status == "passed", (v, r.failures)
    # The ranker's INT8 misses the default score gate (max abs error ~0.06 on its random MLP,
    # docs/engines.md); relaxed thresholds make one to serve, as an operator may choose.
    loose = Thresholds(max_abs_err=0.2, max_rel_err=2.0, rank_agreement=0.9)
    r = optimize(_copy("ranker", repo), Options("int8", thresholds=loose, **QUICK))
    assert r.status == "passed", r.failures
    return repo


def _serving_copy(built: Path, dst: Path, model: str, variant: str) -> Path:
    """``<model>_<variant>``: the built model's files under another name, serving ``variant``."""
    d = dst / f"{model}_{variant}"
    shutil.copytree(built / model, d)
    cfg = d / "config.pbtxt"
    cfg.write_text(cfg.read_text().replace(f'name: "{model}"', f'name: "{d.name}"'))
    set_variant(d, variant)
    return d


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchgate", "optimize", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def _encoder_inputs(rows: list[list[int]]) -> list[tc.InferInput]:
    longest = max(len(r) for r in rows)
    ids = np.zeros((len(rows), longest), np.int64)
    mask = np.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
        mask[i, : len(r)] = 1
    out = []
    for name, arr in (("input_ids", ids), ("attention_mask", mask)):
        t = tc.InferInput(name, list(arr.shape), "INT64")
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


def _ranker_feeds(rows: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"dense": rng.standard_normal((rows, 64)).astype(np.float32),
            "sparse_ids": rng.integers(0, 10_000, (rows, 8)).astype(np.int64)}  # fmt: skip


def _infer_inputs(feeds: dict[str, np.ndarray]) -> list[tc.InferInput]:
    out = []
    for name, arr in feeds.items():
        t = tc.InferInput(name, list(arr.shape), "FP32" if arr.dtype == np.float32 else "INT64")
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


# -- the gate ------------------------------------------------------------------------------------


def test_a_passing_variant_is_written_with_its_report(built):
    d = built / "encoder" / "1"
    for v in ENCODER_VARIANTS:
        assert (d / f"model.{v}.onnx").is_file()
        report = json.loads((d / f"model.{v}.report.json").read_text())
        assert report["status"] == "passed" and report["failures"] == []
        emb = report["accuracy"]["embedding"]
        assert emb["min_cosine"] >= 0.99 and emb["mean_cosine"] >= 0.995, emb
        assert report["batch_independence_max_abs"] <= 1e-5
        assert report["heldout"]["sha256"] != report["calibration"]["sha256"]
        assert "heldout.txt" in report["heldout"]["source"]
        for part in (".md", ".png"):
            assert (d / f"model.{v}.report{part}").stat().st_size > 0
        assert {"original", v} <= set(report["speed"])
    opt = json.loads((d / "model.optimized.report.json").read_text())
    assert opt["build"]["fusions"], "the encoder's graph has fusable patterns (SkipLayerNormalization...)"
    int8 = json.loads((d / "model.int8.report.json").read_text())
    assert int8["build"]["int8_nodes"] >= 1
    for kept in int8["build"]["fp32_nodes"]:  # measured, not listed: each has its own damage figure
        assert kept["damage_alone"] is not None


def test_int8_build_is_deterministic(built, tmp_path):
    again = optimize(_copy("encoder", tmp_path), Options("int8", **QUICK))
    assert again.status == "passed"
    first = (built / "encoder" / "1" / "model.int8.onnx").read_bytes()
    assert again.variant_file.read_bytes() == first


def test_gate_refuses_minmax_calibration_with_an_outlier_and_names_the_figure(tmp_path):
    """One wild row in the calibration set stretches min/max scales until ordinary rows quantise
    to a handful of levels; without an FP32 fallback the scores drift and the gate says which."""
    model = _copy("ranker", tmp_path)
    rng = np.random.default_rng(5)
    dense = rng.standard_normal((64, 64)).astype(np.float32)
    dense[0] = 5000.0
    calib = tmp_path / "calib.npz"
    np.savez(calib, dense=dense, sparse_ids=rng.integers(0, 10_000, (64, 8)).astype(np.int64))
    args = ["ranker", "--int8", "--model-repository", str(tmp_path), "--calibration", str(calib),
            "--scales", "static", "--method", "minmax", "--no-fallback", "--repeats", "1", "--no-memory"]  # fmt: skip
    r = _cli(*args)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "ranker int8: FAILED" in r.stdout and "max_abs_err" in r.stdout and "needs <= 0.01" in r.stdout
    assert not variant_path(model / "1" / "model.onnx", "int8").exists()
    report = json.loads(report_path(model / "1" / "model.onnx", "int8").read_text())
    assert report["status"] == "failed" and any("max_abs_err" in f for f in report["failures"])
    assert report["accuracy"]["score"]["max_abs_err"] > 0.01
    assert "variant" not in (model / "config.pbtxt").read_text()
    # --force writes it, marked failed; the repository refuses to serve it, saying why.
    r = _cli(*args, "--force")
    assert r.returncode == 1 and variant_path(model / "1" / "model.onnx", "int8").is_file()
    assert "variant" not in (model / "config.pbtxt").read_text()
    with pytest.raises(ConfigError, match=r"gate report says 'failed' \(score max_abs_err"):
        load_model(model, variant="int8")
    r = _cli("ranker", "--use", "int8", "--model-repository", str(tmp_path))
    assert r.returncode == 2 and "failed" in r.stderr


NO_INT8_NODE = "int8_nodes 0: no node stays INT8 within the targets (needs >= 1)"


def test_an_int8_build_with_no_int8_node_left_is_refused_and_auto_serves_none(tmp_path):
    """A score bound (1e-4) no INT8 GEMM of the ranker meets sends every node back to FP32: the file
    computes what the original does, so every accuracy figure passes, and only the INT8 node count
    refuses an "INT8" variant that holds none. ``--auto`` with that one candidate then chooses
    nothing (it never serves a candidate that failed the gate) and the model keeps serving FP32."""
    ranker = _copy("ranker", tmp_path)
    opts = Options("int8", thresholds=Thresholds(max_abs_err=1e-4), **QUICK)
    r = optimize(ranker, opts, log=lambda m: None)
    assert r.report["build"]["int8_nodes"] == 0
    assert (r.status, r.failures, r.variant_file) == ("failed", [NO_INT8_NODE], None)
    with pytest.raises(ConfigError, match="model.int8.onnx is missing"):  # a failed variant is not written
        load_model(ranker, variant="int8")
    said: list[str] = []
    res = optimize_auto(ranker, opts, log=said.append, candidates=["int8"])
    assert res.candidates["int8"].failures == [NO_INT8_NODE]
    assert (res.chosen, res.serving, res.report["chosen"]) == (None, "fp32", None)
    assert any("no candidate passed the gate; it keeps serving fp32" in line for line in said), said
    assert load_model(ranker)[0].variant == "fp32"


def test_the_gate_judges_every_kind_of_held_out_row(minilm_dir):
    """The held-out rows are traffic's odd texts too (punctuation, digits, URLs, code, emoji, other
    scripts, one word, texts cut at the model's length): every row is run and judged, each kind
    reported, and answers wrong on one kind of odd row alone fail the gate. The original model
    stands for the variant, and the reference is made wrong on that kind's rows (each vector's
    dims rotated): the same comparison as a variant wrong there, on any CPU."""
    from collections import Counter

    from batchgate.gateway.models.optimize import (
        HELDOUT_TEXTS,
        by_kind,
        gate_variant,
        model_rows,
        read_kinded_texts,
        run_rows,
    )

    spec = load_model(REPO / "encoder", variant="fp32")[0]
    _, kinds = read_kinded_texts(HELDOUT_TEXTS)
    held = model_rows(spec, "heldout")
    assert len(held) == len(kinds) and held.kinds == kinds
    ref = run_rows(session(spec.path), held.feeds)
    acc, failures, _ = gate_variant(ref, spec.path, "optimized", held, Options("optimized"))
    assert failures == [] and acc["embedding"]["rows"] == len(kinds)
    assert {k: v["rows"] for k, v in by_kind(acc, held.kinds)["embedding"].items()} == Counter(kinds)
    odd = sorted(set(kinds) - {"sentences"})
    assert len(odd) >= 8, odd
    for kind in odd:
        rows = [i for i, k in enumerate(kinds) if k == kind]
        wrong = {name: v.copy() for name, v in ref.items()}
        wrong["embedding"][rows] = np.roll(wrong["embedding"][rows], 1, axis=-1)
        _, failures, _ = gate_variant(wrong, spec.path, "optimized", held, Options("optimized"))
        assert any(f.startswith("embedding min_cosine") for f in failures), (kind, failures)
    # Through a tokenizer (minilm keeps 256 tokens), the texts past its length stay, cut to it.
    mini = model_rows(load_model(minilm_dir, variant="fp32")[0], "heldout")
    assert mini.kinds == kinds
    cut = {f["input_ids"].shape[1] for f, k in zip(mini.feeds, kinds) if k == "cut_at_length"}
    assert cut == {256}


def test_thresholds_are_settable_and_a_strict_one_refuses():
    acc = {"embedding": {"kind": "embedding", "min_cosine": 0.995, "mean_cosine": 0.999, "nn_agreement": 1.0}}
    from batchgate.gateway.models.optimize import judge

    assert judge(acc, Thresholds()) == []
    assert judge(acc, Thresholds(min_cosine=0.999)) == ["embedding min_cosine 0.995 (needs >= 0.999)"]


def test_load_refuses_a_missing_failed_or_stale_variant(built, tmp_path):
    model = tmp_path / "encoder"
    shutil.copytree(built / "encoder", model)
    one = model / "1"
    assert load_model(model, variant="int8")[0].path.name == "model.int8.onnx"
    report = report_path(one / "model.onnx", "int8")
    data = json.loads(report.read_text())
    # stale: the original changed after the variant was built
    stale = dict(data, original=dict(data["original"], sha256="0" * 64))
    report.write_text(json.dumps(stale))
    with pytest.raises(ConfigError, match="stale: model.onnx changed"):
        load_model(model, variant="int8")
    # the variant file is not the one measured
    report.write_text(json.dumps(dict(data, variant=dict(data["variant"], sha256="0" * 64))))
    with pytest.raises(ConfigError, match="not the file its report measured"):
        load_model(model, variant="int8")
    report.unlink()
    with pytest.raises(ConfigError, match="gate report 1/model.int8.report.json is missing"):
        load_model(model, variant="int8")
    (one / "model.int8.onnx").unlink()
    with pytest.raises(ConfigError, match=r"1/model.int8.onnx is missing; build it with `batchgate optimize"):
        load_model(model, variant="int8")
    cfg = model / "config.pbtxt"
    cfg.write_text(cfg.read_text() + 'parameters { key: "variant" value { string_value: "int4" } }\n')
    with pytest.raises(ConfigError, match="parameter 'variant' must be 'fp32' or 'optimized'"):
        load_model(model)


def test_cli_refuses_bad_input_by_name(tmp_path):
    r = _cli("nosuch", "--int8", "--model-repository", str(tmp_path))
    assert r.returncode == 2 and "no model 'nosuch'" in r.stderr
    _copy("encoder", tmp_path)
    r = _cli("encoder", "--use", "int8", "--model-repository", str(tmp_path))
    assert r.returncode == 2 and "model.int8.onnx is missing" in r.stderr
    r = _cli(
        "encoder", "--int8", "--model-repository", str(tmp_path), "--calibration", str(tmp_path / "x.npz")
    )
    assert r.returncode == 2 and "x.npz" in r.stderr
    r = _cli(
        "encoder", "--int8", "--model-repository", str(tmp_path), "--scales", "row", "--method", "minmax"
    )
    assert r.returncode == 2 and "--method calibrates static scales" in r.stderr


def test_the_cli_builds_row_int8_unless_told_static(tmp_path):
    """``--int8`` alone means row scales (the form the docs' figures are for); ``--method`` alone
    implies static ones."""
    _copy("ranker", tmp_path)
    for extra, scales in (((), "row"), (("--method", "minmax"), "static")):
        r = _cli("ranker", "--int8", "--model-repository", str(tmp_path), "--no-serve", "--force",
                 "--repeats", "1", "--no-memory", *extra)  # fmt: skip
        assert r.returncode in (0, 1), r.stdout + r.stderr
        report = json.loads(report_path(tmp_path / "ranker" / "1" / "model.onnx", "int8").read_text())
        assert report["build"]["scales"] == scales, (extra, report["build"])


def test_row_int8_rewrites_every_weight_gemm_and_nothing_else(built):
    """The row form keeps attention's activation x activation products in FP32 (no weight to
    quantise ahead) and turns every weight MatMul/Gemm into MatMulIntegerToFloat; the report says so."""
    import onnx

    enc = onnx.load(str(built / "encoder" / "1" / "model.int8.onnx"))
    ops = [n.op_type for n in enc.graph.node]
    report = json.loads(report_path(built / "encoder" / "1" / "model.onnx", "int8").read_text())
    b = report["build"]
    assert b["scales"] == "row" and b["method"] is None and "per row" in b["activations"]
    assert (
        ops.count("MatMulIntegerToFloat") == b["int8_nodes"] == b["quantisable_nodes"] - len(b["fp32_nodes"])
    )
    assert ops.count("MatMul") == 4 + len(b["fp32_nodes"])  # qk and context, two layers
    ranker = onnx.load(str(built / "ranker" / "1" / "model.int8.onnx"))
    assert [n.op_type for n in ranker.graph.node].count("MatMulIntegerToFloat") + [
        n.op_type for n in ranker.graph.node
    ].count("Gemm") == 3


# -- served ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def variant_server(built, tmp_path_factory):
    """One server on every variant: encoder_<variant> for each, ranker_int8."""
    repo = tmp_path_factory.mktemp("served")
    for v in ENCODER_VARIANTS:
        _serving_copy(built, repo, "encoder", v)
    _serving_copy(built, repo, "ranker", "int8")
    srv = start_server(tmp_path_factory.mktemp("served-log"), "--no-build-models", "--workers-per-device", "1",
                       repo=repo)  # fmt: skip
    client = tc.InferenceServerClient(srv.grpc_url)
    yield srv, client, repo
    client.close()
    srv.stop()


@pytest.mark.parametrize("variant", ENCODER_VARIANTS)
def test_a_row_answers_the_same_alone_and_padded_beside_rows_of_other_lengths(variant_server, variant):
    """Through the server: a 5-token row alone (bucket 16) and beside rows of 30 and 12 tokens
    (padded into bucket 32) gets the same vector; and it is the variant that answers."""
    srv, client, repo = variant_server
    model = f"encoder_{variant}"
    rng = np.random.default_rng(3)
    row = rng.integers(1, 1000, 5).tolist()
    others = [rng.integers(1, 1000, n).tolist() for n in (30, 12)]
    alone = client.infer(model, _encoder_inputs([row])).as_numpy("embedding")[0]
    batched = client.infer(model, _encoder_inputs([others[0], row, others[1]])).as_numpy("embedding")
    np.testing.assert_allclose(batched[1], alone, atol=1e-5, rtol=0)
    direct = session(repo / model / "1" / f"model.{variant}.onnx").run(
        None, {"input_ids": np.asarray([row]), "attention_mask": np.ones((1, 5), np.int64)}
    )[0][0]
    np.testing.assert_allclose(alone, direct, atol=1e-5, rtol=0)


def test_ranker_int8_row_alone_and_batched(variant_server):
    srv, client, repo = variant_server
    feeds = _ranker_feeds(9, 11)
    batched = client.infer("ranker_int8", _infer_inputs(feeds)).as_numpy("score")
    alone = client.infer("ranker_int8", _infer_inputs({k: v[3:4] for k, v in feeds.items()})).as_numpy(
        "score"
    )
    np.testing.assert_allclose(batched[3], alone[0], atol=1e-5, rtol=0)
    direct = session(repo / "ranker_int8" / "1" / "model.int8.onnx").run(None, feeds)[0]
    np.testing.assert_allclose(batched, direct, atol=1e-5, rtol=0)


def test_config_and_metrics_say_which_variant_serves(variant_server):
    srv, client, _ = variant_server
    cfg = client.get_model_config("encoder_int8", as_json=True)["config"]
    assert cfg["parameters"]["variant"]["string_value"] == "int8"
    with urllib.request.urlopen(f"http://127.0.0.1:{srv.http_port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    for model, variant, precision in (("encoder_int8", "int8", "INT8"), ("encoder_fp16", "fp16", "FP16"),
                                      ("encoder_optimized", "optimized", "FP32"), ("ranker_int8", "int8", "INT8")):  # fmt: skip
        line = (f'batchgate_model_variant_info{{engine="onnxruntime",model="{model}",precision="{precision}",'
                f'variant="{variant}",version="1"}} 1.0')  # fmt: skip
        assert line in text, [ln for ln in text.splitlines() if "variant_info" in ln]


def test_repository_model_load_switches_variants_without_a_restart(built, tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(built / "encoder", repo / "encoder")
    srv = start_server(tmp_path, "--no-build-models", "--workers-per-device", "1", repo=repo, env=CONTROL)
    client = tc.InferenceServerClient(srv.grpc_url)
    try:
        row = [[5, 17, 301, 44, 9, 870, 2]]
        feeds = {"input_ids": np.asarray(row), "attention_mask": np.ones((1, 7), np.int64)}
        want = {v: session(repo / "encoder" / "1" / f).run(None, feeds)[0][0]
                for v, f in (("fp32", "model.onnx"), ("int8", "model.int8.onnx"))}  # fmt: skip
        assert np.abs(want["fp32"] - want["int8"]).max() > 1e-5  # the two are distinguishable
        for v in ("int8", "fp32"):
            r = _cli("encoder", "--use", v, "--model-repository", str(repo))
            assert r.returncode == 0, r.stderr
            client.load_model("encoder")
            got = client.infer("encoder", _encoder_inputs(row)).as_numpy("embedding")[0]
            np.testing.assert_allclose(got, want[v], atol=1e-5, rtol=0)
            cfg = client.get_model_config("encoder", as_json=True)["config"]
            assert cfg["parameters"]["variant"]["string_value"] == v
        # a variant that may not serve is refused at load; the one serving keeps serving
        report_path(repo / "encoder" / "1" / "model.onnx", "int8").unlink()
        cfg_file = repo / "encoder" / "config.pbtxt"
        cfg_file.write_text(
            cfg_file.read_text() + 'parameters { key: "variant" value { string_value: "int8" } }\n'
        )
        with pytest.raises(Exception, match="report 1/model.int8.report.json is missing"):
            client.load_model("encoder")
        got = client.infer("encoder", _encoder_inputs(row)).as_numpy("embedding")[0]
        np.testing.assert_allclose(got, want["fp32"], atol=1e-5, rtol=0)
    finally:
        client.close()
        srv.stop()


def test_dynamic_int8_depends_on_batch_mates_so_the_gate_would_refuse_it(built, tmp_path):
    """Why --int8's scales are each row's own: ORT's dynamic quantisation scales activations over
    the whole batch tensor, so a row's vector moves with its neighbours; the gate's batch figure
    catches it, and the row-scaled INT8 (built by the fixture) holds still."""
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.quantization.shape_inference import quant_pre_process

    from batchgate.gateway.models.optimize import batch_independence, model_rows, run_rows

    pre, dyn = tmp_path / "pre.onnx", tmp_path / "dynamic.onnx"
    quant_pre_process(str(REPO / "encoder" / "1" / "model.onnx"), str(pre), skip_symbolic_shape=True)
    quantize_dynamic(str(pre), str(dyn), per_channel=True, weight_type=QuantType.QInt8)
    rows = model_rows(load_model(built / "encoder")[0], "heldout").feeds[:96]
    drift = {}
    for name, path in (("dynamic", dyn), ("row", built / "encoder" / "1" / "model.int8.onnx")):
        sess = session(path)
        drift[name] = batch_independence(sess, rows, run_rows(sess, rows))
    assert drift["row"] <= 1e-5 < drift["dynamic"], drift


# -- INT8 weights and the CPU's kernel -----------------------------------------------------------


def _one_gemm(tmp_path: Path, weights: str) -> tuple[Path, np.ndarray]:
    """A single X @ W graph whose every pair of products overflows 16 bits once quantised (X's row
    maximum is 127 levels, so UINT8 255; W's levels are 127): the case VPMADDUBSW saturates."""
    import onnx
    from onnx import TensorProto
    from onnx import helper as h
    from onnx import numpy_helper

    from batchgate.gateway.models.optimize import row_int8

    w = np.full((64, 8), 0.5, np.float32)
    graph = h.make_graph(
        [h.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
        [h.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64])],
        [h.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8])], [numpy_helper.from_array(w, "w")],
    )  # fmt: skip
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    assert row_int8(model, {"mm"}, per_channel=True, weights=weights) == 1
    path = tmp_path / f"{weights}.onnx"
    onnx.save(model, str(path))
    return path, w


def test_uint8_weights_are_exact_where_the_signed_kernel_saturates(tmp_path):
    """UINT8-around-128 weights give the exact quantised product on every CPU; signed ones give it
    only where ``int8_saturates`` says this CPU's kernel does not clip (VNNI, or off x86)."""
    from batchgate.workers.devices import int8_saturates

    x = np.full((4, 64), 3.0, np.float32)
    x[1] *= np.linspace(0.1, 1.0, 64, dtype=np.float32)  # a row of its own scale
    got = {}
    for weights in ("uint8", "int8"):
        path, w = _one_gemm(tmp_path, weights)
        got[weights] = session(path).run(None, {"x": x})[0]
    # the product of the quantised values, in exact arithmetic
    s = np.abs(x).max(axis=1, keepdims=True) / 127
    want = (np.round(x / s) * s) @ w
    rel = {k: float(np.abs(v - want).max() / np.abs(want).max()) for k, v in got.items()}
    assert rel["uint8"] < 1e-5, rel
    if int8_saturates():
        assert rel["int8"] > 0.05, rel  # the clip this CPU's signed kernel makes
    else:
        assert rel["int8"] < 1e-5, rel


@pytest.mark.parametrize(
    ("arch", "flags", "saturates"),
    [("x86_64", "flags\t: fpu sse2 avx avx2 fma avx512f avx512bw", True),
     ("x86_64", "flags\t: avx2 fma avx512f avx512_vnni", False),
     ("x86_64", "flags\t: avx2 fma avx_vnni", False),
     ("aarch64", "Features\t: fp asimd asimddp", False)],
)  # fmt: skip
def test_which_cpus_saturate_and_what_auto_picks(monkeypatch, arch, flags, saturates):
    from batchgate.gateway.models import optimize as opt
    from batchgate.workers import devices

    assert devices.int8_saturates(flags, arch) is saturates
    monkeypatch.setattr(devices, "cpu_flags", lambda: flags)
    monkeypatch.setattr(devices.platform, "machine", lambda: arch)
    assert opt.weight_type("auto") == ("uint8" if saturates else "int8")
    assert opt.weight_type("int8") == "int8" and opt.weight_type("uint8") == "uint8"
    with pytest.raises(opt.OptimizeError, match="INT8 weights must be one of auto, int8, uint8"):
        opt.weight_type("int4")


def test_signed_int8_is_refused_on_a_cpu_that_saturates_and_uint8_serves(tmp_path, monkeypatch):
    """A variant built (or copied) with signed weights does not serve where they would clip; one
    rebuilt there picks UINT8 weights, serves, and its report says which it holds."""
    from batchgate.workers import devices

    model = _copy("encoder", tmp_path)
    # signed whatever this host is; loose thresholds so it passes even where it clips
    loose = Thresholds(min_cosine=-1.0, mean_cosine=-1.0, nn_agreement=0.0)
    r = optimize(model, Options("int8", weights="int8", thresholds=loose, **QUICK))
    assert r.status == "passed" and r.report["build"]["weight_type"] == "int8", r.failures
    monkeypatch.setattr(devices, "cpu_flags", lambda: "flags\t: avx2 fma")
    monkeypatch.setattr(devices.platform, "machine", lambda: "x86_64")
    with pytest.raises(
        ConfigError, match=r"INT8 weights are signed.*saturates.*batchgate optimize encoder --int8"
    ):
        load_model(model, variant="int8")
    r = optimize(model, Options("int8", **QUICK))  # auto, on the CPU faked above
    assert r.status == "passed", r.failures
    assert r.report["build"]["weight_type"] == "uint8" and "uint8" in r.report["build"]["weights"]
    assert load_model(model, variant="int8")[0].path.name == "model.int8.onnx"
    monkeypatch.setattr(devices, "cpu_flags", lambda: "flags\t: avx2 fma avx512_vnni")
    assert load_model(model, variant="int8")[0].path.name == "model.int8.onnx"
