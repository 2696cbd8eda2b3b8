"""The process's one Redis client and its one circuit breaker.

The result cache's Redis tier (``cache/redis_tier.py``) and the global rate limiter
(``gateway/admission/ratelimit.py``) talk to the same Redis, so they share one view of whether it is up:
when it fails both go without it (the cache misses and skips its writes; the limiter decides
with this replica's local share, or refuses when fail-closed), and one probe task brings both
back at once. Each user still bounds its own calls with its own timeout (a lookup's, a
decision's); the client's socket timeouts are only the backstop behind them.

Both users consult ``breaker.allow()`` and report to it: ``failure`` for evidence that counts
toward ``failures_to_open`` in a row (the cache's lookup and write failures and timeouts),
``trip`` for evidence that is conclusive alone (the limiter's: an error, or no answer within ten
times its timeout), ``success`` for a real answer. Opening starts the probe task: it waits
``probe_initial_s``, doubling per failed probe up to ``probe_max_s`` (and never longer than the
breaker's ``open_s``), drops the idle pooled connections (after a restart they are all dead),
PINGs patiently (a reconnect may take a while) and then again within ``probe_answer_s``; that
closes the breaker. The backoff starts again from ``probe_initial_s`` only once a real call has
succeeded since, so a Redis that answers PING but fails real commands is not hammered.

One ``redis.asyncio`` client, built here and nowhere else: redis-py parses the URL
(``redis://``, ``rediss://`` for TLS, ``user:password@``, ``/db``, query options such as
``ssl_ca_certs``; the settings have put a password file's password in it already). The limiter
sends its commands through the client's pool (redis-py retries a command once on a lost
connection: what a restart leaves in the pool). The cache makes its own connections from the
same connection settings (``connection``) and keeps its own free list, without redis-py's
retry: it retries a stale connection itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from batchgate.cache.breaker import Breaker, State

log = logging.getLogger(__name__)


def redact_url(url: str) -> str:
    """The URL with its password replaced, for logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class RedisLink:
    def __init__(
        self,
        url: str,
        *,
        breaker: Breaker | None = None,
        connect_timeout_s: float = 1.0,
        socket_timeout_s: float = 1.0,
        probe_initial_s: float = 0.05,
        probe_max_s: float = 2.0,
        probe_answer_s: float = 0.05,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.url = url
        self.breaker = breaker if breaker is not None else Breaker()
        self.breaker.hand_recovery_to(self._opened)
        self.connect_timeout_s = connect_timeout_s
        self.probe_max_s = min(probe_max_s, self.breaker.open_s)
        self.probe_initial_s = min(probe_initial_s, self.probe_max_s)
        self.probe_answer_s = probe_answer_s
        self.clock = clock
        self.last_error = ""
        self._backoff_s = self.probe_initial_s
        self._next_probe = 0.0
        self._probe_task: asyncio.Task | None = None
        self._closed = False
        # One retry, on a lost connection only: after a Redis restart every pooled connection is
        # dead and its first command fails without having reached Redis. (A connection lost after
        # Redis ran a limiter script charges that decision twice: rare, and on the safe side.) No
        # retry on timeouts: each call has one chance within its own timeout, and the breaker
        # decides when to try a slow Redis again.
        pool = aioredis.ConnectionPool.from_url(
            url,
            socket_connect_timeout=connect_timeout_s,
            socket_timeout=socket_timeout_s,
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
            health_check_interval=0,
        )
        self.client = aioredis.Redis.from_pool(pool)
        self._raw = pool.connection_class
        self._raw_kwargs = {**pool.connection_kwargs, "retry": Retry(NoBackoff(), 0)}

    @classmethod
    def from_settings(cls, settings) -> RedisLink | None:
        """The server's link (``gateway.config.Settings``), or None without a Redis URL."""
        if not settings.redis_url:
            return None
        decision_s = settings.ratelimit_redis_timeout_ms / 1e3
        return cls(
            settings.redis_url,
            breaker=Breaker(settings.cache_breaker_failures, settings.cache_breaker_open_s),
            connect_timeout_s=1.0,
            socket_timeout_s=max(1.0, decision_s),
            probe_initial_s=settings.ratelimit_probe_initial_ms / 1e3,
            probe_max_s=settings.ratelimit_probe_max_ms / 1e3,
            probe_answer_s=max(10 * decision_s, 0.05),  # the bound that trips the limiter
        )

    @property
    def up(self) -> bool:
        return self.breaker.state is State.CLOSED

    def connection(self):
        """A new, unconnected connection with the client's settings and no redis-py retry."""
        return self._raw(**self._raw_kwargs)

    def retry_in(self) -> float:
        """Seconds until the next probe (a short wait while one is under way)."""
        return max(self._next_probe - self.clock(), 0.001)

    # -- recovery ----------------------------------------------------------------------------

    def _opened(self, reason: str) -> None:
        """The breaker opened (a user's failures): log once, schedule the one probe."""
        if self._closed:
            return
        if reason:
            self.last_error = reason
        log.warning(
            "Redis failed (%s): the result cache and the global rate limits go without %s until a probe "
            "answers", reason or "failures in a row", redact_url(self.url),
        )  # fmt: skip
        b = self.breaker
        if b.proven:
            self._backoff_s = self.probe_initial_s
        else:  # it failed again right after recovering, before any real call succeeded
            self._backoff_s = min(self._backoff_s * 2, self.probe_max_s)
        self._next_probe = self.clock() + self._backoff_s
        if self._probe_task is None or self._probe_task.done():
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop: nothing to probe from (the next failure on a loop will)
                return
            self._probe_task = loop.create_task(self._probe(), name="redis-probe")

    async def _probe(self) -> None:
        b = self.breaker
        while True:
            await asyncio.sleep(max(self._next_probe - self.clock(), 0.0))
            b.probing()
            try:
                # connections opened before the failure are likely dead; start the next ones fresh
                await self.client.connection_pool.disconnect(inuse_connections=False)
                async with asyncio.timeout(self.connect_timeout_s):
                    await self.client.ping()
                async with asyncio.timeout(self.probe_answer_s):  # in time, not just alive
                    await self.client.ping()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure means "still down"
                self.last_error = describe(exc)
                b.probed(False)
                self._backoff_s = min(self._backoff_s * 2, self.probe_max_s)
                self._next_probe = self.clock() + self._backoff_s
                continue
            b.probed(True)
            log.info("Redis answers again (%s, probe %d)", redact_url(self.url), b.probes)
            return

    # -- figures and shutdown ----------------------------------------------------------------

    def stats(self) -> dict:
        b = self.breaker
        return {
            "state": b.state.value, "opens": b.opens, "probes": b.probes, "rejected": b.rejected,
            "last_error": self.last_error,
        }  # fmt: skip

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        task = self._probe_task
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        try:
            await self.client.aclose()
        except Exception as exc:  # noqa: BLE001 - closing connections whose server is gone
            log.debug("closing the redis client: %s", exc)
