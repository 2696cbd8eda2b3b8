"""Bucketed static engines vs. padding to the longest row vs. no batching, on ``encoder``.

Drives the worker layer directly (no gRPC), so only the engine side differs between the three:

  (a) per-request  each request runs alone at its own shape (a plain dynamic-shape session)
  (b) pad-longest  FIFO batches of up to ``--max-batch`` rows, padded to the batch's longest row
                   (what a batcher that merges across lengths without buckets must do)
  (c) buckets      the WorkerPool with shape buckets and buffer pools: rows grouped by length
                   bucket (the gateway's batching key), padded to the bucket, bound buffers

Load is a closed loop: ``--concurrency`` clients, each sending one single-row request, waiting
for its answer, then sending the next. A batch is formed whenever a worker is free, from what is
queued (as the gateway's scheduler does under load). Lengths come from a wide, skewed
distribution: lognormal with median ``--median`` tokens, clipped to [``--min-len``, 512], so most
requests are short and a few are long. The modes run in alternating short rounds so that a
shared machine's background load falls on all of them alike.

    .venv/bin/python -m lab.buckets_bench [--seconds 3] [--rounds 2] [--concurrency 64] [--workers 2]
"""

from __future__ import annotations

import argparse
import math
import queue
import sys
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from batchgate.gateway.parameters import bucket_config  # noqa: E402
from batchgate.workers import Device, EngineOptions, WorkerPool  # noqa: E402
from batchgate.workers.sessions import SessionFactory  # noqa: E402

MODEL_DIR = ROOT / "model_repository" / "encoder"
MAX_BATCH = 64  # the encoder's max_batch_size: what the engines are built for


def encoder_parameters() -> dict[str, str]:
    """The bundled encoder's config.pbtxt parameters (seq_buckets, max_batch_tokens, ...)."""
    from google.protobuf import text_format

    from batchgate.proto.inference.v2 import model_config_pb2 as mc

    cfg = mc.ModelConfig()
    text_format.Parse((MODEL_DIR / "config.pbtxt").read_text(), cfg)
    return {k: v.string_value for k, v in cfg.parameters.items()}


@dataclass
class Request:
    length: int
    arrays: dict[str, np.ndarray]
    sent: float = 0.0


@dataclass
class Result:
    rows: int = 0
    executions: int = 0
    tokens: int = 0
    computed_tokens: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # this process's CPU time (all threads): immune to other processes' load
    latencies_ms: list[float] = field(default_factory=list)

    def add(self, other: Result) -> None:
        self.rows += other.rows
        self.executions += other.executions
        self.tokens += other.tokens
        self.computed_tokens += other.computed_tokens
        self.seconds += other.seconds
        self.cpu_seconds += other.cpu_seconds
        self.latencies_ms.extend(other.latencies_ms)

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.seconds if self.seconds else 0.0

    @property
    def rows_per_cpu_s(self) -> float:
        return self.rows / self.cpu_seconds if self.cpu_seconds else 0.0

    def pct(self, q: float) -> float:
        return float(np.percentile(self.latencies_ms, q)) if self.latencies_ms else math.nan


def make_requests(n: int, median: float, sigma: float, min_len: int, seed: int) -> list[Request]:
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.round(rng.lognormal(math.log(median), sigma, n)), min_len, 512).astype(int)
    out = []
    for L in lengths:
        ids = rng.integers(0, 1000, (1, int(L)), dtype=np.int64)
        out.append(Request(int(L), {"input_ids": ids, "attention_mask": np.ones((1, int(L)), np.int64)}))
    return out


class PlainRunner:
    """(a) and (b): one plain dynamic-shape session per worker thread, as a bucket-less server has."""

    def __init__(self, workers: int, cache_dir: Path | None) -> None:
        factory = SessionFactory(MODEL_DIR / "1" / "model.onnx", "", Device("cpu"), cache_dir=cache_dir)
        self._sessions = queue.SimpleQueue()
        for _ in range(workers):
            self._sessions.put(factory.create(None))
        self._exec = ThreadPoolExecutor(workers)

    def _run(self, parts: list[dict[str, np.ndarray]]) -> int:
        sess = self._sessions.get()
        try:
            longest = max(p["input_ids"].shape[1] for p in parts)
            rows = sum(p["input_ids"].shape[0] for p in parts)
            if len(parts) == 1:
                feeds = parts[0]
            else:  # pad every row to the batch's longest, mask 0
                feeds = {n: np.zeros((rows, longest), np.int64) for n in ("input_ids", "attention_mask")}
                r = 0
                for p in parts:
                    k, L = p["input_ids"].shape
                    for n in feeds:
                        feeds[n][r : r + k, :L] = p[n]
                    r += k
            sess.run(None, feeds)
            return rows * longest
        finally:
            self._sessions.put(sess)

    def submit(self, parts: list[dict[str, np.ndarray]]) -> Future:
        return self._exec.submit(self._run, parts)

    def close(self) -> None:
        self._exec.shutdown()


