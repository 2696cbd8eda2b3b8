"""The REST transport (aiohttp): health, KServe v2 REST (JSON, with Triton's binary tensor data
extension), model metadata/config/statistics, the repository extension (index, load, unload) and
``/metrics``.

A REST call is turned into the ``ModelInferRequest`` the gRPC client would have sent and handed to
the same pipeline (``gateway/infer.py``) the gRPC servicer calls, so validation, budgets,
accounting and error messages are the same; this module never goes through the gRPC servicer or
gRPC status codes. Only the translation lives here: JSON <-> protobuf, and the error table below
(domain ``Kind`` -> HTTP status).

Cheap refusals first: the API key is checked from the headers before the body is read; a body
larger than the limit is refused from its Content-Length; a body that takes longer than
``http_body_timeout_s`` to arrive gets 408; connections are capped and a connection that does not
send a whole request head in ``http_header_timeout_s`` is closed (``Listener``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from typing import TYPE_CHECKING, Any

import numpy as np
from aiohttp import web

from batchgate.gateway import codec as codec_module
from batchgate.gateway import tracing
from batchgate.gateway import dtypes
from batchgate.gateway.call import Answer, Call, Output, Tensor, Wanted
from batchgate.gateway.codec import serialize_bytes
from batchgate.gateway.errors import GatewayError, Kind, clip, invalid, retry_headers
from batchgate.gateway.logs import REQUEST_ID, REQUEST_ID_KEY, clean_request_id
from batchgate.gateway.metrics import CONTENT_TYPE_LATEST

if TYPE_CHECKING:
    from batchgate.gateway.admission import Account
    from batchgate.gateway.transport.server import Server

log = logging.getLogger(__name__)

HTTP_STATUS = {
    Kind.INVALID: 400,
    Kind.NOT_FOUND: 404,
    Kind.UNAVAILABLE: 503,
    Kind.EXHAUSTED: 429,
    Kind.DEADLINE: 504,
    Kind.UNAUTHENTICATED: 401,
    Kind.PERMISSION: 403,
    Kind.UNSUPPORTED: 501,
    Kind.PRECONDITION: 400,  # Triton answers a failed load 400
    Kind.FAILED: 500,
}
HEADER_LENGTH = "Inference-Header-Content-Length"  # Triton's binary tensor data extension
JSON_TYPE = "application/json"
BINARY_TYPE = "application/octet-stream"
MAX_JSON_DEPTH = 32  # nested `data` deeper than this is no tensor any model takes
INT64 = (-(2**63), 2**63)


def _error(status: int, message: str, headers: dict | None = None) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers)


def _to_json(msg, defaults: bool = False) -> dict:
    """A protobuf message as KServe/Triton JSON: 64-bit ints stay numbers (json_format would
    quote them), enums by name. With ``defaults``, unset scalars and messages are included too
    (statistics read better with their zeros)."""
    out: dict[str, Any] = {}
    fields = msg.DESCRIPTOR.fields if defaults else [fd for fd, _ in msg.ListFields()]
    for fd in fields:
        value = getattr(msg, fd.name)
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            vfd = fd.message_type.fields_by_name["value"]
            out[fd.name] = {k: (_to_json(v, defaults) if vfd.message_type else v) for k, v in value.items()}
        elif fd.label == fd.LABEL_REPEATED:
            out[fd.name] = [_value(fd, v, defaults) for v in value]
        elif defaults and fd.containing_oneof is not None and not msg.HasField(fd.name):
            continue
        else:
            out[fd.name] = _value(fd, value, defaults)
    return out


def _value(fd, value, defaults: bool):
    if fd.message_type is not None:
        return _to_json(value, defaults)
    if fd.enum_type is not None:
        return fd.enum_type.values_by_number[value].name
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value


def _parameter(key: str, value: Any) -> Any:
    """A JSON parameter as KServe carries it: bool, int64, double or string."""
    if isinstance(value, bool) or isinstance(value, (float, str)):
        return value
    if isinstance(value, int):
        if not INT64[0] <= value < INT64[1]:
            raise invalid(f"parameter '{clip(key)}' is {clip(value, 32)}: out of the int64 range")
        return value
    raise invalid(f"parameter '{clip(key)}' must be a bool, number or string, not {type(value).__name__}")


def _parameters(params: dict, skip: str = "") -> dict:
    return {key: _parameter(key, value) for key, value in params.items() if key != skip}


def _flatten(data: Any, name: str, limit: int) -> list:
    """KServe allows `data` flat or nested like the shape; either way, row-major. Iterative, with
    the depth and the element count bounded as it goes (no recursion for a client to exhaust)."""
    if not isinstance(data, list):
        return [data]
    if not data or not isinstance(data[0], list):
        return data  # flat already: no copy
    out: list = []
    stack = [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                if item and isinstance(item[0], list):
                    if len(stack) >= MAX_JSON_DEPTH:
                        raise invalid(f"input '{name}': 'data' is nested deeper than {MAX_JSON_DEPTH} levels")
                    stack.append(iter(item))
                    break
                out.extend(item)
            else:
                out.append(item)
            if len(out) > limit:
                raise invalid(
                    f"input '{name}': 'data' holds more than {limit} values (limit max_tensor_elements)"
                )
        else:
            stack.pop()
    return out


def _count(shape: list[int]) -> int | None:
    return math.prod(shape) if all(d >= 0 for d in shape) else None


def build_request(model: str, version: str, body: bytes, header_length: str | None) -> tuple[Call, dict]:
    """The pipeline's ``Call`` for a REST infer body, and {output name: as binary} for the answer
    ("": outputs the body does not name). Binary data stays a view of the body (no copy); JSON
    data becomes typed values, checked as KServe's typed contents would check them."""
    if header_length is not None:
        try:
            n = int(header_length)
        except ValueError:
            raise invalid(f"{HEADER_LENGTH} must be an integer, got '{header_length}'") from None
        if not 0 <= n <= len(body):
            raise invalid(f"{HEADER_LENGTH} is {n} but the body holds {len(body)} bytes")
        header, binary = body[:n], memoryview(body)[n:]
    else:
        header, binary = body, memoryview(b"")
    try:
        doc = json.loads(header)
    except (ValueError, UnicodeDecodeError) as exc:
        raise invalid(f"the request body is not valid JSON: {clip(exc, 200)}") from None
    except RecursionError:  # json's decoder recurses per level: 100,000 '[' end here, cheaply
        raise invalid("the request body is not valid JSON: nested too deeply") from None
    if not isinstance(doc, dict):
        raise invalid("the request body must be a JSON object with 'inputs'")
    rid = doc.get("id", "")
    rid = rid if isinstance(rid, str) else str(rid)[:256]
    params = doc.get("parameters") or {}
    if not isinstance(params, dict):
        raise invalid("'parameters' must be an object")
    binary_default = bool(params.get("binary_data_output", False))
    call = Call(model, version, rid, parameters=_parameters(params, "binary_data_output"))

    inputs = doc.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise invalid(f"model '{model}': 'inputs' must be a non-empty list of tensors")
    offset = 0
    for i, inp in enumerate(inputs):
        if not isinstance(inp, dict) or not isinstance(inp.get("name"), str):
            raise invalid(f"inputs[{i}] must be an object with 'name', 'shape', 'datatype' and 'data'")
        name = inp["name"]
        if len(name) > 128:
            raise invalid(f"inputs[{i}]: name '{clip(name)}' is longer than 128 characters")
        shape, datatype = inp.get("shape"), inp.get("datatype")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and -(2**63) <= d < 2**63 for d in shape
        ):  # (int64 on the wire: a larger number is refused here)
            raise invalid(f"input '{name}': 'shape' must be a list of (64-bit) integers")
        if not isinstance(datatype, str):
            raise invalid(f"input '{name}': 'datatype' must be a string such as FP32 or INT64")
        if len(datatype) > 16:
            raise invalid(f"input '{name}': datatype '{clip(datatype, 16)}' is no KServe datatype")
        in_params = inp.get("parameters") or {}
        if not isinstance(in_params, dict):
            raise invalid(f"input '{name}': 'parameters' must be an object")
        t = Tensor(name, datatype, shape, parameters=_parameters(in_params, "binary_data_size"))
        if "binary_data_size" in in_params:
            value = in_params["binary_data_size"]
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise invalid(f"input '{name}': binary_data_size must be a non-negative integer")
            if offset + value > len(binary):
                raise invalid(
                    f"input '{name}': binary_data_size {value} runs past the end of the body "
                    f"({len(binary) - offset} binary bytes left; is {HEADER_LENGTH} right?)"
                )
            t.raw = binary[offset : offset + value]
            offset += value
        else:
            if "data" not in inp:
                raise invalid(f"input '{name}' has neither 'data' nor a binary_data_size parameter")
            need = _count(shape)
            limit = codec_module.LIMITS.max_tensor_elements
            if need is not None and need > limit:  # before any flattening
                raise invalid(
                    f"input '{name}' has shape {shape}: {need} elements; the server accepts at most {limit} "
                    "per tensor (limit max_tensor_elements, BATCHGATE_MAX_TENSOR_ELEMENTS)"
                )
            flat = _flatten(inp["data"], name, limit)
            if need is not None and len(flat) != need:
                raise invalid(f"input '{name}': 'data' holds {len(flat)} values; shape {shape} needs {need}")
            _typed(t, flat)
        call.inputs.append(t)
    if offset != len(binary):
        raise invalid(f"the body holds {len(binary) - offset} bytes of binary data that no input claims")

    binary_out: dict[str, bool] = {}
    outputs = doc.get("outputs")
    if outputs is not None:
        if not isinstance(outputs, list):
            raise invalid("'outputs' must be a list of {'name': ...} objects")
        for i, out in enumerate(outputs):
            if not isinstance(out, dict) or not isinstance(out.get("name"), str):
                raise invalid(f"outputs[{i}] must be an object with a 'name'")
            if len(out["name"]) > 128:
                raise invalid(f"outputs[{i}]: name '{clip(out['name'])}' is longer than 128 characters")
            out_params = out.get("parameters") or {}
            if not isinstance(out_params, dict):
                raise invalid(f"output '{out['name']}': 'parameters' must be an object")
            call.outputs.append(Wanted(out["name"], _parameters(out_params, "binary_data")))
            binary_out[out["name"]] = bool(out_params.get("binary_data", binary_default))
    binary_out[""] = binary_default  # outputs not named in the request
    return call, binary_out


