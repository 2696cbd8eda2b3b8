"""The gRPC transport: the KServe v2 / Triton ``inference.GRPCInferenceService`` servicer and the
interceptor that authenticates on metadata alone; listeners and lifecycle are in ``server.py``.

The servicer is thin: translate a ``ModelInferRequest`` into the pipeline's ``Call`` and its
``Answer`` back (``call_of``, ``message_of``), call ``gateway/infer.py``'s ``Pipeline``, map
``GatewayError`` kinds to status codes in one table (``STATUS``). Streams get a window: at most ``stream_window`` requests in flight, and while it is
full the stream is not read, so a client that sends without reading answers is held back by
HTTP/2 flow control instead of growing the server.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from functools import partial

import grpc

from batchgate.gateway import dtypes, tracing
from batchgate.gateway.admission import Account
from batchgate.gateway.call import Answer, Call, Tensor, Wanted
from batchgate.gateway import codec
from batchgate.gateway.codec import serialize_bytes
from batchgate.gateway.errors import GatewayError, Kind, clip, invalid
from batchgate.gateway.admission.door import NONE_PRIOR, PRIOR, Door, Prior
from batchgate.gateway.infer import Pipeline
from batchgate.gateway.logs import REQUEST_ID_KEY, adopt_request_id
from batchgate.gateway.metadata import Duration, ModelInfo, ModelStats, TensorInfo
from batchgate.gateway.metrics import Metrics
from batchgate.proto.inference.v2 import grpc_service_pb2 as pb
from batchgate.proto.inference.v2 import grpc_service_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

STATUS = {
    Kind.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    Kind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    Kind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    Kind.EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Kind.DEADLINE: grpc.StatusCode.DEADLINE_EXCEEDED,
    Kind.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    Kind.PERMISSION: grpc.StatusCode.PERMISSION_DENIED,
    Kind.UNSUPPORTED: grpc.StatusCode.UNIMPLEMENTED,
    Kind.PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    Kind.FAILED: grpc.StatusCode.INTERNAL,
    Kind.TOO_LARGE: grpc.StatusCode.INVALID_ARGUMENT,
    Kind.SLOW: grpc.StatusCode.DEADLINE_EXCEEDED,
}
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name

# Methods a caller without a key may use: probes and the read-only model description clients
# fetch before they have anything to send. Everything else of the inference service needs a key.
OPEN_METHODS = frozenset(
    f"/{SERVICE_NAME}/{m}"
    for m in ("ServerLive", "ServerReady", "ServerMetadata", "ModelReady", "ModelMetadata", "ModelConfig")
)
_PREFIX = f"/{SERVICE_NAME}/"


def parameters_of(params) -> dict:
    """KServe's ``InferParameter`` map as plain values (an unset choice is None)."""
    out = {}
    for key, p in params.items():
        which = p.WhichOneof("parameter_choice")
        out[key] = getattr(p, which) if which is not None else None
    return out


def call_of(req: pb.ModelInferRequest) -> Call:
    """The pipeline's ``Call`` for a ``ModelInferRequest``: raw contents stay the message's bytes
    (no copy), typed contents its repeated field. Refuses what only this wire can get wrong."""
    tensors = req.inputs
    raw = req.raw_input_contents
    limit = codec.LIMITS.max_inputs  # (set at start from the settings)
    if len(raw) > limit:
        raise invalid(
            f"model '{clip(req.model_name)}': the request carries {len(raw)} raw_input_contents entries; "
            f"the server accepts at most {limit} inputs (limit max_inputs, BATCHGATE_MAX_INPUTS)"
        )
    inputs = []
    if raw:
        if len(raw) != len(tensors):
            for t in tensors:  # Triton checks both forms first (its example clients match on the words)
                if t.HasField("contents"):
                    raise _both_forms(t.name, req.model_name)
            raise invalid(
                f"model '{clip(req.model_name)}': raw_input_contents has {len(raw)} entry(ies) for "
                f"{len(tensors)} inputs; send one entry per input, in the order of `inputs`"
            )
        for t, buf in zip(tensors, raw):
            if t.HasField("contents"):
                raise _both_forms(t.name, req.model_name)
            params = parameters_of(t.parameters) if t.parameters else {}
            inputs.append(Tensor(t.name, t.datatype, t.shape, raw=buf, parameters=params))
    else:
        for t in tensors:
            values = None
            if t.HasField("contents"):
                field = dtypes.CONTENTS_FIELD.get(t.datatype)
                values = getattr(t.contents, field) if field is not None else ()
            params = parameters_of(t.parameters) if t.parameters else {}
            inputs.append(Tensor(t.name, t.datatype, t.shape, values=values, parameters=params))
    outputs = [Wanted(o.name, parameters_of(o.parameters)) for o in req.outputs] if req.outputs else []
    params = parameters_of(req.parameters) if req.parameters else {}
    return Call(req.model_name, req.model_version, req.id, inputs, outputs, params)


