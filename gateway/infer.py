"""The one request pipeline both transports call: identify → admit → decode → runtime → encode.

The transports (gateway/transport/grpc.py, gateway/transport/rest.py) only translate their wire
format to a ``ModelInferRequest`` and back and map ``GatewayError`` kinds to their own status codes,
each in one table. Everything that decides whether a call is taken, and what it costs, is here:

- ``identify`` (the API key from metadata or headers, before any body is read);
- ``check_request``: client strings bounded before anything echoes or keys on them;
- ``infer``: admission (tenant, limits) before decoding, then the runtime; one accounting wrapper
  (in flight, ok, failed) for unary gRPC, each stream message and REST alike;
- model control (load/unload) behind ``model_control`` and the tenant file's ``admin`` flag, the
  name checked before any state is made for it;
- the metadata, statistics and repository index answers, as protobuf messages the transports
  either send as they are (gRPC) or turn into JSON (REST).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from contextvars import ContextVar
from importlib.metadata import PackageNotFoundError, version

from batchgate.gateway.admission import Account, Admission
from batchgate.gateway.scheduling.request import resolve as resolve_budget
from batchgate.gateway.dataplane import DataPlane, ReloadFailed
from batchgate.gateway.errors import ECHO_MAX, GatewayError, Kind, clip, invalid, not_found
from batchgate.gateway.metrics import TransportCounters
from batchgate.proto.inference.v2 import grpc_service_pb2 as pb

log = logging.getLogger(__name__)

try:
    VERSION = version("batchgate")
except PackageNotFoundError:  # running from a source tree without an install
    VERSION = "0.0.0+source"

# The KServe/Triton extensions this server serves, exactly: model_repository is the index plus
# load/unload (those answer PERMISSION_DENIED unless model_control is on).
EXTENSIONS = ("model_repository", "model_configuration", "statistics", "binary_tensor_data")

# A model directory name: what a repository can hold and nothing that walks out of it.
_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")

_clock = time.perf_counter


def _too_long(what: str, text: str) -> GatewayError:
    return invalid(f"{what} '{clip(text)}' is longer than {ECHO_MAX} characters")


def check_request(request: pb.ModelInferRequest) -> None:
    """Every client string that an error may echo or a label may carry, bounded before any other
    work (a length check each: a few hundred nanoseconds per call)."""
    if len(request.model_name) > ECHO_MAX:
        raise not_found(f"unknown model '{clip(request.model_name)}'")
    if len(request.model_version) > ECHO_MAX:
        raise not_found(f"model has no version '{clip(request.model_version)}'")
    for t in request.inputs:
        if len(t.name) > ECHO_MAX:
            raise _too_long("input name", t.name)
        if t.parameters:
            _check_parameters(t.parameters)
    for o in request.outputs:
        if len(o.name) > ECHO_MAX:
            raise _too_long("output name", o.name)
        if o.parameters:
            _check_parameters(o.parameters)
    if request.parameters:
        _check_parameters(request.parameters)


def _check_parameters(params) -> None:
    for key, p in params.items():
        if len(key) > ECHO_MAX:
            raise _too_long("parameter name", key)
        if p.WhichOneof("parameter_choice") == "string_param" and len(p.string_param) > ECHO_MAX:
            n = len(p.string_param)
            raise invalid(f"parameter '{key}' is {n} characters; at most {ECHO_MAX} are accepted")


GATED: ContextVar[bool] = ContextVar("batchgate_gated", default=False)  # the door already took it


RETRY_S = 0.05  # the overload refusal's retry hint
_RETRY_TRAILERS = (("grpc-retry-pushback-ms", "50"), ("retry-after-ms", "50"))


class OverloadGate:
    """Refuses a share of new calls, before any decoding, while the process is past its ceiling.

    Past its ceiling a server that takes every call spends its time on calls that then miss their
    deadlines (goodput falls to nothing). Two signals, looked at every 10 ms:

    - **wasted calls**: of the calls that ended lately (decaying counts, ~100 ms of memory), the
      share that was taken and then dropped — shed by the scheduler, expired in its queue, or
      abandoned by a caller whose deadline passed. Over ``WASTE``, the admitted share is set to what
      the server is completing: the calls that ended well per call that arrived, plus 5 % — while
      more than ``min_in_flight`` calls have been inside lately, or the process is saturated (one
      caller's run of hopeless deadlines is no overload). Rates, not steps: a caller's call that
      dies now was taken up to its budget ago, so cutting by a step per look for as long as drops
      go on would overshoot to nothing and refuse at 1x. Saturated: the loop's thread busy, or the
      process's CPU at the cores it may use, for ``SATURATED`` of the time lately. Without it a
      sudden 4x on an idle server went unseen: the calls waited in gRPC core, reached Python with
      their deadlines spent and were shed at once, so never more than a few were inside, while core
      let the rest expire (bench.goodput --mix one-class --loads 4: 159 of 40,317 calls answered
      in 8 s, the gate taking all);
    - **a standing queue on the loop** (CoDel's idea): the event loop's lag has stayed over the
      target for a whole ``STANDING_S`` while more than ``min_in_flight`` calls are inside (a lag
      burst, a big batch's answers, is no overload): the share is cut by a fifth, once per stretch.

    With neither, the share grows back by half a percent per look (all of it within two seconds).

    The door sees no request body, so no latency class; it does see a gRPC call's deadline. While
    shedding, a call with less than ``TIGHT_S`` left is taken ``TIGHT_S / time left`` times as often
    as one with time to spare (at most ``BOOST`` times, and never more than every one): a tight
    class is not starved at 4x by lenient work that can wait, and the deadline queue serves it
    first. The share is set so that all of them together are what completes. Within each weight,
    refusals are spread evenly over arrivals (a credit counter, no randomness). A call pays a
    counter while not shedding."""

    TICK_S = 0.010
    WASTE = 0.10  # share of ended calls that were dropped, above which the door sheds
    STANDING_S = 0.100
    DECAY = 0.9  # per tick, for the arrived/ended/dropped counts (~100 ms of memory)
    MIN_ADMIT = 0.02
    GROW = 0.005  # per tick while neither signal is on
    SPENT_S = 0.0005  # a call with less than this left when it reaches the door is refused there
    SATURATED = 0.9  # share of the time busy (the loop's thread, or the process's cores)
    TIGHT_S = 0.500  # a call with less time left than this is taken more often while shedding
    BOOST = 8  # ... at most this many times as often (a call with 60 ms left at the full eight)

    def __init__(self, pipeline: Pipeline, lag_target_s: float, min_in_flight: int) -> None:
        self.pipeline = pipeline
        self.target_s = lag_target_s
        self.min_in_flight = min_in_flight
        self.admit = 1.0  # share of new calls taken
        self.shedding = False
        self.refused = 0
        self.spent = 0  # of which refused with their deadline already spent
        self.arrived = 0.0  # new calls asked about lately (decaying)
        self.ended = 0.0  # calls that ended lately (decaying)
        self.dropped = 0.0  # of which taken and then dropped (decaying)
        self.busy = 0.0  # calls inside, a decaying peak
        self.weighted = [0.0] * (self.BOOST + 1)  # arrived lately, by weight 2..BOOST (while shedding)
        self._message = ""
        self._credit = [0.0] * (self.BOOST + 1)  # by weight
        self._lag_low_at = 0.0  # the last time the loop's lag was under the target
        self._handle: asyncio.TimerHandle | None = None
        self._beat = None  # the LoopLag whose timer this gate looks on, when it runs
        self._looked_at = 0.0
        self.saturation = 0.0  # share of the time busy lately (decaying)
        self._cpu_times = _cpu_times  # (the loop thread's, the process's) CPU seconds
        self._cores = (
            len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        )
        self._cpu_at = (0.0, 0.0, 0.0)

    def start(self) -> None:
        if self.target_s > 0 and self._handle is None and self._beat is None:
            self._loop = asyncio.get_running_loop()
            self._lag_low_at = self._loop.time()
            self._cpu_at = (self._lag_low_at, *self._cpu_times())
            lag = self.pipeline.plane.lag
            if getattr(lag, "running", False) and lag.interval_s <= self.TICK_S:
                self._beat = lag  # look on the lag monitor's timer: no timer of the gate's own
                self._looked_at = self._lag_low_at
                lag.listeners.append(self._on_beat)
            else:
                self._handle = self._loop.call_later(self.TICK_S, self._tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._beat is not None:
            self._beat.listeners.remove(self._on_beat)
            self._beat = None

    def stand_down(self) -> None:
        """Take every call from now on (the server is draining)."""
        self.stop()
        self._set_admit(1.0)

    def _tick(self) -> None:
        """A look on the gate's own timer (when no lag monitor runs to beat for it)."""
        self._look(self._loop.time())
        self._handle = self._loop.call_later(self.TICK_S, self._tick)

    def _on_beat(self, now: float) -> None:
        """The lag monitor sampled: look if ``TICK_S`` has passed since the last look (every
        second beat of its 5 ms timer)."""
        if now - self._looked_at >= self.TICK_S - 0.001:
            self._looked_at = now
            self._look(now)

    def _look(self, now: float) -> None:
        thread_cpu, process_cpu = self._cpu_times()
        t0, thread0, process0 = self._cpu_at
        if now > t0:
            used = max(thread_cpu - thread0, (process_cpu - process0) / self._cores) / (now - t0)
            self.saturation = self.saturation * self.DECAY + (1 - self.DECAY) * min(used, 1.0)
        self._cpu_at = (now, thread_cpu, process_cpu)
        # (a busy server only: one caller's run of hopeless deadlines must not shed everyone's calls)
        self.busy = max(self.busy * self.DECAY, self.pipeline.inflight)
        busy = self.busy > self.min_in_flight or self.saturation >= self.SATURATED
        if self.pipeline.plane.lag.s <= self.target_s or not busy:
            self._lag_low_at = now
        if busy and self.ended >= 16 and self.dropped > self.WASTE * self.ended:
            admit = max(self.MIN_ADMIT, min(self.admit, self._share(1.05 * (self.ended - self.dropped))))
        elif now - self._lag_low_at >= self.STANDING_S:
            admit = max(self.MIN_ADMIT, self.admit * 0.8)
            self._lag_low_at = now  # once per stretch
        else:
            admit = min(1.0, self.admit + self.GROW)
        self._set_admit(admit)
        self.arrived *= self.DECAY
        self.ended *= self.DECAY
        self.dropped *= self.DECAY
        w = self.weighted
        for k in range(2, len(w)):
            w[k] *= self.DECAY

    def _share(self, target: float) -> float:
        """The share ``a`` at which the calls that arrived lately, each taken ``min(1, weight * a)``
        of the time, add up to ``target``: what the server is completing."""
        w = self.weighted
        counts = [(k, w[k]) for k in range(len(w) - 1, 1, -1) if w[k] > 0]
        counts.append((1, max(self.arrived - sum(n for _, n in counts), 0.0)))
        # f(a) = sum n * min(1, k * a) is increasing and linear between the breakpoints 1/k;
        # from the highest weight down, the calls of weight k are taken whole once a >= 1/k
        whole, slope = 0.0, sum(k * n for k, n in counts)
        for k, n in counts:  # weights descending: breakpoints 1/k ascending
            if slope > 0 and (target - whole) / slope <= 1.0 / k:
                return (target - whole) / slope
            whole += n
            slope -= k * n
        return 1.0

    def take(self, remaining: float | None = None) -> bool:
        """Whether to take a new call (False: refuse it, counted) with ``remaining`` seconds left
        (None: no deadline). A counter while not shedding; while shedding, refusals are spread
        evenly over the arrivals of each weight."""
        if not self.shedding:
            self.arrived += 1
            return True
        if remaining is not None and remaining <= self.SPENT_S:
            # its caller has given up already (it waited in core past its deadline): refused here,
            # the cheapest way, and kept out of the counts (it says nothing of what completes)
            self.spent += 1
            self.refused += 1
            return False
        self.arrived += 1
        k = 1
        if remaining is not None and remaining < self.TIGHT_S:
            k = min(self.BOOST, int(self.TIGHT_S / max(remaining, 1e-3)))
            if k > 1:
                self.weighted[k] += 1
        credit = self._credit[k] + min(1.0, k * self.admit)
        if credit >= 1.0:
            self._credit[k] = credit - 1.0
            return True
        self._credit[k] = credit
        self.refused += 1
        return False

    def message(self) -> str:
        """The refusal's words (made once per look, not once per refused call)."""
        return self._message

    def trailing(self) -> tuple:
        """The refusal's retry hint: five looks of the gate (gRPC's retry pushback)."""
        return _RETRY_TRAILERS

    def check(self, remaining: float | None = None) -> None:
        """Take the call, or raise UNAVAILABLE (outcome ``overloaded``)."""
        if not self.take(remaining):
            raise GatewayError(Kind.UNAVAILABLE, self._message, outcome="overloaded", retry_after_s=RETRY_S)

    def _set_admit(self, admit: float) -> None:
        if admit != self.admit:
            self._message = f"server overloaded: taking {admit:.0%} of new calls; retry with backoff or on another replica"
        self.admit = admit
        self.shedding = admit < 1.0


def _cpu_times() -> tuple[float, float]:
    return time.thread_time(), time.process_time()


def _wasted(exc: BaseException) -> bool:
    """A call taken and then dropped for want of time or room (not the client's error, nor the
    gate's own refusal): what the gate sheds to avoid."""
    if isinstance(exc, asyncio.CancelledError):  # the caller gave up (its deadline, usually)
        return True
    return isinstance(exc, GatewayError) and (
        exc.kind is Kind.DEADLINE or (exc.kind is Kind.UNAVAILABLE and exc.outcome != "overloaded")
    )


class Pipeline:
    """What a call goes through, whichever transport it came on."""

    def __init__(self, plane: DataPlane, admission: Admission | None = None) -> None:
        self.plane = plane
        self.admission = admission or Admission()  # no tenants: open
        self.settings = plane.settings
        self.inflight = 0  # calls inside ``infer``, all transports
        s = self.settings
        self.gate = OverloadGate(self, s.overload_lag_ms / 1000, s.overload_min_in_flight)

    # -- identify -------------------------------------------------------------------------------

    @property
    def open(self) -> bool:
        return self.admission.open

    def identify(self, metadata) -> Account | None:
        """The caller's account from (lower-case) metadata/headers; None on an open server.
        UNAUTHENTICATED when the key is missing or wrong. Costs one SHA-256 and a dict lookup."""
        if self.admission.open:
            return None
        return self.admission.identify(metadata)

    # -- inference ------------------------------------------------------------------------------

    async def infer(
        self, request: pb.ModelInferRequest, caller: Account | None, edge: TransportCounters,
        time_remaining: float | None = None, gated: bool = False,
    ) -> pb.ModelInferResponse:  # fmt: skip
        """The call, counted at ``edge`` (in flight, then ok or failed with its outcome). Raises
        ``GatewayError`` for everything the client should hear about; other exceptions are bugs.
        ``gated``: the transport has already asked the overload gate (REST does, before the body)."""
        t0 = _clock()
        edge.inflight += 1
        self.inflight += 1
        try:
            # the cheapest refusal there is once a call has reached Python (a call the door took,
            # gRPC's call takers or REST's, has been asked already)
            if not (gated or GATED.get()):
                self.gate.check(time_remaining)
            resp = await self._infer(request, caller, time_remaining)
        except BaseException as exc:
            edge.failed(request.model_name, request.model_version, exc)
            gate = self.gate
            gate.ended += 1
            if _wasted(exc):
                gate.dropped += 1
            raise
        finally:
            edge.inflight -= 1
            self.inflight -= 1
        edge.ok(resp.model_name, resp.model_version, _clock() - t0)
        self.gate.ended += 1
        return resp

    async def _infer(
        self, request: pb.ModelInferRequest, caller: Account | None, time_remaining: float | None
    ) -> pb.ModelInferResponse:
        check_request(request)
        plane = self.plane
        if plane.draining:
            plane.last_refused = time.monotonic()
        rt = plane.get(request.model_name, request.model_version)
        if caller is None:
            return await self._run(rt, request, time_remaining, None, None)
        # Admission runs before any decoding: the row count is read off the first input's shape.
        inputs = request.inputs
        if rt.spec.batched:
            rows = max(inputs[0].shape[0], 0) if inputs and inputs[0].shape else 0
        else:
            rows = 1
        ticket = await self.admission.admit(caller, request.model_name, rows)
        tenant = ticket.tenant
        try:
            # The runtime is looked up again: a reload may have swapped it during a Redis decision.
            rt = plane.get(request.model_name, request.model_version)
            return await self._run(rt, request, time_remaining, tenant.default_class, tenant.cache_namespace)
        finally:
            ticket.release()

    async def _run(self, rt, request, time_remaining, default_class, namespace) -> pb.ModelInferResponse:
        plane = self.plane
        budget = resolve_budget(
            request.parameters, time_remaining, rt.scheduler.clock(), plane.classes,
            default_class or plane.settings.default_latency_class, rt.schedule,
        )  # fmt: skip
        codec = rt.codec
        wanted = codec.requested(request)
        arrays, rows = codec.decode(request)
        outputs = await rt.infer(arrays, rows, budget, wanted=wanted, namespace=namespace)
        return codec.encode(request, outputs, wanted)

    # -- model control --------------------------------------------------------------------------

    def _may_control(self, caller: Account | None) -> None:
        if not self.settings.model_control:
            raise GatewayError(
                Kind.PERMISSION,
                "model control is off on this server: load/unload need model_control "
                "(BATCHGATE_MODEL_CONTROL=true), and with a tenant file a tenant marked admin",
            )
        if caller is not None and not caller.tenant.admin:
            raise GatewayError(
                Kind.PERMISSION,
                f"tenant '{caller.tenant.name}' may not load or unload models "
                "(admin: true in the tenant file)",
            )

    @staticmethod
    def _check_name(name: str) -> None:
        """Before anything is created for ``name`` (a lock, a log line, a metric label)."""
        if len(name) > ECHO_MAX or not _MODEL_NAME.fullmatch(name):
            raise not_found(f"no model directory '{clip(name)}' in the repository")

    async def load(self, caller: Account | None, name: str, parameters) -> None:
        """Triton's load/reload: re-read the model's directory, start and warm it, swap it in.

        A directory that cannot be served answers FAILED_PRECONDITION with the reason (the files
        must be fixed first; the previous load keeps serving). Triton's inline overrides
        (``config`` / ``file:`` parameters) are not offered: UNIMPLEMENTED, never silently ignored."""
        self._may_control(caller)
        self._check_name(name)
        if parameters:
            keys = sorted(clip(k, 32) for k in list(parameters)[:8])
            raise GatewayError(
                Kind.UNSUPPORTED,
                f"load parameters {keys} are not supported: edit the model's directory in the repository "
                "and load it again",
            )
        try:
            await self.plane.reload(name)
        except ReloadFailed as exc:
            raise GatewayError(Kind.PRECONDITION, f"failed to load '{name}': {exc}") from None

    async def unload(self, caller: Account | None, name: str) -> None:
        """Stop serving the model once the calls it holds are answered."""
        self._may_control(caller)
        self._check_name(name)
        if name not in self.plane.models:
            raise not_found(f"model '{name}' is not loaded")
        await self.plane.unload(name)

    # -- metadata -------------------------------------------------------------------------------

    @staticmethod
    def server_metadata() -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name="batchgate", version=VERSION, extensions=list(EXTENSIONS))

    def model_ready(self, name: str, version: str) -> bool:
        try:
            self.plane.get(name, version)
        except GatewayError:
            return False
        return True

    def _runtime_for_metadata(self, name: str, version: str):
        if len(name) > ECHO_MAX or len(version) > ECHO_MAX:
            raise not_found(f"unknown model '{clip(name)}'")
        if not self.plane.draining:
            return self.plane.get(name, version)
        return self.plane.runtimes(name, version)[-1]  # metadata stays readable while draining

    def model_metadata(self, name: str, version: str) -> pb.ModelMetadataResponse:
        spec = self._runtime_for_metadata(name, version).spec
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

    def model_config(self, name: str, version: str) -> pb.ModelConfigResponse:
        return pb.ModelConfigResponse(config=self._runtime_for_metadata(name, version).spec.config)

    def statistics(self, name: str, version: str) -> pb.ModelStatisticsResponse:
        if len(name) > ECHO_MAX or len(version) > ECHO_MAX:
            raise not_found(f"unknown model '{clip(name)}'")
        resp = pb.ModelStatisticsResponse()
        for rt in self.plane.runtimes(name, version):
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

    def repository_index(self, ready: bool) -> pb.RepositoryIndexResponse:
        plane = self.plane
        resp = pb.RepositoryIndexResponse()
        for name in sorted(set(plane.models) | set(plane.failures)):
            for ver in sorted(plane.models.get(name, {}), key=int):
                resp.models.add(name=name, version=ver, state="READY")
            failure = plane.failures.get(name)
            if failure is not None and not ready:
                resp.models.add(
                    name=name, version=failure.version, state="UNAVAILABLE", reason=failure.reason
                )
        return resp
