"""The BERT-family encoder spelled out with ``onnx.helper``: BERT, RoBERTa and XLM-RoBERTa
blocks from their safetensors weights, then one of the heads a served model ends in —
sentence-transformers' pooling (mean, CLS, last token), its Dense modules and optional L2
normalisation (and, when asked, every token's state); a ``*ForSequenceClassification`` head's
logit (a cross-encoder's score) or its logits and probabilities (a classifier); or a masked-LM
head pooled as SPLADE pools it (a sparse encoder).

The arithmetic is Hugging Face's ``BertModel`` / ``RobertaModel`` (post-LN blocks, erf GELU);
the two families differ only in their embeddings: RoBERTa's positions count from
``padding_idx + 1`` and its token-type table has one row. MiniLM (``minilm.py``) and
``prepare-model`` (``hf_model.py``) both build through ``build_model``; MiniLM's file must stay
byte-identical to what it was before this module was split out of it, so the node order and
names of the BERT path are fixed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from batchgate.gateway.models.onnx_graph import GraphBuilder, attend, finish_model, gelu, split_heads

# Large enough that exp() of a masked score underflows to exactly 0 in float32.
MASK_PENALTY = -1e9
# sentence-transformers clamps the token count with 1e-9 and F.normalize the norm with 1e-12.
POOL_EPSILON = 1e-9
NORM_EPSILON = 1e-12

POOLINGS = ("mean", "cls", "lasttoken")
# sentence-transformers' Dense activation_function (a torch class path) -> its ONNX spelling.
ACTIVATIONS = {"Identity": None, "Tanh": "Tanh", "Sigmoid": "Sigmoid", "ReLU": "Relu", "GELU": "gelu"}


@dataclass(frozen=True)
class EncoderConfig:
    hidden: int
    layers: int
    heads: int
    intermediate: int
    max_positions: int
    type_vocab: int
    ln_epsilon: float
    max_seq_length: int  # what sentence-transformers truncates at
    # RoBERTa / XLM-R: position ids are padding_idx + 1 + the token's index among real tokens
    # (Hugging Face's create_position_ids_from_input_ids); None for BERT, whose start at 0.
    padding_idx: int | None = None

    @property
    def token_types(self) -> bool:
        """Whether the graph takes token_type_ids. RoBERTa's tokenizers send none, so its models
        always add type row 0 (whatever type_vocab says), as transformers does without them."""
        return self.type_vocab > 1 and self.padding_idx is None


@dataclass(frozen=True, eq=False)
class Dense:
    """A sentence-transformers ``Dense`` module: ``activation(x @ weight.T + bias)``."""

    weight: np.ndarray  # [out_features, in_features], torch Linear's layout
    bias: np.ndarray | None
    activation: str  # a key of ACTIVATIONS

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])


@dataclass(frozen=True, eq=False)
class MaskedLM:
    """A masked-LM head (BERT's ``cls.predictions``, RoBERTa's ``lm_head``, DistilBERT's
    ``vocab_*``): dense, erf GELU, LayerNorm, then the vocabulary projection, pooled as
    sentence-transformers' ``SpladePooling`` does: ``log(1 + relu(logits))`` (``log1p_relu``
    takes log1p once more), padding masked, then max (or sum) over the tokens."""

    dense_weight: np.ndarray  # [hidden, hidden], torch Linear's layout
    dense_bias: np.ndarray
    norm_weight: np.ndarray
    norm_bias: np.ndarray
    norm_epsilon: float
    decoder_weight: np.ndarray  # [vocab, hidden]: the word embeddings when tied
    decoder_bias: np.ndarray  # [vocab]
    activation: str = "relu"  # SpladePooling's activation_function: "relu" or "log1p_relu"
    pooling: str = "max"  # SpladePooling's pooling_strategy: "max" or "sum"

    @property
    def vocab(self) -> int:
        return int(self.decoder_weight.shape[0])


@dataclass(frozen=True)
class Head:
    """What follows the encoder: ``pooling``, then ``dense`` (sentence-transformers' Dense
    modules, in order), then ``normalize`` (an embedding; ``token_states`` adds every token's
    state); or ``classifier`` ("bert" pooler + classifier, "roberta" classification head) with
    ``labels`` logits: one is a cross-encoder's score, more a classifier's, whose probabilities
    are their softmax (sigmoid each with ``multi_label``); or ``mlm``, a sparse encoder."""

    pooling: str = "mean"
    normalize: bool = True
    classifier: str | None = None
    dense: tuple[Dense, ...] = ()
    labels: int = 1
    multi_label: bool = False
    mlm: MaskedLM | None = None
    token_states: bool = False
    # BGE-M3's sparse and ColBERT heads beside the pooled embedding (bge_m3.py M3Heads)
    m3: object | None = None
    # A ColBERT model's per-token head instead of pooling (colbert.py ColBERTHead)
    colbert: object | None = None

    @property
    def kind(self) -> str:
        """Parameter ``kind`` (gateway/parameters.py KINDS): which outputs the model has."""
        if self.mlm is not None:
            return "sparse_embedding"
        if self.colbert is not None:
            return "multi_vector"
        if self.classifier:
            return "rerank" if self.labels == 1 else "classification"
        return "embedding"

    @property
    def output(self) -> str:
        """The main output's name (the first of ``outputs``)."""
        return {"rerank": "score", "classification": "probabilities", "multi_vector": "token_embeddings"}.get(
            self.kind, self.kind
        )

    def dim(self, hidden: int) -> int:
        """The main output's length: the labels, the vocabulary, the last Dense's out_features,
        else the hidden size."""
        if self.classifier:
            return self.labels
        if self.mlm is not None:
            return self.mlm.vocab
        if self.colbert is not None:
            return self.colbert.dim(hidden)
        return self.dense[-1].out_features if self.dense else hidden

    def outputs(self, hidden: int) -> list[tuple[str, list[int | str]]]:
        """(name, dims after the batch dim) of every output, the main one first; "seq" is the
        input's length (the engines trim it back to each request's own)."""
        if self.colbert is not None:
            return [("token_embeddings", ["seq", self.dim(hidden)]), ("token_mask", ["seq"])]
        main = [(self.output, [self.dim(hidden)])]
        if self.kind == "classification":
            return main + [("logits", [self.labels])]
        if self.m3 is not None:
            return main + [("sparse_embedding", [self.m3.vocab]), ("token_embeddings", ["seq", self.m3.dim]),
                           ("token_mask", ["seq"])]  # fmt: skip
        if self.token_states:
            return main + [("token_embeddings", ["seq", hidden])]
        return main


