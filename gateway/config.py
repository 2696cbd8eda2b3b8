"""Server settings: typed, bounded, and settable from flags or ``BATCHGATE_*`` environment variables
(so Kubernetes can set anything through env). Flags win over env, env over defaults.

The fields are declared by concern, one class each (``Serving``, ``FrontDoor``, ``Engines``,
``Selection``, ``Text``, ``Admission``, ``Scheduling``, ``SharedState``, ``Cache``,
``Observability``), each with its checks, and ``Settings`` inherits them all. Mixins, not nested models (``settings.cache.ttl_s``): every name stays what it was — the
attribute (``settings.cache_ttl_s``), the environment variable (``BATCHGATE_CACHE_TTL_S``, no
nesting delimiter), the flag (``--cache-ttl-s``, one per field of ``Settings.model_fields``), the
Helm and Compose keys — so no caller, deployment or script changes, while a reader finds a
concern's settings, bounds and checks in one place. A check may read another concern's field
(``Cache``'s tiers need ``SharedState``'s URL): it runs on the combined object, and pydantic runs the
concerns' checks in the order they are declared here, so the URL read from its file is in place."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal, Self

from pydantic import BaseModel, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from batchgate.gateway.scheduling.request import DEFAULT_CLASSES, LatencyClass, parse_classes

_ORIGIN = re.compile(r"[a-z][a-z0-9+.\-]*://[^/\s,]+")


def cors_origins(value: str | None) -> tuple[str, ...]:
    """The origins of setting ``cors_allowed_origins``, in order (none when unset)."""
    return tuple(o.strip().rstrip("/") for o in (value or "").split(",") if o.strip())


class Serving(BaseModel):
    """Where the server listens, what it serves, how it starts and stops (TLS: docs/security.md)."""

    model_repository: Path = Field(Path("model_repository"), description="Triton-layout model repository")
    build_bundled_models: bool = Field(
        True, description="build the bundled models (ranker, encoder) into the repository when missing"
    )
    host: str = Field("0.0.0.0", description="address to listen on (gRPC and HTTP)")
    grpc_port: int = Field(8001, ge=0, le=65535, description="gRPC port; 0 picks a free one")
    http_port: int = Field(
        8000, ge=0, le=65535, description="HTTP port (health, metrics); 0 picks a free one"
    )
    metrics_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="plaintext HTTP port for /metrics and /v2/health/live, /v2/health/ready "
        "only (Triton's --metrics-port), so scrapers and probes need no certificate when TLS is on; unset = none, "
        "0 picks a free one",
    )
    health_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="plaintext gRPC port serving grpc.health.v1 only (Kubernetes' native "
        "gRPC probes, which speak no TLS); unset = none, 0 picks a free one",
    )
    strict_readiness: bool = Field(
        False,
        description="ServerReady only when every model loaded (Triton's default); else when loading ended",
    )
    drain_timeout_s: float = Field(
        30.0, ge=0, description="on SIGTERM, how long queued work may take to finish"
    )
    drain_linger_s: float = Field(
        2.0,
        ge=0,
        description="after the drain, keep answering UNAVAILABLE until callers go quiet, this long at most",
    )
    max_connection_age_s: float = Field(
        300.0,
        ge=0,
        description="close client connections after this long (gracefully) so clients re-resolve "
        "and spread over new replicas; 0 = never",
    )
    reuse_port: bool = Field(
        False,
        description="SO_REUSEPORT, so several gateway processes can share the ports; off: a second "
        "server on a busy port exits with 'address in use'",
    )
    model_control: bool = Field(
        False,
        description="allow load/unload (gRPC RepositoryModelLoad/Unload, REST /v2/repository/models/"
        "{m}/load|unload); with a tenant file only tenants marked admin may use it",
    )
    tls_cert_file: Path | None = Field(
        None,
        description="PEM server certificate (chain) for gRPC and HTTP; set with tls_key_file to serve "
        "TLS only (plaintext refused); re-read when the file changes",
    )
    tls_key_file: Path | None = Field(None, description="PEM private key (unencrypted) of tls_cert_file")
    tls_client_ca_file: Path | None = Field(
        None, description="PEM CA bundle: require client certificates signed by it (mutual TLS)"
    )

    @model_validator(mode="after")
    def _check_tls(self) -> Self:
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError(
                "tls_cert_file and tls_key_file go together: set both (TLS) or neither (plaintext)"
            )
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ValueError("tls_client_ca_file (mutual TLS) needs tls_cert_file and tls_key_file too")
        return self

    @model_validator(mode="after")
    def _check_ports(self) -> Self:
        ports = [(n, getattr(self, n)) for n in ("grpc_port", "http_port", "metrics_port", "health_port")]
        for i, (a, pa) in enumerate(ports):
            for b, pb in ports[i + 1 :]:
                if pa and pa == pb:  # 0 (a free port each) and None (off) never clash
                    raise ValueError(f"{a} and {b} are both {pa}; give them different ports")
        return self


class FrontDoor(BaseModel):
    """What one caller can make the server do, bounded before the work (docs/security.md): sizes,
    calls and streams in flight, connections and their timeouts, browsers' origins."""

    max_message_bytes: int | None = Field(
        None,
        ge=1024,
        description="largest gRPC message accepted or sent, in bytes; default: derived from "
        "the served models (their largest acceptable request, between 4 and 64 MiB)",
    )
    max_tensor_elements: int = Field(
        1 << 24,
        ge=1,
        description="most elements one input tensor may hold (product of its shape), checked "
        "before anything is allocated",
    )
    max_string_bytes: int = Field(1 << 20, ge=1, description="longest BYTES element accepted, in bytes")
    max_inputs: int = Field(
        64, ge=1, description="most input tensors one request may carry, checked before any other work"
    )
    max_concurrent_rpcs: int = Field(
        2048,
        ge=1,
        description="gRPC calls (a stream counts as one) in progress at once; more are refused "
        "RESOURCE_EXHAUSTED by gRPC before any Python runs",
    )
    max_http_body_bytes: int | None = Field(
        None,
        ge=1024,
        description="largest REST request body; default: 6 times max_message_bytes (JSON text "
        "of numbers is larger than their binary form)",
    )
    stream_window: int = Field(
        32,
        ge=1,
        le=4096,
        description="requests of one ModelStreamInfer in flight at once; while full the "
        "server stops reading the stream (backpressure), and answers queue for a slow reader at most this many",
    )
    max_streams_per_connection: int = Field(
        16, ge=1, description="concurrent ModelStreamInfer calls on one client connection"
    )
    max_streams_per_tenant: int = Field(
        256,
        ge=1,
        description="concurrent ModelStreamInfer calls of one tenant (of all callers on an open server)",
    )
    # 64: more takers drain core's queue in bigger bursts before calls expire in it, up to a point
    # (docs/performance.md, "Figures the code cites": call takers under a spike)
    grpc_takers: int = Field(
        64,
        ge=0,
        le=256,
        description="requests for new calls kept outstanding in gRPC core beside grpc.aio's own one: "
        "calls are taken as fast as they arrive, and while the overload gate sheds, refused at once "
        "without a handler (gateway/transport/takers.py); 0 = grpc.aio's own loop alone",
    )
    http_max_connections: int = Field(
        1024, ge=1, description="open HTTP connections at most; more are answered 503 and closed"
    )
    http_header_timeout_s: float = Field(
        15.0,
        gt=0,
        description="an HTTP connection that has not sent a whole request head this long after it "
        "opened (or after its last answer) is closed: slow or idle clients do not hold connections",
    )
    http_body_timeout_s: float = Field(
        30.0,
        gt=0,
        description="longest an HTTP request body may take to arrive; then 408 and the connection closes",
    )
    cors_allowed_origins: str | None = Field(
        None,
        description="origins whose browser pages may call the REST API: comma-separated "
        "(https://app.example.com,http://localhost:3000), or * for any; unset: no CORS answers, "
        "so browsers refuse pages of other origins (docs/api.md, CORS)",
        examples=["https://app.example.com,http://localhost:3000"],
    )

    @model_validator(mode="after")
    def _check_cors(self) -> Self:
        for origin in cors_origins(self.cors_allowed_origins):
            if origin != "*" and not _ORIGIN.fullmatch(origin):
                raise ValueError(
                    f"cors_allowed_origins: {origin!r} is not an origin: scheme://host[:port] with no "
                    "path (https://app.example.com), or *"
                )
        return self


