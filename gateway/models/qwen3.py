"""Qwen3 (``model_type`` qwen3): Qwen3-Embedding's ``Qwen3Model`` / ``Qwen3ForCausalLM``
checkpoints as embedders, ``Qwen3ForSequenceClassification``, and Qwen3-Reranker's causal LM
scored by its yes/no logits. The graph is the shared decoder builder's (decoder.py: pre-norm
blocks with RMSNorm, grouped-query attention with an RMSNorm on each query and key head before
the rotary embedding, SwiGLU MLP, causal attention, final RMSNorm); what is Qwen3's own is here:
its architectures, the card's defaults (last-token pooling: the end-of-text token the
tokenizer's post-processor appends; the query instruction) and the reranker's template.

The language-model head (``lm_head``) is not part of an embedding and is left out (the
reranker's yes/no rows of it are read by heads.py).
"""

from __future__ import annotations

import numpy as np
import onnx

from batchgate.gateway.models import decoder
from batchgate.gateway.models.encoder import Head

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


_GRAPH = decoder.QWEN3


def check(config: dict) -> str | None:
    """What in ``config`` the graph would not compute as transformers does, or None (what the
    released Qwen3 checkpoints use; sliding windows and scaled RoPE are not checked against
    transformers for Qwen3, so they are refused)."""
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
    return _GRAPH.position_limit(config)


def encoder_config(config: dict, max_seq_length: int) -> decoder.DecoderConfig:
    return _GRAPH.encoder_config(config, max_seq_length)


def build_model(weights: dict[str, np.ndarray], cfg: decoder.DecoderConfig, head: Head, *, name: str,
                producer: str, head_weights: dict[str, np.ndarray] | None = None) -> onnx.ModelProto:  # fmt: skip
    """input_ids, attention_mask (INT64 [batch, seq]) -> the head's outputs; a classifier head
    (seq-cls score, the reranker's yes/no logits) reads ``head_weights``."""
    return decoder.build_model(weights, cfg, head, name=name, producer=producer, head_weights=head_weights)
