"""The REST API's contract: an OpenAPI 3.1 document of every route the REST listener serves, at
``GET /openapi.json``, and Swagger UI to browse it at ``GET /docs``.

The document is generated: every schema from the types the wires decode their bodies into
(gateway/transport/bodies.py) and the answers' types (answers.py), four of them the error shapes
(KServe's ``{"error"}``, OpenAI's ``{"error": {message, type, param, code}}``, TEI's
``{"error", "error_type"}``, Cohere's ``{"id", "message"}``); the operations from one table here
(``ROUTES``: method, path, body and answer types, summary, statuses). The bodies of other servers'
wires follow those servers: TEI's, Cohere's and vLLM/infinity's ignore unknown fields (their
schemas are open), OpenAI's ``/v1/embeddings`` refuses them (closed: ``forbid_unknown_fields``).
It cannot drift silently: tests/test_openapi.py fails when the app registers a route the table
lacks (or the other way round), and fuzzes a live server from it with schemathesis, which fails on
any answer whose status or body the document does not describe.

Swagger UI comes from the ``swagger-ui-py`` package's bundled assets, served by this server under
``/docs/static/`` (no CDN: the page works on a machine with no way out). ``swagger-ui-bundle`` was the
first choice, but its newest release bundles Swagger UI 4.15, which refuses to render a 3.1
document; swagger-ui-py bundles Swagger UI 5. Neither route asks for an API key: the contract is
no secret, and a caller needs it before it has a key.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from batchgate.gateway.scheduling.request import MIN_BUDGET_MS
from batchgate.gateway.transport import answers, bodies
from batchgate.gateway.transport.fields import LATENCY_BUDGET_HEADER, LATENCY_CLASS_HEADER, MAX_INPUTS
from batchgate.gateway.transport.kserve_rest import HEADER_LENGTH

EXAMPLE_MODEL = bodies.EXAMPLE_MODEL  # the model the examples name (the bundled text embedding model)

VERSION = "0.1.0"
# The files of Swagger UI the page loads; nothing else under the package's static folder is served.
ASSETS = {
    "swagger-ui.css": "text/css",
    "swagger-ui-bundle.js": "text/javascript",
    "favicon-32x32.png": "image/png",
    "favicon-16x16.png": "image/png",
}
MODEL_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$"  # gateway/infer.py _MODEL_NAME: what a repository folder may be

PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>batchgate REST API</title>
<link rel="stylesheet" href="docs/static/swagger-ui.css">
<link rel="icon" type="image/png" href="docs/static/favicon-32x32.png" sizes="32x32">
</head>
<body>
<div id="swagger-ui"></div>
<script src="docs/static/swagger-ui-bundle.js" charset="utf-8"></script>
<script>
window.ui = SwaggerUIBundle({url: "openapi.json", dom_id: "#swagger-ui", deepLinking: true,
  docExpansion: "list", defaultModelsExpandDepth: 0});
</script>
</body>
</html>
"""
# (Relative links: behind a proxy that mounts the server under a prefix the page still finds its
# files and the document.)


# -- building blocks ---------------------------------------------------------------------------------


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict) -> dict:
    return {"application/json": {"schema": schema}}


def _obj(properties: dict, required: tuple[str, ...] = (), closed: bool = False, **extra) -> dict:
    out: dict[str, Any] = {"type": "object", "properties": properties, **extra}
    if required:
        out["required"] = list(required)
    if closed:
        out["additionalProperties"] = False
    return out


_STR = {"type": "string"}
_INT = {"type": "integer"}
_NUM = {"type": "number"}
_BOOL = {"type": "boolean"}
_COUNTER = {"type": "integer", "minimum": 0}

