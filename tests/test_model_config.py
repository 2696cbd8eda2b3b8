"""config.pbtxt as batchgate reads it: typed ``parameters {}`` (gateway/parameters.py), Triton's
``format`` hint and ``reshape``. The unit tests drive the parser; one real server loads a
repository with a misspelled parameter, a hinted model and reshaped models built here."""

from __future__ import annotations

import dataclasses
import re
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import tritonclient.grpc as tc
from onnx import TensorProto, helper

from batchgate.gateway.parameters import DECLARED, TRITON_HINTS, ParameterError, bucket_config, parse
from batchgate.gateway.repository import ConfigError, load_model
from tests.conftest import REPO, start_server

ROOT = Path(__file__).resolve().parent.parent


# -- the parser ---------------------------------------------------------------------------------


def test_defaults_are_the_tables():
    params, ignored = parse({})
    assert ignored == [] and params.max_batch_tokens == 0 and params.learned_batch_limit is True
    assert params.scheduling_policy is None and params.mask_input == "attention_mask" and not params.tokenizer


def test_values_are_typed_once():
    params, _ = parse(
        {"max_batch_tokens": "8192", "batch_buckets": "8, 2,32", "seq_buckets": "none", "seq_buckets.seq": "8,16",
         "input_range.ids": "0:1000", "max_dim.ids": "512", "pad_value.ids": "-1", "learned_batch_limit": "off",
         "scheduling_policy": "fifo", "mask_input": "none", "truncate": "reject", "length_buckets": "16,64"},
        inputs=["ids"], model_inputs=["ids"],
    )  # fmt: skip
    assert params.max_batch_tokens == 8192 and params.batch_buckets == (2, 8, 32) and params.seq_buckets == ()
    assert params.seq_buckets_by_dim == {"seq": (8, 16)} and params.input_range == {"ids": (0.0, 1000.0)}
    assert params.max_dim == {"ids": 512} and params.pad_value == {"ids": -1.0}
    assert (
        params.learned_batch_limit is False
        and params.scheduling_policy == "fifo"
        and params.mask_input is None
    )
    assert params.truncate == "reject" and params.length_buckets == (16, 64)
    cfg = params.bucket_config(64, (16,))
    assert cfg.max_batch_tokens == 8192 and cfg.batch_sizes == (2, 8, 32, 64) and cfg.mask_explicit


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (
            {"max_batch_token": "8192"},
            "unknown parameter 'max_batch_token' (did you mean 'max_batch_tokens'?)",
        ),
        ({"seq_bucket": "16"}, "did you mean 'seq_buckets'?"),
        ({"max_dims.ids": "5"}, "did you mean 'max_dim.ids'?"),
        ({"input_rang.ids": "0:5"}, "did you mean 'input_range.ids'?"),
        ({"intra_op_threads": "2"}, "did you mean 'intra_op_thread_count'?"),
        ({"completely_new": "1"}, "unknown parameter 'completely_new'; batchgate reads: tokenizer"),
        ({"max_dim.idz": "5"}, "parameter 'max_dim.idz' names no input 'idz' (did you mean 'max_dim.ids'?)"),
        ({"pad_value.nope": "1"}, "names no model input 'nope'"),
        ({"max_batch_tokens": "-1"}, "'max_batch_tokens' must be an integer >= 0, got '-1'"),
        ({"max_dim.ids": "lots"}, "'max_dim.ids' must be an integer >= 1, got 'lots'"),
        ({"input_range.ids": "5:1"}, "'input_range.ids' must be 'low:high'"),
        ({"input_range.ids": "0:inf"}, "'input_range.ids' must be 'low:high'"),
        ({"learned_batch_limit": "perhaps"}, "must be true or false"),
        ({"scheduling_policy": "lifo"}, "must be 'deadline' or 'fifo'"),
        ({"length_buckets": "64,32"}, "ascending"),
        ({"pad_value.ids": "nan"}, "finite"),
        ({"tokenizer": " "}, "'tokenizer' must be a file name"),
    ],
)
def test_bad_parameters_are_named(raw, needle):
    with pytest.raises(ParameterError) as err:
        parse(raw, inputs=["ids", "mask"], model_inputs=["ids", "mask"])
    assert needle in str(err.value)


def test_triton_runtime_settings_are_ignored_by_name():
    params, ignored = parse({"intra_op_thread_count": "4", "execution_mode": "1", "max_batch_tokens": "64"})
    assert ignored == ["execution_mode", "intra_op_thread_count"] and params.max_batch_tokens == 64


def test_batch_buckets_above_max_batch_size_are_refused():
    with pytest.raises(ValueError, match="above max_batch_size"):
        bucket_config({"batch_buckets": "128"}, 64)


