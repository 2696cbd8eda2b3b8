"""Goodput under overload: deadline-aware scheduling against a Triton-like FIFO/timer policy.

Open loop: Poisson arrivals at a fixed offered rate on the compute-bound `encoder`, a mix of
latency classes (each request carries `latency_class` and, for `standard`, `latency_budget_ms`;
no gRPC deadline, so the FIFO policy cannot use it). First the capacity is measured closed-loop,
then each policy is offered 0.5x, 1x, 2x and 4x that rate. Goodput = answers that arrived within
their budget, per second, judged by the client. Beside it, the share of realtime answers the
server itself sent after the deadline (its `late` counter): the rest of a client-side miss is time
the server cannot see (the client's own loop, the OS sharing 2 cores among 4 busy threads).
Everything is measured in this one run; compare ratios, not absolutes.

The default request (4 rows x 128 tokens, ~6 ms of compute) keeps the model, not Python's gRPC
stack, the bottleneck at 4x on a 2-core machine: with ~2 ms requests, 4x is ~1,700 calls/s, which
the client and the server's event loop alone cannot carry beside the compute.

    .venv/bin/python -m batchgate.bench.goodput [--seconds 6] [--loads 0.5,1,2,4] [--seq 128] [--rows 4]

Overload past the front end's ceiling (issue 14): the server pinned to one core with taskset and
the load generators to the other, one row per call, a tight and a loose class:

    .venv/bin/python -m batchgate.bench.goodput --pin --mix tight-loose --rows 1 --seq 64 \
        --policies deadline --loads 1,4 --seconds 5

A Python load generator on one core is itself near its ceiling at 4x a cheap call's capacity
(~3,000 calls/s), so the overload points use the C++ client (`--client cxx`, bench/openloop, built
on first use; needs libgrpc++-dev) and real gRPC deadlines (`--grpc-deadline`); `--mix
tight-loose-20` keeps the tight class feasible at 4x, and `--mix texts` mixes many-text calls
(16 texts, minilm) with single texts:

    .venv/bin/python -m batchgate.bench.goodput --pin --client cxx --grpc-deadline --mix tight-loose-20 \
        --rows 1 --seq 64 --policies deadline --loads 1,4 --seconds 8
    .venv/bin/python -m batchgate.bench.goodput --pin --client cxx --grpc-deadline --mix texts \
        --policies deadline --loads 1,4 --seconds 20

One such pair moves by ±0.15 between runs on this VM: ``--repeat 3`` runs the loads three times on
the same server and prints each load's median ratio, each round against its own 1x. Before every
point after the first the bench waits until the overload gate takes every call again (its
``batchgate_overload_admitted_ratio``), so a 1x point never starts with a 4x point's shedding.
The capacity is the median of three closed-loop probes; ``vs cap`` is a point's goodput over it
(1x itself runs under it: Poisson arrivals at the mean rate queue and miss now and then).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from batchgate.proto.inference.v2 import grpc_service_pb2 as pb
from batchgate.proto.inference.v2 import grpc_service_pb2_grpc as pb_grpc
from batchgate.bench.loadgen import free_ports, metric_samples, thread_cpu

ROOT = Path(__file__).resolve().parent.parent
# class -> (share of requests, budget seconds the client judges by, parameters sent)
MIX = {
    "realtime": (0.5, 0.025, {"latency_class": "realtime"}),
    "standard": (0.3, 0.250, {"latency_class": "standard", "latency_budget_ms": 250}),
    "bulk": (0.2, 5.0, {"latency_class": "bulk", "latency_budget_ms": 5000}),
}


# --mix tight-loose: a class whose budget is feasible at 1x (tens of ms) beside a lenient one
MIXES = {
    "default": dict(MIX),  # a copy: MIX itself is cleared and refilled from here
    "tight-loose": {
        "realtime": (0.5, 0.060, {"latency_class": "realtime", "latency_budget_ms": 60}),
        "standard": (0.5, 0.500, {"latency_class": "standard", "latency_budget_ms": 500}),
    },
    # At 4x a 50 % tight share alone offers 2x the capacity, so at most half of it can succeed
    # however it is scheduled; with a 20 % share the tight class alone stays feasible (0.8x).
    "tight-loose-20": {
        "realtime": (0.2, 0.060, {"latency_class": "realtime", "latency_budget_ms": 60}),
        "standard": (0.8, 0.500, {"latency_class": "standard", "latency_budget_ms": 500}),
    },
}


# --mix one-class: every call alike (250 ms), as most services send; with --loads 4 alone the
# overload starts on a server that was not shedding (a sudden spike)
MIXES["one-class"] = {"standard": (1.0, 0.250, {"latency_class": "standard", "latency_budget_ms": 250})}

# --mix texts: many texts a call beside single texts (issue 21's overload clause), served by
# minilm; texts drawn from bench/texts/mixed.txt (most 3-40 tokens, a few at the model's 256).
MIXES["texts"] = {
    # one text, tight: it may wait behind a batch of long texts already running (~0.1-0.2 s here)
    "realtime": (0.5, 0.250, {"latency_class": "realtime", "latency_budget_ms": 250}),
    "standard": (0.5, 2.000, {"latency_class": "standard", "latency_budget_ms": 2000}),
}
TEXT_MIXES = {"texts": {"realtime": 1, "standard": 16}}  # texts per call, by class
TEXTS_PER_CALL: dict[str, int] = {}  # of the mix in use; empty: encoder calls
_TEXTS = ROOT / "bench" / "texts" / "mixed.txt"


def use_mix(mix: str) -> None:
    MIX.clear()
    MIX.update(MIXES[mix])
    TEXTS_PER_CALL.clear()
    TEXTS_PER_CALL.update(TEXT_MIXES.get(mix, {}))


def model_name() -> str:
    return "minilm" if TEXTS_PER_CALL else "encoder"


@functools.cache
def _text_lines() -> list[str]:
    return [t for t in _TEXTS.read_text().splitlines() if t.strip()]


def _class_request(
    rng: np.random.Generator, cls: str, rows: int, seq: int, params: dict
) -> pb.ModelInferRequest:
    n = TEXTS_PER_CALL.get(cls)
    if not n:
        return encoder_request(rng, rows, seq, params)
    lines = _text_lines()
    picked = [lines[i] for i in rng.choice(len(lines), size=n, replace=n > len(lines))]
    req = pb.ModelInferRequest(model_name="minilm")
    req.inputs.add(name="text", datatype="BYTES", shape=[n, 1])
    req.raw_input_contents.append(
        b"".join(len(b).to_bytes(4, "little") + b for b in (t.encode() for t in picked))
    )
    _set_params(req, params)
    return req


def _set_params(req: pb.ModelInferRequest, params: dict) -> None:
    for k, v in params.items():
        if isinstance(v, str):
            req.parameters[k].string_param = v
        else:
            req.parameters[k].int64_param = v


def encoder_request(rng: np.random.Generator, rows: int, seq: int, params: dict) -> pb.ModelInferRequest:
    """One `encoder` call: ``rows`` x ``seq`` random token ids, a full mask, ``params`` set."""
    req = pb.ModelInferRequest(model_name="encoder")
    req.inputs.add(name="input_ids", datatype="INT64", shape=[rows, seq])
    req.inputs.add(name="attention_mask", datatype="INT64", shape=[rows, seq])
    req.raw_input_contents.append(rng.integers(0, 1000, (rows, seq), dtype=np.int64).tobytes())
    req.raw_input_contents.append(np.ones((rows, seq), np.int64).tobytes())
    _set_params(req, params)
    return req


@dataclass
class Point:
    offered: float
    seconds: float
    by_class: dict[str, list[float]] = field(default_factory=dict)  # latencies of OK answers
    status: Counter = field(default_factory=Counter)
    good: Counter = field(default_factory=Counter)
    sent: Counter = field(default_factory=Counter)
    quantiles: dict[str, tuple[float, float, int]] = field(default_factory=dict)  # from the C++ client
    class_status: dict[str, dict] = field(default_factory=dict)  # per class, from the C++ client

    def summary(self) -> dict:
        out = {"offered_rps": self.offered, "goodput_rps": sum(self.good.values()) / self.seconds,
               "status": dict(self.status)}  # fmt: skip
        for cls, lat in self.by_class.items():
            a = np.array(lat) * 1e3 if lat else np.array([np.nan])
            p50, p99, ok = self.quantiles.get(cls) or (
                float(np.percentile(a, 50)),
                float(np.percentile(a, 99)),
                len(lat),
            )
            out[cls] = {"p50_ms": p50, "p99_ms": p99, "ok": ok, "good": self.good[cls], "sent": self.sent[cls],
                        "good_fraction": self.good[cls] / self.sent[cls] if self.sent[cls] else 0.0,
                        "status": self.class_status.get(cls)}  # fmt: skip
        return out


async def _capacity(url: str, seq: int, rows: int, seconds: float, concurrency: int = 32) -> float:
    """Calls/s of the mix's own calls (drawn by share), closed loop, in the lenient bulk class."""
    rng = np.random.default_rng(0)
    classes = list(MIX)
    picks = rng.choice(len(classes), size=32, p=[MIX[c][0] for c in classes])
    reqs = [_class_request(rng, classes[k], rows, seq, {"latency_class": "bulk"}) for k in picks]
    done = 0
    async with grpc.aio.insecure_channel(url) as ch:
        stub = pb_grpc.GRPCInferenceServiceStub(ch)
        stop = time.perf_counter() + seconds

        async def worker(i: int) -> None:
            nonlocal done
            k = i
            while time.perf_counter() < stop:
                await stub.ModelInfer(reqs[k % len(reqs)])
                done += 1
                k += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(i) for i in range(concurrency)))
        return done / (time.perf_counter() - t0)


