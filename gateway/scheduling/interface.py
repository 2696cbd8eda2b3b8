"""The contract between the batcher task (``scheduler.py``) and a queue policy, and the one
factory that builds a queue from a model's policy.

Every method is called on the event loop by the scheduler's single batcher task or by a request
handler on the same loop, never concurrently, so a queue needs no locks. A queue owns every
decision about its requests: order, when a batch closes, how many rows it takes (the token budget
included: a batch leaves the queue as it will run, nothing splits it behind the scheduler), what
is hopeless, and whether a call is refused at admission.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Protocol

from batchgate.gateway.scheduling.deadline import DeadlineQueue
from batchgate.gateway.scheduling.fifo import FifoQueue
from batchgate.gateway.scheduling.latency import LatencyModel, LoopLag
from batchgate.gateway.scheduling.request import LatencyClass, Refusal, Request


class Queue(Protocol):
    size: int  # requests queued (a cancelled one counts until the queue drops it)
    dropped: int  # requests whose caller left before they were batched
    shed: bool  # False: a call ``refuse`` would refuse is queued anyway and the estimate checked
    prediction: float | None  # seconds to the answer that the last ``refuse`` predicted, if any

    def refuse(self, reqs: list[Request], now: float, running_s: float, slots: int) -> Refusal | None:
        """Called once per call, before ``push``: a Refusal when the call's deadline is out of
        reach given the work ahead of it (``running_s``: what running batches still have to do),
        else None. A policy that never sheds returns None. With ``shed`` off it still answers:
        the scheduler then queues the call and counts whether it made its deadline (the shadow
        check of the estimate)."""

    def calibrate(self, predicted_s: float, actual_s: float) -> None:
        """Called when a call admitted with a ``prediction`` is answered: how long it really
        took from admission, so later admission tests can scale their predictions."""

    def ratio(self) -> tuple[int, float, float] | None:
        """For metrics: (samples, mean, mean deviation) of real over predicted time of the calls
        ``calibrate`` saw; None for a policy that predicts nothing."""

    def push(self, reqs: list[Request]) -> bool:
        """Called once per admitted call with all its requests: queue all of them, or none and
        return False when a bound is reached (the caller answers UNAVAILABLE)."""

    def full_reason(self, req: Request) -> str:
        """Called after ``push`` refused: which bound was reached, for the error message."""

    def drain_s(self, req: Request, slots: int) -> float | None:
        """Seconds the work queued ahead of ``req`` takes on ``slots`` workers (a retry hint for a
        refused call); None when the policy keeps no estimate."""

    def take_expired(self, now: float) -> tuple[list[Request], float | None]:
        """Called by the batcher on every turn, first: requests that can no longer make their
        deadline (answered DEADLINE_EXCEEDED, never computed), and when the next queued one
        becomes hopeless (None: not before the next push)."""

    def wake_at(self, reqs: list[Request]) -> float | None:
        """Called after a ``push`` while every worker slot is busy: the earliest moment the batcher
        must look at these requests even if no slot frees before (one may expire then), or None.
        Pushes that need nothing sooner than the batcher's current wake-up do not wake it."""

    def pop_batch(self, now: float, idle: bool) -> tuple[list[Request] | None, float | None]:
        """Called by the batcher when a worker slot is free (``idle``: every slot is): the batch
        that should leave now, or None and when to ask again (None: only on a push or a freed
        slot). The wake-up comes with the answer, so it can never be stale."""

    def depth_by_class(self) -> dict[str, int]:
        """Requests queued per latency class, for metrics (a policy without classes: one line)."""

    def drain_all(self) -> list[Request]:
        """Called on shutdown or when the batcher dies: everything queued, emptied."""


@dataclass(frozen=True, slots=True)
class QueueSettings:
    """What a model's queue is built from (its config.pbtxt and the server's settings)."""

    policy: str  # "deadline" (batchgate's default) or "fifo" (Triton's dynamic batcher)
    max_batch_size: int
    preferred: tuple[int, ...] = ()
    max_delay_s: float = 0.0
    max_queue_size: int = 0  # fifo: requests queued at most (0: unbounded)
    classes: dict[str, LatencyClass] | None = None  # deadline: the server's latency classes
    default_class: str = "standard"
    level_queue_sizes: dict[int, int] | None = None  # Triton priority level -> max_queue_size
    margin_s: float = 0.0005
    cap_fraction: float = 0.5
    learn_limit: bool = True
    shed: bool = True  # deadline: refuse at admission a call that cannot make its deadline
    # Most rows a batch of a bucket may take beside max_batch_size: the token budget
    # (max_batch_tokens // tokens per row of the bucket). Both policies hold batches to it.
    row_limit: Callable[[Hashable], int] | None = None


POLICIES = ("deadline", "fifo")


def make_queue(settings: QueueSettings, latency: LatencyModel, lag: LoopLag | None = None) -> Queue:
    """The queue ``settings.policy`` names; ValueError for an unknown one."""
    s = settings
    if s.policy == "deadline":
        if not s.classes:
            raise ValueError("the deadline policy needs at least one latency class")
        return DeadlineQueue(
            max_batch_size=s.max_batch_size,
            preferred=s.preferred,
            max_delay_s=s.max_delay_s,
            classes=s.classes,
            latency=latency,
            level_queue_sizes=s.level_queue_sizes,
            margin_s=s.margin_s,
            default_class=s.default_class,
            cap_fraction=s.cap_fraction,
            lag=lag,
            row_limit=s.row_limit,
            learn_limit=s.learn_limit,
            shed=s.shed,
        )
    if s.policy == "fifo":
        return FifoQueue(
            max_batch_size=s.max_batch_size,
            preferred=s.preferred,
            max_delay_s=s.max_delay_s,
            max_queue_size=s.max_queue_size,
            row_limit=s.row_limit,
        )
    raise ValueError(f"scheduling policy must be one of {list(POLICIES)}, got '{s.policy}'")