# What each status means, per API family (the error body is the family's own shape).
_WHY = {
    400: "The request is malformed: not JSON, a missing or mistyped field, an unknown model version string, "
    f"a latency budget (`{LATENCY_BUDGET_HEADER}` or `latency_budget_ms`) that is not a finite number of at least "
    f"{MIN_BUDGET_MS:g} ms (the message names which).",
    401: "No API key, or an unknown one (`Authorization: Bearer <key>` or `x-api-key`; only with a tenant file).",
    403: "The tenant may not call this model (or, for load/unload: model control is off, or the tenant is no admin).",
    404: "No such model (or version).",
    408: "The request body did not arrive within `http_body_timeout_s`; the connection closes.",
    413: "The request body is larger than `max_http_body_bytes` (refused from its Content-Length before it is "
    "read); the connection closes.",
    422: "TEI: the request failed validation (a missing field or one of the wrong type, no such option, a model "
    "of another kind).",
    424: "TEI: the model failed to compute the batch.",
    429: "The tenant's rate limit (or stream quota) is spent; `Retry-After` says when to try again.",
    500: "The model failed to execute the batch (not the caller's fault).",
    501: "A KServe/Triton feature batchgate does not offer (the classification extension, load overrides).",
    503: "Not ready, draining, a full queue, or the overload gate refusing new calls; `Retry-After` when known.",
    504: "The call's latency budget cannot be met: shed at admission (work queued ahead; `Retry-After` when "
    "waiting would help, none when the model's own compute alone exceeds the budget), or it expired in the queue.",
}
_TEXT_413 = (
    "The request body is larger than `max_http_body_bytes` (the connection closes), or it holds more than "
    f"{MAX_INPUTS} texts, or a text longer than the model's `max_text_bytes` / `max_tokens` (unless `truncate`)."
)
_ERROR_SCHEMA = {"kserve": "KServeError", "openai": "OpenAIError", "tei": "TEIError", "cohere": "CohereError"}
_RETRY = {
    "Retry-After": {"description": "Seconds to wait before trying again.", "schema": _INT},
    "retry-after-ms": {"description": "The same hint in milliseconds.", "schema": _INT},
}


def _errors(family: str, statuses: tuple[int, ...], overrides: dict | None = None) -> dict:
    out = {}
    for status in statuses:
        why = (overrides or {}).get(status) or (
            _TEXT_413 if status == 413 and family != "kserve" else _WHY[status]
        )
        resp: dict[str, Any] = {"description": why, "content": _json(_ref(_ERROR_SCHEMA[family]))}
        if status in (429, 503):
            resp["headers"] = dict(_RETRY)
        out[str(status)] = resp
    return out


def _ok(description: str, schema: dict | None = None, **extra) -> dict:
    resp: dict[str, Any] = {"description": description, **extra}
    if schema is not None:
        resp["content"] = _json(schema)
    return resp


def _path_param(name: str) -> dict:
    if name == "name":  # Swagger UI's files: an allow-list
        return {
            "name": "name",
            "in": "path",
            "required": True,
            "schema": {"type": "string", "enum": sorted(ASSETS)},
        }
    if name == "model":
        schema = {"type": "string", "pattern": MODEL_NAME, "maxLength": 128, "examples": [EXAMPLE_MODEL]}
        return {
            "name": "model",
            "in": "path",
            "required": True,
            "schema": schema,
            "description": "A model name.",
        }
    return {
        "name": "version",
        "in": "path",
        "required": True,
        "schema": {"type": "string", "pattern": r"^[0-9]{1,18}$", "examples": ["1"]},
        "description": "A model version (a whole number; the repository's version folder).",
    }


