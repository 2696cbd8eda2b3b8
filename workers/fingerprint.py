"""The one fingerprint of a model file: what the result cache keys, engine cache names and the
reload log say a model *is*. Its own module so that reading a repository (gateway/repository.py)
does not import ONNX Runtime."""

from __future__ import annotations

import hashlib
from pathlib import Path

import onnx
from onnx.external_data_helper import ExternalDataInfo, _get_all_tensors, uses_external_data

from batchgate.workers.per_file import once_per_version


def file_fingerprint(path: Path) -> str:
    """sha256 of the file's bytes, then of each external data file its tensors name (sorted),
    first 16 hex digits: a changed weights file beside the graph is a different model. A file
    without external data keeps the digest of its bytes alone."""
    h = hashlib.sha256()
    _hash_file(h, Path(path))
    for data in external_files(path):
        h.update(b"\0" + data.name.encode() + b"\0")
        _hash_file(h, data)
    return h.hexdigest()[:16]


def external_files(path: Path) -> list[Path]:
    """The external data files the ONNX graph at ``path`` reads its tensors from (ONNX resolves
    their locations beside the graph), sorted; empty for a single-file model or one that is not
    ONNX. Parses the graph, not the weights, once per version of the file (workers/per_file.py)."""
    return list(_external_files(Path(path)))


@once_per_version
def _external_files(path: Path) -> tuple[Path, ...]:
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception:  # not an ONNX file (the caller's loader says what is wrong with it)
        return ()
    names = {ExternalDataInfo(t).location for t in _get_all_tensors(model) if uses_external_data(t)}
    return tuple(sorted(path.parent / n for n in names))


def _hash_file(h, path: Path) -> None:
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
