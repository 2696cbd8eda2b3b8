"""Bring your own model: a sentence-transformers or Hugging Face folder as a served model.

``batchgate prepare-model SOURCE --name NAME [--model-repository DIR]`` writes::

    <repo>/NAME/config.pbtxt      text (BYTES) in; the head's outputs (by kind, below) out
    <repo>/NAME/tokenizer.json    the folder's tokenizer, unchanged
    <repo>/NAME/1/model.onnx      the encoder and its head (gateway/models/encoder.py)

What it reads from SOURCE_DIR: ``config.json``, ``model.safetensors`` and ``tokenizer.json`` (in
the Transformer module's folder when ``modules.json`` names one), and when present
sentence-transformers' ``modules.json``, the Pooling module's ``config.json``,
``sentence_bert_config.json`` and ``config_sentence_transformers.json``. The weights are read
with safetensors' numpy API and the graph is spelled out with ``onnx.helper``: no PyTorch here
or at serving time. SOURCE may also be a Hugging Face model ID, read through the hub cache
(``sources.py``); a folder whose architecture the builder does not know is served from its ONNX
export (``onnx/model.onnx`` or ``model.onnx``) with the head appended (``onnx_export.py``).
``prepare.py`` resolves SOURCE and picks between the two; this module is the weights builder.

What it decides, and where from (docs/embeddings.md, "Bringing your own model"):

* architecture: BERT, RoBERTa or XLM-RoBERTa (``model_type``; encoder.py), MPNet, DistilBERT,
  ModernBERT, DeBERTa-v2 or Qwen3 (one module each: mpnet.py, distilbert.py, modernbert.py,
  deberta_v2.py, qwen3.py; their classifier heads in heads.py). A Qwen3 folder named a reranker
  (or ``--reranker``) is Qwen3-Reranker: its yes/no logits under its card's ``pair_template``.
  Mistral, Llama, Qwen2 and Gemma3's text model (EmbeddingGemma) through one decoder builder
  (decoder.py). Anything else is refused by name (``PrepareError``, exit 2). An XLM-R folder with
  BGE-M3's ``colbert_linear.pt`` and ``sparse_linear.pt`` gets its sparse and ColBERT heads
  (bge_m3.py); a PyLate folder (Transformer then Dense, no Pooling) is a ColBERT model
  (colbert.py, kind ``multi_vector``). Sharded weights are read through
  ``model.safetensors.index.json``.
* kind (parameter ``kind``; each kind's outputs fixed by name, so a route reads them): an
  ``embedding`` (FP32 [dim]; ``token_embeddings`` FP32 [-1, hidden] beside it when asked); a
  BERT/RoBERTa ``*ForSequenceClassification`` with one label, a ``rerank`` model whose rows are
  pairs (parameter ``text_pair``) and whose ``score`` is the raw logit; with more labels, a
  ``classification`` model: ``probabilities`` (softmax, or each label's sigmoid for
  ``problem_type`` multi_label_classification) and ``logits``, FP32 [labels], its ``id2label``
  recorded as parameters ``label.<index>``; a masked-LM folder that modules.json declares a
  sentence-transformers sparse encoder (``MLMTransformer`` then ``SpladePooling``), a
  ``sparse_embedding`` model: FP32 [vocab], log(1 + relu) of the MLM logits pooled over tokens.
* max length: sentence-transformers' ``max_seq_length``, else the tokenizer's
  ``model_max_length``, never more than the position table allows (RoBERTa's loses
  ``padding_idx + 1`` rows to its offset).
* pooling, Dense and normalisation: as ``modules.json`` declares them (``Dense`` modules in
  its order, the last one's ``out_features`` the served dimension; a ``Normalize`` module means
  unit vectors, none means raw vectors); a plain Hugging Face folder, which declares
  neither, gets mean pooling (Qwen3: the last token, as Qwen3-Embedding's card pools) and L2
  normalisation, what sentence-transformers' own fallback pools and what cosine-similarity
  callers expect. ``--pooling`` and ``--normalize`` override.
* prompts: ``config_sentence_transformers.json``'s ``prompts`` and ``default_prompt_name``,
  recorded as parameters ``prompt.<name>`` and ``default_prompt_name``; a Qwen3 folder without
  prompts gets its card's query instruction as ``prompt.query``.
"""

from __future__ import annotations

import importlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from google.protobuf import text_encoding

from batchgate.gateway.models import bge_m3, colbert, deberta_v2, decoder, xlm_roberta
from batchgate.gateway.models.encoder import (
    ACTIVATIONS,
    POOLINGS,
    Dense,
    EncoderConfig,
    Head,
    MaskedLM,
    build_model,
)
from batchgate.gateway.models.heads import LABELS_TENSORS
from batchgate.gateway.models.minilm import render_text_config, text_parameters
from batchgate.gateway.models.qwen3 import RERANK_TOKENS
from batchgate.gateway.models.onnx_graph import write_atomic, write_model

Log = Callable[[str], object]

