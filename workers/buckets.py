"""Shape buckets: which static shapes a model's engines run, and how a batch is padded up to one.

A model's inputs have a batch dim and, for some, variable non-batch dims (a sequence length).
Running every batch at its own exact shape means an engine sees a new shape on every call;
padding every batch to its longest row wastes most of the work on padding. Buckets sit between:

* **batch buckets** (``batch_buckets``; default powers of two up to max_batch_size, plus the
  preferred sizes): a batch of n rows runs at the smallest bucket >= n; the extra rows are
  padding and their outputs are dropped.
* **length buckets**, one list per *dim group* (``seq_buckets``, ``seq_buckets.<dim>``): a group
  is a variable dim the ONNX graph names alike on several inputs (``seq`` on ``input_ids`` and
  ``attention_mask``), or one unnamed variable axis. Rows of length 20 and 30 both run at 32, so
  the batcher may merge them (the batching key is the bucket, not the length); positions past a
  row's own length are padding, and outputs that carry the same dim are trimmed back.

Padding must not change a real row's answer. Extra rows never can (rows are independent, which
batching already assumes). Extra positions only cannot when the model masks them, so a group is
bucketed by default only when the mask input (``mask_input``, default ``attention_mask``, padded
with 0) is one of its members; any other group keeps exact lengths unless ``seq_buckets`` names
it, which states that padding it with ``pad_value.<input>`` (default 0) is safe.

Everything here is plain data, computed once at load; the per-call work is ``key`` (bisect per
group) on the event loop and ``seq_buckets_for`` / ``batch_bucket`` in the worker.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from batchgate.workers.per_file import once_per_version

DEFAULT_MASK_INPUT = "attention_mask"
DEFAULT_MIN_SEQ_BUCKET = 16
DEFAULT_MAX_SEQ_BUCKET = 512  # when neither seq_buckets nor max_dim.<input> bounds a masked group


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One graph input or output as the ONNX file declares it."""

    name: str
    dtype: np.dtype  # object for strings
    dims: tuple[int | str | None, ...]  # int: fixed; str: dim_param; None: unknown


def read_model_io(path: Path) -> tuple[list[TensorInfo], list[TensorInfo]]:
    """Inputs (initializers excluded) and outputs of an ONNX file, without its external weights;
    the graph parsed once per version of the file (the placement and the pool both ask)."""
    inputs, outputs = _model_io(Path(path))
    return list(inputs), list(outputs)


@once_per_version
def _model_io(path: Path) -> tuple[tuple[TensorInfo, ...], tuple[TensorInfo, ...]]:
    import onnx
    from onnx import helper

    model = onnx.load(str(path), load_external_data=False)
    init = {i.name for i in model.graph.initializer}

    def info(v) -> TensorInfo:
        elem = v.type.tensor_type.elem_type
        if elem == onnx.TensorProto.STRING:
            dtype = np.dtype(object)
        else:
            dtype = np.dtype(helper.tensor_dtype_to_np_dtype(elem))
        dims: list[int | str | None] = []
        for d in v.type.tensor_type.shape.dim:
            if d.HasField("dim_value") and d.dim_value > 0:
                dims.append(int(d.dim_value))
            elif d.HasField("dim_param") and d.dim_param:
                dims.append(d.dim_param)
            else:
                dims.append(None)
        return TensorInfo(v.name, dtype, tuple(dims))

    inputs = tuple(info(v) for v in model.graph.input if v.name not in init)
    outputs = tuple(info(v) for v in model.graph.output)
    return inputs, outputs


