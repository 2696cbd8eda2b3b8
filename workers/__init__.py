"""Workers: data-parallel engines that run batches. Imports nothing from gateway/ or cache/."""

from batchgate.workers.buckets import BucketConfig, ShapePlan, read_model_io
from batchgate.workers.devices import Device, NoGPU, Placement, discover, gpu_count, gpu_probe, place
from batchgate.workers.engine import BatchTiming, Engine, EngineOptions
from batchgate.workers.pool import WorkerPool
from batchgate.workers.sessions import default_cache_dir

__all__ = [
    "BatchTiming", "BucketConfig", "Device", "Engine", "EngineOptions", "NoGPU", "Placement", "ShapePlan",
    "WorkerPool", "default_cache_dir", "discover", "gpu_count", "gpu_probe", "place", "read_model_io",
]  # fmt: skip
