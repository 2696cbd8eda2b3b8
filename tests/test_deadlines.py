"""Deadline-aware scheduling, driven as a state machine (fake engine, controlled clock): EDF order,
class shares, shedding at admission, expiry in the queue, the closing rule, Triton priorities."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future

import numpy as np
import pytest

from batchgate.gateway.errors import GatewayError, Kind
from batchgate.gateway.scheduling import INF, LatencyModel, LoopLag, Request, SchedulePolicy, Scheduler
from batchgate.gateway.scheduling import parse_classes, resolve
from batchgate.gateway.scheduling.deadline import DeadlineQueue
from batchgate.gateway.transport.grpc import parameters_of
from batchgate.proto.inference.v2 import grpc_service_pb2 as pb
from batchgate.proto.inference.v2 import model_config_pb2 as mc
from batchgate.workers.engine import BatchTiming
from tests.test_scheduler import submit_one

CLASSES = parse_classes("realtime=25ms/100/0,standard=250ms/100/0,bulk=5000ms/100/0.2")


class Done:
    """A stand-in future for pure queue tests: done() only when cancelled."""

    def __init__(self) -> None:
        self.cancelled = False

    def done(self) -> bool:
        return self.cancelled


def make_req(name: str, cls: str, now: float, rows: int = 1, key=None, budget_s: float | None = None, level: int = 0,
             queue_deadline: float = INF, delay: bool = False) -> Request:  # fmt: skip
    c = CLASSES[cls]
    r = Request(
        {"name": name},
        rows,
        key,
        now,
        Done(),
        now + (budget_s or c.budget_s),
        c,
        level,
        queue_deadline,
        delay,
    )
    return r


def names(batch) -> list[str]:
    return [r.inputs["name"] for r in batch or []]


def trained(a: float = 0.002, b: float = 0.0001, key=None) -> LatencyModel:
    m = LatencyModel()
    for rows in (1, 4, 8, 16, 32, 1, 4, 8):
        m.observe(key, rows, a + b * rows)
    return m


def queue(max_bs: int = 8, delay: float = 0.010, latency: LatencyModel | None = None, **kw) -> DeadlineQueue:
    return DeadlineQueue(max_bs, (), delay, CLASSES, latency or trained(), **kw)


def test_latency_model_fits_intercept_and_slope():
    m = trained(0.003, 0.0002)
    a, b = m.per_row(None)
    assert a == pytest.approx(0.003, rel=1e-3) and b == pytest.approx(0.0002, rel=1e-3)
    assert m.estimate(None, 10) == pytest.approx(0.005, rel=1e-3)
    assert m.snapshot()["None"]["batches"] == 8


def test_latency_model_clips_a_one_off_spike():
    m = trained(0.002, 0.0001)
    m.observe(None, 8, 5.0)  # a GC pause or a cold shape
    assert m.estimate(None, 8) < 0.2


def test_edf_across_classes_earliest_deadline_first():
    q = queue(max_bs=1)
    q.push([make_req("bulk", "bulk", 0.0)])
    q.push([make_req("std", "standard", 0.0)])
    q.push([make_req("rt", "realtime", 0.001)])
    assert [names(q.pop_batch(1.0)[0]) for _ in range(3)] == [["rt"], ["std"], ["bulk"]]


def test_edf_within_a_class_by_budget_parameter():
    q = queue(max_bs=1)
    q.push([make_req("late", "standard", 0.0, budget_s=0.200)])
    q.push([make_req("soon", "standard", 0.0, budget_s=0.050)])
    assert names(q.pop_batch(1.0)[0]) == ["soon"]


def test_bulk_keeps_its_guaranteed_share_under_sustained_realtime_load():
    q = queue(max_bs=1)
    for i in range(5):
        q.push([make_req(f"b{i}", "bulk", 0.0)])
    served = []
    now = 0.0
    for i in range(100):
        q.push([make_req(f"r{i}", "realtime", now)])  # one new realtime request per step, forever
        served.extend(names(q.pop_batch(now)[0]))
        now += 0.0001
    bulk = [n for n in served if n.startswith("b")]
    assert len(bulk) == 5  # without the share, realtime (earlier deadlines) would starve bulk
    assert served.index(bulk[0]) < 10


def test_expired_requests_never_reach_a_batch():
    q = queue(max_bs=8)
    q.push([make_req("hopeless", "realtime", 0.0)])
    q.push([make_req("fine", "standard", 0.0)])
    expired = q.take_expired(0.030)[0]  # realtime's 25 ms has passed
    assert names(expired) == ["hopeless"]
    assert names(q.pop_batch(1.0)[0]) == ["fine"]


def test_expiry_uses_the_compute_estimate_not_just_the_clock():
    q = queue(max_bs=8, latency=trained(a=0.020, b=0.0))  # every batch takes 20 ms
    q.push([make_req("rt", "realtime", 0.0)])  # deadline 25 ms
    assert q.take_expired(0.001)[0] == []
    assert names(q.take_expired(0.006)[0]) == ["rt"]  # 19 ms left < 20 ms of compute


def test_batch_closes_when_waiting_longer_would_miss_the_most_urgent_deadline():
    q = queue(max_bs=8, delay=1.0, latency=trained(a=0.010, b=0.0))  # a long max-wait timer
    q.push([make_req("rt", "realtime", 0.0)])
    q._arrivals_per_s = 1e6  # busy model: holding would normally pay
    batch, wake = q.pop_batch(0.001, idle=True)  # the wake-up comes with the answer
    assert batch is None
    assert wake == pytest.approx(0.025 - 0.010 - q.margin_s, abs=1e-6)
    assert names(q.pop_batch(wake, idle=True)[0]) == ["rt"]


def test_idle_worker_does_not_hold_a_lone_request_when_nobody_is_coming():
    q = queue(max_bs=8, delay=1.0)
    q.push([make_req("lone", "standard", 0.0)])
    q._arrivals_per_s = 0.1  # one request every 10 s
    assert names(q.pop_batch(0.0, idle=True)[0]) == ["lone"]


def test_idle_worker_does_not_hold_when_batching_buys_nothing():
    q = queue(max_bs=8, delay=1.0, latency=trained(a=0.0, b=0.001))  # pure per-row cost
    q.push([make_req("x", "standard", 0.0)])
    q._arrivals_per_s = 1e4
    assert names(q.pop_batch(0.0, idle=True)[0]) == ["x"]


def test_busy_model_holds_for_the_timer_when_batching_pays():
    q = queue(max_bs=8, delay=0.005, latency=trained(a=0.010, b=0.0001))
    q.push([make_req("x", "bulk", 0.0)])
    q._arrivals_per_s = 1e4
    assert q.pop_batch(0.001, idle=True)[0] is None
    assert names(q.pop_batch(0.005, idle=True)[0]) == ["x"]


def _lone_call(q: DeadlineQueue, now: float, name: str = "x") -> list[str]:
    """One closed-loop caller's call on an idle worker: pushed, looked at, then (if held) taken when
    the timer says; returns the batch's names, or [] if it was held."""
    q.push([make_req(name, "bulk", now)])
    q._arrivals_per_s = 1e4  # a fast caller: the arrival rate alone promises company
    batch, wake = q.pop_batch(now, idle=True)
    if batch is not None:
        return names(batch)
    assert names(q.pop_batch(wake, idle=True)[0]) == [name]  # nobody came: it leaves alone
    return []