class Engines(BaseModel):
    """Where models run and how: workers per device, threads, shape buckets' engines, their cache
    (docs/engines.md)."""

    workers_per_device: int | None = Field(
        None,
        ge=1,
        description="workers on each device (every GPU, or the CPU) for every model; "
        "default: instance_group count",
    )
    intra_op_threads: int = Field(1, ge=1, description="ONNX Runtime intra-op threads per worker")
    inter_op_threads: int = Field(1, ge=1, description="ONNX Runtime inter-op threads per worker")
    device: Literal["auto", "cpu", "gpu"] = Field(
        "auto",
        description="auto: follow instance_group kind; cpu: every model on the CPU; gpu: every "
        "model on a GPU (string models stay on the CPU provider); a GPU asked for where none is usable: "
        "the model's gpu_fallback (fail, or cpu)",
    )
    default_max_batch_size: int = Field(
        64, ge=0, description="max_batch_size given to models whose config.pbtxt is missing"
    )
    engine_mode: Literal["auto", "shared", "static"] = Field(
        "auto",
        description="shared: one ONNX Runtime session per worker, a bound run configuration per "
        "bucket; static: one session per bucket with its dims fixed (more memory); auto: static on a GPU "
        "with CUDA graphs, else shared",
    )
    engine_warmup: Literal["auto", "all", "lengths", "none"] = Field(
        "auto",
        description="runs before a model is ready: all buckets, each length bucket once, or none; "
        "auto: all on GPU and static engines, lengths on the shared CPU session",
    )
    engine_length_runs: bool = Field(
        True,
        description="a text batch of mixed lengths runs as runs of similar length where the engine's "
        "measured cost of a run is less than the padding it saves (dynamic shapes only)",
    )
    engine_cache: bool = Field(
        True, description="cache optimised models on disk (keyed by model, ORT, provider, shapes)"
    )
    engine_cache_dir: Path | None = Field(
        None, description="optimised-model cache; default ~/.cache/batchgate/engines, else under the temp dir"
    )
    cuda_graphs: bool = Field(
        False, description="GPU: capture a CUDA graph per bucket (static shapes, fixed buffers)"
    )


