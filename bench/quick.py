"""The quick benchmark CI runs after the tests (well under a minute).

batchgate's request rate on ``ranker`` with single-row unary requests, as a ratio to a bare no-op
grpc.aio server (bench/noop_server.py) measured in the same run with the same client. It is
printed; the run fails only on a collapse (ratio below ``--min-ratio``, default 0.3), so a
regression cannot land unseen while the noise of a shared CI machine does not fail builds.

    .venv/bin/python -m batchgate.bench.quick [--concurrency 32] [--seconds 5] [--min-ratio 0.3]
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from batchgate.bench.loadgen import Workload, batching, model_statistics, run_point, start_batchgate, start_noop


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=5.0, help="measured seconds per target")
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument(
        "--min-ratio", type=float, default=0.3, help="fail below this batchgate/noop request rate"
    )
    args = ap.parse_args(argv)

    servers = [start_noop(), start_batchgate()]
    try:
        for s in servers:
            s.ready()
        noop, bg = servers
        workload = Workload("ranker", rows=1)
        results = {}
        for srv in (noop, bg):
            before = asyncio.run(model_statistics(srv.url, "ranker")) if srv is bg else None
            point = asyncio.run(
                run_point(srv.url, workload, "closed", "unary", args.concurrency, args.seconds, args.warmup)
            )
            if srv is bg:
                point.server = batching(before, asyncio.run(model_statistics(srv.url, "ranker")))
            results[srv.name] = point.summary(budget_ms=50.0)
    finally:
        for s in servers:
            s.stop()
    for name, r in results.items():
        extra = f", {r['server_rows_per_batch']} rows/batch" if "server_rows_per_batch" in r else ""
        print(
            f"quick bench {name:>9}: {r['throughput_rps']:7.0f} req/s, p50 {r['p50_ms']:6.2f} ms, "
            f"p99 {r['p99_ms']:6.2f} ms, {r['errors']} errors{extra}"
        )
    ratio = results["batchgate"]["throughput_rps"] / max(results["noop"]["throughput_rps"], 1e-9)
    verdict = "ok" if ratio >= args.min_ratio else f"COLLAPSE (below {args.min_ratio})"
    print(
        f"quick bench: batchgate/noop request rate = {ratio:.2f} (ranker, 1 row, {args.concurrency} callers, "
        f"{args.seconds:g}s each; shared machine, noisy) -> {verdict}"
    )
    if results["batchgate"]["errors"]:
        print(f"quick bench: batchgate answered {results['batchgate']['error_codes']}", file=sys.stderr)
    return 0 if ratio >= args.min_ratio else 1


if __name__ == "__main__":
    sys.exit(main())
