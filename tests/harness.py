"""The gateway in the test's own process: the real ``Server`` (settings, data plane, pipeline, door,
overload gate, schedulers, gRPC and REST listeners on loopback) over a fake worker pool.

Pipeline tests (batching, deadlines, expiry in the queue, the cache, tenants' limits, the gate)
need what the scheduler decides, not what ONNX Runtime computes, and a server process costs each
of them seconds to start and its engines to warm. Here ``serving()`` starts the same objects that
``batchgate serve`` starts (gateway/transport/server.py ``Server``), in the test's event loop, with
``FakePool`` in place of ``workers.WorkerPool``: a batch costs what the test says
(``per_batch_s``, ``per_row_s``), answers each row with a deterministic function of that row alone
(``row_value``), and can be made to fail (``fail_when``) or hang (``hold``). Calls go through the real
transports on loopback sockets (``Gateway.stub``: grpc.aio; ``Gateway.http``: aiohttp), so these tests
depend on the wire protocol, not on the pipeline's Python signatures.

Integration tests keep real server processes (tests/conftest.py ``start_server``) where the process,
the engines or the transport's limits are the point.

    async with serving(model_repo(tmp_path)) as gw:
        gw.pool("encoder").per_batch_s = 0.02
        resp = await gw.stub.ModelInfer(request("encoder", arrays))
        assert output(resp).tobytes() == gw.pool("encoder").expected(arrays)["embedding"].tobytes()

Process-wide state the server sets is set here too, once per process as in a server: the codec's
limits (from the settings), and the collector's freeze of what the first load found (gc.freeze).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

from batchgate.client.client import build_request
from batchgate.proto.inference.v2 import grpc_service_pb2 as pb
from batchgate.proto.inference.v2 import grpc_service_pb2_grpc as pb_grpc
from batchgate.workers import BatchTiming, ShapePlan, read_model_io
from batchgate.workers.pool import WorkerPool

REPO = Path(__file__).resolve().parent.parent / "model_repository"
DATATYPES = {np.dtype(np.float32): "FP32", np.dtype(np.int64): "INT64", np.dtype(np.int32): "INT32"}


class FakeEngineError(RuntimeError):
    """What a batch that ``fail_when`` picks raises (an engine error: the scheduler splits the batch)."""


@dataclass(frozen=True, slots=True)
class Batch:
    """One batch the fake pool ran: each request's rows, when (time.monotonic), and whether it
    failed (``fail_when``)."""

    rows: tuple[int, ...]
    started: float
    ended: float
    failed: bool = False

    @property
    def total(self) -> int:
        return sum(self.rows)


def row_value(arrays: dict[str, np.ndarray], i: int) -> float:
    """Row ``i``'s answer: the exact sum of every value it sent (texts: their lengths), inputs in
    name order. ``math.fsum`` is exact, so the answer does not depend on which batch the row was in
    or where it sat in memory."""
    total = []
    for name in sorted(arrays):
        row = arrays[name][i]
        if row.dtype == object:
            total.append(float(sum(len(x) for x in np.ravel(row))))
        else:
            total.append(math.fsum(np.ravel(row).tolist()))
    return math.fsum(total)


class FakeWorker:
    def __init__(self, name: str) -> None:
        self.name = name
        self.busy_ns = 0
        self.dead = False
        self.engine = None


class FakePool:
    """``workers.WorkerPool``'s interface (what gateway/runtime.py and the scheduler use) without
    engines: ``submit`` runs a batch on one of ``count`` threads per device, each output row filled
    with ``row_value`` of its input row. The shape plan and batching key are the real ones
    (``ShapePlan``, ``WorkerPool.shape_key``), so rows are grouped by bucket as in production.

    Controls, safe to change while calls run: ``per_batch_s`` + ``per_row_s`` x rows is what a batch
    costs, or ``cost(rows)`` when set (slept on the worker thread, reported as its infer time, so
    the latency model learns it);
    ``fail_when(pred)`` fails every batch holding a request whose inputs ``pred`` accepts;
    ``hold()`` makes batches wait (a hung engine) until ``release()``. ``batches`` lists what ran."""

    def __init__(self, name, model_path, devices, count, options=None, buckets=None, fingerprint="") -> None:
        self.name = name
        self.model_path = Path(model_path)
        self.buckets = buckets
        self.fingerprint = fingerprint
        self.plan: ShapePlan | None = None
        self.note = ""
        self.workers = [FakeWorker(f"{name}-{d}-{i}") for d in devices for i in range(count)]
        self.per_batch_s = 0.0
        self.per_row_s = 0.0
        self.cost: Callable[[int], float] | None = None  # seconds a batch of n rows costs (wins over the two)
        self.batches: list[Batch] = []
        self.running = 0  # batches on a worker thread now
        self._fail: Callable[[dict[str, np.ndarray]], bool] | None = None
        self._go = threading.Event()
        self._go.set()
        self._outputs: list = []
        self._executor: ThreadPoolExecutor | None = None
        self._local = threading.local()
        self._next_worker = 0
        self._lock = threading.Lock()
        self._closed = False

    shape_key = WorkerPool.shape_key  # the production batching key, on this pool's plan

    def __len__(self) -> int:
        return len(self.workers)

    def start(self) -> None:
        inputs, self._outputs = read_model_io(self.model_path)
        if self.buckets is not None:
            self.plan = ShapePlan(inputs, self._outputs, self.buckets)
        self._executor = ThreadPoolExecutor(
            len(self.workers), thread_name_prefix=f"fake-{self.name}", initializer=self._bind_worker
        )

    def _bind_worker(self) -> None:
        with self._lock:
            self._local.worker = self.workers[self._next_worker % len(self.workers)]
            self._next_worker += 1

    # -- controls ---------------------------------------------------------------------------------

    def fail_when(self, pred: Callable[[dict[str, np.ndarray]], bool] | None) -> None:
        self._fail = pred

    def hold(self) -> None:
        self._go.clear()

    def release(self) -> None:
        self._go.set()

    @property
    def rows_computed(self) -> int:
        """Rows of the batches that ran to the end."""
        return sum(b.total for b in self.batches if not b.failed)

    def expected(self, arrays: dict[str, np.ndarray], batched: bool = True) -> dict[str, np.ndarray]:
        """What this pool answers for ``arrays``: each output row filled with its input row's
        ``row_value`` (a model without a batch dim: one row, the whole request). Symbolic output
        dims other than the batch are 1."""
        if not batched:
            arrays = {k: v[None] for k, v in arrays.items()}
        values = np.array([row_value(arrays, i) for i in range(len(next(iter(arrays.values()))))])
        out = {}
        for t in self._outputs:
            tail = tuple(d if isinstance(d, int) else 1 for d in t.dims[1:])
            full = np.empty((len(values), *tail), dtype=t.dtype)
            full[...] = values.reshape((-1,) + (1,) * len(tail))
            out[t.name] = full if batched else full[0]
        return out

    # -- the WorkerPool interface ---------------------------------------------------------------------

    def submit(
        self, parts: list[dict[str, np.ndarray]], rows: list[int], batched: bool, outputs=None
    ) -> Future:
        # ``outputs`` (the names a batch reads) is ignored: every row gets every output, a superset.
        if self._closed or self._executor is None:
            raise RuntimeError(f"worker pool '{self.name}' is closed")
        return self._executor.submit(self._run, parts, rows, batched)

    def _run(self, parts, rows, batched):
        t0 = time.monotonic()
        with self._lock:
            self.running += 1
        try:
            self._go.wait()
            cost = self.cost
            delay = cost(sum(rows)) if cost is not None else self.per_batch_s + self.per_row_s * sum(rows)
            if delay > 0:
                time.sleep(delay)
            fail = self._fail
            if fail is not None and any(fail(p) for p in parts):
                self.batches.append(Batch(tuple(rows), t0, time.monotonic(), failed=True))
                raise FakeEngineError(f"fake engine failed on a batch of {sum(rows)} rows (fail_when)")
            outputs = [self.expected(p, batched) for p in parts]
        finally:
            with self._lock:
                self.running -= 1
        t1 = time.monotonic()
        elapsed = int((t1 - t0) * 1e9)
        self._local.worker.busy_ns += elapsed
        self.batches.append(Batch(tuple(rows), t0, t1))
        n = sum(rows)
        return outputs, BatchTiming(infer_ns=elapsed, rows=n, padded_rows=n, tokens=n, padded_tokens=n)

    def summary(self) -> str:
        return f"{len(self.workers)} fake worker(s) (tests/harness.py)"

    def busy_ns(self) -> int:
        return sum(w.busy_ns for w in self.workers)

    def padding(self) -> dict[str, int]:
        n = self.rows_computed
        return {"rows": n, "padded_rows": n, "tokens": n, "padded_tokens": n}

    def device_memory(self) -> dict[str, int]:
        return {}

    def memory_by_pool(self) -> dict[tuple[str, str], int]:
        return {}

    def buffer_memory(self) -> dict[str, dict[str, int]]:
        return {}

    def close(self, timeout_s: float = 5.0) -> None:
        self._closed = True
        self._go.set()  # a held batch must not keep a thread past the test
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)


# -- the gateway ------------------------------------------------------------------------------------


async def until(pred: Callable[[], bool], timeout_s: float = 10.0, what: str = "") -> None:
    """Poll ``pred`` on the event loop (every ms) until it holds; fail after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"not within {timeout_s}s: {what or pred}")
        await asyncio.sleep(0.001)


