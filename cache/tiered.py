"""Memory (L1) in front of Redis (L2); either may be absent.

``local`` is synchronous (L1 only); ``remote`` asks L2 for what L1 lacked and copies its hits
into L1; ``store`` puts computed rows in L1 at once and queues them for L2 behind the response.
One ``TieredCache`` serves every model of a process: keys carry the model's identity.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import asdict

from batchgate.cache.breaker import State
from batchgate.cache.memory import MemoryCache
from batchgate.cache.redis_tier import RedisTier, redact_url

log = logging.getLogger(__name__)


class TieredCache:
    def __init__(self, memory: MemoryCache | None = None, redis: RedisTier | None = None) -> None:
        if memory is None and redis is None:
            raise ValueError("a TieredCache needs at least one tier")
        self.memory = memory
        self.redis = redis

    async def start(self) -> None:
        """Connect to Redis ahead of traffic (never fails: Redis may come later)."""
        if self.redis is not None:
            await self.redis.warm()

    def local(self, keys: Sequence[bytes]) -> list[bytes | None]:
        if self.memory is None:
            return [None] * len(keys)
        return self.memory.get_many(keys)

    async def remote(self, keys: Sequence[bytes], width: int | None = None) -> list[bytes | None] | None:
        """L2 values for ``keys`` (None per miss), or None when there is no L2 answer."""
        if self.redis is None:
            return None
        try:
            values = await self.redis.get_many(keys, width)
        except Exception:  # a bug in this tier must cost a miss, never the request
            self.redis.stats.errors += 1
            log.exception("redis lookup failed")
            return None
        if values is not None and self.memory is not None:
            hit_keys = [k for k, v in zip(keys, values) if v is not None]
            if hit_keys:
                self.memory.put_many(hit_keys, [v for v in values if v is not None])
        return values

    def store(self, keys: list[bytes], values: list[bytes]) -> None:
        if self.memory is not None:
            self.memory.put_many(keys, values)
        if self.redis is not None:
            self.redis.put_many(keys, values)

    def describe(self) -> str:
        parts = []
        if self.memory is not None:
            parts.append(f"memory ({self.memory.max_bytes / 2**20:.0f} MiB)")
        if self.redis is not None:
            r = self.redis
            parts.append(
                f"redis {redact_url(r.url)} (ttl {r.ttl_ms / 1000:g}s, lookup timeout "
                f"{r.lookup_timeout_s * 1000:g}ms)"
            )
        return " + ".join(parts)

    def stats(self) -> dict[str, dict[str, int | float | str]]:
        """Counters and gauges by tier, ``{"memory": {...}, "redis": {...}}``, for metrics.

        Every tier has ``hits`` and ``misses`` (rows); the rest say what they count in
        ``cache/memory.py`` (``MemoryStats``) and ``cache/redis_tier.py`` (``RedisStats``).
        """
        out: dict[str, dict[str, int | float | str]] = {}
        if self.memory is not None:
            m = self.memory
            out["memory"] = {
                **asdict(m.stats), "entries": len(m), "bytes": m.bytes, "max_bytes": m.max_bytes,
            }  # fmt: skip
        if self.redis is not None:
            r = self.redis
            b = r.breaker
            out["redis"] = {
                **asdict(r.stats),
                "write_queue_rows": r.pending_rows,
                "breaker_state": b.state.value,
                "breaker_open": int(b.state is not State.CLOSED),
                "breaker_opens": b.opens,
                "breaker_probes": b.probes,
                "breaker_rejected": b.rejected,
            }
        return out

    async def close(self) -> None:
        if self.redis is not None:
            await self.redis.close()
