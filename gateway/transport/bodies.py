"""Every REST body as one typed definition (msgspec ``Struct``s): the wires decode their bodies
into these (``read``, ``decode``), and the OpenAPI document's schemas are generated from the same
types (gateway/transport/openapi.py), so the contract and the checks cannot drift apart.

Why msgspec: decoding and validating a realistic ``/v1/embeddings`` body costs 0.41 µs with it,
2.8 µs with pydantic v2 and 2.6 µs for ``json.loads`` alone; a KServe infer body 0.79 µs, 5.9 µs
and 5.5 µs (lab/body_decode.py, 2026-12-07, docs/architecture.md "REST bodies").

A refusal names the field in the wire's own words (``refusal``): a missing field "'input' is
required", a mistyped one "'dimensions': expected int >= 1, got 0", an unknown one on OpenAI's
closed body "unrecognized request argument(s): ['temperature']". What a type cannot say (a list of
texts or of token ids, the number of texts, a pair's separator) the wires still check, by name.

Bodies of other servers' wires follow those servers: TEI's, infinity's, vLLM's and Cohere's ignore
unknown fields (``read`` logs each name once), OpenAI's ``/v1/embeddings`` refuses them
(``forbid_unknown_fields``).
"""

from __future__ import annotations

import logging
import re
import typing
from typing import Annotated, Any, ClassVar, Literal

import msgspec
from msgspec import Meta, Struct

from batchgate.gateway.errors import GatewayError, clip, invalid
from batchgate.gateway.scheduling.request import MIN_BUDGET_MS
from batchgate.gateway.text_calls import MAX_INPUTS

log = logging.getLogger(__name__)

EXAMPLE_MODEL = "minilm"  # the model the examples name (the bundled text embedding model)
Positive = Annotated[int, Meta(ge=1)]
Name = Annotated[str, Meta(min_length=1)]
Model = Annotated[str, Meta(min_length=1, description="An extension: default, the server's default model.")]
Prompt = Annotated[str, Meta(min_length=1, description="One of the model's prompts.")]
Truncate = Annotated[
    bool,
    Meta(description="Cut texts over the model's length instead of refusing them; default: the model's own "
         "`truncate` setting (`auto_truncate` in `/info`)."),
]  # fmt: skip
Direction = Annotated[
    Literal["Left", "Right", "left", "right"],
    Meta(description="Which end of a text over the model's length is kept when it is truncated: its first "
         "tokens (`Right`, the default) or its last (`Left`)."),
]  # fmt: skip
LatencyClass = Annotated[str, Meta(description="The call's latency class (an extension).")]
Budget = Annotated[
    float,
    Meta(
        ge=MIN_BUDGET_MS,
        description=f"The call's latency budget in milliseconds (an extension), at least {MIN_BUDGET_MS:g}.",
    ),
]
Texts = Annotated[
    str | list[Any],
    Meta(description=f'One text, or a list of at most {MAX_INPUTS}; whitespace-only texts are embedded, only "" '
         "is refused."),
]  # fmt: skip
TextsOrIds = Annotated[
    str | list[Any],
    Meta(description=f'One text or a list of at most {MAX_INPUTS} (whitespace-only texts are embedded, only "" '
         "is refused); or token ids of the model's vocabulary (a list of ints, or a list of such lists), the "
         "model's input as they are (no special tokens added), as TEI takes them."),
]  # fmt: skip
Query = Annotated[str, Meta(description="The query (not only whitespace).")]
Ignored = Annotated[Any, Meta(description="Accepted and ignored.")]


class Body(Struct, kw_only=True, omit_defaults=True):
    """A request body; ``required`` says what a missing field must be (its refusal's words)."""

    required: ClassVar[dict[str, str]] = {}


class Latency(Body, kw_only=True, omit_defaults=True):
    latency_class: LatencyClass | None = None
    latency_budget_ms: Budget | None = None


class TeiCommon(Latency, kw_only=True, omit_defaults=True):
    model: Model | None = None
    truncate: Truncate | None = None
    truncation_direction: Direction | None = None


# -- OpenAI ----------------------------------------------------------------------------------------


