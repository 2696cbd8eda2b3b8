"""Qwen3 as an embedder (``model_type`` qwen3: Qwen3-Embedding's ``Qwen3Model`` /
``Qwen3ForCausalLM`` checkpoints) from its safetensors weights, as transformers computes it:
token embeddings, pre-norm decoder blocks (RMSNorm; grouped-query attention with an RMSNorm on
each query and key head before the rotary embedding; SwiGLU MLP), CAUSAL attention, final
RMSNorm. The head is normally the last token's state (Qwen3-Embedding's Pooling says
``lasttoken``), which is the end-of-text token the tokenizer's post-processor appends.

The language-model head (``lm_head``) is not part of an embedding and is left out.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

from batchgate.gateway.build.encoder import Head, _Graph, finish_head, key_padding_bias
from batchgate.gateway.build.heads import classify
from batchgate.gateway.build.onnx_graph import GraphBuilder, attend
from batchgate.gateway.build.rotary import linear, position_bias, positions, rms_norm, rotary_tables, rotate

STEM = "Qwen3"
ARCHS = ("Model", "ForCausalLM", "ForSequenceClassification")
CLASSIFIER = "qwen3"  # score (no bias) on the last real token (heads.py)
PREFIXES = ("", "model.")
WORD = "embed_tokens.weight"
# A plain folder (no modules.json) is pooled as Qwen3-Embedding's card does.
DEFAULT_POOLING = "lasttoken"
# Qwen3-Embedding's card: queries get an instruction, documents nothing. Recorded as prompt
# "query" when the folder's config_sentence_transformers.json has no prompts of its own.
DEFAULT_PROMPTS = {
    "query": "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"
}

# Qwen3-Reranker's card: the model answers "yes" or "no" to this chat, its score the two
# logits' softmax at the last token. Recorded as parameter pair_template (gateway/text.py puts
# each query and document in it where the pair is tokenised); the instruction is the card's default.
RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
RERANK_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
    'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
)
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
RERANK_TEMPLATE = f"{RERANK_PREFIX}<Instruct>: {RERANK_INSTRUCTION}\n<Query>: {{query}}\n<Document>: {{document}}{RERANK_SUFFIX}"
RERANK_TOKENS = ("yes", "no")  # the card's token_true_id, token_false_id


@dataclass(frozen=True)
class Qwen3Config:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    max_seq_length: int
    rms_eps: float
    theta: float
    attention_bias: bool


def check(config: dict) -> str | None:
    """What in ``config`` the graph would not compute as transformers does, or None."""
    act = config.get("hidden_act", "silu")
    if act != "silu":
        return f"hidden_act '{act}' is not supported; supported: 'silu' (SwiGLU)"
    if config.get("use_sliding_window"):
        return "use_sliding_window true is not supported; supported: full causal attention on every layer"
    rope = config.get("rope_parameters") or {}
    kind = rope.get("rope_type", "default")
    if kind != "default":
        return f"rope_parameters.rope_type '{kind}' is not supported; supported: 'default'"
    if config.get("rope_scaling"):
        return "rope_scaling is not supported; supported: the default rotary embedding"
    return None


def position_limit(config: dict) -> int:
    return int(config.get("max_position_embeddings", 32768))


def encoder_config(config: dict, max_seq_length: int) -> Qwen3Config:
    heads = int(config["num_attention_heads"])
    rope = config.get("rope_parameters") or {}
    return Qwen3Config(
        hidden=int(config["hidden_size"]),
        layers=int(config["num_hidden_layers"]),
        heads=heads,
        kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or int(config["hidden_size"]) // heads),
        intermediate=int(config["intermediate_size"]),
        max_seq_length=max_seq_length,
        rms_eps=float(config.get("rms_norm_eps", 1e-6)),
        theta=float(rope.get("rope_theta", config.get("rope_theta", 10_000.0))),
        attention_bias=bool(config.get("attention_bias", False)),
    )


def _heads(g: GraphBuilder, name: str, x: str, count: int, cfg: Qwen3Config) -> str:
    shape = g.const(f"{name}.shape", np.array([0, 0, count, cfg.head_dim], np.int64))
    return g.op("Reshape", [x, shape], f"{name}.heads")


def _repeat_kv(g: GraphBuilder, name: str, x: str, cfg: Qwen3Config, shape: list[int]) -> str:
    """[batch, kv_heads, a, b] -> [batch, heads, a, b], each kv head serving heads / kv_heads
    query heads in a row (transformers' repeat_kv), by broadcasting instead of copying weights."""
    rep = cfg.heads // cfg.kv_heads
    if rep == 1:
        return x
    x5 = g.op("Unsqueeze", [x, "kv_axis"], f"{name}.x5")
    x5 = g.op(
        "Expand", [x5, g.const(f"{name}.rep", np.array([1, 1, rep, 1, 1], np.int64))], f"{name}.expanded"
    )
    return g.op("Reshape", [x5, g.const(f"{name}.shape", np.array(shape, np.int64))], f"{name}.repeated")


def _layer(g: GraphBuilder, i: int, x: str, w: dict[str, np.ndarray], cfg: Qwen3Config, cos: str, sin: str,
           bias: str) -> str:  # fmt: skip
    p, name = f"layers.{i}", f"layer{i}"
    a = f"{p}.self_attn"
    h = rms_norm(g, f"{name}.in_norm", x, w[f"{p}.input_layernorm.weight"], cfg.rms_eps)

    def proj(kind: str) -> str:
        return linear(g, f"{name}.{kind}", h, w[f"{a}.{kind}_proj.weight"], w.get(f"{a}.{kind}_proj.bias"))

    # The 1/sqrt(head_dim) score scale rides on q_norm's weight: the norm's output is scaled
    # before the (linear) rotary embedding, which commutes with it.
    q_norm = w[f"{a}.q_norm.weight"] * np.float32(cfg.head_dim**-0.5)
    q = rms_norm(g, f"{name}.q_norm", _heads(g, f"{name}.q", proj("q"), cfg.heads, cfg), q_norm, cfg.rms_eps)
    k = rms_norm(g, f"{name}.k_norm", _heads(g, f"{name}.k", proj("k"), cfg.kv_heads, cfg), w[f"{a}.k_norm.weight"],
                 cfg.rms_eps)  # fmt: skip
    q = g.op(
        "Transpose", [rotate(g, f"{name}.q", q, cos, sin, cfg.head_dim)], f"{name}.q_t", perm=[0, 2, 1, 3]
    )
    k = g.op(
        "Transpose", [rotate(g, f"{name}.k", k, cos, sin, cfg.head_dim)], f"{name}.k_t", perm=[0, 2, 3, 1]
    )
    v = g.op(
        "Transpose", [_heads(g, f"{name}.v", proj("v"), cfg.kv_heads, cfg)], f"{name}.v_t", perm=[0, 2, 1, 3]
    )
    k = _repeat_kv(g, f"{name}.k_rep", k, cfg, [0, cfg.heads, cfg.head_dim, -1])  # K is [.., head_dim, seq]
    v = _repeat_kv(g, f"{name}.v_rep", v, cfg, [0, cfg.heads, -1, cfg.head_dim])
    merged = attend(g, f"{name}.attn", q, k, v, bias)
    attn = linear(g, f"{name}.o", merged, w[f"{a}.o_proj.weight"], w.get(f"{a}.o_proj.bias"))
    x = g.op("Add", [x, attn], f"{name}.resid1")
    h = rms_norm(g, f"{name}.post_norm", x, w[f"{p}.post_attention_layernorm.weight"], cfg.rms_eps)
    # SwiGLU: down(silu(gate(h)) * up(h)); gate and up in one GEMM.
    gate_up = np.concatenate([w[f"{p}.mlp.gate_proj.weight"], w[f"{p}.mlp.up_proj.weight"]])
    gu = linear(g, f"{name}.gate_up", h, gate_up)
    gate, up = g.ops("Split", [gu, "glu_split"], [f"{name}.gate", f"{name}.up"], axis=-1)
    silu = g.op("Mul", [gate, g.op("Sigmoid", [gate], f"{name}.sigmoid")], f"{name}.silu")
    mlp = linear(g, f"{name}.down", g.op("Mul", [silu, up], f"{name}.glu"), w[f"{p}.mlp.down_proj.weight"])
    return g.op("Add", [x, mlp], f"{name}.resid2")


def build_model(weights: dict[str, np.ndarray], cfg: Qwen3Config, head: Head, *, name: str,
                producer: str, head_weights: dict[str, np.ndarray] | None = None) -> onnx.ModelProto:  # fmt: skip
    """input_ids, attention_mask (INT64 [batch, seq]) -> ``embedding`` (FP32 [batch, hidden]).
    ``weights`` are named as in a bare ``Qwen3Model`` (no ``model.`` prefix)."""
    g = _Graph()
    g.const("one_f", np.array(1.0, np.float32))
    g.const("merge_shape", np.array([0, 0, cfg.heads * cfg.head_dim], np.int64))
    g.const("kv_axis", np.array([2], np.int64))
    g.const("glu_split", np.array([cfg.intermediate] * 2, np.int64))

    x = g.op("Gather", [g.const("embed_tokens", weights[WORD]), "input_ids"], "embedded", axis=0)
    mask, key_bias = key_padding_bias(g)
    pos = positions(g, mask)
    cos, sin = rotary_tables(g, "rope", pos, cfg.theta, cfg.head_dim)
    # Causal: a token sees itself and what precedes it, never a later token nor padding.
    bias = position_bias(g, "causal_bias", pos, key_bias, causal=True)
    for i in range(cfg.layers):
        x = _layer(g, i, x, weights, cfg, cos, sin, bias)
    x = rms_norm(g, "final_norm", x, weights["norm.weight"], cfg.rms_eps)
    if head.classifier:  # a seq-cls score, or Qwen3-Reranker's yes/no logits (heads.py)
        classify(g, x, mask, head, head_weights or {})
        x = None
    return finish_head(
        g, x, mask, head, cfg.hidden, ["input_ids", "attention_mask"], name=name, producer=producer
    )
