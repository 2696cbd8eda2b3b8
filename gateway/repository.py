"""The model repository: Triton's layout, ``<model>/config.pbtxt`` and ``<model>/<version>/model.onnx``.

Loading a repository never fails as a whole: each model either becomes a ``ModelSpec`` or a
``LoadFailure`` with the reason, so the rest still serve and RepositoryIndex can say why.
Config fields batchgate does not implement are reported by name: fields that would change the
answers fail the load, hints that only tune a peer's runtime are logged as ignored. The same rule
holds inside ``parameters {}`` (gateway/parameters.py): an undeclared key fails the load by name.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import socket
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import onnx
from google.protobuf import text_format
from google.protobuf.message import Message

from batchgate.gateway import dtypes
from batchgate.gateway.parameters import VARIANTS, ModelParameters, ParameterError
from batchgate.gateway.parameters import parse as parse_parameters
from batchgate.proto.inference.v2 import model_config_pb2 as mc
from batchgate.workers.buckets import BucketConfig
from batchgate.workers.devices import int8_saturates
from batchgate.workers import openvino_engine
from batchgate.workers.devices import cpu_class
from batchgate.workers.fingerprint import file_fingerprint

log = logging.getLogger(__name__)

CONFIG_FILE = "config.pbtxt"
DEFAULT_MODEL_FILE = "model.onnx"
ONNX_PLATFORMS = {"", "onnxruntime_onnx"}
ONNX_BACKENDS = {"", "onnxruntime", "openvino"}  # OpenVINO reads the ONNX file itself
TOKENIZER_PARAMETER = "tokenizer"
TOKEN_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
# Engine variants `batchgate optimize` builds beside model.onnx (gateway/models/optimize/candidates.py),
# and the precision each computes in; parameter `variant` chooses one (docs/engines.md).
VARIANT_PARAMETER = "variant"
VARIANT_PRECISION = {
    "fp32": "FP32", "optimized": "FP32", "fp16": "FP16", "int8": "INT8",
    "openvino-fp32": "FP32", "openvino-bf16": "BF16", "openvino-int8": "INT8",
    "int8-mixed": "INT8",  # gateway/models/optimize/mixed.py: INT8 with its sensitive GEMMs in FP32
}  # fmt: skip
assert tuple(VARIANT_PRECISION) == VARIANTS
# OpenVINO variants that run model.onnx itself (the precision is a compile setting, not a file).
SAME_FILE_VARIANTS = ("openvino-fp32", "openvino-bf16")
# Each kind's outputs (parameter `kind`, gateway/parameters.py): name -> the dims a route relies
# on ("labels", "any" or a fixed size). A model may have more outputs; these must be there.
KIND_OUTPUTS = {
    "embedding": {"embedding": ("any",)},
    "rerank": {"score": (1,)},
    "classification": {"probabilities": ("labels",), "logits": ("labels",)},
    "sparse_embedding": {"sparse_embedding": ("any",)},
    "multi_vector": {"token_embeddings": (-1, "any"), "token_mask": (-1,)},  # ColBERT
}
# An embedding model's optional per-token output: [tokens, hidden], zero past each row's tokens.
TOKEN_OUTPUT = "token_embeddings"
# Beside it (BGE-M3, ColBERT): [tokens], 1 where a token_embeddings row is one of the text's vectors.
TOKEN_MASK_OUTPUT = "token_mask"

# Dotted field paths of ModelConfig that batchgate implements.
SUPPORTED = {
    "name", "platform", "backend", "max_batch_size", "default_model_filename", "parameters",
    "version_policy", "version_policy.latest", "version_policy.latest.num_versions",
    "version_policy.all", "version_policy.specific", "version_policy.specific.versions",
    "input", "input.name", "input.data_type", "input.dims", "input.reshape", "input.reshape.shape",
    "output", "output.name", "output.data_type", "output.dims", "output.reshape", "output.reshape.shape",
    "dynamic_batching", "dynamic_batching.max_queue_delay_microseconds",
    "dynamic_batching.preferred_batch_size", "dynamic_batching.default_queue_policy",
    "dynamic_batching.default_queue_policy.max_queue_size",
    "dynamic_batching.default_queue_policy.timeout_action",
    "dynamic_batching.default_queue_policy.default_timeout_microseconds",
    "dynamic_batching.default_queue_policy.allow_timeout_override",
    "dynamic_batching.priority_levels", "dynamic_batching.default_priority_level",
    "dynamic_batching.priority_queue_policy",
    "instance_group", "instance_group.name", "instance_group.count", "instance_group.kind",
    "instance_group.gpus",
    "response_cache", "response_cache.enable",
}  # fmt: skip

# Fields whose absence of support would silently change what the model computes: refuse.
FATAL = {
    "sequence_batching", "ensemble_scheduling", "batch_input", "batch_output",
    "input.is_shape_tensor", "output.is_shape_tensor",
    "input.allow_ragged_batch", "input.optional", "input.is_non_linear_format_io",
    "output.is_non_linear_format_io", "model_transaction_policy", "instance_group.passive",
}  # fmt: skip
# Not listed above, so logged as ignored: `input.format` (FORMAT_NCHW / NHWC) is a hint in Triton
# too; the tensor's layout is what its dims say, and the ONNX model is checked against those.


class ConfigError(Exception):
    """The model cannot be served as configured; the message names the field."""


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    datatype: str  # KServe v2 spelling: FP32, INT64, BYTES ...
    dims: tuple[int, ...]  # without the batch dim; -1 = any size

    @property
    def dtype(self) -> np.dtype:
        return dtypes.NUMPY[self.datatype]

    def shape_text(self, batched: bool) -> str:
        return str(list((-1,) + self.dims if batched else self.dims))


@dataclass(slots=True)
class ModelSpec:
    name: str
    version: str
    path: Path
    config: mc.ModelConfig  # completed: what ModelConfig answers and requests are validated against
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    fingerprint: str  # sha256 of the model file, first 16 hex digits
    ignored: list[str] = field(default_factory=list)
    # Variable dims that the ONNX graph names alike (dim_param) on several inputs, e.g. "seq" on
    # input_ids and attention_mask: requests must agree on them. name -> [(input, axis)].
    tied_dims: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    # The ONNX graph's input names; they differ from `inputs` when a tokenizer stage feeds it.
    model_inputs: tuple[str, ...] = ()
    # config.pbtxt `parameters {}`, typed and checked once at load (gateway/parameters.py)
    params: ModelParameters = field(default_factory=ModelParameters)
    # The engines' shape settings (buckets, reshape), from params and the config; None: plain
    # dynamic-shape engines (specs built by hand in tests).
    buckets: BucketConfig | None = None
    # The engine variant serving (parameter `variant`); `path` is its file, `fingerprint` its
    # identity: the file's hash, and for any engine or precision but ONNX Runtime FP32 also those
    # and the CPU's arithmetic class (``model_identity``).
    variant: str = "fp32"
    engine: str = "onnxruntime"  # or "openvino"
    # OpenVINO's inference precision ("fp32" or "bf16"), resolved for this CPU; "fp32" for ORT.
    compute: str = "fp32"

    @property
    def precision(self) -> str:
        """What answers: FP32, BF16, FP16 or INT8 (an INT8 file's other layers compute in ``compute``)."""
        if self.engine == "openvino" and self.variant != "openvino-int8":
            return self.compute.upper()
        return VARIANT_PRECISION.get(self.variant, "FP32")

    @property
    def kind(self) -> str | None:
        """What the model serves (parameter ``kind``); a text model without one is known by its
        output: ``score`` a rerank model, ``embedding`` an embedding model. None: a tensor model."""
        if self.params.kind is not None:
            return self.params.kind
        if not self.params.tokenizer:
            return None
        names = {t.name for t in self.outputs}
        return "rerank" if "score" in names else "embedding" if "embedding" in names else None

    def output(self, name: str) -> TensorSpec | None:
        return next((t for t in self.outputs if t.name == name), None)

    @property
    def default_outputs(self) -> tuple[str, ...]:
        """The outputs a call that names none gets, in config order: all but ``on_request_outputs``."""
        later = self.params.on_request_outputs
        return tuple(t.name for t in self.outputs if t.name not in later)

    @property
    def labels(self) -> tuple[str, ...]:
        """A classifier's label names by output index (parameters ``label.<index>``, else LABEL_i)."""
        if self.kind != "classification":
            return ()
        if self.params.labels:
            return self.params.labels
        return tuple(f"LABEL_{i}" for i in range(self.output("probabilities").dims[0]))

    @property
    def max_batch_size(self) -> int:
        return self.config.max_batch_size

    @property
    def batched(self) -> bool:
        return self.config.max_batch_size > 0

    @property
    def max_queue_delay_s(self) -> float:
        return self.config.dynamic_batching.max_queue_delay_microseconds / 1e6

    @property
    def preferred_batch_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self.config.dynamic_batching.preferred_batch_size))

    @property
    def max_queue_size(self) -> int:
        return self.config.dynamic_batching.default_queue_policy.max_queue_size


