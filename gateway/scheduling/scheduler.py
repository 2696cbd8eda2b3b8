"""The dynamic batcher: one scheduler per served model version, its one batcher task.

Two layers, so the policy can be tested without sockets, threads or real time:

* the queue (``interface.Queue``: ``deadline.DeadlineQueue`` or ``fifo.FifoQueue``, built by
  ``interface.make_queue``) is a pure state machine that owns every decision about its requests;
* ``Scheduler`` drives it on the event loop. It is the single owner of the queue: requests are
  pushed from handlers on the same loop, and one task forms batches and hands them to the
  worker pool; completions come back through ``call_soon_threadsafe``. A batch is only formed
  when a worker slot is free, so under load requests accumulate and batches grow by themselves.
  The task sleeps until a push, a freed slot, or the wake-up time the queue returned with its
  last answer: it never polls.

A call is one or more requests (``submit``): the rows of a call that fall in different shape
buckets (texts of mixed lengths) are queued apart, each batching with other callers' rows of its
bucket, and the call is answered when its last request is done. Admission is decided once per
call, before anything is queued: a refused call leaves nothing behind. When one request of a call
fails (its deadline passed part-way), the call's other requests are dropped before compute.

With ``split_failures`` an engine error on a batch of several requests is not final: the batch is
split in two halves that run again (ahead of the queue, each in a slot of its own), recursively,
so a request that makes the engine fail (a poisoned row) fails alone and the rest are answered.
A ``GatewayError`` (the engine's own verdict, e.g. cancellation) is final and never retried.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future

import numpy as np
from batchgate.gateway import tracing
from batchgate.gateway.errors import GatewayError, Kind, unavailable
from batchgate.gateway.scheduling.interface import Queue
from batchgate.gateway.scheduling.latency import LatencyModel
from batchgate.gateway.scheduling.request import Budget, Request
from batchgate.gateway.scheduling.stats import COST, BatchStats, SchedulerSnapshot, Stats

__all__ = ["Part", "Scheduler"]

log = logging.getLogger(__name__)

# (parts, rows, batched[, outputs]): outputs, the names to fetch, is passed only when a request of
# the batch asked for other outputs than the model's defaults.
Execute = Callable[..., Future]
Part = tuple[dict[str, np.ndarray], int, Hashable]  # (inputs, rows, shape bucket) of one request


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
        split_failures: bool = False,
        default_outputs: tuple[str, ...] = (),
    ) -> None:
        self.name = name
        self.default_outputs = default_outputs  # what a request with ``outputs`` None reads
        self.queue = queue
        self._spans: dict[int, tuple] = {}  # batch -> its spans, while tracing is on
        self.latency = latency or getattr(queue, "latency", None) or LatencyModel()
        self._running: dict[int, tuple[float, float]] = {}  # batch id -> (start, estimated seconds)
        self.execute = execute
        self.batched = batched
        self.clock = clock
        self.stats = Stats()
        self._slots = slots
        self._free = slots
        self._wakeup: asyncio.Future | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._wait_at: float | None = None  # when the waiting batcher's timer fires (None: no timer)
        # A queue that can say when just-pushed requests need the batcher lets a push that
        # arrives while every slot is busy leave it asleep (one task step and timer less a call).
        self._wake_at = getattr(queue, "wake_at", None)
        self._task: asyncio.Task | None = None
        self._closing = False
        self._in_flight = 0  # calls accepted and not yet answered
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

    def snapshot(self) -> SchedulerSnapshot:
        return SchedulerSnapshot(
            stats=self.stats,
            in_flight=self._in_flight,
            queued=self.queue.size,
            queued_by_class=self.queue.depth_by_class(),
            busy_slots=self._slots - self._free,
            slots=self._slots,
            latency=self.latency.snapshot(),
            estimate_ratio=self.queue.ratio(),
        )

    # -- request side ---------------------------------------------------------------------------

    async def submit(
        self, parts: list[Part], budget: Budget | None = None, outputs: tuple[str, ...] | None = None
    ) -> list[dict[str, np.ndarray]]:
        """Admit one call of one or more parts (rows of one bucket each; most calls are one part),
        queue them, and return their outputs in order once the last is done. ``outputs``: the
        names the call reads when not the model's defaults (None). Raises DEADLINE_EXCEEDED
        (refused: nothing queued, with a retry hint), UNAVAILABLE (queue full or draining), or a
        part's failure."""
        if self._closing:
            raise unavailable(f"model '{self.name}' is draining; retry on another replica")
        loop = asyncio.get_running_loop()
        now = self.clock()
        if budget is None:
            reqs = [Request(inputs, rows, key, now, loop.create_future()) for inputs, rows, key in parts]
        else:
            reqs = [
                Request(
                    inputs,
                    rows,
                    key,
                    now,
                    loop.create_future(),
                    budget.deadline,
                    budget.cls,
                    budget.level,
                    budget.queue_deadline,
                    budget.delay,
                )  # fmt: skip
                for inputs, rows, key in parts
            ]
            if budget.soft:
                for r in reqs:
                    r.soft = True
        if outputs is not None:
            for r in reqs:
                r.outputs = outputs
        first = reqs[0]
        if tracing.TRACER is not None:
            trace = tracing.current()
            for r in reqs:
                r.trace = trace
        predicted_miss = self._admit(reqs, first, now)
        prediction = self.queue.prediction  # set by the admission test of this call, if it made one
        sound = getattr(self.queue, "prediction_sound", True)  # ... and whether it may calibrate
        try:
            if len(reqs) == 1:
                # If our caller is cancelled, awaiting cancels req.future too; the batcher then
                # skips the request when it forms the next batch (counted as dropped).
                out = [await first.future]
            else:
                for r in reqs:
                    r.call = reqs
                out = await self._gather(reqs, loop)
            if prediction is not None:
                self._judge(first, now, prediction, predicted_miss, sound=sound)
            if (cost := COST.get()) is not None:
                cost.computed += sum(r.rows for r in reqs)
                cost.compute_s += sum(r.compute_s for r in reqs)
            return out
        except (GatewayError, asyncio.CancelledError) as exc:
            if prediction is not None:
                self._judge(first, now, prediction, predicted_miss, exc, sound)
            raise
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()

    def _admit(self, reqs: list[Request], first: Request, now: float) -> bool:
        """Refuse the call (shed, queue full) or queue all its requests and count it in flight.
        True: the estimate would have refused it, but shedding is off (the shadow check)."""
        predicted_miss = False
        if first.cls is not None:
            refusal = self.queue.refuse(reqs, now, self._running_s(now), self._slots)
            if refusal is not None:
                if self.queue.shed:
                    raise self._shed(first, refusal, now)
                predicted_miss = True
        if not self.queue.push(reqs):
            self.stats.rejected_full += 1
            if first.cls is not None:
                self.stats.count_class(first.class_name, "rejected")
            drain = self.queue.drain_s(first, self._slots)
            raise unavailable(
                f"model '{self.name}' {self.queue.full_reason(first)}; retry later", retry_after_s=drain
            )
        self._in_flight += 1
        if self._in_flight == 1:
            self._idle.clear()
        if self._free or self._wake_at is None:
            self._wake()
            return predicted_miss
        # Every slot is busy: a freed slot wakes the batcher anyway; it needs waking now only if
        # one of these requests may expire before the wake-up it already has.
        at = self._wake_at(reqs)
        if at is not None and (self._wait_at is None or at < self._wait_at):
            self._wake()
        return predicted_miss

    def _judge(
        self, first: Request, admitted_at: float, prediction: float, predicted_miss: bool,
        exc: BaseException | None = None, sound: bool = True,
    ) -> None:  # fmt: skip
        """A call admitted with a prediction has ended (``exc``: how it failed): its real time
        calibrates the queue's estimate, and with shedding off the shadow check counts whether a
        call the estimate would have refused made its deadline. One that expired, or whose caller
        gave up (its deadline, usually), took at least until its deadline: a censored sample, but
        without it a spike whose admitted calls all expire would never calibrate."""
        if exc is None:
            end = self.clock()
            made_it = end <= first.deadline
        elif isinstance(exc, asyncio.CancelledError) or exc.kind is Kind.DEADLINE:
            end = max(self.clock(), first.deadline)
            made_it = False
        else:
            return  # a failure that says nothing of time
        if sound:  # (a prediction from buckets still warming up would skew later ones)
            self.queue.calibrate(prediction, end - admitted_at)
        if predicted_miss:
            self._shadow(first, made_it)

    def _shadow(self, first: Request, made_it: bool) -> None:
        """A call the estimate would have refused, queued anyway (shedding off): did it make its
        deadline? ``would_have_made_it`` counts the refusals that shedding would have got wrong."""
        by = self.stats.shadow.get(first.class_name)
        if by is None:
            by = self.stats.shadow[first.class_name] = {"would_have_made_it": 0, "missed": 0}
        by["would_have_made_it" if made_it else "missed"] += 1

    async def _gather(
        self, reqs: list[Request], loop: asyncio.AbstractEventLoop
    ) -> list[dict[str, np.ndarray]]:
        """The outputs of a call's requests in order; the first failure fails the call and drops
        the requests not yet computed (their futures cancelled: the queue skips them)."""
        call = loop.create_future()
        left = [len(reqs)]

        def part_done(f: asyncio.Future) -> None:
            if call.done() or f.cancelled():
                return
            exc = f.exception()
            if exc is None:
                left[0] -= 1
                if left[0] == 0:
                    call.set_result(None)
                return
            call.set_exception(exc)
            self._abandon(reqs)

        for r in reqs:
            r.future.add_done_callback(part_done)
        try:
            await call
        except asyncio.CancelledError:
            self._abandon(reqs)
            raise
        return [r.future.result() for r in reqs]

    def _fail(self, r: Request, err: BaseException) -> None:
        """Answer ``r`` with ``err``; the rest of its call is dropped at once, before the batcher
        forms its next batch (a done-callback would run only after it)."""
        if not r.future.done():
            r.future.set_exception(err)
        if r.call is not None:
            self._abandon(r.call)

    def _abandon(self, reqs: list[Request]) -> None:
        """Drop a failed or cancelled call's requests that have not been answered: nobody reads
        their rows, so none of them is computed (counted in ``abandoned_rows``)."""
        for r in reqs:
            if not r.future.done():
                self.stats.abandoned_rows += r.rows
                r.future.cancel()

    def _running_s(self, now: float) -> float:
        """What the running batches still have to do, when every slot is busy (else 0: a free
        slot starts the call's work at once)."""
        if self._free:
            return 0.0
        return sum(max(start + est - now, 0.0) for start, est in self._running.values())

    def backlog_s(self) -> float | None:
        """How long a call queued now would wait before its own compute, as the queue estimates
        it: everything queued (every class) and what the running batches have left, per worker
        slot; None when the queue keeps no estimate. Read by the overload gate once a look
        (``LoadShedder.vouch_s``)."""
        backlog = getattr(self.queue, "backlog_s", None)
        queued = backlog(self.clock()) if backlog is not None else (None if self.queue.size else 0.0)
        if queued is None:
            return None
        return (queued + self._running_s(self.clock())) / max(self._slots, 1)

    def _shed(self, req: Request, refusal, now: float) -> GatewayError:
        self.stats.fail_count += 1  # Triton counts refused requests as failed
        self.stats.shed += 1
        self.stats.count_class(req.class_name, "shed")
        budget_ms = (req.deadline - now) * 1e3
        if refusal.alone or refusal.own_s * 1e3 >= budget_ms:  # waiting cannot help: no retry hint
            return GatewayError(
                Kind.DEADLINE,
                f"model '{self.name}': the request's budget ({budget_ms:.1f} ms left) is below its own "
                f"compute (estimated {refusal.own_s * 1e3:.1f} ms) and the time kept for the network and "
                "the event loop: not even an idle server could meet it; send a larger budget",
                # its own compute alone past the whole budget: the caller's budget, not the load
                # (the overload gate does not count it, gateway/admission/gate.py ``wasted``)
                outcome="impossible" if refusal.own_s * 1e3 >= budget_ms else "shed",
            )  # fmt: skip
        return GatewayError(
            Kind.DEADLINE,
            f"model '{self.name}': the request's budget of {budget_ms:.1f} ms cannot be met "
            f"(estimated {refusal.wait_s * 1e3:.1f} ms of queued work ahead plus {refusal.own_s * 1e3:.1f} ms "
            f"compute); shed before queueing, retry in {refusal.retry_after_s * 1e3:.0f} ms",
            outcome="shed",
            retry_after_s=refusal.retry_after_s,
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
                expired, expiry_at = queue.take_expired(now)
                for r in expired:
                    self._expire(r, now)
                if self._free == 0:  # a freed slot wakes us; meanwhile only expiry needs a timer
                    await self._wait(expiry_at)
                    continue
                if self._retry:
                    self._dispatch_retry(self._retry.popleft(), now)
                    continue
                batch, close_at = queue.pop_batch(now, self._free == self._slots)
                self.stats.dropped = queue.dropped
                if batch is None:
                    await self._wait(close_at if expiry_at is None else min(expiry_at, close_at or expiry_at))
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
        """Sleep until pushed to, a slot frees, or ``deadline`` (clock time) passes. The queue's
        wake-up times come from the same tests that act on them, so a timer never fires on a
        moment with nothing to do; one at or before now still yields to the loop once."""
        self._wakeup = self._loop.create_future()
        self._wait_at = deadline
        if deadline is not None:
            self._timer = self._loop.call_later(max(deadline - self.clock(), 0.0), self._wake)
        try:
            await self._wakeup
        finally:
            self._wakeup = None
            self._wait_at = None
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
            lag = getattr(self.queue, "lag_expected", None)  # only the deadline queue expires early
            lag_ms = lag() * 1e3 if lag else 0.0
            margin_ms = (r.deadline - self.queue.due(r)) * 1e3 if hasattr(self.queue, "due") else 0.0
            why = (
                f"{left_ms:.1f} ms were left, less than the estimated {est_ms:.1f} ms compute, "
                f"{lag_ms:.1f} ms of event-loop lag and the {margin_ms:.1f} ms margin"
            )
        self._fail(
            r,
            GatewayError(
                Kind.DEADLINE,
                f"model '{self.name}': dropped from the queue before compute: {why} "
                f"(waited {(now - r.arrival) * 1e3:.1f} ms)",
                outcome="expired",
            ),
        )

    def _dispatch_retry(self, batch: list[Request], now: float) -> None:
        live = []
        for r in batch:
            if r.future.done():  # the caller left while its batch was failing
                continue
            if now >= r.deadline and not r.soft:
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
        if tracing.TRACER is not None:
            tracing.queue_spans(batch, start)
            self._spans[id(batch)] = tracing.batch_span(batch, start, self.name)
        try:
            inputs = [r.inputs for r in batch]
            outputs = self._outputs(batch)
            if outputs is None:  # every request reads the defaults: the engine's own list
                fut = self.execute(inputs, rows, self.batched)
            else:
                fut = self.execute(inputs, rows, self.batched, outputs)
        except BaseException as exc:
            # Refused before it ran (e.g. the pool is closed): not the rows' fault, never split.
            if not isinstance(exc, GatewayError):
                exc = GatewayError(
                    Kind.FAILED, f"model '{self.name}' failed to execute a batch of {sum(rows)} rows: {exc}"
                )
            self._complete(batch, start, None, exc, retry)
            return
        loop = self._loop
        fut.add_done_callback(lambda f: loop.call_soon_threadsafe(self._on_done, batch, start, f, retry))

    def _outputs(self, batch: list[Request]) -> tuple[str, ...] | None:
        """The union of the batch's requests' outputs, in first-asked order; None when every
        request reads the model's defaults."""
        if all(r.outputs is None for r in batch):
            return None
        names: list[str] = []
        for r in batch:
            for n in self.default_outputs if r.outputs is None else r.outputs:
                if n not in names:
                    names.append(n)
        return tuple(names)

    def _on_done(self, batch: list[Request], start: float, fut: Future, retry: bool = False) -> None:
        if fut.cancelled():
            exc: BaseException | None = GatewayError(
                Kind.FAILED, f"model '{self.name}': the batch was cancelled"
            )
        else:
            exc = fut.exception()
        result = None if exc else fut.result()
        if result is not None and len(result[0]) != len(batch):
            exc = GatewayError(
                Kind.FAILED,
                f"model '{self.name}': engine returned {len(result[0])} outputs for {len(batch)} requests",
            )
        self._complete(batch, start, None if exc else result, exc, retry)

    def _complete(
        self, batch: list[Request], start: float, result, exc: BaseException | None, retry: bool = False
    ) -> None:
        """``retry``: the batch is a half of a failed one (its queue time was counted then)."""
        self._free += 1
        self._running.pop(id(batch), None)
        if self._spans:
            spans = self._spans.pop(id(batch), None)
            if spans is not None:
                tracing.end_batch(spans, exc)
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
                err = GatewayError(
                    Kind.FAILED, f"model '{self.name}' failed to execute a batch of {n_rows} rows: {exc}"
                )
            log.warning("batch of %d rows failed on %s: %s", n_rows, self.name, exc)
            for r in batch:
                if r.cls is not None:
                    st.count_class(r.class_name, "failed")
                st.fail_count += 1
                st.fail_ns += int((now - r.arrival) * 1e9)
                self._fail(r, err)
            return
        outputs, timing = result
        self.latency.observe(
            batch[0].key, n_rows, (timing.input_ns + timing.infer_ns + timing.output_ns) / 1e9
        )
        st.execution_count += 1
        st.inference_count += n_rows
        st.last_inference_ms = int(time.time() * 1000)
        for name, value in (
            ("input", timing.input_ns),
            ("infer", timing.infer_ns),
            ("output", timing.output_ns),
        ):
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
        per_row_s = (timing.input_ns + timing.infer_ns + timing.output_ns) / 1e9 / n_rows
        for r, out in zip(batch, outputs):
            r.compute_s = per_row_s * r.rows
            if r.cls is not None:
                st.count_class(r.class_name, "success" if now <= r.deadline else "late")
                st.time_class(r.class_name, now - r.arrival)
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
