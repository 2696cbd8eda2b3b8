"""A circuit breaker for Redis: stop paying for a remote that keeps failing.

closed --(``failures_to_open`` failures in a row, or one ``trip``)--> open

Who probes depends on who owns recovery:

- alone (a breaker nobody probes for): after ``open_s`` one caller is let through as the probe
  (half-open); its success closes the breaker, its failure opens it again for another ``open_s``.
  A probe that never reports back (its caller was cancelled) is given up after ``open_s`` and
  another caller probes.
- handed to a prober (``hand_recovery_to``: what ``cache.link.RedisLink`` does with the one
  breaker the result cache and the rate limiter share): callers are refused until the prober's
  own probe closes it, so the users of one Redis never probe it side by side.

The clock is injected so tests drive it without sleeping.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable


class State(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class Breaker:
    def __init__(
        self, failures_to_open: int = 5, open_s: float = 2.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if failures_to_open < 1:
            raise ValueError(f"failures_to_open must be >= 1, got {failures_to_open}")
        if open_s <= 0:
            raise ValueError(f"open_s must be > 0, got {open_s}")
        self.failures_to_open = failures_to_open
        self.open_s = open_s
        self.clock = clock
        self.state = State.CLOSED
        self.failures = 0  # in a row, while closed
        self.opens = 0  # times the breaker opened (counter)
        self.probes = 0  # half-open probes let through (counter)
        self.rejected = 0  # calls refused while open (counter)
        self.proven = True  # a call succeeded since the breaker last closed (a prober's backoff reads it)
        self._until = 0.0  # open: when a probe may go; half-open: when the probe is given up
        self._prober: Callable[[str], None] | None = None

    def allow(self) -> bool:
        """May the caller use the remote now? A True in half-open makes the caller the probe."""
        if self.state is State.CLOSED:
            return True
        if self._prober is not None:
            self.rejected += 1
            return False
        now = self.clock()
        if now < self._until:
            self.rejected += 1
            return False
        self.state = State.HALF_OPEN
        self._until = now + self.open_s
        self.probes += 1
        return True

    def success(self) -> None:
        if self._prober is not None and self.state is not State.CLOSED:
            return  # a call sent before the breaker opened, answering late: the prober decides
        self.state = State.CLOSED
        self.failures = 0
        self.proven = True

    def failure(self, reason: str = "") -> None:
        """One failure or timeout: it opens the breaker after ``failures_to_open`` in a row."""
        if self.state is State.CLOSED:
            self.failures += 1
            if self.failures < self.failures_to_open:
                return
        elif self.state is State.OPEN or self._prober is not None:
            return  # a call let through before the breaker opened, reporting late
        self._open(reason)

    def trip(self, reason: str = "") -> None:
        """A failure that is conclusive on its own (an error, or no answer within a bound far
        above the caller's timeout): open now."""
        if self.state is State.CLOSED or (self.state is State.HALF_OPEN and self._prober is None):
            self._open(reason)

    def _open(self, reason: str) -> None:
        self.state = State.OPEN
        self.failures = 0
        self.opens += 1
        self._until = self.clock() + self.open_s
        if self._prober is not None:
            self._prober(reason)

    # -- recovery owned by a prober --------------------------------------------------------------

    def hand_recovery_to(self, opened: Callable[[str], None]) -> None:
        """From now on no caller probes: ``opened(reason)`` is called each time the breaker opens,
        and the prober it starts reports with ``probing`` then ``probed``."""
        self._prober = opened

    def probing(self) -> None:
        self.state = State.HALF_OPEN
        self.probes += 1

    def probed(self, ok: bool) -> None:
        if ok:
            self.state = State.CLOSED
            self.failures = 0
            self.proven = False  # until a real call succeeds
        else:
            self.state = State.OPEN
            self.opens += 1