def _both_forms(name: str, model: str) -> GatewayError:
    return invalid(
        f"contents field must not be specified when using raw_input_contents for '{clip(name)}' "
        f"for model '{clip(model)}' "
        f"(input '{clip(name)}' has both typed contents and raw_input_contents; send one)"
    )


def message_of(answer: Answer) -> pb.ModelInferResponse:
    """The ``ModelInferResponse`` for an answer: raw contents unless an output was asked for typed;
    then all are typed (the protocol pairs raw_output_contents with outputs by position, so
    mixing forms is ambiguous)."""
    resp = pb.ModelInferResponse(model_name=answer.model, model_version=answer.version, id=answer.id)
    add = resp.outputs.add
    if all(o.binary for o in answer.outputs):
        raw = resp.raw_output_contents
        for o in answer.outputs:
            arr = o.array
            add(name=o.name, datatype=o.datatype, shape=arr.shape)
            # C order whatever the strides: the one copy of the answer
            raw.append(serialize_bytes(arr) if o.datatype == "BYTES" else arr.tobytes())
        return resp
    for o in answer.outputs:
        field = dtypes.CONTENTS_FIELD.get(o.datatype)
        if field is None:
            raise invalid(f"output '{o.name}': {o.datatype} can only be returned raw (binary_data true)")
        tensor = add(name=o.name, datatype=o.datatype, shape=o.array.shape)
        getattr(tensor.contents, field).extend(o.array.reshape(-1).tolist())
    return resp


def _tensor(t: TensorInfo) -> pb.ModelMetadataResponse.TensorMetadata:
    return pb.ModelMetadataResponse.TensorMetadata(name=t.name, datatype=t.datatype, shape=t.shape)


def metadata_message(m: ModelInfo) -> pb.ModelMetadataResponse:
    return pb.ModelMetadataResponse(
        name=m.name,
        versions=m.versions,
        platform=m.platform,
        inputs=[_tensor(t) for t in m.inputs],
        outputs=[_tensor(t) for t in m.outputs],
    )


def _duration(d: Duration) -> pb.StatisticDuration:
    return pb.StatisticDuration(count=d.count, ns=d.ns)


def statistics_message(stats: list[ModelStats]) -> pb.ModelStatisticsResponse:
    resp = pb.ModelStatisticsResponse()
    for s in stats:
        i = s.inference_stats
        durations = {
            "success": i.success, "fail": i.fail, "queue": i.queue, "compute_input": i.compute_input,
            "compute_infer": i.compute_infer, "compute_output": i.compute_output,
            "cache_hit": i.cache_hit, "cache_miss": i.cache_miss,
        }  # fmt: skip
        resp.model_stats.add(
            name=s.name,
            version=s.version,
            last_inference=s.last_inference,
            inference_count=s.inference_count,
            execution_count=s.execution_count,
            # every duration set, zeros too, but the cache's only with a cache (as Triton answers)
            inference_stats=pb.InferStatistics(
                **{k: _duration(d) for k, d in durations.items() if d is not None}
            ),
            batch_stats=[
                pb.InferBatchStatistics(
                    batch_size=b.batch_size, compute_input=_duration(b.compute_input),
                    compute_infer=_duration(b.compute_infer), compute_output=_duration(b.compute_output),
                )
                for b in s.batch_stats
            ],
        )  # fmt: skip
    return resp


