"""The text-batches workload at capacity, replayed in virtual time: the real overload gate
(``LoadShedder``, entered and left through the real ``Door``), the real ``Scheduler`` with its
``DeadlineQueue`` and ``LatencyModel``, closed-loop callers whose calls carry their class's budget
as their deadline (and give up at it, as a gRPC caller does), and a worker whose batches take the
times a slow, shared host took (``tests/data/zen4_shared_batches.json``: minilm's batches recorded
by ``lab/refusals_live.py --keep-trace`` on a 2-core KVM guest busy with other builds). Nothing
sleeps: the event loop's clock jumps to its next timer, so a 20 s run costs well under a second.

Used by tests/test_false_refusals.py; ``python -m tests.capacity_replay [SPEED]`` prints every
shape at a few offsets into the recorded times (SPEED 2: the recorded host twice as fast).

The recorded times (2026-12-07, AMD EPYC Zen 4, 2 cores, KVM, avx512_bf16 + avx512_vnni, no AMX;
other engineers' builds loading both cores, load average 15-19): minilm served by
``python -m lab.refusals_live --runs 2 --seconds 12 --trace --keep-trace T`` (server pinned to one
core, two worker slots on it), 597 batches; per bucket ms = a + b x rows, e.g. 16 tokens
2.2 + 12.6 x rows (about 3x the quiet core's), and each batch's time over its line from 0.19x to
5.8x (p50 0.82, p95 1.56, p99 2.09): the stalls the tests replay."""

from __future__ import annotations

import asyncio
import json
import math
import selectors
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from batchgate.gateway.admission.door import Door
from batchgate.gateway.admission.gate import LoadShedder
from batchgate.gateway.errors import GatewayError
from batchgate.gateway.scheduling import INF, LatencyModel, LoopLag, Scheduler, parse_classes
from batchgate.gateway.scheduling.deadline import DeadlineQueue
from batchgate.gateway.scheduling.request import DEFAULT_CLASSES, Budget, batch_rows
from batchgate.workers.engine import BatchTiming

DATA = Path(__file__).resolve().parent / "data" / "zen4_shared_batches.json"
# A call's round trip outside the server (gRPC on a loaded 2-core host): a refused caller retries after it.
RTT_S = 0.002
SHAPES = ((64, 1, "standard"), (4, 32, "standard"), (8, 32, "bulk"), (1, 32, "bulk"))


class _Selector:
    """The loop's selector, never blocking: a wait of ``timeout`` moves the virtual clock instead."""

    TURN_S = 2e-6

    def __init__(self, inner: selectors.BaseSelector, loop: VirtualLoop) -> None:
        self._inner = inner
        self._loop = loop

    def select(self, timeout: float | None = None):
        events = self._inner.select(0)
        # Every turn of the loop costs a little time, as on a real host: a timer set for "now"
        # must not find the clock standing still.
        self._loop.now += max(timeout or 0.0, self.TURN_S) if not events else self.TURN_S
        return events

    def __getattr__(self, name):
        return getattr(self._inner, name)


class VirtualLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock advances only when it would otherwise wait for a timer."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self._selector = _Selector(self._selector, self)

    def time(self) -> float:
        return self.now


@dataclass
class Host:
    """A host's batch times: per length bucket the line a + b x rows fitted to what it measured,
    and the measured times' ratios to that line in the order they came (its stalls and noisy
    stretches), replayed from ``offset``; ``speed`` divides every time (2: a host twice as fast)."""

    lines: dict[int, tuple[float, float]]
    noise: list[float]
    text_keys: list[int]  # bench/texts/mixed.txt's texts' length buckets, in file order
    speed: float = 1.0
    offset: int = 0

    @classmethod
    def recorded(cls, path: Path = DATA, **kw) -> Host:
        d = json.loads(path.read_text())
        return cls({int(k): tuple(v) for k, v in d["lines"].items()}, d["noise"], d["text_keys"], **kw)

    def batch_s(self, key: int, rows: int, i: int) -> float:
        a, b = self.lines[key]
        return (a + b * rows) * self.noise[(self.offset + i) % len(self.noise)] / self.speed


@dataclass
class Outcome:
    answered: int = 0
    in_time: int = 0
    refused: dict[str, int] = field(default_factory=dict)  # cause -> calls
    latencies: list[float] = field(default_factory=list)
    # shedding off: calls the estimate would have refused, queued anyway, by whether they made it
    shadow: dict[str, int] = field(default_factory=dict)
    busy_s: float = 0.0  # the worker's busy time (two slots share the one core: their union)
    seconds: float = 0.0

    @property
    def refusals(self) -> int:
        return sum(self.refused.values())


def cause(exc: BaseException) -> str:
    """As bench.text_batches counts them: gate, estimate, expiry, late (the caller gave up)."""
    if isinstance(exc, (TimeoutError, asyncio.CancelledError)):
        return "late"
    said = str(exc)
    if "server overloaded" in said:
        return "gate"
    if "shed before queueing" in said or "not even an idle server" in said:
        return "estimate"
    if "dropped from the queue" in said:
        return "expiry"
    return type(exc).__name__


def run_shape(host: Host, callers: int, per_call: int, cls: str, seconds: float = 20.0, warmup_s: float = 5.0,
              shed: bool = True, slots: int = 2) -> Outcome:  # fmt: skip
    """``callers`` closed loops of ``per_call`` texts each in class ``cls`` against minilm's queue
    as served (max_batch_size 64, max_batch_tokens 1024, two worker slots on the host's one core),
    for ``warmup_s`` and then ``seconds`` counted."""
    loop = VirtualLoop()
    try:
        return loop.run_until_complete(
            _run(loop, host, callers, per_call, cls, seconds, warmup_s, shed, slots)
        )
    finally:
        loop.close()


