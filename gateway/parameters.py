"""Typed model parameters: every config.pbtxt ``parameters {}`` key batchgate reads, declared once.

A model's parameters are parsed here once, at load (``gateway/repository.py``), into a frozen
``ModelParameters`` held on its ``ModelSpec``; the codec, the shape buckets (``workers/buckets.py``),
the text stage and the queue factory read the typed values and never the raw strings. ``DECLARED``
is the one table: key, type, bounds, default, which stage reads it, and what it does; the docs'
table (docs/model-config.md) is checked against it by a test.

A key nobody declared fails the load, named, with the closest declared key when it looks like a
misspelling: a typo in a parameter would otherwise leave a model running with a default its
author meant to change. The one exception is Triton's own ONNX Runtime backend settings
(``TRITON_HINTS``): they only tune the runtime, so a repository written for Triton loads, and
each one is logged as ignored, as unimplemented config fields are.

Values are ``string_value`` (Triton's ModelParameter has nothing else). A key ``max_dim.<input>``
is a *family*: one key per input, and the part after the dot must name one.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from batchgate.workers.buckets import DEFAULT_MASK_INPUT, BucketConfig

# Engine variants (gateway/repository.py VARIANT_PRECISION says what each computes in).
VARIANTS = (
    "fp32", "optimized", "fp16", "int8", "openvino-fp32", "openvino-bf16", "openvino-int8", "int8-mixed",
)  # fmt: skip

DEFAULT_MAX_TEXT_BYTES = 32768
# What a text model serves (gateway/models/encoder.py KINDS); each kind's outputs are fixed by name
# (ModelSpec.kind, gateway/repository.py).
KINDS = ("embedding", "rerank", "classification", "sparse_embedding", "multi_vector")
PROBLEM_TYPES = ("single_label_classification", "multi_label_classification")


class ParameterError(ValueError):
    """A parameter is unknown or its value is out of bounds; the message names the key."""


# -- value parsers: text -> value, or ValueError saying what was expected ---------------------


def _int(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise ValueError(f"an integer >= {low}") from None
        if value < low:
            raise ValueError(f"an integer >= {low}")
        return value

    return parse


def _sizes(text: str) -> tuple[int, ...]:
    """'8, 2,32' -> (2, 8, 32): sizes >= 1 in any order, duplicates merged."""
    try:
        values = sorted({int(x) for x in text.replace(" ", "").split(",") if x})
    except ValueError:
        raise ValueError("integers >= 1 separated by commas") from None
    if any(v < 1 for v in values):
        raise ValueError("integers >= 1 separated by commas")
    return tuple(values)


def _seq_sizes(text: str) -> tuple[int, ...]:
    """'' / 'none' / 'off' / 'exact' -> () (no padding on this dim); else the bucket lengths."""
    if text.strip().lower() in ("", "none", "off", "exact"):
        return ()
    try:
        return _sizes(text)
    except ValueError:
        raise ValueError("integers >= 1 separated by commas, or 'none'") from None


def _ascending(text: str) -> tuple[int, ...]:
    """Strictly ascending positive integers, as written (the text stage groups rows by them)."""
    try:
        values = tuple(int(b) for b in text.split(","))
    except ValueError:
        values = ()
    if not values or any(b < 1 for b in values) or list(values) != sorted(set(values)):
        raise ValueError("ascending positive integers separated by commas")
    return values


def _choice(*options: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in options:
            raise ValueError(" or ".join(f"'{o}'" for o in options))
        return text

    return parse


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _bool(text: str) -> bool:
    t = text.strip().lower()
    if t in _TRUE:
        return True
    if t in _FALSE:
        return False
    raise ValueError("true or false")


def _mask(text: str) -> str | None:
    t = text.strip()
    return None if not t or t.lower() == "none" else t


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError("a number") from None
    if not math.isfinite(value):
        raise ValueError("a finite number")
    return value


def _range(text: str) -> tuple[float, float]:
    low, sep, high = text.partition(":")
    try:
        lo, hi = float(low), float(high)
    except ValueError:
        lo = hi = math.nan
    if not sep or not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise ValueError("'low:high', two numbers with low < high")
    return lo, hi


def _pair_template(text: str) -> str:
    query, document = text.find("{query}"), text.find("{document}")
    if query < 0 or document < query or text.count("{query}") != 1 or text.count("{document}") != 1:
        raise ValueError("a text holding {query} once, then {document} once")
    return text


def _weights3(text: str) -> tuple[float, float, float]:
    parts = text.split(",")
    try:
        values = tuple(float(p) for p in parts)
    except ValueError:
        values = ()
    if len(values) != 3 or not all(math.isfinite(v) and v >= 0 for v in values) or not sum(values) > 0:
        raise ValueError("three weights 'dense,sparse,token', each >= 0, not all 0")
    return values


def _names(text: str) -> tuple[str, ...]:
    """'a, b' -> ('a', 'b'): names separated by commas, each once."""
    names = tuple(n.strip() for n in text.split(","))
    if not all(names) or len(set(names)) != len(names):
        raise ValueError("output names separated by commas, each once")
    return names


def _nonempty(text: str) -> str:
    if not text.strip():
        raise ValueError("a file name")
    return text


# -- the table ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Declared:
    key: str  # "max_tokens"; "max_dim.<input>" for a family (one key per input)
    type: str
    default: str
    bounds: str
    reads: str  # the stage that reads it
    doc: str
    parse: Callable[[str], Any]
    field: str  # the ModelParameters attribute it fills

    @property
    def family(self) -> str | None:
        """'max_dim' for 'max_dim.<input>'; None for a plain key."""
        return self.key.split(".<", 1)[0] if ".<" in self.key else None

    @property
    def names(self) -> str | None:
        """What a family's suffix must name: 'input', 'model_input' or 'dim' (checked elsewhere)."""
        return self.key.split(".<", 1)[1].rstrip(">") if ".<" in self.key else None