_INFER = "/inference.GRPCInferenceService/ModelInfer"


async def _open_loop(
    url: str, rate: float, seconds: float, seq: int, rows: int, seed: int, deadline: bool = False
) -> Point:
    rng = np.random.default_rng(seed)
    classes = list(MIX)
    probs = [MIX[c][0] for c in classes]
    # Requests serialized once and answers left as bytes (the call's status and time are all that
    # is judged): the client's per-call cost is gRPC's own, so one core offers ~3,000 calls/s.
    pools = {
        c: [_class_request(rng, c, rows, seq, MIX[c][2]).SerializeToString() for _ in range(16)]
        for c in classes
    }
    timeouts = {c: (MIX[c][1] if deadline else None) for c in classes}
    point = Point(rate, seconds, {c: [] for c in classes})
    tasks: set[asyncio.Task] = set()
    channels = [grpc.aio.insecure_channel(url) for _ in range(4)]
    methods = [ch.unary_unary(_INFER) for ch in channels]

    async def one(i: int, cls: str) -> None:
        point.sent[cls] += 1
        t0 = time.perf_counter()
        try:
            await methods[i % len(methods)](pools[cls][i % 16], timeout=timeouts[cls])
        except grpc.aio.AioRpcError as err:
            name = err.code().name
            if name == "DEADLINE_EXCEEDED":  # which refusal: at admission, or from the queue
                name += ":shed" if "shed" in (err.details() or "") else ":expired"
            point.status[name] += 1
            return
        lat = time.perf_counter() - t0
        point.status["OK"] += 1
        point.by_class[cls].append(lat)
        if lat <= MIX[cls][1]:
            point.good[cls] += 1

    # Arrival times and classes drawn up front (numpy per call would cost more than the send).
    n = int(rate * seconds * 1.2) + 16
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n))
    picks = rng.choice(len(classes), size=n, p=probs)
    start = time.perf_counter()
    i = 0
    while True:
        t = start + arrivals[i]
        if t - start >= seconds:
            break
        delay = t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        cls = classes[picks[i]]
        task = asyncio.create_task(one(i, cls))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        i += 1
    # Answers still owed after the window: give them the longest budget, then hang up (counted).
    if tasks:
        done, pending = await asyncio.wait(set(tasks), timeout=max(b for _, b, _ in MIX.values()))
        for task in pending:
            task.cancel()
        point.status["NO_ANSWER"] += len(pending)
    for ch in channels:
        await ch.close()
    return point


