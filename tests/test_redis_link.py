"""One Redis client and one breaker for the result cache and the global rate limiter
(``cache/link.py``), against a real redis-server.

In process, with the objects built the way the server builds them (``Server.__init__`` makes the
link, the data plane builds the cache on it, admission the limiter): whichever user sees Redis
fail, both go without it, one probe task runs, and both are back when it answers. Then one real
server process with both features on: it builds one redis-py connection pool, and a Redis kill
seen only by the limiter opens the breaker the cache's metrics report."""

from __future__ import annotations

import asyncio
import shutil
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from batchgate.cache import RedisLink
from batchgate.gateway import codec, dataplane
from batchgate.gateway.config import Settings
from batchgate.proto.inference.v2 import grpc_service_pb2_grpc as pb_grpc
from tests.conftest import start_server
from tests.test_cache_server import TIMEOUT_S, ranker_rows, request
from tests.test_cache_server import env as cache_env
from tests.test_redis_restart import _limiter_stats, global_tenants
from tests.test_replicas import _repo

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")

KEY = "link-test-key"
FAILURES = 3  # cache_breaker_failures here


def _probe_tasks() -> int:
    return sum(1 for t in asyncio.all_tasks() if t.get_name() == "redis-probe" and not t.done())


async def _users(tmp_path: Path, url: str, monkeypatch):
    """A ``Server``'s link, admission and data plane; the cache built by the plane's own path
    (``DataPlane._start``, with the model's runtime left out)."""
    from batchgate.gateway.transport.server import Server

    monkeypatch.setattr(codec, "LIMITS", codec.LIMITS)  # Server() sets the process's codec limits

    async def no_runtime(spec, settings, classes, lag, cache):
        return SimpleNamespace(pool=SimpleNamespace(workers=[]))  # no engine: only the cache is wanted

    monkeypatch.setattr(dataplane, "build_runtime", no_runtime)
    settings = Settings(
        model_repository=tmp_path, redis_url=url, api_keys_file=global_tenants(tmp_path, KEY),
        cache_tiers="memory+redis",
        # far above the defaults: this machine's cores are shared, and a late answer is not the point
        cache_lookup_timeout_ms=200, ratelimit_redis_timeout_ms=200,
        ratelimit_probe_initial_ms=20, ratelimit_probe_max_ms=160, cache_breaker_failures=FAILURES,
    )  # fmt: skip
    server = Server(settings)
    monkeypatch.setattr(
        type(server.plane.selector), "note", lambda self, spec, cpu=True: None
    )  # nothing to select
    await server.plane._start(
        SimpleNamespace(config=SimpleNamespace(response_cache=SimpleNamespace(enable=True)))
    )
    await server.admission.start()
    return server, server.plane.cache, server.admission.limiter, server.admission.accounts["t"]


async def _close(server) -> None:
    await server.plane.close()
    await server.admission.close()
    await server.redis.close()


async def _admit(server, account) -> None:
    (await server.admission.admit(account, "ranker", 1)).release()