@dataclass(slots=True)
class LoadFailure:
    name: str
    version: str
    reason: str


@dataclass(slots=True)
class Repository:
    models: dict[str, dict[str, ModelSpec]]  # name -> version -> spec
    failures: dict[str, LoadFailure]


def _set_fields(msg: Message, prefix: str = "") -> list[str]:
    """Dotted paths of every field set in ``msg`` (repeated messages inspected element-wise)."""
    paths: list[str] = []
    for fd, value in msg.ListFields():
        path = f"{prefix}{fd.name}"
        paths.append(path)
        if fd.message_type is None or fd.message_type.GetOptions().map_entry:
            continue
        items = value if fd.is_repeated else [value]
        for item in items:
            paths.extend(p for p in _set_fields(item, path + ".") if p not in paths)
    return paths


def check_fields(config: mc.ModelConfig) -> list[str]:
    """Raise ConfigError on a fatal unsupported field; return the names of ignored ones."""
    ignored = []
    for path in _set_fields(config):
        if path in SUPPORTED:
            continue
        if path in FATAL or any(path.startswith(f + ".") for f in FATAL):
            raise ConfigError(f"config field '{path}' is not supported by batchgate")
        if not any(path.startswith(p + ".") for p in ignored):
            ignored.append(path)
    if config.HasField("model_transaction_policy") and config.model_transaction_policy.decoupled:
        raise ConfigError("config field 'model_transaction_policy.decoupled' is not supported")
    return ignored


