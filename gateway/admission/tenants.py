"""Tenants: who is calling, what they may call, and their limits; loaded from the tenant file.

A tenant is identified by an API key sent as ``authorization: Bearer <key>`` or ``x-api-key: <key>``.
The file holds only SHA-256 hashes of keys (``batchgate hash-key`` makes them). A fast hash is
enough because keys are random (``batchgate hash-key --generate`` gives 256 bits), not chosen by
people: nobody can search that space, with or without a slow KDF, and a fast hash lets
authentication be one hash of the presented key and one dict lookup per call.

The file (YAML, or JSON which YAML also reads; a Kubernetes secret mounted as a file works the
same) looks like::

    tenants:
      - name: search
        key_hashes: ["sha256:9f86d0…"]
        models: [ranker, encoder]      # or "*"
        default_class: realtime        # latency class when a request names none
        cache_namespace: search        # result-cache namespace (absent: shared)
        admin: false                   # true: may load/unload models (when model_control is on)
        limits:                        # enforced by each replica alone
          requests_per_s: 500
          requests_burst: 1000
          rows_per_s: 50000
          rows_burst: 100000
          max_in_flight: 64
        global_limits:                 # shared by all replicas, through Redis
          requests_per_s: 200
          rows_per_s: 20000
        model_limits:                  # per-model overrides, merged field by field
          encoder:
            global_limits: {requests_per_s: 20}

See docs/tenants.md for the semantics.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from batchgate.gateway.errors import GatewayError, Kind
from batchgate.gateway.admission.ratelimit import Rate

HASH_PREFIX = "sha256:"
_HEX64 = re.compile(r"[0-9a-f]{64}")


class TenantFileError(ValueError):
    """The tenant file cannot be used; the message says where and how to fix it."""


def hash_key(key: str) -> str:
    """The form stored in the tenant file: ``sha256:<hex>``."""
    return HASH_PREFIX + hashlib.sha256(key.encode()).hexdigest()


def generate_key() -> str:
    """A new random API key (256 bits, URL-safe)."""
    return "bg_" + secrets.token_urlsafe(32)


def _digest(stored: str) -> str:
    """``sha256:<hex>`` or bare hex -> lower-case hex; anything else is refused without echoing it
    (it may be a key pasted in clear)."""
    text = stored.strip().lower()
    text = text.removeprefix(HASH_PREFIX)
    if not _HEX64.fullmatch(text):
        raise ValueError(
            "a key hash must be 'sha256:' followed by 64 hex digits (make one with `batchgate hash-key`); "
            "is a key in clear in the file?"
        )
    return text


# -- runtime objects ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Limits:
    """One block of limits; ``None`` = not limited."""

    requests: Rate | None = None
    rows: Rate | None = None
    max_in_flight: int | None = None

    @property
    def empty(self) -> bool:
        return self.requests is None and self.rows is None and self.max_in_flight is None

    def merged(self, over: Limits) -> Limits:
        return Limits(
            requests=over.requests or self.requests,
            rows=over.rows or self.rows,
            max_in_flight=over.max_in_flight if over.max_in_flight is not None else self.max_in_flight,
        )


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    key_hashes: tuple[str, ...] = ()
    models: frozenset[str] | None = None  # None: every model
    default_class: str | None = None
    cache_namespace: str | None = None
    limits: Limits = Limits()  # per replica
    global_limits: Limits = Limits()  # across replicas (max_in_flight is always per replica)
    model_limits: dict[str, tuple[Limits, Limits]] = field(default_factory=dict)  # model -> (local, global)
    admin: bool = False  # may load/unload models when the server's model_control is on

    def allows(self, model: str) -> bool:
        return self.models is None or model in self.models

    def limits_for(self, model: str) -> tuple[Limits, Limits]:
        """(local, global) limits for ``model``: the tenant's, with the model's override merged in."""
        over = self.model_limits.get(model)
        if over is None:
            return self.limits, self.global_limits
        return self.limits.merged(over[0]), self.global_limits.merged(over[1])


ANONYMOUS = Tenant(name="anonymous")


# -- the file's schema ----------------------------------------------------------------------------


class _Limits(BaseModel):
    model_config = ConfigDict(extra="forbid")

    requests_per_s: float | None = Field(None, gt=0, description="requests a second (token refill rate)")
    requests_burst: float | None = Field(
        None, ge=1, description="requests at once; default: one second's worth"
    )
    rows_per_s: float | None = Field(None, gt=0, description="rows (batch dim of the first input) a second")
    rows_burst: float | None = Field(
        None, ge=1, description="rows at once, also the largest request; default: one second's worth"
    )
    max_in_flight: int | None = Field(None, ge=1, description="concurrent requests, per replica")

    @model_validator(mode="after")
    def _bursts_need_rates(self) -> _Limits:
        for what in ("requests", "rows"):
            if getattr(self, f"{what}_burst") is not None and getattr(self, f"{what}_per_s") is None:
                raise ValueError(f"{what}_burst needs {what}_per_s")
        return self

    def build(self) -> Limits:
        def rate(per_s: float | None, burst: float | None) -> Rate | None:
            if per_s is None:
                return None
            return Rate(per_s, burst if burst is not None else max(per_s, 1.0))

        return Limits(
            rate(self.requests_per_s, self.requests_burst),
            rate(self.rows_per_s, self.rows_burst),
            self.max_in_flight,
        )


class _GlobalLimits(_Limits):
    @model_validator(mode="after")
    def _no_global_concurrency(self) -> _GlobalLimits:
        if self.max_in_flight is not None:
            raise ValueError("max_in_flight is per replica: put it under `limits`, not `global_limits`")
        return self


class _Override(BaseModel):
    model_config = ConfigDict(extra="forbid")

    limits: _Limits = _Limits()
    global_limits: _GlobalLimits = _GlobalLimits()


class _Tenant(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    key_hashes: list[str] = Field(min_length=1)
    models: list[str] | Literal["*"] = "*"
    default_class: str | None = None
    cache_namespace: str | None = Field(None, min_length=1)
    limits: _Limits = _Limits()
    global_limits: _GlobalLimits = _GlobalLimits()
    model_limits: dict[str, _Override] = {}
    admin: bool = Field(
        False, description="may load/unload models (only when the server's model_control is on)"
    )

    @field_validator("key_hashes")
    @classmethod
    def _hashes(cls, v: list[str]) -> list[str]:
        return [_digest(h) for h in v]

    @model_validator(mode="after")
    def _overrides_for_allowed_models(self) -> _Tenant:
        if self.models != "*":
            stray = sorted(set(self.model_limits) - set(self.models))
            if stray:
                raise ValueError(
                    f"model_limits names models the tenant may not call: {stray}; add them to `models`"
                )
        return self

    def build(self) -> Tenant:
        return Tenant(
            name=self.name,
            key_hashes=tuple(self.key_hashes),
            models=None if self.models == "*" else frozenset(self.models),
            default_class=self.default_class,
            cache_namespace=self.cache_namespace,
            limits=self.limits.build(),
            global_limits=self.global_limits.build(),
            model_limits={
                m: (o.limits.build(), o.global_limits.build()) for m, o in self.model_limits.items()
            },
            admin=self.admin,
        )


class _File(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenants: list[_Tenant] = Field(min_length=1)


def parse_tenants(data: object, source: str = "tenant file") -> list[Tenant]:
    try:
        parsed = _File.model_validate(data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors(include_input=False, include_url=False):
            where = ".".join(str(p) for p in err["loc"])
            lines.append(f"  {where}: {err['msg']}")
        raise TenantFileError(f"{source}: invalid:\n" + "\n".join(lines)) from None
    tenants = [t.build() for t in parsed.tenants]
    seen_names: set[str] = set()
    owner: dict[str, str] = {}
    for t in tenants:
        if t.name in seen_names:
            raise TenantFileError(f"{source}: tenant '{t.name}' is defined twice")
        seen_names.add(t.name)
        for h in t.key_hashes:
            if h in owner:
                raise TenantFileError(
                    f"{source}: one key hash (sha256:{h[:8]}…) belongs to both '{owner[h]}' and '{t.name}'"
                )
            owner[h] = t.name
    return tenants


def load_tenants(path: Path) -> list[Tenant]:
    """Read the tenant file: JSON when it ends in ``.json``, else YAML."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise TenantFileError(f"cannot read tenant file {path}: {exc.strerror or exc}") from None
    try:
        if str(path).endswith(".json"):
            data = json.loads(text)
        else:
            try:
                import yaml  # JSON is YAML, so a .yaml loader reads both
            except ImportError:
                raise TenantFileError(
                    f"tenant file {path}: reading YAML needs PyYAML (pip install pyyaml), or name the file .json"
                ) from None
            data = yaml.safe_load(text)
    except TenantFileError:
        raise
    except ValueError as exc:  # json.JSONDecodeError is a ValueError
        raise TenantFileError(f"tenant file {path}: not valid JSON: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - yaml.YAMLError, without importing yaml where not needed
        raise TenantFileError(f"tenant file {path}: not valid YAML: {exc}") from None
    return parse_tenants(data, source=f"tenant file {path}")


# -- authentication -------------------------------------------------------------------------------

MISSING_KEY = "missing API key: send metadata 'authorization: Bearer <key>' or 'x-api-key: <key>'"
INVALID_KEY = "invalid API key"


def presented_key(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The API key in gRPC metadata (keys arrive lower-cased), or None."""
    for key, value in metadata or ():
        if key == "x-api-key":
            return value.strip() if isinstance(value, str) else None
        if key == "authorization" and isinstance(value, str):
            scheme, _, token = value.strip().partition(" ")
            if scheme.lower() == "bearer":
                return token.strip() or None
    return None


class Directory:
    """Key hash -> tenant; ``identify`` is one SHA-256 and one dict lookup."""

    def __init__(self, tenants: Iterable[Tenant]) -> None:
        self.tenants = {t.name: t for t in tenants}
        self.by_hash = {h: t for t in self.tenants.values() for h in t.key_hashes}

    def identify(self, metadata) -> Tenant:
        key = presented_key(metadata)
        if key is None:
            raise GatewayError(Kind.UNAUTHENTICATED, MISSING_KEY)
        tenant = self.by_hash.get(hashlib.sha256(key.encode()).hexdigest())
        if tenant is None:
            raise GatewayError(Kind.UNAUTHENTICATED, INVALID_KEY)
        return tenant
