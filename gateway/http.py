"""The HTTP side (aiohttp): health, KServe v2 REST (JSON, with Triton's binary tensor data
extension), model metadata/config/statistics, and ``/metrics``.

One data plane behind both transports: a REST call is turned into the ``ModelInferRequest`` the
gRPC client would have sent and handed to the same servicer method (``ModelInfer``) through a
small stand-in for the gRPC context, so validation, budgets, request ids, accounting and error
messages are gRPC's own. Only the translation lives here: JSON <-> protobuf, and the error table
below (domain ``Kind`` -> HTTP status), the REST counterpart of ``server.STATUS``.
"""

from __future__ import annotations

import json
import logging
import math
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
from aiohttp import web

from batchgate.gateway import dtypes
from batchgate.gateway.codec import deserialize_bytes, serialize_bytes
from batchgate.gateway.errors import GatewayError, Kind, invalid
from batchgate.gateway.logs import REQUEST_ID, REQUEST_ID_KEY
from batchgate.gateway.metrics import CONTENT_TYPE_LATEST
from batchgate.proto.inference.v2 import grpc_service_pb2 as pb

if TYPE_CHECKING:
    from batchgate.gateway.server import Server

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
    Kind.FAILED: 500,
}
HEADER_LENGTH = "Inference-Header-Content-Length"  # Triton's binary tensor data extension
JSON_TYPE = "application/json"
BINARY_TYPE = "application/octet-stream"


