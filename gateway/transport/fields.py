"""What the text wires share: the JSON body reader, the fields several of them carry (read once
each, into a ``TextCall``: gateway/call.py), and the two error shapes other servers' clients read
(OpenAI's, which vLLM, infinity, Jina and Cohere's compatibility routes answer in, and TEI's).

Each reader refuses with a ``GatewayError`` naming the field (OpenAI's ``param``). Parsing only:
nothing here looks a model up or computes on an answer (gateway/text_calls.py decides).
"""

from __future__ import annotations

import json
import logging
import math
from typing import TYPE_CHECKING, Any

from aiohttp import web

from batchgate.gateway.errors import GatewayError, Kind, clip, invalid, retry_headers, too_large
from batchgate.gateway.text_calls import MAX_INPUTS  # texts per call, one limit for every wire
from batchgate.gateway.logs import REQUEST_ID_KEY, adopt_request_id
from batchgate.gateway.scheduling.request import MIN_BUDGET_MS

if TYPE_CHECKING:
    from batchgate.gateway.call import TextAnswer
    from batchgate.gateway.transport.http import Http
    from batchgate.gateway.transport.server import Server

log = logging.getLogger(__name__)

LATENCY_CLASS_HEADER = "X-Latency-Class"
LATENCY_BUDGET_HEADER = "X-Latency-Budget-Ms"


async def json_body(http: Http, request: web.Request) -> Any:
    """The request's JSON body, by the listener's one body reader (read only once the door has
    taken the call: a key-less caller costs its headers, not its body)."""
    raw = await http.body(request)
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise invalid(f"the request body is not valid JSON: {exc}") from None


async def json_object(
    http: Http, request: web.Request, allowed: set[str] | frozenset[str] | None, shape: str,
    unknown_words: str | None = None,
) -> dict:  # fmt: skip
    """``json_body``, which must be an object (``shape``: what it must hold). A field outside
    ``allowed`` is refused with the API's own ``unknown_words``, naming it (OpenAI refuses them);
    with ``unknown_words`` None it is ignored, as TEI, infinity and Cohere ignore them (logged once
    per field name); ``allowed`` None: any field (the caller checks them once it knows the shape)."""
    doc = await json_body(http, request)
    if not isinstance(doc, dict):
        raise invalid(f"the request body must be a JSON object with {shape}")
    if allowed is None:
        return doc
    if len(doc) > len(allowed):
        unknown = sorted(k for k in doc if k not in allowed)
    else:
        unknown = [k for k in doc if k not in allowed]
    if unknown:
        if unknown_words is not None:
            unknown.sort()
            raise invalid(f"{unknown_words}: {unknown}", unknown[0])
        ignored(request.path, unknown)
    return doc


_IGNORED: set[str] = set()
_IGNORED_MAX = 256  # distinct names logged; past it, none more (a caller cannot grow the set)


def ignored(path: str, names: list[str]) -> None:
    for name in names:
        key = clip(name, 64)
        if key not in _IGNORED and len(_IGNORED) < _IGNORED_MAX:
            _IGNORED.add(key)
            log.info("ignoring unknown field %r (first seen on %s; TEI, infinity and Cohere ignore them too)",
                     key, clip(path, 64))  # fmt: skip


class TextRoutes:
    """What a text API's handlers hold: the server's door and pipeline, the body reader, their edge."""

    def __init__(self, server: Server, http: Http) -> None:
        self.server = server
        self.http = http
        self.door = server.door
        self.pipeline = server.pipeline
        self.edge = server.metrics.transport("http")

    async def answer(self, request: web.Request, body: Body, parse, fmt, error) -> web.Response:
        """One text call: the door entered before the body is read, the body parsed into a
        ``TextCall`` (``parse(request, doc)``), the pipeline, the answer formatted
        (``fmt(doc, call, answer, headers)``); a refusal in the wire's shape (``error``)."""
        echo = request_echo(request)
        try:
            with self.door.enter(self.http.metadata(request)) as pass_:
                doc = await json_object(self.http, request, body.fields, body.shape, body.unknown_words)
                call = parse(request, doc)
                answer = await self.pipeline.texts(pass_, self.edge, call)
        except GatewayError as exc:
            return error(exc, echo)
        return fmt(doc, call, answer, {**echo, **dict(pass_.limits)})


