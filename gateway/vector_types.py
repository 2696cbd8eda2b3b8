"""Quantised embedding outputs: Cohere's ``embedding_types`` (float, int8, uint8, binary, ubinary),
each the same bytes sentence-transformers' ``quantize_embeddings`` makes of the float vectors.

- ``binary`` / ``ubinary``: one bit per dimension, set where the value is > 0, packed eight to a
  byte, first dimension in the highest bit (``np.packbits``): ``ubinary`` as unsigned bytes,
  ``binary`` the same bytes offset by −128 into int8, as Cohere answers them. No calibration.
- ``int8`` / ``uint8``: each dimension's calibrated range [min, max] cut into 256 equal steps
  (``floor((x - min) / step)``, clipped to 0..255; ``int8`` is that minus 128). The ranges come from
  the model's own float vectors of held-out rows (``Ranges.calibrate``), once per model, kept beside
  its ONNX file as ``vector_ranges.json`` (``RANGES_FILE``), which says how it was made.

Matryoshka: a vector cut to its leading ``size`` values is re-normalised (``cut``), which scales
every value by 1/‖x[:size]‖, so the full vectors' ranges of those dimensions do not fit the cut
ones (minilm cut to 64: a quarter of the values clipped to 0 or 255). The file keeps one range per
size the model serves, each calibrated on the same rows cut and re-normalised exactly as served;
``Ranges.for_size`` picks it, and ``ensure`` recalibrates a file that lacks a size the model now
declares.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

KINDS = ("float", "int8", "uint8", "binary", "ubinary")
CALIBRATED = ("int8", "uint8")  # the kinds that need ranges
RANGES_FILE = "vector_ranges.json"
FORMAT = 1
# The held-out sentences shipped with batchgate (everyday text, then punctuation, digits, URLs,
# code, emoji, other scripts, texts cut at a model's length): what calibration embeds by default.
TEXTS_DIR = Path(__file__).resolve().parent / "models" / "texts"
BATCH_ROWS = 32  # rows per embed() call while calibrating: bounds the padded batch's memory


def cut(vectors: np.ndarray, size: int | None) -> np.ndarray:
    """Matryoshka: the leading ``size`` values of each row, re-normalised to unit length (None:
    the vectors as they are). The one cut the served vectors and the calibration both use."""
    if size is None or size == vectors.shape[-1]:
        return vectors
    head = vectors[:, :size].astype(np.float32)
    return (head / np.maximum(np.linalg.norm(head, axis=1, keepdims=True), 1e-12)).astype(np.float32)


def quantize(vectors: np.ndarray, kind: str, ranges: np.ndarray | None = None) -> np.ndarray:
    """``vectors`` (rows × dims, float) as ``kind``: float32 for ``float``; int8/uint8 rows × dims
    given ``ranges`` (2 × dims: each dimension's min, then max; ``Ranges.for_size``); int8/uint8
    rows × ceil(dims / 8) for ``binary``/``ubinary``. Bit for bit sentence-transformers'
    ``quantize_embeddings(vectors, kind, ranges=ranges)`` (``float`` is its ``float32``)."""
    v = np.asarray(vectors, dtype=np.float32)
    if kind == "float":
        return v
    if kind == "ubinary":
        return np.packbits(v > 0, axis=-1)
    if kind == "binary":
        # packed - 128 as int8 (sentence-transformers, Cohere): the same as flipping the top bit
        return (np.packbits(v > 0, axis=-1) ^ np.uint8(0x80)).view(np.int8)
    if kind in CALIBRATED:
        if ranges is None:
            raise ValueError(f"{kind} vectors need the model's calibrated ranges (vector_types.Ranges)")
        r = np.asarray(ranges, dtype=np.float32)
        if r.shape != (2, v.shape[-1]):
            raise ValueError(f"ranges of shape {r.shape} do not fit {v.shape[-1]}-dim vectors (2 × dims)")
        # the same float32 steps as sentence-transformers, so each value lands in the same bucket
        starts = r[0]
        steps = (r[1] - starts) / 255
        steps = np.where(steps == 0, 1, steps)
        buckets = np.clip(np.floor((v - starts) / steps), 0, 255)
        return buckets.astype(np.uint8) if kind == "uint8" else (buckets - 128).astype(np.int8)
    raise ValueError(f"embedding type must be one of {', '.join(KINDS)}, got {kind!r}")


def read_texts(paths: Iterable[Path]) -> list[str]:
    """One text per line of each file; blank lines and ``#`` lines skipped (gateway/models/texts'
    format, whose ``# kind:`` lines only label the rows below them)."""
    texts = []
    for path in paths:
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            if line.strip() and not line.startswith("#"):
                texts.append(line)
    return texts


# Rows a line of those files cannot hold: a whitespace-only text (a splitter's empty chunk), which
# TEI and sentence-transformers embed as [CLS][SEP], a vector unlike any sentence's.
EXTRA_ROWS = (" ",)


def default_texts() -> tuple[list[str], dict]:
    """The shipped held-out sentences (gateway/models/texts/*.txt, then ``EXTRA_ROWS``) and where
    they came from."""
    # not tuning.txt: int8-mixed's own rows, kept apart from the held-out ones (models/optimize/mixed.py)
    files = [TEXTS_DIR / "calibration.txt", TEXTS_DIR / "heldout.txt"]
    texts = read_texts(files) + list(EXTRA_ROWS)
    source = {"files": [f"gateway/models/texts/{f.name}" for f in files], "extra": list(EXTRA_ROWS)}
    return texts, {**source, "sha256": _digest(texts)}


def _digest(texts: Sequence[str]) -> str:
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode())
        h.update(b"\n")
    return h.hexdigest()


