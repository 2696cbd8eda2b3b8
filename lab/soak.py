"""Soak: minutes of mixed traffic with the Redis cache on, Redis killed and restarted twice.

Starts its own redis-server (free port) and a batchgate server over a temporary repository:
ranker with ``response_cache { enable: true }`` (requests drawn from a small pool, so many are
cache hits), encoder (varied sequence lengths), and minilm when the bundled repository has it.
A closed loop of modest concurrency (the machine's cores are shared) runs for ``--seconds``;
at 1/3 and 2/3 of the run Redis is killed (SIGKILL) and restarted on the same port after
``--redis-down-s``. Every call's outcome is counted by status code, and every answer is checked
(rows and output size).

Passes (exit 0) when: every call sent was answered (sent = answered: OK + errors by status),
no answer was malformed, no INTERNAL/UNKNOWN status, the server exits 0 on SIGTERM, and its RSS
at the end is at most ``start × 1.25 + 50 MiB``, where start is read after a warm-up period
(``--warmup-s``: arenas, buckets and caches fill in the first seconds and are not a leak).

    .venv/bin/python -m lab.soak [--seconds 180] [--concurrency 8] [--json out/soak.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import grpc
import numpy as np

from batchgate.proto.inference.v2 import grpc_service_pb2 as pb
from batchgate.proto.inference.v2 import grpc_service_pb2_grpc as pb_grpc
from batchgate.bench.loadgen import free_ports, wait_ready

ROOT = Path(__file__).resolve().parent.parent
REPO = ROOT / "model_repository"
RSS_FACTOR, RSS_SLACK_MB = 1.25, 50.0
FATAL_CODES = {"INTERNAL", "UNKNOWN", "DATA_LOSS"}


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


# -- the repository and the processes -----------------------------------------------------------


def _repository(dst: Path) -> list[str]:
    """ranker (cached), encoder, minilm if bundled; model files linked, not copied."""
    models = []
    for name in ("ranker", "encoder", "minilm"):
        src = REPO / name
        if not (src / "1" / "model.onnx").exists():
            continue
        (dst / name / "1").mkdir(parents=True)
        os.symlink(src / "1" / "model.onnx", dst / name / "1" / "model.onnx")
        for extra in src.iterdir():
            if extra.is_file() and extra.name != "config.pbtxt":
                os.symlink(extra, dst / name / extra.name)
        cfg = (src / "config.pbtxt").read_text()
        if name == "ranker":
            cfg += "\nresponse_cache { enable: true }\n"
        (dst / name / "config.pbtxt").write_text(cfg)
        models.append(name)
    return models


class Redis:
    def __init__(self, workdir: Path) -> None:
        self.port = free_ports(1)[0]
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.workdir), "--loglevel", "warning"]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"redis-server on port {self.port} did not start")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _start_server(repo: Path, redis_url: str, log_path: Path, workers: int) -> tuple[subprocess.Popen, str]:
    grpc_port, http_port = free_ports(2)
    cmd = [sys.executable, "-m", "batchgate", "serve", "--model-repository", str(repo), "--host", "127.0.0.1",
           "--grpc-port", str(grpc_port), "--http-port", str(http_port), "--redis-url", redis_url,
           "--workers-per-device", str(workers), "--no-build-models"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log_path.open("w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    return proc, f"127.0.0.1:{grpc_port}"


# -- the traffic --------------------------------------------------------------------------------


def _ranker(rng: np.random.Generator) -> tuple[pb.ModelInferRequest, int, int]:
    rows = int(rng.integers(1, 9))
    req = pb.ModelInferRequest(model_name="ranker")
    req.inputs.add(name="dense", datatype="FP32", shape=[rows, 64])
    req.inputs.add(name="sparse_ids", datatype="INT64", shape=[rows, 8])
    req.raw_input_contents.append(rng.standard_normal((rows, 64), dtype=np.float32).tobytes())
    req.raw_input_contents.append(rng.integers(0, 10_000, (rows, 8), dtype=np.int64).tobytes())
    return req, rows, rows * 1 * 4


def _encoder(rng: np.random.Generator) -> tuple[pb.ModelInferRequest, int, int]:
    rows, seq = int(rng.integers(1, 5)), int(rng.choice([12, 16, 30, 48, 64]))
    req = pb.ModelInferRequest(model_name="encoder")
    req.inputs.add(name="input_ids", datatype="INT64", shape=[rows, seq])
    req.inputs.add(name="attention_mask", datatype="INT64", shape=[rows, seq])
    req.raw_input_contents.append(rng.integers(0, 1000, (rows, seq), dtype=np.int64).tobytes())
    req.raw_input_contents.append(np.ones((rows, seq), np.int64).tobytes())
    return req, rows, rows * 128 * 4


WORDS = "the quick brown fox jumps over a lazy dog while batching requests keeps every core busy".split()


def _minilm(rng: np.random.Generator) -> tuple[pb.ModelInferRequest, int, int]:
    rows = int(rng.integers(1, 4))
    req = pb.ModelInferRequest(model_name="minilm")
    t = req.inputs.add(name="text", datatype="BYTES", shape=[rows, 1])
    for _ in range(rows):
        t.contents.bytes_contents.append(" ".join(rng.choice(WORDS, int(rng.integers(3, 20)))).encode())
    return req, rows, rows * 384 * 4


def _pools(models: list[str], seed: int) -> dict[str, list[tuple[pb.ModelInferRequest, int, int]]]:
    """Pre-built requests per model; the ranker's pool is small, so repeats hit the cache."""
    rng = np.random.default_rng(seed)
    make = {"ranker": _ranker, "encoder": _encoder, "minilm": _minilm}
    sizes = {"ranker": 200, "encoder": 400, "minilm": 200}
    return {m: [make[m](rng) for _ in range(sizes[m])] for m in models}