_OPEN: list = []  # security: [] -- no API key asked
_KEYED = [{}, {"bearer": []}, {"apiKey": []}]  # a key when the server has a tenant file; none when open
_HEADER = {
    "request_id": {
        "name": "x-request-id", "in": "header", "required": False,
        "schema": {"type": "string", "maxLength": 128},
        "description": "A request id, echoed in the answer and written to the logs.",
    },
    "latency_class": {
        "name": LATENCY_CLASS_HEADER, "in": "header", "required": False, "schema": _STR,
        "description": "A latency class (e.g. `realtime`, `batch`); the body's `latency_class` wins.",
    },
    "latency_budget": {
        "name": LATENCY_BUDGET_HEADER, "in": "header", "required": False,
        "schema": {"type": "number", "minimum": MIN_BUDGET_MS},
        "description": "The call's latency budget in milliseconds; the body's `latency_budget_ms` wins. "
        f"Not a finite number of at least {MIN_BUDGET_MS:g} ms: 400 (422 on TEI's routes) naming the header.",
    },
}  # fmt: skip


def _query(name: str, schema: dict, description: str, required: bool = False) -> dict:
    return {"name": name, "in": "query", "required": required, "schema": schema, "description": description}


_NAMES = {"type": "array", "items": _STR}
_USAGE_QUERY = [
    _query("start_time", {"type": "integer", "minimum": 0}, "Unix seconds: the first bucket's start.", True),
    _query("end_time", {"type": "integer", "minimum": 0}, "Unix seconds: the end (default now)."),
    _query("bucket_width", {"type": "string", "enum": ["1m", "1h", "1d"], "default": "1d"}, "A bucket's width."),
    _query("limit", {"type": "integer", "minimum": 1}, "Buckets per page (1m: 1440, 1h: 168, 1d: 31 at most)."),
    _query("page", {"type": "integer", "minimum": 0}, "The previous page's `next_page`."),
    _query(
        "group_by", {"type": "array", "items": {"type": "string", "enum": ["project_id", "model"]}},
        "Group by tenant (`project_id`) and/or model.",
    ),
    _query("models", _NAMES, "Only these models."),
    _query("project_ids", _NAMES, "Only these tenants."),
]  # fmt: skip


# -- the routes --------------------------------------------------------------------------------------

_KSERVE_BODY_ERRORS = (400, 401, 408, 413)
_KSERVE_INFER_ERRORS = (400, 401, 403, 404, 408, 413, 429, 500, 501, 503, 504)
_OPENAI_ERRORS = (400, 401, 403, 404, 408, 413, 429, 500, 501, 503, 504)
_COHERE_ERRORS = _OPENAI_ERRORS
_TEI_ERRORS = (400, 401, 403, 404, 408, 413, 422, 424, 429, 501, 503, 504)
_TEI_400 = {400: "TEI: an empty list of inputs (`error_type` `empty`)."}
_TEXT = ("request_id", "latency_class", "latency_budget")  # the headers a text call reads
_BINARY = {"type": "string", "format": "binary"}


@dataclass(frozen=True)
class Route:
    """One operation of the document: a route the app registers, its body and answer types
    (gateway/transport/bodies.py, answers.py) and what the document says of it."""

    method: str
    path: str
    op: str  # operationId
    tag: str
    summary: str
    answer: Any  # the 200 answer's type; a dict: that content as it is; None: no body
    ok: str  # what the 200 means
    errors: str = "kserve"  # whose error shape: kserve, openai, tei, cohere
    statuses: tuple[int, ...] = ()
    body: Any = None  # the request body's type; a tuple: any of them
    body_required: bool = True
    headers: tuple[str, ...] = ()
    keyed: bool = True  # an API key when the server has a tenant file
    description: str = ""
    why: dict[int, str] = field(default_factory=dict)  # a status's reason on this route
    responses: dict[str, dict] = field(default_factory=dict)  # other answers, as they are
    parameters: tuple[dict, ...] = ()  # query parameters
    binary: bool = False  # KServe infer: the binary tensor data extension's bodies too


