"""ModernBERT (``model_type`` modernbert) from its safetensors weights, as transformers'
``ModernBertModel`` computes it: token embeddings + LayerNorm (no position table), pre-norm
blocks (layer 0 has no attention norm) with rotary attention, global on every
``global_attn_every_n_layers``-th layer and a sliding window of ``local_attention`` tokens on the
others, each kind with its own rotary base, a GeGLU MLP, then ``final_norm``. LayerNorms carry a
bias only when ``norm_bias`` says so; linears only when ``attention_bias`` / ``mlp_bias`` do.

transformers may run ModernBERT unpadded (flash attention); on a padded batch that is the same
arithmetic, since padding keys are masked and the text stage pads on the right (each real token's
index is its position).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx

from batchgate.gateway.models.encoder import Head, _Graph, finish_head, key_padding_bias, standard_constants
from batchgate.gateway.models.heads import classify
from batchgate.gateway.models.onnx_graph import GraphBuilder, attend, gelu
from batchgate.gateway.models.rotary import (
    layer_norm,
    linear,
    position_bias,
    positions,
    rotary_tables,
    rotate,
)

STEM = "ModernBert"
ARCHS = ("Model", "ForMaskedLM", "ForSequenceClassification")
CLASSIFIER = "modernbert"  # pooled (cls or mean), head (dense, act, norm), classifier (heads.py)
PREFIXES = ("", "model.")
WORD = "embeddings.tok_embeddings.weight"


@dataclass(frozen=True)
class ModernBertConfig:
    hidden: int
    layers: int
    heads: int
    intermediate: int
    max_seq_length: int
    norm_eps: float
    global_layers: tuple[bool, ...]  # per layer: full attention (True) or the sliding window
    global_theta: float
    local_theta: float
    window: int  # a token sees keys at most this far away in a local layer (local_attention // 2)
    classifier_pooling: str = "cls"  # ModernBertForSequenceClassification's: "cls" or "mean"
    classifier_activation: str = "gelu"


def check(config: dict) -> str | None:
    """What in ``config`` the graph would not compute as transformers does, or None."""
    act = config.get("hidden_activation", "gelu")
    if act != "gelu":
        return f"hidden_activation '{act}' is not supported; supported: 'gelu' (erf GELU)"
    for kind, params in (config.get("rope_parameters") or {}).items():
        rope = (params or {}).get("rope_type", "default")
        if rope != "default":
            return f"rope_parameters.{kind}.rope_type '{rope}' is not supported; supported: 'default'"
    if config.get("rope_scaling"):
        return "rope_scaling is not supported; supported: the default rotary embedding"
    pooling = config.get("classifier_pooling", "cls")
    if pooling not in ("cls", "mean"):
        return f"classifier_pooling '{pooling}' is not supported; supported: 'cls', 'mean'"
    act = config.get("classifier_activation", "gelu")
    if act not in ("gelu", "tanh", "relu"):
        return f"classifier_activation '{act}' is not supported; supported: 'gelu', 'tanh', 'relu'"
    return None


def position_limit(config: dict) -> int:
    return int(config.get("max_position_embeddings", 8192))


def encoder_config(config: dict, max_seq_length: int) -> ModernBertConfig:
    layers = int(config["num_hidden_layers"])
    # transformers 5 saves layer_types and rope_parameters; the released checkpoints (4.x) say
    # global_attn_every_n_layers, global_rope_theta and local_rope_theta. Both are read.
    types = config.get("layer_types")
    if types:
        global_layers = tuple(t == "full_attention" for t in types)
    else:
        every = int(config.get("global_attn_every_n_layers", 3))
        global_layers = tuple(i % every == 0 for i in range(layers))
    rope = config.get("rope_parameters") or {}
    global_theta = (rope.get("full_attention") or {}).get(
        "rope_theta", config.get("global_rope_theta", 160_000.0)
    )
    local_theta = (rope.get("sliding_attention") or {}).get(
        "rope_theta", config.get("local_rope_theta", 10_000.0)
    )
    return ModernBertConfig(
        hidden=int(config["hidden_size"]),
        layers=layers,
        heads=int(config["num_attention_heads"]),
        intermediate=int(config["intermediate_size"]),
        max_seq_length=max_seq_length,
        norm_eps=float(config.get("norm_eps", 1e-5)),
        global_layers=global_layers,
        global_theta=float(global_theta),
        local_theta=float(local_theta),
        window=int(config.get("local_attention", 128)) // 2,
        classifier_pooling=str(config.get("classifier_pooling", "cls")),
        classifier_activation=str(config.get("classifier_activation", "gelu")),
    )


def _norm(
    g: GraphBuilder, name: str, x: str, w: dict[str, np.ndarray], prefix: str, cfg: ModernBertConfig
) -> str:
    return layer_norm(g, name, x, w[f"{prefix}.weight"], w.get(f"{prefix}.bias"), cfg.norm_eps)


def _layer(g: GraphBuilder, i: int, x: str, w: dict[str, np.ndarray], cfg: ModernBertConfig,
           rope: dict[bool, tuple[str, str]], bias: dict[bool, str]) -> str:  # fmt: skip
    p, name = f"layers.{i}", f"layer{i}"
    head_dim = cfg.hidden // cfg.heads
    is_global = cfg.global_layers[i]
    h = x if i == 0 else _norm(g, f"{name}.attn_norm", x, w, f"{p}.attn_norm", cfg)  # layer 0: Identity
    # Wqkv rows are q, k, v; the score scale goes into the query rows (rotary is linear, so it
    # commutes with the scale).
    wqkv = w[f"{p}.attn.Wqkv.weight"].copy()
    bqkv = w.get(f"{p}.attn.Wqkv.bias")
    scale = 1.0 / math.sqrt(head_dim)
    wqkv[: cfg.hidden] *= scale
    if bqkv is not None:
        bqkv = bqkv.copy()
        bqkv[: cfg.hidden] *= scale
    qkv = linear(g, f"{name}.qkv", h, wqkv, bqkv)
    q, k, v = g.ops("Split", [qkv, "qkv_split"], [f"{name}.q", f"{name}.k", f"{name}.v"], axis=-1)
    cos, sin = rope[is_global]
    q = rotate(g, f"{name}.q", g.op("Reshape", [q, "heads_shape"], f"{name}.q4"), cos, sin, head_dim)
    k = rotate(g, f"{name}.k", g.op("Reshape", [k, "heads_shape"], f"{name}.k4"), cos, sin, head_dim)
    q = g.op("Transpose", [q], f"{name}.q_t", perm=[0, 2, 1, 3])
    k = g.op("Transpose", [k], f"{name}.k_t", perm=[0, 2, 3, 1])
    v = g.op(
        "Transpose", [g.op("Reshape", [v, "heads_shape"], f"{name}.v4")], f"{name}.v_t", perm=[0, 2, 1, 3]
    )
    merged = attend(g, f"{name}.attn", q, k, v, bias[is_global])
    attn = linear(g, f"{name}.attn_out", merged, w[f"{p}.attn.Wo.weight"], w.get(f"{p}.attn.Wo.bias"))
    x = g.op("Add", [x, attn], f"{name}.resid1")
    h = _norm(g, f"{name}.mlp_norm", x, w, f"{p}.mlp_norm", cfg)
    # GeGLU: Wi's first half is the input, its second half the gate (transformers' chunk(2)).
    wi = linear(g, f"{name}.wi", h, w[f"{p}.mlp.Wi.weight"], w.get(f"{p}.mlp.Wi.bias"))
    inp, gate = g.ops("Split", [wi, "glu_split"], [f"{name}.glu_in", f"{name}.glu_gate"], axis=-1)
    act = gelu(g, f"{name}.gelu", inp, one="one_f", half="half_f", sqrt2="sqrt2")
    mlp = linear(
        g,
        f"{name}.mlp_out",
        g.op("Mul", [act, gate], f"{name}.glu"),
        w[f"{p}.mlp.Wo.weight"],
        w.get(f"{p}.mlp.Wo.bias"),
    )
    return g.op("Add", [x, mlp], f"{name}.resid2")


def build_model(weights: dict[str, np.ndarray], cfg: ModernBertConfig, head: Head, *, name: str,
                producer: str, head_weights: dict[str, np.ndarray] | None = None) -> onnx.ModelProto:  # fmt: skip
    """input_ids, attention_mask (INT64 [batch, seq]) -> ``embedding`` (FP32 [batch, hidden]).
    ``weights`` are named as in a bare ``ModernBertModel`` (no ``model.`` prefix)."""
    g = _Graph()
    head_dim = cfg.hidden // cfg.heads
    standard_constants(g, cfg)
    g.const("glu_split", np.array([cfg.intermediate] * 2, np.int64))

    words = g.op("Gather", [g.const("tok_embeddings", weights[WORD]), "input_ids"], "word_states", axis=0)
    x = _norm(g, "embeddings.norm", words, weights, "embeddings.norm", cfg)

    mask, key_bias = key_padding_bias(g)
    pos = positions(g, mask)
    rope = {True: rotary_tables(g, "rope_global", pos, cfg.global_theta, head_dim)}
    bias = {True: key_bias}
    if not all(cfg.global_layers):
        rope[False] = rotary_tables(g, "rope_local", pos, cfg.local_theta, head_dim)
        bias[False] = position_bias(g, "window_bias", pos, key_bias, window=cfg.window)
    for i in range(cfg.layers):
        x = _layer(g, i, x, weights, cfg, rope, bias)
    x = _norm(g, "final_norm", x, weights, "final_norm", cfg)
    if head.classifier:
        classify(g, x, mask, head, head_weights or {}, act=cfg.classifier_activation,
                 pooling=cfg.classifier_pooling, norm_eps=cfg.norm_eps)  # fmt: skip
        x = None
    return finish_head(
        g, x, mask, head, cfg.hidden, ["input_ids", "attention_mask"], name=name, producer=producer
    )
