"""KServe v2 REST (Open Inference Protocol over HTTP, with Triton's binary tensor data extension):
health, server and model metadata/config/statistics, the repository extension (index, load,
unload) and ``/v2/models/{m}/infer``.

An infer body becomes the plain ``Call`` (gateway/call.py) straight from its JSON (and binary)
body, and the ``Answer`` goes back as JSON (and binary); both go through the same pipeline
(gateway/infer.py) the gRPC servicer calls, so validation, budgets, accounting and error messages
are the same; this module never goes through the gRPC servicer or gRPC status codes. Only the
translation lives here, and the error table below (domain ``Kind`` -> HTTP status).

The API key is checked from the headers before the body is read (the door, ``Http.body``).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
from aiohttp import web

from batchgate.gateway import codec as codec_module
from batchgate.gateway import dtypes
from batchgate.gateway.call import Answer, Call, Output, Tensor, Wanted
from batchgate.gateway.codec import serialize_bytes
from batchgate.gateway.errors import GatewayError, Kind, clip, invalid, retry_headers
from batchgate.gateway.logs import REQUEST_ID_KEY, adopt_request_id
from batchgate.gateway.metadata import IndexEntry, ModelStats
from batchgate.gateway.transport.bodies import (
    UNSET,
    Body,
    InferenceRequest,
    RepositoryIndexRequest,
    RepositoryModelRequest,
    decode,
)

if TYPE_CHECKING:
    from batchgate.gateway.admission import Account
    from batchgate.gateway.transport.http import Http
    from batchgate.gateway.transport.server import Server

B = TypeVar("B", bound=Body)
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
    Kind.TOO_LARGE: 413,
    Kind.SLOW: 408,
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


def _statistics_json(stats: list[ModelStats]) -> dict:
    """Triton's statistics JSON: every figure, zeros too (a model without a result cache shows its
    cache's as zeros), and the fields batchgate does not measure, empty, as Triton's JSON has them."""
    docs = []
    for s in stats:
        doc = asdict(s)
        doc["inference_stats"] = {k: v or {"count": 0, "ns": 0} for k, v in doc["inference_stats"].items()}
        doc["memory_usage"], doc["response_stats"] = [], {}
        docs.append(doc)
    return {"model_stats": docs}


def _index_json(entry: IndexEntry) -> dict:
    return {k: v for k, v in asdict(entry).items() if v}  # an empty reason is left out, as before


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
        req: InferenceRequest = decode(header, InferenceRequest)
    except GatewayError as exc:
        if "surrogate" in exc.message:
            _name_surrogate(header)
        raise
    rid = req.id if isinstance(req.id, str) else str(req.id or "")[:256]
    params = req.parameters or {}
    binary_default = bool(params.get("binary_data_output", False))
    call = Call(model, version, rid, parameters=_parameters(params, "binary_data_output"))

    offset = 0
    for inp in req.inputs:  # the types checked the fields: names, shapes (int64) and datatypes
        name, shape, datatype = inp.name, inp.shape, inp.datatype
        in_params = inp.parameters or {}
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
            if inp.data is UNSET:
                raise invalid(f"input '{name}' has neither 'data' nor a binary_data_size parameter")
            need = _count(shape)
            limit = codec_module.LIMITS.max_tensor_elements
            if need is not None and need > limit:  # before any flattening
                raise invalid(
                    f"input '{name}' has shape {shape}: {need} elements; the server accepts at most {limit} "
                    "per tensor (limit max_tensor_elements, BATCHGATE_MAX_TENSOR_ELEMENTS)"
                )
            flat = _flatten(inp.data, name, limit)
            if need is not None and len(flat) != need:
                raise invalid(f"input '{name}': 'data' holds {len(flat)} values; shape {shape} needs {need}")
            _typed(t, flat)
        call.inputs.append(t)
    if offset != len(binary):
        raise invalid(f"the body holds {len(binary) - offset} bytes of binary data that no input claims")

    binary_out: dict[str, bool] = {}
    for out in req.outputs or ():
        out_params = out.parameters or {}
        call.outputs.append(Wanted(out.name, _parameters(out_params, "binary_data")))
        binary_out[out.name] = bool(out_params.get("binary_data", binary_default))
    binary_out[""] = binary_default  # outputs not named in the request
    return call, binary_out


def _name_surrogate(header: bytes) -> None:
    """A lone surrogate escape (the only way JSON names a non-UTF-8 byte) refused by the input
    that holds it; msgspec refuses it as malformed JSON, by byte offset (a refusal's cost only)."""
    try:
        doc = json.loads(header)
        inputs = [i for i in doc["inputs"] if isinstance(i, dict)]
    except (ValueError, RecursionError, LookupError, TypeError):
        return
    for inp in inputs:
        try:
            flat = _flatten(inp.get("data"), "", codec_module.LIMITS.max_tensor_elements)
        except GatewayError:
            continue
        for v in flat:
            if isinstance(v, str):
                try:
                    v.encode()
                except UnicodeEncodeError:
                    raise invalid(
                        f"input '{clip(str(inp.get('name')))}': 'data' holds a value that is not BYTES: a lone "
                        "surrogate escape (no UTF-8 text)"
                    ) from None


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


def _error(status: int, message: str, headers: dict | None = None) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers)