def _kserve_model_routes(base: str) -> list[Route]:
    """The per-model KServe routes under ``base`` (with or without ``/versions/{version}``)."""
    versioned = "{version}" in base
    v = "Versioned" if versioned else ""
    lookup = ((400, 404) if versioned else (404,)) + (503,)
    return [
        Route("GET", base, f"modelMetadata{v}", "KServe v2", "Model metadata: inputs, outputs, versions",
              answers.ModelMetadata, "The model's metadata.", statuses=lookup, keyed=False),
        Route("GET", base + "/ready", f"modelReady{v}", "KServe v2", "Is the model ready", answers.ModelReady,
              "Ready.", statuses=lookup, keyed=False),
        Route("GET", base + "/config", f"modelConfig{v}", "KServe v2",
              "The model's configuration (Triton's model_config)", answers.ModelConfig, "The configuration.",
              statuses=lookup, keyed=False),
        Route("GET", base + "/stats", f"modelStatistics{v}", "KServe v2",
              "The model's statistics (Triton's statistics extension)", answers.ModelStatisticsResponse,
              "Counts and durations.", statuses=(400, 401, 404) if versioned else (401, 404)),
        Route("POST", base + "/infer", f"infer{v}", "KServe v2",
              "Inference (KServe v2 REST, Triton's binary tensor data extension)", answers.InferenceResponse,
              "The outputs: JSON, or (binary data asked for) the JSON header followed by the raw tensors, with "
              f"`{HEADER_LENGTH}` giving the header's length.", statuses=_KSERVE_INFER_ERRORS,
              body=bodies.InferenceRequest, headers=("request_id",), binary=True,
              description="The API key (with a tenant file) and the overload gate are checked from the headers "
              "before the body is read."),
    ]  # fmt: skip


def _tei_routes(base: str) -> list[Route]:
    """TEI's routes at the root, and again under ``/tei/{model}`` (that model's own TEI server)."""
    s = "Model" if base else ""

    def call(name: str, summary: str, ok: str, body, answer, op: str = "") -> Route:
        return Route("POST", f"{base}/{name}", op or name + s, "TEI", summary, answer, ok, "tei", _TEI_ERRORS,
                     body, headers=_TEXT, why=_TEI_400)  # fmt: skip

    probes = [
        Route("GET", (base + path) or "/", f"{op}{s}", "TEI", "Whether the model is loaded and the server not "
              "draining" + ("" if path == "/health" else " (TEI's health, at this path too)"), None, "Healthy.",
              "tei", (404, 422, 503), keyed=False)
        for path, op in (("/health", "health"), ("/ping", "ping"), ("", "root"))
    ]  # fmt: skip
    entries = [
        Route("POST", (base + path) or "/", f"{op}{s}", "TEI",
              "The call the model's kind answers (TEI's entry route: what `InferenceClient(base_url=...)` posts)",
              {"application/json": {"schema": {"anyOf": [answers.EmbedResponse, answers.EmbedSparseResponse,
                                                          answers.RerankResponse, answers.PredictResponse,
                                                          answers.SimilarityResponse]}}},
              "The answer of the route the model's kind names.", "tei", _TEI_ERRORS,
              (bodies.EmbedRequest, bodies.EmbedSparseRequest, bodies.RerankRequest, bodies.PredictRequest,
               bodies.SimilarityRequest), headers=_TEXT, why=_TEI_400,
              description="An `inputs` object with `source_sentence` is a similarity call (`/similarity`, as "
              "`InferenceClient.sentence_similarity` sends it); otherwise the body is read as the model's kind "
              "asks: an embedding model `/embed`, a sparse one `/embed_sparse`, a reranker `/rerank`, a "
              "classifier `/predict`. Which model: the base URL's, else the body's `model`, else the server's "
              "default model (`tei_default_model`).")
        for path, op in (("", "entry"), ("/invocations", "invocations"))
    ]  # fmt: skip
    return [
        Route("GET", base + "/info", f"info{s}", "TEI", "The model's TEI info (what TEI's clients read first)",
              answers.Info, "The model.", "tei", (401, 404, 422, 503)),
        *probes,
        *entries,
        call("embed", "Embeddings of this model" if base else "Embeddings (Hugging Face TEI's API)",
             "One vector per input, in order.", bodies.EmbedRequest, answers.EmbedResponse),
        call("rerank", "Rerank texts with this model" if base else "Rerank texts against a query (TEI's API)",
             "Scores, highest first.", bodies.RerankRequest, answers.RerankResponse),
        call("tokenize", "Tokens of each text, with their offsets", "Per text, its tokens.", bodies.TokenizeRequest,
             answers.TokenizeResponse),
        call("decode", "Texts of token ids", "Per row of ids, its text.", bodies.DecodeRequest,
             answers.DecodeResponse),
        call("embed_all", "Every token's vector (models with output token_embeddings)",
             "Per text, one vector per token.", bodies.EmbedAllRequest, answers.EmbedAllResponse),
        call("embed_sparse", "Sparse (SPLADE) vectors as index/value pairs", "Per text, its non-zero weights.",
             bodies.EmbedSparseRequest, answers.EmbedSparseResponse),
        call("similarity", "Cosine of a sentence's embedding with each of others'", "One cosine per sentence.",
             bodies.SimilarityRequest, answers.SimilarityResponse),
        call("predict", "Sequence classification: every label's score, highest first",
             "The labels by score (a list per row for a batch).", bodies.PredictRequest, answers.PredictResponse),
    ]  # fmt: skip


