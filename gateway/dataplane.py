"""The data plane behind every transport: the registry of loaded model runtimes (runtime.py):
get, load, reload, unload, drain.

Transports (gRPC servicer, HTTP) stay thin: they decode with a model's ``Codec``, call
``ModelRuntime.infer`` and encode the answer.

``reload`` (Triton's RepositoryModelLoad) starts and warms a model's new runtimes beside the
serving ones, swaps them in with one assignment on the event loop, then lets the old ones finish
what they hold and closes them; a reload that fails leaves the serving runtimes untouched.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from batchgate.cache import RedisLink, TieredCache
from batchgate.gateway.config import Settings
from batchgate.gateway.errors import not_found, parse_version, unavailable, unknown_model, unknown_version
from batchgate.gateway.repository import (
    ConfigError,
    LoadFailure,
    ModelSpec,
    Repository,
    load_model,
    load_repository,
)
from batchgate.gateway.result_cache import build_cache
from batchgate.gateway.runtime import ModelRuntime, build_runtime
from batchgate.gateway.scheduling import LatencyClass, LoopLag
from batchgate.gateway.selection import Selector, recorded_variant

__all__ = ["DataPlane", "ModelRuntime", "ReloadFailed"]

log = logging.getLogger(__name__)

_gc_frozen = False  # once per process: the first load's start-up objects


class ReloadFailed(Exception):
    """A model's directory could not be loaded (config, model file, engine start); the message
    says why. Whatever served before keeps serving."""


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
    batch_class: str | None = None  # a call of several rows that states no budget (settings.batch_class)
    cache: TieredCache | None = None  # result cache tiers shared by every model that enables it
    redis: RedisLink | None = None  # the process's one Redis client and breaker (the server's, or none)
    lag: LoopLag = field(default_factory=LoopLag)  # the event loop's lag, a margin for every deadline
    selector: Selector | None = None  # the host's variant per model, selected in the background
    _reload_locks: dict[str, asyncio.Lock] = field(
        default_factory=dict
    )  # one load/unload per model at a time

    def __post_init__(self) -> None:
        self.classes = self.settings.classes
        self.batch_class = self.settings.batch_class
        s = self.settings
        self.selector = Selector(
            Path(s.model_repository), s.variant_selection, self.reload, s.variant_selection_memory_mb,
            s.variant_selection_repeats, s.variant_selection_candidates,
        )  # fmt: skip

    @property
    def _choose(self):
        """What ``load_model`` serves where a config names no variant: the host's recorded choice."""
        return None if self.settings.variant_selection == "off" else recorded_variant

    @property
    def ready(self) -> bool:
        if not self.loaded or self.draining:
            return False
        return not (self.settings.strict_readiness and self.failures)

    async def read_repository(self) -> Repository:
        """The repository's model specs, read and checked (no engine started yet)."""
        root = Path(self.settings.model_repository)
        return await asyncio.to_thread(
            load_repository, root, self.settings.default_max_batch_size, self._choose
        )

    async def load(self, repo: Repository | None = None) -> None:
        """Start every model of ``repo`` (read here when not given)."""
        self.lag.start()
        if repo is None:
            repo = await self.read_repository()
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
        _freeze_startup_objects()
        self.selector.start()  # after the freeze: the selection's objects come and go

    async def _start(self, spec: ModelSpec) -> ModelRuntime:
        if spec.config.response_cache.enable and self.cache is None:
            self.cache = await build_cache(self.settings, self.redis)  # when the first model asks for it
        rt = await build_runtime(spec, self.settings, self.classes, self.lag, self.cache)
        cpu = all(getattr(w, "device", None) is None or w.device.kind == "cpu" for w in rt.pool.workers)
        rt.choice = self.selector.note(spec, cpu)
        return rt

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
                specs = await asyncio.to_thread(
                    load_model, root / name, self.settings.default_max_batch_size, None, self._choose
                )
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
                    raise self._reload_failed(
                        name, f"model '{name}' version {spec.version} failed to start: {exc}"
                    ) from None
            old = self.models.get(name, {})
            # The swap: one step on the event loop, so every call sees either the old runtimes or the new.
            self.models[name] = fresh
            self.latest[name] = max(fresh, key=int)
            self.failures.pop(name, None)
            for path in specs[0].ignored:
                log.warning(
                    "model %s: config field '%s' is not implemented by batchgate and is ignored", name, path
                )
            log.info(
                "reloaded model %s: version(s) %s serving (were %s), fingerprint %s",
                name, sorted(fresh, key=int), sorted(old, key=int) or "none", specs[-1].fingerprint,
                extra={"event": "model_reloaded", "model": name},
            )  # fmt: skip
            await self._retire(list(old.values()))

    async def unload(self, name: str) -> None:
        """Stop serving ``name``: new calls get NOT_FOUND, accepted ones are answered first."""
        if name not in self.models:  # before a lock is made for the name: made-up names cost nothing
            raise not_found(f"model '{name}' is not loaded")
        async with self._reload_locks.setdefault(name, asyncio.Lock()):
            old = self.models.pop(name, None)
            if old is None:
                raise not_found(f"model '{name}' is not loaded")
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
        log.error(
            "model %s failed to load: %s", name, reason, extra={"event": "model_load_failed", "model": name}
        )
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

    def backlog_s(self) -> float | None:
        """The longest any model's queued work would keep a call waiting (``Scheduler.backlog_s``);
        None when one with work queued keeps no estimate."""
        most = 0.0
        for versions in self.models.values():
            for rt in versions.values():
                s = rt.scheduler.backlog_s()
                if s is None:
                    return None
                most = max(most, s)
        return most

    async def drain(self, timeout_s: float) -> bool:
        """Refuse new work and wait for every accepted request to be answered."""
        self.draining = True
        await self.selector.close()  # a selection under way is not finished (nothing recorded)
        rts = self.runtimes()
        results = await asyncio.gather(*(rt.scheduler.drain(timeout_s) for rt in rts))
        return all(results)

    async def close(self) -> None:
        self.lag.stop()
        await self.selector.close()
        for rt in self.runtimes():
            await rt.scheduler.close()
            await asyncio.to_thread(rt.pool.close)
        if self.cache is not None:
            await self.cache.close()  # sends what is queued for Redis, briefly


def _freeze_startup_objects() -> None:
    """Move what start-up made (modules, protobuf descriptors, sessions, engines: ~10^5 objects
    that live as long as the process) out of the collector's reach, once: every later
    collection of the oldest generation walked them all again, several us per call at a few
    thousand calls a second. Garbage is collected first so that none of it is kept."""
    global _gc_frozen
    if _gc_frozen:
        return
    _gc_frozen = True
    gc.collect()
    gc.freeze()
