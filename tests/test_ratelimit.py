"""The GCRA bucket and admission, driven by a clock the test controls: burst, refill, fractional
rates, costs above one, refunds, the in-flight cap, and the local share used without Redis."""

from __future__ import annotations

import pytest

from batchgate.gateway.admission import OPEN_TICKET, Admission, Limited
from batchgate.gateway.errors import GatewayError, Kind
from batchgate.gateway.admission.ratelimit import Bucket, GlobalLimiter, GlobalSpec, Rate
from batchgate.gateway.admission.tenants import ANONYMOUS, Limits, Tenant, hash_key


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


# -- the bucket -----------------------------------------------------------------------------------


def drain(bucket: Bucket, now: float, cost: float = 1) -> int:
    n = 0
    while bucket.take(cost, now) == 0.0:
        n += 1
        assert n < 10_000
    return n


def test_starts_full_and_admits_exactly_the_burst():
    b = Bucket(rate_per_s=10, burst=5)
    assert b.tokens(0.0) == pytest.approx(5)
    assert drain(b, 0.0) == 5
    wait = b.take(1, 0.0)
    assert wait == pytest.approx(0.1)  # one token every 1/rate seconds


def test_refill_at_the_rate_and_never_above_the_burst():
    b = Bucket(rate_per_s=10, burst=5)
    drain(b, 0.0)
    assert drain(b, 0.1) == 1
    assert drain(b, 0.35) == 2  # 0.25 s more: 2.5 tokens, the half stays
    assert b.take(1, 0.35) == pytest.approx(0.05)
    assert drain(b, 100.0) == 5  # a long idle time refills to the burst, not beyond


def test_wait_is_exact_for_the_next_token():
    b = Bucket(rate_per_s=4, burst=1)
    assert b.take(1, 0.0) == 0.0
    wait = b.take(1, 0.0)
    assert wait == pytest.approx(0.25)
    assert b.take(1, wait - 1e-6) > 0  # a microsecond early is refused
    assert b.take(1, wait) == 0.0  # on time is admitted


def test_fractional_rate_one_request_every_two_and_a_half_seconds():
    b = Bucket(rate_per_s=0.4, burst=1)
    assert b.take(1, 0.0) == 0.0
    assert b.take(1, 0.0) == pytest.approx(2.5)
    assert b.take(1, 2.4) == pytest.approx(0.1)
    assert b.take(1, 2.5) == 0.0
    admitted = sum(b.take(1, 2.5 + i * 0.1) == 0.0 for i in range(1, 251))  # 25 s at 10 offers/s
    assert admitted == 10


def test_fractional_burst_and_costs_above_one():
    b = Bucket(rate_per_s=100, burst=250)  # rows: 100/s, 250 at once
    assert b.take(200, 0.0) == 0.0
    assert b.take(100, 0.0) == pytest.approx(0.5)  # 50 left, needs 50 more: 0.5 s
    assert b.take(50, 0.0) == 0.0
    assert b.take(1, 0.0) == pytest.approx(0.01)
    assert b.tokens(1.0) == pytest.approx(100)
    c = Bucket(rate_per_s=3, burst=1.5)
    assert c.take(1, 0.0) == 0.0
    assert c.take(1, 0.0) == pytest.approx(1 / 6)  # half a token left, half a token to wait for


def test_long_run_rate_matches_under_steady_overload():
    b = Bucket(rate_per_s=50, burst=10)
    admitted = sum(b.take(1, i / 150) == 0.0 for i in range(150 * 20))  # 3x the rate for 20 s
    assert admitted == pytest.approx(10 + 50 * 20, abs=2)


def test_refund_gives_back_exactly_what_was_charged():
    b = Bucket(rate_per_s=10, burst=3)
    for _ in range(3):
        assert b.take(1, 0.0) == 0.0
    b.refund(1)
    assert b.take(1, 0.0) == 0.0
    assert b.take(1, 0.0) > 0


def test_oversize_cost_admitted_only_when_full_then_in_debt():
    b = Bucket(rate_per_s=10, burst=5)
    assert b.take(1, 0.0) == 0.0
    assert b.take(8, 0.0) == pytest.approx(0.1)  # not full: wait until it is
    assert b.take(8, 0.1) == 0.0  # full: admitted, 3 tokens of debt
    assert b.tokens(0.1) == pytest.approx(-3)
    assert b.take(1, 0.1 + 0.35) > 0
    assert b.take(1, 0.1 + 0.4) == 0.0


