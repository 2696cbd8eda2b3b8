"""OpenVINO behind the engine contract: a compiled model that the worker's Engine drives like an
ONNX Runtime session (run, bound slots), so buckets, pooled buffers, warm-up and the dynamic path
stay the same code.

Why one compiled model with dynamic shapes per worker, not one per bucket: measured on minilm
(OpenVINO 2026.4, BF16, one thread, docs/engines.md), a model reshaped to a static shape runs a
batch 2-10 % faster than the dynamic one, but compiling it costs ~0.14 s and a copy of the weights
per shape; the dynamic model's first run at a new shape costs ~5 ms once. So the buckets are bound
views over one compiled model, as ``shared`` mode does with ONNX Runtime.

Bound slots: each slot owns an infer request whose input and output tensors share the memory of
the slot's numpy views (``ov.Tensor(array, shared_memory=True)``): a batch copied into the views is
what the model reads, and the model writes its outputs straight into the output views.

Precision: ``INFERENCE_PRECISION_HINT`` is always set explicitly (``bf16`` or ``f32``), never left
to OpenVINO's per-CPU default, so the precision a model is known by (its cache identity, its
metrics) is the one it computes in. ``native_bf16()`` says whether this CPU computes BF16 in
hardware (AMX or AVX-512 BF16); elsewhere OpenVINO would emulate it, slower than FP32.

``openvino`` is an optional extra (``pip install 'batchgate[openvino]'``); nothing imports it until
a model asks for this engine.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np

from batchgate.workers.devices import cpu_flags, flag_set

PACKAGE = "openvino"
PRECISIONS = ("fp32", "bf16")  # what INFERENCE_PRECISION_HINT is set to; INT8 is in the model file
_HINT = {"fp32": "f32", "bf16": "bf16"}
_core = None
_core_lock = threading.Lock()


class OpenVINOMissing(RuntimeError):
    """The model asks for OpenVINO and the package is not installed."""


def available() -> bool:
    try:
        import openvino  # noqa: F401
    except ImportError:
        return False
    return True


def require() -> None:
    if not available():
        raise OpenVINOMissing(
            "engine 'openvino' needs the openvino package, which is not installed: "
            "pip install 'batchgate[openvino]' (or serve this model with engine 'onnxruntime')"
        )


def version() -> str:
    import openvino as ov

    return ov.get_version()


def native_bf16(flags: str | None = None) -> bool:
    """Whether this CPU computes BF16 in hardware: AMX (amx_bf16) or AVX-512 BF16."""
    have = flag_set(cpu_flags() if flags is None else flags)
    return bool(have & {"amx_bf16", "avx512_bf16"})


def resolve_precision(asked: str, flags: str | None = None) -> str:
    """``auto`` -> ``bf16`` where the CPU computes BF16 natively, else ``fp32``; others unchanged."""
    if asked == "auto":
        return "bf16" if native_bf16(flags) else "fp32"
    if asked not in PRECISIONS:
        raise ValueError(f"OpenVINO precision must be auto, {' or '.join(PRECISIONS)}, got '{asked}'")
    return asked


def core():
    """One ``ov.Core`` per process (it holds the plugins; creating one per worker costs ~0.1 s)."""
    global _core
    require()
    with _core_lock:
        if _core is None:
            import openvino as ov

            _core = ov.Core()
        return _core


class _Port:
    """What the Engine reads of an ORT NodeArg: the name and the ONNX type string."""

    __slots__ = ("name", "type")

    def __init__(self, name: str, type_: str) -> None:
        self.name = name
        self.type = type_


_ONNX_TYPE = {
    "f32": "tensor(float)", "f16": "tensor(float16)", "bf16": "tensor(bfloat16)", "f64": "tensor(double)",
    "i64": "tensor(int64)", "i32": "tensor(int32)", "i8": "tensor(int8)", "u8": "tensor(uint8)",
    "boolean": "tensor(bool)", "string": "tensor(string)",
}  # fmt: skip


def _port_type(port) -> str:
    et = port.get_element_type().get_type_name()
    return _ONNX_TYPE.get(et, f"tensor({et})")


class Session:
    """A compiled OpenVINO model with the part of ONNX Runtime's session API the Engine uses."""

    def __init__(
        self, model_path: Path, *, precision: str, threads: int = 1, cache_dir: Path | None = None
    ) -> None:
        import openvino as ov

        self.precision = resolve_precision(precision)
        c = core()
        config = {
            "INFERENCE_PRECISION_HINT": _HINT[self.precision],
            # One worker thread is the unit of parallelism here, as with ONNX Runtime: OpenVINO's
            # own streams and pinning would fight the other workers for the same cores.
            "INFERENCE_NUM_THREADS": max(1, int(threads)),
            "NUM_STREAMS": 1,
            "PERFORMANCE_HINT": "LATENCY",
            "ENABLE_CPU_PINNING": False,
        }
        if cache_dir is not None:
            # OpenVINO's own blob cache: keyed by the model's bytes, the properties and the plugin.
            config["CACHE_DIR"] = str(cache_dir)
        model = c.read_model(str(model_path))
        self.compiled = c.compile_model(model, "CPU", config)
        self._ov = ov
        self._inputs = [_Port(p.get_any_name(), _port_type(p)) for p in self.compiled.inputs]
        self._outputs = [_Port(p.get_any_name(), _port_type(p)) for p in self.compiled.outputs]
        self._request = self.compiled.create_infer_request()
        self.computes = self.compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()

    def get_inputs(self) -> list[_Port]:
        return self._inputs

    def get_outputs(self) -> list[_Port]:
        return self._outputs

    def get_providers(self) -> list[str]:
        return ["OpenVINO CPU"]

    def run(self, output_names, feeds: dict[str, np.ndarray], run_options=None) -> list[np.ndarray]:
        """The outputs ``output_names`` (None: all) as arrays of their own (the request's tensors
        are reused by the next run); the others are never copied out of the request."""
        names = [o.name for o in self._outputs] if output_names is None else list(output_names)
        # share_outputs: views of the request's tensors, so only the named ones are copied, here.
        result = self._request.infer(
            {k: np.ascontiguousarray(v) for k, v in feeds.items()}, share_outputs=True
        )
        by_name = {port.get_any_name(): value for port, value in result.items()}
        return [np.array(by_name[n], copy=True) for n in names]

    def bind(self, inputs: dict[str, np.ndarray], outputs: dict[str, np.ndarray]) -> Callable[[], None]:
        """A run function over a new infer request reading ``inputs`` and writing ``outputs`` in place."""
        ov = self._ov
        request = self.compiled.create_infer_request()
        for name, a in inputs.items():
            request.set_tensor(name, ov.Tensor(a, shared_memory=True))
        for name, a in outputs.items():
            request.set_tensor(name, ov.Tensor(a, shared_memory=True))
        return request.infer


class SessionFactory:
    """The OpenVINO counterpart of sessions.SessionFactory: the Engine asks it for sessions."""

    def __init__(
        self, model_path: Path, *, precision: str, threads: int = 1, cache_dir: Path | None = None
    ) -> None:
        self.model_path = Path(model_path)
        self.precision = resolve_precision(precision)
        self.threads = threads
        self.cache_dir = None
        if cache_dir is not None:
            d = Path(cache_dir) / "openvino"
            try:
                d.mkdir(parents=True, exist_ok=True)
                self.cache_dir = d
            except OSError:
                self.cache_dir = None
        self.hits = 0
        self.misses = 0
        self.cuda_graphs = False

    def create(
        self, overrides=None, *, shared_arena: bool = False, cuda_graphs: bool | None = None
    ) -> Session:
        # Dynamic shapes always (see the module docstring): ``overrides`` would fix dims per bucket.
        self.misses += 1
        return Session(
            self.model_path, precision=self.precision, threads=self.threads, cache_dir=self.cache_dir
        )
