"""Python calls on the event loop per KServe gRPC call, by source tree: a per-call cost that does
not move with a shared machine's load.

CPU µs per call (``bench.takers``, ``lab.text_cpu``) moves ±5-15 % between runs of one tree here,
and with it the rows per batch the scheduler forms, which moves the per-call share of each
batch's work again. This counts instead: the server runs under ``cProfile`` (the main thread:
the asyncio loop, grpc.aio's handlers, admission, the scheduler), one caller sends ``ranker``
calls of one row one after another (each call its own batch, so every tree does the same work
per call), and the count of ``--calls`` minus that of ``--calls // 4`` over the difference is
the calls a KServe call adds, start-up and shut-down cancelled. A change that adds Python work to
the call's path shows as more calls here in every run (figures: docs/benchmarks.md, 2026-12-07
"from 10:12 UTC"). The functions whose counts changed most are listed beside.

    .venv/bin/python -m lab.loop_calls [--tree before=/tmp/before --tree after=.] [--calls 1200]
        [--takers 0] [--top 15]

``--tree LABEL=DIR``: a checkout (or ``git archive`` of one), served from its own folders as
``lab.text_cpu --tree`` does; default this tree. ``--takers``: ``grpc_takers`` (0: grpc.aio's
own loop alone; the takers' path adds their own calls).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pstats
import shutil
import signal
import tempfile
from collections import Counter
from pathlib import Path

from batchgate.bench.loadgen import PYTHON, Started, free_ports
from batchgate.bench.takers import _INFER, _ranker_request, drive
from lab.text_cpu import ROOT, pkg_root, serving_tree


def _name(key: tuple[str, int, str]) -> str:
    file, _, func = key
    if func.startswith("<built-in method __new__"):  # its address differs per process
        return "__new__"
    return f"{Path(file).name}:{func}" if file != "~" else func


def profile(tree: Path, calls: int, takers: int) -> tuple[int, Counter]:
    """(total calls, calls by function) of the server's main thread over a run of ``calls``
    one-row calls from one caller."""
    grpc_port, http_port = free_ports(2)
    fd, out = tempfile.mkstemp(suffix=".prof", prefix="loop-calls-")
    os.close(fd)
    root = pkg_root(tree)
    os.environ["BATCHGATE_GRPC_TAKERS"] = str(takers)
    cmd = [*PYTHON, "-m", "cProfile", "-o", out, "-m", "batchgate", "serve", "--host", "127.0.0.1",
           "--grpc-port", str(grpc_port), "--http-port", str(http_port), "--log-level", "WARNING"]  # fmt: skip
    with serving_tree(root):
        server = Started("batchgate", cmd, f"127.0.0.1:{grpc_port}")
    try:
        server.ready(180)
        seen = asyncio.run(drive(server.url, _INFER, _ranker_request(), calls, 1))
        if seen.get("OK") != calls:
            raise SystemExit(f"{tree}: {dict(seen)} of {calls} calls")
    finally:
        server.proc.send_signal(signal.SIGINT)  # cProfile writes its file on a clean exit
        server.proc.wait(60)
        if str(root) != ".":
            shutil.rmtree(root)
    stats = pstats.Stats(out).stats
    os.unlink(out)
    by: Counter = Counter()
    for key, (_, ncalls, *_rest) in stats.items():
        by[_name(key)] += ncalls
    return sum(by.values()), by


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", default=[], help="LABEL=DIR (repeatable; default this tree)")
    ap.add_argument("--calls", type=int, default=1200)
    ap.add_argument("--takers", type=int, default=0)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    trees = [(t.split("=", 1)[0], Path(t.split("=", 1)[1])) for t in args.tree] or [("this tree", ROOT)]
    short = max(args.calls // 4, 1)
    n = args.calls - short
    per: dict[str, tuple[float, Counter]] = {}
    for label, tree in trees:
        total_long, long = profile(tree, args.calls, args.takers)
        total_short, brief = profile(tree, short, args.takers)
        by = Counter({k: (long[k] - brief.get(k, 0)) / n for k in long})
        per[label] = ((total_long - total_short) / n, by)
        print(
            f"{label:>12}: {per[label][0]:.1f} Python calls on the loop per KServe call ({tree})", flush=True
        )
    if len(per) > 1:
        (a, (_, x)), (b, (_, y)) = list(per.items())[:2]
        moved = sorted(set(x) | set(y), key=lambda k: -abs(y.get(k, 0) - x.get(k, 0)))[: args.top]
        print(f"\ncalls per KServe call, the {args.top} that moved most: {a} -> {b}")
        for k in moved:
            print(f"  {x.get(k, 0):7.2f} -> {y.get(k, 0):7.2f}  {k}")


if __name__ == "__main__":
    main()
