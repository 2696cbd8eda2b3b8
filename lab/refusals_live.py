"""Refusals at capacity on the live server, traced (issue 57, item 5): the text-batches shapes
(bench/text_batches.py: minilm, mixed-length texts, closed loops whose calls carry their class's
budget as the gRPC deadline) repeated, the server pinned to one core and the load to the other.
Per run: calls answered, refusals by cause, p99; with ``--trace``, the server records every
refusal with the figures that made it (the admission estimate's wait, own compute, ratio and
time left; an expiry's wait and estimate; each change of the overload gate's share with the
signals that moved it) and the first few of each kind are printed under the run.

    python -m lab.refusals_live [--runs 3] [--seconds 10] [--shapes 64x1:standard,...] [--trace]
        [--keep-trace FILE]
    python -m lab.refusals_live --write-fixture FILE tests/data/zen4_shared_batches.json

The server runs as ``python -m lab.refusals_live --serve-traced FILE -- <batchgate serve args>``,
which wraps three methods (nothing else changes) and appends JSON lines to FILE."""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from batchgate.bench import text_batches as tb
from batchgate.bench.loadgen import Started, free_ports

ROOT = Path(__file__).resolve().parent.parent


def install_trace(path: str) -> None:
    """Wrap the scheduler's shed and expiry and the gate's look to record what they decided."""
    from batchgate.gateway.admission.gate import LoadShedder
    from batchgate.gateway.scheduling.latency import LatencyModel
    from batchgate.gateway.scheduling.scheduler import Scheduler

    out = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the server

    def write(kind: str, **fields) -> None:
        out.write(json.dumps({"kind": kind, "t": time.monotonic(), **fields}) + "\n")

    shed, expire, look, observe = Scheduler._shed, Scheduler._expire, LoadShedder._look, LatencyModel.observe

    def traced_observe(self, key, rows, seconds):
        write("batch", key=str(key), rows=rows, s=seconds)
        return observe(self, key, rows, seconds)

    def traced_shed(self, req, refusal, now):
        q = self.queue
        write(
            "shed", cls=req.class_name, rows=req.rows, key=str(req.key), left_ms=(q.due(req) - now) * 1e3,
            wait_ms=refusal.wait_s * 1e3, own_ms=refusal.own_s * 1e3, alone=refusal.alone,
            predicted_ms=(q.prediction or 0.0) * 1e3, ratio_low=q._ratio_low(), queued=q.size,
            queued_rows=q.rows, running_ms=self._running_s(now) * 1e3, free=self._free,
            lag_ms=q.lag_expected() * 1e3, limit=q._limit(req.key),
        )  # fmt: skip
        return shed(self, req, refusal, now)

    def traced_expire(self, r, now):
        q = self.queue
        write(
            "expire", cls=r.class_name, rows=r.rows, key=str(r.key), waited_ms=(now - r.arrival) * 1e3,
            left_ms=(r.deadline - now) * 1e3, est_hi_ms=self.latency.estimate_hi(r.key, r.rows) * 1e3,
            queued=q.size, queued_rows=q.rows, free=self._free, lag_ms=q.lag_expected() * 1e3,
        )  # fmt: skip
        return expire(self, r, now)

    def traced_look(self, now):
        before = (self.admit, self.ended, self.dropped, self.arrived, self.busy, self.saturation)
        look(self, now)
        if self.admit != before[0] and (self.admit < before[0] or self.admit == 1.0):
            write(
                "gate", admit=self.admit, was=before[0], ended=before[1], dropped=before[2],
                arrived=before[3], busy=before[4], saturation=before[5], lag_ms=self.load.lag.s * 1e3,
                inflight=self.load.inflight, refused=self.refused,
            )  # fmt: skip

    Scheduler._shed, Scheduler._expire, LoadShedder._look = traced_shed, traced_expire, traced_look
    LatencyModel.observe = traced_observe


def summary(path: Path, since: float) -> list[str]:
    """The first records of each kind written after ``since`` (monotonic), and their counts."""
    if not path.exists():
        return []
    kinds: dict[str, list[dict]] = collections.defaultdict(list)
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec["t"] >= since:
            kinds[rec["kind"]].append(rec)
    lines = []
    for kind, recs in kinds.items():
        if kind == "batch":
            lines.append(
                f"    batches: {len(recs)}, {sum(r['rows'] for r in recs)} rows, {sum(r['s'] for r in recs):.1f} s"
            )
            continue
        lines.append(f"    {kind}: {len(recs)}")
        for rec in recs[:4]:
            figures = ", ".join(
                f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                for k, v in rec.items()
                if k not in ("kind", "t")
            )
            lines.append(f"      {figures}")
    return lines


