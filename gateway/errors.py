"""A small domain error vocabulary: one refusal type (``GatewayError``: a kind, a message fit for
the caller, and the request field it concerns), which each wire maps to its own error shape in
one table (gRPC, KServe REST, OpenAI, TEI)."""

from __future__ import annotations

import enum
import math


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
    TOO_LARGE = "too_large"  # more than a limit takes: a body, a list of texts, a text's bytes or tokens
    SLOW = "slow"  # the request body did not arrive within its deadline


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
    """A refusal that reaches the client with its wire's status for ``kind`` and this message;
    ``field``: the request field it concerns (OpenAI's ``param``), when one does."""

    def __init__(
        self, kind: Kind, message: str, outcome: str | None = None, retry_after_s: float | None = None,
        field: str | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.field = field
        self.outcome = outcome  # finer label for metrics than the kind (e.g. "shed" vs "expired")
        # A refusal's retry hint (the queue's drain time): sent as the gRPC trailer
        # grpc-retry-pushback-ms (what gRPC's own retry policy honours) and retry-after-ms, which
        # the HTTP side also turns into Retry-After.
        self.retry_after_s = retry_after_s
        if retry_after_s is not None:
            ms = str(max(1, round(retry_after_s * 1000)))
            self.trailing_metadata = (("grpc-retry-pushback-ms", ms), ("retry-after-ms", ms))


def invalid(message: str, field: str | None = None) -> GatewayError:
    return GatewayError(Kind.INVALID, message, field=field)


def too_large(message: str, field: str | None = None) -> GatewayError:
    """Over a size limit: counted as the client's mistake (outcome ``invalid``), answered as its
    wire answers a request too large (TEI and a body: 413; gRPC: INVALID_ARGUMENT)."""
    return GatewayError(Kind.TOO_LARGE, message, outcome="invalid", field=field)


def not_found(message: str) -> GatewayError:
    return GatewayError(Kind.NOT_FOUND, message)


def unavailable(message: str, retry_after_s: float | None = None) -> GatewayError:
    return GatewayError(Kind.UNAVAILABLE, message, retry_after_s=retry_after_s)


# Triton's wording for a request to a model or version it does not serve (triton core,
# model_repository_manager.cc + model_lifecycle.cc: "Request for unknown model: 'm' is not found",
# "... 'm' version 7 is not found", code NOT_FOUND -> gRPC NOT_FOUND / HTTP 404). Triton's own example
# clients and tools match on its start, so ours comes after it. The caller's strings are clipped, and
# the models served are not listed: a caller may not be allowed to see them.


def unknown_model(name: str) -> GatewayError:
    n = clip(name)
    return not_found(
        f"Request for unknown model: '{n}' is not found (unknown model '{n}'; "
        "RepositoryIndex or POST /v2/repository/index lists the models served)"
    )


def unknown_version(name: str, version: str, served: list[str] | None = None) -> GatewayError:
    n, v = clip(name), clip(version, 32)
    versions = f"; served versions: {served}" if served is not None else ""
    return not_found(
        f"Request for unknown model: '{n}' version {v} is not found "
        f"(model '{n}' has no version '{v}'{versions})"
    )


def parse_version(version: str) -> str:
    """A requested model version as the repository names it ("" = latest). Refuses what is not a
    whole number >= 0 with Triton's wording (its GetModelVersionFromString), INVALID_ARGUMENT."""
    text = version.strip()
    if not text:
        return ""
    try:
        n = int(text, 10)
    except ValueError:
        raise invalid(
            f"failed to get model version from specified version string '{clip(version, 32)}' "
            "(details: not an integer), version should be an integral value > 0"
        ) from None
    if n < 0:
        raise invalid(
            f"invalid model version specified '{clip(version, 32)}' , version should be an integral value > 0"
        )
    return str(n)


def retry_headers(exc: Exception, base: dict) -> dict:
    """HTTP headers of a refusal: ``base``, its trailers (a rate limit's or a queue's
    ``retry-after-ms``), and that hint again as the standard ``Retry-After`` in whole seconds."""
    headers = dict(base)
    for key, value in getattr(exc, "trailing_metadata", ()):
        if isinstance(value, str):
            headers[key] = value
    ms = headers.get("retry-after-ms")
    if ms is not None:
        try:
            headers["Retry-After"] = str(max(1, math.ceil(float(ms) / 1000)))
        except ValueError:
            pass
    return headers


class Limited(GatewayError):
    """RESOURCE_EXHAUSTED, with ``retry-after-ms`` in the trailing metadata."""

    def __init__(self, message: str, retry_after_s: float, cause: str = "", headers: tuple = ()) -> None:
        self.retry_after_ms = max(1, math.ceil(retry_after_s * 1e3 - 1e-6))  # no extra ms for float dust
        super().__init__(Kind.EXHAUSTED, f"{message}; retry after {self.retry_after_ms} ms")
        ms = str(self.retry_after_ms)
        # grpc-retry-pushback-ms: what gRPC's own retry policy honours
        self.trailing_metadata = (("retry-after-ms", ms), ("grpc-retry-pushback-ms", ms), *headers)
        self.cause = cause  # which limit refused (usage metering's refusal label)
