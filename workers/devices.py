"""Device discovery: which devices the workers may use.

The CPU path runs everywhere. The GPU path is chosen only when onnxruntime offers the CUDA
execution provider *and* CuPy can see a device; either missing means CPU, never an error.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import onnxruntime as ort

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Device:
    kind: str  # "cpu" or "gpu"
    id: int = 0

    def __str__(self) -> str:
        return f"{self.kind}:{self.id}"


def gpu_count() -> int:
    """Number of CUDA devices usable by both onnxruntime and CuPy (0 when either is missing)."""
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return 0
    try:
        import cupy  # optional dependency: only present with the `gpu` extra
    except ImportError:
        return 0
    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # a driver without devices raises rather than returning 0
        log.info("CuPy sees no CUDA device (%s); using CPU", exc)
        return 0


def discover(kind: str, gpus: tuple[int, ...] = ()) -> list[Device]:
    """Devices for an instance group: ``kind`` is "cpu", "gpu" or "auto".

    "auto" takes every visible GPU, or the CPU when there is none. "gpu" without a GPU falls back to
    the CPU with a warning, so a repository written for a GPU box still serves on a laptop.
    """
    n = gpu_count()
    if kind == "cpu":
        return [Device("cpu")]
    if n == 0:
        if kind == "gpu":
            log.warning("instance_group asks for KIND_GPU but no CUDA device is usable; serving on CPU")
        return [Device("cpu")]
    ids = gpus or tuple(range(n))
    bad = [i for i in ids if i >= n]
    if bad:
        raise ValueError(f"instance_group names GPU(s) {bad} but only {n} are visible")
    return [Device("gpu", i) for i in ids]
