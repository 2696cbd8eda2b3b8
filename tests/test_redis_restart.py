"""Redis restarts under two replicas: every pooled connection of both is then dead. Each replica's
first lookup, write and rate-limit decision after the restart must go again on a fresh connection
(once) rather than count a miss, a lost write or a Redis failure: the row one replica computes
after the restart is a cache hit on the other, and neither replica's limiter falls back."""

from __future__ import annotations

import ast
import concurrent.futures
import json
import shutil
import time
from pathlib import Path

import grpc
import pytest
import redis

from batchgate.proto.inference.v2 import grpc_service_pb2_grpc as pb_grpc
from tests.conftest import start_server
from tests.test_cache_server import TIMEOUT_S, delta, ranker_rows, request, stats
from tests.test_cache_server import env as cache_env
from tests.test_replicas import _repo

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")

KEY = "restart-test-key"


def global_tenants(root: Path, key: str = KEY) -> Path:
    """A tenant file of one tenant (``key``) under a global limit far above what a test sends:
    every decision goes to Redis and is admitted."""
    from batchgate.gateway.admission.tenants import hash_key

    path = root / "tenants.json"
    tenant = {"name": "t", "key_hashes": [hash_key(key)], "models": "*",
              "global_limits": {"requests_per_s": 1000.0, "requests_burst": 1000}}  # fmt: skip
    path.write_text(json.dumps({"tenants": [tenant]}))
    return path


def _result_keys(r: redis.Redis) -> int:
    return sum(1 for _ in r.scan_iter(match="batchgate:rc:*", count=1000))


def _wait_keys(r: redis.Redis, n: int, timeout_s: float = 5.0) -> int:
    deadline = time.monotonic() + timeout_s
    while (got := _result_keys(r)) < n and time.monotonic() < deadline:
        time.sleep(0.02)
    return got


def _limiter_stats(log: str) -> dict:
    line = next(x for x in log.splitlines() if "global rate limits at close:" in x)
    return ast.literal_eval(line.split("global rate limits at close:", 1)[1].strip())


def test_after_a_redis_restart_the_second_replica_hits(tmp_path, redis_server):
    env = cache_env(redis_server, BATCHGATE_API_KEYS_FILE=str(global_tenants(tmp_path)),
                    BATCHGATE_RATELIMIT_REDIS_TIMEOUT_MS="200", BATCHGATE_LOG_LEVEL="INFO")  # fmt: skip
    repo = _repo(tmp_path)
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        gws = [f.result() for f in [ex.submit(start_server, tmp_path, repo=repo, env=env) for _ in range(2)]]
    md = (("x-api-key", KEY),)
    r = redis.Redis.from_url(redis_server.url)
    channels = [grpc.insecure_channel(gw.grpc_url) for gw in gws]
    a, b = (pb_grpc.GRPCInferenceServiceStub(ch) for ch in channels)
    try:
        # Before: both replicas' pools hold connections that have served lookups, writes, decisions.
        warm = request(ranker_rows(list(range(100, 108))))
        a.ModelInfer(warm, metadata=md, timeout=TIMEOUT_S)
        assert _wait_keys(r, 8) >= 8
        before = stats(b, metadata=md)
        b.ModelInfer(warm, metadata=md, timeout=TIMEOUT_S)
        assert delta(stats(b, metadata=md), before)["hit"] == 1  # the setup works: B hits what A computed

        redis_server.restart()  # same port, empty (no persistence): every pooled connection is dead
        r.close()
        r = redis.Redis.from_url(redis_server.url)
        assert _result_keys(r) == 0

        fresh = request(ranker_rows(list(range(200, 208))))
        before_a, before_b = stats(a, metadata=md), stats(b, metadata=md)
        a.ModelInfer(fresh, metadata=md, timeout=TIMEOUT_S)  # stale lookup and write: retried, fresh
        # A's write went through its dead writer connection's replacement (behind the response).
        assert _wait_keys(r, 8) >= 8, "replica A's rows never reached Redis after the restart"
        b.ModelInfer(fresh, metadata=md, timeout=TIMEOUT_S)  # B's first lookup since the restart
        da, db = delta(stats(a, metadata=md), before_a), delta(stats(b, metadata=md), before_b)
        assert da == {"rows": 8, "executions": 1, "hit": 0, "miss": 1, "success": 1}, da
        assert db == {"rows": 0, "executions": 0, "hit": 1, "miss": 0, "success": 1}, db
    finally:
        for ch in channels:
            ch.close()
        r.close()
        for gw in gws:
            gw.stop()
    for gw in gws:
        limiter = _limiter_stats(gw.log())
        # Every decision, the first after the restart included, was Redis's: no error, no fallback.
        assert limiter["errors"] == 0 and limiter["fallback_decisions"] == 0, limiter
        assert limiter["round_trips"] >= 2, limiter
