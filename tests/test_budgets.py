"""Latency budgets that cannot be met: below the floor (``MIN_BUDGET_MS``) they are invalid input
wherever they come from (tests/test_tei_surface.py checks the REST header and body field live);
one the model's own compute alone exceeds is shed saying so, with no retry hint (waiting cannot
help), while one that the work queued ahead makes late keeps its hint. The scheduler here is the
real one over a fake engine and clock (tests/test_deadlines.py's)."""

from __future__ import annotations

import asyncio
import math

import pytest

from batchgate.gateway.errors import GatewayError, Kind
from batchgate.gateway.scheduling.request import MIN_BUDGET_MS, resolve
from tests.test_deadlines import CLASSES, _schedule, _settle, budget, one_slot
from tests.test_scheduler import submit_one


@pytest.mark.parametrize("value", [5e-324, 0.5, 0, -1, math.inf, math.nan, "soon"])
def test_a_budget_parameter_under_the_floor_is_invalid(value):
    with pytest.raises(GatewayError) as err:
        resolve({"latency_budget_ms": value}, None, 0.0, CLASSES, "standard", _schedule())
    assert err.value.kind is Kind.INVALID and "latency_budget_ms" in err.value.message
    assert f"at least {MIN_BUDGET_MS:g}" in err.value.message


def test_the_floor_itself_is_a_budget():
    b = resolve({"latency_budget_ms": MIN_BUDGET_MS}, None, 0.0, CLASSES, "standard", _schedule())
    assert b.deadline == pytest.approx(MIN_BUDGET_MS / 1000)


async def test_a_budget_below_the_models_own_compute_is_shed_without_a_retry_hint():
    clock, engine, q, s = one_slot(calibrated=True)  # the model knows a 10 ms batch
    try:
        running = asyncio.create_task(submit_one(s, {"x": 1}, 1, None, budget("standard", clock.now)))
        await _settle()
        assert len(engine.calls) == 1  # the slot is busy: 10 ms of work ahead of the next call
        with pytest.raises(GatewayError) as late:  # 15 ms: the work ahead makes it late, not its own
            await submit_one(s, {"x": 1}, 1, None, budget("bulk", clock.now, 0.015))
        assert late.value.kind is Kind.DEADLINE and late.value.retry_after_s is not None
        assert "retry in" in late.value.message
        with pytest.raises(GatewayError) as never:  # 5 ms: its own 10 ms compute alone exceeds it
            await submit_one(s, {"x": 1}, 1, None, budget("bulk", clock.now, 0.005))
        e = never.value
        assert e.kind is Kind.DEADLINE and e.retry_after_s is None and not getattr(e, "trailing_metadata", ())
        assert "not even an idle server" in e.message and "retry" not in e.message
        engine.finish(0)
        await asyncio.wait_for(running, 2)
    finally:
        await s.close()
