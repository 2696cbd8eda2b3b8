"""The load shedder (gateway/admission/gate.py) as a state machine: no sockets; the lag, the in-flight
count, the clock and the calls' endings set by the test."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from batchgate.gateway.errors import GatewayError, Kind
from batchgate.gateway.admission.door import Door, Pass
from batchgate.gateway.admission.gate import LoadShedder, bucket, wasted


def _gate(lag_s: float, inflight: int) -> tuple[LoadShedder, SimpleNamespace, list[float]]:
    pipeline = SimpleNamespace(lag=SimpleNamespace(s=lag_s), inflight=inflight)
    gate = LoadShedder(lag_target_s=0.02, min_in_flight=32, load=pipeline)
    clock = [0.0]
    gate._loop = SimpleNamespace(call_later=lambda *a: None, time=lambda: clock[0])
    return gate, pipeline, clock


def _ticks(
    gate: LoadShedder, clock: list[float], n: int, ended: int = 0, dropped: int = 0, arrived: int = 0
) -> None:
    for _ in range(n):
        gate.arrived += arrived
        gate.ended += ended
        gate.dropped += dropped
        clock[0] += gate.TICK_S
        gate._tick()


def test_a_slow_machine_alone_is_no_overload():
    gate, _, clock = _gate(lag_s=0.5, inflight=3)  # lagging, but hardly any calls inside
    _ticks(gate, clock, 50, ended=5)
    assert not gate.shedding and gate.admit == 1.0


def test_a_lag_burst_is_no_overload_a_standing_lag_is():
    gate, p, clock = _gate(lag_s=0.1, inflight=500)
    # 20 calls end per look, 1 of them lost: under the wasted-call threshold, over the lag's
    _ticks(gate, clock, 9, ended=20, dropped=1)  # 90 ms over the target: a burst
    assert not gate.shedding
    p.lag.s = 0.001
    _ticks(gate, clock, 1, ended=20, dropped=1)
    p.lag.s = 0.1
    _ticks(gate, clock, 9, ended=20, dropped=1)
    assert not gate.shedding  # the burst clock restarted when the lag fell
    _ticks(gate, clock, 2, ended=20, dropped=1)  # now over the target for a whole 100 ms
    assert gate.shedding and gate.admit == pytest.approx(0.8, abs=0.01)
    _ticks(gate, clock, 5, ended=20, dropped=1)  # one cut per 100 ms stretch, not one per look
    assert gate.admit >= 0.79


def test_a_standing_lag_that_loses_no_call_sheds_nothing():
    """A loop that runs late while every call is answered in time is a server at work: a closed
    loop at capacity on one core lags behind its model thread and loses nothing."""
    gate, _, clock = _gate(lag_s=0.5, inflight=500)
    _ticks(gate, clock, 100, ended=20, arrived=20)
    assert not gate.shedding and gate.admit == 1.0


def test_wasted_calls_set_the_share_to_what_completes_spread_evenly_and_recovery_restores_it():
    gate, _, clock = _gate(lag_s=0.001, inflight=500)  # the loop keeps up; the calls still die
    # 40 calls arrive per 10 ms, 20 end, 6 of them dropped: 14 of 40 complete
    _ticks(gate, clock, 10, ended=20, dropped=6, arrived=40)
    assert gate.shedding and gate.admit == pytest.approx(1.05 * 14 / 40, rel=0.02)
    _ticks(gate, clock, 30, ended=20, dropped=6, arrived=40)  # drops go on: no further cut
    assert gate.admit == pytest.approx(1.05 * 14 / 40, rel=0.02)
    taken = refused = 0
    arrived, by_bucket = gate.arrived, list(gate.arrivals)
    for _ in range(1000):
        try:
            gate.check()
            taken += 1
        except GatewayError as exc:
            assert exc.kind is Kind.UNAVAILABLE and exc.outcome == "overloaded"
            assert dict(exc.trailing_metadata)["grpc-retry-pushback-ms"] == "50"
            refused += 1
    assert abs(taken - 1000 * gate.admit) <= 1  # evenly spread: every class keeps its share
    assert gate.refused == refused and gate.arrived == arrived + 1000  # each asked call counted
    gate.arrived, gate.arrivals = arrived, by_bucket  # (a thousand calls in one look: a load of their own)
    share = gate.admit
    _ticks(gate, clock, 50, ended=20, dropped=1, arrived=20)  # 5 %: under the threshold, it grows back
    assert gate.shedding and share < gate.admit < 1.0
    _ticks(gate, clock, 200, ended=20, arrived=20)
    assert not gate.shedding and gate.admit == 1.0


def test_a_few_endings_are_no_evidence():
    gate, _, clock = _gate(lag_s=0.001, inflight=500)
    _ticks(gate, clock, 20, ended=1, dropped=1)  # every call dropped, but one per 10 ms
    assert not gate.shedding


def test_what_counts_as_wasted():
    assert wasted(asyncio.CancelledError())  # the caller gave up
    assert wasted(GatewayError(Kind.DEADLINE, "shed", outcome="shed"))
    assert wasted(GatewayError(Kind.UNAVAILABLE, "queue full"))
    assert not wasted(GatewayError(Kind.UNAVAILABLE, "overloaded", outcome="overloaded"))  # the gate's own
    assert not wasted(GatewayError(Kind.INVALID, "bad input"))
    assert not wasted(GatewayError(Kind.EXHAUSTED, "rate limited"))


def test_one_callers_hopeless_deadlines_on_an_idle_server_shed_nobody():
    gate, _, clock = _gate(lag_s=0.001, inflight=2)  # every call dropped, but hardly any inside
    _ticks(gate, clock, 50, ended=20, dropped=20, arrived=20)
    assert not gate.shedding and gate.admit == 1.0


def test_while_shedding_a_call_near_its_deadline_is_taken_more_often_and_all_add_up_to_what_completes():
    gate, _, clock = _gate(lag_s=0.001, inflight=500)

    def look():  # 40 calls arrive, 8 of them with 60 ms left; 20 end, 6 dropped: 14 complete
        for i in range(40):
            gate.take(0.060 if i % 5 == 0 else gate.TIGHT_S)
        gate.ended += 20
        gate.dropped += 6
        clock[0] += gate.TICK_S
        gate._tick()

    for _ in range(60):
        look()
    a, k = gate.admit, min(gate.BOOST, int(gate.TIGHT_S / 0.060))
    assert gate.shedding and 0.15 < a < 0.3 and k > 1
    # the 60 ms calls have weight k (TIGHT_S / 0.06 s, at most BOOST): taken min(1, k a) of the
    # time; the share is what makes the two add up to what completes (plus 5 %)
    assert 8 * min(1.0, k * a) + 32 * a == pytest.approx(1.05 * 14, rel=0.02)
    arrived = gate.arrived
    taken = {0.060: 0, gate.TIGHT_S: 0, None: 0}
    for left in taken:
        for _ in range(1000):
            taken[left] += gate.take(left)
    gate.arrived = arrived
    assert abs(taken[0.060] - 1000 * min(1.0, k * a)) <= 1  # evenly spread within each weight
    assert (
        abs(taken[gate.TIGHT_S] - 1000 * a) <= 1 and abs(taken[None] - 1000 * a) <= 1
    )  # no deadline: weight 1
    before = gate.arrivals[bucket(0.001)]
    gate.take(0.001)  # a millisecond left: the highest boost (the queue refuses it, by name)
    assert gate.arrivals[bucket(0.001)] == before + 1 and gate.weight[bucket(0.001)] == gate.BOOST


def test_the_share_solves_the_weighted_sum():
    gate, _, _ = _gate(lag_s=0.001, inflight=500)
    gate.arrived, gate.arrivals[3], gate.arrivals[5] = 100.0, 10.0, 20.0  # 70 of weight 1
    gate.weight[3], gate.weight[5] = 4.0, 2.0
    for target in (5.0, 20.0, 47.0, 80.0, 99.0):
        a = gate._share(target)
        got = 10 * min(1, 4 * a) + 20 * min(1, 2 * a) + 70 * min(1, a)
        assert got == pytest.approx(target)
    assert gate._share(150.0) == 1.0  # more completes than arrives: take all


def test_a_saturated_process_sheds_wasted_calls_even_with_few_inside():
    """A sudden overload on an idle server: calls wait in gRPC core, reach Python with their
    deadlines spent and are shed at once, so few are ever inside; the CPU being all used is what
    says the server is past its ceiling."""
    gate, _, clock = _gate(lag_s=0.001, inflight=3)
    cpu = [0.0]
    gate._cpu_times = lambda: (cpu[0], cpu[0])

    def looks(n: int, busy: float) -> None:
        for _ in range(n):
            cpu[0] += busy * gate.TICK_S  # the loop's thread busy this share of each look
            gate.arrived += 40
            gate.ended += 40
            gate.dropped += 36  # nine in ten shed on arrival
            clock[0] += gate.TICK_S
            gate._tick()

    looks(30, busy=0.5)  # half idle: one caller's hopeless deadlines, not an overload
    assert not gate.shedding and gate.saturation < gate.SATURATED
    looks(30, busy=1.0)
    assert gate.saturation >= gate.SATURATED
    assert gate.shedding and gate.admit == pytest.approx(1.05 * 4 / 40, rel=0.05)


def test_while_shedding_a_call_whose_deadline_is_spent_is_refused_and_not_counted():
    gate, _, _ = _gate(lag_s=0.001, inflight=500)
    gate._set_admit(0.5)
    arrived = gate.arrived
    assert not any(gate.take(0.0) for _ in range(100))  # waited in core past its deadline
    assert gate.spent == 100 and gate.refused == 100 and gate.arrived == arrived
    assert sum(gate.take(1.0) for _ in range(100)) == 50  # live calls: the share
    gate._set_admit(1.0)
    assert gate.take(0.0)  # not shedding: the time left is not looked at (the queue refuses it)


def test_the_gate_looks_on_the_lag_monitors_heartbeat():
    """One timer for both: with the loop's lag monitor running (5 ms) the gate takes no timer of
    its own and looks on the monitor's beats, at the first beat 10 ms or more after its last look
    (every second beat when the loop is on time); stop() unsubscribes it. Checked against the
    beats themselves, not a count in a wall-clock window: under the suite's load beats come late."""
    from batchgate.gateway.scheduling import LoopLag

    async def main() -> tuple[list[float], list[float], int, bool]:
        lag = LoopLag()
        beats: list[float] = []
        lag.listeners.append(beats.append)
        lag.start()
        pipeline = SimpleNamespace(lag=lag, inflight=0)
        gate = LoadShedder(lag_target_s=0.02, min_in_flight=32, load=pipeline)
        looks: list[float] = []
        look = gate._look
        gate._look = lambda now: (looks.append(now), look(now))  # the subscription sees this one
        gate.start()
        own_timer = gate._handle is not None
        await asyncio.sleep(0.105)
        seen, beaten = list(looks), list(beats)
        gate.stop()
        await asyncio.sleep(0.03)
        lag.stop()
        return seen, beaten, len(looks), own_timer

    seen, beaten, after_stop, own_timer = asyncio.run(main())
    assert not own_timer
    assert len(beaten) >= 6 and set(seen) <= set(beaten), (seen, beaten)  # looks only on beats
    assert seen and seen[0] in beaten[:3], (seen, beaten)
    last = seen[0]
    for beat in beaten[beaten.index(last) + 1 :]:  # a look exactly when 10 ms passed since the last
        due = beat - last >= LoadShedder.TICK_S - 0.001
        assert (beat in seen) == due, (beat, last, seen)
        last = beat if due else last
    assert after_stop == len(seen)


