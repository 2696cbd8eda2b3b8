"""Triton's dynamic batcher as a queue policy (``scheduling_policy: fifo``), kept for comparison:
FIFO per shape key; a batch closes when full, at a preferred size, or when its oldest request has
waited max_queue_delay. Deadlines play no part and nothing is shed at admission.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable

from batchgate.gateway.scheduling.request import Refusal, Request, batch_rows


class _Group:
    __slots__ = ("requests", "rows")

    def __init__(self) -> None:
        self.requests: deque[Request] = deque()
        self.rows = 0


class FifoQueue:
    """Pending requests of one model, grouped by shape key, oldest first."""

    def __init__(
        self,
        max_batch_size: int,
        preferred: tuple[int, ...] = (),
        max_delay_s: float = 0.0,
        max_queue_size: int = 0,
        row_limit: Callable[[Hashable], int] | None = None,
    ) -> None:
        self.max_batch_size = max_batch_size
        self.row_limit = row_limit  # the token budget: most rows a batch of a bucket takes
        self.preferred = frozenset(p for p in preferred if p <= max(max_batch_size, 1))
        self.min_preferred = min(self.preferred) if self.preferred else None
        self.max_delay_s = max_delay_s
        self.max_queue_size = max_queue_size
        self._groups: dict[Hashable, _Group] = {}
        self.shed = True  # (never refuses at admission: nothing to check)
        self.prediction = None
        self.size = 0  # requests queued (including ones whose caller left, until popped)
        self.dropped = 0  # callers that left before their request was batched

    def __len__(self) -> int:
        return self.size

    def refuse(self, reqs: list[Request], now: float, running_s: float, slots: int) -> Refusal | None:
        return None  # Triton's batcher never sheds: requests wait their turn

    def calibrate(self, predicted_s: float, actual_s: float) -> None:
        pass  # no predictions made

    def ratio(self) -> None:
        return None

    def push(self, reqs: list[Request]) -> bool:
        """Queue all of ``reqs``; False when max_queue_size would be passed (nothing queued)."""
        if self.max_queue_size and self.size + len(reqs) > self.max_queue_size:
            return False
        for req in reqs:
            group = self._groups.get(req.key)
            if group is None:
                group = self._groups[req.key] = _Group()
            group.requests.append(req)
            group.rows += req.rows
        self.size += len(reqs)
        return True

    def full_reason(self, req: Request) -> str:
        return f"queue is full (max_queue_size={self.max_queue_size})"

    def drain_s(self, req: Request, slots: int) -> float | None:
        return None

    def _live_groups(self) -> list[_Group]:
        """Groups with a live request, oldest head first (cancelled heads are dropped here)."""
        groups = []
        for key in list(self._groups):
            g = self._groups[key]
            self._drop_cancelled_head(g)
            if not g.requests:
                del self._groups[key]
            else:
                groups.append(g)
        if len(groups) > 1:
            groups.sort(key=lambda g: g.requests[0].arrival)
        return groups

    def _drop_cancelled_head(self, g: _Group) -> None:
        while g.requests and g.requests[0].future.done():
            r = g.requests.popleft()
            g.rows -= r.rows
            self.size -= 1
            self.dropped += 1

    def take_expired(self, now: float) -> tuple[list[Request], float | None]:
        return [], None  # no deadlines here

    def wake_at(self, reqs: list[Request]) -> float | None:
        return None  # nothing here expires: a busy batcher waits for a freed slot

    def pop_batch(self, now: float, idle: bool = False) -> tuple[list[Request] | None, float | None]:
        """The batch that should leave at ``now``: the oldest group's when its timer expired, else
        the first group (oldest first) that is full or at a preferred size. Else None and when
        the oldest request's max-wait timer fires."""
        groups = self._live_groups()
        for g in groups:
            batch = self._ready(g, now)
            if batch is not None:
                return batch, None
        if not groups:
            return None, None
        return None, min(g.requests[0].arrival for g in groups) + self.max_delay_s

    def _ready(self, g: _Group, now: float) -> list[Request] | None:
        if self.max_batch_size == 0:  # the model does not batch: one request per execution
            return self._take(g, 1)
        expired = now >= g.requests[0].arrival + self.max_delay_s
        limit = batch_rows(self.max_batch_size, self.row_limit, g.requests[0].key)
        if not expired and g.rows < limit and (self.min_preferred is None or g.rows < self.min_preferred):
            return None  # fast path: nothing can close this batch yet
        taken_rows = 0
        n = 0
        best_preferred = 0
        full = False
        for req in g.requests:
            if req.future.done():  # left while queued: skipped now, removed by _take
                n += 1
                continue
            if taken_rows + req.rows > limit:
                full = True
                if taken_rows == 0:  # one request larger than a batch: it goes alone, never stuck
                    n += 1
                break
            taken_rows += req.rows
            n += 1
            if taken_rows in self.preferred:
                best_preferred = n
        if taken_rows == limit:
            full = True
        if full or expired:
            return self._take(g, n)
        if best_preferred:
            return self._take(g, best_preferred)
        return None

    def _take(self, g: _Group, n: int) -> list[Request] | None:
        batch = []
        for _ in range(n):
            r = g.requests.popleft()
            g.rows -= r.rows
            self.size -= 1
            if r.future.done():
                self.dropped += 1
            else:
                batch.append(r)
        return batch or None

    def depth_by_class(self) -> dict[str, int]:
        return {"fifo": self.size}

    def drain_all(self) -> list[Request]:
        out = []
        for g in self._groups.values():
            out.extend(g.requests)
        self._groups.clear()
        self.size = 0
        return out