# JSON value types each datatype's values may have: what KServe's typed contents take.
_INTS = (int, bool)
_JSON_TYPES = {
    "BOOL": _INTS, "FP16": (int, float, bool), "FP32": (int, float, bool), "FP64": (int, float, bool),
    **{d: _INTS for d in ("UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64")},
}  # fmt: skip


def _typed(t: Tensor, flat: list) -> None:
    """``flat`` JSON values as ``t``'s typed values (FP16, which has no typed form, as raw bytes)."""
    datatype = t.datatype
    if datatype == "BYTES":
        try:
            t.values = [_as_bytes(v) for v in flat]
        except (TypeError, UnicodeEncodeError) as exc:  # (a lone surrogate escape is no UTF-8)
            raise invalid(
                f"input '{t.name}': 'data' holds a value that is not BYTES: {clip(exc, 200)}"
            ) from None
        return
    allowed = _JSON_TYPES.get(datatype)
    if allowed is None:
        t.values = flat  # no such datatype: the codec refuses it by name
        return
    for v in flat:
        if type(v) not in allowed:
            raise invalid(
                f"input '{t.name}': 'data' holds a value that is not {datatype}: {clip(repr(v), 64)}"
            )
    if datatype not in dtypes.CONTENTS_FIELD:
        try:
            t.raw = np.asarray(flat, dtype=dtypes.NUMPY[datatype]).tobytes()
        except (OverflowError, ValueError) as exc:
            raise invalid(f"input '{t.name}': 'data' holds a value that is not {datatype}: {exc}") from None
    else:
        t.values = flat