@dataclass(frozen=True)
class Ranges:
    """One model's calibrated per-dimension ranges, one (2 × size) array per size it serves."""

    by_size: Mapping[int, np.ndarray]  # size -> float32 [[min...], [max...]]
    rows: int
    made: str  # UTC time of the calibration, ISO 8601
    texts: Mapping = field(default_factory=dict)  # files, sha256 of the rows
    model: Mapping = field(default_factory=dict)  # what was embedded (caller's identity of the model)
    file: Path | None = None  # where it was loaded from or saved to

    @classmethod
    def calibrate(
        cls,
        embed: Callable[[list[str]], np.ndarray],
        texts: Sequence[str] | None = None,
        sizes: Iterable[int] = (),
        model: Mapping | None = None,
        source: Mapping | None = None,
    ) -> Ranges:
        """Ranges from ``embed`` (texts -> rows × dims float vectors, as the model serves them at
        full size) of ``texts`` (default: ``default_texts()``): the per-dimension min and max, for
        the full size and for each Matryoshka ``size`` below it (the same vectors ``cut``)."""
        if texts is None:
            texts, source = default_texts()
        texts = list(texts)
        if len(texts) < 2:
            raise ValueError("calibration needs at least 2 texts (ranges of one vector are empty)")
        # similar lengths batched together: a batch pads to its longest row, and min/max care
        # nothing for the order
        by_length = sorted(texts, key=len)
        parts = []
        for i in range(0, len(by_length), BATCH_ROWS):
            batch = by_length[i : i + BATCH_ROWS]
            part = np.asarray(embed(batch), np.float32)
            if part.ndim != 2 or part.shape[0] != len(batch):
                raise ValueError(f"embed() gave {part.shape} for {len(batch)} texts (expected rows × dims)")
            parts.append(part)
        texts_info = dict(source or {})
        texts_info.setdefault("sha256", _digest(texts))
        return cls.from_vectors(np.concatenate(parts), sizes, model, texts_info)

    @classmethod
    def from_vectors(
        cls,
        vectors: np.ndarray,
        sizes: Iterable[int] = (),
        model: Mapping | None = None,
        texts: Mapping | None = None,
    ) -> Ranges:
        """Ranges of float ``vectors`` (the calibration rows, full size, as served), for the full
        size and each Matryoshka ``size`` below it: for a caller that embeds by itself (an async
        pipeline; ``calibrate`` embeds through a plain function). ``texts``: what the rows were."""
        vectors = np.asarray(vectors, np.float32)
        if vectors.ndim != 2 or vectors.shape[0] < 2:
            raise ValueError(f"calibration needs rows × dims vectors of at least 2 rows, got {vectors.shape}")
        full = vectors.shape[1]
        by_size = {}
        for size in sorted({full, *(s for s in sizes if 0 < s < full)}):
            v = cut(vectors, size)
            by_size[size] = np.vstack((v.min(axis=0), v.max(axis=0))).astype(np.float32)
        made = dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")
        return cls(by_size, vectors.shape[0], made, dict(texts or {}), dict(model or {}))

    def for_size(self, size: int) -> np.ndarray:
        """The (2 × size) ranges of vectors served at ``size`` dimensions."""
        try:
            return self.by_size[size]
        except KeyError:
            raise KeyError(
                f"vector ranges hold sizes {sorted(self.by_size)}, not {size}: recalibrate (vector_types.ensure)"
            ) from None

    def covers(self, sizes: Iterable[int]) -> bool:
        return all(s in self.by_size for s in sizes)

    def describe(self) -> dict:
        """What ``/info`` says of the ranges: the file, its rows, when and from what it was made."""
        return {
            "file": self.file.name if self.file else None,
            "rows": self.rows,
            "made": self.made,
            "sizes": sorted(self.by_size),
            "texts": dict(self.texts),
            "how": HOW,
        }

    def save(self, path: Path) -> Ranges:
        """Write the file (atomically: a reader never sees half of it); the Ranges with its file."""
        path = Path(path)
        doc = {
            "format": FORMAT,
            "how": HOW,
            "made": self.made,
            "rows": self.rows,
            "texts": dict(self.texts),
            "model": dict(self.model),
            # float32 values written as the float64 they are exactly, so a load gives the same bits
            "sizes": {
                str(s): {"min": r[0].astype(np.float64).tolist(), "max": r[1].astype(np.float64).tolist()}
                for s, r in sorted(self.by_size.items())
            },
        }
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        os.replace(tmp, path)
        return Ranges(self.by_size, self.rows, self.made, self.texts, self.model, path)

    @classmethod
    def load(cls, path: Path) -> Ranges:
        """The ranges saved at ``path``; ValueError naming the file and what is wrong."""
        path = Path(path)
        try:
            doc = json.loads(path.read_text())
            if doc.get("format") != FORMAT:
                raise ValueError(f"format {doc.get('format')!r}, expected {FORMAT}")
            by_size = {}
            for key, r in doc["sizes"].items():
                size = int(key)
                if len(r["min"]) != size or len(r["max"]) != size:
                    raise ValueError(f"size {size}: expected {size} finite min <= max pairs")
                arr = np.array([r["min"], r["max"]], dtype=np.float32)
                if not np.isfinite(arr).all() or (arr[0] > arr[1]).any():
                    raise ValueError(f"size {size}: expected {size} finite min <= max pairs")
                by_size[size] = arr
            if not by_size:
                raise ValueError("no sizes")
            return cls(
                by_size, int(doc["rows"]), str(doc["made"]), doc.get("texts", {}), doc.get("model", {}), path
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) else f"{type(exc).__name__}: {exc}"
            raise ValueError(f"vector ranges {path}: {why}") from None