class Selection(BaseModel):
    """The host's variant of each model (gateway/selection.py, docs/engines.md "Selected in the
    background")."""

    variant_selection: Literal["auto", "recorded", "off"] = Field(
        "auto",
        description="auto: a model whose config names no variant serves the one selected for this host's CPU "
        "class, and while none is, serves the original and selects in the background (a niced child process, "
        "then a reload to the winner); recorded: serve recorded choices, never measure; off: serve what the "
        "configs say (a model pins its own with parameter variant, or opts out with variant_selection: off)",
    )
    variant_selection_memory_mb: int = Field(
        4096, ge=0, description="address-space bound of the background selection's process (0: none)"
    )
    variant_selection_repeats: int = Field(
        3, ge=1, le=20, description="timing repeats of the background selection"
    )
    variant_selection_candidates: str = Field(
        "",
        description="comma-separated optimize --auto candidates to select among; empty: all this host builds",
        examples=["int8,openvino-bf16"],
    )


class Text(BaseModel):
    """The text wires' defaults (TEI, OpenAI)."""

    tei_default_model: str | None = Field(
        None,
        description="the model TEI's routes at the root (/info, /embed, /tokenize ...) serve when a "
        "call names none; unset: the first text embedding model by name. Every text model is also "
        "its own TEI server under /tei/<model>",
    )
    openai_token_ids: Literal["openai", "model", "refuse"] = Field(
        "openai",
        description="what token-id arrays on /v1/embeddings mean: openai = ids of OpenAI's embedding "
        "tokenizer (cl100k_base, as LangChain's OpenAIEmbeddings sends), decoded to text and tokenized by "
        "the model's own tokenizer; model = the model's own tokenizer ids, fed as they are; refuse = "
        "refused (send text). A model's parameter openai_token_ids overrides it. TEI's routes always "
        "take the model's own ids",
    )


