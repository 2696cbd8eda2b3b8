"""Unit tests for the dynamic batcher in ``gateway/scheduling/scheduler.py``.

What is tested
  * ``FifoQueue`` -- the pure batching policy: the max-delay timer, max_batch_size (exact fit
    and overflow), preferred sizes, shape keys, max_queue_size, callers that left, and
    unbatched models (max_batch_size 0).
  * ``Scheduler`` -- the asyncio driver: outputs split back per caller, statistics, batches
    growing while the only slot is busy, error propagation, cancellation, queue-full, drain(),
    close(), and a randomised "every waiter answered exactly once" check.

How
  * No sockets, threads or ONNX. ``FakeEngine.execute`` stands in for ``WorkerPool.submit``: it
    records each call and returns a ``concurrent.futures.Future`` that the *test* completes, so
    the test decides exactly when (and in which order) batches finish.
  * Time is a ``FakeClock`` (a float the test advances). ``FifoQueue`` tests pass ``now``
    explicitly. Scheduler tests mostly avoid the timer altogether: either max_queue_delay is 0
    (a batch leaves as soon as a slot is free) or it is huge and batches close on size. The one
    Scheduler timer test advances the fake clock and lets the scheduler's real ``call_later``
    (a few ms) wake it up.
  * Every await on a caller is bounded (``asyncio.wait_for``) so a bug shows up as a failure,
    never as a hung test run.
"""

from __future__ import annotations

import asyncio
import random
from concurrent.futures import Future

import numpy as np
import pytest

from batchgate.gateway.errors import GatewayError, Kind
from batchgate.gateway.scheduling import Request, Scheduler
from batchgate.gateway.scheduling.fifo import FifoQueue
from batchgate.gateway.scheduling.stats import COST, CallCost
from batchgate.workers.engine import BatchTiming

MODEL = "fake_model"
TIMEOUT = 1.0  # seconds any single await may take before the test fails instead of hanging


# ================================================================================================
# FifoQueue: pure state machine, explicit `now`
# ================================================================================================


class Waiter:
    """Stands in for the caller's asyncio.Future: FifoQueue only ever asks ``done()``."""

    def __init__(self) -> None:
        self.left = False

    def done(self) -> bool:
        return self.left

    def cancel(self) -> None:
        self.left = True


def req(name: str, rows: int = 1, key="k", arrival: float = 0.0) -> Request:
    return Request({"name": name}, rows, key, arrival, Waiter())


def names(batch: list[Request] | None) -> list[str] | None:
    return None if batch is None else [r.inputs["name"] for r in batch]


def pushed(q: FifoQueue, *reqs: Request) -> FifoQueue:
    for r in reqs:
        assert q.push([r])
    return q


# -- 1. timer ------------------------------------------------------------------------------------


def test_queue_lone_request_leaves_when_max_delay_expires():
    q = pushed(FifoQueue(max_batch_size=8, max_delay_s=0.002), req("a", arrival=1.0))

    assert q.pop_batch(0.0)[1] == 1.0 + 0.002
    assert q.pop_batch(1.0)[0] is None  # just arrived
    assert q.pop_batch(1.001)[0] is None  # 1 ms in: still waiting for company
    assert q.size == 1
    assert names(q.pop_batch(1.0 + 0.002)[0]) == ["a"]  # the timer fires at arrival + delay
    assert q.size == 0
    assert q.pop_batch(0.0)[1] is None  # nothing left to wake up for


def test_queue_deadline_follows_the_oldest_request():
    q = pushed(FifoQueue(max_batch_size=8, max_delay_s=0.5), req("a", arrival=2.0), req("b", arrival=3.0))
    assert q.pop_batch(0.0)[1] == 2.5
    assert names(q.pop_batch(2.5)[0]) == ["a", "b"]  # the expired batch takes the younger one along


# -- 2. max_batch_size ---------------------------------------------------------------------------


def test_queue_exactly_full_batch_leaves_before_the_timer():
    q = pushed(FifoQueue(max_batch_size=4, max_delay_s=10.0), req("a", 1), req("b", 3))
    assert names(q.pop_batch(0.0)[0]) == ["a", "b"]
    assert q.size == 0