def _onnx_tensors(model: onnx.ModelProto) -> tuple[list, list]:
    init = {i.name for i in model.graph.initializer}
    inputs = [v for v in model.graph.input if v.name not in init]
    return inputs, list(model.graph.output)


def _onnx_dims(value: onnx.ValueInfoProto) -> list[int]:
    """-1 for a symbolic or unknown dim."""
    dims = []
    for d in value.type.tensor_type.shape.dim:
        dims.append(d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else -1)
    return dims


def _onnx_datatype(value: onnx.ValueInfoProto, model_name: str) -> str:
    elem = value.type.tensor_type.elem_type
    if elem not in dtypes.ONNX_TO_KSERVE:
        raise ConfigError(f"model '{model_name}': tensor '{value.name}' has unsupported ONNX type {elem}")
    return dtypes.ONNX_TO_KSERVE[elem]


def tied_dims(model: onnx.ModelProto, batched: bool) -> dict[str, list[tuple[str, int]]]:
    seen: dict[str, list[tuple[str, int]]] = {}
    for v in _onnx_tensors(model)[0]:
        for axis, d in enumerate(v.type.tensor_type.shape.dim):
            if batched and axis == 0:
                continue
            if d.HasField("dim_param") and d.dim_param:
                seen.setdefault(d.dim_param, []).append((v.name, axis))
    return {k: v for k, v in seen.items() if len(v) > 1}


def tokenized(config: mc.ModelConfig) -> bool:
    """A text model: parameter `tokenizer` names a tokenizer.json that turns the config's one
    TYPE_STRING input into the ONNX model's token inputs (gateway/text.py). Read from the
    raw config because completing the config depends on it, before the parameters are parsed."""
    p = config.parameters.get(TOKENIZER_PARAMETER)
    return p is not None and bool(p.string_value)


def _complete_text_input(config: mc.ModelConfig, onnx_in: list) -> None:
    name = config.name
    if config.max_batch_size < 1:
        raise ConfigError(
            f"model '{name}': parameter 'tokenizer' needs a batching model (max_batch_size >= 1)"
        )
    if not config.input:
        config.input.add(name="text", data_type=mc.TYPE_STRING, dims=[1])
    if (
        len(config.input) != 1
        or config.input[0].data_type != mc.TYPE_STRING
        or list(config.input[0].dims) != [1]
    ):
        raise ConfigError(
            f"model '{name}': with parameter 'tokenizer', config.pbtxt must declare exactly one input, "
            "TYPE_STRING with dims [ 1 ] (one text per row)"
        )
    names = [v.name for v in onnx_in]
    if "input_ids" not in names or any(n not in TOKEN_INPUTS for n in names):
        raise ConfigError(
            f"model '{name}': a tokenized model's ONNX inputs must be input_ids plus any of attention_mask, "
            f"token_type_ids; this one has {names}"
        )
    for v in onnx_in:
        if _onnx_datatype(v, name) != "INT64" or len(_onnx_dims(v)) != 2 or _onnx_dims(v)[0] != -1:
            raise ConfigError(
                f"model '{name}': ONNX input '{v.name}' must be INT64 [batch, seq] to take tokens, "
                f"not {_onnx_datatype(v, name)} {_onnx_dims(v)}"
            )


