"""The dynamic batcher: one scheduler per served model version.

Two layers, so the policy can be tested without sockets, threads or real time:

* the queues (``gateway/queues.py``: ``FifoQueue``, alias ``BatchQueue``, and ``DeadlineQueue``)
  are pure state machines: ``push`` adds a request, ``pop_batch(now, idle)`` returns the batch that
  should leave at ``now`` (or None), ``take_expired``/``next_wakeup`` say what is hopeless and
  when to ask again.
* ``Scheduler`` drives it on the event loop. It is the single owner of the queue: requests are
  pushed from handlers on the same loop, and one task forms batches and hands them to the
  worker pool; completions come back through ``call_soon_threadsafe``. A batch is only formed
  when a worker slot is free, so under load requests accumulate and batches grow by themselves.

When batches leave is the queue's policy (docs/scheduling.md). Rows are merged only when every
input's non-batch dims agree, up to the engine's shape bucket (the request's ``key``).

With ``split_failures`` an engine error on a batch of several requests is not final: the batch is
split in two halves that run again (ahead of the queue, each in a slot of its own), recursively,
so a request that makes the engine fail (a poisoned row) fails alone and the rest are answered.
A ``GatewayError`` (the engine's own verdict, e.g. cancellation) is final and never retried.
"""

from __future__ import annotations

import asyncio
import logging
import time
import math
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from batchgate.gateway.budgets import Budget
from batchgate.gateway.errors import GatewayError, Kind, unavailable
from batchgate.gateway.latency import LatencyModel
from batchgate.gateway.queues import DeadlineQueue, FifoQueue, Request

__all__ = ["BatchQueue", "DeadlineQueue", "FifoQueue", "Request", "Scheduler", "Stats"]

log = logging.getLogger(__name__)

Execute = Callable[[list[dict[str, np.ndarray]], list[int], bool], Future]

# The FIFO queue was born here; tests and callers still import it by its first name.
BatchQueue = FifoQueue
Queue = FifoQueue | DeadlineQueue


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
    retries: int = 0  # sub-batches run again after their batch failed (split_failures)
    by_batch_size: dict[int, BatchStats] = field(default_factory=dict)
    # latency class -> outcome -> count (success, shed, expired, rejected, failed)
    by_class: dict[str, dict[str, int]] = field(default_factory=dict)
    # Called once per executed batch as observer(batch, start, rows, timing): the metrics'
    # histograms (gateway/metrics.py BatchObserver); None costs one test per batch.
    observer: Callable | None = None

    def count_class(self, cls: str, outcome: str, n: int = 1) -> None:
        d = self.by_class.get(cls)
        if d is None:
            d = self.by_class[cls] = {}
        d[outcome] = d.get(outcome, 0) + n


