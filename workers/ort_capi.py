"""ONNX Runtime's C API through ctypes, for the one thing its Python binding cannot do: carry
string tensors byte for byte.

onnxruntime's Python binding converts string elements through Python ``str`` (see "string
tensors" in engine.py): bytes that are not UTF-8 cannot reach a model, nor leave one. The C API
has exact-length strings both ways — ``GetResizedStringTensorElementBuffer`` (one element of
any length, NULs included) on the way in, ``GetStringTensorContent`` (all elements with explicit
offsets) on the way out — and the wheel ships the C library beside its Python module
(``onnxruntime/capi/libonnxruntime.so.<version>``), so no compiler is needed to reach it.

What is bound: only what a session needs here (env, session options, a session from a path or
from bytes, CPU memory info, tensors in and out, Run, Release* for each), by the index of each
function pointer in the ``OrtApi`` struct. The indices were read from ``onnxruntime_c_api.h`` of
ORT 1.29 (``ORT_API_VERSION`` 29) and checked to be the same in the headers of every release
from 1.15 to 1.29: the struct is append-only (ORT's ABI rule), so a library that hands out
version 29 of the struct has these functions at these places. ``load()`` asks the library for
exactly that version and refuses (returns None, with one log line) when the library is missing,
older, or fails a probe of the first entries; the engine then keeps the Python binding's
UTF-8-only path.

This is a second copy of ORT in the process: the Python module is self-contained and does not
export the C API, so the library is loaded beside it (its code pages are shared, but it has its
own env, thread pools and allocators). Only models whose graph reads or writes strings use it.

ctypes releases the GIL around every foreign call, so a worker thread inside ``Run`` does not
hold up the event loop or the other workers, as with the Python binding.
"""

from __future__ import annotations

import ctypes
import logging
import math
import struct
import threading
from itertools import accumulate
from ctypes import POINTER, byref, c_char, c_char_p, c_int, c_size_t, c_uint32, c_void_p
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

API_VERSION = 29  # the OrtApi struct version whose layout the indices below follow

# ONNXTensorElementDataType
_STRING = 8
_ELEM_OF = {
    np.dtype(np.float32): 1, np.dtype(np.uint8): 2, np.dtype(np.int8): 3, np.dtype(np.uint16): 4,
    np.dtype(np.int16): 5, np.dtype(np.int32): 6, np.dtype(np.int64): 7, np.dtype(np.bool_): 9,
    np.dtype(np.float16): 10, np.dtype(np.float64): 11, np.dtype(np.uint32): 12, np.dtype(np.uint64): 13,
}  # fmt: skip
_DTYPE_OF = {v: k for k, v in _ELEM_OF.items()}
_ONNX_TYPE_TENSOR = 1
_LOG_WARNING = 2  # OrtLoggingLevel
_DEVICE_ALLOCATOR, _MEM_DEFAULT = 0, 0  # OrtAllocatorType, OrtMemType: what the Python binding uses for numpy
_ENABLE_ALL, _DISABLE_ALL = 99, 0  # GraphOptimizationLevel

# OrtErrorCode -> the exception the Python binding raises for it (so callers see one kind of error
# whichever binding ran the model), and the name it prints.
_ERRORS = [
    ("OK", "Fail"), ("FAIL", "Fail"), ("INVALID_ARGUMENT", "InvalidArgument"), ("NO_SUCHFILE", "NoSuchFile"),
    ("NO_MODEL", "NoModel"), ("ENGINE_ERROR", "EngineError"), ("RUNTIME_EXCEPTION", "RuntimeException"),
    ("INVALID_PROTOBUF", "InvalidProtobuf"), ("MODEL_LOADED", "ModelLoaded"), ("NOT_IMPLEMENTED", "NotImplemented"),
    ("INVALID_GRAPH", "InvalidGraph"), ("EP_FAIL", "EPFail"),
]  # fmt: skip

_P = c_void_p
_SEP = bytearray(b"\x00")
_SIZE_T = ctypes.sizeof(c_size_t)
_PP = POINTER(c_void_p)
_status = c_void_p  # OrtStatus*; NULL (None in Python) is success