class _Abort(Exception):
    """What ``context.abort`` raises when the servicer is called from HTTP."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing=()) -> None:
        super().__init__(details)
        self.code = code
        self.details = details
        self.trailing = tuple(trailing or ())

    def headers(self, base: tuple) -> dict:
        """The trailing metadata as response headers; ``retry-after-ms`` (rate limits) also as
        the standard ``Retry-After`` in whole seconds."""
        headers = dict(base)
        headers.update(self.trailing)
        ms = headers.get("retry-after-ms")
        if ms is not None:
            try:
                headers["Retry-After"] = str(max(1, math.ceil(float(ms) / 1000)))
            except ValueError:
                pass
        return headers


class _Context:
    """The part of ``grpc.aio.ServicerContext`` the servicer uses, backed by an HTTP request:
    headers are the invocation metadata (lower-case keys, as gRPC has them), trailing metadata
    becomes response headers, abort raises."""

    __slots__ = ("_metadata", "trailing")

    def __init__(self, request: web.Request) -> None:
        self._metadata = tuple((k.lower(), v) for k, v in request.headers.items())
        self.trailing: tuple = ()

    def invocation_metadata(self) -> tuple:
        return self._metadata

    def set_trailing_metadata(self, metadata) -> None:
        self.trailing = tuple(metadata)

    def time_remaining(self) -> float | None:
        return None  # REST has no deadline header; budgets come from parameters or the class

    def peer(self) -> str:
        return "http"

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()) -> None:
        raise _Abort(code, details, trailing_metadata)


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


def _parameter(p: pb.InferParameter, key: str, value: Any) -> None:
    if isinstance(value, bool):
        p.bool_param = value
    elif isinstance(value, int):
        p.int64_param = value
    elif isinstance(value, float):
        p.double_param = value
    elif isinstance(value, str):
        p.string_param = value
    else:
        raise invalid(f"parameter '{key}' must be a bool, number or string, not {type(value).__name__}")


def _flatten(data: Any) -> list:
    """KServe allows `data` flat or nested like the shape; either way, row-major."""
    if not isinstance(data, list):
        return [data]
    if data and isinstance(data[0], list):
        out: list = []
        for item in data:
            out.extend(_flatten(item))
        return out
    return data


def _count(shape: list[int]) -> int | None:
    return math.prod(shape) if all(d >= 0 for d in shape) else None


def build_request(
    model: str, version: str, body: bytes, header_length: str | None
) -> tuple[pb.ModelInferRequest, dict]:
    """The ``ModelInferRequest`` for a REST infer body, and {output name: as binary} for the answer.

    Inputs travel as typed contents when every input came as JSON data; as raw contents when any
    came as binary data (the protocol wants one form for all) or has a type JSON cannot carry
    in typed contents (FP16)."""
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
        raise invalid(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise invalid("the request body must be a JSON object with 'inputs'")
    req = pb.ModelInferRequest(model_name=model, model_version=version, id=str(doc.get("id", "")))
    params = doc.get("parameters") or {}
    if not isinstance(params, dict):
        raise invalid("'parameters' must be an object")
    binary_default = bool(params.get("binary_data_output", False))
    for key, value in params.items():
        if key != "binary_data_output":
            _parameter(req.parameters[key], key, value)

    inputs = doc.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise invalid(f"model '{model}': 'inputs' must be a non-empty list of tensors")
    parsed = []  # (tensor, datatype, binary chunk or None, flat JSON values or None)
    offset = 0
    for i, inp in enumerate(inputs):
        if not isinstance(inp, dict) or not isinstance(inp.get("name"), str):
            raise invalid(f"inputs[{i}] must be an object with 'name', 'shape', 'datatype' and 'data'")
        name = inp["name"]
        shape, datatype = inp.get("shape"), inp.get("datatype")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and -(2**63) <= d < 2**63 for d in shape
        ):  # (int64 on the wire: a larger number is refused here, not by protobuf)
            raise invalid(f"input '{name}': 'shape' must be a list of (64-bit) integers")
        if not isinstance(datatype, str):
            raise invalid(f"input '{name}': 'datatype' must be a string such as FP32 or INT64")
        t = req.inputs.add(name=name, datatype=datatype, shape=shape)
        chunk = None
        for key, value in (inp.get("parameters") or {}).items():
            if key == "binary_data_size":
                if not isinstance(value, int) or value < 0:
                    raise invalid(f"input '{name}': binary_data_size must be a non-negative integer")
                if offset + value > len(binary):
                    raise invalid(
                        f"input '{name}': binary_data_size {value} runs past the end of the body "
                        f"({len(binary) - offset} binary bytes left; is {HEADER_LENGTH} right?)"
                    )
                chunk = bytes(binary[offset : offset + value])
                offset += value
            else:
                _parameter(t.parameters[key], key, value)
        flat = None
        if chunk is None:
            if "data" not in inp:
                raise invalid(f"input '{name}' has neither 'data' nor a binary_data_size parameter")
            flat = _flatten(inp["data"])
            need = _count(shape)
            if need is not None and len(flat) != need:
                raise invalid(f"input '{name}': 'data' holds {len(flat)} values; shape {shape} needs {need}")
        parsed.append((t, datatype, chunk, flat))
    if offset != len(binary):
        raise invalid(f"the body holds {len(binary) - offset} bytes of binary data that no input claims")

    use_raw = any(c is not None or d not in dtypes.CONTENTS_FIELD for _, d, c, _ in parsed)
    for t, datatype, chunk, flat in parsed:
        try:
            if use_raw:
                req.raw_input_contents.append(chunk if chunk is not None else _raw(datatype, flat))
            elif datatype == "BYTES":
                t.contents.bytes_contents.extend(_as_bytes(v) for v in flat)
            else:
                getattr(t.contents, dtypes.CONTENTS_FIELD[datatype]).extend(flat)
        except (TypeError, ValueError, OverflowError) as exc:
            raise invalid(f"input '{t.name}': 'data' holds a value that is not {datatype}: {exc}") from None

    binary_out: dict[str, bool] = {}
    outputs = doc.get("outputs")
    if outputs is not None:
        if not isinstance(outputs, list):
            raise invalid("'outputs' must be a list of {'name': ...} objects")
        for i, out in enumerate(outputs):
            if not isinstance(out, dict) or not isinstance(out.get("name"), str):
                raise invalid(f"outputs[{i}] must be an object with a 'name'")
            o = req.outputs.add(name=out["name"])
            for key, value in (out.get("parameters") or {}).items():
                if key == "binary_data":
                    binary_out[out["name"]] = bool(value)
                else:
                    _parameter(o.parameters[key], key, value)
            # The data plane always answers raw (the cheapest form); JSON is made here.
            o.parameters["binary_data"].bool_param = True
            binary_out.setdefault(out["name"], binary_default)
    binary_out[""] = binary_default  # outputs not named in the request
    return req, binary_out


def _as_bytes(v: Any) -> bytes:
    if isinstance(v, str):
        return v.encode()
    if isinstance(v, (bytes, bytearray)):
        return bytes(v)
    raise TypeError(f"{v!r} is not a string")


def _raw(datatype: str, flat: list) -> bytes:
    if datatype == "BYTES":
        return serialize_bytes(np.array([_as_bytes(v) for v in flat], dtype=object))
    dtype = dtypes.NUMPY.get(datatype)
    if dtype is None:
        return b""  # the codec refuses the datatype by name
    return np.asarray(flat, dtype=dtype).tobytes()


def build_response(resp: pb.ModelInferResponse, binary_out: dict[str, bool]) -> tuple[bytes, int | None]:
    """(body, JSON header length when binary data follows it)."""
    doc: dict[str, Any] = {"model_name": resp.model_name, "model_version": resp.model_version}
    if resp.id:
        doc["id"] = resp.id
    outs = []
    chunks = []
    raw = resp.raw_output_contents
    for i, t in enumerate(resp.outputs):
        shape = list(t.shape)
        item: dict[str, Any] = {"name": t.name, "datatype": t.datatype, "shape": shape}
        data = raw[i] if raw else None
        if binary_out.get(t.name, binary_out[""]):
            if data is None:  # not reached: the data plane answers raw for REST
                raise GatewayError(Kind.FAILED, f"output '{t.name}' came back without raw contents")
            item["parameters"] = {"binary_data_size": len(data)}
            chunks.append(data)
        else:
            item["data"] = _json_data(t, data, shape)
        outs.append(item)
    doc["outputs"] = outs
    header = json.dumps(doc, separators=(",", ":")).encode()
    if not chunks:
        return header, None
    return b"".join([header, *chunks]), len(header)


def _json_data(t, data: bytes | None, shape: list[int]) -> list:
    if data is None:
        field = dtypes.CONTENTS_FIELD.get(t.datatype)
        values = list(getattr(t.contents, field)) if field else []
        return [v.decode("utf-8", "replace") for v in values] if t.datatype == "BYTES" else values
    if t.datatype == "BYTES":
        items = deserialize_bytes(data, math.prod(shape), t.name)
        try:
            return [b.decode() for b in items]
        except UnicodeDecodeError:
            raise invalid(
                f"output '{t.name}' holds bytes that are not UTF-8; ask for it with binary_data true"
            ) from None
    dtype = dtypes.NUMPY.get(t.datatype)
    if dtype is None:
        raise invalid(
            f"output '{t.name}': {t.datatype} can only be returned as binary data (binary_data true)"
        )
    return np.frombuffer(data, dtype=dtype).tolist()


class HttpFrontend:
    """Routes and handlers; every handler stays thin: translate, call the servicer, translate."""

    def __init__(self, server: Server) -> None:
        from batchgate.gateway.server import STATUS  # the gRPC table; server imports this module

        self.server = server
        self.servicer = server.servicer
        self.plane = server.plane
        self.metrics = server.metrics
        self.edge = server.metrics.transport("http")
        self.kind_of_code = {code: kind for kind, code in STATUS.items()}

    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.server.settings.max_message_bytes, middlewares=[_json_errors]
        )
        r = app.router
        r.add_get("/v2/health/live", self.live)
        r.add_get("/v2/health/ready", self.ready)
        r.add_get("/v2", self.server_metadata)
        r.add_get("/metrics", self.scrape)
        r.add_post("/v2/repository/index", self.repository_index)
        r.add_get("/v2/models/stats", self.statistics)
        for base in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
            r.add_get(base, self.model_metadata)
            r.add_get(base + "/ready", self.model_ready)
            r.add_get(base + "/config", self.model_config)
            r.add_get(base + "/stats", self.statistics)
            r.add_post(base + "/infer", self.infer)
        from batchgate.gateway.embeddings_api import add_routes  # OpenAI /v1/embeddings, TEI /embed

        add_routes(app, self.server)
        return app

    def _status(self, exc: _Abort) -> int:
        kind = self.kind_of_code.get(exc.code, Kind.FAILED)
        return HTTP_STATUS[kind]

    async def _call(
        self, method, request_msg, request: web.Request, defaults: bool = False, field: str = ""
    ) -> web.Response:
        try:
            resp = await method(request_msg, _Context(request))
        except _Abort as exc:
            return _error(self._status(exc), exc.details)
        return web.json_response(_to_json(getattr(resp, field) if field else resp, defaults))

    # -- health and metadata --------------------------------------------------------------------

    async def live(self, _req: web.Request) -> web.Response:
        return web.json_response({"live": True})

    async def ready(self, _req: web.Request) -> web.Response:
        ok = self.plane.ready
        return web.json_response({"ready": ok}, status=200 if ok else 503)

    async def server_metadata(self, req: web.Request) -> web.Response:
        return await self._call(self.servicer.ServerMetadata, pb.ServerMetadataRequest(), req)

    async def model_metadata(self, req: web.Request) -> web.Response:
        m = pb.ModelMetadataRequest(name=req.match_info["model"], version=req.match_info.get("version", ""))
        return await self._call(self.servicer.ModelMetadata, m, req)

    async def model_config(self, req: web.Request) -> web.Response:
        m = pb.ModelConfigRequest(name=req.match_info["model"], version=req.match_info.get("version", ""))
        return await self._call(
            self.servicer.ModelConfig, m, req, field="config"
        )  # Triton: the config itself

    async def statistics(self, req: web.Request) -> web.Response:
        m = pb.ModelStatisticsRequest(
            name=req.match_info.get("model", ""), version=req.match_info.get("version", "")
        )
        return await self._call(self.servicer.ModelStatistics, m, req, defaults=True)

    async def repository_index(self, req: web.Request) -> web.Response:
        ready = False
        if req.can_read_body:
            try:
                ready = bool((await req.json() or {}).get("ready", False))
            except (ValueError, AttributeError):
                return _error(400, 'the request body must be a JSON object such as {"ready": true}')
        resp = await self.servicer.RepositoryIndex(pb.RepositoryIndexRequest(ready=ready), _Context(req))
        return web.json_response([_to_json(m) for m in resp.models])

    async def model_ready(self, req: web.Request) -> web.Response:
        name = req.match_info["model"]
        try:
            self.plane.get(name, req.match_info.get("version", ""))
        except GatewayError as exc:
            return _error(HTTP_STATUS[exc.kind], exc.message)
        return web.json_response({"name": name, "ready": True})

    async def scrape(self, _req: web.Request) -> web.Response:
        return web.Response(body=self.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    # -- inference ------------------------------------------------------------------------------

    async def infer(self, req: web.Request) -> web.Response:
        model, version = req.match_info["model"], req.match_info.get("version", "")
        ctx = _Context(req)
        token = REQUEST_ID.set("")  # ModelInfer sets it from the header; undone below
        try:
            try:
                body = await req.read()
                msg, binary_out = build_request(model, version, body, req.headers.get(HEADER_LENGTH))
            except GatewayError as exc:  # refused before the data plane: counted here
                self.edge.failed(model, version, exc)
                return _error(HTTP_STATUS[exc.kind], exc.message, _echo(ctx, req))
            try:
                resp = await self.servicer.ModelInfer(msg, ctx, self.edge)
                payload, header_len = build_response(resp, binary_out)
            except _Abort as exc:
                return _error(self._status(exc), exc.details, exc.headers(ctx.trailing))
            except GatewayError as exc:  # answer could not be put in JSON
                return _error(HTTP_STATUS[exc.kind], exc.message, dict(ctx.trailing))
        finally:
            REQUEST_ID.reset(token)
        headers = dict(ctx.trailing)
        if header_len is None:
            headers["Content-Type"] = JSON_TYPE
        else:
            headers["Content-Type"] = BINARY_TYPE
            headers[HEADER_LENGTH] = str(header_len)
        return web.Response(body=payload, headers=headers)


def _echo(ctx: _Context, req: web.Request) -> dict:
    from batchgate.gateway.logs import clean_request_id

    rid = clean_request_id(req.headers.get(REQUEST_ID_KEY))
    return {REQUEST_ID_KEY: rid} if rid else {}


@web.middleware
async def _json_errors(request: web.Request, handler):
    """aiohttp's own refusals (no such route, wrong method, body too large) as JSON errors too."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error(exc.status, exc.reason if exc.status != 413 else exc.text or exc.reason)
    except Exception as exc:  # a bug: say so, keep serving
        log.exception("HTTP %s %s failed", request.method, request.path)
        return _error(500, f"internal error: {type(exc).__name__}: {exc}")


async def start(server: Server) -> tuple[web.AppRunner, int]:
    """Serve the HTTP side for ``server``; returns the runner (for cleanup) and the bound port."""
    s = server.settings
    runner = web.AppRunner(HttpFrontend(server).app(), access_log=None)
    await runner.setup()
    tls = getattr(server, "tls", None)
    site = web.TCPSite(
        runner, s.host, s.http_port, reuse_port=s.reuse_port, ssl_context=tls.ssl_context() if tls else None
    )
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # the real port when 0 was asked
    return runner, port