def powers_of_two(low: int, high: int) -> tuple[int, ...]:
    """low, 2*low, ... up to high, with high itself as the last value."""
    out = []
    v = low
    while v < high:
        out.append(v)
        v *= 2
    out.append(high)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class BucketConfig:
    """A model's bucket settings, from config.pbtxt ``parameters`` (all optional; parsed and
    declared in gateway/parameters.py, listed in docs/model-config.md):

    ``batch_buckets``       "1,2,4,8"    batch sizes a batch is padded up to (max_batch_size is added)
    ``seq_buckets``         "16,32,64"   lengths for every variable dim group; "none" keeps exact lengths
                                         (``length_buckets``, the text stage's name, is read when absent)
    ``seq_buckets.<dim>``   "8,16"       the same for one group (its dim_param, or ``<input>.<axis>``)
    ``max_batch_tokens``    "8192"       rows x bucket lengths per engine run at most; a larger batch
                                         runs as several (bounds activation memory and warm-up time)
    ``mask_input``          "attention_mask"  the input whose padding (0) masks padded positions;
                                         "none": no mask, so no group is bucketed by default
    ``pad_value.<input>``   "0"          value written into padded rows and positions
    ``max_dim.<input>``     "512"        (the codec's bound) also caps the default length buckets
    """

    max_batch_size: int
    batch_sizes: tuple[int, ...]
    seq_sizes: tuple[int, ...] | None = None  # None: by model (masked groups only)
    seq_by_dim: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    max_batch_tokens: int = 0
    mask_input: str | None = DEFAULT_MASK_INPUT
    mask_explicit: bool = False
    pad_values: Mapping[str, float] = field(default_factory=dict)
    max_dims: Mapping[str, int] = field(default_factory=dict)
    # config.pbtxt `reshape` (Triton's semantics, fixed dims only): input name -> the row shape the
    # ONNX model takes; output name -> the row shape the client gets back (the config's dims).
    reshape_inputs: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    reshape_outputs: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        max_batch_size: int,
        preferred: tuple[int, ...] = (),
        *,
        batch_buckets: tuple[int, ...] = (),
        seq_buckets: tuple[int, ...] | None = None,
        seq_by_dim: Mapping[str, tuple[int, ...]] | None = None,
        max_batch_tokens: int = 0,
        mask_input: str | None = DEFAULT_MASK_INPUT,
        mask_explicit: bool = False,
        pad_values: Mapping[str, float] | None = None,
        max_dims: Mapping[str, int] | None = None,
    ) -> BucketConfig:
        """From typed values (the gateway parses config.pbtxt's strings once, gateway/parameters.py):
        the batch sizes completed and checked against max_batch_size; ValueError names the parameter."""
        if max_batch_size > 0:
            if batch_buckets:
                sizes = set(batch_buckets)
                bad = [s for s in sizes if s > max_batch_size]
                if bad:
                    raise ValueError(
                        f"parameter 'batch_buckets' has sizes {sorted(bad)} above max_batch_size={max_batch_size}"
                    )
            else:
                sizes = set(powers_of_two(1, max_batch_size)) | {p for p in preferred if p <= max_batch_size}
            sizes.add(max_batch_size)  # every batch the scheduler forms must fit a bucket
            batch_sizes = tuple(sorted(sizes))
        else:
            batch_sizes = ()
        return cls(
            max_batch_size=max_batch_size,
            batch_sizes=batch_sizes,
            seq_sizes=seq_buckets,
            seq_by_dim=dict(seq_by_dim or {}),
            max_batch_tokens=max_batch_tokens,
            mask_input=mask_input,
            mask_explicit=mask_explicit,
            pad_values=dict(pad_values or {}),
            max_dims=dict(max_dims or {}),
        )


@dataclass(frozen=True, slots=True)
class DimGroup:
    name: str  # the dim_param, or "<input>.<axis>" for an unnamed variable axis
    members: tuple[tuple[str, int], ...]  # (input, axis), axis counted with the batch dim
    outputs: tuple[tuple[str, int], ...]  # outputs carrying the same dim: trimmed per request
    buckets: tuple[int, ...]  # ascending; () = exact lengths (never padded)
    paddable: bool  # masked, or buckets given explicitly: rows of different lengths may share a batch
    named: bool  # a dim_param (so a static engine can fix it by name)
    why: str  # how the buckets were chosen, for the load log


Arrays = dict[str, np.ndarray]


def _reshaped(items: list[Arrays], rows: Mapping[str, tuple[int, ...]], batched: bool) -> list[Arrays]:
    if not rows:
        return items
    out = []
    for arrays in items:
        out.append({
            k: a.reshape((a.shape[0], *rows[k]) if batched else rows[k]) if k in rows else a
            for k, a in arrays.items()
        })  # fmt: skip
    return out


