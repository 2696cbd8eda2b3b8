"""Online model of compute time: per (model, shape bucket), batch time ≈ a + b·rows.

Fitted by exponentially weighted least squares over recent batches (BentoML's CORK idea, with
forgetting so the fit follows a machine whose speed changes). The scheduler uses it to close
batches in time and to shed requests whose deadline is already out of reach.

Also here: ``LoopLag``, how late the event loop runs callbacks. A request waits that long before
its handler runs and again before its answer is written, time the scheduler cannot see on its
own clock; the deadline queue keeps it as a margin.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Hashable
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
    # coefficients(), computed once per batch observed rather than on every estimate (the
    # request path asks several times per call)
    ab: tuple[float, float] | None = None

    def add(self, rows: int, seconds: float, decay: float) -> None:
        self.ab = None
        self.w = self.w * decay + 1.0
        self.sx = self.sx * decay + rows
        self.sy = self.sy * decay + seconds
        self.sxx = self.sxx * decay + rows * rows
        self.sxy = self.sxy * decay + rows * seconds
        self.batches += 1

    def line(self, min_var: float = 0.25) -> tuple[float, float] | None:
        """The least-squares (a, b), unclipped; None while the variance of batch sizes is at most
        ``min_var`` (by default: sizes within about half a row of each other, no slope to read)."""
        if self.w == 0:
            return None
        mean_x, mean_y = self.sx / self.w, self.sy / self.w
        var_x = self.sxx / self.w - mean_x * mean_x
        if var_x <= min_var:
            return None
        b = (self.sxy / self.w - mean_x * mean_y) / var_x
        return mean_y - b * mean_x, b

    def coefficients(self) -> tuple[float, float]:
        """(a, b) with a, b >= 0; falls back to a proportional fit while rows have not varied."""
        ab = self.ab
        if ab is None:
            ab = self.ab = self._coefficients()
        return ab

    def _coefficients(self) -> tuple[float, float]:
        if self.w == 0:
            return 0.0, 0.0
        line = self.line(min_var=1e-9)
        if line is not None and line[0] >= 0 and line[1] >= 0:
            return line
        mean_x, mean_y = self.sx / self.w, self.sy / self.w
        # Not enough spread in batch sizes (or a negative coefficient from noise): attribute the
        # mean time to an intercept plus a per-row share, which never underestimates big batches.
        return mean_y * 0.5, (mean_y * 0.5) / max(mean_x, 1.0)


class _SizeClasses(dict):
    """Batch sizes grouped by powers of two: ``SIZE_CLASS[rows]`` is 1, 2, 4 (3-4), 8 (5-8), ...
    A dict filled on first use: the lookup runs several times per call on the event loop, and a
    hit costs no Python frame (lab/loop_calls.py counts them). Sizes past MEMO are computed, not
    kept."""

    MEMO = 4096

    def __missing__(self, rows: int) -> int:
        c = 1 << max(rows - 1, 0).bit_length()
        if 0 <= rows <= self.MEMO:
            self[rows] = c
        return c


SIZE_CLASS = _SizeClasses()


class LatencyModel:
    """Per-bucket fits for one model. Not thread-safe: updated and read on the event loop.

    Two layers: an EWMA of observed times per (bucket, batch-size class) — what a batch of this
    size actually took lately, which adapts within a few batches when the load changes — and,
    for sizes not seen yet, the bucket's least-squares line a + b·rows.

    ``estimate`` is the expected time (used to add up queued work); ``estimate_hi`` adds twice the
    EWMA of the absolute deviation, a high quantile, for decisions that must hold at p99 (whether
    a request can still make its deadline, whether a batch may grow).
    """

    CONFIDENT = 3  # batches of a bucket before its estimates may refuse work
    # A batch stops growing where doubling it would make a row less than this much cheaper.
    WORTH = 0.02
    LEARN_AFTER = 20  # batches of a bucket before its batch-size limit is learned
    MEASURED = 3  # batches of a size class before its rows/s counts toward the limit
    STALE = 150  # batches of its bucket after which an unseen size class stops counting
    HYSTERESIS = 0.10  # a learned limit moves to a size this much faster per row, not for less
    DROP = (
        0.10  # with noisy times, a batch size stops paying only where the next makes this much fewer rows/s
    )
    NOISY = 0.10  # a size class's times are noisy where their mean deviation is this much of their mean

    def __init__(self, decay: float = 0.98, prior_s: float = 0.002, alpha: float = 0.2) -> None:
        self.decay = decay
        self.prior_s = prior_s  # assumed batch time before any batch has run
        self.alpha = alpha
        self._fits: dict[Hashable, _Fit] = {}
        # -> [ewma s, samples, ewma |dev| s, ewma rows, the bucket's batch count when last seen]
        self._sizes: dict[tuple[Hashable, int], list[float]] = {}
        self._classes: dict[Hashable, list[int]] = {}  # bucket -> its size classes seen, ascending
        self._any = _Fit()  # across buckets: the estimate for a bucket not seen yet
        # bucket -> rows worth batching (absent: no limit); learned in observe(), once per batch,
        # so the request path only looks it up
        self._useful: dict[Hashable, int] = {}

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
            c = SIZE_CLASS[rows]
            size = self._sizes.get((key, c))
            if size is None:
                self._sizes[(key, c)] = [seconds, 1, 0.0, float(rows), fit.batches]
                classes = self._classes.setdefault(key, [])
                classes.append(c)
                classes.sort()
            else:
                err = seconds - size[0]
                size[0] += self.alpha * err
                size[1] += 1
                size[2] += self.alpha * (abs(err) - size[2])
                size[3] += self.alpha * (rows - size[3])
                size[4] = fit.batches
        useful = self._learn_limit(fit, key)
        if useful is None:
            self._useful.pop(key, None)
        else:
            self._useful[key] = useful

    def estimate(self, key: Hashable, rows: int) -> float:
        """Seconds one batch of ``rows`` rows of bucket ``key`` is expected to take."""
        size = self._sizes.get((key, SIZE_CLASS[rows]))
        if size is not None and size[1] >= 2:
            return size[0]
        fit = self._fits.get(key)
        if fit is None or fit.batches < 3:
            fit = self._any
            if fit.batches == 0:
                return self.prior_s
        a, b = fit.coefficients()
        return a + b * rows

    def estimate_hi(self, key: Hashable, rows: int) -> float:
        """A high estimate (about p95) of one batch's time: the EWMA plus twice its deviation (the
        plain estimate for sizes not seen yet)."""
        size = self._sizes.get((key, SIZE_CLASS[rows]))
        if size is not None and size[1] >= 2:
            return size[0] + 2.0 * size[2]
        return self.estimate(key, rows)

    def useful_rows(self, key: Hashable) -> int | None:
        """Rows beyond which a batch of bucket ``key`` stops paying (``_learn_limit``); None: no
        limit."""
        return self._useful.get(key)

    def _measured_limit(self, fit: _Fit, key: Hashable) -> tuple[int | None, int | None]:
        """(stop, top): by batch-size class (1, 2, 3-4, 5-8, ...) seen at least MEASURED times and
        within the last STALE batches of bucket ``key``, rows/s = the class's mean rows over its
        mean time; ``stop`` is the largest size of the first class whose next larger measured
        class is not WORTH more rows a second (DROP fewer, where times are noisy) (None: rows/s rises up to the largest measured
        class), ``top`` that largest class (None: fewer than two classes measured). What a base
        model on one CPU core shows (issue 57: all-mpnet-base-v2, ONNX Runtime FP32 on one Zen 4
        core, 16.7 rows/s alone and 11.7 in batches of 32) is a time that grows faster than its
        rows, which the line a + b·rows cannot bend to. A class unseen for STALE batches drops
        out, so a limit lifts by itself and the next busy moment measures bigger batches again."""
        rates = []
        for c in self._classes.get(key, ()):
            rate = self._rate(fit, key, c)
            if rate is not None:
                rates.append((c, rate))
        if len(rates) < 2:
            return None, None
        for (c, rate), (c2, bigger) in zip(rates, rates[1:]):
            # Where both classes' times are steady, "not WORTH more rows a second" stops the batch;
            # where they are noisy (a shared host, a model of sub-millisecond batches) only a clear
            # fall does: a limit learned from noise cut the ranker's 5-row calls into 3 batches.
            noisy = max(self._noise(key, c), self._noise(key, c2)) > self.NOISY
            if bigger < rate * (1.0 - self.DROP) or (not noisy and bigger < rate * (1.0 + self.WORTH)):
                return c, rates[-1][0]
        return None, rates[-1][0]

    def _learn_limit(self, fit: _Fit, key: Hashable = None) -> int | None:
        """The bucket's batch-size limit once LEARN_AFTER batches ran: measured rows/s by size
        class where it stops rising (``_measured_limit``), else the line's answer (below), at
        least the largest size measured to pay."""
        if fit.batches < self.LEARN_AFTER:
            return None
        stop, top = self._measured_limit(fit, key)
        if stop is not None:
            new = stop
        else:  # rising at the largest size measured, or too few sizes: the line extrapolates,
            new = self._line_limit(fit)  # never below a size measured to pay
            if new is not None and top is not None:
                new = max(new, top)
        old = self._useful.get(key)
        if new is None or old is None or new == old:
            return new
        if stop is None and new > old and self._noise(key, old) > self.NOISY:
            return new  # no size shows a stop now, and the old one stood on noisy times: lift it
        # Hysteresis: a limit moves only for a clearly better size (HYSTERESIS more rows a second,
        # both sizes measured lately), so noise near the WORTH threshold does not flip it batch to
        # batch, and a call is cut the same way as the same call a moment ago (FP32 answers are
        # bit-identical only within one batch shape).
        now_rate, new_rate = self._rate(fit, key, old), self._rate(fit, key, new)
        if new_rate is None and top is not None and new > top:  # past what was measured: its best evidence
            new_rate = self._rate(fit, key, top)
        if now_rate is not None and new_rate is not None and new_rate < now_rate * (1.0 + self.HYSTERESIS):
            return old
        return new

    def _noise(self, key: Hashable, rows: int) -> float:
        """Mean deviation of a size class's batch times, relative to their mean."""
        size = self._sizes.get((key, SIZE_CLASS[rows]))
        return size[2] / size[0] if size is not None and size[0] > 0 else 1.0

    def _rate(self, fit: _Fit, key: Hashable, rows: int) -> float | None:
        """Measured rows/s of bucket ``key``'s batches in ``rows``' size class, if seen lately."""
        size = self._sizes.get((key, SIZE_CLASS[rows]))
        if size is None or size[1] < self.MEASURED or fit.batches - size[4] > self.STALE or size[0] <= 0:
            return None
        return size[3] / size[0]

    def _line_limit(self, fit: _Fit) -> int | None:
        """Rows beyond which a batch of the bucket ``fit`` describes stops paying: per-row time a/n + b gains
        a/2n by doubling n, worth it while that is at least WORTH of the row's time, i.e. up to
        n = a(1/2 - WORTH) / (WORTH b). None: no limit (batching pays, or not known yet). On CPU a
        long-sequence bucket has a ~ 0 (or a row costs more in a bigger batch): 1, so its rows
        run as they come instead of waiting for a big batch that is no cheaper; on a GPU the
        intercept dominates and there is no limit. Only after LEARN_AFTER batches of the bucket,
        and only while recent batch sizes have varied: under a limit of 1 they stop varying, the
        spread decays, the limit lifts and the next busy moment runs a bigger batch again, so a
        limit learned from noise does not stand for ever (about one probe per ~150 batches)."""
        if fit.batches < self.LEARN_AFTER:
            return None
        line = fit.line()
        if line is None:
            return None
        a, b = line
        if b <= 0:
            return None
        if a <= 0:
            return 1
        return max(1, math.ceil(a * (0.5 - self.WORTH) / (self.WORTH * b)))

    def per_row(self, key: Hashable = None) -> tuple[float, float]:
        fit = self._fits.get(key) if key is not None else None
        return (fit or self._any).coefficients() if (fit or self._any).batches else (self.prior_s, 0.0)

    def snapshot(self) -> dict[str, dict]:
        """For metrics: bucket label -> intercept, per-row slope, batches seen, and per batch-size
        class (the largest size in it: 1, 2, 4, 8, ...) the EWMA time and its deviation."""
        out: dict[str, dict] = {}
        for key, fit in self._fits.items():
            a, b = fit.coefficients()
            out[bucket_label(key)] = {"intercept_s": a, "per_row_s": b, "batches": fit.batches, "sizes": {}}
        for (key, size_class), (mean, samples, dev, *_) in self._sizes.items():
            entry = out.get(bucket_label(key))
            if entry is not None:
                entry["sizes"][size_class] = {"mean_s": mean, "dev_s": dev, "batches": int(samples)}
        return out


