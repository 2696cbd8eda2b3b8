"""Timing and memory: the engines measured alternately in one run on one pinned core (a row alone,
rows/s per batch size), the RSS each loaded engine adds, and the machine that measured."""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from batchgate.gateway.models.optimize.rows import pad_batch, row_len
from batchgate.gateway.models.optimize.sessions import engine_precision, engine_session, judged


BATCH_SIZES = (1, 8, 32)


def pin_core(core: int | None) -> int:
    allowed = sorted(os.sched_getaffinity(0))
    core = allowed[0] if core is None else core
    os.sched_setaffinity(0, {core})
    return core


def speed(engines: dict[str, tuple[Path, str]], feeds: list[dict[str, np.ndarray]], max_batch: int,
          repeats: int) -> dict:  # fmt: skip
    """Per engine (name -> (file, variant)), measured alternately in one run on the current (pinned)
    core: latency of one row alone (p50/p99 over every held-out row, ``repeats`` times) and rows/s
    at each batch size (the held-out rows by length, each batch padded to its longest, as a
    server's length bucket pads; each batch at its quickest of the repeats)."""
    paths = engines
    sessions = {k: engine_session(p, v) for k, (p, v) in engines.items()}
    fetch = {k: judged(s) for k, s in sessions.items()}  # what a call gets by default
    for k, s in sessions.items():  # first runs pay for allocation
        for f in feeds[:3]:
            s.run(fetch[k], f)
    lat: dict[str, list[float]] = {k: [] for k in paths}
    for _ in range(repeats):
        for f in feeds:
            for k, s in sessions.items():
                t0 = time.perf_counter()
                s.run(fetch[k], f)
                lat[k].append(time.perf_counter() - t0)
    result = {
        k: {"latency_ms": {"p50": _pct(v, 50) * 1e3, "p99": _pct(v, 99) * 1e3}, "batches": []}
        for k, v in lat.items()
    }
    by_len = sorted(feeds, key=row_len)  # a server batches rows of like length (length buckets)
    for b in sorted({min(b, max_batch) for b in BATCH_SIZES if max_batch >= 1}):
        batches = [pad_batch(by_len[i : i + b]) for i in range(0, len(by_len), b)]
        times: dict[str, list[list[float]]] = {k: [[] for _ in batches] for k in paths}
        for k, s in sessions.items():
            s.run(fetch[k], batches[0])
        for _ in range(max(2, repeats)):
            for i, batch in enumerate(batches):
                for k, s in sessions.items():
                    t0 = time.perf_counter()
                    s.run(fetch[k], batch)
                    times[k][i].append(time.perf_counter() - t0)
        for k, per_batch in times.items():
            # A pass is each batch at its quickest repeat: on a shared core a stall lands on one
            # run, and the sum of means would charge it to whichever engine ran then.
            per_pass = sum(min(v) for v in per_batch)
            flat = [x for v in per_batch for x in v]
            result[k]["batches"].append({
                "batch": b,
                "rows_per_s": len(feeds) / per_pass,
                "p50_ms": _pct(flat, 50) * 1e3,
                "p99_ms": _pct(flat, 99) * 1e3,
            })  # fmt: skip
    for r in result.values():
        r["peak_rows_per_s"] = max(x["rows_per_s"] for x in r["batches"])
        # What --auto ranks by: served traffic mixes lone rows and full batches, so no one size speaks
        # for it; the geometric mean of rows/s over the measured batch sizes weighs them alike.
        r["score_rows_per_s"] = float(np.exp(np.mean([np.log(x["rows_per_s"]) for x in r["batches"]])))
    return result


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


_RSS_CHILD = """
import sys, numpy as np
def rss():
    for line in open('/proc/self/status'):
        if line.startswith('VmRSS:'):
            return int(line.split()[1]) * 1024
feed = dict(np.load(sys.argv[2]))
if sys.argv[3] == "openvino":
    import openvino
    before = rss()
    from batchgate.workers.openvino_engine import Session
    Session(sys.argv[1], precision=sys.argv[4]).run(None, feed)
else:
    import onnxruntime as ort
    before = rss()
    so = ort.SessionOptions(); so.intra_op_num_threads = 1; so.inter_op_num_threads = 1
    s = ort.InferenceSession(sys.argv[1], so, providers=['CPUExecutionProvider'], disabled_optimizers=sys.argv[4:])
    s.run(None, feed)
print(rss() - before)
"""


def engine_rss(path: Path, feed: dict[str, np.ndarray], variant: str = "fp32") -> int | None:
    """Bytes of RSS a loaded engine adds after one run, in a fresh child (so nothing of ours is
    shared; the runtime's own import is before the first reading)."""
    from batchgate.workers.sessions import disabled_fusions

    engine, precision = engine_precision(variant)
    rest = [precision] if engine == "openvino" else ["fp32", *disabled_fusions("cpu")]
    with tempfile.TemporaryDirectory() as tmp:
        np.savez(Path(tmp) / "feed.npz", **feed)
        try:
            out = subprocess.run([sys.executable, "-c", _RSS_CHILD, str(path), str(Path(tmp) / "feed.npz"),
                                  engine, *rest],
                                 capture_output=True, text=True, timeout=300, check=True)  # fmt: skip
            return int(out.stdout.strip().splitlines()[-1])
        except (subprocess.SubprocessError, ValueError, IndexError):
            return None


def machine(core: int | None = None) -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    import onnxruntime as ort

    pinned = f", pinned to core {core}" if core is not None else ""
    return f"{cpu}, {os.cpu_count()} cores{pinned}; ONNX Runtime {ort.__version__}; Python {platform.python_version()}"
