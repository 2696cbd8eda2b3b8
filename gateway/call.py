"""The call every transport translates its wire format into, and the answer it translates back.

Plain Python: no protobuf, no JSON. gRPC reads a ``ModelInferRequest`` into a ``Call``
(gateway/transport/grpc.py ``call_of``) and writes an ``Answer`` as a ``ModelInferResponse``;
REST builds the ``Call`` straight from its JSON (and binary extension) body and writes JSON from
the ``Answer``'s arrays. The pipeline (gateway/infer.py) and the codec (gateway/codec.py) see
only these types.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

# A parameter's value as the caller sent it: KServe's bool, int64/uint64, double or string.
Param = bool | int | float | str


@dataclass(slots=True)
class Tensor:
    """One input as sent: exactly one of ``raw`` (KServe's binary layout: the values' little-endian
    bytes, or for BYTES a 4-byte length before each element) and ``values`` (typed values in
    row-major order: numbers, bools, or bytes for BYTES) is set; neither when the wire carried no
    data for it (the codec names what is missing)."""

    name: str
    datatype: str
    shape: Sequence[int]
    raw: bytes | memoryview | None = None
    values: Sequence | None = None
    parameters: dict[str, Param] = field(default_factory=dict)


@dataclass(slots=True)
class Wanted:
    """An output the caller asked for by name, with its parameters (``binary_data``, …)."""

    name: str
    parameters: dict[str, Param] = field(default_factory=dict)


@dataclass(slots=True)
class Call:
    model: str
    version: str = ""
    id: str = ""
    inputs: list[Tensor] = field(default_factory=list)
    outputs: list[Wanted] = field(default_factory=list)  # none named: every output
    parameters: dict[str, Param] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        """The row count the first input declares (admission runs on it before any decoding)."""
        shape = self.inputs[0].shape if self.inputs else ()
        return max(shape[0], 0) if len(shape) else 0


@dataclass(slots=True)
class Output:
    name: str
    datatype: str
    array: np.ndarray
    binary: bool  # the caller asked for it as raw bytes (the default) rather than typed values


@dataclass(slots=True)
class Answer:
    model: str
    version: str
    id: str
    outputs: list[Output]
    tokens: list[int] | None = None  # a list of texts: each text's token count, as the model saw it


# -- text calls --------------------------------------------------------------------------------
# Every text wire (OpenAI, TEI REST and gRPC, Cohere, infinity/vLLM shapes) parses its body into
# one ``TextCall`` and formats one ``TextAnswer``; the pipeline (``Pipeline.texts``) makes every
# model decision once (which model, its defaults and prompts, limits, what token ids mean, the
# Matryoshka cut, normalisation, scores' activation, quantised vectors). A wire never looks a
# model up and never computes on vectors.

# What a call asks the model for (``TextCall.output``):
#   dense          one vector per text (the model's embedding; ``TextAnswer.dense``)
#   sparse         vocabulary weights per text (``TextAnswer.sparse``: (indices, values) per row)
#   tokens         one vector per token of each text (``TextAnswer.token_vectors``)
#   scores         one relevance score per document for ``query`` (``TextAnswer.scores``)
#   labels         each label's score per text or pair (``TextAnswer.scores`` [n, labels])
OUTPUTS = ("dense", "sparse", "tokens", "scores", "labels")
# Forms of dense vectors a call may ask for besides float (Cohere's ``embedding_types``).
VECTOR_TYPES = ("float", "int8", "uint8", "binary", "ubinary")


@dataclass(slots=True)
class TextCall:
    """One text call, as a wire read it. ``None`` means "the wire did not say": the pipeline
    decides from the model (its settings, then the server's)."""

    output: str  # one of OUTPUTS
    model: str | None = None  # None: the server's default model for ``output`` (TEI's root)
    texts: list[str] = field(default_factory=list)  # texts; for "scores" the documents
    ids: list[list[int]] | None = None  # token ids instead of ``texts``
    ids_from: str = "model"  # whose ids: "model" (its tokenizer) or "openai" (setting openai_token_ids)
    query: str | None = None  # "scores": the query each document is scored against
    pairs: bool = False  # "labels": each text is a pair, joined by text.PAIR_SEPARATOR
    truncate: bool | None = None  # None: the model's truncate setting
    left: bool = False  # a cut keeps the text's last tokens (TEI's truncation_direction Left)
    max_tokens: int | None = None  # cut each text to at most this many tokens (Cohere's max_tokens_per_doc)
    prompt_name: str | None = None  # one of the model's prompts
    input_type: str | None = None  # Cohere's input_type, mapped to the model's prompts
    dimensions: int | None = None  # Matryoshka cut (None: the model's own size)
    normalize: bool | None = None  # None: the model's vectors as it makes them
    raw_scores: bool = False  # "scores"/"labels": the model's logits, no sigmoid/softmax
    types: tuple[str, ...] = ("float",)  # "dense": forms wanted, of VECTOR_TYPES
    parameters: dict[str, Param] = field(default_factory=dict)  # latency_class, latency_budget_ms
    field: str = "input"  # the body field holding the texts, named by refusals
    long_inputs: str | None = None  # "truncate" or "chunk" (None: the model's parameter long_inputs)
    late_chunking: bool = False  # "dense": the texts are consecutive chunks of one document, embedded
    # in one pass (as far as the model's length allows) and pooled per chunk (Jina's late_chunking)
    max_chunks: int | None = None  # "scores": a long document split into at most this many chunks,
    # scored by its best (Cohere's max_chunks_per_doc)


@dataclass(slots=True)
class TextAnswer:
    model: str
    version: str
    kind: str  # the model's kind (parameter ``kind``)
    tokens: list[int]  # each text's token count as the model saw it (after any cut)
    dense: dict[str, np.ndarray] = field(default_factory=dict)  # type -> [n, dim] (binary: packed bits)
    sparse: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)  # per text (indices, values)
    token_vectors: list[np.ndarray] = field(default_factory=list)  # per text [tokens, dim]
    scores: np.ndarray | None = None  # "scores": [n]; "labels": [n, labels]
    labels: tuple[str, ...] = ()  # "labels": the label of each column of ``scores``
    texts: list[str] = field(default_factory=list)  # the texts as given (for return_documents)