PRODUCER = "batchgate.prepare_model"
VERSION = "1"
# model_type -> family: bert and roberta are encoder.py's (the family fixes the embeddings'
# offset positions and the classifier head); every other family has its own module in
# gateway/models/ (STEM, ARCHS, PREFIXES, WORD, check, position_limit, encoder_config, build_model).
FAMILIES = {
    "bert": "bert",
    "roberta": "roberta",
    "xlm-roberta": "roberta",
    "mpnet": "mpnet",
    "distilbert": "distilbert",
    "modernbert": "modernbert",
    "qwen3": "qwen3",
    "deberta-v2": "deberta_v2",
    # decoder.py: one builder, a switch set per family
    "mistral": "mistral",
    "llama": "llama",
    "qwen2": "qwen2",
    "gemma3_text": "gemma3_text",
}
# The model types whose reference (transformers 5) builds its own tokenizer from the folder's
# vocabulary instead of reading tokenizer.json as it stands: served as that reference builds it.
SERVED_TOKENIZERS = {
    "deberta-v2": deberta_v2.served_tokenizer,
    "xlm-roberta": xlm_roberta.served_tokenizer,  # RoBERTa's graph, its own tokenizer
}
# The class-name stems Hugging Face gives each model_type, for the architectures check.
_STEMS = {"bert": "Bert", "roberta": "Roberta", "xlm-roberta": "XLMRoberta"}
# Heads whose checkpoints hold the bare encoder under a prefix; their head is not served.
_ENCODER_ARCHS = ("Model", "ForMaskedLM", "ForPreTraining")
SUPPORTED = (
    "BERT, RoBERTa and XLM-RoBERTa encoders (model_type bert, roberta, xlm-roberta; "
    "architectures *Model, *ForMaskedLM, *ForPreTraining) and their *ForSequenceClassification "
    "(one label: cross-encoders; more: classifiers); MPNet, DistilBERT and ModernBERT encoders "
    "(model_type mpnet, distilbert, modernbert; *Model, *ForMaskedLM, *ForSequenceClassification); "
    "DeBERTa-v2/v3 (model_type deberta-v2; DebertaV2Model, *ForMaskedLM, *ForSequenceClassification); "
    "Qwen3 (model_type qwen3; Qwen3Model and Qwen3ForCausalLM embedders, Qwen3ForSequenceClassification, "
    "and Qwen3-Reranker's Qwen3ForCausalLM yes/no scorer); Mistral, Llama and Qwen2 embedders "
    "(model_type mistral, llama, qwen2; *Model, *ForCausalLM); EmbeddingGemma (model_type gemma3_text; "
    "Gemma3TextModel)"
)
# transformers' problem_type values a classifier is served with (probabilities by softmax, or by
# each label's sigmoid); "regression" has no probabilities.
PROBLEM_TYPES = ("single_label_classification", "multi_label_classification")
# The masked-LM head of each family a sparse encoder is built on: (dense, LayerNorm, decoder
# weight, decoder bias names). A tied decoder (transformers' default) is the word embeddings,
# and save_pretrained leaves it out of the file.
_MLM_HEADS = {
    "bert": ("cls.predictions.transform.dense", "cls.predictions.transform.LayerNorm",
             "cls.predictions.decoder.weight", ("cls.predictions.bias", "cls.predictions.decoder.bias")),
    "roberta": ("lm_head.dense", "lm_head.layer_norm", "lm_head.decoder.weight",
                ("lm_head.bias", "lm_head.decoder.bias")),
    "mpnet": ("lm_head.dense", "lm_head.layer_norm", "lm_head.decoder.weight",
              ("lm_head.bias", "lm_head.decoder.bias")),
    "distilbert": ("vocab_transform", "vocab_layer_norm", "vocab_projector.weight", ("vocab_projector.bias",)),
}  # fmt: skip
SPLADE_ACTIVATIONS = ("relu", "log1p_relu")
SPLADE_POOLINGS = ("max", "sum")


def _family_module(family: str):
    """The graph module of a family outside encoder.py, or None for bert and roberta."""
    if family in ("bert", "roberta"):
        return None
    if family in decoder.FAMILIES:
        return decoder.FAMILIES[family]
    return importlib.import_module(f"batchgate.gateway.models.{family}")


_POOLING_MODES = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "lasttoken",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
    "pooling_mode_weightedmean_tokens": "weightedmean",
}
SHARD_INDEX = "model.safetensors.index.json"
# A tokenizer_config.json without a limit says 1e30 (transformers' VERY_LARGE_INTEGER).
_NO_LIMIT = 1_000_000


class PrepareError(ValueError):
    """The folder cannot be prepared; the message is the one line the command prints."""


@dataclass(frozen=True)
class Plan:
    """What the folder declares, read and checked before anything is built or written."""

    source: Path
    model_dir: Path  # the Transformer module's folder: config.json, weights, tokenizer
    tokenizer: Path
    architecture: str
    model_type: str
    cfg: EncoderConfig | object  # EncoderConfig for bert, roberta, mpnet, distilbert; else the family's own
    head: Head
    max_tokens: int
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    label_names: tuple[str, ...] = ()  # a classifier's id2label, in index order
    text_pair: bool = False  # rows are pairs (a cross-encoder's, or a pair classifier's)
    # A sparse encoder's SpladePooling (activation, pooling); the MLM head itself is read with
    # the weights (``_mlm_head``).
    splade: tuple[str, str] | None = None
    # Rows are put in this text ({query}, {document}) where the pair is tokenised (Qwen3-Reranker).
    pair_template: str | None = None
    yes_no: tuple[int, int] | None = None  # Qwen3-Reranker's causal-LM form: the "yes", "no" token ids

    @property
    def rerank(self) -> bool:
        return self.head.kind == "rerank"

    @property
    def dim(self) -> int:
        return self.head.dim(self.cfg.hidden)

    @property
    def summary(self) -> str:
        return f"{self.architecture} ({self.model_type}), {self.cfg.layers} layers, hidden {self.cfg.hidden}"


# --------------------------------------------------------------------------------------------
# reading the folder


def _json(path: Path, required: bool = True) -> dict | list | None:
    if not path.is_file():
        if required:
            raise PrepareError(f"{path} is missing")
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise PrepareError(f"{path} is not readable JSON: {exc}") from None


@dataclass(frozen=True)
class Modules:
    """sentence-transformers' pipeline, as modules.json lists it."""

    transformer: Path
    pooling: Path | None  # None for a sparse encoder
    dense: tuple[Path, ...]
    normalize: bool
    splade: Path | None = None  # a sparse encoder's SpladePooling folder
    colbert: bool = False  # a PyLate ColBERT folder: Transformer, then Dense per token


_PIPELINE = (
    "supported: Transformer, then Pooling, then any Dense, then optionally Normalize; or a sparse "
    "encoder's MLMTransformer then SpladePooling"
)


