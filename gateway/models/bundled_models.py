"""Build the two demo models that ship with batchgate: ``ranker`` and ``encoder``.

``python -m batchgate.gateway.models.bundled_models [--out model_repository] [--force]`` writes a Triton-style
model repository::

    <out>/ranker/config.pbtxt    <out>/ranker/1/model.onnx
    <out>/encoder/config.pbtxt   <out>/encoder/1/model.onnx

* ``ranker`` is a recommendation scorer: the mean of 8 embedding lookups (table 10000 x 16)
  concatenated with 64 dense features, then an MLP 80 -> 128 -> 64 -> 1 and a sigmoid. It is
  cheap per row, so it exercises the batcher's throughput path.
* ``encoder`` is a 2-layer, 4-head transformer text encoder (hidden 128, FFN 256, vocab 1000,
  up to 512 positions) with a masked mean pool. Its cost grows with sequence length and padded
  keys are masked out, so it exercises variable-length batching: padding a row with
  ``attention_mask == 0`` positions must not change its embedding.

The graphs are built with ``onnx.helper`` only (no torch, no downloads) and the weights come
from ``numpy.random.default_rng`` with fixed seeds, so anyone can rebuild a byte-identical
repository and the committed files can be checked for staleness. The weights are random: the
models are for load and correctness testing, not for meaningful predictions.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from batchgate.gateway.models.onnx_graph import (
    GraphBuilder,
    attend,
    finish_model,
    gelu,
    split_heads,
    write_atomic,
)

RANKER_SEED = 20240601
ENCODER_SEED = 20240602

RANKER_DENSE = 64
RANKER_SLOTS = 8
RANKER_VOCAB = 10_000
RANKER_EMB = 16
RANKER_HIDDEN = (128, 64)

ENCODER_VOCAB = 1000
ENCODER_MAX_POS = 512
ENCODER_HIDDEN = 128
ENCODER_LAYERS = 2
ENCODER_HEADS = 4
ENCODER_FFN = 256
# Large enough that exp() of a masked score underflows to exactly 0 in float32, so padded keys
# contribute nothing at all (not merely "very little") to the attention output.
MASK_PENALTY = -1e9
LN_EPSILON = 1e-5

Log = Callable[[str], object]


# --------------------------------------------------------------------------------------------
# ranker


def _he_normal(rng: np.random.Generator, fan_in: int, fan_out: int) -> np.ndarray:
    # He init keeps ReLU activations at a stable scale, so the final logit is neither tiny nor
    # huge and the sigmoid scores spread over (0, 1) instead of saturating.
    return rng.standard_normal((fan_in, fan_out)) * math.sqrt(2.0 / fan_in)


def build_ranker() -> onnx.ModelProto:
    rng = np.random.default_rng(RANKER_SEED)
    g = GraphBuilder()
    table = g.weight("embedding_table", rng.standard_normal((RANKER_VOCAB, RANKER_EMB)) * 0.5)

    looked_up = g.op("Gather", [table, "sparse_ids"], "slot_embeddings", axis=0)
    pooled = g.op("ReduceMean", [looked_up], "pooled_embedding", axes=[1], keepdims=0)
    x = g.op("Concat", ["dense", pooled], "features", axis=1)

    fan_in = RANKER_DENSE + RANKER_EMB
    for i, width in enumerate(RANKER_HIDDEN):
        w = g.weight(f"mlp{i}.weight", _he_normal(rng, fan_in, width))
        b = g.weight(f"mlp{i}.bias", np.zeros(width))
        x = g.op("Relu", [g.op("Gemm", [x, w, b], f"mlp{i}.linear")], f"mlp{i}.relu")
        fan_in = width
    # Glorot-scale head (no ReLU after it): logits of std ~1 keep scores away from 0 and 1.
    w = g.weight("head.weight", rng.standard_normal((fan_in, 1)) * math.sqrt(1.0 / fan_in))
    b = g.weight("head.bias", np.zeros(1))
    g.op("Sigmoid", [g.op("Gemm", [x, w, b], "logit")], "score")

    return finish_model(
        g,
        "ranker",
        inputs=[
            helper.make_tensor_value_info("dense", TensorProto.FLOAT, ["batch", RANKER_DENSE]),
            helper.make_tensor_value_info("sparse_ids", TensorProto.INT64, ["batch", RANKER_SLOTS]),
        ],
        outputs=[helper.make_tensor_value_info("score", TensorProto.FLOAT, ["batch", 1])],
    )


# --------------------------------------------------------------------------------------------
# encoder


def _linear(g: GraphBuilder, rng: np.random.Generator, name: str, x: str, fan_in: int, fan_out: int) -> str:
    w = g.weight(f"{name}.weight", rng.standard_normal((fan_in, fan_out)) / math.sqrt(fan_in), fp16=True)
    b = g.weight(f"{name}.bias", rng.standard_normal(fan_out) * 0.02)
    return g.op("Add", [g.op("MatMul", [x, w], f"{name}.matmul"), b], name)


def _layer_norm(g: GraphBuilder, rng: np.random.Generator, name: str, x: str) -> str:
    scale = g.weight(f"{name}.scale", 1.0 + rng.standard_normal(ENCODER_HIDDEN) * 0.02)
    bias = g.weight(f"{name}.bias", rng.standard_normal(ENCODER_HIDDEN) * 0.02)
    return g.op("LayerNormalization", [x, scale, bias], name, axis=-1, epsilon=LN_EPSILON)


def _heads(g: GraphBuilder, rng: np.random.Generator, name: str, x: str, perm: list[int]) -> str:
    projected = _linear(g, rng, name, x, ENCODER_HIDDEN, ENCODER_HIDDEN)
    return split_heads(g, projected, perm, "transposed")


def _attention(g: GraphBuilder, rng: np.random.Generator, name: str, x: str, key_bias: str) -> str:
    # Separate Q, K, V projections (random weights drawn in this order), the core shared.
    q = _heads(g, rng, f"{name}.q", x, [0, 2, 1, 3])
    k = _heads(g, rng, f"{name}.k", x, [0, 2, 3, 1])
    v = _heads(g, rng, f"{name}.v", x, [0, 2, 1, 3])
    merged = attend(g, name, q, k, v, key_bias, scale="attn_scale")
    return _linear(g, rng, f"{name}.out", merged, ENCODER_HIDDEN, ENCODER_HIDDEN)


def _encoder_layer(g: GraphBuilder, rng: np.random.Generator, name: str, x: str, key_bias: str) -> str:
    # Pre-LN residual blocks: stable with random weights, no warm-up tricks needed.
    attn = _attention(g, rng, f"{name}.attn", _layer_norm(g, rng, f"{name}.ln1", x), key_bias)
    x = g.op("Add", [x, attn], f"{name}.resid1")
    normed = _layer_norm(g, rng, f"{name}.ln2", x)
    hidden = gelu(
        g, f"{name}.gelu", _linear(g, rng, f"{name}.ffn1", normed, ENCODER_HIDDEN, ENCODER_FFN), one="one_f"
    )
    ffn = _linear(g, rng, f"{name}.ffn2", hidden, ENCODER_FFN, ENCODER_HIDDEN)
    return g.op("Add", [x, ffn], f"{name}.resid2")


def _embed(g: GraphBuilder, rng: np.random.Generator) -> str:
    tokens = rng.standard_normal((ENCODER_VOCAB, ENCODER_HIDDEN))
    positions = rng.standard_normal((ENCODER_MAX_POS, ENCODER_HIDDEN)) * 0.1
    token_table = g.weight("token_embedding", tokens, fp16=True)
    position_table = g.weight("position_embedding", positions, fp16=True)

    # seq is read from the input at run time so one graph serves every length 1..512; a longer
    # input is an error (its positions run off the table) rather than silently wrapping.
    shape = g.op("Shape", ["input_ids"], "ids_shape")
    seq = g.op("Gather", [shape, g.const("seq_axis", np.array(1, np.int64))], "seq_len", axis=0)
    start, step = g.const("zero_i", np.array(0, np.int64)), g.const("one_i", np.array(1, np.int64))
    position_ids = g.op("Range", [start, seq, step], "position_ids")
    token_states = g.op("Gather", [token_table, "input_ids"], "token_states", axis=0)
    position_states = g.op("Gather", [position_table, position_ids], "position_states", axis=0)
    return g.op("Add", [token_states, position_states], "embedded")


def _key_bias(g: GraphBuilder, mask: str) -> str:
    """[batch, 1, 1, seq]: 0 for real keys, MASK_PENALTY for padding; broadcasts over heads and queries."""
    padding = g.op("Sub", ["one_f", mask], "padding_f")
    penalty = g.const("mask_penalty", np.array(MASK_PENALTY, np.float32))
    penalty = g.op("Mul", [padding, penalty], "key_penalty")
    return g.op("Unsqueeze", [penalty, g.const("key_bias_axes", np.array([1, 2], np.int64))], "key_bias")


def _masked_mean(g: GraphBuilder, x: str, mask: str) -> str:
    # max(count, 1) keeps an all-padding row at 0 instead of NaN.
    seq_axis = g.const("seq_axes", np.array([1], np.int64))
    mask_3d = g.op("Unsqueeze", [mask, g.const("mask_axes", np.array([2], np.int64))], "mask_3d")
    masked = g.op("Mul", [x, mask_3d], "masked_states")
    total = g.op("ReduceSum", [masked, seq_axis], "pooled_sum", keepdims=0)
    count = g.op("ReduceSum", [mask, seq_axis], "token_count", keepdims=1)
    count = g.op("Max", [count, "one_f"], "token_count_clamped")
    return g.op("Div", [total, count], "embedding")


def build_encoder() -> onnx.ModelProto:
    rng = np.random.default_rng(ENCODER_SEED)
    g = GraphBuilder()
    head_dim = ENCODER_HIDDEN // ENCODER_HEADS
    g.const("one_f", np.array(1.0, np.float32))
    g.const("heads_shape", np.array([0, 0, ENCODER_HEADS, head_dim], np.int64))
    g.const("merge_shape", np.array([0, 0, ENCODER_HIDDEN], np.int64))
    g.const("attn_scale", np.array(1 / math.sqrt(head_dim), np.float32))

    x = _embed(g, rng)
    mask = g.op("Cast", ["attention_mask"], "mask_f", to=TensorProto.FLOAT)
    key_bias = _key_bias(g, mask)
    for i in range(ENCODER_LAYERS):
        x = _encoder_layer(g, rng, f"layer{i}", x, key_bias)
    _masked_mean(g, _layer_norm(g, rng, "final_ln", x), mask)

    return finish_model(
        g,
        "encoder",
        inputs=[
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "seq"]),
        ],
        outputs=[helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["batch", ENCODER_HIDDEN])],
    )


# --------------------------------------------------------------------------------------------
# config.pbtxt


@dataclass(frozen=True)
class _Tensor:
    name: str
    data_type: str
    dims: tuple[int, ...]


@dataclass(frozen=True)
class _ModelSpec:
    name: str
    build: Callable[[], onnx.ModelProto]
    max_batch_size: int
    inputs: tuple[_Tensor, ...]
    outputs: tuple[_Tensor, ...]
    preferred_batch_sizes: tuple[int, ...]
    max_queue_size: int
    max_queue_delay_us: int = 2000
    instance_count: int = 2
    # batchgate parameters: value bounds the codec checks, so one bad row is refused alone
    # instead of failing the Gather of a whole merged batch.
    parameters: tuple[tuple[str, str], ...] = ()


def _dims(values: Sequence[int]) -> str:
    return "[ " + ", ".join(str(v) for v in values) + " ]"


def _tensor_list(field: str, tensors: Sequence[_Tensor]) -> list[str]:
    blocks = [
        f'  {{\n    name: "{t.name}"\n    data_type: {t.data_type}\n    dims: {_dims(t.dims)}\n  }}'
        for t in tensors
    ]
    return [f"{field} [", ",\n".join(blocks), "]"]


def render_config(spec: _ModelSpec) -> str:
    """Triton ModelConfig in protobuf text format (dims exclude the batch dimension)."""
    lines = [
        "# Generated by gateway/models/bundled_models.py; edit that script and rerun it instead.",
        f'name: "{spec.name}"',
        'platform: "onnxruntime_onnx"',
        f"max_batch_size: {spec.max_batch_size}",
        *_tensor_list("input", spec.inputs),
        *_tensor_list("output", spec.outputs),
        "dynamic_batching {",
        f"  max_queue_delay_microseconds: {spec.max_queue_delay_us}",
        f"  preferred_batch_size: {_dims(spec.preferred_batch_sizes)}",
        # ModelConfig has no dynamic_batching.max_queue_size: the queue bound lives in the
        # queue policy, and a bare field there would fail to parse.
        "  default_queue_policy {",
        f"    max_queue_size: {spec.max_queue_size}",
        "  }",
        "}",
        "instance_group [",
        "  {",
        f"    count: {spec.instance_count}",
        "    kind: KIND_CPU",
        "  }",
        "]",
    ]
    for key, value in spec.parameters:
        lines.append(f'parameters {{ key: "{key}" value {{ string_value: "{value}" }} }}')
    return "\n".join(lines) + "\n"


MODELS: tuple[_ModelSpec, ...] = (
    _ModelSpec(
        name="ranker",
        build=build_ranker,
        max_batch_size=256,
        inputs=(
            _Tensor("dense", "TYPE_FP32", (RANKER_DENSE,)),
            _Tensor("sparse_ids", "TYPE_INT64", (RANKER_SLOTS,)),
        ),
        outputs=(_Tensor("score", "TYPE_FP32", (1,)),),
        preferred_batch_sizes=(64, 128),
        max_queue_size=4096,
        parameters=(("input_range.sparse_ids", f"0:{RANKER_VOCAB}"),),
    ),
    _ModelSpec(
        name="encoder",
        build=build_encoder,
        max_batch_size=64,
        inputs=(_Tensor("input_ids", "TYPE_INT64", (-1,)), _Tensor("attention_mask", "TYPE_INT64", (-1,))),
        outputs=(_Tensor("embedding", "TYPE_FP32", (ENCODER_HIDDEN,)),),
        preferred_batch_sizes=(16, 32),
        max_queue_size=2048,
        parameters=(
            ("input_range.input_ids", f"0:{ENCODER_VOCAB}"),
            ("input_range.attention_mask", "0:2"),
            ("max_dim.input_ids", str(ENCODER_MAX_POS)),
            ("max_dim.attention_mask", str(ENCODER_MAX_POS)),
            # Engine buckets (workers/buckets.py): a batch is padded to the next length and batch
            # size here (attention_mask 0 on padding). Steps of ~1.4x keep the padding near 1.2x
            # (bench/buckets_bench.py: 1.4x tokens computed/sent against 2.0x with powers of two,
            # which on a CPU is plain lost work); one run computes at most 8192 padded tokens,
            # which bounds its activation memory.
            ("seq_buckets", "16,24,32,48,64,96,128,192,256,384,512"),
            ("batch_buckets", "1,2,3,4,6,8,12,16,24,32,48,64"),
            ("max_batch_tokens", "8192"),
        ),
    ),
)


# --------------------------------------------------------------------------------------------
# repository


def build_bundled_models(repo: Path, *, force: bool = False, log: Log = print) -> list[str]:
    """Write ranker and encoder (config.pbtxt + 1/model.onnx) under repo.

    Skip models whose files already exist unless force. Returns names written.
    """
    repo = Path(repo)
    written: list[str] = []
    for spec in MODELS:
        config_path = repo / spec.name / "config.pbtxt"
        model_path = repo / spec.name / "1" / "model.onnx"
        if not force and config_path.exists() and model_path.exists():
            log(f"{spec.name}: exists in {repo}, skipped (use --force to rebuild)")
            continue
        model_bytes = spec.build().SerializeToString(deterministic=True)
        write_atomic(model_path, model_bytes)
        # Config last, so a repository scan never finds a config whose model file is missing.
        write_atomic(config_path, render_config(spec).encode())
        log(f"{spec.name}: wrote {model_path} ({len(model_bytes) / 1024:.0f} KiB) and {config_path}")
        written.append(spec.name)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the bundled ranker and encoder ONNX models.")
    parser.add_argument("out", nargs="?", type=Path, help="model repository (default: model_repository)")
    parser.add_argument("--out", dest="out_opt", type=Path, metavar="PATH", help="same as the positional")
    parser.add_argument("--force", action="store_true", help="rebuild models that already exist")
    args = parser.parse_args(argv)
    if args.out is not None and args.out_opt is not None and args.out != args.out_opt:
        parser.error("give the repository path once, positionally or with --out")
    repo = args.out or args.out_opt or Path("model_repository")
    build_bundled_models(repo, force=args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