def test_queue_overflowing_request_waits_at_the_head_for_the_next_batch():
    q = pushed(FifoQueue(max_batch_size=4, max_delay_s=10.0), req("a", 2), req("b", 1), req("c", 2))
    # a+b = 3 rows; c would make 5 > 4, so the batch leaves now with what fits ...
    assert names(q.pop_batch(0.0)[0]) == ["a", "b"]
    # ... and c is kept, first in line, for a later batch (which is not full, so it waits).
    assert q.size == 1
    assert q.pop_batch(0.0)[0] is None
    pushed(q, req("d", 1, arrival=1.0))
    assert names(q.pop_batch(10.0)[0]) == ["c", "d"]  # arrival order kept when the timer fires


# -- 3. preferred sizes --------------------------------------------------------------------------


def test_queue_reaching_a_preferred_size_closes_the_batch():
    q = FifoQueue(max_batch_size=16, preferred=(4, 8), max_delay_s=10.0)
    pushed(q, req("a"), req("b"), req("c"))
    assert q.pop_batch(0.0)[0] is None  # 3 rows: no preferred size reached, timer far away
    pushed(q, req("d"))
    assert names(q.pop_batch(0.0)[0]) == ["a", "b", "c", "d"]  # 4 rows == preferred 4


def test_queue_largest_reachable_preferred_prefix_wins():
    q = FifoQueue(max_batch_size=16, preferred=(4, 8), max_delay_s=10.0)
    pushed(q, req("a", 2), req("b", 2), req("c", 4), req("d", 3))
    # Prefix row sums are 2, 4, 8, 11: both 4 and 8 are reachable, the larger one is taken and
    # d (which would make 11, not preferred) stays behind.
    assert names(q.pop_batch(0.0)[0]) == ["a", "b", "c"]
    assert q.size == 1


def test_queue_rows_past_preferred_without_exact_prefix_wait_for_timer():
    q = pushed(FifoQueue(max_batch_size=16, preferred=(4,), max_delay_s=1.0), req("a", 3), req("b", 3))
    assert q.pop_batch(0.0)[0] is None  # 6 rows >= 4, but no prefix sums to exactly 4
    assert names(q.pop_batch(1.0)[0]) == ["a", "b"]


def test_queue_preferred_sizes_above_max_batch_size_are_ignored():
    q = FifoQueue(max_batch_size=4, preferred=(2, 32), max_delay_s=1.0)
    assert q.preferred == {2}


# -- 4. shape keys -------------------------------------------------------------------------------


def test_queue_different_shape_keys_never_share_a_batch():
    q = pushed(
        FifoQueue(max_batch_size=8, max_delay_s=1.0),
        req("a1", key="A", arrival=0.0),
        req("b1", key="B", arrival=0.1),
        req("a2", key="A", arrival=0.2),
    )
    # Everything has expired and 3 rows would fit in one batch, but A and B do not mix.
    assert names(q.pop_batch(5.0)[0]) == ["a1", "a2"]
    assert names(q.pop_batch(5.0)[0]) == ["b1"]
    assert q.pop_batch(5.0)[0] is None


def test_queue_group_of_the_oldest_request_goes_first():
    # B's head is older than A's, even though A was pushed first and B is smaller.
    q = pushed(
        FifoQueue(max_batch_size=8, max_delay_s=1.0),
        req("a1", key="A", arrival=0.5),
        req("b1", key="B", arrival=0.2),
        req("a2", key="A", arrival=0.6),
    )
    assert q.pop_batch(0.0)[1] == 0.2 + 1.0
    assert names(q.pop_batch(5.0)[0]) == ["b1"]
    assert names(q.pop_batch(5.0)[0]) == ["a1", "a2"]


# -- 5. max_queue_size ---------------------------------------------------------------------------


def test_queue_push_refuses_when_max_queue_size_is_reached():
    q = FifoQueue(max_batch_size=8, max_delay_s=1.0, max_queue_size=2)
    assert q.push([req("a")])
    assert q.push([req("b")])
    assert not q.push([req("c")])
    assert q.size == 2
    assert names(q.pop_batch(1.0)[0]) == ["a", "b"]  # the refused one was really not queued
    assert q.push([req("d")])  # room again once the batch left


