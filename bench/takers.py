"""What the extra gRPC call takers (gateway/transport/takers.py) buy, in server CPU per call.

Two measurements, each as server CPU µs per call (utime + stime of the server process, all its
threads, from /proc, divided by the calls answered: robust on a shared machine, where calls/s are not):

1. ``ranker``, one row per call, closed loop (64 callers on 2 channels, raw bytes): the no-op
   grpc.aio server, batchgate with grpc.aio's own loop alone (``grpc_takers=0``) and with the
   takers (16, and the default 64). Calls/s are printed too, for the ratio in this run.
2. The price of a refusal: a bare grpc.aio server whose every call is refused UNAVAILABLE, once
   from its handler (``context.abort``, the cheapest refusal once a handler runs) and once by a
   taker before any handler (``CallTakers`` with a gate that refuses all). Beside them, gRPC
   core's own price of a call no Python code ever sees: a server that never asks for a call, so
   each waits in core until its 50 ms deadline. No refusal in this process can cost less; it
   bounds what any door can do (docs/overload.md, "What a refusal costs").

    .venv/bin/python -m batchgate.bench.takers [--calls 300] [--callers 64] [--pin] [--open-loop 5000]

``--pin`` puts the servers on CPU 0 and the client on CPU 1. batchgate takes its settings from
the environment (``BATCHGATE_*``); ``--api-key`` sends a key to it with every call (a tenant file). ``--open-loop RATE`` measures the
refusals again under the C++ open-loop client (bench/openloop, as bench.goodput's overload points
use it) at RATE calls/s for 5 s, each call with a 1 s deadline: calls that arrive one by one, as
an overload's do, are dearer than a closed loop's bursts (core wakes for each).

``--beside-compute RATES`` prices a refusal where it matters: in a server whose one core also
runs the model. The door and core-alone servers then run a compute thread beside them (a float32
matmul loop that releases the GIL, as ONNX Runtime's run does, one BLAS thread), and the C++
client sends ``encoder`` calls (1 row x 256 tokens, 4 KiB) at each rate for 5 s. The figure is
the compute the thread lost per refused call: (1 - its rate under the load / its rate idle) / the
refusals per second. It counts what /proc cannot: the compute thread preempted at each wake-up of
core's threads and refilling its caches after (bench.goodput's 4x point of that call refuses
~700 calls/s).

    .venv/bin/python -m batchgate.bench.takers --pin --beside-compute 700,3000 [--repeat 3]

On this VM one such run moves by ±30 %, so each server runs ``--repeat`` times, alternated, and
the median is printed beside every run.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import grpc
import numpy as np

from batchgate.bench.loadgen import process_cpu, start_batchgate, start_noop

_INFER = "/inference.GRPCInferenceService/ModelInfer"


def _ranker_request() -> bytes:
    from batchgate.proto.inference.v2 import grpc_service_pb2 as pb

    req = pb.ModelInferRequest(model_name="ranker")
    req.inputs.add(name="dense", datatype="FP32", shape=[1, 64])
    req.inputs.add(name="sparse_ids", datatype="INT64", shape=[1, 8])
    rng = np.random.default_rng(0)
    req.raw_input_contents.append(rng.standard_normal((1, 64), dtype=np.float32).tobytes())
    req.raw_input_contents.append(rng.integers(0, 1000, (1, 8), dtype=np.int64).tobytes())
    return req.SerializeToString()


async def drive(
    url: str, method: str, request: bytes, calls: int, callers: int, timeout: float = 30, metadata: tuple = ()
) -> collections.Counter:
    channels = [grpc.aio.insecure_channel(url) for _ in range(2)]
    methods = [ch.unary_unary(method) for ch in channels]
    out: collections.Counter = collections.Counter()

    async def caller(i: int) -> None:
        for _ in range(calls):
            try:
                await methods[i % 2](request, timeout=timeout, metadata=metadata or None)
                out["OK"] += 1
            except grpc.aio.AioRpcError as exc:
                out[exc.code().name] += 1

    await asyncio.gather(*(caller(i) for i in range(callers)))
    for ch in channels:
        await ch.close()
    return out


def measure(
    pid: int,
    url: str,
    method: str,
    request: bytes,
    calls: int,
    callers: int,
    timeout: float = 30,
    metadata: tuple = (),
) -> tuple[float, float, dict]:
    asyncio.run(drive(url, method, request, max(20, calls // 6), callers, timeout, metadata))  # warm-up
    c0, t0 = process_cpu(pid), time.perf_counter()
    seen = asyncio.run(drive(url, method, request, calls, callers, timeout, metadata))
    wall, cpu = time.perf_counter() - t0, process_cpu(pid) - c0
    n = sum(seen.values())
    return n / wall, 1e6 * cpu / n, dict(seen)


def _openloop(url: str, rate: float, request: bytes, pin: bool) -> dict:
    """The C++ open-loop client (bench/openloop) sending ``request`` at ``rate`` calls/s for 5 s,
    each with a 1 s deadline: its JSON report."""
    from batchgate.bench.goodput import openloop_binary  # (only with --open-loop, --beside-compute)

    with tempfile.NamedTemporaryFile(suffix=".bin") as f:
        f.write(request)
        f.flush()
        cmd = [*(["taskset", "-c", "1"] if pin else []), str(openloop_binary()), url, f"{rate:g}", "5", "1", "1",
               f"a:1:1000:{f.name}"]  # fmt: skip
        return json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)


def open_loop(pid: int, url: str, rate: float, pin: bool) -> tuple[float, float, dict]:
    """The C++ open-loop client at ``rate`` for 5 s (1 s deadlines): calls/s sent, server CPU µs
    per call, outcomes."""
    c0 = process_cpu(pid)
    out = _openloop(url, rate, b"x", pin)
    cpu = process_cpu(pid) - c0
    seen = out["classes"]["a"]["status"]
    n = sum(seen.values())
    return n / 5, 1e6 * cpu / n, seen


def _compute_beside(counter) -> None:
    """A thread beside the server that computes for ever, counting its iterations in ``counter``:
    a 200x200 float32 matmul (~0.2 ms), which releases the GIL as an ONNX Runtime run does."""
    a = np.random.default_rng(0).random((200, 200), dtype=np.float32)

    def spin() -> None:
        from batchgate.workers.pool import _name_os_thread

        _name_os_thread("compute")
        while True:
            a @ a
            counter.value += 1

    threading.Thread(target=spin, name="compute", daemon=True).start()


def _refusing_server(how: str, port_q, cpus: str, counter=None) -> None:
    """A bare grpc.aio server refusing every call UNAVAILABLE, from its handler or at the door;
    or (``core``) a gRPC core server that never asks for a call. With ``counter``, a compute
    thread runs beside it (``_compute_beside``)."""
    if cpus:
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    if counter is not None:
        _compute_beside(counter)
    from types import SimpleNamespace

    from grpc._cython import cygrpc

    from batchgate.gateway.admission.door import CallCap
    from batchgate.gateway.transport.takers import CallTakers

    if how == "core":  # no request for a call is ever made: core holds each until its deadline
        server = cygrpc.Server((), False)
        server.register_completion_queue(cygrpc.CompletionQueue())
        port_q.put(server.add_http2_port(b"127.0.0.1:0"))
        server.start()
        time.sleep(3600)
        return
    refuse_all = SimpleNamespace(
        shedding=True, take=lambda time_left: False, message=lambda: "overloaded", trailing=lambda: ()
    )

    async def main() -> None:
        async def handler(request, context):
            await context.abort(grpc.StatusCode.UNAVAILABLE, "overloaded")

        # "door" takes with the default 64 takers, "door:N" with N
        door = CallTakers(
            int(how.partition(":")[2] or 64) if how.startswith("door") else 0, CallCap(10_000), refuse_all
        )
        server = grpc.aio.server(
            interceptors=door.interceptors_for(()), maximum_concurrent_rpcs=door.grpc_cap
        )
        door.attach(server)
        server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    "t.S", {"M": grpc.unary_unary_rpc_method_handler(handler)}
                ),
            )
        )
        port_q.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        door.start()
        await asyncio.Event().wait()

    asyncio.run(main())


def compute_lost(how: str, rate: float, request: bytes, cpus: str, pin: bool) -> tuple[float, float, int]:
    """Run a refusing server ``how`` with a compute thread beside it; offer ``rate`` calls/s of
    ``request`` for 5 s. Returns (compute iterations/s idle, under the load, calls refused)."""
    os.environ["OPENBLAS_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"] = "1"  # read by the child
    ctx = mp.get_context("spawn")
    q, counter = ctx.Queue(), ctx.Value("q", 0, lock=False)
    proc = ctx.Process(target=_refusing_server, args=(how, q, cpus, counter), daemon=True)
    proc.start()
    try:
        url = f"127.0.0.1:{q.get(timeout=30)}"
        time.sleep(1.0)  # the compute thread and the server settle
        v0, t0 = counter.value, time.perf_counter()
        time.sleep(3.0)
        idle = (counter.value - v0) / (time.perf_counter() - t0)
        v0, t0 = counter.value, time.perf_counter()
        out = _openloop(url, rate, request, pin)
        loaded = (counter.value - v0) / (time.perf_counter() - t0)
        return idle, loaded, sum(out["classes"]["a"]["status"].values())
    finally:
        proc.kill()
        proc.join()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=300, help="calls per caller")
    ap.add_argument("--callers", type=int, default=64)
    ap.add_argument("--pin", action="store_true", help="servers on CPU 0, the client on CPU 1")
    ap.add_argument("--open-loop", type=float, default=0, metavar="RATE",
                    help="also refuse RATE calls/s from the C++ open-loop client (needs libgrpc++-dev)")  # fmt: skip
    ap.add_argument(
        "--beside-compute",
        default="",
        metavar="RATES",
        help="only: the compute lost per refusal beside a compute thread, at each rate (e.g. 700,3000)",
    )
    ap.add_argument("--repeat", type=int, default=3, help="--beside-compute: runs of each server, alternated")  # fmt: skip
    ap.add_argument("--api-key", default="",
                    help="sent to batchgate as 'authorization: Bearer KEY' (its tenant file: BATCHGATE_API_KEYS_FILE)")  # fmt: skip
    args = ap.parse_args()
    key = (("authorization", f"Bearer {args.api_key}"),) if args.api_key else ()
    server_cpus = "0" if args.pin else ""
    if args.pin:
        os.sched_setaffinity(0, {1})
    if args.beside_compute:
        from batchgate.bench.goodput import encoder_request

        big = encoder_request(np.random.default_rng(0), 1, 256, {}).SerializeToString()  # 4 KiB
        labels = {"door": "at the door (a taker)", "core": "gRPC core alone (never taken, 1 s deadline)"}
        print(f"{'refusing server, one core shared with a compute thread':<48} {'refused/s':>9} "
              f"{'µs of compute lost per refusal: median [runs]':>46}")  # fmt: skip
        for rate in (float(r) for r in args.beside_compute.split(",")):
            seen: dict[str, list[float]] = {how: [] for how in labels}
            refused = 0
            for _ in range(args.repeat):  # alternated: the machine's noise falls on both alike
                for how in labels:
                    idle, loaded, n = compute_lost(how, rate, big, server_cpus, args.pin)
                    seen[how].append(1e6 * (1.0 - loaded / idle) / (n / 5))
                    refused = n
            for how, label in labels.items():
                runs = ", ".join(f"{u:.0f}" for u in seen[how])
                print(f"{label:<48} {refused / 5:>9.0f} {statistics.median(seen[how]):>12.0f} [{runs}]")
        return 0
    request = _ranker_request()
    rows = []
    for name, env in (("no-op grpc.aio server", None), ("batchgate, grpc_takers=0", "0"),
                      ("batchgate, grpc_takers=16", "16"), ("batchgate, grpc_takers=64", "64")):  # fmt: skip
        if env is None:
            srv = start_noop()
        else:
            os.environ["BATCHGATE_GRPC_TAKERS"] = env
            srv = start_batchgate()
        try:
            if server_cpus:
                subprocess.run(
                    ["taskset", "-a", "-p", "-c", server_cpus, str(srv.proc.pid)], capture_output=True
                )
            srv.ready()
            rows.append(
                (
                    name,
                    *measure(srv.proc.pid, srv.url, _INFER, request, args.calls, args.callers, metadata=key),
                )
            )
        finally:
            srv.stop()
    os.environ.pop("BATCHGATE_GRPC_TAKERS", None)
    ctx = mp.get_context("spawn")
    labels = {
        "handler": "refusal from a handler (context.abort)",
        "door": "refusal at the door (a taker)",
        "core": "core alone (never taken, 50 ms deadline)",
    }
    for how in labels:
        q = ctx.Queue()
        proc = ctx.Process(target=_refusing_server, args=(how, q, server_cpus), daemon=True)
        proc.start()
        try:
            url = f"127.0.0.1:{q.get(timeout=30)}"
            timeout = 0.05 if how == "core" else 30
            rows.append(
                (labels[how], *measure(proc.pid, url, "/t.S/M", b"x", args.calls, args.callers, timeout))
            )
            if args.open_loop and how != "handler":
                rows.append(
                    (
                        f"  open loop, {args.open_loop:g}/s",
                        *open_loop(proc.pid, url, args.open_loop, args.pin),
                    )
                )
        finally:
            proc.kill()
            proc.join()
    print(f"{'server':<42} {'calls/s':>8} {'server CPU µs/call':>19}  outcomes")
    for name, rate, us, seen in rows:
        print(f"{name:<42} {rate:>8.0f} {us:>19.0f}  {seen}")
    # answered calls/s only: a refusal is no answer
    rows = [(n, rate * seen.get("OK", 0) / sum(seen.values()), us, seen) if n.startswith(("no-op", "batchgate"))
            else (n, rate, us, seen) for n, rate, us, seen in rows]  # fmt: skip
    by = {r[0]: r for r in rows}
    noop = by["no-op grpc.aio server"]
    for name in ("batchgate, grpc_takers=0", "batchgate, grpc_takers=16", "batchgate, grpc_takers=64"):
        print(f"{name}: {by[name][1] / noop[1]:.2f} of the no-op's answered calls/s in this run")
    h, d, c = (by[labels[k]] for k in ("handler", "door", "core"))
    print(f"a refusal at the door costs {d[2] / h[2]:.2f} of one from a handler; "
          f"gRPC core's own share of a call: {c[2]:.0f} µs ({c[2] / d[2]:.2f} of the door's)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
