"""In-flight coalescing: a row that is already being looked up or computed is not computed again.

A request that misses on rows nobody is working on opens a ``Flight`` for them (``begin``); a
later request that misses on one of those rows finds it with ``find`` and waits for the flight
instead of computing it. The owner ends the flight exactly once:

* ``finish(values)``: waiters read ``flight.values[j]``;
* ``fail(exc)``: computing those rows failed for a reason that is the rows' own (the model
  raised); waiters get the same error;
* ``abandon()``: the owner went away or was refused for reasons of its own (cancelled,
  shed, queue full); waiters must look the rows up again, and one of them becomes the owner.

The keys leave the in-flight map in the same synchronous step that ends the flight, so a request
arriving later finds the value in the cache instead (the owner stores before it finishes).

Every waiter awaits a future of its own, so a waiter that is cancelled cancels nothing shared.
Event-loop only, no locks.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterable, Sequence
from itertools import repeat


class Flight:
    __slots__ = ("keys", "values", "error", "done", "_waiters", "_pos")

    def __init__(self, keys: Sequence[bytes]) -> None:
        self.keys = keys
        self.values: list[bytes | None] | None = None  # set by finish, in the order of keys
        self.error: BaseException | None = None  # set by fail
        self.done = False
        self._waiters: list[_Waiter] = []
        self._pos: dict[bytes, int] | None = None

    def index(self, key: bytes) -> int:
        """Where ``key`` is in ``keys`` (built on first use: most flights are never waited on)."""
        if self._pos is None:
            self._pos = {k: j for j, k in enumerate(self.keys)}
        return self._pos[key]

    @property
    def abandoned(self) -> bool:
        return self.done and self.values is None and self.error is None


class _Waiter:
    __slots__ = ("future", "pending")

    def __init__(self, future: asyncio.Future, pending: int) -> None:
        self.future = future
        self.pending = pending


class SingleFlight:
    def __init__(self) -> None:
        self.calls: dict[bytes, Flight] = {}  # key in flight -> its flight

    def __len__(self) -> int:
        return len(self.calls)

    def find(self, key: bytes) -> Flight | None:
        return self.calls.get(key)

    def begin(self, keys: Sequence[bytes]) -> Flight:
        """Open a flight for ``keys``; the caller has checked that none of them is in flight."""
        flight = Flight(keys)
        self.calls.update(dict.fromkeys(keys, flight))
        return flight

    def finish(self, flight: Flight, values: list[bytes]) -> None:
        if not flight.done:
            flight.values = values
            self._end(flight)

    def fail(self, flight: Flight, error: BaseException) -> None:
        if not flight.done:
            flight.error = error
            self._end(flight)

    def abandon(self, flight: Flight) -> None:
        self._end(flight)

    def _end(self, flight: Flight) -> None:
        if flight.done:
            return  # a flight ends once; later calls change nothing
        flight.done = True
        deque(map(self.calls.pop, flight.keys, repeat(None)), 0)
        for w in flight._waiters:
            w.pending -= 1
            if w.pending == 0 and not w.future.done():
                w.future.set_result(None)
        flight._waiters = []

    async def wait(self, flights: Iterable[Flight]) -> None:
        """Return when every one of ``flights`` has ended (in any of the three ways)."""
        open_ = [f for f in flights if not f.done]
        if not open_:
            return
        waiter = _Waiter(asyncio.get_running_loop().create_future(), len(open_))
        for f in open_:
            f._waiters.append(waiter)
        await waiter.future