def _check_reshape(name: str, kind: str, t: mc.ModelInput | mc.ModelOutput) -> None:
    """Fixed shapes only: with a variable dim on either side the element count of a row is not
    known until a request comes, and which client dim maps to which model dim is ambiguous."""
    dims, shape = list(t.dims), list(t.reshape.shape)
    if any(d < 0 for d in dims + shape):
        raise ConfigError(
            f"model '{name}': {kind} '{t.name}' has reshape {shape} for dims {dims}; batchgate implements "
            "reshape for fixed dims only (no -1 on either side)"
        )
    if math.prod(dims) != math.prod(shape):
        raise ConfigError(
            f"model '{name}': {kind} '{t.name}': reshape {shape} holds {math.prod(shape)} values per row "
            f"but dims {dims} hold {math.prod(dims)}"
        )


def _reshapes(tensors, to_client: bool) -> dict[str, tuple[int, ...]]:
    """Row shape per reshaped tensor: the model's (inputs go in reshaped) or the client's (outputs
    come back in the config's dims)."""
    return {t.name: tuple(t.dims if to_client else t.reshape.shape) for t in tensors if t.HasField("reshape")}


def complete_config(config: mc.ModelConfig, model: onnx.ModelProto, default_max_batch_size: int) -> None:
    """Fill what config.pbtxt left out from the ONNX file, and check what it says against it."""
    name = config.name
    onnx_in, onnx_out = _onnx_tensors(model)
    if not config.input and not config.output and config.max_batch_size == 0:
        # No config at all: batch along dim 0 when every tensor's first dim is dynamic.
        first_dynamic = all(_onnx_dims(v)[:1] == [-1] for v in onnx_in + onnx_out)
        if first_dynamic and default_max_batch_size > 0:
            config.max_batch_size = default_max_batch_size
    batched = config.max_batch_size > 0
    pairs = [("input", onnx_in, config.input), ("output", onnx_out, config.output)]
    if tokenized(config):  # config inputs are text; the ONNX inputs are checked against the stage
        if any(t.HasField("reshape") for t in config.input):
            raise ConfigError(f"model '{name}': the text input (parameter 'tokenizer') takes no reshape")
        _complete_text_input(config, onnx_in)
        pairs = pairs[1:]
    for kind, onnx_list, cfg_list in pairs:
        by_name = {v.name: v for v in onnx_list}
        if not cfg_list:
            for v in onnx_list:
                dims = _onnx_dims(v)
                cfg_list.add(
                    name=v.name,
                    data_type=dtypes.to_config(_onnx_datatype(v, name)),
                    dims=dims[1:] if batched else dims,
                )
            continue
        for t in cfg_list:
            v = by_name.get(t.name)
            if v is None:
                raise ConfigError(
                    f"model '{name}': config {kind} '{t.name}' is not in the ONNX model "
                    f"(its {kind}s: {sorted(by_name)})"
                )
            onnx_type = _onnx_datatype(v, name)
            cfg_type = dtypes.from_config(t.data_type)
            if cfg_type != onnx_type:
                raise ConfigError(
                    f"model '{name}': {kind} '{t.name}' is {cfg_type} in config.pbtxt but {onnx_type} in the ONNX model"
                )
            odims = _onnx_dims(v)
            # With `reshape` the ONNX model sees reshape.shape and the client the dims (Triton's
            # semantics); the worker reshapes on the way in and out (workers/buckets.ShapePlan).
            want = list(t.reshape.shape) if t.HasField("reshape") else list(t.dims)
            if t.HasField("reshape"):
                _check_reshape(name, kind, t)
            if batched:
                if not odims or odims[0] != -1:
                    raise ConfigError(
                        f"model '{name}': max_batch_size > 0 but ONNX {kind} '{t.name}' has no dynamic "
                        f"batch dim (shape {odims})"
                    )
                odims = odims[1:]
            what = f"reshape {want}" if t.HasField("reshape") else f"dims {want}"
            if t.HasField("reshape") and -1 in odims:
                # The batcher and the engines plan variable dims on the client's arrays, whose
                # axes no longer line up with the model's once reshaped.
                raise ConfigError(
                    f"model '{name}': {kind} '{t.name}' has reshape {want} but the ONNX model's dims {odims} "
                    "are not all fixed; batchgate implements reshape onto fixed model dims only"
                )
            if len(odims) != len(want):
                raise ConfigError(
                    f"model '{name}': {kind} '{t.name}' has {what} in config.pbtxt but "
                    f"{odims} in the ONNX model (batch dim excluded)"
                )
            for c, o in zip(want, odims):
                if c != -1 and o != -1 and c != o:
                    raise ConfigError(
                        f"model '{name}': {kind} '{t.name}' has {what} in config.pbtxt but "
                        f"{odims} in the ONNX model"
                    )
        if kind == "input":
            missing = sorted(set(by_name) - {t.name for t in cfg_list})
            if missing:
                raise ConfigError(f"model '{name}': ONNX inputs {missing} are missing from config.pbtxt")


