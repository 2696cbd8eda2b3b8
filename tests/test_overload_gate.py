"""The overload gate (gateway/infer.py) as a state machine: no sockets, the lag and the in-flight
count set by the test."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from batchgate.gateway.errors import GatewayError, Kind
from batchgate.gateway.infer import OverloadGate


def _gate(lag_s: float, inflight: int) -> tuple[OverloadGate, SimpleNamespace]:
    pipeline = SimpleNamespace(plane=SimpleNamespace(lag=SimpleNamespace(s=lag_s)), inflight=inflight)
    gate = OverloadGate(pipeline, lag_target_s=0.02, min_in_flight=32)
    gate._loop = SimpleNamespace(call_later=lambda *a: None)
    return gate, pipeline


def test_a_slow_machine_alone_is_no_overload():
    gate, _ = _gate(lag_s=0.5, inflight=3)  # lagging, but hardly any calls inside
    for _ in range(50):
        gate._tick()
    assert not gate.shedding and gate.admit == 1.0


def test_overload_cuts_the_share_and_recovery_restores_it():
    gate, p = _gate(lag_s=0.1, inflight=500)
    for _ in range(10):
        gate._tick()
    assert gate.shedding and gate.admit == pytest.approx(0.8**10)
    taken = refused = 0
    for _ in range(1000):
        try:
            gate.check()
            taken += 1
        except GatewayError as exc:
            assert exc.kind is Kind.UNAVAILABLE and exc.outcome == "overloaded"
            refused += 1
    assert abs(taken - 1000 * gate.admit) <= 1  # evenly spread: every class keeps its share
    p.plane.lag.s = 0.001
    for _ in range(200):
        gate._tick()
    assert not gate.shedding and gate.admit == 1.0