class Body:
    """A route's JSON body: its fields, what it must hold (for the refusal of another shape), and
    what an unknown field gets (the API's words refusing it; None: ignored)."""

    __slots__ = ("fields", "shape", "unknown_words")

    def __init__(self, fields: set[str], shape: str, unknown_words: str | None = None) -> None:
        self.fields = frozenset(fields)
        self.shape = shape
        self.unknown_words = unknown_words


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


def latency_of(request: web.Request, doc: dict) -> dict:
    """The call's parameters ``latency_class`` and ``latency_budget_ms``: the body's extension
    fields, else the headers."""
    cls = doc.get("latency_class", request.headers.get(LATENCY_CLASS_HEADER))
    if cls is not None and not isinstance(cls, str):
        raise invalid("'latency_class' must be a string such as 'realtime'", "latency_class")
    in_body = "latency_budget_ms" in doc
    budget = doc["latency_budget_ms"] if in_body else request.headers.get(LATENCY_BUDGET_HEADER)
    if budget is not None:
        try:
            budget = float(budget)
        except (TypeError, ValueError, OverflowError):
            budget = math.nan
        if isinstance(doc.get("latency_budget_ms"), bool) or not MIN_BUDGET_MS <= budget < math.inf:
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


def flag(doc: dict, key: str, default: bool) -> bool:
    value = doc.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(f"'{key}' must be true or false", key)
    return value


def request_echo(request: web.Request) -> dict:
    """The caller's x-request-id, adopted for the call's log lines, as headers to send back."""
    rid = adopt_request_id(request.headers.get(REQUEST_ID_KEY))
    return {REQUEST_ID_KEY: rid} if rid else {}


def dimensions_of(doc: dict, key: str = "dimensions") -> int | None:
    value = doc.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise invalid(f"'{key}' must be a positive integer", key)
    return value


def prompt_name_of(doc: dict) -> str | None:
    name = doc.get("prompt_name")
    if name is not None and (not isinstance(name, str) or not name):
        raise invalid("'prompt_name' must be the name of one of the model's prompts", "prompt_name")
    return name


def is_ids(value: Any) -> bool:
    """Whether a JSON input is token ids: a list of ints, or a list of such lists."""
    if not isinstance(value, list) or not value:
        return False
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return True
    return all(isinstance(v, list) and v and all(isinstance(x, int) for x in v) for v in value)


def ids_rows(value: list) -> list[list[int]]:
    return value if isinstance(value[0], list) else [value]


def left_of(doc: dict) -> bool:
    """TEI's ``truncation_direction``: whether a text over the model's length keeps its last
    tokens (``Left``) rather than its first (``Right``, the default)."""
    value = doc.get("truncation_direction")
    if value is None or value in ("Right", "right"):
        return False
    if value in ("Left", "left"):
        return True
    raise invalid(
        f"'truncation_direction' must be 'Left' or 'Right', not {clip(value)!r}", "truncation_direction"
    )


def positive(doc: dict, key: str) -> int | None:
    value = doc.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise invalid(f"'{key}' must be a positive integer", key)
    return value


def documents_of(value: Any, field: str = "documents") -> list[str]:
    """Cohere's, Jina's and infinity's ``documents``: strings, or objects with a ``text``."""
    if not isinstance(value, list):
        raise invalid(f"'{field}' must be a list of strings or {{'text': ...}} objects", field)
    out = []
    for i, d in enumerate(value):
        if isinstance(d, dict) and isinstance(d.get("text"), str):
            d = d["text"]
        if not isinstance(d, str):
            raise invalid(f"'{field}[{i}]' must be a string or an object with 'text'", field)
        out.append(d)
    return texts_of(out, field)


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


def json_response(body: Any, headers: dict | None = None, status: int = 200) -> web.Response:
    return web.Response(
        text=json.dumps(body, separators=(",", ":")), content_type="application/json", headers=headers,
        status=status,
    )  # fmt: skip


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


def long_inputs_of(doc: dict) -> str | None:
    """The extension field ``long_inputs``: "truncate" or "chunk" (None: the model's parameter)."""
    value = doc.get("long_inputs")
    if value is not None and value not in ("truncate", "chunk"):
        raise invalid(f"'long_inputs' must be 'truncate' or 'chunk', not {clip(str(value))!r}", "long_inputs")
    return value


def model_of(doc: dict) -> str | None:
    """The body's ``model``: a served model's name, or None (the server's default)."""
    model = doc.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise invalid("'model' must be the name of a served model", "model")
    return model
