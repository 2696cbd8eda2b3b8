"""Result cache: per-row keys, an in-process LRU (L1), Redis (L2), in-flight coalescing; and the
process's one Redis client and breaker (``RedisLink``), which the global rate limiter shares.

Nothing here knows about models or requests beyond bytes: ``gateway/result_cache.py`` turns a
request's rows into keys and values and back. Event-loop only; no locks.
"""

from batchgate.cache.breaker import Breaker, State
from batchgate.cache.keys import KEY_BYTES, model_prefix, prefix_rows, row_keys, row_keys_parts
from batchgate.cache.link import RedisLink
from batchgate.cache.memory import ENTRY_OVERHEAD, MemoryCache
from batchgate.cache.redis_tier import RedisTier, redact_url
from batchgate.cache.singleflight import Flight, SingleFlight
from batchgate.cache.tiered import TieredCache

__all__ = [
    "ENTRY_OVERHEAD", "KEY_BYTES", "Breaker", "Flight", "MemoryCache", "RedisLink", "RedisTier",
    "SingleFlight", "State", "TieredCache", "model_prefix", "prefix_rows", "redact_url", "row_keys",
    "row_keys_parts",
]  # fmt: skip
