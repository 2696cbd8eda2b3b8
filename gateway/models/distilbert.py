"""DistilBERT (``model_type`` distilbert: ``DistilBertModel``, or ``DistilBertForMaskedLM`` whose
encoder sits under ``distilbert.``) from its safetensors weights, as transformers computes it.

Its block is BERT's post-LN block under other names (``q_lin``, ``sa_layer_norm``, ``ffn.lin1``,
``output_layer_norm``), so the graph is ``encoder.py``'s with the weights renamed; the
embeddings have no token types and start positions at 0. Sinusoidal position embeddings
(``sinusoidal_pos_embds``) are stored in the checkpoint like learned ones (transformers saves
the table it computed), so they are read as learned ones. LayerNorm epsilon is DistilBERT's
fixed 1e-12.
"""

from __future__ import annotations

import numpy as np
import onnx

from batchgate.gateway.models import encoder, heads
from batchgate.gateway.models.encoder import EncoderConfig, Head, renamed

STEM = "DistilBert"
ARCHS = ("Model", "ForMaskedLM", "ForSequenceClassification")
CLASSIFIER = "distilbert"  # pre_classifier, ReLU, classifier (heads.py)
PREFIXES = ("", "distilbert.")
WORD = "embeddings.word_embeddings.weight"
_RENAMES = (
    ("transformer.layer.", "encoder.layer."),
    (".attention.q_lin.", ".attention.self.query."),
    (".attention.k_lin.", ".attention.self.key."),
    (".attention.v_lin.", ".attention.self.value."),
    (".attention.out_lin.", ".attention.output.dense."),
    (".sa_layer_norm.", ".attention.output.LayerNorm."),
    (".ffn.lin1.", ".intermediate.dense."),
    (".ffn.lin2.", ".output.dense."),
    (".output_layer_norm.", ".output.LayerNorm."),
)


def check(config: dict) -> str | None:
    act = config.get("activation", "gelu")
    if act != "gelu":
        return f"activation '{act}' is not supported; supported: 'gelu' (erf GELU)"
    return None


def position_limit(config: dict) -> int:
    return int(config.get("max_position_embeddings", 512))


def encoder_config(config: dict, max_seq_length: int) -> EncoderConfig:
    return EncoderConfig(
        hidden=int(config.get("dim", 768)),
        layers=int(config.get("n_layers", 6)),
        heads=int(config.get("n_heads", 12)),
        intermediate=int(config.get("hidden_dim", 3072)),
        max_positions=position_limit(config),
        type_vocab=1,
        ln_epsilon=1e-12,  # hard-coded in DistilBERT's modules
        max_seq_length=max_seq_length,
    )


def build_model(weights: dict[str, np.ndarray], cfg: EncoderConfig, head: Head, *, name: str,
                producer: str, head_weights: dict[str, np.ndarray] | None = None) -> onnx.ModelProto:  # fmt: skip
    """input_ids, attention_mask (INT64 [batch, seq]) -> ``embedding`` (FP32 [batch, hidden]).
    ``weights`` are named as in a bare ``DistilBertModel`` (no ``distilbert.`` prefix)."""
    return encoder.build_model(
        renamed(weights, _RENAMES),
        cfg,
        head,
        name=name,
        producer=producer,
        head_weights=head_weights,
        classify=heads.classify,
    )