class BucketRunner:
    """(c): the WorkerPool with shape buckets and buffer pools."""

    def __init__(self, workers: int, cache_dir: Path | None, overrides: dict[str, str]) -> None:
        cfg = bucket_config({**encoder_parameters(), **overrides}, MAX_BATCH, (16, 32))
        self.pool = WorkerPool("encoder-bench", MODEL_DIR / "1" / "model.onnx", [Device("cpu")], workers,
                               EngineOptions(cache_dir=cache_dir), cfg)  # fmt: skip
        self.pool.start()

    def submit(self, parts: list[dict[str, np.ndarray]]) -> Future:
        outer: Future = Future()
        inner = self.pool.submit(parts, [1] * len(parts), True)

        def done(f: Future) -> None:
            if f.exception() is not None:
                outer.set_exception(f.exception())
            else:
                outer.set_result(f.result()[1].padded_tokens)

        inner.add_done_callback(done)
        return outer

    def close(self) -> None:
        self.pool.close()


def form_batch(mode: str, pending: deque[Request], key, max_rows: int) -> list[Request]:
    if mode == "per-request":
        return [pending.popleft()]
    if mode == "pad-longest":
        return [pending.popleft() for _ in range(min(max_rows, len(pending)))]
    # buckets: the oldest request's bucket, its requests in arrival order, up to max_rows rows
    want = key(pending[0].arrays)
    batch, rest = [], deque()
    while pending and len(batch) < max_rows:
        r = pending.popleft()
        (batch if key(r.arrays) == want else rest).append(r)
    pending.extendleft(reversed(rest))
    return batch