# name: (index in OrtApi, restype, argtypes). Signatures as declared in onnxruntime_c_api.h.
_FUNCTIONS = {
    "CreateStatus": (0, _P, [c_int, c_char_p]),
    "GetErrorCode": (1, c_int, [_P]),
    "GetErrorMessage": (2, c_char_p, [_P]),
    "CreateEnv": (3, _status, [c_int, c_char_p, _PP]),
    "CreateSession": (7, _status, [_P, c_char_p, _P, _PP]),
    "CreateSessionFromArray": (8, _status, [_P, _P, c_size_t, _P, _PP]),
    "Run": (9, _status, [_P, _P, _P, _P, c_size_t, _P, c_size_t, _P]),
    "CreateSessionOptions": (10, _status, [_PP]),
    "SetSessionGraphOptimizationLevel": (23, _status, [_P, c_int]),
    "SetIntraOpNumThreads": (24, _status, [_P, c_int]),
    "SetInterOpNumThreads": (25, _status, [_P, c_int]),
    "SessionGetInputCount": (30, _status, [_P, POINTER(c_size_t)]),
    "SessionGetOutputCount": (31, _status, [_P, POINTER(c_size_t)]),
    "SessionGetInputTypeInfo": (33, _status, [_P, c_size_t, _PP]),
    "SessionGetOutputTypeInfo": (34, _status, [_P, c_size_t, _PP]),
    "SessionGetInputName": (36, _status, [_P, c_size_t, _P, _PP]),
    "SessionGetOutputName": (37, _status, [_P, c_size_t, _P, _PP]),
    "CreateTensorAsOrtValue": (48, _status, [_P, _P, c_size_t, c_int, _PP]),
    "CreateTensorWithDataAsOrtValue": (49, _status, [_P, _P, c_size_t, _P, c_size_t, c_int, _PP]),
    "GetTensorMutableData": (51, _status, [_P, _PP]),
    "FillStringTensor": (52, _status, [_P, _P, c_size_t]),
    "GetStringTensorDataLength": (53, _status, [_P, POINTER(c_size_t)]),
    "GetStringTensorContent": (54, _status, [_P, _P, c_size_t, _P, c_size_t]),
    "CastTypeInfoToTensorInfo": (55, _status, [_P, _PP]),
    "GetOnnxTypeFromTypeInfo": (56, _status, [_P, POINTER(c_int)]),
    "GetTensorElementType": (60, _status, [_P, POINTER(c_int)]),
    "GetDimensionsCount": (61, _status, [_P, POINTER(c_size_t)]),
    "GetDimensions": (62, _status, [_P, _P, c_size_t]),
    "GetTensorShapeElementCount": (64, _status, [_P, POINTER(c_size_t)]),
    "GetTensorTypeAndShape": (65, _status, [_P, _PP]),
    "CreateCpuMemoryInfo": (69, _status, [c_int, c_int, _PP]),
    "AllocatorFree": (76, _status, [_P, _P]),
    "GetAllocatorWithDefaultOptions": (78, _status, [_PP]),
    "ReleaseStatus": (93, None, [_P]),
    "ReleaseMemoryInfo": (94, None, [_P]),
    "ReleaseSession": (95, None, [_P]),
    "ReleaseValue": (96, None, [_P]),
    "ReleaseTypeInfo": (98, None, [_P]),
    "ReleaseTensorTypeAndShapeInfo": (99, None, [_P]),
    "ReleaseSessionOptions": (100, None, [_P]),
    "AddSessionConfigEntry": (130, _status, [_P, c_char_p, c_char_p]),
    "GetResizedStringTensorElementBuffer": (252, _status, [_P, c_size_t, c_size_t, _PP]),
}


class _ApiBase(ctypes.Structure):
    _fields_ = [
        ("GetApi", ctypes.CFUNCTYPE(c_void_p, c_uint32)),
        ("GetVersionString", ctypes.CFUNCTYPE(c_char_p)),
    ]


