"""Admission: who is calling, whether the server takes the call now, and the tenant's limits.

door.py       the one door every transport goes through (identity, the overload gate, the gRPC
              call cap, stream slots)
gate.py       the overload gate
limits.py     tenants' limits (rates, in-flight caps, the global limiter)
ratelimit.py  the rate limiters (GCRA buckets, local and in Redis)
tenants.py    the tenant file: keys, models, limits
"""

from batchgate.gateway.admission.limits import (  # noqa: F401
    IN_FLIGHT_RETRY_MS,
    OPEN_TICKET,
    Account,
    Admission,
    Limited,
    Ticket,
)
