"""Online model of compute time: per (model, shape bucket), batch time ≈ a + b·rows.

Fitted by exponentially weighted least squares over recent batches (BentoML's CORK idea, with
forgetting so the fit follows a machine whose speed changes). The scheduler uses it to close
batches in time and to shed requests whose deadline is already out of reach.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass


@dataclass(slots=True)
class _Fit:
    # Exponentially weighted sums of 1, x, y, x², xy (x = rows, y = seconds).
    w: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0
    batches: int = 0

    def add(self, rows: int, seconds: float, decay: float) -> None:
        self.w = self.w * decay + 1.0
        self.sx = self.sx * decay + rows
        self.sy = self.sy * decay + seconds
        self.sxx = self.sxx * decay + rows * rows
        self.sxy = self.sxy * decay + rows * seconds
        self.batches += 1

    def coefficients(self) -> tuple[float, float]:
        """(a, b) with a, b >= 0; falls back to a proportional fit while rows have not varied."""
        if self.w == 0:
            return 0.0, 0.0
        mean_x, mean_y = self.sx / self.w, self.sy / self.w
        var_x = self.sxx / self.w - mean_x * mean_x
        if var_x > 1e-9:
            b = (self.sxy / self.w - mean_x * mean_y) / var_x
            a = mean_y - b * mean_x
            if b >= 0 and a >= 0:
                return a, b
        # Not enough spread in batch sizes (or a negative coefficient from noise): attribute the
        # mean time to an intercept plus a per-row share, which never underestimates big batches.
        return mean_y * 0.5, (mean_y * 0.5) / max(mean_x, 1.0)


def _size_class(rows: int) -> int:
    """Batch sizes grouped by powers of two: 1, 2, 3-4, 5-8, ..."""
    return 1 << max(rows - 1, 0).bit_length()


class LatencyModel:
    """Per-bucket fits for one model. Not thread-safe: updated and read on the event loop.

    Two layers: an EWMA of observed times per (bucket, batch-size class) — what a batch of this
    size actually took lately, which adapts within a few batches when the load changes — and,
    for sizes not seen yet, the bucket's least-squares line a + b·rows.
    """

    CONFIDENT = 3  # batches of a bucket before its estimates may refuse work

    def __init__(self, decay: float = 0.98, prior_s: float = 0.002, alpha: float = 0.2) -> None:
        self.decay = decay
        self.prior_s = prior_s  # assumed batch time before any batch has run
        self.alpha = alpha
        self._fits: dict[Hashable, _Fit] = {}
        self._sizes: dict[tuple[Hashable, int], list[float]] = {}  # -> [ewma seconds, samples]
        self._any = _Fit()  # across buckets: the estimate for a bucket not seen yet

    def confident(self, key: Hashable) -> bool:
        """Whether this bucket has run often enough for its estimate to justify shedding."""
        fit = self._fits.get(key)
        return fit is not None and fit.batches > self.CONFIDENT

    def confident_model(self) -> bool:
        """Whether the model as a whole (any bucket) has run often enough to estimate queued work."""
        return self._any.batches > self.CONFIDENT

    def observe(self, key: Hashable, rows: int, seconds: float) -> None:
        fit = self._fits.get(key)
        if fit is None:
            fit = self._fits[key] = _Fit()
        if fit.batches >= 3:
            # Clip outliers (a first run of a new shape, a GC pause, a noisy neighbour) so one slow
            # batch cannot make the scheduler shed everything behind it; a lasting slowdown still
            # moves the fit within a few batches because each clipped sample pulls it up by 3x.
            seconds = min(seconds, 3.0 * max(self.estimate(key, rows), 1e-5))
        first = fit.batches == 0
        fit.add(rows, seconds, self.decay)
        if not first:  # a bucket's first run pays one-off set-up; keep it out of the shared fit
            self._any.add(rows, seconds, self.decay)
            size = self._sizes.get((key, _size_class(rows)))
            if size is None:
                self._sizes[(key, _size_class(rows))] = [seconds, 1]
            else:
                size[0] += self.alpha * (seconds - size[0])
                size[1] += 1

    def estimate(self, key: Hashable, rows: int) -> float:
        """Seconds one batch of ``rows`` rows of bucket ``key`` is expected to take."""
        size = self._sizes.get((key, _size_class(rows)))
        if size is not None and size[1] >= 2:
            return size[0]
        fit = self._fits.get(key)
        if fit is None or fit.batches < 3:
            fit = self._any
            if fit.batches == 0:
                return self.prior_s
        a, b = fit.coefficients()
        return a + b * rows

    def per_row(self, key: Hashable = None) -> tuple[float, float]:
        fit = self._fits.get(key) if key is not None else None
        return (fit or self._any).coefficients() if (fit or self._any).batches else (self.prior_s, 0.0)

    def snapshot(self) -> dict[str, dict[str, float]]:
        """For statistics and metrics: bucket -> intercept, per-row slope, batches seen."""
        out = {}
        for key, fit in self._fits.items():
            a, b = fit.coefficients()
            out[str(key)] = {"intercept_s": a, "per_row_s": b, "batches": fit.batches}
        return out
