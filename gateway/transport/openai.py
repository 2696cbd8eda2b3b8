"""OpenAI's embedding API on the REST listener: ``POST /v1/embeddings``, ``GET /v1/models`` and
``GET /v1/models/{model}``.

Only translation lives here: the body's fields into one ``Pipeline.texts`` call (gateway/infer.py),
so the tenant (``Authorization: Bearer``, checked from the headers before the body is read), rate
limits, latency class, result cache, batching with other callers' texts and accounting are the
ones every transport gets. Errors are OpenAI's ``{"error": {"message", "type", "param", "code"}}``
with the statuses OpenAI uses (table ``OPENAI``); the Cohere/Jina rerank route (tei.py) answers in
the same shape.
"""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING, Any

import numpy as np
from aiohttp import web

from batchgate.gateway.call import TextCall
from batchgate.gateway.errors import GatewayError, Kind, not_found
from batchgate.gateway.transport.answers import Embedding, EmbeddingsResponse, EmbeddingsUsage
from batchgate.gateway.transport.bodies import EmbeddingsRequest
from batchgate.gateway.transport.fields import (
    TextRoutes,
    either,
    ids_rows,
    is_ids,
    json_response,
    latency_of,
    openai_error,
    texts_of,
)

if TYPE_CHECKING:
    from batchgate.gateway.transport.http import Http
    from batchgate.gateway.transport.server import Server


def _openai_vector(vec: np.ndarray, fmt: str) -> Any:
    if fmt == "base64":  # OpenAI's form: the little-endian float32 bytes, base64
        return base64.b64encode(vec.astype("<f4", copy=False).tobytes()).decode()
    return vec.tolist()


def _model_card(name: str, kind: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "batchgate", "kind": kind}


def embeddings_call(request: web.Request, body: EmbeddingsRequest) -> TextCall:
    """OpenAI's embeddings body as a ``TextCall``: token-id arrays are OpenAI's tokens (what
    tiktoken made), unless the server or model says otherwise (setting ``openai_token_ids``)."""
    value = body.input
    ids = ids_rows(value) if is_ids(value) else None
    return TextCall(
        "dense", body.model, texts=[] if ids is not None else texts_of(value, "input"), ids=ids, ids_from="openai",
        truncate=body.truncate, prompt_name=body.prompt_name, dimensions=body.dimensions,
        parameters=latency_of(request, body), long_inputs=body.long_inputs,
        late_chunking=either(body.late_chunking, False),
    )  # fmt: skip


def embeddings_body(body: EmbeddingsRequest, call: TextCall, answer, headers: dict) -> web.Response:
    fmt = body.encoding_format or "float"
    total = sum(answer.tokens)
    out = EmbeddingsResponse(
        "list",
        [Embedding("embedding", i, _openai_vector(v, fmt)) for i, v in enumerate(answer.dense["float"])],
        answer.model,
        EmbeddingsUsage(total, total),
    )
    return json_response(out, headers)


class OpenAI(TextRoutes):
    async def embeddings(self, request: web.Request) -> web.Response:
        """``POST /v1/embeddings`` (and ``POST /embeddings``, as TEI, infinity and vLLM serve it):
        OpenAI's body and answer."""
        return await self.answer(request, EmbeddingsRequest, embeddings_call, embeddings_body, openai_error)

    async def usage(self, request: web.Request) -> web.Response:
        """OpenAI's usage API for embeddings: a tenant marked admin sees every tenant, another
        tenant only its own figures (this replica's; docs/tenants.md)."""
        try:
            account = self.pipeline.identify(self.http.metadata(request))
            usage = self.server.usage
            if usage is None:
                raise GatewayError(
                    Kind.UNSUPPORTED,
                    "usage metering is off on this server (usage_metering, BATCHGATE_USAGE_METERING)",
                )
            only = None if account is None or account.tenant.admin else account.tenant.name
            query: dict[str, list[str]] = {}
            for key, value in request.query.items():
                query.setdefault(key, []).append(value)
            page = usage.page(query, only)
        except GatewayError as exc:
            return openai_error(exc)
        return web.json_response(page)

    def _visible(self, request: web.Request) -> dict[str, str]:
        """The text models this caller may call (all of them on an open server), with their kinds."""
        pipeline = self.pipeline
        kinds = pipeline.text_kinds()
        account = pipeline.identify(self.http.metadata(request))
        allowed = None if account is None else account.models
        return kinds if allowed is None else {n: k for n, k in kinds.items() if n in allowed}

    async def models(self, request: web.Request) -> web.Response:
        try:
            names = self._visible(request)
        except GatewayError as exc:
            return openai_error(exc)
        return web.json_response({"object": "list", "data": [_model_card(n, k) for n, k in names.items()]})

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        try:
            kinds = self._visible(request)
            if name not in kinds:
                raise not_found(f"The model '{name}' does not exist or you do not have access to it.")
        except GatewayError as exc:
            if exc.kind is Kind.NOT_FOUND:
                exc.field = "model"
            return openai_error(exc)
        return web.json_response(_model_card(name, kinds[name]))


def routes(server: Server, http: Http) -> list[web.RouteDef]:
    """OpenAI's routes (the HTTP listener's ``app()`` adds them)."""
    api = OpenAI(server, http)
    return [
        web.post("/v1/embeddings", api.embeddings),
        web.post("/embeddings", api.embeddings),
        web.get("/v1/models", api.models),
        web.get("/v1/models/{model}", api.model),
        web.get("/v1/organization/usage/embeddings", api.usage),
    ]