class _Graph(GraphBuilder):
    """The shared builder; weights come transposed out of safetensors, so each is made
    contiguous before it is stored (which also keeps the built file byte-identical)."""

    def const(self, name: str, value: np.ndarray) -> str:
        return super().const(name, np.ascontiguousarray(value))

    def scalar(self, name: str, value: np.ndarray) -> str:
        """A 0-d constant: ``const`` stores a 0-d array as shape [1] (np.ascontiguousarray
        does), which MiniLM's bytes keep, but a Gather index or a CumSum axis must be 0-d."""
        return super().const(name, value)


def _linear(g: GraphBuilder, name: str, x: str, weight: np.ndarray, bias: np.ndarray) -> str:
    # torch Linear stores [out, in]; MatMul wants [in, out].
    w = g.const(f"{name}.weight", weight.T.astype(np.float32))
    b = g.const(f"{name}.bias", bias.astype(np.float32))
    return g.op("Add", [g.op("MatMul", [x, w], f"{name}.matmul"), b], name)


def _layer_norm(g: GraphBuilder, name: str, x: str, w: dict[str, np.ndarray], prefix: str, eps: float) -> str:
    scale = g.const(f"{name}.scale", w[f"{prefix}.weight"])
    bias = g.const(f"{name}.bias", w[f"{prefix}.bias"])
    return g.op("LayerNormalization", [x, scale, bias], name, axis=-1, epsilon=eps)


def _attention(
    g: GraphBuilder, name: str, x: str, key_bias: str, w: dict[str, np.ndarray], p: str, cfg: EncoderConfig
) -> str:
    head_dim = cfg.hidden // cfg.heads
    scale = 1.0 / math.sqrt(head_dim)
    # One [hidden, 3*hidden] GEMM instead of three; the 1/sqrt(head_dim) score scale is folded
    # into the query weights, which saves a Mul over every [heads, seq, seq] score tensor.
    weight = np.concatenate([w[f"{p}.query.weight"] * scale, w[f"{p}.key.weight"], w[f"{p}.value.weight"]])
    bias = np.concatenate([w[f"{p}.query.bias"] * scale, w[f"{p}.key.bias"], w[f"{p}.value.bias"]])
    qkv = _linear(g, f"{name}.qkv", x, weight, bias)
    q, k, v = g.ops("Split", [qkv, "qkv_split"], [f"{name}.q", f"{name}.k", f"{name}.v"], axis=-1)
    q = split_heads(g, q, [0, 2, 1, 3], "t")
    k = split_heads(g, k, [0, 2, 3, 1], "t")
    v = split_heads(g, v, [0, 2, 1, 3], "t")
    merged = attend(g, name, q, k, v, key_bias)  # the scale is in the query weights
    return _linear(
        g,
        f"{name}.out",
        merged,
        w[f"{p[: -len('.self')]}.output.dense.weight"],
        w[f"{p[: -len('.self')]}.output.dense.bias"],
    )


