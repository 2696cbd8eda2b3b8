"""Rows, not calls, are scheduled (issue 21): a call of several parts (rows of different shape
buckets) is admitted or refused as a whole, refused calls leave nothing to compute, a call that
fails part-way drops its other parts before compute, refusals carry a retry hint, and the batcher
sleeps between events instead of polling. Driven without sockets: a fake engine, a fake clock."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from batchgate.gateway.errors import GatewayError, Kind
from batchgate.gateway.scheduling import INF, Budget, LatencyModel, Scheduler, parse_classes
from batchgate.gateway.scheduling.deadline import DeadlineQueue
from batchgate.gateway.scheduling.fifo import FifoQueue

from tests.test_deadlines import FakeEngine
from tests.test_scheduler import submit_one

CLASSES = parse_classes("realtime=25ms/64/0,standard=250ms/64/0,bulk=5000ms/64/0")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def budget(cls: str, now: float, budget_s: float | None = None) -> Budget:
    c = CLASSES[cls]
    return Budget(c, now + (budget_s or c.budget_s), 0, INF, False)


def trained(per_key: dict) -> LatencyModel:
    """A latency model confident about each bucket: batch time = a + b x rows."""
    m = LatencyModel()
    for key, (a, b) in per_key.items():
        for rows in (1, 2, 4, 8, 1, 2, 4, 8):
            m.observe(key, rows, a + b * rows)
    return m


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def part(key: int, rows: int = 1):
    return ({"x": np.full((rows, 1), key)}, rows, key)


async def test_a_refused_call_is_never_computed_and_carries_a_retry_hint():
    clock = Clock()
    engine = FakeEngine()
    q = DeadlineQueue(8, (), 0.0, CLASSES, trained({16: (0.010, 0.0), 256: (0.050, 0.0)}))
    s = Scheduler("m", q, engine.execute, slots=1, clock=clock)
    s.start()
    try:
        running = asyncio.create_task(submit_one(s, *part(16), budget("bulk", clock.now)))
        await settle()
        assert len(engine.calls) == 1  # the slot is busy
        queued = [asyncio.create_task(s.submit([part(256, 8)], budget("bulk", clock.now))) for _ in range(3)]
        await settle()
        size = q.size
        # Three 50 ms batches ahead of it plus its own 10 ms: 160 ms predicted. Uncalibrated, the
        # estimate refuses only when half the prediction already misses, so a 60 ms budget is refused.
        with pytest.raises(GatewayError) as err:
            await asyncio.wait_for(s.submit([part(16, 2), part(256, 1)], budget("bulk", clock.now, 0.060)), 2)
        e = err.value
        assert e.kind is Kind.DEADLINE and e.outcome == "shed"
        assert e.retry_after_s == pytest.approx(0.150, rel=0.2)  # the queue's drain time
        trailers = dict(e.trailing_metadata)
        assert (
            int(trailers["grpc-retry-pushback-ms"])
            == int(trailers["retry-after-ms"])
            == round(e.retry_after_s * 1000)
        )
        assert q.size == size  # none of its parts was queued
        for i in range(4):
            await asyncio.wait_for(_until(lambda i=i: len(engine.calls) > i), 2)
            engine.finish(i)
        await asyncio.wait_for(asyncio.gather(running, *queued), 2)
        await settle()
        assert len(engine.calls) == 4  # the refused call's rows never reached the engine
        assert s.stats.shed == 1
    finally:
        await s.close()


async def test_a_call_whose_deadline_passes_part_way_computes_none_of_its_remaining_rows():
    clock = Clock()
    engine = FakeEngine()
    # Bucket 256 is known to take 40 ms a batch; bucket 16 is not known yet (no estimate).
    q = DeadlineQueue(8, (), 0.0, CLASSES, trained({256: (0.040, 0.0)}))
    s = Scheduler("m", q, engine.execute, slots=1, clock=clock)
    s.start()
    try:
        blocker = asyncio.create_task(submit_one(s, *part(32), budget("bulk", clock.now)))
        await settle()
        assert len(engine.calls) == 1  # holds the only slot
        call = asyncio.create_task(
            s.submit([part(256, 2), part(16, 3), part(16, 1)], budget("standard", clock.now, 0.100))
        )
        await settle()
        assert q.size == 3
        clock.now += 0.070  # 30 ms left: the 256 part can no longer make it, the 16 parts could
        engine.finish(0)
        await asyncio.wait_for(blocker, 2)
        with pytest.raises(GatewayError) as err:
            await asyncio.wait_for(call, 2)
        assert err.value.kind is Kind.DEADLINE and err.value.outcome == "expired"
        await settle()
        assert len(engine.calls) == 1  # nothing of the call was computed
        assert q.size == 0
        assert s.stats.expired == 1 and s.stats.abandoned_rows == 4  # its other parts: dropped, counted
    finally:
        await s.close()


async def test_parts_of_one_call_batch_with_other_callers_rows_and_come_back_in_order():
    clock = Clock()
    engine = FakeEngine()
    q = DeadlineQueue(8, (), 0.0, CLASSES, LatencyModel())
    s = Scheduler("m", q, engine.execute, slots=1, clock=clock)
    s.start()
    try:
        blocker = asyncio.create_task(submit_one(s, *part(32), budget("bulk", clock.now)))
        await settle()
        mine = asyncio.create_task(s.submit([part(16, 2), part(256, 1)], budget("standard", clock.now)))
        other = asyncio.create_task(submit_one(s, *part(16, 3), budget("standard", clock.now)))
        await settle()
        engine.finish(0)
        for i in (1, 2):
            await asyncio.wait_for(_until(lambda i=i: len(engine.calls) > i), 2)
            engine.finish(i)
        out = await asyncio.wait_for(mine, 2)
        await asyncio.wait_for(asyncio.gather(other, blocker), 2)
        assert [o["y"].shape[0] for o in out] == [2, 1]
        by_rows = sorted(rows for _, rows, _ in engine.calls[1:])
        assert by_rows == [[1], [2, 3]]  # the 16-bucket part shared a batch with the other caller
    finally:
        await s.close()


class Counting(FifoQueue):
    """Counts the batcher's turns."""

    turns = 0

    def take_expired(self, now):
        self.turns += 1
        return super().take_expired(now)