def test_queue_max_queue_size_zero_means_unbounded():
    q = FifoQueue(max_batch_size=8, max_delay_s=1.0, max_queue_size=0)
    assert all(q.push([req(str(i))]) for i in range(1000))
    assert q.size == 1000


# -- 6. callers that left ------------------------------------------------------------------------


def test_queue_cancelled_request_is_skipped_and_counted_as_dropped():
    a, b, c = req("a", 2), req("b", 2), req("c", 2)
    q = pushed(FifoQueue(max_batch_size=4, max_delay_s=10.0), a, b, c)
    b.future.cancel()
    # b's 2 rows do not count: a + c = 4 is a full batch, and b is not in it.
    assert names(q.pop_batch(0.0)[0]) == ["a", "c"]
    assert q.dropped == 1
    assert q.size == 0


def test_queue_cancelled_head_does_not_set_the_deadline():
    a, b = req("a", arrival=0.0), req("b", arrival=3.0)
    q = pushed(FifoQueue(max_batch_size=8, max_delay_s=1.0), a, b)
    a.future.cancel()
    assert q.pop_batch(0.0)[1] == 4.0  # b's deadline, not the departed a's
    assert q.dropped == 1
    assert q.pop_batch(2.0)[0] is None  # and a's expired timer does not push b out early
    assert names(q.pop_batch(4.0)[0]) == ["b"]


def test_queue_all_cancelled_yields_no_batch():
    a, b = req("a"), req("b")
    q = pushed(FifoQueue(max_batch_size=8, max_delay_s=0.0), a, b)
    a.future.cancel()
    b.future.cancel()
    assert q.pop_batch(10.0)[0] is None
    assert q.pop_batch(0.0)[1] is None
    assert (q.size, q.dropped) == (0, 2)


# -- 7. unbatched models -------------------------------------------------------------------------


def test_queue_max_batch_size_zero_sends_one_request_per_batch():
    q = pushed(FifoQueue(max_batch_size=0, max_delay_s=10.0), req("a"), req("b"), req("c"))
    # No waiting for the timer: there is nothing to batch with.
    assert names(q.pop_batch(0.0)[0]) == ["a"]
    assert names(q.pop_batch(0.0)[0]) == ["b"]
    assert names(q.pop_batch(0.0)[0]) == ["c"]
    assert q.pop_batch(0.0)[0] is None


# -- regression: oversize request ----------------------------------------------------------------------------------


def test_queue_oversize_request_does_not_wedge_the_queue():
    q = FifoQueue(max_batch_size=4, max_delay_s=0.001)
    big = req("big", rows=5)
    accepted = q.push([big])
    # Either refuse it up front, or send it (alone) once its timer has expired.
    assert not accepted or names(q.pop_batch(1.0)[0]) == ["big"]


# ================================================================================================
# Scheduler: asyncio driver with a fake engine and a fake clock
# ================================================================================================


class FakeClock:
    """The scheduler's clock: stands still until the test advances it."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Call:
    """One ``execute`` call: what the scheduler sent, and the future the test completes."""

    def __init__(self, parts, rows, batched) -> None:
        self.parts = parts
        self.rows = list(rows)
        self.batched = batched
        self.future: Future = Future()

    @property
    def ids(self) -> list[int]:
        return [int(p["id"][0]) for p in self.parts]

    def succeed(self, timing: BatchTiming | None = None) -> None:
        # Like Engine.run_batch: one output dict per request, derived from that request's rows.
        outputs = [{"echo": p["id"].copy(), "twice": p["x"] * 2} for p in self.parts]
        self.future.set_result((outputs, timing or BatchTiming()))

    def fail(self, exc: BaseException) -> None:
        self.future.set_exception(exc)


class FakeEngine:
    """Stands in for ``WorkerPool.submit``."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.raise_next: BaseException | None = None  # make the next execute() raise synchronously
        self.max_running = 0  # most calls outstanding at once (must never exceed the slots)

    def execute(self, parts, rows, batched) -> Future:
        if self.raise_next is not None:
            exc, self.raise_next = self.raise_next, None
            raise exc
        call = Call(parts, rows, batched)
        self.calls.append(call)
        self.max_running = max(self.max_running, len(self.running()))
        return call.future

    def running(self) -> list[Call]:
        return [c for c in self.calls if not c.future.done()]


