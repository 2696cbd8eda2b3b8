"""The door: the one place a call is taken or refused before its body is read, for every
transport. It owns who is calling (the API key), the overload gate (every transport's arrivals
and ends are counted here), stream slots, and the tenant's limits once the call's rows are known.

    pass_ = door.enter(metadata, time_left)     identity, then the gate: UNAUTHENTICATED, UNAVAILABLE
    ...read the body...
    ticket = await door.admit(pass_, model, rows)  the tenant's limits: PERMISSION_DENIED, RESOURCE_EXHAUSTED
    ...compute...
    ticket.release(); door.leave(exc)             in a finally: the gate counts how the call ended

gRPC's call takers (gateway/transport/takers.py) ask the gate for the calls they take, before any
handler runs, through ``take``; ``ASKED`` marks those calls so that ``enter`` does not ask twice.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass

from batchgate.gateway import tracing
from batchgate.gateway.admission.gate import OverloadGate, _wasted, bucket
from batchgate.gateway.admission.limits import OPEN_TICKET, Account, Admission, Ticket
from batchgate.gateway.errors import GatewayError, Kind

ASKED: ContextVar[bool] = ContextVar("batchgate_asked", default=False)  # a call taker asked the gate


@dataclass(slots=True)
class Pass:
    """A call the door took: who is calling (None on an open server) and the time it had left
    when it came in (a gRPC deadline; None when the caller set none)."""

    caller: Account | None = None
    time_left: float | None = None
    trace: object | None = None  # the caller's trace context while tracing is on (gateway/tracing.py)
    ended: bool = False  # set by Door.leave: a route that ends its pass on every path can tell
    limits: tuple = ()  # the tenant's rate-limit headers once admitted (OpenAI's x-ratelimit-*)


class Door:
    def __init__(self, admission: Admission, gate: OverloadGate, streams: StreamSlots) -> None:
        self.admission = admission
        self.gate = gate
        self.streams = streams

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
        """Identity (unless ``caller`` is known already), then the gate (unless a call taker asked
        it for this call). Raises ``GatewayError``."""
        if caller is None:
            caller = self.identify(metadata)
        if not ASKED.get():
            self.gate.check(time_left)
        if tracing.TRACER is not None:
            return Pass(caller, time_left, tracing.extract(metadata))
        return Pass(caller, time_left)

    # -- for a caller that answers a refusal itself (the call takers, in core) ---------------------

    @property
    def shedding(self) -> bool:
        return self.gate.shedding

    def take(self, time_left: float | None) -> bool:
        return self.gate.take(time_left)

    def message(self) -> str:
        return self.gate.message()

    def trailing(self) -> tuple:
        return self.gate.trailing()

    async def admit(self, pass_: Pass, model: str, rows: int, tokens: int = 0) -> Ticket:
        """The tenant's limits for ``rows`` rows of ``model`` (an open server: nothing to check)."""
        if pass_.caller is None:
            return OPEN_TICKET
        return await self.admission.admit(pass_.caller, model, rows, tokens)

    def leave(self, exc: BaseException | None = None, pass_: Pass | None = None) -> None:
        """A call the door took as ``pass_`` has ended (``exc``: how it failed, if it did)."""
        gate = self.gate
        gate.ended += 1
        wasted = exc is not None and _wasted(exc)
        if wasted:
            gate.dropped += 1
        if pass_ is not None:
            pass_.ended = True
            counts = gate.outcomes[bucket(pass_.time_left)]
            counts[0] += 1
            if not wasted:
                counts[1] += 1


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
