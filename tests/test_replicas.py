"""Three gateway replicas and one real redis-server: the deployment shape of the Helm chart with
`redis.mode` set, on loopback. Shows what the replicas share through Redis:

- the result cache: a row computed on one replica is a cache hit on the others (ModelStatistics:
  the engine runs on the first replica only, the others count a cache hit, the bytes are equal);
- a tenant's global rate limit: ~3x the limit offered round-robin over the three replicas is
  admitted at the limit in total, while an unlimited tenant's calls all succeed meanwhile.

The helpers come from the cache and rate-limit tests (request builders, statistics deltas, the
open-loop paced load generator)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import shutil
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import redis

from batchgate.proto.inference.v2 import grpc_service_pb2 as pb
from batchgate.proto.inference.v2 import grpc_service_pb2_grpc as pb_grpc
from tests.conftest import REPO, RedisServer, ServerProcess, start_server
from tests.test_cache_server import TIMEOUT_S, delta, ranker_rows, request, score, stats
from tests.test_cache_server import env as cache_env
from tests.test_ratelimit_redis import NOISY_KEY, QUIET_KEY, _offer

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")

REPLICAS = 3
LIMIT, BURST = 30.0, 10  # the limited tenant's global requests/s and burst
OFFER = 3 * LIMIT  # offered to the limited tenant, in total over the replicas
UNLIMITED_RATE = 10.0  # per replica
LOAD_S = 4.0
LIMITED, UNLIMITED = NOISY_KEY, QUIET_KEY  # _offer sends the first as x-api-key, the other as Bearer


def reference(arrays: dict[str, np.ndarray], model: str = "ranker") -> np.ndarray:
    """What the model computes for ``arrays``, by ONNX Runtime directly."""
    import onnxruntime as ort

    sess = ort.InferenceSession(str(REPO / model / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    return sess.run(None, arrays)[0]


def _repo(root: Path) -> Path:
    """A copy of the bundled ranker with ``response_cache { enable: true }``."""
    model = root / "repo" / "ranker"
    (model / "1").mkdir(parents=True)
    shutil.copy(REPO / "ranker" / "1" / "model.onnx", model / "1" / "model.onnx")
    config = (REPO / "ranker" / "config.pbtxt").read_text() + "response_cache { enable: true }\n"
    (model / "config.pbtxt").write_text(config)
    return root / "repo"


def _tenants(root: Path) -> Path:
    from batchgate.gateway.admission.tenants import hash_key

    path = root / "tenants.json"
    tenants = [
        {"name": "limited", "key_hashes": [hash_key(LIMITED)], "models": ["ranker"],
         "global_limits": {"requests_per_s": LIMIT, "requests_burst": BURST}},
        {"name": "unlimited", "key_hashes": [hash_key(UNLIMITED)], "models": "*"},
    ]  # fmt: skip
    path.write_text(json.dumps({"tenants": tenants}))
    return path


@pytest.fixture(scope="module")
def redis_shared(tmp_path_factory) -> Iterator[RedisServer]:
    srv = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield srv
    srv.kill()


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, redis_shared) -> Iterator[list[ServerProcess]]:
    tmp = tmp_path_factory.mktemp("replicas")
    repo, tenants = _repo(tmp), _tenants(tmp)
    env = cache_env(
        redis_shared,
        BATCHGATE_API_KEYS_FILE=str(tenants),
        BATCHGATE_RATELIMIT_EXPECTED_REPLICAS=str(REPLICAS),
        # 50 ms rather than the default 5 ms for a decision (the breaker opens at 10x that): three
        # gateways, the client and Redis share two cores here, often beside other test runs, and a
        # replica whose loop stalls past 50 ms would fall back to its local share and prove nothing
        # about the shared limit. The 5 ms bound itself is tested in test_ratelimit_redis.py.
        BATCHGATE_RATELIMIT_REDIS_TIMEOUT_MS="50",
        BATCHGATE_LOG_LEVEL="INFO",
    )
    with concurrent.futures.ThreadPoolExecutor(REPLICAS) as ex:  # start all at once: a third of the wait
        futs = [ex.submit(start_server, tmp, repo=repo, env=env) for _ in range(REPLICAS)]
        gws = [f.result() for f in futs]
    try:
        yield gws
    finally:
        with concurrent.futures.ThreadPoolExecutor(REPLICAS) as ex:  # drain all at once too
            list(ex.map(lambda gw: gw.stop(), gws))


def _result_keys(r: redis.Redis) -> int:
    return sum(1 for _ in r.scan_iter(match="batchgate:rc:*", count=1000))


def test_a_row_computed_on_one_replica_is_a_hit_on_the_others(replicas, redis_shared):
    md = (("authorization", f"Bearer {UNLIMITED}"),)
    r = redis.Redis.from_url(redis_shared.url)
    channels = [grpc.insecure_channel(gw.grpc_url) for gw in replicas]
    stubs = [pb_grpc.GRPCInferenceServiceStub(ch) for ch in channels]
    try:
        per_replica = [Counter() for _ in replicas]
        # Each replica in turn computes a fresh batch of 8 rows; the two others must answer it from
        # Redis without running the engine.
        for origin in range(REPLICAS):
            arrays = ranker_rows([7000 + 100 * origin + k for k in range(8)])
            req = request(arrays)
            before = [stats(s, metadata=md) for s in stubs]  # statistics need a key
            keys_before = _result_keys(r)
            computed = stubs[origin].ModelInfer(req, metadata=md, timeout=TIMEOUT_S)
            expected = computed.SerializeToString(deterministic=True)
            # Writes to Redis are behind the response: wait until this batch's 8 rows are there,
            # or the next replica would (correctly) miss and compute them itself.
            for _ in range(200):
                if _result_keys(r) >= keys_before + 8:
                    break
                time.sleep(0.01)
            assert _result_keys(r) >= keys_before + 8, "the origin replica never wrote its rows to Redis"
            others = [i for i in range(REPLICAS) if i != origin]
            answers = {i: stubs[i].ModelInfer(req, metadata=md, timeout=TIMEOUT_S) for i in others}
            deltas = [delta(stats(s, metadata=md), b) for s, b in zip(stubs, before, strict=True)]

            assert deltas[origin] == {"rows": 8, "executions": 1, "hit": 0, "miss": 1, "success": 1}, deltas
            for i in others:
                hit = {"rows": 0, "executions": 0, "hit": 1, "miss": 0, "success": 1}
                assert deltas[i] == hit, (i, deltas)
                assert answers[i].SerializeToString(deterministic=True) == expected
            np.testing.assert_allclose(score(computed), reference(arrays), rtol=1e-5, atol=1e-6)
            for i, d in enumerate(deltas):
                per_replica[i].update(d)
        summary = [dict(c) for c in per_replica]
        print(f"per replica over the three rounds (rows computed, cache hits, misses): {summary}")
        assert [(c["hit"], c["miss"], c["rows"]) for c in per_replica] == [(2, 1, 8)] * REPLICAS, summary
    finally:
        for ch in channels:
            ch.close()
        r.close()


def test_a_global_limit_holds_across_three_replicas(replicas, redis_shared):
    out = asyncio.run(_drive(replicas))
    limited, unlimited, t0, t1 = out["limited"], out["unlimited"], out["start"], out["stop"]

    # The unlimited tenant is untouched by the other's limit: every call succeeds, promptly.
    codes = Counter(c for _, c, _, _ in unlimited)
    assert codes == {grpc.StatusCode.OK: len(unlimited)}, codes
    assert len(unlimited) >= 0.9 * UNLIMITED_RATE * REPLICAS * LOAD_S, len(unlimited)
    slowest = max(lat for _, _, lat, _ in unlimited)
    assert slowest < 1.0, f"slowest unlimited call {slowest:.3f} s; this test's loop lagged {out['lag']:.3f}"

    codes = Counter(c for _, c, _, _ in limited)
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
    ok = [(ts, gw) for ts, c, _, gw in limited if c == grpc.StatusCode.OK and t0 <= ts < t1]
    # Redis was fresh for this tenant: a full burst, then the rate.
    rate = (len(ok) - BURST) / (t1 - t0)
    by_replica = Counter(gw for _, gw in ok)
    each_s = [sum(1 for ts, _ in ok if t0 + k <= ts < t0 + k + 1) for k in range(int(LOAD_S))]
    logs = "".join(gw.log() for gw in replicas)
    summary = (
        f"limited tenant: offered {len(limited)} calls ({len(limited) / (t1 - t0):.1f}/s), "
        f"admitted {len(ok)} = burst {BURST} + {rate:.1f}/s (limit {LIMIT:.0f}/s); "
        f"per replica {dict(sorted(by_replica.items()))}; "
        f"each second {each_s}; codes {dict(codes)}; unlimited tenant {len(unlimited)} calls all OK, "
        f"slowest {slowest * 1e3:.0f} ms; client loop lag {out['lag'] * 1e3:.0f} ms"
    )
    print(summary)
    assert len(limited) >= 0.9 * OFFER * LOAD_S, summary  # the load really was ~3x the limit
    # +-15% (the two-replica test in test_ratelimit_redis.py holds +-10%): here three gateways, the
    # load generator and Redis share two CPU cores, so every loop runs late more often, and the
    # window is one 4 s phase (one call = 0.25/s of measured rate). A call is decided some ms to tens
    # of ms after the client's send time, by which the window is measured, so a few admissions move
    # across its edges; and a decision Redis does not answer in time is made locally, in the ratio
    # Redis was recently admitting (an EWMA), close to but not exactly the limit. Measured: 29.2 to
    # 31.0/s over a dozen runs at load averages 2 to 8; 32.8/s once, with the 5 ms default timeout
    # and two busy loops competing for the cores.
    assert abs(rate - LIMIT) <= 0.15 * LIMIT, summary
    # How the admissions split over the replicas is not asserted: a token frees up every 1/LIMIT s
    # and a call arrives every 1/OFFER s in replica order, so the phase of the two decides which
    # replica's calls find the tokens (a split like 27/95/7 is normal, and is itself a sign of one
    # shared bucket). Round-robin traffic would also sum to the limit if each replica enforced its
    # local third alone (the fallback while Redis fails), so show that the decisions were Redis's:
    # the tenant's bucket is in Redis, and no replica lost Redis.
    r = redis.Redis.from_url(redis_shared.url)
    try:
        buckets = list(r.scan_iter(match="batchgate:rl:*", count=1000))
        assert any(b"{limited}" in k for k in buckets), f"no global bucket in Redis: {buckets}"
    finally:
        r.close()
    assert "Redis failed" not in logs, summary


async def _drive(gws: list[ServerProcess]) -> dict:
    loop = asyncio.get_running_loop()
    channels = [grpc.aio.insecure_channel(gw.grpc_url) for gw in gws]
    stubs = [pb_grpc.GRPCInferenceServiceStub(ch) for ch in channels]
    for stub in stubs:  # connect before the clock starts
        await stub.ServerReady(pb.ServerReadyRequest(), timeout=5)
    start = loop.time() + 0.2
    stop = start + LOAD_S
    limited: list = []
    unlimited: list = []
    tasks: list = []
    n = len(stubs)
    # Round-robin: each replica gets OFFER/n calls a second, the three streams staggered by 1/OFFER,
    # so consecutive calls of the tenant go to consecutive replicas. Open loop, paced by the clock.
    load = []
    for i in range(n):
        load.append(_offer(stubs[i], i, LIMITED, OFFER / n, start + i / OFFER, stop, limited, tasks))
        t_i = start + i / (n * UNLIMITED_RATE)
        load.append(_offer(stubs[i], i, UNLIMITED, UNLIMITED_RATE, t_i, stop, unlimited, tasks))
    lag = 0.0

    async def lag_monitor() -> None:  # to tell this process's stalls from the gateways'
        nonlocal lag
        while loop.time() < stop:
            t = loop.time()
            await asyncio.sleep(0.01)
            lag = max(lag, loop.time() - t - 0.01)

    await asyncio.gather(*load, lag_monitor())
    await asyncio.gather(*tasks)
    for ch in channels:
        await ch.close()
    return {"limited": limited, "unlimited": unlimited, "start": start, "stop": stop, "lag": lag}
