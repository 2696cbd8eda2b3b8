"""A file's version, and what is read off a model file once per version: the fingerprint, the
placement, and every worker's pool and session factory ask about the same graph at start, and
each parse of a graph with inline weights costs (minilm's: docs/benchmarks.md, 2026-12-06)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def file_version(path) -> tuple:
    """What says a file changed: its inode, size and modification time (following symlinks, as a
    mounted Secret's ``..data`` link is swapped); () when it cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return ()
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def once_per_version(fn: Callable[[Path], T]) -> Callable[[Path], T]:
    """``fn(path)``, remembered per version of the file (inode, size, modification time): a file
    rewritten or replaced is read again. ``fn`` must return something immutable (it is shared)."""

    @functools.lru_cache(maxsize=64)
    def remembered(path: Path, _version: tuple) -> T:
        return fn(path)

    @functools.wraps(fn)
    def read(path: Path) -> T:
        path = Path(path)
        version = file_version(path)
        if not version:  # no file: fn says what that means, and nothing is remembered
            return fn(path)
        return remembered(path, version)

    return read
