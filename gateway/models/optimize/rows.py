"""The rows a candidate is calibrated and gated on: the shipped texts (``gateway/models/texts/``: the
held-out ones look like traffic and calibration never sees them), a user's ``.txt`` or ``.npz``, or
seeded synthetic rows for a model without text; each row at its own length."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from batchgate.gateway.models.optimize.options import OptimizeError, Options
from batchgate.gateway.repository import TOKEN_INPUTS, ModelSpec


TEXTS = Path(__file__).resolve().parent.parent / "texts"  # gateway/models/texts
CALIBRATION_TEXTS = TEXTS / "calibration.txt"
HELDOUT_TEXTS = TEXTS / "heldout.txt"
# Synthetic rows for models without text: calibration and held-out draw from other seeds.
CALIBRATION_SEED, HELDOUT_SEED = 1, 2
SYNTHETIC_ROWS = {"calibration": 256, "heldout": 512}


@dataclass(slots=True)
class Rows:
    """Model inputs, one row per feed at its own length (batch dim 1), and where they came from."""

    feeds: list[dict[str, np.ndarray]]
    source: str
    digest: str  # sha256 of the rows' bytes: the report names exactly what was measured
    kinds: list[str] | None = None  # per row, from the text file's `# kind: NAME` lines; None: one kind

    def __len__(self) -> int:
        return len(self.feeds)


def _digest(feeds: list[dict[str, np.ndarray]]) -> str:
    h = hashlib.sha256()
    for f in feeds:
        for k in sorted(f):
            h.update(k.encode())
            h.update(np.ascontiguousarray(f[k]).tobytes())
    return h.hexdigest()


def read_texts(path: Path) -> list[str]:
    """One text per line; blank lines and lines starting with '#' skipped."""
    return read_kinded_texts(path)[0]


_KIND = re.compile(r"^#\s*kind:\s*(\S+)\s*$")


def read_kinded_texts(path: Path) -> tuple[list[str], list[str]]:
    """The texts and, per text, its kind: the last ``# kind: NAME`` line above it ("text" before any)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise OptimizeError(f"cannot read texts from {path}: {exc}") from None
    texts, kinds, kind = [], [], "text"
    for line in lines:
        if line.startswith("#"):
            if m := _KIND.match(line):
                kind = m.group(1)
            continue
        if line.strip():
            texts.append(line)
            kinds.append(kind)
    if not texts:
        raise OptimizeError(f"{path} holds no texts (expected one text per line)")
    return texts, kinds


def _token_rows(spec: ModelSpec, texts: list[str]) -> list[dict[str, np.ndarray]]:
    """Token inputs for a text model (its tokenizer) or a token model without one (each word
    hashed into ``input_range.input_ids``, stable across runs and machines)."""
    names = spec.model_inputs
    max_len = spec.params.max_tokens or spec.params.max_dim.get("input_ids") or 512
    if spec.params.tokenizer:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(spec.path.parent.parent / spec.params.tokenizer))
        tok.no_padding()
        tok.enable_truncation(max_len)
        id_lists = [tok.encode(t).ids for t in texts]
    else:
        low, high = spec.params.input_range.get("input_ids", (None, None))
        if low is None:
            raise OptimizeError(
                f"model '{spec.name}': texts become token ids only through a tokenizer or within "
                "parameter input_range.input_ids; give --calibration/--heldout as .npz arrays instead"
            )
        lo, hi = int(max(low, 1)), int(high)  # id 0 is left for padding
        id_lists = []
        for t in texts:
            words = re.findall(r"\w+|[^\w\s]", t.lower())[:max_len] or ["."]
            ids = [
                lo + int.from_bytes(hashlib.blake2b(w.encode(), digest_size=8).digest()) % (hi - lo)
                for w in words
            ]
            id_lists.append(ids)
    feeds = []
    for ids in id_lists:
        arr = np.asarray([ids], np.int64)
        row = {"input_ids": arr}
        if "attention_mask" in names:
            row["attention_mask"] = np.ones_like(arr)
        if "token_type_ids" in names:
            row["token_type_ids"] = np.zeros_like(arr)
        feeds.append(row)
    return feeds


