"""One served model version: its codec, text stage, result cache, scheduler and worker pool,
built from its spec (``build_runtime``), and the path of one call through them.

A call's rows are what gets scheduled, not the call: ``ModelRuntime.infer`` gives each row the
shape bucket it will run in (a text's own length bucket; a numeric call's one bucket), cuts the
call into requests of one bucket each, none larger than a batch takes (``batch_rows``:
max_batch_size and the token budget), and hands them to the scheduler as one call (admitted or
refused as a whole). Each request batches with other callers' rows of its bucket; the answer is
put back together in row order when the last one is done. So a call never pays the padding of its longest text, and the queue is the one
place batches are formed within the budget.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from batchgate.cache import TieredCache
from batchgate.gateway.codec import Codec
from batchgate.gateway.config import Settings
from batchgate.gateway.repository import ModelSpec, tokenized
from batchgate.gateway.result_cache import ModelCache, model_cache
from batchgate.gateway.scheduling import (
    Budget,
    LatencyClass,
    LatencyModel,
    LoopLag,
    Part,
    QueueSettings,
    SchedulePolicy,
    Scheduler,
    SchedulerSnapshot,
    batch_rows,
    make_queue,
)
from batchgate.gateway.text import TextStage
from batchgate.proto.inference.v2 import model_config_pb2 as mc
from batchgate.workers import (
    Device,
    EngineOptions,
    Placement,
    WorkerPool,
    default_cache_dir,
    gpu_probe,
    place,
    read_model_io,
)

_KIND = {mc.ModelInstanceGroup.KIND_GPU: "gpu", mc.ModelInstanceGroup.KIND_CPU: "cpu"}
_NO_LIMIT = 1 << 30

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RuntimeSnapshot:
    """What metrics read of one runtime (gateway/metrics.py): nothing private."""

    model: str
    version: str
    scheduler: SchedulerSnapshot
    workers: tuple[tuple[str, float], ...]  # (worker name, seconds spent running batches)
    memory: tuple[tuple[str, str, int], ...] = ()  # (device, memory pool, bytes): WorkerPool.memory_by_pool
    tokenized: int | None = None  # texts tokenised (a text model), else None


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
    row_limit: Callable[[Hashable], int] | None = None  # the token budget: rows a batch of a bucket takes
    inflight: int = 0  # calls inside ``infer``: a runtime swapped out by a reload is closed at 0
    choice: object | None = None  # gateway/selection.py Selection: the host's variant for this model
    cut_limit: Callable[[Hashable], int] | None = None  # row_limit held to the learned limit (None: off)
    defaults: frozenset[str] = frozenset()  # the outputs a call naming none reads (spec.default_outputs)
    on_request: bool = False  # the model has outputs fetched only when asked for (on_request_outputs)

    @property
    def selection(self) -> dict:
        """The host's variant selection for this model (gateway/selection.py): state (off, pinned,
        recorded, selecting, switched, kept, failed, waiting), the variant serving, the CPU class,
        and once chosen the choice (variant, why, x the original, report, date, seconds)."""
        if self.choice is None:
            return {"state": "off", "variant": self.spec.variant}
        return self.choice.as_dict()

    def snapshot(self) -> RuntimeSnapshot:
        return RuntimeSnapshot(
            self.spec.name,
            self.spec.version,
            self.scheduler.snapshot(),
            tuple((w.name, w.busy_ns * 1e-9) for w in self.pool.workers),
            tuple((d, p, b) for (d, p), b in self.pool.memory_by_pool().items()),
            self.text.tokenized if self.text is not None else None,
        )

    async def infer(
        self, arrays: dict[str, np.ndarray], rows: int, budget: Budget | None = None, *,
        wanted: list[tuple[str, bool]] | None = None, namespace: str | None = None,
    ) -> dict[str, np.ndarray]:  # fmt: skip
        """``wanted`` (Codec.requested) says which outputs the engine fetches (and the cache keys
        on); ``namespace`` (the tenant's) only shapes cache keys."""
        # Counted from the first line: callers get the runtime and call this with no await in
        # between, so a reload never closes a runtime that a call is about to enter.
        self.inflight += 1
        try:
            return await self._infer(arrays, rows, budget, wanted, namespace)
        finally:
            self.inflight -= 1

    async def _infer(self, arrays, rows, budget, wanted, namespace) -> dict[str, np.ndarray]:
        keys = texts = None
        if self.text is not None:  # checks the texts; each row's key is its estimated length bucket
            keys, texts = await self.text.check(arrays)
        outputs = self._outputs(wanted)
        if self.cache is None:
            return await self._schedule(arrays, rows, budget, keys, texts, outputs)
        # The cache hands on only the rows it could not answer; their buckets are estimated again
        # (microseconds a text), their texts decoded in the worker.
        return await self.cache.infer(
            arrays, rows, lambda a, n: self._schedule(a, n, budget, outputs=outputs), wanted, namespace
        )

    def _outputs(self, wanted) -> tuple[str, ...] | None:
        """The output names ``wanted`` reads; None where they are the model's defaults (the
        engine's own list: the usual call carries nothing)."""
        if wanted is None:
            return None
        defaults = self.defaults
        if len(wanted) == len(defaults) and (not self.on_request or all(n in defaults for n, _ in wanted)):
            return None  # (names are unique: as many as the defaults, all of them defaults, is them)
        return tuple(n for n, _ in wanted)

    async def texts(
        self, texts: list[bytes], output: str | tuple[str, ...], budget: Budget | None, namespace: str | None,
        encodings: list | None = None,
    ) -> tuple[np.ndarray | dict[str, np.ndarray], list[int]]:  # fmt: skip
        """A text model's ``output`` for a list of texts, and each text's token count as the model
        sees it. Each text is tokenised once, here (in a thread; ``encodings`` may hold some
        already): the counts answer the caller's usage, and the encodings are what the worker
        turns into the model's inputs. Rows the cache holds are not
        computed; their texts are still counted (the usage needs it)."""
        self.inflight += 1
        try:
            stage = self.text
            n = len(texts)
            column = np.empty((n, 1), dtype=object)
            column[:, 0] = texts
            arrays = {stage.input: column}
            keys, encodings = await stage.check_encoded(arrays, encodings)
            tokens = [len(e.ids) for e in encodings]
            names = (output,) if isinstance(output, str) else output  # a tuple: those outputs, by name
            wanted = [(name, True) for name in names]
            outputs = self._outputs(wanted)
            if self.cache is None:
                outs = await self._schedule(arrays, n, budget, keys, encodings, outputs)
            else:
                by_text = dict(zip(texts, encodings, strict=True))

                key_of = dict(zip(texts, keys))

                def compute(a: dict[str, np.ndarray], rows: int):
                    column = a[stage.input].reshape(-1)
                    return self._schedule(
                        a, rows, budget, [key_of[b] for b in column], [by_text[b] for b in column], outputs
                    )

                outs = await self.cache.infer(arrays, n, compute, wanted, namespace)
            return (outs[output] if isinstance(output, str) else {n: outs[n] for n in names}), tokens
        finally:
            self.inflight -= 1

    async def _schedule(
        self, arrays: dict[str, np.ndarray], rows: int, budget: Budget | None,
        keys: list[int] | None = None, texts: list | None = None, outputs: tuple[str, ...] | None = None,
    ) -> dict[str, np.ndarray]:  # fmt: skip
        """The call's rows as requests of one bucket each (and of at most max_batch_size rows),
        scheduled as one call, reassembled. ``texts``: each row's text decoded once on the loop,
        or its encoding (``texts``): the worker tokenizes the one and reads the other as it is.
        ``outputs``: what the engine fetches for these rows (None: the model's defaults)."""
        sched = self.scheduler
        # A call is cut where its bucket's batches stop making more rows a second on this host (the
        # latency model's learned limit, ``cut_limit``): one request of 32 rows would run as one
        # batch past that size, whatever the queue holds its batches to.
        cap, limit = self.spec.max_batch_size, self.cut_limit or self.row_limit
        if self.text is not None and self.spec.batched:
            name = self.text.input
            if keys is None:
                keys = self.text.row_keys(arrays)
            column = arrays[name]
            if texts is not None:
                column = np.empty(rows, dtype=object)
                for i, t in enumerate(texts):  # (one by one: numpy would look into an encoding)
                    column[i] = t
                column = column.reshape(arrays[name].shape)
            first = keys[0]
            if rows <= batch_rows(cap, limit, first) and all(k == first for k in keys):  # the common case
                return (await sched.submit([({name: column}, rows, first)], budget, outputs))[0]
            groups: dict[int, list[int]] = {}
            for i, k in enumerate(keys):
                groups.setdefault(k, []).append(i)
            parts: list[Part] = []
            index: list[np.ndarray] = []
            for k, rows_of in groups.items():
                step = batch_rows(cap, limit, k)
                for s in range(0, len(rows_of), step):
                    sel = np.array(rows_of[s : s + step], dtype=np.intp)
                    parts.append(({name: column[sel]}, len(sel), k))
                    index.append(sel)
            return _assemble(await sched.submit(parts, budget, outputs), index, rows)
        # Numeric: every row of a call has the call's shape, so one bucket; the batcher groups by
        # length bucket (lengths 20 and 30 share a batch padded to 32), the cache keeps exact shapes.
        key = self.pool.shape_key(arrays) if self.variable_inputs else None
        step = batch_rows(cap, limit, key)
        if not self.spec.batched or rows <= step:
            return (await sched.submit([(arrays, rows, key)], budget, outputs))[0]
        parts = [
            ({n: a[s : s + step] for n, a in arrays.items()}, min(step, rows - s), key)
            for s in range(0, rows, step)
        ]
        outs = await sched.submit(parts, budget, outputs)
        return {n: np.concatenate([o[n] for o in outs]) for n in outs[0]}


def _learned_limit(
    latency: LatencyModel, limit: Callable[[Hashable], int] | None
) -> Callable[[Hashable], int]:
    """``limit`` (the token budget's rows per bucket; None: no limit) held to the rows the latency
    model learned still pay in each bucket."""

    def rows(key: Hashable) -> int:
        useful = latency.useful_rows(key)
        base = _NO_LIMIT if limit is None else limit(key)
        return base if useful is None else min(base, useful)

    return rows


def _assemble(outs: list[dict[str, np.ndarray]], index: list[np.ndarray], rows: int) -> dict[str, np.ndarray]:
    """One call's outputs in its row order from its requests' (``index``: their rows)."""
    result = {}
    for name in outs[0]:
        arrs = [o[name] for o in outs]
        tail = arrs[0].shape[1:]
        if all(a.shape[1:] == tail for a in arrs):
            full = np.empty((rows, *tail), dtype=arrs[0].dtype)
            for a, sel in zip(arrs, index):
                full[sel] = a
        else:  # a per-token output from batches of different lengths: padded to the longest, as one batch is
            tail = tuple(max(d) for d in zip(*(a.shape[1:] for a in arrs)))
            full = np.zeros((rows, *tail), dtype=arrs[0].dtype)
            for a, sel in zip(arrs, index):
                full[(sel, *(slice(0, d) for d in a.shape[1:]))] = a
        result[name] = full
    return result


def _numeric_row_limit(pool: WorkerPool, max_batch_tokens: int) -> Callable[[Hashable], int] | None:
    """Rows of a bucket (a tuple of lengths) within max_batch_tokens, as the engine runs them."""
    plan = pool.plan
    if not max_batch_tokens or plan is None:
        return None

    def limit(key: Hashable) -> int:
        if not isinstance(key, tuple) or not key or not all(isinstance(k, int) for k in key):
            return _NO_LIMIT
        if plan.seq_buckets_for(key) is not None:
            return plan.max_rows(key)  # exactly what one engine run takes
        return max(1, max_batch_tokens // max(math.prod(key), 1))

    return limit


def place_model(spec: ModelSpec, s: Settings, probe: Callable[[], tuple[int, str]] = gpu_probe) -> Placement:
    """Where ``spec`` runs under ``s.device`` (docs/engines.md, "Where a model runs"): every
    instance group placed by the one rule (workers/devices.py), devices merged in order. A
    fallback to the CPU is logged once, as a WARNING naming the model."""
    if spec.engine == "openvino":  # a CPU engine here (workers/openvino_engine.py)
        asked = s.device == "gpu" or any(
            g.kind == mc.ModelInstanceGroup.KIND_GPU for g in spec.config.instance_group
        )
        return Placement((Device("cpu"),), "engine openvino: CPU" if asked else "")
    strings = any(t.dtype == object for ts in read_model_io(spec.path) for t in ts)
    groups = list(spec.config.instance_group) or [mc.ModelInstanceGroup(kind=mc.ModelInstanceGroup.KIND_AUTO)]
    visible, why = probe() if s.device != "cpu" else (0, "")
    devices: list[Device] = []
    notes: list[str] = []
    fallback = ""
    for group in groups:
        # NoGPU propagates: the data plane logs it as this model's one "failed to start" line.
        p = place(_KIND.get(group.kind, "auto"), s.device, visible=visible, gpus=tuple(group.gpus),
                  fallback=spec.params.gpu_fallback, strings=strings, why_none=why)  # fmt: skip
        devices.extend(d for d in p.devices if d not in devices)
        if p.note and p.note not in notes:
            notes.append(p.note)
        fallback = fallback or p.fallback
    if fallback:
        log.warning("model %s version %s: %s", spec.name, spec.version, fallback)
    return Placement(tuple(devices), "; ".join(notes), fallback)


def workers_per_device(spec: ModelSpec, s: Settings, devices: Sequence[Device] = ()) -> int:
    """Workers on each device the model runs on, a GPU as the CPU: the server's workers_per_device,
    else the instance groups' count (per device, as Triton's). On the CPU that count is capped at
    the cores this process may use (``usable_cores``) over the intra-op threads: workers
    time-slicing one core run smaller batches and each holds its weights (docs/engines.md). The
    server's setting is never capped."""
    if s.workers_per_device:
        return s.workers_per_device
    count = max([g.count or 1 for g in spec.config.instance_group] or [1])
    if devices and all(d.kind == "cpu" for d in devices):
        usable = usable_cores()
        cores = max(1, usable // max(1, s.intra_op_threads))
        if count > cores:
            log.info("model %s version %s: %d CPU workers, not the config's %d: this process may use %d core(s)",
                     spec.name, spec.version, cores, count, usable)  # fmt: skip
            count = cores
    return count


def usable_cores(cpu_max: Path = Path("/sys/fs/cgroup/cpu.max")) -> int:
    """The cores this process may use: its affinity mask (taskset, a cpuset), and under a cgroup v2
    CPU quota (a Kubernetes CPU limit) quota / period, rounded up: a pod limited to one core sees
    every core of its node in the mask."""
    cores = len(os.sched_getaffinity(0))
    try:
        quota, period = cpu_max.read_text().split()
        if quota != "max":
            cores = min(cores, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        pass  # no cgroup v2 file (another OS, cgroup v1): the mask alone
    return cores


async def build_runtime(
    spec: ModelSpec, s: Settings, classes: dict[str, LatencyClass], lag: LoopLag, cache: TieredCache | None
) -> ModelRuntime:
    """Start one model version: text stage, worker pool (engines warmed), queue and scheduler."""
    placement = await asyncio.to_thread(place_model, spec, s)
    devices = list(placement.devices)
    count = workers_per_device(spec, s, devices)
    text = await asyncio.to_thread(TextStage, spec) if tokenized(spec.config) else None
    options = EngineOptions(intra_op_threads=s.intra_op_threads, inter_op_threads=s.inter_op_threads,
                            preprocess=text, mode=s.engine_mode, warmup=s.engine_warmup, length_runs=s.engine_length_runs,
                            cache_dir=(s.engine_cache_dir or default_cache_dir()) if s.engine_cache else None,
                            cuda_graphs=s.cuda_graphs, engine=spec.engine, precision=spec.compute,
                            on_request=spec.params.on_request_outputs)  # fmt: skip
    pool = WorkerPool(
        f"{spec.name}-v{spec.version}", spec.path, devices, count, options, spec.buckets, spec.fingerprint
    )
    pool.note = placement.note  # the startup line says why a model runs where it does
    await asyncio.to_thread(pool.start)
    try:
        # The token budget has one owner, the queue: text rows by their length bucket, numeric
        # rows by their bucket's lengths, as the engine would run them.
        if text is not None:
            row_limit = text.row_limit if text.settings.max_batch_tokens else None
        else:
            row_limit = _numeric_row_limit(pool, spec.params.max_batch_tokens)
        schedule = SchedulePolicy.from_config(spec.config)
        # A model may override the server's policy (parameter scheduling_policy), e.g. to keep
        # Triton's FIFO semantics for one model while the rest are scheduled by deadline.
        policy = spec.params.scheduling_policy or s.scheduling_policy  # checked at load (parameters.py)
        latency = LatencyModel()
        queue = make_queue(
            QueueSettings(
                policy=policy,
                max_batch_size=spec.max_batch_size,
                preferred=spec.preferred_batch_sizes,
                max_delay_s=spec.max_queue_delay_s,
                max_queue_size=spec.max_queue_size,
                classes=classes,
                default_class=s.default_latency_class,
                level_queue_sizes={lvl: p.max_queue_size for lvl, p in schedule.policies.items()},
                margin_s=s.deadline_margin_ms / 1000,
                cap_fraction=s.batch_time_cap,
                learn_limit=spec.params.learned_batch_limit,
                shed=spec.params.shed_at_admission,
                row_limit=row_limit,
            ),
            latency,
            lag,
        )
    except BaseException:
        await asyncio.to_thread(pool.close)
        raise
    scheduler = Scheduler(
        f"{spec.name}:{spec.version}",
        queue,
        pool.submit,
        slots=len(pool),
        batched=spec.batched,
        latency=latency,
        split_failures=True,
        default_outputs=spec.default_outputs,
    )
    scheduler.start()
    variable = tuple(t.name for t in spec.inputs if -1 in t.dims)
    rt = ModelRuntime(
        spec, Codec(spec), pool, scheduler, variable, schedule, model_cache(spec, cache), text, row_limit
    )
    rt.defaults = frozenset(spec.default_outputs)
    rt.on_request = bool(spec.params.on_request_outputs)
    if spec.params.learned_batch_limit and policy == "deadline":  # the deadline queue learns it
        rt.cut_limit = _learned_limit(latency, row_limit)
    return rt
