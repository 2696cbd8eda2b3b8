"""The embedding APIs callers already speak, on the REST listener: OpenAI's ``POST /v1/embeddings``
and ``GET /v1/models``, and Hugging Face TEI's ``POST /embed``.

Only translation lives here. ``embed_texts`` is the one seam to the serving path: it hands a list
of texts to the request pipeline's one entry for texts (``Pipeline.texts``, gateway/infer.py), so
the tenant (``Authorization: Bearer``, checked from the headers before the body is read), rate
limits, latency class, result cache, batching with other callers' texts and accounting are the
ones every transport gets, not copies.

Errors are each API's own JSON: OpenAI's ``{"error": {"message", "type", "param", "code"}}`` and
TEI's ``{"error", "error_type"}``, with the statuses those servers use (tables ``OPENAI`` and
``TEI`` below).
"""

from __future__ import annotations

import asyncio
import base64
import functools
import json
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from aiohttp import web

from batchgate.gateway.admission.door import Pass
from batchgate.gateway.errors import GatewayError, Kind, retry_headers
from batchgate.gateway.infer import prompt_of
from batchgate.gateway.logs import REQUEST_ID, REQUEST_ID_KEY, clean_request_id
from batchgate.gateway.text import PAIR_SEPARATOR
from batchgate.gateway.transport.rest import BodyRefused, closing, read_body

if TYPE_CHECKING:
    from batchgate.gateway.transport.server import Server

MAX_INPUTS = 2048  # texts per request: OpenAI's own limit; larger bodies are refused before any work
DEFAULT_MODEL = "minilm"  # what /embed serves when the body names no model
LATENCY_CLASS_HEADER = "X-Latency-Class"
LATENCY_BUDGET_HEADER = "X-Latency-Budget-Ms"
_ROW = re.compile(r"^input '[^']*' row (\d+): ")


