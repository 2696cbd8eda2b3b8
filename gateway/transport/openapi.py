"""The REST API's contract: an OpenAPI 3.1 document of every route the REST listener serves, at
``GET /openapi.json``, and Swagger UI to browse it at ``GET /docs``.

The document is written here by hand from the handlers (gateway/transport/kserve_rest.py,
openai.py, tei.py, cohere.py, vllm.py): their fields, limits, statuses and the four error shapes
(KServe's ``{"error"}``, OpenAI's ``{"error": {message, type, param, code}}``, TEI's
``{"error", "error_type"}``, Cohere's ``{"id", "message"}``). The bodies of other servers' wires
follow those servers: TEI's, Cohere's and vLLM/infinity's ignore unknown fields (their schemas are
open), OpenAI's ``/v1/embeddings`` refuses them (closed).
It cannot drift silently: tests/test_openapi.py fails when the app registers a route the document
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
from pathlib import Path
from typing import Any

from aiohttp import web

from batchgate.gateway.scheduling.request import MIN_BUDGET_MS
from batchgate.gateway.transport.fields import LATENCY_BUDGET_HEADER, LATENCY_CLASS_HEADER, MAX_INPUTS
from batchgate.gateway.transport.kserve_rest import HEADER_LENGTH, MAX_JSON_DEPTH

EXAMPLE_MODEL = "minilm"  # the model the examples name (the bundled text embedding model)

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


def _op(
    op_id: str, tag: str, summary: str, responses: dict, *, params: tuple[str, ...] = (),
    headers: tuple[str, ...] = (), body: dict | None = None, security: list | None = None,
    description: str | None = None,
) -> dict:  # fmt: skip
    op: dict[str, Any] = {"operationId": op_id, "tags": [tag], "summary": summary, "responses": responses}
    if description:
        op["description"] = description
    parameters = [_path_param(p) for p in params] + [_HEADER[h] for h in headers]
    if parameters:
        op["parameters"] = parameters
    if body is not None:
        op["requestBody"] = body
    op["security"] = _KEYED if security is None else security
    return op


# -- schemas -----------------------------------------------------------------------------------------

_PARAM_VALUE = {"type": ["boolean", "number", "string"], "description": "bool, int64, double or string"}
_LATENCY_FIELDS = {
    "latency_class": {"type": "string", "description": "The call's latency class (an extension)."},
    "latency_budget_ms": {
        "type": "number",
        "minimum": MIN_BUDGET_MS,
        "description": f"The call's latency budget in milliseconds (an extension), at least {MIN_BUDGET_MS:g}.",
    },
}
# A text a model computes on: a whitespace-only text is embedded (as TEI and sentence-transformers
# embed it: [CLS][SEP]); only the empty string is refused (400, 422 on TEI's routes, naming it).
_TEXT = {"type": "string", "minLength": 1}
_TEXTS = {
    "oneOf": [_TEXT, {"type": "array", "items": _TEXT, "minItems": 1, "maxItems": MAX_INPUTS}],
    "description": f"One text, or a list of at most {MAX_INPUTS}; whitespace-only texts are embedded, only "
    '"" is refused.',
}
_ANY_TEXTS = {  # texts only tokenised (TEI's /tokenize): the empty string too
    "oneOf": [_STR, {"type": "array", "items": _STR, "minItems": 1, "maxItems": MAX_INPUTS}],
    "description": f"One text, or a list of at most {MAX_INPUTS}.",
}
_TRUNCATION = {
    "type": ["string", "null"],
    "enum": ["Right", "right", "Left", "left", None],
    "default": "Right",
    "description": "Which end of a text over the model's length is kept when it is truncated: its first "
    "tokens (`Right`) or its last (`Left`).",
}
_TRUNCATE = {
    "type": ["boolean", "null"],
    "description": "Cut texts over the model's length instead of refusing them; default: the model's own "
    "`truncate` setting (`auto_truncate` in `/info`).",
}
_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
_TEXTS_OR_IDS = {
    "oneOf": [
        _TEXT,
        {"type": "array", "items": _TEXT, "minItems": 1, "maxItems": MAX_INPUTS},
        _IDS,
        {"type": "array", "items": _IDS, "minItems": 1, "maxItems": MAX_INPUTS},
    ],
    "description": f'One text or a list of at most {MAX_INPUTS} (whitespace-only texts are embedded, only "" '
    "is refused); or token ids of the model's vocabulary (a list of ints, or a list of such lists), the "
    "model's input as they are (no special tokens added), as TEI takes them.",
}
_OPENAI_INPUT = {
    **_TEXTS_OR_IDS,
    "description": f'One text or a list of at most {MAX_INPUTS} (whitespace-only texts are embedded, only "" '
    "is refused); or token ids (a list of ints, or a list of such lists), by default ids of OpenAI's "
    "`cl100k_base` encoding (what tiktoken makes, and LangChain's `OpenAIEmbeddings` sends by default), "
    "decoded to text and tokenized by the model's own tokenizer. The setting `openai_token_ids` (server-wide, "
    "or the model's parameter) chooses `openai` (the default), `model` (the model's own vocabulary, used as "
    "they are) or `refuse` (400 naming `input`). `usage` counts the model's tokens.",
}

_DOCUMENTS = {
    "type": "array",
    "minItems": 1,
    "maxItems": MAX_INPUTS,
    "items": {"oneOf": [_TEXT, _obj({"text": _TEXT}, ("text",))]},
    "description": "The documents: strings, or objects with a `text`.",
}
_QUERY = {
    "type": "string",
    "minLength": 1,
    "pattern": r"\S",
    "description": "The query (not only whitespace).",
}
_RANKED = {
    "type": "array",
    "items": _obj(
        {
            "index": {"type": "integer", "minimum": 0},
            "relevance_score": _NUM,
            "document": _obj({"text": _STR}, ("text",)),
        },
        ("index", "relevance_score"),
    ),
    "description": "By relevance, highest first; `document` with `return_documents`.",
}

SCHEMAS: dict[str, dict] = {
    # -- the error shapes
    "KServeError": _obj({"error": _STR}, ("error",), closed=True, description="KServe v2 / Triton's error."),
    "OpenAIError": _obj(
        {
            "error": _obj(
                {
                    "message": _STR,
                    "type": {
                        "type": "string",
                        "enum": [
                            "invalid_request_error",
                            "permission_error",
                            "rate_limit_error",
                            "server_error",
                        ],
                    },
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "null"]},
                },
                ("message", "type", "param", "code"),
                closed=True,
            )
        },
        ("error",),
        closed=True,
        description="OpenAI's error (also Cohere/Jina's /v1/rerank).",
    ),
    "TEIError": _obj(
        {
            "error": _STR,
            "error_type": {
                "type": "string",
                "enum": ["validation", "unauthorized", "overloaded", "unhealthy", "backend", "empty"],
            },
        },
        ("error", "error_type"),
        closed=True,
        description="Hugging Face text-embeddings-inference's error.",
    ),
    # -- KServe v2
    "ServerMetadata": _obj(
        {"name": _STR, "version": _STR, "extensions": {"type": "array", "items": _STR}}, ("name", "version")
    ),
    "TensorMetadata": _obj(
        {"name": _STR, "datatype": _STR, "shape": {"type": "array", "items": _INT}}, ("name", "datatype")
    ),
    "ModelMetadata": _obj(
        {
            "name": _STR,
            "versions": {"type": "array", "items": _STR},
            "platform": _STR,
            "inputs": {"type": "array", "items": _ref("TensorMetadata")},
            "outputs": {"type": "array", "items": _ref("TensorMetadata")},
        },
        ("name",),
    ),
    "ModelReady": _obj({"name": _STR, "ready": {"const": True}}, ("name", "ready")),
    "ModelConfig": _obj(
        {
            "name": _STR,
            "platform": _STR,
            "backend": _STR,
            "max_batch_size": _INT,
            "input": {"type": "array", "items": {"type": "object"}},
            "output": {"type": "array", "items": {"type": "object"}},
            "instance_group": {"type": "array", "items": {"type": "object"}},
            "dynamic_batching": {"type": "object"},
            "parameters": {"type": "object", "additionalProperties": _obj({"string_value": _STR})},
        },
        description="Triton's model configuration (model_config.proto) as JSON, defaults left out.",
    ),
    "Duration": _obj({"count": _COUNTER, "ns": _COUNTER}, ("count", "ns")),
    "ModelStatistics": _obj(
        {
            "name": _STR,
            "version": _STR,
            "last_inference": _COUNTER,
            "inference_count": _COUNTER,
            "execution_count": _COUNTER,
            "inference_stats": {"type": "object", "additionalProperties": _ref("Duration")},
            "batch_stats": {
                "type": "array",
                "items": {"type": "object", "properties": {"batch_size": _COUNTER}},
            },
            "memory_usage": {"type": "array", "items": {"type": "object"}},
            "response_stats": {"type": "object"},
        },
        ("name", "version", "inference_count", "execution_count", "inference_stats"),
    ),
    "ModelStatisticsResponse": _obj(
        {"model_stats": {"type": "array", "items": _ref("ModelStatistics")}}, ("model_stats",)
    ),
    "RepositoryIndexRequest": _obj(
        {"ready": {"type": "boolean", "description": "Only the models ready."}}, examples=[{"ready": True}]
    ),
    "RepositoryIndex": {
        "type": "array",
        "items": _obj(
            {"name": _STR, "version": _STR, "state": {"enum": ["READY", "UNAVAILABLE"]}, "reason": _STR},
            ("name",),
        ),
    },
    "RepositoryModelRequest": _obj(
        {
            "parameters": {
                "type": "object",
                "description": "Triton's load overrides (`config`, `file:...`) are not offered: "
                "a non-empty object is answered 501.",
            }
        }
    ),
    "InferInputTensor": _obj(
        {
            "name": {"type": "string", "maxLength": 128},
            "shape": {
                "type": "array",
                "items": {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1},
            },
            "datatype": {
                "type": "string",
                "maxLength": 16,
                "examples": ["FP32", "INT64", "BYTES"],
                "description": "A KServe datatype: BOOL, UINT8..UINT64, INT8..INT64, FP16, FP32, FP64, BYTES.",
            },
            "parameters": _obj(
                {"binary_data_size": {"type": "integer", "minimum": 0}},
                additionalProperties=_PARAM_VALUE,
            ),
            "data": {
                "description": "Row-major values, flat or nested like the shape (at most "
                f"{MAX_JSON_DEPTH} levels); absent when the tensor travels as binary data "
                "(`binary_data_size`)."
            },
        },
        ("name", "shape", "datatype"),
    ),
    "InferRequestedOutput": _obj(
        {
            "name": {"type": "string", "maxLength": 128},
            "parameters": _obj({"binary_data": _BOOL}, additionalProperties=_PARAM_VALUE),
        },
        ("name",),
    ),
    "InferenceRequest": _obj(
        {
            "id": _STR,
            "parameters": _obj({"binary_data_output": _BOOL}, additionalProperties=_PARAM_VALUE),
            "inputs": {"type": "array", "items": _ref("InferInputTensor"), "minItems": 1},
            "outputs": {"type": "array", "items": _ref("InferRequestedOutput")},
        },
        ("inputs",),
        description="KServe v2's inference request (Triton's binary tensor data extension included).",
        examples=[
            {
                "inputs": [
                    {"name": "text", "shape": [2, 1], "datatype": "BYTES", "data": ["a text", "another"]}
                ]
            }
        ],
    ),
    "InferOutputTensor": _obj(
        {
            "name": _STR,
            "datatype": _STR,
            "shape": {"type": "array", "items": _INT},
            "data": {"type": "array"},
            "parameters": _obj({"binary_data_size": _COUNTER}),
        },
        ("name", "datatype", "shape"),
    ),
    "InferenceResponse": _obj(
        {
            "model_name": _STR,
            "model_version": _STR,
            "id": _STR,
            "outputs": {"type": "array", "items": _ref("InferOutputTensor")},
        },
        ("model_name", "outputs"),
    ),
    # -- OpenAI
    "EmbeddingsRequest": _obj(
        {
            "model": {"type": "string", "minLength": 1, "examples": [EXAMPLE_MODEL]},
            "input": _OPENAI_INPUT,
            "encoding_format": {"enum": ["float", "base64", None], "default": "float"},
            "dimensions": {
                "type": "integer",
                "description": "A Matryoshka size the model declares, or its own.",
            },
            "user": _STR,
            "prompt_name": {"type": "string", "minLength": 1, "description": "One of the model's prompts."},
            "truncate": _TRUNCATE,
            **_LATENCY_FIELDS,
        },
        ("model", "input"),
        closed=True,
        description="OpenAI's embeddings body; a field not listed is refused (400 naming it), as OpenAI does.",
        examples=[{"model": EXAMPLE_MODEL, "input": ["A man is eating food.", "A man is riding a horse."]}],
    ),
    "Embedding": _obj(
        {
            "object": {"const": "embedding"},
            "index": {"type": "integer", "minimum": 0},
            "embedding": {
                "oneOf": [
                    {"type": "array", "items": _NUM},
                    {"type": "string", "contentEncoding": "base64", "description": "little-endian float32"},
                ]
            },
        },
        ("object", "index", "embedding"),
    ),
    "EmbeddingsResponse": _obj(
        {
            "object": {"const": "list"},
            "data": {"type": "array", "items": _ref("Embedding")},
            "model": _STR,
            "usage": _obj(
                {"prompt_tokens": _COUNTER, "total_tokens": _COUNTER}, ("prompt_tokens", "total_tokens")
            ),
        },
        ("object", "data", "model", "usage"),
    ),
    "Model": _obj(
        {
            "id": _STR,
            "object": {"const": "model"},
            "created": _INT,
            "owned_by": _STR,
            "kind": {
                "type": "string",
                "enum": ["embedding", "sparse_embedding", "classification", "rerank"],
                "description": "batchgate's: what the model serves (its parameter `kind`), so a caller knows "
                "which route to send it (embedding: /v1/embeddings; rerank: /v1/rerank, /v2/rerank, /score; "
                "classification: /classify, /predict; sparse_embedding: /embed_sparse).",
            },
        },
        ("id", "object", "created", "owned_by", "kind"),
    ),
    "ModelList": _obj(
        {"object": {"const": "list"}, "data": {"type": "array", "items": _ref("Model")}}, ("object", "data")
    ),
    "UsageResult": _obj(
        {
            "object": {"const": "organization.usage.embeddings.result"},
            "input_tokens": _COUNTER,
            "num_model_requests": _COUNTER,
            "project_id": {
                "type": ["string", "null"],
                "description": "The tenant (with group_by project_id).",
            },
            "user_id": {"type": "null"},
            "api_key_id": {"type": "null"},
            "model": {"type": ["string", "null"], "description": "The model (with group_by model)."},
        },
        ("object", "input_tokens", "num_model_requests", "project_id", "model"),
    ),
    "UsageBucket": _obj(
        {
            "object": {"const": "bucket"},
            "start_time": _INT,
            "end_time": _INT,
            "results": {"type": "array", "items": _ref("UsageResult")},
        },
        ("object", "start_time", "end_time", "results"),
    ),
    "UsagePage": _obj(
        {
            "object": {"const": "page"},
            "data": {"type": "array", "items": _ref("UsageBucket")},
            "has_more": _BOOL,
            "next_page": {"type": ["string", "null"], "description": "The `page` of the next buckets."},
        },
        ("object", "data", "has_more", "next_page"),
    ),
    # -- TEI
    "EmbedRequest": _obj(
        {
            "inputs": _TEXTS_OR_IDS,
            "normalize": {"type": ["boolean", "null"], "default": True},
            "truncate": _TRUNCATE,
            "truncation_direction": _TRUNCATION,
            "prompt_name": {"type": "string", "minLength": 1},
            "dimensions": _INT,
            "model": {
                "type": "string",
                "minLength": 1,
                "description": "An extension (TEI serves one model): default, the server's default model.",
            },
            **_LATENCY_FIELDS,
        },
        ("inputs",),
        description="TEI's embed body; fields not listed are ignored, as TEI ignores them.",
        examples=[{"inputs": ["What is Deep Learning?"], "normalize": True}],
    ),
    "EmbedResponse": {"type": "array", "items": {"type": "array", "items": _NUM}},
    "RerankRequest": _obj(
        {
            "query": _QUERY,
            "texts": _TEXTS,
            "documents": {
                **_DOCUMENTS,
                "description": "infinity's and vLLM's Cohere-shaped body: sent instead of `texts`, it is "
                "answered in that shape (`RerankResultsResponse`).",
            },
            "top_n": {"type": "integer", "minimum": 1, "description": "Only the first `top_n` by score."},
            "return_documents": {
                "type": ["boolean", "null"],
                "default": False,
                "description": "With `documents`: each result's `document`.",
            },
            "truncate": _TRUNCATE,
            "truncation_direction": _TRUNCATION,
            "raw_scores": {"type": ["boolean", "null"], "default": False},
            "return_text": {"type": ["boolean", "null"], "default": False},
            "model": {
                "type": "string",
                "minLength": 1,
                "description": "Needed when more than one rerank model.",
            },
            **_LATENCY_FIELDS,
        },
        ("query",),
        anyOf=[{"required": ["texts"]}, {"required": ["documents"]}],
        description="TEI's rerank body (`texts`), or infinity's and vLLM's (`documents`, `top_n`, "
        "`return_documents`); fields not listed are ignored, as those servers ignore them.",
        examples=[
            {
                "query": "What is Deep Learning?",
                "texts": ["Deep Learning is a subset of ML.", "Cheese is made from milk."],
            }
        ],
    ),
    "RerankResponse": {
        "oneOf": [
            {
                "type": "array",
                "items": _obj(
                    {"index": {"type": "integer", "minimum": 0}, "score": _NUM, "text": _STR},
                    ("index", "score"),
                ),
                "description": "TEI's answer to `texts`: highest score first.",
            },
            _ref("RerankResultsResponse"),
        ]
    },
    "RerankResultsResponse": _obj(
        {
            "object": {"const": "rerank"},
            "id": _STR,
            "created": _INT,
            "model": _STR,
            "results": _RANKED,
            "usage": _obj({"prompt_tokens": _COUNTER, "total_tokens": _COUNTER}),
        },
        ("object", "model", "results", "usage"),
        description="infinity's and vLLM's answer to `documents`: by relevance, the first `top_n`.",
    ),
    # -- Cohere / Jina
    "V1RerankRequest": _obj(
        {
            "model": {
                "type": "string",
                "minLength": 1,
                "description": "Default: the only served rerank model (or `tei_default_model`).",
            },
            "query": _QUERY,
            "documents": _DOCUMENTS,
            "top_n": {"type": "integer", "minimum": 1},
            "return_documents": {"type": ["boolean", "null"], "default": False},
            "max_chunks_per_doc": {"description": "Accepted and ignored."},
            "rank_fields": {"description": "Accepted and ignored."},
            **_LATENCY_FIELDS,
        },
        ("query", "documents"),
        description="Cohere's v1 and Jina's rerank body; fields not listed are ignored, as Cohere ignores them.",
        examples=[
            {
                "query": "What is Deep Learning?",
                "documents": ["Deep Learning is a subset of ML.", "Cheese."],
                "top_n": 1,
            }
        ],
    ),
    "V1RerankResponse": _obj(
        {
            "model": _STR,
            "results": _RANKED,
            "usage": _obj({"total_tokens": _COUNTER}),
            "meta": {"type": "object"},
        },
        ("model", "results"),
    ),
}


def _json_body(name: str, required: bool = True) -> dict:
    return {"required": required, "content": _json(_ref(name))}


_MODEL_FIELD = {
    "type": "string",
    "minLength": 1,
    "description": "An extension: default, the server's default model.",
}
_PROMPT = {"type": ["string", "null"], "minLength": 1, "description": "One of the model's prompts."}
_TOKEN = _obj(
    {"id": _COUNTER, "text": _STR, "special": {"type": "boolean"},
     "start": {"type": ["integer", "null"], "minimum": 0}, "stop": {"type": ["integer", "null"], "minimum": 0}},
    ("id", "text", "special"),
)  # fmt: skip
_LABELS = _obj(
    {"id2label": {"type": "object", "additionalProperties": _STR},
     "label2id": {"type": "object", "additionalProperties": _COUNTER}},
    ("id2label", "label2id"),
)  # fmt: skip
_PREDICTION = _obj({"score": _NUM, "label": _STR}, ("score", "label"))
_VLLM_IGNORED = {k: {"description": "Accepted and ignored."}
                 for k in ("truncate_prompt_tokens", "encoding_format", "priority")}  # fmt: skip
_VLLM_USAGE = _obj(
    {"prompt_tokens": _COUNTER, "total_tokens": _COUNTER, "completion_tokens": _COUNTER,
     "prompt_tokens_details": {"type": "null"}},
    ("prompt_tokens", "total_tokens"),
)  # fmt: skip
_ROW = {"type": "array", "items": _TEXT, "minItems": 1, "maxItems": 2}
_IGNORED = "fields not listed are ignored, as TEI ignores them."
SCHEMAS.update({
    "Info": _obj(
        {"model_id": _STR, "model_sha": _STR, "model_dtype": _STR,
         "model_type": {"oneOf": [_obj({"embedding": _obj({"pooling": _STR}, ("pooling",))}, ("embedding",)),
                                  _obj({"classifier": _LABELS}, ("classifier",)),
                                  _obj({"reranker": _LABELS}, ("reranker",))]},
         "max_concurrent_requests": _COUNTER, "max_input_length": _COUNTER, "max_batch_tokens": _COUNTER,
         "max_batch_requests": _COUNTER, "max_client_batch_size": _COUNTER, "auto_truncate": {"type": "boolean"},
         "tokenization_workers": _COUNTER, "version": _STR, "sha": {"type": ["string", "null"]},
         "docker_label": {"type": ["string", "null"]}, "kind": _STR, "max_text_bytes": _COUNTER,
         "pairs": {"type": "boolean"}, "prompts": {"type": "array", "items": _STR},
         "matryoshka_dimensions": {"type": "array", "items": _COUNTER},
         "vector_ranges": {"type": "object", "description": "The per-dimension ranges int8/uint8 vectors are "
                           "quantised with (calibrated once per model), where the model has them."},
         "selection": {"type": "object", "description": "The engine and precision chosen for this host."}},
        ("model_id", "model_dtype", "model_type", "max_input_length", "max_batch_tokens", "auto_truncate", "version"),
        description="TEI's `/info` for the route's model; `kind`, `max_text_bytes`, `pairs`, `prompts`, "
        "`matryoshka_dimensions`, `vector_ranges` and `selection` are batchgate's.",
    ),
    "TokenizeRequest": _obj(
        {"inputs": _ANY_TEXTS, "add_special_tokens": {"type": ["boolean", "null"], "default": True},
         "prompt_name": _PROMPT, "model": _MODEL_FIELD},
        ("inputs",), description="TEI's tokenize body; " + _IGNORED,
        examples=[{"inputs": "What is Deep Learning?"}],
    ),
    "TokenizeResponse": {"type": "array", "items": {"type": "array", "items": _TOKEN}},
    "DecodeRequest": _obj(
        {"ids": {"oneOf": [_IDS, {"type": "array", "items": _IDS, "minItems": 1, "maxItems": MAX_INPUTS}]},
         "skip_special_tokens": {"type": ["boolean", "null"], "default": True}, "model": _MODEL_FIELD},
        ("ids",), description="TEI's decode body; " + _IGNORED, examples=[{"ids": [101, 7592, 102]}],
    ),
    "DecodeResponse": {"type": "array", "items": _STR},
    "EmbedAllRequest": _obj(
        {"inputs": _TEXTS_OR_IDS, "truncate": _TRUNCATE, "truncation_direction": _TRUNCATION,
         "prompt_name": _PROMPT, "normalize": {"type": ["boolean", "null"], "description": "Accepted and ignored."},
         "model": _MODEL_FIELD, **_LATENCY_FIELDS},
        ("inputs",), description="TEI's embed_all body; " + _IGNORED,
    ),
    "EmbedAllResponse": {"type": "array", "items": {"type": "array", "items": {"type": "array", "items": _NUM}}},
    "EmbedSparseRequest": _obj(
        {"inputs": _TEXTS_OR_IDS, "truncate": _TRUNCATE, "truncation_direction": _TRUNCATION,
         "prompt_name": _PROMPT, "top_k": {"type": ["integer", "null"], "minimum": 1,
                                           "description": "Keep only the k largest weights (an extension)."},
         "model": _MODEL_FIELD, **_LATENCY_FIELDS},
        ("inputs",), description="TEI's embed_sparse body; " + _IGNORED,
    ),
    "EmbedSparseResponse": {"type": "array", "items": {"type": "array", "items": _obj(
        {"index": _COUNTER, "value": _NUM}, ("index", "value"))}},
    "SimilarityRequest": _obj(
        {"inputs": _obj({"source_sentence": _STR, "sentences": _TEXTS}, ("source_sentence", "sentences")),
         "parameters": {"oneOf": [{"type": "null"}, _obj(
             {"truncate": _TRUNCATE, "truncation_direction": _TRUNCATION, "prompt_name": _PROMPT})]},
         "model": _MODEL_FIELD, **_LATENCY_FIELDS},
        ("inputs",), description="TEI's similarity body (what `InferenceClient.sentence_similarity` sends); "
        + _IGNORED,
        examples=[{"inputs": {"source_sentence": "What is Deep Learning?", "sentences": ["What is ML?"]}}],
    ),
    "SimilarityResponse": {"type": "array", "items": _NUM},
    "PredictRequest": _obj(
        {"inputs": {"oneOf": [_TEXT, {"type": "array", "items": _TEXT, "minItems": 2, "maxItems": 2},
                              {"type": "array", "items": _ROW, "minItems": 1, "maxItems": MAX_INPUTS}],
                    "description": "A text, a pair [text, text], or a batch of [text] / [text, text] (all rows "
                    "alike). Any classifier takes pairs, tokenized as its tokenizer pairs two sequences."},
         "raw_scores": {"type": ["boolean", "null"], "default": False}, "truncate": _TRUNCATE,
         "truncation_direction": _TRUNCATION, "model": _MODEL_FIELD, **_LATENCY_FIELDS},
        ("inputs",), description="TEI's predict body; " + _IGNORED, examples=[{"inputs": "I like you."}],
    ),
    "PredictResponse": {"oneOf": [{"type": "array", "items": _PREDICTION},
                                  {"type": "array", "items": {"type": "array", "items": _PREDICTION}}]},
    "ClassifyRequest": _obj(
        {"model": _MODEL_FIELD, "input": {"oneOf": [_TEXTS, {"type": "array", "items": _ROW, "minItems": 1}]},
         "user": _STR, "truncate": _TRUNCATE, "truncation_direction": _TRUNCATION, **_VLLM_IGNORED,
         **_LATENCY_FIELDS},
        ("input",), description="vLLM's classify body; fields not listed are ignored, as vLLM ignores them.",
        examples=[{"input": ["I like you.", "Go away."]}],
    ),
    "ClassifyResponse": _obj(
        {"id": _STR, "object": {"const": "list"}, "created": _INT, "model": _STR,
         "data": {"type": "array", "items": _obj(
             {"index": _COUNTER, "label": _STR, "probs": {"type": "array", "items": _NUM}, "num_classes": _COUNTER},
             ("index", "label", "probs", "num_classes"))},
         "usage": _VLLM_USAGE},
        ("object", "data", "model", "usage"),
    ),
    "ScoreRequest": _obj(
        {"model": _MODEL_FIELD,
         "text_1": {"oneOf": [_TEXT, {"type": "array", "items": _TEXT, "minItems": 1, "maxItems": MAX_INPUTS}],
                    "description": "One query (a text, or a list of one) scored against every `text_2`, or as "
                    "many texts as `text_2`, paired index by index."},
         "text_2": _TEXTS, "user": _STR, "truncate": _TRUNCATE, "truncation_direction": _TRUNCATION,
         **_VLLM_IGNORED, **_LATENCY_FIELDS},
        ("text_1", "text_2"),
        description="vLLM's score body (a cross-encoder); fields not listed are ignored, as vLLM ignores them.",
        examples=[{"text_1": "What is Deep Learning?", "text_2": ["Deep Learning is a subset of ML.", "Cheese."]}],
    ),
    "ScoreResponse": _obj(
        {"id": _STR, "object": {"const": "list"}, "created": _INT, "model": _STR,
         "data": {"type": "array", "items": _obj(
             {"index": _COUNTER, "object": {"const": "score"}, "score": _NUM}, ("index", "object", "score"))},
         "usage": _VLLM_USAGE},
        ("object", "data", "model", "usage"),
        description="One score per pair, in the order of `text_2`: the sigmoid of the model's logit.",
    ),
})  # fmt: skip

# -- Cohere v2 (gateway/transport/cohere.py)
_COHERE_META = _obj(
    {"api_version": _obj({"version": _STR}),
     "billed_units": _obj({"input_tokens": _COUNTER, "search_units": _COUNTER})},
)  # fmt: skip
_PRIORITY = {"type": "integer", "description": "Cohere's request priority: accepted and ignored (latency classes "
             "and budgets order calls here)."}  # fmt: skip
_INT_ROWS = {"type": "array", "items": {"type": "array", "items": _INT}}
SCHEMAS.update({
    "CohereError": _obj(
        {"id": _STR, "message": _STR}, ("id", "message"), closed=True,
        description="Cohere's error (`/v2/rerank`, `/v2/embed`); the SDK raises its error class by the status.",
    ),
    "V2RerankRequest": _obj(
        {"model": {**_MODEL_FIELD, "description": "Cohere requires it; here, absent: the only served rerank "
                   "model (or `tei_default_model`)."},
         "query": _QUERY, "documents": _DOCUMENTS, "top_n": {"type": "integer", "minimum": 1},
         "max_tokens_per_doc": {"type": "integer", "minimum": 1,
                                "description": "Each document cut to its first this many tokens before scoring."},
         "return_documents": {"type": ["boolean", "null"], "default": False,
                              "description": "Cohere's v1 field, still honoured: each result's `document`."},
         "priority": _PRIORITY, **_LATENCY_FIELDS},
        ("query", "documents"),
        description="Cohere's v2 rerank body (`cohere.ClientV2.rerank`); fields not listed are ignored, as "
        "Cohere ignores them.",
        examples=[{"model": "ce", "query": "What is Deep Learning?",
                   "documents": ["Deep Learning is a subset of ML.", "Cheese."], "top_n": 1}],
    ),
    "V2RerankResponse": _obj(
        {"id": _STR, "results": _RANKED, "meta": _COHERE_META}, ("id", "results", "meta"),
        description="By relevance (the sigmoid of the model's logit), highest first, the first `top_n`.",
    ),
    "V2EmbedRequest": _obj(
        {"model": {**_MODEL_FIELD, "description": "Cohere requires it; here, absent: the server's default "
                   "embedding model."},
         "texts": {"type": "array", "items": _TEXT, "minItems": 1, "maxItems": MAX_INPUTS},
         "inputs": {"type": "array", "minItems": 1, "maxItems": MAX_INPUTS,
                    "items": _obj({"content": {"type": "array", "minItems": 1, "maxItems": 1, "items": _obj(
                        {"type": {"const": "text"}, "text": _TEXT}, ("type", "text"))}}, ("content",)),
                    "description": "v2's mixed inputs, instead of `texts`: text content only (one text each)."},
         "input_type": {"type": "string",
                        "enum": ["search_query", "search_document", "classification", "clustering"],
                        "description": "Mapped to the model's prompts (search_query: `query`; search_document: "
                        "`document`, `passage`; classification; clustering); a model without such a prompt "
                        "embeds the text as it is. Each type has its own cache entries."},
         "embedding_types": {"type": "array", "items": {
             "type": "string", "enum": ["float", "int8", "uint8", "binary", "ubinary", "base64"]},
             "description": "Default `[\"float\"]`. binary/ubinary: the signs packed 8 to a byte (binary "
             "offset by -128); int8/uint8: per-dimension ranges calibrated once per model (`/info` "
             "`vector_ranges`); base64: float's little-endian bytes."},
         "truncate": {"type": "string", "enum": ["NONE", "START", "END"], "default": "END",
                      "description": "A text over the model's length: refused (NONE), or cut keeping its end "
                      "(START) or its start (END)."},
         "output_dimension": {"type": "integer", "minimum": 1,
                              "description": "A Matryoshka size the model declares, or its own."},
         "max_tokens": {"type": "integer", "minimum": 1, "description": "Each text cut to this many tokens."},
         "priority": _PRIORITY, **_LATENCY_FIELDS},
        anyOf=[{"required": ["texts"]}, {"required": ["inputs"]}],
        description="Cohere's v2 embed body (`cohere.ClientV2.embed`); fields not listed are ignored, as Cohere "
        "ignores them. Images are not served.",
        examples=[{"model": EXAMPLE_MODEL, "texts": ["A man is eating food."], "input_type": "search_document",
                   "embedding_types": ["float", "int8"]}],
    ),
    "V2EmbedResponse": _obj(
        {"id": _STR, "response_type": {"const": "embeddings_by_type"},
         "embeddings": _obj({"float": {"type": "array", "items": {"type": "array", "items": _NUM}},
                             "int8": _INT_ROWS, "uint8": _INT_ROWS, "binary": _INT_ROWS, "ubinary": _INT_ROWS,
                             "base64": {"type": "array", "items": _STR}},
                            description="One list of vectors per type asked for, in the texts' order."),
         "texts": {"type": "array", "items": _STR}, "meta": _COHERE_META},
        ("id", "response_type", "embeddings", "texts", "meta"),
    ),
})  # fmt: skip

_TEI_ERRORS = (400, 401, 403, 404, 408, 413, 422, 424, 429, 501, 503, 504)
_TEI_400 = {400: "TEI: an empty list of inputs (`error_type` `empty`)."}


def _tei_call(op_id: str, summary: str, ok: str, request: str, response: str, base: str) -> dict:
    return _op(
        op_id, "TEI", summary,
        {"200": _ok(ok, _ref(response)), **_errors("tei", _TEI_ERRORS, _TEI_400)},
        params=("model",) if base else (), headers=("request_id", "latency_class", "latency_budget"),
        body=_json_body(request),
    )  # fmt: skip


def tei_paths() -> dict[str, dict]:
    """TEI's routes beside ``/embed`` and ``/rerank`` at the root (its entry routes ``POST /`` and
    ``/invocations``, ``GET /`` and ``/ping`` included), vLLM's ``/classify`` and ``/score``, and every
    TEI route again under ``/tei/{model}`` (that model's own TEI server)."""
    out: dict[str, dict] = {}
    for base in ("", "/tei/{model}"):
        s = "Model" if base else ""
        params = ("model",) if base else ()
        out[base + "/info"] = {
            "get": _op(
                f"info{s}",
                "TEI",
                "The model's TEI info (what TEI's clients read first)",
                {"200": _ok("The model.", _ref("Info")), **_errors("tei", (401, 404, 422, 503))},
                params=params,
            )
        }
        for path, op_id in (("/health", "health"), ("/ping", "ping"), ("", "root")):
            out[(base + path) or "/"] = {
                "get": _op(
                    f"{op_id}{s}",
                    "TEI",
                    "Whether the model is loaded and the server not draining"
                    + ("" if path == "/health" else " (TEI's health, at this path too)"),
                    {"200": _ok("Healthy."), **_errors("tei", (404, 422, 503))},
                    params=params,
                    security=_OPEN,
                )
            }
        for path, op_id in (("", "entry"), ("/invocations", "invocations")):
            entry = _op(
                f"{op_id}{s}", "TEI",
                "The call the model's kind answers (TEI's entry route: what `InferenceClient(base_url=...)` posts)",
                {"200": _ok("The answer of the route the model's kind names.", {"anyOf": [
                    _ref(r) for r in ("EmbedResponse", "EmbedSparseResponse", "RerankResponse", "PredictResponse",
                                      "SimilarityResponse")]}),
                 **_errors("tei", _TEI_ERRORS, _TEI_400)},
                params=params, headers=("request_id", "latency_class", "latency_budget"),
                body={"required": True, "content": _json({"anyOf": [
                    _ref(r) for r in ("EmbedRequest", "EmbedSparseRequest", "RerankRequest", "PredictRequest",
                                      "SimilarityRequest")]})},
                description="An `inputs` object with `source_sentence` is a similarity call (`/similarity`, as "
                "`InferenceClient.sentence_similarity` sends it); otherwise the body is read as the model's kind "
                "asks: an embedding model `/embed`, a sparse one `/embed_sparse`, a reranker `/rerank`, a "
                "classifier `/predict`. Which model: the base URL's, else the body's `model`, else the server's "
                "default model (`tei_default_model`).",
            )  # fmt: skip
            out.setdefault((base + path) or "/", {})["post"] = entry  # "/" and "/tei/{model}" hold a GET too
        routes = (
            ("tokenize", "Tokens of each text, with their offsets", "Per text, its tokens.", "Tokenize"),
            ("decode", "Texts of token ids", "Per row of ids, its text.", "Decode"),
            ("embed_all", "Every token's vector (models with output token_embeddings)",
             "Per text, one vector per token.", "EmbedAll"),
            ("embed_sparse", "Sparse (SPLADE) vectors as index/value pairs", "Per text, its non-zero weights.",
             "EmbedSparse"),
            ("similarity", "Cosine of a sentence's embedding with each of others'", "One cosine per sentence.",
             "Similarity"),
            ("predict", "Sequence classification: every label's score, highest first",
             "The labels by score (a list per row for a batch).", "Predict"),
        )  # fmt: skip
        for name, summary, ok, schema in routes:
            out[f"{base}/{name}"] = {
                "post": _tei_call(name + s, summary, ok, schema + "Request", schema + "Response", base)
            }
        if base:
            out[base + "/embed"] = {
                "post": _tei_call(
                    "embedModel",
                    "Embeddings of this model",
                    "One vector per input, in order.",
                    "EmbedRequest",
                    "EmbedResponse",
                    base,
                )
            }
            out[base + "/rerank"] = {
                "post": _tei_call(
                    "rerankModel",
                    "Rerank texts with this model",
                    "Scores, highest first.",
                    "RerankRequest",
                    "RerankResponse",
                    base,
                )
            }
    for path, op_id in (("/score", "score"), ("/v1/score", "v1Score")):
        out[path] = {
            "post": _op(
                op_id, "vLLM", "Score pairs with a cross-encoder (vLLM's API)",
                {"200": _ok("One score per pair, in order.", _ref("ScoreResponse")),
                 **_errors("openai", _OPENAI_ERRORS)},
                headers=("request_id", "latency_class", "latency_budget"),
                body=_json_body("ScoreRequest"),
            )
        }  # fmt: skip
    for path, op_id in (("/classify", "classify"), ("/v1/classify", "v1Classify")):
        out[path] = {
            "post": _op(
                op_id,
                "vLLM",
                "Sequence classification (vLLM's / SGLang's API)",
                {
                    "200": _ok(
                        "Per input, the most probable label and every label's probability.",
                        _ref("ClassifyResponse"),
                    ),
                    **_errors("openai", (400, 401, 403, 404, 408, 413, 429, 500, 501, 503, 504)),
                },
                headers=("request_id", "latency_class", "latency_budget"),
                body=_json_body("ClassifyRequest"),
            )
        }
    return out


# -- the routes --------------------------------------------------------------------------------------

_KSERVE_BODY_ERRORS = (400, 401, 408, 413)
_OPENAI_ERRORS = (400, 401, 403, 404, 408, 413, 429, 500, 501, 503, 504)
_COHERE_ERRORS = (400, 401, 403, 404, 408, 413, 429, 500, 501, 503, 504)


def _model_routes(base: str, versioned: bool) -> dict[str, dict]:
    """The per-model KServe routes under ``base`` (with or without ``/versions/{version}``)."""
    params = ("model", "version") if versioned else ("model",)
    v = "Versioned" if versioned else ""
    lookup = (400, 404) if versioned else (404,)
    infer_ok = {
        "description": "The outputs: JSON, or (binary data asked for) the JSON header followed by the raw "
        f"tensors, with `{HEADER_LENGTH}` giving the header's length.",
        "content": {
            **_json(_ref("InferenceResponse")),
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
        },
        "headers": {
            HEADER_LENGTH: {"description": "With binary output: the JSON header's length.", "schema": _INT}
        },
    }
    return {
        base: {
            "get": _op(
                f"modelMetadata{v}", "KServe v2", "Model metadata: inputs, outputs, versions",
                {"200": _ok("The model's metadata.", _ref("ModelMetadata")), **_errors("kserve", lookup + (503,))},
                params=params, security=_OPEN,
            )
        },
        base + "/ready": {
            "get": _op(
                f"modelReady{v}", "KServe v2", "Is the model ready",
                {"200": _ok("Ready.", _ref("ModelReady")), **_errors("kserve", lookup + (503,))},
                params=params, security=_OPEN,
            )
        },
        base + "/config": {
            "get": _op(
                f"modelConfig{v}", "KServe v2", "The model's configuration (Triton's model_config)",
                {"200": _ok("The configuration.", _ref("ModelConfig")), **_errors("kserve", lookup + (503,))},
                params=params, security=_OPEN,
            )
        },
        base + "/stats": {
            "get": _op(
                f"modelStatistics{v}", "KServe v2", "The model's statistics (Triton's statistics extension)",
                {
                    "200": _ok("Counts and durations.", _ref("ModelStatisticsResponse")),
                    **_errors("kserve", (400, 401, 404) if versioned else (401, 404)),
                },
                params=params,
            )
        },
        base + "/infer": {
            "post": _op(
                f"infer{v}", "KServe v2", "Inference (KServe v2 REST, Triton's binary tensor data extension)",
                {"200": infer_ok, **_errors("kserve", (400, 401, 403, 404, 408, 413, 429, 500, 501, 503, 504))},
                params=params, headers=("request_id",),
                body={
                    "required": True,
                    "content": {
                        **_json(_ref("InferenceRequest")),
                        "application/octet-stream": {
                            "schema": {
                                "type": "string",
                                "format": "binary",
                                "description": f"The JSON header, then the binary tensors; `{HEADER_LENGTH}` "
                                "gives the header's length.",
                            },
                        },
                    },
                },
                description="The API key (with a tenant file) and the overload gate are checked from the "
                "headers before the body is read.",
            )
        },
    }  # fmt: skip


def _paths() -> dict[str, dict]:
    paths: dict[str, dict] = {
        "/v2/health/live": {
            "get": _op(
                "live", "Health", "Liveness", {"200": _ok("Alive.", _obj({"live": {"const": True}}, ("live",)))},
                security=_OPEN,
            )
        },
        "/v2/health/ready": {
            "get": _op(
                "ready", "Health", "Readiness: every model loaded and the server not draining",
                {
                    "200": _ok("Ready.", _obj({"ready": {"const": True}}, ("ready",))),
                    "503": _ok("Not ready (starting, a model failed, draining).",
                               _obj({"ready": {"const": False}}, ("ready",))),
                },
                security=_OPEN,
            )
        },
        "/v2": {
            "get": _op(
                "serverMetadata", "KServe v2", "Server metadata",
                {"200": _ok("Name, version and extensions.", _ref("ServerMetadata"))}, security=_OPEN,
            )
        },
        "/metrics": {
            "get": _op(
                "metrics", "Metrics", "Prometheus metrics",
                {"200": {"description": "The Prometheus text exposition.",
                         "content": {"text/plain": {"schema": _STR}}}},
                security=_OPEN,
            )
        },
        "/v2/repository/index": {
            "post": _op(
                "repositoryIndex", "Repository", "The models in the repository and their state",
                {"200": _ok("Every model, ready or not.", _ref("RepositoryIndex")),
                 **_errors("kserve", _KSERVE_BODY_ERRORS)},
                body=_json_body("RepositoryIndexRequest", required=False),
            )
        },
        "/v2/repository/models/{model}/load": {
            "post": _op(
                "repositoryLoad", "Repository", "Load (or reload) a model from its directory",
                {"200": _ok("Loaded and serving."),
                 **_errors("kserve", (*_KSERVE_BODY_ERRORS, 403, 404, 501, 503),
                           {400: "The body is malformed, or the model's directory cannot be served (the "
                                 "previous load keeps serving)."})},
                params=("model",), body=_json_body("RepositoryModelRequest", required=False),
                description="Needs `model_control` on, and with a tenant file an admin tenant.",
            )
        },
        "/v2/repository/models/{model}/unload": {
            "post": _op(
                "repositoryUnload", "Repository", "Stop serving a model once its calls are answered",
                {"200": _ok("Unloaded."), **_errors("kserve", (*_KSERVE_BODY_ERRORS, 403, 404, 503))},
                params=("model",), body=_json_body("RepositoryModelRequest", required=False),
                description="Needs `model_control` on, and with a tenant file an admin tenant.",
            )
        },
        "/v2/models/stats": {
            "get": _op(
                "statistics", "KServe v2", "Statistics of every model",
                {"200": _ok("Counts and durations.", _ref("ModelStatisticsResponse")),
                 **_errors("kserve", (401,))},
            )
        },
        **_model_routes("/v2/models/{model}", versioned=False),
        **_model_routes("/v2/models/{model}/versions/{version}", versioned=True),
        # -- OpenAI
        "/v1/embeddings": {
            "post": _op(
                "createEmbeddings", "OpenAI", "Embeddings (OpenAI's API)",
                {"200": _ok("One vector per input, in order.", _ref("EmbeddingsResponse")),
                 **_errors("openai", _OPENAI_ERRORS)},
                headers=("request_id", "latency_class", "latency_budget"),
                body=_json_body("EmbeddingsRequest"),
                description="An unknown model is 404 naming `GET /v1/models`.",
            )
        },
        "/embeddings": {
            "post": _op(
                "createEmbeddingsRoot", "OpenAI",
                "Embeddings at the root (as TEI, infinity and vLLM serve it; the OpenAI SDK with `base_url` at the "
                "server's root calls it)",
                {"200": _ok("One vector per input, in order.", _ref("EmbeddingsResponse")),
                 **_errors("openai", _OPENAI_ERRORS)},
                headers=("request_id", "latency_class", "latency_budget"),
                body=_json_body("EmbeddingsRequest"),
                description="The same body and answer as `POST /v1/embeddings`.",
            )
        },
        "/v1/models": {
            "get": _op(
                "listModels", "OpenAI", "The text models this caller may call",
                {"200": _ok("The models.", _ref("ModelList")), **_errors("openai", (401,))},
            )
        },
        "/v1/models/{model}": {
            "get": _op(
                "retrieveModel", "OpenAI", "One text model",
                {"200": _ok("The model.", _ref("Model")), **_errors("openai", (401, 404))},
                params=("model",),
            )
        },
        "/v1/organization/usage/embeddings": {
            "get": {
                **_op(
                    "usageEmbeddings", "OpenAI", "Embeddings usage (OpenAI's usage API)",
                    {"200": _ok("Buckets of input tokens and calls.", _ref("UsagePage")),
                     **_errors("openai", (400, 401),
                               {400: "A query parameter is missing, malformed or out of range (`param` names it)."}),
                     **_errors("openai", (501,), {501: "Usage metering is off on this server (`usage_metering`)."})},
                    description="This replica's figures. A tenant marked admin sees every tenant; another "
                    "tenant only its own. `project_id` is the tenant.",
                ),
                "parameters": _USAGE_QUERY,
            }
        },
        # -- TEI
        "/embed": {
            "post": _op(
                "embed", "TEI", "Embeddings (Hugging Face TEI's API)",
                {"200": _ok("One vector per input, in order.", _ref("EmbedResponse")),
                 **_errors("tei", (400, 401, 403, 404, 408, 413, 422, 424, 429, 501, 503, 504),
                           {400: "TEI: an empty list of inputs (`error_type` `empty`)."})},
                headers=("request_id", "latency_class", "latency_budget"),
                body=_json_body("EmbedRequest"),
                description="`model` defaults to the server's default model (`tei_default_model`; unset: the "
                "first text embedding model by name). A body TEI cannot read is 422.",
            )
        },
        **tei_paths(),
        "/rerank": {
            "post": _op(
                "rerank", "TEI", "Rerank texts against a query (TEI's API)",
                {"200": _ok("Scores, highest first.", _ref("RerankResponse")),
                 **_errors("tei", (400, 401, 403, 404, 408, 413, 422, 424, 429, 501, 503, 504),
                           {400: "TEI: an empty list of texts (`error_type` `empty`)."})},
                headers=("request_id", "latency_class", "latency_budget"),
                body=_json_body("RerankRequest"),
            )
        },
        # -- Cohere
        "/v2/rerank": {
            "post": _op(
                "v2Rerank", "Cohere / Jina", "Rerank documents against a query (Cohere's v2 API)",
                {"200": _ok("The first `top_n` documents by relevance.", _ref("V2RerankResponse")),
                 **_errors("cohere", _COHERE_ERRORS)},
                headers=("request_id", "latency_class", "latency_budget"),
                body=_json_body("V2RerankRequest"),
            )
        },
        "/v2/embed": {
            "post": _op(
                "v2Embed", "Cohere / Jina", "Embeddings in the types asked for (Cohere's v2 API)",
                {"200": _ok("Per type, one vector per text, in order.", _ref("V2EmbedResponse")),
                 **_errors("cohere", _COHERE_ERRORS)},
                headers=("request_id", "latency_class", "latency_budget"),
                body=_json_body("V2EmbedRequest"),
            )
        },
        # -- Cohere v1 / Jina
        "/v1/rerank": {
            "post": _op(
                "v1Rerank", "Cohere / Jina", "Rerank documents against a query (Cohere's / Jina's API)",
                {"200": _ok("The first `top_n` documents by relevance.", _ref("V1RerankResponse")),
                 **_errors("openai", _OPENAI_ERRORS)},
                headers=("request_id", "latency_class", "latency_budget"),
                body=_json_body("V1RerankRequest"),
            )
        },
        # -- this contract
        "/openapi.json": {
            "get": _op(
                "openapi", "Contract", "This document (OpenAPI 3.1)",
                {"200": _ok("The document.", {"type": "object", "required": ["openapi", "paths"]})},
                security=_OPEN,
            )
        },
        "/docs": {
            "get": _op(
                "docs", "Contract", "Swagger UI over this document",
                {"200": {"description": "The page.", "content": {"text/html": {"schema": _STR}}},
                 **_errors("kserve", (404,), {404: "Swagger UI's files are not installed (swagger-ui-py)."})},
                security=_OPEN,
            )
        },
        "/docs/static/{name}": {
            "get": {
                **_op(
                    "docsAsset", "Contract", "Swagger UI's files (bundled with the server; no CDN)",
                    {"200": {"description": "The file.",
                             "content": {t: {"schema": {"type": "string", "format": "binary"}}
                                         for t in sorted(set(ASSETS.values()))}},
                     **_errors("kserve", (404,), {404: "No such file."})},
                    security=_OPEN,
                ),
                "parameters": [{"name": "name", "in": "path", "required": True,
                                "schema": {"type": "string", "enum": sorted(ASSETS)}}],
            }
        },
    }  # fmt: skip
    return paths


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
        "paths": _paths(),
        "components": {
            "schemas": SCHEMAS,
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
