"""Admission: the one object the door (door.py) asks before any decoding work — who is calling,
may they call this model, and is there room for it now.

    account = admission.identify(metadata)         once per call (once per stream): UNAUTHENTICATED
    ticket = await admission.admit(account, model, rows)
                                                    PERMISSION_DENIED / RESOURCE_EXHAUSTED
    ...decode, infer, encode...
    ticket.release()                                in a finally: success, error or cancel

With no tenant file the server is open: ``admission.open`` is True and the door skips both
calls (one attribute check per call) and uses ``OPEN_TICKET``, whose tenant is ``ANONYMOUS``.

Checks run cheapest first — model allowed, in-flight cap, local buckets, then the global limit
(a Redis round trip, only when the tenant has one) — and a refusal refunds what earlier checks
charged, so a refused request costs the tenant nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

from batchgate.cache import RedisLink
from batchgate.gateway.admission import budgets
from batchgate.gateway.errors import GatewayError, Kind, Limited
from batchgate.gateway.admission.ratelimit import Bucket, GlobalLimiter, GlobalSpec, RedisLimiter
from batchgate.gateway.admission.tenants import (
    ANONYMOUS,
    Directory,
    Limits,
    Tenant,
    TenantFileError,
    load_tenants,
)
from batchgate.workers.per_file import file_version

log = logging.getLogger(__name__)

# No refill time to point at when the in-flight cap is what refused: a short hint, so clients back
# off a little instead of spinning.
IN_FLIGHT_RETRY_MS = 10


class TenantStats:
    """Plain counters per tenant (the metrics exporter reads them through ``Admission.stats``)."""

    __slots__ = (
        "admitted",
        "denied_model",
        "limited_global",
        "limited_in_flight",
        "limited_oversize",
        "limited_requests",
        "limited_rows",
        "limited_tokens",
        "rows_admitted",
    )  # fmt: skip

    def __init__(self) -> None:
        for name in self.__slots__:
            setattr(self, name, 0)

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


class Quota:
    """The limits one (tenant, model) pair is held to; models without overrides share the tenant's."""

    __slots__ = (
        "in_flight",
        "label",
        "max_in_flight",
        "max_rows",
        "max_tokens",
        "requests",
        "rows",
        "spec",
        "tokens",
    )

    def __init__(self, label: str, local: Limits, spec: GlobalSpec | None, global_limits: Limits) -> None:
        self.label = label
        self.requests: Bucket | None = local.requests.bucket() if local.requests else None
        self.rows: Bucket | None = local.rows.bucket() if local.rows else None
        self.max_in_flight = local.max_in_flight
        self.in_flight = 0
        self.spec = spec
        bursts = [r.burst for r in (local.rows, global_limits.rows) if r is not None]
        self.max_rows = int(min(bursts)) if bursts else None  # larger requests could never be admitted
        self.tokens: Bucket | None = local.tokens.bucket() if local.tokens else None
        bursts = [r.burst for r in (local.tokens, global_limits.tokens) if r is not None]
        self.max_tokens = int(min(bursts)) if bursts else None


class Account:
    """A tenant as admission sees it: its gates and counters. ``identify`` hands it to the servicer,
    which passes it back to ``admit`` for each request (once per call, or once per stream)."""

    __slots__ = ("default", "gates", "models", "stats", "tenant")

    def __init__(self, tenant: Tenant, default: Quota, gates: dict[str, Quota]) -> None:
        self.tenant = tenant
        self.models = tenant.models
        self.default = default
        self.gates = gates
        self.stats = TenantStats()

    def budgets_tokens(self, model: str) -> bool:
        """Whether a token budget binds this tenant's calls to ``model`` (then admission needs an estimate)."""
        return self.gates.get(model, self.default).max_tokens is not None


class Ticket:
    """An admitted request; ``release`` frees its in-flight slot (idempotent). ``settle`` charges
    the exact token count against the estimate ``charged`` at admission."""

    __slots__ = ("_gate", "charged", "limiter", "quota", "tenant")

    def __init__(self, tenant: Tenant, gate: Quota | None, charged: int = 0, limiter=None) -> None:
        self.tenant = tenant
        self._gate = gate
        self.quota = gate  # kept after release: the settlement and the headers need it
        self.charged = charged
        self.limiter = limiter

    def settle(self, tokens: int, now: float) -> None:
        budgets.settle(self, tokens, now)

    def headers(self, now: float) -> tuple[tuple[str, str], ...]:
        return budgets.headers(self.quota, now) if self.quota is not None else ()

    def release(self) -> None:
        gate = self._gate
        if gate is not None:
            self._gate = None
            gate.in_flight -= 1


OPEN_TICKET = Ticket(ANONYMOUS, None)


def _load(settings) -> list[Tenant]:
    tenants = load_tenants(settings.api_keys_file)
    classes = settings.classes
    for t in tenants:
        if t.default_class is not None and t.default_class not in classes:
            raise TenantFileError(
                f"tenant '{t.name}' in {settings.api_keys_file}: default_class '{t.default_class}' is not one "
                f"of the latency classes {sorted(classes)}"
            )
    return tenants


