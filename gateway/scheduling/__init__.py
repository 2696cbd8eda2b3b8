"""Scheduling: per model, latency-class queues and the one batcher task that feeds the workers.

interface.py  the queue contract (``Queue``) and the factory (``make_queue``)
request.py    ``Request`` (rows of one bucket), latency classes, budgets, Triton's schedule policy
deadline.py   the default policy: earliest deadline first, shedding, deadline-aware closing
fifo.py       Triton's dynamic batcher (``scheduling_policy: fifo``)
latency.py    the learned compute-time model and the event loop's lag
scheduler.py  the batcher task: admission, batches to the pool, answers
stats.py      its statistics and the snapshot metrics read
"""

from batchgate.gateway.scheduling.interface import POLICIES, Queue, QueueSettings, Refusal, make_queue
from batchgate.gateway.scheduling.latency import LatencyModel, LoopLag, bucket_label
from batchgate.gateway.scheduling.request import (
    DEFAULT_CLASSES,
    INF,
    Budget,
    LatencyClass,
    Request,
    SchedulePolicy,
    batch_rows,
    parse_classes,
    resolve,
)
from batchgate.gateway.scheduling.scheduler import Part, Scheduler
from batchgate.gateway.scheduling.stats import SchedulerSnapshot, Stats

__all__ = [
    "DEFAULT_CLASSES", "INF", "POLICIES", "Budget", "LatencyClass", "LatencyModel", "LoopLag", "Part", "Queue",
    "QueueSettings", "Refusal", "Request", "SchedulePolicy", "Scheduler", "SchedulerSnapshot", "Stats",
    "batch_rows", "bucket_label", "make_queue", "parse_classes", "resolve",
]  # fmt: skip