async def submit_one(scheduler: Scheduler, inputs, rows: int, key, budget=None):
    """A call of one part (the common case), as the runtime submits it: its one output."""
    return (await scheduler.submit([(inputs, rows, key)], budget))[0]


def inputs_for(rid: int, rows: int) -> dict[str, np.ndarray]:
    # "id" lets the engine and the test tell requests apart; "x" is distinct per request too.
    return {"id": np.full(rows, rid, dtype=np.int64), "x": np.arange(rows, dtype=np.float32) + 1000 * rid}


def assert_own_output(out: dict[str, np.ndarray], rid: int, rows: int) -> None:
    np.testing.assert_array_equal(out["echo"], np.full(rows, rid))
    np.testing.assert_array_equal(out["twice"], (np.arange(rows, dtype=np.float32) + 1000 * rid) * 2)


async def settle(rounds: int = 20) -> None:
    """Let every ready callback chain run (no real time passes, the fake clock stands still)."""
    for _ in range(rounds):
        await asyncio.sleep(0)


async def until(pred, timeout: float = TIMEOUT) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not pred():
        if loop.time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.001)


async def answer(task: asyncio.Task):
    """The caller's result, or its exception returned (not raised) -- never waits forever."""
    try:
        return await asyncio.wait_for(asyncio.shield(task), TIMEOUT)
    except asyncio.CancelledError:
        if task.cancelled():
            return asyncio.CancelledError()
        raise
    except GatewayError as exc:
        return exc


class Rig:
    """A started Scheduler wired to a FakeEngine and a FakeClock, plus a way to call it."""

    def __init__(self, *, slots: int = 1, batched: bool = True, **queue_kw) -> None:
        self.clock = FakeClock()
        self.engine = FakeEngine()
        self.queue = FifoQueue(**queue_kw)
        self.scheduler = Scheduler(MODEL, self.queue, self.engine.execute, slots, batched, clock=self.clock)
        self.tasks: list[asyncio.Task] = []
        self.scheduler.start()

    def call(self, rid: int, rows: int = 1, key="k") -> asyncio.Task:
        task = asyncio.create_task(submit_one(self.scheduler, inputs_for(rid, rows), rows, key))
        self.tasks.append(task)
        return task

    @property
    def stats(self):
        return self.scheduler.stats


@pytest.fixture
async def make_rig():
    """Builds Rigs; at the end closes them so no task outlives the test's loop."""
    loop = asyncio.get_running_loop()
    loop_errors: list[dict] = []
    # Exceptions inside loop callbacks (e.g. the scheduler's done-callback) are otherwise only
    # logged; collect them so tests can assert there were none.
    loop.set_exception_handler(lambda _loop, ctx: loop_errors.append(ctx))
    rigs: list[Rig] = []

    def make(**kw) -> Rig:
        rig = Rig(**kw)
        rig.loop_errors = loop_errors
        rigs.append(rig)
        return rig

    yield make
    for rig in rigs:
        for t in rig.tasks:
            t.cancel()
        await rig.scheduler.close()
        await asyncio.gather(*rig.tasks, return_exceptions=True)
    loop.set_exception_handler(None)


# -- 8. outputs and statistics -------------------------------------------------------------------