def _synthetic_rows(spec: ModelSpec, n: int, seed: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    cols: dict[str, np.ndarray] = {}
    for t in spec.inputs:
        if any(d < 0 for d in t.dims):
            raise OptimizeError(
                f"model '{spec.name}': input '{t.name}' has variable dims {list(t.dims)}; synthetic rows need "
                "fixed dims: give --calibration/--heldout as .npz arrays (one array per input, rows on axis 0)"
            )
        shape = (n, *t.dims)
        if np.issubdtype(t.dtype, np.floating):
            cols[t.name] = rng.standard_normal(shape).astype(t.dtype)
        elif t.name in spec.params.input_range:
            lo, hi = spec.params.input_range[t.name]
            cols[t.name] = rng.integers(int(lo), int(hi), shape).astype(t.dtype)
        else:
            raise OptimizeError(
                f"model '{spec.name}': integer input '{t.name}' has no parameter input_range.{t.name} to draw "
                "synthetic rows from; give --calibration/--heldout as .npz arrays"
            )
    return [{k: v[i : i + 1] for k, v in cols.items()} for i in range(n)]


def _npz_rows(spec: ModelSpec, path: Path) -> list[dict[str, np.ndarray]]:
    try:
        with np.load(path) as data:
            cols = {k: data[k] for k in data.files}
    except (OSError, ValueError) as exc:
        raise OptimizeError(f"cannot read {path} as .npz arrays: {exc}") from None
    want = list(spec.model_inputs)
    missing = [k for k in want if k not in cols]
    if missing:
        raise OptimizeError(
            f"{path} lacks arrays {missing}; expected one per model input {want}, rows on axis 0"
        )
    n = {len(cols[k]) for k in want}
    if len(n) != 1 or 0 in n:
        raise OptimizeError(
            f"{path}: the arrays {want} must hold the same number (>= 1) of rows, got {sorted(n)}"
        )
    return [{k: np.ascontiguousarray(cols[k][i : i + 1]) for k in want} for i in range(n.pop())]


def _is_token_model(spec: ModelSpec) -> bool:
    return "input_ids" in spec.model_inputs and all(n in TOKEN_INPUTS for n in spec.model_inputs)


def model_rows(spec: ModelSpec, which: str, path: Path | None = None) -> Rows:
    """The calibration or held-out rows of ``spec``: from ``path`` when given, else the shipped
    sentences (text and token models) or seeded synthetic rows."""
    if path is not None and path.suffix == ".npz":
        feeds, source = _npz_rows(spec, path), str(path)
    elif path is not None or _is_token_model(spec):
        if path is not None and not _is_token_model(spec):
            raise OptimizeError(f"model '{spec.name}' takes no text; give {path.name} as .npz arrays")
        src = path or (CALIBRATION_TEXTS if which == "calibration" else HELDOUT_TEXTS)
        shipped = path is None
        texts, kinds = read_kinded_texts(src)
        feeds = _token_rows(spec, texts)
        source = f"gateway/models/texts/{src.name} (shipped)" if shipped else str(src)
        return Rows(feeds, source, _digest(feeds), kinds if len(set(kinds)) > 1 else None)
    else:
        seed = CALIBRATION_SEED if which == "calibration" else HELDOUT_SEED
        feeds = _synthetic_rows(spec, SYNTHETIC_ROWS[which], seed)
        source = f"synthetic, seed {seed} (floats N(0,1), integers uniform in input_range)"
    return Rows(feeds, source, _digest(feeds))


def calibration_and_heldout(spec: ModelSpec, opts: Options) -> tuple[Rows, Rows]:
    calib = model_rows(spec, "calibration", opts.calibration)
    held = model_rows(spec, "heldout", opts.heldout)
    if calib.digest == held.digest:
        raise OptimizeError(
            "the held-out rows are the calibration rows; the gate needs rows calibration never saw"
        )
    return calib, held


def pad_batch(feeds: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Rows of other lengths as one batch padded to the longest (0: an attention mask's padding)."""
    out = {}
    for k in feeds[0]:
        arrs = [f[k] for f in feeds]
        shape = [max(a.shape[d] for a in arrs) for d in range(1, arrs[0].ndim)]
        batch = np.zeros((len(arrs), *shape), arrs[0].dtype)
        for i, a in enumerate(arrs):
            batch[(i, *(slice(0, s) for s in a.shape[1:]))] = a[0]
        out[k] = batch
    return out


def row_len(feed: dict[str, np.ndarray]) -> int:
    return max(int(np.prod(v.shape[1:])) for v in feed.values())
