"""Every REST answer's body as a type (msgspec ``Struct``s), beside the requests' in bodies.py: the
OpenAPI document's answer schemas are generated from these (gateway/transport/openapi.py), and the
contract fuzz (tests/test_openapi.py, schemathesis) fails on an answer that does not match them.

Answers are open (a client must not break on a field added later); a field some answers lack has
a default, so it is not required.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

Count = Annotated[int, Meta(ge=0)]
Vector = list[float]


# -- the error shapes ------------------------------------------------------------------------------


class KServeError(Struct, forbid_unknown_fields=True):
    """KServe v2 / Triton's error."""

    error: str


class OpenAIErrorBody(Struct, forbid_unknown_fields=True):
    message: str
    type: Literal["invalid_request_error", "permission_error", "rate_limit_error", "server_error"]
    param: str | None
    code: str | None


class OpenAIError(Struct, forbid_unknown_fields=True):
    """OpenAI's error (also Cohere/Jina's /v1/rerank and vLLM's routes)."""

    error: OpenAIErrorBody


class TEIError(Struct, forbid_unknown_fields=True):
    """Hugging Face text-embeddings-inference's error."""

    error: str
    error_type: Literal["validation", "unauthorized", "overloaded", "unhealthy", "backend", "empty"]


class CohereError(Struct, forbid_unknown_fields=True):
    """Cohere's error (`/v2/rerank`, `/v2/embed`); the SDK raises its error class by the status."""

    id: str
    message: str


# -- KServe v2 -------------------------------------------------------------------------------------


class Live(Struct):
    live: Literal[True]


class Ready(Struct):
    ready: bool


class ServerMetadata(Struct):
    name: str
    version: str
    extensions: list[str] = []


class TensorMetadata(Struct):
    name: str
    datatype: str
    shape: list[int] = []


class ModelMetadata(Struct):
    name: str
    versions: list[str] = []
    platform: str = ""
    inputs: list[TensorMetadata] = []
    outputs: list[TensorMetadata] = []
    batchgate: Annotated[
        dict[str, Any], Meta(description="batchgate's: which engine variant serves and how it was chosen.")
    ] = {}


class ModelReady(Struct):
    name: str
    ready: Literal[True]


class StringValue(Struct):
    string_value: str = ""


class ModelConfig(Struct):
    """Triton's model configuration (model_config.proto) as JSON, defaults left out."""

    name: str = ""
    platform: str = ""
    backend: str = ""
    max_batch_size: int = 0
    input: list[dict[str, Any]] = []
    output: list[dict[str, Any]] = []
    instance_group: list[dict[str, Any]] = []
    dynamic_batching: dict[str, Any] = {}
    parameters: dict[str, StringValue] = {}


class Duration(Struct):
    count: Count
    ns: Count


class BatchStats(Struct):
    batch_size: Count = 0


class ModelStatistics(Struct):
    name: str
    version: str
    inference_count: Count
    execution_count: Count
    inference_stats: dict[str, Duration]
    last_inference: Count = 0
    batch_stats: list[BatchStats] = []
    memory_usage: list[dict[str, Any]] = []
    response_stats: dict[str, Any] = {}


class ModelStatisticsResponse(Struct):
    model_stats: list[ModelStatistics]


class RepositoryModel(Struct):
    name: str
    version: str = ""
    state: Literal["READY", "UNAVAILABLE"] = "READY"
    reason: str = ""


RepositoryIndex = list[RepositoryModel]


class OutputParameters(Struct):
    binary_data_size: Count = 0


class InferOutputTensor(Struct):
    name: str
    datatype: str
    shape: list[int]
    data: list[Any] = []
    parameters: OutputParameters | None = None


class InferenceResponse(Struct):
    model_name: str
    outputs: list[InferOutputTensor]
    model_version: str = ""
    id: str = ""


# -- OpenAI ----------------------------------------------------------------------------------------


class Embedding(Struct):
    object: Literal["embedding"]
    index: Count
    embedding: Annotated[
        Vector | str,
        Meta(description="The vector; with encoding_format base64, its little-endian float32 bytes."),
    ]


class EmbeddingsUsage(Struct):
    prompt_tokens: Count
    total_tokens: Count


class EmbeddingsResponse(Struct):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingsUsage


class Model(Struct):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    kind: Annotated[
        Literal["embedding", "sparse_embedding", "classification", "rerank"],
        Meta(description="batchgate's: what the model serves (its parameter `kind`), so a caller knows which "
             "route to send it (embedding: /v1/embeddings; rerank: /v1/rerank, /v2/rerank, /score; "
             "classification: /classify, /predict; sparse_embedding: /embed_sparse)."),
    ]  # fmt: skip


class ModelList(Struct):
    object: Literal["list"]
    data: list[Model]


class UsageResult(Struct):
    object: Literal["organization.usage.embeddings.result"]
    input_tokens: Count
    num_model_requests: Count
    project_id: Annotated[str | None, Meta(description="The tenant (with group_by project_id).")]
    model: Annotated[str | None, Meta(description="The model (with group_by model).")]
    user_id: None = None
    api_key_id: None = None


class UsageBucket(Struct):
    object: Literal["bucket"]
    start_time: int
    end_time: int
    results: list[UsageResult]


class UsagePage(Struct):
    object: Literal["page"]
    data: list[UsageBucket]
    has_more: bool
    next_page: Annotated[str | None, Meta(description="The `page` of the next buckets.")]


