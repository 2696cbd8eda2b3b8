"""The JSON fields the text APIs share (OpenAI embeddings, TEI embed and rerank, Cohere/Jina
rerank), read once each.

Each reader refuses with a ``GatewayError`` naming the field (OpenAI's ``param``); each wire's
error table turns it into that wire's shape.
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

import numpy as np
from aiohttp import web

from batchgate.gateway.errors import GatewayError, invalid, too_large
from batchgate.gateway.logs import REQUEST_ID_KEY, adopt_request_id
from batchgate.gateway.scheduling.request import MIN_BUDGET_MS

if TYPE_CHECKING:
    from batchgate.gateway.transport.http import Http
    from batchgate.gateway.transport.server import Server

MAX_INPUTS = 2048  # texts per request: OpenAI's own limit; larger bodies are refused before any work
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
    http: Http, request: web.Request, allowed: set[str], shape: str, unknown_words: str
) -> dict:
    """``json_body``, which must be an object (``shape``: what it must hold) of ``allowed`` fields
    only (an unknown one is refused with the API's own ``unknown_words``, naming it)."""
    doc = await json_body(http, request)
    if not isinstance(doc, dict):
        raise invalid(f"the request body must be a JSON object with {shape}")
    unknown = sorted(set(doc) - allowed)
    if unknown:
        raise invalid(f"{unknown_words}: {unknown}", unknown[0])
    return doc


class TextRoutes:
    """What a text API's handlers hold: the server's door and pipeline, the body reader, their edge."""

    def __init__(self, server: Server, http: Http) -> None:
        self.server = server
        self.http = http
        self.door = server.door
        self.edge = server.metrics.transport("http")


def texts_of(value: Any, field: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise invalid(f"'{field}' must be a string or a list of strings", field)
    if not value:
        raise invalid(f"'{field}' is an empty list; send at least one text", field)
    if len(value) > MAX_INPUTS:
        raise too_large(f"'{field}' holds {len(value)} texts; at most {MAX_INPUTS} per request", field)
    if all(isinstance(v, int) for v in value) or all(
        isinstance(v, list) and v and all(isinstance(x, int) for x in v) for v in value
    ):
        raise invalid(f"'{field}' holds token ids; this server tokenizes text itself: send strings", field)
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


def prompt_name_of(doc: dict) -> str | None:
    name = doc.get("prompt_name")
    if name is not None and (not isinstance(name, str) or not name):
        raise invalid("'prompt_name' must be the name of one of the model's prompts", "prompt_name")
    return name


def dimensions_of(value: Any, dim: int, model: str, allowed: tuple[int, ...]) -> int | None:
    """The size a call's ``dimensions`` cuts the vectors to (None: the model's own size)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid("'dimensions' must be an integer", "dimensions")
    if value == dim:
        return None
    if value in allowed and value < dim:
        return value
    sizes = sorted({*(a for a in allowed if a < dim), dim})
    why = (
        "its Matryoshka sizes (parameter matryoshka_dimensions) and its own"
        if allowed
        else "none declared: it returns"
    )
    raise invalid(
        f"model '{model}' does not support 'dimensions' {value}: {why} {sizes}-dim vectors "
        f"(omit 'dimensions' or send one of {sizes})",
        "dimensions",
    )


def cut_to(vectors: np.ndarray, size: int | None) -> np.ndarray:
    """Matryoshka: the leading ``size`` values of each vector, re-normalised to unit length."""
    if size is None:
        return vectors
    head = vectors[:, :size].astype(np.float32)
    return (head / np.maximum(np.linalg.norm(head, axis=1, keepdims=True), 1e-12)).astype(np.float32)


def flag(doc: dict, key: str, default: bool) -> bool:
    value = doc.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(f"'{key}' must be true or false", key)
    return value


def dimensions_for(server: Server, model: str, value: Any) -> int | None:
    """``dimensions_of`` for served model ``model`` (None, unchecked, when it is not served: the
    pipeline answers for the model, after the key is checked)."""
    if value is None:
        return None
    try:
        rt = server.plane.get(model)
    except GatewayError:
        return None
    output = next((t for t in rt.spec.outputs if t.datatype == "FP32"), None)
    if output is not None and len(output.dims) == 1:
        return dimensions_of(value, output.dims[0], model, rt.spec.params.matryoshka_dimensions)
    return None


def request_echo(request: web.Request) -> dict:
    """The caller's x-request-id, adopted for the call's log lines, as headers to send back."""
    rid = adopt_request_id(request.headers.get(REQUEST_ID_KEY))
    return {REQUEST_ID_KEY: rid} if rid else {}
