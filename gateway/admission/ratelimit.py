"""Rate limits: a GCRA bucket in process, the same algorithm as one atomic Lua script in Redis for
limits shared by every replica, and what a replica does when Redis cannot answer in time.

GCRA (the generic cell rate algorithm) is a token bucket kept as one number, the "theoretical
arrival time" (TAT): the moment the bucket would be full again. Admitting a request of cost c at
time t moves TAT to ``max(TAT, t) + c / rate``; it is allowed when that new TAT is at most
``burst / rate`` ahead of t. One number per bucket means one Redis key, one GET and one SET.

Decisions:
    ``Bucket.take`` (local)        -> 0.0 admitted, else seconds until it would be
    ``GlobalLimiter.decide``       -> the same, for a ``GlobalSpec``; Redis when it answers in time,
                                      else this replica's local share (fail-open) or a refusal
                                      (fail-closed) until a probe finds Redis again.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from batchgate.cache import Breaker, RedisLink

log = logging.getLogger(__name__)

# Rounding slack: a burst of exactly `burst` unit requests at one instant sums `burst` intervals in
# floating point and must not be refused for the last ulp.
_EPS_S = 1e-9
# A timer that fires this much past its time means the process was not running, not that Redis was slow.
_LAG_S = 0.002
_RATIO_ALPHA = 0.05


class Bucket:
    """A token bucket of ``burst`` tokens refilled at ``rate_per_s``, in GCRA form; starts full.

    The clock is the caller's (``now`` in seconds, any monotonic origin), so tests drive it.

    A cost larger than the whole burst can never fit; the primary buckets are protected from such
    requests by a static check before they get here (``Admission``), and a bucket that does see
    one (a fallback share smaller than the global burst) admits it only when full, leaving the
    bucket in debt for the excess, so the long-run rate still holds.
    """

    __slots__ = ("burst", "interval_s", "rate_per_s", "tat", "tau_s")

    def __init__(self, rate_per_s: float, burst: float) -> None:
        if not rate_per_s > 0:
            raise ValueError(f"rate must be > 0, got {rate_per_s}")
        if not burst > 0:
            raise ValueError(f"burst must be > 0, got {burst}")
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.interval_s = 1.0 / rate_per_s
        self.tau_s = burst * self.interval_s  # how far TAT may run ahead of now
        self.tat = -math.inf  # full

    def take(self, cost: float, now: float) -> float:
        """Charge ``cost`` tokens and return 0.0, or charge nothing and return the seconds to wait."""
        tat = max(now, self.tat)
        new_tat = tat + cost * self.interval_s
        wait = new_tat - now - self.tau_s
        if wait > _EPS_S:
            if cost <= self.burst:
                return wait
            if tat > now:  # oversize: wait until the bucket is full
                return tat - now
            # oversize and the bucket is full: admit, in debt
        self.tat = new_tat
        return 0.0

    def refund(self, cost: float) -> None:
        """Give back what ``take`` charged (a later limit refused the request)."""
        self.tat -= cost * self.interval_s

    def charge(self, cost: float, now: float) -> None:
        """Record use decided elsewhere (the global limiter), never leaving more than an empty bucket,
        so a switch to this bucket continues from this replica's real recent rate."""
        tat = (max(now, self.tat)) + cost * self.interval_s
        limit = now + self.tau_s
        self.tat = min(limit, tat)

    def settle(self, delta: float, now: float) -> None:
        """Charge (or give back, when negative) what an estimate charged at admission missed: never
        refused, since the work is done; a bucket may go into debt, and the next calls wait for it."""
        if delta > 0:
            self.tat = max(now, self.tat) + delta * self.interval_s
        elif delta < 0:
            self.refund(-delta)

    def tokens(self, now: float) -> float:
        """Tokens available at ``now`` (negative while in debt)."""
        ahead = self.tat - now if self.tat > now else 0.0
        return (self.tau_s - ahead) / self.interval_s


@dataclass(frozen=True, slots=True)
class Rate:
    """``per_s`` tokens a second, at most ``burst`` at once."""

    per_s: float
    burst: float

    def bucket(self, scale: float = 1.0) -> Bucket:
        return Bucket(self.per_s * scale, max(self.burst * scale, 1.0))


# -- the global limiter ---------------------------------------------------------------------------

# Redis's clock in microseconds, or ARGV[1] when a test gives one.
_NOW_LUA = """
local now
if ARGV[1] ~= '' then
  now = tonumber(ARGV[1])
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
"""

