"""The per-row flow of gateway/result_cache.py driven without sockets: a hand-made model spec, a fake
compute the test gates with events, the real memory tier and single-flight."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from batchgate.cache import MemoryCache, TieredCache
from batchgate.gateway.result_cache import ModelCache
from batchgate.gateway.errors import GatewayError, Kind
from batchgate.gateway.repository import ModelSpec, TensorSpec
from batchgate.proto.inference.v2 import model_config_pb2 as mc


def _spec(inputs, outputs, max_batch_size=64, name="m", version="1", fingerprint="f00d") -> ModelSpec:
    config = mc.ModelConfig(name=name, max_batch_size=max_batch_size)
    config.response_cache.enable = True
    return ModelSpec(
        name=name, version=version, path=Path("/nonexistent"), config=config,
        inputs=[TensorSpec(*t) for t in inputs], outputs=[TensorSpec(*t) for t in outputs], fingerprint=fingerprint,
    )  # fmt: skip


RANKER_LIKE = _spec(
    inputs=[("dense", "FP32", (4,)), ("ids", "INT64", (2,))],
    outputs=[("score", "FP32", (1,)), ("echo", "INT64", (2,))],
)


def model(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {
        "score": arrays["dense"].sum(axis=1, keepdims=True, dtype=np.float32) * np.float32(2),
        "echo": arrays["ids"] + 1,
    }


class FakeScheduler:
    """Records every call; ``gate`` (when set) holds computations until the test opens it."""

    def __init__(self, fn=model, batched: bool = True) -> None:
        self.fn = fn
        self.batched = batched
        self.calls: list[int] = []
        self.gate: asyncio.Event | None = None
        self.fail_with: BaseException | None = None
        self.failures_left = 1_000_000  # how many calls fail_with applies to

    @property
    def rows(self) -> int:
        return sum(self.calls)

    async def __call__(self, arrays: dict[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
        self.calls.append(rows)
        if self.gate is not None:
            await self.gate.wait()
        if self.fail_with is not None and self.failures_left > 0:
            self.failures_left -= 1
            raise self.fail_with
        for a in arrays.values():
            assert not self.batched or a.shape[0] == rows
        return self.fn(arrays)


def _req(seeds: list[int]) -> dict[str, np.ndarray]:
    """One row per seed; the same seed gives the same row."""
    dense = np.stack([np.random.default_rng(s).standard_normal(4, dtype=np.float32) for s in seeds])
    ids = np.stack([np.random.default_rng(s + 10_000).integers(0, 100, 2) for s in seeds])
    return {"dense": dense, "ids": ids}


def _cache(spec=RANKER_LIKE) -> ModelCache:
    return ModelCache(spec, TieredCache(MemoryCache(1 << 20)))


def _same(got: dict[str, np.ndarray], want: dict[str, np.ndarray], names=None) -> None:
    for name in names or want:
        assert got[name].shape == want[name].shape, name
        assert got[name].dtype == want[name].dtype, name
        assert got[name].tobytes() == want[name].tobytes(), name


async def test_second_request_is_answered_from_memory_byte_identical():
    c, sched = _cache(), FakeScheduler()
    arrays = _req([1, 2, 3])
    first = await c.infer(arrays, 3, sched)
    second = await c.infer(_req([1, 2, 3]), 3, sched)
    assert sched.calls == [3]
    _same(first, model(arrays))
    _same(second, first)
    s = c.stats()
    assert (s["hits"], s["computed_rows"], s["hit_requests"], s["miss_requests"]) == (3, 3, 1, 1)


async def test_partial_hits_compute_only_the_misses_and_keep_row_order():
    c, sched = _cache(), FakeScheduler()
    await c.infer(_req([10, 11, 12]), 3, sched)
    seeds = [20, 11, 21, 10, 22, 12, 23]
    got = await c.infer(_req(seeds), len(seeds), sched)
    assert sched.calls == [3, 4]  # only 20, 21, 22, 23
    _same(got, model(_req(seeds)))


async def test_rows_repeated_inside_one_request_are_computed_once():
    c, sched = _cache(), FakeScheduler()
    seeds = [5, 6, 5, 5, 6, 7]
    got = await c.infer(_req(seeds), len(seeds), sched)
    assert sched.calls == [3]
    _same(got, model(_req(seeds)))
    assert c.stats()["coalesced_rows"] == 3


async def test_identical_concurrent_requests_compute_each_row_once():
    c, sched = _cache(), FakeScheduler()
    sched.gate = asyncio.Event()
    reqs = [[1, 2, 3], [3, 2, 1], [2, 4], [4, 1, 5], [1, 2, 3]] * 20
    tasks = [asyncio.create_task(c.infer(_req(s), len(s), sched)) for s in reqs]
    await asyncio.sleep(0.01)
    sched.gate.set()
    results = await asyncio.gather(*tasks)
    assert sched.rows == 5  # rows 1..5, each once
    for seeds, got in zip(reqs, results):
        _same(got, model(_req(seeds)))
    assert len(c.flights) == 0


async def test_a_cancelled_owner_hands_its_rows_to_a_waiter():
    c, sched = _cache(), FakeScheduler()
    sched.gate = asyncio.Event()
    owner = asyncio.create_task(c.infer(_req([1, 2]), 2, sched))
    await asyncio.sleep(0)
    waiter = asyncio.create_task(c.infer(_req([2, 1]), 2, sched))
    await asyncio.sleep(0.01)
    assert sched.calls == [2]  # the waiter waits
    owner.cancel()
    await asyncio.sleep(0.01)
    assert sched.calls == [2, 2]  # the waiter claimed the rows and computes them itself
    sched.gate.set()
    _same(await waiter, model(_req([2, 1])))
    assert owner.cancelled() and c.stats()["abandoned"] == 1


@pytest.mark.parametrize("kind", [Kind.UNAVAILABLE, Kind.DEADLINE, Kind.EXHAUSTED])
async def test_an_owner_refused_for_its_own_reasons_does_not_fail_its_waiters(kind):
    c, sched = _cache(), FakeScheduler()
    sched.gate = asyncio.Event()
    sched.fail_with = GatewayError(kind, "queue full")
    sched.failures_left = 1  # the owner's call only; the waiter's own turn succeeds
    owner = asyncio.create_task(c.infer(_req([1]), 1, sched))
    await asyncio.sleep(0)
    waiter = asyncio.create_task(c.infer(_req([1]), 1, sched))
    await asyncio.sleep(0.01)
    sched.gate.set()
    with pytest.raises(GatewayError):
        await owner
    _same(await waiter, model(_req([1])))
    assert sched.calls == [1, 1]


async def test_a_model_failure_reaches_every_waiter_once():
    c, sched = _cache(), FakeScheduler()
    sched.gate = asyncio.Event()
    sched.fail_with = GatewayError(Kind.FAILED, "model exploded")
    tasks = [asyncio.create_task(c.infer(_req([1, 2]), 2, sched)) for _ in range(5)]
    await asyncio.sleep(0.01)
    sched.gate.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, GatewayError) and "model exploded" in r.message for r in results)
    assert sched.calls == [2]
    assert c.stats()["failed_requests"] == 4  # the waiters; the owner's failure is the scheduler's
    assert len(c.flights) == 0


async def test_requested_outputs_and_namespace_are_part_of_the_key():
    c, sched = _cache(), FakeScheduler()
    arrays = _req([1])
    only_score = await c.infer(arrays, 1, sched, wanted=[("score", True)])
    assert set(only_score) >= {"score"}
    assert sched.calls == [1]
    got = await c.infer(arrays, 1, sched, wanted=[("score", True)])
    assert sched.calls == [1] and list(got) == ["score"]  # the cached value holds score only
    _same(got, model(arrays), ["score"])
    await c.infer(arrays, 1, sched)  # all outputs: another key
    await c.infer(arrays, 1, sched, wanted=[("echo", False), ("score", True)])  # all, other order: same
    assert sched.calls == [1, 1]
    await c.infer(arrays, 1, sched, namespace="tenant-a")
    await c.infer(arrays, 1, sched, namespace="tenant-b")
    await c.infer(arrays, 1, sched, namespace="tenant-a")
    assert sched.calls == [1, 1, 1, 1]


async def test_another_model_version_or_file_never_shares_entries():
    tiers = TieredCache(MemoryCache(1 << 20))
    sched = FakeScheduler()
    arrays = _req([1, 2])
    for spec in (
        RANKER_LIKE,
        _spec(RANKER_LIKE_INPUTS := [("dense", "FP32", (4,)), ("ids", "INT64", (2,))],
              [("score", "FP32", (1,)), ("echo", "INT64", (2,))], version="2"),
        _spec(RANKER_LIKE_INPUTS, [("score", "FP32", (1,)), ("echo", "INT64", (2,))], fingerprint="beef"),
    ):  # fmt: skip
        await ModelCache(spec, tiers).infer(arrays, 2, sched)
    assert sched.calls == [2, 2, 2]


async def test_bytes_and_variable_shape_outputs_round_trip():
    spec = _spec(
        inputs=[("text", "BYTES", (1,)), ("ids", "INT64", (-1,))],
        outputs=[("tokens", "BYTES", (-1,)), ("hidden", "FP32", (-1, 2))],
    )

    def fn(arrays):
        n, seq = arrays["ids"].shape
        tokens = np.empty((n, seq), dtype=object)
        for r in range(n):
            for s in range(seq):
                tokens[r, s] = arrays["text"][r, 0][: s + 1]
        hidden = np.repeat(arrays["ids"][:, :, None].astype(np.float32), 2, axis=2)
        return {"tokens": tokens, "hidden": hidden}

    def req(words, seq):
        return {
            "text": np.array([[w] for w in words], dtype=object),
            "ids": np.array([[len(w) + s for s in range(seq)] for w in words], dtype=np.int64),
        }

    c, sched = _cache(spec), FakeScheduler(fn)
    await c.infer(req([b"alpha", b"beta"], 3), 2, sched)
    got = await c.infer(req([b"beta", b"gamma", b"alpha"], 3), 3, sched)
    assert sched.calls == [2, 1]
    want = fn(req([b"beta", b"gamma", b"alpha"], 3))
    assert got["tokens"].tolist() == want["tokens"].tolist()
    _same(got, want, ["hidden"])
    # Another sequence length is another shape: no hit.
    await c.infer(req([b"beta"], 4), 1, sched)
    assert sched.calls == [2, 1, 1]


async def test_unbatched_model_caches_whole_requests():
    spec = _spec(inputs=[("x", "FP32", (3,))], outputs=[("y", "FP32", (3,))], max_batch_size=0)
    c, sched = _cache(spec), FakeScheduler(lambda a: {"y": a["x"] * 3}, batched=False)
    x = np.arange(3, dtype=np.float32)
    first = await c.infer({"x": x}, 1, sched)
    second = await c.infer({"x": x.copy()}, 1, sched)
    assert sched.calls == [1]
    assert second["y"].shape == (3,) and second["y"].tobytes() == (x * 3).tobytes() == first["y"].tobytes()


async def test_outputs_that_do_not_fit_the_layout_are_answered_uncached():
    c = _cache()
    sched = FakeScheduler(lambda a: {"score": np.zeros((len(a["dense"]), 5), np.float32), "echo": a["ids"]})
    got = await c.infer(_req([1, 2]), 2, sched)
    assert got["score"].shape == (2, 5)
    await c.infer(_req([1, 2]), 2, sched)
    assert sched.calls == [2, 2] and c.stats()["uncacheable"] == 2


async def test_statistics_follow_triton():
    from batchgate.proto.inference.v2 import grpc_service_pb2 as pb

    c, sched = _cache(), FakeScheduler()
    await c.infer(_req([1, 2]), 2, sched)
    await c.infer(_req([1, 2]), 2, sched)
    await c.infer(_req([2, 3]), 2, sched)
    s = pb.InferStatistics()
    s.success.count = 2  # what the scheduler counted: the two requests it computed for
    c.fill_statistics(s)
    assert (s.cache_hit.count, s.cache_miss.count, s.success.count) == (1, 2, 3)
    assert s.cache_hit.ns > 0 and s.cache_miss.ns > 0


async def test_server_settings_choose_the_tiers(tmp_path):
    from pydantic import ValidationError

    from batchgate.gateway.result_cache import build_cache
    from batchgate.gateway.config import Settings

    def tiers(**kw):
        return Settings(model_repository=tmp_path, **kw)

    c = await build_cache(tiers())
    assert c is not None and c.memory is not None and c.redis is None
    assert await build_cache(tiers(cache_tiers="off")) is None
    assert await build_cache(tiers(cache_tiers="memory", cache_memory_bytes=0)) is None
    url = "redis://127.0.0.1:1/0"  # nothing listens there: the tier is built, its warm-up says so
    c = await build_cache(tiers(redis_url=url, cache_lookup_timeout_ms=3, cache_ttl_s=60))
    assert c.memory is not None and c.redis is not None and c.redis.lookup_timeout_s == 0.003
    assert "redis redis://127.0.0.1:1/0" in c.describe()
    await c.close()
    c = await build_cache(tiers(redis_url=url, cache_tiers="redis"))
    assert c.memory is None and c.redis is not None
    await c.close()
    with pytest.raises(ValidationError, match="needs a Redis"):
        tiers(cache_tiers="memory+redis")
