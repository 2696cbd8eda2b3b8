"""A circuit breaker for the Redis tier: stop paying for a remote that keeps failing.

closed --(``failures_to_open`` failures in a row)--> open --(``open_s`` passed)--> half-open
half-open: one caller is let through as the probe; its success closes the breaker, its failure
opens it again for another ``open_s``. A probe that never reports back (its caller was
cancelled) is given up after ``open_s`` and another caller probes.

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
        self._until = 0.0  # open: when a probe may go; half-open: when the probe is given up

    def allow(self) -> bool:
        """May the caller use the remote now? A True in half-open makes the caller the probe."""
        if self.state is State.CLOSED:
            return True
        now = self.clock()
        if now < self._until:
            self.rejected += 1
            return False
        self.state = State.HALF_OPEN
        self._until = now + self.open_s
        self.probes += 1
        return True

    def success(self) -> None:
        self.state = State.CLOSED
        self.failures = 0

    def failure(self) -> None:
        if self.state is State.CLOSED:
            self.failures += 1
            if self.failures < self.failures_to_open:
                return
        elif self.state is State.OPEN:
            return  # a call let through before the breaker opened, reporting late
        self.state = State.OPEN
        self.failures = 0
        self.opens += 1
        self._until = self.clock() + self.open_s
