"""Workers: data-parallel engines that run batches. Imports nothing from gateway/ or cache/."""

from workers.buckets import BucketConfig, ShapePlan
from workers.devices import Device, discover, gpu_count
from workers.engine import BatchTiming, Engine, EngineOptions
from workers.pool import WorkerPool
from workers.sessions import default_cache_dir

__all__ = [
    "BatchTiming", "BucketConfig", "Device", "Engine", "EngineOptions", "ShapePlan", "WorkerPool",
    "default_cache_dir", "discover", "gpu_count",
]  # fmt: skip