async def test_outputs_are_split_back_and_stats_count_batches(make_rig):
    # A huge delay: batches can only close on size, so the test fully controls their shape.
    rig = make_rig(slots=2, max_batch_size=6, max_delay_s=60.0)
    first = {1: rig.call(1, rows=1), 2: rig.call(2, rows=2), 3: rig.call(3, rows=3)}
    await until(lambda: len(rig.engine.calls) == 1)  # 1 + 2 + 3 = 6 rows: full
    second = {4: rig.call(4, rows=2), 5: rig.call(5, rows=4)}
    await until(lambda: len(rig.engine.calls) == 2)

    call1, call2 = rig.engine.calls
    assert (call1.ids, call1.rows, call1.batched) == ([1, 2, 3], [1, 2, 3], True)
    assert (call2.ids, call2.rows) == ([4, 5], [2, 4])

    # Finish them out of order, with known timings.
    call2.succeed(BatchTiming(input_ns=1, infer_ns=2, output_ns=3))
    call1.succeed(BatchTiming(input_ns=10, infer_ns=20, output_ns=30))
    rows = {1: 1, 2: 2, 3: 3, 4: 2, 5: 4}
    for rid, task in {**first, **second}.items():
        assert_own_output(await answer(task), rid, rows[rid])

    st = rig.stats
    assert st.execution_count == 2  # batches
    assert st.inference_count == 12  # rows
    assert (st.success_count, st.fail_count, st.queue_count) == (5, 0, 5)
    assert sorted(st.by_batch_size) == [6]  # both batches had 6 rows
    assert st.by_batch_size[6].count == 2
    assert st.by_batch_size[6].infer_ns == 22  # per batch
    assert st.infer_ns == 20 * 3 + 2 * 2  # per request, as Triton counts it
    assert rig.loop_errors == []


async def test_each_call_is_billed_its_rows_share_of_the_batch_compute(make_rig):
    """Usage metering's compute seconds: a call pays its share, by rows, of the batch that computed
    its rows; the shares add up to the batch's engine time (not that time once per call), and a
    call of several parts (a text call's length buckets) pays for all of them."""
    rig = make_rig(slots=1, max_batch_size=4, max_delay_s=60.0)
    costs: dict[int, CallCost] = {}

    async def billed(rid: int, *rows: int):
        costs[rid] = CallCost()
        COST.set(costs[rid])  # this task's own context, as the pipeline sets it per call
        parts = [(inputs_for(10 * rid + i, n), n, "k") for i, n in enumerate(rows)]
        return await rig.scheduler.submit(parts, None)

    tasks = [asyncio.create_task(billed(1, 1)), asyncio.create_task(billed(2, 1, 2))]
    rig.tasks += tasks
    await until(lambda: len(rig.engine.calls) == 1)  # 1 + 1 + 2 rows: one full batch
    rig.engine.calls[0].succeed(
        BatchTiming(input_ns=100_000_000, infer_ns=200_000_000, output_ns=100_000_000)
    )
    for t in tasks:
        await answer(t)
    assert (costs[1].computed, costs[2].computed) == (1, 3)
    assert costs[1].compute_s == pytest.approx(0.1) and costs[2].compute_s == pytest.approx(0.3)


async def test_unbatched_model_gets_one_request_per_execution(make_rig):
    rig = make_rig(slots=2, batched=False, max_batch_size=0, max_delay_s=60.0)
    a, b = rig.call(1), rig.call(2)
    await until(lambda: len(rig.engine.calls) == 2)
    assert [(c.ids, c.batched) for c in rig.engine.calls] == [([1], False), ([2], False)]
    for c in rig.engine.calls:
        c.succeed()
    assert_own_output(await answer(a), 1, 1)
    assert_own_output(await answer(b), 2, 1)
    assert rig.stats.by_batch_size[1].count == 2


async def test_scheduler_waits_for_max_delay_on_its_own_clock(make_rig):
    rig = make_rig(slots=1, max_batch_size=8, max_delay_s=0.005)
    task = rig.call(1)
    # Real time passes (the scheduler's 5 ms call_later fires, maybe twice) but the scheduler's
    # clock does not move, so the lone request must still be waiting.
    await asyncio.sleep(0.02)
    assert rig.engine.calls == []
    rig.clock.advance(0.005)  # now the oldest request has waited max_queue_delay
    await until(lambda: len(rig.engine.calls) == 1)  # the next timer wake-up sends it
    rig.engine.calls[0].succeed()
    assert_own_output(await answer(task), 1, 1)


# -- 9. batches grow while the only slot is busy -------------------------------------------------