def _as_bytes(v: Any) -> bytes:
    if isinstance(v, str):
        return v.encode()
    if isinstance(v, (bytes, bytearray)):
        return bytes(v)
    raise TypeError(f"{v!r} is not a string")


def build_response(answer: Answer, binary_out: dict[str, bool]) -> tuple[bytes, int | None]:
    """(body, JSON header length when binary data follows it)."""
    doc: dict[str, Any] = {"model_name": answer.model, "model_version": answer.version}
    if answer.id:
        doc["id"] = answer.id
    outs = []
    chunks = []
    for o in answer.outputs:
        arr = o.array
        item: dict[str, Any] = {"name": o.name, "datatype": o.datatype, "shape": list(arr.shape)}
        if binary_out.get(o.name, binary_out[""]):
            data = serialize_bytes(arr) if o.datatype == "BYTES" else arr.tobytes()
            item["parameters"] = {"binary_data_size": len(data)}
            chunks.append(data)
        else:
            item["data"] = _json_data(o)
        outs.append(item)
    doc["outputs"] = outs
    header = json.dumps(doc, separators=(",", ":")).encode()
    if not chunks:
        return header, None
    return b"".join([header, *chunks]), len(header)


def _json_data(o: Output) -> list:
    if o.datatype == "BYTES":  # JSON strings carry UTF-8 only; other bytes are never altered
        try:
            return [b.decode() for b in o.array.reshape(-1)]
        except UnicodeDecodeError:
            raise invalid(
                f"output '{o.name}' holds bytes that are not UTF-8; ask for it with binary_data true"
            ) from None
    if o.datatype not in dtypes.NUMPY:
        raise invalid(
            f"output '{o.name}': {o.datatype} can only be returned as binary data (binary_data true)"
        )
    return o.array.reshape(-1).tolist()


