"""Workers: data-parallel engines that run batches. Imports nothing from gateway/ or cache/."""

from batchgate.workers.buckets import BucketConfig, ShapePlan
from batchgate.workers.devices import Device, discover, gpu_count
from batchgate.workers.engine import BatchTiming, Engine, EngineOptions
from batchgate.workers.pool import WorkerPool
from batchgate.workers.sessions import default_cache_dir

__all__ = [
    "BatchTiming", "BucketConfig", "Device", "Engine", "EngineOptions", "ShapePlan", "WorkerPool",
    "default_cache_dir", "discover", "gpu_count",
]  # fmt: skip