def test_the_door_counts_each_ending_by_the_time_the_call_had_left():
    gate, _, _ = _gate(lag_s=0.001, inflight=500)
    door = Door(None, gate, None)
    door.leave(None, Pass(time_left=0.2))  # answered
    door.leave(GatewayError(Kind.DEADLINE, "expired", outcome="expired"), Pass(time_left=0.2))
    door.leave(asyncio.CancelledError(), Pass(time_left=0.04))  # its caller gave up
    door.leave(GatewayError(Kind.INVALID, "bad input"), Pass(time_left=0.04))  # no waste: answered
    door.leave(None, Pass())  # no deadline (REST, a stream's message)
    door.leave(None)  # a transport that had no pass: counted at the gate only
    assert gate.ended == 6 and gate.dropped == 2
    assert gate.outcomes[bucket(0.2)] == [2, 1] and gate.outcomes[bucket(0.04)] == [2, 1]
    assert gate.outcomes[gate.NO_DEADLINE] == [1, 1]
    assert bucket(0.2) == 8 and bucket(0.04) == 6 and bucket(0.0) == 0 and bucket(30.0) == 10


def test_while_shedding_calls_are_taken_by_the_odds_of_their_time_left():
    """A spike's backlog in gRPC core: one 250 ms class reaches the door with 40 ms left after
    waiting in core, or fresh with 200 ms. The 40 ms calls look tight (boost 8 against 3) but
    are nearly all dropped after they are taken, the fresh ones answered: the door takes the fresh
    ones, which also drains the backlog (a taken call that is dropped costs its decode and queue)."""
    gate, _, clock = _gate(lag_s=0.001, inflight=500)
    door = Door(None, gate, None)
    expired = GatewayError(Kind.DEADLINE, "expired", outcome="expired")
    for _ in range(100):
        taken = {0.04: 0, 0.2: 0}
        for i in range(60):
            left = 0.04 if i % 2 else 0.2
            taken[left] += gate.take(left)
        for _ in range(taken[0.04]):
            door.leave(expired, Pass(time_left=0.04))
        for _ in range(taken[0.2]):
            door.leave(None, Pass(time_left=0.2))
        clock[0] += gate.TICK_S
        gate._tick()
    assert gate.shedding
    w_late, w_fresh = gate.weight[bucket(0.04)], gate.weight[bucket(0.2)]
    assert w_fresh == pytest.approx(3.0, rel=0.05)  # the best odds, boosted by 500 ms / 128 ms
    assert w_late < 0.1 * w_fresh
    counts = {0.04: 0, 0.2: 0}
    for left in counts:
        for _ in range(1000):
            counts[left] += gate.take(left)
    assert counts[0.04] < 0.1 * counts[0.2]
    assert abs(counts[0.2] - 1000 * min(1.0, w_fresh * gate.admit)) <= 1


