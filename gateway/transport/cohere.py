"""Cohere's API on the REST listener: ``POST /v2/rerank`` and ``POST /v2/embed`` (what
``cohere.ClientV2``, langchain-cohere and LiteLLM's ``cohere/`` provider call), and the v1-style
``POST /v1/rerank`` that Cohere's v1 client and Jina's read.

Only translation lives here: each body into one ``TextCall`` (gateway/call.py), the
``TextAnswer`` into Cohere's JSON. ``input_type`` is handed to the pipeline, which maps it to the
model's prompts (search_query, search_document, classification, clustering); ``embedding_types``
(float, int8, uint8, binary, ubinary) are made there too; ``base64`` is float's bytes, written
here. Cohere ignores body fields it does not know, and so do these routes. Errors are Cohere's
``{"id", "message"}`` with its statuses (table ``COHERE``); ``/v1/rerank`` answers in OpenAI's
shape, as Jina's clients read it.
"""

from __future__ import annotations

import base64
import uuid
from typing import TYPE_CHECKING

import numpy as np
from aiohttp import web

from batchgate.gateway.call import TextCall
from batchgate.gateway.errors import GatewayError, Kind, clip, invalid, retry_headers
from batchgate.gateway.transport.fields import (
    Body,
    TextRoutes,
    documents_of,
    flag,
    json_response,
    latency_of,
    model_of,
    openai_error,
    positive,
    ranked,
    texts_of,
)

if TYPE_CHECKING:
    from batchgate.gateway.transport.http import Http
    from batchgate.gateway.transport.server import Server

_LATENCY = {"latency_class", "latency_budget_ms"}
_V2_RERANK = Body(
    {"model", "query", "documents", "top_n", "max_tokens_per_doc", "priority", "return_documents", *_LATENCY},
    "'model', 'query' and 'documents'",
)
_V2_EMBED = Body(
    {"model", "texts", "inputs", "input_type", "embedding_types", "truncate", "output_dimension", "max_tokens",
     "priority", *_LATENCY},
    "'model', 'texts' and 'input_type'",
)  # fmt: skip
_V1_RERANK = Body(
    {
        "model",
        "query",
        "documents",
        "top_n",
        "return_documents",
        "max_chunks_per_doc",
        "rank_fields",
        *_LATENCY,
    },
    "'query' and 'documents'",
)
INPUT_TYPES = ("search_query", "search_document", "classification", "clustering")
TRUNCATE = {"NONE": {"truncate": False}, "START": {"truncate": True, "left": True}, "END": {"truncate": True}}
EMBEDDING_TYPES = ("float", "int8", "uint8", "binary", "ubinary", "base64")

# Kind -> HTTP status Cohere's API answers (the SDK raises its error class by the status).
COHERE = {
    Kind.INVALID: 400, Kind.NOT_FOUND: 404, Kind.UNAUTHENTICATED: 401, Kind.PERMISSION: 403,
    Kind.EXHAUSTED: 429, Kind.UNAVAILABLE: 503, Kind.DEADLINE: 504, Kind.UNSUPPORTED: 501,
    Kind.PRECONDITION: 400, Kind.FAILED: 500, Kind.TOO_LARGE: 413, Kind.SLOW: 408,
}  # fmt: skip


def cohere_error(exc: GatewayError, echo: dict | None = None) -> web.Response:
    message = exc.message
    if exc.kind is Kind.NOT_FOUND and exc.field == "model":
        message += " (the models served: GET /v1/models)"
    body = {"id": str(uuid.uuid4()), "message": message}
    return web.json_response(body, status=COHERE[exc.kind], headers=retry_headers(exc, echo or {}))


def _meta(answer, **extra) -> dict:
    return {"api_version": {"version": "2"}, "billed_units": {"input_tokens": sum(answer.tokens), **extra}}


def _rerank_call(request: web.Request, doc: dict, **cut) -> TextCall:
    """Cohere's rerank body, v1 or v2 (``cut``: v2's ``max_tokens`` or v1's ``max_chunks``)."""
    if "documents" not in doc:
        raise invalid("'documents' is required: a list of texts", "documents")
    query = doc.get("query")
    if not isinstance(query, str):
        raise invalid("'query' is required: a non-empty string", "query")
    positive(doc, "top_n")
    return TextCall(
        "scores", model_of(doc), texts=documents_of(doc["documents"]), query=query,
        parameters=latency_of(request, doc), field="documents", **cut,
    )  # fmt: skip


def v2_rerank_call(request: web.Request, doc: dict) -> TextCall:
    return _rerank_call(request, doc, max_tokens=positive(doc, "max_tokens_per_doc"))