def write_fixture(trace: Path, out: Path) -> None:
    """tests/data/zen4_shared_batches.json from a kept trace: per length bucket the least-squares
    line a + b x rows of its batch times, every batch's time over its line in the order they ran
    (the host's noise, stalls included), and bench/texts/mixed.txt's texts' buckets as the text
    stage keys them (tests/capacity_replay.py replays them)."""
    import bisect

    import numpy as np

    from batchgate.gateway.text import estimate_tokens

    batches = [r for r in map(json.loads, trace.read_text().splitlines()) if r["kind"] == "batch"]
    by_key: dict[int, list[tuple[int, float]]] = collections.defaultdict(list)
    for r in batches:
        by_key[int(r["key"])].append((r["rows"], r["s"]))
    lines = {}
    for key, pts in by_key.items():
        x, y = np.array([p[0] for p in pts], float), np.array([p[1] for p in pts])
        b = float(np.polyfit(x, y, 1)[0]) if len(set(x)) > 1 else 0.0
        b = max(b, 0.0)
        a = max(float(np.median(y - b * x)), 0.0005)  # the median: a stall does not move the line
        lines[key] = (round(a, 6), round(b, 6))
    noise = [
        round(r["s"] / (lines[int(r["key"])][0] + lines[int(r["key"])][1] * r["rows"]), 3) for r in batches
    ]
    buckets = [16, 24, 32, 48, 64, 96, 128, 192, 256]  # minilm's length_buckets
    keys = [buckets[min(bisect.bisect_left(buckets, estimate_tokens(t.encode(), 2)), 8)] for t in tb.texts()]
    out.write_text(json.dumps({"lines": lines, "noise": noise, "text_keys": keys}) + "\n")
    print(f"{out}: {len(batches)} batches, {len(lines)} buckets, noise {min(noise)}-{max(noise)}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--seconds", type=float, default=10.0, help="measured seconds per shape and run")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds of load before a shape's first run")
    p.add_argument("--shapes", default="64x1:standard,4x32:standard,8x32:bulk,1x32:bulk")
    p.add_argument("--server-core", type=int, default=0)
    p.add_argument("--load-core", type=int, default=1)
    p.add_argument("--trace", action="store_true", help="record every refusal's figures in the server")
    p.add_argument("--keep-trace", type=Path, help="copy the server's trace (JSON lines) here at the end")
    p.add_argument("--model-dir", type=Path, default=ROOT / "model_repository" / "minilm")
    args = p.parse_args()
    all_texts = tb.texts()
    shapes = []
    for item in args.shapes.split(","):
        dims, _, cls = item.partition(":")
        callers, per_call = (int(x) for x in dims.split("x"))
        shapes.append((callers, per_call, cls or "standard"))
    tmp = Path(tempfile.mkdtemp(prefix="refusals-live-"))
    tb.make_repo(args.model_dir, tmp)
    trace = tmp / "trace.jsonl"
    grpc_port, http_port = free_ports(2)
    url = f"127.0.0.1:{grpc_port}"
    serve = ["--host", "127.0.0.1", "--grpc-port", str(grpc_port), "--http-port", str(http_port),
             "--model-repository", str(tmp), "--no-build-models", "--log-level", "WARNING"]  # fmt: skip
    cmd = ["taskset", "-c", str(args.server_core), sys.executable]
    cmd += ["-m", "lab.refusals_live", "--serve-traced", str(trace), "--", *serve] if args.trace else ["-m", "batchgate", "serve", *serve]  # fmt: skip
    server = Started("batchgate", cmd, url)
    os.sched_setaffinity(0, {args.load_core})
    totals: dict[str, list[int]] = {}
    try:
        server.ready(180)
        for callers, per_call, cls in shapes:
            label = f"{callers}x{per_call}:{cls}"
            asyncio.run(tb.load(url, "minilm", all_texts, callers, per_call, cls, args.warmup))
            for run in range(args.runs):
                since = time.monotonic()
                r = asyncio.run(tb.load(url, "minilm", all_texts, callers, per_call, cls, args.seconds))
                n = sum(r["refused"].values())
                totals.setdefault(label, []).append(n)
                print(
                    f"{label:<14} run {run}: {r['answered']:>5} answered, {r['texts_per_s']:6.1f} texts/s, "
                    f"p99 {r['p99_ms']:6.0f} ms, refused {n} {r['refused'] or ''}",
                    flush=True,
                )
                if args.trace:
                    print("\n".join(summary(trace, since)), flush=True)
        for label, counts in totals.items():
            print(f"{label:<14} refused per run: {counts}; runs with any: {sum(1 for c in counts if c)}")
    finally:
        server.stop()
        if args.keep_trace and trace.exists():
            shutil.copy(trace, args.keep_trace)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--write-fixture"]:
        write_fixture(Path(sys.argv[2]), Path(sys.argv[3]))
        sys.exit(0)
    if sys.argv[1:2] == ["--serve-traced"]:
        install_trace(sys.argv[2])
        from batchgate.gateway.cli import main as serve_main

        sys.exit(serve_main(["serve", *sys.argv[4:]]))
    sys.exit(main())
