"""``batchgate.client``: a small sync + asyncio gRPC client (embed, score, infer) with retries of
UNAVAILABLE and round robin over a headless Service's addresses. See client/client.py."""

from batchgate.client.client import (
    AsyncClient,
    BatchgateError,
    Client,
    DeadlineExceeded,
    InvalidInput,
    ModelNotFound,
    PermissionDenied,
    RateLimited,
    ServerError,
    Unauthenticated,
    Unavailable,
    service_config,
    target_of,
)

__all__ = [
    "AsyncClient",
    "BatchgateError",
    "Client",
    "DeadlineExceeded",
    "InvalidInput",
    "ModelNotFound",
    "PermissionDenied",
    "RateLimited",
    "ServerError",
    "Unauthenticated",
    "Unavailable",
    "service_config",
    "target_of",
]
