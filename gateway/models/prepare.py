"""``batchgate prepare-model``'s one entry: prepares a model folder or Hugging Face model ID.

SOURCE is resolved (a folder, or a Hub ID through the hub cache: ``sources.py``); the graph is
built from the weights where the builder knows the architecture (``hf_model.py``), else the
folder's ONNX export is served with the head appended (``onnx_export.py``).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

from batchgate.gateway.models import sources
from batchgate.gateway.models.hf_model import (
    Log,
    PrepareError,
    _architecture,
    _json,
    _modules,
    prepare_weights,
)
from batchgate.gateway.models.onnx_export import EXPORT_HINT, find_onnx, prepare_export

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def prepare_model(source: str | Path, name: str, repo: Path, *, pooling: str | None = None,
                  normalize: bool | None = None, revision: str | None = None, from_onnx: bool = False,
                  onnx_file: Path | None = None, text_pair: bool | None = None,
                  token_embeddings: bool = False, reranker: bool | None = None, log: Log = print) -> Path:  # fmt: skip
    """Write ``<repo>/<name>`` from ``source`` (a folder, or a Hugging Face model ID resolved
    through the hub cache: gateway/models/sources.py); returns the model directory. The weights
    are built into a graph when the builder knows the architecture; a folder carrying an ONNX
    export is served from that export otherwise (gateway/models/onnx_export.py), or always with
    ``from_onnx`` / ``onnx_file``. Raises PrepareError (one line) when the folder is not one
    this build serves faithfully. ``reranker``: a Qwen3 folder is Qwen3-Reranker (default: when
    its folder name or Hub ID says "reranker")."""
    if not _NAME.fullmatch(name):
        raise PrepareError(f"--name '{name}': a model name is letters, digits, '_', '.' and '-'")
    t0 = time.monotonic()
    try:
        source = sources.resolve(source, revision, log=log)
    except sources.SourceError as exc:
        raise PrepareError(str(exc)) from None
    if from_onnx or onnx_file is not None or _export_only(source):
        return prepare_export(
            source, name, repo, onnx_file=onnx_file, pooling=pooling, normalize=normalize, log=log, t0=t0
        )
    return prepare_weights(source, name, repo, pooling=pooling, normalize=normalize, text_pair=text_pair,
                           token_embeddings=token_embeddings, reranker=reranker, log=log, t0=t0)  # fmt: skip


def _export_only(folder: Path) -> bool:
    """Whether the folder is served from its ONNX export: it has one, and the builder does not
    know its architecture (or has no safetensors weights to build from). An architecture
    neither covers is refused with the way forward appended."""
    if not folder.is_dir():
        return False  # read_folder says what it is
    modules = _modules(folder)
    model_dir = modules.transformer if modules else folder
    has_export = find_onnx(model_dir, folder) is not None
    config = _json(model_dir / "config.json", required=has_export is False)
    if config is None:
        return True
    try:
        _architecture(config, model_dir / "config.json")
    except PrepareError as exc:
        if has_export:
            return True
        raise PrepareError(f"{exc}; {EXPORT_HINT}") from None
    weights = (model_dir / "model.safetensors").is_file() or (
        model_dir / "model.safetensors.index.json"
    ).is_file()
    return has_export and not weights


def run(args: argparse.Namespace) -> int:
    """``batchgate prepare-model``: 0; 2 for a folder it refuses, 1 for a failure; one line on stderr."""
    try:
        prepare_model(
            args.source,
            args.name,
            args.model_repository,
            pooling=args.pooling,
            normalize=args.normalize,
            revision=args.revision,
            from_onnx=args.from_onnx,
            onnx_file=args.onnx,
            text_pair=args.text_pair,
            token_embeddings=args.token_embeddings,
            reranker=getattr(args, "reranker", None),
        )
    except PrepareError as exc:
        print(f"batchgate prepare-model: {str(exc).replace(chr(10), ' ')}", file=sys.stderr)
        return 2
    except Exception as exc:  # an I/O or build failure: one line too, as prepare-minilm says it
        print(f"batchgate prepare-model: {type(exc).__name__}: {exc}".replace("\n", " "), file=sys.stderr)
        return 1
    return 0