def test_a_time_left_refused_for_long_is_tried_again():
    """The odds forget (by a fiftieth per look): calls of a bucket refused while its calls were
    dropped are taken again at the boost alone once nothing of it has ended for a while."""
    gate, _, clock = _gate(lag_s=0.001, inflight=500)
    door = Door(None, gate, None)
    for _ in range(200):
        door.leave(asyncio.CancelledError(), Pass(time_left=0.04))
    door.leave(None, Pass(time_left=0.2))
    _ticks(gate, clock, 1)
    assert gate.weight[bucket(0.04)] < 0.05 * gate.BOOST
    _ticks(gate, clock, 500)  # 5 s: 200 endings decayed to under one
    assert gate.weight[bucket(0.04)] == pytest.approx(gate.BOOST, rel=0.05)


def test_a_pass_is_left_once_however_many_exits_see_it():
    """A transport's ``with door.enter(...) as pass_`` wraps the pipeline's own ``with pass_``:
    the call ends at the door once, with how it failed, whichever exit sees it first."""
    gate, _, _ = _gate(lag_s=0.001, inflight=0)
    door = Door(None, gate, None)
    with pytest.raises(GatewayError):
        with Pass(door, time_left=0.2) as outer:
            with outer:
                raise GatewayError(Kind.DEADLINE, "expired", outcome="expired")
    assert outer.ended and gate.ended == 1 and gate.dropped == 1
    assert gate.outcomes[bucket(0.2)] == [1, 0]
    with Pass(door) as answered:
        pass
    assert answered.ended and gate.ended == 2 and gate.dropped == 1
