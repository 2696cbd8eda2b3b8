"""Admission: the one object the servicer asks before any decoding work — who is calling, may they
call this model, and is there room for it now.

    account = admission.identify(metadata)         once per call (once per stream): UNAUTHENTICATED
    ticket = await admission.admit(account, model, rows)
                                                    PERMISSION_DENIED / RESOURCE_EXHAUSTED
    ...decode, infer, encode...
    ticket.release()                                in a finally: success, error or cancel

With no tenant file the server is open: ``admission.open`` is True and the servicer skips both
calls (one attribute check per call) and uses ``OPEN_TICKET``, whose tenant is ``ANONYMOUS``.

Checks run cheapest first — model allowed, in-flight cap, local buckets, then the global limit
(a Redis round trip, only when the tenant has one) — and a refusal refunds what earlier checks
charged, so a refused request costs the tenant nothing.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable

from batchgate.gateway.errors import GatewayError, Kind
from batchgate.gateway.ratelimit import Bucket, GlobalLimiter, GlobalSpec, RedisLimiter
from batchgate.gateway.tenants import ANONYMOUS, Directory, Limits, Tenant, TenantFileError, load_tenants

log = logging.getLogger(__name__)

# No refill time to point at when the in-flight cap is what refused: a short hint, so clients back
# off a little instead of spinning.
IN_FLIGHT_RETRY_MS = 10


class Limited(GatewayError):
    """RESOURCE_EXHAUSTED, with ``retry-after-ms`` in the trailing metadata."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        self.retry_after_ms = max(1, math.ceil(retry_after_s * 1e3 - 1e-6))  # no extra ms for float dust
        super().__init__(Kind.EXHAUSTED, f"{message}; retry after {self.retry_after_ms} ms")
        self.trailing_metadata = (("retry-after-ms", str(self.retry_after_ms)),)


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
        "rows_admitted",
    )  # fmt: skip

    def __init__(self) -> None:
        for name in self.__slots__:
            setattr(self, name, 0)

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


class Gate:
    """The limits one (tenant, model) pair is held to; models without overrides share the tenant's."""

    __slots__ = ("in_flight", "label", "max_in_flight", "max_rows", "requests", "rows", "spec")

    def __init__(self, label: str, local: Limits, spec: GlobalSpec | None, global_limits: Limits) -> None:
        self.label = label
        self.requests: Bucket | None = local.requests.bucket() if local.requests else None
        self.rows: Bucket | None = local.rows.bucket() if local.rows else None
        self.max_in_flight = local.max_in_flight
        self.in_flight = 0
        self.spec = spec
        bursts = [r.burst for r in (local.rows, global_limits.rows) if r is not None]
        self.max_rows = int(min(bursts)) if bursts else None  # larger requests could never be admitted


class Account:
    """A tenant as admission sees it: its gates and counters. ``identify`` hands it to the servicer,
    which passes it back to ``admit`` for each request (once per call, or once per stream)."""

    __slots__ = ("default", "gates", "models", "stats", "tenant")

    def __init__(self, tenant: Tenant, default: Gate, gates: dict[str, Gate]) -> None:
        self.tenant = tenant
        self.models = tenant.models
        self.default = default
        self.gates = gates
        self.stats = TenantStats()


class Ticket:
    """An admitted request; ``release`` frees its in-flight slot (idempotent)."""

    __slots__ = ("_gate", "tenant")

    def __init__(self, tenant: Tenant, gate: Gate | None) -> None:
        self.tenant = tenant
        self._gate = gate

    def release(self) -> None:
        gate = self._gate
        if gate is not None:
            self._gate = None
            gate.in_flight -= 1