def test_idle_holds_stop_once_nobody_joins_them_and_a_probe_a_second_tries_again():
    """A caller whose call is held sends nothing more: holding for company it cannot bring only
    adds the max-wait timer to every call. After a few lone holds the idle worker takes a lone
    call at once, but for one probe hold per HOLD_PROBE_S."""
    q = queue(max_bs=8, delay=0.002, latency=trained(a=0.010, b=0.0001))
    now, held = 0.0, 0
    while _lone_call(q, now) == []:  # every hold scored a loss
        held += 1
        now += 0.003
        assert held < 10
    # 1.0 -> 0.8 -> 0.64 -> 0.51 -> 0.41 after four; the fifth is the first probe (0.33)
    assert held == 5 and q.hold_score < q.HOLD_PAYS
    for _ in range(50):  # no more holds for a while: each lone call leaves at once
        now += 0.001
        assert _lone_call(q, now) == ["x"]
    now += q.HOLD_PROBE_S
    assert _lone_call(q, now) == []  # the probe
    assert _lone_call(q, now + 0.003) == ["x"]


def test_holding_resumes_when_held_batches_gain_company():
    q = queue(max_bs=8, delay=0.002, latency=trained(a=0.010, b=0.0001))
    q.hold_score = 0.1  # lone calls lately
    now = 10.0
    for i in range(6):  # probes, a second apart, each joined by a second caller
        q.push([make_req("a", "bulk", now)])
        q._arrivals_per_s = 1e4
        batch, wake = q.pop_batch(now, idle=True)
        if batch is None:
            q.push([make_req("b", "bulk", now + 0.001)])
            assert names(q.pop_batch(wake, idle=True)[0]) == ["a", "b"]
        else:
            assert names(batch) == ["a"] and q.hold_score < q.HOLD_PAYS
        now += q.HOLD_PROBE_S
    assert q.hold_score >= q.HOLD_PAYS
    q.push([make_req("c", "bulk", now)])  # holding again, without waiting for a probe
    assert q.pop_batch(now + 0.0001, idle=True)[0] is None


def test_full_batch_leaves_at_once_and_merges_classes_in_edf_order():
    q = queue(max_bs=4, delay=1.0)
    for i, cls in enumerate(["bulk", "standard", "realtime", "standard"]):
        q.push([make_req(f"{cls}{i}", cls, 0.0)])
    assert names(q.pop_batch(0.0)[0]) == ["realtime2", "standard1", "standard3", "bulk0"]