HOW = (
    "per-dimension min and max of the model's float vectors of held-out rows (one range per served "
    "size, the rows cut and re-normalised as served); int8/uint8 = sentence-transformers' "
    "quantize_embeddings(vectors, precision, ranges=these)"
)


def usable(
    version_dir: Path, sizes: Iterable[int] = (), model: Mapping | None = None
) -> tuple[Ranges | None, str]:
    """The model's saved ranges when they can serve it — made from the same ``model`` identity
    (e.g. its ONNX file's name and sha256) and holding every size in ``sizes`` — else None; and
    why not ("missing", "made from another model file", ...)."""
    path = Path(version_dir) / RANGES_FILE
    if not path.is_file():
        return None, "missing"
    try:
        found = Ranges.load(path)
    except ValueError as exc:
        return None, str(exc)
    full = max(found.by_size)
    if dict(found.model) != dict(model or {}):
        return None, "made from another model file"
    if not found.covers(s for s in sizes if s < full):
        return None, f"sizes {sorted(found.by_size)} lack some of {sorted(sizes)}"
    return found, ""


def ensure(
    version_dir: Path,
    embed: Callable[[list[str]], np.ndarray],
    sizes: Iterable[int] = (),
    model: Mapping | None = None,
    texts: Sequence[str] | None = None,
    log: Callable[[str], None] | None = None,
) -> Ranges:
    """The model's ranges: its ``vector_ranges.json`` when ``usable``; else calibrated now with
    ``embed`` (blocking: run it off the event loop) and saved there (a read-only directory keeps
    them in memory only, said in the log)."""
    sizes = tuple(sizes)
    found, stale = usable(version_dir, sizes, model)
    if found is not None:
        return found
    return save_beside(Path(version_dir), Ranges.calibrate(embed, texts, sizes, model), stale, log)


def save_beside(
    version_dir: Path, ranges: Ranges, stale: str = "", log: Callable[[str], None] | None = None
) -> Ranges:
    """``ranges`` saved as the model's ``vector_ranges.json`` (kept in memory when it cannot be)."""
    path = Path(version_dir) / RANGES_FILE
    try:
        ranges = ranges.save(path)
    except OSError as exc:
        if log:
            log(f"vector ranges not saved to {path} ({exc.strerror}): kept in memory")
        return ranges
    if log:
        log(f"vector ranges {path} calibrated on {ranges.rows} rows ({stale or 'asked'} before)")
    return ranges