DECLARED: tuple[Declared, ...] = (
    # text stage (gateway/text.py)
    Declared("tokenizer", "file name", "none", "a file in the model directory", "text stage",
             "tokenizer.json (Hugging Face tokenizers) relative to the model directory; makes the model a "
             "text model: one TYPE_STRING input, token inputs made in the workers", _nonempty, "tokenizer"),
    Declared("max_tokens", "int", "the tokenizer file's truncation length, else 512", ">= 3", "text stage",
             "longest token sequence the model sees, special tokens included", _int(3), "max_tokens"),
    Declared("truncate", "'truncate' or 'reject'", "truncate", "one of the two", "text stage",
             "what happens to a text over max_tokens: cut to it, or refused with INVALID_ARGUMENT",
             _choice("truncate", "reject"), "truncate"),
    Declared("long_inputs", "'truncate' or 'chunk'", "truncate", "one of the two", "text calls",
             "an embedding call's text over max_tokens: cut (or refused, per truncate), or split into "
             "chunks of max_tokens with chunk_overlap tokens shared, each embedded in the same batches as "
             "other rows, answered as their token-weighted mean (vLLM's chunked processing); a call may "
             "say otherwise (field long_inputs)", _choice("truncate", "chunk"), "long_inputs"),
    Declared("chunk_overlap", "int", "0", ">= 0, below max_tokens", "text calls",
             "tokens each chunk of a long input shares with the one before it (long_inputs chunk)",
             _int(0), "chunk_overlap"),
    Declared("max_text_bytes", "int", str(DEFAULT_MAX_TEXT_BYTES), ">= 1", "text stage",
             "longest text accepted at all, in UTF-8 bytes (checked before tokenizing)", _int(1),
             "max_text_bytes"),
    Declared("length_buckets", "int list", "16,32,64,128,256,512 capped at max_tokens",
             "strictly ascending, >= 1", "text stage, buckets",
             "token lengths text rows are grouped by; the engines pad to the same lengths unless "
             "seq_buckets is set", _ascending, "length_buckets"),
    Declared("max_batch_tokens", "int", "0 (no limit)", ">= 0", "text stage, buckets",
             "token budget of one engine run, rows x bucket lengths: a larger batch runs as several "
             "(bounds activation memory and warm-up time)", _int(0), "max_batch_tokens"),
    Declared("text_pair", "bool", "false", "true/false (1/0, yes/no, on/off)", "text stage",
             "each row is a pair of texts joined by U+001F (a cross-encoder's query and document), "
             "tokenised as the tokenizer pairs two sequences", _bool, "text_pair"),
    Declared("pair_template", "text", "none", "{query} once, then {document} once", "text stage",
             "a pair is tokenised as this one text with its query and document put in (no special tokens "
             "added), the text after {document} kept whole when it is cut (Qwen3-Reranker's chat)",
             _pair_template, "pair_template"),
    # recorded by `batchgate prepare-model` (gateway/models/hf_model.py, docs/embeddings.md)
    Declared("pooling", "'mean', 'cls' or 'lasttoken'", "none", "one of the three", "nothing (recorded)",
             "how the graph pools token states into the embedding; the graph does it, this says which",
             _choice("mean", "cls", "lasttoken"), "pooling"),
    Declared("normalize", "bool", "none", "true/false (1/0, yes/no, on/off)", "nothing (recorded)",
             "whether the graph L2-normalises the embedding", _bool, "normalize"),
    Declared("kind", "'embedding', 'rerank', 'classification', 'sparse_embedding' or 'multi_vector'",
             "by outputs: 'score' rerank, 'embedding' embedding", "one of the five; the kind's outputs present",
             "repository, routes", "what the model serves, so a route knows which outputs to read: "
             "embedding (embedding, optional token_embeddings), rerank (score), classification "
             "(probabilities, logits), sparse_embedding (sparse_embedding, vocabulary-sized), multi_vector "
             "(token_embeddings and token_mask: a ColBERT model)",
             _choice(*KINDS), "kind"),
    Declared("problem_type", "'single_label_classification' or 'multi_label_classification'",
             "single_label_classification", "one of the two; kind classification only", "routes",
             "transformers' problem_type: probabilities are the softmax over the labels, or each "
             "label's sigmoid (the graph computes them; this says which)", _choice(*PROBLEM_TYPES),
             "problem_type"),
    Declared("label.<index>", "text", "none", "indices 0..n-1, all of them; kind classification only",
             "routes", "a classifier's label names (its id2label): the name of output index <index>",
             str, "labels"),
    Declared("prompt.<name>", "text", "none", "any text, empty included", "prompts",
             "a prompt the model was trained with (sentence-transformers' prompts): prepended to a "
             "text whose call names it", str, "prompts"),
    Declared("default_prompt_name", "prompt name", "none", "a prompt.<name> key of the model", "prompts",
             "the prompt a call that names none gets", _nonempty, "default_prompt_name"),
    Declared("openai_token_ids", "'openai', 'model' or 'refuse'", "the server's --openai-token-ids",
             "one of the three", "embedding routes",
             "what token-id arrays on /v1/embeddings mean for this model: OpenAI's cl100k_base ids "
             "(decoded to text, then tokenized by the model's tokenizer), the model's own ids, or refused",
             _choice("openai", "model", "refuse"), "openai_token_ids"),
    Declared("query_length", "int", "none", ">= 1; kind multi_vector", "text stage (queries)",
             "a ColBERT model's query length: a query row (prompt query) is cut at this many tokens and, with "
             "query_expansion_token_id, padded up to it with that token at attention mask 0 (PyLate's query "
             "expansion); documents use max_tokens", _int(1), "query_length"),
    Declared("query_expansion_token_id", "int", "none", ">= 0; with query_length", "text stage (queries)",
             "the token a ColBERT query is padded with up to query_length (the mask token); its vectors "
             "are part of the query's (token_mask 1)", _int(0), "query_expansion_token_id"),
    Declared("score_weights", "three numbers 'dense,sparse,token'", "none",
             ">= 0, not all 0; the outputs embedding, sparse_embedding and token_embeddings present",
             "rerank routes", "a model with all three outputs (BGE-M3): a pair's score is the weighted mean of "
             "its dense dot product, its sparse weights' dot product and the MaxSim of its token vectors "
             "(recorded by prepare-model from the model card: 0.4,0.2,0.4)", _weights3, "score_weights"),
    Declared("matryoshka_dimensions", "int list", "none", "strictly ascending, >= 1, below the output's size",
             "embedding routes", "the sizes a Matryoshka-trained embedding may be cut to: a call's "
             "`dimensions` keeps that many leading values and re-normalises", _ascending,
             "matryoshka_dimensions"),
    # shape buckets (workers/buckets.py)
    Declared("batch_buckets", "int list", "powers of two up to max_batch_size, plus preferred_batch_size",
             "each in [1, max_batch_size]", "buckets",
             "batch sizes a batch is padded up to (max_batch_size is always added)", _sizes,
             "batch_buckets"),
    Declared("seq_buckets", "int list or 'none'", "by model: masked dims get powers of two 16..512",
             ">= 1", "buckets",
             "lengths every variable dim group is padded up to; 'none' keeps exact lengths", _seq_sizes,
             "seq_buckets"),
    Declared("seq_buckets.<dim>", "int list or 'none'", "seq_buckets", ">= 1; <dim> a variable dim group",
             "buckets", "the same for one dim group (its ONNX dim_param, or <input>.<axis>)", _seq_sizes,
             "seq_buckets_by_dim"),
    Declared("mask_input", "input name or 'none'", DEFAULT_MASK_INPUT, "an ONNX input", "buckets",
             "the input whose padding (0) masks padded positions; 'none': no mask, so no dim is padded by "
             "default", _mask, "mask_input"),
    Declared("pad_value.<model_input>", "float", "0", "finite; <model_input> an ONNX input", "buckets",
             "value written into padded rows and positions of that input", _number, "pad_value"),
    # codec (gateway/codec.py)
    Declared("input_range.<input>", "'low:high'", "none", "low < high; <input> a config input", "codec",
             "every value of that input must lie in [low, high): one bad row is refused alone",
             _range, "input_range"),
    Declared("max_dim.<input>", "int", "none", ">= 1; <input> a config input", "codec, buckets",
             "every variable (-1) dim of that input at most this; also caps its default length buckets",
             _int(1), "max_dim"),
    Declared("on_request_outputs", "output names", "none (every output is a default one)",
             "config outputs, not all of them", "codec, workers",
             "outputs computed only for a call that asks for them: a KServe call naming no outputs gets the "
             "others, a text call only what its route reads, and an engine fetches and copies an output only "
             "for a batch holding a request that asked for it; model metadata still lists them",
             _names, "on_request_outputs"),
    # scheduling (gateway/dataplane.py)
    Declared("scheduling_policy", "'deadline' or 'fifo'", "the server's --scheduling-policy",
             "one of the two", "queue factory",
             "this model's queue: earliest deadline first, or Triton's FIFO",
             _choice("deadline", "fifo"), "scheduling_policy"),
    Declared("learned_batch_limit", "bool", "true", "true/false (1/0, yes/no, on/off)", "queue factory",
             "let the deadline queue learn the largest batch that still meets deadlines", _bool,
             "learned_batch_limit"),
    # engine file (gateway/repository.py; built by `batchgate optimize`, docs/engines.md)
    Declared("variant", "'fp32', 'optimized', 'fp16', 'int8', 'openvino-fp32', 'openvino-bf16', "
             "'openvino-int8' or 'int8-mixed'", "fp32", "one of the eight", "repository",
             "which engine serves: model.onnx (fp32) or the variant built beside it (model.<variant>.onnx; "
             "openvino-fp32 and -bf16 run model.onnx itself through OpenVINO); refused at load unless its "
             "report model.<variant>.report.json passed and matches both files",
             _choice(*VARIANTS), "variant"),
    Declared("variant_selection", "'auto' or 'off'", "auto", "one of the two", "repository, selection",
             "auto: with no `variant` set, serve the variant selected for this host's CPU class and, while "
             "none is, select one in the background (gateway/selection.py; the server's "
             "variant_selection must allow it); off: serve the config's variant, never select",
             _choice("auto", "off"), "variant_selection"),
    Declared("engine", "'onnxruntime' or 'openvino'", "onnxruntime (an openvino-* variant: openvino)",
             "one of the two; openvino needs the openvino package", "repository, workers",
             "the runtime that runs the model file; Triton's backend: \"openvino\" says the same "
             "(docs/engines.md)", _choice("onnxruntime", "openvino"), "engine"),
    Declared("precision", "'auto', 'fp32' or 'bf16'", "auto", "one of the three; bf16 with engine openvino only",
             "repository, workers",
             "OpenVINO's inference precision; auto: BF16 where the CPU computes it natively (AMX, "
             "AVX-512 BF16), FP32 elsewhere", _choice("auto", "fp32", "bf16"), "precision"),
    Declared("shed_at_admission", "bool", "true", "true/false (1/0, yes/no, on/off)", "queue factory",
             "refuse at admission a request whose deadline is already out of reach; false queues it "
             "anyway and counts whether it made its deadline (batchgate_shed_shadow_total: the "
             "estimate's false refusals)", _bool, "shed_at_admission"),
    # placement (gateway/runtime.py, workers/devices.py; docs/engines.md "Where a model runs")
    Declared("gpu_fallback", "'fail' or 'cpu'", "fail", "one of the two", "placement",
             "a GPU asked for (device=gpu, or KIND_GPU) where none is usable: the load fails, or the "
             "model serves on the CPU; one log line says which and why", _choice("fail", "cpu"),
             "gpu_fallback"),
)  # fmt: skip