OPEN_TICKET = Ticket(ANONYMOUS, None)


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
            gates: dict[str, Gate] = {}
            for model in (None, *t.model_limits):
                local, glob = t.limits_for(model) if model else (t.limits, t.global_limits)
                spec = None
                if glob.requests or glob.rows:
                    has_global = True
                    scope = model or "*"
                    # one hash tag per tenant keeps a decision's keys in one Redis Cluster slot
                    keys = tuple(
                        f"{redis_prefix}:{{{t.name}}}:{scope}:{what}"
                        for what, r in (("req", glob.requests), ("rows", glob.rows)) if r is not None
                    )  # fmt: skip
                    spec = GlobalSpec(f"{t.name}/{scope}", keys, glob.requests, glob.rows, local_share)
                gates[model or ""] = Gate(f"{t.name}/{model or '*'}", local, spec, glob)
            default = gates.pop("")
            self.accounts[t.name] = Account(t, default, gates)
        self._by_hash = {h: self.accounts[t.name] for h, t in self.directory.by_hash.items()}
        self.limiter = (limiter or GlobalLimiter(clock)) if has_global else None
        self.local_share = local_share

    @classmethod
    def from_settings(cls, settings) -> Admission:
        """The server's admission: open without a tenant file; a Redis limiter only when some
        tenant has a global limit and a Redis URL is set."""
        if settings.api_keys_file is None:
            return cls()
        tenants = load_tenants(settings.api_keys_file)
        classes = settings.classes
        for t in tenants:
            if t.default_class is not None and t.default_class not in classes:
                raise TenantFileError(
                    f"tenant '{t.name}' in {settings.api_keys_file}: default_class '{t.default_class}' is not one "
                    f"of the latency classes {sorted(classes)}"
                )
        share = settings.ratelimit_local_share or 1.0 / settings.ratelimit_expected_replicas
        has_global = any(
            not g.empty for t in tenants for g in (t.global_limits, *(o[1] for o in t.model_limits.values()))
        )
        limiter: GlobalLimiter | None = None
        if has_global and settings.redis_url:
            limiter = RedisLimiter.from_url(
                settings.redis_url,
                timeout_s=settings.ratelimit_redis_timeout_ms / 1e3,
                fail_mode=settings.ratelimit_fail_mode,
                probe_initial_s=settings.ratelimit_probe_initial_ms / 1e3,
                probe_max_s=settings.ratelimit_probe_max_ms / 1e3,
            )
        elif has_global:
            log.warning(
                "global rate limits are configured but no Redis URL: each replica enforces %.3g of them alone",
                share,
            )
        adm = cls(tenants, limiter, local_share=share, redis_prefix=settings.ratelimit_redis_prefix)
        log.info(
            "tenants: %d loaded from %s; global limits %s",
            len(tenants), settings.api_keys_file, adm.limiter.backend if adm.limiter else "none",
        )  # fmt: skip
        return adm

    async def start(self) -> None:
        if self.limiter is not None:
            await self.limiter.start()

    async def close(self) -> None:
        if self.limiter is not None:
            await self.limiter.close()

    # -- the per-call path ---------------------------------------------------------------------

    def identify(self, metadata) -> Account:
        """The caller's account from gRPC metadata, or UNAUTHENTICATED."""
        try:
            tenant = self.directory.identify(metadata)
        except GatewayError:
            self.unauthenticated += 1
            raise
        return self.accounts[tenant.name]

    async def admit(self, account: Account, model: str, rows: int) -> Ticket:
        """A ticket for one request of ``rows`` rows to ``model``, or PERMISSION_DENIED /
        RESOURCE_EXHAUSTED (``Limited``). Release the ticket when the request finishes."""
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
        if gate.max_in_flight is not None and gate.in_flight >= gate.max_in_flight:
            st.limited_in_flight += 1
            raise Limited(
                f"tenant '{account.tenant.name}' has {gate.max_in_flight} requests in flight (its limit)",
                IN_FLIGHT_RETRY_MS / 1e3,
            )
        req, rws = gate.requests, gate.rows
        if req is not None or rws is not None:
            now = self.clock()
            if req is not None and (wait := req.take(1, now)):
                st.limited_requests += 1
                raise Limited(f"tenant '{account.tenant.name}' is over {req.rate_per_s:g} requests/s", wait)
            if rws is not None and rows and (wait := rws.take(rows, now)):
                if req is not None:
                    req.refund(1)
                st.limited_rows += 1
                raise Limited(f"tenant '{account.tenant.name}' is over {rws.rate_per_s:g} rows/s", wait)
        spec = gate.spec
        if spec is not None:
            # The slot is held across the await so the in-flight cap counts requests waiting on
            # Redis too; a cancel while waiting gives everything back.
            gate.in_flight += 1
            try:
                wait = await self.limiter.decide(spec, rows)
            except BaseException:
                gate.in_flight -= 1
                self._refund(gate, rows)
                raise
            if wait:
                gate.in_flight -= 1
                self._refund(gate, rows)
                st.limited_global += 1
                raise Limited(f"tenant '{account.tenant.name}' is over its global limit ({spec.name})", wait)
        else:
            gate.in_flight += 1
        st.admitted += 1
        st.rows_admitted += rows
        return Ticket(account.tenant, gate)

    @staticmethod
    def _refund(gate: Gate, rows: int) -> None:
        if gate.requests is not None:
            gate.requests.refund(1)
        if gate.rows is not None and rows:
            gate.rows.refund(rows)

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
