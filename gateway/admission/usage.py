"""Usage metering: what each tenant used, per model — requests, rows, tokens, cache hits, refusals
by cause, compute seconds — for /metrics, for OpenAI's usage API and for a record sink.

Per call this is a few dict operations on the event loop (``answered`` / ``refused``); the
metric families are made at scrape time, the usage API's buckets at query time, and the sink's
records are written off the loop once per ``interval_s``.

* Tokens are the answer's ``usage`` counts (each text as the model saw it, truncated ones capped);
  a row the result cache answered counts as usage too (its tokens were counted, the tenant got
  its vector), and is also counted apart as a cache hit. A call without token counts (KServe v2
  on a numeric model) counts 0 tokens.
* Compute seconds: the call's share, by rows, of each batch that computed its rows (the engine's
  time, not the queue's); rows the cache answered cost none.
* Labels are bounded: tenants come from the tenant file (``anonymous`` on an open server), models
  from the served repository (any other name is counted as ``(unknown)``).
* The usage API's buckets are this replica's; every replica's records meet in the sink (one
  JSON-lines file per replica, or one Redis stream for all).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from batchgate.gateway.errors import GatewayError, Kind, invalid
from batchgate.gateway.scheduling.stats import COST, CallCost

log = logging.getLogger(__name__)

UNKNOWN_MODEL = "(unknown)"
MINUTE_RETENTION_S = 86_400  # 1m buckets for a day
HOUR_RETENTION_S = 35 * 86_400  # 1h and 1d buckets for 35 days
# OpenAI's usage API: bucket width -> (seconds, default limit, most buckets per page)
WIDTHS = {"1m": (60, 60, 1440), "1h": (3600, 24, 168), "1d": (86_400, 7, 31)}
GROUPS = ("project_id", "model")  # project_id: the tenant (an OpenAI project is one team's budget)
_TOTALS = ("requests", "rows", "tokens", "cache_hits", "compute_s")


class Usage:
    def __init__(self, sink: Sink | None = None, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.sink = sink
        self.totals: dict[tuple[str, str], list] = {}  # (tenant, model) -> _TOTALS
        self.refusals: dict[tuple[str, str, str], int] = {}  # (tenant, model, cause) -> calls
        self.minutes: dict[int, dict[tuple[str, str], list[int]]] = {}  # minute -> pair -> [tokens, requests]
        self.hours: dict[int, dict[tuple[str, str], list[int]]] = {}
        self._minute = -1

    # -- per call ------------------------------------------------------------------------------

    def answered(self, tenant: str, model: str, rows: int, tokens: int, cost: CallCost | None) -> None:
        hits = max(rows - cost.computed, 0) if cost is not None else 0
        compute_s = cost.compute_s if cost is not None else 0.0
        key = (tenant, model)
        t = self.totals.get(key)
        if t is None:
            t = self.totals[key] = [0, 0, 0, 0, 0.0]
        t[0] += 1
        t[1] += rows
        t[2] += tokens
        t[3] += hits
        t[4] += compute_s
        now = self.clock()
        minute = int(now // 60)
        if minute != self._minute:
            self._roll(minute)
        for bins, at in ((self.minutes, minute), (self.hours, minute // 60)):
            b = bins[at].get(key)
            if b is None:
                b = bins[at][key] = [0, 0]
            b[0] += tokens
            b[1] += 1
        if self.sink is not None:
            self.sink.add({
                "time": round(now, 3), "tenant": tenant, "model": model, "outcome": "ok", "rows": rows,
                "tokens": tokens, "cache_hits": hits, "compute_s": round(compute_s, 6),
            })  # fmt: skip

    def refused(self, tenant: str, model: str, cause: str) -> None:
        key = (tenant, model, cause)
        self.refusals[key] = self.refusals.get(key, 0) + 1
        if self.sink is not None:
            self.sink.add(
                {"time": round(self.clock(), 3), "tenant": tenant, "model": model, "outcome": cause}
            )

    def _roll(self, minute: int) -> None:
        self._minute = minute
        self.minutes.setdefault(minute, {})
        self.hours.setdefault(minute // 60, {})
        for bins, oldest in (
            (self.minutes, minute - MINUTE_RETENTION_S // 60),
            (self.hours, minute // 60 - HOUR_RETENTION_S // 3600),
        ):
            for at in [a for a in bins if a <= oldest]:
                del bins[at]

    # -- OpenAI's usage API --------------------------------------------------------------------

    def page(self, query: dict[str, list[str]], only: str | None) -> dict:
        """The answer to ``GET /v1/organization/usage/embeddings`` for ``query`` (each parameter's
        values). ``only``: the caller's tenant when it may see only its own figures."""
        start = _int(query, "start_time", None)
        if start is None:
            raise invalid(
                "'start_time' is required: Unix seconds, the start of the first bucket", "start_time"
            )
        width = _one(query, "bucket_width", "1d")
        if width not in WIDTHS:
            raise invalid(f"'bucket_width' must be one of {list(WIDTHS)}, not {width!r}", "bucket_width")
        step, default_limit, most = WIDTHS[width]
        limit = _int(query, "limit", default_limit)
        if not 1 <= limit <= most:
            raise invalid(f"'limit' must be 1..{most} for bucket_width {width}", "limit")
        start = start - start % step
        page = _int(query, "page", start)  # next_page: the start of the next bucket
        end = _int(query, "end_time", None)
        group_by = [
            g for v in query.get("group_by", []) + query.get("group_by[]", []) for g in v.split(",") if g
        ]
        for g in group_by:
            if g not in GROUPS:
                raise invalid(
                    f"'group_by' value {g!r} is not metered here; group by {list(GROUPS)} "
                    "(project_id is the tenant)", "group_by",
                )  # fmt: skip
        models = set(_many(query, "models"))
        tenants = set(_many(query, "project_ids"))
        if only is not None:
            tenants = {only} if not tenants or only in tenants else {"\0none"}
        bins, bin_s = (self.minutes, 60) if step == 60 else (self.hours, 3600)
        data = []
        at = max(page, start)
        stop = end if end is not None else math.ceil(self.clock() / step) * step
        while at < stop and len(data) < limit:
            groups: dict[tuple, list[int]] = {}
            for b in range(at // bin_s, (at + step) // bin_s):
                for (tenant, model), (tokens, requests) in bins.get(b, {}).items():
                    if (tenants and tenant not in tenants) or (models and model not in models):
                        continue
                    g = (tenant if "project_id" in group_by else None, model if "model" in group_by else None)
                    acc = groups.setdefault(g, [0, 0])
                    acc[0] += tokens
                    acc[1] += requests
            results = [
                {
                    "object": "organization.usage.embeddings.result",
                    "input_tokens": tokens,
                    "num_model_requests": requests,
                    "project_id": g[0],
                    "user_id": None,
                    "api_key_id": None,
                    "model": g[1],
                }  # fmt: skip
                for g, (tokens, requests) in sorted(
                    groups.items(), key=lambda kv: (kv[0][0] or "", kv[0][1] or "")
                )
            ]
            data.append({"object": "bucket", "start_time": at, "end_time": at + step, "results": results})
            at += step
        more = at < stop
        return {"object": "page", "data": data, "has_more": more, "next_page": str(at) if more else None}

    # -- /metrics ------------------------------------------------------------------------------

    def families(self, admission=None, models: Iterable[str] = ()) -> Iterator:
        """The usage families; every (tenant, model) pair ``admission``'s tenants may call among
        the served ``models`` has zero-valued series from the first scrape (a new server's panels
        read 0): bounded by the tenant file, as the labels are."""
        from prometheus_client.core import CounterMetricFamily

        totals = self.totals
        if admission is not None:
            tenants = [(a.tenant.name, a.models) for a in admission.accounts.values()] or [
                ("anonymous", None)
            ]
            quiet = [
                (t, m) for t, allowed in tenants for m in models
                if (t, m) not in totals and (allowed is None or m in allowed)
            ]  # fmt: skip
            if quiet:
                totals = {**totals, **{pair: (0, 0, 0, 0, 0.0) for pair in quiet}}

        p, labels = "batchgate_usage_", ["tenant", "model"]
        helps = {
            "requests": "calls answered, per tenant and model",
            "rows": "rows answered (texts, or the first input's batch rows), cache hits included",
            "tokens": "tokens answered, as the answers' usage counts them (cache hits included)",
            "cache_hits": "rows the result cache answered",
            "compute_s": "seconds of engine time: the call's share, by rows, of the batches that computed it",
        }
        for i, name in enumerate(_TOTALS):
            fam = CounterMetricFamily(
                p + (name if name != "compute_s" else "compute_seconds"), helps[name], labels=labels
            )
            for (tenant, model), t in totals.items():
                fam.add_metric([tenant, model], t[i])
            yield fam
        fam = CounterMetricFamily(
            p + "refusals", "calls refused, per tenant, model and cause (the limit that refused, or the "
            "error's kind)", labels=[*labels, "cause"],
        )  # fmt: skip
        for (tenant, model, cause), n in self.refusals.items():
            fam.add_metric([tenant, model, cause], n)
        fam.add_metric(
            ["(unknown key)", "", "unauthenticated"], admission.unauthenticated if admission else 0
        )
        yield fam


def cause_of(exc: BaseException) -> str:
    """The refusal label of a failed call: the limit that refused, else the error's kind."""
    cause = getattr(exc, "cause", None)
    if cause:
        return cause
    if isinstance(exc, GatewayError):
        return exc.kind.name.lower()
    return "cancelled" if isinstance(exc, asyncio.CancelledError) else "error"


def _one(query: dict, name: str, default):
    values = query.get(name) or []
    return values[-1] if values else default


def _many(query: dict, name: str) -> list[str]:
    return [v for v in query.get(name, []) + query.get(name + "[]", []) for v in v.split(",") if v]


def _int(query: dict, name: str, default):
    value = _one(query, name, None)
    if value is None:
        return default
    try:
        n = int(value)
    except ValueError:
        raise invalid(f"'{name}' must be an integer, not {value[:32]!r}", name) from None
    if n < 0:
        raise invalid(f"'{name}' must be >= 0", name)
    return n


# -- the record sink ------------------------------------------------------------------------------


class Sink:
    """Usage records, one per call, buffered and written once per ``interval_s`` off the hot path:
    appended as JSON lines to a file, or added to a Redis stream (``XADD``, capped at ``max_len``
    entries). A buffer over ``max_buffer`` records (the target is down) drops the oldest, counted."""

    def __init__(self, target: str, *, link=None, interval_s: float = 1.0, stream: str = "batchgate:usage",
                 max_len: int = 1_000_000, max_buffer: int = 100_000) -> None:  # fmt: skip
        self.target = target
        self.link = link
        self.interval_s = interval_s
        self.stream = stream
        self.max_len = max_len
        self.max_buffer = max_buffer
        self.buffer: list[dict] = []
        self.written = 0
        self.dropped = 0
        self.failures = 0
        self._task: asyncio.Task | None = None

    @classmethod
    def from_settings(cls, settings, link=None) -> Sink | None:
        target = settings.usage_sink
        if not target:
            return None
        if target == "redis" and link is None:
            raise ValueError("usage_sink 'redis' needs a Redis URL (redis_url)")
        return cls(target, link=link, interval_s=settings.usage_sink_interval_s)

    def add(self, record: dict) -> None:
        buf = self.buffer
        buf.append(record)
        if len(buf) > self.max_buffer:
            del buf[: len(buf) - self.max_buffer]
            self.dropped += 1

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="usage-sink")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.flush()  # what the last interval held

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.flush()

    async def flush(self) -> None:
        records, self.buffer = self.buffer, []
        if not records:
            return
        try:
            if self.target == "redis":
                pipe = self.link.client.pipeline(transaction=False)
                for r in records:
                    pipe.xadd(self.stream, {"r": json.dumps(r, separators=(",", ":"))}, maxlen=self.max_len,
                              approximate=True)  # fmt: skip
                await pipe.execute()
            else:
                lines = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records)
                await asyncio.to_thread(_append, Path(self.target), lines)
            self.written += len(records)
        except Exception as exc:  # noqa: BLE001 - the sink must never stop serving; kept for the next try
            self.failures += 1
            self.buffer[:0] = records[-self.max_buffer :]
            log.warning("usage records: %d not written yet to %s: %s", len(records), self.target, exc)


def _append(path: Path, text: str) -> None:
    with path.open("a") as f:
        f.write(text)


def read_records(lines: Iterable[str]) -> list[dict]:
    return [json.loads(line) for line in lines if line.strip()]


__all__ = ["COST", "CallCost", "Kind", "Sink", "Usage", "cause_of"]
