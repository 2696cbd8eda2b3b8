"""Result-cache benchmark: the `ranker` with the cache off, in memory, and in Redis, in one run.

Workload (closed loop): C concurrent callers each send ModelInfer with a client batch of R rows
(default 32), drawn Zipf(alpha = 1.1) over 10^6 distinct rows, for S seconds per configuration,
every configuration from a cold cache and with the same draws. Per configuration: calls/s, rows/s,
client p50/p99, and the row hit rate (1 - rows the engine computed / rows sent, read from
ModelStatistics), next to the ideal hit rate of the draws (an unbounded cache).

Then an all-miss workload (every row new, one caller, so latency is not queueing; the
configurations taken in turn request by request, so all see the same moments of a shared
machine's load) measures what the cache path adds to a request whose rows all miss: p50 with the
cache off, in memory, and in Redis; the goal is that Redis adds at most 1 ms p50. The server's own figure is shown too:
cache_miss.ns / cache_miss.count, the mean time a missing request spent in the cache (keys,
memory, the Redis MGET, storing), compute excluded.

    .venv/bin/python -m lab.cache_bench [--seconds 8] [--concurrency 16] [--configs off,memory,redis]

Starts its own redis-server and one batchgate server per configuration, all at once (a temporary
copy of the bundled ranker with `response_cache { enable: true }`). The machine is shared: compare ratios
from one run, not absolute numbers across runs.
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

from batchgate.proto.inference.v2 import grpc_service_pb2 as pb
from batchgate.proto.inference.v2 import grpc_service_pb2_grpc as pb_grpc
from batchgate.bench.loadgen import free_ports, wait_ready

ROOT = Path(__file__).resolve().parent.parent
DISTINCT = 1_000_000
DENSE_TABLE = 4096
TIERS = {"off": "off", "memory": "memory", "redis": "redis", "memory+redis": "memory+redis"}


class Rows:
    """Row id -> the row's inputs, deterministic, distinct for distinct ids below 10^6."""

    def __init__(self) -> None:
        rng = np.random.default_rng(1234)
        self.dense = rng.standard_normal((DENSE_TABLE, 64), dtype=np.float32)
        self.mix = rng.integers(1, 10_000, 6, dtype=np.int64)

    def request(self, ids: np.ndarray) -> pb.ModelInferRequest:
        n = len(ids)
        sparse = np.empty((n, 8), np.int64)
        sparse[:, 0] = ids % 10_000
        sparse[:, 1] = ids // 10_000
        sparse[:, 2:] = (ids[:, None] * self.mix[None, :]) % 10_000
        return _request(self.dense[ids % DENSE_TABLE], sparse)


def _request(dense: np.ndarray, sparse: np.ndarray) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name="ranker")
    req.inputs.add(name="dense", datatype="FP32", shape=list(dense.shape))
    req.inputs.add(name="sparse_ids", datatype="INT64", shape=list(sparse.shape))
    req.raw_input_contents.append(dense.tobytes())
    req.raw_input_contents.append(sparse.tobytes())
    return req


class Zipf:
    def __init__(self, alpha: float, n: int = DISTINCT) -> None:
        cdf = np.cumsum(np.arange(1, n + 1, dtype=np.float64) ** -alpha)
        self.cdf = cdf / cdf[-1]
        self.ids = np.random.default_rng(99).permutation(n)  # popularity rank -> row id

    def draw(self, rng: np.random.Generator, k: int) -> np.ndarray:
        return self.ids[np.minimum(np.searchsorted(self.cdf, rng.random(k)), len(self.ids) - 1)]


async def _stats(url: str) -> dict:
    async with grpc.aio.insecure_channel(url) as ch:
        stub = pb_grpc.GRPCInferenceServiceStub(ch)
        st = (await stub.ModelStatistics(pb.ModelStatisticsRequest(name="ranker"))).model_stats[0]
        s = st.inference_stats
        return {
            "rows": st.inference_count, "executions": st.execution_count,
            "hit": s.cache_hit.count, "hit_ns": s.cache_hit.ns, "miss": s.cache_miss.count, "miss_ns": s.cache_miss.ns,
        }  # fmt: skip