def test_class_queue_bound():
    small = parse_classes("realtime=25ms/2/0")
    q = DeadlineQueue(8, (), 0.0, small, trained())

    def r(name: str) -> Request:
        return Request({"name": name}, 1, None, 0.0, Done(), 0.025, small["realtime"])

    assert q.push([r("a")]) and q.push([r("b")])
    assert not q.push([r("c")])


def test_triton_priority_levels_are_strict_before_deadlines():
    q = queue(max_bs=1)
    q.push([make_req("low-urgent", "realtime", 0.0, level=2)])
    q.push([make_req("high-relaxed", "bulk", 0.0, level=1)])
    assert names(q.pop_batch(0.0)[0]) == ["high-relaxed"]


def test_triton_delay_action_moves_timed_out_request_behind_the_rest():
    q = queue(max_bs=1)
    q.push([make_req("delayed", "bulk", 0.0, queue_deadline=0.001, delay=True)])
    q.push([make_req("other", "bulk", 0.0005)])
    assert q.take_expired(0.002)[0] == []  # DELAY: not rejected...
    assert names(q.pop_batch(0.002)[0]) == ["other"]  # ...but served after everyone else
    assert names(q.pop_batch(0.002)[0]) == ["delayed"]


def test_triton_reject_action_expires_at_the_queue_timeout():
    q = queue(max_bs=1)
    q.push([make_req("rejected", "bulk", 0.0, queue_deadline=0.001)])
    assert names(q.take_expired(0.002)[0]) == ["rejected"]


# -- budget resolution -----------------------------------------------------------------------


def _params(**kw) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest()
    for k, v in kw.items():
        if isinstance(v, str):
            req.parameters[k].string_param = v
        else:
            req.parameters[k].int64_param = v
    return parameters_of(req.parameters)


def _schedule(text: str = "") -> SchedulePolicy:
    from google.protobuf import text_format

    return SchedulePolicy.from_config(text_format.Parse(text, mc.ModelConfig()))


def test_budget_resolution_order():
    s = _schedule()
    assert resolve(_params(), None, 10.0, CLASSES, "standard", s).deadline == pytest.approx(10.25)
    b = resolve(_params(latency_class="realtime"), None, 10.0, CLASSES, "standard", s)
    assert b.cls.name == "realtime" and b.deadline == pytest.approx(10.025)
    assert resolve(
        _params(latency_budget_ms=40), None, 10.0, CLASSES, "standard", s
    ).deadline == pytest.approx(10.04)
    # The gRPC deadline wins over both.
    assert resolve(
        _params(latency_budget_ms=40), 0.5, 10.0, CLASSES, "standard", s
    ).deadline == pytest.approx(10.5)
    with pytest.raises(GatewayError) as err:
        resolve(_params(latency_class="nope"), None, 0.0, CLASSES, "standard", s)
    assert err.value.kind is Kind.INVALID and "latency_class" in err.value.message


def test_triton_priority_and_timeout_parameters():
    s = _schedule(
        "dynamic_batching { priority_levels: 3 default_priority_level: 2 "
        "default_queue_policy { default_timeout_microseconds: 100000 allow_timeout_override: true "
        "timeout_action: DELAY } }"
    )
    b = resolve(_params(), None, 0.0, CLASSES, "standard", s)
    assert b.level == 2 and b.queue_deadline == pytest.approx(0.1) and b.delay
    b = resolve(_params(priority=1, timeout=5000), None, 0.0, CLASSES, "standard", s)
    assert b.level == 1 and b.queue_deadline == pytest.approx(0.005)
    b = resolve(_params(timeout=500000), None, 0.0, CLASSES, "standard", s)  # may only lower it
    assert b.queue_deadline == pytest.approx(0.1)
    no_override = _schedule(
        "dynamic_batching { default_queue_policy { default_timeout_microseconds: 100000 } }"
    )
    assert resolve(
        _params(timeout=5000), None, 0.0, CLASSES, "standard", no_override
    ).queue_deadline == pytest.approx(0.1)


# -- the scheduler: shedding at admission, expiry, every waiter answered once ---------------------


class FakeEngine:
    def __init__(self) -> None:
        self.calls: list[tuple[list, list[int], Future]] = []

    def execute(self, parts, rows, batched) -> Future:
        f: Future = Future()
        self.calls.append((parts, rows, f))
        return f

    def finish(self, i: int) -> None:
        parts, rows, f = self.calls[i]
        f.set_result(([{"y": np.zeros((r, 1))} for r in rows], BatchTiming(infer_ns=2_000_000)))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def one_slot(calibrated: bool = False):
    """A started scheduler with one slot, its fake engine and clock, over a queue that knows a
    10 ms batch (``calibrated``: and has checked its predictions)."""
    clock, engine = Clock(), FakeEngine()
    q = DeadlineQueue(4, (), 0.0, CLASSES, trained(a=0.010, b=0.0, key=None))
    if calibrated:
        _calibrated(q)
    s = Scheduler("m", q, engine.execute, slots=1, clock=clock)
    s.start()
    return clock, engine, q, s


