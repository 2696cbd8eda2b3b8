"""What the scheduler queues: ``Request`` (one part of a call: rows of one shape bucket), the
most rows one batch of a bucket takes (``batch_rows``), and the latency budget that says which
class it belongs to and the absolute deadline it must meet.

Resolution, first that applies:
  deadline  = gRPC deadline  >  parameter ``latency_budget_ms``  >  the class's budget
  class     = parameter ``latency_class``  >  the tenant's default class  >  the batch class (a call of
              several rows that states no budget)  >  the server default
Client libraries (OpenAI, TEI, Cohere) send documents in batches and cannot state a budget, so a
call of several rows that states none (no deadline, no ``latency_budget_ms``) is bulk work: it goes
to the batch class (``batch_latency_class``, by default ``bulk``) unless its tenant names a class;
a single row, or a call that states a budget, keeps the default class. The batch class's deadline
is soft (``Budget.soft``): the caller stated none, so it orders the queue but never refuses or
drops the call (answered late rather than not at all).
Triton's schedule-policy parameters are honoured too: ``priority`` (1 = highest level) and
``timeout`` (µs, a queue timeout; only lowers the model's default when allow_timeout_override).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from batchgate.gateway.errors import invalid
from batchgate.proto.inference.v2 import model_config_pb2 as mc

INF = math.inf
# The least latency budget a call may ask for (ms): under it no call is answered in time, whatever
# the load (a REST call spends about this much in parsing and the event loop alone). Less is
# refused as invalid input, not shed as a missed deadline.
MIN_BUDGET_MS = 1.0


@dataclass(frozen=True, slots=True)
class LatencyClass:
    name: str
    budget_s: float
    max_queue: int  # requests queued per model; 0 = unbounded
    min_share: float  # fraction of dispatched rows guaranteed while the class has work queued
    rank: int  # position in the configured order (0 = most urgent); orders work-ahead estimates


def batch_rows(max_batch_size: int, row_limit: Callable[[Hashable], int] | None, key: Hashable) -> int:
    """Most rows one batch of bucket ``key`` takes: ``max_batch_size`` (1 for a model that does
    not batch) and the bucket's token budget (``row_limit``: a text model's max_batch_tokens //
    length bucket, a numeric model's lengths as its engine runs them). Both queues hold every
    batch to it and the runtime cuts a call into requests no larger, so no request waits for a
    batch it cannot fit."""
    limit = max_batch_size or 1
    return limit if row_limit is None else min(limit, row_limit(key))


DEFAULT_CLASSES = "realtime=25ms/1024/0,standard=2000ms/4096/0,bulk=10000ms/16384/0.1"


def parse_classes(spec: str) -> dict[str, LatencyClass]:
    """``name=<budget>ms/<max_queue>/<min_share>,...`` (budget also in ``s``)."""
    classes: dict[str, LatencyClass] = {}
    for rank, item in enumerate(p.strip() for p in spec.split(",") if p.strip()):
        try:
            name, _, rest = item.partition("=")
            budget, max_queue, share = (rest.split("/") + ["0", "0"])[:3]
            budget = budget.strip()
            seconds = float(budget[:-2]) / 1000 if budget.endswith("ms") else float(budget.rstrip("s"))
            cls = LatencyClass(name.strip(), seconds, int(max_queue), float(share), rank)
        except ValueError as exc:
            raise ValueError(
                f"latency class '{item}': expected name=<budget>ms/<max_queue>/<min_share>, e.g. realtime=25ms/1024/0"
            ) from exc
        if not cls.name or cls.budget_s <= 0 or cls.max_queue < 0 or not 0 <= cls.min_share < 1:
            raise ValueError(
                f"latency class '{item}': budget must be > 0, max_queue >= 0, 0 <= min_share < 1"
            )
        classes[cls.name] = cls
    if not classes:
        raise ValueError("at least one latency class is required")
    if sum(c.min_share for c in classes.values()) >= 1:
        raise ValueError("latency class min_share values must add up to less than 1")
    return classes


@dataclass(frozen=True, slots=True)
class QueuePolicy:
    """Triton's ModelQueuePolicy for one priority level."""

    timeout_s: float  # 0 = none
    delay: bool  # timeout_action DELAY (else REJECT)
    allow_override: bool
    max_queue_size: int


@dataclass(frozen=True, slots=True)
class SchedulePolicy:
    """Triton's dynamic_batching schedule policy of one model."""

    priority_levels: int
    default_level: int
    policies: dict[int, QueuePolicy]  # level -> policy (level 0 used when priority_levels == 0)

    @classmethod
    def from_config(cls, config: mc.ModelConfig) -> SchedulePolicy:
        db = config.dynamic_batching

        def policy(p: mc.ModelQueuePolicy) -> QueuePolicy:
            return QueuePolicy(
                timeout_s=p.default_timeout_microseconds / 1e6,
                delay=p.timeout_action == mc.ModelQueuePolicy.DELAY,
                allow_override=p.allow_timeout_override,
                max_queue_size=p.max_queue_size,
            )

        levels = int(db.priority_levels)
        default = policy(db.default_queue_policy)
        policies = {lvl: default for lvl in range(0, levels + 1)}
        for lvl, p in db.priority_queue_policy.items():
            policies[int(lvl)] = policy(p)
        default_level = int(db.default_priority_level) or (levels if levels else 0)
        if levels and not 1 <= default_level <= levels:
            raise ValueError(
                f"default_priority_level {default_level} is outside [1, priority_levels={levels}]"
            )
        return cls(levels, default_level, policies)


