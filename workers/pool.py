"""Data-parallel worker pool: N threads, each owning its own engine.

ONNX Runtime releases the GIL while a session runs, so threads give real parallelism for the
compute; each thread owns its session outright (no locks on the hot path). A batch goes to the
least-loaded worker. An exception in a batch fails that batch's future only; the thread keeps
serving.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from workers.devices import Device
from workers.engine import BatchTiming, Engine, EngineOptions

log = logging.getLogger(__name__)

BatchResult = tuple[list[dict[str, np.ndarray]], BatchTiming]


@dataclass(slots=True)
class _Job:
    parts: list[dict[str, np.ndarray]]
    rows: list[int]
    batched: bool
    future: Future


class _Worker:
    def __init__(self, name: str, model_path: Path, device: Device, options: EngineOptions) -> None:
        self.name = name
        self.device = device
        self.outstanding = 0  # batches queued or running; only changed under the pool's lock
        self.busy_ns = 0
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._engine: Engine | None = None
        self._args = (model_path, device, options)
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def wait_ready(self) -> None:
        self._ready.wait()
        if self._error is not None:
            raise self._error

    def put(self, job: _Job | None) -> None:
        self._jobs.put(job)

    def _main(self) -> None:
        try:
            self._engine = Engine(*self._args)
        except BaseException as exc:  # reported to whoever waits for readiness
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        engine = self._engine
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if not job.future.set_running_or_notify_cancel():
                continue
            try:
                result = engine.run_batch(job.parts, job.rows, job.batched)
            except BaseException as exc:  # one bad batch must not take the worker down
                job.future.set_exception(exc)
            else:
                self.busy_ns += result[1].input_ns + result[1].infer_ns + result[1].output_ns
                job.future.set_result(result)


class WorkerPool:
    """``count`` workers per device, all serving the same model file."""

    def __init__(
        self, name: str, model_path: Path, devices: list[Device], count: int, options: EngineOptions
    ) -> None:
        if count < 1:
            raise ValueError(f"worker count must be >= 1, got {count}")
        self.name = name
        self._lock = threading.Lock()
        self.workers = [
            _Worker(f"{name}-{dev}-{i}", model_path, dev, options) for dev in devices for i in range(count)
        ]
        self._closed = False

    def __len__(self) -> int:
        return len(self.workers)

    def start(self) -> None:
        """Create every worker's engine (blocking; call it off the event loop)."""
        for w in self.workers:
            w.start()
        try:
            for w in self.workers:
                w.wait_ready()
        except BaseException:
            self.close()
            raise

    def submit(self, parts: list[dict[str, np.ndarray]], rows: list[int], batched: bool) -> Future:
        """Queue one batch on the least-loaded worker; the future yields ``(outputs, timing)``."""
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"worker pool '{self.name}' is closed")
            worker = min(self.workers, key=lambda w: w.outstanding)
            worker.outstanding += 1
        future.add_done_callback(lambda _f, w=worker: self._done(w))
        worker.put(_Job(parts, rows, batched, future))
        return future

    def _done(self, worker: _Worker) -> None:
        with self._lock:
            worker.outstanding -= 1

    def busy_ns(self) -> int:
        return sum(w.busy_ns for w in self.workers)

    def close(self, timeout_s: float = 5.0) -> None:
        with self._lock:
            self._closed = True
        for w in self.workers:
            w.put(None)
        for w in self.workers:
            if w.thread.is_alive():
                w.thread.join(timeout_s)
