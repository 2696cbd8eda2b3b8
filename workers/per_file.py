"""What is read off a model file once per version of that file: the fingerprint, the placement,
and every worker's pool and session factory ask about the same graph at start, and each parse
of a graph with inline weights costs (minilm's: docs/benchmarks.md, 2026-12-06)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def once_per_version(fn: Callable[[Path], T]) -> Callable[[Path], T]:
    """``fn(path)``, remembered per version of the file (inode, size, modification time): a file
    rewritten or replaced is read again. ``fn`` must return something immutable (it is shared)."""

    @functools.lru_cache(maxsize=64)
    def remembered(path: Path, _version: tuple[int, int, int]) -> T:
        return fn(path)

    @functools.wraps(fn)
    def read(path: Path) -> T:
        path = Path(path)
        try:
            st = path.stat()
        except OSError:  # no file: fn says what that means, and nothing is remembered
            return fn(path)
        return remembered(path, (st.st_ino, st.st_size, st.st_mtime_ns))

    return read
