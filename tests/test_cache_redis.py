"""The Redis tier against a real redis-server: round trip with TTL, auth and TLS through the URL,
and the faults (down, slow, full) costing misses and counters, never errors or stalls."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import redis

from batchgate.cache import Breaker, MemoryCache, RedisTier, State, TieredCache, redact_url
from tests.conftest import RedisServer, free_ports

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")

TIMEOUT_S = 0.005


def _tier(url: str, **kw) -> RedisTier:
    args = dict(ttl_s=60.0, lookup_timeout_s=TIMEOUT_S, breaker=Breaker(3, 0.2), key_prefix=b"t:")
    args.update(kw)
    return RedisTier(url, **args)


def _keys(n: int, tag: bytes = b"") -> list[bytes]:
    return [tag + i.to_bytes(16 - len(tag), "little") for i in range(n)]


async def _lookup(tier: RedisTier, keys, width=None):
    """get_many, retried while a fresh connection is still being set up (the first call connects)."""
    for _ in range(50):
        got = await tier.get_many(keys, width)
        if got is not None:
            return got
        await asyncio.sleep(0.01)
    raise AssertionError(f"redis never answered: {tier.stats}")


async def test_rows_written_behind_come_back_with_one_mget_and_carry_a_ttl(redis_server):
    tier = _tier(redis_server.url, ttl_s=30.0, lookup_timeout_s=1.0)
    try:
        keys = _keys(40)
        values = [bytes([i]) * 8 for i in range(40)]
        tier.put_many(keys[:20], values[:20])  # returns at once: the writer sends them later
        tier.put_many(keys[20:], values[20:])
        assert tier.pending_rows == 40
        assert await tier.flush(5.0)
        got = await tier.get_many(keys + _keys(2, b"zz"), width=8)
        assert got == values + [None, None]
        assert (tier.stats.hits, tier.stats.misses, tier.stats.lookups, tier.stats.writes) == (40, 2, 1, 40)
        assert tier.stats.write_batches == 1  # both requests' rows went in one pipeline
        direct = redis.Redis(port=redis_server.port)
        ttl_ms = direct.pttl(b"t:" + keys[0])
        assert 25_000 < ttl_ms <= 30_000
        direct.set(b"t:" + keys[1], b"short")  # a value of the wrong size is a miss
        assert (await tier.get_many(keys[:2], width=8)) == [values[0], None]
        assert tier.stats.invalid == 1
        direct.close()
    finally:
        await tier.close()


async def test_password_in_the_url(tmp_path):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    srv = RedisServer(tmp_path, password="s3cret/pw").start()
    try:
        good = _tier(srv.url.replace("s3cret/pw", "s3cret%2Fpw"), lookup_timeout_s=1.0)
        bad = _tier(f"redis://:wrong@127.0.0.1:{srv.port}/0", lookup_timeout_s=1.0)
        try:
            good.put_many(_keys(1), [b"v"])
            assert await good.flush(5.0)
            assert await good.get_many(_keys(1)) == [b"v"]
            assert await bad.get_many(_keys(1)) is None  # refused: a miss and a counted error
            assert bad.stats.errors == 1
            assert "wrong" not in redact_url(bad.url) and "***" in redact_url(bad.url)
        finally:
            await good.close()
            await bad.close()
    finally:
        srv.kill()


@pytest.mark.serial
async def test_redis_down_costs_a_fast_miss_then_the_breaker_skips_it_and_probes_back(redis_server):
    tier = _tier(redis_server.url, breaker=Breaker(3, 0.3))
    try:
        keys = _keys(4)
        tier.put_many(keys, [b"x"] * 4)
        assert await tier.flush(5.0)
        assert await _lookup(tier, keys) == [b"x"] * 4
        tier.breaker.success()  # slow first connections above may have counted as failures
        base = tier.stats.errors + tier.stats.timeouts
        redis_server.kill()
        for _ in range(3):
            t0 = time.perf_counter()
            assert await tier.get_many(keys) is None
            assert time.perf_counter() - t0 < 0.1
        assert tier.breaker.state is State.OPEN
        failed = tier.stats.errors + tier.stats.timeouts
        assert failed - base == 3
        assert await tier.get_many(keys) is None  # open: Redis is not even asked
        assert tier.stats.skipped == 4 and tier.stats.errors + tier.stats.timeouts == failed
        tier.put_many(keys, [b"y"] * 4)  # writes while open are dropped, counted
        await asyncio.sleep(0.05)
        assert tier.stats.write_dropped == 4
        redis_server.restart()  # same port, empty
        await asyncio.sleep(0.35)
        got = await _lookup(tier, keys)  # the probe reconnects
        assert got == [None] * 4 and tier.breaker.state is State.CLOSED
        tier.put_many(keys, [b"z"] * 4)
        assert await tier.flush(5.0)
        assert await tier.get_many(keys) == [b"z"] * 4
    finally:
        await tier.close()


@pytest.mark.serial
async def test_a_paused_redis_costs_at_most_the_lookup_timeout(redis_server):
    tier = _tier(redis_server.url, lookup_timeout_s=0.005, breaker=Breaker(100, 1.0))
    try:
        await _lookup(tier, _keys(1))  # connected
        admin = redis.Redis(host="127.0.0.1", port=redis_server.port)
        # UNPAUSE waits out the pause (the admin is paused too): 2 s, 20x what 10 lookups take
        admin.execute_command("CLIENT", "PAUSE", 2000, "ALL")
        before = tier.stats.timeouts
        lat = []
        for i in range(10):
            t0 = time.perf_counter()
            got = await tier.get_many(_keys(8))
            lat.append(time.perf_counter() - t0)
            assert got is None, (i, lat, tier.stats)
        assert tier.stats.timeouts - before == 10
        # 5 ms timeout against a 2 s pause; the slack is for a shared, loaded machine.
        assert sorted(lat)[5] < 0.05 and max(lat) < 1.0, lat
        admin.execute_command("CLIENT", "UNPAUSE")
        admin.close()
        assert await _lookup(tier, _keys(1)) == [None]
    finally:
        await tier.close()


async def test_a_full_redis_refuses_writes_without_opening_the_breaker(redis_server):
    admin = redis.Redis(port=redis_server.port)
    tier = _tier(redis_server.url, lookup_timeout_s=1.0)
    try:
        tier.put_many(_keys(1, b"a"), [b"kept"])
        assert await tier.flush(5.0)
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", 1)  # below what is used: every write is refused (OOM)
        tier.put_many(_keys(50, b"b"), [b"v" * 100] * 50)
        assert await tier.flush(5.0)
        assert tier.stats.write_errors == 50
        assert tier.breaker.state is State.CLOSED
        assert await tier.get_many(_keys(1, b"a")) == [b"kept"]  # reads still served
    finally:
        admin.config_set("maxmemory", 0)
        admin.close()
        await tier.close()


async def test_the_write_queue_is_bounded(redis_server):
    tier = _tier(redis_server.url, write_queue_rows=10)
    try:
        tier.put_many(_keys(8), [b"v"] * 8)
        tier.put_many(_keys(8, b"x"), [b"v"] * 8)  # would pass the bound: dropped whole
        assert tier.stats.write_dropped == 8
        assert await tier.flush(5.0)
        assert tier.stats.writes == 8
    finally:
        await tier.close()


async def test_tiered_copies_redis_hits_into_memory(redis_server):
    tier = _tier(redis_server.url, lookup_timeout_s=1.0)
    tiers = TieredCache(MemoryCache(1 << 20), tier)
    try:
        keys = _keys(3)
        tier.put_many(keys[:2], [b"a", b"b"])
        assert await tier.flush(5.0)
        assert tiers.local(keys) == [None] * 3
        assert await tiers.remote(keys) == [b"a", b"b", None]
        assert tiers.local(keys) == [b"a", b"b", None]
        s = tiers.stats()
        assert s["memory"]["hits"] == 2 and s["redis"]["hits"] == 2 and s["redis"]["breaker_open"] == 0
        tiers.store(keys[2:], [b"c"])  # L1 at once, Redis behind
        assert tiers.local(keys[2:]) == [b"c"]
        assert await tier.flush(5.0)
        assert await tier.get_many(keys[2:]) == [b"c"]
    finally:
        await tiers.close()


# -- TLS -------------------------------------------------------------------------------------------------


def _certs(d: Path) -> tuple[Path, Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "batchgate test CA")])
    ca = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    paths = d / "ca.pem", d / "server.pem", d / "server.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return paths


async def test_rediss_url_with_password(tmp_path):
    pytest.importorskip("cryptography")
    ca, cert, key = _certs(tmp_path)
    port = free_ports(1)[0]
    args = ["redis-server", "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
            "--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file", str(ca),
            "--tls-auth-clients", "no", "--requirepass", "pw", "--save", "", "--appendonly", "no",
            "--dir", str(tmp_path)]  # fmt: skip
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tier = _tier(f"rediss://:pw@127.0.0.1:{port}/0?ssl_ca_certs={ca}", lookup_timeout_s=1.0)
    try:
        deadline = time.monotonic() + 10
        while await tier.get_many(_keys(1)) is None:
            if proc.poll() is not None:
                pytest.skip("this redis-server was built without TLS")
            assert time.monotonic() < deadline, tier.stats
            tier.breaker.success()  # connection attempts while the server starts are not the point here
            await asyncio.sleep(0.05)
        tier.put_many(_keys(2), [b"tls1", b"tls2"])
        assert await tier.flush(5.0)
        assert await tier.get_many(_keys(2)) == [b"tls1", b"tls2"]
    finally:
        await tier.close()
        proc.kill()
        proc.wait()


async def test_after_a_restart_the_first_lookup_and_write_reconnect(redis_server):
    tier = _tier(redis_server.url, lookup_timeout_s=1.0)
    try:
        assert await tier.warm(connections=4)
        tier.put_many(_keys(1), [b"a"])
        assert await tier.flush(5.0) and tier.stats.writes == 1
        redis_server.restart()  # every kept connection is now stale
        tier.put_many(_keys(1), [b"b"])
        assert await tier.flush(5.0)
        assert tier.stats.write_errors == 0 and tier.stats.writes == 2
        assert await tier.get_many(_keys(1)) == [b"b"]
        assert tier.stats.errors == 0 and tier.breaker.failures == 0
    finally:
        await tier.close()


def test_resp_packing_matches_redis_py():
    from redis.asyncio.connection import Connection

    from batchgate.cache.redis_tier import SET_PX_SCRIPT, pack_mget, pack_set_px

    pack = Connection().pack_command
    keys = [b"k1" * 8, b"k2" * 8]
    assert pack_mget(b"p:", keys) == b"".join(pack("MGET", *(b"p:" + k for k in keys)))
    odd = [b"a", b"bcd", b""]
    assert pack_mget(b"", odd) == b"".join(pack("MGET", *odd))
    values = [b"v" * 4, b"\r\n\x00w"]
    want = pack("EVAL", SET_PX_SCRIPT, 2, *(b"p:" + k for k in keys), *values, 3600000)
    assert pack_set_px(b"p:", keys, values, 3_600_000) == b"".join(want)
    values = [b"short", b"longer value"]
    want = pack("EVAL", SET_PX_SCRIPT, 2, *(b"p:" + k for k in keys), *values, 5)
    assert pack_set_px(b"p:", keys, values, 5) == b"".join(want)


async def test_lookups_of_one_loop_turn_share_one_mget_and_each_gets_its_own_rows(redis_server):
    tier = _tier(redis_server.url, lookup_timeout_s=1.0)
    try:
        assert await tier.warm()
        tier.put_many(_keys(30), [bytes([i]) for i in range(30)])
        assert await tier.flush(5.0)
        asks = [_keys(30)[i : i + 3] + _keys(1, b"none") for i in range(0, 30, 3)]
        got = await asyncio.gather(*(tier.get_many(k) for k in asks))
        assert tier.stats.lookups == 1
        for i, values in enumerate(got):
            assert values == [bytes([3 * i]), bytes([3 * i + 1]), bytes([3 * i + 2]), None]
        # A stalled Redis: the requests sharing the MGET each time out, and the breaker hears once.
        admin = redis.Redis(host="127.0.0.1", port=redis_server.port)
        admin.execute_command("CLIENT", "PAUSE", 3000, "ALL")
        tier.lookup_timeout_s = 0.02
        failures = tier.breaker.failures
        assert await asyncio.gather(*(tier.get_many(k) for k in asks)) == [None] * len(asks)
        assert tier.stats.timeouts == len(asks) and tier.breaker.failures == failures + 1
        admin.execute_command("CLIENT", "UNPAUSE")
        admin.close()
    finally:
        await tier.close()