def _modules(source: Path) -> Modules | None:
    """sentence-transformers' pipeline, or None for a plain Hugging Face folder."""
    modules = _json(source / "modules.json", required=False)
    if modules is None:
        return None
    kinds = [(str(m.get("type", "")).rsplit(".", 1)[-1], str(m.get("path", ""))) for m in modules]
    if [k for k, _ in kinds] in (["MLMTransformer", "SpladePooling"], ["Transformer", "SpladePooling"]):
        return Modules(transformer=source / kinds[0][1], pooling=None, dense=(), normalize=False,
                       splade=source / kinds[1][1])  # fmt: skip
    for kind, path in kinds:
        if kind not in ("Transformer", "Pooling", "Dense", "Normalize"):
            raise PrepareError(
                f"{source / 'modules.json'}: module {kind} ({path or 'no path'}) is not supported; {_PIPELINE}"
            )
    order = [k for k, _ in kinds]
    n_dense = order.count("Dense")
    if n_dense and order == ["Transformer"] + ["Dense"] * n_dense:  # PyLate's ColBERT: per-token Dense
        st = _json(source / "config_sentence_transformers.json", required=False) or {}
        if colbert.is_pylate(st):
            return Modules(transformer=source / kinds[0][1], pooling=None, normalize=False, colbert=True,
                           dense=tuple(source / path for _, path in kinds[1:]))  # fmt: skip
    if order not in (
        ["Transformer", "Pooling"] + ["Dense"] * n_dense,
        ["Transformer", "Pooling"] + ["Dense"] * n_dense + ["Normalize"],
    ):
        raise PrepareError(f"{source / 'modules.json'}: modules {', '.join(order)}; {_PIPELINE}")
    return Modules(
        transformer=source / kinds[0][1],
        pooling=source / kinds[1][1],
        dense=tuple(source / path for kind, path in kinds if kind == "Dense"),
        normalize=order[-1] == "Normalize",
    )


def _dense(folder: Path, in_features: int) -> Dense:
    """A Dense module's folder: config.json (features, bias, activation) and its weights."""
    cfg = _json(folder / "config.json")
    act = str(cfg.get("activation_function", "torch.nn.modules.linear.Identity")).rsplit(".", 1)[-1]
    if act not in ACTIVATIONS:
        raise PrepareError(
            f"{folder / 'config.json'}: activation_function {cfg.get('activation_function')} is not "
            f"supported; supported: {', '.join(ACTIVATIONS)}"
        )
    if cfg.get("in_features") != in_features:
        raise PrepareError(
            f"{folder / 'config.json'}: in_features {cfg.get('in_features')}; the vector before it "
            f"has {in_features}"
        )
    weights_file = folder / "model.safetensors"
    if weights_file.is_file():
        weights = _read_safetensors(weights_file)
    elif (folder / "pytorch_model.bin").is_file():
        # Older sentence-transformers saved Dense with torch.save (LaBSE, distiluse-*): read as
        # BGE-M3's heads are, by torch_file.py's allow-list reader, without PyTorch or unpickling.
        from batchgate.gateway.models.torch_file import TorchFileError, read_state_dict

        weights_file = folder / "pytorch_model.bin"
        try:
            weights = read_state_dict(weights_file)
        except TorchFileError as exc:
            raise PrepareError(f"{exc}; save the Dense module with safetensors") from None
    else:
        raise PrepareError(f"{weights_file} is missing (and no pytorch_model.bin beside it)")
    weight, bias = weights.get("linear.weight"), weights.get("linear.bias")
    out = cfg.get("out_features")
    if weight is None or weight.shape != (out, in_features):
        got = "no tensor linear.weight" if weight is None else f"linear.weight {list(weight.shape)}"
        raise PrepareError(f"{weights_file}: {got}; config.json says [{out}, {in_features}]")
    if cfg.get("bias", True) and (bias is None or bias.shape != (out,)):
        raise PrepareError(f"{weights_file}: config.json says bias, and linear.bias is not [{out}]")
    return Dense(weight=weight, bias=bias if cfg.get("bias", True) else None, activation=act)


def _pooling(pool_dir: Path, hidden: int, has_prompts: bool) -> str:
    cfg = _json(pool_dir / "config.json")
    modes = [mode for key, mode in _POOLING_MODES.items() if cfg.get(key)]
    if "pooling_mode" in cfg:  # sentence-transformers 6 saves one key: a mode or a list of them
        given = cfg["pooling_mode"]
        modes = [str(m) for m in ([given] if isinstance(given, str) else given or [])]
    if len(modes) != 1 or modes[0] not in POOLINGS:
        raise PrepareError(
            f"{pool_dir / 'config.json'}: pooling {' + '.join(modes) or 'none'} is not supported; "
            f"supported: one of {', '.join(POOLINGS)}"
        )
    dim = cfg.get("word_embedding_dimension", cfg.get("embedding_dimension", hidden))
    if dim != hidden:
        raise PrepareError(
            f"{pool_dir / 'config.json'}: word_embedding_dimension {dim}, the model's hidden size {hidden}"
        )
    if cfg.get("include_prompt") is False and modes[0] == "mean" and has_prompts:
        # sentence-transformers would leave the prompt's tokens out of the mean; the graph
        # cannot know where a prompt ends.
        raise PrepareError(
            f"{pool_dir / 'config.json'}: include_prompt false (prompt tokens left out of the mean) "
            "is not supported"
        )
    return modes[0]


def _architecture(config: dict, where: Path) -> tuple[str, str, bool]:
    """(architecture, model_type, whether it is a cross-encoder), or PrepareError naming it."""
    model_type = str(config.get("model_type", ""))
    archs = config.get("architectures") or []
    arch = str(archs[0]) if archs else ""
    shown = f"{arch} (model_type '{model_type}')" if arch else f"model_type '{model_type}'"
    family = FAMILIES.get(model_type)
    if family is None:
        raise PrepareError(f"{where}: unsupported architecture {shown}; supported: {SUPPORTED}")
    module = _family_module(family)
    if module is not None:
        tail = arch[len(module.STEM) :] if arch.startswith(module.STEM) else None
        if arch and tail not in module.ARCHS:
            raise PrepareError(f"{where}: unsupported architecture {shown}; supported: {SUPPORTED}")
        problem = module.check(config)
        if problem:
            raise PrepareError(f"{where}: {problem}")
        return arch or f"{module.STEM}Model", model_type, tail == "ForSequenceClassification"
    stem = _STEMS[model_type]
    tail = arch[len(stem) :] if arch.startswith(stem) else None
    if arch and tail not in (*_ENCODER_ARCHS, "ForSequenceClassification"):
        raise PrepareError(f"{where}: unsupported architecture {shown}; supported: {SUPPORTED}")
    if config.get("is_decoder") or config.get("add_cross_attention"):
        raise PrepareError(f"{where}: {shown} is configured as a decoder; supported: {SUPPORTED}")
    act = config.get("hidden_act", "gelu")
    if act != "gelu":
        raise PrepareError(f"{where}: hidden_act '{act}' is not supported; supported: 'gelu' (erf GELU)")
    pos = config.get("position_embedding_type", "absolute")
    if pos != "absolute":
        raise PrepareError(
            f"{where}: position_embedding_type '{pos}' is not supported; supported: 'absolute'"
        )
    return arch or f"{stem}Model", model_type, tail == "ForSequenceClassification"