async def _until_up(link: RedisLink, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not link.up:
        assert time.monotonic() < deadline, f"the breaker never closed: {link.stats()}"
        await asyncio.sleep(0.01)


def _keys(n: int, tag: bytes) -> list[bytes]:
    return [tag + i.to_bytes(8, "little") for i in range(n)]


async def test_a_limiter_failure_opens_the_cache_and_one_probe_brings_both_back(
    tmp_path, redis_server, monkeypatch
):
    server, tiers, limiter, account = await _users(tmp_path, redis_server.url, monkeypatch)
    link = server.redis
    try:
        assert tiers.redis.link is link and limiter.link is link
        assert tiers.redis.breaker is limiter.breaker is link.breaker
        keys, values = _keys(4, b"a"), [b"v%d" % i for i in range(4)]
        await _admit(server, account)
        tiers.store(keys, values)
        assert await tiers.redis.flush(5.0)
        assert await tiers.remote(keys) == values
        assert limiter.fallback_decisions == 0 and link.up

        redis_server.kill()
        await _admit(server, account)  # the limiter's first error trips the breaker: the local share admits
        assert not link.up and limiter.errors == 1 and limiter.fallback_decisions == 1
        cache_failed = tiers.redis.stats.errors + tiers.redis.stats.timeouts
        assert await tiers.remote(keys) is None  # the cache sees it open without having failed itself
        red = tiers.stats()["redis"]
        assert red["breaker_open"] == 1 and red["breaker_opens"] == 1 and red["skipped"] == len(keys)
        assert red["errors"] + red["timeouts"] == cache_failed == 0
        assert limiter.stats()["up"] is False
        assert _probe_tasks() == 1  # one probe for both users

        await asyncio.to_thread(redis_server.start)  # same port, empty
        await _until_up(link)
        assert _probe_tasks() == 0
        trips = limiter.round_trips
        await _admit(server, account)
        assert limiter.round_trips == trips + 1 and limiter.fallback_decisions == 1  # decided in Redis again
        assert await tiers.remote(keys) == [None] * 4  # asked again (a restarted Redis is empty)
        tiers.store(keys, values)
        assert await tiers.redis.flush(5.0) and tiers.redis.stats.write_errors == 0
        assert await tiers.remote(keys) == values
        probes = link.breaker.probes
        assert probes >= 1 and limiter.stats()["probes"] == tiers.stats()["redis"]["breaker_probes"] == probes
    finally:
        await _close(server)


async def test_cache_failures_in_a_row_send_the_limiter_to_its_share(tmp_path, redis_server, monkeypatch):
    server, tiers, limiter, account = await _users(tmp_path, redis_server.url, monkeypatch)
    link = server.redis
    try:
        keys = _keys(2, b"b")
        await _admit(server, account)
        assert await tiers.remote(keys) == [None, None]
        redis_server.kill()
        for i in range(FAILURES):
            assert link.up, f"open after {i} failures"
            assert await tiers.remote(keys) is None
        assert not link.up and tiers.redis.stats.errors == FAILURES
        trips, errors = limiter.round_trips, limiter.errors
        await _admit(server, account)
        # decided by the share without asking Redis: the limiter never failed itself
        assert limiter.fallback_decisions == 1 and limiter.round_trips == trips and limiter.errors == errors
        assert _probe_tasks() == 1
        await asyncio.to_thread(redis_server.start)
        await _until_up(link)
        await _admit(server, account)
        assert limiter.fallback_decisions == 1 and limiter.round_trips == trips + 1
        assert await tiers.remote(keys) == [None, None]
    finally:
        await _close(server)


@pytest.mark.serial
async def test_the_link_backs_off_and_resets_only_after_a_real_success(redis_server):
    from batchgate.cache import Breaker

    link = RedisLink(redis_server.url, breaker=Breaker(1, 10.0), probe_initial_s=0.02, probe_max_s=0.16)
    try:
        assert link.probe_max_s == 0.16 and link.probe_initial_s == 0.02
        redis_server.kill()
        link.breaker.trip("test")
        await asyncio.sleep(0.6)  # probes at ~0.02, 0.06, 0.14, 0.30, 0.46: waits double to the cap
        assert 3 <= link.breaker.probes <= 6, link.stats()
        assert link._backoff_s == 0.16
        await asyncio.to_thread(redis_server.start)
        await _until_up(link)
        link.breaker.trip("right after recovering, before any real success")
        assert link._backoff_s == 0.16  # still backed off
        await _until_up(link)
        link.breaker.success()  # a real call succeeded
        link.breaker.trip("later")
        assert link._backoff_s == 0.02
        await _until_up(link)
    finally:
        await link.close()


def test_the_cap_is_the_shorter_of_open_s_and_probe_max():
    from batchgate.cache import Breaker

    link = RedisLink("redis://127.0.0.1:1/0", breaker=Breaker(5, 0.3), probe_initial_s=0.5, probe_max_s=2.0)
    assert (link.probe_initial_s, link.probe_max_s) == (0.3, 0.3)
    assert RedisLink.from_settings(Settings(model_repository=".")) is None


# -- one server process ----------------------------------------------------------------------------

# Counts the redis-py connection pools a process builds (every redis.asyncio client has one), by
# wrapping the constructor before the server imports anything; PYTHONPATH puts it in the server.
_COUNTER = """
import os
if os.environ.get("BG_TEST_COUNT_REDIS_POOLS"):
    import redis.asyncio.connection as _c
    _init = _c.ConnectionPool.__init__
    def _counted(self, *a, **kw):
        print("test: redis-py connection pool built", flush=True)
        _init(self, *a, **kw)
    _c.ConnectionPool.__init__ = _counted
"""


def _redis_figures(http_port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name == "batchgate_cache_stat":
            for s in family.samples:
                if s.labels["tier"] == "redis" and not s.labels["model"]:
                    out[s.labels["stat"]] = s.value
    return out


def test_one_server_builds_one_client_and_its_users_trip_together(tmp_path, redis_server):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_COUNTER)
    env = cache_env(
        redis_server, BATCHGATE_API_KEYS_FILE=str(global_tenants(tmp_path, KEY)),
        BATCHGATE_RATELIMIT_REDIS_TIMEOUT_MS="200",
        BATCHGATE_CACHE_BREAKER_FAILURES=str(FAILURES), BATCHGATE_LOG_LEVEL="INFO",
        PYTHONPATH=str(site), BG_TEST_COUNT_REDIS_POOLS="1",
    )  # fmt: skip
    gw = start_server(tmp_path, repo=_repo(tmp_path), env=env)
    md = (("x-api-key", KEY),)
    r = redis.Redis.from_url(redis_server.url)
    channel = grpc.insecure_channel(gw.grpc_url)
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    try:
        stub.ModelInfer(request(ranker_rows(list(range(8)))), metadata=md, timeout=TIMEOUT_S)
        deadline = time.monotonic() + 5
        while sum(1 for _ in r.scan_iter(match="batchgate:rc:*")) < 8:  # written behind the answer
            assert time.monotonic() < deadline, "the rows never reached Redis"
            time.sleep(0.02)
        me = r.client_id()
        connections = [c for c in r.client_list() if int(c["id"]) != me]
        print(f"connections from the server: {len(connections)} ({sorted(c['cmd'] for c in connections)})")
        assert gw.log().count("test: redis-py connection pool built") == 1, "one client, one pool"
        assert _redis_figures(gw.http_port)["breaker_open"] == 0

        redis_server.kill()
        # Admission asks Redis first: the limiter's error trips the breaker, and the cache then
        # skips Redis without having failed once itself.
        stub.ModelInfer(request(ranker_rows(list(range(100, 108)))), metadata=md, timeout=TIMEOUT_S)
        down = _redis_figures(gw.http_port)
        assert down["breaker_open"] == 1 and down["breaker_opens"] == 1, down
        assert down["errors"] + down["timeouts"] == 0 and down["skipped"] == 8, down

        redis_server.start()  # same port, empty
        deadline = time.monotonic() + 5
        while _redis_figures(gw.http_port)["breaker_open"]:
            assert time.monotonic() < deadline, "the breaker never closed"
            time.sleep(0.05)
        stub.ModelInfer(request(ranker_rows(list(range(200, 208)))), metadata=md, timeout=TIMEOUT_S)
        deadline = time.monotonic() + 5
        while sum(1 for _ in r.scan_iter(match="batchgate:rc:*")) < 8:  # the cache writes again
            assert time.monotonic() < deadline, "no rows reached Redis after it came back"
            time.sleep(0.02)
        up = _redis_figures(gw.http_port)
    finally:
        channel.close()
        r.close()
        gw.stop()
    limiter = _limiter_stats(gw.log())
    # one decision fell back (the one that tripped); the limiter's probes are the cache's
    assert limiter["fallback_decisions"] == 1 and limiter["errors"] == 1, limiter
    assert limiter["probes"] == up["breaker_probes"] >= 1, (limiter, up)
    assert gw.log().count("Redis failed") == 1 and "Redis answers again" in gw.log()