_EMBEDDINGS = dict(
    ok="One vector per input, in order.", errors="openai", statuses=_OPENAI_ERRORS, body=bodies.EmbeddingsRequest,
    headers=_TEXT,
)  # fmt: skip

ROUTES: list[Route] = [
    # -- health, metrics, KServe v2
    Route("GET", "/v2/health/live", "live", "Health", "Liveness", answers.Live, "Alive.", keyed=False),
    Route("GET", "/v2/health/ready", "ready", "Health", "Readiness: every model loaded and the server not draining",
          answers.Ready, "Ready.", keyed=False,
          responses={"503": {"description": "Not ready (starting, a model failed, draining).",
                             "content": {"application/json": {"schema": answers.Ready}}}}),
    Route("GET", "/v2", "serverMetadata", "KServe v2", "Server metadata", answers.ServerMetadata,
          "Name, version and extensions.", keyed=False),
    Route("GET", "/metrics", "metrics", "Metrics", "Prometheus metrics", {"text/plain": {"schema": _STR}},
          "The Prometheus text exposition.", keyed=False),
    Route("POST", "/v2/repository/index", "repositoryIndex", "Repository",
          "The models in the repository and their state", answers.RepositoryIndex, "Every model, ready or not.",
          statuses=_KSERVE_BODY_ERRORS, body=bodies.RepositoryIndexRequest, body_required=False),
    Route("POST", "/v2/repository/models/{model}/load", "repositoryLoad", "Repository",
          "Load (or reload) a model from its directory", None, "Loaded and serving.",
          statuses=(*_KSERVE_BODY_ERRORS, 403, 404, 501, 503), body=bodies.RepositoryModelRequest,
          body_required=False, description="Needs `model_control` on, and with a tenant file an admin tenant.",
          why={400: "The body is malformed, or the model's directory cannot be served (the previous load keeps "
                    "serving)."}),
    Route("POST", "/v2/repository/models/{model}/unload", "repositoryUnload", "Repository",
          "Stop serving a model once its calls are answered", None, "Unloaded.",
          statuses=(*_KSERVE_BODY_ERRORS, 403, 404, 503), body=bodies.RepositoryModelRequest, body_required=False,
          description="Needs `model_control` on, and with a tenant file an admin tenant."),
    Route("GET", "/v2/models/stats", "statistics", "KServe v2", "Statistics of every model",
          answers.ModelStatisticsResponse, "Counts and durations.", statuses=(401,)),
    *_kserve_model_routes("/v2/models/{model}"),
    *_kserve_model_routes("/v2/models/{model}/versions/{version}"),
    # -- OpenAI
    Route("POST", "/v1/embeddings", "createEmbeddings", "OpenAI", "Embeddings (OpenAI's API)",
          answers.EmbeddingsResponse, description="An unknown model is 404 naming `GET /v1/models`.", **_EMBEDDINGS),
    Route("POST", "/embeddings", "createEmbeddingsRoot", "OpenAI",
          "Embeddings at the root (as TEI, infinity and vLLM serve it; the OpenAI SDK with `base_url` at the "
          "server's root calls it)", answers.EmbeddingsResponse,
          description="The same body and answer as `POST /v1/embeddings`.", **_EMBEDDINGS),
    Route("GET", "/v1/models", "listModels", "OpenAI", "The text models this caller may call", answers.ModelList,
          "The models.", "openai", (401,)),
    Route("GET", "/v1/models/{model}", "retrieveModel", "OpenAI", "One text model", answers.Model, "The model.",
          "openai", (401, 404)),
    Route("GET", "/v1/organization/usage/embeddings", "usageEmbeddings", "OpenAI",
          "Embeddings usage (OpenAI's usage API)", answers.UsagePage, "Buckets of input tokens and calls.", "openai",
          (400, 401, 501), parameters=tuple(_USAGE_QUERY),
          why={400: "A query parameter is missing, malformed or out of range (`param` names it).",
               501: "Usage metering is off on this server (`usage_metering`)."},
          description="This replica's figures. A tenant marked admin sees every tenant; another tenant only its "
          "own. `project_id` is the tenant."),
    # -- TEI
    *_tei_routes(""),
    *_tei_routes("/tei/{model}"),
    # -- vLLM
    *[Route("POST", path, op, "vLLM", "Score pairs with a cross-encoder (vLLM's API)", answers.ScoreResponse,
            "One score per pair, in order.", "openai", _OPENAI_ERRORS, bodies.ScoreRequest, headers=_TEXT)
      for path, op in (("/score", "score"), ("/v1/score", "v1Score"))],
    *[Route("POST", path, op, "vLLM", "Sequence classification (vLLM's / SGLang's API)", answers.ClassifyResponse,
            "Per input, the most probable label and every label's probability.", "openai", _OPENAI_ERRORS,
            bodies.ClassifyRequest, headers=_TEXT)
      for path, op in (("/classify", "classify"), ("/v1/classify", "v1Classify"))],
    # -- Cohere / Jina
    Route("POST", "/v2/rerank", "v2Rerank", "Cohere / Jina", "Rerank documents against a query (Cohere's v2 API)",
          answers.V2RerankResponse, "The first `top_n` documents by relevance.", "cohere", _COHERE_ERRORS,
          bodies.V2RerankRequest, headers=_TEXT),
    Route("POST", "/v2/embed", "v2Embed", "Cohere / Jina", "Embeddings in the types asked for (Cohere's v2 API)",
          answers.V2EmbedResponse, "Per type, one vector per text, in order.", "cohere", _COHERE_ERRORS,
          bodies.V2EmbedRequest, headers=_TEXT),
    Route("POST", "/v1/rerank", "v1Rerank", "Cohere / Jina", "Rerank documents against a query (Cohere's / Jina's "
          "API)", answers.V1RerankResponse, "The first `top_n` documents by relevance.", "openai", _OPENAI_ERRORS,
          bodies.V1RerankRequest, headers=_TEXT),
    # -- this contract
    Route("GET", "/openapi.json", "openapi", "Contract", "This document (OpenAPI 3.1)", answers.OpenAPIDocument,
          "The document.", keyed=False),
    Route("GET", "/docs", "docs", "Contract", "Swagger UI over this document", {"text/html": {"schema": _STR}},
          "The page.", statuses=(404,), keyed=False,
          why={404: "Swagger UI's files are not installed (swagger-ui-py)."}),
    Route("GET", "/docs/static/{name}", "docsAsset", "Contract", "Swagger UI's files (bundled with the server; no "
          "CDN)", {t: {"schema": _BINARY} for t in sorted(set(ASSETS.values()))}, "The file.", statuses=(404,),
          keyed=False, why={404: "No such file."}),
]  # fmt: skip


