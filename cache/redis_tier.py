"""The shared tier: Redis, through redis-py's asyncio connections (hiredis parser when installed).

Reads: at most one MGET per request for the rows it owns (requests asking in the same turn of
the event loop share one), bounded by ``lookup_timeout_s``; a slow, down or refusing Redis turns
into misses, never into an error or a stall past the timeout.
Writes: queued and sent behind the responses by one writer task, many requests' rows per
command (a short Lua script doing ``SET key value PX ttl`` for each); when the queue is full new
rows are dropped (counted). Connection failures and timeouts of either count toward the breaker
of the process's one ``RedisLink`` (shared with the global rate limiter, ``cache/link.py``); while
it is open Redis is not asked at all and the writes queued meanwhile are dropped.

The link's connection settings (URL, TLS, auth, timeouts) make and handshake the connections;
this module keeps its own free list of them and writes the two commands it sends itself. The
per-request path runs on the gateway's one event loop, where redis-py's general command
machinery (pool lock, retries, per-argument encoding, observability hooks) cost several times
the round trip's own CPU. redis-py's own retries are off; what this module retries is a kept
connection found dead (what a Redis restart leaves behind, all of them at once): the lookup or
write goes again, once, on a fresh connection before a miss or a failure is counted. Beyond that
the breaker and the next request are the retry.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from redis.exceptions import ConnectionError, RedisError, ResponseError

from batchgate.cache.breaker import Breaker
from batchgate.cache.link import RedisLink, describe, redact_url

log = logging.getLogger(__name__)

# One round trip stores a whole batch, each row with its TTL; KEYS are the keys, ARGV the values
# then the TTL in ms.
SET_PX_SCRIPT = (
    b"local ttl = ARGV[#ARGV] "
    b"for i = 1, #KEYS do redis.call('SET', KEYS[i], ARGV[i], 'PX', ttl) end "
    b"return #KEYS"
)


# -- RESP, packed with a few C-level joins ----------------------------------------------------------


def _bulk(items: Sequence[bytes], prefix: bytes = b"") -> bytes:
    """RESP bulk strings for ``prefix + item`` each; one join when all items are one length."""
    if not items:
        return b""
    n = len(items[0])
    if all(len(x) == n for x in items):  # the usual case: keys are digests, values one layout
        head = b"$%d\r\n%s" % (n + len(prefix), prefix)
        return head + (b"\r\n" + head).join(items) + b"\r\n"
    return b"".join(b"$%d\r\n%s%s\r\n" % (len(x) + len(prefix), prefix, x) for x in items)


def pack_mget(prefix: bytes, keys: Sequence[bytes]) -> bytes:
    return b"*%d\r\n$4\r\nMGET\r\n" % (len(keys) + 1) + _bulk(keys, prefix)


def pack_set_px(prefix: bytes, keys: Sequence[bytes], values: Sequence[bytes], ttl_ms: int) -> bytes:
    n = len(keys)
    ttl = b"%d" % ttl_ms
    return (
        b"*%d\r\n$4\r\nEVAL\r\n$%d\r\n%s\r\n" % (2 * n + 4, len(SET_PX_SCRIPT), SET_PX_SCRIPT)
        + b"$%d\r\n%d\r\n" % (len(str(n)), n)
        + _bulk(keys, prefix)
        + _bulk(values)
        + b"$%d\r\n%s\r\n" % (len(ttl), ttl)
    )


_TIMED_OUT = object()

# A reply that reached the socket by the time the lookup timer fires still needs a few turns of
# the event loop to travel (read, parse, hand out, wake the request). When the loop is busy a
# turn can take milliseconds, and giving up at once would blame Redis for the gateway's own lag
# (and open the breaker under load). So the timer gives up only after this many more turns.
_GRACE_TURNS = 3


def _give_up(fut: asyncio.Future, turns: int = _GRACE_TURNS) -> None:
    if fut.done():
        return
    if turns:
        fut.get_loop().call_soon(_give_up, fut, turns - 1)
    else:
        fut.set_result(_TIMED_OUT)


class _Batch:
    """The lookups of one event-loop turn: their keys end to end, and where each request's are."""

    __slots__ = ("keys", "parts", "failed", "t0")

    def __init__(self, t0: float) -> None:
        self.keys: list[bytes] = []
        self.parts: list[tuple[int, int, asyncio.Future]] = []
        self.failed = False
        self.t0 = t0