def _validate(config: mc.ModelConfig) -> None:
    name = config.name
    if config.platform not in ONNX_PLATFORMS or config.backend not in ONNX_BACKENDS:
        raise ConfigError(
            f"model '{name}': platform '{config.platform}' / backend '{config.backend}' is not served; "
            "batchgate serves ONNX models (platform onnxruntime_onnx)"
        )
    if config.max_batch_size < 0:
        raise ConfigError(f"model '{name}': max_batch_size must be >= 0, got {config.max_batch_size}")
    db = config.dynamic_batching
    for p in db.preferred_batch_size:
        if p < 1 or (config.max_batch_size and p > config.max_batch_size):
            raise ConfigError(
                f"model '{name}': dynamic_batching.preferred_batch_size {p} must be in [1, max_batch_size="
                f"{config.max_batch_size}]"
            )
    levels = db.priority_levels
    if levels and db.default_priority_level and not 1 <= db.default_priority_level <= levels:
        raise ConfigError(
            f"model '{name}': dynamic_batching.default_priority_level {db.default_priority_level} must be in "
            f"[1, priority_levels={levels}]"
        )
    for lvl in db.priority_queue_policy:
        if not 1 <= lvl <= max(levels, 0):
            raise ConfigError(
                f"model '{name}': dynamic_batching.priority_queue_policy has level {lvl} outside [1, priority_levels={levels}]"
            )
    for g in config.instance_group:
        if g.count < 0:
            raise ConfigError(f"model '{name}': instance_group.count must be >= 1")
    for t in list(config.input) + list(config.output):
        if any(d < -1 or d == 0 for d in t.dims):
            raise ConfigError(f"model '{name}': tensor '{t.name}' has invalid dims {list(t.dims)}")
        if dtypes.from_config(t.data_type) not in dtypes.NUMPY:
            raise ConfigError(
                f"model '{name}': tensor '{t.name}' has data_type {mc.DataType.Name(t.data_type)}, "
                "which batchgate does not serve"
            )


def variant_path(model_file: Path, variant: str) -> Path:
    """``1/model.onnx`` -> ``1/model.int8.onnx`` (``fp32`` and OpenVINO's FP32 and BF16 are the file itself)."""
    if variant == "fp32" or variant in SAME_FILE_VARIANTS:
        return model_file
    return model_file.with_name(f"{model_file.stem}.{variant}{model_file.suffix}")


def build_path(variant_file: Path) -> Path:
    """Where a variant is built before it is gated and published: beside it, hidden, named for
    this host and process, so ``remove_builds`` can tell a build killed half-way (a server stopped
    while it selected) from one still running."""
    return variant_file.with_name(f".{variant_file.name}.{socket.gethostname()}.{os.getpid()}.build")


def remove_builds(folder: Path, pid: int | None = None) -> list[Path]:
    """Remove the builds (``build_path``) in ``folder`` that processes of this host left: those of
    ``pid``, or with None those whose process no longer runs. A build of another host sharing
    the repository is never touched (its process cannot be seen from here)."""
    removed = []
    for f in folder.glob(f".*.{socket.gethostname()}.*.build"):
        try:
            owner = int(f.name.rsplit(".", 2)[-2])
        except ValueError:
            continue
        if owner == pid or (pid is None and not _running(owner)):
            f.unlink(missing_ok=True)
            removed.append(f)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def report_path(model_file: Path, variant: str) -> Path:
    """The gate's report of a variant: ``1/model.int8.report.json``."""
    return model_file.with_name(f"{model_file.stem}.{variant}.report.json")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def check_variant(name: str, version: str, model_file: Path, variant: str) -> Path:
    """The engine file of ``variant``, or ConfigError saying why it may not serve: only a variant
    whose gate report passed, and was made from the model.onnx that is there now, serves."""
    if variant == "fp32":
        return model_file
    where = f"model '{name}' version {version}: variant '{variant}'"
    rebuild = f"build it with `batchgate optimize {name} --{variant}`"
    path, report = variant_path(model_file, variant), report_path(model_file, variant)
    if not path.is_file():
        raise ConfigError(f"{where}: {version}/{path.name} is missing; {rebuild}")
    if not report.is_file():
        raise ConfigError(f"{where}: its gate report {version}/{report.name} is missing; {rebuild}")
    try:
        data = json.loads(report.read_text())
        status, failures = data["status"], data.get("failures", [])
        want_orig, want_var = data["original"]["sha256"], data["variant"]["sha256"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"{where}: its gate report {version}/{report.name} is unreadable ({exc!r})"
        ) from None
    if status != "passed":
        why = "; ".join(failures) or status
        raise ConfigError(f"{where}: its gate report says '{status}' ({why}); it is not served")
    if sha256_file(model_file) != want_orig:
        raise ConfigError(
            f"{where}: stale: {model_file.name} changed since the variant was built (its report names "
            f"sha256 {want_orig[:16]}…); {rebuild}"
        )
    if sha256_file(path) != want_var:
        raise ConfigError(
            f"{where}: {path.name} is not the file its report measured (sha256 {want_var[:16]}… in the "
            f"report); {rebuild}"
        )
    if variant == "openvino-bf16" and not openvino_engine.native_bf16():
        raise ConfigError(
            f"{where}: this CPU has neither AMX nor AVX-512 BF16, so BF16 would be emulated, slower than "
            f"FP32, and its gate figures (measured where BF16 is native) do not hold here; serve fp32 or "
            f"run `batchgate optimize {name} --auto` on this machine"
        )
    if variant in ("int8", "int8-mixed") and _int8_weights(data) == "int8" and int8_saturates():
        raise ConfigError(
            f"{where}: its INT8 weights are signed, and on this CPU (x86 without VNNI) ONNX Runtime's "
            f"UINT8 x INT8 kernel saturates (docs/engines.md measures 14 % off), so its gate figures do "
            f"not hold here; rebuild it on this machine with `batchgate optimize {name} --int8` (it "
            f"picks UINT8 weights) or serve fp32"
        )
    return path


