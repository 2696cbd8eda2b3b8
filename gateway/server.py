"""The gRPC servicer (KServe v2 / Triton ``inference.GRPCInferenceService``), health, reflection,
and the process lifecycle (start, ready, drain on SIGTERM, exit 0); the HTTP side is gateway/http.py.

The servicer is thin: look the model up, decode with its codec, call the data plane, encode.
Domain errors become status codes in one table (``STATUS``).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from importlib.metadata import PackageNotFoundError, version

import grpc
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection, reflection_pb2

from batchgate import proto
from batchgate.gateway import http as http_side
from batchgate.gateway import probes
from batchgate.gateway.admission import Account, Admission
from batchgate.gateway.scheduling.request import resolve as resolve_budget
from batchgate.gateway.codec import Limits, set_limits
from batchgate.gateway.config import Settings
from batchgate.gateway.dataplane import DataPlane, ModelRuntime, ReloadFailed
from batchgate.gateway.errors import GatewayError, Kind
from batchgate.gateway.logs import REQUEST_ID, REQUEST_ID_KEY, clean_request_id
from batchgate.gateway.metrics import Metrics, Transport
from batchgate.gateway.tls import CertStore
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
    Kind.FAILED: grpc.StatusCode.INTERNAL,
}
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name

try:
    VERSION = version("batchgate")
except PackageNotFoundError:  # running from a source tree without an install
    VERSION = "0.0.0+source"


_clock = time.perf_counter


def _request_id(context) -> str:
    """Adopt the caller's ``x-request-id`` for this call's log lines and echo it back (trailing
    metadata). Each RPC runs in its own task, but a stale id must never outlive its call."""
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_KEY:
            rid = clean_request_id(value)
            REQUEST_ID.set(rid)
            if rid:
                context.set_trailing_metadata(((REQUEST_ID_KEY, rid),))
            return rid
    if REQUEST_ID.get():
        REQUEST_ID.set("")
    return ""


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, plane: DataPlane, admission: Admission | None = None, metrics: Metrics | None = None) -> None:
        self.plane = plane
        self.admission = admission or Admission()  # no tenants: open
        self.metrics = metrics or Metrics(plane, VERSION)
        self._unary_edge = self.metrics.transport("grpc")
        self._stream_edge = self.metrics.transport("grpc_stream")

    # -- health and metadata --------------------------------------------------------------------

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.plane.ready)

    async def ModelReady(self, request, context):
        try:
            self.plane.get(request.name, request.version)
        except GatewayError:
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=True)

    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(
            name="batchgate", version=VERSION, extensions=["model_configuration", "statistics", "binary_tensor_data"]
        )

    async def ModelMetadata(self, request, context):
        rt = await self._model(request.name, request.version, context, for_metadata=True)
        spec = rt.spec
        versions = sorted(self.plane.models[spec.name], key=int)

        def meta(t):
            return pb.ModelMetadataResponse.TensorMetadata(
                name=t.name, datatype=t.datatype, shape=((-1,) + t.dims) if spec.batched else t.dims
            )

        return pb.ModelMetadataResponse(
            name=spec.name,
            versions=versions,
            platform=spec.config.platform or "onnxruntime_onnx",
            inputs=[meta(t) for t in spec.inputs],
            outputs=[meta(t) for t in spec.outputs],
        )

    async def ModelConfig(self, request, context):
        rt = await self._model(request.name, request.version, context, for_metadata=True)
        return pb.ModelConfigResponse(config=rt.spec.config)

    async def ModelStatistics(self, request, context):
        try:
            runtimes = self.plane.runtimes(request.name, request.version)
        except GatewayError as exc:
            await context.abort(STATUS[exc.kind], exc.message)
        resp = pb.ModelStatisticsResponse()
        for rt in runtimes:
            st = rt.scheduler.stats
            m = resp.model_stats.add(
                name=rt.spec.name,
                version=rt.spec.version,
                last_inference=st.last_inference_ms,
                inference_count=st.inference_count,
                execution_count=st.execution_count,
            )
            s = m.inference_stats
            s.success.count, s.success.ns = st.success_count, st.success_ns
            s.fail.count, s.fail.ns = st.fail_count, st.fail_ns
            s.queue.count, s.queue.ns = st.queue_count, st.queue_ns
            s.compute_input.count, s.compute_input.ns = st.input_count, st.input_ns
            s.compute_infer.count, s.compute_infer.ns = st.infer_count, st.infer_ns
            s.compute_output.count, s.compute_output.ns = st.output_count, st.output_ns
            # Triton: cache hits are in success but in none of queue/compute (gateway/result_cache.py).
            if rt.cache is not None:
                rt.cache.fill_statistics(s)
            for size in sorted(st.by_batch_size):
                b = st.by_batch_size[size]
                bs = m.batch_stats.add(batch_size=size)
                bs.compute_input.count, bs.compute_input.ns = b.count, b.input_ns
                bs.compute_infer.count, bs.compute_infer.ns = b.count, b.infer_ns
                bs.compute_output.count, bs.compute_output.ns = b.count, b.output_ns
        return resp

    async def RepositoryIndex(self, request, context):
        resp = pb.RepositoryIndexResponse()
        for name in sorted(set(self.plane.models) | set(self.plane.failures)):
            for ver in sorted(self.plane.models.get(name, {}), key=int):
                resp.models.add(name=name, version=ver, state="READY")
            failure = self.plane.failures.get(name)
            if failure is not None and not request.ready:
                resp.models.add(name=name, version=failure.version, state="UNAVAILABLE", reason=failure.reason)
        return resp

    async def RepositoryModelLoad(self, request, context):
        """Triton's load/reload: re-read the model's directory, start and warm it, swap it in.

        A directory that cannot be served (config.pbtxt, model file, engine start) answers
        FAILED_PRECONDITION with the reason: the repository's files must be fixed before a retry
        can succeed, and the previous load keeps serving meanwhile. Triton's inline overrides
        (``config`` / ``file:`` parameters) are not offered: UNIMPLEMENTED, never silently ignored."""
        if request.parameters:
            await context.abort(
                grpc.StatusCode.UNIMPLEMENTED,
                f"load parameters {sorted(request.parameters)} are not supported: edit the model's directory "
                "in the repository and load it again",
            )
        try:
            await self.plane.reload(request.model_name)
        except GatewayError as exc:
            await context.abort(STATUS[exc.kind], exc.message)
        except ReloadFailed as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"failed to load '{request.model_name}': {exc}")
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request, context):
        """Stop serving the model once the calls it holds are answered (no ensembles here, so
        ``unload_dependents`` has nothing to act on)."""
        try:
            await self.plane.unload(request.model_name)
        except GatewayError as exc:
            await context.abort(STATUS[exc.kind], exc.message)
        return pb.RepositoryModelUnloadResponse()

    async def _model(self, name: str, version: str, context, for_metadata: bool = False) -> ModelRuntime:
        try:
            if for_metadata and not self.plane.draining:
                return self.plane.get(name, version)
            if for_metadata:  # metadata stays readable while draining
                return self.plane.runtimes(name, version)[-1]
            return self.plane.get(name, version)
        except GatewayError as exc:
            await context.abort(STATUS[exc.kind], exc.message)

    # -- inference ------------------------------------------------------------------------------

    async def _infer(
        self,
        request: pb.ModelInferRequest,
        time_remaining: float | None = None,
        default_class: str | None = None,
        namespace: str | None = None,
    ) -> pb.ModelInferResponse:
        plane = self.plane
        if plane.draining:
            plane.last_refused = time.monotonic()
        rt = plane.get(request.model_name, request.model_version)
        budget = resolve_budget(
            request.parameters, time_remaining, rt.scheduler.clock(), plane.classes,
            default_class or plane.settings.default_latency_class, rt.schedule,
        )  # fmt: skip
        codec = rt.codec
        wanted = codec.requested(request)
        arrays, rows = codec.decode(request)
        outputs = await rt.infer(arrays, rows, budget, wanted=wanted, namespace=namespace)
        return codec.encode(request, outputs, wanted)

    async def _admitted(
        self, account: Account, request: pb.ModelInferRequest, time_remaining: float | None = None
    ) -> pb.ModelInferResponse:
        """Admission (auth already done), then ``_infer``; the ticket is released however the request ends.
        Runs before any decoding: the row count is read off the first input's shape."""
        try:
            batched = self.plane.get(request.model_name, request.model_version).spec.batched
        except GatewayError:  # unknown model or draining: nothing to admit, _infer answers it
            return await self._infer(request, time_remaining)
        inputs = request.inputs
        rows = (max(inputs[0].shape[0], 0) if inputs and inputs[0].shape else 0) if batched else 1
        ticket = await self.admission.admit(account, request.model_name, rows)
        tenant = ticket.tenant
        try:
            return await self._infer(request, time_remaining, tenant.default_class, tenant.cache_namespace)
        finally:
            ticket.release()

    async def ModelInfer(self, request, context, edge: Transport | None = None):
        """``edge``: whose counters this call goes to; the HTTP side passes its own."""
        edge = edge or self._unary_edge
        rid = _request_id(context)
        t0 = _clock()
        edge.inflight += 1
        try:
            if self.admission.open:
                resp = await self._infer(request, context.time_remaining())
            else:
                account = self.admission.identify(context.invocation_metadata())
                resp = await self._admitted(account, request, context.time_remaining())
        except GatewayError as exc:
            edge.failed(request.model_name, request.model_version, exc)
            trailing = getattr(exc, "trailing_metadata", ())
            if trailing and rid:  # abort's own metadata replaces what was set: keep the id
                trailing = (*trailing, (REQUEST_ID_KEY, rid))
            await context.abort(STATUS[exc.kind], exc.message, trailing)
        except asyncio.CancelledError as exc:
            edge.failed(request.model_name, request.model_version, exc)
            raise
        except Exception as exc:  # a bug, not the client's fault: say so, keep serving
            edge.failed(request.model_name, request.model_version, exc)
            log.exception("ModelInfer for model '%s' failed", request.model_name)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")
        finally:
            edge.inflight -= 1
        edge.ok(resp.model_name, resp.model_version, _clock() - t0)
        return resp

    async def ModelStreamInfer(self, request_iterator, context):
        """Each request is answered on the stream as soon as it completes (not in order), with its
        ``id`` echoed; an error answers that request with ``error_message`` and the stream goes on.
        The API key is checked once, when the stream opens."""
        account = None
        if not self.admission.open:
            try:
                account = self.admission.identify(context.invocation_metadata())
            except GatewayError as exc:
                await context.abort(STATUS[exc.kind], exc.message)
        _request_id(context)  # one id for the stream; the messages' own ids travel in `id`
        edge = self._stream_edge
        out: asyncio.Queue = asyncio.Queue()
        tasks: set[asyncio.Task] = set()

        async def one(request: pb.ModelInferRequest) -> None:
            t0 = _clock()
            edge.inflight += 1
            try:
                resp = await (self._infer(request) if account is None else self._admitted(account, request))
            except GatewayError as exc:
                edge.failed(request.model_name, request.model_version, exc)
                await out.put(self._stream_error(request, exc.message))
                return
            except asyncio.CancelledError as exc:
                edge.failed(request.model_name, request.model_version, exc)
                raise
            except Exception as exc:
                edge.failed(request.model_name, request.model_version, exc)
                log.exception("ModelStreamInfer request for '%s' failed", request.model_name)
                await out.put(self._stream_error(request, f"internal error: {type(exc).__name__}: {exc}"))
                return
            finally:
                edge.inflight -= 1
            edge.ok(resp.model_name, resp.model_version, _clock() - t0)
            await out.put(pb.ModelStreamInferResponse(infer_response=resp))

        async def reader() -> None:
            async for request in request_iterator:
                t = asyncio.create_task(one(request))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
            while tasks:
                await asyncio.gather(*list(tasks), return_exceptions=True)
            await out.put(None)

        read_task = asyncio.create_task(reader())
        try:
            while True:
                item = await out.get()
                if item is None:
                    break
                await context.write(item)
            await read_task
        finally:
            read_task.cancel()
            for t in list(tasks):
                t.cancel()

    @staticmethod
    def _stream_error(request: pb.ModelInferRequest, message: str) -> pb.ModelStreamInferResponse:
        return pb.ModelStreamInferResponse(
            error_message=message,
            infer_response=pb.ModelInferResponse(
                model_name=request.model_name, model_version=request.model_version, id=request.id
            ),
        )