def _splade(folder: Path) -> tuple[str, str]:
    """SpladePooling's config.json: (activation_function, pooling_strategy)."""
    cfg = _json(folder / "config.json", required=False) or {}
    act, pool = cfg.get("activation_function", "relu"), cfg.get("pooling_strategy", "max")
    if act not in SPLADE_ACTIVATIONS or pool not in SPLADE_POOLINGS:
        raise PrepareError(
            f"{folder / 'config.json'}: SpladePooling activation_function '{act}', pooling_strategy "
            f"'{pool}'; supported: activation {' or '.join(SPLADE_ACTIVATIONS)}, pooling "
            f"{' or '.join(SPLADE_POOLINGS)}"
        )
    return act, pool


def _labels(config: dict, where: Path) -> tuple[tuple[str, ...], bool]:
    """A classifier's (label names in index order, multi-label), from config.json's id2label and
    problem_type."""
    id2label = config.get("id2label") or {}
    n = len(id2label) or int(config.get("num_labels") or 2)
    try:
        names = {int(k): str(v) for k, v in id2label.items()}
    except (TypeError, ValueError):
        names = {}
    if n > 1 and id2label and sorted(names) != list(range(n)):
        raise PrepareError(f"{where}: id2label keys {sorted(id2label)}; expected 0..{n - 1}")
    problem = config.get("problem_type") or "single_label_classification"
    if n > 1 and problem not in PROBLEM_TYPES:
        raise PrepareError(
            f"{where}: problem_type '{problem}' with {n} labels is not supported; supported: "
            f"{', '.join(PROBLEM_TYPES)} (one label: a rerank model)"
        )
    return tuple(names.get(i, f"LABEL_{i}") for i in range(n)), problem == "multi_label_classification"


def _embedding_head(source: Path, modules: Modules | None, hidden: int, prompts: dict[str, str],
                    pooling: str | None, normalize: bool | None, default_pooling: str = "mean") -> Head:  # fmt: skip
    """Pooling, Dense modules (chained: each takes the previous one's vector) and Normalize as
    ``modules.json`` declares them; a plain folder gets mean pooling and unit vectors."""
    if modules and modules.splade is not None:
        raise PrepareError(
            f"{source / 'modules.json'}: a sparse encoder (SpladePooling) is built from its safetensors "
            "weights (the masked-LM head included), not from an ONNX export"
        )
    if modules:
        found_pooling = _pooling(modules.pooling, hidden, any(prompts.values()))
        found_normalize = modules.normalize
        dense: list[Dense] = []
        for folder in modules.dense:
            dense.append(_dense(folder, dense[-1].out_features if dense else hidden))
    else:
        found_pooling, found_normalize, dense = default_pooling, True, []
    return Head(
        pooling=pooling or found_pooling,
        normalize=found_normalize if normalize is None else normalize,
        dense=tuple(dense),
    )


def _max_tokens(config: dict, model_dir: Path, position_limit: int) -> int:
    """sentence-transformers' rule: its max_seq_length, else min(positions, the tokenizer's
    model_max_length); here also never past the position table."""
    st = _json(model_dir / "sentence_bert_config.json", required=False) or {}
    limit = st.get("max_seq_length")
    if limit is None:
        tok_cfg = _json(model_dir / "tokenizer_config.json", required=False) or {}
        limit = tok_cfg.get("model_max_length")
        if not isinstance(limit, int | float) or limit >= _NO_LIMIT:
            limit = None
    return min(int(limit), position_limit) if limit else position_limit


def _lowercases(tokenizer: dict) -> bool:
    text = json.dumps(tokenizer.get("normalizer"))
    return '"lowercase": true' in text or '"Lowercase"' in text


def text_settings(
    source: Path, model_dir: Path, default_prompts: dict[str, str] | None = None
) -> tuple[dict[str, str], str | None]:
    """(prompts, default prompt name) from config_sentence_transformers.json (``default_prompts``
    where it names none), after checking that tokenizer.json lowercases when
    sentence_bert_config.json says the model expects it."""
    st = _json(source / "config_sentence_transformers.json", required=False) or {}
    prompts = st.get("prompts") or dict(default_prompts or {})
    if not isinstance(prompts, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in prompts.items()
    ):
        raise PrepareError(f"{source / 'config_sentence_transformers.json'}: prompts must map names to texts")
    default_prompt = st.get("default_prompt_name")
    if default_prompt is not None and default_prompt not in prompts:
        raise PrepareError(
            f"{source / 'config_sentence_transformers.json'}: default_prompt_name '{default_prompt}' "
            f"names no prompt; the folder's: {sorted(prompts)}"
        )
    st_model = _json(model_dir / "sentence_bert_config.json", required=False) or {}
    tokenizer = _json(model_dir / "tokenizer.json")
    if st_model.get("do_lower_case") and not _lowercases(tokenizer):
        raise PrepareError(
            f"{model_dir / 'sentence_bert_config.json'}: do_lower_case is set but tokenizer.json does not "
            "lowercase; add a Lowercase normalizer to tokenizer.json"
        )
    return dict(prompts), default_prompt