class Refused(Exception):
    """A request refused before or inside the pipeline: the domain kind, a message fit for the
    caller, the input it concerns (OpenAI's ``param``) and headers to send (Retry-After, ids)."""

    def __init__(
        self, kind: Kind, message: str, param: str | None = None, headers: dict | None = None,
        too_large: bool = False, status: int | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param
        self.headers = headers or {}
        self.too_large = too_large  # TEI answers these 413 (its "validation" errors)
        self.status = status  # the body was refused (408/413): this status, and the connection closes


@dataclass(slots=True)
class Embedded:
    vectors: np.ndarray  # float32 [n, dim], as the model computed them
    tokens: list[int]  # the tokenizer's count per text (what the model saw: truncated ones capped)
    model: str
    headers: dict  # response headers from the serving path (x-request-id)


# -- the seam ---------------------------------------------------------------------------------------


def text_models(server: Server, pairs: bool | None = None) -> list[str]:
    """Served models that take text (parameter ``tokenizer``), sorted; ``pairs``: only those that
    do (True: rerank models) or do not (False: embedding models) take pairs."""
    plane = server.plane
    out = []
    for name, versions in plane.models.items():
        stage = versions[plane.latest[name]].text if versions else None
        if stage is not None and (pairs is None or stage.settings.pair == pairs):
            out.append(name)
    return sorted(out)


def rerank_models(server: Server) -> list[str]:
    return text_models(server, pairs=True)


async def embed_texts(
    server: Server, model: str, texts: list[str], metadata: tuple, *,
    pass_: Pass, latency_class: str | None = None, latency_budget_ms: float | None = None,
    exact_limit: bool = False, pairs: bool = False, prompt_name: str | None = None, cut: bool = False,
) -> Embedded:  # fmt: skip
    """Embed ``texts`` with text model ``model`` on the serving path; raises ``Refused``.

    ``metadata``: the caller's headers as gRPC metadata (lower-case keys; the API key, x-request-id).
    ``pass_``: the door's pass, taken by the route before it read the body (``_body``).
    ``exact_limit``: refuse a text over the model's ``max_tokens`` (413 in TEI) instead of letting
    the model's ``truncate`` setting decide. ``cut``: the caller asked for truncation, so a text
    over ``max_text_bytes`` is cut to it (at a character) instead of refused; the model keeps its
    first ``max_tokens`` tokens. The whole list is one call (``Pipeline.texts``): through the door
    once, admitted once against the tenant's limits for all its rows, each text tokenised once,
    its rows queued by length bucket to batch with other callers' texts."""
    try:
        rt = server.plane.get(model)
    except GatewayError as exc:
        raise Refused(exc.kind, exc.message, "model") from None
    stage = rt.text
    if stage is None:
        raise Refused(
            Kind.INVALID, f"model '{model}' does not take text; text models: {text_models(server)}", "model"
        )
    if stage.settings.pair != pairs:
        if pairs:
            message = f"model '{model}' is not a rerank model (a cross-encoder); rerank models: {rerank_models(server)}"
        else:
            message = f"model '{model}' is a rerank model: send its query and texts to /rerank or /v1/rerank"
        raise Refused(Kind.INVALID, message, "model")
    spec = rt.spec
    output = next((t for t in spec.outputs if t.datatype == "FP32"), None)
    if output is None:
        raise Refused(Kind.INVALID, f"model '{model}' has no FP32 output to return as an embedding", "model")
    try:
        # before every text: what the model, the checks and the cache see
        prompt = prompt_of(spec, prompt_name)
    except GatewayError as exc:
        raise Refused(exc.kind, exc.message, "prompt_name") from None
    max_tokens = stage.settings.max_tokens
    max_bytes = stage.settings.max_text_bytes
    if cut:
        if not stage.settings.truncate:
            raise Refused(
                Kind.INVALID,
                f"model '{model}' does not truncate (parameter truncate is 'reject')",
                "truncate",
            )
        # Every token covers at least one byte: the first max_text_bytes bytes hold more tokens
        # than max_tokens for any text this bound was made for; cutting first bounds the work.
        room = max_bytes - len(prompt.encode())
        texts = [_cut_text(t, room) if len(t) * 4 > room else t for t in texts]
    if prompt:
        texts = [prompt + t for t in texts]
    fits = max_tokens - stage.specials  # a text of at most this many bytes cannot be over max_tokens
    long = []
    for i, t in enumerate(texts):
        if len(t) * 4 > fits:  # (a character is at most 4 UTF-8 bytes)
            n = len(t.encode())
            if n > max_bytes:  # refused before the tokenizer ever sees it (bounds the counting below)
                raise Refused(
                    Kind.INVALID,
                    f"input {i}: text is {n} bytes; model '{model}' accepts at most {max_bytes} "
                    "(parameter max_text_bytes)",
                    "input", too_large=True,
                )  # fmt: skip
            if n > fits:
                long.append(i)
    encodings = None
    if exact_limit and long:
        # Only texts that could be over max_tokens are tokenised before admission (in a thread);
        # their encodings go on with the call, so no text is tokenised twice.
        made = await asyncio.to_thread(stage.encode, [texts[i] for i in long])
        for i, e in zip(long, made, strict=True):
            if e.overflowing or len(e.ids) > max_tokens:
                n = len(e.ids) if not e.overflowing else "more than " + str(max_tokens)
                raise Refused(
                    Kind.INVALID,
                    f"input {i} is {n} tokens; model '{model}' takes at most {max_tokens} "
                    "(send truncate: true to keep its first tokens)",
                    "input", too_large=True,
                )  # fmt: skip
        encodings = [None] * len(texts)
        for i, e in zip(long, made):
            encodings[i] = e
    params: dict[str, Any] = {}
    if latency_class is not None:
        params["latency_class"] = latency_class
    if latency_budget_ms is not None:
        params["latency_budget_ms"] = latency_budget_ms
    rid = next((clean_request_id(v) for k, v in metadata if k == REQUEST_ID_KEY), "")
    echo = {REQUEST_ID_KEY: rid} if rid else {}
    token = REQUEST_ID.set(rid)
    try:
        answer = await server.pipeline.texts(
            pass_, server.metrics.transport("http"), spec.name, [t.encode() for t in texts], params,
            output.name, encodings,
        )  # fmt: skip
    except GatewayError as exc:
        message = exc.message
        m = _ROW.match(message)
        if m:  # the text stage names the row: the caller's list index
            message = f"input {m.group(1)}: {message[m.end() :]}"
        raise Refused(exc.kind, message, "input" if m else None, retry_headers(exc, echo)) from None
    finally:
        REQUEST_ID.reset(token)
    return Embedded(answer.outputs[0].array, answer.tokens, spec.name, echo)


def _cut_text(text: str, max_bytes: int) -> str:
    raw = text.encode()
    if len(raw) <= max_bytes:
        return text
    return raw[: max(max_bytes, 0)].decode("utf-8", "ignore")  # (a character cut in two is dropped)


def _metadata(request: web.Request) -> tuple:
    return tuple((k.lower(), v) for k, v in request.headers.items())


# -- request parsing shared by both APIs ------------------------------------------------------------


def _enter(server: Server, metadata) -> Pass:
    """Through the door (the API key, the overload gate), as ``Refused`` when it says no."""
    try:
        return server.pipeline.door.enter(metadata)
    except GatewayError as exc:
        raise Refused(exc.kind, exc.message, None, retry_headers(exc, {})) from None


_PASS = "batchgate.pass"  # the request's door pass, ended by ``_ends_its_pass`` if nothing else did


def _ends_its_pass(route):
    """A route that takes a door pass: however the call ends (a field refused before the pipeline,
    a body that never came), the door counts its end once, so the overload gate's ended calls
    match the calls it took."""

    @functools.wraps(route)
    async def wrapped(self, request: web.Request) -> web.StreamResponse:
        try:
            return await route(self, request)
        finally:
            pass_ = request.get(_PASS)
            if pass_ is not None and not pass_.ended:
                self.server.pipeline.door.leave(None, pass_)

    return wrapped


async def _body(request: web.Request, api: EmbeddingsApi) -> tuple[Pass, Any]:
    """The door's pass and the JSON body, read only once the door has taken the call (a key-less
    caller costs its headers, not its body), by the REST listener's one body reader."""
    pass_ = request[_PASS] = _enter(api.server, _metadata(request))
    try:
        raw = await read_body(request, api.max_body, api.body_timeout_s)
    except BodyRefused as exc:
        raise Refused(Kind.INVALID, exc.message, too_large=exc.status == 413, status=exc.status) from None
    try:
        return pass_, json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise Refused(Kind.INVALID, f"the request body is not valid JSON: {exc}") from None


def _texts(value: Any, field: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise Refused(Kind.INVALID, f"'{field}' must be a string or a list of strings", field)
    if not value:
        raise Refused(Kind.INVALID, f"'{field}' is an empty list; send at least one text", field)
    if len(value) > MAX_INPUTS:
        raise Refused(
            Kind.INVALID, f"'{field}' holds {len(value)} texts; at most {MAX_INPUTS} per request", field,
            too_large=True,
        )  # fmt: skip
    if all(isinstance(v, int) for v in value) or all(
        isinstance(v, list) and v and all(isinstance(x, int) for x in v) for v in value
    ):
        raise Refused(
            Kind.INVALID, f"'{field}' holds token ids; this server tokenizes text itself: send strings", field
        )
    for i, v in enumerate(value):
        if not isinstance(v, str):
            raise Refused(Kind.INVALID, f"'{field}[{i}]' must be a string, not {type(v).__name__}", field)
    return value


def _latency(request: web.Request, doc: dict) -> tuple[str | None, float | None]:
    """The latency class and budget: the body's extension fields, else the headers."""
    cls = doc.get("latency_class", request.headers.get(LATENCY_CLASS_HEADER))
    if cls is not None and not isinstance(cls, str):
        raise Refused(Kind.INVALID, "'latency_class' must be a string such as 'realtime'", "latency_class")
    budget = doc.get("latency_budget_ms", request.headers.get(LATENCY_BUDGET_HEADER))
    if budget is not None:
        try:
            budget = float(budget)
        except (TypeError, ValueError):
            budget = -1.0
        if isinstance(doc.get("latency_budget_ms"), bool) or not 0 < budget < math.inf:
            raise Refused(
                Kind.INVALID,
                "'latency_budget_ms' must be a positive number of milliseconds",
                "latency_budget_ms",
            )
    return cls, budget


def _prompt_name(doc: dict) -> str | None:
    name = doc.get("prompt_name")
    if name is not None and (not isinstance(name, str) or not name):
        raise Refused(
            Kind.INVALID, "'prompt_name' must be the name of one of the model's prompts", "prompt_name"
        )
    return name


def _dimensions(value: Any, dim: int, model: str, allowed: tuple[int, ...]) -> int | None:
    """The size a call's ``dimensions`` cuts the vectors to (None: the model's own size)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise Refused(Kind.INVALID, "'dimensions' must be an integer", "dimensions")
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
    raise Refused(
        Kind.INVALID,
        f"model '{model}' does not support 'dimensions' {value}: {why} {sizes}-dim vectors "
        f"(omit 'dimensions' or send one of {sizes})",
        "dimensions",
    )


def _cut(vectors: np.ndarray, size: int | None) -> np.ndarray:
    """Matryoshka: the leading ``size`` values of each vector, re-normalised to unit length."""
    if size is None:
        return vectors
    head = vectors[:, :size].astype(np.float32)
    return (head / np.maximum(np.linalg.norm(head, axis=1, keepdims=True), 1e-12)).astype(np.float32)


# -- OpenAI -----------------------------------------------------------------------------------------

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
    Kind.FAILED: (500, "server_error", None),
}
_OPENAI_FIELDS = {
    "model", "input", "encoding_format", "dimensions", "user", "latency_class", "latency_budget_ms",
    "prompt_name",  # an extension: sentence-transformers' word for one of the model's prompts
    "truncate",  # an extension: cut texts over the model's length instead of refusing them (OpenAI refuses)
}  # fmt: skip


def openai_error(exc: Refused) -> web.Response:
    status, type_, code = OPENAI[exc.kind]
    if exc.too_large and exc.kind is Kind.INVALID and exc.param is None:
        status = 413
    if exc.status == 408:
        status, code = 408, "request_timeout"
    body = {"error": {"message": exc.message, "type": type_, "param": exc.param, "code": code}}
    return _closing(web.json_response(body, status=status, headers=exc.headers), exc)


def _closing(resp: web.Response, exc: Refused) -> web.Response:
    return closing(resp) if exc.status is not None else resp  # a refused body: the connection ends


def _openai_vector(vec: np.ndarray, fmt: str) -> Any:
    if fmt == "base64":  # OpenAI's form: the little-endian float32 bytes, base64
        return base64.b64encode(vec.astype("<f4", copy=False).tobytes()).decode()
    return vec.tolist()


class EmbeddingsApi:
    def __init__(self, server: Server, max_body: int, body_timeout_s: float) -> None:
        self.server = server
        self.max_body = max_body
        self.body_timeout_s = body_timeout_s

    @_ends_its_pass
    async def openai_embeddings(self, request: web.Request) -> web.Response:
        try:
            pass_, doc = await _body(request, self)
            if not isinstance(doc, dict):
                raise Refused(Kind.INVALID, "the request body must be a JSON object with 'model' and 'input'")
            unknown = sorted(set(doc) - _OPENAI_FIELDS)
            if unknown:
                raise Refused(Kind.INVALID, f"unrecognized request argument(s): {unknown}", unknown[0])
            model = doc.get("model")
            if not isinstance(model, str) or not model:
                raise Refused(Kind.INVALID, "'model' is required: the name of a text model", "model")
            if "input" not in doc:
                raise Refused(Kind.INVALID, "'input' is required: a string or a list of strings", "input")
            texts = _texts(doc["input"], "input")
            fmt = doc.get("encoding_format") or "float"
            if fmt not in ("float", "base64"):
                message = f"'encoding_format' must be 'float' or 'base64', not {fmt!r}"
                raise Refused(Kind.INVALID, message, "encoding_format")
            if "user" in doc and not isinstance(doc["user"], str):
                raise Refused(Kind.INVALID, "'user' must be a string", "user")
            cls, budget = _latency(request, doc)
            size = self._check_dimensions(model, doc.get("dimensions"))
            truncate = _flag(doc, "truncate", False)
            out = await embed_texts(
                self.server, model, texts, _metadata(request), latency_class=cls, latency_budget_ms=budget,
                pass_=pass_, prompt_name=_prompt_name(doc), exact_limit=not truncate, cut=truncate,
            )  # fmt: skip
        except Refused as exc:
            return openai_error(exc)
        total = sum(out.tokens)
        body = {
            "object": "list",
            "data": [
                {"object": "embedding", "index": i, "embedding": _openai_vector(v, fmt)}
                for i, v in enumerate(_cut(out.vectors, size))
            ],
            "model": out.model,
            "usage": {"prompt_tokens": total, "total_tokens": total},
        }
        return web.Response(
            text=json.dumps(body, separators=(",", ":")), content_type="application/json", headers=out.headers
        )

    def _check_dimensions(self, model: str, dims: Any) -> int | None:
        if dims is None:
            return None
        try:
            rt = self.server.plane.get(model)
        except GatewayError:
            return None  # embed_texts answers for the model (after the key is checked)
        output = next((t for t in rt.spec.outputs if t.datatype == "FP32"), None)
        if output is not None and len(output.dims) == 1:
            return _dimensions(dims, output.dims[0], model, rt.spec.params.matryoshka_dimensions)
        return None

    def _visible(self, request: web.Request) -> list[str]:
        """The text models this caller may call (all of them on an open server)."""
        door = self.server.pipeline.door
        names = text_models(self.server)
        if door.open:
            return names
        try:
            account = door.identify(_metadata(request))
        except GatewayError as exc:
            raise Refused(exc.kind, exc.message) from None
        allowed = account.models
        return names if allowed is None else [n for n in names if n in allowed]

    async def openai_models(self, request: web.Request) -> web.Response:
        try:
            names = self._visible(request)
        except Refused as exc:
            return openai_error(exc)
        return web.json_response({"object": "list", "data": [_model_card(n) for n in names]})

    async def openai_model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        try:
            names = self._visible(request)
            if name not in names:
                raise Refused(
                    Kind.NOT_FOUND,
                    f"The model '{name}' does not exist or you do not have access to it.",
                    "model",
                )
        except Refused as exc:
            return openai_error(exc)
        return web.json_response(_model_card(name))

    # -- TEI ------------------------------------------------------------------------------------

    @_ends_its_pass
    async def tei_embed(self, request: web.Request) -> web.Response:
        try:
            pass_, doc = await _body(request, self)
            if not isinstance(doc, dict):
                raise Refused(Kind.INVALID, "the request body must be a JSON object with 'inputs'")
            unknown = sorted(set(doc) - _TEI_FIELDS)
            if unknown:
                raise Refused(Kind.INVALID, f"unknown field(s): {unknown}", unknown[0])
            if "inputs" not in doc:
                raise Refused(Kind.INVALID, "'inputs' is required: a string or a list of strings", "inputs")
            if doc["inputs"] == []:
                raise Refused(Kind.INVALID, "Input cannot be empty", "empty")
            texts = _texts(doc["inputs"], "inputs")
            normalize = _flag(doc, "normalize", True)
            truncate = _flag(doc, "truncate", False)
            direction = doc.get("truncation_direction", "Right")
            if direction not in ("Right", "right"):
                raise Refused(
                    Kind.INVALID, "'truncation_direction' must be 'Right': texts keep their first tokens"
                )
            prompt_name = _prompt_name(doc)
            model = doc.get("model", DEFAULT_MODEL)
            if not isinstance(model, str):
                raise Refused(Kind.INVALID, "'model' must be the name of a text model")
            cls, budget = _latency(request, doc)
            size = self._check_dimensions(model, doc.get("dimensions"))
            out = await embed_texts(
                self.server, model, texts, _metadata(request), latency_class=cls, latency_budget_ms=budget,
                exact_limit=not truncate, pass_=pass_, prompt_name=prompt_name, cut=truncate,
            )  # fmt: skip
        except Refused as exc:
            return tei_error(exc)
        vectors = out.vectors
        if size is not None:  # TEI: cut, then normalised only if asked
            vectors = vectors[:, :size].copy()
        if normalize:
            vectors = _unit(vectors)
        total = sum(out.tokens)
        return web.Response(
            text=json.dumps(vectors.tolist(), separators=(",", ":")),
            content_type="application/json",
            headers={
                **out.headers,
                "x-compute-tokens": str(total),
                "x-compute-characters": str(sum(map(len, texts))),
            },
        )


_TEI_FIELDS = {
    "inputs", "normalize", "truncate", "truncation_direction", "prompt_name", "dimensions", "model",
    "latency_class", "latency_budget_ms",
}  # fmt: skip

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
    Kind.FAILED: (424, "backend"),
}


def tei_error(exc: Refused) -> web.Response:
    status, type_ = TEI[exc.kind]
    if exc.status is not None:
        status = exc.status
    elif exc.too_large:
        status = 413
    elif exc.param == "empty":
        status, type_ = 400, "empty"
    return _closing(
        web.json_response({"error": exc.message, "error_type": type_}, status=status, headers=exc.headers),
        exc,
    )


def _flag(doc: dict, key: str, default: bool) -> bool:
    value = doc.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise Refused(Kind.INVALID, f"'{key}' must be true or false", key)
    return value


def _unit(vectors: np.ndarray) -> np.ndarray:
    """Rows scaled to unit length; rows already unit length (minilm's graph ends in L2
    normalisation) are returned bit for bit as the model computed them."""
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    off = np.abs(norms - 1.0) > 1e-5
    if not off.any():
        return vectors
    return np.where(off, vectors / np.maximum(norms, 1e-12), vectors).astype(np.float32)


def _model_card(name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "batchgate"}


# -- rerank: TEI's /rerank and the Cohere/Jina-style /v1/rerank ------------------------------------

_TEI_RERANK_FIELDS = {
    "query", "texts", "truncate", "truncation_direction", "raw_scores", "return_text", "model",
    "latency_class", "latency_budget_ms",
}  # fmt: skip
_V1_RERANK_FIELDS = {
    "model", "query", "documents", "top_n", "return_documents", "max_chunks_per_doc", "rank_fields",
    "latency_class", "latency_budget_ms",
}  # fmt: skip


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return (1.0 / (1.0 + np.exp(-x.astype(np.float64)))).astype(np.float32)


def _query(doc: dict) -> str:
    q = doc.get("query")
    if not isinstance(q, str) or not q.strip():
        raise Refused(Kind.INVALID, "'query' is required: a non-empty string", "query")
    if PAIR_SEPARATOR in q:
        raise Refused(Kind.INVALID, "'query' may not hold U+001F (the pair separator)", "query")
    return q


async def _rerank(api: EmbeddingsApi, request: web.Request, pass_: Pass, doc: dict, texts: list[str],
                  exact_limit: bool, cut: bool = False) -> tuple[np.ndarray, Embedded]:  # fmt: skip
    """The raw scores of (query, text) for each text, in the caller's order."""
    server = api.server
    model = doc.get("model")
    if model is None:
        names = rerank_models(server)
        if len(names) != 1:
            raise Refused(
                Kind.INVALID, f"'model' is required: this server serves rerank models {names}", "model"
            )
        model = names[0]
    if not isinstance(model, str) or not model:
        raise Refused(Kind.INVALID, "'model' must be the name of a rerank model", "model")
    query = _query(doc)
    cls, budget = _latency(request, doc)
    rows = [query + PAIR_SEPARATOR + t for t in texts]
    out = await embed_texts(
        server, model, rows, _metadata(request), latency_class=cls, latency_budget_ms=budget,
        exact_limit=exact_limit, pass_=pass_, pairs=True, cut=cut,
    )  # fmt: skip
    return out.vectors[:, 0].copy(), out


def _documents(value: Any) -> list[str]:
    """Cohere's and Jina's ``documents``: strings, or objects with a ``text``."""
    if not isinstance(value, list):
        raise Refused(
            Kind.INVALID, "'documents' must be a list of strings or {'text': ...} objects", "documents"
        )
    out = []
    for i, d in enumerate(value):
        if isinstance(d, dict) and isinstance(d.get("text"), str):
            d = d["text"]
        if not isinstance(d, str):
            raise Refused(
                Kind.INVALID, f"'documents[{i}]' must be a string or an object with 'text'", "documents"
            )
        out.append(d)
    return _texts(out, "documents")


class RerankApi:
    def __init__(self, api: EmbeddingsApi) -> None:
        self.api = api
        self.server = api.server

    @_ends_its_pass
    async def tei_rerank(self, request: web.Request) -> web.Response:
        """TEI's ``POST /rerank``: ``[{index, score, text?}]`` sorted by score, highest first;
        scores through a sigmoid unless ``raw_scores`` (what TEI answers for a one-label model)."""
        try:
            pass_, doc = await _body(request, self.api)
            if not isinstance(doc, dict):
                raise Refused(Kind.INVALID, "the request body must be a JSON object with 'query' and 'texts'")
            unknown = sorted(set(doc) - _TEI_RERANK_FIELDS)
            if unknown:
                raise Refused(Kind.INVALID, f"unknown field(s): {unknown}", unknown[0])
            if doc.get("texts") == []:
                raise Refused(Kind.INVALID, "Input cannot be empty", "empty")
            texts = _texts(doc.get("texts"), "texts")
            truncate = _flag(doc, "truncate", False)
            raw = _flag(doc, "raw_scores", False)
            return_text = _flag(doc, "return_text", False)
            if doc.get("truncation_direction", "Right") not in ("Right", "right"):
                raise Refused(
                    Kind.INVALID, "'truncation_direction' must be 'Right': texts keep their first tokens"
                )
            scores, out = await _rerank(
                self.api, request, pass_, doc, texts, exact_limit=not truncate, cut=truncate
            )
        except Refused as exc:
            return tei_error(exc)
        if not raw:
            scores = _sigmoid(scores)
        order = sorted(range(len(texts)), key=lambda i: -float(scores[i]))
        body = []
        for i in order:
            item: dict[str, Any] = {"index": i, "score": float(scores[i])}
            if return_text:
                item["text"] = texts[i]
            body.append(item)
        return web.Response(
            text=json.dumps(body, separators=(",", ":")), content_type="application/json",
            headers={**out.headers, "x-compute-tokens": str(sum(out.tokens))},
        )  # fmt: skip

    @_ends_its_pass
    async def v1_rerank(self, request: web.Request) -> web.Response:
        """Cohere's / Jina's ``POST /v1/rerank``: ``{results: [{index, relevance_score,
        document?}]}`` sorted by relevance, the first ``top_n``; relevance through a sigmoid."""
        try:
            pass_, doc = await _body(request, self.api)
            if not isinstance(doc, dict):
                raise Refused(
                    Kind.INVALID, "the request body must be a JSON object with 'query' and 'documents'"
                )
            unknown = sorted(set(doc) - _V1_RERANK_FIELDS)
            if unknown:
                raise Refused(Kind.INVALID, f"unrecognized request argument(s): {unknown}", unknown[0])
            if "documents" not in doc:
                raise Refused(Kind.INVALID, "'documents' is required: a list of texts", "documents")
            texts = _documents(doc["documents"])
            top_n = doc.get("top_n")
            if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1):
                raise Refused(Kind.INVALID, "'top_n' must be a positive integer", "top_n")
            return_documents = _flag(doc, "return_documents", False)
            scores, out = await _rerank(self.api, request, pass_, doc, texts, exact_limit=False)
        except Refused as exc:
            return openai_error(exc)
        relevance = _sigmoid(scores)
        order = sorted(range(len(texts)), key=lambda i: -float(relevance[i]))[: top_n or len(texts)]
        results = []
        for i in order:
            item: dict[str, Any] = {"index": i, "relevance_score": float(relevance[i])}
            if return_documents:
                item["document"] = {"text": texts[i]}
            results.append(item)
        tokens = sum(out.tokens)
        body = {
            "model": out.model, "results": results,
            "usage": {"total_tokens": tokens}, "meta": {"billed_units": {"search_units": 1}},
        }  # fmt: skip
        return web.Response(
            text=json.dumps(body, separators=(",", ":")), content_type="application/json", headers=out.headers
        )


def add_routes(app: web.Application, server: Server, max_body: int, body_timeout_s: float) -> None:
    """Register the OpenAI and TEI routes on the REST app (gateway/transport/rest.py calls this)."""
    api = EmbeddingsApi(server, max_body, body_timeout_s)
    r = app.router
    r.add_post("/v1/embeddings", api.openai_embeddings)
    r.add_get("/v1/models", api.openai_models)
    r.add_get("/v1/models/{model}", api.openai_model)
    r.add_post("/embed", api.tei_embed)
    rerank = RerankApi(api)
    r.add_post("/rerank", rerank.tei_rerank)
    r.add_post("/v1/rerank", rerank.v1_rerank)