def _refused(exc: GatewayError, headers: dict | None = None) -> web.Response:
    return _error(HTTP_STATUS[exc.kind], exc.message, headers)


class KServeRest:
    """Routes and handlers; every handler stays thin: translate, call the pipeline, translate."""

    def __init__(self, server: Server, http: Http) -> None:
        self.server = server
        self.pipeline = server.pipeline
        self.plane = server.plane
        self.edge = server.metrics.transport("http")
        self.door = server.door
        self.http = http

    # -- the cheap checks, before any body ------------------------------------------------------

    def _caller(self, req: web.Request) -> Account | None:
        """The tenant from the headers (aiohttp keeps them case-insensitive; the directory wants
        gRPC's lower-case keys). UNAUTHENTICATED before a byte of the body is read."""
        if self.pipeline.open:
            return None
        return self.pipeline.identify(self.http.metadata(req))

    async def _body(self, req: web.Request, cls: type[B]) -> B:
        """A repository call's body as its type; none (or blank) is the type's defaults."""
        if not req.can_read_body:
            return cls()
        body = await self.http.body(req)
        if not body.strip():
            return cls()
        return decode(body, cls)

    async def _answer(self, req: web.Request, make, keyed: bool = False) -> web.Response:
        """A metadata-style call: ``make()`` gives its JSON document (or raises GatewayError)."""
        try:
            if keyed:
                self._caller(req)
            doc = make()
        except GatewayError as exc:
            return _refused(exc)
        return web.json_response(doc)

    # -- health and metadata --------------------------------------------------------------------

    async def live(self, _req: web.Request) -> web.Response:
        return web.json_response({"live": True})

    async def ready(self, _req: web.Request) -> web.Response:
        ok = self.plane.ready
        return web.json_response({"ready": ok}, status=200 if ok else 503)

    async def server_metadata(self, req: web.Request) -> web.Response:
        return await self._answer(req, lambda: asdict(self.pipeline.server_metadata()))

    async def model_metadata(self, req: web.Request) -> web.Response:
        name, version = req.match_info["model"], req.match_info.get("version", "")
        try:
            doc = asdict(self.pipeline.model_metadata(name, version))
            # batchgate's extension (KServe's metadata has no parameters): which engine variant
            # serves and how this host's selection chose it (gateway/selection.py)
            doc["batchgate"] = self.pipeline.variant_info(doc["name"], version)
        except GatewayError as exc:
            return _refused(exc)
        return web.json_response(doc)

    async def model_config(self, req: web.Request) -> web.Response:
        name, version = req.match_info["model"], req.match_info.get("version", "")
        # Triton: the config itself
        return await self._answer(req, lambda: _to_json(self.pipeline.model_config(name, version)))

    async def statistics(self, req: web.Request) -> web.Response:
        name, version = req.match_info.get("model", ""), req.match_info.get("version", "")
        make = lambda: _statistics_json(self.pipeline.statistics(name, version))  # noqa: E731
        return await self._answer(req, make, keyed=True)

    async def model_ready(self, req: web.Request) -> web.Response:
        name = req.match_info["model"]
        try:
            self.pipeline.require(name, req.match_info.get("version", ""))
        except GatewayError as exc:
            return _refused(exc)
        return web.json_response({"name": name, "ready": True})

    # -- the repository extension --------------------------------------------------------------

    async def repository_index(self, req: web.Request) -> web.Response:
        try:
            self._caller(req)
            ready = (await self._body(req, RepositoryIndexRequest)).ready
        except GatewayError as exc:
            if exc.kind is Kind.INVALID:
                return _error(400, f'{exc.message} (a JSON object such as {{"ready": true}})')
            return _refused(exc)
        return web.json_response([_index_json(m) for m in self.pipeline.repository_index(ready)])

    async def repository_load(self, req: web.Request) -> web.Response:
        """KServe/Triton ``POST /v2/repository/models/{m}/load``: the gRPC RepositoryModelLoad's
        semantics and rule (model_control on; admin tenants only); ``parameters`` as there."""
        try:
            caller = self._caller(req)
            params = (await self._body(req, RepositoryModelRequest)).parameters or {}
            await self.pipeline.load(caller, req.match_info["model"], params)
        except GatewayError as exc:
            return _refused(exc)
        return web.Response(status=200)

    async def repository_unload(self, req: web.Request) -> web.Response:
        """``POST /v2/repository/models/{m}/unload`` (``unload_dependents`` has nothing to act on)."""
        try:
            caller = self._caller(req)
            await self._body(req, RepositoryModelRequest)
            await self.pipeline.unload(caller, req.match_info["model"])
        except GatewayError as exc:
            return _refused(exc)
        return web.Response(status=200)

    # -- inference ------------------------------------------------------------------------------

    async def infer(self, req: web.Request) -> web.Response:
        model, version = req.match_info["model"], req.match_info.get("version", "")
        rid = adopt_request_id(req.headers.get(REQUEST_ID_KEY))
        echo = {REQUEST_ID_KEY: rid} if rid else {}
        edge = self.edge
        try:
            # before the body: a key-less 60 MiB body is never read, nor one the shedder refuses
            pass_ = self.door.enter(self.http.metadata(req))
        except GatewayError as exc:  # refused at the door: counted here
            edge.failed(model, version, exc)
            return _refused(exc, retry_headers(exc, echo))
        try:
            with pass_:
                try:
                    body = await self.http.body(req)
                    call, binary_out = build_request(model, version, body, req.headers.get(HEADER_LENGTH))
                except GatewayError as exc:  # taken, then refused before the pipeline: counted here
                    edge.failed(model, version, exc)
                    raise
                answer = await self.pipeline.infer(call, pass_, edge)
            payload, header_len = build_response(answer, binary_out)
        except GatewayError as exc:
            return _refused(exc, retry_headers(exc, echo))
        headers = dict(echo)
        if header_len is None:
            headers["Content-Type"] = JSON_TYPE
        else:
            headers["Content-Type"] = BINARY_TYPE
            headers[HEADER_LENGTH] = str(header_len)
        return web.Response(body=payload, headers=headers)


def routes(server: Server, http: Http) -> list[web.RouteDef]:
    """KServe v2's REST routes (the HTTP listener's ``app()`` adds them)."""
    api = KServeRest(server, http)
    table = [
        web.get("/v2/health/live", api.live),
        web.get("/v2/health/ready", api.ready),
        web.get("/v2", api.server_metadata),
        web.post("/v2/repository/index", api.repository_index),
        web.post("/v2/repository/models/{model}/load", api.repository_load),
        web.post("/v2/repository/models/{model}/unload", api.repository_unload),
        web.get("/v2/models/stats", api.statistics),
    ]
    for base in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        table += [
            web.get(base, api.model_metadata),
            web.get(base + "/ready", api.model_ready),
            web.get(base + "/config", api.model_config),
            web.get(base + "/stats", api.statistics),
            web.post(base + "/infer", api.infer),
        ]
    return table