class BodyRefused(Exception):
    """A request body not taken: larger than the limit (413) or slower than the body deadline
    (408). The connection closes with the answer: what is left of the body is never parsed."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


async def read_body(req: web.Request, max_body: int, timeout_s: float) -> bytes:
    """The one reader of every REST route's body: refused by its declared length when too large,
    cut off at ``max_body`` when undeclared (chunked), and within the body deadline (a client
    trickling its body holds a connection, not the server)."""
    n = req.content_length
    if n is not None and n > max_body:
        raise BodyRefused(
            413, f"the request body is {n} bytes; at most {max_body} are accepted (max_http_body_bytes)"
        )
    try:
        async with asyncio.timeout(timeout_s):
            return await req.read()
    except TimeoutError:
        raise BodyRefused(
            408, f"the request body did not arrive within {timeout_s:g} s (http_body_timeout_s)"
        ) from None
    except web.HTTPRequestEntityTooLarge:
        raise BodyRefused(
            413, f"the request body is larger than {max_body} bytes (max_http_body_bytes)"
        ) from None


BODY_REFUSED = "batchgate.body_refused"  # a response mark: the connection ends with it (``_close_refused``)


def body_error(exc: BodyRefused, doc: dict, headers: dict | None = None) -> web.Response:
    """``doc`` (the route's own error shape) as the answer to a refused body, closing the connection."""
    return closing(web.json_response(doc, status=exc.status, headers=headers))


def closing(resp: web.StreamResponse) -> web.StreamResponse:
    """Mark ``resp`` as the last answer on its connection, with nothing more of the body read."""
    resp.force_close()
    resp[BODY_REFUSED] = True
    return resp


@web.middleware
async def _close_refused(request: web.Request, handler):
    """After the answer to a refused body, the connection closes at once: aiohttp would otherwise
    keep reading and discarding the rest of the body for its lingering time (10 s), on which a
    trickling client holds the connection."""
    resp = await handler(request)
    if resp.get(BODY_REFUSED):
        await resp.prepare(request)
        await resp.write_eof()
        if request.transport is not None:
            request.transport.close()  # after the answer: asyncio flushes what is written first
    return resp


def _metadata(req: web.Request) -> list[tuple[str, str]]:
    """The headers the door reads, as gRPC-style metadata (lower-case keys; aiohttp's headers are
    case-insensitive)."""
    h = req.headers
    keys = ("x-api-key", "authorization", *tracing.HEADERS) if tracing.TRACER is not None else _KEY_HEADERS
    return [(k, h[k]) for k in keys if k in h]


_KEY_HEADERS = ("x-api-key", "authorization")


class HttpFrontend:
    """Routes and handlers; every handler stays thin: translate, call the pipeline, translate."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.pipeline = server.pipeline
        self.plane = server.plane
        self.metrics = server.metrics
        self.edge = server.metrics.transport("http")
        s = server.settings
        self.max_body = s.max_http_body_bytes or 6 * server.max_message_bytes
        self.body_timeout_s = s.http_body_timeout_s

    def app(self) -> web.Application:
        plane = self.plane

        @web.middleware
        async def close_when_draining(request: web.Request, handler):
            # While draining, the connection ends with this answer (Connection: close), so the
            # client opens a new one for its next request (refused: the listener is closed) and
            # none is left open for a later close to cut under a request. Raised answers too.
            try:
                resp = await handler(request)
            except web.HTTPException as exc:
                if plane.draining:
                    exc.force_close()
                raise
            if plane.draining:
                resp.force_close()
            return resp

        app = web.Application(
            client_max_size=self.max_body, middlewares=[_close_refused, close_when_draining, _json_errors]
        )
        r = app.router
        r.add_get("/v2/health/live", self.live)
        r.add_get("/v2/health/ready", self.ready)
        r.add_get("/v2", self.server_metadata)
        r.add_get("/metrics", self.scrape)
        r.add_post("/v2/repository/index", self.repository_index)
        r.add_post("/v2/repository/models/{model}/load", self.repository_load)
        r.add_post("/v2/repository/models/{model}/unload", self.repository_unload)
        r.add_get("/v2/models/stats", self.statistics)
        for base in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
            r.add_get(base, self.model_metadata)
            r.add_get(base + "/ready", self.model_ready)
            r.add_get(base + "/config", self.model_config)
            r.add_get(base + "/stats", self.statistics)
            r.add_post(base + "/infer", self.infer)
        from batchgate.gateway.transport.embeddings import add_routes  # OpenAI /v1/embeddings, TEI /embed

        add_routes(app, self.server, self.max_body, self.body_timeout_s)
        from batchgate.gateway.transport import openapi  # GET /openapi.json, GET /docs

        openapi.add_routes(app)
        return app

    # -- the cheap checks, before any body ------------------------------------------------------

    def _caller(self, req: web.Request) -> Account | None:
        """The tenant from the headers (aiohttp keeps them case-insensitive; the directory wants
        gRPC's lower-case keys). UNAUTHENTICATED before a byte of the body is read."""
        if self.pipeline.open:
            return None
        return self.pipeline.identify(_metadata(req))

    async def _body(self, req: web.Request) -> bytes:
        return await read_body(req, self.max_body, self.body_timeout_s)

    async def _json_body(self, req: web.Request) -> dict:
        if not req.can_read_body:
            return {}
        body = await self._body(req)
        if not body.strip():
            return {}
        try:
            doc = json.loads(body)
        except (ValueError, UnicodeDecodeError, RecursionError):
            raise invalid("the request body must be a JSON object") from None
        if not isinstance(doc, dict):
            raise invalid("the request body must be a JSON object")
        return doc

    async def _answer(
        self, req: web.Request, make, defaults: bool = False, keyed: bool = False
    ) -> web.Response:
        """A metadata-style call: ``make()`` gives a protobuf message (or raises GatewayError)."""
        try:
            if keyed:
                self._caller(req)
            msg = make()
        except GatewayError as exc:
            return _error(HTTP_STATUS[exc.kind], exc.message)
        return web.json_response(_to_json(msg, defaults))

    # -- health and metadata --------------------------------------------------------------------

    async def live(self, _req: web.Request) -> web.Response:
        return web.json_response({"live": True})

    async def ready(self, _req: web.Request) -> web.Response:
        ok = self.plane.ready
        return web.json_response({"ready": ok}, status=200 if ok else 503)

    async def server_metadata(self, req: web.Request) -> web.Response:
        return await self._answer(req, self.pipeline.server_metadata)

    async def model_metadata(self, req: web.Request) -> web.Response:
        name, version = req.match_info["model"], req.match_info.get("version", "")
        return await self._answer(req, lambda: self.pipeline.model_metadata(name, version))

    async def model_config(self, req: web.Request) -> web.Response:
        name, version = req.match_info["model"], req.match_info.get("version", "")
        # Triton: the config itself
        return await self._answer(req, lambda: self.pipeline.model_config(name, version).config)

    async def statistics(self, req: web.Request) -> web.Response:
        name, version = req.match_info.get("model", ""), req.match_info.get("version", "")
        make = lambda: self.pipeline.statistics(name, version)  # noqa: E731
        return await self._answer(req, make, defaults=True, keyed=True)

    async def model_ready(self, req: web.Request) -> web.Response:
        name = req.match_info["model"]
        try:
            self.plane.get(name, req.match_info.get("version", ""))
        except GatewayError as exc:
            return _error(HTTP_STATUS[exc.kind], exc.message)
        return web.json_response({"name": name, "ready": True})

    async def scrape(self, _req: web.Request) -> web.Response:
        return web.Response(body=self.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    # -- the repository extension --------------------------------------------------------------

    async def repository_index(self, req: web.Request) -> web.Response:
        try:
            self._caller(req)
            ready = (await self._json_body(req)).get("ready", False)
            if not isinstance(ready, bool):
                raise invalid("'ready' must be true or false")
        except BodyRefused as exc:
            return body_error(exc, {"error": exc.message})
        except GatewayError as exc:
            if exc.kind is Kind.INVALID:
                return _error(400, 'the request body must be a JSON object such as {"ready": true}')
            return _error(HTTP_STATUS[exc.kind], exc.message)
        resp = self.pipeline.repository_index(ready)
        return web.json_response([_to_json(m) for m in resp.models])

    async def repository_load(self, req: web.Request) -> web.Response:
        """KServe/Triton ``POST /v2/repository/models/{m}/load``: the gRPC RepositoryModelLoad's
        semantics and rule (model_control on; admin tenants only); ``parameters`` as there."""
        try:
            caller = self._caller(req)
            params = (await self._json_body(req)).get("parameters") or {}
            if not isinstance(params, dict):
                raise invalid("'parameters' must be an object")
            await self.pipeline.load(caller, req.match_info["model"], params)
        except BodyRefused as exc:
            return body_error(exc, {"error": exc.message})
        except GatewayError as exc:
            return _error(HTTP_STATUS[exc.kind], exc.message)
        return web.Response(status=200)

    async def repository_unload(self, req: web.Request) -> web.Response:
        """``POST /v2/repository/models/{m}/unload`` (``unload_dependents`` has nothing to act on)."""
        try:
            caller = self._caller(req)
            await self._json_body(req)
            await self.pipeline.unload(caller, req.match_info["model"])
        except BodyRefused as exc:
            return body_error(exc, {"error": exc.message})
        except GatewayError as exc:
            return _error(HTTP_STATUS[exc.kind], exc.message)
        return web.Response(status=200)

    # -- inference ------------------------------------------------------------------------------

    async def infer(self, req: web.Request) -> web.Response:
        model, version = req.match_info["model"], req.match_info.get("version", "")
        rid = clean_request_id(req.headers.get(REQUEST_ID_KEY))
        echo = {REQUEST_ID_KEY: rid} if rid else {}
        token = REQUEST_ID.set(rid)
        try:
            try:
                # before the body: a key-less 60 MiB body is never read, nor one the gate refuses
                pass_ = self.pipeline.door.enter(_metadata(req))
            except GatewayError as exc:  # refused at the door: counted here
                self.edge.failed(model, version, exc)
                return _error(HTTP_STATUS[exc.kind], exc.message, echo)
            try:
                body = await self._body(req)
                call, binary_out = build_request(model, version, body, req.headers.get(HEADER_LENGTH))
            except GatewayError as exc:  # taken, then refused before the pipeline: counted as it ends
                self.pipeline.failed(pass_, self.edge, model, version, exc)
                return _error(HTTP_STATUS[exc.kind], exc.message, echo)
            except BodyRefused as exc:
                self.pipeline.door.leave(None, pass_)
                return body_error(exc, {"error": exc.message}, echo)
            try:
                answer = await self.pipeline.infer(call, pass_, self.edge)
                payload, header_len = build_response(answer, binary_out)
            except GatewayError as exc:
                return _error(HTTP_STATUS[exc.kind], exc.message, retry_headers(exc, echo))
        finally:
            REQUEST_ID.reset(token)
        headers = dict(echo)
        if header_len is None:
            headers["Content-Type"] = JSON_TYPE
        else:
            headers["Content-Type"] = BINARY_TYPE
            headers[HEADER_LENGTH] = str(header_len)
        return web.Response(body=payload, headers=headers)


@web.middleware
async def _json_errors(request: web.Request, handler):
    """aiohttp's own refusals (no such route, wrong method, body too large) as JSON errors too."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400 or exc.content_type == JSON_TYPE:
            raise
        headers = (
            {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        )  # a 405 names the methods
        return _error(exc.status, exc.reason if exc.status != 413 else exc.text or exc.reason, headers)
    except Exception as exc:  # a bug: say so, keep serving
        log.exception("HTTP %s %s failed", request.method, clip(request.path))
        return _error(500, f"internal error: {type(exc).__name__}: {clip(exc, 512)}")


class _Refuse(asyncio.Protocol):
    """A connection over ``http_max_connections``: one 503 and closed, before any parsing."""

    def connection_made(self, transport) -> None:
        transport.write(
            b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
            b'Content-Length: 49\r\n\r\n{"error": "too many connections; try again later"}'
        )
        transport.close()


class Listener:
    """A listening socket for an aiohttp runner, through public API only (the runner's protocol
    factory and asyncio's ``create_server``), with an optional connection cap in front of the
    factory: a connection over it gets ``_Refuse`` before any parsing."""

    def __init__(self, server: asyncio.Server, cap: _Cap | None) -> None:
        self._listening = server
        self._cap = cap
        self.port = (
            server.sockets[0].getsockname()[1] if server.sockets else 0
        )  # the real port when 0 was asked

    @property
    def refused(self) -> int:
        return self._cap.refused if self._cap is not None else 0

    @classmethod
    async def open(
        cls, runner: web.AppRunner, host: str, port: int, *, reuse_port: bool = False,
        ssl_context=None, max_connections: int | None = None,
    ) -> Listener:  # fmt: skip
        factory = runner.server
        if factory is None:
            raise RuntimeError("the runner is not set up")
        cap = _Cap(factory, max_connections) if max_connections else None
        server = await asyncio.get_running_loop().create_server(
            cap or factory, host, port, ssl=ssl_context, reuse_address=True, reuse_port=reuse_port or None,
        )  # fmt: skip
        return cls(server, cap)

    def stop_accepting(self) -> None:
        """Close the listening socket only; connections already open go on being served."""
        self._listening.close()


class _Cap:
    def __init__(self, factory: web.Server, max_connections: int) -> None:
        self.factory = factory
        self.max_connections = max_connections
        self.refused = 0

    def __call__(self):
        if len(self.factory.connections) >= self.max_connections:
            self.refused += 1
            return _Refuse()
        return self.factory()


async def start(server: Server) -> tuple[web.AppRunner, int]:
    """Serve the HTTP side for ``server``; returns the runner (for cleanup) and the bound port."""
    s = server.settings
    # keepalive_timeout is aiohttp's one timer for a connection waiting for a request head: it
    # runs from the connection's start and from each answer, and data arriving does not reset it
    # (aiohttp >= 3.10), so it is the header deadline too (idle keep-alive connections close then).
    runner = web.AppRunner(
        HttpFrontend(server).app(), access_log=None, keepalive_timeout=s.http_header_timeout_s,
        max_field_size=16 * 1024, max_line_size=16 * 1024,
        # A caller that hangs up cancels its handler: its queued rows leave the queue before
        # compute (counted as outcome "cancelled"), as a gRPC cancellation does.
        handler_cancellation=True,
    )  # fmt: skip
    await runner.setup()
    tls = getattr(server, "tls", None)
    listener = await Listener.open(
        runner, s.host, s.http_port, reuse_port=s.reuse_port, ssl_context=tls.ssl_context() if tls else None,
        max_connections=s.http_max_connections,
    )  # fmt: skip
    server.http_site = listener
    return runner, listener.port