@dataclass(slots=True)
class Budget:
    cls: LatencyClass
    deadline: float  # absolute, on the scheduler's clock; the answer is useless after it
    level: int  # Triton priority level (0 when the model has none); lower runs first
    queue_deadline: float  # Triton queue timeout (absolute); INF when none
    delay: bool  # on queue timeout: DELAY (deprioritise) instead of REJECT
    # The deadline is the batch class's, not the caller's: a call of several rows that stated no
    # budget. It orders the queue but never refuses or drops the call (see ``resolve``).
    soft: bool = False


def _param_number(value) -> float | None:
    """The parameter as a finite number (a number, or a string holding one); None for anything
    else (refused by the caller)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return None
    elif isinstance(value, (int, float)):
        value = float(value)
    else:
        return None
    return value if math.isfinite(value) else None


def resolve(
    params,
    time_remaining: float | None,
    now: float,
    classes: dict[str, LatencyClass],
    default_class: str,
    schedule: SchedulePolicy,
    rows: int = 1,
    batch_class: str | None = None,
) -> Budget:
    """Budget of one request from its parameters and gRPC deadline (``time_remaining`` seconds).
    ``rows``: the call's rows (texts); ``batch_class``: the class of a call of several rows that
    states no budget (None: the tenant names a class, or the server has none)."""
    name = default_class
    soft = False
    stated = time_remaining is not None and time_remaining < 1e6  # grpc.aio reports "no deadline" as huge
    if "latency_class" in params:
        name = params["latency_class"]
        if not isinstance(name, str) or name not in classes:
            raise invalid(f"parameter 'latency_class' is '{name}'; expected one of {sorted(classes)}")
    elif batch_class is not None and rows > 1 and not stated and "latency_budget_ms" not in params:
        name = batch_class
        soft = True
    cls = classes[name]
    budget = cls.budget_s
    if "latency_budget_ms" in params:
        value = _param_number(params["latency_budget_ms"])
        if value is None or not MIN_BUDGET_MS <= value < math.inf:
            raise invalid(
                f"parameter 'latency_budget_ms' must be a finite number of milliseconds, at least {MIN_BUDGET_MS:g}"
            )
        budget = value / 1000
    if stated:
        budget = max(time_remaining, 0.0)
    level = 0
    if schedule.priority_levels:
        level = schedule.default_level
        if "priority" in params:
            value = _param_number(params["priority"])
            if value is None or value < 0:
                raise invalid("parameter 'priority' must be a non-negative integer")
            # Triton: 0 means "use the default"; levels past the last clamp to the lowest priority.
            if value:
                level = min(int(value), schedule.priority_levels)
    policy = schedule.policies.get(level) or schedule.policies[0]
    timeout = policy.timeout_s
    if "timeout" in params:
        value = _param_number(params["timeout"])
        if value is None or value < 0:
            raise invalid("parameter 'timeout' must be a non-negative number of microseconds")
        if value and (timeout == 0 or (policy.allow_override and value / 1e6 < timeout)):
            timeout = value / 1e6
    queue_deadline = now + timeout if timeout else INF
    return Budget(cls, now + budget, level, queue_deadline, policy.delay, soft)


class Request:
    """Rows of one call that share a shape bucket (``key``): what a queue holds and a batch takes.

    A call whose rows fall in several buckets (texts of mixed lengths) is several requests with
    one budget; the scheduler answers the call when its last request is done."""

    __slots__ = (
        "inputs", "rows", "key", "arrival", "future", "deadline", "cls", "level", "queue_deadline", "delay", "call",
        "trace", "compute_s", "outputs", "due", "soft",
    )  # fmt: skip

    def __init__(
        self,
        inputs,
        rows: int,
        key: Hashable,
        arrival: float,
        future,
        deadline: float = INF,
        cls: LatencyClass | None = None,
        level: int = 0,
        queue_deadline: float = INF,
        delay: bool = False,
    ) -> None:
        self.inputs = inputs
        self.rows = rows
        self.key = key
        self.arrival = arrival
        self.future = future  # asyncio.Future; done() early means the caller went away
        self.deadline = deadline
        self.cls = cls
        self.level = level
        self.queue_deadline = queue_deadline
        self.delay = delay
        self.trace = None  # the call's span context while tracing is on (gateway/tracing.py)
        self.compute_s = 0.0  # its share, by rows, of its batch's engine time (usage metering)
        # The call's requests when it has several (None when it is the whole call): one that
        # fails drops the others before compute, nobody would read their rows.
        self.call: list[Request] | None = None
        # The outputs the call reads, when not the model's defaults (None): a batch fetches the
        # union of its requests', so an output computed on request is copied only when asked for.
        self.outputs: tuple[str, ...] | None = None
        # The deadline the queue works to (DeadlineQueue.due), kept once computed: the queue asks
        # for it several times per call and per batch.
        self.due: float | None = None
        self.soft = False  # Budget.soft: the deadline orders the request, never drops it

    @property
    def class_name(self) -> str:
        return self.cls.name if self.cls is not None else ""


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a call was refused at admission, in the queue's own estimates (seconds)."""

    wait_s: float  # queued (and running) work ahead of the call, per worker slot
    own_s: float  # the call's own rows' compute
    retry_after_s: float  # when a retry could fit: the time the work ahead takes to drain
    # Even alone on an idle worker the call ends past its due time: its budget is below its own
    # compute, the margin and the loop's lag (waiting cannot help: no retry hint).
    alone: bool = False
