"""The process lifecycle: listeners (gRPC and HTTP), health, reflection, start, ready, drain on
SIGTERM, exit 0. The servicer is in ``grpc.py``, the REST listener and its app in ``http.py``.

Bounds set here, before any Python runs for a call: the gRPC message size (derived from the served
models unless configured), the cap on concurrent RPCs (``max_concurrent_rpcs``: the door's
``CallCap``, which the call takers hold every call to, or grpc.aio's own cap when the takers are
off; either answers RESOURCE_EXHAUSTED before a handler), and the ports, shared with SO_REUSEPORT
only when asked.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import math
import signal
import time

import grpc
from aiohttp import web
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection, reflection_pb2

from batchgate import proto
from batchgate.cache import RedisLink
from batchgate.gateway import dtypes, tracing
from batchgate.gateway.admission import Admission
from batchgate.gateway.admission.door import CallCap, Door, StreamSlots
from batchgate.gateway.admission.gate import LoadShedder
from batchgate.gateway.admission.usage import Sink, Usage
from batchgate.gateway.codec import Limits, set_limits
from batchgate.gateway.config import Settings
from batchgate.gateway.dataplane import DataPlane
from batchgate.gateway.infer import VERSION, Pipeline
from batchgate.gateway.metrics import Metrics
from batchgate.gateway.repository import ModelSpec, tokenized
from batchgate.gateway.transport import http, probes
from batchgate.gateway.transport.grpc import SERVICE_NAME, AuthInterceptor, InferenceServicer
from batchgate.gateway.transport import tei_grpc
from batchgate.gateway.transport.takers import CallTakers
from batchgate.proto.inference.v2 import grpc_service_pb2_grpc as pb_grpc
from batchgate.gateway.transport.tls import CertStore

log = logging.getLogger(__name__)

MiB = 2**20
# The last step of a drain (DrainHold): hold calls until none has arrived for HOLD_QUIET_S (at most
# HOLD_MAX_S), then stop gRPC, and answer the held calls GOAWAY_S later. The quiet period is longer
# than a loaded client's stall (a shorter one can end the hold just before a burst of calls).
HOLD_QUIET_S = 0.25
HOLD_MAX_S = 1.0
GOAWAY_S = 0.2
MIN_MESSAGE_BYTES = 4 * MiB  # gRPC's own default: never derive a limit below it
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


def request_bytes(spec: ModelSpec, limits: Limits) -> int:
    """The largest request ``spec`` can accept, in bytes of tensor data: max_batch_size rows of
    every input, a variable dim at its ``max_dim`` (else the element cap), BYTES elements at the
    text stage's ``max_text_bytes`` or the server's ``max_string_bytes``, plus their length prefix."""
    rows = spec.max_batch_size if spec.batched else 1
    params = spec.params
    text_bytes = params.max_text_bytes if tokenized(spec.config) else None
    total = 0
    for t in spec.inputs:
        per_row = 1
        for d in t.dims:
            bound = d if d > 0 else params.max_dim.get(t.name, 0)
            if bound <= 0:
                per_row = None
                break
            per_row *= bound
        cap = limits.max_tensor_elements
        elements = cap if per_row is None else min(rows * per_row, cap)
        if t.datatype == "BYTES":
            each = 4 + min(text_bytes or limits.max_string_bytes, limits.max_string_bytes)
        else:
            # typed contents spend up to 10 bytes on a 64-bit varint; raw, the item size
            each = max(_itemsize(t.datatype), 10 if "INT" in t.datatype else 0)
        total += elements * each
    return total


def _itemsize(datatype: str) -> int:
    dtype = dtypes.NUMPY.get(datatype)
    return dtype.itemsize if dtype is not None else 8


MAX_DERIVED_BYTES = 64 * 2**20  # the old fixed default: a model with unbounded dims gets no more


def derived_message_bytes(specs: list[ModelSpec], limits: Limits) -> int:
    """The gRPC message limit that lets every served model's largest request in (with room for the
    message's own framing), and no bigger; at least gRPC's default of 4 MiB, at most 64 MiB (a model
    whose dims are unbounded would otherwise ask for gigabytes: set max_message_bytes for more)."""
    largest = max((request_bytes(s, limits) for s in specs), default=0)
    return min(MAX_DERIVED_BYTES, max(MIN_MESSAGE_BYTES, math.ceil(largest * 1.05) + 64 * 1024))


def _register_for_reflection() -> None:
    """Reflection answers from ``proto.POOL``; put the health and reflection protos there too, and
    reflection v1 (the same messages under package ``grpc.reflection.v1``: current tools ask v1 first)."""
    for fd in (health_pb2.DESCRIPTOR, reflection_pb2.DESCRIPTOR):
        try:
            proto.POOL.FindFileByName(fd.name)
        except KeyError:
            proto.POOL.AddSerializedFile(fd.serialized_pb)
    v1 = descriptor_pb2.FileDescriptorProto.FromString(reflection_pb2.DESCRIPTOR.serialized_pb)
    v1.name = "grpc/reflection/v1/reflection.proto"
    v1.package = "grpc.reflection.v1"
    for m in v1.message_type:
        for f in m.field:
            if f.type_name.startswith(".grpc.reflection.v1alpha."):
                f.type_name = ".grpc.reflection.v1." + f.type_name.rsplit(".", 1)[1]
    for svc in v1.service:
        for meth in svc.method:
            meth.input_type = ".grpc.reflection.v1." + meth.input_type.rsplit(".", 1)[1]
            meth.output_type = ".grpc.reflection.v1." + meth.output_type.rsplit(".", 1)[1]
    try:
        proto.POOL.FindFileByName(v1.name)
    except KeyError:
        proto.POOL.AddSerializedFile(v1.SerializeToString())


def _enable_reflection(server: grpc.aio.Server, names: list[str]) -> None:
    """v1alpha through grpcio-reflection; v1 by the same servicer: the two protocols are the same
    messages, field for field, under another package name, so v1alpha's (de)serialisers read and
    write v1's bytes."""
    servicer = reflection.aio.ReflectionServicer(names, pool=proto.POOL)
    for service in (reflection.SERVICE_NAME, REFLECTION_V1):
        handler = grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, {"ServerReflectionInfo": handler}),)
        )