def _layer(
    g: GraphBuilder, i: int, x: str, key_bias: str, w: dict[str, np.ndarray], cfg: EncoderConfig
) -> str:
    # Post-LN, as BERT: LayerNorm(x + sublayer(x)).
    p = f"encoder.layer.{i}"
    name = f"layer{i}"
    attn = _attention(g, f"{name}.attn", x, key_bias, w, f"{p}.attention.self", cfg)
    x = _layer_norm(
        g,
        f"{name}.ln1",
        g.op("Add", [x, attn], f"{name}.resid1"),
        w,
        f"{p}.attention.output.LayerNorm",
        cfg.ln_epsilon,
    )
    hidden = _linear(
        g, f"{name}.ffn1", x, w[f"{p}.intermediate.dense.weight"], w[f"{p}.intermediate.dense.bias"]
    )
    ffn = _linear(
        g,
        f"{name}.ffn2",
        gelu(g, f"{name}.gelu", hidden, one="one_f", half="half_f", sqrt2="sqrt2"),
        w[f"{p}.output.dense.weight"],
        w[f"{p}.output.dense.bias"],
    )
    return _layer_norm(
        g, f"{name}.ln2", g.op("Add", [x, ffn], f"{name}.resid2"), w, f"{p}.output.LayerNorm", cfg.ln_epsilon
    )


def _positions(g: _Graph, table: np.ndarray, cfg: EncoderConfig) -> str:
    if cfg.padding_idx is None:
        # positions = table[:seq], with seq taken from the input's shape. (Range + Gather says
        # the same, but onnxruntime 1.32's extended optimiser rewrites that into a Slice that fails.)
        seq = g.op("Shape", ["input_ids"], "seq_len", start=1, end=2)
        return g.op(
            "Slice",
            [
                g.const("position_embeddings", table),
                g.const("zero_1d", np.array([0], np.int64)),
                seq,
                g.const("axis0_1d", np.array([0], np.int64)),
            ],
            "position_states",
        )
    # RoBERTa counts real tokens from padding_idx + 1; padding sits at padding_idx. Counted on
    # the attention mask, not on input_ids == pad id as Hugging Face does: the same numbers for
    # a tokenizer's own output, and independent of the id the text stage pads with (a
    # tokenizer.json without a padding block pads with 0, which is XLM-R's <s>).
    ids = g.op(
        "Mul", [g.op("CumSum", ["attention_mask", "axis1"], "real_index"), "attention_mask"], "real_pos"
    )
    ids = g.op("Add", [ids, g.const("padding_idx", np.array(cfg.padding_idx, np.int64))], "position_ids")
    return g.op("Gather", [g.const("position_embeddings", table), ids], "position_states", axis=0)


def _embeddings(g: _Graph, weights: dict[str, np.ndarray], cfg: EncoderConfig) -> str:
    """Words + positions (+ token types where the family has a table) + LayerNorm. MPNet and
    DistilBERT have no type table: nothing is added there, where a zero row would cost an Add
    over every token."""
    # seq is read from the input at run time, so one graph serves 1..max_positions; a longer
    # input fails its Gather instead of silently wrapping.
    if cfg.padding_idx is not None:
        g.scalar("axis1", np.array(1, np.int64))
    words = g.op(
        "Gather",
        [g.const("word_embeddings", weights["embeddings.word_embeddings.weight"]), "input_ids"],
        "word_states",
        axis=0,
    )
    positions = _positions(g, weights["embeddings.position_embeddings.weight"], cfg)
    type_table = weights.get("embeddings.token_type_embeddings.weight")
    if type_table is None:
        x = g.op("Add", [words, positions], "embedded")
    else:
        if cfg.token_types:
            types = g.op(
                "Gather",
                [g.const("token_type_embeddings", type_table), "token_type_ids"],
                "type_states",
                axis=0,
            )
        else:
            types = g.const("token_type_embedding", type_table[0])
        x = g.op("Add", [g.op("Add", [words, positions], "word_pos"), types], "embedded")
    return _layer_norm(g, "embeddings.ln", x, weights, "embeddings.LayerNorm", cfg.ln_epsilon)