def budget(cls: str, now: float, budget_s: float | None = None):
    from batchgate.gateway.scheduling import Budget

    c = CLASSES[cls]
    return Budget(c, now + (budget_s or c.budget_s), 0, INF, False)


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def test_shed_at_admission_when_work_ahead_exceeds_the_budget():
    clock, engine, q, s = one_slot()
    try:
        first = asyncio.create_task(submit_one(s, {"x": 1}, 1, None, budget("standard", clock.now)))
        await _settle()
        assert len(engine.calls) == 1  # running: the slot is busy
        queued = [
            asyncio.create_task(submit_one(s, {"x": 1}, 4, None, budget("bulk", clock.now))) for _ in range(3)
        ]
        await _settle()
        # A realtime request runs before the bulk ones (EDF), so it is admitted...
        rt = asyncio.create_task(submit_one(s, {"x": 1}, 1, None, budget("realtime", clock.now)))
        await _settle()
        assert not rt.done()
        # ...but a bulk request with a 20 ms budget has 3 batches of 10 ms (same class, queued
        # earlier) plus what the running one has left ahead of it: shed at once, not queued.
        with pytest.raises(GatewayError) as err:
            await submit_one(s, {"x": 1}, 1, None, budget("bulk", clock.now, 0.020))
        assert err.value.kind is Kind.DEADLINE and "cannot be met" in err.value.message
        assert s.stats.shed == 1 and s.stats.by_class["bulk"]["shed"] == 1
        for i in range(5):
            await asyncio.wait_for(_until(lambda: len(engine.calls) > i), 2)
            engine.finish(i)
        await asyncio.wait_for(asyncio.gather(first, rt, *queued), 2)
        assert engine.calls[1][1] == [1]  # realtime went first once the slot freed
        # The shed request never reached the engine.
        assert sum(sum(rows) for _, rows, _ in engine.calls) == 1 + 1 + 12
    finally:
        await s.close()


async def _until(cond) -> None:
    while not cond():
        await asyncio.sleep(0.001)


async def test_expired_in_queue_is_answered_deadline_exceeded_and_never_computed():
    clock = Clock()
    engine = FakeEngine()
    q = DeadlineQueue(4, (), 0.0, CLASSES, trained(a=0.001, b=0.0))
    s = Scheduler("m", q, engine.execute, slots=1, clock=clock)
    s.start()
    try:
        running = asyncio.create_task(submit_one(s, {"x": 1}, 4, None, budget("bulk", clock.now)))
        await _settle()
        doomed = asyncio.create_task(submit_one(s, {"x": 2}, 1, None, budget("realtime", clock.now)))
        await _settle()
        clock.now += 0.050  # the running batch is slow; realtime's 25 ms pass while queued
        s._wake()
        err = await asyncio.wait_for(asyncio.gather(doomed, return_exceptions=True), 2)
        assert isinstance(err[0], GatewayError) and err[0].kind is Kind.DEADLINE
        assert "before compute" in err[0].message
        engine.finish(0)
        await asyncio.wait_for(running, 2)
        assert len(engine.calls) == 1 and s.stats.expired == 1
        assert s.stats.by_class["realtime"] == {"expired": 1}
    finally:
        await s.close()


async def test_every_waiter_answered_once_under_mixed_classes():
    import random

    rnd = random.Random(5)
    clock = Clock()
    engine = FakeEngine()
    q = DeadlineQueue(16, (), 0.002, CLASSES, trained())
    s = Scheduler("m", q, engine.execute, slots=2, clock=clock)
    s.start()
    try:
        tasks = []
        for i in range(200):
            cls = rnd.choice(list(CLASSES))
            tasks.append(
                asyncio.create_task(submit_one(s, {"i": i}, rnd.randint(1, 4), None, budget(cls, clock.now)))
            )
            if i % 7 == 0:
                clock.now += rnd.random() * 0.01
                s._wake()
            await asyncio.sleep(0)
            for j, (_, _, f) in enumerate(engine.calls):
                if not f.done() and rnd.random() < 0.5:
                    engine.finish(j)
        while not all(t.done() for t in tasks):
            for j, (_, _, f) in enumerate(engine.calls):
                if not f.done():
                    engine.finish(j)
            clock.now += 0.001
            s._wake()
            await asyncio.sleep(0.001)
        results = [t.exception() if t.exception() else "ok" for t in tasks]
        assert all(r == "ok" or (isinstance(r, GatewayError) and r.kind is Kind.DEADLINE) for r in results)
        computed = sum(len(rows) for _, rows, _ in engine.calls)
        assert computed == results.count("ok")  # each answered request computed exactly once
        st = s.stats
        assert st.success_count + st.shed + st.expired == 200
    finally:
        await s.close()