# GCRA over 1..n keys, all or nothing: either every bucket admits and all are charged, or nothing
# is written and the reply says how long to wait. Time is Redis's own clock (TIME), so replicas
# with skewed clocks still share one timeline; ARGV[1] overrides it for tests.
#   KEYS[i]   a bucket's TAT, microseconds on that clock, expiring when the bucket is full again
#   ARGV[1]   now in microseconds, or '' for TIME
#   ARGV[3i-1], ARGV[3i], ARGV[3i+1]   emission interval (us), tolerance = burst x interval (us), cost
# Returns {1, 0, ahead_1..n} admitted; {0, wait_us, ahead_1..n} refused, where ahead_i is how far
# bucket i's TAT is ahead of now after the decision (its time to be full again; the headers' reset).
GCRA_LUA = (
    _NOW_LUA
    + """local new = {}
local wait = 0
for i = 1, #KEYS do
  local interval = tonumber(ARGV[3 * i - 1])
  local tau = tonumber(ARGV[3 * i])
  local cost = tonumber(ARGV[3 * i + 1])
  local tat = tonumber(redis.call('GET', KEYS[i]) or 0)
  if tat < now then tat = now end
  local nt = tat + cost * interval
  local w = nt - now - tau
  if w > 0.001 then
    if cost * interval > tau then w = tat - now end
    if w > 0.001 and w > wait then wait = w end
  end
  new[i] = nt
end
local ahead = {}
if wait > 0 then
  ahead[1], ahead[2] = 0, math.ceil(wait)
  for i = 1, #KEYS do
    ahead[i + 2] = math.max(0, math.ceil(new[i] - now - tonumber(ARGV[3 * i + 1]) * tonumber(ARGV[3 * i - 1])))
  end
  return ahead
end
ahead[1], ahead[2] = 1, 0
for i = 1, #KEYS do
  redis.call('SET', KEYS[i], string.format('%.17g', new[i]), 'PX', math.ceil((new[i] - now) / 1000) + 1)
  ahead[i + 2] = math.ceil(new[i] - now)
end
return ahead
"""
)
GCRA_SHA = hashlib.sha1(GCRA_LUA.encode()).hexdigest()

# What an admission estimate missed, charged (or given back) once the exact count is known: never
# refused. KEYS[1] a bucket's TAT; ARGV: now ('' for TIME), interval (us), delta (tokens).
SETTLE_LUA = (
    _NOW_LUA
    + """local tat = tonumber(redis.call('GET', KEYS[1]) or 0)
if tat < now then tat = now end
local nt = tat + tonumber(ARGV[3]) * tonumber(ARGV[2])
if nt > now then
  redis.call('SET', KEYS[1], string.format('%.17g', nt), 'PX', math.ceil((nt - now) / 1000) + 1)
else
  redis.call('DEL', KEYS[1])
end
return 1
"""
)


class GlobalSpec:
    """One global limit (a tenant's, or a tenant's for one model): its Redis keys and rates, the
    local share buckets this replica uses when Redis cannot answer, and Redis's last answer here."""

    __slots__ = (
        "_args", "admit_ratio", "ahead", "keys", "late_credit", "name", "requests", "retry_at", "rows",
        "share_requests", "share_rows", "share_tokens", "tokens",
    )  # fmt: skip

    def __init__(
        self, name: str, keys: tuple[str, ...], requests: Rate | None, rows: Rate | None, share: float,
        tokens: Rate | None = None,
    ):  # fmt: skip
        self.name = name
        self.requests = requests
        self.rows = rows
        self.tokens = tokens  # its key is the last of ``keys``
        self.keys = keys
        self.share_requests = requests.bucket(share) if requests else None
        self.share_rows = rows.bucket(share) if rows else None
        self.share_tokens = tokens.bucket(share) if tokens else None
        self.ahead: tuple[float, tuple] = (0.0, ())  # Redis's last (clock, each key's time to full, s)
        self.admit_ratio: float | None = None  # recent share of this replica's decisions Redis admitted
        self.late_credit = 0.0  # error diffusion: late decisions admit in that ratio, without bursts
        self.retry_at = 0.0  # when Redis's last refusal said to come back (limiter clock)
        # per-key (interval, tolerance) in microseconds, formatted once; the cost is added per call
        self._args = tuple(
            (repr(1e6 / r.per_s), repr(r.burst * 1e6 / r.per_s))
            for r in (requests, rows, tokens)
            if r is not None
        )

    def argv(self, rows: int, now_us: str = "", tokens: int = 0) -> list[str]:
        args = [now_us]
        costs = (
            ([1] if self.requests else []) + ([rows] if self.rows else []) + ([tokens] if self.tokens else [])
        )
        for (interval, tau), cost in zip(self._args, costs, strict=True):
            args += (interval, tau, str(cost))
        return args

    def answered(self, allowed: bool) -> None:
        """Record one of Redis's answers in the recent admit ratio (an EWMA over ~20 answers)."""
        r = self.admit_ratio
        self.admit_ratio = float(allowed) if r is None else r + _RATIO_ALPHA * (allowed - r)

    def take_late(self) -> bool:
        """Decide a late decision in the ratio Redis has been admitting: deterministic, so a run of
        late decisions (a Redis hiccup) admits that fraction of them, never all or none."""
        self.late_credit += self.admit_ratio
        if self.late_credit >= 1.0:
            self.late_credit -= 1.0
            return True
        return False

    def take_share(self, rows: int, now: float, tokens: int = 0) -> float:
        """All or nothing: every share bucket takes its cost, or those that took it get it back."""
        taken = []
        for bucket, cost in ((self.share_requests, 1), (self.share_rows, rows), (self.share_tokens, tokens)):
            if bucket is None or not cost:
                continue
            wait = bucket.take(cost, now)
            if wait:
                for b, c in taken:
                    b.refund(c)
                return wait
            taken.append((bucket, cost))
        return 0.0

    def charge_share(self, rows: int, now: float, tokens: int = 0) -> None:
        if self.share_requests is not None:
            self.share_requests.charge(1, now)
        if self.share_rows is not None and rows:
            self.share_rows.charge(rows, now)
        if self.share_tokens is not None and tokens:
            self.share_tokens.charge(tokens, now)