# Triton's ONNX Runtime backend reads these from the same map (onnxruntime_backend README): they
# tune ORT's threads and memory, never an answer, so they are logged as ignored, not refused.
TRITON_HINTS = frozenset({
    "intra_op_thread_count", "inter_op_thread_count", "execution_mode", "enable_mem_arena",
    "enable_mem_pattern", "memory.enable_memory_arena_shrinkage",
    "session.use_device_allocator_for_initializers", "cudnn_conv_algo_search", "gpu_mem_limit",
    "arena_extend_strategy", "do_copy_in_default_stream",
})  # fmt: skip

_PLAIN = {d.key: d for d in DECLARED if d.family is None}
_FAMILIES = {d.family: d for d in DECLARED if d.family is not None}


@dataclass(frozen=True, slots=True)
class ModelParameters:
    """One model's parameters, typed; the defaults are the table's."""

    tokenizer: str = ""
    max_tokens: int | None = None  # None: the tokenizer file's truncation length (text stage)
    truncate: str = "truncate"
    max_text_bytes: int = DEFAULT_MAX_TEXT_BYTES
    long_inputs: str = "truncate"
    chunk_overlap: int = 0
    length_buckets: tuple[int, ...] | None = None  # None: the text stage's default
    max_batch_tokens: int = 0
    batch_buckets: tuple[int, ...] = ()  # (): powers of two + preferred sizes
    seq_buckets: tuple[int, ...] | None = None  # None: by model (masked groups only)
    seq_buckets_by_dim: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    mask_input: str | None = DEFAULT_MASK_INPUT
    pad_value: Mapping[str, float] = field(default_factory=dict)
    input_range: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    max_dim: Mapping[str, int] = field(default_factory=dict)
    on_request_outputs: tuple[str, ...] = ()  # fetched only when a call names them (repository checks)
    scheduling_policy: str | None = None  # None: the server's
    learned_batch_limit: bool = True
    shed_at_admission: bool = True
    gpu_fallback: str = "fail"
    variant: str = "fp32"
    variant_selection: str = "auto"  # off: never the host's selected variant (gateway/selection.py)
    engine: str | None = None  # None: the variant's (onnxruntime unless an openvino-* variant)
    precision: str = "auto"
    text_pair: bool = False
    pair_template: str | None = None  # a pair tokenised as this one text (gateway/text.py)
    kind: str | None = None  # None: by the outputs (ModelSpec.kind)
    problem_type: str | None = None  # None: single_label_classification for a classifier
    labels: tuple[str, ...] = ()  # label.<index>, in index order
    pooling: str | None = None  # recorded: the graph pools
    normalize: bool | None = None  # recorded: the graph normalises
    prompts: Mapping[str, str] = field(default_factory=dict)  # prompt name -> text
    default_prompt_name: str | None = None
    openai_token_ids: str | None = None  # None: the server's setting (gateway/openai_ids.py meaning)
    query_length: int | None = None  # a ColBERT model's queries (kind multi_vector)
    query_expansion_token_id: int | None = None
    score_weights: tuple[float, float, float] | None = None  # dense, sparse, token (BGE-M3's rerank)
    matryoshka_dimensions: tuple[
        int, ...
    ] = ()  # sizes `dimensions` may ask for (the full size is always served)
    given: frozenset[str] = frozenset()  # keys the config set, as written

    def bucket_config(self, max_batch_size: int, preferred: tuple[int, ...] = ()) -> BucketConfig:
        """The engines' shape settings; ValueError when batch_buckets exceeds max_batch_size."""
        seq = self.seq_buckets
        if seq is None and self.length_buckets is not None:
            # The text stage's name for the same thing: its rows are grouped by these lengths,
            # so the engines use them as their buckets too.
            seq = self.length_buckets
        return BucketConfig.build(
            max_batch_size,
            preferred,
            batch_buckets=self.batch_buckets,
            seq_buckets=seq,
            seq_by_dim=self.seq_buckets_by_dim,
            max_batch_tokens=self.max_batch_tokens,
            mask_input=self.mask_input,
            mask_explicit="mask_input" in self.given,
            pad_values=self.pad_value,
            max_dims=self.max_dim,
        )


