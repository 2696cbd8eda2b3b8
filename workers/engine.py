"""A worker's engines and the work of running one batch on them.

A worker thread owns its engine; nothing here is shared between threads. The batch is padded,
run and split back *in the worker thread*, so the gateway's event loop only hands over
references and never touches tensor data.

Two paths:

* **pooled** (batched models whose inputs are numeric and whose output dims are known): the
  batch is copied into the pooled buffers of its bucket (rows padded up to the batch bucket,
  lengths up to the length bucket), the bucket's bound run configuration runs, and each
  request's rows are copied out of the pooled outputs (trimmed back to its own lengths). A batch
  with more tokens than ``max_batch_tokens`` runs as several bucket runs.
* **dynamic** (everything else: unbatched models, string tensors, lengths past the last bucket,
  dims that keep exact lengths): the old way, concatenate and run at the batch's own shape; rows
  of different lengths are padded to the longest only where the plan says padding is safe.

Engine modes (``EngineOptions.mode``):

* ``shared`` — one session per worker, dims left dynamic; every bucket is a bound run
  configuration (buffers + IOBinding) on it. Weights and the activation arena exist once per
  worker; the arena peaks at the largest bucket.
* ``static`` — one session per bucket with every symbolic dim fixed by a free-dimension
  override, so ORT plans memory and folds shape arithmetic ahead of time (which CUDA graphs
  need: no shape nodes left to run on the CPU). Costs a weight copy and a session per bucket;
  on CPU the sessions share one arena (see sessions.py).
* ``auto`` — static on a GPU with CUDA graphs on, shared otherwise: on CPU a static session is
  no faster than the dynamic one at the same shape, so there the sessions per bucket only cost
  memory (docs/performance.md, "Figures the code cites").
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from batchgate.workers import openvino_engine, ort_capi
from batchgate.workers.buckets import ShapePlan
from batchgate.workers.buffers import CudaBuffers, HostBuffers, Slot
from batchgate.workers.devices import Device
from batchgate.workers.runs import RunCost, partition
from batchgate.workers.sessions import SessionFactory

log = logging.getLogger(__name__)

CPU_RUN_TOKENS = 8.0


@dataclass(frozen=True, slots=True)
class EngineOptions:
    intra_op_threads: int = 1
    inter_op_threads: int = 1
    graph_optimization: bool = True
    mode: str = "auto"  # auto | shared | static
    cache_dir: Path | None = None  # optimised-model cache; None: no cache
    cuda_graphs: bool = False  # GPU only: capture a CUDA graph per bucket
    # What start() runs before the model is ready. Every bucket's buffers and bindings are made
    # either way. "all": run every bucket; "lengths": run each length bucket once, at its smallest
    # batch; "none"; "auto": "all" for static engines and GPUs (a bucket's first run there pays
    # for graph capture, kernel selection and its arena), "lengths" for the shared CPU session
    # (measured: a shape's first run costs what later ones do, so running every batch bucket of
    # every length would only add minutes of start-up for a large model).
    warmup: str = "auto"
    # A preprocessed batch of mixed lengths runs as runs of similar length where that is cheaper
    # than padding it whole (workers/runs.py); False: one run padded to its longest row.
    length_runs: bool = True
    # Runs in the worker on the merged batch before the model (e.g. texts -> token inputs); its
    # output goes through the buckets and pools like any batch.
    preprocess: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]] | None = None
    # "onnxruntime" or "openvino" (CPU only; workers/openvino_engine.py); ``precision`` is
    # OpenVINO's inference precision ("fp32", "bf16", or "auto": BF16 where the CPU has it).
    engine: str = "onnxruntime"
    precision: str = "fp32"
    # Outputs fetched only for a batch that asks for them (the model's on_request_outputs): a
    # batch with no ``outputs`` named fetches, binds and copies out the others alone.
    on_request: tuple[str, ...] = ()

    def resolved_mode(self, device: Device) -> str:
        if self.engine == "openvino":
            return "shared"  # one compiled model with dynamic shapes (openvino_engine.py says why)
        if self.mode in ("shared", "static"):
            return self.mode
        return "static" if device.kind == "gpu" and self.cuda_graphs else "shared"


@dataclass(slots=True)
class BatchTiming:
    """Nanoseconds spent in each phase, as Triton's statistics report them, and the batch's padding.

    ``rows``/``tokens`` are what the requests sent (tokens: rows x their lengths on the variable
    dims, 1 per row for a model without any); ``padded_*`` what the engine computed. Their ratios
    are the padding waste of the batch.
    """

    input_ns: int = 0
    infer_ns: int = 0
    output_ns: int = 0
    rows: int = 0
    padded_rows: int = 0
    tokens: int = 0
    padded_tokens: int = 0
    bucket: tuple[int, ...] | None = None  # (rows, *lengths) of the (last) bucket run; None: dynamic shapes
    runs: int = 0  # engine runs for this batch (several when max_batch_tokens splits it)

    @property
    def row_waste(self) -> float:
        """padded rows / real rows (1.0 = no padding)."""
        return self.padded_rows / self.rows if self.rows else 1.0

    @property
    def token_waste(self) -> float:
        """padded tokens / real tokens (1.0 = no padding)."""
        return self.padded_tokens / self.tokens if self.tokens else 1.0


class Engine:
    def __init__(
        self,
        model_path: Path,
        device: Device,
        options: EngineOptions,
        plan: ShapePlan | None = None,
        fingerprint: str = "",
    ) -> None:
        self.device = device
        self.options = options
        self.plan = plan
        self.mode = options.resolved_mode(device)
        # A run's overhead in tokens before this engine has measured its own: on the CPU ~4.5
        # (a base-size encoder) to ~8.5 (minilm) on a Zen 4 core; a GPU's run costs far more than
        # a token, so there nothing is cut until measured (workers/runs.py).
        self._run_cost = RunCost(CPU_RUN_TOKENS if device.kind == "cpu" else None)
        if device.kind == "gpu":
            import cupy

            cupy.cuda.Device(device.id).use()  # this worker thread's current device, for CuPy
            self._cupy_pool = cupy.cuda.MemoryPool()
            self._stream = cupy.cuda.Stream(non_blocking=True)
        if options.engine == "openvino":
            if device.kind != "cpu":
                raise ValueError(f"{device}: engine 'openvino' runs on the CPU only")
            self.factory = openvino_engine.SessionFactory(
                model_path, precision=options.precision, threads=options.intra_op_threads,
                cache_dir=options.cache_dir,
            )  # fmt: skip
        else:
            self.factory = self._ort_factory(model_path, fingerprint, device, options)
        self.cuda_graphs = self.factory.cuda_graphs
        self._init_sessions(plan, options)

    @staticmethod
    def _ort_factory(model_path, fingerprint, device, options) -> SessionFactory:
        return SessionFactory(
            model_path,
            fingerprint,
            device,
            intra_op_threads=options.intra_op_threads,
            inter_op_threads=options.inter_op_threads,
            graph_optimization=options.graph_optimization,
            cache_dir=options.cache_dir,
            cuda_graphs=options.cuda_graphs and device.kind == "gpu",
        )

    def _init_sessions(self, plan: ShapePlan | None, options: EngineOptions) -> None:
        self.pooled = plan is not None and plan.pooled
        if self.mode == "static" and self.pooled and not plan.static_ok:
            log.warning("static engines need a dim_param on every variable axis; using one shared session")
            self.mode = "shared"
        self._no_graph: ort.RunOptions | None = None  # run options of the dynamic path
        self._dynamic: ort.InferenceSession | None = None
        if self.mode == "shared" or not self.pooled:
            self._dynamic = self._create(None)
        self.session = self._dynamic  # the session of the dynamic path (None until needed in static mode)
        if self.cuda_graphs and self.mode == "shared":
            # The shared session captures a graph per bucket under its gpu_graph_id; a run at any
            # other shape must not replay one of them.
            self._no_graph = ort.RunOptions()
            self._no_graph.add_run_config_entry("gpu_graph_id", "-1")
        self._sessions: dict[tuple[int, ...], ort.InferenceSession] = {}
        self._buffers: dict[tuple[int, ...], HostBuffers | CudaBuffers] = {}
        self._slots: dict[tuple[int, ...], Slot] = {}
        self.slot_allocations = 0  # slots (buffer views + bindings) created; flat after warm-up
        self.graph_slots: set[tuple[int, ...]] = set()  # buckets running as a CUDA graph
        ref = self._dynamic
        if ref is None:  # static: read names from the plan (the sessions come per bucket)
            self.input_names = [t.name for t in plan.inputs]
            self.output_names = [t.name for t in plan.outputs]
        else:
            self.input_names = [i.name for i in ref.get_inputs()]
            self.output_names = [o.name for o in ref.get_outputs()]
        # What a batch that names no outputs fetches: all but the on-request ones.
        self.default_outputs = tuple(n for n in self.output_names if n not in options.on_request)
        self._known = frozenset(self.output_names)
        # Batches that fetched each output (a test and a debugger read it; one add per name a batch).
        self.fetched: dict[str, int] = dict.fromkeys(self.output_names, 0)
        # A model whose graph reads or writes strings runs through ORT's C API (ort_capi.py), the
        # one way string tensors reach it byte for byte; every other model keeps the Python
        # binding. (Such models are never pooled, so ``ref`` is their dynamic session.)
        self._strings: ort_capi.Session | None = None
        if ref is not None and _has_strings(ref):
            if options.engine == "openvino":
                raise ValueError(
                    "the model's graph reads or writes string tensors, which engine 'openvino' does not "
                    "take; serve it with engine 'onnxruntime'"
                )
            self._strings = self._string_session()

    # -- sessions and slots -------------------------------------------------------------------

    def _create(self, overrides: dict[str, int] | None) -> ort.InferenceSession:
        # Graphs on the static buckets' sessions, or on the shared one (a graph per bucket there);
        # never on static mode's fallback session, which runs shapes outside the buckets.
        graphs = self.cuda_graphs and (overrides is not None or self.mode == "shared")
        try:
            return self.factory.create(overrides, shared_arena=self.mode == "static", cuda_graphs=graphs)
        except Exception as exc:
            if not graphs:
                raise
            # CUDA graphs need every compute node on the GPU and no control flow: say why not, run without.
            log.warning("CUDA graphs unavailable for this model (%s); running without them", exc)
            self.cuda_graphs = False
            return self.factory.create(overrides, shared_arena=self.mode == "static", cuda_graphs=False)

    def _string_session(self) -> ort_capi.Session | None:
        """The C-API session that replaces the Python one, or None (logged once by ort_capi)
        when the C library is not usable: then strings pass as UTF-8 only, as the codec checks.

        Always on the CPU provider, also on a GPU worker: ORT keeps string tensors in host memory
        and has string kernels on the CPU only, so under the CUDA provider a string model's
        string nodes would run on the CPU anyway, with copies to and from the device around its
        numeric nodes. A model mixing strings with heavy numeric work would lose its GPU here.
        """
        if not ort_capi.available():
            return None
        session = ort_capi.Session(
            self.factory.model_path,
            intra_op_threads=self.options.intra_op_threads,
            inter_op_threads=self.options.inter_op_threads,
            graph_optimization=self.options.graph_optimization,
        )
        if self.device.kind == "gpu":
            log.info("%s: the model has string tensors; it runs on the CPU provider", self.device)
        # The Python session only told us the model has strings: drop it (weights, arena).
        self._dynamic = None
        self.session = session
        return session

    def _dynamic_session(self) -> ort.InferenceSession:
        if self._dynamic is None:
            log.info("%s: creating a dynamic-shape session for shapes outside the buckets", self.device)
            self._dynamic = self._create(None)
            self.session = self._dynamic
        return self._dynamic

    def _slot(self, rows: int, seqs: tuple[int, ...], names: tuple[str, ...] | None = None) -> Slot:
        """The bound slot of bucket (rows, *seqs) for the outputs ``names`` (None: the defaults);
        other outputs than the defaults get slots of their own, bound on first use."""
        bucket = (rows, *seqs)
        if names is None or names == self.default_outputs:
            key, names = bucket, self.default_outputs
        else:
            key = (bucket, names)
        slot = self._slots.get(key)
        if slot is not None:
            return slot
        plan = self.plan
        buffers = self._buffers.get(seqs)
        if buffers is None:
            cap = plan.max_rows(seqs)
            ins = {t.name: (plan.input_shape(t.name, cap, seqs), t.dtype) for t in plan.inputs}
            outs = {t.name: (plan.output_shape(t.name, cap, seqs), t.dtype) for t in plan.outputs}
            if self.device.kind == "gpu":
                buffers = CudaBuffers(ins, outs, self.device.id, self._cupy_pool, self._stream)
            else:
                buffers = HostBuffers(ins, outs)
            for name, a in _host_inputs(buffers).items():
                a.fill(plan.pad_values[name])
            self._buffers[seqs] = buffers
        if self.mode == "static":
            session = self._sessions.get(bucket)
            if session is None:
                session = self._sessions[bucket] = self._create(plan.overrides(rows, seqs))
            run_options = None
        else:
            session = self._dynamic
            run_options = None
            if self.cuda_graphs:
                # One session, one captured graph per bucket (ORT keys graphs by gpu_graph_id).
                run_options = ort.RunOptions()
                run_options.add_run_config_entry("gpu_graph_id", str(len(self._slots)))
        slot = buffers.slot(bucket, rows, seqs, session, run_options, names)
        self._slots[key] = slot
        self.slot_allocations += 1
        if self.cuda_graphs:
            self.graph_slots.add(bucket)
        return slot

    def warm_up(self) -> int:
        """Create every bucket (buffers, bindings, sessions) and run them as ``options.warmup``
        says; with CUDA graphs each run bucket runs three times, since ORT captures a graph only
        after regular runs. Returns the number of buckets run."""
        if not self.pooled:
            return 0
        policy = self.options.warmup
        if policy == "auto":
            policy = "all" if self.mode == "static" or self.device.kind == "gpu" else "lengths"
        if policy not in ("all", "lengths", "none"):
            raise ValueError(f"engine warm-up '{policy}' is not one of auto, all, lengths, none")
        runs = 3 if self.cuda_graphs else 1
        slots = [self._slot(rows, seqs) for rows, seqs in self.plan.slots()]
        if policy == "lengths":
            first: dict[tuple[int, ...], Slot] = {}
            for slot in slots:
                first.setdefault(slot.seqs, slot)  # slots() lists batch buckets smallest first
            to_run = list(first.values())
        else:
            to_run = slots if policy == "all" else []
        t0 = time.perf_counter()
        for slot in to_run:
            for name, a in slot.inputs.items():
                a.fill(self.plan.pad_values[name])
            for _ in range(runs):
                slot.run()
        # (buckets bound, buckets run, seconds): the pool puts it in the model's one startup line.
        self.warmed = (len(slots), len(to_run), time.perf_counter() - t0)
        log.debug(
            "%s: %d bucket(s) bound, %d run in %.2fs (%s mode, warm-up %s, cache %d hit / %d built, "
            "%.1f MiB host buffers%s)",
            self.device, len(slots), len(to_run), time.perf_counter() - t0, self.mode, policy,
            self.factory.hits, self.factory.misses, self.buffer_bytes()[0] / 2**20,
            f", {self.buffer_bytes()[1] / 2**20:.1f} MiB device buffers, "
            f"CUDA graphs {'on' if self.cuda_graphs else 'off'}"
            if self.device.kind == "gpu" else "",
        )  # fmt: skip
        return len(to_run)

    def buffer_bytes(self) -> tuple[int, int]:
        """(host, device) bytes held by the pooled buffers."""
        host = sum(b.host_bytes for b in self._buffers.values())
        dev = sum(b.device_bytes for b in self._buffers.values())
        return host, dev

    def device_memory(self) -> int:
        """Bytes in use on this engine's device: for a GPU what the driver reports as used (ORT's
        arenas, the CuPy pool, the CUDA context); for the CPU the pooled buffers."""
        if self.device.kind != "gpu":
            return self.buffer_bytes()[0]
        import cupy

        with cupy.cuda.Device(self.device.id):
            free, total = cupy.cuda.runtime.memGetInfo()
        return int(total - free)

    # -- running a batch ----------------------------------------------------------------------

    def run_batch(
        self, parts: list[dict[str, np.ndarray]], rows: list[int], batched: bool,
        outputs: tuple[str, ...] | None = None,
    ) -> tuple[list[dict[str, np.ndarray]], BatchTiming]:  # fmt: skip
        """Run the requests ``parts`` as one batch and split the outputs back by ``rows``.

        With ``batched`` false (max_batch_size 0) there is exactly one part and no batch dim.
        ``outputs``: the outputs to fetch (the union of what the batch's requests read); None:
        ``default_outputs``. No other output is bound or copied out.
        """
        if outputs is None:
            names = self.default_outputs
        else:
            asked = set(outputs)
            if not self._known.issuperset(asked):
                unknown = sorted(asked - self._known)
                raise ValueError(f"the model has no output {unknown}; its outputs: {self.output_names}")
            # In the model's order: one bound slot per set, whatever order the callers named them in.
            names = tuple(n for n in self.output_names if n in asked)
        fetched = self.fetched
        for n in names:
            fetched[n] += 1
        if self.options.preprocess is not None:
            return self._run_preprocessed(parts, rows, batched, names)
        return self._run(parts, rows, batched, names)

    def _run(self, parts, rows, batched, names) -> tuple[list[dict[str, np.ndarray]], BatchTiming]:
        if self.pooled and batched:
            plan = self.plan
            lengths = [plan.lengths(p) for p in parts]
            longest = tuple(max(col) for col in zip(*lengths)) if plan.groups else ()
            # None past the last bucket, and always for exact dims (they have no buckets), so only
            # dims where padding is safe are ever padded here.
            seqs = plan.seq_buckets_for(longest)
            if seqs is not None:
                return self._run_pooled(parts, rows, lengths, seqs, names)
        return self._run_dynamic(parts, rows, batched, names)

    def _run_preprocessed(
        self, parts, rows, batched, names
    ) -> tuple[list[dict[str, np.ndarray]], BatchTiming]:
        t0 = time.perf_counter_ns()
        merged = parts[0] if len(parts) == 1 else {n: np.concatenate([p[n] for p in parts]) for n in parts[0]}
        feeds = self.options.preprocess(merged)
        pre_ns = time.perf_counter_ns() - t0
        total = sum(rows) if batched else 1
        real = self._real_lengths(feeds) if batched else None
        runs = self._cut(feeds, real) if real is not None and self.options.length_runs else None
        if runs is not None:
            outputs, timing = self._run_cut(feeds, runs, names)
        else:
            outputs, timing = self._run([feeds], [total], batched, names)
            self._observe_run(timing)
        if real is not None:
            timing.tokens = int(real.sum())  # what the rows hold; padded_tokens what ran
        timing.input_ns += pre_ns
        if not batched or len(parts) == 1:
            return outputs, timing
        own = self._own_lengths(feeds, rows)
        split = []
        start = 0
        for i, n in enumerate(rows):  # views: the arrays are this batch's own (never a pooled buffer)
            out = {}
            for name, arr in outputs[0].items():
                piece = arr[start : start + n]
                if own is not None and self.plan.output_axes(name):
                    piece = piece[_trim(piece.ndim, self.plan.output_axes(name), own[i])]
                out[name] = piece
            split.append(out)
            start += n
        return split, timing

    def _real_lengths(self, feeds: dict[str, np.ndarray]) -> np.ndarray | None:
        """Each row's width up to its last position that is not the preprocess stage's right
        padding (a masked position whose id is not the pad id counts: ColBERT's query expansion is
        masked [MASK] tokens whose vectors are answered); None where the stage does not say what
        its padding is, or the batch is not one masked sequence dim."""
        plan = self.plan
        pad = getattr(self.options.preprocess, "pad_id", None)
        if pad is None or plan is None or len(plan.groups) != 1 or plan.mask_input is None:
            return None
        mask, ids = feeds.get(plan.mask_input), feeds.get("input_ids")
        if mask is None or ids is None or mask.ndim != 2 or ids.shape != mask.shape or not mask.shape[0]:
            return None
        kept = (mask != 0) | (ids != pad)
        width = kept.shape[1]
        return np.where(kept.any(1), width - np.argmax(kept[:, ::-1], axis=1), 0)

    def _cut(self, feeds: dict[str, np.ndarray], real: np.ndarray) -> list[tuple[np.ndarray, int]] | None:
        """The batch as runs of similar length (rows, their width), where padding it whole would
        cost more than the extra runs (workers/runs.py); None: one run."""
        rows, width = len(real), self.plan.lengths(feeds)[0]
        if rows < 2 or (self.pooled and self.plan.seq_buckets_for((width,)) is not None):
            return None  # (static buckets pad every run to a bucket anyway)
        overhead = self._run_cost.overhead_tokens()
        if overhead is None or rows * width - int(real.sum()) <= overhead:
            return None
        groups = partition(real, overhead)
        if len(groups) == 1:
            return None
        return [(g, int(real[g[-1]])) for g in groups]  # (each group ascending: its last is its longest)

    def _run_cut(self, feeds, runs, names) -> tuple[list[dict[str, np.ndarray]], BatchTiming]:
        """Run each group of ``runs`` at its own width and put the rows back in the batch's order,
        per-token outputs zero past a row's group width, as one padded run leaves them masked."""
        plan = self.plan
        total, width = len(next(iter(feeds.values()))), plan.lengths(feeds)[0]
        whole: dict[str, np.ndarray] = {}
        timing = BatchTiming()
        for sel, w in runs:
            sub = {
                name: arr[sel][_trim(arr.ndim, plan.input_axes(name), (w,))] for name, arr in feeds.items()
            }
            out, t = self._run([sub], [len(sel)], True, names)
            self._observe_run(t)
            t0 = time.perf_counter_ns()
            for name, arr in out[0].items():
                axes = plan.output_axes(name)
                dst = whole.get(name)
                if dst is None:
                    shape = [total, *arr.shape[1:]]
                    for axis, _ in axes:
                        shape[axis] = width
                    dst = whole[name] = np.zeros(shape, arr.dtype) if axes else np.empty(shape, arr.dtype)
                index = [sel] + [slice(None)] * (arr.ndim - 1)
                for axis, _ in axes:
                    index[axis] = slice(0, arr.shape[axis])
                dst[tuple(index)] = arr
            timing.input_ns += t.input_ns
            timing.infer_ns += t.infer_ns
            timing.output_ns += t.output_ns + time.perf_counter_ns() - t0
            timing.rows += t.rows
            timing.padded_rows += t.padded_rows
            timing.padded_tokens += t.padded_tokens
            timing.runs += t.runs
            timing.bucket = t.bucket
        return [whole], timing

    def _observe_run(self, t: BatchTiming) -> None:
        """One dynamic-shape run's time into the run cost (a bucketed run's padding is the bucket's)."""
        if t.runs == 1 and t.bucket is None:
            self._run_cost.observe(t.padded_tokens, t.infer_ns * 1e-9)

    def _own_lengths(self, feeds: dict[str, np.ndarray], rows: list[int]) -> list[tuple[int, ...]] | None:
        """Each request's longest real row, read from the mask, where an output has a per-token
        dim: the preprocessed batch is padded to its longest row, and a request batched with
        longer rows gets its per-token outputs back at its own length (its answer's shape never
        depends on whose rows it shared a batch with). None where no output needs it."""
        plan = self.plan
        if plan is None or len(plan.groups) != 1 or not any(plan.output_axes(t.name) for t in plan.outputs):
            return None
        mask = feeds.get(plan.mask_input) if plan.mask_input else None
        if mask is None or mask.ndim != 2:
            return None
        # last real position + 1 (the text stage pads on the right; a left-padded row keeps its width)
        real = np.where(mask.any(1), mask.shape[1] - np.argmax(mask[:, ::-1] != 0, axis=1), 0)
        own, start = [], 0
        for n in rows:
            own.append((int(real[start : start + n].max()),))
            start += n
        return own

    def _run_pooled(
        self, parts, rows, lengths, seqs, names
    ) -> tuple[list[dict[str, np.ndarray]], BatchTiming]:
        plan = self.plan
        if not plan.groups:
            total = sum(rows)
            if total <= plan.max_rows(seqs):
                done = self._run_pooled_fixed(parts, rows, total, seqs, names)
                if done is not None:
                    return done
        timing = BatchTiming()
        t0 = time.perf_counter_ns()
        total = sum(rows)
        per_row = math.prod(seqs)
        cap = plan.max_rows(seqs)
        results = []
        for n, ls in zip(rows, lengths):
            # The answers' own memory (the pooled outputs are reused by the next batch).
            results.append({t.name: np.empty(_trimmed(plan, t.name, n, ls), t.dtype)
                            for t in plan.outputs if t.name in names})  # fmt: skip
            timing.tokens += n * math.prod(ls)
        timing.rows = total
        input_ns = time.perf_counter_ns() - t0
        infer_ns = output_ns = 0
        part_i, part_off, done = 0, 0, 0
        while done < total:
            n = min(cap, total - done)
            b = plan.batch_bucket(n)
            slot = self._slot(b, seqs, names)
            t1 = time.perf_counter_ns()
            # Which rows of which request land where: (part, first row in it, first row in slot, count).
            pieces = []
            d = 0
            while d < n:
                k = min(rows[part_i] - part_off, n - d)
                pieces.append((part_i, part_off, d, k))
                d += k
                part_off += k
                if part_off == rows[part_i]:
                    part_i, part_off = part_i + 1, 0
            for name, buf in slot.inputs.items():
                pad = plan.pad_values[name]
                axes = plan.input_axes(name)
                for pi, s0, d0, k in pieces:
                    src = parts[pi][name]
                    if s0 or k != src.shape[0]:
                        src = src[s0 : s0 + k]
                    region = buf[d0 : d0 + k]
                    if src.shape == region.shape:
                        np.copyto(region, src, casting="same_kind")
                        continue
                    # Shorter than the bucket: pad what lies past each of its lengths, then copy.
                    for axis, _ in axes:
                        if src.shape[axis] < region.shape[axis]:
                            region[(slice(None),) * axis + (slice(src.shape[axis], None),)] = pad
                    np.copyto(region[tuple(slice(0, s) for s in src.shape)], src, casting="same_kind")
                if n < b:
                    buf[n:] = pad  # padding rows: masked (pad 0) and dropped below
            t2 = time.perf_counter_ns()
            slot.run()
            t3 = time.perf_counter_ns()
            for name, buf in slot.outputs.items():
                axes = plan.output_axes(name)
                for pi, s0, d0, k in pieces:
                    src = buf[d0 : d0 + k]
                    if axes:  # a dim of the request's own length: drop the padded positions
                        src = src[_trim(src.ndim, axes, lengths[pi])]
                    results[pi][name][s0 : s0 + k] = src
            t4 = time.perf_counter_ns()
            input_ns += t2 - t1
            infer_ns += t3 - t2
            output_ns += t4 - t3
            timing.padded_rows += b
            timing.padded_tokens += b * per_row
            timing.runs += 1
            timing.bucket = slot.bucket
            done += n
        timing.input_ns = input_ns
        timing.infer_ns = infer_ns
        timing.output_ns = output_ns
        return results, timing

    def _run_pooled_fixed(self, parts, rows, total, seqs, names):
        """A batch of fixed-shape rows (no length to pad or trim) that fits one run: each input's
        parts copied into the pooled buffer in one call, each output copied out of it once, and
        every request's answer a view of that copy (the pooled buffers are the next batch's).
        None if a part's shape differs from the bucket's (the general path pads or refuses)."""
        plan = self.plan
        timing = BatchTiming()
        t0 = time.perf_counter_ns()
        b = plan.batch_bucket(total)
        slot = self._slot(b, seqs, names)
        inputs = slot.inputs
        for name, buf in inputs.items():
            tail = buf.shape[1:]
            for p in parts:
                if p[name].shape[1:] != tail:
                    return None
        pad = plan.pad_values
        for name, buf in inputs.items():
            if len(parts) == 1:
                np.copyto(buf[:total], parts[0][name], casting="same_kind")
            else:
                np.concatenate([p[name] for p in parts], out=buf[:total], casting="same_kind")
            if total < b:
                buf[total:] = pad[name]  # padding rows: masked (pad 0) and dropped below
        t2 = time.perf_counter_ns()
        slot.run()
        t3 = time.perf_counter_ns()
        outs = [(name, buf[:total].copy()) for name, buf in slot.outputs.items()]
        if len(parts) == 1:
            results = [dict(outs)]
        else:
            results = []
            start = 0
            for n in rows:
                end = start + n
                results.append({name: out[start:end] for name, out in outs})
                start = end
        t4 = time.perf_counter_ns()
        timing.input_ns = t2 - t0
        timing.infer_ns = t3 - t2
        timing.output_ns = t4 - t3
        timing.rows = timing.tokens = total
        timing.padded_rows = b
        timing.padded_tokens = b * math.prod(seqs)
        timing.runs = 1
        timing.bucket = slot.bucket
        return results, timing

    def _run_dynamic(self, parts, rows, batched, names) -> tuple[list[dict[str, np.ndarray]], BatchTiming]:
        plan = self.plan
        timing = BatchTiming()
        t0 = time.perf_counter_ns()
        lengths = None
        if len(parts) == 1:
            feeds = parts[0]
        else:
            shapes = {name: {p[name].shape[1:] for p in parts} for name in parts[0]}
            if all(len(s) == 1 for s in shapes.values()):
                feeds = {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
            else:
                feeds, lengths = self._pad_to_longest(parts, rows)
        t1 = time.perf_counter_ns()
        if self._strings is not None:  # exact bytes both ways (the conversion is part of run)
            outputs = self._strings.run(list(names), feeds)
        else:
            outputs = self._run_python(feeds, names)
        t2 = time.perf_counter_ns()
        if not batched or len(parts) == 1:
            split = [dict(zip(names, outputs))]
        else:
            split = []
            start = 0
            for i, n in enumerate(rows):
                out = {}
                for name, arr in zip(names, outputs):
                    piece = arr[start : start + n]
                    if lengths is not None and plan.output_axes(name):
                        piece = piece[_trim(piece.ndim, plan.output_axes(name), lengths[i])]
                    out[name] = piece
                split.append(out)
                start += n
            total = start
            for name, out in zip(names, outputs):
                if out.shape[0] != total:
                    raise RuntimeError(
                        f"output '{name}' has {out.shape[0]} rows for a batch of {total}; "
                        "the model does not keep the batch dimension"
                    )
        timing.input_ns = t1 - t0
        timing.infer_ns = t2 - t1
        timing.output_ns = time.perf_counter_ns() - t2
        n_rows = sum(rows) if batched else 1
        timing.rows = timing.padded_rows = n_rows
        first = next(iter(feeds.values()), None)
        if plan is not None and plan.groups and batched:
            real = [plan.lengths(p) for p in parts]
            timing.tokens = sum(n * math.prod(ls) for n, ls in zip(rows, real))
            padded = plan.lengths(feeds) if first is not None else ()
            timing.padded_tokens = n_rows * math.prod(padded)
        else:
            timing.tokens = timing.padded_tokens = n_rows
        timing.runs = 1
        return split, timing

    def _run_python(self, feeds: dict[str, np.ndarray], names: tuple[str, ...]) -> list[np.ndarray]:
        session = self._dynamic_session()
        # Only where the C API is not usable does a string tensor get here (UTF-8 only, see below).
        feeds = {name: to_ort_strings(name, a) if a.dtype == object else a for name, a in feeds.items()}
        try:
            outputs = session.run(names, feeds, self._no_graph)
        except UnicodeDecodeError as exc:  # raised by ORT's binding while it converts a string output
            raise ValueError(
                f"the model produced a string output holding bytes that are not UTF-8 ({exc.reason} at "
                f"byte {exc.start}); onnxruntime's Python API can only return UTF-8 strings"
            ) from None
        return [from_ort_strings(a) if a.dtype == object else a for a in outputs]

    def _pad_to_longest(self, parts, rows):
        """Rows of different lengths in one batch (only where padding is safe): pad to the longest."""
        plan = self.plan
        if plan is None or not plan.groups:
            raise ValueError("requests of different shapes cannot run as one batch of this model")
        lengths = [plan.lengths(p) for p in parts]
        for i, g in enumerate(plan.groups):
            if not g.paddable and len({ls[i] for ls in lengths}) > 1:
                raise ValueError(
                    f"rows of lengths {sorted({ls[i] for ls in lengths})} on dim '{g.name}' cannot share a "
                    "batch: nothing masks padding on that dim (set seq_buckets or mask_input if padding is safe)"
                )
        longest = tuple(max(col) for col in zip(*lengths))
        total = sum(rows)
        feeds = {}
        for name in parts[0]:
            proto = parts[0][name]
            shape = list((total, *proto.shape[1:]))
            for axis, g in plan.input_axes(name):
                shape[axis] = longest[g]
            buf = np.full(shape, plan.pad_values.get(name, 0), dtype=proto.dtype)
            start = 0
            for p in parts:
                a = p[name]
                buf[(slice(start, start + a.shape[0]),) + tuple(slice(0, s) for s in a.shape[1:])] = a
                start += a.shape[0]
            feeds[name] = buf
        return feeds, lengths


# -- string tensors ------------------------------------------------------------------------------------
#
# The gateway carries BYTES tensors as object arrays of ``bytes``, any bytes (NULs, empty strings,
# bytes that are not UTF-8). A model whose graph has a string input or output runs through ORT's
# C API (ort_capi.py), which takes and returns each element at its exact length: nothing is
# converted, so every byte arrives and leaves as sent. A call costs more than the Python binding's
# UTF-8 path, the price of a dozen ctypes calls per run (docs/performance.md, "Figures the code cites").
#
# The Python binding remains the road only where the C library cannot be used (ort_capi.load()
# logs why). It (measured, ORT 1.32) turns each element of an object array into a std::string by type:
#   str   -> its UTF-8 bytes, exactly (NUL and empty strings survive);
#   bytes -> str(element), i.e. the text "b'abc'" (so bytes must never reach it as bytes);
# a fixed-width ``S`` array is read as NUL-terminated C strings (NUL cuts an element, and an
# element filling its width runs on into the next), and a string *output* comes back as ``str``
# decoded strictly as UTF-8 (a model output holding other bytes raises UnicodeDecodeError).
# So there the one lossless road is UTF-8: bytes -> str on the way in, str -> bytes on the way
# out, and the codec refuses other bytes at decode time, naming the input (gateway/codec.py); the
# check below only guards callers that skip it.


def _has_strings(session: ort.InferenceSession) -> bool:
    """Whether the ONNX graph itself reads or writes a string tensor (a text model's tokeniser
    runs before the graph: its graph sees token ids only)."""
    return any(t.type == "tensor(string)" for t in (*session.get_inputs(), *session.get_outputs()))


def to_ort_strings(name: str, arr: np.ndarray) -> np.ndarray:
    """An object array of bytes (or str) as the object array of str onnxruntime reads byte for byte."""
    out = np.empty(arr.shape, dtype=object)
    flat = arr.reshape(-1)
    try:  # one comprehension: faster than filling the array element by element (docs/performance.md)
        out.reshape(-1)[:] = [v.decode("utf-8") if type(v) is bytes else _as_str(v) for v in flat]
    except (UnicodeDecodeError, TypeError):
        i, why = next((i, why) for i, v in enumerate(flat) if (why := _not_str(v)))
        raise ValueError(f"input '{name}': element {i} {why}; onnxruntime's Python API passes strings "
                         "to a model as UTF-8 only") from None  # fmt: skip
    return out


def _as_str(v) -> str:
    if isinstance(v, str):
        return str(v)
    if isinstance(v, bytes | bytearray | memoryview):
        return bytes(v).decode("utf-8")
    # Never bytes(v) on anything else: bytes(3) is three NULs, a silently wrong string.
    raise TypeError(type(v).__name__)


def _not_str(v) -> str:
    """Why ``v`` cannot be a string element ("" when it can)."""
    try:
        _as_str(v)
    except UnicodeDecodeError:
        return "is not a UTF-8 string"
    except TypeError:
        return f"is a {type(v).__name__}, not a string"
    return ""


def from_ort_strings(arr: np.ndarray) -> np.ndarray:
    """A string output of onnxruntime (object array of str) as the object array of bytes the
    gateway sends back."""
    out = np.empty(arr.shape, dtype=object)
    out.reshape(-1)[:] = [v.encode("utf-8") if type(v) is str else v for v in arr.reshape(-1)]
    return out


def _trim(ndim: int, axes: list[tuple[int, int]], lengths: tuple[int, ...]) -> tuple[slice, ...]:
    """Index that cuts each (axis, group) back to the request's own length in that group."""
    idx = [slice(None)] * ndim
    for axis, g in axes:
        idx[axis] = slice(0, lengths[g])
    return tuple(idx)


def _trimmed(plan: ShapePlan, name: str, rows: int, lengths: tuple[int, ...]) -> tuple[int, ...]:
    shape = list(next(t.dims for t in plan.outputs if t.name == name))
    shape[0] = rows
    for axis, g in plan.output_axes(name):
        shape[axis] = lengths[g]
    return tuple(int(d) for d in shape)


def _host_inputs(buffers) -> dict[str, np.ndarray]:
    return buffers.inputs if isinstance(buffers, HostBuffers) else buffers.host_in