def bucket_label(key: Hashable) -> str:
    """A shape bucket as a metric label: (128,) -> "128", (16, 64) -> "16x64", () -> "all"."""
    if isinstance(key, tuple):
        return "x".join(str(k) for k in key) or "all"
    return str(key)


class LoopLag:
    """How late the event loop runs a timer: sampled every ``interval_s``; ``s`` is an EWMA of the
    lag plus twice its mean deviation (a high quantile), what a request loses to the loop on its
    way in and again on its way out. Started once per server loop; ``s`` is 0 until then.

    Its timer is the process's heartbeat: ``listeners`` (the overload gate's look) run on it with
    the loop's time, so the loop keeps no second timer (every wake-up of the loop preempts a
    model thread on a shared core; docs/overload.md). Refusals use ``mean`` (the expected lag),
    planning uses ``s``; why the interval and alpha are 5 ms and 0.05: docs/scheduling.md."""

    def __init__(self, interval_s: float = 0.005, alpha: float = 0.05) -> None:
        self.interval_s = interval_s
        self.alpha = alpha
        self.mean = 0.0
        self.dev = 0.0
        self.s = 0.0
        self.listeners: list[Callable[[float], None]] = []
        self._handle: asyncio.TimerHandle | None = None

    @property
    def running(self) -> bool:
        return self._handle is not None

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Begin sampling on ``loop`` (the running one by default); a second call does nothing."""
        if self._handle is not None:
            return
        self._loop = loop or asyncio.get_running_loop()
        self._due = self._loop.time() + self.interval_s
        self._handle = self._loop.call_at(self._due, self._tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _tick(self) -> None:
        now = self._loop.time()
        lag = max(now - self._due, 0.0)
        err = lag - self.mean
        self.mean += self.alpha * err
        self.dev += self.alpha * (abs(err) - self.dev)
        self.s = self.mean + 2.0 * self.dev
        self._due = now + self.interval_s
        self._handle = self._loop.call_at(self._due, self._tick)  # first: a listener's bug stops no beat
        for listener in self.listeners:
            listener(now)