def renamed(weights: dict[str, np.ndarray], renames: tuple[tuple[str, str], ...]) -> dict[str, np.ndarray]:
    """``weights`` with each (old, new) substring replaced in their names, in order: a family's
    names mapped onto the BERT names the shared blocks read."""
    out = {}
    for key, value in weights.items():
        for old, new in renames:
            key = key.replace(old, new)
        out[key] = value
    return out


def standard_constants(g: GraphBuilder, cfg: EncoderConfig) -> None:
    """The shared constants every BERT-like block reads by name (GELU's, the head shapes, the
    fused QKV split)."""
    head_dim = cfg.hidden // cfg.heads
    g.const("one_f", np.array(1.0, np.float32))
    g.const("half_f", np.array(0.5, np.float32))
    g.const("sqrt2", np.array(math.sqrt(2), np.float32))
    g.const("heads_shape", np.array([0, 0, cfg.heads, head_dim], np.int64))
    g.const("merge_shape", np.array([0, 0, cfg.hidden], np.int64))
    g.const("qkv_split", np.array([cfg.hidden] * 3, np.int64))


def _pool(g: _Graph, x: str, mask: str, pooling: str, masked: str = "masked_states") -> str:
    """sentence-transformers' Pooling over [batch, seq, hidden] -> [batch, hidden]. Mean pooling
    names its masked states ``masked`` (each token's state, zero on padding)."""
    if pooling == "cls":
        return g.op("Gather", [x, g.scalar("first_token", np.array(0, np.int64))], "pooled", axis=1)
    seq_axes = g.const("seq_axes", np.array([1], np.int64))
    if pooling == "lasttoken":
        # The last position whose mask is 1, whichever side the padding is on: the largest
        # (index + 1) * mask, as a one-hot row that selects it.
        zeros = g.op("Mul", [mask, g.const("zero_f", np.array(0.0, np.float32))], "zeros_f")
        ones = g.op("Add", [zeros, "one_f"], "ones_f")
        index = g.op("CumSum", [ones, g.scalar("pool_axis", np.array(1, np.int64))], "index_plus1")
        rank = g.op("Mul", [index, mask], "real_rank")
        last = g.op("ReduceMax", [rank], "last_rank", axes=[1], keepdims=1)
        pick = g.op("Cast", [g.op("Equal", [rank, last], "is_last")], "pick_f", to=TensorProto.FLOAT)
        pick = g.op("Unsqueeze", [pick, g.const("mask_axes", np.array([2], np.int64))], "pick_3d")
        return g.op("ReduceSum", [g.op("Mul", [x, pick], "picked_states"), seq_axes], "pooled", keepdims=0)
    # Mean over real tokens.
    mask_3d = g.op("Unsqueeze", [mask, g.const("mask_axes", np.array([2], np.int64))], "mask_3d")
    total = g.op("ReduceSum", [g.op("Mul", [x, mask_3d], masked), seq_axes], "pooled_sum", keepdims=0)
    count = g.op("ReduceSum", [mask, seq_axes], "token_count", keepdims=1)
    count = g.op(
        "Max", [count, g.const("pool_eps", np.array(POOL_EPSILON, np.float32))], "token_count_clamped"
    )
    return g.op("Div", [total, count], "pooled")


def add_dense(g: GraphBuilder, x: str, layers: tuple[Dense, ...], prefix: str = "dense") -> str:
    """sentence-transformers' Dense modules in order over [batch, in] -> [batch, out]."""
    for i, layer in enumerate(layers):
        name = f"{prefix}{i}"
        w = g.const(f"{name}.weight", np.ascontiguousarray(layer.weight.T.astype(np.float32)))
        x = g.op("MatMul", [x, w], f"{name}.matmul")
        if layer.bias is not None:
            x = g.op("Add", [x, g.const(f"{name}.bias", layer.bias.astype(np.float32))], f"{name}.linear")
        op = ACTIVATIONS[layer.activation]
        if op == "gelu":  # torch's GELU() default: the exact (erf) form
            x = gelu(g, f"{name}.gelu", x, one=g.const(f"{name}.one", np.array(1.0, np.float32)))
        elif op is not None:
            x = g.op(op, [x], f"{name}.{op.lower()}")
    return x


