"""The data plane behind every transport: the loaded models, their schedulers and worker pools.

Transports (gRPC servicer, HTTP) stay thin: they decode with a model's ``Codec``, call
``ModelRuntime.infer`` and encode the answer.

``reload`` (Triton's RepositoryModelLoad) starts and warms a model's new runtimes beside the
serving ones, swaps them in with one assignment on the event loop, then lets the old ones finish
what they hold and closes them; a reload that fails leaves the serving runtimes untouched.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from batchgate.cache import TieredCache
from batchgate.gateway.budgets import Budget, LatencyClass, SchedulePolicy
from batchgate.gateway.caching import ModelCache, build_cache, model_cache
from batchgate.gateway.codec import Codec
from batchgate.gateway.config import Settings
from batchgate.gateway.errors import not_found, parse_version, unavailable, unknown_model, unknown_version
from batchgate.gateway.preprocess import TextStage
from batchgate.gateway.repository import ConfigError, LoadFailure, ModelSpec, load_model, load_repository, tokenized
from batchgate.gateway.latency import LatencyModel, LoopLag
from batchgate.gateway.queues import DeadlineQueue, FifoQueue
from batchgate.gateway.scheduler import Scheduler
from batchgate.proto.inference.v2 import model_config_pb2 as mc
from batchgate.workers import EngineOptions, WorkerPool, default_cache_dir, discover

log = logging.getLogger(__name__)

_KIND = {mc.ModelInstanceGroup.KIND_GPU: "gpu", mc.ModelInstanceGroup.KIND_CPU: "cpu"}


class ReloadFailed(Exception):
    """A model's directory could not be loaded (config, model file, engine start); the message
    says why. Whatever served before keeps serving."""


@dataclass(slots=True)
class ModelRuntime:
    spec: ModelSpec
    codec: Codec
    pool: WorkerPool
    scheduler: Scheduler
    variable_inputs: tuple[str, ...]  # inputs with a -1 non-batch dim: part of the batching key
    schedule: SchedulePolicy  # Triton's priority levels and queue policies from config.pbtxt
    cache: ModelCache | None = None  # config.pbtxt response_cache on and the server's cache on
    text: TextStage | None = None  # parameter `tokenizer`: texts in, token inputs made in the workers
    inflight: int = 0  # calls inside ``infer``: a runtime swapped out by a reload is closed at 0

    async def infer(
        self, arrays: dict[str, np.ndarray], rows: int, budget: Budget | None = None, *,
        wanted: list[tuple[str, bool]] | None = None, namespace: str | None = None,
    ) -> dict[str, np.ndarray]:  # fmt: skip
        """``wanted`` (Codec.requested) and ``namespace`` (the tenant's) only shape cache keys."""
        # Counted from the first line: callers get the runtime and call this with no await in
        # between, so a reload never closes a runtime that a call is about to enter.
        self.inflight += 1
        try:
            return await self._infer(arrays, rows, budget, wanted, namespace)
        finally:
            self.inflight -= 1

    async def _infer(self, arrays, rows, budget, wanted, namespace) -> dict[str, np.ndarray]:
        if self.text is not None:  # checks the texts; the key is their estimated length bucket
            key = batch_key = await self.text.admit(arrays)
        else:
            key = tuple(arrays[n].shape[1:] for n in self.variable_inputs) if self.variable_inputs else None
            # The batcher groups by length bucket (lengths 20 and 30 share a batch padded to 32);
            # the cache keeps the exact shapes, which its keys describe.
            batch_key = self.pool.shape_key(arrays) if key is not None else None
        if self.cache is None:
            return await self.scheduler.infer(arrays, rows, batch_key, budget)
        sched = self.scheduler
        return await self.cache.infer(
            arrays, rows, lambda a, n: sched.infer(a, n, batch_key, budget), wanted, namespace
        )


@dataclass(slots=True)
class DataPlane:
    settings: Settings
    models: dict[str, dict[str, ModelRuntime]] = field(default_factory=dict)
    latest: dict[str, str] = field(default_factory=dict)
    failures: dict[str, LoadFailure] = field(default_factory=dict)
    loaded: bool = False
    draining: bool = False
    last_refused: float = 0.0  # monotonic time of the last request refused while draining
    classes: dict[str, LatencyClass] = field(default_factory=dict)
    cache: TieredCache | None = None  # result cache tiers shared by every model that enables it
    lag: LoopLag = field(default_factory=LoopLag)  # the event loop's lag, a margin for every deadline
    _reload_locks: dict[str, asyncio.Lock] = field(default_factory=dict)  # one load/unload per model at a time

    def __post_init__(self) -> None:
        self.classes = self.settings.classes

    @property
    def ready(self) -> bool:
        if not self.loaded or self.draining:
            return False
        return not (self.settings.strict_readiness and self.failures)

    async def load(self) -> None:
        self.lag.start()
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
                    "loaded model %s version %s: %s; max_batch_size=%d, inputs %s",
                    name, version, rt.pool.summary(), spec.max_batch_size, rt.codec.expected,
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
        text = await asyncio.to_thread(TextStage, spec) if tokenized(spec.config) else None
        options = EngineOptions(intra_op_threads=s.intra_op_threads, inter_op_threads=s.inter_op_threads,
                                preprocess=text, mode=s.engine_mode, warmup=s.engine_warmup,
                                cache_dir=(s.engine_cache_dir or default_cache_dir()) if s.engine_cache else None,
                                cuda_graphs=s.cuda_graphs)  # fmt: skip
        name = f"{spec.name}-v{spec.version}"
        pool = WorkerPool(name, spec.path, devices, count, options, spec.buckets, spec.fingerprint)
        await asyncio.to_thread(pool.start)
        # A text batch over its token budget leaves as several, spread over the workers.
        execute = text.budgeted(pool.submit) if text is not None else pool.submit
        schedule = SchedulePolicy.from_config(spec.config)
        latency = LatencyModel()
        queue: DeadlineQueue | FifoQueue
        # A model may override the server's policy (parameter scheduling_policy), e.g. to keep
        # Triton's FIFO semantics for one model while the rest are scheduled by deadline.
        policy = spec.params.scheduling_policy or s.scheduling_policy
        if policy == "deadline":
            queue = DeadlineQueue(
                max_batch_size=spec.max_batch_size,
                preferred=spec.preferred_batch_sizes,
                max_delay_s=spec.max_queue_delay_s,
                classes=self.classes,
                latency=latency,
                level_queue_sizes={lvl: p.max_queue_size for lvl, p in schedule.policies.items()},
                default_class=s.default_latency_class,
                lag=self.lag,
                margin_s=s.deadline_margin_ms / 1000,
                cap_fraction=s.batch_time_cap,
                row_limit=text.row_limit if text is not None else None,
                learn_limit=spec.params.learned_batch_limit,
            )
        else:
            queue = FifoQueue(
                max_batch_size=spec.max_batch_size,
                preferred=spec.preferred_batch_sizes,
                max_delay_s=spec.max_queue_delay_s,
                max_queue_size=spec.max_queue_size,
            )
        scheduler = Scheduler(
            f"{spec.name}:{spec.version}", queue, execute, slots=len(pool), batched=spec.batched, latency=latency,
            split_failures=True,
        )
        scheduler.start()
        variable = tuple(t.name for t in spec.inputs if -1 in t.dims)
        if spec.config.response_cache.enable and self.cache is None:
            self.cache = await build_cache(s)  # built when the first model asks for it
        return ModelRuntime(spec, Codec(spec), pool, scheduler, variable, schedule, model_cache(spec, self.cache), text)

    async def reload(self, name: str) -> None:
        """Load model ``name`` again from its directory (config, versions, model files): start and
        warm the new runtimes, swap them in, then drain and close the old ones. Raises
        ``ReloadFailed`` (old runtimes untouched and serving), or NOT_FOUND / UNAVAILABLE."""
        if self.draining:
            raise unavailable("server is draining; load the model on another replica")
        root = Path(self.settings.model_repository)
        if Path(name).name != name or name.startswith((".", "_")) or not (root / name).is_dir():
            raise not_found(f"no model directory '{name}' in the repository {root}")
        async with self._reload_locks.setdefault(name, asyncio.Lock()):
            try:
                specs = await asyncio.to_thread(load_model, root / name, self.settings.default_max_batch_size)
            except ConfigError as exc:
                raise self._reload_failed(name, str(exc)) from None
            if not specs:
                raise self._reload_failed(name, f"model '{name}': no version to serve")
            fresh: dict[str, ModelRuntime] = {}
            for spec in specs:
                try:
                    fresh[spec.version] = await self._start(spec)
                except Exception as exc:
                    await self._retire(list(fresh.values()), wait=False)
                    raise self._reload_failed(name, f"model '{name}' version {spec.version} failed to start: {exc}") from None
            old = self.models.get(name, {})
            # The swap: one step on the event loop, so every call sees either the old runtimes or the new.
            self.models[name] = fresh
            self.latest[name] = max(fresh, key=int)
            self.failures.pop(name, None)
            for path in specs[0].ignored:
                log.warning("model %s: config field '%s' is not implemented by batchgate and is ignored", name, path)
            log.info(
                "reloaded model %s: version(s) %s serving (were %s), fingerprint %s",
                name, sorted(fresh, key=int), sorted(old, key=int) or "none", specs[-1].fingerprint,
                extra={"event": "model_reloaded", "model": name},
            )  # fmt: skip
            await self._retire(list(old.values()))

    async def unload(self, name: str) -> None:
        """Stop serving ``name``: new calls get NOT_FOUND, accepted ones are answered first."""
        async with self._reload_locks.setdefault(name, asyncio.Lock()):
            old = self.models.pop(name, None)
            if old is None:
                raise not_found(f"model '{name}' is not loaded; loaded models: {sorted(self.models)}")
            self.latest.pop(name, None)
            log.info("unloading model %s", name, extra={"event": "unload", "model": name})
            await self._retire(list(old.values()))

    def _reload_failed(self, name: str, reason: str) -> ReloadFailed:
        serving = self.models.get(name)
        if serving:
            log.error(
                "reload of model %s failed; version(s) %s keep serving: %s", name, sorted(serving, key=int), reason,
                extra={"event": "model_reload_failed", "model": name},
            )  # fmt: skip
            return ReloadFailed(f"{reason} (the previous load keeps serving)")
        self.failures[name] = LoadFailure(name, "", reason)  # not serving: RepositoryIndex says why
        log.error("model %s failed to load: %s", name, reason, extra={"event": "model_load_failed", "model": name})
        return ReloadFailed(reason)

    async def _retire(self, rts: list[ModelRuntime], wait: bool = True) -> None:
        """Close runtimes that no call can reach any more, once the calls inside them are answered
        (at most drain_timeout_s; what is left then gets UNAVAILABLE)."""
        for rt in rts:
            end = time.monotonic() + self.settings.drain_timeout_s
            while wait and rt.inflight and time.monotonic() < end:
                await asyncio.sleep(0.01)
            await rt.scheduler.close()
            await asyncio.to_thread(rt.pool.close)

    def get(self, name: str, version: str = "") -> ModelRuntime:
        version = parse_version(version)  # Triton checks the version string before the model
        versions = self.models.get(name)
        if versions is None:
            failure = self.failures.get(name)
            if failure is not None:
                raise unavailable(f"model '{name}' is not ready: {failure.reason}")
            raise unknown_model(name)
        rt = versions.get(version or self.latest[name])
        if rt is None:
            raise unknown_version(name, version, sorted(versions, key=int))
        if self.draining:
            raise unavailable("server is draining; retry on another replica")
        return rt

    def runtimes(self, name: str = "", version: str = "") -> list[ModelRuntime]:
        if not name:
            return [rt for versions in self.models.values() for rt in versions.values()]
        versions = self.models.get(name)
        if versions is None:
            raise unknown_model(name)
        version = parse_version(version)
        if not version:
            return list(versions.values())
        if version not in versions:
            raise unknown_version(name, version)
        return [versions[version]]

    async def drain(self, timeout_s: float) -> bool:
        """Refuse new work and wait for every accepted request to be answered."""
        self.draining = True
        rts = self.runtimes()
        results = await asyncio.gather(*(rt.scheduler.drain(timeout_s) for rt in rts))
        return all(results)

    async def close(self) -> None:
        self.lag.stop()
        for rt in self.runtimes():
            await rt.scheduler.close()
            await asyncio.to_thread(rt.pool.close)
        if self.cache is not None:
            await self.cache.close()  # sends what is queued for Redis, briefly