async def test_requests_accumulate_while_the_slot_is_busy(make_rig):
    # max_delay 0: every request is "expired" at once, so only the busy slot holds them back.
    rig = make_rig(slots=1, max_batch_size=16, max_delay_s=0.0)
    first = rig.call(1, rows=2)
    await until(lambda: len(rig.engine.calls) == 1)
    later = [rig.call(rid, rows=rid) for rid in (2, 3, 4)]
    await settle()
    assert len(rig.engine.calls) == 1  # nothing else may start while the slot is taken
    assert rig.queue.size == 3

    rig.engine.calls[0].succeed()
    await until(lambda: len(rig.engine.calls) == 2)
    await settle()
    assert len(rig.engine.calls) == 2  # ... and the three went as ONE batch
    assert (rig.engine.calls[1].ids, rig.engine.calls[1].rows) == ([2, 3, 4], [2, 3, 4])

    rig.engine.calls[1].succeed()
    assert_own_output(await answer(first), 1, 2)
    for rid, t in zip((2, 3, 4), later):
        assert_own_output(await answer(t), rid, rid)
    assert {n: b.count for n, b in rig.stats.by_batch_size.items()} == {2: 1, 9: 1}


# -- 10. errors ----------------------------------------------------------------------------------


async def test_engine_failure_fails_the_whole_batch_and_serving_continues(make_rig):
    rig = make_rig(slots=1, max_batch_size=2, max_delay_s=60.0)
    a, b = rig.call(1), rig.call(2)
    await until(lambda: len(rig.engine.calls) == 1)
    rig.engine.calls[0].fail(RuntimeError("CUDA out of memory"))
    for task in (a, b):
        err = await answer(task)
        assert isinstance(err, GatewayError)
        assert err.kind is Kind.FAILED
        assert MODEL in err.message and "CUDA out of memory" in err.message
    assert (rig.stats.fail_count, rig.stats.success_count, rig.stats.execution_count) == (2, 0, 0)

    # The slot was given back: the next batch runs and succeeds.
    c, d = rig.call(3), rig.call(4)
    await until(lambda: len(rig.engine.calls) == 2)
    rig.engine.calls[1].succeed()
    assert_own_output(await answer(c), 3, 1)
    assert_own_output(await answer(d), 4, 1)
    assert rig.stats.success_count == 2


async def test_execute_raising_synchronously_fails_the_batch_and_serving_continues(make_rig):
    rig = make_rig(slots=1, max_batch_size=2, max_delay_s=60.0)
    rig.engine.raise_next = RuntimeError("worker pool 'fake_model' is closed")
    a, b = rig.call(1), rig.call(2)
    for task in (a, b):
        err = await answer(task)
        assert isinstance(err, GatewayError) and err.kind is Kind.FAILED
        assert MODEL in err.message
    assert rig.engine.calls == []  # execute raised before recording anything

    c, d = rig.call(3), rig.call(4)
    await until(lambda: len(rig.engine.calls) == 1)
    rig.engine.calls[0].succeed()
    assert_own_output(await answer(c), 3, 1)
    assert_own_output(await answer(d), 4, 1)


async def test_gateway_error_from_engine_keeps_its_kind(make_rig):
    rig = make_rig(slots=1, max_batch_size=0, max_delay_s=0.0)
    task = rig.call(1)
    await until(lambda: len(rig.engine.calls) == 1)
    rig.engine.calls[0].fail(GatewayError(Kind.DEADLINE, "too slow"))
    err = await answer(task)
    assert isinstance(err, GatewayError) and (err.kind, err.message) == (Kind.DEADLINE, "too slow")


async def test_cancelled_engine_future_answers_callers_and_frees_the_slot(make_rig):
    rig = make_rig(slots=1, max_batch_size=0, max_delay_s=0.0)
    task = rig.call(1)
    await until(lambda: len(rig.engine.calls) == 1)
    assert rig.engine.calls[0].future.cancel()
    try:
        err = await asyncio.wait_for(asyncio.shield(task), 0.3)
    except GatewayError as exc:
        err = exc
    except TimeoutError:
        pytest.fail("the caller of a batch whose engine future was cancelled was never answered")
    assert isinstance(err, GatewayError)
    nxt = rig.call(2)
    await until(lambda: len(rig.engine.calls) == 2, timeout=0.3)  # the slot came back
    rig.engine.calls[1].succeed()
    assert_own_output(await answer(nxt), 2, 1)


