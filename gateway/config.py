"""Server settings: typed, bounded, and settable from flags or ``BATCHGATE_*`` environment variables
(so Kubernetes can set anything through env). Flags win over env, env over defaults."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="BATCHGATE_", extra="forbid")

    model_repository: Path = Field(Path("model_repository"), description="Triton-layout model repository")
    build_bundled_models: bool = Field(
        True, description="build the bundled models (ranker, encoder) into the repository when missing"
    )
    host: str = Field("0.0.0.0", description="address to listen on (gRPC and HTTP)")
    grpc_port: int = Field(8001, ge=0, le=65535, description="gRPC port; 0 picks a free one")
    http_port: int = Field(8000, ge=0, le=65535, description="HTTP port (health, metrics); 0 picks a free one")
    workers_per_device: int | None = Field(
        None, ge=1, description="workers per device for every model; default: instance_group count"
    )
    intra_op_threads: int = Field(1, ge=1, description="ONNX Runtime intra-op threads per worker")
    inter_op_threads: int = Field(1, ge=1, description="ONNX Runtime inter-op threads per worker")
    device: Literal["auto", "cpu", "gpu"] = Field(
        "auto", description="auto: follow instance_group kind (GPU when usable); cpu: force CPU"
    )
    default_max_batch_size: int = Field(
        64, ge=0, description="max_batch_size given to models whose config.pbtxt is missing"
    )
    max_message_bytes: int = Field(
        64 * 1024 * 1024, ge=1024, description="largest gRPC message accepted or sent, in bytes"
    )
    strict_readiness: bool = Field(
        False, description="ServerReady only when every model loaded (Triton's default); else when loading ended"
    )
    drain_timeout_s: float = Field(30.0, ge=0, description="on SIGTERM, how long queued work may take to finish")
    drain_linger_s: float = Field(
        2.0, ge=0, description="after the drain, keep answering UNAVAILABLE until callers go quiet, this long at most"
    )
    reuse_port: bool = Field(True, description="SO_REUSEPORT, so several gateway processes can share the port")
    log_level: str = Field("INFO", description="logging level")

    # -- shared state (result cache tier 2, global rate limits) --------------------------------
    redis_url: str | None = Field(
        None, description="Redis URL (redis:// or rediss://, with user:password@ when needed); turns on the "
        "shared result cache and global rate limits"
    )
    # -- tenants ---------------------------------------------------------------------------------
    api_keys_file: Path | None = Field(
        None, description="tenant file (API-key hashes, allowed models, limits); none = open server"
    )

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if self.grpc_port and self.grpc_port == self.http_port:
            raise ValueError(f"grpc_port and http_port are both {self.grpc_port}; give them different ports")
        return self