def _int8_weights(report: dict) -> str:
    """The INT8 variant's weight storage its report names; reports from before the choice existed
    were all signed."""
    build = report.get("build")
    return str(build.get("weight_type", "int8")) if isinstance(build, dict) else "int8"


def select_versions(model_dir: Path, config: mc.ModelConfig) -> list[str]:
    filename = config.default_model_filename or DEFAULT_MODEL_FILE
    found = sorted(
        (
            int(p.name)
            for p in model_dir.iterdir()
            if p.is_dir() and p.name.isdigit() and (p / filename).is_file()
        ),
    )
    policy = config.version_policy
    which = policy.WhichOneof("policy_choice")
    if which == "all":
        chosen = found
    elif which == "specific":
        missing = [v for v in policy.specific.versions if v not in found]
        if missing:
            raise ConfigError(
                f"model '{config.name}': version_policy.specific names missing versions {missing}"
            )
        chosen = sorted(policy.specific.versions)
    else:
        n = policy.latest.num_versions if which == "latest" else 1
        chosen = found[-max(n, 1) :]
    if not chosen:
        raise ConfigError(f"model '{config.name}': no version directory holds {filename} in {model_dir}")
    return [str(v) for v in chosen]


def load_model(
    model_dir: Path, default_max_batch_size: int = 64, variant: str | None = None, choose=None
) -> list[ModelSpec]:
    """Parse, complete and check one model directory; one spec per served version. ``variant``
    overrides the config's (``batchgate optimize`` reads the original, whatever serves).
    ``choose(model_dir, version, model_file)``: the variant selected for this host
    (gateway/selection.py ``recorded_variant``), served where the config sets no ``variant`` and
    the model's ``variant_selection`` is auto; None: the config's."""
    config = mc.ModelConfig()
    cfg_path = model_dir / CONFIG_FILE
    if cfg_path.exists():
        try:
            text_format.Parse(cfg_path.read_text(), config)
        except text_format.ParseError as exc:
            raise ConfigError(f"model '{model_dir.name}': {CONFIG_FILE}: {exc}") from None
    if not config.name:
        config.name = model_dir.name
    elif config.name != model_dir.name:
        raise ConfigError(f"config name '{config.name}' does not match its directory '{model_dir.name}'")
    ignored = check_fields(config)
    _validate(config)
    specs = []
    for version in select_versions(model_dir, config):
        path = model_dir / version / (config.default_model_filename or DEFAULT_MODEL_FILE)
        cfg = mc.ModelConfig()
        cfg.CopyFrom(config)
        try:
            model = onnx.load(str(path), load_external_data=False)
        except Exception as exc:
            raise ConfigError(
                f"model '{config.name}' version {version}: cannot read {path.name}: {exc}"
            ) from None
        complete_config(cfg, model, default_max_batch_size)
        _validate(cfg)
        model_inputs = tuple(v.name for v in _onnx_tensors(model)[0])
        raw = {k: v.string_value for k, v in cfg.parameters.items()}
        try:
            inputs = [t.name for t in cfg.input]
            params, hints = parse_parameters(raw, inputs=inputs, model_inputs=model_inputs)
            preferred = tuple(sorted(cfg.dynamic_batching.preferred_batch_size))
            buckets = params.bucket_config(cfg.max_batch_size, preferred)
        except (ParameterError, ValueError) as exc:
            raise ConfigError(f"model '{config.name}': {exc}") from None
        buckets = replace(buckets, reshape_inputs=_reshapes(cfg.input, False),
                          reshape_outputs=_reshapes(cfg.output, True))  # fmt: skip
        ignored = ignored + [f"parameters.{k}" for k in hints if f"parameters.{k}" not in ignored]
        check_kind(cfg, params)
        check_on_request(cfg, params)
        if variant is not None:
            params = replace(params, variant=variant)
        elif (
            choose is not None
            and VARIANT_PARAMETER not in params.given
            and params.variant_selection == "auto"
        ):
            params = replace(params, variant=choose(model_dir, version, path) or params.variant)
        engine, compute = resolve_engine(cfg, params)
        engine_file = check_variant(cfg.name, version, path, params.variant)
        # ModelConfig answers which variant serves, also when the config left it at its default.
        cfg.parameters[VARIANT_PARAMETER].string_value = params.variant
        if not cfg.platform and not cfg.backend:
            cfg.platform = "onnxruntime_onnx"
        if not cfg.instance_group:
            cfg.instance_group.add(count=1, kind=mc.ModelInstanceGroup.KIND_AUTO)
        specs.append(
            ModelSpec(
                name=cfg.name,
                version=version,
                path=engine_file,
                config=cfg,
                inputs=[
                    TensorSpec(t.name, dtypes.from_config(t.data_type), tuple(t.dims)) for t in cfg.input
                ],
                outputs=[
                    TensorSpec(t.name, dtypes.from_config(t.data_type), tuple(t.dims)) for t in cfg.output
                ],
                fingerprint=model_identity(file_fingerprint(engine_file), engine, compute, params.variant),
                ignored=ignored,
                tied_dims={} if tokenized(cfg) else tied_dims(model, cfg.max_batch_size > 0),
                model_inputs=model_inputs,
                params=params,
                buckets=buckets,
                variant=params.variant,
                engine=engine,
                compute=compute,
            )
        )
    return specs