@dataclass(slots=True)
class RedisStats:
    hits: int = 0  # rows
    misses: int = 0  # rows asked for and not found
    lookups: int = 0  # MGETs answered (requests asking in the same loop turn share one)
    lookup_ns: int = 0  # their total time
    errors: int = 0  # MGETs that failed (connection, protocol)
    timeouts: int = 0  # requests that gave up on an MGET after lookup_timeout_s
    skipped: int = 0  # rows not looked up: breaker open, or too many lookups in flight
    invalid: int = 0  # values of the wrong size, treated as misses
    writes: int = 0  # rows written
    write_batches: int = 0  # write round trips
    write_errors: int = 0  # rows whose write failed
    write_dropped: int = 0  # rows not written: queue full, breaker open, or shutdown
    connections: int = 0  # open now


class RedisTier:
    def __init__(
        self,
        link: RedisLink | str,
        *,
        ttl_s: float,
        lookup_timeout_s: float,
        breaker: Breaker | None = None,
        key_prefix: bytes = b"bg:rc:",
        max_connections: int = 32,
        write_queue_rows: int = 100_000,
        write_batch_rows: int = 512,
        write_timeout_s: float = 1.0,
        close_link: bool | None = None,
    ) -> None:
        """``link``: the process's ``RedisLink`` (its breaker is the tier's), or a URL for a link
        of the tier's own, with ``breaker`` and ``write_timeout_s`` as its connections' timeouts.
        ``close_link``: close the link with the tier (default: only a link of its own)."""
        if ttl_s <= 0:
            raise ValueError("ttl_s must be > 0: entries without a TTL would live in Redis forever")
        if isinstance(link, str):
            link = RedisLink(
                link, breaker=breaker, connect_timeout_s=write_timeout_s, socket_timeout_s=write_timeout_s,
                probe_answer_s=max(10 * lookup_timeout_s, 0.05),
            )  # fmt: skip
            close_link = True if close_link is None else close_link
        elif breaker is not None and breaker is not link.breaker:
            raise ValueError("a tier on a shared RedisLink uses the link's breaker")
        self.link = link
        self._close_link = bool(close_link)
        self.url = link.url
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.lookup_timeout_s = lookup_timeout_s
        self.breaker = link.breaker
        self.key_prefix = key_prefix
        self.write_queue_rows = write_queue_rows
        self.write_batch_rows = write_batch_rows
        self.write_timeout_s = write_timeout_s
        # One connection is the writer's; lookups beyond the rest are skipped, not queued.
        self.max_lookups = max(1, max_connections - 1)
        self.stats = RedisStats()
        self._idle: list = []  # connected lookup connections, most recently used last
        self._open: set = set()
        self._lookups = 0  # MGETs in flight
        self._batch: _Batch | None = None  # lookups gathering for the next MGET
        self._writer_conn = None
        self._writer_conn_fresh = False
        self._pending: deque[tuple[list[bytes], list[bytes]]] = deque()
        self._pending_rows = 0
        self._wake: asyncio.Event | None = None
        self._writer: asyncio.Task | None = None
        self._writing = 0  # rows taken by the writer and not yet answered
        self._closed = False

    # -- connections ----------------------------------------------------------------------------

    async def _connect(self):
        conn = self.link.connection()  # its socket timeout bounds an abandoned lookup's life too
        self._open.add(conn)
        self.stats.connections = len(self._open)
        try:
            await conn.connect()
        except BaseException:
            self._drop(conn)
            raise
        return conn

    def _drop(self, conn) -> None:
        """Forget a connection in an unknown state (error, timeout) and close its socket."""
        self._open.discard(conn)
        self.stats.connections = len(self._open)
        try:
            asyncio.get_running_loop().create_task(conn.disconnect(nowait=True))
        except RuntimeError:  # no loop (interpreter shutting down)
            pass

    async def _command(self, conn, payload: bytes):
        await conn.send_packed_command(payload, check_health=False)
        return await conn.read_response()

    async def warm(self, connections: int = 4, timeout_s: float = 1.0) -> bool:
        """Open a few lookup connections before traffic, so first lookups do not pay the
        connection setup against the lookup timeout. Never raises: False when Redis did not answer."""
        n = max(1, min(connections, self.max_lookups))
        conns = []
        try:
            async with asyncio.timeout(timeout_s):
                for _ in range(n):
                    conn = await self._connect()
                    conns.append(conn)
                    await self._command(conn, b"*1\r\n$4\r\nPING\r\n")
        except (TimeoutError, RedisError, OSError) as exc:
            for conn in conns:
                self._drop(conn)
            log.warning(
                "redis %s did not answer at start (%s); lookups will miss until it does",
                redact_url(self.url),
                exc,
            )
            return False
        self._idle.extend(conns)
        return True

    # -- reads ---------------------------------------------------------------------------------

    async def get_many(self, keys: Sequence[bytes], width: int | None = None) -> list[bytes | None] | None:
        """Values for ``keys`` (None per miss), or None when Redis was not or could not be asked.

        ``width``: the only valid value length, when known; others count as misses.

        Requests that ask in the same turn of the event loop share one MGET: under load many
        arrive together, and each round trip costs system calls and wake-ups on the one loop
        thread. A request never waits for another's; it waits at most ``lookup_timeout_s``.
        """
        st = self.stats
        if self._closed or not self.breaker.allow():
            st.skipped += len(keys)
            return None
        loop = asyncio.get_running_loop()
        batch = self._batch
        if batch is None:
            if self._lookups >= self.max_lookups:
                st.skipped += len(keys)
                return None
            self._lookups += 1
            batch = self._batch = _Batch(loop.time())
            loop.call_soon(self._send, batch)
        fut = loop.create_future()
        batch.parts.append((len(batch.keys), len(keys), fut))
        batch.keys.extend(keys)
        timer = loop.call_later(self.lookup_timeout_s, _give_up, fut)
        try:
            values = await fut
        finally:
            timer.cancel()
        if values is _TIMED_OUT:
            st.timeouts += 1
            if not batch.failed:  # one failure per MGET, however many requests shared it
                batch.failed = True
                self.breaker.failure(f"result cache lookup timed out ({self.lookup_timeout_s * 1e3:g} ms)")
            return None
        if values is None:  # the MGET failed (counted once, in _done)
            return None
        n_miss = values.count(None)
        if width is not None and n_miss < len(values):
            for i, v in enumerate(values):
                if v is not None and len(v) != width:
                    values[i] = None
                    st.invalid += 1
                    n_miss += 1
        st.hits += len(keys) - n_miss
        st.misses += n_miss
        return values

    def _send(self, batch: _Batch) -> None:
        # The MGET runs as its own task and requests stop waiting for it at their timeout,
        # rather than cancelling it in place: redis-py can lose a cancellation that lands
        # during a connection's handshake and then wait for the server (seen with CLIENT PAUSE).
        # An MGET given up on finishes or fails later by itself (socket_timeout bounds it) and
        # holds its connection until then, so a stalled Redis fills max_lookups and further
        # lookups are skipped instead of piling up.
        if self._batch is batch:
            self._batch = None
        task = asyncio.get_running_loop().create_task(self._mget(pack_mget(self.key_prefix, batch.keys)))
        task.add_done_callback(lambda t: self._done(batch, t))

    def _done(self, batch: _Batch, task: asyncio.Task) -> None:
        st = self.stats
        exc = asyncio.CancelledError() if task.cancelled() else task.exception()
        values = None if exc is not None else task.result()
        if values is not None and len(values) != len(batch.keys):
            exc = RedisError(f"MGET of {len(batch.keys)} keys answered {len(values)} values")
        if exc is not None:
            st.errors += 1
            if not batch.failed:
                batch.failed = True
                self.breaker.failure(f"result cache lookup: {describe(exc)}")
            if isinstance(exc, RedisError | OSError):
                log.debug("redis lookup failed: %s", exc)
            else:
                log.error("redis lookup failed: %r", exc)
            for _, _, fut in batch.parts:
                if not fut.done():
                    fut.set_result(None)
            return
        if not batch.failed:  # an answer after its requests gave up does not close the breaker
            self.breaker.success()
        st.lookups += 1
        st.lookup_ns += int((task.get_loop().time() - batch.t0) * 1e9)
        for start, n, fut in batch.parts:
            if not fut.done():
                fut.set_result(values[start : start + n])

    async def _mget(self, payload: bytes) -> list:
        try:
            return await self._on_lookup_conn(payload)
        finally:
            self._lookups -= 1

    async def _on_lookup_conn(self, payload: bytes):
        for attempt in (0, 1):
            reused = bool(self._idle)
            conn = self._idle.pop() if reused else await self._connect()
            try:
                values = await self._command(conn, payload)
            except BaseException as exc:
                self._drop(conn)
                if not isinstance(exc, ConnectionError | OSError):
                    raise
                # A lost connection is what a Redis restart looks like: every kept one is as
                # stale, so they all go; if this one was kept, try once on a fresh one.
                self._drop_idle()
                if not reused or attempt:
                    raise
                log.debug("redis connection went stale (%s); reconnecting", exc)
                continue
            if self._closed:
                self._drop(conn)
            else:
                self._idle.append(conn)
            return values
        raise AssertionError("unreachable")

    def _drop_idle(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            self._drop(conn)

    # -- writes (behind the response) ----------------------------------------------------------

    def put_many(self, keys: list[bytes], values: list[bytes]) -> None:
        """Queue rows for the writer; returns at once."""
        n = len(keys)
        if self._closed or self._pending_rows + n > self.write_queue_rows:
            self.stats.write_dropped += n
            return
        self._pending.append((keys, values))
        self._pending_rows += n
        if self._writer is None:
            self._wake = asyncio.Event()
            self._writer = asyncio.get_running_loop().create_task(
                self._write_loop(), name="cache-redis-writer"
            )
        self._wake.set()

    @property
    def pending_rows(self) -> int:
        return self._pending_rows

    def _take(self) -> tuple[list[bytes], list[bytes]]:
        keys: list[bytes] = []
        values: list[bytes] = []
        while self._pending and len(keys) < self.write_batch_rows:
            k, v = self._pending.popleft()
            keys.extend(k)
            values.extend(v)
        self._pending_rows -= len(keys)
        return keys, values

    async def _write_loop(self) -> None:
        wake = self._wake
        while True:
            if not self._pending:
                wake.clear()
                await wake.wait()
                continue
            keys, values = self._take()
            if not self.breaker.allow():
                self.stats.write_dropped += len(keys)
                continue
            self._writing = len(keys)
            try:
                await self._write(keys, values)
            except asyncio.CancelledError:
                raise
            except Exception:  # never let the writer die: the queue would only fill up
                self.stats.write_errors += len(keys)
                log.exception("redis write of %d rows failed", len(keys))
            finally:
                self._writing = 0

    async def _write(self, keys: list[bytes], values: list[bytes]) -> None:
        st = self.stats
        payload = pack_set_px(self.key_prefix, keys, values, self.ttl_ms)
        try:
            async with asyncio.timeout(self.write_timeout_s):
                try:
                    await self._send_write(payload)
                except (ConnectionError, OSError):
                    if self._writer_conn_fresh:
                        raise
                    await self._send_write(payload)  # a kept connection gone stale: once more, fresh
        except ResponseError as exc:
            # Redis is up but refuses these writes (e.g. OOM under maxmemory noeviction): counted,
            # and the breaker stays closed. The reply was read, so the connection is fine.
            st.write_errors += len(keys)
            log.debug("redis refused a write of %d rows: %s", len(keys), exc)
            self.breaker.success()
            return
        except (TimeoutError, RedisError, OSError) as exc:
            st.write_errors += len(keys)
            self.breaker.failure(f"result cache write: {describe(exc)}")
            if self._writer_conn is not None:
                self._drop(self._writer_conn)
                self._writer_conn = None
            log.debug("redis write of %d rows failed: %s", len(keys), exc)
            return
        self.breaker.success()
        st.writes += len(keys)
        st.write_batches += 1

    async def _send_write(self, payload: bytes) -> None:
        conn = self._writer_conn
        self._writer_conn_fresh = conn is None
        if conn is None:
            conn = self._writer_conn = await self._connect()
        try:
            await self._command(conn, payload)
        except (ConnectionError, OSError):
            self._drop(conn)
            self._writer_conn = None
            raise

    async def flush(self, timeout_s: float) -> bool:
        """Wait until the queued writes are sent (or ``timeout_s``); True when none are left."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._pending_rows or self._writing:
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(0.005)
        return True

    async def close(self, flush_timeout_s: float = 1.0) -> None:
        if self._closed:
            return
        try:
            await self.flush(flush_timeout_s)
        finally:
            self._closed = True
            if self._writer is not None:
                self._writer.cancel()
                try:
                    await self._writer
                except BaseException:
                    pass
            self.stats.write_dropped += self._pending_rows
            self._pending.clear()
            self._pending_rows = 0
            for conn in list(self._open):
                try:
                    await conn.disconnect(nowait=True)
                except Exception as exc:  # closing a connection whose server is gone
                    log.debug("closing a redis connection: %s", exc)
            self._open.clear()
            self._idle.clear()
            self.stats.connections = 0
            if self._close_link:
                await self.link.close()
