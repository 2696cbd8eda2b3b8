"""The gate of ``batchgate optimize`` (gateway/models/optimize/gate.py), each test checked by breaking the
code it guards by hand and seeing it fail: which GEMMs INT8 keeps in FP32 and why, a
batch-dependent candidate refused through ``optimize()``, nearest-neighbour agreement on a case
whose value is known, static percentile scales gated, and the encoder's row INT8 held to what it
measures rather than to the loose threshold.

Real models (the bundled encoder and ranker), real ONNX Runtime; one timing repeat, no RSS child.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

from batchgate.gateway.models.optimize import (
    NN_TIE,
    Options,
    Thresholds,
    accuracy,
    judge,
    optimize,
)
from batchgate.gateway.models.optimize.gate import _nn_agreement
from batchgate.gateway.repository import ConfigError, load_model, report_path, variant_path
from tests.conftest import REPO

QUICK = {"timing_repeats": 1, "memory": False}


def _copy(name: str, dst: Path) -> Path:
    d = dst / name
    shutil.copytree(REPO / name, d)
    return d


# -- which nodes stay FP32 -----------------------------------------------------------------------


def test_ranker_int8_keeps_its_most_damaging_gemms_fp32_with_the_default_thresholds(tmp_path):
    """Default thresholds: the scan quantises each Gemm alone and measures its damage; the worst are
    kept FP32, worst first, until the calibration targets hold. Which ones is a measurement, so it is
    asserted against the scan's own figures, and every smaller set is seen to miss."""
    lines: list[str] = []
    r = optimize(_copy("ranker", tmp_path / "kept"), Options("int8", **QUICK), log=lines.append)
    assert r.status == "passed", r.failures
    b = r.report["build"]
    damage = b["damage_alone"]
    assert set(damage) == {"mlp0.linear", "mlp1.linear", "logit"}  # every weight Gemm was scanned
    kept = [x["node"] for x in b["fp32_nodes"]]
    assert 1 <= len(kept) < len(damage), b["fp32_nodes"]
    worst_first = sorted(damage, key=lambda n: -damage[n])
    assert kept == worst_first[: len(kept)], (kept, damage)
    assert min(damage[n] for n in kept) > max(damage[n] for n in damage if n not in kept), damage
    assert all(x["damage_alone"] == damage[x["node"]] for x in b["fp32_nodes"])
    # Measured (ORT 1.32, row scales): damage alone mlp1.linear 4.9e-3, mlp0.linear 4.4e-3,
    # logit 3.7e-3; the first two stay FP32.
    assert kept == ["mlp1.linear", "mlp0.linear"], damage
    assert b["int8_nodes"] == len(damage) - len(kept) and r.report["accuracy"]["score"]["max_abs_err"] <= 0.01
    # Each smaller set kept in FP32 missed the calibration targets (half the gate's bounds).
    assert any(
        ln.startswith("int8: everything quantised misses the calibration targets (score ") for ln in lines
    )
    for k in range(1, len(kept)):
        step = [ln for ln in lines if ln.startswith(f"int8: {k} node(s) kept in FP32 (last {kept[k - 1]}): ")]
        assert len(step) == 1 and "(needs " in step[0], lines

    # Quantising them too misses the gate itself, on the held-out rows, naming the figure.
    r = optimize(
        _copy("ranker", tmp_path / "all"), Options("int8", fallback=False, **QUICK), log=lines.append
    )
    assert r.status == "failed" and r.report["build"]["int8_nodes"] == len(damage)
    err = r.report["accuracy"]["score"]["max_abs_err"]
    assert r.failures[0] == f"score max_abs_err {err:.6g} (needs <= 0.01)", r.failures  # measured 0.0112


# -- a batch-dependent candidate -----------------------------------------------------------------