def read_folder(source: Path, *, pooling: str | None = None, normalize: bool | None = None,
                text_pair: bool | None = None, token_embeddings: bool = False,
                reranker: bool | None = None) -> Plan:  # fmt: skip
    """Read and check ``source``; PrepareError (one line) on anything the build would not serve
    as the folder's own library would. ``text_pair``: a classifier's rows are pairs (default: a
    rerank model's always are; a classifier's when config.json says sentence-transformers saved
    it as a CrossEncoder, which scores pairs). ``token_embeddings``: an embedding model also
    outputs every token's state. ``reranker``: a Qwen3 folder is Qwen3-Reranker (its card's
    template; a Qwen3ForCausalLM scored by its yes/no logits); None: when its name says
    "reranker" (``named_reranker``)."""
    source = Path(source)
    if not source.is_dir():
        raise PrepareError(
            f"{source} is not a directory (expected a sentence-transformers or Hugging Face model folder)"
        )
    modules = _modules(source)
    model_dir = modules.transformer if modules else source
    # The architecture first: a folder of another kind is refused by name, not for a file it lacks.
    config = _json(model_dir / "config.json")
    arch, model_type, classifier = _architecture(config, model_dir / "config.json")
    family = FAMILIES[model_type]
    if reranker and family != "qwen3":
        raise PrepareError(f"{source}: --reranker is for Qwen3-Reranker folders (model_type qwen3); {arch} is "
                           f"{'a cross-encoder already' if classifier else 'not one'}")  # fmt: skip
    qwen3_reranker = family == "qwen3" and (named_reranker(source) if reranker is None else reranker)
    yes_no = None
    if qwen3_reranker and not classifier:
        if not arch.endswith("ForCausalLM"):
            raise PrepareError(f"{source}: a Qwen3-Reranker is a Qwen3ForCausalLM (scored by its yes/no "
                               f"logits) or a Qwen3ForSequenceClassification; not {arch}")  # fmt: skip
        classifier, yes_no = True, _yes_no(model_dir / "tokenizer.json")
    for name in ("model.safetensors", "tokenizer.json"):
        if name == "model.safetensors" and (model_dir / SHARD_INDEX).is_file():
            continue  # sharded (a large decoder's): the index names the files, read with the weights
        if not (model_dir / name).is_file():
            hint = ""
            if name == "model.safetensors" and any(model_dir.glob("*.bin")):
                hint = " (pytorch_model.bin is not read: it needs PyTorch; save the model with safetensors)"
            elif name == "model.safetensors" and any(model_dir.glob("model-*-of-*.safetensors")):
                hint = f" (sharded weights are read through their {SHARD_INDEX}, which is missing)"
            raise PrepareError(f"{model_dir / name} is missing{hint}")

    module = _family_module(family)
    if module is not None:
        cfg = module.encoder_config(config, _max_tokens(config, model_dir, module.position_limit(config)))
    else:
        padding_idx = int(config.get("pad_token_id", 1)) if family == "roberta" else None
        max_positions = int(config["max_position_embeddings"])
        position_limit = max_positions - (padding_idx + 1 if padding_idx is not None else 0)
        cfg = EncoderConfig(
            hidden=int(config["hidden_size"]),
            layers=int(config["num_hidden_layers"]),
            heads=int(config["num_attention_heads"]),
            intermediate=int(config["intermediate_size"]),
            max_positions=max_positions,
            type_vocab=int(config.get("type_vocab_size", 2)),
            ln_epsilon=float(config.get("layer_norm_eps", 1e-12)),
            max_seq_length=_max_tokens(config, model_dir, position_limit),
            padding_idx=padding_idx,
        )
    hidden = cfg.hidden

    # A family whose card gives prompts (Qwen3-Embedding's query instruction) has them recorded
    # when the folder names none of its own.
    prompts, default_prompt = text_settings(source, model_dir, dict(getattr(module, "DEFAULT_PROMPTS", {})))

    labels: tuple[str, ...] = ()
    splade = None
    if classifier or (modules and modules.splade is not None):
        what = "a sparse encoder (SpladePooling)" if not classifier else f"{arch}, a sequence classifier"
        if pooling is not None or normalize is not None or token_embeddings:
            raise PrepareError(
                f"{source}: --pooling, --normalize and token embeddings are for embedding models; "
                f"{source.name} is {what}"
            )
    if yes_no is not None:
        labels, multi_label = ("yes",), False  # one score: logit(yes) - logit(no)
        head = Head(classifier="qwen3_yes_no")
    elif classifier:
        labels, multi_label = _labels(config, model_dir / "config.json")
        head = Head(
            classifier=module.CLASSIFIER if module else family, labels=len(labels), multi_label=multi_label
        )
    if classifier:
        if head.kind == "rerank":
            labels, text_pair = (), True  # a cross-encoder: its rows are always pairs
        elif text_pair is None:
            text_pair = isinstance(config.get("sentence_transformers"), dict)
    elif modules and modules.colbert:
        if pooling is not None or normalize is not None or token_embeddings:
            raise PrepareError(
                f"{source}: --pooling, --normalize and token embeddings are for embedding models; {source.name} "
                "is a ColBERT model (PyLate): its per-token vectors are its output"
            )
        dense: list[Dense] = []
        for folder in modules.dense:
            dense.append(_dense(folder, dense[-1].out_features if dense else hidden))
        st_config = _json(source / "config_sentence_transformers.json")
        try:
            cb = colbert.read_head(st_config, tuple(dense), model_dir / "tokenizer.json",
                                   source / "config_sentence_transformers.json")  # fmt: skip
        except ValueError as exc:
            raise PrepareError(str(exc)) from None
        # The markers are the prompts (PyLate puts its marker ahead of a prompt's text).
        prompts = {"query": cb.query_prefix + prompts.get("query", ""),
                   "document": cb.document_prefix + prompts.get("document", "")}  # fmt: skip
        default_prompt = None if default_prompt not in prompts else default_prompt
        head = Head(colbert=cb)
        # PyLate cuts a document at document_length tokens, its marker included (whatever
        # max_seq_length it saved); never past the position table.
        if module is not None:
            limit = module.position_limit(config)
        else:
            limit = cfg.max_positions - (cfg.padding_idx + 1 if cfg.padding_idx is not None else 0)
        if cb.query_length > limit:
            raise PrepareError(
                f"{source / 'config_sentence_transformers.json'}: query_length {cb.query_length}; the model "
                f"has {limit} positions"
            )
        cfg = replace(cfg, max_seq_length=min(limit, cb.document_length))
    elif modules and modules.splade is not None:
        if family not in _MLM_HEADS or not arch.endswith("ForMaskedLM"):
            raise PrepareError(
                f"{model_dir / 'config.json'}: a sparse encoder needs a masked-LM checkpoint "
                f"({', '.join(sorted(_MLM_HEADS))}; *ForMaskedLM), not {arch}"
            )
        splade = _splade(modules.splade)
        head = Head(pooling="max", normalize=False)  # the MLM head is added with the weights
    else:
        head = _embedding_head(
            source, modules, hidden, prompts, pooling, normalize, getattr(module, "DEFAULT_POOLING", "mean")
        )
        head = replace(head, token_states=token_embeddings)
        if bge_m3.present(model_dir) and family == "roberta":
            if token_embeddings:
                raise PrepareError(
                    f"{source}: a BGE-M3 folder's token_embeddings are its ColBERT vectors "
                    f"({bge_m3.COLBERT_FILE}); they are always built, without the token embeddings flag"
                )
            if head.pooling != "cls" or not head.normalize or head.dense:
                raise PrepareError(
                    f"{source}: a BGE-M3 folder ({bge_m3.COLBERT_FILE}, {bge_m3.SPARSE_FILE}) pools its dense "
                    f"vector from CLS, normalised, as FlagEmbedding does; this one says {head.pooling}"
                    f"{', normalised' if head.normalize else ''}{', Dense' if head.dense else ''}"
                )
    if text_pair and not classifier:
        raise PrepareError(f"{source}: text pairs are for cross-encoders and classifiers; {arch} is neither")
    return Plan(
        source=source,
        model_dir=model_dir,
        tokenizer=model_dir / "tokenizer.json",
        architecture=arch,
        model_type=model_type,
        cfg=cfg,
        head=head,
        max_tokens=cfg.max_seq_length,
        prompts=prompts,
        default_prompt_name=default_prompt,
        label_names=labels,
        text_pair=bool(text_pair),
        splade=splade,
        pair_template=module.RERANK_TEMPLATE if qwen3_reranker and head.kind == "rerank" else None,
        yes_no=yes_no,
    )