def test_charge_records_use_but_never_below_empty():
    b = Bucket(rate_per_s=10, burst=5)
    b.charge(3, 0.0)
    assert b.tokens(0.0) == pytest.approx(2)
    b.charge(100, 0.0)
    assert b.tokens(0.0) == pytest.approx(0)
    assert b.take(1, 0.1) == 0.0


def test_bad_rates_are_refused():
    with pytest.raises(ValueError):
        Bucket(0, 1)
    with pytest.raises(ValueError):
        Bucket(1, 0)


# -- admission --------------------------------------------------------------------------------------

KEY = "test-key-1"
OTHER_KEY = "test-key-2"


def tenant(name: str = "t", key: str = KEY, models=None, **limits) -> Tenant:
    local = Limits(
        requests=Rate(*limits["requests"]) if "requests" in limits else None,
        rows=Rate(*limits["rows"]) if "rows" in limits else None,
        max_in_flight=limits.get("max_in_flight"),
    )
    glob = Limits(
        requests=Rate(*limits["g_requests"]) if "g_requests" in limits else None,
        rows=Rate(*limits["g_rows"]) if "g_rows" in limits else None,
    )
    return Tenant(
        name=name,
        key_hashes=(hash_key(key).removeprefix("sha256:"),),
        models=frozenset(models) if models else None,
        default_class="bulk",
        cache_namespace=f"ns-{name}",
        limits=local,
        global_limits=glob,
        model_limits=limits.get("model_limits", {}),
    )


def md(key: str) -> tuple:
    return (("x-api-key", key),)


def test_open_admission_has_no_tenants_and_an_anonymous_ticket():
    adm = Admission()
    assert adm.open
    assert OPEN_TICKET.tenant is ANONYMOUS
    OPEN_TICKET.release()  # a no-op, any number of times
    assert adm.stats()["tenants"] == {}


async def test_ticket_carries_the_tenant():
    adm = Admission([tenant()])
    assert not adm.open
    ticket = await adm.admit(adm.identify(md(KEY)), "ranker", 4)
    assert ticket.tenant.name == "t"
    assert ticket.tenant.default_class == "bulk"
    assert ticket.tenant.cache_namespace == "ns-t"
    ticket.release()


async def test_identify_counts_unauthenticated():
    adm = Admission([tenant()])
    for metadata in ((), md("nope"), (("authorization", "Basic abc"),)):
        with pytest.raises(GatewayError) as e:
            adm.identify(metadata)
        assert e.value.kind is Kind.UNAUTHENTICATED
    assert adm.stats()["unauthenticated"] == 3
    assert adm.identify((("authorization", f"Bearer {KEY}"),)).tenant.name == "t"


async def test_model_not_allowed_is_permission_denied():
    adm = Admission([tenant(models=["ranker"])])
    acct = adm.identify(md(KEY))
    (await adm.admit(acct, "ranker", 1)).release()
    with pytest.raises(GatewayError) as e:
        await adm.admit(acct, "encoder", 1)
    assert e.value.kind is Kind.PERMISSION
    assert "encoder" in e.value.message
    assert adm.stats()["tenants"]["t"]["denied_model"] == 1


async def test_requests_per_second_with_retry_after():
    clock = Clock()
    adm = Admission([tenant(requests=(2, 2))], clock=clock)
    acct = adm.identify(md(KEY))
    for _ in range(2):
        (await adm.admit(acct, "ranker", 1)).release()
    with pytest.raises(Limited) as e:
        await adm.admit(acct, "ranker", 1)
    assert e.value.kind is Kind.EXHAUSTED
    assert e.value.retry_after_ms == 500
    assert e.value.trailing_metadata == (("retry-after-ms", "500"),)
    clock.advance(0.5)
    (await adm.admit(acct, "ranker", 1)).release()
    st = adm.stats()["tenants"]["t"]
    assert (st["admitted"], st["limited_requests"]) == (3, 1)


async def test_rows_limit_refunds_the_request_token():
    clock = Clock()
    adm = Admission([tenant(requests=(10, 3), rows=(100, 100))], clock=clock)
    acct = adm.identify(md(KEY))
    (await adm.admit(acct, "ranker", 90)).release()
    with pytest.raises(Limited) as e:
        await adm.admit(acct, "ranker", 20)  # 10 rows left: 0.1 s to wait
    assert e.value.retry_after_ms == 100
    # the refused call did not spend a request token: two more single-row calls still fit
    (await adm.admit(acct, "ranker", 5)).release()
    (await adm.admit(acct, "ranker", 5)).release()
    with pytest.raises(Limited):
        await adm.admit(acct, "ranker", 0)
    st = adm.stats()["tenants"]["t"]
    assert (st["limited_rows"], st["limited_requests"], st["rows_admitted"]) == (1, 1, 100)