class Admission:
    def __init__(
        self,
        tenants: Iterable[Tenant] = (),
        limiter: GlobalLimiter | None = None,
        *,
        local_share: float = 1.0,
        redis_prefix: str = "batchgate:rl",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.directory = Directory(tenants)
        self.open = not self.directory.by_hash
        self.clock = clock
        self.unauthenticated = 0
        self.accounts: dict[str, Account] = {}
        has_global = False
        for t in self.directory.tenants.values():
            gates: dict[str, Quota] = {}
            for model in (None, *t.model_limits):
                local, glob = t.limits_for(model) if model else (t.limits, t.global_limits)
                spec = None
                if glob.requests or glob.rows or glob.tokens:
                    has_global = True
                    scope = model or "*"
                    # one hash tag per tenant keeps a decision's keys in one Redis Cluster slot
                    keys = tuple(
                        f"{redis_prefix}:{{{t.name}}}:{scope}:{what}"
                        for what, r in (("req", glob.requests), ("rows", glob.rows), ("tok", glob.tokens))
                        if r is not None
                    )  # fmt: skip
                    spec = GlobalSpec(
                        f"{t.name}/{scope}", keys, glob.requests, glob.rows, local_share, glob.tokens
                    )
                gates[model or ""] = Quota(f"{t.name}/{model or '*'}", local, spec, glob)
            default = gates.pop("")
            self.accounts[t.name] = Account(t, default, gates)
        self._by_hash = {h: self.accounts[t.name] for h, t in self.directory.by_hash.items()}
        self.limiter = (limiter or GlobalLimiter(clock)) if has_global else None
        self.local_share = local_share

    @classmethod
    def from_settings(cls, settings, redis=None) -> Admission:
        """The server's admission: open without a tenant file; a Redis limiter only when some
        tenant has a global limit and a Redis URL is set. ``redis``: the process's one
        ``cache.RedisLink`` (the server's, shared with the result cache); without it the limiter
        gets a link of its own."""
        if settings.api_keys_file is None:
            return cls()
        tenants = _load(settings)
        share = settings.ratelimit_local_share or 1.0 / settings.ratelimit_expected_replicas
        has_global = any(
            not g.empty for t in tenants for g in (t.global_limits, *(o[1] for o in t.model_limits.values()))
        )
        limiter: GlobalLimiter | None = None
        if has_global and settings.redis_url:
            limiter = RedisLimiter(
                redis or RedisLink.from_settings(settings),
                timeout_s=settings.ratelimit_redis_timeout_ms / 1e3,
                fail_mode=settings.ratelimit_fail_mode,
                close_link=redis is None,
            )
        elif has_global:
            log.warning(
                "global rate limits are configured but no Redis URL: each replica enforces %.3g of them alone",
                share,
            )
        adm = cls(tenants, limiter, local_share=share, redis_prefix=settings.ratelimit_redis_prefix)
        adm._source = (settings, file_version(settings.api_keys_file))
        log.info(
            "tenants: %d loaded from %s; global limits %s",
            len(tenants), settings.api_keys_file, adm.limiter.backend if adm.limiter else "none",
        )  # fmt: skip
        return adm

    async def start(self) -> None:
        if self.limiter is not None:
            await self.limiter.start()
        source = getattr(self, "_source", None)
        if source is not None and source[0].tenants_reload_s > 0:
            self._watch = asyncio.create_task(self._watch_file(), name="tenant-file-watch")

    async def close(self) -> None:
        watch = getattr(self, "_watch", None)
        if watch is not None:
            watch.cancel()
        if self.limiter is not None:
            await self.limiter.close()

    # -- the tenant file, re-read when it changes ------------------------------------------------

    async def _watch_file(self) -> None:
        settings, _ = self._source
        while True:
            await asyncio.sleep(settings.tenants_reload_s)
            try:
                tenants = await asyncio.to_thread(self._read_if_changed)  # the file is read off the loop
                if tenants is not None:
                    self._swap(tenants)  # on the loop: a call sees the old tenants or the new ones whole
            except Exception:  # a bug here must not stop the checks, nor the server
                log.exception("tenant file check failed")

    def _read_if_changed(self) -> list[Tenant] | None:
        settings, state = self._source
        path = settings.api_keys_file
        now = file_version(path)
        if now == state:
            return None
        self._source = (settings, now)
        try:
            return _load(settings)
        except TenantFileError as exc:
            log.warning(
                "tenant file %s changed but cannot be used (the previous tenants stay): %s", path, exc
            )
            return None

    def _swap(self, tenants: list[Tenant]) -> None:
        settings = self._source[0]
        fresh = Admission(
            tenants, self.limiter, local_share=self.local_share, redis_prefix=settings.ratelimit_redis_prefix
        )
        if fresh.limiter is not None and self.limiter is None:
            # (a local limiter: a Redis one starts with the server)
            log.warning(
                "tenant file %s: global limits were added; restart the server to enforce them in Redis",
                settings.api_keys_file,
            )
            self.limiter = fresh.limiter
        now = self.clock()
        for name, account in fresh.accounts.items():
            old = self.accounts.get(name)
            if old is not None and old.tenant == account.tenant:
                fresh.accounts[name] = old
            elif old is not None:  # new limits: what was used this minute stays used
                budgets.carry_over(old, account, now)
        self.directory, self.accounts = fresh.directory, fresh.accounts
        self._by_hash = {h: self.accounts[t.name] for h, t in self.directory.by_hash.items()}
        log.info(
            "tenants: %d reloaded from %s (the file changed)", len(self.accounts), settings.api_keys_file
        )

    # -- the per-call path ---------------------------------------------------------------------

    def identify(self, metadata) -> Account:
        """The caller's account from gRPC metadata, or UNAUTHENTICATED."""
        try:
            tenant = self.directory.identify(metadata)
        except GatewayError:
            self.unauthenticated += 1
            raise
        return self.accounts[tenant.name]

    async def admit(self, account: Account, model: str, rows: int, tokens: int = 0) -> Ticket:
        """A ticket for one request of ``rows`` rows to ``model``, or PERMISSION_DENIED /
        RESOURCE_EXHAUSTED (``Limited``). Release the ticket when the request finishes.
        ``tokens``: the call's estimated token count, charged to the token budgets now and
        settled against the exact count later (``Ticket.settle``)."""
        st = account.stats
        if account.models is not None and model not in account.models:
            st.denied_model += 1
            raise GatewayError(
                Kind.PERMISSION, f"tenant '{account.tenant.name}' may not call model '{model}'"
            )
        gate = account.gates.get(model, account.default) if account.gates else account.default
        if gate.max_rows is not None and rows > gate.max_rows:
            st.limited_oversize += 1
            raise GatewayError(
                Kind.INVALID,
                f"request has {rows} rows but tenant '{account.tenant.name}' may send at most {gate.max_rows} "
                f"rows per request to model '{model}' (its rows burst); split it",
            )
        if gate.max_tokens is not None and tokens > gate.max_tokens:
            st.limited_oversize += 1
            raise budgets.too_large(account.tenant.name, model, tokens, gate.max_tokens)
        if gate.max_in_flight is not None and gate.in_flight >= gate.max_in_flight:
            st.limited_in_flight += 1
            raise Limited(
                f"tenant '{account.tenant.name}' has {gate.max_in_flight} requests in flight (its limit)",
                IN_FLIGHT_RETRY_MS / 1e3,
                "in_flight",
            )
        req, rws = gate.requests, gate.rows
        if req is not None or rws is not None:
            now = self.clock()
            if req is not None and (wait := req.take(1, now)):
                st.limited_requests += 1
                raise Limited(
                    f"tenant '{account.tenant.name}' is over {req.rate_per_s:g} requests/s",
                    wait,
                    "requests",
                    budgets.headers(gate, now),
                )
            if rws is not None and rows and (wait := rws.take(rows, now)):
                if req is not None:
                    req.refund(1)
                st.limited_rows += 1
                raise Limited(
                    f"tenant '{account.tenant.name}' is over {rws.rate_per_s:g} rows/s", wait, "rows"
                )
        tks = gate.tokens
        if tks is not None and tokens and (wait := tks.take(tokens, self.clock())):
            if req is not None:
                req.refund(1)
            if rws is not None and rows:
                rws.refund(rows)
            st.limited_tokens += 1
            raise budgets.limited(account.tenant.name, gate, wait, self.clock())
        spec = gate.spec
        if spec is not None:
            # The slot is held across the await so the in-flight cap counts requests waiting on
            # Redis too; a cancel while waiting gives everything back.
            gate.in_flight += 1
            try:
                wait = await self.limiter.decide(spec, rows, tokens)
            except BaseException:
                gate.in_flight -= 1
                self._refund(gate, rows, tokens)
                raise
            if wait:
                gate.in_flight -= 1
                self._refund(gate, rows, tokens)
                st.limited_global += 1
                raise Limited(
                    f"tenant '{account.tenant.name}' is over its global limit ({spec.name})",
                    wait,
                    "global",
                    budgets.headers(gate, self.clock()),
                )
        else:
            gate.in_flight += 1
        st.admitted += 1
        st.rows_admitted += rows
        return Ticket(account.tenant, gate, tokens, self.limiter)

    @staticmethod
    def _refund(gate: Quota, rows: int, tokens: int = 0) -> None:
        if gate.requests is not None:
            gate.requests.refund(1)
        if gate.rows is not None and rows:
            gate.rows.refund(rows)
        if gate.tokens is not None and tokens:
            gate.tokens.refund(tokens)

    # -- observability -------------------------------------------------------------------------

    def stats(self) -> dict:
        """Plain counters: per tenant, plus unauthenticated calls and the global limiter's state."""
        tenants = {}
        for name, acct in self.accounts.items():
            d = acct.stats.as_dict()
            d["in_flight"] = acct.default.in_flight + sum(g.in_flight for g in acct.gates.values())
            tenants[name] = d
        return {
            "open": self.open,
            "unauthenticated": self.unauthenticated,
            "tenants": tenants,
            "global": self.limiter.stats() if self.limiter is not None else None,
        }
