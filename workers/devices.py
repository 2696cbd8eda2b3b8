"""Device discovery and the one rule for where a model runs (docs/engines.md, "Where a model runs").

A GPU is usable when onnxruntime offers the CUDA execution provider *and* CuPy sees a device.
``place`` decides a model's devices from three inputs: the operator's ``device`` setting (flag,
env, chart), the model's ``instance_group.kind``, and what is visible. It is a pure function of
them (the visible GPU count is passed in), so the rule is tested with fake device lists:

* ``device=cpu``: the CPU, whatever the config says.
* ``device=gpu``: a GPU for every model that can run there, overriding ``KIND_CPU``; a model whose
  ONNX graph reads or writes strings stays on the CPU provider (ORT has string kernels on the CPU
  only) and its startup line says so.
* ``device=auto``: the config decides; ``KIND_GPU`` asks for a GPU, ``KIND_CPU`` for the CPU,
  ``KIND_AUTO``/``KIND_MODEL`` take a GPU when one is usable, else the CPU.
* A GPU asked for (by ``device=gpu`` or by ``KIND_GPU``) where none is usable: the model's
  ``gpu_fallback`` parameter says what happens, ``fail`` (the default, as Triton fails a KIND_GPU
  model on a machine without one) or ``cpu`` (serve on the CPU); either way one line says why.
"""

from __future__ import annotations

import logging
import platform
from dataclasses import dataclass
from functools import cache

import onnxruntime as ort

log = logging.getLogger(__name__)

GPU_FALLBACKS = ("fail", "cpu")


@dataclass(frozen=True, slots=True)
class Device:
    kind: str  # "cpu" or "gpu"
    id: int = 0

    def __str__(self) -> str:
        return f"{self.kind}:{self.id}"


@cache
def cpu_flags() -> str:
    """This CPU's flag line from /proc/cpuinfo ("flags" on x86, "Features" on ARM); "" if none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return ""


def flag_set(line: str) -> set[str]:
    """The flag names of a /proc/cpuinfo flag line (``cpu_flags``)."""
    return set(line.split(":", 1)[-1].split())


# The instruction sets that change which kernels compute a reduced-precision answer, best first.
_ISA_CLASSES = (
    ("amx", {"amx_bf16", "amx_int8"}), ("avx512_bf16", {"avx512_bf16"}), ("avx512_vnni", {"avx512_vnni"}),
    ("avx512", {"avx512f"}), ("avx_vnni", {"avx_vnni"}), ("avx2", {"avx2"}),
)  # fmt: skip


def cpu_class(flags: str | None = None) -> str:
    """The CPU's arithmetic class for a reduced-precision answer's identity ("amx", "avx512_bf16",
    ..., or the machine name): BF16 and INT8 kernels differ by it, so two replicas on CPUs of
    one class may share cached answers and replicas of different classes do not."""
    import platform

    have = flag_set(cpu_flags() if flags is None else flags)
    for name, need in _ISA_CLASSES:
        if need <= have:
            return name
    return platform.machine() or "cpu"


# The flags that change which engine and precision win on a CPU (docs/engines.md): the host class
# of a variant selection names those present.
SELECTION_FLAGS = (
    "avx2",
    "avx512f",
    "avx512_vnni",
    "avx_vnni",
    "avx512_bf16",
    "amx_bf16",
    "amx_int8",
    "avx512_fp16",
)


@cache
def _cpuinfo_head() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read(8192)
    except OSError:
        return ""


def host_class(cpuinfo: str | None = None) -> str:
    """This host's CPU class for a variant selection (gateway/selection.py): vendor, family, model
    and the instruction sets that decide which variant wins, e.g.
    ``AuthenticAMD-25-17-avx2+avx512_bf16+avx512_vnni+avx512f``. A choice measured on one class is
    reused on that class only; a CPU of another model or other flags measures for itself."""
    text = _cpuinfo_head() if cpuinfo is None else cpuinfo
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        key = key.strip()
        if sep and key not in fields:
            fields[key] = value.strip()
    vendor = fields.get("vendor_id") or fields.get("CPU implementer") or platform.machine() or "cpu"
    family = fields.get("cpu family") or fields.get("CPU architecture") or "-"
    model = fields.get("model") or fields.get("CPU part") or "-"
    have = flag_set(fields.get("flags") or fields.get("Features") or "")
    isa = "+".join(sorted(f for f in SELECTION_FLAGS if f in have)) or "base"
    return "-".join(x.replace(" ", "_") for x in (vendor, family, model, isa))


def int8_saturates(flags: str | None = None, arch: str | None = None) -> bool:
    """Whether ONNX Runtime's UINT8 x INT8 GEMM saturates here: on x86 without VNNI it multiplies
    with VPMADDUBSW, whose pairwise 16-bit sums clip (docs/engines.md measures 14 % off), so INT8
    weights are stored as UINT8 around 128 instead (the UINT8 x UINT8 kernel widens to 16 bits
    first and is exact). With AVX512-VNNI or AVX-VNNI, and off x86, the signed kernel is exact."""
    arch = arch if arch is not None else platform.machine()
    if arch.lower() not in ("x86_64", "amd64", "i686", "x86"):
        return False
    have = flag_set(flags if flags is not None else cpu_flags())
    return not ({"avx512_vnni", "avx_vnni"} & have)


class NoGPU(RuntimeError):
    """A GPU was asked for where none is usable, and the model's gpu_fallback is ``fail``."""


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one model runs, and why in a phrase for its startup line ("" when it simply runs
    where its config says). ``fallback`` is the one WARNING line of a GPU fallback, else ""."""

    devices: tuple[Device, ...]
    note: str = ""
    fallback: str = ""


def gpu_probe() -> tuple[int, str]:
    """(usable CUDA devices, why none when 0): both onnxruntime's CUDA provider and CuPy are needed."""
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return 0, f"onnxruntime {ort.__version__} has no CUDAExecutionProvider: the CPU wheel is installed"
    try:
        import cupy  # optional dependency: only present with the `gpu` extra
    except ImportError:
        return 0, "CuPy is not installed (pip install 'batchgate[gpu]')"
    try:
        n = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # a driver without devices raises rather than returning 0
        return 0, f"CuPy sees no CUDA device ({exc})"
    return n, "" if n else "CuPy sees no CUDA device"


