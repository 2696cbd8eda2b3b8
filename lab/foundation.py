"""Foundation benchmark: batchgate against a no-op gRPC server, unary and streamed, in one run.

Closed loop: C concurrent callers, each sending ``ranker`` requests of R rows (raw inputs) as fast
as answers come back, for D seconds per target and API: ``ModelInfer`` calls (unary) and messages
on long-lived ``ModelStreamInfer`` streams (stream), against batchgate and against the no-op
server (bench/noop_server.py) speaking the same API. Prints calls/s, rows/s, latency
percentiles, the mean requests and rows per executed batch (from ModelStatistics), and the ratios
batchgate / no-op per API. The load generator is bench/loadgen.py's, on 4 connections.

    .venv/bin/python -m lab.foundation [--concurrency 64] [--rows 4] [--seconds 8]
        [--apis unary,stream] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from batchgate.bench.loadgen import (
    Workload,
    batching,
    model_statistics,
    run_point,
    start_batchgate,
    start_noop,
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--apis", default="unary,stream", help="unary, stream or both (comma-separated)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = ap.parse_args(argv)
    apis = args.apis.split(",")
    if not set(apis) <= {"unary", "stream"}:
        ap.error("--apis takes unary and/or stream")

    workload = Workload("ranker", rows=args.rows)
    servers = [start_noop(), start_batchgate()]
    results: dict[str, dict[str, dict]] = {api: {} for api in apis}
    try:
        for s in servers:
            s.ready()
        for api in apis:
            for srv in servers:
                print(f"  {srv.name} {api}: {args.concurrency} callers x {args.rows} rows for "
                      f"{args.seconds:g}s ...", file=sys.stderr)  # fmt: skip
                before = asyncio.run(model_statistics(srv.url, "ranker")) if srv.name == "batchgate" else None
                point = asyncio.run(
                    run_point(srv.url, workload, "closed", api, args.concurrency, args.seconds, args.warmup)
                )
                if before is not None:
                    point.server = batching(before, asyncio.run(model_statistics(srv.url, "ranker")))
                results[api][srv.name] = point.summary(budget_ms=50.0)
    finally:
        for s in servers:
            s.stop()

    ratios = {api: _ratios(r["batchgate"], r["noop"]) for api, r in results.items()}
    if args.json:
        print(
            json.dumps(
                {"args": vars(args), "results": results, "ratio_batchgate_over_noop": ratios}, indent=2
            )
        )
        return 0
    print(
        f"{'target':<10} {'api':<7} {'calls/s':>9} {'rows/s':>9} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'errors':>6}  batching"
    )
    for api, by_target in results.items():
        for name, r in by_target.items():
            extra = (
                f"{r['server_requests_per_batch']:.1f} requests, "
                f"{r['server_rows_per_batch']:.1f} rows per batch"
                if "server_rows_per_batch" in r
                else ""
            )
            print(
                f"{name:<10} {api:<7} {r['throughput_rps']:>9.0f} {r['rows_per_s']:>9.0f} "
                f"{r['p50_ms']:>8.2f} "
                f"{r['p99_ms']:>8.2f} {r['errors']:>6}  {extra}"
            )
    for api, ratio in ratios.items():
        print(
            f"ratio batchgate/noop ({api}): calls/s {ratio['calls_per_s']:.2f}, p50 {ratio['p50_ms']:.2f}x, "
            f"p99 {ratio['p99_ms']:.2f}x"
        )
    return 0


def _ratios(bg: dict, noop: dict) -> dict:
    def div(a: float, b: float) -> float:
        return a / b if b else float("nan")

    return {
        "calls_per_s": div(bg["throughput_rps"], noop["throughput_rps"]),
        "p50_ms": div(bg["p50_ms"], noop["p50_ms"]),
        "p99_ms": div(bg["p99_ms"], noop["p99_ms"]),
    }


if __name__ == "__main__":
    sys.exit(main())