def check_kind(cfg: mc.ModelConfig, params: ModelParameters) -> None:
    """ConfigError unless the outputs are what parameter ``kind`` promises the routes (and the
    classification parameters belong to a classifier whose outputs they number)."""
    where = f"model '{cfg.name}'"
    kind = params.kind
    if kind != "classification" and (params.labels or params.problem_type):
        key = "label.<index>" if params.labels else "problem_type"
        raise ConfigError(f"{where}: parameter {key} is for kind 'classification', not '{kind}'")
    if kind is None:
        return
    outputs = {t.name: t for t in cfg.output}
    for name, dims in KIND_OUTPUTS[kind].items():
        t = outputs.get(name)
        got = list(t.dims) if t is not None else None
        ok = t is not None and dtypes.from_config(t.data_type) == "FP32" and len(got) == len(dims)
        ok = ok and all(want in ("any", "labels") or g == want for g, want in zip(got, dims))
        if ok and "labels" in dims:
            ok = got[0] > 0 and (not params.labels or got[0] == len(params.labels))
        if not ok:
            shape = "[labels]" if "labels" in dims else str([-1 if d == "any" else d for d in dims])
            counted = f" ({len(params.labels)} labels: parameters label.<index>)" if params.labels else ""
            have = f"{dtypes.from_config(t.data_type)} {got}" if t is not None else "no such output"
            raise ConfigError(
                f"{where}: parameter kind '{kind}' needs output '{name}' FP32 {shape}{counted}; the model's: {have}"
            )
    token = outputs.get(TOKEN_OUTPUT)
    if token is not None and (
        kind not in ("embedding", "multi_vector") or len(token.dims) != 2 or token.dims[0] != -1
    ):
        raise ConfigError(
            f"{where}: output '{TOKEN_OUTPUT}' is an embedding model's [-1, hidden] (tokens of the row); "
            f"this one is {list(token.dims)} on kind '{kind}'"
        )
    # BGE-M3: an embedding model may also answer sparse weights and say which token rows count.
    sparse, token_mask = outputs.get("sparse_embedding"), outputs.get(TOKEN_MASK_OUTPUT)
    if kind == "embedding" and sparse is not None and (len(sparse.dims) != 1 or sparse.dims[0] < 1):
        raise ConfigError(
            f"{where}: output 'sparse_embedding' is vocabulary-sized [n]; this one is {list(sparse.dims)}"
        )
    if token_mask is not None and (token is None or list(token_mask.dims) != [-1]):
        raise ConfigError(
            f"{where}: output '{TOKEN_MASK_OUTPUT}' is [-1] beside '{TOKEN_OUTPUT}' (which token rows are the "
            f"text's vectors); this one is {list(token_mask.dims)}"
            + ("" if token is not None else f" and the model has no '{TOKEN_OUTPUT}'")
        )
    if (
        params.query_length is not None or params.query_expansion_token_id is not None
    ) and kind != "multi_vector":
        raise ConfigError(
            f"{where}: parameters query_length and query_expansion_token_id are for kind 'multi_vector'"
        )
    if params.query_expansion_token_id is not None and params.query_length is None:
        raise ConfigError(
            f"{where}: parameter query_expansion_token_id pads queries up to query_length; set it too"
        )
    if params.score_weights is not None and not (
        kind == "embedding" and sparse is not None and token is not None
    ):
        raise ConfigError(
            f"{where}: parameter score_weights combines the outputs embedding, sparse_embedding and "
            f"{TOKEN_OUTPUT}; the model's: {sorted(outputs)}"
        )


