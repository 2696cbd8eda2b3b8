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
import json
from typing import TYPE_CHECKING, Any

import numpy as np
from aiohttp import web

from batchgate.gateway.errors import GatewayError, Kind, invalid, not_found, retry_headers
from batchgate.gateway.transport import tei_models
from batchgate.gateway.transport.fields import (
    cut_to,
    dimensions_for,
    TextRoutes,
    json_object,
    flag,
    latency_of,
    prompt_name_of,
    request_echo,
)

if TYPE_CHECKING:
    from batchgate.gateway.transport.http import Http
    from batchgate.gateway.transport.server import Server

# Kind -> (HTTP status, OpenAI error type, code)
OPENAI = {
    Kind.INVALID: (400, "invalid_request_error", None),
    Kind.NOT_FOUND: (404, "invalid_request_error", "model_not_found"),
    Kind.UNAUTHENTICATED: (401, "invalid_request_error", "invalid_api_key"),
    Kind.PERMISSION: (403, "permission_error", "model_not_allowed"),
    Kind.EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    Kind.UNAVAILABLE: (503, "server_error", "unavailable"),
    Kind.DEADLINE: (504, "server_error", "deadline_exceeded"),
    Kind.UNSUPPORTED: (501, "invalid_request_error", "unsupported"),
    Kind.PRECONDITION: (400, "invalid_request_error", None),
    Kind.FAILED: (500, "server_error", None),
    Kind.TOO_LARGE: (413, "invalid_request_error", None),
    Kind.SLOW: (408, "invalid_request_error", "request_timeout"),
}
_OPENAI_FIELDS = {
    "model", "input", "encoding_format", "dimensions", "user", "latency_class", "latency_budget_ms",
    "prompt_name",  # an extension: sentence-transformers' word for one of the model's prompts
    "truncate",  # an extension: cut texts over the model's length instead of refusing them (OpenAI refuses)
}  # fmt: skip


def openai_error(exc: GatewayError, echo: dict | None = None) -> web.Response:
    status, type_, code = OPENAI[exc.kind]
    if exc.kind is Kind.TOO_LARGE and exc.field is not None:
        status = 400  # OpenAI answers an input over a limit 400 naming it; only a body it cannot take 413
    body = {"error": {"message": exc.message, "type": type_, "param": exc.field, "code": code}}
    return web.json_response(body, status=status, headers=retry_headers(exc, echo or {}))


def _openai_vector(vec: np.ndarray, fmt: str) -> Any:
    if fmt == "base64":  # OpenAI's form: the little-endian float32 bytes, base64
        return base64.b64encode(vec.astype("<f4", copy=False).tobytes()).decode()
    return vec.tolist()


def _model_card(name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "batchgate"}


class OpenAI(TextRoutes):
    async def embeddings(self, request: web.Request) -> web.Response:
        echo = request_echo(request)
        try:
            with self.door.enter(self.http.metadata(request)) as pass_:
                doc = await json_object(
                    self.http,
                    request,
                    _OPENAI_FIELDS,
                    "'model' and 'input'",
                    "unrecognized request argument(s)",
                )
                model = doc.get("model")
                if not isinstance(model, str) or not model:
                    raise invalid("'model' is required: the name of a text model", "model")
                if "input" not in doc:
                    raise invalid("'input' is required: a string or a list of strings", "input")
                # the model's own truncate setting unless the call says (OpenAI itself refuses)
                truncate = flag(doc, "truncate", tei_models.truncates(self.server, model))
                texts, given = tei_models.inputs_of(
                    self.server, model, doc["input"], "input", truncate, False
                )
                fmt = doc.get("encoding_format") or "float"
                if fmt not in ("float", "base64"):
                    raise invalid(
                        f"'encoding_format' must be 'float' or 'base64', not {fmt!r}", "encoding_format"
                    )
                if "user" in doc and not isinstance(doc["user"], str):
                    raise invalid("'user' must be a string", "user")
                params = latency_of(request, doc)
                size = dimensions_for(self.server, model, doc.get("dimensions"))
                answer = await self.server.pipeline.texts(
                    pass_, self.edge, model, texts, params, prompt_name=prompt_name_of(doc),
                    exact_limit=not truncate, cut=truncate and given is None, encodings=given,
                )  # fmt: skip
        except GatewayError as exc:
            return openai_error(exc, echo)
        total = sum(answer.tokens)
        body = {
            "object": "list",
            "data": [
                {"object": "embedding", "index": i, "embedding": _openai_vector(v, fmt)}
                for i, v in enumerate(cut_to(answer.outputs[0].array, size))
            ],
            "model": answer.model,
            "usage": {"prompt_tokens": total, "total_tokens": total},
        }
        return web.Response(
            text=json.dumps(body, separators=(",", ":")), content_type="application/json",
            headers={**echo, **dict(pass_.limits)},
        )  # fmt: skip

    async def usage(self, request: web.Request) -> web.Response:
        """OpenAI's usage API for embeddings: a tenant marked admin sees every tenant, another
        tenant only its own figures (this replica's; docs/tenants.md)."""
        try:
            account = self.server.pipeline.identify(self.http.metadata(request))
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

    def _visible(self, request: web.Request) -> list[str]:
        """The text models this caller may call (all of them on an open server)."""
        pipeline = self.server.pipeline
        names = pipeline.text_models()
        account = pipeline.identify(self.http.metadata(request))
        if account is None:
            return names
        allowed = account.models
        return names if allowed is None else [n for n in names if n in allowed]

    async def models(self, request: web.Request) -> web.Response:
        try:
            names = self._visible(request)
        except GatewayError as exc:
            return openai_error(exc)
        return web.json_response({"object": "list", "data": [_model_card(n) for n in names]})

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        try:
            if name not in self._visible(request):
                raise not_found(f"The model '{name}' does not exist or you do not have access to it.")
        except GatewayError as exc:
            if exc.kind is Kind.NOT_FOUND:
                exc.field = "model"
            return openai_error(exc)
        return web.json_response(_model_card(name))


def routes(server: Server, http: Http) -> list[web.RouteDef]:
    """OpenAI's routes (the HTTP listener's ``app()`` adds them)."""
    api = OpenAI(server, http)
    return [
        web.post("/v1/embeddings", api.embeddings),
        web.get("/v1/models", api.models),
        web.get("/v1/models/{model}", api.model),
        web.get("/v1/organization/usage/embeddings", api.usage),
    ]
