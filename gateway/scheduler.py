"""The dynamic batcher: one scheduler per served model version.

Two layers, so the policy can be tested without sockets, threads or real time:

* ``BatchQueue`` is a pure state machine. ``push`` adds a request, ``pop_batch(now)`` returns the
  batch that should leave at ``now`` (or None), ``next_deadline()`` says when to ask again.
* ``Scheduler`` drives it on the event loop. It is the single owner of the queue: requests are
  pushed from handlers on the same loop, and one task forms batches and hands them to the
  worker pool; completions come back through ``call_soon_threadsafe``. A batch is only formed
  when a worker slot is free, so under load requests accumulate and batches grow by themselves.

A batch leaves when it is full (max_batch_size rows, or the next request would not fit), when
its rows reach a preferred size, or when its oldest request has waited max_queue_delay. Rows
are merged only when every input's non-batch dims agree (the request's shape ``key``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from gateway.errors import GatewayError, Kind, unavailable

log = logging.getLogger(__name__)

Execute = Callable[[list[dict[str, np.ndarray]], list[int], bool], Future]


class Request:
    __slots__ = ("inputs", "rows", "key", "arrival", "future")

    def __init__(self, inputs: dict[str, np.ndarray], rows: int, key: Hashable, arrival: float, future) -> None:
        self.inputs = inputs
        self.rows = rows
        self.key = key
        self.arrival = arrival
        self.future = future  # asyncio.Future; done() early means the caller went away


class _Group:
    __slots__ = ("requests", "rows")

    def __init__(self) -> None:
        self.requests: deque[Request] = deque()
        self.rows = 0


class BatchQueue:
    """Pending requests of one model, grouped by shape key, oldest first."""

    def __init__(
        self,
        max_batch_size: int,
        preferred: tuple[int, ...] = (),
        max_delay_s: float = 0.0,
        max_queue_size: int = 0,
    ) -> None:
        self.max_batch_size = max_batch_size
        self.preferred = frozenset(p for p in preferred if p <= max(max_batch_size, 1))
        self.min_preferred = min(self.preferred) if self.preferred else None
        self.max_delay_s = max_delay_s
        self.max_queue_size = max_queue_size
        self._groups: dict[Hashable, _Group] = {}
        self.size = 0  # requests queued (including ones whose caller left, until popped)
        self.dropped = 0  # callers that left before their request was batched

    def __len__(self) -> int:
        return self.size

    def push(self, req: Request) -> bool:
        """Queue ``req``; False when max_queue_size is reached (the caller answers UNAVAILABLE)."""
        if self.max_queue_size and self.size >= self.max_queue_size:
            return False
        group = self._groups.get(req.key)
        if group is None:
            group = self._groups[req.key] = _Group()
        group.requests.append(req)
        group.rows += req.rows
        self.size += 1
        return True

    def _live_groups(self) -> list[_Group]:
        """Groups with a live request, oldest head first (cancelled heads are dropped here)."""
        groups = []
        for key in list(self._groups):
            g = self._groups[key]
            self._drop_cancelled_head(g)
            if not g.requests:
                del self._groups[key]
            else:
                groups.append(g)
        if len(groups) > 1:
            groups.sort(key=lambda g: g.requests[0].arrival)
        return groups

    def _drop_cancelled_head(self, g: _Group) -> None:
        while g.requests and g.requests[0].future.done():
            r = g.requests.popleft()
            g.rows -= r.rows
            self.size -= 1
            self.dropped += 1

    def next_deadline(self) -> float | None:
        """When the oldest request's max-wait timer fires; None when nothing is queued."""
        groups = self._live_groups()
        return None if not groups else groups[0].requests[0].arrival + self.max_delay_s

    def pop_batch(self, now: float) -> list[Request] | None:
        """The batch that should leave at ``now``: the oldest group's when its timer expired, else
        the first group (oldest first) that is full or at a preferred size."""
        for g in self._live_groups():
            batch = self._ready(g, now)
            if batch is not None:
                return batch
        return None

    def _ready(self, g: _Group, now: float) -> list[Request] | None:
        if self.max_batch_size == 0:  # the model does not batch: one request per execution
            return self._take(g, 1)
        expired = now >= g.requests[0].arrival + self.max_delay_s
        if not expired and g.rows < self.max_batch_size and (self.min_preferred is None or g.rows < self.min_preferred):
            return None  # fast path: nothing can close this batch yet
        taken_rows = 0
        n = 0
        best_preferred = 0
        full = False
        for req in g.requests:
            if req.future.done():  # left while queued: skipped now, removed by _take
                n += 1
                continue
            if taken_rows + req.rows > self.max_batch_size:
                full = True
                if taken_rows == 0:  # one request larger than a batch: it goes alone, never stuck
                    n += 1
                break
            taken_rows += req.rows
            n += 1
            if taken_rows in self.preferred:
                best_preferred = n
        if taken_rows == self.max_batch_size:
            full = True
        if full or expired:
            return self._take(g, n)
        if best_preferred:
            return self._take(g, best_preferred)
        return None

    def _take(self, g: _Group, n: int) -> list[Request] | None:
        batch = []
        for _ in range(n):
            r = g.requests.popleft()
            g.rows -= r.rows
            self.size -= 1
            if r.future.done():
                self.dropped += 1
            else:
                batch.append(r)
        return batch or None

    def drain_all(self) -> list[Request]:
        out = []
        for g in self._groups.values():
            out.extend(g.requests)
        self._groups.clear()
        self.size = 0
        return out


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
    by_batch_size: dict[int, BatchStats] = field(default_factory=dict)