async def _load(url: str, make, concurrency: int, seconds: float, on_sent=None) -> dict:
    """Closed loop; ``make(caller)`` builds the caller's next request, ``on_sent(req)`` sees
    each answered one."""
    latencies: list[float] = []
    rows_sent = 0
    errors = 0
    channels = [grpc.aio.insecure_channel(url) for _ in range(min(4, concurrency))]
    stubs = [pb_grpc.GRPCInferenceServiceStub(ch) for ch in channels]
    stop_at = time.perf_counter() + seconds

    async def caller(i: int) -> None:
        nonlocal errors, rows_sent
        stub = stubs[i % len(stubs)]
        while True:
            req = make(i)
            t0 = time.perf_counter()
            if t0 >= stop_at:
                return
            try:
                await stub.ModelInfer(req, timeout=30)
                latencies.append(time.perf_counter() - t0)
                rows_sent += req.inputs[0].shape[0]
                if on_sent is not None:
                    on_sent(req)
            except grpc.RpcError:
                errors += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(caller(i) for i in range(concurrency)))
    elapsed = time.perf_counter() - t0
    for ch in channels:
        await ch.close()
    lat = np.array(latencies or [float("nan")]) * 1e3
    return {
        "calls": len(latencies), "calls_per_s": len(latencies) / elapsed, "rows_sent": rows_sent,
        "rows_per_s": rows_sent / elapsed, "p50_ms": float(np.percentile(lat, 50)),
        "p99_ms": float(np.percentile(lat, 99)), "errors": errors,
    }  # fmt: skip


async def _interleaved(urls: dict[str, str], make, seconds: float) -> dict[str, dict]:
    """One caller, one request at a time, taking the configurations in turn, so that every
    configuration sees the same moments of a shared machine's load."""
    channels = {c: grpc.aio.insecure_channel(u) for c, u in urls.items()}
    stubs = {c: pb_grpc.GRPCInferenceServiceStub(ch) for c, ch in channels.items()}
    lat: dict[str, list[float]] = {c: [] for c in urls}
    errors = dict.fromkeys(urls, 0)
    stop_at = time.perf_counter() + seconds
    while time.perf_counter() < stop_at:
        for c, stub in stubs.items():
            req = make(0)
            t0 = time.perf_counter()
            try:
                await stub.ModelInfer(req, timeout=30)
                lat[c].append(time.perf_counter() - t0)
            except grpc.RpcError:
                errors[c] += 1
    for ch in channels.values():
        await ch.close()
    out = {}
    for c, xs in lat.items():
        a = np.array(xs or [float("nan")]) * 1e3
        out[c] = {"calls": len(xs), "p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99)),
                  "mean_ms": float(a.mean()), "errors": errors[c]}  # fmt: skip
    return out


def _repo(tmp: Path) -> Path:
    repo = tmp / "repo"
    (repo / "ranker" / "1").mkdir(parents=True)
    shutil.copy(
        ROOT / "model_repository" / "ranker" / "1" / "model.onnx", repo / "ranker" / "1" / "model.onnx"
    )
    config = (ROOT / "model_repository" / "ranker" / "config.pbtxt").read_text()
    (repo / "ranker" / "config.pbtxt").write_text(config + "response_cache { enable: true }\n")
    return repo


def _start_redis(tmp: Path) -> tuple[subprocess.Popen, int]:
    import redis

    port = free_ports(1)[0]
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(tmp), "--loglevel", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    client = redis.Redis(host="127.0.0.1", port=port)
    for _ in range(100):
        try:
            client.ping()
            return proc, port
        except redis.RedisError:
            time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


def _start_server(repo: Path, tiers: str, redis_url: str) -> tuple[subprocess.Popen, str, int]:
    grpc_port, http_port = free_ports(2)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "BATCHGATE_CACHE_TIERS": tiers}
    if tiers in ("redis", "memory+redis"):
        env["BATCHGATE_REDIS_URL"] = redis_url
        # Each configuration its own keys: they replay the same draws and must not hit each other's.
        env["BATCHGATE_CACHE_REDIS_PREFIX"] = f"bench:{tiers}:"
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchgate", "serve", "--model-repository", str(repo), "--host", "127.0.0.1",
         "--grpc-port", str(grpc_port), "--http-port", str(http_port), "--log-level", "WARNING"],
        cwd=ROOT, env=env,
    )  # fmt: skip
    return proc, f"127.0.0.1:{grpc_port}", http_port


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _row_ids(req: pb.ModelInferRequest) -> np.ndarray:
    """The row ids of a Zipf request (``Rows`` writes them into the first two sparse slots)."""
    sparse = np.frombuffer(req.raw_input_contents[1], np.int64).reshape(-1, 8)
    return sparse[:, 0] + 10_000 * sparse[:, 1]


def _redis_figures(http_port: int) -> dict[str, float]:
    """The server's Redis-tier counters, from its /metrics (empty when it has no Redis tier)."""
    import urllib.request

    wanted = ("lookups", "timeouts", "errors", "skipped", "breaker_opens", "writes", "write_dropped")
    out: dict[str, float] = {}
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=5).read().decode()
    except OSError:
        return out
    for line in text.splitlines():
        if line.startswith("batchgate_cache_stat{") and 'tier="redis"' in line and 'model=""' in line:
            stat = line.split('stat="', 1)[1].split('"', 1)[0]
            if stat in wanted:
                out[stat] = float(line.rsplit(" ", 1)[1])
    return out