class EmbeddingsRequest(Latency, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """OpenAI's embeddings body; a field not listed is refused (400 naming it), as OpenAI does."""

    required: ClassVar = {
        "model": "the name of a text model (GET /v1/models lists them)",
        "input": "a string, a list of strings, or token ids",
    }
    model: Annotated[str, Meta(min_length=1, examples=[EXAMPLE_MODEL])]
    input: Annotated[
        str | list[Any],
        Meta(description=f'One text or a list of at most {MAX_INPUTS} (whitespace-only texts are embedded, only '
             '"" is refused); or token ids (a list of ints, or a list of such lists), by default ids of OpenAI\'s '
             "`cl100k_base` encoding (what tiktoken makes, and LangChain's `OpenAIEmbeddings` sends by default), "
             "decoded to text and tokenized by the model's own tokenizer. The setting `openai_token_ids` "
             "(server-wide, or the model's parameter) chooses `openai` (the default), `model` (the model's own "
             "vocabulary, used as they are) or `refuse` (400 naming `input`). `usage` counts the model's tokens."),
    ]  # fmt: skip
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: (
        Annotated[int, Meta(ge=1, description="A Matryoshka size the model declares, or its own.")] | None
    ) = None
    user: str | None = None
    prompt_name: Prompt | None = None  # an extension: sentence-transformers' word for a prompt
    truncate: Truncate | None = None  # an extension (OpenAI refuses a text over the length)
    long_inputs: Annotated[
        Literal["truncate", "chunk"],
        Meta(description="An extension: `chunk` embeds a text over the model's length in pieces and averages "
             "them (vLLM's chunked processing); default: the model's parameter."),
    ] | None = None  # fmt: skip
    late_chunking: (
        Annotated[
            bool, Meta(description="Jina's: the inputs are chunks of one document, embedded in one pass.")
        ]
        | None
    ) = None


# -- TEI -------------------------------------------------------------------------------------------

_IGNORED = "fields not listed are ignored, as TEI ignores them."


class EmbedRequest(TeiCommon, kw_only=True, omit_defaults=True):
    """TEI's embed body; fields not listed are ignored, as TEI ignores them."""

    required: ClassVar = {"inputs": "a string or a list of strings"}
    inputs: TextsOrIds
    normalize: bool | None = None
    prompt_name: Prompt | None = None
    dimensions: Positive | None = None
    long_inputs: Literal["truncate", "chunk"] | None = None
    late_chunking: bool | None = None


class Document(Struct, omit_defaults=True):
    text: str


Documents = Annotated[
    list[str | Document],
    Meta(min_length=1, description="The documents: strings, or objects with a `text`."),
]


class RerankRequest(TeiCommon, kw_only=True, omit_defaults=True):
    """TEI's rerank body (`texts`), or infinity's and vLLM's (`documents`, `top_n`,
    `return_documents`, answered in that shape); fields not listed are ignored, as those servers
    ignore them."""

    required: ClassVar = {"query": "a non-empty string", "texts": "a list of texts"}
    query: Query
    texts: Texts | None = None
    documents: list[str | Document] | None = None
    top_n: Positive | None = None
    return_documents: bool | None = None
    raw_scores: bool | None = None
    return_text: bool | None = None


class EmbedAllRequest(TeiCommon, kw_only=True, omit_defaults=True):
    """TEI's embed_all body; fields not listed are ignored, as TEI ignores them."""

    required: ClassVar = {"inputs": "a string or a list of strings"}
    inputs: TextsOrIds
    prompt_name: Prompt | None = None
    normalize: Ignored | None = None  # sent by TEI's clients; TEI does not normalise token vectors


class EmbedSparseRequest(TeiCommon, kw_only=True, omit_defaults=True):
    """TEI's embed_sparse body; fields not listed are ignored, as TEI ignores them."""

    required: ClassVar = {"inputs": "a string or a list of strings"}
    inputs: TextsOrIds
    prompt_name: Prompt | None = None
    top_k: (
        Annotated[int, Meta(ge=1, description="Keep only the k largest weights (an extension).")] | None
    ) = None


class PredictRequest(TeiCommon, kw_only=True, omit_defaults=True):
    """TEI's predict body; fields not listed are ignored, as TEI ignores them."""

    required: ClassVar = {"inputs": "a text, a pair [text, text], or a batch of [text] or [text, text]"}
    inputs: Annotated[
        str | list[Any],
        Meta(description="A text, a pair [text, text], or a batch of [text] / [text, text] (all rows alike). "
             "Any classifier takes pairs, tokenized as its tokenizer pairs two sequences."),
    ]  # fmt: skip
    raw_scores: bool | None = None


class SimilarityInputs(Struct):
    source_sentence: str
    sentences: Texts


class SimilarityParameters(Struct, omit_defaults=True):
    truncate: Truncate | None = None
    truncation_direction: Direction | None = None
    prompt_name: Prompt | None = None


class SimilarityRequest(Latency, kw_only=True, omit_defaults=True):
    """TEI's similarity body (what `InferenceClient.sentence_similarity` sends); fields not listed
    are ignored, as TEI ignores them."""

    required: ClassVar = {"inputs": "an object {'source_sentence': text, 'sentences': [text]}"}
    inputs: SimilarityInputs
    parameters: SimilarityParameters | None = None
    model: Model | None = None


class TokenizeRequest(Body, kw_only=True, omit_defaults=True):
    """TEI's tokenize body; fields not listed are ignored, as TEI ignores them."""

    required: ClassVar = {"inputs": "a string or a list of strings"}
    inputs: Annotated[str | list[Any], Meta(description=f"One text, or a list of at most {MAX_INPUTS}.")]
    add_special_tokens: bool | None = None
    prompt_name: Prompt | None = None
    model: Model | None = None


class DecodeRequest(Body, kw_only=True, omit_defaults=True):
    """TEI's decode body; fields not listed are ignored, as TEI ignores them."""

    required: ClassVar = {"ids": "a list of token ids or a list of such lists"}
    ids: Annotated[list[Any], Meta(min_length=1, description="Token ids, or a list of such lists.")]
    skip_special_tokens: bool | None = None
    model: Model | None = None


# -- Cohere ----------------------------------------------------------------------------------------

Priority = Annotated[
    int, Meta(description="Cohere's request priority: accepted and ignored (latency classes and budgets order "
              "calls here).")
]  # fmt: skip


class V2RerankRequest(Latency, kw_only=True, omit_defaults=True):
    """Cohere's v2 rerank body (`cohere.ClientV2.rerank`); fields not listed are ignored, as Cohere
    ignores them."""

    required: ClassVar = {"documents": "a list of texts", "query": "a non-empty string"}
    model: Model | None = None
    query: Query
    documents: Documents
    top_n: Positive | None = None
    max_tokens_per_doc: (
        Annotated[
            int, Meta(ge=1, description="Each document cut to its first this many tokens before scoring.")
        ]
        | None
    ) = None
    return_documents: bool | None = None
    priority: Priority | None = None


class V1RerankRequest(Latency, kw_only=True, omit_defaults=True):
    """Cohere's v1 and Jina's rerank body; fields not listed are ignored, as Cohere ignores them."""

    required: ClassVar = {"documents": "a list of texts", "query": "a non-empty string"}
    model: Model | None = None
    query: Query
    documents: Documents
    top_n: Positive | None = None
    return_documents: bool | None = None
    max_chunks_per_doc: Positive | None = None
    rank_fields: Ignored | None = None


class Content(Struct):
    type: Literal["text"]
    text: str


class CohereInput(Struct):
    content: Annotated[list[Content], Meta(min_length=1, max_length=1)]


INPUT_TYPES = ("search_query", "search_document", "classification", "clustering")
EMBEDDING_TYPES = ("float", "int8", "uint8", "binary", "ubinary", "base64")


class V2EmbedRequest(Latency, kw_only=True, omit_defaults=True):
    """Cohere's v2 embed body (`cohere.ClientV2.embed`); fields not listed are ignored, as Cohere
    ignores them. Images are not served."""

    required: ClassVar = {"texts": "a list of texts (images are not served)"}
    model: Model | None = None
    texts: Texts | None = None
    inputs: (
        Annotated[
            list[CohereInput], Meta(description="v2's mixed inputs, instead of `texts`: text content only.")
        ]
        | None
    ) = None
    input_type: Annotated[
        Literal[INPUT_TYPES],  # type: ignore[valid-type]
        Meta(description="Mapped to the model's prompts (search_query: `query`; search_document: `document`, "
             "`passage`; classification; clustering); a model without such a prompt embeds the text as it is."),
    ] | None = None  # fmt: skip
    embedding_types: Annotated[
        list[Literal[EMBEDDING_TYPES]],  # type: ignore[valid-type]
        Meta(description='Default `["float"]`. binary/ubinary: the signs packed 8 to a byte (binary offset by '
             "-128); int8/uint8: per-dimension ranges calibrated once per model (`/info` `vector_ranges`); "
             "base64: float's little-endian bytes."),
    ] | None = None  # fmt: skip
    truncate: Annotated[
        Literal["NONE", "START", "END"],
        Meta(description="A text over the model's length: refused (NONE), or cut keeping its end (START) or "
             "its start (END, the default)."),
    ] | None = None  # fmt: skip
    output_dimension: (
        Annotated[int, Meta(ge=1, description="A Matryoshka size the model declares, or its own.")] | None
    ) = None
    max_tokens: Annotated[int, Meta(ge=1, description="Each text cut to this many tokens.")] | None = None
    priority: Priority | None = None


# -- vLLM ------------------------------------------------------------------------------------------


class VllmCommon(Latency, kw_only=True, omit_defaults=True):
    model: Model | None = None
    user: str | None = None
    truncate: Truncate | None = None
    truncation_direction: Direction | None = None
    truncate_prompt_tokens: Ignored | None = None
    encoding_format: Ignored | None = None
    priority: Ignored | None = None


class ClassifyRequest(VllmCommon, kw_only=True, omit_defaults=True):
    """vLLM's classify body; fields not listed are ignored, as vLLM ignores them."""

    required: ClassVar = {"input": "a text or a list of texts"}
    input: Annotated[
        str | list[Any], Meta(description="A text, texts, or rows of [text] / [text, text] (all alike).")
    ]


class ScoreRequest(VllmCommon, kw_only=True, omit_defaults=True):
    """vLLM's score body (a cross-encoder); fields not listed are ignored, as vLLM ignores them."""

    required: ClassVar = {"text_1": "texts or lists of texts", "text_2": "texts or lists of texts"}
    text_1: Annotated[
        str | list[Any],
        Meta(description="One query (a text, or a list of one) scored against every `text_2`, or as many texts "
             "as `text_2`, paired index by index."),
    ]  # fmt: skip
    text_2: Texts


# -- KServe v2 -------------------------------------------------------------------------------------

ParamValue = Annotated[bool | int | float | str, Meta(description="bool, int64, double or string")]


Int64 = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]