def request(model: str, arrays: dict[str, np.ndarray], version: str = "", **params) -> pb.ModelInferRequest:
    """A ModelInfer request of ``arrays`` (raw contents), with request ``params``: the client's own."""
    req = build_request(model, arrays, params)
    req.model_version = version
    return req


def rest_body(arrays: dict[str, np.ndarray], **params) -> dict:
    """The KServe v2 JSON document of ``arrays``."""
    doc = {
        "inputs": [
            {"name": n, "shape": list(a.shape), "datatype": DATATYPES[a.dtype], "data": a.ravel().tolist()}
            for n, a in arrays.items()
        ]
    }
    if params:
        doc["parameters"] = params
    return doc


def output(resp: pb.ModelInferResponse, name: str | None = None) -> np.ndarray:
    """An output of a ModelInfer response (raw contents) as an array."""
    for i, t in enumerate(resp.outputs):
        if name is None or t.name == name:
            dtype = {"FP32": np.float32, "INT64": np.int64, "INT32": np.int32}[t.datatype]
            return np.frombuffer(resp.raw_output_contents[i], dtype).reshape(tuple(t.shape))
    raise KeyError(name)


class Gateway:
    """A started in-process server and clients of it on loopback."""

    def __init__(self, server) -> None:
        import aiohttp

        self.server = server
        self.grpc_url = f"127.0.0.1:{server.grpc_port}"
        self.http_url = f"http://127.0.0.1:{server.http_port}"
        self.channel = grpc.aio.insecure_channel(self.grpc_url)
        self.stub = pb_grpc.GRPCInferenceServiceStub(self.channel)
        self.http = aiohttp.ClientSession(self.http_url)

    def pool(self, model: str, version: str = "") -> FakePool:
        """The fake pool under ``model`` (``version``, else the last one loaded)."""
        return self.server.plane.runtimes(model, version)[-1].pool

    async def statistics(self, model: str, version: str = "", metadata=()) -> pb.ModelStatistics:
        req = pb.ModelStatisticsRequest(name=model, version=version)
        return (await self.stub.ModelStatistics(req, metadata=metadata, timeout=10)).model_stats[0]

    async def rest_infer(self, model: str, doc: dict, headers: dict | None = None) -> tuple[int, dict]:
        async with self.http.post(f"/v2/models/{model}/infer", json=doc, headers=headers) as resp:
            return resp.status, await resp.json(content_type=None)

    async def metrics(self) -> list:
        from prometheus_client.parser import text_string_to_metric_families

        async with self.http.get("/metrics") as resp:
            text = await resp.text()
        return [s for fam in text_string_to_metric_families(text) for s in fam.samples]

    async def metric(self, name: str, **labels) -> float:
        """The sum of ``name``'s samples with these labels, from /metrics now."""
        return sum(
            s.value
            for s in await self.metrics()
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        )

    async def wait_metric(self, name: str, at_least: float, timeout_s: float = 10.0, **labels) -> float:
        """Poll /metrics until ``metric(name, **labels)`` reaches ``at_least``; its value then."""
        end = time.monotonic() + timeout_s
        while (value := await self.metric(name, **labels)) < at_least:
            if time.monotonic() > end:
                raise AssertionError(f"{name}{labels} is {value}, not {at_least}, after {timeout_s}s")
            await asyncio.sleep(0.005)
        return value

    async def close(self) -> None:
        await self.channel.close()
        await self.http.close()


