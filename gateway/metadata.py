"""The answers of the metadata calls, as plain types: server and model metadata, statistics and
the repository index.

Like ``Call`` and ``Answer`` (gateway/call.py), no protobuf and no JSON: the pipeline
(gateway/infer.py) builds these, and each transport writes its own wire form — the gRPC servicer
KServe's messages (gateway/transport/grpc.py), KServe REST its JSON (gateway/transport/kserve_rest.py).
The fields and their order are KServe's / Triton's, so a transport maps them one to one.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class ServerInfo:
    name: str
    version: str
    extensions: list[str]


@dataclass(slots=True)
class TensorInfo:
    name: str
    datatype: str
    shape: list[int]  # -1 where the dim varies (the batch dim of a batched model)


@dataclass(slots=True)
class ModelInfo:
    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorInfo]
    outputs: list[TensorInfo]


@dataclass(slots=True)
class Duration:
    """Triton's StatisticDuration: how many, and their nanoseconds in all."""

    count: int = 0
    ns: int = 0


@dataclass(slots=True)
class InferStats:
    """Triton's InferStatistics: per request (success, fail, cache), per executed batch (queue and
    compute)."""

    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)
    # None without a result cache: gRPC then leaves them out, as Triton does
    cache_hit: Duration | None = None
    cache_miss: Duration | None = None


@dataclass(slots=True)
class BatchStats:
    batch_size: int
    compute_input: Duration
    compute_infer: Duration
    compute_output: Duration


@dataclass(slots=True)
class ModelStats:
    """Triton's ModelStatistics of one model version: ``inference_count`` counts rows inferred,
    ``execution_count`` batches run; neither counts cache hits."""

    name: str
    version: str
    last_inference: int  # ms since the epoch; 0: never
    inference_count: int
    execution_count: int
    inference_stats: InferStats = field(default_factory=InferStats)
    batch_stats: list[BatchStats] = field(default_factory=list)


@dataclass(slots=True)
class IndexEntry:
    """One model version in the repository index: READY, or UNAVAILABLE with the reason."""

    name: str
    version: str
    state: str
    reason: str = ""