# -- 11. cancellation ----------------------------------------------------------------------------


async def test_cancelled_caller_is_left_out_of_the_batch(make_rig):
    rig = make_rig(slots=1, max_batch_size=16, max_delay_s=0.0)
    busy = rig.call(1)
    await until(lambda: len(rig.engine.calls) == 1)  # the only slot is now taken
    b, c, d = rig.call(2, rows=2), rig.call(3, rows=3), rig.call(4, rows=4)
    await settle()
    c.cancel()  # the client goes away while its request is queued
    await settle()
    assert c.cancelled()

    rig.engine.calls[0].succeed()
    await until(lambda: len(rig.engine.calls) == 2)
    batch = rig.engine.calls[1]
    assert (batch.ids, batch.rows) == ([2, 4], [2, 4])  # no compute spent on the one that left
    assert rig.queue.dropped == 1
    assert rig.stats.dropped == 1

    batch.succeed()
    assert_own_output(await answer(busy), 1, 1)
    assert_own_output(await answer(b), 2, 2)
    assert_own_output(await answer(d), 4, 4)
    assert rig.stats.inference_count == 1 + 6


# -- 12. queue full ------------------------------------------------------------------------------


async def test_full_queue_answers_unavailable(make_rig):
    rig = make_rig(slots=1, max_batch_size=16, max_delay_s=0.0, max_queue_size=2)
    busy = rig.call(1)
    await until(lambda: len(rig.engine.calls) == 1)  # dispatched: no longer in the queue
    queued = [rig.call(2), rig.call(3)]
    await settle()
    assert rig.queue.size == 2

    err = await answer(rig.call(4))
    assert isinstance(err, GatewayError)
    assert err.kind is Kind.UNAVAILABLE
    assert "max_queue_size=2" in err.message
    assert rig.stats.rejected_full == 1

    # The queued ones are unaffected.
    rig.engine.calls[0].succeed()
    await until(lambda: len(rig.engine.calls) == 2)
    rig.engine.calls[1].succeed()
    for rid, t in zip((1, 2, 3), [busy, *queued]):
        assert_own_output(await answer(t), rid, 1)


# -- 13. drain and close -------------------------------------------------------------------------


async def test_drain_refuses_new_work_and_waits_for_outstanding_batches(make_rig):
    rig = make_rig(slots=1, max_batch_size=16, max_delay_s=0.0)
    a = rig.call(1)
    await until(lambda: len(rig.engine.calls) == 1)
    b = rig.call(2)  # queued behind the busy slot
    await settle()

    drain = asyncio.create_task(rig.scheduler.drain(timeout_s=TIMEOUT))
    await settle()
    err = await answer(rig.call(3))
    assert isinstance(err, GatewayError) and err.kind is Kind.UNAVAILABLE
    assert MODEL in err.message

    assert not drain.done()
    rig.engine.calls[0].succeed()  # a is answered, b (accepted before drain) still runs
    await until(lambda: len(rig.engine.calls) == 2)
    await settle()
    assert not drain.done()  # b is still outstanding
    assert rig.engine.calls[1].ids == [2]

    rig.engine.calls[1].succeed()
    assert await asyncio.wait_for(drain, TIMEOUT) is True
    assert_own_output(await answer(a), 1, 1)
    assert_own_output(await answer(b), 2, 1)


async def test_drain_times_out_while_a_batch_is_stuck(make_rig):
    rig = make_rig(slots=1, max_batch_size=0, max_delay_s=0.0)
    a = rig.call(1)
    await until(lambda: len(rig.engine.calls) == 1)
    assert await rig.scheduler.drain(timeout_s=0.05) is False
    rig.engine.calls[0].succeed()
    assert_own_output(await answer(a), 1, 1)
    assert await rig.scheduler.drain(timeout_s=TIMEOUT) is True