def model_repo(
    root: Path, models: dict[str, str] | None = None, versions: dict[str, tuple[str, ...]] | None = None
) -> Path:
    """A repository under ``root`` serving the bundled ``models`` (name -> text appended to its
    config.pbtxt; default ranker and encoder as they are); ``"copy:new"`` as a key serves a twin of
    the bundled ``copy`` named ``new``; ``versions`` (by name) links its model file as those
    versions (default "1"). Model files are linked, not copied."""
    repo = root / "repo"
    for key, extra in (models or {"ranker": "", "encoder": ""}).items():
        src, _, name = key.partition(":")
        name = name or src
        (repo / name).mkdir(parents=True)
        for v in (versions or {}).get(name, ("1",)):
            (repo / name / v).symlink_to(REPO / src / "1", target_is_directory=True)
        text = (REPO / src / "config.pbtxt").read_text().replace(f'name: "{src}"', f'name: "{name}"')
        (repo / name / "config.pbtxt").write_text(text + extra)
    return repo


@contextlib.asynccontextmanager
async def serving(repo: Path, **settings) -> AsyncIterator[Gateway]:
    """The real server over ``repo`` (``model_repo``) with ``FakePool`` workers, on free loopback
    ports, in this event loop; ``settings`` are ``Settings`` fields. Drained and stopped at the end."""
    from batchgate.gateway import runtime
    from batchgate.gateway.config import Settings
    from batchgate.gateway.transport import server as server_mod
    from batchgate.gateway.transport.server import Server

    settings.setdefault("variant_selection", "off")  # no background selection unless the test asks
    s = Settings(  # device cpu: no GPU probe (a fake pool runs anywhere)
        model_repository=repo, host="127.0.0.1", grpc_port=0, http_port=0, device="cpu",
        build_bundled_models=False, drain_linger_s=0.0, **settings,
    )  # fmt: skip
    # The one substitution: the class build_runtime makes a model's pool from. Everything else is
    # the production object graph.
    real = runtime.WorkerPool
    runtime.WorkerPool = FakePool
    server = Server(s)
    gw: Gateway | None = None
    try:
        await server.start()
        pools = [rt.pool for rt in server.plane.runtimes()]
        assert pools and all(isinstance(p, FakePool) for p in pools), (
            "the harness could not put FakePool under the runtimes (did build_runtime stop making its "
            f"pool from gateway.runtime.WorkerPool?): {pools} {server.plane.failures}"
        )
        gw = Gateway(server)
        yield gw
    finally:
        for rt in server.plane.runtimes():
            if isinstance(rt.pool, FakePool):
                rt.pool.release()
        if gw is not None:
            await gw.close()
        # The drain's last step waits for callers to go quiet (~0.5 s); the test's clients are
        # closed already, so the wait is cut short.
        waits = {k: getattr(server_mod, k) for k in ("HOLD_QUIET_S", "GOAWAY_S") if hasattr(server_mod, k)}
        for k in waits:
            setattr(server_mod, k, 0.005)
        try:
            await server.drain_and_stop()
        finally:
            runtime.WorkerPool = real
            for k, v in waits.items():
                setattr(server_mod, k, v)