# -- the document, from the table and the types --------------------------------------------------------

_ERROR_TYPES = {"kserve": answers.KServeError, "openai": answers.OpenAIError, "tei": answers.TEIError,
                "cohere": answers.CohereError}  # fmt: skip


def _types() -> list:
    """Every type the document names: the error shapes, each route's body and answer types (the
    entry routes' several, the readiness 503's)."""
    out: list = list(_ERROR_TYPES.values())
    for r in ROUTES:
        for t in r.body if isinstance(r.body, tuple) else (r.body,):
            if t is not None:
                out.append(t)
        if r.answer is not None and not isinstance(r.answer, dict):
            out.append(r.answer)
        for content in ([r.answer] if isinstance(r.answer, dict) else []) + [
            resp.get("content", {}) for resp in r.responses.values()
        ]:
            out += [v["schema"] for v in content.values() if not isinstance(v["schema"], dict)]
            out += [t for v in content.values() if isinstance(v["schema"], dict)
                    for t in v["schema"].get("anyOf", ()) if not isinstance(t, dict)]  # fmt: skip
    return out


def _resolve(content: dict, schema_of) -> dict:
    """A content map with its types replaced by their schemas (an ``anyOf`` of types too)."""
    out = {}
    for media, spec in content.items():
        schema = spec["schema"]
        if not isinstance(schema, dict):
            schema = schema_of(schema)
        elif "anyOf" in schema:
            schema = {
                **schema,
                "anyOf": [t if isinstance(t, dict) else schema_of(t) for t in schema["anyOf"]],
            }
        out[media] = {**spec, "schema": schema}
    return out


