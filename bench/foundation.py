"""Foundation benchmark: batchgate against a no-op gRPC server, in one run.

Closed loop: C concurrent callers, each sending ModelInfer for `ranker` (R rows of raw inputs) as
fast as answers come back, for D seconds per target. Prints calls/s, rows/s, latency percentiles,
the mean rows per executed batch (from ModelStatistics), and the ratios batchgate / no-op.

    .venv/bin/python -m batchgate.bench.foundation [--concurrency 64] [--rows 4] [--seconds 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np

from batchgate.proto.inference.v2 import grpc_service_pb2 as pb
from batchgate.proto.inference.v2 import grpc_service_pb2_grpc as pb_grpc
from batchgate.bench.loadgen import free_ports, wait_ready

ROOT = Path(__file__).resolve().parent.parent


def _request(rows: int, seed: int) -> pb.ModelInferRequest:
    rng = np.random.default_rng(seed)
    req = pb.ModelInferRequest(model_name="ranker")
    req.inputs.add(name="dense", datatype="FP32", shape=[rows, 64])
    req.inputs.add(name="sparse_ids", datatype="INT64", shape=[rows, 8])
    req.raw_input_contents.append(rng.standard_normal((rows, 64), dtype=np.float32).tobytes())
    req.raw_input_contents.append(rng.integers(0, 10_000, (rows, 8), dtype=np.int64).tobytes())
    return req


async def _load(url: str, concurrency: int, rows: int, seconds: float) -> dict:
    requests = [_request(rows, i) for i in range(64)]
    latencies: list[float] = []
    errors = 0
    # A few channels, as a real client fleet would have; one HTTP/2 connection serialises a lot.
    channels = [grpc.aio.insecure_channel(url) for _ in range(4)]
    stubs = [pb_grpc.GRPCInferenceServiceStub(ch) for ch in channels]
    stop_at = time.perf_counter() + seconds

    async def caller(i: int) -> None:
        nonlocal errors
        stub = stubs[i % len(stubs)]
        k = i
        while (t0 := time.perf_counter()) < stop_at:
            try:
                await stub.ModelInfer(requests[k % len(requests)], timeout=10)
                latencies.append(time.perf_counter() - t0)
            except grpc.RpcError:
                errors += 1
            k += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(caller(i) for i in range(concurrency)))
    elapsed = time.perf_counter() - t0
    for ch in channels:
        await ch.close()
    lat = np.array(latencies) * 1e3
    return {
        "calls_per_s": len(latencies) / elapsed,
        "rows_per_s": len(latencies) * rows / elapsed,
        "p50_ms": float(np.percentile(lat, 50)),
        "p99_ms": float(np.percentile(lat, 99)),
        "errors": errors,
    }


async def _batch_stats(url: str) -> dict:
    async with grpc.aio.insecure_channel(url) as ch:
        stub = pb_grpc.GRPCInferenceServiceStub(ch)
        st = (await stub.ModelStatistics(pb.ModelStatisticsRequest(name="ranker"))).model_stats[0]
        return {"executions": st.execution_count, "rows": st.inference_count, "requests": st.inference_stats.success.count}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = ap.parse_args()

    noop_port, bg_grpc, bg_http = free_ports(3)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = [
        subprocess.Popen([sys.executable, "-m", "batchgate.bench.noop_server", str(noop_port)], cwd=ROOT, env=env),
        subprocess.Popen(
            [sys.executable, "-m", "batchgate", "serve", "--host", "127.0.0.1", "--grpc-port", str(bg_grpc),
             "--http-port", str(bg_http), "--log-level", "WARNING"],
            cwd=ROOT, env=env,
        ),
    ]  # fmt: skip
    try:
        noop_url, bg_url = f"127.0.0.1:{noop_port}", f"127.0.0.1:{bg_grpc}"
        asyncio.run(wait_ready(noop_url))
        asyncio.run(wait_ready(bg_url))
        asyncio.run(_load(bg_url, args.concurrency, args.rows, 1.0))  # warm-up
        results = {}
        for name, url in (("noop", noop_url), ("batchgate", bg_url)):
            before = asyncio.run(_batch_stats(bg_url))
            print(f"  {name}: {args.concurrency} callers x {args.rows} rows for {args.seconds:.0f}s ...", file=sys.stderr)
            results[name] = asyncio.run(_load(url, args.concurrency, args.rows, args.seconds))
            after = asyncio.run(_batch_stats(bg_url))
            if name == "batchgate":
                ex = after["executions"] - before["executions"]
                results[name]["rows_per_batch"] = (after["rows"] - before["rows"]) / max(ex, 1)
                results[name]["requests_per_batch"] = (after["requests"] - before["requests"]) / max(ex, 1)
        ratio = {
            "calls_per_s": results["batchgate"]["calls_per_s"] / results["noop"]["calls_per_s"],
            "p50_ms": results["batchgate"]["p50_ms"] / results["noop"]["p50_ms"],
            "p99_ms": results["batchgate"]["p99_ms"] / results["noop"]["p99_ms"],
        }
        if args.json:
            print(json.dumps({"args": vars(args), "results": results, "ratio_batchgate_over_noop": ratio}, indent=2))
            return 0
        print(f"{'target':<10} {'calls/s':>9} {'rows/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'errors':>6}  batching")
        for name, r in results.items():
            extra = (
                f"{r['requests_per_batch']:.1f} requests, {r['rows_per_batch']:.1f} rows per batch"
                if "rows_per_batch" in r
                else ""
            )
            print(
                f"{name:<10} {r['calls_per_s']:>9.0f} {r['rows_per_s']:>9.0f} {r['p50_ms']:>8.2f} "
                f"{r['p99_ms']:>8.2f} {r['errors']:>6}  {extra}"
            )
        print(
            f"ratio batchgate/noop: calls/s {ratio['calls_per_s']:.2f}, p50 {ratio['p50_ms']:.2f}x, "
            f"p99 {ratio['p99_ms']:.2f}x"
        )
        return 0
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    sys.exit(main())