def _cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a process (Linux /proc), worker threads included."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--configs", default="off,memory,redis,memory+redis", help="comma list of: " + ",".join(TIERS)
    )
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rows", type=int, default=32, help="rows per client batch")
    ap.add_argument("--alpha", type=float, default=1.1)
    ap.add_argument("--seconds", type=float, default=8.0, help="Zipf run per configuration")
    ap.add_argument(
        "--slices", type=int, default=4, help="the Zipf run of each configuration in this many turns"
    )
    ap.add_argument(
        "--miss-seconds", type=float, default=4.0, help="all-miss run, per configuration (0: skip)"
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    args = ap.parse_args()
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in TIERS]
    if unknown:
        ap.error(f"unknown configs {unknown}; choose from {list(TIERS)}")

    rows = Rows()
    zipf = Zipf(args.alpha)
    fresh = np.random.default_rng(7)

    def miss_request(_caller: int) -> pb.ModelInferRequest:
        # New random dense features every time: no two rows alike, ever.
        return _request(fresh.standard_normal((args.rows, 64), dtype=np.float32),
                        fresh.integers(0, 10_000, (args.rows, 8), dtype=np.int64))  # fmt: skip

    results: dict[str, dict] = {}
    miss: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="cache-bench-") as tmp_s:
        tmp = Path(tmp_s)
        repo = _repo(tmp)
        redis_proc, redis_port = _start_redis(tmp)
        redis_url = f"redis://127.0.0.1:{redis_port}/0"
        servers: dict[str, tuple[subprocess.Popen, str, int]] = {}
        try:
            import redis

            admin = redis.Redis(host="127.0.0.1", port=redis_port)
            for config in configs:  # all up at once; an idle one costs next to nothing
                servers[config] = _start_server(repo, TIERS[config], redis_url)
            for config, (_, url, _) in servers.items():
                asyncio.run(wait_ready(url))
            urls = {c: url for c, (_, url, _) in servers.items()}
            miss_configs = [c for c in configs if c in ("off", "memory", "redis")]
            if args.miss_seconds > 0 and miss_configs:
                print(f"  all-miss: 1 caller x {args.rows} rows, interleaved over {miss_configs}, "
                      f"{args.miss_seconds:.0f}s each ...", file=sys.stderr)  # fmt: skip
                asyncio.run(_interleaved({c: urls[c] for c in miss_configs}, miss_request, 0.5))  # warm-up
                before = {c: asyncio.run(_stats(urls[c])) for c in miss_configs}
                miss = asyncio.run(
                    _interleaved(
                        {c: urls[c] for c in miss_configs},
                        miss_request,
                        args.miss_seconds * len(miss_configs),
                    )
                )
                for c in miss_configs:
                    after = asyncio.run(_stats(urls[c]))
                    n = after["miss"] - before[c]["miss"]
                    miss[c]["cache_us_per_request"] = (
                        (after["miss_ns"] - before[c]["miss_ns"]) / n / 1e3 if n else None
                    )
            admin.flushall()  # the Zipf runs start cold
            # Zipf: the configurations take turns in short slices, so each sees the machine's load
            # at the same moments; each keeps its cache, its callers' draws and its counters
            # across its slices.
            gens = {c: {i: np.random.default_rng(i) for i in range(args.concurrency)} for c in configs}
            sent_ids: dict[str, list[np.ndarray]] = {c: [] for c in configs}
            runs: dict[str, list[dict]] = {c: [] for c in configs}
            first = {c: asyncio.run(_stats(urls[c])) for c in configs}
            cpu0 = {c: _cpu_s(servers[c][0].pid) for c in configs}
            slice_s = args.seconds / args.slices
            print(f"  Zipf({args.alpha}) over {DISTINCT:,} rows, {args.concurrency} callers x {args.rows} rows, "
                  f"{args.slices} slices of {slice_s:.1f}s per configuration, in turn ...", file=sys.stderr)  # fmt: skip
            for _ in range(args.slices):
                for c in configs:
                    g = gens[c]
                    runs[c].append(asyncio.run(_load(
                        urls[c], lambda i, g=g: rows.request(zipf.draw(g[i], args.rows)), args.concurrency, slice_s,
                        on_sent=lambda req, c=c: sent_ids[c].append(_row_ids(req)),
                    )))  # fmt: skip
            for c in configs:
                after = asyncio.run(_stats(urls[c]))
                cpu1 = _cpu_s(servers[c][0].pid)
                rs = runs[c]
                calls = sum(r["calls"] for r in rs)
                sent = sum(r["rows_sent"] for r in rs)
                lat_p50 = float(np.median([r["p50_ms"] for r in rs]))
                ids = np.concatenate(sent_ids[c]) if sent_ids[c] else np.zeros(0, np.int64)
                computed = after["rows"] - first[c]["rows"]
                hits = after["hit"] - first[c]["hit"]
                misses = after["miss"] - first[c]["miss"]
                results[c] = {
                    "calls": calls, "calls_per_s": calls / args.seconds, "rows_per_s": sent / args.seconds,
                    "p50_ms": lat_p50, "p99_ms": float(np.median([r["p99_ms"] for r in rs])),
                    "errors": sum(r["errors"] for r in rs), "rows_sent": sent, "rows_computed": computed,
                    "row_hit_rate": 1 - computed / max(sent, 1),
                    "ideal_hit_rate": 1 - len(np.unique(ids)) / max(len(ids), 1),
                    "request_hit_rate": hits / max(hits + misses, 1),
                    "server_cpu_ms_per_call": (cpu1 - cpu0[c]) * 1e3 / max(calls, 1)
                    if cpu1 is not None and cpu0[c] is not None else None,
                    "redis": _redis_figures(servers[c][2]),
                }  # fmt: skip
            admin.close()
        finally:
            for proc, _, _ in servers.values():
                _stop(proc)
            redis_proc.kill()
            redis_proc.wait()

    base = results.get("off")
    keys = ("calls_per_s", "p50_ms", "p99_ms", "server_cpu_ms_per_call")
    ratios = {
        c: {k: r[k] / base[k] for k in keys if base and base.get(k) and r.get(k)} for c, r in results.items()
    }
    added = {}
    if "off" in miss:
        for c in ("memory", "redis"):
            if c in miss:
                added[c] = miss[c]["p50_ms"] - miss["off"]["p50_ms"]
    if args.json:
        print(json.dumps({"args": vars(args), "zipf": results, "ratios_vs_off": ratios, "all_miss": miss,
                          "added_p50_ms_all_miss": added}, indent=2))  # fmt: skip
        return 0
    nan = float("nan")
    print(f"\nZipf(alpha={args.alpha}) over {DISTINCT:,} distinct rows, {args.concurrency} callers x {args.rows} rows, "
          f"{args.seconds:.0f}s each ({args.slices} turns), cold cache")  # fmt: skip
    print(f"{'config':<13} {'calls/s':>8} {'rows/s':>8} {'p50 ms':>7} {'p99 ms':>7} {'row hits':>8} {'ideal':>6} "
          f"{'req hits':>8} {'CPU ms/call':>11} {'errors':>6} | vs off: calls/s  p50    p99    CPU/call")  # fmt: skip
    for c, r in results.items():
        ra = ratios.get(c, {})
        cpu = r["server_cpu_ms_per_call"]
        print(
            f"{c:<13} {r['calls_per_s']:>8.0f} {r['rows_per_s']:>8.0f} {r['p50_ms']:>7.2f} {r['p99_ms']:>7.2f} "
            f"{r['row_hit_rate']:>8.1%} {r['ideal_hit_rate']:>6.1%} {r['request_hit_rate']:>8.1%} "
            f"{nan if cpu is None else cpu:>11.3f} {r['errors']:>6} | "
            f"{ra.get('calls_per_s', nan):>13.2f}x {ra.get('p50_ms', nan):>5.2f}x {ra.get('p99_ms', nan):>5.2f}x "
            f"{ra.get('server_cpu_ms_per_call', nan):>5.2f}x"
        )
    for c, r in results.items():
        if r.get("redis"):
            print(f"  {c} Redis tier: " + ", ".join(f"{k} {v:.0f}" for k, v in r["redis"].items()))
    if miss:
        print(
            f"\nall-miss (every row new), 1 caller x {args.rows} rows, configurations interleaved request by request"
        )
        print(
            f"{'config':<13} {'calls':>8} {'p50 ms':>7} {'p99 ms':>7} {'added p50':>10} {'cache us/req (server)':>22}"
        )
        for c, r in miss.items():
            a = added.get(c)
            us = r.get("cache_us_per_request")
            print(
                f"{c:<13} {r['calls']:>8} {r['p50_ms']:>7.2f} {r['p99_ms']:>7.2f} "
                f"{'' if a is None else f'{a:+.3f} ms':>10} {'' if us is None else f'{us:.0f}':>22}"
            )
        if "redis" in added:
            verdict = "meets" if added["redis"] <= 1.0 else "misses"
            print(
                f"Redis tier adds {added['redis']:+.3f} ms p50 on all-miss requests ({verdict} the <= 1 ms goal)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