def _request_id(context) -> str:
    """Adopt the caller's ``x-request-id`` and echo it back (trailing metadata)."""
    md = context.invocation_metadata() or ()
    rid = adopt_request_id(next((value for key, value in md if key == REQUEST_ID_KEY), None))
    if rid:
        context.set_trailing_metadata(((REQUEST_ID_KEY, rid),))
    return rid


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses a keyed method on its metadata alone, before the request message is read: the
    refusal is a stream handler that never reads, so a key-less 60 MiB message costs its headers.
    Installed only when there is a tenant file (an open server pays nothing)."""

    def __init__(self, door: Door, metrics: Metrics, keyed: dict[str, str] | None = None) -> None:
        self.door = door
        self._edges = {
            f"{_PREFIX}ModelInfer": metrics.transport("grpc"),
            f"{_PREFIX}ModelStreamInfer": metrics.transport("grpc_stream"),
        }
        # other services' methods that need the key -> the edge their refusals count at (TEI's)
        self._keyed = frozenset(keyed or ())
        self._edges.update({m: metrics.transport(e) for m, e in (keyed or {}).items()})

    async def intercept_service(self, continuation, details):
        method = details.method
        if (not method.startswith(_PREFIX) or method in OPEN_METHODS) and method not in self._keyed:
            return await continuation(details)
        try:
            caller = self.door.identify(details.invocation_metadata)
        except GatewayError as exc:
            edge = self._edges.get(method)
            if edge is not None:
                edge.failed("", "", exc)  # no model read: counted under empty labels
            return _refusal(STATUS[exc.kind], exc.message)
        # Read by the servicer: the interceptor and the handler run in the same task (grpc.aio
        # awaits the interceptors, then the handler, in one coroutine).
        PRIOR.set(Prior(PRIOR.get().asked, caller))
        return await continuation(details)


def _refusal(code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    async def refuse(_request_iterator, context):
        await context.abort(code, message)

    return grpc.stream_stream_rpc_method_handler(refuse)


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, pipeline: Pipeline, metrics: Metrics) -> None:
        self.pipeline = pipeline
        self.plane = pipeline.plane
        self.metrics = metrics
        s = pipeline.settings
        self.window = s.stream_window
        self.door = pipeline.door
        self.streams = pipeline.door.streams
        self._unary_edge = metrics.transport("grpc")
        self._stream_edge = metrics.transport("grpc_stream")
        self._readers: set[asyncio.Task] = set()  # each open stream's reader, stopped by a drain

    def end_streams(self) -> None:
        """Drain: every open stream stops being read, answers what it holds, then ends UNAVAILABLE."""
        for t in list(self._readers):
            t.cancel()

    def _caller(self, context) -> Account | None:
        if self.pipeline.open:
            return None
        caller = PRIOR.get().caller
        # The interceptor has identified every keyed call; this is the fallback for a servicer
        # mounted without it (tests), and it refuses the same way.
        return caller if caller is not None else self.door.identify(context.invocation_metadata())

    async def _abort(self, context, exc: GatewayError, rid: str = "") -> None:
        trailing = getattr(exc, "trailing_metadata", ())
        if trailing and rid:  # abort's own metadata replaces what was set: keep the id
            trailing = (*trailing, (REQUEST_ID_KEY, rid))
        await context.abort(STATUS[exc.kind], exc.message, trailing)

    # -- health and metadata --------------------------------------------------------------------

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.plane.ready)

    async def ModelReady(self, request, context):
        return pb.ModelReadyResponse(ready=self.pipeline.model_ready(request.name, request.version))

    async def ServerMetadata(self, request, context):
        s = self.pipeline.server_metadata()
        return pb.ServerMetadataResponse(name=s.name, version=s.version, extensions=s.extensions)

    async def ModelMetadata(self, request, context):
        try:
            return metadata_message(self.pipeline.model_metadata(request.name, request.version))
        except GatewayError as exc:
            await self._abort(context, exc)

    async def ModelConfig(self, request, context):
        try:
            return pb.ModelConfigResponse(config=self.pipeline.model_config(request.name, request.version))
        except GatewayError as exc:
            await self._abort(context, exc)

    async def ModelStatistics(self, request, context):
        try:
            return statistics_message(self.pipeline.statistics(request.name, request.version))
        except GatewayError as exc:
            await self._abort(context, exc)

    async def RepositoryIndex(self, request, context):
        index = self.pipeline.repository_index(request.ready)
        return pb.RepositoryIndexResponse(
            models=[
                pb.RepositoryIndexResponse.ModelIndex(
                    name=m.name, version=m.version, state=m.state, reason=m.reason
                )
                for m in index
            ]
        )

    async def RepositoryModelLoad(self, request, context):
        """Triton's load/reload (see ``Pipeline.load``); only with model_control, admin tenants only."""
        try:
            await self.pipeline.load(self._caller(context), request.model_name, request.parameters)
        except GatewayError as exc:
            await self._abort(context, exc)
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request, context):
        """Stop serving the model once the calls it holds are answered (no ensembles here, so
        ``unload_dependents`` has nothing to act on)."""
        try:
            await self.pipeline.unload(self._caller(context), request.model_name)
        except GatewayError as exc:
            await self._abort(context, exc)
        return pb.RepositoryModelUnloadResponse()

    # -- inference ------------------------------------------------------------------------------

    async def ModelInfer(self, request, context):
        rid = _request_id(context)
        edge = self._unary_edge
        try:
            try:
                md = context.invocation_metadata() if tracing.TRACER is not None else ()  # traceparent
                pass_ = self.door.enter(md, context.time_remaining(), self._caller(context))
            except GatewayError as exc:
                edge.failed(request.model_name, request.model_version, exc)
                raise
            with pass_:
                try:
                    call = call_of(request)
                except GatewayError as exc:  # taken, then refused before the pipeline: counted here
                    edge.failed(request.model_name, request.model_version, exc)
                    raise
                answer = await self.pipeline.infer(call, pass_, edge)
            return message_of(answer)
        except GatewayError as exc:
            await self._abort(context, exc, rid)
        except Exception as exc:  # a bug, not the client's fault: say so, keep serving
            log.exception("ModelInfer for model '%s' failed", clip(request.model_name))
            message = f"internal error: {type(exc).__name__}: {clip(exc, 512)}"
            await context.abort(grpc.StatusCode.INTERNAL, message)

    async def ModelStreamInfer(self, request_iterator, context):
        """Each request is answered on the stream as soon as it completes (not in order), with its
        ``id`` echoed; an error answers that request with ``error_message`` and the stream goes on.
        The API key is checked once, when the stream opens (by the interceptor, on metadata).

        At most ``stream_window`` requests are in flight: the next message is read only when one of
        them has been written back, so a client that never reads its answers stops being read."""
        try:
            caller = self._caller(context)
            PRIOR.set(NONE_PRIOR)  # a call taker may have taken the stream; each message asks the shedder
            tenant = caller.tenant.name if caller is not None else ""
            peer = context.peer() or ""
            self.streams.take(tenant, peer)
        except GatewayError as exc:
            await self._abort(context, exc)
        try:
            await self._stream(request_iterator, context, caller)
        finally:
            self.streams.give(tenant, peer)

    async def _stream(self, request_iterator, context, caller: Account | None) -> None:
        _request_id(context)  # one id for the stream; the messages' own ids travel in `id`
        edge = self._stream_edge
        pipeline = self.pipeline
        door = self.door
        plane = self.plane
        loop = asyncio.get_running_loop()
        window = self.window
        # Per message: one task (pipeline.infer itself, no wrapper coroutine) whose done-callback
        # puts the answer here; this coroutine writes them. Plain futures wake the writer when
        # answers arrive and the reader when the window has room: an asyncio.Queue and a
        # Semaphore cost several times that per message.
        ready: deque = deque()  # answers to write, then None: the end mark
        tasks: set[asyncio.Task] = set()
        unwritten = 0  # requests read and not yet answered on the wire: at most `window`
        writer_wait: asyncio.Future | None = None
        reader_wait: asyncio.Future | None = None
        cut = False  # the drain ended the reading, not the client

        def push(item) -> None:
            ready.append(item)
            if writer_wait is not None and not writer_wait.done():
                writer_wait.set_result(None)

        def finished(request: pb.ModelInferRequest, t: asyncio.Task) -> None:
            tasks.discard(t)
            if t.cancelled():  # the stream is ending: nobody reads this answer
                return
            exc = t.exception()
            if exc is None:
                try:
                    push(pb.ModelStreamInferResponse(infer_response=message_of(t.result())))
                except GatewayError as err:
                    push(self._stream_error(request, err.message))
            elif isinstance(exc, GatewayError):
                push(self._stream_error(request, exc.message))
            else:
                log.error("ModelStreamInfer request for '%s' failed", clip(request.model_name), exc_info=exc)
                push(self._stream_error(request, f"internal error: {type(exc).__name__}: {clip(exc, 512)}"))

        async def reader() -> None:
            nonlocal cut, reader_wait, unwritten
            it = request_iterator.__aiter__()
            client_done = False  # the client closed its side: every request it sent is answered
            try:
                while not plane.draining:
                    if unwritten >= window:  # backpressure: a full window stops the reading
                        reader_wait = loop.create_future()
                        try:
                            await reader_wait
                        finally:
                            reader_wait = None
                        continue
                    try:
                        request = await it.__anext__()
                    except StopAsyncIteration:
                        client_done = True
                        break
                    unwritten += 1
                    pass_ = None
                    try:
                        pass_ = door.enter((), None, caller)  # each message is a call at the door
                        call = call_of(request)
                    except GatewayError as exc:
                        if pass_ is not None:  # taken, then refused before the pipeline
                            door.leave(exc, pass_)
                        edge.failed(request.model_name, request.model_version, exc)
                        push(self._stream_error(request, exc.message))
                        continue
                    # the pipeline leaves the pass as the message's call ends (one task, no wrapper)
                    t = loop.create_task(pipeline.infer(call, pass_, edge))
                    tasks.add(t)
                    t.add_done_callback(partial(finished, request))
            except asyncio.CancelledError:
                if not plane.draining:
                    raise
                cut = True  # end_streams: answer what was read, then end the stream
            if plane.draining and not client_done:
                cut = True
            while tasks:
                await asyncio.gather(*list(tasks), return_exceptions=True)
            push(None)

        def reader_done(t: asyncio.Task) -> None:
            nonlocal cut
            # A reader cancelled before it ran (a drain as the stream opened) or failed never put
            # its end mark: the writer must still finish.
            if t.cancelled() or t.exception() is not None:
                cut = cut or plane.draining
                push(None)

        read_task = loop.create_task(reader())
        read_task.add_done_callback(reader_done)
        self._readers.add(read_task)
        try:
            while True:
                if not ready:
                    writer_wait = loop.create_future()
                    try:
                        await writer_wait
                    finally:
                        writer_wait = None
                    continue
                item = ready.popleft()
                if item is None:
                    break
                await context.write(item)
                unwritten -= 1
                if reader_wait is not None and not reader_wait.done():
                    reader_wait.set_result(None)
            if not read_task.cancelled() and read_task.done():
                read_task.result()  # a reader's own failure (a bug) surfaces here
        finally:
            self._readers.discard(read_task)
            read_task.cancel()
            for t in list(tasks):
                t.cancel()
        if cut:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "server is draining; retry on another replica")

    @staticmethod
    def _stream_error(request: pb.ModelInferRequest, message: str) -> pb.ModelStreamInferResponse:
        return pb.ModelStreamInferResponse(
            error_message=message,
            infer_response=pb.ModelInferResponse(
                model_name=clip(request.model_name), model_version=clip(request.model_version), id=request.id
            ),
        )
