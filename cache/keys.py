"""Per-row cache keys: one 128-bit xxh3 hash per row.

A row's key is ``xxh3_128(prefix || row)``. The 16-byte ``prefix`` is itself the xxh3-128 of what
all rows of one request share: the key format, model name, version and model-file fingerprint,
the outputs stored, each input's name, dtype and non-batch shape, and the tenant namespace, each
written length-prefixed so that no two different tuples encode alike. ``row`` is that row's
bytes of every input, in the model's input order (not the request's).

Identity is by bytes: ``-0.0`` and ``0.0`` are different rows, as are two NaN payloads. Typed
``contents`` and raw inputs of the same values decode to the same bytes, so they share keys.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np
import xxhash

# Bump when the key derivation or the stored value layout changes: old entries then simply miss.
FORMAT = b"batchgate-rc/1"
KEY_BYTES = 16

_LEN = struct.Struct("<I")
_digest = xxhash.xxh3_128_digest


def model_prefix(
    model: str,
    version: str,
    fingerprint: str,
    outputs: Sequence[str],
    inputs: Sequence[tuple[str, str, tuple[int, ...]]],
    namespace: str | None = None,
) -> bytes:
    """The 16 bytes every row key of one request starts from.

    ``inputs`` are ``(name, datatype, non-batch shape)`` in the model's input order; ``outputs``
    the names of the outputs the cached value holds; ``namespace`` separates tenants that must
    not share results (None and "" are different namespaces).
    """
    h = xxhash.xxh3_128()

    def put(b: bytes) -> None:
        h.update(_LEN.pack(len(b)))
        h.update(b)

    put(FORMAT)
    put(model.encode())
    put(version.encode())
    put(fingerprint.encode())
    if namespace is None:
        put(b"\x00")
    else:
        put(b"\x01" + namespace.encode())
    h.update(_LEN.pack(len(outputs)))
    for name in outputs:
        put(name.encode())
    h.update(_LEN.pack(len(inputs)))
    for name, datatype, shape in inputs:
        put(name.encode())
        put(datatype.encode())
        put(struct.pack(f"<{len(shape)}q", *shape))
    return h.digest()


def prefix_rows(prefix: bytes, rows: int) -> np.ndarray:
    """``prefix`` repeated on ``rows`` rows, for ``row_keys`` (a caller keeps one per prefix)."""
    return np.tile(np.frombuffer(prefix, np.uint8), (max(rows, 1), 1))


def row_keys(
    prefix: bytes, columns: Sequence[np.ndarray], rows: int, tiled: np.ndarray | None = None
) -> list[bytes]:
    """Keys of ``rows`` rows whose inputs are fixed-size numbers.

    ``columns`` holds each input (first dim = rows; no BYTES) in the model's input order. The
    rows are laid side by side behind the prefix in one buffer (one copy), then hashed once each.
    ``tiled``: ``prefix_rows(prefix, n)`` for some n >= rows, to save building it per call.
    """
    if tiled is None or len(tiled) < rows:
        tiled = prefix_rows(prefix, rows)
    buf = np.concatenate(
        [tiled[:rows], *(np.ascontiguousarray(c).reshape(rows, -1).view(np.uint8) for c in columns)], axis=1
    )
    width = buf.shape[1]
    mv = memoryview(buf).cast("B")
    d = _digest
    return [d(mv[o : o + width]) for o in range(0, rows * width, width)]


def row_keys_parts(prefix: bytes, columns: Sequence[Sequence[bytes]], rows: int) -> list[bytes]:
    """Keys of rows given as per-input byte strings of any length (the path for BYTES inputs).

    ``columns[i][r]`` is row ``r`` of input ``i``; each part is length-prefixed, since variable
    lengths would otherwise let two different rows concatenate alike.
    """
    base = xxhash.xxh3_128(prefix)
    pack = _LEN.pack
    out = []
    for r in range(rows):
        h = base.copy()
        for col in columns:
            part = col[r]
            h.update(pack(len(part)))
            h.update(part)
        out.append(h.digest())
    return out