MIX = {"ranker": 0.55, "encoder": 0.30, "minilm": 0.15}


class Tally:
    def __init__(self) -> None:
        self.sent = 0
        self.answered = 0
        self.by_status: Counter[str] = Counter()  # "OK" or the status code's name
        self.by_model: dict[str, Counter[str]] = {}
        self.malformed = 0
        self.samples: dict[str, str] = {}  # one message per error status
        self.latencies: list[float] = []
        self.t0 = time.monotonic()
        self.error_windows: dict[
            str, list[float]
        ] = {}  # status -> [first, last] second it was seen (answer time)


def _check(resp: pb.ModelInferResponse, rows: int, out_bytes: int) -> bool:
    if len(resp.outputs) != 1 or resp.outputs[0].shape[0] != rows:
        return False
    raw = resp.raw_output_contents[0] if resp.raw_output_contents else b""
    return len(raw) == out_bytes


async def _traffic(
    url: str, models: list[str], seconds: float, concurrency: int, tally: Tally, seed: int
) -> None:
    pools = _pools(models, seed)
    names = list(pools)
    weights = [MIX[m] for m in names]
    channels = [grpc.aio.insecure_channel(url) for _ in range(2)]
    stubs = [pb_grpc.GRPCInferenceServiceStub(ch) for ch in channels]
    stop_at = time.monotonic() + seconds

    async def caller(i: int) -> None:
        rnd = random.Random(seed * 1000 + i)
        stub = stubs[i % len(stubs)]
        while time.monotonic() < stop_at:
            model = rnd.choices(names, weights)[0]
            req, rows, out_bytes = rnd.choice(pools[model])
            tally.sent += 1
            t0 = time.perf_counter()
            try:
                resp = await stub.ModelInfer(req, timeout=15)
                status = "OK"
                if not _check(resp, rows, out_bytes):
                    tally.malformed += 1
            except grpc.aio.AioRpcError as exc:
                status = exc.code().name
                tally.samples.setdefault(status, f"{model}: {exc.details()}")
            except Exception as exc:  # a client-side failure is still an outcome, never a hole
                status = f"client:{type(exc).__name__}"
                tally.samples.setdefault(status, f"{model}: {exc}")
            tally.answered += 1
            tally.latencies.append(time.perf_counter() - t0)
            tally.by_status[status] += 1
            tally.by_model.setdefault(model, Counter())[status] += 1
            if status != "OK":
                t = round(time.monotonic() - tally.t0, 1)
                tally.error_windows.setdefault(status, [t, t])[1] = t
                await asyncio.sleep(0.05)  # as a caller would back off

    try:
        await asyncio.gather(*(caller(i) for i in range(concurrency)))
    finally:
        for ch in channels:
            await ch.close()


async def _statistics(url: str) -> dict:
    async with grpc.aio.insecure_channel(url) as ch:
        resp = await pb_grpc.GRPCInferenceServiceStub(ch).ModelStatistics(
            pb.ModelStatisticsRequest(), timeout=5
        )
    out = {}
    for m in resp.model_stats:
        s = m.inference_stats
        out[m.name] = {
            "success": s.success.count, "fail": s.fail.count, "executions": m.execution_count,
            "rows": m.inference_count, "cache_hits": s.cache_hit.count, "cache_misses": s.cache_miss.count,
        }  # fmt: skip
    return out


# -- the run ------------------------------------------------------------------------------------