class InferInputTensor(Struct, omit_defaults=True):
    name: Annotated[str, Meta(max_length=128)]
    shape: list[Int64]
    datatype: Annotated[
        str,
        Meta(max_length=16, examples=["FP32", "INT64", "BYTES"],
             description="A KServe datatype: BOOL, UINT8..UINT64, INT8..INT64, FP16, FP32, FP64, BYTES."),
    ]  # fmt: skip
    parameters: dict[str, ParamValue] | None = None
    data: Annotated[
        Any,
        Meta(description="Row-major values, flat or nested like the shape; absent when the tensor travels as "
             "binary data (`binary_data_size`)."),
    ] = msgspec.UNSET  # fmt: skip


class InferRequestedOutput(Struct, omit_defaults=True):
    name: Annotated[str, Meta(max_length=128)]
    parameters: dict[str, ParamValue] | None = None


class InferenceRequest(Body, kw_only=True, omit_defaults=True):
    """KServe v2's inference request (Triton's binary tensor data extension included)."""

    required: ClassVar = {"inputs": "a non-empty list of tensors"}
    inputs: Annotated[list[InferInputTensor], Meta(min_length=1)]
    id: str | int | None = ""
    parameters: dict[str, ParamValue] | None = None
    outputs: list[InferRequestedOutput] | None = None