async def _run(loop, host, callers, per_call, cls, seconds, warmup_s, shed, slots) -> Outcome:
    classes = parse_classes(DEFAULT_CLASSES)
    budget_s = classes[cls].budget_s
    latency = LatencyModel()
    lag = LoopLag()
    row_limit = lambda key: max(1, 1024 // key)  # noqa: E731 - the text stage's token budget
    queue = DeadlineQueue(64, (), 0.0, classes, latency, lag=lag, row_limit=row_limit, shed=shed)
    out = Outcome()
    counting = [False]
    running: list[float] = []  # end times of the batches on the core now
    n_batches = [0]

    def execute(inputs, rows, batched) -> Future:
        fut: Future = Future()
        key = inputs[0]["key"]
        now = loop.time()
        t = host.batch_s(key, sum(rows), n_batches[0])
        n_batches[0] += 1
        # The core's busy time: what this batch adds beyond the batches already on it.
        end = now + t
        if counting[0]:
            out.busy_s += max(0.0, end - max([now, *running]))
        running.append(end)

        def done() -> None:
            running.remove(end)
            ns = int(t * 1e9)
            fut.set_result(([{"embedding": None}] * len(rows), BatchTiming(infer_ns=ns)))

        loop.call_at(end, done)
        return fut

    sched = Scheduler("minilm", queue, execute, slots, clock=loop.time, latency=latency)
    sched.start()
    shedder = LoadShedder(0.1, 32)
    busy_cpu = [0.0]  # the process's CPU seconds: the core's busy time (a server pinned to it)
    shedder._cpu_times = lambda: (0.0, busy_cpu[0])
    shedder._cores = 1
    door = Door(SimpleNamespace(open=True), shedder, None)
    shedder.start(SimpleNamespace(inflight=0, lag=lag, backlog_s=sched.backlog_s))  # as the Pipeline gives it
    inflight = [0]
    load = shedder.load

    def tick_cpu() -> None:  # the core is busy while a batch runs on it
        if running:
            busy_cpu[0] += 0.005
        load.inflight = inflight[0]
        loop.call_later(0.005, tick_cpu)

    tick_cpu()
    texts = host.text_keys
    n = len(texts)
    stop = warmup_s + seconds

    def parts_of(keys: list[int]):
        groups: dict[int, int] = {}
        for k in keys:
            groups[k] = groups.get(k, 0) + 1
        parts = []
        for k, rows in groups.items():
            step = batch_rows(64, lambda key: min(row_limit(key), latency.useful_rows(key) or 1 << 30), k)
            for s in range(0, rows, step):
                parts.append(({"key": k}, min(step, rows - s), k))
        return parts

    async def caller(c: int) -> None:
        j = c * 7
        while loop.time() < stop:
            keys = [texts[(j + i) % n] for i in range(per_call)]
            j += 1
            await asyncio.sleep(RTT_S)
            t0 = loop.time()
            counted = counting[0]
            try:
                with door.enter({}, budget_s) as pass_:
                    inflight[0] += 1
                    try:
                        budget = Budget(classes[cls], t0 + budget_s, 0, INF, False)
                        await asyncio.wait_for(sched.submit(parts_of(keys), budget), budget_s)
                    except TimeoutError:
                        door.leave(
                            asyncio.CancelledError(), pass_
                        )  # what gRPC's deadline does to the handler
                        raise
                    finally:
                        inflight[0] -= 1
                if counted:
                    out.answered += 1
                    out.latencies.append(loop.time() - t0)
                    out.in_time += loop.time() - t0 <= budget_s
            except (GatewayError, TimeoutError) as exc:
                if counted:
                    why = cause(exc)
                    out.refused[why] = out.refused.get(why, 0) + 1

    async def clock() -> None:
        await asyncio.sleep(warmup_s)
        counting[0] = True

    await asyncio.gather(clock(), *(caller(c) for c in range(callers)))
    out.seconds = seconds
    for by in sched.stats.shadow.values():
        for verdict, k in by.items():
            out.shadow[verdict] = out.shadow.get(verdict, 0) + k
    shedder.stop()
    await sched.close()
    return out


def texts_per_s(out: Outcome, per_call: int) -> float:
    return out.answered * per_call / out.seconds if out.seconds else math.nan


if __name__ == "__main__":
    import sys

    speed = float(sys.argv[1]) if len(sys.argv) > 1 else 2.0  # python -m tests.capacity_replay [SPEED]
    host = Host.recorded()
    for callers, per_call, cls in SHAPES:
        for offset in range(0, len(host.noise), max(1, len(host.noise) // 5)):
            h = Host.recorded(offset=offset, speed=speed)
            o = run_shape(h, callers, per_call, cls, warmup_s=0.0)
            lat = sorted(o.latencies) or [math.nan]
            print(
                f"{callers}x{per_call}:{cls} offset {offset}: {o.answered} answered, {texts_per_s(o, per_call):.1f} "
                f"texts/s, busy {o.busy_s / o.seconds:.2f}, p99 {lat[int(0.99 * (len(lat) - 1))] * 1e3:.0f} ms, "
                f"refused {o.refusals} {o.refused or ''}"
            )