def _classify(g: _Graph, x: str, weights: dict[str, np.ndarray], kind: str, out: str = "score") -> str:
    """The sequence-classification head on the first token's state -> ``out``, [batch, num_labels]."""
    first = g.op("Gather", [x, g.scalar("first_token", np.array(0, np.int64))], "first_state", axis=1)
    if kind == "bert":  # BertPooler (dense + tanh), then the classifier
        pooled = g.op(
            "Tanh",
            [_linear(g, "pooler", first, weights["pooler.dense.weight"], weights["pooler.dense.bias"])],
            "pooler_out",
        )
        return _linear(g, out, pooled, weights["classifier.weight"], weights["classifier.bias"])
    # RobertaClassificationHead: dense + tanh + out_proj (dropout is off in inference)
    dense = _linear(g, "head", first, weights["classifier.dense.weight"], weights["classifier.dense.bias"])
    hidden = g.op("Tanh", [dense], "head_out")
    return _linear(g, out, hidden, weights["classifier.out_proj.weight"], weights["classifier.out_proj.bias"])


def build_model(
    weights: dict[str, np.ndarray],
    cfg: EncoderConfig,
    head: Head,
    *,
    name: str,
    producer: str,
    head_weights: dict[str, np.ndarray] | None = None,
    classify=None,
) -> onnx.ModelProto:
    """input_ids, attention_mask[, token_type_ids] (INT64 [batch, seq]) -> the head's outputs
    (``Head.outputs``). ``weights`` are the encoder's, named as in a bare ``BertModel`` (no
    ``bert.``/``roberta.`` prefix); ``head_weights`` hold the classifier's (and BERT's pooler,
    prefix stripped). ``classify``: the head builder of a classifier other than BERT's and
    RoBERTa's (heads.py's, given by the family module: heads.py builds on this module)."""
    g = _Graph()
    standard_constants(g, cfg)
    x = _embeddings(g, weights, cfg)
    mask, key_bias = key_padding_bias(g)
    for i in range(cfg.layers):
        x = _layer(g, i, x, key_bias, weights, cfg)

    names = ["input_ids", "attention_mask"] + (["token_type_ids"] if cfg.token_types else [])
    if head.classifier:
        out = "logits" if head.kind == "classification" else "score"
        if head.classifier in ("bert", "roberta"):
            _classify(g, x, head_weights or weights, head.classifier, out)
        else:  # DistilBERT's
            classify(g, x, mask, head, head_weights or {})
        return finish_head(g, None, mask, head, cfg.hidden, names, name=name, producer=producer)
    return finish_head(g, x, mask, head, cfg.hidden, names, name=name, producer=producer)


def key_padding_bias(g: GraphBuilder) -> tuple[str, str]:
    """(``mask_f``: the attention mask as float [batch, seq], ``key_bias``: [batch, 1, 1, seq],
    0 for real tokens and MASK_PENALTY for padding). Needs the graph's ``one_f``."""
    mask = g.op("Cast", ["attention_mask"], "mask_f", to=TensorProto.FLOAT)
    penalty = g.op(
        "Mul",
        [
            g.op("Sub", ["one_f", mask], "padding_f"),
            g.const("mask_penalty", np.array(MASK_PENALTY, np.float32)),
        ],
        "key_penalty",
    )
    key_bias = g.op("Unsqueeze", [penalty, g.const("key_bias_axes", np.array([1, 2], np.int64))], "key_bias")
    return mask, key_bias


