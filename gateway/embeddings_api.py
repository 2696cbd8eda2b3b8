"""The embedding APIs callers already speak, on the REST listener: OpenAI's ``POST /v1/embeddings``
and ``GET /v1/models``, and Hugging Face TEI's ``POST /embed``.

Only translation lives here. ``embed_texts`` is the one seam to the serving path: it turns a list
of texts into the KServe v2 ``ModelInferRequest``\\s a tritonclient caller would send (BYTES
``[n, 1]``) and hands them to the request pipeline (gateway/infer.py), exactly as KServe REST does —
so the tenant (``Authorization: Bearer``, checked from the headers before the body is read), rate
limits, latency class, result cache, batching with other callers' texts and accounting are the
ones every transport gets, not copies.

Errors are each API's own JSON: OpenAI's ``{"error": {"message", "type", "param", "code"}}`` and
TEI's ``{"error", "error_type"}``, with the statuses those servers use (tables ``OPENAI`` and
``TEI`` below).
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from aiohttp import web

from batchgate.gateway.codec import serialize_bytes
from batchgate.gateway.errors import GatewayError, Kind, retry_headers
from batchgate.gateway.logs import REQUEST_ID, REQUEST_ID_KEY, clean_request_id
from batchgate.proto.inference.v2 import grpc_service_pb2 as pb

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
        too_large: bool = False,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param
        self.headers = headers or {}
        self.too_large = too_large  # TEI answers these 413 (its "validation" errors)


@dataclass(slots=True)
class Embedded:
    vectors: np.ndarray  # float32 [n, dim], as the model computed them
    tokens: list[int]  # the tokenizer's count per text (what the model saw: truncated ones capped)
    model: str
    headers: dict  # response headers from the serving path (x-request-id)


# -- the seam ---------------------------------------------------------------------------------------


def text_models(server: Server) -> list[str]:
    """Served models that take text (parameter ``tokenizer``), sorted."""
    plane = server.plane
    return sorted(
        name for name, versions in plane.models.items() if versions and versions[plane.latest[name]].text
    )


async def embed_texts(
    server: Server, model: str, texts: list[str], metadata: tuple, *,
    latency_class: str | None = None, latency_budget_ms: float | None = None, exact_limit: bool = False,
) -> Embedded:  # fmt: skip
    """Embed ``texts`` with text model ``model`` on the serving path; raises ``Refused``.

    ``metadata``: the caller's headers as gRPC metadata (lower-case keys; the API key, x-request-id).
    ``exact_limit``: refuse a text over the model's ``max_tokens`` (413 in TEI) instead of letting
    the model's ``truncate`` setting decide. The list is sent as one request per length bucket
    (``plan``), each at most max_batch_size texts; they run, and batch with other callers' texts,
    side by side."""
    adm = server.admission
    if not adm.open:  # before anything says whether the model exists
        try:
            adm.identify(metadata)
        except GatewayError as exc:
            raise Refused(exc.kind, exc.message) from None
    try:
        rt = server.plane.get(model)
    except GatewayError as exc:
        raise Refused(exc.kind, exc.message, "model") from None
    stage = rt.text
    if stage is None:
        raise Refused(
            Kind.INVALID, f"model '{model}' does not take text; text models: {text_models(server)}", "model"
        )
    spec = rt.spec
    output = next((t for t in spec.outputs if t.datatype == "FP32"), None)
    if output is None:
        raise Refused(Kind.INVALID, f"model '{model}' has no FP32 output to return as an embedding", "model")
    max_tokens = stage.settings.max_tokens
    max_bytes = stage.settings.max_text_bytes
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
    if exact_limit:
        # Only texts that could be over max_tokens are counted, in a thread, before any other work.
        if long:
            counts = await asyncio.to_thread(stage.count_tokens, [texts[i] for i in long])
            for i, n in zip(long, counts, strict=True):
                if n > max_tokens:
                    raise Refused(
                        Kind.INVALID,
                        f"input {i} is {n} tokens; model '{model}' takes at most {max_tokens} "
                        "(send truncate: true to embed its first tokens)",
                        "input", too_large=True,
                    )  # fmt: skip
    params: dict[str, Any] = {}
    if latency_class is not None:
        params["latency_class"] = latency_class
    if latency_budget_ms is not None:
        params["latency_budget_ms"] = latency_budget_ms
    counting = asyncio.create_task(asyncio.to_thread(stage.count_tokens, texts))
    name = spec.inputs[0].name
    encoded = [t.encode() for t in texts]
    groups = plan(len(encoded), spec.max_batch_size or 1)
    tasks = [
        asyncio.create_task(_infer_chunk(server, model, name, output.name, encoded, rows, params, metadata))
        for rows in groups
    ]
    try:
        parts = await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:  # one refusal answers the whole request: the other parts stop computing
            t.cancel()
        counting.cancel()
        raise
    counts = await counting
    if len(parts) == 1:
        vectors = parts[0][0]
    else:
        vectors = np.empty((len(texts), parts[0][0].shape[1]), dtype=np.float32)
        for rows, (part, _) in zip(groups, parts, strict=True):
            vectors[rows] = part
    if stage.settings.truncate:
        counts = [min(n, max_tokens) for n in counts]
    return Embedded(vectors, counts, spec.name, parts[0][1])


def plan(n: int, max_rows: int) -> list[list[int]]:
    """The KServe requests a list of ``n`` texts is sent as: as few as the model's batch size
    allows, in the caller's order. No split by length here: the scheduler already sends each row
    to the bucket of its own length and batches it there with other callers' rows (issue 21), so
    one request costs one admission (one request against the tenant's rate) and no padding."""
    return [list(range(a, min(a + max_rows, n))) for a in range(0, n, max_rows)]


async def _infer_chunk(
    server: Server, model: str, input_name: str, output: str, encoded: list[bytes], rows: list[int],
    params: dict[str, Any], metadata: tuple,
) -> tuple[np.ndarray, dict]:  # fmt: skip
    """One KServe request of the caller's texts ``rows``; its vectors in that order."""
    req = pb.ModelInferRequest(model_name=model)
    req.inputs.add(name=input_name, datatype="BYTES", shape=[len(rows), 1])
    req.raw_input_contents.append(serialize_bytes(np.array([encoded[i] for i in rows], dtype=object)))
    for key, value in params.items():
        if isinstance(value, str):
            req.parameters[key].string_param = value
        else:
            req.parameters[key].double_param = float(value)
    rid = next((clean_request_id(v) for k, v in metadata if k == REQUEST_ID_KEY), "")
    echo = {REQUEST_ID_KEY: rid} if rid else {}
    pipeline = server.pipeline
    token = REQUEST_ID.set(rid)
    try:
        caller = pipeline.identify(metadata)
        resp = await pipeline.infer(req, caller, server.metrics.transport("http"))
    except GatewayError as exc:
        message = exc.message
        m = _ROW.match(message)
        if m:  # the text stage names rows of this request: say which input of the caller's list
            message = f"input {rows[int(m.group(1))]}: {message[m.end() :]}"
        raise Refused(exc.kind, message, "input" if m else None, retry_headers(exc, echo)) from None
    finally:
        REQUEST_ID.reset(token)
    for i, t in enumerate(resp.outputs):
        if t.name == output:
            vectors = np.frombuffer(resp.raw_output_contents[i], dtype="<f4").reshape(len(rows), -1)
            return vectors, dict(echo)
    raise Refused(Kind.FAILED, f"model '{model}' answered without output '{output}'")


def _metadata(request: web.Request) -> tuple:
    return tuple((k.lower(), v) for k, v in request.headers.items())


# -- request parsing shared by both APIs ------------------------------------------------------------


async def _body(request: web.Request, server: Server) -> Any:
    """The JSON body, read only after the API key in the headers is known good (a key-less caller
    costs its headers, not its body)."""
    try:
        server.pipeline.identify(_metadata(request))
    except GatewayError as exc:
        raise Refused(exc.kind, exc.message) from None
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise Refused(
            Kind.INVALID, f"the request body is larger than {exc.text or 'the limit'}", too_large=True
        ) from None
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
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


def _dimensions(value: Any, dim: int, model: str) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise Refused(Kind.INVALID, "'dimensions' must be an integer", "dimensions")
    if value != dim:
        raise Refused(
            Kind.INVALID,
            f"model '{model}' does not support 'dimensions' {value}: it returns {dim}-dim vectors "
            f"(omit 'dimensions' or send {dim})",
            "dimensions",
        )


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
}  # fmt: skip


