"""A Prometheus histogram without locks or label lookups, shared by the metrics and the
schedulers' statistics (which must not import the metrics)."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable

# Seconds. Dense below 50 ms, where the latency classes live.
LATENCY_BUCKETS = (
    0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25,
    0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip


class Histogram:
    """A Prometheus histogram without locks or label lookups: the owner's thread only."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Iterable[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # `le` buckets: value <= bound
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def buckets(self) -> list[tuple[str, int]]:
        out, total = [], 0
        for bound, n in zip(self.bounds, self.counts):
            total += n
            out.append((_fmt(bound), total))
        out.append(("+Inf", total + self.counts[-1]))
        return out


def _fmt(bound: float) -> str:
    return str(float(bound))
