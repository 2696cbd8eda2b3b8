"""The result cache, per row, between a model's runtime and its scheduler.

``ModelRuntime.infer`` hands a decoded request here when the model's config.pbtxt says
``response_cache { enable: true }`` and the server's cache is on (``build_cache``):

1. one key per row (``cache.keys``): model, version, model-file fingerprint, the outputs kept,
   each input's dtype and non-batch shape, the tenant namespace, and that row's input bytes;
2. memory (L1) for all rows at once, synchronously;
3. rows still missing that another request is already looking up or computing are waited for
   (``cache.SingleFlight``); the rest are claimed, asked of Redis (L2: one MGET, bounded by the
   lookup timeout), and what is still missing goes to the scheduler as one smaller request;
4. computed rows go into L1, are queued for Redis behind the response, the claim ends (waiters
   wake), and the response is put together in the request's row order.

A value is one row's outputs. When every kept output has fixed dims and a numeric dtype (the
usual case) it is their bytes side by side (``_Fixed``), so a request is reassembled with one
join and a few numpy views; otherwise each value carries its shapes (``_General``).

The request path only pays for this when the model enables it: ``ModelRuntime.infer`` checks
``self.cache is None`` and nothing else.
"""

from __future__ import annotations

import asyncio
import logging
import math
import struct
import time
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import asdict, dataclass
from itertools import compress, repeat
from operator import is_

import numpy as np

from batchgate.cache import Flight, MemoryCache, RedisLink, RedisTier, SingleFlight, TieredCache, model_prefix
from batchgate.cache import prefix_rows, row_keys, row_keys_parts
from batchgate.gateway.codec import deserialize_bytes, serialize_bytes
from batchgate.gateway.config import Settings
from batchgate.gateway.errors import GatewayError, Kind
from batchgate.gateway.repository import ModelSpec, TensorSpec

log = logging.getLogger(__name__)

Compute = Callable[[dict[str, np.ndarray], int], Awaitable[dict[str, np.ndarray]]]

# A claim whose owner failed for one of these reasons is abandoned, not failed: the reason is the
# owner's (its deadline, its place in a full queue, its tenant's limit), not the rows', so the
# waiters look again and one of them computes.
_OWNER_REASONS = frozenset({Kind.UNAVAILABLE, Kind.DEADLINE, Kind.EXHAUSTED})

_MAX_LAYOUTS = 4096  # per model: (outputs kept, namespace, input shapes) combinations remembered
_now = time.perf_counter_ns


async def build_cache(settings: Settings, redis: RedisLink | None = None) -> TieredCache | None:
    """The process's tiers from the server settings, connected; None when the cache is off.
    ``redis``: the process's one Redis link (the server's, shared with the rate limiter);
    without it the Redis tier gets a link of its own, closed with it."""
    tiers = settings.cache_tiers
    if tiers == "off":
        return None
    use_memory = tiers in ("auto", "memory", "memory+redis") and settings.cache_memory_bytes > 0
    use_redis = tiers in ("redis", "memory+redis") or (tiers == "auto" and bool(settings.redis_url))
    memory = MemoryCache(settings.cache_memory_bytes) if use_memory else None
    if use_redis:
        tier = RedisTier(
            redis or RedisLink.from_settings(settings),
            ttl_s=settings.cache_ttl_s,
            lookup_timeout_s=settings.cache_lookup_timeout_ms / 1000,
            key_prefix=settings.cache_redis_prefix.encode(),
            max_connections=settings.cache_redis_max_connections,
            write_queue_rows=settings.cache_write_queue_rows,
            close_link=redis is None,
        )
    else:
        tier = None
    if memory is None and tier is None:
        return None
    tiered = TieredCache(memory, tier)
    await tiered.start()
    log.info("result cache: %s", tiered.describe())
    return tiered


class _Uncacheable(Exception):
    """The model's outputs do not fit the layout (e.g. a data-dependent shape): answer uncached."""