class Admission(BaseModel):
    """Who may call and how much: tenants, rate limits (local and global), the overload gate,
    usage metering."""

    api_keys_file: Path | None = Field(
        None, description="tenant file (API-key hashes, allowed models, limits); none = open server"
    )
    tenants_reload_s: float = Field(
        2.0,
        ge=0,
        description="how often the tenant file is checked for changes and re-read (revoked keys "
        "refused, new ones taken, without a restart); 0 = read once at start",
    )
    overload_lag_ms: float = Field(
        100.0,
        ge=0,
        description="overload gate: while more than a tenth of the calls that end were dropped (shed by "
        "the calibrated admission estimate, expired in the queue, abandoned by their callers), or while "
        "the event loop has run this late for 100 ms on end with more than overload_min_in_flight calls "
        "inside and calls being dropped, a share of new calls is refused UNAVAILABLE before any decoding, "
        "so the calls taken still meet their budgets; 0 = off",
    )
    overload_min_in_flight: int = Field(
        32,
        ge=1,
        description="calls inside the server below which the overload gate never refuses (a slow "
        "machine alone is no overload)",
    )
    ratelimit_redis_timeout_ms: float = Field(
        5.0, gt=0, description="longest a global-limit decision waits for Redis before deciding locally"
    )
    ratelimit_fail_mode: Literal["open", "closed"] = Field(
        "open",
        description="while Redis cannot answer: open = enforce this replica's local share of each "
        "global limit; closed = refuse requests under a global limit",
    )
    ratelimit_expected_replicas: int = Field(
        1, ge=1, description="replicas sharing the global limits; the local share is 1/this"
    )
    ratelimit_local_share: float | None = Field(
        None,
        gt=0,
        le=1,
        description="fraction of a global limit one replica enforces alone (default "
        "1/ratelimit_expected_replicas)",
    )
    ratelimit_probe_initial_ms: float = Field(
        50.0, gt=0, description="first wait before probing Redis after it failed; doubles per failed probe"
    )
    ratelimit_probe_max_ms: float = Field(2000.0, gt=0, description="longest wait between Redis probes")
    ratelimit_redis_prefix: str = Field(
        "batchgate:rl", min_length=1, description="prefix of the rate-limit keys in Redis"
    )
    usage_metering: bool = Field(
        True,
        description="count what each tenant used (/metrics batchgate_usage_*, the usage API, the sink); "
        "off: no usage accounting at all (no usage families, no usage API, usage_sink unused)",
    )
    usage_sink: str | None = Field(
        None,
        description="where one usage record per call goes: a file path (JSON lines, appended), or "
        "'redis' for the stream batchgate:usage on redis_url; none = metrics and the usage API only",
    )
    usage_sink_interval_s: float = Field(
        1.0, gt=0, description="how often buffered usage records are written to the sink"
    )


class Scheduling(BaseModel):
    """Latency budgets: classes, their queues, and how batches close around deadlines."""

    scheduling_policy: Literal["deadline", "fifo"] = Field(
        "deadline",
        description="deadline: latency classes, EDF, shedding, deadline-aware batch closing; "
        "fifo: Triton-like FIFO + max-wait timer (kept for comparison)",
    )
    latency_classes: str = Field(
        DEFAULT_CLASSES, description="latency classes: name=<budget>ms/<max_queue per model>/<min_share>,..."
    )
    default_latency_class: str = Field("standard", description="class of a request that names none")
    batch_latency_class: str | None = Field(
        None,
        description="class of a call of several rows (texts) that states no budget (no deadline, no "
        "latency_budget_ms) and whose tenant names no class: client libraries send documents in batches and "
        "cannot set a budget; default: 'bulk' where that class is configured, else default_latency_class; "
        "'' = default_latency_class for every call",
        examples=["bulk"],
    )
    batch_time_cap: float = Field(
        0.5,
        gt=0,
        le=1,
        description="longest batch run while a latency class is active, as a fraction of the "
        "tightest active budget: 0.5 lets an urgent request that arrives as a batch starts still finish in time; "
        "more trades that class's p99 for throughput",
    )
    deadline_margin_ms: float = Field(
        4.0,
        ge=0,
        le=1000,
        description="time kept free before every deadline for what this process cannot "
        "see: the network and the caller's own stack, both ways (at most a fifth of a request's budget; the event "
        "loop's measured lag is added to it)",
    )

    @property
    def classes(self) -> dict[str, LatencyClass]:
        return parse_classes(self.latency_classes)

    @property
    def batch_class(self) -> str | None:
        """The class of a call of several rows that states no budget (None: the default class)."""
        name = self.batch_latency_class
        if name is None:
            return "bulk" if "bulk" in self.classes else None
        return name or None

    @model_validator(mode="after")
    def _check_classes(self) -> Self:
        classes = parse_classes(self.latency_classes)  # raises with a message naming the bad class
        if self.default_latency_class not in classes:
            raise ValueError(
                f"default_latency_class '{self.default_latency_class}' is not one of the latency classes {sorted(classes)}"
            )
        if self.batch_latency_class and self.batch_latency_class not in classes:
            raise ValueError(
                f"batch_latency_class '{self.batch_latency_class}' is not one of the latency classes "
                f"{sorted(classes)}; '' sends every call that names no class to default_latency_class"
            )
        return self


