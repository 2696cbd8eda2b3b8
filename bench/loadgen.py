"""The load generator: KServe v2 gRPC requests in closed or open loop, unary or streamed.

* Closed loop: ``concurrency`` callers, each sending its next request when the last one is
  answered. Measures capacity at a fixed number of outstanding requests.
* Open loop: requests leave at Poisson arrival times of a fixed ``rate``, whether or not earlier
  ones were answered. Latency is measured from the *scheduled* send time, so a client that falls
  behind does not hide the queueing it caused (no coordinated omission).
* Unary sends ``ModelInfer`` calls; stream sends every request on a few long-lived
  ``ModelStreamInfer`` streams and matches answers to requests by ``id``; rest posts the same
  requests as KServe v2 JSON (``/v2/models/<m>/infer``) and openai as ``/v1/embeddings`` (text
  workload only), one keep-alive HTTP connection per request in flight.

Each measured point runs ``warmup_s`` unrecorded, then ``duration_s`` recorded. Requests are
built once, before the clock starts (a pool per caller), so the client spends its time on gRPC.
The client is Python on the same machine as the server: on a small machine it competes with the
server for CPU, and the figures say more about ratios measured in one run than about absolutes.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import os
import resource
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from batchgate.proto.inference.v2 import grpc_service_pb2 as pb
from batchgate.proto.inference.v2 import grpc_service_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parent.parent
PERCENTILES = (50, 90, 99, 99.9)

# -- workloads ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """What each request carries: the bundled ``ranker`` (dense FP32 [rows, 64], sparse_ids INT64
    [rows, 8] in [0, 10000)), ``encoder`` (input_ids / attention_mask INT64 [rows, seq], ids in
    [0, 1000)) or ``minilm`` (``rows`` texts, BYTES [rows, 1], consecutive texts of bench/texts.py:
    mixed lengths, each request different)."""

    model: str = "ranker"
    rows: int = 1
    seq: int = 32
    variants: int = 64  # distinct requests cycled through (distinct inputs, so a cache cannot hide work)
    openai_format: str = "base64"  # encoding_format of the openai api (the SDK's default)
    latency_class: str | None = None  # the request parameter (openai: the extension field), if set

    def texts(self, seed: int = 0) -> list[list[str]]:
        """The text workload's requests: ``rows`` consecutive shipped texts each, from a seeded start."""
        from batchgate.bench.texts import TEXTS

        start = int(np.random.default_rng(seed).integers(len(TEXTS)))
        n = max(self.variants, -(-len(TEXTS) // self.rows))  # every shipped text at least once
        return [[TEXTS[(start + k * self.rows + i) % len(TEXTS)] for i in range(self.rows)] for k in range(n)]

    def http_requests(self, api: str, seed: int = 0) -> list[tuple[str, bytes]]:
        """(path, JSON body) per request, for the rest and openai apis."""
        if api == "openai":
            if self.model != "minilm":
                raise ValueError("the openai api takes the text workload only (--model minilm)")
            fmt = self.openai_format
            extra = {"latency_class": self.latency_class} if self.latency_class else {}
            out = []
            for t in self.texts(seed):
                body = {"model": self.model, "input": t, "encoding_format": fmt, **extra}
                out.append(("/v1/embeddings", json.dumps(body).encode()))
            return out
        out = []
        for req in self.requests(seed):
            inputs = []
            for t, raw in zip(req.inputs, req.raw_input_contents, strict=True):
                if t.datatype == "BYTES":
                    data: list = _split_bytes(raw)
                else:
                    data = np.frombuffer(raw, dtype=_NUMPY[t.datatype]).tolist()
                inputs.append({"name": t.name, "shape": list(t.shape), "datatype": t.datatype, "data": data})
            doc: dict = {"inputs": inputs}
            if self.latency_class:
                doc["parameters"] = {"latency_class": self.latency_class}
            out.append((f"/v2/models/{self.model}/infer", json.dumps(doc).encode()))
        return out

    def requests(self, seed: int = 0) -> list[pb.ModelInferRequest]:
        reqs = self._requests(seed)
        if self.latency_class:
            for r in reqs:
                r.parameters["latency_class"].string_param = self.latency_class
        return reqs

    def _requests(self, seed: int) -> list[pb.ModelInferRequest]:
        if self.model == "minilm":
            out = []
            for texts in self.texts(seed):
                req = pb.ModelInferRequest(model_name=self.model)
                req.inputs.add(name="text", datatype="BYTES", shape=[len(texts), 1])
                encoded = (t.encode() for t in texts)
                req.raw_input_contents.append(b"".join(struct.pack("<I", len(b)) + b for b in encoded))
                out.append(req)
            return out
        rng = np.random.default_rng(seed)
        out = []
        for _ in range(self.variants):
            req = pb.ModelInferRequest(model_name=self.model)
            if self.model == "ranker":
                arrays = {
                    "dense": ("FP32", rng.standard_normal((self.rows, 64), dtype=np.float32)),
                    "sparse_ids": ("INT64", rng.integers(0, 10_000, (self.rows, 8), dtype=np.int64)),
                }
            elif self.model == "encoder":
                mask = np.ones((self.rows, self.seq), dtype=np.int64)
                mask[:, self.seq - self.seq // 4 :] = 0
                arrays = {
                    "input_ids": ("INT64", rng.integers(0, 1000, (self.rows, self.seq), dtype=np.int64)),
                    "attention_mask": ("INT64", mask),
                }
            else:
                raise ValueError(f"unknown workload model '{self.model}' (ranker, encoder or minilm)")
            for name, (datatype, arr) in arrays.items():
                req.inputs.add(name=name, datatype=datatype, shape=list(arr.shape))
                req.raw_input_contents.append(arr.tobytes())
            out.append(req)
        return out


_NUMPY = {"FP32": np.float32, "INT64": np.int64}


def _split_bytes(raw: bytes) -> list[str]:
    out, pos = [], 0
    while pos < len(raw):
        (n,) = struct.unpack_from("<I", raw, pos)
        out.append(raw[pos + 4 : pos + 4 + n].decode())
        pos += 4 + n
    return out


# -- results --------------------------------------------------------------------------------------


@dataclass
class Point:
    """One measured point of a sweep."""

    mode: str  # closed | open
    api: str  # unary | stream
    level: float  # concurrency (closed) or offered requests/s (open)
    duration_s: float
    rows: int
    latencies_s: np.ndarray = field(default_factory=lambda: np.empty(0))  # of successful requests
    errors: dict[str, int] = field(default_factory=dict)  # by status code name
    completed: int = 0  # successful answers that arrived inside the measured window
    behind: int = 0  # open loop: requests not sent because max_outstanding was reached
    server: dict = field(default_factory=dict)  # batching figures from ModelStatistics, if offered

    def summary(self, budget_ms: float) -> dict:
        lat_ms = self.latencies_s * 1e3
        pct = {
            f"p{str(p).replace('.', '_')}_ms": float(np.percentile(lat_ms, p)) if lat_ms.size else math.nan
            for p in PERCENTILES
        }
        within = int(np.count_nonzero(lat_ms <= budget_ms))
        answered = max(lat_ms.size, 1)
        rate = self.completed / self.duration_s
        return {
            "mode": self.mode,
            "api": self.api,
            "concurrency": int(self.level) if self.mode == "closed" else None,
            "offered_rps": self.level if self.mode == "open" else None,
            "duration_s": round(self.duration_s, 3),
            "rows_per_request": self.rows,
            "throughput_rps": rate,
            "rows_per_s": self.completed * self.rows / self.duration_s,
            # goodput: answers within the budget, per second (the share of the window's answers
            # that made it, times the throughput)
            # (exactly the throughput when every answer made it: x * n / n can round above x)
            "goodput_rps": rate if within >= answered else rate * within / answered,
            "budget_ms": budget_ms,
            "mean_ms": float(lat_ms.mean()) if lat_ms.size else math.nan,
            **pct,
            "max_ms": float(lat_ms.max()) if lat_ms.size else math.nan,
            "ok": int(lat_ms.size),
            "errors": sum(self.errors.values()),
            "error_codes": ";".join(f"{k}={v}" for k, v in sorted(self.errors.items())),
            "not_sent": self.behind,
            **{f"server_{k}": v for k, v in self.server.items()},
        }


class Progress:
    """One stderr line rewritten in place (a terminal) or one line per point (a log)."""

    def __init__(self, enabled: bool = True, stream=None) -> None:
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and self.stream.isatty()

    def update(self, label: str, elapsed: float, total: float, done: int) -> None:
        if not self.tty:
            return
        width = 24
        filled = int(width * min(elapsed / total, 1.0)) if total > 0 else width
        rate = done / elapsed if elapsed > 0 else 0.0
        bar = "#" * filled + "." * (width - filled)
        self.stream.write(f"\r[{bar}] {label}  {elapsed:5.1f}/{total:.1f}s  {done} ok  {rate:8.0f}/s ")
        self.stream.flush()

    def finish(self, label: str, line: str) -> None:
        if not self.enabled:
            return
        if self.tty:
            self.stream.write("\r\033[K")
        self.stream.write(f"{label}: {line}\n")
        self.stream.flush()


# -- the runner -----------------------------------------------------------------------------------


class _Recorder:
    """Where senders report. Throughput counts answers that arrive inside the measured window;
    latency is recorded for requests sent inside it (answered in it or after)."""

    def __init__(self) -> None:
        self.start = math.inf
        self.end = math.inf
        self.latencies: list[float] = []
        self.errors: dict[str, int] = {}
        self.completed = 0
        self.behind = 0

    def ok(self, t_sent: float, t_done: float) -> None:
        if self.start <= t_done <= self.end:
            self.completed += 1
        if self.start <= t_sent <= self.end:
            self.latencies.append(t_done - t_sent)

    def error(self, t_sent: float, code: str) -> None:
        if self.start <= t_sent <= self.end:
            self.errors[code] = self.errors.get(code, 0) + 1


_STREAM_METHOD = "/inference.GRPCInferenceService/ModelStreamInfer"


class _Stream:
    """One ModelStreamInfer call shared by many senders; answers matched by request id.

    Requests are serialised here, with their id set just before (no await in between), so one
    request object can serve every sender; gRPC then passes the bytes through."""

    def __init__(self, channel: grpc.aio.Channel, timeout_s: float, metadata: tuple = ()) -> None:
        method = channel.stream_stream(
            _STREAM_METHOD,
            request_serializer=lambda b: b,
            response_deserializer=pb.ModelStreamInferResponse.FromString,
        )
        self.call = method(metadata=metadata or None)
        self.pending: dict[str, asyncio.Future] = {}
        self.lock = asyncio.Lock()  # grpc.aio allows one write at a time per call
        self.reader = asyncio.create_task(self._read())
        self.timeout_s = timeout_s

    async def _read(self) -> None:
        err: BaseException | None = None
        try:
            async for resp in self.call:
                fut = self.pending.pop(resp.infer_response.id, None)
                if fut is not None and not fut.done():
                    if resp.error_message:
                        fut.set_exception(_StreamError(resp.error_message))
                    else:
                        fut.set_result(None)
        except grpc.RpcError as exc:
            err = exc
        except asyncio.CancelledError:
            pass
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(err or _StreamError("stream closed"))
        self.pending.clear()

    async def infer(self, req: pb.ModelInferRequest, rid: str) -> None:
        fut = asyncio.get_running_loop().create_future()
        self.pending[rid] = fut
        req.id = rid
        data = req.SerializeToString()
        try:
            async with self.lock:
                await self.call.write(data)
            await asyncio.wait_for(fut, self.timeout_s)
        finally:
            self.pending.pop(rid, None)

    async def close(self) -> None:
        try:
            await self.call.done_writing()
        except Exception:
            pass
        self.call.cancel()
        self.reader.cancel()
        try:
            await self.reader
        except BaseException:
            pass


class _StreamError(Exception):
    code_name = "STREAM_ERROR"


class _HttpError(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.code_name = f"HTTP_{status}"


APIS = ("unary", "stream", "rest", "openai")


def _code(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code().name
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return "CLIENT_TIMEOUT"
    if isinstance(exc, (_StreamError, _HttpError)):
        return exc.code_name
    return type(exc).__name__


async def run_point(
    url: str,
    workload: Workload,
    mode: str,
    api: str,
    level: float,
    duration_s: float = 5.0,
    warmup_s: float = 1.0,
    channels: int = 4,
    timeout_s: float = 10.0,
    max_outstanding: int = 4096,
    progress: Progress | None = None,
    seed: int = 0,
    http_url: str = "127.0.0.1:8000",
    metadata: tuple[tuple[str, str], ...] = (),
) -> Point:
    """Measure one point: ``level`` is the concurrency (closed) or the rate in requests/s (open).
    ``metadata``: sent with every gRPC call or stream (an API key: ``authorization``)."""
    if mode not in ("closed", "open") or api not in APIS:
        raise ValueError(f"mode must be closed|open and api one of {APIS}, not {mode}/{api}")
    if level <= 0:
        raise ValueError("concurrency and rate must be > 0")
    # Separate subchannel pools: `channels` real HTTP/2 connections, as a fleet of clients has.
    chans = [
        grpc.aio.insecure_channel(url, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(channels)
    ]
    stubs = [pb_grpc.GRPCInferenceServiceStub(ch) for ch in chans]
    streams = [_Stream(ch, timeout_s, metadata) for ch in chans] if api == "stream" else []
    rec = _Recorder()
    ids = itertools.count()
    clock = time.perf_counter
    http = api in ("rest", "openai")
    pool = workload.http_requests(api, seed) if http else workload.requests(seed)
    n_pool = len(pool)
    session = None
    if http:
        import aiohttp

        session = aiohttp.ClientSession(
            base_url=f"http://{http_url}",
            connector=aiohttp.TCPConnector(limit=0),  # one keep-alive connection per caller in flight
            timeout=aiohttp.ClientTimeout(total=timeout_s),
            headers={"Content-Type": "application/json"},
        )

    async def post(path: str, body: bytes) -> None:
        async with session.post(path, data=body) as r:
            await r.read()
            if r.status != 200:
                raise _HttpError(r.status)

    async def send(slot: int, k: int, t_sent: float) -> None:
        req = pool[k % n_pool]
        try:
            if api == "unary":
                await stubs[slot % channels].ModelInfer(req, timeout=timeout_s, metadata=metadata or None)
            elif api == "stream":
                await streams[slot % channels].infer(req, str(next(ids)))
            else:
                await post(*req)
        except Exception as exc:
            rec.error(t_sent, _code(exc))
            return
        rec.ok(t_sent, clock())

    total = warmup_s + duration_s
    t0 = clock()
    rec.start = t0 + warmup_s
    rec.end = rec.start + duration_s
    stop_at = rec.end

    async def ticker() -> None:
        while True:
            await asyncio.sleep(0.25)
            if progress is not None:
                progress.update(
                    f"{mode} {api} {_level_text(mode, level)}", clock() - t0, total, rec.completed
                )

    tick = asyncio.create_task(ticker())
    try:
        if mode == "closed":

            async def caller(slot: int) -> None:
                k = slot  # callers start at different requests
                while (t := clock()) < stop_at:
                    await send(slot, k, t)
                    k += 1

            await asyncio.gather(*(caller(i) for i in range(int(level))))
        else:
            rng = np.random.default_rng(seed + 1)
            outstanding: set[asyncio.Task] = set()
            t_next = clock()
            k = 0
            while t_next < stop_at:
                now = clock()
                if t_next > now:
                    await asyncio.sleep(t_next - now)
                # Everything due by now leaves now: a loop that fell behind sends a burst, and the
                # latency of each request still starts at its scheduled time.
                now = clock()
                while t_next <= now and t_next < stop_at:
                    if len(outstanding) >= max_outstanding:
                        if rec.start <= t_next <= rec.end:
                            rec.behind += 1
                    else:
                        t = asyncio.create_task(send(k, k, t_next))
                        outstanding.add(t)
                        t.add_done_callback(outstanding.discard)
                    k += 1
                    t_next += rng.exponential(1.0 / level)
            if outstanding:
                await asyncio.wait(list(outstanding), timeout=timeout_s + 1)
    finally:
        tick.cancel()
        for s in streams:
            await s.close()
        for ch in chans:
            await ch.close()
        if session is not None:
            await session.close()
    return Point(
        mode=mode,
        api=api,
        level=level,
        duration_s=duration_s,
        rows=workload.rows,
        latencies_s=np.asarray(rec.latencies),
        errors=rec.errors,
        completed=rec.completed,
        behind=rec.behind,
    )


def _level_text(mode: str, level: float) -> str:
    return f"c={int(level)}" if mode == "closed" else f"rate={level:g}/s"


async def model_statistics(url: str, model: str) -> dict | None:
    """(executions, rows, requests) of ``model`` so far; None when the server has no statistics."""
    try:
        async with grpc.aio.insecure_channel(url) as ch:
            stub = pb_grpc.GRPCInferenceServiceStub(ch)
            resp = await stub.ModelStatistics(pb.ModelStatisticsRequest(name=model), timeout=5)
    except grpc.RpcError:
        return None
    if not resp.model_stats:
        return None
    st = resp.model_stats[-1]
    return {
        "executions": st.execution_count,
        "rows": st.inference_count,
        "requests": st.inference_stats.success.count,
    }


def batching(before: dict | None, after: dict | None) -> dict:
    if not before or not after:
        return {}
    ex = after["executions"] - before["executions"]
    if ex <= 0:
        return {}
    return {
        "requests_per_batch": round((after["requests"] - before["requests"]) / ex, 2),
        "rows_per_batch": round((after["rows"] - before["rows"]) / ex, 2),
    }


def metric_samples(http_port: int) -> list:
    """Every sample a server's /metrics shows now (prometheus_client's parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10).read().decode()
    return [sample for fam in text_string_to_metric_families(text) for sample in fam.samples]


async def wait_ready(url: str, timeout_s: float = 60.0, proc: subprocess.Popen | None = None) -> None:
    """Until the server at ``url`` says ServerReady; with ``proc``, fail at once if it exits."""
    deadline = time.monotonic() + timeout_s
    async with grpc.aio.insecure_channel(url) as ch:
        stub = pb_grpc.GRPCInferenceServiceStub(ch)
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode} during start")
            try:
                if (await stub.ServerReady(pb.ServerReadyRequest(), timeout=1)).ready:
                    return
            except grpc.RpcError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} not ready within {timeout_s:.0f}s")


# -- CPU time of a process and its threads, from /proc --------------------------------------------

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _stat_cpu(path: str) -> float:
    """utime + stime in seconds from a /proc stat file (fields 14 and 15; comm may hold spaces)."""
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * _TICK_S


def process_cpu(pid: int) -> float:
    return _stat_cpu(f"/proc/{pid}/stat")


def thread_cpu(pid: int) -> dict[int, float]:
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out[int(tid)] = _stat_cpu(f"/proc/{pid}/task/{tid}/stat")
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            pass
    return out


def self_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


# -- servers started for a run ------------------------------------------------------------------

# The interpreter of a started server. ``-P``: its ``batchgate`` comes from PYTHONPATH or the
# install, never from its working directory: a checkout's root (the cwd below) holds a
# ``batchgate`` folder, which ``python -m`` would otherwise import first, serving this tree where a
# before/after run put another on PYTHONPATH.
PYTHON = [sys.executable, "-P"]


def served_from() -> Path:
    """The folder the servers started now would import ``batchgate.gateway`` from (same
    interpreter flags, environment and working directory): what a before/after run checks."""
    out = subprocess.run(
        [*PYTHON, "-c", "import batchgate.gateway as g; print(g.__file__)"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return Path(out.stdout.strip()).resolve().parent


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Started:
    """A server process this run started (and stops, SIGTERM then SIGKILL)."""

    def __init__(self, name: str, cmd: list[str], url: str, http_url: str = "") -> None:
        self.name = name
        self.url = url
        self.http_url = http_url  # host:port of the REST listener, when it has one
        # a bench measures what it serves: no variant selection switching engines mid-run (unless set)
        env = {"BATCHGATE_VARIANT_SELECTION": "off", **os.environ, "PYTHONUNBUFFERED": "1"}
        self.log = tempfile.TemporaryFile()  # a pipe nobody reads would block a chatty server
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=self.log)

    def stop(self, report: bool = True) -> None:
        """SIGTERM, then SIGKILL after 20 s; with ``report``, the log's tail when it had not
        exited cleanly (a crash in the middle of a bench)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if report and self.proc.returncode not in (0, -signal.SIGTERM):
            self.log.seek(0)
            print(self.log.read().decode(errors="replace")[-2000:], file=sys.stderr)

    def ready(self, timeout_s: float = 60.0) -> None:
        try:
            asyncio.run(wait_ready(self.url, timeout_s))
        except RuntimeError:
            self.stop(report=False)
            self.log.seek(0)
            err = self.log.read().decode(errors="replace")[-2000:]
            raise RuntimeError(f"{self.name} did not become ready at {self.url}\n{err}") from None


def start_batchgate(*extra: str) -> Started:
    grpc_port, http_port = free_ports(2)
    cmd = [
        *PYTHON, "-m", "batchgate", "serve", "--host", "127.0.0.1", "--grpc-port", str(grpc_port),
        "--http-port", str(http_port), "--log-level", "WARNING", *extra,
    ]  # fmt: skip
    return Started("batchgate", cmd, f"127.0.0.1:{grpc_port}", f"127.0.0.1:{http_port}")


# bench/noop_server.py's kinds, by target name
NOOPS = {"noop": (), "noop-suspend": ("--suspend",), "noop-batch": ("--batch",)}


def start_target(target: str, *serve_args: str) -> Started:
    """A bench target by name: a kind of no-op server (``NOOPS``) or ``batchgate`` (with
    ``serve_args``)."""
    if target in NOOPS:
        return start_noop(target)
    if target == "batchgate":
        return start_batchgate(*serve_args)
    raise SystemExit(f"unknown target '{target}' ({', '.join([*NOOPS, 'batchgate'])})")


def start_noop(kind: str = "noop") -> Started:
    """bench/noop_server.py of one of its ``NOOPS`` kinds."""
    (port,) = free_ports(1)
    cmd = [*PYTHON, "-m", "batchgate.bench.noop_server", str(port), *NOOPS[kind]]
    return Started(kind, cmd, f"127.0.0.1:{port}")