def test_docs_list_every_parameter():
    """docs/model-config.md's table is the declared table: a new key without a docs row fails."""
    text = (ROOT / "docs" / "model-config.md").read_text()
    rows = set(re.findall(r"^\| `([^`]+)` \|", text, re.M))
    assert rows >= {d.key for d in DECLARED}, sorted({d.key for d in DECLARED} - rows)
    for hint in TRITON_HINTS:
        assert f"`{hint}`" in text
    assert "model-config.md" in (ROOT / "README.md").read_text()


# -- config.pbtxt: format and reshape, at load --------------------------------------------------


def _reshape_model(path: Path) -> None:
    """x [N, 2, 3] -> y = reshape(2x, [N, 6]); a [N] -> b = a + 1 (the [ batch ] model of Triton's docs)."""
    nodes = [
        helper.make_node("Mul", ["x", "two"], ["x2"]),
        helper.make_node("Reshape", ["x2", "shape"], ["y"]),
        helper.make_node("Add", ["a", "one"], ["b"]),
    ]
    inits = [
        helper.make_tensor("two", TensorProto.FLOAT, [], [2.0]),
        helper.make_tensor("one", TensorProto.FLOAT, [], [1.0]),
        helper.make_tensor("shape", TensorProto.INT64, [2], [-1, 6]),
    ]
    graph = helper.make_graph(
        nodes, "reshape", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2, 3]),
                           helper.make_tensor_value_info("a", TensorProto.FLOAT, ["N"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 6]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, ["N"])], inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True)
    onnx.save(model, str(path))


RESHAPED = """name: "{name}"
max_batch_size: 8
input [
  {{ name: "x" data_type: TYPE_FP32 format: FORMAT_NCHW dims: [ 6 ] reshape: {{ shape: [ {xshape} ] }} }},
  {{ name: "a" data_type: TYPE_FP32 dims: [ 1 ] reshape: {{ shape: [ ] }} }}
]
output [
  {{ name: "y" data_type: TYPE_FP32 dims: [ 2, 3 ] reshape: {{ shape: [ 6 ] }} }},
  {{ name: "b" data_type: TYPE_FP32 dims: [ 1 ] reshape: {{ shape: [ ] }} }}
]
"""


def _reshape_dir(root: Path, name: str, xshape: str = "2, 3") -> Path:
    d = root / name
    _reshape_model(d / "1" / "model.onnx")
    (d / "config.pbtxt").write_text(RESHAPED.format(name=name, xshape=xshape))
    return d


def test_reshape_is_checked_against_the_onnx_model(tmp_path):
    spec = load_model(_reshape_dir(tmp_path, "ok"))[0]
    assert [t.dims for t in spec.inputs] == [(6,), (1,)]  # the client's dims
    assert spec.buckets.reshape_inputs == {"x": (2, 3), "a": ()}
    assert spec.buckets.reshape_outputs == {"y": (2, 3), "b": (1,)}
    assert "input.format" in spec.ignored
    with pytest.raises(ConfigError, match=r"reshape \[3, 2\] in config.pbtxt but \[2, 3\] in the ONNX model"):
        load_model(_reshape_dir(tmp_path, "wrongshape", "3, 2"))
    with pytest.raises(ConfigError, match="holds 4 values per row but dims \\[6\\] hold 6"):
        load_model(_reshape_dir(tmp_path, "count", "2, 2"))
    with pytest.raises(ConfigError, match="reshape for fixed dims only"):
        load_model(_reshape_dir(tmp_path, "variable", "-1, 3"))
    d = _reshape_dir(tmp_path, "symbolic")
    model = onnx.load(str(d / "1" / "model.onnx"))
    model.graph.input[0].type.tensor_type.shape.dim[1].dim_param = "rows"  # x [N, rows, 3]
    onnx.save(model, str(d / "1" / "model.onnx"))
    with pytest.raises(ConfigError, match="onto fixed model dims only"):
        load_model(d)


# -- a real server ------------------------------------------------------------------------------


def _ranker(repo: Path, name: str, extra: str) -> None:
    d = repo / name
    (d / "1").mkdir(parents=True)
    shutil.copy(REPO / "ranker" / "1" / "model.onnx", d / "1" / "model.onnx")
    cfg = (REPO / "ranker" / "config.pbtxt").read_text().replace('"ranker"', f'"{name}"')
    (d / "config.pbtxt").write_text(cfg + extra)


def _param(key: str, value: str) -> str:
    return f'parameters {{ key: "{key}" value {{ string_value: "{value}" }} }}\n'


def _ranker_inputs(rows: int) -> list[tc.InferInput]:
    dense = tc.InferInput("dense", [rows, 64], "FP32")
    dense.set_data_from_numpy(np.zeros((rows, 64), np.float32))
    ids = tc.InferInput("sparse_ids", [rows, 8], "INT64")
    ids.set_data_from_numpy(np.ones((rows, 8), np.int64))
    return [dense, ids]