# -- TEI -------------------------------------------------------------------------------------------


class Pooling(Struct):
    pooling: str


class Labels(Struct):
    id2label: dict[str, str]
    label2id: dict[str, Count]


class EmbeddingType(Struct, forbid_unknown_fields=True):
    embedding: Pooling


class ClassifierType(Struct, forbid_unknown_fields=True):
    classifier: Labels


class RerankerType(Struct, forbid_unknown_fields=True):
    reranker: Labels


class Info(Struct):
    """TEI's `/info` for the route's model; `kind`, `max_text_bytes`, `pairs`, `prompts`,
    `matryoshka_dimensions`, `vector_ranges` and `selection` are batchgate's."""

    model_id: str
    model_dtype: str
    model_type: dict[str, Any]  # one of EmbeddingType, ClassifierType, RerankerType (see model_type's schema)
    max_input_length: Count
    max_batch_tokens: Count
    auto_truncate: bool
    version: str
    model_sha: str | None = None
    max_concurrent_requests: Count = 0
    max_batch_requests: Count | None = None
    max_client_batch_size: Count = 0
    tokenization_workers: Count = 0
    sha: str | None = None
    docker_label: str | None = None
    kind: str = ""
    max_text_bytes: Count = 0
    pairs: bool = False
    prompts: list[str] = []
    matryoshka_dimensions: list[Count] = []
    vector_ranges: Annotated[
        dict[str, Any], Meta(description="The per-dimension ranges int8/uint8 vectors are quantised with "
                             "(calibrated once per model), where the model has them.")
    ] = {}  # fmt: skip
    selection: Annotated[
        dict[str, Any], Meta(description="The engine and precision chosen for this host.")
    ] = {}


class Token(Struct):
    id: Count
    text: str
    special: bool
    start: Count | None = None
    stop: Count | None = None


class RankedText(Struct):
    index: Count
    score: float
    text: str = ""


class RankedDocument(Struct):
    text: str


class Ranked(Struct):
    index: Count
    relevance_score: float
    document: RankedDocument | None = None


class RerankUsage(Struct):
    prompt_tokens: Count = 0
    total_tokens: Count = 0


class RerankResultsResponse(Struct):
    """infinity's and vLLM's answer to `documents`: by relevance, the first `top_n`."""

    object: Literal["rerank"]
    model: str
    results: list[Ranked]
    usage: RerankUsage
    id: str = ""
    created: int = 0


class SparseValue(Struct):
    index: Count
    value: float


class Prediction(Struct):
    score: float
    label: str


EmbedResponse = list[Vector]
RerankResponse = Annotated[
    list[RankedText] | RerankResultsResponse,
    Meta(
        description="TEI's answer to `texts` (highest score first), or infinity's and vLLM's to `documents`."
    ),
]
TokenizeResponse = list[list[Token]]
DecodeResponse = list[str]
EmbedAllResponse = list[list[Vector]]
EmbedSparseResponse = list[list[SparseValue]]
SimilarityResponse = list[float]
PredictResponse = Annotated[
    list[Prediction | list[Prediction]],
    Meta(
        description="The labels by score, highest first: one list for one input, a list per row for a batch."
    ),
]


# -- vLLM ------------------------------------------------------------------------------------------


class VllmUsage(Struct):
    prompt_tokens: Count
    total_tokens: Count
    completion_tokens: Count = 0
    prompt_tokens_details: None = None


class Classification(Struct):
    index: Count
    label: str
    probs: list[float]
    num_classes: Count


class ClassifyResponse(Struct):
    object: Literal["list"]
    data: list[Classification]
    model: str
    usage: VllmUsage
    id: str = ""
    created: int = 0


class Score(Struct):
    index: Count
    object: Literal["score"]
    score: float


class ScoreResponse(Struct):
    """One score per pair, in the order of `text_2`: the sigmoid of the model's logit."""

    object: Literal["list"]
    data: list[Score]
    model: str
    usage: VllmUsage
    id: str = ""
    created: int = 0


# -- Cohere ----------------------------------------------------------------------------------------


class ApiVersion(Struct):
    version: str = ""


class BilledUnits(Struct):
    input_tokens: Count = 0
    search_units: Count = 0


class CohereMeta(Struct):
    api_version: ApiVersion | None = None
    billed_units: BilledUnits | None = None


class V2RerankResponse(Struct):
    """By relevance (the sigmoid of the model's logit), highest first, the first `top_n`."""

    id: str
    results: list[Ranked]
    meta: CohereMeta


class EmbeddingsByType(Struct):
    """One list of vectors per type asked for, in the texts' order."""

    float: list[Vector] = []
    int8: list[list[int]] = []
    uint8: list[list[int]] = []
    binary: list[list[int]] = []
    ubinary: list[list[int]] = []
    base64: list[str] = []


class V2EmbedResponse(Struct):
    id: str
    response_type: Literal["embeddings_by_type"]
    embeddings: EmbeddingsByType
    texts: list[str]
    meta: CohereMeta


class V1RerankUsage(Struct):
    total_tokens: Count = 0


class V1RerankResponse(Struct):
    model: str
    results: list[Ranked]
    usage: V1RerankUsage | None = None
    meta: dict[str, Any] = {}


# -- this contract ---------------------------------------------------------------------------------


class OpenAPIDocument(Struct):
    openapi: str
    paths: dict[str, Any]