class SharedState(BaseModel):
    """The Redis that replicas share: the result cache's second tier and the global rate limits."""

    redis_url: str | None = Field(
        None,
        description="Redis URL (redis:// or rediss://, with user:password@ when needed); turns on the "
        "shared result cache and global rate limits",
    )
    redis_url_file: Path | None = Field(
        None, description="a file holding the Redis URL (a mounted Secret); wins over redis_url"
    )
    redis_password_file: Path | None = Field(
        None,
        description="a file holding the Redis password (a mounted Secret), put into redis_url's "
        "authority (user:password@host)",
    )

    @model_validator(mode="after")
    def _read_redis_files(self) -> Self:
        """The Redis URL, or its password, from files (mounted Secrets), so no credential need
        travel in the environment."""
        if self.redis_url_file is not None:
            self.redis_url = _read_secret(self.redis_url_file, "redis_url_file")
        if self.redis_password_file is not None:
            if not self.redis_url:
                raise ValueError(
                    "redis_password_file needs redis_url (or redis_url_file): the URL it goes into"
                )
            password = _read_secret(self.redis_password_file, "redis_password_file")
            self.redis_url = _with_password(self.redis_url, password)
        return self


class Cache(BaseModel):
    """The result cache (per model: config.pbtxt ``response_cache { enable: true }``; docs/cache.md)."""

    cache_tiers: Literal["auto", "memory", "redis", "memory+redis", "off"] = Field(
        "auto", description="result cache tiers; auto: memory, plus Redis when redis_url is set"
    )
    cache_memory_bytes: int = Field(
        256 * 2**20, ge=0, description="byte budget of the in-process LRU (keys, values and bookkeeping)"
    )
    cache_ttl_s: float = Field(3600.0, gt=0, description="lifetime of a result in Redis")
    cache_lookup_timeout_ms: float = Field(
        5.0, gt=0, le=1000, description="longest a request waits for Redis before treating its rows as misses"
    )
    cache_breaker_failures: int = Field(
        5,
        ge=1,
        description="Redis failures or timeouts in a row that open the breaker (Redis is then skipped)",
    )
    cache_breaker_open_s: float = Field(
        2.0, gt=0, description="longest wait of the shared Redis breaker (cache and limiter) before a probe"
    )
    cache_redis_max_connections: int = Field(
        32, ge=2, description="Redis connections for the cache; lookups beyond them are skipped, not queued"
    )
    cache_write_queue_rows: int = Field(
        100_000, ge=0, description="rows waiting to be written to Redis at most; more are dropped (counted)"
    )
    cache_redis_prefix: str = Field(
        "batchgate:rc:", min_length=1, description="prefix of result keys in Redis"
    )

    @model_validator(mode="after")
    def _check_cache(self) -> Self:
        if self.cache_tiers in ("redis", "memory+redis") and not self.redis_url:
            raise ValueError(
                f"cache_tiers '{self.cache_tiers}' needs a Redis: set redis_url (--redis-url / BATCHGATE_REDIS_URL)"
            )
        return self


class Observability(BaseModel):
    """Logs and traces."""

    log_level: str = Field("INFO", description="logging level")
    log_format: Literal["text", "json"] = Field(
        "text",
        description="text: one readable line per event; json: one JSON object per line (for log shippers)",
    )
    otel_endpoint: str | None = Field(
        None,
        description="OpenTelemetry: an OTLP/HTTP collector (e.g. http://otel-collector:4318) to export "
        "traces to; none = tracing off (and free)",
    )
    otel_service_name: str = Field("batchgate", description="OpenTelemetry: the service.name of the spans")


class Settings(
    Observability,
    Cache,
    SharedState,
    Scheduling,
    Admission,
    Text,
    Selection,
    Engines,
    FrontDoor,
    Serving,
    BaseSettings,
):
    """Every setting, one flat namespace (``settings.grpc_port``, ``BATCHGATE_GRPC_PORT``,
    ``--grpc-port``), declared by concern in the classes above."""

    # pydantic takes fields from the last base first: the concerns are listed in reverse so that
    # flags (``serve --help``) and generated lists read in the order they are declared above.
    model_config = SettingsConfigDict(env_prefix="BATCHGATE_", extra="forbid")


def _read_secret(path: Path, setting: str) -> str:
    try:
        value = Path(path).read_text().strip()
    except OSError as exc:
        raise ValueError(f"{setting}: cannot read {path}: {exc.strerror}") from None
    if not value:
        raise ValueError(f"{setting}: {path} is empty")
    return value


def _with_password(url: str, password: str) -> str:
    """``url`` with ``password`` in its authority (quoted), keeping its user, host and the rest."""
    from urllib.parse import quote, urlsplit, urlunsplit

    parts = urlsplit(url)
    if not parts.hostname:
        raise ValueError(
            f"redis_url has no host to put the password of redis_password_file on: {parts.scheme}://..."
        )
    user = quote(parts.username, safe="") if parts.username else ""
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit(parts._replace(netloc=f"{user}:{quote(password, safe='')}@{host}"))
