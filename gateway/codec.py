"""A ``Call``'s inputs -> numpy arrays, and numpy arrays -> the ``Answer``, checked against the
model's config (gateway/call.py: the plain types every transport translates its wire into).

Raw inputs become numpy views of the request's bytes (no copy). Every refusal names the input
and what was expected, so a client can fix its request from the message alone.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np

from batchgate.gateway import dtypes
from batchgate.gateway.call import Answer, Call, Output, Tensor
from batchgate.gateway.errors import GatewayError, Kind, invalid
from batchgate.gateway.repository import ModelSpec, TensorSpec, tokenized
from batchgate.workers import ort_capi

_LEN = struct.Struct("<I")


@dataclass(frozen=True, slots=True)
class Limits:
    """Server-wide request limits (Settings' security block), checked before anything is allocated;
    each refusal is INVALID_ARGUMENT naming the limit and its setting."""

    max_tensor_elements: int = 1 << 24
    max_string_bytes: int = 1 << 20
    max_inputs: int = 64

    @classmethod
    def from_settings(cls, settings) -> Limits:
        return cls(settings.max_tensor_elements, settings.max_string_bytes, settings.max_inputs)


LIMITS = Limits()


def set_limits(limits: Limits) -> None:
    """Set the process's limits (the server does, from its settings, at start)."""
    global LIMITS
    LIMITS = limits


def _too_long(name: str, i: int, n: int, limit: int) -> GatewayError:
    return invalid(
        f"input '{name}': BYTES element {i} is {n} bytes; the server accepts at most {limit} per element "
        "(limit max_string_bytes, BATCHGATE_MAX_STRING_BYTES)"
    )


def deserialize_bytes(buf: bytes, count: int, name: str, max_len: int | None = None) -> np.ndarray:
    """Triton's raw BYTES layout: per element a 4-byte little-endian length, then the bytes.
    ``max_len``: longest element accepted (refused before it is copied)."""
    if count * 4 > len(buf):  # every element needs its length prefix: refuse before allocating
        raise invalid(
            f"input '{name}': raw BYTES contents hold {len(buf)} bytes, too few for {count} elements "
            "(each element is a 4-byte little-endian length followed by its bytes)"
        )
    out = np.empty(count, dtype=object)
    view = memoryview(buf)
    pos = 0
    for i in range(count):
        if pos + 4 > len(buf):
            raise invalid(
                f"input '{name}': raw BYTES contents end after {i} of {count} elements "
                "(each element is a 4-byte little-endian length followed by its bytes)"
            )
        (n,) = _LEN.unpack_from(buf, pos)
        pos += 4
        if max_len is not None and n > max_len:
            raise _too_long(name, i, n, max_len)
        if pos + n > len(buf):
            raise invalid(
                f"input '{name}': raw BYTES element {i} claims {n} bytes but only {len(buf) - pos} remain"
            )
        out[i] = bytes(view[pos : pos + n])
        pos += n
    if pos != len(buf):
        raise invalid(
            f"input '{name}': raw BYTES contents hold {len(buf) - pos} bytes beyond {count} elements"
        )
    return out


def check_utf8(model: str, name: str, values) -> None:
    """Refuse a BYTES element that is not UTF-8, naming the input and the element.

    Only used when onnxruntime's C library cannot be loaded (``workers/ort_capi.py`` logs why):
    then strings reach a model through the Python API, which carries them as UTF-8 only
    (measured; see ``workers/engine.py``), so other bytes are refused here rather than altered.
    NUL bytes and empty strings are UTF-8 and pass as they are."""
    for i, v in enumerate(values):
        if v.isascii():
            continue
        try:
            v.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise invalid(
                f"input '{name}': BYTES element {i} is not valid UTF-8 ({exc.reason} at byte {exc.start}); "
                f"model '{model}' runs on onnxruntime, and this server could not load its C library, "
                "so strings reach the model through its Python API, as UTF-8 only "
                "(NUL bytes and empty strings are fine)"
            ) from None


def serialize_bytes(arr: np.ndarray) -> bytes:
    parts = []
    for item in arr.reshape(-1):
        b = item if isinstance(item, bytes) else str(item).encode()
        parts.append(_LEN.pack(len(b)))
        parts.append(b)
    return b"".join(parts)


@dataclass(frozen=True, slots=True)
class _Range:
    low: float
    high: float  # exclusive


class Codec:
    """Per-model decoder/encoder; built once at load so the per-call path only looks things up."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.name = spec.name
        self.version = spec.version
        self.batched = spec.batched
        self.max_batch_size = spec.max_batch_size
        self.inputs = {t.name: t for t in spec.inputs}
        self.outputs = {t.name: t for t in spec.outputs}
        self.expected = ", ".join(
            f"{t.name} ({t.datatype} {t.shape_text(self.batched)})" for t in spec.inputs
        )
        # batchgate's own per-input limits from config.pbtxt `parameters`:
        #   input_range.<input> = "low:high"  values must lie in [low, high)
        #   max_dim.<input>     = "N"         every variable (-1) dim at most N
        self.tied = list(spec.tied_dims.items())
        # A text model's input (dims [ 1 ]) also takes shape [N]: one string per row either way.
        self.flat_text = spec.inputs[0].name if tokenized(spec.config) else None
        # BYTES inputs the ONNX model itself reads (a text model's input goes to its tokeniser,
        # which takes any bytes) reach it byte for byte through ORT's C API; only where that
        # cannot be loaded must they be UTF-8 (the Python API's one lossless road).
        # (The library is loaded only for a model that has such an input.)
        self.utf8_inputs = {t.name for t in spec.inputs if t.datatype == "BYTES" and t.name != self.flat_text}
        if self.utf8_inputs and ort_capi.available():
            self.utf8_inputs = set()
        # (parsed and checked at load: gateway/parameters.py)
        self.ranges = {name: _Range(low, high) for name, (low, high) in spec.params.input_range.items()}
        self.max_dim = dict(spec.params.max_dim)
        self._fast = self._fast_inputs()
        # What a request that names no outputs gets: every output but those computed on request
        # (parameter on_request_outputs), raw (one shared list, read only).
        self._all_raw = [(name, True) for name in spec.default_outputs]

    def _fast_inputs(self) -> dict[str, tuple] | None:
        """The common request, decoded in one pass (``_decode_fast``): a batched model whose
        inputs are all numeric, sent as raw_input_contents. Per input: (datatype, dims as a list,
        bytes per row, elements per row, numpy dtype, the variable-dim limit); bytes and
        elements per row are None when a dim is variable (-1: a token model's sequence), which
        is then checked against ``max_dim`` and the dims tied across inputs.
        None when some input needs the general checks (BYTES, a text model's flat input)."""
        if not self.batched or self.flat_text:
            return None
        fast = {}
        for t in self.spec.inputs:
            if t.datatype == "BYTES" or not t.dims or any(d < 1 and d != -1 for d in t.dims):
                return None
            if -1 in t.dims:
                fast[t.name] = (t.datatype, list(t.dims), None, None, t.dtype, self.max_dim.get(t.name))
            else:
                per_row = math.prod(t.dims)
                fast[t.name] = (t.datatype, list(t.dims), per_row * t.dtype.itemsize, per_row, t.dtype, None)
        return fast

    # -- decode -------------------------------------------------------------------------------

    def decode(self, call: Call) -> tuple[dict[str, np.ndarray], int]:
        """Return the input arrays by name and the number of rows (1 for an unbatched model)."""
        if self._fast is not None:
            decoded = self._decode_fast(call.inputs)
            if decoded is not None:
                return decoded
        return self._decode(call.inputs)

    def _decode_fast(self, tensors: list[Tensor]) -> tuple[dict[str, np.ndarray], int] | None:
        """``_decode`` for a call every check of which passes, in fewer steps: the arrays, or None
        as soon as anything differs from the fast case (``_decode`` then runs the full checks and
        names what is wrong). Accepts nothing ``_decode`` refuses."""
        n = len(tensors)
        fast = self._fast
        if n != len(fast) or n > LIMITS.max_inputs:
            return None
        arrays: dict[str, np.ndarray] = {}
        rows = -1
        max_elements = LIMITS.max_tensor_elements
        for t in tensors:
            name = t.name
            entry = fast.get(name)
            buf = t.raw
            if entry is None or name in arrays or buf is None:
                return None
            datatype, dims, row_bytes, per_row, dtype, limit = entry
            shape = t.shape
            if t.datatype != datatype:
                return None
            if row_bytes is None:  # variable dims: each >= 1, at most max_dim, fixed ones equal
                if len(shape) != len(dims) + 1:
                    return None
                per_row = 1
                for d, w in zip(shape[1:], dims):
                    if d < 1 or (w != -1 and d != w) or (w == -1 and limit is not None and d > limit):
                        return None
                    per_row *= d
                row_bytes = per_row * dtype.itemsize
            elif list(shape[1:]) != dims:
                return None
            n_rows = shape[0]
            if rows == -1:
                if not 1 <= n_rows <= self.max_batch_size:
                    return None
                rows = n_rows
            elif n_rows != rows:
                return None
            if len(buf) != rows * row_bytes or rows * per_row > max_elements:
                return None
            arrays[name] = np.frombuffer(buf, dtype).reshape(shape)
        if self._untied(arrays) is not None:
            return None
        for name, rng in self.ranges.items():
            a = arrays[name]
            # a few ids: Python's min/max are cheaper than numpy's two reductions
            if a.dtype.kind in "iu" and a.size <= 32:
                values = a.ravel().tolist()
                low, high = min(values), max(values)
            else:
                low, high = a.min(), a.max()
            if low < rng.low or high >= rng.high:
                return None
        return arrays, rows

    def _untied(self, arrays: dict[str, np.ndarray]) -> tuple[str, list[tuple[str, int]]] | None:
        """The first dim the model uses one length for (token ids and their mask) that the inputs
        give different lengths, with its (input, axis) members; None when all agree."""
        for dim, members in self.tied:
            if len({arrays[n].shape[a] for n, a in members}) > 1:
                return dim, members
        return None

    def _decode(self, tensors: list[Tensor]) -> tuple[dict[str, np.ndarray], int]:
        limit = LIMITS.max_inputs
        if len(tensors) > limit:
            raise invalid(
                f"model '{self.name}': the request carries {len(tensors)} inputs; "
                f"the server accepts at most {limit} (limit max_inputs, BATCHGATE_MAX_INPUTS); expected inputs: {self.expected}"
            )
        arrays: dict[str, np.ndarray] = {}
        rows = -1
        for t in tensors:
            spec = self.inputs.get(t.name)
            if spec is None:
                raise invalid(
                    f"model '{self.name}' has no input named '{t.name}'; expected inputs: {self.expected}"
                )
            if t.name in arrays:
                raise invalid(f"input '{t.name}' is given more than once")
            shape = self._check_shape(t, spec)
            if self.batched:
                if rows == -1:
                    rows = shape[0]
                elif shape[0] != rows:
                    raise invalid(
                        f"input '{t.name}' has batch size {shape[0]} but an earlier input has {rows}; "
                        "all inputs must have the same first dim"
                    )
            arrays[t.name] = self._array(t, spec, shape)
        if len(arrays) != len(self.inputs):
            missing = [n for n in self.inputs if n not in arrays]
            raise invalid(
                f"model '{self.name}': missing input(s) "
                + ", ".join(
                    f"'{n}' ({self.inputs[n].datatype} {self.inputs[n].shape_text(self.batched)})"
                    for n in missing
                )
            )
        untied = self._untied(arrays)
        if untied is not None:
            dim, members = untied
            shapes = ", ".join(f"'{n}' {list(arrays[n].shape)}" for n, _ in members)
            raise invalid(f"inputs {shapes} must agree on dim '{dim}' (the model uses one length for all)")
        for name, rng in self.ranges.items():
            a = arrays[name]
            if a.size and (a.min() < rng.low or a.max() >= rng.high):
                raise invalid(
                    f"input '{name}' has values outside [{rng.low:g}, {rng.high:g}) "
                    f"(min {a.min()}, max {a.max()})"
                )
        return arrays, (rows if self.batched else 1)

    def _check_shape(self, t: Tensor, spec: TensorSpec) -> tuple[int, ...]:
        shape = tuple(t.shape)
        if t.name == self.flat_text and len(shape) == 1:
            shape = (*shape, 1)
        if t.datatype != spec.datatype:
            raise invalid(
                f"input '{t.name}' has datatype {t.datatype or '(empty)'}; model '{self.name}' expects {spec.datatype}"
            )
        want = ((-1,) + spec.dims) if self.batched else spec.dims
        ok = len(shape) == len(want) and all(d >= 0 and (w == -1 or d == w) for d, w in zip(shape, want))
        if not ok or (self.batched and shape[0] < 1) or any(d == 0 for d in shape[1:]):
            raise invalid(
                f"input '{t.name}' has shape {list(shape)}; model '{self.name}' expects {list(want)} "
                "(-1 there means any size; every dim sent must be >= 1)"
            )
        limit = self.max_dim.get(t.name)
        if limit is not None:
            dims = shape[1:] if self.batched else shape
            if any(d > limit and w == -1 for d, w in zip(dims, spec.dims)):
                raise invalid(
                    f"input '{t.name}' has shape {list(shape)}; its variable dims may be at most {limit}"
                )
        if self.batched and shape[0] > self.max_batch_size:
            raise invalid(
                f"input '{t.name}' has {shape[0]} rows; model '{self.name}' takes at most "
                f"max_batch_size={self.max_batch_size} per request"
            )
        count = math.prod(shape)  # Python ints: no overflow, whatever the dims
        if count > LIMITS.max_tensor_elements:
            raise invalid(
                f"input '{t.name}' has shape {list(shape)}: {count} elements; the server accepts at most "
                f"{LIMITS.max_tensor_elements} per tensor "
                "(limit max_tensor_elements, BATCHGATE_MAX_TENSOR_ELEMENTS)"
            )
        return shape

    def _array(self, t: Tensor, spec: TensorSpec, shape: tuple[int, ...]) -> np.ndarray:
        count = math.prod(shape)
        dtype = spec.dtype
        raw = t.raw
        if raw is not None:
            if spec.datatype == "BYTES":
                arr = deserialize_bytes(raw, count, t.name, LIMITS.max_string_bytes)
                if t.name in self.utf8_inputs:
                    check_utf8(self.name, t.name, arr)
                return arr.reshape(shape)
            need = count * dtype.itemsize
            if len(raw) != need:
                raise invalid(
                    f"input '{t.name}': raw_input_contents holds {len(raw)} bytes; shape {list(shape)} of "
                    f"{spec.datatype} needs {need}"
                )
            return np.frombuffer(raw, dtype=dtype).reshape(shape)
        field = dtypes.CONTENTS_FIELD.get(spec.datatype)
        if field is None:
            raise invalid(f"input '{t.name}': {spec.datatype} can only be sent as raw_input_contents")
        values = t.values if t.values is not None else ()
        if len(values) != count:
            raise invalid(
                f"input '{t.name}': contents.{field} holds {len(values)} values; shape {list(shape)} needs {count} "
                f"({spec.datatype} values travel in contents.{field})"
            )
        if spec.datatype == "BYTES":
            limit = LIMITS.max_string_bytes
            for i, v in enumerate(values):
                if len(v) > limit:
                    raise _too_long(t.name, i, len(v), limit)
            if t.name in self.utf8_inputs:
                check_utf8(self.name, t.name, values)
            arr = np.empty(count, dtype=object)
            arr[:] = list(values)
            return arr.reshape(shape)
        try:
            return np.array(values, dtype=dtype).reshape(shape)
        except (OverflowError, ValueError, TypeError) as exc:  # e.g. 300 for a UINT8 input
            raise invalid(f"input '{t.name}': a value is not {spec.datatype}: {exc}") from None

    # -- encode -------------------------------------------------------------------------------

    def requested(self, call: Call) -> list[tuple[str, bool]]:
        """(output name, as raw bytes) for each output to return; by default the model's default
        outputs (all but its on-request ones), raw."""
        if not call.outputs:
            return self._all_raw
        out = []
        seen = set()
        for o in call.outputs:
            if o.name in seen:
                raise invalid(f"output '{o.name}' is requested more than once")
            seen.add(o.name)
            if o.name not in self.outputs:
                raise invalid(
                    f"model '{self.name}' has no output named '{o.name}'; outputs: {sorted(self.outputs)}"
                )
            params = o.parameters
            if "classification" in params:
                raise GatewayError(
                    Kind.UNSUPPORTED, f"output '{o.name}': the classification extension is not supported"
                )
            out.append((o.name, params.get("binary_data", True) is not False))
        return out

    def encode(self, call: Call, outputs: dict[str, np.ndarray], wanted: list[tuple[str, bool]]) -> Answer:
        specs = self.outputs
        return Answer(
            self.name, self.version, call.id, [Output(n, specs[n].datatype, outputs[n], b) for n, b in wanted]
        )