class Scheduler:
    def __init__(
        self,
        name: str,
        queue: Queue,
        execute: Execute,
        slots: int,
        batched: bool = True,
        clock: Callable[[], float] = time.monotonic,
        latency: LatencyModel | None = None,
        shed: bool | None = None,
        split_failures: bool = False,
    ) -> None:
        self.name = name
        self.queue = queue
        self.latency = latency or getattr(queue, "latency", None) or LatencyModel()
        # Shedding at admission belongs to the deadline policy; FIFO (Triton-like) never sheds.
        self.shed = isinstance(queue, DeadlineQueue) if shed is None else shed
        self._running: dict[int, tuple[float, float]] = {}  # batch id -> (start, estimated seconds)
        self.execute = execute
        self.batched = batched
        self.clock = clock
        self.stats = Stats()
        self._slots = slots
        self._free = slots
        self._wakeup: asyncio.Future | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Task | None = None
        self._closing = False
        self._in_flight = 0  # requests accepted and not yet answered
        self._idle = asyncio.Event()
        self._idle.set()
        self.split_failures = split_failures
        # Halves of failed batches, run before anything new: these callers have waited longest.
        self._retry: deque[list[Request]] = deque()

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._run(), name=f"batcher-{self.name}")

    async def drain(self, timeout_s: float | None = None) -> bool:
        """Refuse new requests and wait until every accepted one is answered."""
        self._closing = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except TimeoutError:
            return False

    async def close(self) -> None:
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except BaseException:  # cancelled, or the batcher had died (already logged)
                pass
        self._fail_queued(unavailable(f"model '{self.name}' is shutting down"))

    # -- request side ---------------------------------------------------------------------------

    async def infer(
        self, inputs: dict[str, np.ndarray], rows: int, key: Hashable, budget: Budget | None = None
    ) -> dict[str, np.ndarray]:
        if self._closing:
            raise unavailable(f"model '{self.name}' is draining; retry on another replica")
        loop = asyncio.get_running_loop()
        now = self.clock()
        if budget is None:
            req = Request(inputs, rows, key, now, loop.create_future())
        else:
            req = Request(
                inputs, rows, key, now, loop.create_future(),
                budget.deadline, budget.cls, budget.level, budget.queue_deadline, budget.delay,
            )  # fmt: skip
        if self.shed and req.cls is not None:
            self._admit_or_shed(req, now)
        if not self.queue.push(req):
            self.stats.rejected_full += 1
            if req.cls is not None:
                self.stats.count_class(req.class_name, "rejected")
            if isinstance(self.queue, DeadlineQueue):
                where = f"queue for latency class '{req.class_name}' is full ({req.cls.max_queue} requests"
                if self.queue.level_queue_sizes.get(req.level):
                    where += f", or priority level {req.level} reached max_queue_size"
                where += ")"
            else:
                where = f"queue is full (max_queue_size={self.queue.max_queue_size})"
            raise unavailable(f"model '{self.name}' {where}; retry later")
        self._in_flight += 1
        self._idle.clear()
        self._wake()
        try:
            # If our caller is cancelled, awaiting cancels req.future too; the batcher then
            # skips the request when it forms the next batch (counted as dropped).
            return await req.future
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()

    def _admit_or_shed(self, req: Request, now: float) -> None:
        """Refuse at once a request whose deadline is out of reach given the work ahead of it."""
        if req.deadline == math.inf or not self.latency.confident_model():
            return  # no estimate worth refusing work on yet: admit, the queue still expires it
        ahead = self.queue.work_ahead_s(req)
        if self._free == 0:  # every worker is busy: add what the running batches still have to do
            ahead += sum(max(start + est - now, 0.0) for start, est in self._running.values())
        wait = ahead / self._slots
        # A bucket that has not run enough yet counts no compute of its own (never over-refuse).
        own = self.latency.estimate_hi(req.key, req.rows) if self.latency.confident(req.key) else 0.0
        if now + wait + own + self.queue.lag_margin() > self.queue.due(req):
            self.stats.fail_count += 1  # Triton counts refused requests as failed
            self.stats.shed += 1
            self.stats.count_class(req.class_name, "shed")
            budget_ms = (req.deadline - now) * 1e3
            raise GatewayError(
                Kind.DEADLINE,
                f"model '{self.name}': the request's budget of {budget_ms:.1f} ms cannot be met "
                f"(estimated {wait * 1e3:.1f} ms of queued work ahead plus {own * 1e3:.1f} ms compute); "
                "shed before queueing",
                outcome="shed",
            )

    def _wake(self) -> None:
        w = self._wakeup
        if w is not None and not w.done():
            w.set_result(None)

    # -- batcher task ---------------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            queue = self.queue
            while True:
                now = self.clock()
                for r in queue.take_expired(now):
                    self._expire(r, now)
                if self._free == 0:
                    await self._wait(queue.next_wakeup(now) if self.shed else None)
                    continue
                if self._retry:
                    self._dispatch_retry(self._retry.popleft(), now)
                    continue
                batch = queue.pop_batch(now, self._free == self._slots)
                self.stats.dropped = queue.dropped
                if batch is None:
                    await self._wait(queue.next_wakeup(now))
                    continue
                self._dispatch(batch)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # a bug here must not leave callers hanging
            log.exception("batcher for %s died", self.name)
            self._closing = True  # later callers get UNAVAILABLE instead of waiting forever
            self._fail_queued(GatewayError(Kind.FAILED, f"model '{self.name}' scheduler failed: {exc}"))
            raise

    async def _wait(self, deadline: float | None) -> None:
        """Sleep until pushed to, a slot frees, or ``deadline`` (clock time) passes."""
        self._wakeup = self._loop.create_future()
        if deadline is not None:
            # Never return without yielding: the queue can report a wake-up already past that
            # take_expired/pop_batch do not act on (next_wakeup counts a not-yet-confident
            # estimate, take_expired does not), and returning at once spun _run without ever
            # letting the loop deliver the completions that free a slot (bench/soak.py: 15 s
            # stalls until the callers' deadlines expired them). A past wake-up waits 1 ms.
            delay = max(deadline - self.clock(), 0.001)
            self._timer = self._loop.call_later(delay, self._wake)
        try:
            await self._wakeup
        finally:
            self._wakeup = None
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    def _expire(self, r: Request, now: float) -> None:
        self.stats.fail_count += 1
        self.stats.fail_ns += int((now - r.arrival) * 1e9)
        self.stats.expired += 1
        self.stats.count_class(r.class_name, "expired")
        if r.future.done():
            return
        left_ms = (r.deadline - now) * 1e3
        if left_ms <= 0:
            why = f"its deadline passed {-left_ms:.1f} ms ago"
        elif now >= r.queue_deadline:
            why = "its queue timeout (Triton 'timeout' / default_timeout_microseconds) passed"
        else:
            est_ms = self.latency.estimate_hi(r.key, r.rows) * 1e3
            why = f"{left_ms:.1f} ms were left, less than the estimated {est_ms:.1f} ms compute"
        r.future.set_exception(
            GatewayError(
                Kind.DEADLINE,
                f"model '{self.name}': dropped from the queue before compute: {why} "
                f"(waited {(now - r.arrival) * 1e3:.1f} ms)",
                outcome="expired",
            )
        )

    def _dispatch_retry(self, batch: list[Request], now: float) -> None:
        live = []
        for r in batch:
            if r.future.done():  # the caller left while its batch was failing
                continue
            if now >= r.deadline:
                self._expire(r, now)
            else:
                live.append(r)
        if live:
            self.stats.retries += 1
            self._dispatch(live, retry=True)

    def _dispatch(self, batch: list[Request], retry: bool = False) -> None:
        self._free -= 1
        start = self.clock()
        rows = [r.rows for r in batch]
        est = self.latency.estimate_hi(batch[0].key, sum(rows))
        self._running[id(batch)] = (start, est)
        try:
            fut = self.execute([r.inputs for r in batch], rows, self.batched)
        except BaseException as exc:
            # Refused before it ran (e.g. the pool is closed): not the rows' fault, never split.
            if not isinstance(exc, GatewayError):
                exc = GatewayError(Kind.FAILED, f"model '{self.name}' failed to execute a batch of {sum(rows)} rows: {exc}")
            self._complete(batch, start, None, exc, retry)
            return
        loop = self._loop
        fut.add_done_callback(lambda f: loop.call_soon_threadsafe(self._on_done, batch, start, f, retry))

    def _on_done(self, batch: list[Request], start: float, fut: Future, retry: bool = False) -> None:
        if fut.cancelled():
            exc: BaseException | None = GatewayError(Kind.FAILED, f"model '{self.name}': the batch was cancelled")
        else:
            exc = fut.exception()
        result = None if exc else fut.result()
        if result is not None and len(result[0]) != len(batch):
            exc = GatewayError(
                Kind.FAILED, f"model '{self.name}': engine returned {len(result[0])} outputs for {len(batch)} requests"
            )
        self._complete(batch, start, None if exc else result, exc, retry)

    def _complete(
        self, batch: list[Request], start: float, result, exc: BaseException | None, retry: bool = False
    ) -> None:
        """``retry``: the batch is a half of a failed one (its queue time was counted then)."""
        self._free += 1
        self._running.pop(id(batch), None)
        self._wake()
        now = self.clock()
        st = self.stats
        n_rows = sum(r.rows for r in batch)
        if not retry:
            for r in batch:
                st.queue_count += 1
                st.queue_ns += int((start - r.arrival) * 1e9)
        if exc is not None:
            if self.split_failures and len(batch) > 1 and not isinstance(exc, GatewayError):
                # Bisect: whichever half fails is split again, down to single requests. The
                # halves go first in line; the batcher loop dispatches them as slots free up.
                mid = len(batch) // 2
                self._retry.extend((batch[:mid], batch[mid:]))
                log.warning(
                    "batch of %d requests (%d rows) failed on %s: %s; running it again as %d + %d requests "
                    "to isolate the failing one", len(batch), n_rows, self.name, exc, mid, len(batch) - mid,
                )  # fmt: skip
                return
            if isinstance(exc, GatewayError):
                err = exc
            elif retry and len(batch) == 1:
                err = GatewayError(
                    Kind.FAILED,
                    f"model '{self.name}' failed to execute this request ({n_rows} rows; run alone after "
                    f"the batch it was in failed, the other requests were answered): {exc}",
                )
            else:
                err = GatewayError(Kind.FAILED, f"model '{self.name}' failed to execute a batch of {n_rows} rows: {exc}")
            log.warning("batch of %d rows failed on %s: %s", n_rows, self.name, exc)
            for r in batch:
                if r.cls is not None:
                    st.count_class(r.class_name, "failed")
                st.fail_count += 1
                st.fail_ns += int((now - r.arrival) * 1e9)
                if not r.future.done():
                    r.future.set_exception(err)
            return
        outputs, timing = result
        self.latency.observe(batch[0].key, n_rows, (timing.input_ns + timing.infer_ns + timing.output_ns) / 1e9)
        st.execution_count += 1
        st.inference_count += n_rows
        st.last_inference_ms = int(time.time() * 1000)
        for name, value in (("input", timing.input_ns), ("infer", timing.infer_ns), ("output", timing.output_ns)):
            setattr(st, f"{name}_count", getattr(st, f"{name}_count") + len(batch))
            setattr(st, f"{name}_ns", getattr(st, f"{name}_ns") + value * len(batch))
        bs = st.by_batch_size.get(n_rows)
        if bs is None:
            bs = st.by_batch_size[n_rows] = BatchStats()
        bs.count += 1
        bs.input_ns += timing.input_ns
        bs.infer_ns += timing.infer_ns
        bs.output_ns += timing.output_ns
        if st.observer is not None:
            st.observer(batch, start, n_rows, timing)
        for r, out in zip(batch, outputs):
            if r.cls is not None:
                st.count_class(r.class_name, "success" if now <= r.deadline else "late")
            st.success_count += 1
            st.success_ns += int((now - r.arrival) * 1e9)
            if not r.future.done():
                r.future.set_result(out)

    def _fail_queued(self, err: GatewayError) -> None:
        while self._retry:
            for r in self._retry.popleft():
                if not r.future.done():
                    r.future.set_exception(err)
        for r in self.queue.drain_all():
            if not r.future.done():
                r.future.set_exception(err)