def _calibrated(q: DeadlineQueue) -> DeadlineQueue:
    """As after calls whose real times matched their predictions: decisions at the edge trusted
    (an unchecked prediction refuses only when half of it already misses)."""
    for _ in range(q.CALIBRATE_AFTER):
        q.calibrate(1.0, 1.0)
    return q


async def test_shedding_counts_what_the_running_batch_has_left():
    clock, engine, q, s = one_slot(calibrated=True)
    try:
        first = asyncio.create_task(submit_one(s, {"x": 1}, 1, None, budget("bulk", clock.now)))
        await _settle()
        assert len(engine.calls) == 1  # a 10 ms batch runs from clock 100.000
        clock.now += 0.001  # 9 ms left: 9 + 10 ms own compute + margin > a 14 ms budget
        with pytest.raises(GatewayError) as err:
            await submit_one(s, {"x": 1}, 1, None, budget("realtime", clock.now, 0.014))
        assert err.value.kind is Kind.DEADLINE
        clock.now += 0.008  # 1 ms left: 1 + 10 + margin fits 14 ms (counting half of 10 would not)
        late = asyncio.create_task(submit_one(s, {"x": 1}, 1, None, budget("realtime", clock.now, 0.014)))
        await _settle()
        assert not late.done() and s.stats.shed == 1
        engine.finish(0)
        await asyncio.wait_for(_until(lambda: len(engine.calls) > 1), 2)
        engine.finish(1)
        await asyncio.wait_for(asyncio.gather(first, late), 2)
    finally:
        await s.close()


def test_non_finite_parameters_are_refused_not_crashed():
    s = _schedule("dynamic_batching { priority_levels: 2 }")
    for name in ("priority", "latency_budget_ms", "timeout"):
        req = pb.ModelInferRequest()
        req.parameters[name].double_param = float("nan")
        with pytest.raises(GatewayError) as err:
            resolve(parameters_of(req.parameters), None, 0.0, CLASSES, "standard", s)
        assert err.value.kind is Kind.INVALID and name in err.value.message
    req = pb.ModelInferRequest()
    req.parameters["priority"].double_param = float("inf")
    with pytest.raises(GatewayError):
        resolve(parameters_of(req.parameters), None, 0.0, CLASSES, "standard", s)


def test_fill_stops_before_the_batch_would_make_its_most_urgent_request_late():
    # 10 ms per batch plus 2 ms per row: a realtime request (25 ms) can share with a few rows only.
    q = queue(max_bs=64, delay=0.0, latency=trained(a=0.010, b=0.002), cap_fraction=0.75)
    q.push([make_req("rt", "realtime", 0.0)])
    for i in range(20):
        q.push([make_req(f"bulk{i}", "bulk", 0.0)])
    batch = names(q.pop_batch(0.0)[0])
    assert batch[0] == "rt"
    # rt + n rows must finish by 25 ms: 10 + 2*(n+1) <= 25 - margin -> n <= 6; and the batch-time
    # cap (0.75 of realtime's 25 ms less the margin while realtime is active) allows
    # 10 + 2*rows <= 18.4 -> 4 rows.
    assert len(batch) == 4
    rest = names(q.pop_batch(0.0)[0])
    assert rest and all(n.startswith("bulk") for n in rest)


def test_default_batch_time_cap_is_half_the_tightest_budget():
    # At the default 0.5, a realtime request that arrives as a batch starts waits at most the cap,
    # then runs in a batch of at most the cap: 10 + 2*rows <= 12.25 ms -> it leaves alone.
    q = queue(max_bs=64, delay=0.0, latency=trained(a=0.010, b=0.002))
    q.push([make_req("rt", "realtime", 0.0)])
    for i in range(20):
        q.push([make_req(f"bulk{i}", "bulk", 0.0)])
    assert q._batch_time_cap(0.0) == pytest.approx(0.5 * (0.025 - q.margin_s))
    assert names(q.pop_batch(0.0)[0]) == ["rt"]
    assert len(q.pop_batch(0.0)[0]) == 1  # bulk too, while realtime was seen within the last second
    assert len(q.pop_batch(2.0)[0]) == 19  # realtime quiet for 1 s: no cap, the rest in one batch


def test_loop_lag_widens_the_margin_of_every_deadline_decision():
    lag = LoopLag()
    q = queue(max_bs=8, latency=trained(a=0.010, b=0.0), lag=lag)
    q.push([make_req("rt", "realtime", 0.0)])  # deadline 25 ms, 10 ms compute
    assert q.take_expired(0.010)[0] == []  # 15 ms left
    lag.mean = lag.s = 0.004  # the loop runs 4 ms late: 8 ms of the 15 go to getting in and out
    assert names(q.take_expired(0.010)[0]) == ["rt"]