def run_mode(mode: str, runner, workers: int, concurrency: int, seconds: float, requests: list[Request],
             key, start_index: int, max_rows: int) -> tuple[Result, int]:  # fmt: skip
    res = Result()
    done_q: queue.SimpleQueue = queue.SimpleQueue()
    pending: deque[Request] = deque()
    nxt = start_index

    def issue(now: float) -> None:
        nonlocal nxt
        proto = requests[nxt % len(requests)]
        nxt += 1
        pending.append(Request(proto.length, proto.arrays, now))

    t0 = time.perf_counter()
    c0 = time.process_time()
    end = t0 + seconds
    for _ in range(concurrency):
        issue(t0)
    inflight = 0
    while True:
        while inflight < workers and pending and time.perf_counter() < end:
            batch = form_batch(mode, pending, key, max_rows)
            fut = runner.submit([r.arrays for r in batch])
            fut.add_done_callback(lambda f, b=batch: done_q.put((b, f)))
            inflight += 1
        if inflight == 0:
            break
        batch, fut = done_q.get()
        inflight -= 1
        now = time.perf_counter()
        computed = fut.result()
        res.executions += 1
        res.computed_tokens += computed
        for r in batch:
            res.rows += 1
            res.tokens += r.length
            res.latencies_ms.append((now - r.sent) * 1e3)
            if now < end:
                issue(now)
    res.seconds = time.perf_counter() - t0
    res.cpu_seconds = time.process_time() - c0
    return res, nxt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=3.0, help="measured seconds per mode per round")
    ap.add_argument("--rounds", type=int, default=2, help="rounds; each runs every mode once")
    ap.add_argument("--concurrency", type=int, default=64, help="closed-loop clients")
    ap.add_argument("--workers", type=int, default=2, help="worker threads (the encoder's instance count)")
    ap.add_argument("--max-batch", type=int, default=32,
                    help="rows per batch at most, (b) and (c) alike: the encoder's largest preferred size, "
                    "so concurrency 64 keeps two workers busy")  # fmt: skip
    ap.add_argument("--median", type=float, default=24.0, help="median request length, tokens")
    ap.add_argument("--sigma", type=float, default=0.9, help="lognormal sigma of the lengths (skew)")
    ap.add_argument("--min-len", type=int, default=4)
    ap.add_argument("--modes", default="per-request,pad-longest,buckets")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seq-buckets", default="", help="override the encoder's seq_buckets parameter")
    ap.add_argument("--batch-buckets", default="", help="override the batch buckets (default: the config's)")
    args = ap.parse_args(argv)
    overrides = {}
    if args.seq_buckets:
        overrides["seq_buckets"] = args.seq_buckets
    if args.batch_buckets:
        overrides["batch_buckets"] = args.batch_buckets

    requests = make_requests(4096, args.median, args.sigma, args.min_len, args.seed)
    lengths = np.array([r.length for r in requests])
    print(
        f"lengths: median {np.median(lengths):.0f}, mean {lengths.mean():.1f}, p90 {np.percentile(lengths, 90):.0f}, "
        f"p99 {np.percentile(lengths, 99):.0f}, max {lengths.max()}; {(lengths > 128).mean():.1%} over 128 tokens"
    )
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    t = time.perf_counter()
    plain = PlainRunner(args.workers, None) if {"per-request", "pad-longest"} & set(modes) else None
    buckets = BucketRunner(args.workers, None, overrides) if "buckets" in modes else None
    print(f"engines ready in {time.perf_counter() - t:.1f}s; {args.workers} workers, concurrency {args.concurrency}, "
          f"{args.rounds} x {args.seconds:.0f}s per mode")  # fmt: skip
    key = buckets.pool.shape_key if buckets is not None else None
    results = {m: Result() for m in modes}
    index = 0
    try:
        for m in modes:  # short warm-up of each mode's code paths, not measured
            runner = buckets if m == "buckets" else plain
            _, index = run_mode(
                m, runner, args.workers, args.concurrency, 0.5, requests, key, index, args.max_batch
            )
        for _ in range(args.rounds):
            for m in modes:
                runner = buckets if m == "buckets" else plain
                r, index = run_mode(
                    m,
                    runner,
                    args.workers,
                    args.concurrency,
                    args.seconds,
                    requests,
                    key,
                    index,
                    args.max_batch,
                )
                results[m].add(r)
    finally:
        if plain is not None:
            plain.close()
        if buckets is not None:
            buckets.close()

    print()
    print(f"{'mode':<14}{'rows/s':>10}{'rows/cpu-s':>12}{'p50 ms':>10}{'p99 ms':>10}{'rows/exec':>11}"
          f"{'tokens computed/sent':>22}")  # fmt: skip
    for m, r in results.items():
        waste = r.computed_tokens / r.tokens if r.tokens else math.nan
        print(f"{m:<14}{r.rows_per_s:>10.1f}{r.rows_per_cpu_s:>12.1f}{r.pct(50):>10.1f}{r.pct(99):>10.1f}"
              f"{r.rows / max(r.executions, 1):>11.1f}{waste:>22.2f}")  # fmt: skip
    if "buckets" in results and "pad-longest" in results:
        c, b = results["buckets"], results["pad-longest"]
        print()
        print(f"(c) buckets / (b) pad-longest: rows/s x{c.rows_per_s / b.rows_per_s:.2f}, rows/cpu-s "
              f"x{c.rows_per_cpu_s / b.rows_per_cpu_s:.2f}, p99 x{c.pct(99) / b.pct(99):.2f} (lower is better)")  # fmt: skip
    if "buckets" in results and "per-request" in results:
        c, a = results["buckets"], results["per-request"]
        print(f"(c) buckets / (a) per-request: rows/s x{c.rows_per_s / a.rows_per_s:.2f}, rows/cpu-s "
              f"x{c.rows_per_cpu_s / a.rows_per_cpu_s:.2f}, p99 x{c.pct(99) / a.pct(99):.2f}")  # fmt: skip
    if "buckets" in results and "pad-longest" in results:
        goal = c.rows_per_s >= 2 * b.rows_per_s and c.pct(99) <= b.pct(99)
        print(f"goal (c) >= 2x (b) rows/s at equal or better p99: {'met' if goal else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
