"""The door: the one place a call is taken or refused before its body is read, for every
transport. It owns who is calling (the API key), the overload shedder (every transport's arrivals
and ends are counted there), the cap on gRPC calls in progress (``CallCap``: gRPC's call takers
count and refuse there, before any handler), stream slots, and the tenant's limits once the
call's rows are known.
Every transport enters and leaves it the same way:

    with door.enter(metadata, time_left) as pass_:     identity, then the shedder: UNAUTHENTICATED, UNAVAILABLE
        ...read the body...
        ticket = await door.admit(pass_, model, rows)   the tenant's limits: PERMISSION_DENIED, RESOURCE_EXHAUSTED
        ...compute...; ticket.release()
                                                        the exit leaves once: the shedder counts how the call ended

What a gRPC call has learned about its pass before its handler runs (a call taker asked the
shedder for it; the auth interceptor identified the caller) travels in one contextvar, ``PRIOR``.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass

from batchgate.gateway import tracing
from batchgate.gateway.admission.gate import LoadShedder, bucket, wasted
from batchgate.gateway.admission.limits import OPEN_TICKET, Account, Admission, Ticket
from batchgate.gateway.errors import GatewayError, Kind


@dataclass(frozen=True, slots=True)
class Prior:
    """A gRPC call's pass as far as it is known before the handler: the shedder asked (by a call
    taker), the caller identified (by the auth interceptor; None: not yet, or an open server)."""

    asked: bool = False
    caller: Account | None = None


NONE_PRIOR = Prior()
ASKED = Prior(asked=True)
PRIOR: ContextVar[Prior] = ContextVar("batchgate_prior", default=NONE_PRIOR)


@dataclass(slots=True)
class Pass:
    """A call the door took: who is calling (None on an open server) and the time it had left
    when it came in (a gRPC deadline; None when the caller set none). A context manager: its exit
    leaves the door once, however the call ended (nested exits are no-ops)."""

    door: Door | None = None
    caller: Account | None = None
    time_left: float | None = None
    trace: object | None = None  # the caller's trace context while tracing is on (gateway/tracing.py)
    ended: bool = False  # set by Door.leave
    limits: tuple = ()  # the tenant's rate-limit headers once admitted (OpenAI's x-ratelimit-*)

    def __enter__(self) -> Pass:
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if not self.ended:
            self.door.leave(exc, self)


class Door:
    def __init__(
        self, admission: Admission, shedder: LoadShedder, streams: StreamSlots, calls: CallCap | None = None
    ) -> None:
        self.admission = admission
        self.shedder = shedder
        self.streams = streams
        self.calls = calls  # the gRPC call cap, counted by the call takers before the door is entered

    @property
    def open(self) -> bool:
        return self.admission.open

    def identify(self, metadata) -> Account | None:
        """The caller's account from (lower-case) metadata/headers; None on an open server.
        UNAUTHENTICATED when the key is missing or wrong. One SHA-256 and a dict lookup."""
        if self.admission.open:
            return None
        return self.admission.identify(metadata)

    def enter(self, metadata, time_left: float | None = None, caller: Account | None = None) -> Pass:
        """Identity (unless ``caller`` or ``PRIOR`` knows it already), then the shedder (unless a
        call taker asked it for this call). Raises ``GatewayError``."""
        prior = PRIOR.get()
        if caller is None:
            caller = prior.caller if prior.caller is not None else self.identify(metadata)
        if not prior.asked:
            self.shedder.check(time_left)
        if tracing.TRACER is not None:
            return Pass(self, caller, time_left, tracing.extract(metadata))
        return Pass(self, caller, time_left)

    async def admit(self, pass_: Pass, model: str, rows: int, tokens: int = 0) -> Ticket:
        """The tenant's limits for ``rows`` rows of ``model``, ``tokens`` its estimated token count
        (0: no token budget binds the call); an open server: nothing to check."""
        if pass_.caller is None:
            return OPEN_TICKET
        return await self.admission.admit(pass_.caller, model, rows, tokens)

    def leave(self, exc: BaseException | None = None, pass_: Pass | None = None) -> None:
        """A call the door took as ``pass_`` has ended (``exc``: how it failed, if it did)."""
        shedder = self.shedder
        shedder.ended += 1
        dropped = exc is not None and wasted(exc)
        if dropped:
            shedder.dropped += 1
        if pass_ is not None:
            pass_.ended = True
            counts = shedder.outcomes[bucket(pass_.time_left)]
            counts[0] += 1
            if not dropped:
                counts[1] += 1


class CallCap:
    """gRPC calls in progress (a stream counts as one), every loop that takes them together,
    capped at ``limit`` (max_concurrent_rpcs): one past it is refused RESOURCE_EXHAUSTED before any
    handler runs. gRPC's call takers count the calls they take and, through their interceptor,
    the ones grpc.aio's own loop takes (gateway/transport/takers.py); grpc.aio's own cap knows
    only the latter."""

    __slots__ = ("limit", "in_progress")

    DETAILS = "Concurrent RPC limit exceeded!"  # grpc.aio's own words for its cap

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_progress = 0


class StreamSlots:
    """Open ModelStreamInfer calls per tenant and per client connection (gRPC's peer string names
    the connection), each capped; a slot is taken when a stream opens and given back when it ends."""

    def __init__(self, per_tenant: int, per_connection: int) -> None:
        self.per_tenant = per_tenant
        self.per_connection = per_connection
        self.tenants: dict[str, int] = {}
        self.connections: dict[str, int] = {}

    def take(self, tenant: str, peer: str) -> None:
        if self.tenants.get(tenant, 0) >= self.per_tenant:
            who = f"tenant '{tenant}'" if tenant else "this server"
            raise GatewayError(
                Kind.EXHAUSTED, f"{who} has {self.per_tenant} streams open (max_streams_per_tenant)"
            )
        if self.connections.get(peer, 0) >= self.per_connection:
            raise GatewayError(
                Kind.EXHAUSTED,
                f"this connection has {self.per_connection} streams open (max_streams_per_connection)",
            )
        self.tenants[tenant] = self.tenants.get(tenant, 0) + 1
        self.connections[peer] = self.connections.get(peer, 0) + 1

    def give(self, tenant: str, peer: str) -> None:
        for d, k in ((self.tenants, tenant), (self.connections, peer)):
            n = d.get(k, 0) - 1
            if n > 0:
                d[k] = n
            else:
                d.pop(k, None)  # nothing kept for a connection or tenant with no stream
