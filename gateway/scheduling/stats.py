"""A scheduler's statistics (Triton's ModelStatistics semantics) and the public snapshot metrics
and the statistics endpoints read; nothing outside the scheduler reads its private state.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field

from batchgate.gateway.histogram import LATENCY_BUCKETS, Histogram


@dataclass(slots=True)
class BatchStats:
    count: int = 0
    input_ns: int = 0
    infer_ns: int = 0
    output_ns: int = 0


@dataclass(slots=True)
class Stats:
    """Triton's ModelStatistics semantics; updated on the event loop only."""

    last_inference_ms: int = 0
    inference_count: int = 0  # rows inferred
    execution_count: int = 0  # batches executed
    success_count: int = 0
    success_ns: int = 0
    fail_count: int = 0
    fail_ns: int = 0
    queue_count: int = 0
    queue_ns: int = 0
    input_count: int = 0
    input_ns: int = 0
    infer_count: int = 0
    infer_ns: int = 0
    output_count: int = 0
    output_ns: int = 0
    dropped: int = 0  # callers that cancelled before compute
    rejected_full: int = 0
    shed: int = 0  # refused at admission: the deadline was out of reach
    expired: int = 0  # dropped from the queue before compute: the deadline passed
    abandoned_rows: int = 0  # rows dropped before compute: another part of their call had failed
    retries: int = 0  # sub-batches run again after their batch failed (split_failures)
    by_batch_size: dict[int, BatchStats] = field(default_factory=dict)
    # latency class -> outcome -> count (success, shed, expired, rejected, failed)
    by_class: dict[str, dict[str, int]] = field(default_factory=dict)
    # latency class -> seconds from the scheduler's admission to the answer, answered requests
    # (in budget or late): the p50/p99 by class an operator watches against the class's budget
    class_seconds: dict[str, Histogram] = field(default_factory=dict)
    # shedding off (shed_at_admission: false): latency class -> calls the estimate would have
    # refused -> whether each made its deadline (would_have_made_it) or not (missed)
    shadow: dict[str, dict[str, int]] = field(default_factory=dict)
    # Called once per executed batch as observer(batch, start, rows, timing): the metrics'
    # histograms (gateway/metrics.py BatchObserver); None costs one test per batch.
    observer: Callable | None = None

    def count_class(self, cls: str, outcome: str, n: int = 1) -> None:
        d = self.by_class.get(cls)
        if d is None:
            d = self.by_class[cls] = {}
        d[outcome] = d.get(outcome, 0) + n

    def time_class(self, cls: str, seconds: float) -> None:
        h = self.class_seconds.get(cls)
        if h is None:
            h = self.class_seconds[cls] = Histogram(LATENCY_BUCKETS)
        h.observe(seconds)


@dataclass(frozen=True, slots=True)
class SchedulerSnapshot:
    """What one scheduler holds at one moment, for metrics (read on the event loop)."""

    stats: Stats  # the live counters (not copied: metrics only read them)
    in_flight: int  # calls accepted and not yet answered
    queued: int  # requests queued
    queued_by_class: dict[str, int]  # latency class -> requests queued (deadline policy only)
    busy_slots: int  # worker slots running a batch
    slots: int
    latency: dict[str, dict]  # LatencyModel.snapshot(): bucket -> fit
    # admission predictions against the calls' real times: (samples, mean ratio, mean |deviation|);
    # None for a policy that predicts nothing
    estimate_ratio: tuple[int, float, float] | None = None


class CallCost:
    """What the scheduler saw of one call (set per call by the pipeline, filled by the scheduler on
    the call's own task): rows computed and their share of the batches' compute time."""

    __slots__ = ("compute_s", "computed", "rows")

    def __init__(self) -> None:
        self.rows = 0  # the call's rows (set by the pipeline)
        self.computed = 0
        self.compute_s = 0.0


COST: ContextVar[CallCost | None] = ContextVar("batchgate_call_cost", default=None)
