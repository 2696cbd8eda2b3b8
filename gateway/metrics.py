"""Prometheus metrics, prefixed ``batchgate_``; every metric is described in docs/metrics.md.

Per-call Python work is the scarce resource, so almost nothing here runs per call:

* At scrape time a collector reads what the data plane already keeps (``Stats`` per model
  version, queue lengths, worker busy time, the result cache's ``stats()``) and turns it into
  metric families. Zero hot-path cost.
* At the edge each transport (``TransportCounters``) keeps plain integers per (model, version) and a
  histogram of request time; a success costs a dict lookup, an integer increment and a bisect.
* Per executed batch (not per request) the scheduler calls the model's ``BatchObserver`` with
  the batch; it fills the queue-time, compute-time, batch-size and padding histograms.

Everything is mutated and read on the event loop thread only (the scheduler completes batches
there, the transports and the /metrics handler run there), which is why these are plain ints
and lists rather than prometheus_client's locked metric objects.

Each ``Metrics`` owns its own ``CollectorRegistry`` (never the global default), so a test can run
several servers in one process and each process exports only its own state. Several gateway
processes on one host (SO_REUSEPORT) are scraped one by one, each on its own HTTP port; see
docs/metrics.md for why prometheus_client's multiprocess mode does not fit collectors like these.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from batchgate.gateway.errors import GatewayError, Kind
from batchgate.gateway.histogram import LATENCY_BUCKETS, Histogram

log = logging.getLogger(__name__)

__all__ = ["CONTENT_TYPE_LATEST", "BatchObserver", "Histogram", "Metrics", "TransportCounters", "outcome_of"]

BATCH_ROWS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
BATCH_TOKENS_BUCKETS = (64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
PADDING_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.75, 0.9, 1.0)

# Domain error -> the `outcome` label. An error may carry a finer `outcome` attribute of its own
# (e.g. the scheduler's "shed" for a deadline refused at admission, against "expired" for one
# that ran out while queued); otherwise its kind decides.
OUTCOME_BY_KIND = {
    Kind.INVALID: "invalid",
    Kind.NOT_FOUND: "not_found",
    Kind.UNAVAILABLE: "unavailable",
    Kind.EXHAUSTED: "rate_limited",
    Kind.DEADLINE: "expired",
    Kind.UNAUTHENTICATED: "unauthenticated",
    Kind.PERMISSION: "permission_denied",
    Kind.UNSUPPORTED: "unsupported",
    Kind.FAILED: "error",
}
TRANSPORTS = ("grpc", "grpc_stream", "http")
_EMPTY = Histogram(LATENCY_BUCKETS)  # never observed: the zero-valued series of a quiet label set


def outcome_of(exc: BaseException) -> str:
    if isinstance(exc, GatewayError):
        outcome = getattr(exc, "outcome", None)
        if outcome:
            return outcome
        if exc.kind is Kind.DEADLINE and "shed" in exc.message:
            return "shed"  # the scheduler's admission refusal says so; the slow path can afford a look
        return OUTCOME_BY_KIND.get(exc.kind, "error")
    if isinstance(exc, asyncio.CancelledError):
        return "cancelled"  # the caller went away (or its deadline passed in gRPC) before the answer
    return "error"


# -- the edge -------------------------------------------------------------------------------------


class _ModelCounters:
    """One (model, version) at one transport."""

    __slots__ = ("model", "version", "success", "outcomes", "latency")

    def __init__(self, model: str, version: str) -> None:
        self.model = model
        self.version = version
        self.success = 0
        self.outcomes: dict[str, int] = {}  # everything but success; rare, so a dict is fine
        self.latency = Histogram(LATENCY_BUCKETS)


class TransportCounters:
    """Request counters of one transport. ``ok`` is the per-call path; ``failed`` is not."""

    def __init__(self, name: str, plane) -> None:
        self.name = name
        self.plane = plane
        self.inflight = 0  # calls between receipt and answer at this transport
        self._edges: dict[tuple[str, str], _ModelCounters] = {}

    def _edge(self, model: str, version: str) -> _ModelCounters:
        key = (model, version)
        e = self._edges.get(key)
        if e is None:
            e = self._edges[key] = _ModelCounters(model, version)
        return e

    def ok(self, model: str, version: str, seconds: float) -> None:
        """A success, labelled with the model and version that answered (the response's)."""
        e = self._edges.get((model, version))
        if e is None:
            e = self._edge(model, version)
        e.success += 1
        e.latency.observe(seconds)

    def failed(self, model: str, version: str, exc: BaseException) -> str:
        """Count a refused or failed call; labels stay bounded by what the repository holds
        (an unknown model or version is counted under empty labels, never under the name sent)."""
        outcome = outcome_of(exc)
        versions = self.plane.models.get(model)
        if versions is not None:
            version = version or self.plane.latest.get(model, "")
            if version not in versions:
                version = ""
        elif model in self.plane.failures:
            version = self.plane.failures[model].version
        else:
            model = version = ""
        e = self._edge(model, version)
        e.outcomes[outcome] = e.outcomes.get(outcome, 0) + 1
        return outcome

    def edges(self) -> list[_ModelCounters]:
        return list(self._edges.values())


# -- per batch ------------------------------------------------------------------------------------


class BatchObserver:
    """Called by the scheduler once per executed batch (see ``Stats.observer``)."""

    __slots__ = ("queue", "compute", "rows", "tokens", "padding", "token_input")

    def __init__(self, token_input: str | None) -> None:
        self.queue = Histogram(LATENCY_BUCKETS)
        self.compute = Histogram(LATENCY_BUCKETS)
        self.rows = Histogram(BATCH_ROWS_BUCKETS)
        self.tokens = Histogram(BATCH_TOKENS_BUCKETS)
        self.padding = Histogram(PADDING_BUCKETS)
        # The first input with a variable (-1) dim: rows x its per-row elements are a request's
        # tokens, when the engine does not report them itself.
        self.token_input = token_input

    def __call__(self, batch, start: float, rows: int, timing) -> None:
        q = self.queue
        for r in batch:
            q.observe(start - r.arrival)
        self.compute.observe((timing.input_ns + timing.infer_ns + timing.output_ns) * 1e-9)
        self.rows.observe(rows)
        # The engine reports what the requests sent (`tokens`) and what it computed after padding
        # the batch up to a shape bucket (`padded_tokens`).
        tokens = timing.tokens
        if self.token_input is not None:
            self.tokens.observe(tokens)
        padded = timing.padded_tokens
        if padded and tokens:
            self.padding.observe(1.0 - tokens / padded)


# -- the registry ---------------------------------------------------------------------------------


class Metrics:
    """The metrics of one gateway process (one ``DataPlane``)."""

    def __init__(self, plane, version: str = "") -> None:
        self.plane = plane
        self.version = version
        self.transports = {name: TransportCounters(name, plane) for name in TRANSPORTS}
        self.observers: dict[tuple[str, str], BatchObserver] = {}
        self.registry = CollectorRegistry(auto_describe=False)
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self.overload = None  # (LoadShedder, CallTakers | None), set by the server once made
        self.usage = None  # (Usage, Admission), set by the server while metering: per-tenant families
        self.registry.register(_PlaneCollector(self))

    def transport(self, name: str) -> TransportCounters:
        return self.transports[name]

    def attach(self) -> None:
        """Hook a BatchObserver into every loaded model's scheduler (idempotent; also run at
        each scrape so models loaded later are covered)."""
        for rt in self.plane.runtimes():
            stats = rt.scheduler.stats
            if stats.observer is None:
                key = (rt.spec.name, rt.spec.version)
                obs = self.observers.get(key)
                if obs is None:
                    token_input = rt.variable_inputs[0] if rt.variable_inputs else None
                    obs = self.observers[key] = BatchObserver(token_input)
                stats.observer = obs

    def exposition(self) -> bytes:
        self.attach()
        return generate_latest(self.registry)


def _caches(plane) -> Iterator[tuple[str, str, object]]:
    """(model, version, cache) for each distinct cache: the data plane's shared tiers (model and
    version empty) and each model's own view of them."""
    seen: set[int] = set()
    candidates = [("", "", plane.cache)]
    candidates += [(rt.spec.name, rt.spec.version, rt.cache) for rt in plane.runtimes()]
    for model, version, cache in candidates:
        if cache is not None and id(cache) not in seen:
            seen.add(id(cache))
            yield model, version, cache


def _cache_tiers(stats: dict) -> dict[str, dict]:
    """``stats()`` is ``{tier: {"hits": n, "misses": n, ...}}``; a flat ``{"hits": n, ...}`` is
    taken as one tier named "all"."""
    if any(isinstance(v, dict) for v in stats.values()):
        return {str(k): v for k, v in stats.items() if isinstance(v, dict)}
    return {"all": stats}


class _PlaneCollector:
    """Collected fresh at each scrape from public state only: the data plane's registry, each
    runtime's ``snapshot()`` and the transports' counters; one function per family group."""

    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics

    def describe(self) -> list:
        return []  # collected fresh at each scrape; nothing to check at registration

    def collect(self):
        m, plane = self.m, self.m.plane
        snaps = [rt.snapshot() for rt in plane.runtimes()]
        yield from _server_families(m, plane)
        yield from _edge_families(m)
        yield from _batch_families(m)
        yield from _scheduler_families(snaps)
        yield from _worker_families(snaps)
        yield _loop_lag_family(plane)
        yield from _selection_families(plane)
        yield from _overload_families(m)
        yield from _cache_families(plane)
        if m.usage is not None:
            usage, admission = m.usage
            yield from usage.families(admission, m.plane.models)


P = "batchgate_"
MV = ["model", "version"]


def _selection_families(plane) -> Iterator:
    """The host's variant selection per model (gateway/selection.py): its state and wall time."""
    state = GaugeMetricFamily(
        P + "variant_selection",
        "1 for each model's variant selection state on this host's CPU class (off, pinned, recorded, "
        "pending, selecting, switched, kept, failed, waiting), with the variant serving",
        labels=["model", "host_class", "state", "variant"],
    )
    seconds = GaugeMetricFamily(
        P + "variant_selection_seconds",
        "wall time of the model's background selection (so far, or taken)",
        labels=["model"],
    )
    selector = getattr(plane, "selector", None)
    for s in selector.states.values() if selector is not None else ():
        state.add_metric([s.model, s.host_class, s.state, s.variant], 1)
        if s.started is not None:
            seconds.add_metric([s.model], s.seconds if s.seconds is not None else time.time() - s.started)
    yield state
    yield seconds


def _server_families(m: Metrics, plane) -> Iterator:
    info = GaugeMetricFamily(P + "build_info", "batchgate version of this process", labels=["version"])
    info.add_metric([m.version], 1)
    yield info
    ready = GaugeMetricFamily(P + "server_ready", "1 while the server reports ready (ServerReady)")
    ready.add_metric([], 1 if plane.ready else 0)
    yield ready
    model_ready = GaugeMetricFamily(
        P + "model_ready", "1 for a served model version, 0 for one that failed to load", labels=MV
    )
    for rt in plane.runtimes():
        model_ready.add_metric([rt.spec.name, rt.spec.version], 1)
    for name, failure in plane.failures.items():
        if name not in plane.models:
            model_ready.add_metric([name, failure.version], 0)
    yield model_ready
    variant = GaugeMetricFamily(
        P + "model_variant_info",
        "1 per served model version: the engine variant answering (parameter variant), its precision and "
        "the runtime computing it (onnxruntime or openvino)",
        labels=MV + ["variant", "precision", "engine"],
    )
    for rt in plane.runtimes():
        variant.add_metric(
            [rt.spec.name, rt.spec.version, rt.spec.variant, rt.spec.precision, rt.spec.engine], 1
        )
    yield variant


def _edge_families(m: Metrics) -> Iterator:
    requests = CounterMetricFamily(
        P + "requests",
        "inference requests answered, by outcome",
        labels=["model", "version", "transport", "outcome"],
    )
    duration = HistogramMetricFamily(
        P + "request_duration_seconds",
        "time from receipt of a successful inference request to its encoded answer",
        labels=["model", "version", "transport"],
    )
    inflight = GaugeMetricFamily(
        P + "inflight_requests", "inference requests being served now", labels=["transport"]
    )
    served = [(rt.spec.name, rt.spec.version) for rt in m.plane.runtimes()]
    for t in m.transports.values():
        inflight.add_metric([t.name], t.inflight)
        for model, version in served:  # zero-valued from the start: a new server's panels read 0
            t._edge(model, version)
        for e in t.edges():
            requests.add_metric([e.model, e.version, t.name, "success"], e.success)
            for outcome, n in e.outcomes.items():
                requests.add_metric([e.model, e.version, t.name, outcome], n)
            duration.add_metric([e.model, e.version, t.name], e.latency.buckets(), e.latency.sum)
    yield from (requests, duration, inflight)


def _batch_families(m: Metrics) -> Iterator:
    """The BatchObservers' histograms."""
    fams = {
        "queue": HistogramMetricFamily(
            P + "queue_duration_seconds", "time a request waited in the scheduler before its batch ran", labels=MV
        ),
        "compute": HistogramMetricFamily(
            P + "compute_duration_seconds", "time one batch took in the worker (input + infer + output)", labels=MV
        ),
        "rows": HistogramMetricFamily(P + "batch_size_rows", "rows per executed batch", labels=MV),
        "tokens": HistogramMetricFamily(
            P + "batch_size_tokens", "rows x variable-length elements per executed batch (models with -1 dims)", labels=MV
        ),
        "padding": HistogramMetricFamily(
            P + "batch_padding_ratio", "share of a batch's computed elements that was padding (static-shape engines)",
            labels=MV,
        ),
    }  # fmt: skip
    for (name, ver), obs in m.observers.items():
        for attr, fam in fams.items():
            h: Histogram = getattr(obs, attr)
            if attr != "tokens" or obs.token_input is not None:  # tokens: models with -1 dims only
                fam.add_metric([name, ver], h.buckets(), h.sum)
    yield from fams.values()


def _scheduler_families(snaps) -> Iterator:
    """Each scheduler's statistics, queue depths and latency model, from its snapshot."""
    rows = CounterMetricFamily(P + "inference_rows", "rows inferred (Triton inference_count)", labels=MV)
    batches = CounterMetricFamily(P + "batches", "batches executed (Triton execution_count)", labels=MV)
    failed = CounterMetricFamily(
        P + "batch_failed_requests", "requests in batches that failed to execute", labels=MV
    )
    rejected = CounterMetricFamily(
        P + "queue_rejected", "requests refused because the queue was full", labels=MV
    )
    dropped = CounterMetricFamily(
        P + "queue_dropped", "requests whose caller left while queued (dropped before compute)", labels=MV
    )
    abandoned = CounterMetricFamily(
        P + "abandoned_rows",
        "rows dropped before compute because another part of their call had failed (e.g. expired)",
        labels=MV,
    )
    depth = GaugeMetricFamily(P + "queue_depth", "requests queued now", labels=["model", "version", "class"])
    sched_inflight = GaugeMetricFamily(
        P + "scheduler_inflight_requests",
        "requests accepted by the scheduler and not yet answered",
        labels=MV,
    )
    by_class = CounterMetricFamily(
        P + "class_requests",
        "requests that reached the scheduler, by latency class and outcome (success, late = answered after "
        "its deadline, shed, expired, rejected, failed)",
        labels=["model", "version", "class", "outcome"],
    )
    class_time = HistogramMetricFamily(
        P + "class_request_duration_seconds",
        "requests answered by the scheduler (in budget or late), by latency class: seconds from "
        "admission to the answer; a call of many rows counts each request it was queued as",
        labels=["model", "version", "class"],
    )
    shadow = CounterMetricFamily(
        P + "shed_shadow",
        "shed_at_admission off: calls the admission estimate would have refused, queued anyway, by "
        "whether they then made their deadline (verdict would_have_made_it = a false refusal avoided)",
        labels=["model", "version", "class", "verdict"],
    )
    ratio = GaugeMetricFamily(
        P + "admission_estimate_ratio",
        "the admission estimate checked against what happened: a call's real time from admission to "
        "its answer over the time predicted for it (stat mean and deviation, EWMA; samples: calls "
        "compared), for calls near enough to their deadline that the estimate was made; refusals use "
        "the low end, mean - 2 deviations",
        labels=["model", "version", "stat"],
    )
    est = GaugeMetricFamily(
        P + "batch_time_estimate_seconds",
        "the scheduler's latency model: recent compute time of one batch (EWMA), per shape bucket and "
        "batch-size class (batch_size = the largest size in the class: 1, 2, 4, 8, ...)",
        labels=["model", "version", "bucket", "batch_size"],
    )
    fit = GaugeMetricFamily(
        P + "batch_time_fit_seconds",
        "the scheduler's latency model: least-squares line of batch time = intercept + per_row x rows, "
        "per shape bucket",
        labels=["model", "version", "bucket", "term"],
    )
    for snap in snaps:
        lv = [snap.model, snap.version]
        sched = snap.scheduler
        st = sched.stats
        rows.add_metric(lv, st.inference_count)
        batches.add_metric(lv, st.execution_count)
        failed.add_metric(lv, st.fail_count)
        rejected.add_metric(lv, st.rejected_full)
        dropped.add_metric(lv, st.dropped)
        abandoned.add_metric(lv, st.abandoned_rows)
        # every class from the start, answered or not, so a new server's panels read 0
        for cls in {
            **dict.fromkeys(sched.queued_by_class),
            **dict.fromkeys(st.by_class),
            **dict.fromkeys(st.class_seconds),
        }:
            for outcome, n in ({"success": 0} | st.by_class.get(cls, {})).items():
                by_class.add_metric(lv + [cls, outcome], n)
            h = st.class_seconds.get(cls, _EMPTY)
            class_time.add_metric(lv + [cls], h.buckets(), h.sum)
        if sched.estimate_ratio is not None:
            n, mean, dev = sched.estimate_ratio
            ratio.add_metric(lv + ["samples"], n)
            ratio.add_metric(lv + ["mean"], mean)
            ratio.add_metric(lv + ["deviation"], dev)
        for cls, verdicts in st.shadow.items():
            for verdict, n in verdicts.items():
                shadow.add_metric(lv + [cls, verdict], n)
        for cls, n in sched.queued_by_class.items():
            depth.add_metric(lv + [cls], n)
        sched_inflight.add_metric(lv, sched.in_flight)
        for bucket, model in sched.latency.items():
            fit.add_metric(lv + [bucket, "intercept"], model["intercept_s"])
            fit.add_metric(lv + [bucket, "per_row"], model["per_row_s"])
            for size, figures in model["sizes"].items():
                est.add_metric(lv + [bucket, str(size)], figures["mean_s"])
    yield from (
        rows,
        batches,
        failed,
        rejected,
        dropped,
        abandoned,
        by_class,
        class_time,
        shadow,
        ratio,
        depth,
        sched_inflight,
        est,
        fit,
    )


def _worker_families(snaps) -> Iterator:
    busy = CounterMetricFamily(
        P + "worker_busy_seconds",
        "time a worker spent running batches",
        labels=["model", "version", "worker"],
    )
    workers = GaugeMetricFamily(P + "workers", "worker threads serving the model version", labels=MV)
    tokenized = CounterMetricFamily(
        P + "texts_tokenized", "texts a text model's tokenizer encoded (each text of a call once)", labels=MV
    )
    for snap in snaps:
        lv = [snap.model, snap.version]
        workers.add_metric(lv, len(snap.workers))
        if snap.tokenized is not None:
            tokenized.add_metric(lv, snap.tokenized)
        for name, busy_s in snap.workers:
            busy.add_metric(lv + [name], busy_s)
    # Per device and memory pool, over every model: buffers add up; the driver's figure is the
    # whole device's, the same from every model on it.
    memory: dict[tuple[str, str], int] = {}
    for snap in snaps:
        for device, pool, size in snap.memory:
            key = (device, pool)
            memory[key] = size if pool == "driver_used" else memory.get(key, 0) + size
    mem = GaugeMetricFamily(
        P + "device_memory_bytes",
        "bytes by device and memory pool: io_buffers (pooled batch buffers), pinned_host (a GPU's "
        "staging buffers), driver_used (the GPU's used memory as the driver reports it)",
        labels=["device", "pool"],
    )
    for (device, pool), size in sorted(memory.items()):
        mem.add_metric([device, pool], size)
    yield from (busy, workers, tokenized, mem)


def _overload_families(m: Metrics) -> Iterator:
    if m.overload is None:
        return
    gate, door = m.overload
    refused = CounterMetricFamily(
        P + "overload_refused",
        "new calls refused UNAVAILABLE by the overload gate: at the door (by a gRPC call taker, before "
        "any handler) or in the pipeline (before decoding)",
        labels=["where"],
    )
    at_door = door.refused if door is not None else 0
    refused.add_metric(["door"], at_door)
    refused.add_metric(["pipeline"], gate.refused - at_door)
    yield refused
    admit = GaugeMetricFamily(P + "overload_admitted_ratio", "share of new calls the overload gate takes now")
    admit.add_metric([], gate.admit)
    yield admit


def _loop_lag_family(plane) -> GaugeMetricFamily:
    lag = GaugeMetricFamily(
        P + "event_loop_lag_seconds",
        "how late the event loop runs timers (EWMA + 2 deviations); kept free before every deadline",
    )
    lag.add_metric([], plane.lag.s)
    return lag


def _cache_families(plane) -> Iterator:
    """The result cache (absent until the cache is configured)."""
    lookups = CounterMetricFamily(
        P + "cache_lookups",
        "result cache lookups in rows, by tier and result (hit, miss); tier none: the model has no cache (0)",
        labels=["model", "version", "tier", "result"],
    )
    other = GaugeMetricFamily(
        P + "cache_stat",
        "other figures the cache reports (entries, bytes, evictions, breaker state ...)",
        labels=["model", "version", "tier", "stat"],
    )
    for model, version, cache in _caches(plane):
        try:
            tiers = _cache_tiers(cache.stats())
        except Exception:  # a scrape must not fail because the cache could not say
            log.debug("cache stats() failed", exc_info=True)
            continue
        for tier, figures in tiers.items():
            for key, result in (("hits", "hit"), ("misses", "miss")):  # both from the start
                lookups.add_metric([model, version, tier, result], figures.get(key, 0))
            for key, value in figures.items():
                if (
                    key in ("hits", "misses")
                    or isinstance(value, bool)
                    or not isinstance(value, (int, float))
                ):
                    continue  # e.g. breaker_state "closed": its numeric twin is exported
                other.add_metric([model, version, tier, str(key)], value)
    for rt in plane.runtimes():
        if rt.cache is None:  # tier "none": a model without a result cache looks nothing up
            for result in ("hit", "miss"):
                lookups.add_metric([rt.spec.name, rt.spec.version, "none", result], 0)
    yield lookups
    yield other
