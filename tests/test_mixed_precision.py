"""``int8-mixed`` (gateway/models/optimize/mixed.py): INT8 with the GEMMs measured sensitive on
tuning rows (odd rows included, never the gate's) kept FP32, gated and served like every variant.

The bundled encoder (tiny, real ONNX Runtime): everything INT8 is within ~2e-4 of it, so the
default gate passes with nothing kept FP32; a gate of 0.9999 makes the search keep some GEMMs FP32
and leaves others INT8 (measured: 7 of 12 FP32), and a gate past 1 keeps all FP32, which the gate
refuses (nothing INT8 left). One timing repeat and no RSS child, to keep it quick.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

from batchgate.gateway.models.optimize import mixed as mp
from batchgate.gateway.models.optimize import (
    HELDOUT_TEXTS,
    Options,
    model_rows,
    Thresholds,
    optimize,
    optimize_auto,
    read_texts,
)
from batchgate.gateway.repository import ConfigError, check_variant, load_model, variant_path
from tests.conftest import REPO

QUICK = {"timing_repeats": 1, "memory": False}
# Strict enough that everything INT8 misses it on the tuning rows, loose enough that a mix passes.
STRICT = Thresholds(min_cosine=0.9999, mean_cosine=0.9999)


def _encoder(dst: Path) -> Path:
    d = dst / "encoder"
    shutil.copytree(REPO / "encoder", d)
    return d


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> Path:
    """An encoder with an int8-mixed variant built and gated at STRICT."""
    enc = _encoder(tmp_path_factory.mktemp("mixed"))
    r = optimize(enc, Options("int8-mixed", thresholds=STRICT, **QUICK), log=lambda m: None)
    assert r.status == "passed", r.failures
    return enc


def test_the_sensitive_gemms_stay_fp32_and_the_rest_are_int8(mixed):
    d = mixed / "1"
    report = json.loads((d / "model.int8-mixed.report.json").read_text())
    build = report["build"]
    kept = [k["node"] for k in build["fp32_nodes"]]
    damage = build["damage_alone"]
    assert kept and build["int8_nodes"] >= 1 and len(kept) + build["int8_nodes"] == build["quantisable_nodes"]
    # Kept by measurement: the worst alone, in order, and none kept that did less harm than one left INT8.
    assert kept == sorted(kept, key=lambda n: -damage[n])
    assert min(damage[n] for n in kept) >= max(damage[n] for n in damage if n not in kept)
    graph = onnx.load(str(d / "model.int8-mixed.onnx")).graph
    nodes = {n.name: n for n in graph.node}
    weights = {i.name for i in graph.initializer}
    for name in kept:  # still an FP32 MatMul on its FP32 weight
        assert nodes[name].op_type == "MatMul" and nodes[name].input[1] in weights, name
    int8 = [n for n in graph.node if n.op_type == "MatMulIntegerToFloat"]
    assert len(int8) == build["int8_nodes"]
    assert not {n.name.removesuffix(".rowq.mm") for n in int8} & set(kept)
    # Every kept GEMM is named with its layer and part, and the gate passed on held-out rows.
    assert all(k["group"].startswith(("layer0.", "layer1.")) for k in build["fp32_nodes"])
    assert report["status"] == "passed" and report["accuracy"]["embedding"]["min_cosine"] >= 0.9999


def test_the_choice_is_tuned_on_odd_rows_that_are_not_the_gates(mixed):
    report = json.loads((mixed / "1" / "model.int8-mixed.report.json").read_text())
    tuning = report["build"]["tuning"]
    assert "tuning.txt" in tuning["source"] and tuning["sha256"] != report["heldout"]["sha256"]
    kinds = report["build"]["tuning_accuracy_by_kind"]["embedding"]
    assert {"punctuation", "emoji", "one_word", "calibration"} <= set(kinds)
    assert not set(read_texts(mp.TUNING_TEXTS)) & set(read_texts(HELDOUT_TEXTS))


@pytest.mark.parametrize("model", ["encoder", "minilm"])
def test_no_tuning_row_is_a_held_out_row_as_the_model_sees_it(model):
    # Other texts can be the same input: the encoder hashes words (one tuning text collides), and
    # minilm's WordPiece reads any lone emoji as [UNK] alone.
    spec = load_model(REPO / model)[0]
    calib, held = model_rows(spec, "calibration"), model_rows(spec, "heldout")
    tune = mp.tuning_rows(spec, calib, 48, held)
    seen = {np.ascontiguousarray(f["input_ids"]).tobytes() for f in held.feeds}
    assert len(tune) > 48 and not [f for f in tune.feeds if f["input_ids"].tobytes() in seen]


def test_auto_gates_it_and_never_serves_a_failing_one(tmp_path):
    enc = _encoder(tmp_path)
    # Past 1: not even the original meets it, so every GEMM stays FP32 and nothing INT8 is left.
    res = optimize_auto(
        enc, Options("int8", thresholds=Thresholds(min_cosine=1.5), **QUICK), log=lambda m: None,
        candidates=["int8-mixed"],
    )  # fmt: skip
    r = res.candidates["int8-mixed"]
    assert r.status == "failed" and any("int8_nodes 0" in f for f in r.failures), r.failures
    assert res.chosen is None and r.variant_file is None
    assert not variant_path(enc / "1" / "model.onnx", "int8-mixed").exists()
    with pytest.raises(ConfigError, match="int8-mixed"):
        check_variant("encoder", "1", enc / "1" / "model.onnx", "int8-mixed")


def test_a_passing_one_serves_through_the_repository_check(mixed):
    path = check_variant("encoder", "1", mixed / "1" / "model.onnx", "int8-mixed")
    assert path.name == "model.int8-mixed.onnx"


@pytest.mark.parametrize(
    ("name", "group"),
    [
        ("layer3.ffn2.matmul", "layer3.ffn"),
        ("layer0.attn.qkv.matmul", "layer0.attention"),
        ("/encoder/layer.11/attention/self/query/MatMul", "layer11.attention"),
        ("/encoder/layer.2/intermediate/dense/MatMul", "layer2.ffn"),
        ("/model/layers.5/mlp/down_proj/MatMul", "layer5.ffn"),
        ("/model/layers.5/self_attn/o_proj/MatMul", "layer5.attention"),
        ("/pooler/dense/MatMul", "/pooler/dense/MatMul"),
    ],
)
def test_each_gemm_is_named_with_its_layer_and_part(name, group):
    assert mp.group_of(name) == group
