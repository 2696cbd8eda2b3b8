"""What the text wires share: one text call's handler (the body decoded into its type from
gateway/transport/bodies.py), what the types cannot say about the fields several wires carry (a
list of texts or of token ids, the latency budget from a header), and the two error shapes other
servers' clients read (OpenAI's, which vLLM, infinity, Jina and Cohere's compatibility routes answer
in, and TEI's).

Each check refuses with a ``GatewayError`` naming the field (OpenAI's ``param``). Parsing only:
nothing here looks a model up or computes on an answer (gateway/text_calls.py decides).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from batchgate.gateway.errors import GatewayError, Kind, invalid, retry_headers, too_large
from batchgate.gateway.logs import REQUEST_ID_KEY, adopt_request_id
from batchgate.gateway.scheduling.request import MIN_BUDGET_MS
from batchgate.gateway.text_calls import MAX_INPUTS  # texts per call, one limit for every wire
from batchgate.gateway.transport.bodies import Body, Document, Latency, read

if TYPE_CHECKING:
    from batchgate.gateway.call import TextAnswer
    from batchgate.gateway.transport.http import Http
    from batchgate.gateway.transport.server import Server

LATENCY_CLASS_HEADER = "X-Latency-Class"
LATENCY_BUDGET_HEADER = "X-Latency-Budget-Ms"


class TextRoutes:
    """What a text API's handlers hold: the server's door and pipeline, the body reader, their edge."""

    def __init__(self, server: Server, http: Http) -> None:
        self.server = server
        self.http = http
        self.door = server.door
        self.pipeline = server.pipeline
        self.edge = server.metrics.transport("http")

    async def answer(self, request: web.Request, body: type[Body], parse, fmt, error) -> web.Response:
        """One text call: the door entered before the body is read, the body decoded into its
        type (gateway/transport/bodies.py) and parsed into a ``TextCall`` (``parse(request,
        body)``), the pipeline, the answer formatted (``fmt(body, call, answer, headers)``); a
        refusal in the wire's shape (``error``)."""
        echo = request_echo(request)
        try:
            with self.door.enter(self.http.metadata(request)) as pass_:
                doc = read(await self.http.body(request), body, request.path)
                call = parse(request, doc)
                answer = await self.pipeline.texts(pass_, self.edge, call)
        except GatewayError as exc:
            return error(exc, echo)
        return fmt(doc, call, answer, {**echo, **dict(pass_.limits)})