class Api:
    """The bound functions of one loaded library, plus the objects shared by its sessions: the
    process's one env, the CPU memory info for numpy buffers and the default allocator."""

    def __init__(self, lib_path: Path) -> None:
        lib = ctypes.CDLL(str(lib_path))
        get_base = lib.OrtGetApiBase
        get_base.restype = POINTER(_ApiBase)
        get_base.argtypes = []
        base = get_base().contents
        self.version = base.GetVersionString().decode()
        self.path = lib_path
        api = base.GetApi(API_VERSION)
        if not api:
            raise OSError(
                f"{lib_path} (ORT {self.version}) does not provide version {API_VERSION} of the C API"
            )
        table = ctypes.cast(api, POINTER(c_void_p))
        for name, (index, restype, argtypes) in _FUNCTIONS.items():
            proto = ctypes.CFUNCTYPE(restype, *argtypes)  # releases the GIL around each call
            setattr(self, name, proto(table[index]))
        self._lib = lib  # kept: the function pointers live in it
        self._probe()
        env = c_void_p()
        self.check(self.CreateEnv(_LOG_WARNING, b"batchgate", byref(env)))
        # One env per process, kept for the process's life as the Python binding keeps its own:
        # ORT allows one, and its sessions must not outlive it.
        self.env = env
        info = c_void_p()
        self.check(self.CreateCpuMemoryInfo(_DEVICE_ALLOCATOR, _MEM_DEFAULT, byref(info)))
        self.cpu = info  # kept as long as the env
        alloc = c_void_p()
        self.check(self.GetAllocatorWithDefaultOptions(byref(alloc)))
        self.allocator = alloc  # owned by ORT: never released

    def _probe(self) -> None:
        """The first entries must behave as the header says; a wrong table fails here, not in Run."""
        status = self.CreateStatus(2, b"batchgate probe")
        try:
            ok = self.GetErrorCode(status) == 2 and self.GetErrorMessage(status) == b"batchgate probe"
        finally:
            self.ReleaseStatus(status)
        if not ok:
            raise OSError(f"{self.path}: the C API table does not answer as version {API_VERSION} describes")

    def check(self, status) -> None:
        """Raise the Python binding's exception for a failed OrtStatus (and release it)."""
        if not status:
            return
        code = self.GetErrorCode(status)
        message = (self.GetErrorMessage(status) or b"").decode("utf-8", "replace")
        self.ReleaseStatus(status)
        name, cls_name = _ERRORS[code] if 0 <= code < len(_ERRORS) else (str(code), "Fail")
        from onnxruntime.capi import onnxruntime_pybind11_state as state

        raise getattr(state, cls_name, RuntimeError)(f"[ONNXRuntimeError] : {code} : {name} : {message}")


_lock = threading.Lock()
_api: Api | None = None
_tried = False


def library_path() -> Path | None:
    """The C library the installed onnxruntime wheel ships beside its Python module."""
    try:
        import onnxruntime as ort
    except ImportError:
        return None
    capi = Path(ort.__file__).parent / "capi"
    exact = capi / f"libonnxruntime.so.{ort.__version__}"
    if exact.is_file():
        return exact
    found = sorted(capi.glob("libonnxruntime.so*")) + sorted(capi.glob("libonnxruntime*.dylib"))
    found += sorted(capi.glob("onnxruntime.dll"))
    return found[0] if found else None


def load() -> Api | None:
    """The bound C API, loaded once per process; None (logged once) when it cannot be used."""
    global _api, _tried
    if _tried:
        return _api
    with _lock:
        if not _tried:
            path = library_path()
            try:
                if path is None:
                    raise OSError("the onnxruntime wheel ships no libonnxruntime beside its Python module")
                _api = Api(path)
                log.debug("ONNX Runtime C API %d bound from %s (ORT %s)", API_VERSION, path, _api.version)
            except (OSError, AttributeError) as exc:
                log.warning(
                    "ONNX Runtime's C API is not usable (%s): string tensors pass to models as UTF-8 only, "
                    "through the Python binding", exc,
                )  # fmt: skip
            _tried = True
    return _api


def available() -> bool:
    """Whether string tensors can reach models byte for byte in this process."""
    return load() is not None