def test_a_batch_dependent_int8_is_refused_through_optimize_by_its_batch_figure(tmp_path):
    """ONNX Runtime's dynamic quantisation (one activation scale per batch tensor) is as accurate as
    the row form on rows alone; only the batch figure tells them apart, and the gate refuses it for
    that alone. Forced to disk, the repository refuses to serve it, naming the figure."""
    model = _copy("encoder", tmp_path)
    r = optimize(model, Options("int8", scales="dynamic", force=True, **QUICK))
    drift = r.report["batch_independence_max_abs"]
    assert r.status == "failed"
    assert r.failures == [f"batch_independence {drift:.3g} (needs <= 1e-05)"], r.failures
    assert drift > 1e-3, drift  # measured 0.045 on the shipped held-out rows
    assert judge(r.report["accuracy"], Thresholds()) == []  # the rows alone pass
    assert r.report["build"]["scales"] == "dynamic"
    ops = [n.op_type for n in onnx.load(str(r.variant_file)).graph.node]
    assert ops.count("DynamicQuantizeLinear") >= 1 and "MatMulIntegerToFloat" not in ops, sorted(set(ops))
    with pytest.raises(
        ConfigError, match=r"gate report says 'failed' \(batch_independence .* \(needs <= 1e-05\)"
    ):
        load_model(model, variant="int8")


# -- nearest-neighbour agreement -----------------------------------------------------------------


def _unit(degrees: list[float], norms: list[float] | None = None) -> np.ndarray:
    t = np.radians(np.asarray(degrees, np.float64))
    v = np.stack([np.cos(t), np.sin(t)], axis=1)
    return v * np.asarray(norms)[:, None] if norms else v


def test_nn_agreement_is_the_share_of_rows_whose_nearest_neighbour_holds():
    """Five directions 0, 10, 30, 60 and 100 degrees: nearest neighbours 1, 0, 1, 2, 3. The variant
    turns row 2 to 40 degrees, so its nearest becomes row 3 (20 degrees off) and no other row's
    changes: 4 of 5 agree. Row 3 was 30 degrees from row 2 against row 1's 20: far from a tie."""
    a = _unit([0, 10, 30, 60, 100])
    b = _unit([0, 10, 40, 60, 100], norms=[3.0, 0.5, 2.0, 1.0, 7.0])  # lengths do not count, angles do
    assert _nn_agreement(a, b) == pytest.approx(0.8)
    assert _nn_agreement(a, b, NN_TIE) == pytest.approx(0.8)
    assert _nn_agreement(a, a) == 1.0
    acc = accuracy({"e": a}, {"e": b})["e"]
    assert acc["nn_exact"] == pytest.approx(0.8) and acc["nn_agreement"] == pytest.approx(0.8)


def test_a_near_tie_within_nn_tie_counts_as_agreeing_and_one_past_it_does_not():
    """Row 2 at 30 degrees sits 20 degrees from row 1 and 20.5 from row 3: cosines 0.93969 and
    0.93667, 0.003 apart, within NN_TIE. The variant moves row 2 to pick row 3: exactly 0.8, but a
    near-tie, so 1.0 with the tie; a tie just under the gap counts it as a miss again."""
    a = _unit([0, 10, 30, 50.5, 100])
    b = _unit([0, 10, 31, 50.5, 100])
    gap = np.cos(np.radians(20)) - np.cos(np.radians(20.5))
    assert gap < NN_TIE
    assert _nn_agreement(a, b) == pytest.approx(0.8)
    assert _nn_agreement(a, b, NN_TIE) == pytest.approx(1.0)
    assert _nn_agreement(a, b, gap * 0.99) == pytest.approx(0.8)
    assert _nn_agreement(a, b, gap * 1.01) == pytest.approx(1.0)
    acc = accuracy({"e": a}, {"e": b})["e"]
    assert (acc["nn_exact"], acc["nn_agreement"]) == (pytest.approx(0.8), pytest.approx(1.0))


# -- static percentile scales --------------------------------------------------------------------


