"""Cutting a padded text batch into runs of similar length, where that costs less than padding.

On the CPU an engine run at dynamic shapes costs about ``a + b * tokens``: ``b`` per padded token
and ``a`` once a run (reading the weights, setting up the kernels), so one run of n rows padded to
the longest L costs ``a + b * n * L``. A batch whose rows differ in length pays ``b`` for every pad
token; cut into runs of similar length it pays ``a`` once more a run. With the rows sorted by
length the cheapest cut is a contiguous one, found exactly by a small dynamic programme over the
distinct lengths. ``a / b`` (the overhead of a run, in tokens) is measured on the engine's own runs
(``RunCost``), so a model and host where runs are cheap cut finely and one where they are dear
(a GPU) hardly at all. Figures in docs/performance.md ("Runs of similar length").
"""

from __future__ import annotations

import numpy as np


class RunCost:
    """An engine's cost of a run against its padded tokens, as ``a + b * tokens``, fitted over its
    recent small runs (up to ``SMALL`` tokens, where the per-run part shows; a long run's time
    says little about ``a`` and much about noise). Used from the engine's own thread only."""

    SMALL = 1024  # padded tokens: runs past this do not enter the fit
    MIN_RUNS = 16  # runs before the fit replaces ``default``
    DECAY = 0.98  # per run: the fit follows the last ~50 runs

    def __init__(self, default: float | None) -> None:
        self.default = default  # overhead tokens before the fit speaks; None: never cut until then
        self._n = self._sx = self._sy = self._sxx = self._sxy = 0.0
        self._runs = 0

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens > self.SMALL or seconds <= 0:
            return
        d = self.DECAY
        self._n = self._n * d + 1.0
        self._sx = self._sx * d + tokens
        self._sy = self._sy * d + seconds
        self._sxx = self._sxx * d + tokens * tokens
        self._sxy = self._sxy * d + tokens * seconds
        self._runs += 1

    def overhead_tokens(self) -> float | None:
        """``a / b``: what one more run costs, in padded tokens (never below 0); ``default`` until
        MIN_RUNS small runs of different sizes were seen."""
        if self._runs < self.MIN_RUNS:
            return self.default
        var = self._sxx - self._sx * self._sx / self._n
        if var <= 1e-9 * max(self._sxx, 1.0):
            return self.default  # every run the same size: the line is not known
        b = (self._sxy - self._sx * self._sy / self._n) / var
        if b <= 0:
            return self.default
        a = (self._sy - b * self._sx) / self._n
        return max(a / b, 0.0)


def partition(lengths: np.ndarray, overhead: float) -> list[np.ndarray]:
    """The rows (indices into ``lengths``) of each run, longest run first, that minimise
    ``sum(overhead + rows * longest)`` over the runs: one group when cutting gains nothing."""
    order = np.argsort(lengths, kind="stable")
    values, counts = np.unique(lengths[order], return_counts=True)
    d = len(values)
    if d == 1:
        return [order]
    # best[j]: cheapest cost of the rows of the first j distinct lengths; cut[j]: where its last run starts
    best = [0.0] * (d + 1)
    cut = [0] * (d + 1)
    before = np.concatenate(([0], np.cumsum(counts))).tolist()
    vals = values.tolist()
    for j in range(1, d + 1):
        top = vals[j - 1]
        end = before[j]
        b, c = float("inf"), 0
        for i in range(j):
            cost = best[i] + overhead + (end - before[i]) * top
            if cost < b:
                b, c = cost, i
        best[j], cut[j] = b, c
    groups = []
    j = d
    while j > 0:
        i = cut[j]
        groups.append(order[before[i] : before[j]])
        j = i
    return groups