class Session:
    """One ORT session on the CPU provider, run with numpy arrays in and out; string tensors are
    object arrays of ``bytes``, carried exactly."""

    def __init__(
        self,
        model: Path | bytes,
        *,
        intra_op_threads: int = 1,
        inter_op_threads: int = 1,
        graph_optimization: bool = True,
        api: Api | None = None,
    ) -> None:
        self._session = c_void_p()  # set first: close() must work whatever fails below
        api = api or load()
        if api is None:
            raise RuntimeError("ONNX Runtime's C API is not available in this process")
        self.api = api
        opts = c_void_p()
        api.check(api.CreateSessionOptions(byref(opts)))
        try:
            api.check(api.SetIntraOpNumThreads(opts, intra_op_threads))
            api.check(api.SetInterOpNumThreads(opts, inter_op_threads))
            # Worker threads are the unit of parallelism (as in sessions.py): no spinning ORT threads.
            api.check(api.AddSessionConfigEntry(opts, b"session.intra_op.allow_spinning", b"0"))
            level = _ENABLE_ALL if graph_optimization else _DISABLE_ALL
            api.check(api.SetSessionGraphOptimizationLevel(opts, level))
            if isinstance(model, bytes | bytearray):
                data = bytes(model)
                api.check(api.CreateSessionFromArray(api.env, data, len(data), opts, byref(self._session)))
            else:
                api.check(api.CreateSession(api.env, str(model).encode(), opts, byref(self._session)))
        finally:
            api.ReleaseSessionOptions(opts)
        self.input_names, self.input_types = self._io(api.SessionGetInputCount, api.SessionGetInputName,
                                                      api.SessionGetInputTypeInfo)  # fmt: skip
        self.output_names, self.output_types = self._io(api.SessionGetOutputCount, api.SessionGetOutputName,
                                                        api.SessionGetOutputTypeInfo)  # fmt: skip
        self._out_types = dict(zip(self.output_names, self.output_types))
        self._name_arrays: dict[tuple[str, ...], ctypes.Array] = {}

    def _io(self, count_fn, name_fn, type_fn) -> tuple[list[str], list[int]]:
        """Names and element types (ONNXTensorElementDataType; -1 for a non-tensor) in graph order."""
        api = self.api
        n = c_size_t()
        api.check(count_fn(self._session, byref(n)))
        names, types = [], []
        for i in range(n.value):
            p = c_void_p()
            api.check(name_fn(self._session, i, api.allocator, byref(p)))
            try:
                names.append(ctypes.string_at(p).decode())
            finally:
                api.check(api.AllocatorFree(api.allocator, p))
            info = c_void_p()
            api.check(type_fn(self._session, i, byref(info)))
            try:
                kind = c_int()
                api.check(api.GetOnnxTypeFromTypeInfo(info, byref(kind)))
                elem = c_int(-1)
                if kind.value == _ONNX_TYPE_TENSOR:
                    tensor = c_void_p()  # borrowed from info: not released
                    api.check(api.CastTypeInfoToTensorInfo(info, byref(tensor)))
                    api.check(api.GetTensorElementType(tensor, byref(elem)))
                types.append(elem.value)
            finally:
                api.ReleaseTypeInfo(info)
        return names, types

    def run(self, output_names: list[str] | None, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """As ``InferenceSession.run``; string outputs come back as object arrays of ``bytes``."""
        api = self.api
        names = self.output_names if output_names is None else output_names
        if len(feeds) < len(self.input_names) and (
            missing := [n for n in self.input_names if n not in feeds]
        ):
            # (ORT's C API runs what it can and fails somewhere inside; say it as the Python binding does)
            raise ValueError(f"Required inputs ({missing}) are missing from input feed ({list(feeds)}).")
        in_names = self._names(tuple(feeds))
        out_names = self._names(tuple(names))
        n_in, n_out = len(feeds), len(names)
        values = (c_void_p * n_in)()
        outputs = (c_void_p * n_out)()
        keep = []  # what the input values point into, alive until Run returns
        try:
            for i, (name, arr) in enumerate(feeds.items()):
                values[i] = self._tensor(name, arr, keep)
            api.check(api.Run(self._session, None, in_names, values, n_in, out_names, n_out, outputs))
            return [self._array(names[i], outputs[i]) for i in range(n_out)]
        finally:
            for v in values:
                if v:
                    api.ReleaseValue(v)
            for v in outputs:
                if v:
                    api.ReleaseValue(v)

    def _names(self, names: tuple[str, ...]):
        """A C array of ``names``, made once per distinct tuple (a model has few)."""
        arr = self._name_arrays.get(names)
        if arr is None:
            if len(self._name_arrays) > 64:
                self._name_arrays.clear()
            arr = self._name_arrays[names] = (c_char_p * len(names))(*(n.encode() for n in names))
        return arr

    def _tensor(self, name: str, arr: np.ndarray, keep: list) -> int:
        api = self.api
        shape = struct.pack(f"{arr.ndim}q", *arr.shape)  # int64_t[ndim], passed by address
        value = c_void_p()
        if arr.dtype == object:
            api.check(api.CreateTensorAsOrtValue(api.allocator, shape, arr.ndim, _STRING, byref(value)))
            try:
                _fill_strings(api, value, name, arr)
            except BaseException:
                api.ReleaseValue(value)
                raise
            return value.value
        elem = _ELEM_OF.get(arr.dtype)
        if elem is None:
            raise ValueError(f"input '{name}': numpy dtype {arr.dtype} has no ONNX tensor type")
        arr = np.ascontiguousarray(arr)
        keep.append(arr)
        api.check(api.CreateTensorWithDataAsOrtValue(
            api.cpu, arr.ctypes.data, arr.nbytes, shape, arr.ndim, elem, byref(value)
        ))  # fmt: skip
        return value.value

    def _array(self, name: str, value: int) -> np.ndarray:
        api = self.api
        info = c_void_p()
        api.check(api.GetTensorTypeAndShape(value, byref(info)))
        try:
            elem = self._out_types.get(name, -1)
            if elem == -1:
                e = c_int()
                api.check(api.GetTensorElementType(info, byref(e)))
                elem = e.value
            ndim = c_size_t()
            api.check(api.GetDimensionsCount(info, byref(ndim)))
            dims = bytearray(8 * ndim.value or 1)  # int64_t[ndim]
            api.check(api.GetDimensions(info, _address(dims), ndim.value))
        finally:
            api.ReleaseTensorTypeAndShapeInfo(info)
        shape = struct.unpack_from(f"{ndim.value}q", dims)  # (reading the array item by item is slower)
        if elem == _STRING:
            return _read_strings(api, value, math.prod(shape)).reshape(shape)
        dtype = _DTYPE_OF.get(elem)
        if dtype is None:
            raise TypeError(f"output '{name}' has ONNX element type {elem}, which batchgate does not return")
        out = np.empty(shape, dtype=dtype)
        if out.nbytes:
            p = c_void_p()
            api.check(api.GetTensorMutableData(value, byref(p)))
            ctypes.memmove(out.ctypes.data, p, out.nbytes)
        return out

    def close(self) -> None:
        if self._session:
            self.api.ReleaseSession(self._session)
            self._session = c_void_p()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at interpreter exit ctypes may already be gone
            pass


def _fill_strings(api: Api, value: c_void_p, name: str, arr: np.ndarray) -> None:
    items = arr.reshape(-1).tolist()
    try:
        items = [v if type(v) is bytes else _as_bytes(v) for v in items]
    except (TypeError, UnicodeEncodeError):
        i, why = next((i, why) for i, v in enumerate(items) if (why := _not_bytes(v)))
        raise ValueError(f"input '{name}': element {i} {why}") from None
    n = len(items)
    if not n:
        return
    # All elements in one call (FillStringTensor) from one buffer holding them NUL-terminated,
    # side by side; FillStringTensor reads C strings, so an element holding a NUL goes in empty
    # here and is then written at its exact length (GetResizedStringTensorElementBuffer).
    joined = _SEP.join(items)
    joined.append(0)
    with_nul = [] if joined.count(0) == n else [i for i, b in enumerate(items) if 0 in b]
    fill = items
    if with_nul:
        fill = list(items)
        for i in with_nul:
            fill[i] = b""
        joined = _SEP.join(fill)
        joined.append(0)
    starts = accumulate([len(b) + 1 for b in fill[:-1]], initial=_address(joined))
    pointers = struct.pack(f"{n}N", *starts)  # const char*[n], passed by address
    api.check(api.FillStringTensor(value, pointers, n))
    buf = c_void_p()
    for i in with_nul:
        b = items[i]
        api.check(api.GetResizedStringTensorElementBuffer(value, i, len(b), byref(buf)))
        ctypes.memmove(buf, b, len(b))


def _read_strings(api: Api, value: int, n: int) -> np.ndarray:
    """A string tensor's elements, exactly: all bytes at once plus each element's start offset."""
    out = np.empty(n, dtype=object)
    if not n:
        return out
    size = c_size_t()
    api.check(api.GetStringTensorDataLength(value, byref(size)))
    total = size.value
    buf = bytearray(total or 1)
    starts = bytearray(_SIZE_T * n)
    api.check(api.GetStringTensorContent(value, _address(buf), total, _address(starts), n))
    data = bytes(buf) if total else b""
    bounds = [*struct.unpack_from(f"{n}N", starts), total]
    out[:] = [data[a:b] for a, b in zip(bounds, bounds[1:])]
    return out


def _address(buf: bytearray) -> int:
    """Where a bytearray's data lies, for the length of one foreign call (nothing may resize it
    meanwhile). Buffers are never ctypes arrays of their length: ctypes makes a new array type
    for every length it sees, which costs more than the model run for strings of varied sizes."""
    return ctypes.addressof(c_char.from_buffer(buf))


def _as_bytes(v) -> bytes:
    if isinstance(v, bytes | bytearray | memoryview):
        return bytes(v)
    if isinstance(v, str):
        return v.encode("utf-8")
    # Never bytes(v) on anything else: bytes(3) is three NULs, a silently wrong string.
    raise TypeError(type(v).__name__)


def _not_bytes(v) -> str:
    """Why ``v`` cannot be a string element ("" when it can)."""
    try:
        _as_bytes(v)
    except UnicodeEncodeError:
        return "is a str that cannot be encoded as UTF-8"
    except TypeError:
        return f"is a {type(v).__name__}, not a string"
    return ""