def test_static_percentile_int8_on_the_encoder_is_gated_as_measured(tmp_path):
    """Static scales calibrated by percentile (QDQ, attention's products quantised too) meet the
    calibration targets on the calibration rows, so nothing is kept FP32, yet miss the gate on the
    held-out rows (measured: min cosine 0.9712, the held-out's odd kinds of text): refused, by name."""
    model = _copy("encoder", tmp_path)
    r = optimize(model, Options("int8", scales="static", method="percentile", force=True, **QUICK))
    b = r.report["build"]
    assert (b["scales"], b["method"], b["percentile"]) == ("static", "percentile", 99.999)
    assert b["activations"] == "uint8 per tensor (static)"
    emb = r.report["accuracy"]["embedding"]
    assert {"min_cosine", "mean_cosine", "nn_agreement", "nn_exact"} <= set(emb)
    assert r.report["batch_independence_max_abs"] <= 1e-5  # static scales never see the batch
    # The verdict is the judge's over the figures in the report, nothing else.
    assert r.failures == judge(r.report["accuracy"], Thresholds())
    assert r.status == "failed" and 0.95 < emb["min_cosine"] < 0.99, emb
    assert r.failures[0] == f"embedding min_cosine {emb['min_cosine']:.6g} (needs >= 0.99)", r.failures
    ops = [n.op_type for n in onnx.load(str(r.variant_file)).graph.node]
    assert ops.count("QuantizeLinear") >= 16 and "MatMulIntegerToFloat" not in ops  # QDQ, all 16 GEMMs
    md = report_path(model / "1" / "model.onnx", "int8").with_suffix(".md").read_text()
    assert "INT8: percentile p99.999 calibration" in md and "min cosine" in md
    # Percentile calibration clips each activation's range below its min/max one: every calibrated
    # activation scale in the file is smaller than min/max's on the same rows (measured 0.83-0.99x).
    minmax = optimize(_copy("encoder", tmp_path / "minmax"), Options("int8", scales="static", method="minmax",
                                                                      force=True, **QUICK))  # fmt: skip
    pct, mm = _activation_scales(r.variant_file), _activation_scales(minmax.variant_file)
    assert set(pct) == set(mm) and len(pct) >= 16
    assert all(pct[k] < mm[k] for k in pct), {k: pct[k] / mm[k] for k in pct}


def _activation_scales(path: Path) -> dict[str, float]:
    """Each QuantizeLinear of an activation (not a weight): its input's name and its scale."""
    from onnx import numpy_helper

    g = onnx.load(str(path)).graph
    init = {i.name: numpy_helper.to_array(i) for i in g.initializer}
    return {n.input[0]: float(init[n.input[1]]) for n in g.node if n.op_type == "QuantizeLinear"
            and n.input[0] not in init}  # fmt: skip


# -- the encoder's row INT8 ----------------------------------------------------------------------


def test_encoder_row_int8_quantises_every_weight_gemm_and_holds_its_measured_cosine(tmp_path):
    """Every one of the encoder's 12 weight GEMMs INT8, none kept FP32, and the held-out cosine held
    to what it measures (min 0.99980, mean 0.99991 with ORT 1.32), not only to the gate's 0.99: a
    rounding or scale slip that still clears 0.99 fails here."""
    model = _copy("encoder", tmp_path)
    r = optimize(model, Options("int8", **QUICK))
    assert r.status == "passed", r.failures
    b = r.report["build"]
    weight_gemms = {
        n.name for n in onnx.load(str(REPO / "encoder" / "1" / "model.onnx")).graph.node
        if n.op_type == "MatMul" and not n.name.endswith((".qk", ".context"))  # attention's: no weight
    }  # fmt: skip
    assert len(weight_gemms) == 12
    assert b["fp32_nodes"] == [] and b["int8_nodes"] == b["int8_weight_nodes"] == b["quantisable_nodes"] == 12
    built = onnx.load(str(variant_path(model / "1" / "model.onnx", "int8")))
    fused = {n.name.removesuffix(".rowq.mm") for n in built.graph.node if n.op_type == "MatMulIntegerToFloat"}
    assert fused == weight_gemms
    assert sorted(n.name for n in built.graph.node if n.op_type == "MatMul") == sorted(
        f"layer{i}.attn.{p}" for i in (0, 1) for p in ("qk", "context")
    )
    emb = r.report["accuracy"]["embedding"]
    # Just under the measured 0.999799 / 0.999907. Measured breaks that still pass the gate's 0.99:
    # weights floored instead of rounded 0.99972 / 0.99984; activations clipped at 30/127 of a
    # row's max 0.99851 / 0.99937.
    assert emb["min_cosine"] >= 0.99975 and emb["mean_cosine"] >= 0.99988, emb
    assert emb["nn_agreement"] == 1.0, emb
    saved = json.loads(report_path(model / "1" / "model.onnx", "int8").read_text())
    assert saved["accuracy"]["embedding"]["min_cosine"] == emb["min_cosine"]