def openai_error(exc: Refused) -> web.Response:
    status, type_, code = OPENAI[exc.kind]
    if exc.too_large and exc.kind is Kind.INVALID and exc.param is None:
        status = 413
    body = {"error": {"message": exc.message, "type": type_, "param": exc.param, "code": code}}
    return web.json_response(body, status=status, headers=exc.headers)


def _openai_vector(vec: np.ndarray, fmt: str) -> Any:
    if fmt == "base64":  # OpenAI's form: the little-endian float32 bytes, base64
        return base64.b64encode(vec.astype("<f4", copy=False).tobytes()).decode()
    return vec.tolist()


class EmbeddingsApi:
    def __init__(self, server: Server) -> None:
        self.server = server

    async def openai_embeddings(self, request: web.Request) -> web.Response:
        try:
            doc = await _body(request, self.server)
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
            dims = doc.get("dimensions")
            if dims is not None:
                self._check_dimensions(model, dims)
            out = await embed_texts(
                self.server, model, texts, _metadata(request), latency_class=cls, latency_budget_ms=budget
            )
        except Refused as exc:
            return openai_error(exc)
        total = sum(out.tokens)
        body = {
            "object": "list",
            "data": [
                {"object": "embedding", "index": i, "embedding": _openai_vector(v, fmt)}
                for i, v in enumerate(out.vectors)
            ],
            "model": out.model,
            "usage": {"prompt_tokens": total, "total_tokens": total},
        }
        return web.Response(
            text=json.dumps(body, separators=(",", ":")), content_type="application/json", headers=out.headers
        )

    def _check_dimensions(self, model: str, dims: Any) -> None:
        try:
            rt = self.server.plane.get(model)
        except GatewayError:
            return  # embed_texts answers for the model (after the key is checked)
        output = next((t for t in rt.spec.outputs if t.datatype == "FP32"), None)
        if output is not None and len(output.dims) == 1:
            _dimensions(dims, output.dims[0], model)

    def _visible(self, request: web.Request) -> list[str]:
        """The text models this caller may call (all of them on an open server)."""
        adm = self.server.admission
        names = text_models(self.server)
        if adm.open:
            return names
        try:
            account = adm.identify(_metadata(request))
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

    async def tei_embed(self, request: web.Request) -> web.Response:
        try:
            doc = await _body(request, self.server)
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
            if doc.get("prompt_name") is not None:
                raise Refused(
                    Kind.INVALID, "'prompt_name' is not supported: send the prompt as part of the text"
                )
            model = doc.get("model", DEFAULT_MODEL)
            if not isinstance(model, str):
                raise Refused(Kind.INVALID, "'model' must be the name of a text model")
            cls, budget = _latency(request, doc)
            if doc.get("dimensions") is not None:
                self._check_dimensions(model, doc["dimensions"])
            out = await embed_texts(
                self.server, model, texts, _metadata(request), latency_class=cls, latency_budget_ms=budget,
                exact_limit=not truncate,
            )  # fmt: skip
        except Refused as exc:
            return tei_error(exc)
        vectors = out.vectors
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
    if exc.too_large:
        status = 413
    elif exc.param == "empty":
        status, type_ = 400, "empty"
    return web.json_response({"error": exc.message, "error_type": type_}, status=status, headers=exc.headers)


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


def add_routes(app: web.Application, server: Server) -> None:
    """Register the OpenAI and TEI routes on the REST app (gateway/http.py calls this)."""
    api = EmbeddingsApi(server)
    r = app.router
    r.add_post("/v1/embeddings", api.openai_embeddings)
    r.add_get("/v1/models", api.openai_models)
    r.add_get("/v1/models/{model}", api.openai_model)
    r.add_post("/embed", api.tei_embed)