def named_reranker(source: Path) -> bool:
    """Whether the folder's name (or the Hub ID of a cache snapshot, models--ORG--NAME/snapshots/
    COMMIT) says it is a reranker: Qwen3-Reranker's folders carry no other mark of it."""
    path = Path(source).resolve()
    name = path.parent.parent.name if path.parent.name == "snapshots" else path.name
    return "reranker" in name.lower()


def _yes_no(tokenizer: Path) -> tuple[int, int]:
    """The ids of Qwen3-Reranker's answer tokens, as its card looks them up (convert_tokens_to_ids)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    ids = [tok.token_to_id(t) for t in RERANK_TOKENS]
    if None in ids:
        missing = RERANK_TOKENS[ids.index(None)]
        raise PrepareError(
            f"{tokenizer} has no token '{missing}' (a Qwen3-Reranker scores its 'yes' and 'no' logits)"
        )
    return ids[0], ids[1]


# --------------------------------------------------------------------------------------------
# weights


def _read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every float tensor as float32 (float16 and bfloat16 checkpoints included)."""
    # ml_dtypes (onnx's own dependency) registers bfloat16 with numpy, without which
    # safetensors' numpy API refuses a bfloat16 file.
    import ml_dtypes  # noqa: F401
    from safetensors.numpy import load_file

    # Integer buffers (an old checkpoint's position_ids) are left out: the graph computes its own.
    return {
        k: v.astype(np.float32) for k, v in load_file(path).items() if not np.issubdtype(v.dtype, np.integer)
    }


def _read_weights(model_dir: Path) -> dict[str, np.ndarray]:
    """model.safetensors, or the shards model.safetensors.index.json names (transformers'
    save_pretrained splits a model past its max_shard_size, as every 7B decoder ships)."""
    index = model_dir / SHARD_INDEX
    if not index.is_file():
        return _read_safetensors(model_dir / "model.safetensors")
    weight_map = (_json(index) or {}).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise PrepareError(f"{index}: no weight_map naming each tensor's file")
    weights: dict[str, np.ndarray] = {}
    for shard in sorted(set(weight_map.values())):
        path = model_dir / str(shard)
        if Path(str(shard)).name != str(shard) or not path.is_file():
            raise PrepareError(f"{index} names {shard}, which is not a file beside it")
        weights.update(_read_safetensors(path))
    return weights