async def test_request_larger_than_the_rows_burst_is_invalid_not_retryable():
    adm = Admission([tenant(rows=(100, 64))])
    acct = adm.identify(md(KEY))
    with pytest.raises(GatewayError) as e:
        await adm.admit(acct, "ranker", 65)
    assert e.value.kind is Kind.INVALID
    assert "at most 64 rows" in e.value.message


async def test_in_flight_cap_and_release_is_idempotent():
    adm = Admission([tenant(max_in_flight=2)])
    acct = adm.identify(md(KEY))
    a = await adm.admit(acct, "ranker", 1)
    b = await adm.admit(acct, "ranker", 1)
    with pytest.raises(Limited) as e:
        await adm.admit(acct, "ranker", 1)
    assert e.value.retry_after_ms > 0
    assert adm.stats()["tenants"]["t"]["in_flight"] == 2
    a.release()
    a.release()  # twice must not free two slots
    c = await adm.admit(acct, "ranker", 1)
    with pytest.raises(Limited):
        await adm.admit(acct, "ranker", 1)
    b.release()
    c.release()
    assert adm.stats()["tenants"]["t"]["in_flight"] == 0


async def test_per_model_override_has_its_own_buckets():
    clock = Clock()
    override = {"encoder": (Limits(requests=Rate(1, 1)), Limits())}
    adm = Admission([tenant(requests=(10, 5), model_limits=override)], clock=clock)
    acct = adm.identify(md(KEY))
    (await adm.admit(acct, "encoder", 1)).release()
    with pytest.raises(Limited):
        await adm.admit(acct, "encoder", 1)
    for _ in range(5):  # the tenant-wide bucket is untouched by encoder calls
        (await adm.admit(acct, "ranker", 1)).release()
    with pytest.raises(Limited):
        await adm.admit(acct, "ranker", 1)


async def test_tenants_do_not_share_buckets():
    adm = Admission(
        [tenant("a", KEY, requests=(1, 1)), tenant("b", OTHER_KEY, requests=(1, 1))], clock=Clock()
    )
    a, b = adm.identify(md(KEY)), adm.identify(md(OTHER_KEY))
    (await adm.admit(a, "ranker", 1)).release()
    with pytest.raises(Limited):
        await adm.admit(a, "ranker", 1)
    (await adm.admit(b, "ranker", 1)).release()


async def test_global_limit_without_redis_is_the_local_share():
    clock = Clock()
    adm = Admission([tenant(g_requests=(40, 10))], local_share=0.25, clock=clock)
    assert type(adm.limiter) is GlobalLimiter
    acct = adm.identify(md(KEY))
    admitted = 0
    for i in range(400):  # 4 s at 100 offers/s against a share of 10/s, burst 2.5
        clock.t = 1000.0 + i / 100
        try:
            (await adm.admit(acct, "ranker", 1)).release()
            admitted += 1
        except Limited:
            pass
    assert admitted == pytest.approx(2 + 10 * 4, abs=2)
    assert adm.stats()["global"]["fallback_decisions"] == 400


def test_share_buckets_scale_rate_and_burst():
    spec = GlobalSpec("t/*", ("k1", "k2"), Rate(100, 50), Rate(1000, 500), share=0.5)
    assert (spec.share_requests.rate_per_s, spec.share_requests.burst) == (50, 25)
    assert (spec.share_rows.rate_per_s, spec.share_rows.burst) == (500, 250)
    # interval and tolerance in microseconds for the Lua script, then the cost
    assert spec.argv(7) == ["", "10000.0", "500000.0", "1", "1000.0", "500000.0", "7"]
    # 300 rows exceed the share's burst of 250 (not the global 500): admitted while full, in debt
    assert spec.take_share(300, 0.0) == 0.0
    assert spec.share_rows.tokens(0.0) == pytest.approx(-50)
    assert spec.take_share(1, 0.0) == pytest.approx(0.102)  # 51 rows at 500/s
    assert spec.share_requests.tokens(0.0) == pytest.approx(24)  # the refused call was refunded
