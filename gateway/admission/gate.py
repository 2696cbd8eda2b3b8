"""The load shedder: the share of new calls taken while the process is past its ceiling, set
from what the calls that ended lately wasted. Asked by the door (``door.py``), which counts every
transport's arrivals and ends here, and by gRPC's call takers for the calls they take."""

from __future__ import annotations

import asyncio
import os
import time
from typing import TYPE_CHECKING, Protocol

from batchgate.gateway.errors import GatewayError, Kind

if TYPE_CHECKING:
    from batchgate.gateway.scheduling.latency import LoopLag


class Load(Protocol):
    """What the shedder reads of the process's load (the pipeline gives it)."""

    inflight: int  # calls inside the pipeline now, every transport

    @property
    def lag(self) -> LoopLag: ...  # the event loop's lag monitor (its beat is the shedder's timer)

    # Optional: seconds the work queued in the schedulers would keep a new call waiting (None:
    # not known). A load without it is never vouched for (every call is subject to the share).
    # def backlog_s(self) -> float | None: ...


RETRY_S = 0.05  # the overload refusal's retry hint
_RETRY_TRAILERS = (("grpc-retry-pushback-ms", "50"), ("retry-after-ms", "50"))


class LoadShedder:
    """Refuses a share of new calls, before any decoding, while the process is past its ceiling.

    Past its ceiling a server that takes every call spends its time on calls that then miss their
    deadlines (goodput falls to nothing). Two signals, looked at every 10 ms:

    - **wasted calls**: of the calls that ended lately (decaying counts, ~100 ms of memory), the
      share that was taken and then dropped — shed by the scheduler, expired in its queue, or
      abandoned by a caller whose deadline passed. Over ``WASTE``, the admitted share is set to what
      the server is completing: the calls that ended well per call that arrived, plus 5 % — while
      more than ``min_in_flight`` calls have been inside lately, or the process is saturated (one
      caller's run of hopeless deadlines is no overload). Rates, not steps: a caller's call that
      dies now was taken up to its budget ago, so cutting by a step per look for as long as drops
      go on would overshoot to nothing and refuse at 1x. Saturated: the loop's thread busy, or the
      process's CPU at the cores it may use, for ``SATURATED`` of the time lately. Without it a
      sudden spike on an idle server goes unseen: the calls wait in gRPC core and reach Python
      with their deadlines spent, so few are ever inside (docs/performance.md, "Figures the code
      cites");
    - **a standing queue on the loop** (CoDel's idea): the event loop's lag has stayed over the
      target for a whole ``STANDING_S`` while more than ``min_in_flight`` calls are inside (a lag
      burst, a big batch's answers, is no overload) and calls are being lost (over ``LAG_WASTE``
      of those that end): the share is cut by a fifth, once per stretch.

    A closed loop at capacity whose calls meet their budgets loses none: the admission estimate,
    calibrated against the calls' real times, refuses none of them (bench.text_batches;
    tests/test_capacity_live.py).

    With neither, the share grows back by half a percent per look (all of it within two seconds).

    While shedding, a call whose deadline leaves it more time than the work queued ahead of it
    (the schedulers' backlog, looked at once a look, and the loop's lag in and out) is taken
    whatever the share: it is no overload's call, and refusing it refuses an answer it would have
    had. At capacity a closed loop's calls are all such calls; a stall there (a noisy neighbour, a
    batch five times its usual time) drops a few, and before this the share that followed refused
    hundreds more, each retried at once and refused again (issue 57: 215 calls in a 15 s run of 64
    single-text callers; docs/benchmarks.md, "False refusals at capacity"). A call that waited in
    gRPC core until its deadline is nearly spent, or arrives while the queue holds more work than
    its budget, is still subject to the share; the scheduler's estimate refuses, after decoding,
    the vouched-for call whose own compute does not fit.

    Which calls are taken while shedding: the door sees no request body, so no latency class; it
    does see a gRPC call's deadline. Calls are put in buckets by the time they have left when they
    reach the door (``bucket``: powers of two of a millisecond), and each bucket is weighted by
    the odds that such a call is answered, learned from the calls of that bucket that ended lately
    (answered + 1 over taken + 2, so an unseen bucket starts at even odds and one refused for long
    forgets and is tried again) over the best bucket's odds, times a boost for tight calls: a
    bucket under ``TIGHT_S`` is taken ``TIGHT_S / its least time left`` times as often (at most
    ``BOOST``), because a tight call refused cannot retry in time while one with time to spare
    can. The share is set so that all of them together are what completes. Within each bucket,
    refusals are spread evenly over arrivals (a credit counter, no randomness). A call pays a
    counter while not shedding, and its end two more in ``Door.leave``.

    The odds are what keep a spike from feeding on itself: a spike's backlog in gRPC core makes
    every call reach Python with little left, so by time left alone the door would take the oldest
    calls most often, nearly all of which are then dropped (docs/performance.md, "Figures the
    code cites")."""

    TICK_S = 0.010
    WASTE = 0.10  # share of ended calls that were dropped, above which the door sheds
    LAG_WASTE = 0.02  # ... and above which a standing lag cuts the share
    STANDING_S = 0.100
    DECAY = 0.9  # per tick, for the arrived/ended/dropped counts (~100 ms of memory)
    MIN_ADMIT = 0.02
    GROW = 0.005  # per tick while neither signal is on
    SPENT_S = 0.0005  # a call with less than this left when it reaches the door is refused there
    SATURATED = 0.9  # share of the time busy (the loop's thread, or the process's cores)
    TIGHT_S = 0.500  # a call with less time left than this is taken more often while shedding
    BOOST = 8  # ... at most this many times as often (a call with 60 ms left at the full eight)
    BUCKETS = 12  # by time left at the door: its whole ms' bit length (0-10); NO_DEADLINE
    NO_DEADLINE = 11
    ODDS_DECAY = 0.98  # per look, for each bucket's calls ended and answered (~0.5 s of memory)

    def __init__(self, lag_target_s: float, min_in_flight: int, load: Load | None = None) -> None:
        self.load = load  # given by ``start`` when not here (the pipeline, made after the door)
        self.target_s = lag_target_s
        self.min_in_flight = min_in_flight
        self.admit = 1.0  # share of new calls taken
        self.shedding = False
        self.refused = 0
        self.spent = 0  # of which refused with their deadline already spent
        self.arrived = 0.0  # new calls asked about lately (decaying)
        self.ended = 0.0  # calls that ended lately (decaying)
        self.dropped = 0.0  # of which taken and then dropped (decaying)
        self.busy = 0.0  # calls inside, a decaying peak
        # by time left at the door (``bucket``): calls that arrived lately while shedding, and the
        # calls that ended lately, [taken, answered], with each bucket's weight made from them
        self.arrivals = [0.0] * self.BUCKETS
        self.outcomes = [[0.0, 0.0] for _ in range(self.BUCKETS)]
        self.weight = list(BOOSTS)  # the boost alone until calls end
        self._message = ""
        self._credit = [0.0] * self.BUCKETS
        self._lag_low_at = 0.0  # the last time the loop's lag was under the target
        self._handle: asyncio.TimerHandle | None = None
        self._beat = None  # the LoopLag whose timer this shedder looks on, when it runs
        self._looked_at = 0.0
        self.saturation = 0.0  # share of the time busy lately (decaying)
        self._cpu_times = _cpu_times  # (the loop thread's, the process's) CPU seconds
        self._cores = (
            len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        )
        self._cpu_at = (0.0, 0.0, 0.0)
        # While shedding: the schedulers' backlog plus the loop's lag in and out, in seconds, as of
        # the last look (None: not known, no call is vouched for)
        self.vouch_s: float | None = None

    def start(self, load: Load | None = None) -> None:
        if load is not None:
            self.load = load
        if self.target_s > 0 and self._handle is None and self._beat is None:
            self._loop = asyncio.get_running_loop()
            self._lag_low_at = self._loop.time()
            self._cpu_at = (self._lag_low_at, *self._cpu_times())
            lag = self.load.lag
            if getattr(lag, "running", False) and lag.interval_s <= self.TICK_S:
                self._beat = lag  # look on the lag monitor's timer: no timer of the shedder's own
                self._looked_at = self._lag_low_at
                lag.listeners.append(self._on_beat)
            else:
                self._handle = self._loop.call_later(self.TICK_S, self._tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._beat is not None:
            self._beat.listeners.remove(self._on_beat)
            self._beat = None

    def stand_down(self) -> None:
        """Take every call from now on (the server is draining)."""
        self.stop()
        self._set_admit(1.0)

    def _tick(self) -> None:
        """A look on the shedder's own timer (when no lag monitor runs to beat for it)."""
        self._look(self._loop.time())
        self._handle = self._loop.call_later(self.TICK_S, self._tick)

    def _on_beat(self, now: float) -> None:
        """The lag monitor sampled: look if ``TICK_S`` has passed since the last look (every
        second beat of its 5 ms timer)."""
        if now - self._looked_at >= self.TICK_S - 0.001:
            self._looked_at = now
            self._look(now)

    def _look(self, now: float) -> None:
        thread_cpu, process_cpu = self._cpu_times()
        t0, thread0, process0 = self._cpu_at
        if now > t0:
            used = max(thread_cpu - thread0, (process_cpu - process0) / self._cores) / (now - t0)
            self.saturation = self.saturation * self.DECAY + (1 - self.DECAY) * min(used, 1.0)
        self._cpu_at = (now, thread_cpu, process_cpu)
        # (a busy server only: one caller's run of hopeless deadlines must not shed everyone's calls)
        self.busy = max(self.busy * self.DECAY, self.load.inflight)
        busy = self.busy > self.min_in_flight or self.saturation >= self.SATURATED
        if self.load.lag.s <= self.target_s or not busy:
            self._lag_low_at = now
        wasting = busy and self.ended >= 16
        if wasting and self.dropped > self.WASTE * self.ended:
            admit = max(self.MIN_ADMIT, min(self.admit, self._share(1.05 * (self.ended - self.dropped))))
        elif (
            now - self._lag_low_at >= self.STANDING_S
            and wasting
            and self.dropped > self.LAG_WASTE * self.ended
        ):
            # a lag that costs nobody their answer is a loop at work, not an overload
            admit = max(self.MIN_ADMIT, self.admit * 0.8)
            self._lag_low_at = now  # once per stretch
        else:
            admit = min(1.0, self.admit + self.GROW)
        self._set_admit(admit)
        self.vouch_s = None
        if self.shedding:
            backlog = getattr(self.load, "backlog_s", None)
            queued = backlog() if backlog is not None else None
            if queued is not None:
                self.vouch_s = queued + 2.0 * self.load.lag.s
        self.arrived *= self.DECAY
        self.ended *= self.DECAY
        self.dropped *= self.DECAY
        arrivals, d = self.arrivals, self.ODDS_DECAY
        odds = []
        for b, counts in enumerate(self.outcomes):
            arrivals[b] *= self.DECAY
            taken, answered = counts[0] * d, counts[1] * d
            counts[0], counts[1] = taken, answered
            odds.append((answered + 1.0) / (taken + 2.0))
        best = max(odds)  # weights relative to the best odds: the share is of those calls
        self.weight = [p / best * boost for p, boost in zip(odds, BOOSTS)]

    def _share(self, target: float) -> float:
        """The share ``a`` at which the calls that arrived lately, each taken ``min(1, weight * a)``
        of the time, add up to ``target``: what the server is completing."""
        counts = [(self.weight[b], n) for b, n in enumerate(self.arrivals) if n > 0]
        counts.append((1.0, max(self.arrived - sum(n for _, n in counts), 0.0)))
        counts.sort(reverse=True)
        # f(a) = sum n * min(1, k * a) is increasing and linear between the breakpoints 1/k;
        # from the highest weight down, the calls of weight k are taken whole once a >= 1/k
        whole, slope = 0.0, sum(k * n for k, n in counts)
        for k, n in counts:  # weights descending: breakpoints 1/k ascending
            if slope > 0 and (target - whole) / slope <= 1.0 / k:
                return (target - whole) / slope
            whole += n
            slope -= k * n
        return 1.0

    def take(self, remaining: float | None = None) -> bool:
        """Whether to take a new call (False: refuse it, counted) with ``remaining`` seconds left
        (None: no deadline). A counter while not shedding; while shedding, refusals are spread
        evenly over the arrivals of each weight."""
        if not self.shedding:
            self.arrived += 1
            return True
        if remaining is not None and remaining <= self.SPENT_S:
            # its caller has given up already (it waited in core past its deadline): refused here,
            # the cheapest way, and kept out of the counts (it says nothing of what completes)
            self.spent += 1
            self.refused += 1
            return False
        self.arrived += 1
        b = bucket(remaining)
        self.arrivals[b] += 1
        if remaining is not None and self.vouch_s is not None and remaining > self.vouch_s:
            return True  # more time left than the work ahead of it: not an overload's call
        credit = self._credit[b] + min(1.0, self.weight[b] * self.admit)
        if credit >= 1.0:
            self._credit[b] = credit - 1.0
            return True
        self._credit[b] = credit
        self.refused += 1
        return False

    def message(self) -> str:
        """The refusal's words (made once per look, not once per refused call)."""
        return self._message

    def trailing(self) -> tuple:
        """The refusal's retry hint: five looks of the shedder (gRPC's retry pushback)."""
        return _RETRY_TRAILERS

    def check(self, remaining: float | None = None) -> None:
        """Take the call, or raise UNAVAILABLE (outcome ``overloaded``)."""
        if not self.take(remaining):
            raise GatewayError(Kind.UNAVAILABLE, self._message, outcome="overloaded", retry_after_s=RETRY_S)

    def _set_admit(self, admit: float) -> None:
        if admit != self.admit:
            self._message = f"server overloaded: taking {admit:.0%} of new calls; retry with backoff or on another replica"
        self.admit = admit
        self.shedding = admit < 1.0


def bucket(remaining: float | None) -> int:
    """A call's bucket by the time it had left at the door: the bit length of its whole
    milliseconds (<1 ms: 0, 1 ms: 1, 2-3 ms: 2, ..., 512 ms and more: 10); no deadline: 11."""
    if remaining is None:
        return LoadShedder.NO_DEADLINE
    return min(int(remaining * 1000.0).bit_length(), 10) if remaining > 0 else 0


def _boost(b: int) -> float:
    """A bucket's boost for tight calls: ``TIGHT_S`` over the least time left in it, 1 to BOOST."""
    if b == LoadShedder.NO_DEADLINE:
        return 1.0
    if b == 0:  # under a millisecond left
        return float(LoadShedder.BOOST)
    least = (1 << (b - 1)) / 1000.0  # bucket b holds [2**(b-1), 2**b) ms
    return float(max(1, min(LoadShedder.BOOST, int(LoadShedder.TIGHT_S / least))))


BOOSTS = tuple(_boost(b) for b in range(LoadShedder.BUCKETS))


def _cpu_times() -> tuple[float, float]:
    return time.thread_time(), time.process_time()


def wasted(exc: BaseException) -> bool:
    """A call taken and then dropped for want of time or room (not the client's error, nor the
    shedder's own refusal): what the shedder sheds to avoid. A refusal by the admission estimate counts:
    the estimate is calibrated against what happened (gateway/scheduling/deadline.py), so it
    refuses only calls that would miss, and a closed loop at capacity meets none."""
    if isinstance(exc, asyncio.CancelledError):  # the caller gave up (its deadline, usually)
        return True
    if isinstance(exc, GatewayError) and exc.outcome == "impossible":
        return False  # a budget under the call's own compute: the caller's, whatever the load
    return isinstance(exc, GatewayError) and (
        exc.kind is Kind.DEADLINE or (exc.kind is Kind.UNAVAILABLE and exc.outcome != "overloaded")
    )