def gpu_count() -> int:
    """Number of CUDA devices usable by both onnxruntime and CuPy (0 when either is missing)."""
    return gpu_probe()[0]


def place(
    kind: str,
    device: str = "auto",
    *,
    visible: int,
    gpus: tuple[int, ...] = (),
    fallback: str = "fail",
    strings: bool = False,
    why_none: str = "",
) -> Placement:
    """Apply the rule (module docstring). ``kind``: the config's "cpu", "gpu" or "auto";
    ``device``: the operator's "auto", "cpu" or "gpu"; ``visible``: usable GPUs (``why_none``
    says why there are none); ``gpus``: the instance group's device ids; ``strings``: the graph
    has string tensors. Raises NoGPU, or ValueError for a GPU id that is not visible."""
    if kind not in ("cpu", "gpu", "auto") or device not in ("auto", "cpu", "gpu"):
        raise ValueError(f"kind must be cpu/gpu/auto and device auto/cpu/gpu, got {kind!r}, {device!r}")
    if fallback not in GPU_FALLBACKS:
        raise ValueError(f"gpu_fallback must be one of {GPU_FALLBACKS}, got {fallback!r}")
    cpu = (Device("cpu"),)
    if device == "cpu":
        return Placement(cpu, "device=cpu" if kind == "gpu" else "")
    want = "gpu" if device == "gpu" else kind
    asker = "device=gpu" if device == "gpu" else f"instance_group KIND_{kind.upper()}"
    if want == "cpu":
        return Placement(cpu)
    if strings:  # ORT keeps string tensors in host memory, with string kernels on the CPU only
        note = f"{asker}, but the graph has string tensors: CPU provider"
        return Placement(cpu, note if want == "gpu" else "")
    if visible == 0:
        why = why_none or "no CUDA device is usable"
        if want == "auto":
            return Placement(cpu)
        if fallback == "cpu":
            msg = f"{asker} asks for a GPU but none is usable ({why}); gpu_fallback=cpu: serving on the CPU"
            return Placement(cpu, f"{asker}: no usable GPU, gpu_fallback=cpu", msg)
        raise NoGPU(
            f"{asker} asks for a GPU but none is usable ({why}); the model's gpu_fallback is 'fail' "
            "(parameter gpu_fallback 'cpu' serves it on the CPU instead)"
        )
    ids = gpus or tuple(range(visible))  # Triton: the group's gpus, else every visible one
    bad = [i for i in ids if i >= visible]
    if bad:
        raise ValueError(f"instance_group names GPU(s) {bad} but only {visible} are visible")
    note = "device=gpu overrides KIND_CPU" if device == "gpu" and kind == "cpu" else ""
    return Placement(tuple(Device("gpu", i) for i in ids), note)


def discover(kind: str, gpus: tuple[int, ...] = ()) -> list[Device]:
    """Devices for an instance group of ``kind`` ("cpu", "gpu" or "auto") under ``device=auto``
    with ``gpu_fallback=cpu``: the CPU when no GPU is usable (logged). For tools and tests; the
    server places models with ``place``."""
    n, why = gpu_probe() if kind != "cpu" else (0, "")
    p = place(kind, visible=n, gpus=gpus, fallback="cpu", why_none=why)
    if p.fallback:
        log.warning("%s", p.fallback)
    return list(p.devices)