class Scheduler:
    def __init__(
        self,
        name: str,
        queue: BatchQueue,
        execute: Execute,
        slots: int,
        batched: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.queue = queue
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

    async def infer(self, inputs: dict[str, np.ndarray], rows: int, key: Hashable) -> dict[str, np.ndarray]:
        if self._closing:
            raise unavailable(f"model '{self.name}' is draining; retry on another replica")
        loop = asyncio.get_running_loop()
        req = Request(inputs, rows, key, self.clock(), loop.create_future())
        if not self.queue.push(req):
            self.stats.rejected_full += 1
            raise unavailable(
                f"model '{self.name}' queue is full (max_queue_size={self.queue.max_queue_size}); retry later"
            )
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

    def _wake(self) -> None:
        w = self._wakeup
        if w is not None and not w.done():
            w.set_result(None)

    # -- batcher task ---------------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            while True:
                while self._free == 0:
                    await self._wait(None)
                batch = self.queue.pop_batch(self.clock())
                self.stats.dropped = self.queue.dropped
                if batch is None:
                    await self._wait(self.queue.next_deadline())
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
            delay = deadline - self.clock()
            if delay <= 0:
                self._wakeup = None
                return
            self._timer = self._loop.call_later(delay, self._wake)
        try:
            await self._wakeup
        finally:
            self._wakeup = None
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    def _dispatch(self, batch: list[Request]) -> None:
        self._free -= 1
        start = self.clock()
        rows = [r.rows for r in batch]
        try:
            fut = self.execute([r.inputs for r in batch], rows, self.batched)
        except BaseException as exc:
            self._complete(batch, start, None, exc)
            return
        loop = self._loop
        fut.add_done_callback(lambda f: loop.call_soon_threadsafe(self._on_done, batch, start, f))

    def _on_done(self, batch: list[Request], start: float, fut: Future) -> None:
        if fut.cancelled():
            exc: BaseException | None = GatewayError(Kind.FAILED, f"model '{self.name}': the batch was cancelled")
        else:
            exc = fut.exception()
        result = None if exc else fut.result()
        if result is not None and len(result[0]) != len(batch):
            exc = GatewayError(
                Kind.FAILED, f"model '{self.name}': engine returned {len(result[0])} outputs for {len(batch)} requests"
            )
        self._complete(batch, start, None if exc else result, exc)

    def _complete(self, batch: list[Request], start: float, result, exc: BaseException | None) -> None:
        self._free += 1
        self._wake()
        now = self.clock()
        st = self.stats
        n_rows = sum(r.rows for r in batch)
        for r in batch:
            st.queue_count += 1
            st.queue_ns += int((start - r.arrival) * 1e9)
        if exc is not None:
            err = exc if isinstance(exc, GatewayError) else GatewayError(
                Kind.FAILED, f"model '{self.name}' failed to execute a batch of {n_rows} rows: {exc}"
            )
            log.warning("batch of %d rows failed on %s: %s", n_rows, self.name, exc)
            for r in batch:
                st.fail_count += 1
                st.fail_ns += int((now - r.arrival) * 1e9)
                if not r.future.done():
                    r.future.set_exception(err)
            return
        outputs, timing = result
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
        for r, out in zip(batch, outputs):
            st.success_count += 1
            st.success_ns += int((now - r.arrival) * 1e9)
            if not r.future.done():
                r.future.set_result(out)

    def _fail_queued(self, err: GatewayError) -> None:
        for r in self.queue.drain_all():
            if not r.future.done():
                r.future.set_exception(err)