def test_a_jittery_loop_drops_on_its_expected_lag_not_its_high_quantile():
    """Dropping a call is a prediction that it would miss: the loop's mean lag, not the bound its
    deviation adds (which plans batches), or a loaded machine drops calls that would have made it."""
    lag = LoopLag()
    q = queue(max_bs=8, latency=trained(a=0.010, b=0.0), lag=lag)
    q.push([make_req("rt", "realtime", 0.0)])  # deadline 25 ms, 10 ms compute
    lag.mean, lag.s = 0.001, 0.006  # usually 1 ms late, now and then far more
    assert q.take_expired(0.010)[0] == []  # 15 ms left: 10 compute + 2 expected lag fit
    assert q.wake_at([]) is None
    lag.mean = 0.003
    assert names(q.take_expired(0.010)[0]) == ["rt"]  # 10 + 6 > 15


def test_loop_lag_monitor_sees_a_blocked_loop():
    async def main() -> float:
        lag = LoopLag(interval_s=0.002, alpha=0.5)
        lag.start()
        await asyncio.sleep(0.02)
        quiet = lag.s
        for _ in range(5):
            time.sleep(0.01)  # block the loop: each tick runs ~10 ms late
            await asyncio.sleep(0)
        lag.stop()
        return quiet, lag.s

    quiet, blocked = asyncio.run(main())
    assert blocked > 0.005 and blocked > quiet


def test_least_laxity_first_a_slow_bucket_starts_before_a_fast_one_with_the_same_budget():
    m = LatencyModel()
    for rows in (1, 2, 1, 2, 1, 2):
        m.observe("long", rows, 0.060 * rows)  # 60 ms a row
        m.observe("short", rows, 0.004 * rows)  # 4 ms a row
    q = queue(max_bs=1, latency=m)
    q.push([make_req("short", "standard", 0.000, key="short")])
    q.push([make_req("long", "standard", 0.010, key="long")])  # 10 ms later, same 250 ms budget
    # EDF alone would run "short" first (deadline 250 < 260 ms); the long one must start by
    # 260 - 60 = 200 ms, the short one by 246 ms: the long one goes first and both make it.
    assert [names(q.pop_batch(0.02)[0]) for _ in range(2)] == [["long"], ["short"]]