class ShapePlan:
    """The buckets of one model, and the arithmetic of padding a batch into one."""

    def __init__(self, inputs: list[TensorInfo], outputs: list[TensorInfo], config: BucketConfig) -> None:
        self.inputs = inputs
        self.outputs = outputs
        self.config = config
        self.batched = bool(config.batch_sizes)
        self.batch_sizes = config.batch_sizes
        self.max_batch_tokens = config.max_batch_tokens
        self.reshape_inputs = dict(config.reshape_inputs)
        self.reshape_outputs = dict(config.reshape_outputs)
        names = {t.name for t in inputs}
        for name in config.pad_values:
            if name not in names:
                raise ValueError(
                    f"parameter 'pad_value.{name}' names no input of the model ({sorted(names)})"
                )
        mask = config.mask_input if config.mask_input in names else None
        if config.mask_explicit and config.mask_input and mask is None:
            raise ValueError(
                f"parameter 'mask_input' names '{config.mask_input}', not an input ({sorted(names)})"
            )
        self.mask_input = mask
        self.pad_values = {t.name: config.pad_values.get(t.name, 0) for t in inputs}
        self.groups = self._groups(config)
        unknown = set(config.seq_by_dim) - {g.name for g in self.groups}
        if unknown:
            raise ValueError(
                f"parameters seq_buckets.<dim> name unknown dims {sorted(unknown)}; "
                f"variable dims of the model: {[g.name for g in self.groups]}"
            )
        # Batch dim name for free-dimension overrides (static engines); None when unnamed or mixed.
        first = {t.dims[0] for t in inputs if t.dims} if self.batched else set()
        self.batch_dim = next(iter(first)) if len(first) == 1 and isinstance(next(iter(first)), str) else None
        self.pooled, self.why_not_pooled = self._poolable()
        # key(): (input, axis, buckets) per group; the first member speaks for its tied siblings
        self._key_plan = [(g.members[0][0], g.members[0][1], g.buckets) for g in self.groups]
        self._member_axes = {t.name: [] for t in inputs}
        for gi, g in enumerate(self.groups):
            for name, axis in g.members:
                self._member_axes[name].append((axis, gi))
        self._output_axes = {t.name: [] for t in outputs}
        for gi, g in enumerate(self.groups):
            for name, axis in g.outputs:
                self._output_axes[name].append((axis, gi))

    # -- building ---------------------------------------------------------------------------

    def _groups(self, config: BucketConfig) -> list[DimGroup]:
        first_axis = 1 if self.batched else 0
        members: dict[str, list[tuple[str, int]]] = {}
        named: dict[str, bool] = {}
        for t in self.inputs:
            for axis, d in enumerate(t.dims):
                if axis < first_axis or isinstance(d, int):
                    continue
                name = d if isinstance(d, str) else f"{t.name}.{axis}"
                members.setdefault(name, []).append((t.name, axis))
                named.setdefault(name, isinstance(d, str))
        groups = []
        for name, mem in members.items():
            outs = tuple(
                (o.name, axis)
                for o in self.outputs
                for axis, d in enumerate(o.dims)
                if axis >= first_axis and d == name and named[name]
            )
            masked = self.mask_input is not None and any(n == self.mask_input for n, _ in mem)
            explicit = config.seq_by_dim.get(name, config.seq_sizes)
            if explicit is not None:
                buckets, why = explicit, "configured"
                paddable = bool(buckets)
            elif masked:
                caps = [config.max_dims[n] for n, _ in mem if n in config.max_dims]
                cap = min(caps) if caps else DEFAULT_MAX_SEQ_BUCKET
                low = min(DEFAULT_MIN_SEQ_BUCKET, cap)
                buckets = powers_of_two(low, cap)
                why, paddable = f"default: masked by '{self.mask_input}'", True
            else:
                buckets, paddable = (), False
                why = "exact: no mask input covers it (set seq_buckets to pad it)"
            groups.append(DimGroup(name, tuple(mem), outs, tuple(buckets), paddable, named[name], why))
        return groups

    def _poolable(self) -> tuple[bool, str]:
        if not self.batched:
            return False, "the model does not batch (max_batch_size 0)"
        for t in self.inputs + self.outputs:
            if t.dtype == np.dtype(object):
                return False, f"'{t.name}' is a string tensor"
        group_names = {g.name for g in self.groups}
        for o in self.outputs:
            for axis, d in enumerate(o.dims[1:], start=1):
                if not isinstance(d, int) and d not in group_names:
                    return False, f"output '{o.name}' dim {axis} ({d}) is not tied to an input dim"
        return True, ""

    # -- per call ---------------------------------------------------------------------------

    def key(self, arrays: Mapping[str, np.ndarray]) -> Hashable:
        """The batching key: each group's bucket (or exact length past the last bucket)."""
        out = []
        for name, axis, buckets in self._key_plan:
            n = arrays[name].shape[axis]
            i = bisect.bisect_left(buckets, n)
            out.append(buckets[i] if i < len(buckets) else n)
        return tuple(out)

    def batch_bucket(self, rows: int) -> int | None:
        i = bisect.bisect_left(self.batch_sizes, rows)
        return self.batch_sizes[i] if i < len(self.batch_sizes) else None

    def lengths(self, part: Mapping[str, np.ndarray]) -> tuple[int, ...]:
        return tuple(part[name].shape[axis] for name, axis, _ in self._key_plan)

    def seq_buckets_for(self, lengths: tuple[int, ...]) -> tuple[int, ...] | None:
        """Bucket of each group for rows up to ``lengths``; None when one is past its buckets."""
        out = []
        for n, (_, _, buckets) in zip(lengths, self._key_plan):
            i = bisect.bisect_left(buckets, n)
            if i == len(buckets):
                return None
            out.append(buckets[i])
        return tuple(out)

    def max_rows(self, seqs: tuple[int, ...]) -> int:
        """Rows one engine run may take at these lengths: a batch bucket within max_batch_tokens."""
        if not self.max_batch_tokens:
            return self.batch_sizes[-1]
        per_row = math.prod(seqs)
        fit = [b for b in self.batch_sizes if b * per_row <= self.max_batch_tokens]
        return fit[-1] if fit else self.batch_sizes[0]

    def slots(self) -> list[tuple[int, tuple[int, ...]]]:
        """Every (batch bucket, lengths) an engine can run: what warm-up prepares."""
        out = []
        for seqs in itertools.product(*(g.buckets for g in self.groups)):
            limit = self.max_rows(seqs)
            out.extend((b, seqs) for b in self.batch_sizes if b <= limit)
        return out

    def input_shape(self, name: str, rows: int, seqs: tuple[int, ...]) -> tuple[int, ...]:
        dims = list(next(t.dims for t in self.inputs if t.name == name))
        dims[0] = rows
        for axis, gi in self._member_axes[name]:
            dims[axis] = seqs[gi]
        return tuple(int(d) for d in dims)

    def output_shape(self, name: str, rows: int, seqs: tuple[int, ...]) -> tuple[int, ...]:
        dims = list(next(t.dims for t in self.outputs if t.name == name))
        dims[0] = rows
        for axis, gi in self._output_axes[name]:
            dims[axis] = seqs[gi]
        return tuple(int(d) for d in dims)

    def input_axes(self, name: str) -> list[tuple[int, int]]:
        """(axis, group index) of an input's variable dims."""
        return self._member_axes[name]

    def output_axes(self, name: str) -> list[tuple[int, int]]:
        return self._output_axes[name]

    @property
    def static_ok(self) -> bool:
        """Every symbolic dim has a name, so a static engine can fix them all by name."""
        return self.batch_dim is not None and all(g.named for g in self.groups)

    def overrides(self, rows: int, seqs: tuple[int, ...]) -> dict[str, int] | None:
        """Free-dimension overrides fixing every symbolic dim for a static engine; None if one is unnamed."""
        if not self.static_ok:
            return None
        out = {self.batch_dim: rows}
        out.update({g.name: s for g, s in zip(self.groups, seqs)})
        return out

    def to_model(self, parts: list[Arrays], batched: bool) -> list[Arrays]:
        """Each request's inputs in the shapes the ONNX model takes (``reshape``): views, no copy."""
        return _reshaped(parts, self.reshape_inputs, batched)

    def to_client(self, outputs: list[Arrays], batched: bool) -> list[Arrays]:
        """Each request's outputs back in the config's dims (``reshape``)."""
        return _reshaped(outputs, self.reshape_outputs, batched)

    def describe(self) -> str:
        parts = [f"batch {list(self.batch_sizes)}"]
        for g in self.groups:
            parts.append(f"{g.name} {list(g.buckets) or 'exact'} ({g.why})")
        if self.max_batch_tokens:
            parts.append(f"max_batch_tokens {self.max_batch_tokens}")
        return "; ".join(parts)