async def _soak(args: argparse.Namespace, work: Path) -> dict:
    repo = work / "repo"
    models = _repository(repo)
    redis = Redis(work)
    redis.start()
    log_path = work / "server.log"
    proc, url = _start_server(repo, redis.url, log_path, args.workers)
    report: dict = {
        "models": models,
        "seconds": args.seconds,
        "concurrency": args.concurrency,
        "log": str(log_path),
    }
    try:
        await wait_ready(url, 180, proc)
        report["rss_ready_mb"] = _rss_mb(proc.pid)
        tally = Tally()
        t_start = tally.t0 = time.monotonic()
        samples: list[tuple[float, float]] = []
        traffic = asyncio.create_task(_traffic(url, models, args.seconds, args.concurrency, tally, args.seed))
        restarts = []

        async def chaos() -> None:
            for frac in (1 / 3, 2 / 3):
                await asyncio.sleep(max(t_start + args.seconds * frac - time.monotonic(), 0))
                redis.kill()
                t_kill = time.monotonic() - t_start
                await asyncio.sleep(args.redis_down_s)
                await asyncio.to_thread(redis.start)
                restarts.append(
                    {"killed_at_s": round(t_kill, 1), "up_at_s": round(time.monotonic() - t_start, 1)}
                )
                print(
                    f"  redis killed at {t_kill:.0f}s, back at {time.monotonic() - t_start:.0f}s", flush=True
                )

        async def sampler() -> None:
            while not traffic.done():
                await asyncio.sleep(min(10.0, args.seconds / 12))
                if proc.poll() is not None:
                    return
                t = time.monotonic() - t_start
                samples.append((round(t, 1), round(_rss_mb(proc.pid), 1)))
                if t >= args.warmup_s and "rss_start_mb" not in report:
                    report["rss_start_mb"] = samples[-1][1]
                print(f"  {t:5.0f}s  sent {tally.sent:7d}  answered {tally.answered:7d}  RSS {samples[-1][1]:.0f} MiB  "
                      f"{dict(tally.by_status)}", flush=True)  # fmt: skip

        chaos_task = asyncio.create_task(chaos())
        sample_task = asyncio.create_task(sampler())
        await traffic
        await chaos_task
        sample_task.cancel()
        report["rss_end_mb"] = round(_rss_mb(proc.pid), 1)
        report.setdefault("rss_start_mb", samples[0][1] if samples else report["rss_ready_mb"])
        report["rss_samples"] = samples
        report["redis_restarts"] = restarts
        lat = sorted(tally.latencies) or [0.0]
        report.update(
            sent=tally.sent, answered=tally.answered, by_status=dict(tally.by_status),
            by_model={m: dict(c) for m, c in tally.by_model.items()}, malformed=tally.malformed,
            error_samples=tally.samples, error_windows_s=tally.error_windows, calls_per_s=round(tally.answered / args.seconds, 1),
            p50_ms=round(lat[len(lat) // 2] * 1e3, 2), p99_ms=round(lat[int(len(lat) * 0.99)] * 1e3, 2),
            statistics=await _statistics(url),
        )  # fmt: skip
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        report["server_exit"] = proc.returncode
        redis.kill()
    return report


def _verdict(r: dict) -> list[str]:
    bound = r["rss_start_mb"] * RSS_FACTOR + RSS_SLACK_MB
    r["rss_bound_mb"] = round(bound, 1)
    problems = []
    if r["sent"] != r["answered"]:
        problems.append(f"sent {r['sent']} != answered {r['answered']}")
    if r["malformed"]:
        problems.append(f"{r['malformed']} malformed answers")
    fatal = {k: v for k, v in r["by_status"].items() if k in FATAL_CODES or k.startswith("client:")}
    if fatal:
        problems.append(f"statuses that must never happen: {fatal}")
    if r["rss_end_mb"] > bound:
        problems.append(
            f"RSS grew from {r['rss_start_mb']:.0f} to {r['rss_end_mb']:.0f} MiB (bound {bound:.0f})"
        )
    if r["server_exit"] != 0:
        problems.append(f"server exit code {r['server_exit']}")
    if len(r["redis_restarts"]) != 2:
        problems.append("Redis was not restarted twice")
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=180.0, help="length of the run (default 180)")
    ap.add_argument("--concurrency", type=int, default=8, help="closed-loop callers (default 8)")
    ap.add_argument("--workers", type=int, default=1, help="workers per device per model (default 1)")
    ap.add_argument("--warmup-s", type=float, default=15.0, help="RSS 'start' is read this far into the run")
    ap.add_argument("--redis-down-s", type=float, default=3.0, help="how long Redis stays dead each time")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="also write the report here")
    ap.add_argument("--keep", action="store_true", help="keep the work dir (server log) after the run")
    args = ap.parse_args()
    if shutil.which("redis-server") is None:
        print("soak: redis-server is not installed", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="batchgate-soak-"))
    print(
        f"soak: {args.seconds:.0f}s, {args.concurrency} callers, Redis restarted twice; work dir {work}",
        flush=True,
    )
    try:
        report = asyncio.run(_soak(args, work))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    problems = _verdict(report)
    report["problems"] = problems
    print(json.dumps({k: v for k, v in report.items() if k != "rss_samples"}, indent=2))
    print(
        f"\nsent {report['sent']} = answered {report['answered']} "
        f"({report['calls_per_s']} calls/s, p50 {report['p50_ms']} ms, p99 {report['p99_ms']} ms); "
        f"statuses {report['by_status']}; RSS {report['rss_start_mb']:.0f} -> {report['rss_end_mb']:.0f} MiB "
        f"(bound {report['rss_bound_mb']:.0f} = start x {RSS_FACTOR} + {RSS_SLACK_MB:.0f}); "
        + ("PASS" if not problems else "FAIL: " + "; ".join(problems))
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