def _operation(r: Route, schema_of) -> dict:
    if r.answer is None:
        responses: dict[str, Any] = {"200": _ok(r.ok)}
    elif isinstance(r.answer, dict):
        responses = {"200": {"description": r.ok, "content": _resolve(r.answer, schema_of)}}
    else:
        responses = {"200": _ok(r.ok, schema_of(r.answer))}
    if r.binary:
        responses["200"]["content"]["application/octet-stream"] = {"schema": _BINARY}
        responses["200"]["headers"] = {
            HEADER_LENGTH: {"description": "With binary output: the JSON header's length.", "schema": _INT}
        }
    for status, resp in r.responses.items():
        responses[status] = (
            {**resp, "content": _resolve(resp["content"], schema_of)} if "content" in resp else resp
        )
    responses.update(_errors(r.errors, r.statuses, r.why))
    op: dict[str, Any] = {"operationId": r.op, "tags": [r.tag], "summary": r.summary, "responses": responses}
    if r.description:
        op["description"] = r.description
    parameters = [_path_param(p) for p in re.findall(r"\{(\w+)\}", r.path)] + [_HEADER[h] for h in r.headers]
    parameters += r.parameters
    if parameters:
        op["parameters"] = parameters
    if r.body is not None:
        schema = {"anyOf": [schema_of(t) for t in r.body]} if isinstance(r.body, tuple) else schema_of(r.body)
        content = _json(schema)
        if r.binary:
            content["application/octet-stream"] = {"schema": {
                **_BINARY, "description": f"The JSON header, then the binary tensors; `{HEADER_LENGTH}` gives the "
                "header's length."}}  # fmt: skip
        op["requestBody"] = {"required": r.body_required, "content": content}
    op["security"] = _KEYED if r.keyed else _OPEN
    return op


def _schemas() -> tuple[dict, Any]:
    """(components' schemas, type -> its schema), generated from the types (msgspec's JSON Schema,
    the dialect OpenAPI 3.1 takes)."""
    types = _types()
    schemas, components = msgspec.json.schema_components(types, ref_template="#/components/schemas/{name}")
    by_id = {id(t): s for t, s in zip(types, schemas)}
    return components, lambda t: by_id[id(t)]


