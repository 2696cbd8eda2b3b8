"""Workers: data-parallel engines that run batches. Imports nothing from gateway/ or cache/."""

from workers.devices import Device, discover, gpu_count
from workers.engine import BatchTiming, Engine, EngineOptions
from workers.pool import WorkerPool

__all__ = ["BatchTiming", "Device", "Engine", "EngineOptions", "WorkerPool", "discover", "gpu_count"]
