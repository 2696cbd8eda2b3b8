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
    PRECONDITION = "failed_precondition"  # the repository's files must be fixed first (a failed load)
    FAILED = "failed"  # the model failed to execute (not the client's fault)


# Client text echoed in an error (a model name, an input name, a parameter) is cut to this many
# characters: a 1 MiB name must not come back as a 1 MiB status message.
ECHO_MAX = 128


def clip(text: object, limit: int = ECHO_MAX) -> str:
    """``text`` for an error message: at most ``limit`` characters, an ellipsis and the full length
    when cut (so the client can tell its string was longer)."""
    s = text if isinstance(text, str) else str(text)
    if len(s) <= limit:
        return s
    return f"{s[:limit]}… ({len(s)} characters)"


class GatewayError(Exception):
    """An error that reaches the client with a status code and this message."""

    def __init__(self, kind: Kind, message: str, outcome: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.outcome = outcome  # finer label for metrics than the kind (e.g. "shed" vs "expired")


def invalid(message: str) -> GatewayError:
    return GatewayError(Kind.INVALID, message)


def not_found(message: str) -> GatewayError:
    return GatewayError(Kind.NOT_FOUND, message)


def unavailable(message: str) -> GatewayError:
    return GatewayError(Kind.UNAVAILABLE, message)