class RepositoryIndexRequest(Body, kw_only=True, omit_defaults=True):
    ready: Annotated[bool, Meta(description="Only the models ready.")] = False


class RepositoryModelRequest(Body, kw_only=True, omit_defaults=True):
    parameters: Annotated[
        dict[str, Any],
        Meta(description="Triton's load overrides (`config`, `file:...`) are not offered: a non-empty object is "
             "answered 501."),
    ] | None = None  # fmt: skip


# -- decoding --------------------------------------------------------------------------------------

UNSET = msgspec.UNSET  # a field the body does not hold (KServe: a tensor sent as binary data)
_DECODERS: dict[type, msgspec.json.Decoder] = {}
_KEYS = msgspec.json.Decoder(dict[str, msgspec.Raw])
_AT = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
UNRECOGNIZED = "unrecognized request argument(s)"  # OpenAI's words refusing a field it does not know


def decode(raw: bytes | memoryview, cls: type[Body]) -> Any:
    """``raw`` JSON as a ``cls``, or a ``GatewayError`` naming the field (``refusal``)."""
    decoder = _DECODERS.get(cls)
    if decoder is None:
        decoder = _DECODERS[cls] = msgspec.json.Decoder(cls)
    try:
        return decoder.decode(raw)
    except msgspec.ValidationError as exc:
        _valid_json(raw)  # msgspec checks types as it reads: "[1," is refused as a list, not as JSON
        raise refusal(cls, str(exc), raw) from None
    except msgspec.DecodeError as exc:
        raise invalid(f"the request body is not valid JSON: {clip(exc, 200)}") from None
    except RecursionError:  # msgspec's decoder recurses per level: 100,000 '[' end here, cheaply
        raise invalid("the request body is not valid JSON: nested too deeply") from None


