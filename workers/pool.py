"""Data-parallel worker pool: N threads, each owning its own engine.

ONNX Runtime releases the GIL while a session runs, so threads give real parallelism for the
compute; each thread owns its session outright (no locks on the hot path). A batch goes to the
least-loaded worker. An exception in a batch fails that batch's future only; the thread keeps
serving. A worker thread that dies anyway (an exception outside the per-batch guard) is replaced
by a new thread on the same queue, with a fresh engine, so the pool keeps its size; the batch it
held runs once more on the least-loaded other worker, and fails with ``WorkerDied`` if that
worker dies on it too.

With a ``BucketConfig`` the pool reads the model's inputs and outputs at start, plans its shape
buckets (``workers.buckets``) and has every worker build and warm all of them before ``start``
returns, so a model is never ready with a cold bucket. ``shape_key`` gives the batcher the key
that groups rows by bucket. Every device, a GPU as the CPU, gets ``count`` workers; each worker
has its own engines, buffers and, on a GPU, its own CuPy stream and memory pool and its own ORT
sessions (each on the CUDA provider's own stream), so N workers on one GPU overlap their copies
and kernels instead of queueing behind one thread.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Hashable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from batchgate.workers.buckets import BucketConfig, ShapePlan, read_model_io
from batchgate.workers.devices import Device
from batchgate.workers.engine import Engine, EngineOptions

log = logging.getLogger(__name__)

# Test-only fault injection (tests/test_faults.py, docs/faults.md): with N > 0 the first worker
# thread to take its (N+1)-th batch dies holding it, outside the per-batch guard, the way a thread
# killed by a bug would. Once per process. Unset in production: one integer test per batch.
_KILL_AFTER = int(os.environ.get("BATCHGATE_TEST_KILL_WORKER_AFTER", "0") or 0)
_kill_lock = threading.Lock()
_killed = False


def _name_os_thread(name: str) -> None:
    """Give the calling thread ``name`` at the OS level too (Linux keeps 15 bytes), so that
    ``top -H``, ``/proc/PID/task/*/comm`` and profilers tell the workers from gRPC's and the
    event loop's threads; Python before 3.14 leaves every thread named after the process."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):  # not Linux: the Python name still shows in logs
        pass


class WorkerDied(RuntimeError):
    """The worker thread running a batch died (twice: the batch is retried once)."""


@dataclass(slots=True)
class _Job:
    parts: list[dict[str, np.ndarray]]
    rows: list[int]
    batched: bool
    future: Future
    outputs: tuple[str, ...] | None = None  # the names to fetch; None: the engine's defaults
    worker: _Worker | None = None  # whose ``outstanding`` counts it (moves when retried)
    retried: bool = False  # its worker died holding it; the future is already running


class _Worker:
    def __init__(self, name: str, model_path: Path, device: Device, options: EngineOptions) -> None:
        self.name = name
        self.device = device
        self.outstanding = 0  # batches queued or running; only changed under the pool's lock
        self.busy_ns = 0
        # Padding totals over this worker's batches (plain counters; only this thread writes them).
        self.rows = self.padded_rows = self.tokens = self.padded_tokens = 0
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._engine: Engine | None = None
        self._model_path = model_path
        self._options = options
        self.plan: ShapePlan | None = None
        self.fingerprint = ""
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.taken = 0  # batches taken by this thread generation
        self.restarts = 0
        self.dead = False  # a replacement failed to start: no batch is sent here any more
        # Called from the dying thread as on_death(worker, held_job | None, exc); set by the pool.
        self.on_death = None

    def start(self) -> None:
        self.thread.start()

    def restart(self) -> None:
        """A new thread on the same queue and counters; it builds a fresh engine before serving."""
        self.restarts += 1
        self.taken = 0
        self._engine = None
        self._error = None
        self._ready.clear()
        self.thread = threading.Thread(target=self._main, name=f"{self.name}-r{self.restarts}", daemon=True)
        self.thread.start()

    def fail_queued(self, exc: BaseException) -> None:
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None and not job.future.done():
                if job.retried or job.future.set_running_or_notify_cancel():
                    job.future.set_exception(exc)

    def wait_ready(self) -> None:
        self._ready.wait()
        if self._error is not None:
            raise self._error

    def put(self, job: _Job | None) -> None:
        self._jobs.put(job)

    @property
    def engine(self) -> Engine | None:
        return self._engine

    def _main(self) -> None:
        _name_os_thread(f"bg:{self.name}")
        try:
            self._engine = Engine(self._model_path, self.device, self._options, self.plan, self.fingerprint)
            self._engine.warm_up()
        except BaseException as exc:  # reported to whoever waits for readiness
            self._error = exc
            self._ready.set()
            if self.restarts:  # a replacement: nobody waits for it, so answer its queue here
                self.dead = True
                log.error(
                    "%s: replacement worker failed to start, batches sent to it fail: %s", self.name, exc
                )
                self.fail_queued(
                    WorkerDied(f"worker {self.name} died and its replacement failed to start: {exc}")
                )
            return
        self._ready.set()
        if self.restarts:
            log.warning("%s: replacement worker thread %s serving", self.name, self.thread.name)
        engine = self._engine
        job: _Job | None = None
        try:
            while True:
                job = None
                job = self._jobs.get()
                if job is None:
                    return
                if not (job.retried or job.future.set_running_or_notify_cancel()):
                    continue
                self.taken += 1
                if _KILL_AFTER and self.taken > _KILL_AFTER:
                    _test_kill(self.name)
                try:
                    plan = self.plan
                    if plan is None:
                        result = engine.run_batch(job.parts, job.rows, job.batched, job.outputs)
                    else:  # config `reshape`: the model sees its own shapes, the caller the config's
                        parts = plan.to_model(job.parts, job.batched)
                        outs, timing = engine.run_batch(parts, job.rows, job.batched, job.outputs)
                        result = (plan.to_client(outs, job.batched), timing)
                except BaseException as exc:  # one bad batch must not take the worker down
                    job.future.set_exception(exc)
                else:
                    t = result[1]
                    self.busy_ns += t.input_ns + t.infer_ns + t.output_ns
                    self.rows += t.rows
                    self.padded_rows += t.padded_rows
                    self.tokens += t.tokens
                    self.padded_tokens += t.padded_tokens
                    job.future.set_result(result)
        except BaseException as exc:  # the thread is dying: whatever it held must still be answered
            held = job if job is not None and not job.future.done() else None
            if self.on_death is None:
                if held is not None:
                    held.future.set_exception(WorkerDied(f"worker {self.name} died: {exc!r}"))
                raise
            self.on_death(self, held, exc)


def _span(sizes, what: str) -> str:
    """``[1, 2, 4, ..., 64]`` as ``7 batch sizes 1-64``."""
    sizes = list(sizes)
    if len(sizes) == 1:
        return f"{what} {sizes[0]}"
    return f"{len(sizes)} {what} {sizes[0]}-{sizes[-1]}"


def _test_kill(name: str) -> None:
    global _killed
    with _kill_lock:
        if _killed:
            return
        _killed = True
    raise SystemExit(f"BATCHGATE_TEST_KILL_WORKER_AFTER={_KILL_AFTER}: worker {name} killed by the test hook")


class WorkerPool:
    """``count`` workers per device (CPU or GPU), all serving the same model file.

    ``buckets`` None keeps the plain dynamic-shape engines (no padding, no pools).
    """

    def __init__(
        self,
        name: str,
        model_path: Path,
        devices: list[Device],
        count: int,
        options: EngineOptions,
        buckets: BucketConfig | None = None,
        fingerprint: str = "",
    ) -> None:
        if count < 1:
            raise ValueError(f"worker count must be >= 1, got {count}")
        self.name = name
        self.model_path = Path(model_path)
        self.buckets = buckets
        self.fingerprint = fingerprint
        self.plan: ShapePlan | None = None
        self._lock = threading.Lock()
        self.workers = []
        for dev in devices:
            self.workers.extend(_Worker(f"{name}-{dev}-{i}", model_path, dev, options) for i in range(count))
        self.note = ""  # why the model runs where it does (gateway/runtime.py), for summary()
        for w in self.workers:
            w.on_death = self._worker_died
        self._closed = False

    def __len__(self) -> int:
        return len(self.workers)

    def start(self) -> None:
        """Plan the buckets, then create and warm every worker's engines (blocking; call it off
        the event loop). Returns when every bucket of every worker has run once."""
        if self.buckets is not None and self.plan is None:
            inputs, outputs = read_model_io(self.model_path)
            self.plan = ShapePlan(inputs, outputs, self.buckets)
            if self.plan.pooled:  # summary() puts this in the model's one startup line
                log.debug("%s: buckets %s", self.name, self.plan.describe())
            else:
                log.debug("%s: dynamic shapes, no buffer pools (%s)", self.name, self.plan.why_not_pooled)
        for w in self.workers:
            w.plan = self.plan
            w.fingerprint = self.fingerprint
            w.start()
        try:
            for w in self.workers:
                w.wait_ready()
        except BaseException:
            self.close()
            raise

    def summary(self) -> str:
        """One phrase for the model's startup line: workers, devices, engines and shape buckets.
        Every worker builds the same buckets, so the first live one speaks for all."""
        devices = ",".join(sorted({str(w.device) for w in self.workers}))
        text = f"{len(self.workers)} worker(s) on {devices}" + (f" ({self.note})" if self.note else "")
        plan = self.plan
        if plan is None or not plan.pooled:
            why = f" ({plan.why_not_pooled})" if plan is not None and plan.why_not_pooled else ""
            return f"{text}, dynamic shapes{why}"
        engine = next((w.engine for w in self.workers if w.engine is not None), None)
        bound, run, seconds = getattr(engine, "warmed", (0, 0, 0.0))
        graphs = " with CUDA graphs" if getattr(engine, "cuda_graphs", False) else ""
        mode = f", {engine.mode} engines{graphs}" if engine is not None else ""
        if engine is not None and engine.options.engine == "openvino":
            mode = f", {engine.mode} OpenVINO {engine.factory.precision.upper()} engines"
        dims = [_span(plan.batch_sizes, "batch sizes")]
        for g in plan.groups:
            dims.append(_span(g.buckets, f"{g.name} lengths") if g.buckets else f"exact {g.name} lengths")
        cap = f", <= {plan.max_batch_tokens} tokens a batch" if plan.max_batch_tokens else ""
        if bound:
            return f"{text}{mode}, {bound} buckets ({' x '.join(dims)}{cap}), {run} warmed in {seconds:.2f}s"
        # Exact (unbucketed) lengths: an engine binds each length the first time a batch has it.
        return f"{text}{mode}, {' x '.join(dims)} (bound on first use{cap})"

    def submit(
        self, parts: list[dict[str, np.ndarray]], rows: list[int], batched: bool,
        outputs: tuple[str, ...] | None = None,
    ) -> Future:  # fmt: skip
        """Queue one batch on the least-loaded worker; the future yields ``(outputs, timing)``.
        ``outputs``: the output names to fetch (None: the engine's defaults)."""
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"worker pool '{self.name}' is closed")
            live = [w for w in self.workers if not w.dead]
            if not live:
                raise RuntimeError(
                    f"worker pool '{self.name}' has no live worker (replacements failed to start)"
                )
            worker = min(live, key=lambda w: w.outstanding)
            worker.outstanding += 1
            job = _Job(parts, rows, batched, future, outputs, worker)
        future.add_done_callback(lambda _f, j=job: self._done(j))
        worker.put(job)
        return future

    def _done(self, job: _Job) -> None:
        with self._lock:
            job.worker.outstanding -= 1

    def _worker_died(self, worker: _Worker, job: _Job | None, exc: BaseException) -> None:
        """Runs on the dying thread: start its replacement, and answer or re-run the batch it held."""
        with self._lock:
            closed = self._closed
            target = None
            if job is not None and not job.retried and not closed:
                # Prefer another worker: this one first has to build and warm a new engine.
                target = min(
                    (w for w in self.workers if not w.dead), key=lambda w: (w is worker, w.outstanding)
                )
                job.worker.outstanding -= 1
                target.outstanding += 1
                job.worker, job.retried = target, True
        held = "no batch" if job is None else f"a batch of {sum(job.rows)} rows"
        if closed:
            log.warning("%s: worker thread died during close (%r), holding %s", worker.name, exc, held)
            err = WorkerDied(f"worker {worker.name} died while the pool was closing: {exc!r}")
            if job is not None:
                job.future.set_exception(err)
            worker.fail_queued(err)
            return
        log.error(
            "%s: worker thread %s died (%r) holding %s; starting a replacement%s", worker.name,
            worker.thread.name, exc, held,
            "" if job is None else (f", the batch runs again on {target.name}" if target else ", the batch fails"),
        )  # fmt: skip
        if target is not None:
            target.put(job)
        elif job is not None:
            job.future.set_exception(
                WorkerDied(f"worker {worker.name} died running this batch, twice: {exc!r}")
            )
        worker.restart()

    def shape_key(self, arrays: dict[str, np.ndarray]) -> Hashable:
        """The batcher's key for a request: the bucket of each variable dim (exact lengths where
        a dim is not bucketed), so rows that can share a padded batch share a key."""
        plan = self.plan
        if plan is None or not plan.groups:
            return tuple(a.shape[1:] for a in arrays.values()) if plan is None else None
        return plan.key(arrays)

    def busy_ns(self) -> int:
        return sum(w.busy_ns for w in self.workers)

    def padding(self) -> dict[str, int]:
        """Totals since start: rows and tokens sent vs computed (padded); their ratios are the waste."""
        out = {"rows": 0, "padded_rows": 0, "tokens": 0, "padded_tokens": 0}
        for w in self.workers:
            out["rows"] += w.rows
            out["padded_rows"] += w.padded_rows
            out["tokens"] += w.tokens
            out["padded_tokens"] += w.padded_tokens
        return out

    def device_memory(self) -> dict[str, int]:
        """Bytes in use per device: on a GPU what the driver reports used (ORT arenas, buffers, the
        CUDA context); on the CPU the pooled buffers of the workers on it."""
        out: dict[str, int] = {}
        for w in self.workers:
            e = w.engine
            if e is None:
                continue
            key = str(w.device)
            if w.device.kind == "gpu":
                out[key] = e.device_memory()  # the whole device: the same for every engine on it
            else:
                out[key] = out.get(key, 0) + e.device_memory()
        return out

    def memory_by_pool(self) -> dict[tuple[str, str], int]:
        """Bytes by (device, memory pool), for batchgate_device_memory_bytes: ``io_buffers`` the
        workers' pooled input/output buffers on the device (CuPy pool on a GPU, numpy on the CPU),
        ``pinned_host`` a GPU worker's pinned staging buffers, ``driver_used`` what the driver
        reports used on the GPU (ORT arenas, CUDA contexts, other processes: the whole device)."""
        out: dict[tuple[str, str], int] = {}
        for w in self.workers:
            e = w.engine
            if e is None:
                continue
            dev = str(w.device)
            host, device = e.buffer_bytes()
            if w.device.kind == "gpu":
                out[(dev, "io_buffers")] = out.get((dev, "io_buffers"), 0) + device
                out[(dev, "pinned_host")] = out.get((dev, "pinned_host"), 0) + host
                out[(dev, "driver_used")] = e.device_memory()
            else:
                out[(dev, "io_buffers")] = out.get((dev, "io_buffers"), 0) + host
        return out

    def buffer_memory(self) -> dict[str, dict[str, int]]:
        """Per worker: host and device bytes held by its pooled buffers, and its bucket count."""
        out = {}
        for w in self.workers:
            e = w.engine
            if e is not None:
                host, dev = e.buffer_bytes()
                out[w.name] = {"host_bytes": host, "device_bytes": dev, "buckets": len(e._slots)}
        return out

    def close(self, timeout_s: float = 5.0) -> None:
        with self._lock:
            self._closed = True
        for w in self.workers:
            w.put(None)
        for w in self.workers:
            if w.thread.is_alive():
                w.thread.join(timeout_s)
