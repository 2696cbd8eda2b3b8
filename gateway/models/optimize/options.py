"""What ``batchgate optimize`` is asked: the variants it builds, its options, and the model version they
apply to, checked before anything is built."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from batchgate.workers.fingerprint import external_files

from batchgate.gateway.models.thresholds import METHODS, SCALES, Thresholds
from batchgate.gateway.repository import CONFIG_FILE, ConfigError, ModelSpec, load_model


VARIANTS = ("optimized", "fp16", "int8", "openvino-fp32", "openvino-bf16", "openvino-int8", "int8-mixed")
Log = Callable[[str], None]


class OptimizeError(Exception):
    """The variant cannot be built as asked; the message names the input and what was expected."""


@dataclass(slots=True)
class Options:
    variant: str
    version: str | None = None  # None: the latest version served
    calibration: Path | None = None  # .txt (one text per line) or .npz (arrays by input name)
    heldout: Path | None = None
    scales: str = "row"  # INT8 activations: "row" (each row's own scale, at run time) or "static"
    method: str = "percentile"  # static scales' calibration
    percentile: float = 99.999
    per_channel: bool = True
    weights: str = "auto"  # INT8 weights stored as "int8", "uint8" (around 128), or "auto" for this CPU
    fallback: bool = True  # keep the measured-worst nodes in FP32
    thresholds: Thresholds = field(default_factory=Thresholds)
    force: bool = False
    core: int | None = None  # the core the timing runs on; None: the first this process may use
    timing_repeats: int = 3
    memory: bool = True  # RSS of each loaded engine, in a child process each
    search_rows: int = 48  # calibration rows per candidate in the sensitivity scan
    smooth: float = 0.8  # INT8: SmoothQuant's alpha (0: off)
    command: str = ""


def model_spec(model_dir: Path, version: str | None) -> ModelSpec:
    if not (model_dir / CONFIG_FILE).is_file() and not model_dir.is_dir():
        raise OptimizeError(f"no model directory {model_dir}")
    try:
        specs = load_model(model_dir, variant="fp32")
    except ConfigError as exc:
        raise OptimizeError(str(exc)) from None
    by_version = {s.version: s for s in specs}
    if version is not None and version not in by_version:
        raise OptimizeError(
            f"model '{model_dir.name}' serves no version {version} (it serves {sorted(by_version)})"
        )
    spec = specs[-1] if version is None else by_version[version]
    data = external_files(spec.path)
    if data:
        # Each variant and its gate report name one file (the report's sha256 is the staleness
        # check); a variant of a model past 2 GiB would need its own weights file beside it.
        raise OptimizeError(
            f"model '{spec.name}' version {spec.version}: {spec.path.name} keeps its weights in "
            f"{', '.join(d.name for d in data)} (ONNX external data, as a model past 2 GiB must), and "
            "`batchgate optimize` builds variants of single-file models only; serve the original "
            "(parameters engine 'openvino' and precision 'bf16' run it through OpenVINO without a variant)"
        )
    return spec


def check_options(opts: Options) -> None:
    if opts.variant not in VARIANTS:
        raise OptimizeError(f"variant must be one of {', '.join(VARIANTS)}, got '{opts.variant}'")
    if opts.scales not in SCALES:
        raise OptimizeError(f"INT8 scales must be one of {', '.join(SCALES)}, got '{opts.scales}'")
    if opts.method not in METHODS:
        raise OptimizeError(f"calibration method must be one of {', '.join(METHODS)}, got '{opts.method}'")
    if not 0 < opts.percentile <= 100:
        raise OptimizeError(f"percentile must be in (0, 100], got {opts.percentile}")
    if opts.variant.startswith("openvino-"):
        from batchgate.workers import openvino_engine

        if not openvino_engine.available():
            raise OptimizeError(f"{opts.variant} runs on OpenVINO, which is not installed: "
                                "pip install 'batchgate[openvino]'")  # fmt: skip