def address_in_use(host: str, port: int, what: str) -> OSError:
    return OSError(
        errno.EADDRINUSE,
        f"cannot listen on {host}:{port} for {what}: address in use (another server there? "
        "set reuse_port to share the port between gateway processes on purpose)",
    )


class DrainHold(grpc.GenericRpcHandler):
    """Holds every gRPC call that arrives in the last moment before gRPC core shuts down, so that
    none is cancelled.

    ``grpc_server_shutdown_and_notify`` kills (CANCELLED, not retried by clients) every call the core
    has received but not yet handed to Python, and every call that reaches it afterwards, until the
    client has read the GOAWAY that the same shutdown sends. A caller that retries this server at
    once after each UNAVAILABLE always has its next call on the way, so answering UNAVAILABLE up to
    the shutdown is not enough. Instead, at the end of the drain each new call is held (taken from
    the core, not answered); when no call has arrived for a moment every such caller is waiting on
    one, and the core holds none. Then gRPC stops (GOAWAY, listener closed), and only after the
    GOAWAY has reached the clients are the held calls answered UNAVAILABLE: a retry then opens a new
    connection, which is refused.

    Registered before the servicer: grpc.aio asks the generic handlers in order, so while not
    holding this costs one method call per RPC and answers nothing."""

    def __init__(self) -> None:
        self.holding = False
        self.held = 0  # calls held by this drain (logged)
        self.last_arrival = 0.0  # monotonic time of the last call held
        self._released = asyncio.Event()
        self._handler = grpc.stream_stream_rpc_method_handler(self._hold)  # reads nothing

    def service(self, handler_call_details):
        if not self.holding:
            return None
        self.last_arrival = time.monotonic()
        return self._handler

    async def _hold(self, _requests, context) -> None:
        self.held += 1
        await self._released.wait()
        await context.abort(grpc.StatusCode.UNAVAILABLE, "server is draining; retry on another replica")

    def hold(self) -> None:
        self.holding = True
        self.last_arrival = time.monotonic()

    async def quiet(self, quiet_s: float, max_s: float) -> None:
        """Until no call has arrived for ``quiet_s`` (or ``max_s`` has passed)."""
        end = time.monotonic() + max_s
        while (now := time.monotonic()) < end and now - self.last_arrival < quiet_s:
            await asyncio.sleep(quiet_s / 4)

    def release(self) -> None:
        self._released.set()


