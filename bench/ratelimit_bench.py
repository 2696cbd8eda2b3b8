"""Rate-limit benchmark, in one run: how exactly a global limit holds across two gateways, and what
a global-limit decision (a Redis round trip) adds over a local one.

1. decision: ``Admission.admit`` + release in process, N times each for a tenant with a local
   limit and one with a global limit (Redis on loopback), interleaved in blocks; p50/p99 and the
   CPU each costs; then 32 global decisions at a time, which share round trips.
2. call: one gateway, closed loop of C callers for D seconds per tenant (local, global, local,
   global, ...), single-row ``ranker`` calls; p50/p99 of the whole call as the client sees it.
3. accuracy: two gateways sharing one Redis; a tenant limited to L requests/s globally is offered
   3L/s (open loop, split evenly) for S seconds; accepted rate / L over the steady part.

Limits in 1 and 2 are set far above the offered load, so every decision admits and only the
decision's cost is measured. It starts its own redis-server and gateway processes.

    .venv/bin/python -m batchgate.bench.ratelimit_bench [--decisions 5000] [--concurrency 16] [--seconds 3]
                                              [--limit 50] [--accuracy-seconds 8] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np

from batchgate.gateway.admission import Admission
from batchgate.gateway.admission.ratelimit import Rate, RedisLimiter
from batchgate.gateway.admission.tenants import Limits, Tenant, hash_key
from batchgate.proto.inference.v2 import grpc_service_pb2 as pb
from batchgate.proto.inference.v2 import grpc_service_pb2_grpc as pb_grpc
from batchgate.bench.loadgen import free_ports, wait_ready

ROOT = Path(__file__).resolve().parent.parent
KEYS = {"local": "bench-local-key-0000", "global": "bench-global-key-000", "limited": "bench-limited-key-00"}
HIGH = 1e6  # a limit nobody reaches: the decision is made, and always admits


def _pct(samples_s: list[float]) -> dict[str, float]:
    a = np.asarray(samples_s) * 1e6
    return {"p50_us": float(np.percentile(a, 50)), "p99_us": float(np.percentile(a, 99)), "n": len(a)}


# -- 1. the decision alone --------------------------------------------------------------------------


async def bench_decisions(redis_url: str, n: int, block: int = 250) -> dict:
    tenants = [
        Tenant("local", (hash_key(KEYS["local"])[7:],), limits=Limits(requests=Rate(HIGH, HIGH), rows=Rate(HIGH, HIGH))),
        Tenant("global", (hash_key(KEYS["global"])[7:],),
               global_limits=Limits(requests=Rate(HIGH, HIGH), rows=Rate(HIGH, HIGH))),
    ]  # fmt: skip
    # A generous timeout here, so every global decision is Redis's and its whole tail is measured;
    # how many would have missed the 5 ms default (and been decided locally) is counted instead.
    limiter = RedisLimiter.from_url(redis_url, timeout_s=1.0)
    adm = Admission(tenants, limiter)
    await adm.start()
    accounts = {name: adm.identify((("x-api-key", KEYS[name]),)) for name in ("local", "global")}
    samples: dict[str, list[float]] = {"local": [], "global": []}
    cpu = {"local": 0.0, "global": 0.0}
    clock = time.perf_counter
    try:
        for _ in range(200):  # warm the connection, the script cache and the code paths
            (await adm.admit(accounts["global"], "ranker", 1)).release()
        for i in range(0, n, block):
            for name in ("local", "global"):
                acct, out = accounts[name], samples[name]
                c0 = time.process_time()
                for _ in range(min(block, n - i)):
                    t0 = clock()
                    ticket = await adm.admit(acct, "ranker", 1)
                    ticket.release()
                    out.append(clock() - t0)
                cpu[name] += time.process_time() - c0
        # Many callers at once, as under load: decisions share round trips (pipelines).
        callers, trips0, c0, t0 = 32, limiter.round_trips, time.process_time(), clock()

        async def caller() -> None:
            for _ in range(n // callers):
                (await adm.admit(accounts["global"], "ranker", 1)).release()

        await asyncio.gather(*(caller() for _ in range(callers)))
        done = callers * (n // callers)
        concurrent = {
            "callers": callers,
            "decisions_per_s": done / (clock() - t0),
            "cpu_us_per_decision": (time.process_time() - c0) / done * 1e6,
            "decisions_per_round_trip": done / max(limiter.round_trips - trips0, 1),
        }
        stats = limiter.stats()
    finally:
        await adm.close()
    result = {name: _pct(s) for name, s in samples.items()}
    for name, cpu_s in cpu.items():
        result[name]["cpu_us"] = cpu_s / len(samples[name]) * 1e6
    result["concurrent_global"] = concurrent
    result["fallback_decisions"] = stats["fallback_decisions"]
    result["global_over_5ms"] = sum(1 for s in samples["global"] if s > 0.005)
    return result


# -- processes ----------------------------------------------------------------------------------------


class Procs:
    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.tmp = Path(tempfile.mkdtemp(prefix="bg-rl-bench-"))

    def redis(self) -> str:
        if shutil.which("redis-server") is None:
            raise SystemExit("redis-server is not installed")
        (port,) = free_ports(1)
        self.procs.append(
            subprocess.Popen(
                ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--dir", str(self.tmp)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
        )  # fmt: skip
        import redis

        client = redis.Redis(port=port, socket_timeout=0.5)
        for _ in range(100):
            try:
                client.ping()
                return f"redis://127.0.0.1:{port}/0"
            except redis.RedisError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def gateway(self, env: dict) -> str:
        grpc_port, http_port = free_ports(2)
        log = (self.tmp / f"gateway-{grpc_port}.log").open("w")
        self.procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "batchgate", "serve", "--host", "127.0.0.1", "--grpc-port", str(grpc_port),
                 "--http-port", str(http_port), "--log-level", "WARNING"],
                cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1", **env}, stdout=log, stderr=subprocess.STDOUT,
            )
        )  # fmt: skip
        return f"127.0.0.1:{grpc_port}"

    def close(self) -> None:
        for p in self.procs:
            p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _request(i: int) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name="ranker")
    req.inputs.add(name="dense", datatype="FP32", shape=[1, 64])
    req.inputs.add(name="sparse_ids", datatype="INT64", shape=[1, 8])
    req.raw_input_contents.append(np.full((1, 64), 0.25, np.float32).tobytes())
    req.raw_input_contents.append(np.full((1, 8), i % 10_000, np.int64).tobytes())
    return req


# -- 2. whole calls -------------------------------------------------------------------------------------


async def bench_calls(url: str, concurrency: int, seconds: float, rounds: int = 6) -> dict:
    requests = [_request(i) for i in range(64)]
    channels = [grpc.aio.insecure_channel(url) for _ in range(4)]
    stubs = [pb_grpc.GRPCInferenceServiceStub(ch) for ch in channels]
    samples: dict[str, list[float]] = {"local": [], "global": []}
    errors = 0

    async def phase(name: str, secs: float, record: bool) -> None:
        md = (("x-api-key", KEYS[name]),)
        stop_at = time.perf_counter() + secs

        async def caller(i: int) -> None:
            nonlocal errors
            stub, k = stubs[i % len(stubs)], i
            while (t0 := time.perf_counter()) < stop_at:
                try:
                    await stub.ModelInfer(requests[k % len(requests)], metadata=md, timeout=10)
                    if record:
                        samples[name].append(time.perf_counter() - t0)
                except grpc.RpcError:
                    errors += 1
                k += 1

        await asyncio.gather(*(caller(i) for i in range(concurrency)))

    await phase("global", 1.0, record=False)  # warm-up
    for _ in range(rounds):
        for name in ("local", "global"):
            await phase(name, seconds / rounds, record=True)
    for ch in channels:
        await ch.close()
    out = {name: _pct(s) for name, s in samples.items()}
    for name, s in samples.items():
        out[name]["calls_per_s"] = len(s) / seconds
    out["errors"] = errors
    return out


# -- 3. accuracy across two gateways ----------------------------------------------------------------


async def bench_accuracy(urls: list[str], limit: float, seconds: float, settle_s: float = 1.0) -> dict:
    loop = asyncio.get_running_loop()
    channels = [grpc.aio.insecure_channel(u) for u in urls]
    stubs = [pb_grpc.GRPCInferenceServiceStub(ch) for ch in channels]
    for stub in stubs:
        await stub.ServerReady(pb.ServerReadyRequest(), timeout=5)
    md = (("x-api-key", KEYS["limited"]),)
    log: list[tuple[float, bool]] = []
    tasks: list[asyncio.Task] = []
    start = loop.time() + 0.2
    stop = start + seconds
    per_gateway = 3 * limit / len(stubs)

    async def one(stub, i: int) -> None:
        t = loop.time()
        try:
            await stub.ModelInfer(_request(i), metadata=md, timeout=10)
            log.append((t, True))
        except grpc.RpcError as exc:
            log.append((t, False if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else None))

    async def offer(stub, offset: float) -> None:
        i = 0
        while (t := start + (i + offset) / per_gateway) < stop:
            await asyncio.sleep(max(0.0, t - loop.time()))
            tasks.append(asyncio.ensure_future(one(stub, i)))
            i += 1

    await asyncio.gather(*(offer(s, k / len(stubs)) for k, s in enumerate(stubs)))
    await asyncio.gather(*tasks)
    for ch in channels:
        await ch.close()
    t0 = start + settle_s  # the initial burst is spent by then; measure the steady state
    accepted = sum(1 for t, ok in log if ok and t >= t0)
    rate = accepted / (stop - t0)
    per_s = [sum(1 for t, ok in log if ok and start + k <= t < start + k + 1) for k in range(int(seconds))]
    return {
        "limit_per_s": limit,
        "offered_per_s": 3 * limit,
        "accepted_per_s": rate,
        "accuracy": rate / limit,
        "accepted_each_second": per_s,
        "other_errors": sum(1 for _, ok in log if ok is None),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decisions", type=int, default=5000, help="in-process decisions per tenant")
    ap.add_argument("--concurrency", type=int, default=16, help="closed-loop callers for whole calls")
    ap.add_argument("--seconds", type=float, default=3.0, help="measured seconds per tenant for whole calls")
    ap.add_argument("--limit", type=float, default=50.0, help="global requests/s for the accuracy run")
    ap.add_argument("--accuracy-seconds", type=float, default=8.0)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = ap.parse_args(argv)

    procs = Procs()
    try:
        redis_url = procs.redis()
        tenants = {
            "tenants": [
                {"name": "local", "key_hashes": [hash_key(KEYS["local"])],
                 "limits": {"requests_per_s": HIGH, "rows_per_s": HIGH}},
                {"name": "global", "key_hashes": [hash_key(KEYS["global"])],
                 "global_limits": {"requests_per_s": HIGH, "rows_per_s": HIGH}},
                {"name": "limited", "key_hashes": [hash_key(KEYS["limited"])],
                 "global_limits": {"requests_per_s": args.limit, "requests_burst": max(1.0, args.limit / 5)}},
            ]
        }  # fmt: skip
        tenant_file = procs.tmp / "tenants.json"
        tenant_file.write_text(json.dumps(tenants))
        env = {
            "BATCHGATE_REDIS_URL": redis_url,
            "BATCHGATE_API_KEYS_FILE": str(tenant_file),
            "BATCHGATE_RATELIMIT_EXPECTED_REPLICAS": "2",
        }
        # The in-process part runs alone first: gateways starting beside it would steal its CPU.
        print("  decisions in process ...", file=sys.stderr)
        decisions = asyncio.run(bench_decisions(redis_url, args.decisions))
        urls = [procs.gateway(env), procs.gateway(env)]
        for u in urls:
            asyncio.run(wait_ready(u))
        print(
            f"  whole calls: {args.concurrency} callers, {args.seconds:.0f}s per tenant ...", file=sys.stderr
        )
        calls = asyncio.run(bench_calls(urls[0], args.concurrency, args.seconds))
        print(
            f"  accuracy: 2 gateways, {3 * args.limit:.0f}/s offered against {args.limit:.0f}/s ...",
            file=sys.stderr,
        )
        accuracy = asyncio.run(bench_accuracy(urls, args.limit, args.accuracy_seconds))
    finally:
        procs.close()

    def ratio(part: dict, key: str) -> float:
        return part["global"][key] / part["local"][key]

    ratios = {
        "decision_p50": ratio(decisions, "p50_us"),
        "decision_p99": ratio(decisions, "p99_us"),
        "call_p50": ratio(calls, "p50_us"),
        "call_p99": ratio(calls, "p99_us"),
    }
    added = {
        "decision_p50_us": decisions["global"]["p50_us"] - decisions["local"]["p50_us"],
        "decision_p99_us": decisions["global"]["p99_us"] - decisions["local"]["p99_us"],
        "call_p50_us": calls["global"]["p50_us"] - calls["local"]["p50_us"],
        "call_p99_us": calls["global"]["p99_us"] - calls["local"]["p99_us"],
    }
    if args.json:
        print(json.dumps({"args": vars(args), "decisions": decisions, "calls": calls, "accuracy": accuracy,
                          "ratio_global_over_local": ratios, "added_us": added}, indent=2))  # fmt: skip
        return 0
    print(f"{'':<22} {'local p50':>10} {'p99':>9} {'global p50':>11} {'p99':>9}   global/local p50, p99")
    for label, part, key in (("decision (in process)", decisions, "decision"), ("whole call", calls, "call")):
        lo, gl = part["local"], part["global"]
        print(
            f"{label:<22} {lo['p50_us']:>8.1f}us {lo['p99_us']:>7.1f}us {gl['p50_us']:>9.1f}us {gl['p99_us']:>7.1f}us"
            f"   {ratios[key + '_p50']:.2f}x, {ratios[key + '_p99']:.2f}x"
            f"  (+{added[key + '_p50_us']:.0f}us, +{added[key + '_p99_us']:.0f}us)"
        )
    cg = decisions["concurrent_global"]
    print(
        f"gateway CPU per decision: local {decisions['local']['cpu_us']:.1f}us, global {decisions['global']['cpu_us']:.0f}us "
        f"alone; global with {cg['callers']} callers at once {cg['cpu_us_per_decision']:.0f}us "
        f"({cg['decisions_per_round_trip']:.1f} decisions per round trip, {cg['decisions_per_s']:.0f} decisions/s)"
    )
    print(
        f"calls/s: local {calls['local']['calls_per_s']:.0f}, global {calls['global']['calls_per_s']:.0f}; "
        f"errors {calls['errors']}; in-process global decisions over 5 ms: {decisions['global_over_5ms']} of "
        f"{decisions['global']['n']} (fell back: {decisions['fallback_decisions']})"
    )
    print(
        f"accuracy: {accuracy['accepted_per_s']:.2f}/s accepted of a {accuracy['limit_per_s']:.0f}/s global limit "
        f"offered {accuracy['offered_per_s']:.0f}/s over 2 gateways = {accuracy['accuracy']:.3f} "
        f"(each second: {accuracy['accepted_each_second']}; other errors {accuracy['other_errors']})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
