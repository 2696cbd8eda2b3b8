"""Token budgets: a tenant's ``tokens_per_minute`` / ``tokens_burst``, charged as its answers'
``usage`` counts tokens, and OpenAI's rate-limit headers that say where a caller stands.

The exact count of a call's tokens is known only once its texts are tokenised, in a thread after
admission; a refusal must come before that work. So admission charges the text stage's estimate
(``estimate``: a few microseconds a text, on the loop, a text capped at what the model keeps),
refuses when the estimate does not fit, and ``settle`` charges the difference to the exact count
when the answer is made: the buckets track what ``usage`` reports, and an estimate's error shifts
when a later call waits, never what is billed. A call whose estimate exceeds the whole budget (its
burst) could never be admitted: it is refused as too large (INVALID_ARGUMENT, so no client
retries it), not as rate limited.

Headers (OpenAI's names; ``limit`` is the bucket's size, ``remaining`` what it holds now, ``reset``
the time until it is full again, as OpenAI writes durations: ``1s``, ``6m0s``, ``250ms``):
``x-ratelimit-{limit,remaining,reset}-{requests,tokens}``, for the tighter of the tenant's local
and global buckets; a global bucket's state is Redis's last answer to this replica.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from batchgate.gateway.errors import GatewayError, Kind, Limited
from batchgate.gateway.text import estimate_tokens

if TYPE_CHECKING:
    from batchgate.gateway.admission.limits import Account, Quota, Ticket
    from batchgate.gateway.admission.ratelimit import Bucket, GlobalSpec


def estimate(stage, texts: list[bytes]) -> int:
    """The token count admission charges for ``texts`` on a text model's ``stage`` (before
    tokenising): each text's estimate, capped at the model's ``max_tokens`` (a truncated text
    counts what the model sees)."""
    cap, specials = stage.settings.max_tokens, stage.specials
    return sum(min(estimate_tokens(b, specials), cap) for b in texts)


def settle(ticket: Ticket, tokens: int, now: float) -> None:
    """Charge the difference between the exact ``tokens`` and what admission charged."""
    delta = tokens - ticket.charged
    quota = ticket.quota
    if not delta or quota is None:
        return
    ticket.charged = tokens
    if quota.tokens is not None:
        quota.tokens.settle(delta, now)
    spec = quota.spec
    if spec is not None and spec.tokens is not None and ticket.limiter is not None:
        ticket.limiter.settle(spec, delta)


def too_large(tenant: str, model: str, tokens: int, most: int) -> GatewayError:
    return GatewayError(
        Kind.INVALID,
        f"request is about {tokens} tokens but tenant '{tenant}' may send at most {most} tokens per "
        f"request to model '{model}' (its tokens burst); split it",
    )


def limited(tenant: str, quota: Quota, wait_s: float, now: float) -> Limited:
    rate = quota.tokens.rate_per_s * 60
    return Limited(f"tenant '{tenant}' is over {rate:g} tokens/min", wait_s, "tokens", headers(quota, now))


# -- where a tenant stands: OpenAI's headers --------------------------------------------------------


def duration(seconds: float) -> str:
    """OpenAI's form of a reset time: ``250ms``, ``1.5s``, ``6m0s``."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    if seconds < 60:
        return f"{math.ceil(seconds * 10) / 10:g}s"
    minutes, rest = divmod(math.ceil(seconds), 60)
    return f"{minutes}m{rest}s"


def _local(bucket: Bucket, now: float) -> tuple[float, float, float]:
    ahead = max(bucket.tat - now, 0.0)
    return bucket.burst, bucket.tokens(now), ahead


def _global(spec: GlobalSpec, which: int, now: float) -> tuple[float, float, float] | None:
    """(limit, remaining, reset) of the spec's ``which``-th key as Redis last answered, aged to now;
    its local share while Redis has not answered here."""
    rate = (spec.requests, spec.rows, spec.tokens)[which]
    at, aheads = spec.ahead
    if not aheads:
        share = (spec.share_requests, spec.share_rows, spec.share_tokens)[which]
        return _local(share, now) if share is not None else None
    index = sum(r is not None for r in (spec.requests, spec.rows, spec.tokens)[:which])
    ahead = max(aheads[index] - (now - at), 0.0)
    return rate.burst, rate.burst - ahead * rate.per_s, ahead


def _tightest(states) -> tuple[float, float, float] | None:
    states = [s for s in states if s is not None]
    return min(states, key=lambda s: s[1]) if states else None


def headers(quota: Quota, now: float) -> tuple[tuple[str, str], ...]:
    """OpenAI's rate-limit headers for the buckets ``quota`` holds (none for what is not limited)."""
    spec = quota.spec
    out: list[tuple[str, str]] = []
    for what, local, which in (("requests", quota.requests, 0), ("tokens", quota.tokens, 2)):
        glob = None
        if spec is not None and (spec.requests, spec.rows, spec.tokens)[which] is not None:
            glob = _global(spec, which, now)
        state = _tightest((_local(local, now) if local is not None else None, glob))
        if state is None:
            continue
        limit, remaining, reset = state
        out += (
            (f"x-ratelimit-limit-{what}", str(int(limit))),
            (f"x-ratelimit-remaining-{what}", str(max(0, math.floor(remaining)))),
            (f"x-ratelimit-reset-{what}", duration(reset)),
        )
    return tuple(out)


# -- reload: new limits, what was used stays used --------------------------------------------------


def _carry(old: Bucket | None, new: Bucket | None, now: float) -> None:
    if old is None or new is None:
        return
    used = old.burst - old.tokens(now)  # in debt: more than the burst
    if used > 0:
        new.tat = now + used * new.interval_s


def carry_over(old: Account, new: Account, now: float) -> None:
    """``new`` (the tenant's entry changed in the tenant file) starts from what ``old`` used:
    each bucket holds what the old one used (in tokens, rows, requests), and the counters go on."""
    new.stats = old.stats
    for model, quota in ((None, new.default), *new.gates.items()):
        before = old.default if model is None else old.gates.get(model, old.default)
        for name in ("requests", "rows", "tokens"):
            _carry(getattr(before, name), getattr(quota, name), now)
        if quota.spec is not None and before.spec is not None:
            for name in ("share_requests", "share_rows", "share_tokens"):
                _carry(getattr(before.spec, name), getattr(quota.spec, name), now)
            quota.spec.ahead = before.spec.ahead