def test_row_limit_holds_a_batch_to_the_token_budget_of_its_bucket():
    q = queue(max_bs=64, delay=0.0, row_limit=lambda key: 1024 // key, learn_limit=False)
    for i in range(20):
        q.push([make_req(f"t{i}", "standard", 0.0, key=256)])
    sizes = [len(q.pop_batch(0.0)[0]) for _ in range(5)]
    assert sizes == [4, 4, 4, 4, 4]  # 4 rows x 256 tokens = the 1024-token budget


def test_latency_model_learns_where_batching_stops_paying():
    m = LatencyModel()
    for rows in (1, 2, 4, 8) * 4:
        m.observe("few", rows, 0.060 * rows)
    assert m.useful_rows("few") is None  # 16 batches: too few to learn from
    for _ in range(6):
        for rows in (1, 2, 4, 8):
            m.observe("gpu", rows, 0.010 + 0.0001 * rows)  # a big fixed cost: batching always pays
            m.observe("long", rows, 0.060 * rows)  # no fixed cost: a row costs the same alone
            m.observe("short", rows, 0.0012 + 0.0034 * rows)  # minilm at 16 tokens, 1 thread
    assert m.useful_rows("gpu") > 64
    assert m.useful_rows("long") == 1
    # doubling past n saves a/2n per row; worth it while >= 2% of a row: n <= 0.48a / 0.02b ~ 8.5
    assert m.useful_rows("short") == 9
    assert m.useful_rows("unseen") is None
    # under the limit of 1 sizes stop varying: the spread decays and the limit lifts, so the next
    # busy moment probes a bigger batch (a limit learned from noise does not stand for ever) ...
    for _ in range(300):
        m.observe("long", 1, 0.060)
    assert m.useful_rows("long") is None
    # ... and a probe that shows no gain puts it back
    m.observe("long", 8, 0.480)
    assert m.useful_rows("long") == 1


def test_learned_limit_runs_slow_bucket_rows_one_by_one():
    m = LatencyModel()
    for _ in range(8):
        for rows in (1, 2, 4):
            m.observe(256, rows, 0.060 * rows)
    q = queue(max_bs=64, delay=0.0, latency=m)
    for i in range(3):
        q.push([make_req(f"t{i}", "bulk", 0.0, key=256)])
    assert [len(q.pop_batch(0.0)[0]) for _ in range(3)] == [1, 1, 1]
    off = queue(max_bs=64, delay=0.0, latency=m, learn_limit=False)
    for i in range(3):
        off.push([make_req(f"t{i}", "bulk", 0.0, key=256)])
    assert len(off.pop_batch(0.0)[0]) == 3


def test_fixed_margin_never_takes_more_than_a_fifth_of_a_budget():
    q = queue(max_bs=8, latency=trained(a=0.0015, b=0.0), margin_s=0.004)
    q.push([make_req("tight", "realtime", 0.0, budget_s=0.005)])  # 5 ms budget, 1.5 ms compute
    q.push([make_req("rt", "realtime", 0.0)])  # 25 ms budget
    # 5 ms keeps 1 ms (not 4) for the network and the caller: 1.5 ms of compute still fits
    assert q.due(q._lanes[None]["realtime"].heap[0][3]) == pytest.approx(0.004)
    assert q.take_expired(0.0)[0] == []
    assert names(q.take_expired(0.0026)[0]) == ["tight"]  # 2.6 + 1.5 > 4
    # the 25 ms request keeps the full 4 ms: due at 21 ms
    assert q.take_expired(0.0194)[0] == [] and names(q.take_expired(0.0196)[0]) == ["rt"]


# -- the admission estimate: right at capacity ----------------------------------------------------


def _two_buckets(a: float, b: float) -> LatencyModel:
    m = LatencyModel()
    for key in ("short", "long"):
        for rows in (1, 4, 8, 16, 32, 1, 4, 8):
            m.observe(key, rows, a + b * rows)
    return m


def test_a_part_that_joins_queued_work_of_its_bucket_costs_its_rows_not_a_batch():
    """A many-text call is one request per length bucket. Queued behind work of the same buckets,
    each part rides in a batch that runs anyway: charging each a batch of its own (intercept
    included) put a 32-text call at twice its real time and refused callers at capacity."""
    q = _calibrated(DeadlineQueue(64, (), 0.0, CLASSES, _two_buckets(a=0.050, b=0.001)))
    ahead = [make_req(f"a{i}", "standard", 0.0, rows=4, key=k) for i, k in enumerate(("short", "long"))]
    assert q.push(ahead)
    # queued ahead: one batch per bucket, 2 x (50 + 4) ms = 108 ms; this call's two parts join
    # those batches: 2 x 4 ms more, 116 ms in all. A budget of 120 ms fits (charged as batches
    # of their own: 108 + 2 x 54 = 216 ms, refused).
    call = [make_req(f"c{k}", "standard", 0.0, rows=4, key=k, budget_s=0.120) for k in ("short", "long")]
    assert q.refuse(call, 0.0, 0.0, 1) is None
    # with nothing of its buckets queued a part pays its batch
    q2 = _calibrated(DeadlineQueue(64, (), 0.0, CLASSES, _two_buckets(a=0.050, b=0.001)))
    lone = [make_req(f"l{k}", "standard", 0.0, rows=4, key=k, budget_s=0.090) for k in ("short", "long")]
    assert q2.refuse(lone, 0.0, 0.0, 1) is None  # nothing ahead: one probe a second is let through
    refusal = q2.refuse(lone, 0.0, 0.0, 1)
    assert refusal is not None and refusal.own_s == pytest.approx(0.108, rel=1e-3)


def _buckets(keys, a: float, b: float) -> LatencyModel:
    m = LatencyModel()
    for key in keys:
        for rows in (1, 4, 8, 16, 32, 1, 4, 8):
            m.observe(key, rows, a + b * rows)
    return m


def test_a_request_waits_only_for_the_buckets_whose_heads_come_before_its_batch():
    """Single texts of mixed lengths at capacity: one queued in each of five buckets, oldest first.
    A new text of the oldest bucket rides in that bucket's next batch, which the batcher picks
    first: only that batch runs before it answers, not the four later buckets' batches (charged
    all of them, it was predicted five batches and refused though it would have made it). A text
    of a new bucket, or one that does not fit its bucket's next batch, waits for everything."""
    keys = ("k0", "k1", "k2", "k3", "k4")
    q = _calibrated(DeadlineQueue(4, (), 0.0, CLASSES, _buckets(keys + ("new",), a=0.050, b=0.001)))
    for i, k in enumerate(keys):
        assert q.push([make_req(f"q{k}", "standard", 0.001 * i, rows=1, key=k)])
    now = 0.010
    ahead = q.work_ahead_s(make_req("x", "standard", now, key="k0"))
    assert ahead == pytest.approx(5 * 0.051)
    # k0's batch (its queued row) only; its own row is the call's own compute
    assert q.work_before_s([make_req("j", "standard", now, rows=1, key="k0")]) == pytest.approx(0.051)
    # k2's batch runs after k0's and k1's
    assert q.work_before_s([make_req("j", "standard", now, rows=1, key="k2")]) == pytest.approx(3 * 0.051)
    # a bucket of its own: every head is older than it
    assert q.work_before_s([make_req("n", "standard", now, rows=1, key="new")]) == pytest.approx(ahead)
    # four rows do not fit k0's next batch (4 rows a batch, one queued): all the work ahead
    assert q.work_before_s([make_req("big", "standard", now, rows=4, key="k0")]) == pytest.approx(ahead)
    # a call of two parts waits for its latest part's batch
    call = [make_req(f"c{k}", "standard", now, rows=1, key=k) for k in ("k0", "k3")]
    assert q.work_before_s(call) == pytest.approx(4 * 0.051)
    # so a 200 ms budget is refused for a k4 text (5 x 51 ahead + 1 own) and taken for a k0 one
    assert q.refuse([make_req("t4", "standard", now, rows=1, key="k4", budget_s=0.2)], now, 0.0, 1)
    assert q.refuse([make_req("t0", "standard", now, rows=1, key="k0", budget_s=0.2)], now, 0.0, 1) is None


def test_predictions_are_scaled_by_how_they_compared_with_real_times():
    """Refused only where even the low end of (real / predicted) lately says the call misses:
    unchecked predictions refuse only a call that half of its prediction already misses; checked
    ones that ran 40 % high stop refusing calls that would make it."""
    q = queue(latency=trained(0.0, 0.010))
    assert q.push([make_req(f"w{i}", "standard", 0.0, rows=1) for i in range(20)])  # 200 ms ahead
    call = [make_req("c", "standard", 0.0, rows=1, budget_s=0.180)]
    assert q.refuse(call, 0.0, 0.0, 1) is None  # unchecked: 210 ms predicted, half of it fits 180
    assert q.refuse([make_req("h", "standard", 0.0, rows=1, budget_s=0.090)], 0.0, 0.0, 1) is not None
    predicted = q.prediction
    for _ in range(q.CALIBRATE_AFTER):
        q.calibrate(predicted, predicted)  # predictions matched what happened
    assert q.refuse(call, 0.0, 0.0, 1) is not None  # now trusted: 210 ms misses 180
    for _ in range(60):
        q.calibrate(predicted, 0.6 * predicted)  # calls like it took 60 % of their prediction
    n, mean, dev = q.ratio()
    assert mean == pytest.approx(0.6, abs=0.01) and dev < 0.01
    assert q.refuse(call, 0.0, 0.0, 1) is None  # 0.6 x 210 ms fits 180
    # ... while a call that misses even then is still refused
    assert q.refuse([make_req("t", "standard", 0.0, rows=1, budget_s=0.080)], 0.0, 0.0, 1) is not None


def test_a_scattered_estimate_refuses_only_what_misses_even_at_its_best_recent_ratio():
    """At capacity on a shared core the same queue ran from a quarter to three times its
    prediction, mostly slower (mean 1.4): the mean less twice its deviation (above 1) refused
    calls predicted just past their budget, most of which made it. Only a call that misses even
    at the best recent ratio is refused."""
    q = queue(latency=trained(0.0, 0.010))
    assert q.push([make_req(f"w{i}", "standard", 0.0, rows=1) for i in range(20)])  # 200 ms ahead
    for i in range(q.RATIO_WINDOW):
        q.calibrate(1.0, 0.3 if i % 16 == 5 else (1.4, 1.5, 1.6)[i % 3])
    n, mean, dev = q.ratio()
    assert mean > 1.2 and mean - 2 * dev > 0.9  # what used to be taken as the low end: 210 x it > 180
    # predicted 210 ms against 180: at 0.3x it would make it, so it is taken
    assert q.refuse([make_req("c", "standard", 0.0, rows=1, budget_s=0.180)], 0.0, 0.0, 1) is None
    # against 50 ms it misses even at 0.3x (63 ms): refused
    assert q.refuse([make_req("h", "standard", 0.0, rows=1, budget_s=0.050)], 0.0, 0.0, 1) is not None
    # the window forgets: once the slow ratios are all that is left, 210 ms misses 180 again
    for _ in range(q.RATIO_WINDOW):
        q.calibrate(1.0, 1.2)
    assert q.refuse([make_req("c2", "standard", 0.0, rows=1, budget_s=0.180)], 0.0, 0.0, 1) is not None


async def test_an_admitted_call_that_expires_still_calibrates_the_estimate():
    """A call admitted near its deadline that then expires took at least until its deadline: a
    censored comparison, without which a spike whose admitted calls all expire would never
    calibrate and the queue would go on admitting calls that expire."""
    clock, engine, q, s = one_slot()
    try:
        running = asyncio.create_task(submit_one(s, {"x": 1}, 1, None, budget("bulk", clock.now)))
        await _settle()
        # 10 ms running + 10 ms own against 14 ms: predicted at 20, admitted while unchecked
        doomed = asyncio.create_task(submit_one(s, {"x": 2}, 1, None, budget("realtime", clock.now, 0.014)))
        await _settle()
        assert not doomed.done() and q.ratio()[0] == 0
        clock.now += 0.050  # the running batch is slow: the 14 ms pass while queued
        s._wake()
        (err,) = await asyncio.wait_for(asyncio.gather(doomed, return_exceptions=True), 2)
        assert isinstance(err, GatewayError) and err.kind is Kind.DEADLINE
        n, mean, _ = q.ratio()
        assert n == 1 and mean >= 0.014 / 0.020 - 1e-9  # at least to its deadline over the prediction
        engine.finish(0)
        await asyncio.wait_for(running, 2)
    finally:
        await s.close()