def finish_head(
    g: GraphBuilder,
    x: str | None,
    mask: str,
    head: Head,
    width: int,
    input_names: list[str],
    *,
    name: str,
    producer: str,
) -> onnx.ModelProto:
    """The head's outputs from the final states ``x`` (hidden size ``width``): the pooled (and
    normalised) ``embedding``, a sparse encoder's ``sparse_embedding``, or, for a classifier whose
    logits node is already built (``x`` None), its probabilities; then the finished model with
    INT64 [batch, seq] inputs ``input_names``. Shared by every family's graph."""
    if head.kind == "classification":
        # transformers' problem_type: softmax over the labels, or each label's own sigmoid.
        if head.multi_label:
            g.op("Sigmoid", ["logits"], "probabilities")
        else:
            g.op("Softmax", ["logits"], "probabilities", axis=-1)
    elif head.mlm is not None:
        _splade(g, x, mask, head.mlm, width)
    elif head.colbert is not None:
        head.colbert.add(g, x, mask)  # colbert.py's head (it builds on this module)
    elif not head.classifier:
        # Mean pooling already masks every token's state: that tensor is the token output, so
        # serving it computes nothing more in the graph.
        shared = head.token_states and head.pooling == "mean"
        masked = "token_embeddings" if shared else "masked_states"
        pooled = add_dense(g, _pool(g, x, mask, head.pooling, masked), head.dense)
        if head.normalize:
            # ReduceL2 still takes axes as an attribute at opset 17 (ReduceSum moved them to an input).
            norm = g.op("ReduceL2", [pooled], "norm", axes=[1], keepdims=1)
            norm = g.op(
                "Max", [norm, g.const("norm_eps", np.array(NORM_EPSILON, np.float32))], "norm_clamped"
            )
            g.op("Div", [pooled, norm], "embedding")
        else:
            g.op("Identity", [pooled], "embedding")
        if head.m3 is not None:
            head.m3.add(g, x, mask)  # bge_m3.py's heads (it builds on this module)
        if head.token_states and not shared:
            # Padding positions are zeros, so a row padded to a longer batch says where it ends.
            token_mask = g.op("Unsqueeze", [mask, g.const("token_mask_axes", np.array([2], np.int64))],
                              "token_mask_3d")  # fmt: skip
            g.op("Mul", [x, token_mask], "token_embeddings")

    ids = ["batch", "seq"]
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT64, ids) for n in input_names]
    outputs = [
        helper.make_tensor_value_info(out, TensorProto.FLOAT, ["batch", *dims])
        for out, dims in head.outputs(width)
    ]
    return finish_model(g, name, inputs, outputs, producer=producer)


def _splade(g: GraphBuilder, x: str, mask: str, mlm: MaskedLM, width: int) -> str:
    """[batch, seq, hidden] -> ``sparse_embedding`` [batch, vocab]: the masked-LM logits of every
    token, then log(1 + relu) with padding zeroed, pooled over the tokens."""
    t = g.op(
        "MatMul",
        [x, g.const("mlm.dense.weight", np.ascontiguousarray(mlm.dense_weight.T))],
        "mlm.dense.matmul",
    )
    t = g.op("Add", [t, g.const("mlm.dense.bias", mlm.dense_bias)], "mlm.dense")
    t = gelu(g, "mlm.gelu", t, one=g.const("mlm.one", np.array(1.0, np.float32)))
    t = g.op(
        "LayerNormalization",
        [t, g.const("mlm.norm.scale", mlm.norm_weight), g.const("mlm.norm.bias", mlm.norm_bias)],
        "mlm.norm", axis=-1, epsilon=mlm.norm_epsilon,
    )  # fmt: skip
    decoder = g.const("mlm.decoder.weight", np.ascontiguousarray(mlm.decoder_weight.T))
    logits = g.op("Add", [g.op("MatMul", [t, decoder], "mlm.decoder.matmul"),
                          g.const("mlm.decoder.bias", mlm.decoder_bias)], "mlm.logits")  # fmt: skip
    # relu(x) * mask is relu(x * mask) for a 0/1 mask: padding scores 0, the least any token
    # scores, so neither max nor sum pooling sees it.
    mask_3d = g.op("Unsqueeze", [mask, g.const("mlm.mask_axes", np.array([2], np.int64))], "mlm.mask_3d")
    scores = g.op("Mul", [g.op("Relu", [logits], "mlm.relu"), mask_3d], "mlm.masked")
    one = g.const("mlm.log_one", np.array(1.0, np.float32))
    scores = g.op("Log", [g.op("Add", [scores, one], "mlm.one_plus")], "mlm.log1p")
    if mlm.activation == "log1p_relu":
        scores = g.op("Log", [g.op("Add", [scores, one], "mlm.one_plus2")], "mlm.log1p2")
    op = "ReduceMax" if mlm.pooling == "max" else "ReduceSum"
    if op == "ReduceMax":  # still an attribute at opset 17
        return g.op(op, [scores], "sparse_embedding", axes=[1], keepdims=0)
    return g.op(
        op, [scores, g.const("mlm.seq_axes", np.array([1], np.int64))], "sparse_embedding", keepdims=0
    )