def _open_loop_proc(url: str, rate: float, seconds: float, seq: int, rows: int, seed: int, mix: str = "default",
                    cpus: str = "", deadline: bool = False) -> Point:  # fmt: skip
    if cpus:
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    use_mix(mix)
    return asyncio.run(_open_loop(url, rate, seconds, seq, rows, seed, deadline))


def _offer(url: str, rate: float, seconds: float, seq: int, rows: int, seed: int, procs: int, mix: str = "default",
           cpus: str = "", deadline: bool = False) -> Point:  # fmt: skip
    """The open loop split over ``procs`` client processes (each a Poisson stream of rate/procs, so
    the sum is Poisson at ``rate``): one Python client at several hundred calls/s delays its own
    sends and reads by milliseconds, which would be charged to the server."""
    if procs <= 1 and not cpus:
        return asyncio.run(_open_loop(url, rate, seconds, seq, rows, seed, deadline))
    with ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("spawn")) as ex:
        parts = list(ex.map(_open_loop_proc, *zip(*[(url, rate / procs, seconds, seq, rows, seed * 31 + i, mix, cpus, deadline)
                                                    for i in range(procs)])))  # fmt: skip
    point = Point(rate, seconds, {c: [] for c in MIX})
    for part in parts:
        for cls, lat in part.by_class.items():
            point.by_class[cls].extend(lat)
        point.status.update(part.status)
        point.good.update(part.good)
        point.sent.update(part.sent)
    return point