async def test_the_batcher_sleeps_until_its_timer_or_an_event_never_polls():
    engine = FakeEngine()
    q = Counting(max_batch_size=8, max_delay_s=0.2)
    s = Scheduler("m", q, engine.execute, slots=1)  # the real clock
    s.start()
    try:
        held = asyncio.create_task(submit_one(s, *part(16)))
        await asyncio.sleep(0.1)  # halfway through the max-wait timer: one turn for the push
        assert q.turns <= 2 and not engine.calls
        await asyncio.wait_for(_until(lambda: engine.calls), 2)
        assert q.turns <= 4  # one when the timer fired, one after the dispatch
        # Every slot busy, one request queued: nothing to do until the slot frees.
        queued = asyncio.create_task(submit_one(s, *part(16)))
        await asyncio.sleep(0.3)
        assert q.turns <= 5  # one for the push; a 1 ms poll would have made hundreds
        engine.finish(0)
        await asyncio.wait_for(held, 2)
        await asyncio.wait_for(_until(lambda: len(engine.calls) > 1), 2)
        engine.finish(1)
        await asyncio.wait_for(queued, 2)
    finally:
        await s.close()


async def _until(pred) -> None:
    while not pred():
        await asyncio.sleep(0.001)


def test_an_idle_queue_refuses_a_call_its_own_compute_cannot_fit_every_time():
    """Nothing ahead: a call whose own batch alone cannot end by its due time is refused at
    admission every time, saying no server could meet it. (It was let through once a second, a
    probe meant to correct an estimate grown too high, but the queue's expiry test, the same
    estimate, dropped it before compute at once: it corrected nothing, and the caller heard a
    different refusal.) A call that fits is never refused."""
    from batchgate.gateway.scheduling import Request

    q = DeadlineQueue(8, (), 0.0, CLASSES, trained({256: (0.040, 0.0)}))

    def call(now: float, budget_s: float):
        c = CLASSES["standard"]
        return [Request({}, 1, 256, now, None, now + budget_s, c)]

    assert q.refuse(call(0.0, 0.100), 0.0, 0.0, 1) is None  # fits: 40 ms of 100
    for now in (0.0, 0.5, 1.1):  # 10 ms for 40 ms of compute: every time, no probe
        refusal = q.refuse(call(now, 0.010), now, 0.0, 1)
        assert refusal is not None and refusal.alone and refusal.own_s == pytest.approx(0.040)
    assert q.refuse(call(1.2, 0.100), 1.2, 0.0, 1) is None  # a call that fits is never refused