def test_server_names_a_misspelled_parameter_and_serves_reshaped_models(tmp_path):
    repo = tmp_path / "repo"
    _ranker(repo, "misspelled", _param("max_batch_token", "4096"))
    _ranker(repo, "wronginput", _param("max_dim.sparse_idz", "8"))
    _ranker(repo, "hinted", _param("intra_op_thread_count", "2"))
    _reshape_dir(repo, "reshaped")
    _reshape_dir(repo, "variable", "-1, 3")
    srv = start_server(tmp_path, "--no-build-models", repo=repo)
    try:
        client = tc.InferenceServerClient(srv.grpc_url)
        index = {m.name: m for m in client.get_model_repository_index().models}
        assert not client.is_model_ready("misspelled") and index["misspelled"].state == "UNAVAILABLE"
        assert (
            "unknown parameter 'max_batch_token' (did you mean 'max_batch_tokens'?)"
            in index["misspelled"].reason
        )
        assert "'max_dim.sparse_idz' names no input" in index["wronginput"].reason
        assert "did you mean 'max_dim.sparse_ids'" in index["wronginput"].reason
        assert "reshape for fixed dims only" in index["variable"].reason
        log = srv.log()
        assert "misspelled" in log and "max_batch_token" in log  # named in the load log too
        # Triton's ORT thread setting and the NCHW hint are tuning: served, each logged as ignored
        assert client.is_model_ready("hinted") and client.is_model_ready("reshaped")
        assert "config field 'parameters.intra_op_thread_count' is not implemented by batchgate" in log
        assert (
            "model reshaped: config field 'input.format' is not implemented by batchgate and is ignored"
            in log
        )
        assert client.infer("hinted", _ranker_inputs(2)).as_numpy("score").shape == (2, 1)

        # reshape: the client sends and gets the config's dims, the model sees its own
        meta = client.get_model_metadata("reshaped")
        assert [list(i.shape) for i in meta.inputs] == [[-1, 6], [-1, 1]]
        assert [list(o.shape) for o in meta.outputs] == [[-1, 2, 3], [-1, 1]]
        rng = np.random.default_rng(0)
        for rows in (1, 3):
            x = rng.standard_normal((rows, 6), dtype=np.float32)
            a = rng.standard_normal((rows, 1), dtype=np.float32)
            ins = [tc.InferInput("x", [rows, 6], "FP32"), tc.InferInput("a", [rows, 1], "FP32")]
            ins[0].set_data_from_numpy(x)
            ins[1].set_data_from_numpy(a)
            result = client.infer("reshaped", ins)
            np.testing.assert_array_equal(result.as_numpy("y"), (2 * x).reshape(rows, 2, 3))
            np.testing.assert_array_equal(result.as_numpy("b"), a + 1)
    finally:
        assert srv.stop() == 0


def test_serving_path_does_not_import_the_build_tools():
    """gateway/models/ is offline preparation: only the CLI's build commands import it."""
    import subprocess
    import sys

    # Every service module, wherever the other packages move them; the CLI imports build lazily.
    service = sorted(
        "batchgate.gateway." + ".".join(p.relative_to(ROOT / "gateway").with_suffix("").parts)
        for p in (ROOT / "gateway").rglob("*.py")
        if "models" not in p.relative_to(ROOT / "gateway").parts
        and p.stem not in ("__init__", "__main__", "cli")
    )
    assert "batchgate.gateway.repository" in service
    code = f"import importlib, sys\nfor m in {service!r}: importlib.import_module(m)\n" + (
        "print(sorted(m for m in sys.modules if m.startswith('batchgate.gateway.models')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_reshape_views_batched_and_unbatched():
    """The worker's reshape is a view each way, with and without a batch dim."""
    from batchgate.workers.buckets import BucketConfig, ShapePlan, TensorInfo

    f32 = np.dtype(np.float32)
    cfg = dataclasses.replace(
        BucketConfig.build(0), reshape_inputs={"x": (2, 3)}, reshape_outputs={"y": (6,)}
    )
    plan = ShapePlan([TensorInfo("x", f32, (2, 3))], [TensorInfo("y", f32, (3, 2))], cfg)
    x = np.arange(6, dtype=np.float32)
    (fed,) = plan.to_model([{"x": x, "other": x}], batched=False)
    assert fed["x"].shape == (2, 3) and fed["x"].base is x and fed["other"] is x
    (back,) = plan.to_client([{"y": np.zeros((3, 2), np.float32)}], batched=False)
    assert back["y"].shape == (6,)
    (rows,) = plan.to_model([{"x": np.zeros((4, 6), np.float32)}], batched=True)
    assert rows["x"].shape == (4, 2, 3)