def texts_of(value: Any, field: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise invalid(f"'{field}' must be a string or a list of strings", field)
    if not value:
        raise invalid(f"'{field}' is an empty list; send at least one text", field)
    if len(value) > MAX_INPUTS:
        raise too_large(f"'{field}' holds {len(value)} texts; at most {MAX_INPUTS} per request", field)
    for i, v in enumerate(value):
        if not isinstance(v, str):
            raise invalid(f"'{field}[{i}]' must be a string, not {type(v).__name__}", field)
    return value


def latency_of(request: web.Request, body: Latency) -> dict:
    """The call's parameters ``latency_class`` and ``latency_budget_ms``: the body's extension
    fields, else the headers."""
    cls = body.latency_class
    if cls is None:
        cls = request.headers.get(LATENCY_CLASS_HEADER)
    in_body = body.latency_budget_ms is not None
    budget = body.latency_budget_ms if in_body else request.headers.get(LATENCY_BUDGET_HEADER)
    if budget is not None:
        try:
            budget = float(budget)
        except (TypeError, ValueError, OverflowError):
            budget = math.nan
        if not MIN_BUDGET_MS <= budget < math.inf:
            name = "'latency_budget_ms'" if in_body else f"header {LATENCY_BUDGET_HEADER}"
            raise invalid(
                f"{name} must be a finite number of milliseconds, at least {MIN_BUDGET_MS:g} "
                "(a budget under it cannot be met)", "latency_budget_ms" if in_body else LATENCY_BUDGET_HEADER,
            )  # fmt: skip
    params: dict[str, Any] = {}
    if cls is not None:
        params["latency_class"] = cls
    if budget is not None:
        params["latency_budget_ms"] = budget
    return params


def either(value: bool | None, default: bool) -> bool:
    """A body's optional flag: its value, or the wire's default when absent or null."""
    return default if value is None else value


def request_echo(request: web.Request) -> dict:
    """The caller's x-request-id, adopted for the call's log lines, as headers to send back."""
    rid = adopt_request_id(request.headers.get(REQUEST_ID_KEY))
    return {REQUEST_ID_KEY: rid} if rid else {}


def is_ids(value: Any) -> bool:
    """Whether a JSON input is token ids: a list of ints, or a list of such lists."""
    if not isinstance(value, list) or not value:
        return False
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return True
    return all(isinstance(v, list) and v and all(isinstance(x, int) for x in v) for v in value)


def ids_rows(value: list) -> list[list[int]]:
    return value if isinstance(value[0], list) else [value]


def left_of(direction: str | None) -> bool:
    """TEI's ``truncation_direction``: whether a text over the model's length keeps its last
    tokens (``Left``) rather than its first (``Right``, the default; the body's type refuses others)."""
    return direction in ("Left", "left")


def documents_of(value: list[str | Document], field: str = "documents") -> list[str]:
    """Cohere's, Jina's and infinity's ``documents``: strings, or objects with a ``text``."""
    return texts_of([d if isinstance(d, str) else d.text for d in value], field)


def ranked(answer: TextAnswer, top_n: int | None, return_documents: bool) -> list[dict]:
    """Cohere's rerank results (infinity's and vLLM's too): ``{index, relevance_score,
    document?}`` by relevance, highest first, the first ``top_n``."""
    scores = answer.scores
    order = sorted(range(len(scores)), key=lambda i: -float(scores[i]))[: top_n or len(scores)]
    results = []
    for i in order:
        item: dict[str, Any] = {"index": i, "relevance_score": float(scores[i])}
        if return_documents:
            item["document"] = {"text": answer.texts[i]}
        results.append(item)
    return results


_ENCODER = msgspec.json.Encoder()


def json_response(body: Any, headers: dict | None = None, status: int = 200) -> web.Response:
    """An answer as compact JSON, by msgspec: an answer's types (answers.py) or plain lists and
    dicts alike; 8 vectors of 384 floats encode in ~0.3 ms where ``json.dumps`` took ~3 ms
    (2026-12-07, Zen 4, shared)."""
    return web.Response(
        body=_ENCODER.encode(body), content_type="application/json", headers=headers, status=status
    )


# -- the error shapes ----------------------------------------------------------------------------

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


def openai_error(
    exc: GatewayError, echo: dict | None = None, discovery: str = "GET /v1/models"
) -> web.Response:
    """OpenAI's ``{"error": {"message", "type", "param", "code"}}``; an unknown model's message
    says where the caller finds the served ones (``discovery``)."""
    status, type_, code = OPENAI[exc.kind]
    if exc.kind is Kind.TOO_LARGE and exc.field is not None:
        status = 400  # OpenAI answers an input over a limit 400 naming it; only a body it cannot take 413
    message = exc.message
    if exc.kind is Kind.NOT_FOUND and exc.field == "model" and discovery:
        message += f" (the models served: {discovery})"
    body = {"error": {"message": message, "type": type_, "param": exc.field, "code": code}}
    return web.json_response(body, status=status, headers=retry_headers(exc, echo or {}))


EMPTY = "Input cannot be empty"  # TEI's words, answered 400 "empty"
# Kind -> (HTTP status, TEI error_type); TEI answers input validation 413, JSON it cannot read
# 422, an empty batch 400, a full queue 429, a backend failure 424 (router/src/http/server.rs).
TEI = {
    Kind.INVALID: (422, "validation"),
    Kind.NOT_FOUND: (404, "validation"),
    Kind.UNAUTHENTICATED: (401, "unauthorized"),
    Kind.PERMISSION: (403, "unauthorized"),
    Kind.EXHAUSTED: (429, "overloaded"),
    Kind.UNAVAILABLE: (503, "unhealthy"),
    Kind.DEADLINE: (504, "backend"),
    Kind.UNSUPPORTED: (501, "backend"),
    Kind.PRECONDITION: (422, "validation"),
    Kind.FAILED: (424, "backend"),
    Kind.TOO_LARGE: (413, "validation"),
    Kind.SLOW: (408, "validation"),
}


def tei_error(exc: GatewayError, echo: dict | None = None) -> web.Response:
    status, type_ = TEI[exc.kind]
    if exc.message == EMPTY:
        status, type_ = 400, "empty"
    body = {"error": exc.message, "error_type": type_}
    return web.json_response(body, status=status, headers=retry_headers(exc, echo or {}))