async def test_drain_with_nothing_outstanding_returns_at_once(make_rig):
    rig = make_rig(slots=1, max_batch_size=8, max_delay_s=0.0)
    assert await rig.scheduler.drain(timeout_s=TIMEOUT) is True


async def test_close_answers_queued_requests_unavailable(make_rig):
    rig = make_rig(slots=1, max_batch_size=16, max_delay_s=0.0)
    running = rig.call(1)
    await until(lambda: len(rig.engine.calls) == 1)
    queued = [rig.call(2), rig.call(3, key="other")]
    await settle()
    assert rig.queue.size == 2

    await asyncio.wait_for(rig.scheduler.close(), TIMEOUT)
    for t in queued:
        err = await answer(t)
        assert isinstance(err, GatewayError) and err.kind is Kind.UNAVAILABLE
        assert MODEL in err.message
    assert rig.queue.size == 0
    assert len(rig.engine.calls) == 1  # nothing new was started

    # The batch already handed to the engine still answers its caller.
    rig.engine.calls[0].succeed()
    assert_own_output(await answer(running), 1, 1)
    err = await answer(rig.call(4))  # and new work is refused
    assert isinstance(err, GatewayError) and err.kind is Kind.UNAVAILABLE


# -- 14. every waiter answered exactly once ------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
async def test_every_waiter_is_answered_exactly_once(make_rig, seed):
    rng = random.Random(seed)
    slots, max_batch = 3, 16
    rig = make_rig(slots=slots, max_batch_size=max_batch, preferred=(4, 8), max_delay_s=0.0)
    n = 200
    rows = {rid: rng.randint(1, 8) for rid in range(n)}
    keys = {rid: rng.choice("AB") for rid in range(n)}  # two shape groups
    tasks: dict[int, asyncio.Task] = {}
    failed_calls: set[int] = set()

    def finish_some() -> None:
        # Complete a random subset of the running batches, in random order; ~1 in 10 fails.
        running = rig.engine.running()
        rng.shuffle(running)
        for call in running[: rng.randint(0, len(running))]:
            if rng.random() < 0.1:
                failed_calls.add(id(call))
                call.fail(RuntimeError("boom"))
            else:
                call.succeed()

    rid = 0
    while rid < n:  # submit in random-sized bursts, finishing batches in between
        for _ in range(rng.randint(1, 25)):
            if rid < n:
                tasks[rid] = rig.call(rid, rows[rid], keys[rid])
                rid += 1
        await settle(rng.randint(0, 5))
        finish_some()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + TIMEOUT
    while not all(t.done() for t in tasks.values()):
        assert loop.time() < deadline, f"{sum(not t.done() for t in tasks.values())} callers never answered"
        finish_some()
        await asyncio.sleep(0)

    # Each request went to the engine exactly once, in a batch that respected the limits.
    sent = [i for call in rig.engine.calls for i in call.ids]
    assert sorted(sent) == list(range(n))
    assert sum(sum(call.rows) for call in rig.engine.calls) == sum(rows.values())
    for call in rig.engine.calls:
        assert sum(call.rows) <= max_batch
        assert len({keys[i] for i in call.ids}) == 1
    assert rig.engine.max_running <= slots

    # Each caller got its own answer: its outputs, or FAILED if its batch failed.
    batch_failed = {i: id(call) in failed_calls for call in rig.engine.calls for i in call.ids}
    for i, task in tasks.items():
        if batch_failed[i]:
            with pytest.raises(GatewayError) as exc_info:
                task.result()
            assert exc_info.value.kind is Kind.FAILED
        else:
            assert_own_output(task.result(), i, rows[i])

    st = rig.stats
    assert st.success_count + st.fail_count == n
    assert st.fail_count == sum(batch_failed.values())
    assert st.execution_count == len(rig.engine.calls) - len(failed_calls)
    assert st.inference_count == sum(rows[i] for i in range(n) if not batch_failed[i])
    assert rig.queue.size == 0 and rig.queue.dropped == 0
    assert rig.loop_errors == []  # no exception escaped into a loop callback (e.g. double answer)