def _register_for_reflection() -> None:
    """Reflection answers from ``proto.POOL``; put the health and reflection protos there too."""
    for fd in (health_pb2.DESCRIPTOR, reflection_pb2.DESCRIPTOR):
        try:
            proto.POOL.FindFileByName(fd.name)
        except KeyError:
            proto.POOL.AddSerializedFile(fd.serialized_pb)


class Server:
    """One gateway process: gRPC + HTTP in front of a DataPlane."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.plane = DataPlane(settings)
        self.admission = Admission.from_settings(settings)  # reads the tenant file; errors stop the start
        self.metrics = Metrics(self.plane, VERSION)  # this process's own registry, read at scrape time
        self.servicer = InferenceServicer(self.plane, self.admission, self.metrics)
        self.health = health_aio.HealthServicer()
        self.tls = CertStore.from_settings(settings)  # reads the certificate files; errors stop the start
        set_limits(Limits.from_settings(settings))  # before any model's codec is built
        self.grpc_port = 0
        self.http_port = 0
        self._grpc: grpc.aio.Server | None = None
        self._http: web.AppRunner | None = None
        self.probes: probes.Probes | None = None
        self._stopped = asyncio.Event()

    async def start(self) -> None:
        s = self.settings
        options = [
            ("grpc.max_receive_message_length", s.max_message_bytes),
            ("grpc.max_send_message_length", s.max_message_bytes),
            ("grpc.so_reuseport", 1 if s.reuse_port else 0),
        ]
        if s.max_connection_age_s:
            # Clients re-resolve DNS only when a connection ends: ageing connections out lets pods
            # added by a scale-up (headless Service, dns:/// round robin) receive calls.
            options += [
                ("grpc.max_connection_age_ms", int(s.max_connection_age_s * 1000)),
                ("grpc.max_connection_age_grace_ms", int(s.drain_timeout_s * 1000)),
            ]
        server = grpc.aio.server(options=options)
        await self.admission.start()  # Redis for global limits, if any; being down is not fatal
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        _register_for_reflection()
        reflection.enable_server_reflection(
            [SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            server,
            pool=proto.POOL,
        )
        if self.tls is not None:  # TLS only: a plaintext client fails its handshake
            self.grpc_port = server.add_secure_port(f"{s.host}:{s.grpc_port}", self.tls.grpc_credentials())
        else:
            self.grpc_port = server.add_insecure_port(f"{s.host}:{s.grpc_port}")
        if self.grpc_port == 0:
            raise OSError(f"cannot listen on {s.host}:{s.grpc_port} for gRPC")
        await self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.start()
        self._grpc = server
        self._http, self.http_port = await http_side.start(self)
        self.probes = await probes.start(self)  # plaintext health/metrics ports, when set (TLS deployments)
        log.info(
            "listening: gRPC %s:%d, HTTP %s:%d%s", s.host, self.grpc_port, s.host, self.http_port,
            "" if self.tls is None else (" (TLS, client certificates required)" if self.tls.mutual else " (TLS)"),
        )  # fmt: skip
        t0 = time.perf_counter()
        await self.plane.load()
        self.metrics.attach()
        await self._set_health()
        for rt in self.plane.runtimes():
            log.info(
                "model %s version %s ready", rt.spec.name, rt.spec.version,
                extra={"event": "model_ready", "model": rt.spec.name, "version": rt.spec.version},
            )  # fmt: skip
        log.info(
            "ready: %d model(s) serving %s, %d failed%s, in %.1fs",
            len(self.plane.models), sorted(self.plane.models), len(self.plane.failures),
            f" {sorted(self.plane.failures)}" if self.plane.failures else "", time.perf_counter() - t0,
            extra={"event": "ready", "ready": self.plane.ready},
        )  # fmt: skip

    async def _set_health(self) -> None:
        serving = health_pb2.HealthCheckResponse.SERVING
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        ready = self.plane.ready
        await self.health.set("", serving if ready else not_serving)
        await self.health.set(SERVICE_NAME, serving if ready else not_serving)
        for name in self.plane.models:
            await self.health.set(name, serving if ready else not_serving)
        for name in self.plane.failures:
            if name not in self.plane.models:
                await self.health.set(name, not_serving)

    async def drain_and_stop(self) -> None:
        """Readiness false first, then let accepted work finish, then stop listening."""
        if self.plane.draining:
            return
        log.info("draining: readiness false; new requests get UNAVAILABLE", extra={"event": "drain"})
        self.plane.draining = True
        # The quiet period of _linger counts from here: callers that have not yet sent their next
        # request (so none was refused) must still get the chance to be told UNAVAILABLE.
        self.plane.last_refused = time.monotonic()
        await self._set_health()
        ok = await self.plane.drain(self.settings.drain_timeout_s)
        if not ok:
            log.warning("drain timed out after %.1fs; answering what is left UNAVAILABLE", self.settings.drain_timeout_s)
        await self._linger()
        if self._grpc is not None:
            await self._grpc.stop(grace=2.0)
        await self.plane.close()
        for rt in self.plane.runtimes():
            log.info(
                "model %s version %s unloaded", rt.spec.name, rt.spec.version,
                extra={"event": "unload", "model": rt.spec.name, "version": rt.spec.version},
            )  # fmt: skip
        await self.admission.close()
        if self._http is not None:
            await self._http.cleanup()
        if self.probes is not None:  # last: probes see the drain through
            await self.probes.stop()
        log.info("stopped", extra={"event": "stopped"})
        self._stopped.set()

    async def _linger(self) -> None:
        """Keep answering UNAVAILABLE until callers stop arriving (or drain_linger_s passes).

        Closing the transport while calls are arriving makes gRPC cancel the ones it had not yet
        handed to us (CANCELLED, which clients do not retry elsewhere); a clean UNAVAILABLE tells
        them to go to another replica, and Kubernetes needs a moment to take us off its endpoints.
        """
        quiet_s = 0.5  # calls queued in gRPC core behind a busy loop need time to reach us
        end = time.monotonic() + self.settings.drain_linger_s
        while (now := time.monotonic()) < end:
            if now - self.plane.last_refused >= quiet_s:
                return
            await asyncio.sleep(quiet_s / 4)

    async def wait_stopped(self) -> None:
        await self._stopped.wait()


async def serve(settings: Settings) -> None:
    server = Server(settings)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    start = asyncio.create_task(server.start())
    waiter = asyncio.create_task(stop.wait())
    await asyncio.wait({start, waiter}, return_when=asyncio.FIRST_COMPLETED)
    if start.done():
        start.result()  # startup errors surface here
        await stop.wait()
    else:
        start.cancel()
    log.info("signal received")
    await server.drain_and_stop()
