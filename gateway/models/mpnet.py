"""MPNet (``model_type`` mpnet: all-mpnet-base-v2's ``MPNetModel``, or an ``MPNetForMaskedLM``
checkpoint) from its safetensors weights, as transformers' ``MPNetModel`` computes it.

MPNet is BERT's post-LN block with three differences, so the graph is ``encoder.py``'s with the
weights renamed: no token types; positions count from ``padding_idx + 1`` as RoBERTa's do
(``padding_idx`` is fixed at 1 in MPNetEmbeddings, whatever the config says); and every layer adds
one relative attention bias, shared across layers, looked up per head from the bucket of each
(query, key) distance (T5-style buckets: 32 buckets, max distance 128).
"""

from __future__ import annotations

import math

import numpy as np
import onnx

from batchgate.gateway.models.encoder import (
    EncoderConfig,
    Head,
    _embeddings,
    _Graph,
    renamed,
    _layer,
    finish_head,
    key_padding_bias,
    standard_constants,
)
from batchgate.gateway.models.heads import classify

STEM = "MPNet"
ARCHS = ("Model", "ForMaskedLM", "ForSequenceClassification")
CLASSIFIER = "roberta"  # MPNetClassificationHead: RoBERTa's layout and names
PREFIXES = ("", "mpnet.")
WORD = "embeddings.word_embeddings.weight"
PADDING_IDX = 1  # MPNetEmbeddings.padding_idx, not read from the config
# transformers' compute_position_bias is always called with num_buckets=32 (the table may have
# more rows: relative_attention_num_buckets sizes it, but no bucket past 31 is ever looked up).
BUCKETS = 32
MAX_DISTANCE = 128
_RENAMES = (
    (".attention.attn.q.", ".attention.self.query."),
    (".attention.attn.k.", ".attention.self.key."),
    (".attention.attn.v.", ".attention.self.value."),
    (".attention.attn.o.", ".attention.output.dense."),
    (".attention.LayerNorm.", ".attention.output.LayerNorm."),
)


def check(config: dict) -> str | None:
    act = config.get("hidden_act", "gelu")
    if act != "gelu":
        return f"hidden_act '{act}' is not supported; supported: 'gelu' (erf GELU)"
    return None


def position_limit(config: dict) -> int:
    return int(config["max_position_embeddings"]) - (PADDING_IDX + 1)


def encoder_config(config: dict, max_seq_length: int) -> EncoderConfig:
    return EncoderConfig(
        hidden=int(config["hidden_size"]),
        layers=int(config["num_hidden_layers"]),
        heads=int(config["num_attention_heads"]),
        intermediate=int(config["intermediate_size"]),
        max_positions=int(config["max_position_embeddings"]),
        type_vocab=1,
        ln_epsilon=float(config.get("layer_norm_eps", 1e-12)),
        max_seq_length=max_seq_length,
        padding_idx=PADDING_IDX,
    )


def relative_buckets(length: int) -> np.ndarray:
    """[length, length] int32: the bucket of key k's distance from query q, as transformers'
    MPNetEncoder.relative_position_bucket computes it (in float32, as torch does, so the
    truncation at each bucket's edge agrees)."""
    pos = np.arange(length, dtype=np.int64)
    n = -(pos[None, :] - pos[:, None])  # -(memory - context)
    half = BUCKETS // 2
    ret = (n < 0).astype(np.int64) * half
    n = np.abs(n)
    max_exact = half // 2
    # log(0) would be -inf; those distances are exact buckets, the log value is not used.
    ratio = np.maximum(n, 1).astype(np.float32) / np.float32(max_exact)
    scaled = np.log(ratio) / np.float32(math.log(MAX_DISTANCE / max_exact))
    large = max_exact + (scaled * np.float32(half - max_exact)).astype(np.int64)
    large = np.minimum(large, half - 1)
    return (ret + np.where(n < max_exact, n, large)).astype(np.int32)


def _relative_bias(g: _Graph, table: np.ndarray, key_bias: str, length: int) -> str:
    """[batch, heads, seq, seq]: the shared relative bias plus the padding mask, computed once
    for every layer."""
    seq = g.op("Shape", ["input_ids"], "rel_seq", start=1, end=2)
    ends = g.op("Concat", [seq, seq], "rel_ends", axis=0)
    buckets = g.op(
        "Slice",
        [g.const("rel_buckets", relative_buckets(length)), g.const("rel_starts", np.array([0, 0], np.int64)), ends,
         g.const("rel_axes", np.array([0, 1], np.int64))],
        "rel_buckets_seq",
    )  # fmt: skip
    values = g.op("Gather", [g.const("relative_attention_bias", table), buckets], "rel_values", axis=0)
    per_head = g.op("Transpose", [values], "rel_bias", perm=[2, 0, 1])  # [heads, seq, seq]
    return g.op("Add", [per_head, key_bias], "attention_bias")


def build_model(weights: dict[str, np.ndarray], cfg: EncoderConfig, head: Head, *, name: str,
                producer: str, head_weights: dict[str, np.ndarray] | None = None) -> onnx.ModelProto:  # fmt: skip
    """input_ids, attention_mask (INT64 [batch, seq]) -> ``embedding`` (FP32 [batch, hidden]).
    ``weights`` are named as in a bare ``MPNetModel`` (no ``mpnet.`` prefix)."""
    w = renamed(weights, _RENAMES)
    g = _Graph()
    standard_constants(g, cfg)
    x = _embeddings(g, w, cfg)
    mask, key_bias = key_padding_bias(g)
    bias = _relative_bias(
        g, w["encoder.relative_attention_bias.weight"], key_bias, cfg.max_positions - PADDING_IDX - 1
    )
    for i in range(cfg.layers):
        x = _layer(g, i, x, bias, w, cfg)
    if head.classifier:
        classify(g, x, mask, head, head_weights or {})
        x = None
    return finish_head(
        g, x, mask, head, cfg.hidden, ["input_ids", "attention_mask"], name=name, producer=producer
    )