def _valid_json(raw: bytes | memoryview) -> None:
    try:
        msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise invalid(f"the request body is not valid JSON: {clip(exc, 200)}") from None
    except RecursionError:
        raise invalid("the request body is not valid JSON: nested too deeply") from None


def keys(raw: bytes | memoryview, shape: str) -> dict[str, msgspec.Raw]:
    """The body's top-level fields, each value undecoded (for a route that picks its body type by
    a field, and to name the fields a route ignores)."""
    try:
        return _KEYS.decode(raw)
    except msgspec.ValidationError:
        _valid_json(raw)
        raise invalid(f"the request body must be a JSON object with {shape}") from None
    except msgspec.DecodeError as exc:
        raise invalid(f"the request body is not valid JSON: {clip(exc, 200)}") from None
    except RecursionError:
        raise invalid("the request body is not valid JSON: nested too deeply") from None


_MODEL = msgspec.json.Decoder(Model | None)


def model_field(raw: msgspec.Raw) -> str | None:
    """A body's ``model`` alone (a route that picks its body type by the model's kind)."""
    try:
        return _MODEL.decode(raw)
    except msgspec.ValidationError as exc:
        raise refusal(None, f"{exc} - at `$.model`") from None


def refusal(cls: type | None, message: str, raw: bytes | memoryview | None = None) -> GatewayError:
    """msgspec's validation message in the wire's words: the field named, as a path
    (``inputs[0].shape``; a KServe tensor's field by the tensor's name, ``input 'x': 'shape'``),
    and ``field`` the top-level name (OpenAI's ``param``)."""
    m = _AT.match(message)
    msg, path = m["msg"], (m["path"] or "").lstrip(".")
    where = f"'{path}'"
    tensor = re.fullmatch(r"(inputs|outputs)\[(\d+)\]\.(\w+)(.*)", path) if raw is not None else None
    if tensor and tensor[3] != "name":
        name = _tensor_name(raw, tensor[1], int(tensor[2]))
        if name is not None:
            where = f"{tensor[1][:-1]} '{clip(name)}': '{tensor[3]}{tensor[4]}'"
    missing = re.fullmatch(r"Object missing required field `(.+)`", msg)
    if missing:
        name = f"{path}.{missing[1]}" if path else missing[1]
        hint = getattr(cls, "required", {}).get(name) if not path else None
        return invalid(f"'{name}' is required" + (f": {hint}" if hint else ""), _top(name))
    unknown = re.fullmatch(r"Object contains unknown field `(.+)`", msg)
    if unknown:
        name = f"{path}.{unknown[1]}" if path else unknown[1]
        return invalid(f"{UNRECOGNIZED}: [{clip(name, 64)!r}]", _top(name))
    if not path:
        got = msg.rpartition("got ")[2].strip("`")
        return invalid(f"the request body must be a JSON object, not {_KINDS.get(got, got)}")
    choices = _choices(cls, path)
    if msg.startswith("Invalid enum value") and choices:
        value = msg.removeprefix("Invalid enum value ").strip()
        return invalid(
            f"{where} must be {' or '.join(map(repr, choices))}, not {clip(value, 64)}", _top(path)
        )
    return invalid(f"{where}{_words(msg)}", _top(path))