def check_on_request(cfg: mc.ModelConfig, params: ModelParameters) -> None:
    """ConfigError unless ``on_request_outputs`` names config outputs and leaves at least one
    for a call that names none."""
    names = [t.name for t in cfg.output]
    for name in params.on_request_outputs:
        if name not in names:
            raise ConfigError(
                f"model '{cfg.name}': parameter on_request_outputs names no output '{name}'; the model's: {names}"
            )
    if names and set(names) <= set(params.on_request_outputs):
        raise ConfigError(
            f"model '{cfg.name}': parameter on_request_outputs names every output ({names}); leave at least "
            "one for calls that name none"
        )


def resolve_engine(cfg: mc.ModelConfig, params: ModelParameters) -> tuple[str, str]:
    """(engine, OpenVINO compute precision) from parameters ``engine``/``precision``, the variant
    and Triton's ``backend``; ConfigError for a contradiction or a missing package."""
    where = f"model '{cfg.name}'"
    ov_variant = params.variant.startswith("openvino-")
    implied = "openvino" if ov_variant or cfg.backend == "openvino" else "onnxruntime"
    engine = params.engine or implied
    if params.engine and params.engine != implied and (ov_variant or cfg.backend == "openvino"):
        why = f"variant '{params.variant}'" if ov_variant else "backend 'openvino'"
        raise ConfigError(f"{where}: engine '{params.engine}' contradicts {why}, which runs on OpenVINO")
    if engine == "onnxruntime":
        if params.precision == "bf16":
            raise ConfigError(f"{where}: precision 'bf16' needs engine 'openvino' (ONNX Runtime serves FP32 "
                              "or a variant built by `batchgate optimize`)")  # fmt: skip
        return engine, "fp32"
    if params.variant in ("optimized", "fp16", "int8", "int8-mixed"):
        raise ConfigError(
            f"{where}: variant '{params.variant}' is an ONNX Runtime graph; with engine 'openvino' serve fp32 "
            "or an openvino-* variant (`batchgate optimize --engine openvino`)"
        )
    try:
        openvino_engine.require()
    except openvino_engine.OpenVINOMissing as exc:
        raise ConfigError(f"{where}: {exc}") from None
    asked = {"openvino-fp32": "fp32", "openvino-bf16": "bf16"}.get(params.variant, params.precision)
    if params.variant in SAME_FILE_VARIANTS and params.precision not in ("auto", asked):
        raise ConfigError(f"{where}: precision '{params.precision}' contradicts variant '{params.variant}'")
    return engine, openvino_engine.resolve_precision(asked)


def model_identity(file_fp: str, engine: str, compute: str, variant: str) -> str:
    """What the result cache and the engine cache know a model by: the file's fingerprint alone for
    ONNX Runtime FP32 (its answers agree across CPUs to ~1e-7, so replicas on other CPUs share
    them); otherwise also the engine, the precision and the CPU's arithmetic class, so an answer of
    one precision (or of other BF16/INT8 kernels) is never served for another."""
    if engine == "onnxruntime" and VARIANT_PRECISION.get(variant, "FP32") == "FP32":
        return file_fp
    ident = f"{file_fp}|{engine}|{compute}|{variant}|{cpu_class()}"
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def load_repository(root: Path, default_max_batch_size: int = 64, choose=None) -> Repository:
    if not root.is_dir():
        raise FileNotFoundError(f"model repository {root} does not exist")
    repo = Repository(models={}, failures={})
    for model_dir in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))):
        try:
            specs = load_model(model_dir, default_max_batch_size, choose=choose)
        except ConfigError as exc:
            repo.failures[model_dir.name] = LoadFailure(model_dir.name, "", str(exc))
            log.error("model %s failed to load: %s", model_dir.name, exc)
            continue
        for path in specs[0].ignored:
            log.warning(
                "model %s: config field '%s' is not implemented by batchgate and is ignored",
                specs[0].name,
                path,
            )
        repo.models[model_dir.name] = {s.version: s for s in specs}
    return repo
