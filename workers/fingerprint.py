"""The one fingerprint of a model file: what the result cache keys, engine cache names and the
reload log say a model *is*. Its own module so that reading a repository (gateway/repository.py)
does not import ONNX Runtime."""

from __future__ import annotations

import hashlib
from pathlib import Path


def file_fingerprint(path: Path) -> str:
    """sha256 of the file's bytes, first 16 hex digits (read in 1 MiB chunks)."""
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]