class _OwnerFailed(Exception):
    """Rows this request waited for failed to compute in the request that claimed them."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


# -- value layouts ---------------------------------------------------------------------------------


class _Layout:
    """How one kind of request (outputs kept, namespace, input shapes) becomes keys and values."""

    __slots__ = ("prefix", "names", "batched", "inputs", "bytes_inputs", "tiled")
    width: int | None = None  # every value's length, when fixed

    def __init__(
        self, prefix: bytes, names: tuple[str, ...], batched: bool, inputs: list[TensorSpec]
    ) -> None:
        self.prefix = prefix
        self.names = names
        self.batched = batched
        self.inputs = [t.name for t in inputs]
        self.bytes_inputs = {t.name for t in inputs if t.datatype == "BYTES"}
        self.tiled = prefix_rows(prefix, 64)  # grown to the largest request seen

    def keys(self, arrays: dict[str, np.ndarray], rows: int) -> list[bytes]:
        if not self.bytes_inputs:
            if rows > len(self.tiled):
                self.tiled = prefix_rows(self.prefix, rows)
            return row_keys(self.prefix, [arrays[n] for n in self.inputs], rows, self.tiled)
        columns = []
        for n in self.inputs:
            a = arrays[n] if self.batched else arrays[n][None]
            if n in self.bytes_inputs:
                columns.append([serialize_bytes(a[r]) for r in range(rows)])
            else:
                flat = np.ascontiguousarray(a).reshape(rows, -1)
                columns.append([flat[r].tobytes() for r in range(rows)])
        return row_keys_parts(self.prefix, columns, rows)

    def pack(self, out: dict[str, np.ndarray], n: int) -> list[bytes]:
        raise NotImplementedError

    def unpack(self, values: Sequence[bytes], rows: int) -> dict[str, np.ndarray]:
        raise NotImplementedError


class _Fixed(_Layout):
    """Kept outputs all numeric with fixed dims: a value is the row's output bytes side by side."""

    __slots__ = ("dtypes", "dims", "widths", "width")

    def __init__(self, prefix, names, batched, inputs, outputs: list[TensorSpec]) -> None:
        super().__init__(prefix, names, batched, inputs)
        self.dtypes = [t.dtype for t in outputs]
        self.dims = [t.dims for t in outputs]
        self.widths = [math.prod(t.dims) * t.dtype.itemsize for t in outputs]
        self.width = sum(self.widths)

    def pack(self, out: dict[str, np.ndarray], n: int) -> list[bytes]:
        parts = []
        for name, dtype, dims in zip(self.names, self.dtypes, self.dims):
            a = out[name]
            if a.dtype != dtype or a.shape != ((n, *dims) if self.batched else dims):
                raise _Uncacheable(
                    f"output '{name}' is {a.dtype} {list(a.shape)}, expected {dtype} {list(dims)} per row"
                )
            parts.append(np.ascontiguousarray(a).reshape(n, -1).view(np.uint8))
        buf = (parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)).tobytes()
        w = self.width
        return [buf[o : o + w] for o in range(0, n * w, w)]

    def unpack(self, values: Sequence[bytes], rows: int) -> dict[str, np.ndarray]:
        buf = np.frombuffer(b"".join(values), np.uint8).reshape(rows, self.width)
        out = {}
        o = 0
        for name, dtype, dims, w in zip(self.names, self.dtypes, self.dims, self.widths):
            col = buf if w == self.width else buf[:, o : o + w]
            a = col.view(dtype)
            out[name] = a.reshape((rows, *dims)) if self.batched else a.reshape(dims)
            o += w
        return out


_DIM = struct.Struct("<I")


class _General(_Layout):
    """Some kept output is BYTES or has variable dims: a value carries, per output, its dims
    (u8 count, u32 each) then its bytes (BYTES elements as u32 length + bytes)."""

    __slots__ = ("specs",)

    def __init__(self, prefix, names, batched, inputs, outputs: list[TensorSpec]) -> None:
        super().__init__(prefix, names, batched, inputs)
        self.specs = outputs

    def pack(self, out: dict[str, np.ndarray], n: int) -> list[bytes]:
        rows: list[list[bytes]] = [[] for _ in range(n)]
        for t in self.specs:
            a = out[t.name] if self.batched else out[t.name][None]
            if a.shape[0] != n:
                raise _Uncacheable(f"output '{t.name}' has {a.shape[0]} rows for {n}")
            dims = a.shape[1:]
            head = struct.pack(f"<B{len(dims)}I", len(dims), *dims)
            is_bytes = t.datatype == "BYTES"
            if not is_bytes:
                flat = np.ascontiguousarray(a, dtype=t.dtype).reshape(n, -1)
            for r in range(n):
                body = serialize_bytes(a[r]) if is_bytes else flat[r].tobytes()
                rows[r].append(head + _DIM.pack(len(body)) + body)
        return [b"".join(parts) for parts in rows]

    def unpack(self, values: Sequence[bytes], rows: int) -> dict[str, np.ndarray]:
        shapes: list[tuple[int, ...] | None] = [None] * len(self.specs)
        bodies: list[list[bytes]] = [[] for _ in self.specs]
        for v in values:
            pos = 0
            for i in range(len(self.specs)):
                ndim = v[pos]
                dims = struct.unpack_from(f"<{ndim}I", v, pos + 1)
                pos += 1 + 4 * ndim
                (size,) = _DIM.unpack_from(v, pos)
                pos += 4
                if shapes[i] is None:
                    shapes[i] = dims
                elif shapes[i] != dims:  # rows computed apart came out in different shapes
                    raise _Uncacheable(f"output '{self.specs[i].name}' rows differ in shape")
                bodies[i].append(v[pos : pos + size])
                pos += size
            if pos != len(v):
                raise _Uncacheable("cached value has trailing bytes")
        out = {}
        for t, dims, parts in zip(self.specs, shapes, bodies):
            if t.datatype == "BYTES":
                a = deserialize_bytes(b"".join(parts), rows * math.prod(dims), t.name)
            else:
                a = np.frombuffer(b"".join(parts), t.dtype)
            a = a.reshape((rows, *dims))
            out[t.name] = a if self.batched else a[0]
        return out


