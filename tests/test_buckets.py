"""Shape buckets as plain data: parameters parsed and checked, keys, padding plans. No sessions run
here except where a tiny hand-built ONNX model is the clearest way to state a case."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tests.conftest import REPO
from batchgate.gateway.parameters import bucket_config
from batchgate.workers.buckets import ShapePlan, TensorInfo, powers_of_two, read_model_io

ENCODER = REPO / "encoder" / "1" / "model.onnx"


def _encoder_plan(**params: str) -> ShapePlan:
    inputs, outputs = read_model_io(ENCODER)
    return ShapePlan(inputs, outputs, bucket_config(params, 64, (16, 32)))


def _t(name: str, dtype, *dims) -> TensorInfo:
    return TensorInfo(name, np.dtype(dtype), tuple(dims))


# -- parameters -------------------------------------------------------------------------------


def test_default_batch_buckets_are_powers_of_two_plus_preferred_and_max():
    cfg = bucket_config({}, 48, (12,))
    assert cfg.batch_sizes == (1, 2, 4, 8, 12, 16, 32, 48)


def test_configured_batch_buckets_always_end_at_max_batch_size():
    cfg = bucket_config({"batch_buckets": "8, 2,32"}, 64)
    assert cfg.batch_sizes == (2, 8, 32, 64)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"batch_buckets": "4,x"}, "batch_buckets"),
        ({"batch_buckets": "128"}, "above max_batch_size"),
        ({"seq_buckets": "0,16"}, "seq_buckets"),
        ({"max_batch_tokens": "-1"}, "max_batch_tokens"),
        ({"max_batch_tokens": "lots"}, "max_batch_tokens"),
        ({"pad_value.input_ids": "zero"}, "pad_value.input_ids"),
    ],
)
def test_bad_parameters_name_the_parameter(params, message):
    with pytest.raises(ValueError, match=message):
        bucket_config(params, 64)


def test_parameters_naming_unknown_inputs_or_dims_are_refused():
    with pytest.raises(ValueError, match="pad_value.nope"):
        _encoder_plan(**{"pad_value.nope": "1"})
    with pytest.raises(ValueError, match="mask_input"):
        _encoder_plan(mask_input="nope")
    with pytest.raises(ValueError, match="unknown dims"):
        _encoder_plan(**{"seq_buckets.tokens": "8,16"})


def test_powers_of_two_end_at_the_cap():
    assert powers_of_two(16, 512) == (16, 32, 64, 128, 256, 512)
    assert powers_of_two(16, 100) == (16, 32, 64, 100)
    assert powers_of_two(1, 1) == (1,)


# -- the encoder's plan -----------------------------------------------------------------------


def test_encoder_groups_its_tied_seq_dim_and_buckets_it_by_default():
    plan = _encoder_plan(**{"max_dim.input_ids": "512"})
    assert plan.pooled
    [g] = plan.groups
    assert g.name == "seq" and set(g.members) == {("input_ids", 1), ("attention_mask", 1)}
    assert g.buckets == (16, 32, 64, 128, 256, 512) and g.paddable
    assert plan.mask_input == "attention_mask"
    assert plan.overrides(8, (64,)) == {"batch": 8, "seq": 64}


def test_lengths_20_and_30_share_a_key_and_33_does_not():
    plan = _encoder_plan()
    k = [plan.key({"input_ids": np.zeros((1, n), np.int64)}) for n in (20, 30, 32, 33)]
    assert k[0] == k[1] == k[2] == (32,)
    assert k[3] == (64,)


def test_lengths_past_the_last_bucket_keep_their_exact_length():
    plan = _encoder_plan(seq_buckets="16,32")
    assert plan.key({"input_ids": np.zeros((1, 40), np.int64)}) == (40,)
    assert plan.seq_buckets_for((40,)) is None


def test_seq_buckets_none_means_exact_lengths():
    plan = _encoder_plan(seq_buckets="none")
    assert plan.groups[0].buckets == () and not plan.groups[0].paddable
    assert plan.key({"input_ids": np.zeros((1, 20), np.int64)}) == (20,)


def test_max_batch_tokens_caps_rows_per_run_and_the_slots():
    plan = _encoder_plan(seq_buckets="16,128,512", max_batch_tokens="4096")
    assert plan.max_rows((16,)) == 64
    assert plan.max_rows((128,)) == 32
    assert plan.max_rows((512,)) == 8
    slots = plan.slots()
    assert (8, (512,)) in slots and (16, (512,)) not in slots
    assert all(b * s[0] <= 4096 or b == 1 for b, s in slots)


def test_a_single_row_over_the_budget_still_has_a_bucket():
    plan = _encoder_plan(seq_buckets="512", max_batch_tokens="100")
    assert plan.max_rows((512,)) == 1


# -- other model shapes -----------------------------------------------------------------------


def test_unmasked_variable_dim_keeps_exact_lengths_unless_configured():
    inputs = [_t("x", np.float32, "batch", "n")]
    outputs = [_t("y", np.float32, "batch", 4)]
    plan = ShapePlan(inputs, outputs, bucket_config({}, 8))
    assert plan.groups[0].buckets == () and "no mask" in plan.groups[0].why
    plan = ShapePlan(inputs, outputs, bucket_config({"seq_buckets": "4,8"}, 8))
    assert plan.groups[0].buckets == (4, 8) and plan.groups[0].paddable


def test_unnamed_variable_axes_are_their_own_groups_and_not_static():
    inputs = [_t("a", np.float32, "batch", None), _t("b", np.float32, "batch", None)]
    outputs = [_t("y", np.float32, "batch", 1)]
    plan = ShapePlan(inputs, outputs, bucket_config({"seq_buckets": "8"}, 4))
    assert [g.name for g in plan.groups] == ["a.1", "b.1"]
    assert not plan.static_ok and plan.overrides(4, (8, 8)) is None


def test_outputs_with_the_seq_dim_are_trimmed_and_unknown_output_dims_are_not_pooled():
    inputs = [_t("ids", np.int64, "batch", "seq"), _t("attention_mask", np.int64, "batch", "seq")]
    plan = ShapePlan(inputs, [_t("tokens", np.float32, "batch", "seq", 8)], bucket_config({}, 8))
    assert plan.pooled and plan.output_axes("tokens") == [(1, 0)]
    assert plan.output_shape("tokens", 4, (32,)) == (4, 32, 8)
    plan = ShapePlan(inputs, [_t("tokens", np.float32, "batch", "other")], bucket_config({}, 8))
    assert not plan.pooled and "not tied" in plan.why_not_pooled


def test_strings_and_unbatched_models_are_not_pooled():
    plan = ShapePlan([_t("s", object, "batch", 1)], [_t("y", np.float32, "batch", 1)],
                     bucket_config({}, 8))  # fmt: skip
    assert not plan.pooled and "string" in plan.why_not_pooled
    plan = ShapePlan([_t("x", np.float32, 4)], [_t("y", np.float32, 4)], bucket_config({}, 0))
    assert not plan.pooled and not plan.batched


def test_read_model_io_sees_dim_params_values_and_unknowns(tmp_path: Path):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, None])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3, None])
    model = helper.make_model(helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x], [y]))
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    [i], [o] = read_model_io(path)
    assert i.dims == ("batch", 3, None) and i.dtype == np.float32 and o.name == "y"