def _closest(key: str, choices: Iterable[str]) -> str | None:
    found = difflib.get_close_matches(key, list(choices), n=1, cutoff=0.6)
    return found[0] if found else None


def _unknown(key: str) -> ParameterError:
    head, dot, tail = key.partition(".")
    candidates = list(_PLAIN) + list(TRITON_HINTS)
    if dot:  # 'max_dims.ids' reads best as 'max_dim.ids'
        candidates += [f"{fam}.{tail}" for fam in _FAMILIES]
    family = _closest(head, _FAMILIES) if dot else None
    guess = _closest(key, candidates) or (family and f"{family}.{tail}")
    hint = f" (did you mean '{guess}'?)" if guess else ""
    known = ", ".join(d.key for d in DECLARED)
    return ParameterError(f"unknown parameter '{key}'{hint}; batchgate reads: {known} (docs/model-config.md)")


def parse(
    raw: Mapping[str, str],
    *,
    inputs: Iterable[str] | None = None,
    model_inputs: Iterable[str] | None = None,
) -> tuple[ModelParameters, list[str]]:
    """Typed parameters from ``raw`` (key -> string_value) and the ignored keys (Triton's ORT
    settings). ``inputs`` (the config's) and ``model_inputs`` (the ONNX graph's) check what a
    family key names; None skips that check. ParameterError names the first bad key."""
    names = {"input": None if inputs is None else set(inputs),
             "model_input": None if model_inputs is None else set(model_inputs)}  # fmt: skip
    values: dict[str, Any] = {}
    families: dict[str, dict[str, Any]] = {}
    ignored: list[str] = []
    for key in sorted(raw):
        text = raw[key]
        decl = _PLAIN.get(key)
        suffix = None
        if decl is None:
            head, dot, suffix = key.partition(".")
            decl = _FAMILIES.get(head) if dot and suffix else None
        if decl is None:
            if key in TRITON_HINTS:
                ignored.append(key)
                continue
            raise _unknown(key)
        if suffix is not None:
            allowed = names.get(decl.names or "")
            if allowed is not None and suffix not in allowed:
                guess = _closest(suffix, allowed)
                hint = f" (did you mean '{decl.family}.{guess}'?)" if guess else ""
                raise ParameterError(
                    f"parameter '{key}' names no {decl.names.replace('_', ' ')} '{suffix}'{hint}; "
                    f"the model's: {sorted(allowed)}"
                )
        try:
            value = decl.parse(text)
        except ValueError as exc:
            raise ParameterError(f"parameter '{key}' must be {exc}, got '{text}'") from None
        if suffix is None:
            values[decl.field] = value
        else:
            families.setdefault(decl.field, {})[suffix] = value
    default_prompt = values.get("default_prompt_name")
    if default_prompt is not None and default_prompt not in families.get("prompts", {}):
        raise ParameterError(
            f"parameter 'default_prompt_name' names no prompt '{default_prompt}'; the model's: "
            f"{sorted(families.get('prompts', {}))} (parameters prompt.<name>)"
        )
    if "labels" in families:
        families["labels"] = _labels(families["labels"])
    return ModelParameters(**values, **families, given=frozenset(raw)), ignored


def _labels(by_index: Mapping[str, str]) -> tuple[str, ...]:
    """label.<index> keys -> the names in index order; every index 0..n-1 exactly once."""
    try:
        indexed = {int(k): v for k, v in by_index.items() if k.isdigit()}
    except ValueError:
        indexed = {}
    if len(indexed) != len(by_index) or sorted(indexed) != list(range(len(indexed))):
        keys = ", ".join(f"label.{k}" for k in sorted(by_index))
        raise ParameterError(
            f"parameters label.<index> must number the labels 0..{len(by_index) - 1}, each once; got {keys}"
        )
    return tuple(indexed[i] for i in range(len(indexed)))


def bucket_config(raw: Mapping[str, str], max_batch: int, preferred: tuple[int, ...] = ()) -> BucketConfig:
    """BucketConfig from raw parameter strings, unchecked against a model (tests, benches)."""
    return parse(raw)[0].bucket_config(max_batch, preferred)