def _tensor_name(raw: bytes | memoryview, key: str, i: int) -> str | None:
    """The name of a refused body's ``inputs[i]`` (read again, untyped: a refusal's cost only)."""
    try:
        item = msgspec.json.decode(raw)[key][i]
    except (msgspec.DecodeError, RecursionError, LookupError, TypeError):
        return None
    name = item.get("name") if isinstance(item, dict) else None
    return name if isinstance(name, str) else None


def _top(path: str) -> str:
    return re.split(r"[.\[]", path, maxsplit=1)[0]


_KINDS = {
    "str": "a string", "int": "an integer", "float": "a number", "bool": "true or false", "array": "a list",
    "object": "an object", "null": "null",
}  # fmt: skip


def _words(msg: str) -> str:
    """msgspec's "Expected `int` >= 1, got `0`" as "must be an integer >= 1, not 0"."""
    m = re.fullmatch(r"Expected `([^`]+)`(.*?)(?:, got `([^`]+)`)?", msg, re.S)
    if m is None:
        return ": " + msg[:1].lower() + msg[1:].replace("`", "")
    kinds = [_KINDS.get(k, k) for k in m[1].split(" | ") if k != "null"] or ["null"]
    bound = m[2]
    if bound == " of length >= 1":
        kinds, bound = [k.replace("a ", "a non-empty ", 1) for k in kinds], ""
    elif bound in (f" <= {2**63 - 1}", f" >= {-(2**63)}"):  # Int64's bounds
        kinds, bound = ["a 64-bit integer"], ""
    got = {**_KINDS, "bool": "a boolean"}.get(m[3], m[3]) if m[3] else None
    return f" must be {' or '.join(kinds)}{bound}" + (f", not {clip(got, 64)}" if got else "")


def _choices(cls: type | None, path: str) -> tuple:
    """The values a field's Literal takes (a top-level field, or the items of a top-level list),
    for an enum refusal that lists them."""
    if not isinstance(cls, type) or "." in path:
        return ()
    todo = [typing.get_type_hints(cls).get(_top(path))]
    while todo:
        hint = todo.pop()
        if typing.get_origin(hint) is Literal:
            return typing.get_args(hint)
        todo.extend(typing.get_args(hint))
    return ()


_IGNORED_NAMES: set[str] = set()
_IGNORED_MAX = 256  # distinct names logged; past it, none more (a caller cannot grow the set)


def ignored(path: str, names: list[str]) -> None:
    """Logs each unknown field name once (TEI, infinity and Cohere ignore them; so do we)."""
    for name in names:
        key = clip(name, 64)
        if key not in _IGNORED_NAMES and len(_IGNORED_NAMES) < _IGNORED_MAX:
            _IGNORED_NAMES.add(key)
            log.info("ignoring unknown field %r (first seen on %s; TEI, infinity and Cohere ignore them too)",
                     key, clip(path, 64))  # fmt: skip


def read(raw: bytes, cls: type[Body], path: str, fields: dict[str, msgspec.Raw] | None = None) -> Any:
    """``raw`` as a ``cls``; on a body that ignores unknown fields, their names logged once each
    (``fields``: the top-level fields when the caller has them already)."""
    if cls.__struct_config__.forbid_unknown_fields:
        return decode(raw, cls)
    body = decode(raw, cls)  # first: a malformed body is refused by its own words
    known = cls.__struct_fields__
    if fields is None:
        fields = _KEYS.decode(raw)
    unknown = [k for k in fields if k not in known]
    if unknown:
        ignored(path, sorted(unknown))
    return body