OPENLOOP_SRC = ROOT / "bench" / "openloop" / "openloop.cc"
OPENLOOP_BIN = ROOT / "build" / "openloop"


def openloop_binary() -> Path:
    """bench/openloop/openloop.cc built once (again when the source is newer) into build/."""
    if OPENLOOP_BIN.exists() and OPENLOOP_BIN.stat().st_mtime >= OPENLOOP_SRC.stat().st_mtime:
        return OPENLOOP_BIN
    flags = subprocess.run(["pkg-config", "--cflags", "--libs", "grpc++"], capture_output=True, text=True)
    if flags.returncode != 0:
        raise SystemExit(
            "--client cxx needs gRPC's C++ library and g++: apt-get install libgrpc++-dev pkg-config g++ "
            f"({flags.stderr.strip()})"
        )
    OPENLOOP_BIN.parent.mkdir(exist_ok=True)
    print(f"building {OPENLOOP_BIN} ...", file=sys.stderr)
    subprocess.run(["g++", "-O2", "-std=c++17", str(OPENLOOP_SRC), "-o", str(OPENLOOP_BIN), *flags.stdout.split()],
                   check=True)  # fmt: skip
    return OPENLOOP_BIN


def _offer_cxx(url: str, rate: float, seconds: float, seq: int, rows: int, seed: int, cpus: str,
               deadline: bool) -> Point:  # fmt: skip
    """The open loop from the C++ client (one process, ~0.1 ms of CPU per call)."""
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory() as tmp:
        specs = []
        for cls, (share, budget, params) in MIX.items():
            f = Path(tmp) / f"{cls}.bin"
            f.write_bytes(_class_request(rng, cls, rows, seq, params).SerializeToString())
            specs.append(f"{cls}:{share}:{budget * 1000:g}:{f}")
        pin = ["taskset", "-c", cpus] if cpus else []
        cmd = [*pin, str(openloop_binary()), url, f"{rate:.1f}", f"{seconds:g}", str(seed), "1" if deadline else "0",
               *specs]  # fmt: skip
        out = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    point = Point(rate, seconds, {c: [] for c in MIX})
    for cls, r in out["classes"].items():
        point.sent[cls] = r["sent"]
        point.good[cls] = r["good"]
        point.status.update(r["status"])
        point.quantiles[cls] = (r["p50_ms"], r["p99_ms"], r["ok"])
        point.class_status[cls] = r["status"]
    point.status["NO_ANSWER"] += out["no_answer"]
    return point


def _server_outcomes(http_port: int) -> Counter:
    """The server's own count of answers per (class, outcome) for the encoder, from /metrics:
    ``late`` = answered after the deadline on the server's clock."""
    out: Counter = Counter()
    for sample in metric_samples(http_port):
        if sample.name == "batchgate_class_requests_total" and sample.labels.get("model") == model_name():
            out[(sample.labels["class"], sample.labels["outcome"])] += sample.value
    return out


