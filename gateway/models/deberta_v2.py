"""DeBERTa-v2 and v3 (``model_type`` deberta-v2: ``DebertaV2ForSequenceClassification``, e.g.
mxbai-rerank-*-v1, or a bare ``DebertaV2Model`` / ``DebertaV2ForMaskedLM`` encoder) from its
safetensors weights, as transformers computes it.

The block is BERT's post-LN block; what differs is the attention. DeBERTa's is *disentangled*:
besides the content score q·k it adds, for each (query i, key j), a content-to-position term
(c2p: query i against the relative-position key of the distance i - j) and a position-to-content
term (p2c: key j against the relative-position query of the distance j - i). Distances are
log-bucketed past ``position_buckets / 2`` (v3; ``make_log_bucket_position``), else clipped to
``max_relative_positions``. The relative-position projections come from one shared table
(``encoder.rel_embeddings``, LayerNorm'd when ``norm_rel_ebd`` says so) through each layer's own
key/query projections (``share_att_key``) or its ``pos_key_proj`` / ``pos_query_proj``. Every
score is divided by sqrt(head_dim x (1 + the number of position terms)).

The table's projections depend on the weights only, so they are computed here once per layer
(float64, stored float32) instead of on every batch; the (query, key) -> table-row index is a
constant too, sliced to the batch's length and gathered per element.

The classifier head is ``ContextPooler`` (first token, dense, ``pooler_hidden_act``) then
``classifier``. Embeddings: words (+ absolute positions when ``position_biased_input``, + token
types when ``type_vocab_size`` > 0), ``embed_proj`` when ``embedding_size`` differs, LayerNorm.
DeBERTa-v2-xlarge's convolution after the first layer (``conv_kernel_size``) is not built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from batchgate.gateway.models.encoder import Head, _Graph, finish_head, key_padding_bias
from batchgate.gateway.models.heads import classify
from batchgate.gateway.models.onnx_graph import GraphBuilder, gelu
from batchgate.gateway.models.rotary import layer_norm, linear
from batchgate.gateway.models.sources import special_token, tokenizer_config

STEM = "DebertaV2"
ARCHS = ("Model", "ForMaskedLM", "ForSequenceClassification")
CLASSIFIER = "deberta"  # ContextPooler, classifier (heads.py)
PREFIXES = ("", "deberta.")
WORD = "embeddings.word_embeddings.weight"
# The classifier's last layer: its rows are the labels (hf_model checks them against id2label).
LABELS_TENSOR = "classifier.weight"
POSITION_TERMS = ("c2p", "p2c")
POOLER_ACTIVATIONS = ("gelu", "tanh")


@dataclass(frozen=True)
class DebertaConfig:
    hidden: int
    layers: int
    heads: int
    head_dim: int
    intermediate: int
    max_positions: int
    type_vocab: int
    ln_epsilon: float
    max_seq_length: int
    embedding_size: int
    position_biased_input: bool
    relative_attention: bool
    position_buckets: int  # <= 0: distances clipped, not bucketed
    max_relative_positions: int
    share_att_key: bool
    pos_att_type: tuple[str, ...]
    norm_rel_ebd: bool  # the relative table goes through encoder.LayerNorm first
    pooler_act: str

    @property
    def token_types(self) -> bool:
        return self.type_vocab > 0

    @property
    def span(self) -> int:
        """Rows on each side of the relative table (transformers' ``pos_ebd_size``)."""
        return self.position_buckets if self.position_buckets > 0 else self.max_relative_positions


def check(config: dict) -> str | None:
    """What in ``config`` the graph would not compute as transformers does, or None."""
    act = config.get("hidden_act", "gelu")
    if act != "gelu":
        return f"hidden_act '{act}' is not supported; supported: 'gelu' (erf GELU)"
    pooler = config.get("pooler_hidden_act", "gelu")
    if pooler not in POOLER_ACTIVATIONS:
        return f"pooler_hidden_act '{pooler}' is not supported; supported: {', '.join(POOLER_ACTIVATIONS)}"
    if int(config.get("conv_kernel_size", 0) or 0) > 0:
        return "conv_kernel_size > 0 (DeBERTa-v2-xlarge's convolution layer) is not supported; supported: 0"
    terms = _terms(config)
    unknown = [t for t in terms if t not in POSITION_TERMS]
    if unknown:
        return f"pos_att_type '{unknown[0]}' is not supported; supported: {', '.join(POSITION_TERMS)}"
    hidden = int(config.get("hidden_size", 768))
    if int(config.get("pooler_hidden_size", hidden)) != hidden:
        return (
            f"pooler_hidden_size {config.get('pooler_hidden_size')} is not supported; supported: hidden_size"
        )
    return None


def _terms(config: dict) -> tuple[str, ...]:
    terms = config.get("pos_att_type") or ()
    if isinstance(terms, str):  # DeBERTa's own configs say "p2c|c2p"
        terms = terms.lower().split("|")
    return tuple(str(t).strip() for t in terms if str(t).strip())


def position_limit(config: dict) -> int:
    return int(config.get("max_position_embeddings", 512))


def encoder_config(config: dict, max_seq_length: int) -> DebertaConfig:
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    max_positions = int(config.get("max_position_embeddings", 512))
    max_rel = int(config.get("max_relative_positions", -1))
    return DebertaConfig(
        hidden=hidden,
        layers=int(config["num_hidden_layers"]),
        heads=heads,
        head_dim=int(config.get("attention_head_size") or hidden // heads),
        intermediate=int(config["intermediate_size"]),
        max_positions=max_positions,
        type_vocab=int(config.get("type_vocab_size", 0)),
        ln_epsilon=float(config.get("layer_norm_eps", 1e-7)),
        max_seq_length=max_seq_length,
        embedding_size=int(config.get("embedding_size") or hidden),
        position_biased_input=bool(config.get("position_biased_input", True)),
        relative_attention=bool(config.get("relative_attention", False)),
        position_buckets=int(config.get("position_buckets", -1)),
        max_relative_positions=max_rel if max_rel >= 1 else max_positions,
        share_att_key=bool(config.get("share_att_key", False)),
        pos_att_type=_terms(config),
        norm_rel_ebd="layer_norm"
        in [s.strip() for s in str(config.get("norm_rel_ebd", "none")).lower().split("|")],
        pooler_act=str(config.get("pooler_hidden_act", "gelu")),
    )


def log_buckets(relative: np.ndarray, bucket_size: int, max_position: int) -> np.ndarray:
    """transformers' make_log_bucket_position: distances under bucket_size / 2 kept, longer ones
    log-spaced up to max_position (float32 arithmetic, as torch does it, so each ceil agrees)."""
    sign = np.sign(relative)
    mid = bucket_size // 2
    abs_pos = np.where((relative < mid) & (relative > -mid), mid - 1, np.abs(relative))
    ratio = np.log(abs_pos.astype(np.float32) / np.float32(mid))
    log_pos = np.ceil(
        ratio / np.log(np.float32((max_position - 1) / mid)) * np.float32(mid - 1)
    ) + np.float32(mid)
    return np.where(abs_pos <= mid, relative, log_pos * sign).astype(np.int64)


def relative_positions(length: int, cfg: DebertaConfig) -> np.ndarray:
    """[length, length]: query i's position relative to key j (i - j), bucketed as configured."""
    pos = np.arange(length, dtype=np.int64)
    rel = pos[:, None] - pos[None, :]
    if cfg.position_buckets > 0 and cfg.max_relative_positions > 0:
        rel = log_buckets(rel, cfg.position_buckets, cfg.max_relative_positions)
    return rel


def table_rows(length: int, cfg: DebertaConfig) -> tuple[np.ndarray, np.ndarray]:
    """(c2p, p2c), each [length, length] int64: the relative table's row each term reads.
    c2p[i, j] for query i and key j; p2c[j, i] for key j and query i (transformers gathers p2c
    along its key's row, then transposes), as disentangled_attention_bias clamps them."""
    rel = relative_positions(length, cfg)
    span = cfg.span
    c2p = np.clip(rel + span, 0, 2 * span - 1)
    p2c = np.clip(-rel + span, 0, 2 * span - 1)
    return c2p, p2c


def _np_layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float64)
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * weight + bias


def _heads(g: GraphBuilder, name: str, x: str, perm: list[int]) -> str:
    return g.op("Transpose", [g.op("Reshape", [x, "heads_shape"], f"{name}.4d")], f"{name}.t", perm=perm)


def _layer(g: GraphBuilder, i: int, x: str, key_bias: str, w: dict[str, np.ndarray], cfg: DebertaConfig,
           rel: np.ndarray | None, rows: tuple[str, str] | None) -> str:  # fmt: skip
    p, name = f"encoder.layer.{i}", f"layer{i}"
    a = f"{p}.attention.self"
    factor = 1 + sum(t in cfg.pos_att_type for t in POSITION_TERMS) if cfg.relative_attention else 1
    inv_scale = 1.0 / math.sqrt(cfg.head_dim * factor)
    # Every term is divided by the same scale: it rides on the query weights (content and c2p
    # both read q) and on the position queries (p2c).
    q = _heads(g, f"{name}.q", linear(g, f"{name}.q", x, w[f"{a}.query_proj.weight"] * np.float32(inv_scale),
                                      w[f"{a}.query_proj.bias"] * np.float32(inv_scale)), [0, 2, 1, 3])  # fmt: skip
    k = _heads(g, f"{name}.k", linear(g, f"{name}.k", x, w[f"{a}.key_proj.weight"], w[f"{a}.key_proj.bias"]),
               [0, 2, 1, 3])  # fmt: skip
    v = _heads(g, f"{name}.v", linear(g, f"{name}.v", x, w[f"{a}.value_proj.weight"], w[f"{a}.value_proj.bias"]),
               [0, 2, 1, 3])  # fmt: skip
    k_t = g.op("Transpose", [k], f"{name}.k_tt", perm=[0, 1, 3, 2])
    scores = g.op("MatMul", [q, k_t], f"{name}.c2c")
    if cfg.relative_attention and rel is not None and rows is not None:

        def projected(kind: str) -> np.ndarray:
            """The relative table through this layer's key or query projection: [heads, head_dim,
            2 * span], ready for x @ it."""
            proj = f"{a}.{kind}_proj" if cfg.share_att_key else f"{a}.pos_{kind}_proj"
            bias = w.get(f"{proj}.bias")
            out = rel @ w[f"{proj}.weight"].astype(np.float64).T + (0 if bias is None else bias)
            return out.reshape(rel.shape[0], cfg.heads, cfg.head_dim).transpose(1, 2, 0)

        if "c2p" in cfg.pos_att_type:
            pos_key = g.const(f"{name}.pos_key", projected("key").astype(np.float32))
            c2p = g.op("MatMul", [q, pos_key], f"{name}.c2p_all")  # [b, h, query, 2 * span]
            c2p = g.op("Reshape", [c2p, "rel_flat"], f"{name}.c2p_flat")  # [b, h, query * 2 * span]
            c2p = g.op("Gather", [c2p, rows[0]], f"{name}.c2p", axis=2)
            scores = g.op("Add", [scores, c2p], f"{name}.with_c2p")
        if "p2c" in cfg.pos_att_type:
            pos_query = g.const(f"{name}.pos_query", (projected("query") * inv_scale).astype(np.float32))
            p2c = g.op("MatMul", [k, pos_query], f"{name}.p2c_all")  # [b, h, key, 2 * span]
            p2c = g.op("Reshape", [p2c, "rel_flat"], f"{name}.p2c_flat")  # [b, h, key * 2 * span]
            p2c = g.op("Gather", [p2c, rows[1]], f"{name}.p2c", axis=2)
            scores = g.op("Add", [scores, p2c], f"{name}.with_p2c")
    scores = g.op("Add", [scores, key_bias], f"{name}.masked")
    probs = g.op("Softmax", [scores], f"{name}.probs", axis=-1)
    context = g.op("MatMul", [probs, v], f"{name}.context")
    merged = g.op("Reshape", [g.op("Transpose", [context], f"{name}.context_t", perm=[0, 2, 1, 3]), "merge_shape"],
                  f"{name}.merged")  # fmt: skip
    attn = linear(g, f"{name}.attn_out", merged, w[f"{p}.attention.output.dense.weight"],
                  w[f"{p}.attention.output.dense.bias"])  # fmt: skip
    x = layer_norm(g, f"{name}.ln1", g.op("Add", [attn, x], f"{name}.resid1"),
                   w[f"{p}.attention.output.LayerNorm.weight"], w[f"{p}.attention.output.LayerNorm.bias"],
                   cfg.ln_epsilon)  # fmt: skip
    h = linear(g, f"{name}.ffn1", x, w[f"{p}.intermediate.dense.weight"], w[f"{p}.intermediate.dense.bias"])
    h = gelu(g, f"{name}.gelu", h, one="one_f")
    h = linear(g, f"{name}.ffn2", h, w[f"{p}.output.dense.weight"], w[f"{p}.output.dense.bias"])
    return layer_norm(g, f"{name}.ln2", g.op("Add", [h, x], f"{name}.resid2"), w[f"{p}.output.LayerNorm.weight"],
                      w[f"{p}.output.LayerNorm.bias"], cfg.ln_epsilon)  # fmt: skip


def _embeddings(g: GraphBuilder, w: dict[str, np.ndarray], cfg: DebertaConfig) -> str:
    x = g.op("Gather", [g.const("word_embeddings", w[WORD]), "input_ids"], "word_states", axis=0)
    if cfg.position_biased_input:
        seq = g.op("Shape", ["input_ids"], "seq_len", start=1, end=2)
        table = g.const("position_embeddings", w["embeddings.position_embeddings.weight"])
        positions = g.op("Slice", [table, g.const("zero_1d", np.array([0], np.int64)), seq,
                                   g.const("axis0_1d", np.array([0], np.int64))], "position_states")  # fmt: skip
        x = g.op("Add", [x, positions], "word_pos")
    if cfg.token_types:
        types = g.op("Gather", [g.const("token_type_embeddings", w["embeddings.token_type_embeddings.weight"]),
                                "token_type_ids"], "type_states", axis=0)  # fmt: skip
        x = g.op("Add", [x, types], "with_types")
    if cfg.embedding_size != cfg.hidden:
        x = linear(g, "embed_proj", x, w["embeddings.embed_proj.weight"])
    return layer_norm(g, "embeddings.ln", x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"],
                      cfg.ln_epsilon)  # fmt: skip


def build_model(weights: dict[str, np.ndarray], cfg: DebertaConfig, head: Head, *, name: str, producer: str,
                head_weights: dict[str, np.ndarray] | None = None) -> onnx.ModelProto:  # fmt: skip
    """input_ids, attention_mask[, token_type_ids] (INT64 [batch, seq]) -> the head's outputs.
    ``weights`` are named as in a bare ``DebertaV2Model`` (no ``deberta.`` prefix);
    ``head_weights`` the classifier's (``pooler.*``, ``classifier.*``)."""
    g = _Graph()
    g.const("one_f", np.array(1.0, np.float32))
    g.const("heads_shape", np.array([0, 0, cfg.heads, cfg.head_dim], np.int64))
    g.const("merge_shape", np.array([0, 0, cfg.heads * cfg.head_dim], np.int64))
    x = _embeddings(g, weights, cfg)
    mask, key_bias = key_padding_bias(g)
    rel, rows = None, None
    if cfg.relative_attention:
        rel = weights["encoder.rel_embeddings.weight"][: 2 * cfg.span].astype(np.float64)
        if cfg.norm_rel_ebd:
            rel = _np_layer_norm(rel, weights["encoder.LayerNorm.weight"], weights["encoder.LayerNorm.bias"],
                                 cfg.ln_epsilon)  # fmt: skip
        # The longest row the graph can take: the position table's, or the served length. Each
        # term is one Gather from its [b, h, seq * 2 * span] scores flattened, by an index
        # [query, key] into them: no [b, h, seq, seq] index tensor is ever made.
        length = max(cfg.max_seq_length, cfg.max_positions)
        width = 2 * cfg.span
        c2p, p2c = table_rows(length, cfg)
        at = np.arange(length, dtype=np.int64)
        c2p = at[:, None] * width + c2p  # query i's row, then its column
        p2c = (at[:, None] * width + p2c).T  # key j's row (p2c[j, i]), laid out [query i, key j]
        g.const("rel_flat", np.array([0, 0, -1], np.int64))
        seq = g.op("Shape", ["input_ids"], "rel_seq", start=1, end=2)
        ends = g.op("Concat", [seq, seq], "rel_ends", axis=0)
        starts, axes = (
            g.const("rel_starts", np.array([0, 0], np.int64)),
            g.const("rel_axes", np.array([0, 1], np.int64)),
        )
        rows = tuple(
            g.op("Slice", [g.const(f"{kind}_rows", table), starts, ends, axes], f"{kind}_rows_seq")
            for kind, table in (("c2p", c2p), ("p2c", p2c))
        )
    for i in range(cfg.layers):
        x = _layer(g, i, x, key_bias, weights, cfg, rel, rows)
    names = ["input_ids", "attention_mask"] + (["token_type_ids"] if cfg.token_types else [])
    if head.classifier:
        classify(g, x, mask, head, head_weights or {}, act=cfg.pooler_act)
        return finish_head(g, None, mask, head, cfg.hidden, names, name=name, producer=producer)
    return finish_head(g, x, mask, head, cfg.hidden, names, name=name, producer=producer)


def served_tokenizer(model_dir: Path, tokenizer: Path) -> bytes:
    """The folder's tokenizer.json as its reference tokenises: transformers 5's DebertaV2Tokenizer
    (what sentence-transformers' CrossEncoder and the cards' code load) keeps the file's vocabulary
    but builds its own normalizer (lowercase per ``do_lower_case``; whitespace runs, tabs and
    newlines to one space; NFC; right strip), pre-tokenizer (punctuation per ``split_by_punct``;
    Metaspace) and [CLS] A [SEP] (B [SEP]) template from tokenizer_config.json, ignoring the
    file's (which transformers 4 converted from sentencepiece: its precompiled NFKC map, for one).
    On text where the two differ (full-width letters, ligatures, tabs) the model is served what
    its reference feeds it."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors

    config = tokenizer_config(model_dir)
    tok = Tokenizer.from_file(str(tokenizer))
    steps = [normalizers.Lowercase()] if config.get("do_lower_case", False) else []
    steps += [normalizers.Replace(Regex(r"\s{2,}|[\n\r\t]"), " "), normalizers.NFC(),
              normalizers.Strip(left=False, right=True)]  # fmt: skip
    tok.normalizer = normalizers.Sequence(steps)
    scheme = "always" if config.get("add_prefix_space", True) else "first"
    pre = [pre_tokenizers.Punctuation(behavior="isolated")] if config.get("split_by_punct", False) else []
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [*pre, pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme)]
    )
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme=scheme)
    cls, sep = special_token(config, "cls_token", "[CLS]"), special_token(config, "sep_token", "[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls}:0 $A:0 {sep}:0", pair=f"{cls}:0 $A:0 {sep}:0 $B:1 {sep}:1",
        special_tokens=[(cls, tok.token_to_id(cls) or 0), (sep, tok.token_to_id(sep) or 0)],
    )  # fmt: skip
    return tok.to_str().encode()
