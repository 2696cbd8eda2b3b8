"""N server processes sharing one gRPC port (SO_REUSEPORT): the ceiling of several front processes.

Starts N no-op servers, or N whole batchgate processes (each with its own workers: no hand-off,
so an upper bound on what N fronts feeding one engine could give), all bound to the same port;
the kernel spreads the load generator's connections over them. Sends a fixed number of
single-row ``ranker`` calls (unary or streamed) from C callers on K connections and prints calls/s
(from a loaded, shared machine: indicative only), the CPU µs per call of all server processes
together and of this load generator (robust), and how the calls' CPU split over the processes.

    .venv/bin/python -m lab.reuseport [--kind noop|batchgate] [--procs 1,2]
        [--apis unary,stream] [--calls 20000] [--concurrency 64] [--connections 16]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import grpc
from batchgate.bench.loadgen import Started, free_ports, process_cpu, self_cpu
from lab.profile import _drive, ranker_sender


def start(kind: str, n: int) -> list[Started]:
    grpc_port, http_port = free_ports(2)
    url = f"127.0.0.1:{grpc_port}"
    if kind == "noop":
        cmd = [sys.executable, "-m", "batchgate.bench.noop_server", str(grpc_port)]
    else:
        cmd = [
            sys.executable, "-m", "batchgate", "serve", "--host", "127.0.0.1", "--grpc-port", str(grpc_port),
            "--http-port", str(http_port), "--log-level", "WARNING", "--reuse-port",  # sharing on purpose
        ]  # fmt: skip
    servers = [Started(f"{kind}-{i}", cmd, url) for i in range(n)]
    for s in servers:
        s.ready()
    return servers


async def measure(
    url: str, pids: list[int], api: str, calls: int, concurrency: int, connections: int
) -> dict:
    chans = [
        grpc.aio.insecure_channel(url, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(connections)
    ]
    streams, send = ranker_sender(chans, api, 1)

    try:
        await _drive(send, concurrency, max(calls // 10, 500))
        t0, c0, s0 = time.perf_counter(), self_cpu(), [process_cpu(p) for p in pids]
        ok, errors = await _drive(send, concurrency, calls)
        t1, c1, s1 = time.perf_counter(), self_cpu(), [process_cpu(p) for p in pids]
    finally:
        for s in streams:
            await s.close()
        for ch in chans:
            await ch.close()
    per_proc = [b - a for a, b in zip(s0, s1)]
    return {
        "api": api,
        "procs": len(pids),
        "calls": ok,
        "errors": errors,
        "calls_per_s_loaded_machine": ok / (t1 - t0),
        "server_cpu_us_per_call": sum(per_proc) / max(ok, 1) * 1e6,
        "client_cpu_us_per_call": (c1 - c0) / max(ok, 1) * 1e6,
        "cpu_share_per_process": [round(p / max(sum(per_proc), 1e-9), 2) for p in per_proc],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", choices=("noop", "batchgate"), default="noop")
    ap.add_argument("--procs", default="1,2", help="process counts to compare, comma-separated")
    ap.add_argument("--apis", default="unary,stream")
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument(
        "--connections", type=int, default=16, help="client connections (the kernel spreads these)"
    )
    args = ap.parse_args(argv)
    rows = []
    for n in (int(x) for x in args.procs.split(",")):
        servers = start(args.kind, n)
        try:
            for api in args.apis.split(","):
                rows.append(
                    asyncio.run(
                        measure(servers[0].url, [s.proc.pid for s in servers], api, args.calls,
                                args.concurrency, args.connections)
                    )
                )  # fmt: skip
        finally:
            for s in servers:
                s.stop()
    print(f"{args.kind}: {args.concurrency} callers on {args.connections} connections, 1-row ranker calls")
    print(
        f"{'api':<7} {'procs':>5} {'calls/s*':>9} {'server µs/call':>14} {'client µs/call':>14}  "
        "CPU share per process"
    )
    for r in rows:
        print(
            f"{r['api']:<7} {r['procs']:>5} {r['calls_per_s_loaded_machine']:>9.0f} "
            f"{r['server_cpu_us_per_call']:>14.1f} "
            f"{r['client_cpu_us_per_call']:>14.1f}  {r['cpu_share_per_process']}"
        )
    print("* calls/s from a shared, loaded machine: compare within one run only")
    return 0


if __name__ == "__main__":
    sys.exit(main())
