"""The data plane behind every transport: the loaded models, their schedulers and worker pools.

Transports (gRPC servicer, HTTP) stay thin: they decode with a model's ``Codec``, call
``ModelRuntime.infer`` and encode the answer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gateway.codec import Codec
from gateway.config import Settings
from gateway.errors import GatewayError, Kind, not_found, unavailable
from gateway.repository import LoadFailure, ModelSpec, load_repository
from gateway.scheduler import BatchQueue, Scheduler
from proto.inference.v2 import model_config_pb2 as mc
from workers import EngineOptions, WorkerPool, discover

log = logging.getLogger(__name__)

_KIND = {mc.ModelInstanceGroup.KIND_GPU: "gpu", mc.ModelInstanceGroup.KIND_CPU: "cpu"}


@dataclass(slots=True)
class ModelRuntime:
    spec: ModelSpec
    codec: Codec
    pool: WorkerPool
    scheduler: Scheduler
    variable_inputs: tuple[str, ...]  # inputs with a -1 non-batch dim: part of the batching key

    async def infer(self, arrays: dict[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
        key = tuple(arrays[n].shape[1:] for n in self.variable_inputs) if self.variable_inputs else None
        return await self.scheduler.infer(arrays, rows, key)


@dataclass(slots=True)
class DataPlane:
    settings: Settings
    models: dict[str, dict[str, ModelRuntime]] = field(default_factory=dict)
    latest: dict[str, str] = field(default_factory=dict)
    failures: dict[str, LoadFailure] = field(default_factory=dict)
    loaded: bool = False
    draining: bool = False
    last_refused: float = 0.0  # monotonic time of the last request refused while draining
    started_at: float = field(default_factory=time.time)

    @property
    def ready(self) -> bool:
        if not self.loaded or self.draining:
            return False
        return not (self.settings.strict_readiness and self.failures)

    async def load(self) -> None:
        root = Path(self.settings.model_repository)
        repo = await asyncio.to_thread(load_repository, root, self.settings.default_max_batch_size)
        self.failures.update(repo.failures)
        for name, versions in repo.models.items():
            for version, spec in versions.items():
                try:
                    rt = await self._start(spec)
                except Exception as exc:
                    self.failures[name] = LoadFailure(name, version, f"failed to start: {exc}")
                    log.error("model %s version %s failed to start: %s", name, version, exc)
                    continue
                self.models.setdefault(name, {})[version] = rt
                log.info(
                    "loaded model %s version %s: max_batch_size=%d, %d worker(s) on %s, inputs %s",
                    name, version, spec.max_batch_size, len(rt.pool),
                    ",".join(sorted({str(w.device) for w in rt.pool.workers})),
                    rt.codec.expected,
                )  # fmt: skip
            if name in self.models:
                self.latest[name] = max(self.models[name], key=int)
        self.loaded = True

    async def _start(self, spec: ModelSpec) -> ModelRuntime:
        s = self.settings
        devices = []
        count = 1
        for group in spec.config.instance_group:
            kind = "cpu" if s.device == "cpu" else _KIND.get(group.kind, "auto")
            devices.extend(d for d in discover(kind, tuple(group.gpus)) if d not in devices)
            count = max(count, group.count or 1)
        if s.workers_per_device:
            count = s.workers_per_device
        options = EngineOptions(intra_op_threads=s.intra_op_threads, inter_op_threads=s.inter_op_threads)
        pool = WorkerPool(f"{spec.name}-v{spec.version}", spec.path, devices, count, options)
        await asyncio.to_thread(pool.start)
        queue = BatchQueue(
            max_batch_size=spec.max_batch_size,
            preferred=spec.preferred_batch_sizes,
            max_delay_s=spec.max_queue_delay_s,
            max_queue_size=spec.max_queue_size,
        )
        scheduler = Scheduler(f"{spec.name}:{spec.version}", queue, pool.submit, slots=len(pool), batched=spec.batched)
        scheduler.start()
        variable = tuple(t.name for t in spec.inputs if -1 in t.dims)
        return ModelRuntime(spec, Codec(spec), pool, scheduler, variable)

    def get(self, name: str, version: str = "") -> ModelRuntime:
        versions = self.models.get(name)
        if versions is None:
            failure = self.failures.get(name)
            if failure is not None:
                raise unavailable(f"model '{name}' is not ready: {failure.reason}")
            raise not_found(f"unknown model '{name}'; served models: {sorted(self.models)}")
        rt = versions.get(version or self.latest[name])
        if rt is None:
            raise not_found(f"model '{name}' has no version '{version}'; served versions: {sorted(versions, key=int)}")
        if self.draining:
            raise unavailable("server is draining; retry on another replica")
        return rt

    def runtimes(self, name: str = "", version: str = "") -> list[ModelRuntime]:
        if not name:
            return [rt for versions in self.models.values() for rt in versions.values()]
        versions = self.models.get(name)
        if versions is None:
            raise not_found(f"unknown model '{name}'")
        if not version:
            return list(versions.values())
        if version not in versions:
            raise not_found(f"model '{name}' has no version '{version}'")
        return [versions[version]]

    async def drain(self, timeout_s: float) -> bool:
        """Refuse new work and wait for every accepted request to be answered."""
        self.draining = True
        rts = self.runtimes()
        results = await asyncio.gather(*(rt.scheduler.drain(timeout_s) for rt in rts))
        return all(results)

    async def close(self) -> None:
        for rt in self.runtimes():
            await rt.scheduler.close()
            await asyncio.to_thread(rt.pool.close)


def status_kind(exc: BaseException) -> Kind:
    return exc.kind if isinstance(exc, GatewayError) else Kind.FAILED