def v2_rerank_body(doc: dict, call: TextCall, answer, headers: dict) -> web.Response:
    results = ranked(answer, doc.get("top_n"), flag(doc, "return_documents", False))
    body = {"id": str(uuid.uuid4()), "results": results, "meta": _meta(answer, search_units=1)}
    return json_response(body, headers)


def v2_embed_call(request: web.Request, doc: dict) -> TextCall:
    texts = doc.get("texts")
    if texts is None and isinstance(doc.get("inputs"), list):  # v2's mixed inputs: text content only
        texts = [_input_text(i, item) for i, item in enumerate(doc["inputs"])]
    if texts is None:
        raise invalid("'texts' is required: a list of texts (images are not served)", "texts")
    input_type = doc.get("input_type")
    if input_type is not None and input_type not in INPUT_TYPES:
        raise invalid(
            f"'input_type' must be one of {list(INPUT_TYPES)}, not {clip(str(input_type))!r}", "input_type"
        )
    types = doc.get("embedding_types") or ["float"]
    if not isinstance(types, list) or not all(isinstance(t, str) and t in EMBEDDING_TYPES for t in types):
        raise invalid(f"'embedding_types' must be a list of {list(EMBEDDING_TYPES)}", "embedding_types")
    truncate = doc.get("truncate") or "END"
    if truncate not in TRUNCATE:
        raise invalid(f"'truncate' must be one of {list(TRUNCATE)}, not {clip(str(truncate))!r}", "truncate")
    wanted = tuple(dict.fromkeys("float" if t == "base64" else t for t in types))
    return TextCall(
        "dense", model_of(doc), texts=texts_of(texts, "texts"), input_type=input_type, types=wanted,
        dimensions=positive(doc, "output_dimension"), max_tokens=positive(doc, "max_tokens"),
        parameters=latency_of(request, doc), field="texts", **TRUNCATE[truncate],
    )  # fmt: skip


def _input_text(i: int, item) -> str:
    content = item.get("content") if isinstance(item, dict) else None
    if isinstance(content, list) and len(content) == 1 and isinstance(content[0], dict):
        if content[0].get("type") == "text" and isinstance(content[0].get("text"), str):
            return content[0]["text"]
    raise invalid(f"'inputs[{i}]' must hold one text content ({{'type': 'text', 'text': ...}})", "inputs")


def _base64(vectors: np.ndarray) -> list[str]:
    return [base64.b64encode(v.astype("<f4", copy=False).tobytes()).decode() for v in vectors]


def v2_embed_body(doc: dict, call: TextCall, answer, headers: dict) -> web.Response:
    embeddings = {}
    for t in doc.get("embedding_types") or ["float"]:
        embeddings[t] = _base64(answer.dense["float"]) if t == "base64" else answer.dense[t].tolist()
    body = {
        "id": str(uuid.uuid4()), "response_type": "embeddings_by_type", "embeddings": embeddings,
        "texts": call.texts, "meta": _meta(answer),
    }  # fmt: skip
    return json_response(body, headers)


def v1_rerank_call(request: web.Request, doc: dict) -> TextCall:
    return _rerank_call(request, doc, max_chunks=positive(doc, "max_chunks_per_doc"))


def v1_rerank_body(doc: dict, call: TextCall, answer, headers: dict) -> web.Response:
    body = {
        "model": answer.model, "results": ranked(answer, doc.get("top_n"), flag(doc, "return_documents", False)),
        "usage": {"total_tokens": sum(answer.tokens)}, "meta": {"billed_units": {"search_units": 1}},
    }  # fmt: skip
    return json_response(body, headers)


class Cohere(TextRoutes):
    async def v2_rerank(self, request: web.Request) -> web.Response:
        return await self.answer(request, _V2_RERANK, v2_rerank_call, v2_rerank_body, cohere_error)

    async def v2_embed(self, request: web.Request) -> web.Response:
        return await self.answer(request, _V2_EMBED, v2_embed_call, v2_embed_body, cohere_error)

    async def v1_rerank(self, request: web.Request) -> web.Response:
        """Cohere's v1 / Jina's ``POST /v1/rerank``: ``{results: [{index, relevance_score,
        document?}]}`` by relevance, the first ``top_n``."""
        return await self.answer(request, _V1_RERANK, v1_rerank_call, v1_rerank_body, openai_error)


def routes(server: Server, http: Http) -> list[web.RouteDef]:
    api = Cohere(server, http)
    return [
        web.post("/v2/rerank", api.v2_rerank),
        web.post("/v2/embed", api.v2_embed),
        web.post("/v1/rerank", api.v1_rerank),
    ]
