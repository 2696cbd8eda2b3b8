"""A small domain error vocabulary; the transports map it to status codes in one table each."""

from __future__ import annotations

import enum


class Kind(enum.Enum):
    INVALID = "invalid"  # the client's request is malformed
    NOT_FOUND = "not_found"  # unknown model or version
    UNAVAILABLE = "unavailable"  # queue full, draining, model not ready
    EXHAUSTED = "exhausted"  # rate limited
    DEADLINE = "deadline"  # budget cannot be met
    UNAUTHENTICATED = "unauthenticated"
    PERMISSION = "permission"
    UNSUPPORTED = "unsupported"  # a feature batchgate does not offer
    FAILED = "failed"  # the model failed to execute (not the client's fault)


class GatewayError(Exception):
    """An error that reaches the client with a status code and this message."""

    def __init__(
        self, kind: Kind, message: str, outcome: str | None = None, retry_after_s: float | None = None
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.outcome = outcome  # finer label for metrics than the kind (e.g. "shed" vs "expired")
        # A refusal's retry hint (the queue's drain time): sent as the gRPC trailer
        # grpc-retry-pushback-ms (what gRPC's own retry policy honours) and retry-after-ms, which
        # the HTTP side also turns into Retry-After.
        self.retry_after_s = retry_after_s
        if retry_after_s is not None:
            ms = str(max(1, round(retry_after_s * 1000)))
            self.trailing_metadata = (("grpc-retry-pushback-ms", ms), ("retry-after-ms", ms))


def invalid(message: str) -> GatewayError:
    return GatewayError(Kind.INVALID, message)


def not_found(message: str) -> GatewayError:
    return GatewayError(Kind.NOT_FOUND, message)


def unavailable(message: str, retry_after_s: float | None = None) -> GatewayError:
    return GatewayError(Kind.UNAVAILABLE, message, retry_after_s=retry_after_s)