def _split_weights(
    weights: dict[str, np.ndarray], plan: Plan
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(encoder weights named as in a bare model, head weights); the encoder may sit under the
    family's prefix (``bert.``, ``roberta.``), as every task model's checkpoint has it."""
    module = _family_module(FAMILIES[plan.model_type])
    word = module.WORD if module else "embeddings.word_embeddings.weight"
    prefixes = module.PREFIXES if module else ("", "bert.", "roberta.")
    prefix = next((p for p in prefixes if p + word in weights), None)
    if prefix is None:
        others = " nor ".join(f"{p}{word}" for p in prefixes if p)
        raise PrepareError(f"{plan.model_dir / 'model.safetensors'} has no tensor {word} (nor {others})")
    encoder = {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}
    head: dict[str, np.ndarray] = {}
    if plan.head.classifier == "bert":
        names = ("pooler.dense.weight", "pooler.dense.bias", "classifier.weight", "classifier.bias")
        head = {n: encoder.get(n, weights.get(n)) for n in names}
    elif plan.head.classifier == "roberta":
        names = ("classifier.dense.weight", "classifier.dense.bias", "classifier.out_proj.weight",
                 "classifier.out_proj.bias")  # fmt: skip
        head = {n: weights.get(n) for n in names}
    elif plan.head.classifier == "qwen3_yes_no":
        # The language-model head's "yes" and "no" rows; a tied head (Qwen3-Reranker-0.6B) is the
        # word embeddings, which save_pretrained leaves out of the file.
        lm = weights.get("lm_head.weight", encoder[word])
        return encoder, {"yes_no.weight": lm[list(plan.yes_no)]}
    elif plan.head.classifier:  # the other families' heads sit outside the encoder's prefix
        head = {k: v for k, v in weights.items() if prefix and not k.startswith(prefix)}
        names = ("", "", LABELS_TENSORS[plan.head.classifier])
        if names[2] not in head:
            raise PrepareError(
                f"{plan.model_dir / 'model.safetensors'} has no tensor {names[2]} ({plan.architecture})"
            )
    missing = [n for n, v in head.items() if v is None]
    if missing:
        raise PrepareError(
            f"{plan.model_dir / 'model.safetensors'} has no tensor {missing[0]} ({plan.architecture})"
        )
    if head:
        labels = head[names[2]].shape[0]
        if labels != plan.head.labels:
            raise PrepareError(
                f"{plan.model_dir / 'model.safetensors'}: {names[2]} has {labels} labels; config.json's "
                f"id2label names {plan.head.labels}"
            )
    return encoder, head


def _mlm_head(plan: Plan, weights: dict[str, np.ndarray], encoder: dict[str, np.ndarray]) -> MaskedLM:
    """A sparse encoder's masked-LM head from the checkpoint, outside the encoder's prefix."""
    dense, norm, decoder, biases = _MLM_HEADS[FAMILIES[plan.model_type]]
    where = plan.model_dir / "model.safetensors"
    config = _json(plan.model_dir / "config.json")
    word = encoder["embeddings.word_embeddings.weight"]
    decoder_weight = weights.get(decoder)
    if decoder_weight is None and config.get("tie_word_embeddings", True):
        decoder_weight = word
    bias = next((weights[b] for b in biases if b in weights), None)
    needed = {f"{dense}.weight": weights.get(f"{dense}.weight"), f"{dense}.bias": weights.get(f"{dense}.bias"),
              f"{norm}.weight": weights.get(f"{norm}.weight"), f"{norm}.bias": weights.get(f"{norm}.bias"),
              decoder: decoder_weight, biases[0]: bias}  # fmt: skip
    missing = [n for n, v in needed.items() if v is None]
    if missing:
        raise PrepareError(f"{where} has no tensor {missing[0]} (the masked-LM head a sparse encoder pools)")
    if decoder_weight.shape != word.shape or bias.shape != (word.shape[0],):
        raise PrepareError(
            f"{where}: {decoder} {list(decoder_weight.shape)} and bias {list(bias.shape)}; the vocabulary "
            f"is {word.shape[0]} x {word.shape[1]}"
        )
    activation, pooling = plan.splade
    return MaskedLM(
        dense_weight=needed[f"{dense}.weight"], dense_bias=needed[f"{dense}.bias"],
        norm_weight=needed[f"{norm}.weight"], norm_bias=needed[f"{norm}.bias"], norm_epsilon=plan.cfg.ln_epsilon,
        decoder_weight=decoder_weight, decoder_bias=bias, activation=activation, pooling=pooling,
    )  # fmt: skip


def _m3_heads(plan: Plan, encoder: dict[str, np.ndarray]):
    """BGE-M3's ColBERT and sparse heads, and the ids FlagEmbedding drops from the sparse weights:
    the tokenizer's CLS, EOS, PAD and UNK tokens (special_tokens_map.json / tokenizer_config.json,
    XLM-R's <s>, </s>, <pad>, <unk> where neither names them)."""
    from tokenizers import Tokenizer

    named = {"cls_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}
    for file in ("tokenizer_config.json", "special_tokens_map.json"):
        found = _json(plan.model_dir / file, required=False) or {}
        for key in bge_m3.DROPPED:
            value = found.get(key)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                named[key] = value
    tok = Tokenizer.from_file(str(plan.tokenizer))
    ids = sorted({i for t in named.values() if (i := tok.token_to_id(t)) is not None})
    vocab = encoder["embeddings.word_embeddings.weight"].shape[0]
    try:
        return bge_m3.read_heads(plan.model_dir, plan.cfg.hidden, vocab, tuple(ids))
    except ValueError as exc:
        raise PrepareError(str(exc)) from None


# --------------------------------------------------------------------------------------------
# config.pbtxt


def _escape(text: str) -> str:
    return text_encoding.CEscape(text, as_utf8=True)


def render_config(name: str, plan) -> str:
    """``plan``: a Plan, or onnx_export's ExportPlan (the same fields this reads)."""
    params = text_parameters(plan.max_tokens)
    head = plan.head
    kind = head.kind
    # (an ONNX export's plan, onnx_export.ExportPlan, is always an embedding: it has no splade)
    described = {
        "rerank": "rerank: pairs in, the classifier's logit out",
        "classification": f"classification: {head.labels} labels, "
        + ("each label's sigmoid" if head.multi_label else "softmax")
        + " (probabilities) and logits",
        "sparse_embedding": "sparse embedding: log(1 + relu) of the masked-LM logits, "
        + ("max" if head.mlm is None else head.mlm.pooling)
        + "-pooled over tokens",
        "multi_vector": "ColBERT (PyLate): a normalised vector per token",
    }.get(kind, "embedding")
    notes = [f"Source: {plan.summary}; {described}."]
    params["kind"] = kind
    if getattr(plan, "pair_template", None):
        notes.append(
            "pair_template: each pair is put in this text ({query}, {document}) where it is tokenised; "
            "the text after {document} is kept whole when a pair is cut (Qwen3-Reranker's card)."
        )
        params["pair_template"] = _escape(plan.pair_template)
    if getattr(plan, "yes_no", None):
        notes.append("score: logit('yes') - logit('no') at the last token; its sigmoid is the card's P(yes).")
    if getattr(plan, "text_pair", False):
        notes.append(
            "Each row is a pair: query and document joined by U+001F (gateway/text.py PAIR_SEPARATOR)."
        )
        params["text_pair"] = "true"
    if kind == "classification":
        params["problem_type"] = PROBLEM_TYPES[head.multi_label]
        for i, label in enumerate(plan.label_names):
            params[f"label.{i}"] = _escape(label)
    elif kind == "sparse_embedding":
        notes.append("sparse_embedding is vocabulary-sized: index i scores tokenizer.json's token id i.")
    elif kind == "multi_vector":
        cb = head.colbert
        params["query_length"] = str(cb.query_length)
        if cb.expansion_id is not None:
            params["query_expansion_token_id"] = str(cb.expansion_id)
        notes.append(
            "ColBERT (PyLate): token_embeddings are the Dense projection of every token, normalised; the rows "
            "where token_mask is 1 are the text's vectors (a query's all, its expansion tokens included; a "
            f"document's less {len(cb.skip_ids)} skiplist tokens). Queries get prompt query ({cb.query_prefix!r}), "
            f"cut at query_length and padded to it with query_expansion_token_id at attention mask 0; documents "
            f"prompt document ({cb.document_prefix!r}), cut at max_tokens. Score: MaxSim (sum over the query's "
            "vectors of the best dot product with the document's)."
        )
    elif kind == "embedding":
        notes.append(
            "pooling and normalize record what the graph does; prompt.<name> are the folder's prompts."
        )
        if plan.head.dense:
            shapes = ", ".join(f"{d.in_features}->{d.out_features} {d.activation}" for d in plan.head.dense)
            notes.append(f"Dense modules after pooling (in the graph): {shapes}.")
        params["pooling"] = plan.head.pooling
        params["normalize"] = "true" if plan.head.normalize else "false"
        if plan.head.pooling == "lasttoken":
            notes.append(_last_token_note(plan.tokenizer))
        if plan.head.m3 is not None:
            params["score_weights"] = ",".join(str(w) for w in bge_m3.CARD_WEIGHTS)
            notes.append(
                "BGE-M3, one pass, three outputs: embedding (CLS, normalised); sparse_embedding (relu of "
                "sparse_linear per token, max per token id, CLS/EOS/PAD/UNK dropped; index i scores "
                "tokenizer.json's id i); token_embeddings (colbert_linear, normalised) where token_mask "
                "is 1 (every token after CLS). score_weights: the card's dense, sparse, ColBERT weights."
            )
        if plan.head.token_states:
            notes.append(
                "token_embeddings: each token's final state, zero past the row's own tokens (a row comes "
                "back padded to the longest row of its answer)."
            )
    for prompt, text in sorted(plan.prompts.items()):
        params[f"prompt.{_escape(prompt)}"] = _escape(text)
    if plan.default_prompt_name is not None:
        params["default_prompt_name"] = _escape(plan.default_prompt_name)
    first, *more = head.outputs(plan.cfg.hidden if hasattr(plan, "cfg") else plan.hidden)
    first_dims = ", ".join(str(-1 if d == "seq" else d) for d in first[1])
    text = render_text_config(
        name, "gateway/models/hf_model.py (batchgate prepare-model)", first[0], first_dims, params, notes
    )
    if more:  # render_text_config writes one output; the others follow it in the same list
        block = f"    dims: [ {first_dims} ]\n  }}\n]\n"
        assert text.count(block) == 1
        extra = (
            ",\n".join(
                f'  {{\n    name: "{n}"\n    data_type: TYPE_FP32\n    dims: [ {", ".join(str(-1 if d == "seq" else d) for d in dims)} ]\n  }}'
                for n, dims in more
            )
            + "\n"
        )
        text = text.replace(block, f"    dims: [ {first_dims} ]\n  }},\n{extra}]\n")
    return text


def _last_token_note(tokenizer: Path) -> str:
    """Which token last-token pooling reads, from what tokenizer.json's post-processor does (a
    decoder embedder pools the end-of-text token only if its tokenizer appends one)."""
    from tokenizers import Tokenizer

    enc = Tokenizer.from_file(str(tokenizer)).encode("a")
    if enc.special_tokens_mask and enc.special_tokens_mask[-1]:
        return (
            f"lasttoken pools {enc.tokens[-1]}, which tokenizer.json's post-processor appends to every text."
        )
    return "tokenizer.json appends no special token: lasttoken pools each text's own last token."


# --------------------------------------------------------------------------------------------
# building


def prepare_weights(source: Path, name: str, repo: Path, *, pooling: str | None = None,
                    normalize: bool | None = None, text_pair: bool | None = None,
                    token_embeddings: bool = False, reranker: bool | None = None, log: Log = print,
                    t0: float | None = None) -> Path:  # fmt: skip
    """Write ``<repo>/<name>`` from a local folder whose architecture the builder knows: its
    safetensors weights built into a graph. Returns the model directory; raises PrepareError."""
    t0 = time.monotonic() if t0 is None else t0
    plan = read_folder(source, pooling=pooling, normalize=normalize, text_pair=text_pair,
                       token_embeddings=token_embeddings, reranker=reranker)  # fmt: skip
    weights = _read_weights(plan.model_dir)
    encoder, head = _split_weights(weights, plan)
    _check_vocab(plan, encoder)
    if plan.splade is not None:
        plan = replace(plan, head=replace(plan.head, mlm=_mlm_head(plan, weights, encoder)))
    if (
        plan.head.kind == "embedding"
        and FAMILIES[plan.model_type] == "roberta"
        and bge_m3.present(plan.model_dir)
    ):
        plan = replace(plan, head=replace(plan.head, m3=_m3_heads(plan, encoder)))
    del weights
    module = _family_module(FAMILIES[plan.model_type])
    try:
        if module is None:
            model = build_model(encoder, plan.cfg, plan.head, name=name, producer=PRODUCER, head_weights=head)
        else:
            model = module.build_model(encoder, plan.cfg, plan.head, name=name, producer=PRODUCER,
                                       **({"head_weights": head} if head else {}))  # fmt: skip
    except KeyError as exc:
        raise PrepareError(f"{plan.model_dir / 'model.safetensors'} has no tensor {exc.args[0]}") from None
    out = Path(repo) / name
    write_model(out / VERSION / "model.onnx", model)  # past 2 GiB with its weights beside it
    served = SERVED_TOKENIZERS.get(plan.model_type)
    write_atomic(
        out / "tokenizer.json",
        served(plan.model_dir, plan.tokenizer) if served else plan.tokenizer.read_bytes(),
    )
    # Config last, so a repository scan never finds a config whose other files are missing.
    write_atomic(out / "config.pbtxt", render_config(name, plan).encode())
    dense = f", {len(plan.head.dense)} Dense to {plan.dim} dims" if plan.head.dense else ""
    what = {
        "rerank": "rerank, "
        + ("logit('yes') - logit('no')" if plan.yes_no else "raw logit")
        + (", the card's pair template" if plan.pair_template else ""),
        "classification": f"classification, {plan.head.labels} labels"
        + (", multi-label" if plan.head.multi_label else "")
        + (", pairs" if plan.text_pair else ""),
        "sparse_embedding": f"sparse embedding, {plan.dim} terms",
        "multi_vector": f"ColBERT token vectors, {plan.dim} dims, queries {plan.head.colbert.query_length} tokens"
        if plan.head.colbert is not None
        else "",
    }.get(
        plan.head.kind,
        f"embedding, {plan.head.pooling} pooling{dense}{', normalised' if plan.head.normalize else ''}"
        + (", token embeddings" if plan.head.token_states else ""),
    )
    log(
        f"{name}: wrote {out} from {plan.source} ({plan.architecture}, {what}, max {plan.max_tokens} tokens"
        f"{f', prompts {sorted(plan.prompts)}' if plan.prompts else ''}) in {time.monotonic() - t0:.1f}s"
    )
    return out


def _check_vocab(plan: Plan, encoder: dict[str, np.ndarray]) -> None:
    from tokenizers import Tokenizer

    module = _family_module(FAMILIES[plan.model_type])
    rows = encoder[module.WORD if module else "embeddings.word_embeddings.weight"].shape[0]
    tokens = Tokenizer.from_file(str(plan.tokenizer)).get_vocab_size(with_added_tokens=True)
    if tokens > rows:
        raise PrepareError(
            f"{plan.tokenizer} has {tokens} tokens; the model's embedding table has {rows} rows"
        )
