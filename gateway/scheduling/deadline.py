"""batchgate's default queue policy: latency classes, earliest deadline first (strict Triton
priority levels above that), guaranteed shares, expiry before compute, batches that close as soon
as waiting longer would make their most urgent request late, and shedding at admission of calls
whose deadline is out of reach given the work ahead (the queue is what knows that work).

The contract is ``interface.Queue``; ``fifo.FifoQueue`` is the Triton-like alternative.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Hashable

from batchgate.gateway.scheduling.latency import LatencyModel, LoopLag
from batchgate.gateway.scheduling.request import LatencyClass, Refusal, Request, batch_rows

_DELAYED_LEVEL = 1 << 30  # Triton DELAY: after every live request of every level


class _Lane:
    """One (shape key, class) heap, ordered by (priority level, latest start, arrival): the latest
    start is the deadline less the bucket's estimated compute when the request arrived."""

    __slots__ = ("heap", "rows", "cls")

    def __init__(self, cls: str) -> None:
        self.heap: list[tuple[int, float, int, Request]] = []
        self.rows = 0
        self.cls = cls


class DeadlineQueue:
    """Latency classes, EDF within priority levels, guaranteed shares, deadline-aware closing."""

    # Never keep more than this share of a request's budget for time outside the process: a
    # 5 ms budget on a fast model keeps 1 ms, not the whole deadline_margin_ms.
    MARGIN_SHARE = 0.2
    # Holding an idle worker's batch for company is a bet on the arrival rate, and closed-loop
    # callers make it a losing one: a caller whose call is held sends nothing more, so one fast
    # caller looks like a busy stream and waited the whole max-wait timer on every call
    # (docs/performance.md, "Figures the code cites": holding for company). Each hold is
    # scored when its batch leaves: did anyone join while it waited? Below HOLD_PAYS (a decaying
    # share of holds) an idle worker stops holding, but for one probe every HOLD_PROBE_S, which
    # lets holding resume when company starts to come.
    HOLD_PAYS = 0.5
    HOLD_DECAY = 0.8
    HOLD_PROBE_S = 1.0

    def __init__(
        self,
        max_batch_size: int,
        preferred: tuple[int, ...],
        max_delay_s: float,
        classes: dict[str, LatencyClass],
        latency: LatencyModel,
        level_queue_sizes: dict[int, int] | None = None,
        margin_s: float = 0.0005,
        default_class: str = "standard",
        cap_fraction: float = 0.5,
        lag: LoopLag | None = None,
        row_limit: Callable[[Hashable], int] | None = None,
        learn_limit: bool = True,
        shed: bool = True,
    ) -> None:
        self.max_batch_size = max_batch_size
        self.preferred = frozenset(p for p in preferred if p <= max(max_batch_size, 1))
        self.max_delay_s = max_delay_s
        self.classes = classes
        self.latency = latency
        self.level_queue_sizes = {k: v for k, v in (level_queue_sizes or {}).items() if v}
        self.cap_fraction = cap_fraction
        self.default_class = classes.get(default_class) or max(classes.values(), key=lambda c: c.budget_s)
        self.margin_s = margin_s
        # The event loop's lag, paid once before the handler runs and once before the answer is
        # written: kept out of every deadline decision (0 when no monitor runs, as in unit tests).
        self.lag = lag or LoopLag()
        # Most rows one batch of a bucket may take, beside max_batch_size: a text model's token
        # budget (max_batch_tokens // length bucket). Held here, where the order is decided, a
        # batch never has to be split behind the scheduler's back into parts that queue in the
        # pool, out of deadline order.
        self.row_limit = row_limit
        self.learn_limit = learn_limit  # hold batches to the size the latency model says pays
        # Off only to check the estimate (bench/text_batches.py: false refusals): ``refuse`` still
        # answers, the scheduler queues the call anyway and counts whether it made its deadline;
        # hopeless requests still expire before compute.
        self.shed = shed
        self._probe_at = -math.inf  # when an idle queue last admitted a call its estimate refused
        self.prediction: float | None = None  # the last ``refuse`` that computed one (seconds)
        # Whether that prediction may calibrate (``calibrate``): every bucket it counted had run
        # enough for its estimate to stand (see ``refuse``).
        self.prediction_sound = False
        self._ratio = (0, 1.0, 0.0)  # actual / predicted time of admitted calls: (n, mean, mean |dev|)
        self._recent: deque[float] = deque(maxlen=self.RATIO_WINDOW)  # the last ratios themselves
        self._lanes: dict[Hashable, dict[str, _Lane]] = {}
        self._seq = itertools.count()
        self.size = 0
        self.rows = 0  # rows of the queued requests (all lanes): bounds the work ahead cheaply
        self.dropped = 0
        self.class_size: dict[str, int] = {c: 0 for c in classes}
        self.level_size: dict[int, int] = {}
        # Guaranteed shares as credit: while a class has work queued, every batch dispatched earns
        # it min_share x the batch's rows; its own rows spend the credit. A class whose credit
        # covers a row goes first, so `bulk` progresses under sustained `realtime` load.
        self._credit: dict[str, float] = {c: 0.0 for c, lc in classes.items() if lc.min_share > 0}
        self._arrivals_per_s = 0.0
        self._last_arrival: float | None = None
        self._class_seen: dict[str, float] = {}  # class -> last arrival, for the batch-time cap
        self.hold_score = 1.0  # decaying share of idle holds that someone joined (starts trusting)
        self._held: dict[Hashable, int] = {}  # bucket -> requests in its plan when an idle hold began
        self._hold_probe_at = -math.inf

    def __len__(self) -> int:
        return self.size

    def _limit(self, key: Hashable) -> int:
        """Most rows a batch of bucket ``key`` takes: max_batch_size, the bucket's token budget
        (row_limit), and the rows the latency model says are still worth batching."""
        limit = batch_rows(self.max_batch_size, self.row_limit, key)
        if self.learn_limit:
            useful = self.latency.useful_rows(key)
            if useful is not None:
                limit = min(limit, useful)
        return limit

    def _fixed_margin(self, budget_s: float) -> float:
        """Time kept for the network and the caller (deadline_margin_ms), at most MARGIN_SHARE of
        the budget."""
        return min(self.margin_s, self.MARGIN_SHARE * budget_s)

    def due(self, r: Request) -> float:
        """The deadline the scheduler works to: the request's, less the fixed margin (kept on the
        request: its deadline is set before it is queued and never moves after)."""
        due = r.due
        if due is None:
            due = r.due = r.deadline - self._fixed_margin(r.deadline - r.arrival)
        return due

    def lag_margin(self) -> float:
        """The loop's lag, paid on the way in and again on the way out: its high quantile, for
        planning (what a batch may take on, how long it may be held)."""
        return 2.0 * self.lag.s

    def lag_expected(self) -> float:
        """The loop's lag in and out as expected (its mean), for refusing: a call is refused or
        dropped only when it would likely miss, not when a pessimistic bound says it might (a
        25 ms realtime call dropped at once with 24.9 ms left, on a loaded CI machine)."""
        return 2.0 * self.lag.mean

    # -- admission ----------------------------------------------------------------------------

    def push(self, reqs: list[Request]) -> bool:
        """Queue all of one call's requests (they share its class and level), or none."""
        first = reqs[0]
        if first.cls is None:  # a caller that resolved no budget (internal use): the default class
            for req in reqs:
                req.cls = self.default_class
                req.deadline = min(req.deadline, req.arrival + req.cls.budget_s)
                req.due = None
        cls = first.cls.name
        bound = first.cls.max_queue
        n = len(reqs)
        if bound and self.class_size[cls] + n > bound:
            return False
        level_bound = self.level_queue_sizes.get(first.level)
        if level_bound and self.level_size.get(first.level, 0) + n > level_bound:
            return False
        for req in reqs:
            lanes = self._lanes.get(req.key)
            if lanes is None:
                lanes = self._lanes[req.key] = {}
            lane = lanes.get(cls)
            if lane is None:
                lane = lanes[cls] = _Lane(cls)
            # Least laxity first: order by when the request must start, not when it must end, so
            # a long text (a slow bucket) is not made to wait as long as a short one with the same
            # budget, which would put all the long ones in the tail.
            latest_start = req.deadline
            if self.latency.confident(req.key):
                latest_start -= self.latency.estimate(req.key, req.rows)
            heapq.heappush(lane.heap, (req.level, latest_start, next(self._seq), req))
            lane.rows += req.rows
            self.rows += req.rows
        self.size += n
        self.class_size[cls] += n
        self.level_size[first.level] = self.level_size.get(first.level, 0) + n
        self._note_arrival(first.arrival)
        self._class_seen[cls] = first.arrival
        return True

    def full_reason(self, req: Request) -> str:
        where = f"queue for latency class '{req.class_name}' is full ({req.cls.max_queue} requests"
        if self.level_queue_sizes.get(req.level):
            where += f", or priority level {req.level} reached max_queue_size"
        return where + ")"

    def refuse(self, reqs: list[Request], now: float, running_s: float, slots: int) -> Refusal | None:
        """A call whose deadline is out of reach: the compute queued ahead of it (bucket by bucket,
        the rows as they will run), what the running batches still have to do, then its own
        requests' compute, all from the learned latency model and scaled by how such predictions
        have lately compared with what happened (``calibrate``), would end past its due time even
        at the low end of that comparison. A refusal is a call nobody gets an answer to, so it is
        made only where the call would almost surely miss; one that is admitted and then falls
        behind is still dropped before compute (``take_expired``)."""
        self.prediction = None
        first = reqs[0]
        if first.cls is None or first.deadline == math.inf or first.soft:
            return None  # (a soft deadline is the class's, not the caller's: late beats refused)
        # Its requests run one after another on one slot at worst: their expected times add up.
        # A request of a bucket with work queued joins one of its batches and adds its rows' share
        # only (a 32-text call's six parts charged six batches of their own came out at twice its
        # real time). A bucket that has not run enough yet counts no compute of its own (never
        # over-refuse).
        # One pass also finds a hopeless call: one of its requests would end past its due time
        # even alone on an idle worker (its bucket's high estimate and the loop's expected lag),
        # which ``take_expired`` would drop the moment the batcher looks. Refused here with no
        # retry hint, so an impossible budget is told the same way on every route and under any
        # load, before the model is confident as after, instead of being queued only to be
        # dropped before compute (or, by the probe, let through).
        latency = self.latency
        lag = self.lag_expected()
        own = spread = 0.0
        for r in reqs:
            if latency.confident(r.key):
                hi = latency.estimate_hi(r.key, r.rows)
                if now > self.due(r) - hi - lag:
                    return Refusal(0.0, hi, 0.0, alone=True)
                own += self._own_s(r)
                spread = max(spread, hi - latency.estimate(r.key, r.rows))
        if not self.latency.confident_model():
            return None  # no estimate worth refusing work on yet: admit, the queue still expires it
        left = self.due(first) - now - lag
        per_slot = max(slots, 1)
        # Most calls are far from their deadline: a bound on the work ahead that costs a lookup
        # per bucket (every queued request a batch of its own) admits them without the exact
        # bucket-by-bucket sum, which is only needed when the bound does not fit.
        if (self._work_bound_s() + running_s) / per_slot + own <= left:
            return None
        wait = (self.work_before_s(reqs) + running_s) / per_slot
        self.prediction = wait + own  # checked against the call's real time (``calibrate``)
        # A prediction that counted a bucket not yet confident (its work guessed from other
        # buckets, its own compute left out) says nothing of the predictions made once the model
        # has learned: in the model's first batches such predictions ran 3-8x short, and a window
        # of those ratios then scaled every later prediction up 3x and refused calls that made
        # their deadlines, the refusals themselves leaving no sample to correct it
        # (tests/test_false_refusals.py: the warm-up).
        self.prediction_sound = all(latency.confident(r.key) for r in reqs) and all(
            latency.confident(key) for key in self._lanes
        )
        if self.prediction * self._ratio_low() - spread <= left:
            return None
        if wait <= 0.0:
            # Nothing ahead and a slot free: only the estimate of its own compute is against it.
            # One such call a second is let through: refusing on the model alone could refuse for
            # ever, since nothing would run to correct an estimate that has become too high.
            if now - self._probe_at >= 1.0:
                self._probe_at = now
                return None
        return Refusal(wait, own, max(wait, 0.001))

    # Admission predictions checked against the calls' real times: enough samples before the
    # ratio moves the decision, and then the lowest of the last RATIO_WINDOW ratios. A refusal is
    # an answer nobody gets, so a call is refused only if it would miss even had it gone as well
    # as the best of the recent calls: on a shared core a queue's real times stray far from its
    # predictions both ways, and the mean less twice its deviation refused calls that made their
    # deadlines (docs/performance.md, "Figures the code cites": the admission ratio). A call that
    # does fall behind is still dropped before compute.
    CALIBRATE_AFTER = 8
    CALIBRATE_ALPHA = 0.1
    RATIO_FLOOR = 0.5
    RATIO_WINDOW = 64

    def calibrate(self, predicted_s: float, actual_s: float) -> None:
        """A call admitted with ``prediction`` = ``predicted_s`` (work ahead plus its own) took
        ``actual_s`` from admission to its answer."""
        if predicted_s <= 0.0:
            return
        ratio = actual_s / predicted_s
        self._recent.append(ratio)
        n, mean, dev = self._ratio
        if n == 0:
            self._ratio = (1, ratio, 0.0)
            return
        err = ratio - mean
        a = self.CALIBRATE_ALPHA
        self._ratio = (n + 1, mean + a * err, dev + a * (abs(err) - dev))

    def _ratio_low(self) -> float:
        """The low end of real over predicted time lately: the least of the recent ratios. Before
        CALIBRATE_AFTER samples, the floor: a call is refused on an unchecked prediction only when
        half of it already misses (a backlog many budgets long), never at the edge of capacity."""
        if self._ratio[0] < self.CALIBRATE_AFTER:
            return self.RATIO_FLOOR
        return min(self._recent)

    def ratio(self) -> tuple[int, float, float]:
        return self._ratio

    def _own_s(self, r: Request) -> float:
        """The compute ``r`` adds: its rows' share when its bucket has work queued that it can
        join, else a batch of its own."""
        a, b = self.latency.per_row(r.key)
        lanes = self._lanes.get(r.key)
        if lanes and any(lane.rows for lane in lanes.values()):
            return b * r.rows
        return a + b * r.rows

    def drain_s(self, req: Request, slots: int) -> float | None:
        if req.cls is None or not self.latency.confident_model():
            return None
        return self.work_ahead_s(req) / max(slots, 1)

    def _note_arrival(self, now: float) -> None:
        if self._last_arrival is not None:
            gap = max(now - self._last_arrival, 1e-6)
            # EWMA of the arrival rate, so "will anyone join this batch soon?" has an answer.
            self._arrivals_per_s = 0.9 * self._arrivals_per_s + 0.1 * (1.0 / gap)
        self._last_arrival = now

    def _work_bound_s(self) -> float:
        """At least ``work_ahead_s`` for any request: every queued request (of every class) as a
        batch of its own, at the largest intercept and per-row time among the queued buckets."""
        if not self.size:
            return 0.0
        a_max = b_max = 0.0
        for key in self._lanes:
            a, b = self.latency.per_row(key)
            a_max = max(a_max, a)
            b_max = max(b_max, b)
        return self.size * a_max + self.rows * b_max

    def wake_at(self, reqs: list[Request]) -> float | None:
        """When the batcher must first look at these just-pushed requests if no slot frees before:
        the moment one of them becomes hopeless by ``take_expired``'s test, or its queue timeout."""
        lag = self.lag_expected()
        at = math.inf
        for r in reqs:
            if r.soft:  # never hopeless: only its queue timeout, if any, ends it
                at = min(at, r.queue_deadline)
                continue
            est = self.latency.estimate_hi(r.key, r.rows) if self.latency.confident(r.key) else 0.0
            at = min(at, self.due(r) - est - lag, r.queue_deadline)
        return None if at == math.inf else at

    def backlog_s(self, now: float) -> float | None:
        """Compute seconds of everything queued (every class), bucket by bucket as
        ``work_ahead_s`` counts it; None while the model has not run enough to say."""
        if not self.size:
            return 0.0
        if not self.latency.confident_model():
            return None
        rank = max(c.rank for c in self.classes.values())
        cap = self._batch_time_cap(now)
        return sum(self._bucket_work_s(key, lanes, rank, cap) for key, lanes in self._lanes.items())

    def work_ahead_s(self, req: Request) -> float:
        """Compute seconds queued ahead of ``req`` (classes at least as urgent), bucket by bucket:
        a row of a long bucket costs more than a short one."""
        rank = req.cls.rank
        cap = self._batch_time_cap(req.arrival)
        return sum(self._bucket_work_s(key, lanes, rank, cap) for key, lanes in self._lanes.items())

    def work_before_s(self, reqs: list[Request]) -> float:
        """Compute seconds that run before a call's last request is answered. A request joins its
        bucket's next batch, which leaves when that bucket's head is the most urgent: the buckets
        whose heads come later run after it, not before (charging every queued row, a single text
        at capacity was predicted several times its real wait and refused though it would have
        made it). Where a request does not fit its bucket's next batch, all the work ahead."""
        first = reqs[0]
        rank = first.cls.rank
        cap = self._batch_time_cap(first.arrival)
        last = None  # the (level, latest start) of the latest batch the call's requests ride in
        for r in reqs:
            lanes = self._lanes.get(r.key)
            head = self._head(lanes, rank) if lanes else None
            if head is None:
                est = self.latency.estimate(r.key, r.rows) if self.latency.confident(r.key) else 0.0
                head = (r.level, r.deadline - est)
            else:
                rows = sum(lane.rows for lane in lanes.values() if self.classes[lane.cls].rank <= rank)
                if rows + r.rows > self._per_batch(r.key, cap):
                    return self.work_ahead_s(first)
            if last is None or head > last:
                last = head
        total = 0.0
        for key, lanes in self._lanes.items():
            head = self._head(lanes, rank)
            if head is not None and head <= last:
                total += self._bucket_work_s(key, lanes, rank, cap)
        return total

    def _head(self, lanes: dict[str, _Lane], rank: int) -> tuple[int, float] | None:
        """The (level, latest start) of a bucket's most urgent request of a class ranked at most
        ``rank``: the order in which the batcher picks buckets."""
        best = None
        for lane in lanes.values():
            if lane.heap and self.classes[lane.cls].rank <= rank:
                h = lane.heap[0][:2]
                if best is None or h < best:
                    best = h
        return best

    def _per_batch(self, key: Hashable, cap: float) -> int:
        """Rows one batch of bucket ``key`` takes, held under the batch-time cap."""
        per_batch = self._limit(key)
        a, b = self.latency.per_row(key)
        if cap < math.inf and b > 0:  # batches are held under the cap: more, smaller ones
            per_batch = max(1, min(per_batch, int((cap - a) / b)))
        return per_batch

    def _bucket_work_s(self, key: Hashable, lanes: dict[str, _Lane], rank: int, cap: float) -> float:
        ahead = [lane for lane in lanes.values() if self.classes[lane.cls].rank <= rank]
        rows = sum(lane.rows for lane in ahead)
        if not rows:
            return 0.0
        # A request never splits: there are no more batches than requests, whatever the limit (a
        # limit of 1 row must not charge a 4-row request four intercepts).
        batches = min(math.ceil(rows / self._per_batch(key, cap)), sum(len(lane.heap) for lane in ahead))
        # Each batch at the time batches of its size took lately (``estimate``), not the linear
        # fit's extrapolation: fitted on large batches on a shared core, its intercept can be many
        # times a whole small batch (docs/performance.md, "Figures the code cites").
        return batches * self.latency.estimate(key, math.ceil(rows / batches))

    # -- bookkeeping ----------------------------------------------------------------------------

    def _remove(self, lane: _Lane, req: Request) -> None:
        lane.rows -= req.rows
        self.rows -= req.rows
        self.size -= 1
        self.class_size[lane.cls] -= 1
        self.level_size[req.level] -= 1

    def _clean_head(self, lane: _Lane) -> None:
        while lane.heap and lane.heap[0][3].future.done():
            _, _, _, r = heapq.heappop(lane.heap)
            self._remove(lane, r)
            self.dropped += 1

    def take_expired(self, now: float) -> tuple[list[Request], float | None]:
        """Requests that cannot finish in time even if they ran alone right now (Triton DELAY
        requests past their queue timeout are moved behind everything instead), and when the
        most urgent one left becomes hopeless, by the same test, so that wake-up is never early."""
        out: list[Request] = []
        lag = self.lag_expected()
        wake = math.inf
        for key, lanes in self._lanes.items():
            confident = self.latency.confident(key)  # no estimate until the bucket is known
            for lane in lanes.values():
                self._clean_head(lane)
                # Deadlines are only ordered within a level, so scan the (few) heads per level
                # lazily: pop from the top while the top is hopeless.
                while lane.heap:
                    level, start_by, _, r = lane.heap[0]
                    if r.soft:  # a soft deadline orders the request, it never drops it
                        hopeless_at = math.inf
                    else:
                        est = self.latency.estimate_hi(key, r.rows) if confident else 0.0
                        hopeless_at = self.due(r) - est - lag
                    late = now > hopeless_at
                    timed_out = now >= r.queue_deadline
                    if not (late or timed_out):
                        wake = min(wake, hopeless_at, r.queue_deadline)
                        break
                    heapq.heappop(lane.heap)
                    if timed_out and r.delay and not late and level != _DELAYED_LEVEL:
                        heapq.heappush(lane.heap, (_DELAYED_LEVEL, start_by, next(self._seq), r))
                        continue
                    self._remove(lane, r)
                    if r.future.done():
                        self.dropped += 1
                    else:
                        out.append(r)
        return out, (None if wake == math.inf else wake)

    # -- batch formation ------------------------------------------------------------------------

    def _starving(self) -> str | None:
        """The class owed the most rows by its guaranteed share (credit >= its head's rows)."""
        best = None
        for name, credit in self._credit.items():
            if credit >= 1.0 and self.class_size[name] and (best is None or credit > self._credit[best]):
                best = name
        return best

    def _heads(self) -> list[tuple[tuple, Hashable, _Lane]]:
        heads = []
        for key in list(self._lanes):
            lanes = self._lanes[key]
            for cls in list(lanes):
                lane = lanes[cls]
                self._clean_head(lane)
                if lane.heap:
                    level, deadline, seq, _ = lane.heap[0]
                    heads.append(((level, deadline, seq), key, lane))
                else:
                    del lanes[cls]
            if not lanes:
                del self._lanes[key]
        heads.sort(key=lambda h: h[0])
        return heads

    def _batch_time_cap(self, now: float) -> float:
        """Longest batch worth running now: ``cap_fraction`` of the tightest budget among classes
        active in the last second (less the margin). Batches do not preempt: an urgent request
        that arrives as a batch starts waits for it, then runs in a batch of its own, so at 0.5
        the two together still fit its budget; a larger fraction trades that p99 for throughput."""
        active = [self.classes[c].budget_s for c, t in self._class_seen.items() if now - t < 1.0]
        if not active:
            return math.inf
        budget = min(active)
        return max(budget - self._fixed_margin(budget) - self.lag_margin(), 0.0) * self.cap_fraction

    def _pop_plan(
        self, key: Hashable, first: _Lane | None, now: float = 0.0
    ) -> tuple[list[tuple[_Lane, tuple]], int, int]:
        """Pop, in (level, deadline) order across the bucket's lanes, the requests a batch of bucket
        ``key`` would take now. Returns (lane, heap entry) pairs, their rows, and the count at the
        largest preferred size reached (0 if none). ``_restore`` puts them back if it doesn't go."""
        lanes = [l for l in self._lanes[key].values() if l.heap]
        plan: list[tuple[_Lane, tuple]] = []
        rows = 0
        best_pref = 0
        limit = self._limit(key)
        cand = [(l.heap[0][:3], i) for i, l in enumerate(lanes) if l is not first]
        heapq.heapify(cand)
        # Deadline-aware filling: a row joins only if the batch, with it, still finishes before the
        # most urgent deadline in it and stays under the batch-time cap (known buckets only).
        sized = self.latency.confident(key)
        cap = self._batch_time_cap(now) if sized else math.inf
        lag = self.lag_margin()
        urgent = math.inf  # the earliest due time among the rows taken
        if first is not None:  # a starving class's head goes first
            cand.insert(0, ((-1, -math.inf, -1), lanes.index(first)))
        while rows < limit and cand:
            _, i = heapq.heappop(cand)
            lane = lanes[i]
            entry = heapq.heappop(lane.heap)
            r = entry[3]
            if r.future.done():  # the caller left: forget the request
                self._remove(lane, r)
                self.dropped += 1
            elif rows + r.rows > limit and plan:
                heapq.heappush(lane.heap, entry)
                break
            elif (
                plan
                and sized
                and (
                    (est := self.latency.estimate_hi(key, rows + r.rows)) > cap
                    or now + est + lag > min(urgent, self.due(r))
                )
            ):
                heapq.heappush(lane.heap, entry)
                break
            else:
                plan.append((lane, entry))
                rows += r.rows
                urgent = min(urgent, self.due(r))
                if rows in self.preferred:
                    best_pref = len(plan)
                if self.max_batch_size == 0:
                    break
            if lane.heap:
                heapq.heappush(cand, (lane.heap[0][:3], i))
        return plan, rows, best_pref

    @staticmethod
    def _restore(plan: list[tuple[_Lane, tuple]]) -> None:
        for lane, entry in plan:
            heapq.heappush(lane.heap, entry)

    def _live_in(self, key: Hashable) -> int:
        """Requests queued in bucket ``key`` besides a popped plan (heaps hold the rest)."""
        return sum(len(lane.heap) for lane in self._lanes[key].values())

    def _close_at(
        self,
        key: Hashable,
        plan: list[tuple[_Lane, tuple]],
        rows: int,
        best_pref: int,
        now: float,
        idle: bool,
    ) -> float:
        """When this batch should leave: now (returns ``now``) or a later time to re-check."""
        if self.max_batch_size == 0 or rows >= self._limit(key) or best_pref == len(plan):
            return now
        if self._live_in(key):  # rows were left out (deadline, cap or size): waiting adds nothing
            return now
        urgent = min(self.due(e[3]) for _, e in plan)
        compute = self.latency.estimate_hi(key, rows)
        latest = urgent - compute - self.lag_margin()  # waiting past this makes the most urgent late
        timer = min(e[3].arrival for _, e in plan) + self.max_delay_s
        close = min(latest, timer)
        if close <= now:
            return now
        if idle:
            # A worker is free: hold only if someone is likely to join before we must go, and
            # if a bigger batch is cheaper per row at all (a fixed cost per batch to amortise).
            expected = self._arrivals_per_s * (close - now)
            a, b = self.latency.per_row(key)
            if expected < 1.0 or a < 0.1 * (a + b * rows):
                return now
            if key not in self._held:  # a new hold (not the same one looked at again)
                if self.hold_score < self.HOLD_PAYS:
                    if now - self._hold_probe_at < self.HOLD_PROBE_S:
                        return now
                    self._hold_probe_at = now
                self._held[key] = len(plan)
        return close

    def _score_hold(self, key: Hashable, n: int) -> None:
        """A batch of bucket ``key`` with ``n`` requests leaves: if an idle hold kept it, score
        whether anyone joined while it waited."""
        before = self._held.pop(key, None)
        if before is not None:
            d = self.HOLD_DECAY
            self.hold_score = d * self.hold_score + (1.0 - d) * (n > before)

    def pop_batch(self, now: float, idle: bool = False) -> tuple[list[Request] | None, float | None]:
        heads = self._heads()
        if not heads:
            return None, None
        starving = self._starving()
        order = heads
        if starving is not None:
            order = sorted(heads, key=lambda h: (h[2].cls != starving, h[0]))
        wake = math.inf
        seen = set()
        for _, key, lane in order:
            if key in seen and starving != lane.cls:
                continue  # one plan per bucket is enough: it already merged every lane
            seen.add(key)
            if key not in self._lanes:
                continue
            plan, rows, best_pref = self._pop_plan(key, lane if starving == lane.cls else None, now)
            if not plan:
                continue
            at = self._close_at(key, plan, rows, best_pref, now, idle)
            if at <= now:
                self._score_hold(key, len(plan))
                return self._take(plan), None
            self._restore(plan)
            wake = min(wake, at)
        return None, (None if wake == math.inf else wake)

    def _take(self, plan: list[tuple[_Lane, tuple]]) -> list[Request]:
        batch = []
        for lane, entry in plan:
            r = entry[3]
            self._remove(lane, r)
            batch.append(r)
        if self._credit:
            rows = sum(r.rows for r in batch)
            cap = max(self.max_batch_size, 1)
            for name in self._credit:
                if self.class_size[name] or any(r.cls.name == name for r in batch):
                    own = sum(r.rows for r in batch if r.cls.name == name)
                    credit = self._credit[name] + self.classes[name].min_share * rows - own
                    self._credit[name] = min(max(credit, 0.0), cap)
                else:
                    self._credit[name] = 0.0  # nothing waiting: no debt builds up
        return batch

    def depth_by_class(self) -> dict[str, int]:
        return dict(self.class_size)

    def drain_all(self) -> list[Request]:
        out = []
        for lanes in self._lanes.values():
            for lane in lanes.values():
                out.extend(e[3] for e in lane.heap)
        self._lanes.clear()
        self.size = 0
        self.rows = 0
        for c in self.class_size:
            self.class_size[c] = 0
        self.level_size.clear()
        return out