class GlobalLimiter:
    """Global limits without Redis: every replica enforces its local share alone (with one replica
    and the default share of 1, that is the whole limit)."""

    backend = "local"

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.fallback_decisions = 0

    @property
    def up(self) -> bool:
        return False

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def decide(self, spec: GlobalSpec, rows: int, tokens: int = 0) -> float:
        self.fallback_decisions += 1
        return spec.take_share(rows, self.clock(), tokens)

    def settle(self, spec: GlobalSpec, delta: int) -> None:
        """Charge ``delta`` more tokens (fewer, when negative) than the decision did: the exact
        count against the estimate it was decided on."""
        if spec.share_tokens is not None and delta:
            spec.share_tokens.settle(delta, self.clock())

    def stats(self) -> dict:
        return {"backend": self.backend, "up": self.up, "fallback_decisions": self.fallback_decisions}


class RedisLimiter(GlobalLimiter):
    """Global limits in Redis: one EVALSHA per decision; no decision waits longer than ``timeout_s``.

    Decisions share round trips: at most ``max_batches`` are in flight, and decisions arriving
    meanwhile queue for the next one, which carries all of them as a pipeline of EVALSHAs (each
    still its own atomic script). Alone, a decision is one plain command sent at the end of the
    loop turn; under load the batches grow by themselves, and a pipelined decision costs the
    gateway a fraction of the CPU of a command of its own (redis-py spends 300+ us of CPU per
    command), which is what keeps a global limit affordable at thousands of calls a second.

    A decision whose answer is late is made locally: it admits in the ratio Redis has recently
    been admitting for that limit on this replica (before any answer, the local share decides;
    when fail-closed, it is refused). Its
    command is dropped if not yet sent, and otherwise left to finish: cancelling a sent command
    tears down the connection, and a late answer is most often this process's own event loop
    running behind (a busy or CPU-throttled pod), not Redis. What trips the breaker is Redis
    failing: an error, or no answer within ``slow_s`` (10x the timeout, 50 ms at least) unless
    this process was itself stalled past that deadline. While it is open, decisions skip Redis
    entirely. The breaker and its one probe task are the ``RedisLink``'s (``cache/link.py``),
    shared with the result cache: whichever user sees Redis fail, both go without it, and the
    link's probe brings both back.
    """

    backend = "redis"

    def __init__(
        self,
        link,  # batchgate.cache.RedisLink
        timeout_s: float = 0.005,
        fail_mode: Literal["open", "closed"] = "open",
        connect_timeout_s: float | None = None,
        max_batches: int = 4,
        clock: Callable[[], float] = time.monotonic,
        close_link: bool = False,
    ) -> None:
        super().__init__(clock)
        self.max_batches = max_batches
        self.link = link
        self.breaker = link.breaker
        self.timeout_s = timeout_s
        self.fail_mode = fail_mode
        self.slow_s = max(10 * timeout_s, 0.05)
        self.connect_timeout_s = link.connect_timeout_s if connect_timeout_s is None else connect_timeout_s
        self._close_link = close_link
        self._closed = False
        self._queue: list[tuple[tuple[str, ...], list[str], asyncio.Future]] = []
        self._batches: set[asyncio.Task] = set()
        self._flush_pending = False
        self.errors = 0
        self.timeouts = 0
        self.late = 0
        self.round_trips = 0
        self.stalls = 0
        self.last_error = ""

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        timeout_s: float,
        connect_timeout_s: float = 1.0,
        probe_initial_s: float = 0.05,
        probe_max_s: float = 2.0,
        **kwargs,
    ) -> RedisLimiter:
        """A limiter on a ``RedisLink`` of its own (closed with it); the server passes its one
        link to the constructor instead."""
        link = RedisLink(
            url,
            breaker=Breaker(open_s=probe_max_s),  # a decision's failure trips it: the count is moot
            connect_timeout_s=connect_timeout_s,
            socket_timeout_s=max(connect_timeout_s, timeout_s),
            probe_initial_s=probe_initial_s,
            probe_max_s=probe_max_s,
            probe_answer_s=max(10 * timeout_s, 0.05),
        )
        return cls(link, timeout_s=timeout_s, close_link=True, **kwargs)

    @property
    def client(self):
        return self.link.client

    @property
    def up(self) -> bool:
        return self.link.up

    @property
    def probes(self) -> int:
        return self.breaker.probes

    async def start(self) -> None:
        """Warm one connection and load the script; Redis being down here is not fatal."""
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                await self.client.script_load(GCRA_LUA)
        except Exception as exc:  # noqa: BLE001 - any failure means "down", and is logged
            self._trip(exc)

    async def close(self) -> None:
        self._closed = True
        log.info("global rate limits at close: %s", self.stats())
        tasks = list(self._batches)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._close_link:
            await self.link.close()

    async def decide(self, spec: GlobalSpec, rows: int, tokens: int = 0) -> float:
        if self.breaker.allow():
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            answer = self._submit(spec.keys, spec.argv(rows, "", tokens))
            try:
                await asyncio.wait((answer,), timeout=self.timeout_s)
                if not answer.done() and loop.time() - t0 > self.timeout_s + _LAG_S:
                    # The timer fired late: this process was not running (a busy or throttled CPU),
                    # and the answer may already sit in our socket. Two turns of our own loop pick
                    # it up; that waits on us, not on Redis.
                    for _ in range(2):
                        await asyncio.sleep(0)
                        if answer.done():
                            break
            finally:
                if not answer.done():  # late, or our caller was cancelled: decided without it
                    answer.cancel()  # unsent, it is dropped from the batch and charges nothing
            if answer.cancelled():
                self.late += 1
                if spec.admit_ratio is not None and self.fail_mode == "open":
                    # Redis is up, only late for this one: admit in the ratio Redis has been
                    # admitting here. The share would be wrong for a replica that takes more or less
                    # than its share of the traffic, and these are Redis's calls, not an outage.
                    now = self.clock()
                    if spec.take_late():
                        spec.charge_share(rows, now, tokens)
                        return 0.0
                    return max(spec.retry_at - now, 0.001)
            elif answer.exception() is None:
                allowed, wait_us, *ahead = answer.result()
                now = self.clock()
                spec.ahead = (now, tuple(a / 1e6 for a in ahead))
                spec.answered(bool(allowed))
                if allowed:
                    spec.charge_share(rows, now, tokens)
                    return 0.0
                spec.retry_at = now + wait_us / 1e6
                return wait_us / 1e6
            # else the batch failed and has tripped the breaker
        self.fallback_decisions += 1
        if self.fail_mode == "closed":
            return self.link.retry_in()
        return spec.take_share(rows, self.clock(), tokens)

    def settle(self, spec: GlobalSpec, delta: int) -> None:
        super().settle(spec, delta)
        if delta and spec.tokens is not None and self.breaker.allow() and not self._closed:
            # Not waited for: the call is answered; a settlement lost to a Redis failure leaves the
            # shared bucket off by one estimate's error, as a fail-open decision does.
            task = asyncio.get_running_loop().create_task(self._settle(spec, delta))
            self._batches.add(task)
            task.add_done_callback(self._batches.discard)

    async def _settle(self, spec: GlobalSpec, delta: int) -> None:
        key, interval = spec.keys[-1], spec._args[-1][0]
        try:
            async with asyncio.timeout(self.slow_s):
                await self.client.eval(SETTLE_LUA, 1, key, "", interval, str(delta))
        except Exception as exc:  # noqa: BLE001 - timeouts, connection and server errors alike
            self._trip(exc)

    def _submit(self, keys: tuple[str, ...], argv: list[str]) -> asyncio.Future:
        """Queue one decision; it goes out at the end of this loop turn if a batch slot is free,
        else with the next batch when one comes back."""
        loop = asyncio.get_running_loop()
        answer = loop.create_future()
        self._queue.append((keys, argv, answer))
        if not self._flush_pending and len(self._batches) < self.max_batches:
            self._flush_pending = True
            loop.call_soon(self._flush)
        return answer

    def _flush(self) -> None:
        self._flush_pending = False
        if len(self._batches) >= self.max_batches:
            return
        batch = [item for item in self._queue if not item[2].done()]  # late ones are not sent
        self._queue = []
        if not batch:
            return
        task = asyncio.get_running_loop().create_task(self._run(batch))
        self._batches.add(task)
        task.add_done_callback(self._batch_done)

    def _batch_done(self, task: asyncio.Task) -> None:
        self._batches.discard(task)
        if self._queue and not self._flush_pending and not self._closed:
            self._flush_pending = True
            asyncio.get_running_loop().call_soon(self._flush)

    async def _run(self, batch: list[tuple[tuple[str, ...], list[str], asyncio.Future]]) -> None:
        """One round trip for the batch; every decision still waiting in it is answered once."""
        from redis.exceptions import NoScriptError

        self.round_trips += 1
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.slow_s
        try:
            async with asyncio.timeout_at(deadline):
                if len(batch) == 1:
                    keys, argv, _ = batch[0]
                    try:
                        results = [await self.client.evalsha(GCRA_SHA, len(keys), *keys, *argv)]
                    except NoScriptError:  # a restarted or flushed Redis: EVAL sends the body, caches it
                        results = [await self.client.eval(GCRA_LUA, len(keys), *keys, *argv)]
                else:
                    pipe = self.client.pipeline(transaction=False)
                    for keys, argv, _ in batch:
                        pipe.evalsha(GCRA_SHA, len(keys), *keys, *argv)
                    results = await pipe.execute(raise_on_error=False)
                    again = [i for i, r in enumerate(results) if isinstance(r, NoScriptError)]
                    if again:
                        pipe = self.client.pipeline(transaction=False)
                        for i in again:
                            keys, argv, _ = batch[i]
                            pipe.eval(GCRA_LUA, len(keys), *keys, *argv)
                        for i, r in zip(again, await pipe.execute(raise_on_error=False), strict=True):
                            results[i] = r
        except asyncio.CancelledError:  # closing
            for _, _, answer in batch:
                answer.cancel()
            raise
        except Exception as exc:  # noqa: BLE001 - timeouts, connection and server errors alike
            if isinstance(exc, TimeoutError) and loop.time() - deadline > self.slow_s / 2:
                self.stalls += 1  # our process was not running when the timer was due: not Redis's fault
            else:
                self._trip(exc)
            for _, _, answer in batch:
                if not answer.done():
                    answer.set_exception(exc)
                    answer.exception()  # read: nobody may be waiting any more
            return
        failed = False
        for (_, _, answer), result in zip(batch, results, strict=True):
            if isinstance(result, Exception):
                failed = True
                self._trip(result)
                if not answer.done():
                    answer.set_exception(result)
                    answer.exception()
            elif not answer.done():
                answer.set_result(result)
        if not failed:
            self.breaker.success()  # answered within slow_s, whether or not its deciders still waited

    def _trip(self, exc: BaseException) -> None:
        if self._closed:
            return
        if isinstance(exc, TimeoutError):
            self.timeouts += 1
        else:
            self.errors += 1
        self.last_error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if self.link.up:
            log.warning(
                "global rate limits: deciding %s until Redis answers again",
                "with this replica's local share" if self.fail_mode == "open" else "by refusing (fail-closed)",
            )  # fmt: skip
        self.breaker.trip(f"global rate limit decision: {self.last_error}")

    def stats(self) -> dict:
        return {
            "backend": self.backend,
            "up": self.up,
            "fallback_decisions": self.fallback_decisions,
            "errors": self.errors,
            "timeouts": self.timeouts,
            "late": self.late,
            "round_trips": self.round_trips,
            "stalls": self.stalls,
            "probes": self.probes,
            "last_error": self.last_error,
        }