def _settle(http_port: int, timeout_s: float = 15.0) -> float:
    """Wait until the overload gate takes every call again (its gauge at 1), then 1 s for the
    queue to empty: a point after a 4x one must not start with the last one's shedding (the gate
    grows back by half a percent every 10 ms). Returns the seconds waited."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        admitted = next(
            (s.value for s in metric_samples(http_port) if s.name == "batchgate_overload_admitted_ratio"),
            1.0,
        )
        if admitted >= 1.0:
            break
        time.sleep(0.2)
    time.sleep(1.0)
    return time.perf_counter() - t0


def _thread_cpu(pid: int) -> Counter:
    """CPU seconds of the server's threads so far (bench.loadgen's /proc reader), summed by thread
    name: where a point's core went. The main thread runs the event loop, the model's workers are
    ``bg:<worker>``, gRPC core's threads carry core's names."""
    out: Counter = Counter()
    for tid, seconds in thread_cpu(pid).items():
        if tid == pid:
            name = "main (event loop)"
        else:
            try:
                name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            except OSError:  # the thread ended between the two reads
                continue
        out[name] += seconds
    return out


def _serve(policy: str, port: int, http_port: int, extra: list[str], cpus: str = "") -> subprocess.Popen:
    env = {"BATCHGATE_VARIANT_SELECTION": "off", **os.environ, "BATCHGATE_SCHEDULING_POLICY": policy,
           "PYTHONUNBUFFERED": "1"}  # fmt: skip
    pin = ["taskset", "-c", cpus] if cpus else []
    return subprocess.Popen(
        [*pin, sys.executable, "-m", "batchgate", "serve", "--host", "127.0.0.1", "--grpc-port", str(port),
         "--http-port", str(http_port), "--log-level", "WARNING", "--no-build-models", *extra],
        cwd=ROOT, env=env,
    )  # fmt: skip


async def _ready(url: str) -> None:
    async with grpc.aio.insecure_channel(url) as ch:
        stub = pb_grpc.GRPCInferenceServiceStub(ch)
        for _ in range(600):
            try:
                if (await stub.ModelReady(pb.ModelReadyRequest(name=model_name()), timeout=1)).ready:
                    return
            except grpc.RpcError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError("server not ready")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=6.0, help="length of each open-loop point")
    ap.add_argument(
        "--capacity", type=float, default=None,
        help="use this many requests/s as 1x instead of probing (alternated runs of two builds then "
        "offer the same load; the probe's own spread moves it by up to a third)",
    )  # fmt: skip
    ap.add_argument("--loads", default="0.5,1,2,4", help="offered load as multiples of the measured capacity")
    ap.add_argument("--seq", type=int, default=128, help="tokens per row")
    ap.add_argument("--rows", type=int, default=4, help="rows per request")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--client-procs", type=int, default=2, help="client processes sharing the offered load")
    ap.add_argument(
        "--server-args", default="--workers-per-device 1",
        help="extra `batchgate serve` flags; by default one worker, so on a 2-core machine the event loop "
        "and the load generator keep a core and the model's compute is what saturates",
    )  # fmt: skip
    ap.add_argument("--mix", choices=sorted(MIXES), default="default", help="latency classes of the load")
    ap.add_argument("--policies", default="deadline,fifo", help="scheduling policies to compare")
    ap.add_argument(
        "--repeat", type=int, default=1,
        help="rounds of the loads, one after another on the same server; with more than one, the median "
        "of each load's goodput ratio (each round against its own 1x) is printed at the end",
    )  # fmt: skip
    ap.add_argument(
        "--pin", action="store_true",
        help="server on CPU 0 (taskset), the load generators on CPU 1: the front end's own ceiling",
    )  # fmt: skip
    ap.add_argument(
        "--grpc-deadline", action="store_true",
        help="each call also carries a gRPC deadline of its class's budget (the client stops waiting "
        "then, and the server sees how long the call waited before Python took it)",
    )  # fmt: skip
    ap.add_argument(
        "--client", choices=("python", "cxx"), default="python",
        help="the open-loop load generator: Python (grpc.aio, --client-procs processes) or the C++ one "
        "(bench/openloop, built on first use; needs libgrpc++-dev): a Python client on one core cannot "
        "offer 4x a cheap call's capacity without being the bottleneck itself",
    )  # fmt: skip
    args = ap.parse_args()
    use_mix(args.mix)
    server_cpus, client_cpus = ("0", "1") if args.pin else ("", "")
    if args.pin:
        os.sched_setaffinity(0, {1})  # the capacity probe runs here: keep it off the server's core
    loads = [float(x) for x in args.loads.split(",")]
    results: dict[str, list[dict]] = {}
    capacity = args.capacity
    for policy in args.policies.split(","):
        port, http_port = free_ports(2)
        proc = _serve(policy, port, http_port, args.server_args.split(), server_cpus)
        url = f"127.0.0.1:{port}"
        try:
            asyncio.run(_ready(url))
            asyncio.run(_capacity(url, args.seq, args.rows, 1.0))  # warm-up
            if capacity is None:  # measured once, on the first server, and used for both
                # the median of three probes: one 3 s probe moved by up to a third between runs
                probes = sorted(asyncio.run(_capacity(url, args.seq, args.rows, 2.0)) for _ in range(3))
                capacity = statistics.median(probes)
                print(
                    f"capacity: {capacity:.0f} requests/s ({args.rows} rows x {args.seq} tokens; probes "
                    + ", ".join(f"{p:.0f}" for p in probes)
                    + ")",
                    file=sys.stderr,
                )
            results[policy] = []
            for i, (rnd, load) in enumerate((r, x) for r in range(args.repeat) for x in loads):
                rate = capacity * load
                if i:
                    _settle(http_port)
                print(
                    f"  {policy}: offering {load}x = {rate:.0f} req/s for {args.seconds:.0f}s ...",
                    file=sys.stderr,
                )
                before = _server_outcomes(http_port)
                cpu_before, t0 = _thread_cpu(proc.pid), time.perf_counter()
                if args.client == "cxx":
                    point = _offer_cxx(url, rate, args.seconds, args.seq, args.rows, int(load * 100), client_cpus,
                                       args.grpc_deadline)  # fmt: skip
                else:
                    point = _offer(url, rate, args.seconds, args.seq, args.rows, int(load * 100), args.client_procs,
                                   args.mix, client_cpus, args.grpc_deadline)  # fmt: skip
                cpu = _thread_cpu(proc.pid)
                cpu.subtract(cpu_before)
                wall = time.perf_counter() - t0
                seen = _server_outcomes(http_port) - before
                answered = {c: seen[(c, "success")] + seen[(c, "late")] for c in MIX}
                late = {c: seen[(c, "late")] / answered[c] if answered[c] else 0.0 for c in MIX}
                server = {c: {o: int(n) for (cc, o), n in sorted(seen.items()) if cc == c and n} for c in MIX}
                results[policy].append({"load": load, "round": rnd, **point.summary(), "server_late_fraction": late,
                                        "server_outcomes": server,
                                        "server_cpu_share": {k: v / wall for k, v in cpu.most_common() if v > 0}})  # fmt: skip
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    # each round's points against that round's 1x
    base = {(p, r["round"]): r["goodput_rps"] for p, rs in results.items() for r in rs if r["load"] == 1.0}
    budgets = ", ".join(f"{c} {b * 1e3:g} ms" for c, (_, b, _) in MIX.items())
    shares = "/".join(f"{sh * 100:g}" for sh, _, _ in MIX.values())
    print(f"\ncapacity {capacity:.0f} req/s; budgets: {budgets}; mix {shares}")
    cols = "".join(f" {c[:8] + ' ok':>12} {c[:8] + ' p99':>12}" for c in MIX)
    print(
        f"{'policy':<9} {'load':>5} {'offered':>8} {'goodput':>8} {'vs 1x':>6} {'vs cap':>6}{cols}  statuses"
    )
    ratios: dict[tuple[str, float], list[float]] = {}
    for policy, rows in results.items():
        for r in rows:
            one = base.get((policy, r["round"]))
            ratio = r["goodput_rps"] / one if one else float("nan")
            ratios.setdefault((policy, r["load"]), []).append(ratio)
            per = "".join(f" {r[c]['good_fraction']:>12.1%} {r[c]['p99_ms']:>12.1f}" for c in MIX)
            print(f"{policy:<9} {r['load']:>4}x {r['offered_rps']:>8.0f} {r['goodput_rps']:>8.0f} {ratio:>6.2f} "
                  f"{r['goodput_rps'] / capacity:>6.2f}{per}  "
                  f"{r['status']}")  # fmt: skip
            shares = ", ".join(f"{k} {v:.0%}" for k, v in r["server_cpu_share"].items() if v >= 0.005)
            print(f"{'':<16}server CPU (share of a core): {shares}")
            for c in MIX:  # where each class's calls went (the C++ client counts them per class)
                if r[c]["status"]:
                    print(f"{'':<16}{c}: {r[c]['status']}, p50 {r[c]['p50_ms']:.1f} ms")
                    # The server's side of the same calls: late = computed but answered past the
                    # deadline (compute spent on nothing), expired = dropped before compute.
                    print(f"{'':<16}{'':<{len(c)}}  server: {r['server_outcomes'][c]}")
    if args.repeat > 1:
        print(f"\ngoodput vs 1x, median of {args.repeat} rounds (each round against its own 1x):")
        for (policy, load), rs in ratios.items():
            print(
                f"  {policy:<9} {load:>4}x  {statistics.median(rs):.2f}  ["
                + ", ".join(f"{x:.2f}" for x in rs)
                + "]"
            )
    if args.json:
        args.json.write_text(json.dumps({"capacity_rps": capacity, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
