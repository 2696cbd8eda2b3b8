"""The cache's parts alone: key derivation, the LRU's byte budget, the breaker on a controlled
clock, single-flight. No sockets, no sleeping."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import xxhash

from batchgate.cache import ENTRY_OVERHEAD, KEY_BYTES, Breaker, MemoryCache, SingleFlight, State
from batchgate.cache import model_prefix, row_keys, row_keys_parts

# -- keys ---------------------------------------------------------------------------------------------

INPUTS = [("dense", "FP32", (4,)), ("ids", "INT64", (2,))]


def _prefix(**changes) -> bytes:
    args = dict(model="m", version="1", fingerprint="abcd", outputs=("score",), inputs=INPUTS, namespace=None)
    args.update(changes)
    return model_prefix(**args)


def _rows(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 4), dtype=np.float32), rng.integers(0, 100, (n, 2), dtype=np.int64)


def test_key_is_xxh3_128_of_prefix_and_row_bytes():
    dense, ids = _rows(3)
    p = _prefix()
    keys = row_keys(p, [dense, ids], 3)
    assert len(p) == KEY_BYTES and all(len(k) == KEY_BYTES for k in keys)
    for r in range(3):
        assert keys[r] == xxhash.xxh3_128_digest(p + dense[r].tobytes() + ids[r].tobytes())


def test_key_depends_on_each_row_alone():
    dense, ids = _rows(5)
    keys = row_keys(_prefix(), [dense, ids], 5)
    assert len(set(keys)) == 5
    # The same row in another request, at another position, among other rows: same key.
    other_dense, other_ids = _rows(4, seed=9)
    other_dense[2], other_ids[2] = dense[1], ids[1]
    assert row_keys(_prefix(), [other_dense, other_ids], 4)[2] == keys[1]
    # A single byte of one input changes the key of that row only.
    dense2 = dense.copy()
    dense2[3, 0] = np.nextafter(dense2[3, 0], np.float32(np.inf))
    keys2 = row_keys(_prefix(), [dense2, ids], 5)
    assert [a == b for a, b in zip(keys, keys2)] == [True, True, True, False, True]


def test_non_contiguous_views_hash_like_their_copies():
    dense, ids = _rows(6)
    view = dense[::2]
    assert not view.flags.c_contiguous
    assert row_keys(_prefix(), [view, ids[::2]], 3) == row_keys(_prefix(), [view.copy(), ids[::2].copy()], 3)


@pytest.mark.parametrize(
    "change",
    [
        {"model": "m2"},
        {"version": "2"},
        {"fingerprint": "abce"},
        {"outputs": ("score", "extra")},
        {"outputs": ()},
        {"namespace": "tenant-a"},
        {"namespace": ""},
        {"inputs": [("dense", "FP32", (4,)), ("ids", "INT32", (2,))]},  # dtype
        {"inputs": [("dense", "FP32", (2, 2)), ("ids", "INT64", (2,))]},  # same bytes, other shape
        {"inputs": [("ids", "FP32", (4,)), ("dense", "INT64", (2,))]},  # names
    ],
)
def test_prefix_covers_every_part_of_the_identity(change):
    assert _prefix(**change) != _prefix()


def test_prefix_fields_cannot_run_into_each_other():
    # Length-prefixed fields: moving a character between model and version changes the key.
    assert _prefix(model="ab", version="c") != _prefix(model="a", version="bc")
    assert _prefix(namespace="a") != _prefix(namespace="b")
    assert _prefix(namespace="t") == _prefix(namespace="t")


def test_variable_length_parts_are_length_prefixed():
    p = _prefix()
    a = row_keys_parts(p, [[b"ab"], [b"c"]], 1)
    b = row_keys_parts(p, [[b"a"], [b"bc"]], 1)
    assert a != b
    assert row_keys_parts(p, [[b"ab", b"x"], [b"c", b"y"]], 2)[0] == a[0]


# -- memory tier ----------------------------------------------------------------------------------------


def _entry(key: bytes, value: bytes) -> int:
    return len(key) + len(value) + ENTRY_OVERHEAD


def test_lru_stays_within_its_byte_budget_and_evicts_least_recent():
    key = lambda i: i.to_bytes(16, "little")  # noqa: E731
    value = b"v" * 100
    per = _entry(key(0), value)
    m = MemoryCache(max_bytes=per * 10)
    m.put_many([key(i) for i in range(10)], [value] * 10)
    assert len(m) == 10 and m.bytes == per * 10
    assert m.get(key(0)) == value  # 0 becomes most recent
    m.put(key(10), value)  # over budget by one entry: the least recent (1) goes
    assert m.bytes <= m.max_bytes
    assert key(1) not in m and key(0) in m and key(10) in m
    assert m.stats.evictions == 1
    # A bigger value evicts as many as needed.
    m.put(key(11), b"w" * (per * 3))
    assert m.bytes <= m.max_bytes
    assert [key(i) in m for i in (2, 3, 4, 5)] == [False] * 4
    assert m.stats.evictions == 5


def test_lru_replacing_a_key_accounts_bytes_once_and_refuses_oversized():
    m = MemoryCache(max_bytes=1000)
    m.put(b"k" * 16, b"a" * 10)
    m.put(b"k" * 16, b"b" * 20)
    assert len(m) == 1 and m.bytes == _entry(b"k" * 16, b"b" * 20)
    m.put(b"z" * 16, b"x" * 2000)  # larger than the budget: never stored, nothing evicted for it
    assert b"z" * 16 not in m and len(m) == 1 and m.stats.rejected == 1
    assert MemoryCache(0).get_many([b"a"]) == [None]


def test_lru_get_many_counts_hits_and_misses():
    m = MemoryCache(10_000)
    m.put_many([b"a", b"b"], [b"1", b"2"])
    assert m.get_many([b"a", b"x", b"b", b"a"]) == [b"1", None, b"2", b"1"]
    assert (m.stats.hits, m.stats.misses) == (3, 1)


# -- breaker ----------------------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_breaker_opens_after_failures_in_a_row_and_probes_back():
    clock = Clock()
    b = Breaker(failures_to_open=3, open_s=2.0, clock=clock)
    for _ in range(2):
        assert b.allow()
        b.failure()
    assert b.allow()
    b.success()  # a success resets the count
    for _ in range(2):
        b.failure()
    assert b.state is State.CLOSED
    b.failure()
    assert b.state is State.OPEN and b.opens == 1
    assert not b.allow() and b.rejected == 1
    clock.t += 1.999
    assert not b.allow()
    clock.t += 0.002
    assert b.allow()  # the probe
    assert b.state is State.HALF_OPEN and b.probes == 1
    assert not b.allow()  # only one probe at a time
    b.failure()  # probe failed: open for another open_s
    assert b.state is State.OPEN and b.opens == 2
    assert not b.allow()
    clock.t += 2.0
    assert b.allow()
    b.success()
    assert b.state is State.CLOSED and b.allow() and b.allow()


def test_breaker_gives_up_on_a_probe_that_never_reports():
    clock = Clock()
    b = Breaker(failures_to_open=1, open_s=1.0, clock=clock)
    b.failure()
    clock.t += 1.0
    assert b.allow()  # probe whose caller is then cancelled: it never reports
    clock.t += 0.5
    assert not b.allow()
    clock.t += 0.5
    assert b.allow()  # a new probe
    assert b.probes == 2


def test_breaker_ignores_late_failures_while_open():
    clock = Clock()
    b = Breaker(failures_to_open=1, open_s=1.0, clock=clock)
    b.failure()
    b.failure()  # a call let through before it opened, failing late: does not extend the open time
    assert b.opens == 1
    clock.t += 1.0
    assert b.allow()


def test_breaker_rejects_nonsense():
    with pytest.raises(ValueError):
        Breaker(failures_to_open=0)
    with pytest.raises(ValueError):
        Breaker(open_s=0)


# -- single-flight ----------------------------------------------------------------------------------------


async def test_single_flight_waiters_get_the_owners_values():
    sf = SingleFlight()
    f = sf.begin([b"a", b"b"])
    assert sf.find(b"a") is f and sf.find(b"b") is f and sf.find(b"c") is None
    assert (f.index(b"a"), f.index(b"b")) == (0, 1)
    waiters = [asyncio.create_task(sf.wait([f])) for _ in range(3)]
    await asyncio.sleep(0)
    assert not any(w.done() for w in waiters)
    sf.finish(f, [b"A", b"B"])
    assert len(sf) == 0  # keys leave the map in the same step
    await asyncio.gather(*waiters)
    assert f.values == [b"A", b"B"] and not f.abandoned


async def test_single_flight_fail_and_abandon_end_the_wait():
    sf = SingleFlight()
    f1, f2 = sf.begin([b"a"]), sf.begin([b"b"])
    w = asyncio.create_task(sf.wait([f1, f2]))
    await asyncio.sleep(0)
    err = RuntimeError("model failed")
    sf.fail(f1, err)
    await asyncio.sleep(0)
    assert not w.done()  # still waiting for f2
    sf.abandon(f2)
    await w
    assert f1.error is err and f2.abandoned
    assert sf.find(b"a") is None and sf.find(b"b") is None
    sf.finish(f2, [b"late"])  # ending twice changes nothing
    assert f2.values is None


async def test_single_flight_cancelled_waiter_cancels_nothing_shared():
    sf = SingleFlight()
    f = sf.begin([b"a"])
    w1 = asyncio.create_task(sf.wait([f]))
    w2 = asyncio.create_task(sf.wait([f]))
    await asyncio.sleep(0)
    w1.cancel()
    await asyncio.sleep(0)
    sf.finish(f, [b"A"])
    await w2
    assert w1.cancelled() and f.values == [b"A"]


async def test_single_flight_wait_on_ended_flights_returns_at_once():
    sf = SingleFlight()
    f = sf.begin([b"a"])
    sf.finish(f, [b"A"])
    await asyncio.wait_for(sf.wait([f]), 0.1)


def test_row_keys_with_a_prebuilt_prefix_block_of_any_size():
    from batchgate.cache import prefix_rows

    dense, ids = _rows(9)
    p = _prefix()
    want = row_keys(p, [dense, ids], 9)
    assert row_keys(p, [dense, ids], 9, prefix_rows(p, 64)) == want
    assert row_keys(p, [dense, ids], 9, prefix_rows(p, 4)) == want  # too small: built for the call
