"""Choosing what serves: the variant a model serves now, and ``set_variant`` (``optimize --use``), which
writes it into the model's config and refuses a variant whose report did not pass."""

from __future__ import annotations

import os
import re
from pathlib import Path

from batchgate.gateway.models.optimize.options import OptimizeError, model_spec
from batchgate.gateway.repository import (
    CONFIG_FILE,
    VARIANT_PARAMETER,
    VARIANT_PRECISION,
    ConfigError,
    check_variant,
    load_model,
)


def serving_variant(model_dir: Path, version: str | None) -> str:
    try:
        specs = load_model(model_dir)
    except ConfigError:
        return "fp32"
    by_version = {s.version: s for s in specs}
    return (by_version.get(version) or specs[-1]).variant


_VARIANT_LINE = re.compile(
    r'^\s*parameters\s*\{\s*key:\s*"variant"\s*value\s*\{\s*string_value:\s*"[^"]*"\s*\}\s*\}\s*$'
)


def set_variant(model_dir: Path, variant: str, version: str | None = None) -> str:
    """Make ``variant`` what the model serves on its next load (config.pbtxt parameter
    ``variant``; ``fp32`` removes it). Refused, saying why, when that variant may not serve."""
    if variant not in VARIANT_PRECISION:
        raise OptimizeError(f"variant must be one of {', '.join(VARIANT_PRECISION)}, got '{variant}'")
    spec = model_spec(model_dir, version)
    try:
        check_variant(spec.name, spec.version, spec.path, variant)
    except ConfigError as exc:
        raise OptimizeError(str(exc)) from None
    cfg = model_dir / CONFIG_FILE
    text = cfg.read_text() if cfg.is_file() else ""
    lines = text.splitlines()
    kept = [ln for ln in lines if not _VARIANT_LINE.match(ln)]
    if any(f'"{VARIANT_PARAMETER}"' in ln for ln in kept):
        raise OptimizeError(
            f"{cfg}: parameter '{VARIANT_PARAMETER}' is written over several lines; set it by hand to "
            f'parameters {{ key: "{VARIANT_PARAMETER}" value {{ string_value: "{variant}" }} }}'
        )
    if variant != "fp32":
        kept.append(f'parameters {{ key: "{VARIANT_PARAMETER}" value {{ string_value: "{variant}" }} }}')
    tmp = cfg.with_name(f".{cfg.name}.tmp")
    tmp.write_text("\n".join(kept) + "\n")
    os.replace(tmp, cfg)
    return f"{spec.name}: serves {variant} ({VARIANT_PRECISION[variant]}) on its next load"