# -- per model ----------------------------------------------------------------------------------------


@dataclass(slots=True)
class ModelCacheStats:
    hit_rows: int = 0  # rows answered from memory or Redis
    computed_rows: int = 0  # rows sent to the scheduler
    coalesced_rows: int = 0  # rows that waited for another request's claim (or repeated in one request)
    hit_requests: int = 0  # requests with nothing computed for them (Triton cache_hit) ...
    hit_ns: int = 0  # ... and their time in the cache, start to answer
    miss_requests: int = 0  # requests that computed rows (Triton cache_miss) ...
    miss_ns: int = 0  # ... and their time in the cache, compute excluded
    failed_requests: int = 0  # waiters answered with their owner's error ...
    failed_ns: int = 0
    uncacheable: int = 0  # requests answered without the cache: outputs did not fit the layout
    abandoned: int = 0  # claims given up by their owner (waiters looked again)


class ModelCache:
    """The cache as seen by one model version; the tiers are shared by all models."""

    def __init__(self, spec: ModelSpec, tiers: TieredCache) -> None:
        self.spec = spec
        self.tiers = tiers
        self.flights = SingleFlight()
        self.stat = ModelCacheStats()
        self._inputs = list(spec.inputs)
        self._outputs = list(spec.outputs)
        # What a request naming no outputs reads: all but the on-request outputs (layout None).
        self._all = spec.default_outputs
        self._on_request = bool(spec.params.on_request_outputs)
        self._variable_inputs = any(-1 in t.dims for t in spec.inputs)
        self._layouts: dict[Hashable, _Layout] = {}
        # The usual request (the default outputs, no namespace, fixed shapes) skips building a lookup key.
        self._plain: _Layout | None = None

    def _defaults(self, wanted: Sequence[tuple[str, bool]]) -> bool:
        """Whether ``wanted`` is the default outputs. Names are unique, so as many as the model's
        outputs is all of them; beside outputs given on request it must also be none of those."""
        return len(wanted) == len(self._all) and (
            not self._on_request or all(n in self._all for n, _ in wanted)
        )

    # -- layouts -----------------------------------------------------------------------------

    def _layout(
        self, arrays: dict[str, np.ndarray], wanted: Sequence[tuple[str, bool]] | None, namespace: str | None
    ) -> _Layout:
        if wanted is None or self._defaults(wanted):
            names = None  # the default outputs
        else:
            names = tuple(sorted(n for n, _ in wanted))
        # The input shapes are part of the key: read from the arrays, whatever the batcher groups by.
        if not self.spec.batched:
            shapes = tuple(arrays[t.name].shape for t in self._inputs)
        elif self._variable_inputs:
            shapes = tuple(arrays[t.name].shape[1:] for t in self._inputs)
        else:
            shapes = None  # fixed by the config, checked by the codec
        lk = (names, namespace, shapes)
        layout = self._layouts.get(lk)
        if layout is None:
            layout = self._make_layout(arrays, names, namespace)
            if len(self._layouts) >= _MAX_LAYOUTS:
                self._layouts.clear()
            self._layouts[lk] = layout
            if lk == (None, None, None) and self.spec.batched:
                self._plain = layout
        return layout

    def _make_layout(
        self, arrays: dict[str, np.ndarray], names: tuple[str, ...] | None, namespace: str | None
    ) -> _Layout:
        spec = self.spec
        keep = set(names) if names is not None else set(self._all)
        outputs = [t for t in self._outputs if t.name in keep]  # model order: one layout per set
        kept = tuple(t.name for t in outputs)
        shapes = [
            (t.name, t.datatype, tuple(arrays[t.name].shape[1:] if spec.batched else arrays[t.name].shape))
            for t in self._inputs
        ]
        prefix = model_prefix(spec.name, spec.version, spec.fingerprint, kept, shapes, namespace)
        fixed = all(t.datatype != "BYTES" and -1 not in t.dims for t in outputs)
        cls = _Fixed if fixed else _General
        return cls(prefix, kept, spec.batched, self._inputs, outputs)

    # -- the request path ----------------------------------------------------------------------

    async def infer(
        self,
        arrays: dict[str, np.ndarray],
        rows: int,
        compute: Compute,
        wanted: Sequence[tuple[str, bool]] | None = None,
        namespace: str | None = None,
    ) -> dict[str, np.ndarray]:
        """The outputs for ``arrays`` (all outputs, or at least the ``wanted`` ones), computing
        only the rows no tier holds and nobody is computing. ``compute(arrays, rows)`` is the
        scheduler call for a subset of the rows."""
        t0 = _now()
        st = self.stat
        layout = self._plain  # only ever set for a batched model with fixed input shapes
        if (
            layout is None
            or namespace is not None
            or (
                wanted is not None
                and (len(wanted) != len(self._all) or (self._on_request and not self._defaults(wanted)))
            )
        ):
            layout = self._layout(arrays, wanted, namespace)
        keys = layout.keys(arrays, rows)
        vals = self.tiers.local(keys)
        n_miss = vals.count(None)
        st.hit_rows += rows - n_miss
        if n_miss == rows:
            miss = list(range(rows))
        else:
            miss = list(compress(range(rows), map(is_, vals, repeat(None)))) if n_miss else []
        spent = 0  # ns in the scheduler (not the cache's time)
        whole = None
        try:
            while miss:
                miss, whole, ns = await self._resolve(miss, keys, vals, arrays, rows, layout, compute)
                spent += ns
                if miss:  # their owner went away; someone may have stored them since
                    again = self.tiers.local([keys[i] for i in miss])
                    st.hit_rows += len(again) - again.count(None)
                    for i, v in zip(miss, again):
                        vals[i] = v
                    miss = [i for i in miss if vals[i] is None]
            out = whole if whole is not None else layout.unpack(vals, rows)
        except _Uncacheable as exc:
            st.uncacheable += 1
            log.warning("model %s: answering uncached: %s", self.spec.name, exc)
            return await compute(arrays, rows)
        except _OwnerFailed as exc:
            st.failed_requests += 1
            st.failed_ns += _now() - t0
            raise exc.error from None
        if spent:
            st.miss_requests += 1
            st.miss_ns += _now() - t0 - spent
        else:
            st.hit_requests += 1
            st.hit_ns += _now() - t0
        return out

    async def _resolve(
        self, miss: list[int], keys: list[bytes], vals: list[bytes | None], arrays: dict[str, np.ndarray],
        rows: int, layout: _Layout, compute: Compute,
    ) -> tuple[list[int], dict[str, np.ndarray] | None, int]:  # fmt: skip
        """Fill ``vals`` for the ``miss`` rows; return rows to look at again (their owner went
        away), the computed outputs when they answer the whole request as they are, and the ns
        spent computing."""
        calls = self.flights.calls
        mkeys = keys if len(miss) == rows else list(map(keys.__getitem__, miss))
        waited: list[tuple[int, Flight, int]] = []
        dups: list[tuple[int, int]] = []
        if calls.keys().isdisjoint(mkeys) and len(set(mkeys)) == len(mkeys):
            own_keys, own_rows = mkeys, miss  # the usual case, decided in C: all ours, none repeated
        else:
            own_keys, own_rows = [], []
            own_at: dict[bytes, int] = {}
            for i, k in zip(miss, mkeys):
                f = calls.get(k)
                if f is not None:
                    waited.append((i, f, f.index(k)))
                else:
                    j = own_at.get(k)
                    if j is None:
                        own_at[k] = len(own_keys)
                        own_keys.append(k)
                        own_rows.append(i)
                    else:
                        dups.append((i, j))
        whole = None
        spent = 0
        if own_keys:
            whole, spent = await self._own(own_keys, own_rows, vals, arrays, rows, layout, compute)
        for i, j in dups:
            vals[i] = vals[own_rows[j]]
        st = self.stat
        st.coalesced_rows += len(dups)
        retry: list[int] = []
        if waited:
            await self.flights.wait({f for _, f, _ in waited})
            for i, f, j in waited:
                if f.values is not None:
                    vals[i] = f.values[j]
                elif f.error is not None:
                    raise _OwnerFailed(f.error)
                else:
                    retry.append(i)
            st.coalesced_rows += len(waited) - len(retry)
        return retry, whole, spent

    async def _own(
        self, keys: list[bytes], rows_of: list[int], vals: list[bytes | None], arrays: dict[str, np.ndarray],
        rows: int, layout: _Layout, compute: Compute,
    ) -> tuple[dict[str, np.ndarray] | None, int]:  # fmt: skip
        """Claim ``keys``, ask L2, compute the rest, store, end the claim; fill ``vals``."""
        sf = self.flights
        tiers = self.tiers
        flight = sf.begin(keys)
        values: list[bytes | None] = [None] * len(keys)
        whole = None
        spent = 0
        try:
            if tiers.redis is not None:
                got = await tiers.remote(keys, layout.width)
                if got is not None:
                    values = got
            n_todo = values.count(None)
            self.stat.hit_rows += len(keys) - n_todo
            if n_todo == len(keys):
                todo = range(n_todo)
            else:
                todo = list(compress(range(len(values)), map(is_, values, repeat(None)))) if n_todo else []
            if todo:
                n = len(todo)
                if n == rows:  # every row, in order, none repeated: send the request as it came
                    sub = arrays
                else:
                    idx = np.array(
                        rows_of if n == len(rows_of) else list(map(rows_of.__getitem__, todo)), np.intp
                    )
                    sub = {name: a.take(idx, axis=0) for name, a in arrays.items()}
                t = _now()
                try:
                    out = await compute(sub, n)
                except GatewayError as exc:
                    if exc.kind in _OWNER_REASONS:
                        sf.abandon(flight)
                        self.stat.abandoned += 1
                    else:
                        sf.fail(flight, exc)
                    raise
                except asyncio.CancelledError:
                    raise  # abandoned below
                except Exception as exc:
                    sf.fail(flight, GatewayError(Kind.FAILED, f"model '{self.spec.name}' failed: {exc}"))
                    raise
                spent = max(_now() - t, 1)
                self.stat.computed_rows += n
                try:
                    packed = layout.pack(out, n)
                except _Uncacheable:
                    if sub is arrays:  # answer this request with what was computed, uncached
                        log.warning(
                            "model %s: outputs do not fit the cache layout; not cached", self.spec.name
                        )
                        self.stat.uncacheable += 1
                        return out, spent
                    raise
                if n == len(keys):
                    values = packed
                    tiers.store(keys, packed)
                else:
                    for j, v in zip(todo, packed):
                        values[j] = v
                    tiers.store(list(map(keys.__getitem__, todo)), packed)
                if sub is arrays:
                    whole = out
            sf.finish(flight, values)  # after store: a later request finds the rows in L1
        finally:
            if not flight.done:  # cancelled, or a bug above: waiters look again
                sf.abandon(flight)
                self.stat.abandoned += 1
        if len(rows_of) == rows:
            vals[:] = values  # rows_of is every row, in order
        else:
            for i, v in zip(rows_of, values):
                vals[i] = v
        return whole, spent

    # -- figures ----------------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Flat counters for metrics: ``hits`` rows from a tier, ``misses`` rows from none of them
        (computed or coalesced), and the ``ModelCacheStats`` fields."""
        s = self.stat
        return {
            "hits": s.hit_rows,
            "misses": s.computed_rows + s.coalesced_rows,
            **asdict(s),
            "in_flight_rows": len(self.flights),
        }

    def fill_statistics(self, stats) -> None:
        """Triton's ModelStatistics ``inference_stats``: cache_hit / cache_miss, and requests
        answered without the scheduler counted as successes (inference_count and
        execution_count, from the scheduler, never include them)."""
        s = self.stat
        stats.cache_hit.count, stats.cache_hit.ns = s.hit_requests, s.hit_ns
        stats.cache_miss.count, stats.cache_miss.ns = s.miss_requests, s.miss_ns
        stats.success.count += s.hit_requests
        stats.success.ns += s.hit_ns
        stats.fail.count += s.failed_requests
        stats.fail.ns += s.failed_ns


def model_cache(spec: ModelSpec, tiers: TieredCache | None) -> ModelCache | None:
    """The model's cache when its config.pbtxt enables ``response_cache`` and the server has one."""
    if not spec.config.response_cache.enable:
        return None
    if tiers is None:
        log.warning(
            "model %s version %s: config.pbtxt enables response_cache but the server's result cache is off "
            "(cache_tiers=off or no tier left); serving uncached", spec.name, spec.version,
        )  # fmt: skip
        return None
    log.info("model %s version %s: result cache on", spec.name, spec.version)
    return ModelCache(spec, tiers)
