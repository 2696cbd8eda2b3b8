"""Health checks under overload: the service port against the plaintext health port.

The server (bench.loadgen's ``start_batchgate``) is pinned to core 0 and serves with
``--health-port``. The C++ open-loop client
(bench/openloop, as bench.goodput's overload points use it) offers ``encoder`` one-row calls of
64 tokens (250 ms budget, as gRPC deadlines) from core 1, at RATE calls/s for SECONDS. Meanwhile two
threads call ``grpc.health.v1.Health/Check`` every 100 ms with a 3 s timeout (a kubelet probe's
default): one on the service port and one on the health port. It prints what each got and its
slowest answer.

The overload gate's door refuses a share of every new call on the service port before the method
is known (docs/overload.md), health checks included. That is why the chart's probes use the
health port.

    .venv/bin/python -m lab.health_overload [--rate 5000] [--seconds 8]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from batchgate.bench.goodput import encoder_request, openloop_binary
from batchgate.bench.loadgen import free_ports, start_batchgate


def _probe(port: int, seen: collections.Counter, slowest: list[float], stop: threading.Event) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=3)
                seen[health_pb2.HealthCheckResponse.ServingStatus.Name(status.status)] += 1
            except grpc.RpcError as exc:
                seen[exc.code().name] += 1
            slowest[0] = max(slowest[0], time.perf_counter() - t0)
            stop.wait(0.1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=5000, help="calls/s offered (encoder, 1 row x 64 tokens)")
    ap.add_argument("--seconds", type=float, default=8)
    args = ap.parse_args()
    (health_port,) = free_ports(1)
    server = start_batchgate("--health-port", str(health_port))
    try:
        subprocess.run(
            ["taskset", "-a", "-p", "-c", "0", str(server.proc.pid)], capture_output=True, check=True
        )
        server.ready()
        grpc_port = int(server.url.rsplit(":", 1)[1])
        os.sched_setaffinity(0, {1})
        params = {"latency_class": "standard", "latency_budget_ms": 250}
        with tempfile.NamedTemporaryFile(suffix=".bin") as f:
            f.write(encoder_request(np.random.default_rng(0), 1, 64, params).SerializeToString())
            f.flush()
            stop = threading.Event()
            ports = {"service port": grpc_port, "health port": health_port}
            seen = {name: collections.Counter() for name in ports}
            slowest = {name: [0.0] for name in ports}
            probes = [
                threading.Thread(target=_probe, args=(port, seen[name], slowest[name], stop))
                for name, port in ports.items()
            ]
            for t in probes:
                t.start()
            cmd = ["taskset", "-c", "1", str(openloop_binary()), f"127.0.0.1:{grpc_port}", f"{args.rate:g}",
                   f"{args.seconds:g}", "1", "1", f"a:1:250:{f.name}"]  # fmt: skip
            out = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
            stop.set()
            for t in probes:
                t.join()
    finally:
        server.stop()
    print(f"load: {args.rate:g} calls/s for {args.seconds:g} s: {out['classes']['a']['status']}")
    for name in ports:
        print(f"health checks on the {name}: {dict(seen[name])}, slowest {slowest[name][0] * 1000:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