class Server:
    """One gateway process: gRPC + HTTP in front of a DataPlane."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.redis = RedisLink.from_settings(settings)  # one client and breaker: the cache's and the limits'
        self.plane = DataPlane(settings, redis=self.redis)
        # reads the tenant file; errors stop the start
        self.admission = Admission.from_settings(settings, self.redis)
        self.metrics = Metrics(self.plane, VERSION)  # this process's own registry, read at scrape time
        # The door, built once here and given to the pipeline, the call takers and every transport.
        self.shedder = LoadShedder(settings.overload_lag_ms / 1000, settings.overload_min_in_flight)
        self.door = Door(
            self.admission, self.shedder,
            StreamSlots(settings.max_streams_per_tenant, settings.max_streams_per_connection),
            CallCap(settings.max_concurrent_rpcs),
        )  # fmt: skip
        # what each tenant used (None: usage_metering off, nothing counted); its sink, if any
        self.usage = Usage(Sink.from_settings(settings, self.redis)) if settings.usage_metering else None
        if self.usage is None and settings.usage_sink:
            log.warning("usage_sink %s is unused: usage_metering is off", settings.usage_sink)
        if self.usage is not None:
            self.metrics.usage = (self.usage, self.admission)
        self.pipeline = Pipeline(self.plane, self.door, self.usage)
        self.servicer = InferenceServicer(self.pipeline, self.metrics)
        self.tei = tei_grpc.TeiServicer(self.pipeline, self.metrics)  # TEI's API (tei.v1) beside KServe's
        self.health = health_aio.HealthServicer()
        self.tls = CertStore.from_settings(settings)  # reads the certificate files; errors stop the start
        self.limits = Limits.from_settings(settings)
        set_limits(self.limits)  # before any model's codec is built
        self.max_message_bytes = settings.max_message_bytes or MIN_MESSAGE_BYTES
        self.grpc_port = 0
        self.http_port = 0
        self._grpc: grpc.aio.Server | None = None
        self._http: web.AppRunner | None = None
        self.http_site: http.Listener | None = None
        self.probes: probes.Probes | None = None
        self.takers: CallTakers | None = None
        self.hold = DrainHold()

    async def start(self) -> None:
        s = self.settings
        t0 = time.perf_counter()
        # The specs first (no engine started): the message limit follows from them, and gRPC's
        # options are fixed when the server is made.
        repo = await self.plane.read_repository()
        if s.max_message_bytes is None:
            specs = [spec for versions in repo.models.values() for spec in versions.values()]
            self.max_message_bytes = derived_message_bytes(specs, self.limits)
        options = [
            ("grpc.max_receive_message_length", self.max_message_bytes),
            # Answers are ours: the derived limit guards what clients send, not what models return
            # (an output may be larger than its inputs).
            ("grpc.max_send_message_length", s.max_message_bytes or max(self.max_message_bytes, 64 * MiB)),
            ("grpc.so_reuseport", 1 if s.reuse_port else 0),
        ]
        if s.max_connection_age_s:
            # Clients re-resolve DNS only when a connection ends: ageing connections out lets pods
            # added by a scale-up (headless Service, dns:/// round robin) receive calls.
            options += [
                ("grpc.max_connection_age_ms", int(s.max_connection_age_s * 1000)),
                ("grpc.max_connection_age_grace_ms", int(s.drain_timeout_s * 1000)),
            ]
        # Authentication on metadata, before the message is read; an open server has no interceptor.
        interceptors = (
            () if self.admission.open else (AuthInterceptor(self.door, self.metrics, tei_grpc.EDGE_OF),)
        )
        self.takers = CallTakers(s.grpc_takers, self.door.calls, self.shedder)
        server = grpc.aio.server(
            options=options, interceptors=self.takers.interceptors_for(interceptors),
            maximum_concurrent_rpcs=self.takers.grpc_cap,
        )  # fmt: skip
        self.takers.attach(server)
        self.metrics.overload = (self.shedder, self.takers)
        tracing.setup(s)  # on only with otel_endpoint
        await self.admission.start()  # Redis for global limits, if any; being down is not fatal
        if self.usage is not None and self.usage.sink is not None:
            await self.usage.sink.start()
        server.add_generic_rpc_handlers((self.hold,))  # first: while holding it answers every call
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(self.servicer, server)
        self.tei.add_to(server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        _register_for_reflection()
        _enable_reflection(
            server,
            [SERVICE_NAME, *tei_grpc.SERVICES, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME, REFLECTION_V1],
        )  # fmt: skip
        try:
            if self.tls is not None:  # TLS only: a plaintext client fails its handshake
                creds = self.tls.grpc_credentials()
                self.grpc_port = server.add_secure_port(f"{s.host}:{s.grpc_port}", creds)
            else:
                self.grpc_port = server.add_insecure_port(f"{s.host}:{s.grpc_port}")
        except RuntimeError:  # grpcio raises "Failed to bind" rather than returning 0
            self.grpc_port = 0
        if self.grpc_port == 0:
            raise address_in_use(s.host, s.grpc_port, "gRPC")
        await self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.start()
        self.takers.start()
        self._grpc = server
        try:
            self._http, self.http_site = await http.start(self)
            self.http_port = self.http_site.port
        except OSError as exc:
            await server.stop(None)
            if exc.errno == errno.EADDRINUSE:
                raise address_in_use(s.host, s.http_port, "HTTP") from None
            raise
        self.probes = await probes.start(self)  # plaintext health/metrics ports, when set (TLS deployments)
        log.info(
            "listening: gRPC %s:%d, HTTP %s:%d%s; messages up to %d bytes%s",
            s.host, self.grpc_port, s.host, self.http_port,
            "" if self.tls is None
            else (" (TLS, client certificates required)" if self.tls.mutual else " (TLS)"),
            self.max_message_bytes, "" if s.max_message_bytes else " (derived from the models)",
        )  # fmt: skip
        await self.plane.load(repo)
        self.shedder.start(self.pipeline)  # the load it watches: the pipeline's calls, the loop's lag
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
        kinds = [rt.spec.kind for rt in self.plane.runtimes() if rt.text is not None]
        for name, useful in tei_grpc.serving(kinds).items():  # as TEI reports its services
            await self.health.set(name, serving if ready and useful else not_serving)
        for name in self.plane.failures:
            if name not in self.plane.models:
                await self.health.set(name, not_serving)

    async def drain_and_stop(self) -> None:
        """Readiness false first, then let accepted work finish, then stop listening."""
        if self.plane.draining:
            return
        log.info("draining: readiness false; new requests get UNAVAILABLE", extra={"event": "drain"})
        self.plane.draining = True
        # The load shedder stands down: every call now gets the drain's own answers (UNAVAILABLE,
        # then the hold), and a call refused at the door would leave its caller's retry in flight
        # when gRPC stops (and draining refusals would read to the shedder as wasted calls).
        self.shedder.stand_down()
        # The quiet period of _linger counts from here: callers that have not yet sent their next
        # request (so none was refused) must still get the chance to be told UNAVAILABLE.
        self.plane.last_refused = time.monotonic()
        await self._set_health()
        # HTTP stops accepting connections now (a new one is refused: the client goes elsewhere);
        # the open ones are answered 503 with "Connection: close", so each closes after its answer
        # instead of being cut under a request later.
        if self.http_site is not None:
            self.http_site.stop_accepting()
        # Streams stop being read; what they hold is answered, then each ends UNAVAILABLE.
        self.servicer.end_streams()
        self.tei.end_streams()
        ok = await self.plane.drain(self.settings.drain_timeout_s)
        if not ok:
            log.warning(
                "drain timed out after %.1fs; answering what is left UNAVAILABLE",
                self.settings.drain_timeout_s,
            )
        await self._linger()
        if self._grpc is not None:
            await self._stop_grpc()
        if self.http_site is not None:
            self.http_site.stop_accepting()  # (again, if a drain closed it: a no-op)
        if self._http is not None:
            await self._http.cleanup()
        self.shedder.stop()
        await self.plane.close()
        for rt in self.plane.runtimes():
            log.info(
                "model %s version %s unloaded", rt.spec.name, rt.spec.version,
                extra={"event": "unload", "model": rt.spec.name, "version": rt.spec.version},
            )  # fmt: skip
        await self.admission.close()
        if self.usage is not None and self.usage.sink is not None:
            await self.usage.sink.close()  # before the link it may write through
        if self.redis is not None:  # after both of its users
            await self.redis.close()
        tracing.stop()  # flushes the spans still buffered
        if self.probes is not None:  # last: probes see the drain through
            await self.probes.stop()
        log.info("stopped", extra={"event": "stopped"})

    async def _linger(self) -> None:
        """Keep answering UNAVAILABLE until callers stop arriving (or drain_linger_s passes).

        A clean UNAVAILABLE tells callers to go to another replica, and Kubernetes needs a moment
        to take us off its endpoints; callers that keep coming back are dealt with by _stop_grpc.
        """
        quiet_s = 0.5  # calls queued in gRPC core behind a busy loop need time to reach us
        end = time.monotonic() + self.settings.drain_linger_s
        while (now := time.monotonic()) < end:
            if now - self.plane.last_refused >= quiet_s:
                return
            await asyncio.sleep(quiet_s / 4)

    async def _stop_grpc(self) -> None:
        """Stop gRPC without a CANCELLED call: hold what arrives until callers are all waiting,
        stop (GOAWAY), then answer the held calls (see DrainHold)."""
        assert self._grpc is not None
        hold = self.hold
        hold.hold()
        await hold.quiet(HOLD_QUIET_S, HOLD_MAX_S)
        stopping = asyncio.create_task(self._grpc.stop(grace=2.0))
        await asyncio.sleep(0)  # the task's first step calls grpc_server_shutdown_and_notify
        # The GOAWAY is queued on each connection before the held answers, so a client reads it
        # first (measured: no CANCELLED with no pause either); the pause is a margin for the core
        # sending it from its own threads.
        await asyncio.sleep(GOAWAY_S)
        log.info("gRPC stopping (GOAWAY sent); answering %d held call(s) UNAVAILABLE", hold.held)
        hold.release()
        await stopping


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