def paths() -> dict[str, dict]:
    """Every route of the table, by path and method."""
    _, schema_of = _schemas()
    out: dict[str, dict] = {}
    for r in ROUTES:
        out.setdefault(r.path, {})[r.method.lower()] = _operation(r, schema_of)
    return out


@functools.cache
def document() -> dict:
    """The OpenAPI 3.1 document (built once; callers must not change it)."""
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "batchgate REST API",
            "version": VERSION,
            "summary": "KServe v2 REST, OpenAI embeddings, TEI's whole REST surface, Cohere v2 embed/rerank, "
            "vLLM/infinity classify, score and rerank, served by one dynamic-batching gateway.",
            "description": "Every call (all APIs) goes through the same pipeline: API key, rate limits, "
            "latency class, batching with other callers. Errors come in each API's own shape: KServe's "
            '`{"error": ...}`, OpenAI\'s `{"error": {"message", "type", "param", "code"}}` (also '
            '`/v1/rerank`, `/classify` and `/score`), TEI\'s `{"error", "error_type"}`, Cohere\'s '
            '`{"id", "message"}` (`/v2/*` but KServe\'s `/v2/models`, `/v2/health`, `/v2/repository`). '
            "Unknown body fields are refused on `/v1/embeddings` (as OpenAI refuses them) and ignored "
            "everywhere else among the text APIs (as TEI, Cohere, infinity and vLLM ignore them). A path or "
            "method the server does not serve is answered 404/405 with KServe's shape. An API key is needed "
            "only when the server has a tenant file (`api_keys_file`).",
            "license": {"name": "Apache-2.0", "identifier": "Apache-2.0"},
        },
        "tags": [
            {"name": n}
            for n in (
                "KServe v2",
                "Repository",
                "Health",
                "Metrics",
                "OpenAI",
                "TEI",
                "vLLM",
                "Cohere / Jina",
                "Contract",
            )
        ],
        "paths": paths(),
        "components": {
            "schemas": _schemas()[0],
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "`Authorization: Bearer <key>`",
                },
                "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
            },
        },
    }


# -- serving -----------------------------------------------------------------------------------------


@functools.cache
def _document_bytes() -> bytes:
    return json.dumps(document(), separators=(",", ":")).encode()


@functools.cache
def static_dir() -> Path | None:
    """swagger-ui-py's static folder, found without importing the package (it imports Jinja)."""
    spec = importlib.util.find_spec("swagger_ui")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))) / "static"
    return folder if (folder / "swagger-ui-bundle.js").is_file() else None


def _missing() -> web.Response:
    return web.json_response(
        {"error": "Swagger UI's files are not installed: pip install swagger-ui-py"}, status=404
    )


async def openapi_json(_req: web.Request) -> web.Response:
    return web.Response(body=_document_bytes(), content_type="application/json")


async def docs(_req: web.Request) -> web.Response:
    if static_dir() is None:
        return _missing()
    return web.Response(text=PAGE, content_type="text/html")


async def asset(req: web.Request) -> web.StreamResponse:
    name = req.match_info["name"]
    folder = static_dir()
    if name not in ASSETS:  # an allow-list: no path from the caller ever reaches the file system
        return web.json_response({"error": "no such file"}, status=404)
    if folder is None:
        return _missing()
    return web.FileResponse(
        folder / name, headers={"Content-Type": ASSETS[name], "Cache-Control": "public, max-age=86400"}
    )


def routes() -> list[web.RouteDef]:
    """``GET /openapi.json``, ``GET /docs`` and Swagger UI's files (the HTTP listener's ``app()`` adds them)."""
    return [
        web.get("/openapi.json", openapi_json),
        web.get("/docs", docs),
        web.get("/docs/static/{name}", asset),
    ]
