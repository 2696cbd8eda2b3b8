"""Graph pieces the rotary-position families share (ModernBERT, Qwen3): token positions, rotary
embeddings, position masks (sliding window, causal), bias-free LayerNorm, RMSNorm and a plain
linear layer.

Positions are each token's index in the padded row (0, 1, 2, …), what transformers' ModernBERT
and Qwen3 use when no position_ids are given. The text stage pads on the right, so a real token's
index is its position; with left padding every real token shifts by the same amount, which
rotary attention cannot see (it depends on q - k only).
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from batchgate.gateway.models.encoder import MASK_PENALTY
from batchgate.gateway.models.onnx_graph import GraphBuilder


def linear(g: GraphBuilder, name: str, x: str, weight: np.ndarray, bias: np.ndarray | None = None) -> str:
    """x @ weight.T (+ bias): torch's Linear stores [out, in]."""
    out = g.op(
        "MatMul", [x, g.const(f"{name}.weight", np.ascontiguousarray(weight.T, np.float32))], f"{name}.matmul"
    )
    if bias is None:
        return out
    return g.op("Add", [out, g.const(f"{name}.bias", bias.astype(np.float32))], name)


def layer_norm(
    g: GraphBuilder, name: str, x: str, weight: np.ndarray, bias: np.ndarray | None, eps: float
) -> str:
    """LayerNorm over the last axis; ModernBERT's has no bias (norm_bias false), and ONNX's B
    input is optional."""
    inputs = [x, g.const(f"{name}.scale", weight.astype(np.float32))]
    if bias is not None:
        inputs.append(g.const(f"{name}.bias", bias.astype(np.float32)))
    return g.op("LayerNormalization", inputs, name, axis=-1, epsilon=eps)


def rms_norm(g: GraphBuilder, name: str, x: str, weight: np.ndarray, eps: float) -> str:
    """x / sqrt(mean(x²) + eps) * weight over the last axis (opset 17 has no RMSNormalization;
    onnxruntime fuses this pattern into its SimplifiedLayerNormalization)."""
    square = g.op("Mul", [x, x], f"{name}.sq")
    mean = g.op("ReduceMean", [square], f"{name}.mean", axes=[-1], keepdims=1)
    root = g.op(
        "Sqrt",
        [g.op("Add", [mean, g.const(f"{name}.eps", np.array(eps, np.float32))], f"{name}.var")],
        f"{name}.rms",
    )
    return g.op(
        "Mul",
        [g.op("Div", [x, root], f"{name}.normed"), g.const(f"{name}.weight", weight.astype(np.float32))],
        name,
    )


def positions(g: GraphBuilder, mask: str) -> str:
    """[batch, seq] float: 0, 1, 2, … along each row. Counted with CumSum over a row of ones
    rather than with Range (encoder.py: onnxruntime 1.32's optimiser rewrote Range + Gather into
    a Slice that fails)."""
    zeros = g.op("Mul", [mask, g.const("pos_zero", np.array(0.0, np.float32))], "pos_zeros")
    ones = g.op("Add", [zeros, g.const("pos_one", np.array(1.0, np.float32))], "pos_ones")
    counted = g.op("CumSum", [ones, g.const("pos_axis", np.array(1, np.int64))], "pos_counted")
    return g.op("Sub", [counted, "pos_one"], "positions")


def rotary_tables(g: GraphBuilder, name: str, pos: str, theta: float, dim: int) -> tuple[str, str]:
    """(cos, sin), each [batch, seq, 1, dim] to broadcast over heads in the [batch, seq, heads,
    dim] layout: the default RoPE, inv_freq = theta ** -(2i / dim), angles repeated for both
    halves (transformers' ``torch.cat((freqs, freqs))``). inv_freq and the angles are float32,
    as transformers computes them."""
    inv_freq = (1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))).astype(
        np.float32
    )
    both = np.concatenate([inv_freq, inv_freq]).astype(np.float32)
    pos_3d = g.op("Unsqueeze", [pos, g.const(f"{name}.axes", np.array([2, 3], np.int64))], f"{name}.pos")
    angles = g.op("Mul", [pos_3d, g.const(f"{name}.inv_freq", both)], f"{name}.angles")
    return g.op("Cos", [angles], f"{name}.cos"), g.op("Sin", [angles], f"{name}.sin")


def rotate(g: GraphBuilder, name: str, x: str, cos: str, sin: str, dim: int) -> str:
    """x * cos + rotate_half(x) * sin on [batch, seq, heads, dim], rotate_half(x) being
    (-x2, x1) for the halves x1, x2 (the GPT-NeoX layout transformers uses for both families)."""
    split = f"rot_halves_{dim}"
    if not any(t.name == split for t in g.initializers):
        g.const(split, np.array([dim // 2, dim // 2], np.int64))
    x1, x2 = g.ops("Split", [x, split], [f"{name}.x1", f"{name}.x2"], axis=-1)
    rotated = g.op("Concat", [g.op("Neg", [x2], f"{name}.neg_x2"), x1], f"{name}.rotated", axis=-1)
    return g.op(
        "Add",
        [g.op("Mul", [x, cos], f"{name}.xcos"), g.op("Mul", [rotated, sin], f"{name}.xsin")],
        f"{name}.roped",
    )


def position_bias(g: GraphBuilder, name: str, pos: str, key_bias: str, *, window: int | None = None,
                  causal: bool = False) -> str:  # fmt: skip
    """[batch, 1, seq, seq]: ``key_bias`` (padding) plus MASK_PENALTY where query q may not see
    key k: k > q when ``causal``; |q - k| > ``window`` for a sliding window."""
    q = g.op("Unsqueeze", [pos, g.const(f"{name}.q_axes", np.array([2], np.int64))], f"{name}.q")
    k = g.op("Unsqueeze", [pos, g.const(f"{name}.k_axes", np.array([1], np.int64))], f"{name}.k")
    dist = g.op("Sub", [k, q], f"{name}.dist")  # [batch, seq, seq]: k - q
    if causal:
        blocked = g.op(
            "Greater", [dist, g.const(f"{name}.zero", np.array(0.0, np.float32))], f"{name}.future"
        )
    else:
        limit = g.const(f"{name}.window", np.array(float(window), np.float32))
        blocked = g.op("Greater", [g.op("Abs", [dist], f"{name}.abs"), limit], f"{name}.far")
    return blocked_bias(g, name, blocked, key_bias)


def blocked_bias(g: GraphBuilder, name: str, blocked: str, key_bias: str) -> str:
    """[batch, 1, seq, seq]: ``key_bias`` plus MASK_PENALTY where ``blocked`` [batch, seq, seq] is true."""
    penalty = g.op(
        "Mul",
        [g.op("Cast", [blocked], f"{name}.blocked_f", to=TensorProto.FLOAT),
         g.const(f"{name}.penalty", np.array(MASK_PENALTY, np.float32))],
        f"{name}.penalty_f",
    )  # fmt: skip
    penalty = g.op(
        "Unsqueeze", [penalty, g.const(f"{name}.head_axis", np.array([1], np.int64))], f"{name}.bias4d"
    )
    return g.op("Add", [penalty, key_bias], name)
