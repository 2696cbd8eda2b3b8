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
from batchgate.gateway.errors import GatewayError, Kind, invalid, retry_headers
from batchgate.gateway.transport.bodies import CohereInput, V1RerankRequest, V2EmbedRequest, V2RerankRequest
from batchgate.gateway.transport.fields import (
    TextRoutes,
    documents_of,
    either,
    json_response,
    latency_of,
    openai_error,
    ranked,
    texts_of,
)

if TYPE_CHECKING:
    from batchgate.gateway.transport.http import Http
    from batchgate.gateway.transport.server import Server

TRUNCATE = {"NONE": {"truncate": False}, "START": {"truncate": True, "left": True}, "END": {"truncate": True}}

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


def _rerank_call(request: web.Request, body: V1RerankRequest | V2RerankRequest, **cut) -> TextCall:
    """Cohere's rerank body, v1 or v2 (``cut``: v2's ``max_tokens`` or v1's ``max_chunks``)."""
    return TextCall(
        "scores", body.model, texts=documents_of(body.documents), query=body.query,
        parameters=latency_of(request, body), field="documents", **cut,
    )  # fmt: skip


def v2_rerank_call(request: web.Request, body: V2RerankRequest) -> TextCall:
    return _rerank_call(request, body, max_tokens=body.max_tokens_per_doc)


def v2_rerank_body(body: V2RerankRequest, call: TextCall, answer, headers: dict) -> web.Response:
    results = ranked(answer, body.top_n, either(body.return_documents, False))
    out = {"id": str(uuid.uuid4()), "results": results, "meta": _meta(answer, search_units=1)}
    return json_response(out, headers)


def v2_embed_call(request: web.Request, body: V2EmbedRequest) -> TextCall:
    texts = body.texts
    if texts is None and body.inputs is not None:  # v2's mixed inputs: text content only
        texts = [_input_text(item) for item in body.inputs]
    if texts is None:
        raise invalid("'texts' is required: a list of texts (images are not served)", "texts")
    types = body.embedding_types or ["float"]
    wanted = tuple(dict.fromkeys("float" if t == "base64" else t for t in types))
    return TextCall(
        "dense", body.model, texts=texts_of(texts, "texts"), input_type=body.input_type, types=wanted,
        dimensions=body.output_dimension, max_tokens=body.max_tokens, parameters=latency_of(request, body),
        field="texts", **TRUNCATE[body.truncate or "END"],
    )  # fmt: skip


def _input_text(item: CohereInput) -> str:
    return item.content[0].text  # the type holds one text content each


def _base64(vectors: np.ndarray) -> list[str]:
    return [base64.b64encode(v.astype("<f4", copy=False).tobytes()).decode() for v in vectors]


def v2_embed_body(body: V2EmbedRequest, call: TextCall, answer, headers: dict) -> web.Response:
    embeddings = {}
    for t in body.embedding_types or ["float"]:
        embeddings[t] = _base64(answer.dense["float"]) if t == "base64" else answer.dense[t].tolist()
    out = {
        "id": str(uuid.uuid4()), "response_type": "embeddings_by_type", "embeddings": embeddings,
        "texts": call.texts, "meta": _meta(answer),
    }  # fmt: skip
    return json_response(out, headers)


def v1_rerank_call(request: web.Request, body: V1RerankRequest) -> TextCall:
    return _rerank_call(request, body, max_chunks=body.max_chunks_per_doc)


def v1_rerank_body(body: V1RerankRequest, call: TextCall, answer, headers: dict) -> web.Response:
    out = {
        "model": answer.model, "results": ranked(answer, body.top_n, either(body.return_documents, False)),
        "usage": {"total_tokens": sum(answer.tokens)}, "meta": {"billed_units": {"search_units": 1}},
    }  # fmt: skip
    return json_response(out, headers)


class Cohere(TextRoutes):
    async def v2_rerank(self, request: web.Request) -> web.Response:
        return await self.answer(request, V2RerankRequest, v2_rerank_call, v2_rerank_body, cohere_error)

    async def v2_embed(self, request: web.Request) -> web.Response:
        return await self.answer(request, V2EmbedRequest, v2_embed_call, v2_embed_body, cohere_error)

    async def v1_rerank(self, request: web.Request) -> web.Response:
        """Cohere's v1 / Jina's ``POST /v1/rerank``: ``{results: [{index, relevance_score,
        document?}]}`` by relevance, the first ``top_n``."""
        return await self.answer(request, V1RerankRequest, v1_rerank_call, v1_rerank_body, openai_error)


def routes(server: Server, http: Http) -> list[web.RouteDef]:
    api = Cohere(server, http)
    return [
        web.post("/v2/rerank", api.v2_rerank),
        web.post("/v2/embed", api.v2_embed),
        web.post("/v1/rerank", api.v1_rerank),
    ]
