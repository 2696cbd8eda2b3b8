"""``batchgate optimize``: engine variants beside a model's original, each behind an accuracy gate.

A variant is built offline into the version folder of the model it came from
(``<model>/<version>/model.<variant>.onnx``) with its evaluation report beside it
(``model.<variant>.report.json`` / ``.md`` / ``.png``):

* ``optimized``: ONNX Runtime's transformer optimiser (``onnxruntime.transformers.optimizer``),
  FP32; the report lists the fusions that happened.
* ``int8``: INT8 weights (per output channel) and INT8 activations, in one of two forms:

  - ``row`` scales (the default): each activation row (a token) gets its own scale at run time,
    max|row| / 127, so a row's answer never depends on its batch-mates or its padding, and no
    calibration of ranges is needed (``row_int8``). ONNX Runtime's own dynamic quantisation
    (``dynamic``) is built only to be refused: it computes one scale over the whole batch tensor, so
    a text would get another vector beside a long or odd neighbour (measured: cosine 0.991 to itself
    alone, docs/engines.md), the result cache would keep whichever came first, and the gate's batch
    figure says so.
  - ``static`` scales: QDQ (``onnxruntime.quantization.quantize_static``), UINT8 activations with
    ranges calibrated once on calibration inputs (percentile by default, entropy or min/max).

  Both first fold SmoothQuant into the weights (outlier channels scaled down) and keep the nodes
  that damage the answer most in FP32. Which nodes those are is measured, not listed: each
  quantisable node is quantised alone and its damage to the output on the calibration inputs
  measured; then the worst are kept in FP32, one at a time, until the whole model meets the
  accuracy targets on the calibration inputs.
* ``fp16``: ``onnxruntime.transformers.float16`` with FP32 inputs and outputs kept; op types whose
  FP16 kernels ONNX Runtime lacks, or whose FP16 form misses the targets on the calibration inputs,
  stay FP32 (measured, one type at a time). Built and checked for accuracy here; its speed is a
  GPU's question (ORT runs FP16 graphs on a CPU slowly).

The gate: on a held-out set that calibration never saw (``texts/heldout.txt`` for text models,
other seeds for synthetic inputs), in one run, the variant against the original: accuracy
(embeddings: cosine per row, min and mean, nearest-neighbour agreement; scores: max abs/rel error,
pairwise rank agreement), batch independence (a row alone and padded into a batch of other
lengths), p50/p99 latency and rows/s on one pinned core, and the RSS of each loaded engine. A
variant that misses a threshold is not written (``force`` writes it, its report marked failed,
and the repository refuses to serve it). Same inputs give the same model bytes.

Only the CLI imports this module (and the tests and benches).
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import hashlib
import importlib.util
import json
import logging
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from dataclasses import replace as dataclass_replace
from pathlib import Path

import numpy as np
import onnx

from batchgate.workers.devices import cpu_class
from batchgate.workers.fingerprint import external_files

from batchgate.gateway.build.thresholds import METHODS, NN_TIE, SCALES, Thresholds
from batchgate.gateway.repository import (
    CONFIG_FILE,
    TOKEN_INPUTS,
    VARIANT_PARAMETER,
    VARIANT_PRECISION,
    ConfigError,
    SAME_FILE_VARIANTS,
    TOKEN_MASK_OUTPUT,
    TOKEN_OUTPUT,
    ModelSpec,
    check_variant,
    load_model,
    report_path,
    sha256_file,
    variant_path,
)

VARIANTS = ("optimized", "fp16", "int8", "openvino-fp32", "openvino-bf16", "openvino-int8")
# What `--auto` builds and measures on a host, in this order (the original, ONNX Runtime FP32, is
# measured beside them as the baseline): ONNX Runtime's INT8 and OpenVINO's FP32, BF16 (where the
# CPU computes it natively) and INT8 (where NNCF is installed).
AUTO_CANDIDATES = ("int8", "openvino-fp32", "openvino-bf16", "openvino-int8")
TEXTS = Path(__file__).resolve().parent / "texts"
CALIBRATION_TEXTS = TEXTS / "calibration.txt"
HELDOUT_TEXTS = TEXTS / "heldout.txt"
# Synthetic rows for models without text: calibration and held-out draw from other seeds.
CALIBRATION_SEED, HELDOUT_SEED = 1, 2
SYNTHETIC_ROWS = {"calibration": 256, "heldout": 512}
# Op types INT8 quantises: the GEMMs, where the time goes; the rest stays FP32 (QDQ around an
# element-wise op costs more than it saves on a CPU).
INT8_OPS = ("MatMul", "Gemm")
# Op types whose FP16 form is tried in FP32 when the FP16 model misses the targets.
FP16_CANDIDATES = (
    "LayerNormalization", "Softmax", "ReduceL2", "ReduceSum", "ReduceMean", "Div", "Pow", "Sqrt",
    "Erf", "Exp", "Sigmoid", "Sub", "Add", "Mul", "MatMul", "Gemm",
)  # fmt: skip
BATCH_SIZES = (1, 8, 32)
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


# -- inputs --------------------------------------------------------------------------------------


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
        source = f"gateway/build/texts/{src.name} (shipped)" if shipped else str(src)
        return Rows(feeds, source, _digest(feeds), kinds if len(set(kinds)) > 1 else None)
    else:
        seed = CALIBRATION_SEED if which == "calibration" else HELDOUT_SEED
        feeds = _synthetic_rows(spec, SYNTHETIC_ROWS[which], seed)
        source = f"synthetic, seed {seed} (floats N(0,1), integers uniform in input_range)"
    return Rows(feeds, source, _digest(feeds))


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


# -- running models ------------------------------------------------------------------------------


def session(path: Path, threads: int = 1):
    """A session as a batchgate CPU worker makes one: one thread, no spinning, all graph passes
    but the fusions workers skip."""
    import onnxruntime as ort

    from batchgate.workers.sessions import disabled_fusions

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.log_severity_level = 3
    return ort.InferenceSession(
        str(path), so, providers=["CPUExecutionProvider"], disabled_optimizers=disabled_fusions("cpu")
    )


def engine_precision(variant: str) -> tuple[str, str]:
    """(engine, OpenVINO precision) a variant runs with; ONNX Runtime's precision is in its file."""
    if not variant.startswith("openvino-"):
        return "onnxruntime", "fp32"
    from batchgate.workers import openvino_engine

    asked = {"openvino-fp32": "fp32", "openvino-bf16": "bf16"}.get(variant, "auto")
    return "openvino", openvino_engine.resolve_precision(asked)


def engine_session(path: Path, variant: str):
    """A session of ``variant``'s engine over ``path`` as a worker makes one (one thread):
    ONNX Runtime's, or OpenVINO's behind the same ``run``/``get_outputs``."""
    engine, precision = engine_precision(variant)
    if engine == "onnxruntime":
        return session(path)
    from batchgate.workers import openvino_engine

    return openvino_engine.Session(path, precision=precision, threads=1)


def judged(sess) -> list[str]:
    """The outputs the gate judges and the timings fetch: those a call gets without asking. A
    pooled output's per-token companions (minilm's token_embeddings, given on request) are left
    out: rows of other lengths do not stack, and serving copies them only for calls that ask."""
    names = [o.name for o in sess.get_outputs()]
    return [n for n in names if n not in (TOKEN_OUTPUT, TOKEN_MASK_OUTPUT)] or names


def run_rows(sess, feeds: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Each row alone; outputs stacked by name (rows on axis 0)."""
    names = judged(sess)
    outs: dict[str, list[np.ndarray]] = {n: [] for n in names}
    for f in feeds:
        for n, v in zip(names, sess.run(names, f)):
            outs[n].append(np.asarray(v, np.float64))
    return {n: np.concatenate(v) for n, v in outs.items()}


def output_kind(arr: np.ndarray) -> str:
    """'scores' for one value per row, else 'embedding'."""
    return "scores" if arr.reshape(len(arr), -1).shape[1] == 1 else "embedding"


def accuracy(ref: dict[str, np.ndarray], got: dict[str, np.ndarray]) -> dict[str, dict]:
    """Per output: the figures the gate judges (and per-row values for the plot)."""
    out = {}
    for name, a in ref.items():
        b = got[name]
        a2, b2 = a.reshape(len(a), -1), b.reshape(len(b), -1)
        if output_kind(a) == "embedding":
            na, nb = np.linalg.norm(a2, axis=1), np.linalg.norm(b2, axis=1)
            cos = (a2 * b2).sum(1) / np.maximum(na * nb, 1e-30)
            out[name] = {
                "kind": "embedding",
                "rows": len(a),
                "min_cosine": float(cos.min()),
                "mean_cosine": float(cos.mean()),
                "nn_agreement": _nn_agreement(a2, b2, NN_TIE),
                "nn_exact": _nn_agreement(a2, b2),
                "per_row": [float(c) for c in cos],
            }
        else:
            x, y = a2[:, 0], b2[:, 0]
            err = np.abs(x - y)
            big = np.abs(x) >= 1e-3
            rel = err[big] / np.abs(x[big]) if big.any() else np.zeros(1)
            out[name] = {
                "kind": "scores",
                "rows": len(a),
                "max_abs_err": float(err.max()),
                "max_rel_err": float(rel.max()),
                "rank_agreement": _pair_agreement(x, y),
                "per_row": [float(e) for e in err],
            }
    return out


def _nn_agreement(a: np.ndarray, b: np.ndarray, tie: float = 0.0) -> float:
    """Share of rows whose nearest other row (by cosine) under the variant is, by the original's
    cosines, within ``tie`` of the original's nearest (``tie`` 0: the same row)."""
    if len(a) < 3:
        return 1.0

    def sims(x):
        x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-30)
        s = x @ x.T
        np.fill_diagonal(s, -np.inf)
        return s

    sa = sims(a)
    pick = sims(b).argmax(1)
    rows = np.arange(len(a))
    return float((sa[rows, pick] >= sa.max(1) - tie).mean())


def _pair_agreement(x: np.ndarray, y: np.ndarray) -> float:
    """Share of row pairs the two score vectors order alike (ties in the reference skipped)."""
    sx = np.sign(x[:, None] - x[None, :])
    sy = np.sign(y[:, None] - y[None, :])
    mask = np.triu(sx != 0, 1)
    return float((sx[mask] == sy[mask]).mean()) if mask.any() else 1.0


def judge(acc: dict[str, dict], t: Thresholds) -> list[str]:
    """The failures, each naming the figure and its threshold; [] when every figure holds."""
    fails = []
    for name, a in acc.items():
        if a["kind"] == "embedding":
            checks = [("min_cosine", a["min_cosine"], t.min_cosine, ">="),
                      ("mean_cosine", a["mean_cosine"], t.mean_cosine, ">="),
                      ("nn_agreement", a["nn_agreement"], t.nn_agreement, ">=")]  # fmt: skip
        else:
            checks = [("max_abs_err", a["max_abs_err"], t.max_abs_err, "<="),
                      ("max_rel_err", a["max_rel_err"], t.max_rel_err, "<="),
                      ("rank_agreement", a["rank_agreement"], t.rank_agreement, ">=")]  # fmt: skip
        for what, value, bound, op in checks:
            ok = value >= bound if op == ">=" else value <= bound
            if not ok:
                fails.append(f"{name} {what} {value:.6g} (needs {op} {bound:g})")
    return fails


def _damage(acc: dict[str, dict]) -> float:
    """One number per candidate model for the sensitivity scan: the worst row's harm."""
    worst = 0.0
    for a in acc.values():
        worst = max(worst, 1 - a["min_cosine"] if a["kind"] == "embedding" else a["max_abs_err"])
    return worst


def batch_independence(sess, feeds: list[dict[str, np.ndarray]], alone: dict[str, np.ndarray]) -> float:
    """Largest difference between a row's output alone and in a batch with rows of other lengths
    padded to the longest (groups of 8 spread over the lengths, as a length bucket holds)."""
    order = sorted(range(len(feeds)), key=lambda i: _row_len(feeds[i]))
    names = judged(sess)
    worst = 0.0
    step = max(1, len(order) // 8)
    for start in range(min(step, 4)):
        group = order[start::step][:8]
        outs = sess.run(names, pad_batch([feeds[i] for i in group]))
        for n, v in zip(names, outs):
            ref = alone[n][group]
            worst = max(worst, float(np.abs(np.asarray(v, np.float64) - ref).max()))
    return worst


def _row_len(feed: dict[str, np.ndarray]) -> int:
    return max(int(np.prod(v.shape[1:])) for v in feed.values())


# -- timing and memory ---------------------------------------------------------------------------


def _pin(core: int | None) -> int:
    allowed = sorted(os.sched_getaffinity(0))
    core = allowed[0] if core is None else core
    os.sched_setaffinity(0, {core})
    return core


def speed(engines: dict[str, tuple[Path, str]], feeds: list[dict[str, np.ndarray]], max_batch: int,
          repeats: int) -> dict:  # fmt: skip
    """Per engine (name -> (file, variant)), measured alternately in one run on the current (pinned)
    core: latency of one row alone (p50/p99 over every held-out row, ``repeats`` times) and rows/s
    at each batch size (the held-out rows by length, each batch padded to its longest, as a
    server's length bucket pads; each batch at its quickest of the repeats)."""
    paths = engines
    sessions = {k: engine_session(p, v) for k, (p, v) in engines.items()}
    fetch = {k: judged(s) for k, s in sessions.items()}  # what a call gets by default
    for k, s in sessions.items():  # first runs pay for allocation
        for f in feeds[:3]:
            s.run(fetch[k], f)
    lat: dict[str, list[float]] = {k: [] for k in paths}
    for _ in range(repeats):
        for f in feeds:
            for k, s in sessions.items():
                t0 = time.perf_counter()
                s.run(fetch[k], f)
                lat[k].append(time.perf_counter() - t0)
    result = {
        k: {"latency_ms": {"p50": _pct(v, 50) * 1e3, "p99": _pct(v, 99) * 1e3}, "batches": []}
        for k, v in lat.items()
    }
    by_len = sorted(feeds, key=_row_len)  # a server batches rows of like length (length buckets)
    for b in sorted({min(b, max_batch) for b in BATCH_SIZES if max_batch >= 1}):
        batches = [pad_batch(by_len[i : i + b]) for i in range(0, len(by_len), b)]
        times: dict[str, list[list[float]]] = {k: [[] for _ in batches] for k in paths}
        for k, s in sessions.items():
            s.run(fetch[k], batches[0])
        for _ in range(max(2, repeats)):
            for i, batch in enumerate(batches):
                for k, s in sessions.items():
                    t0 = time.perf_counter()
                    s.run(fetch[k], batch)
                    times[k][i].append(time.perf_counter() - t0)
        for k, per_batch in times.items():
            # A pass is each batch at its quickest repeat: on a shared core a stall lands on one
            # run, and the sum of means would charge it to whichever engine ran then.
            per_pass = sum(min(v) for v in per_batch)
            flat = [x for v in per_batch for x in v]
            result[k]["batches"].append({
                "batch": b,
                "rows_per_s": len(feeds) / per_pass,
                "p50_ms": _pct(flat, 50) * 1e3,
                "p99_ms": _pct(flat, 99) * 1e3,
            })  # fmt: skip
    for r in result.values():
        r["peak_rows_per_s"] = max(x["rows_per_s"] for x in r["batches"])
        # What --auto ranks by: served traffic mixes lone rows and full batches, so no one size speaks
        # for it; the geometric mean of rows/s over the measured batch sizes weighs them alike.
        r["score_rows_per_s"] = float(np.exp(np.mean([np.log(x["rows_per_s"]) for x in r["batches"]])))
    return result


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


_RSS_CHILD = """
import sys, numpy as np
def rss():
    for line in open('/proc/self/status'):
        if line.startswith('VmRSS:'):
            return int(line.split()[1]) * 1024
feed = dict(np.load(sys.argv[2]))
if sys.argv[3] == "openvino":
    import openvino
    before = rss()
    from batchgate.workers.openvino_engine import Session
    Session(sys.argv[1], precision=sys.argv[4]).run(None, feed)
else:
    import onnxruntime as ort
    before = rss()
    so = ort.SessionOptions(); so.intra_op_num_threads = 1; so.inter_op_num_threads = 1
    s = ort.InferenceSession(sys.argv[1], so, providers=['CPUExecutionProvider'], disabled_optimizers=sys.argv[4:])
    s.run(None, feed)
print(rss() - before)
"""


def engine_rss(path: Path, feed: dict[str, np.ndarray], variant: str = "fp32") -> int | None:
    """Bytes of RSS a loaded engine adds after one run, in a fresh child (so nothing of ours is
    shared; the runtime's own import is before the first reading)."""
    from batchgate.workers.sessions import disabled_fusions

    engine, precision = engine_precision(variant)
    rest = [precision] if engine == "openvino" else ["fp32", *disabled_fusions("cpu")]
    with tempfile.TemporaryDirectory() as tmp:
        np.savez(Path(tmp) / "feed.npz", **feed)
        try:
            out = subprocess.run([sys.executable, "-c", _RSS_CHILD, str(path), str(Path(tmp) / "feed.npz"),
                                  engine, *rest],
                                 capture_output=True, text=True, timeout=300, check=True)  # fmt: skip
            return int(out.stdout.strip().splitlines()[-1])
        except (subprocess.SubprocessError, ValueError, IndexError):
            return None


# -- building ------------------------------------------------------------------------------------


@contextlib.contextmanager
def _quiet():
    """ORT's Python tools log warnings per call (pre-processing advice, producer names) that say
    nothing about this build; the report says what happened."""
    loggers = [logging.getLogger(), logging.getLogger("onnxruntime"), logging.getLogger("onnx_model"),
               logging.getLogger("fusion_base"), logging.getLogger("optimizer")]  # fmt: skip
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):  # the calibrator prints
            yield
    finally:
        for lg, lv in zip(loggers, levels):
            lg.setLevel(lv)


def _save(model: onnx.ModelProto, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    onnx.save(model, str(tmp))
    os.replace(tmp, path)


def build_optimized(src: Path, dst: Path, log: Log) -> dict:
    from onnxruntime.transformers.fusion_options import FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model

    log("optimized: ONNX Runtime transformer fusions (onnxruntime.transformers.optimizer, model_type bert)")
    # The SkipLayerNormalization fusions are left out, as CPU sessions leave them out
    # (workers/sessions.py): that CPU kernel is slower than the ops it replaces.
    fusion = FusionOptions("bert")
    fusion.enable_skip_layer_norm = fusion.enable_bias_skip_layer_norm = False
    with _quiet():
        # opt_level 0: the transformer fusions only; ORT's own graph passes still run at load.
        opt = optimize_model(str(src), model_type="bert", num_heads=0, hidden_size=0, opt_level=0,
                             optimization_options=fusion)  # fmt: skip
    fusions = {k: int(v) for k, v in sorted(opt.get_fused_operator_statistics().items()) if v}
    _save(opt.model, dst)
    log(f"optimized: fusions {fusions or 'none (no known pattern in this graph)'}")
    return {"fusions": fusions}


class _Reader:
    """CalibrationDataReader over rows of their own lengths: with ``CalibStridedMinMax`` 1 the
    calibrator collects one row per pass (``set_range``), so rows of different lengths never have
    to share a tensor (it refuses those) and no padding enters the ranges."""

    def __init__(self, feeds: list[dict[str, np.ndarray]]) -> None:
        self.feeds, self.i, self.end = feeds, 0, len(feeds)

    def __len__(self) -> int:
        return len(self.feeds)

    def set_range(self, start_index: int, end_index: int) -> None:
        self.i, self.end = start_index, end_index

    def get_next(self):
        if self.i >= self.end:
            return None
        self.i += 1
        return self.feeds[self.i - 1]


def _named(model: onnx.ModelProto) -> onnx.ModelProto:
    """Every node named (the quantiser's include/exclude lists go by name)."""
    for i, n in enumerate(model.graph.node):
        if not n.name:
            n.name = f"{n.op_type}_{i}"
    return model


def _channel_absmax(model: onnx.ModelProto, names: list[str], feeds) -> dict[str, np.ndarray]:
    """Largest |value| per last-axis channel of each tensor in ``names`` over ``feeds``."""
    probe = copy.deepcopy(model)
    have = {o.name for o in probe.graph.output}
    for n in names:
        if n not in have:
            probe.graph.output.append(onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "probe.onnx"
        onnx.save(probe, str(path))
        sess = session(path)
        outs = [o.name for o in sess.get_outputs()]
        want = set(names)
        amax: dict[str, np.ndarray] = {}
        for f in feeds:
            for k, v in zip(outs, sess.run(None, f)):
                if k in want:
                    a = np.abs(np.asarray(v, np.float32)).reshape(-1, v.shape[-1]).max(0)
                    amax[k] = np.maximum(amax[k], a) if k in amax else a
    return amax


def smooth(model: onnx.ModelProto, feeds, alpha: float) -> int:
    """SmoothQuant (Xiao et al. 2023), folded in place: per input channel j of each weight GEMM,
    X[:, j] / s_j and W[j, :] * s_j with s_j = max|X_j|^alpha / max|W_j|^(1 - alpha), so the
    product is unchanged and the few channels with outlier activations (a transformer's
    LayerNorm outputs have them) no longer set one per-tensor scale for all. The division is a
    Mul node before the GEMM, because the same activation also feeds residual paths. ORT's own
    SmoothQuant needs Intel Neural Compressor's ONNX adaptor, which its current releases dropped.
    Returns the number of activations smoothed."""
    from onnx import numpy_helper

    init = {i.name: i for i in model.graph.initializer}
    groups: dict[str, list[onnx.NodeProto]] = {}
    for n in model.graph.node:
        attrs = {a.name: a for a in n.attribute}
        if n.op_type not in INT8_OPS or len(n.input) < 2 or n.input[1] not in init:
            continue
        if "transA" in attrs and attrs["transA"].i:
            continue
        groups.setdefault(n.input[0], []).append(n)
    amax = _channel_absmax(model, sorted(groups), feeds)

    def trans_b(n):
        return any(a.name == "transB" and a.i for a in n.attribute)

    nodes = list(model.graph.node)
    for x in sorted(groups):
        consumers = groups[x]
        weights = {id(n): numpy_helper.to_array(init[n.input[1]]).astype(np.float32) for n in consumers}
        rows = [(w.T if trans_b(n) else w) for n in consumers for w in [weights[id(n)]]]  # K x N each
        wmax = np.max([np.abs(r).max(1) for r in rows], axis=0)
        if x not in amax or len(amax[x]) != len(wmax):
            continue
        s = np.where(
            (amax[x] > 0) & (wmax > 0), amax[x] ** alpha / np.maximum(wmax, 1e-12) ** (1 - alpha), 1.0
        )
        s = np.clip(s, 1e-4, 1e4).astype(np.float32)
        inv = numpy_helper.from_array((1.0 / s).astype(np.float32), f"{x}.smooth_inv")
        model.graph.initializer.append(inv)
        mul = onnx.helper.make_node("Mul", [x, inv.name], [f"{x}.smoothed"], name=f"{x}.smooth")
        nodes.insert(nodes.index(consumers[0]), mul)
        for n in consumers:
            w = weights[id(n)]
            w = w * s[None, :] if trans_b(n) else w * s[:, None]
            init[n.input[1]].CopyFrom(numpy_helper.from_array(w.astype(np.float32), n.input[1]))
            n.input[0] = f"{x}.smoothed"
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return len(groups)


WEIGHT_TYPES = ("auto", "int8", "uint8")


def weight_type(asked: str) -> str:
    """The INT8 weights' storage: "int8" where ONNX Runtime's UINT8 x INT8 kernel is exact (VNNI, or
    off x86), "uint8" where it saturates (x86 without VNNI, see ``int8_saturates``)."""
    from batchgate.workers.devices import int8_saturates

    if asked not in WEIGHT_TYPES:
        raise OptimizeError(f"INT8 weights must be one of {', '.join(WEIGHT_TYPES)}, got {asked!r}")
    if asked != "auto":
        return asked
    return "uint8" if int8_saturates() else "int8"


def row_int8(model: onnx.ModelProto, names: set[str], per_channel: bool, weights: str = "int8") -> int:
    """Rewrite the weight GEMMs in ``names`` (MatMul or Gemm with a constant 2-D weight) to INT8
    with each row's own activation scale, computed at run time: for every row (a token) of the
    activation X, s = max|X_row| / 127 and X_row quantised to UINT8 around 128 (QuantizeLinear per
    row), so ONNX Runtime takes its UINT8 x INT8 kernel (VNNI where the CPU has it); the product
    against INT8 weights (per output channel, symmetric) comes back as FP32 through ORT's fused
    MatMulIntegerToFloat, which also applies s. A row's scale depends on that row alone, never on its
    batch-mates or its padding: dynamic quantisation that is batch-independent. The fused ops,
    against the same arithmetic written out op by op, are measured in docs/engines.md. Returns the
    number of GEMMs rewritten; the FP32 weights they no longer read are dropped.

    ``weights="uint8"`` stores the same symmetric levels shifted by 128 with zero point 128, so ORT
    takes its UINT8 x UINT8 kernel instead: the same product, exact on x86 CPUs without VNNI where
    the UINT8 x INT8 one saturates (``weight_type``)."""
    from onnx import helper as h
    from onnx import numpy_helper

    opset = max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0)
    if opset < 13:
        raise OptimizeError(
            f"row INT8 needs ONNX opset 13 or later (per-row QuantizeLinear); the model has {opset}: "
            "use --scales static"
        )
    if weights not in ("int8", "uint8"):
        raise OptimizeError(f"row INT8 weights must be int8 or uint8, got {weights!r}")
    unsigned = weights == "uint8"
    w_zp = "rowq.zp" if unsigned else ""
    init = {i.name: i for i in model.graph.initializer}
    shared = [numpy_helper.from_array(np.array(1 / 127, np.float32), "rowq.inv127"),
              numpy_helper.from_array(np.array(1e-12, np.float32), "rowq.tiny"),
              numpy_helper.from_array(np.array([-1, 1], np.int64), "rowq.column"),
              numpy_helper.from_array(np.array(128, np.uint8), "rowq.zp"),
              numpy_helper.from_array(np.array([-1], np.int64), "rowq.minus1"),
              numpy_helper.from_array(np.array([0], np.int64), "rowq.zero")]  # fmt: skip

    def row_max(src: str, dst: str) -> onnx.NodeProto:
        if opset >= 18:  # ReduceMax's axes became an input
            return h.make_node("ReduceMax", [src, "rowq.minus1"], [dst], name=dst, keepdims=1)
        return h.make_node("ReduceMax", [src], [dst], name=dst, axes=[-1], keepdims=1)

    nodes: list[onnx.NodeProto] = []
    replaced: set[str] = set()  # the rewritten GEMMs' weights (and Gemm's C)
    done = 0
    for n in model.graph.node:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        weight = n.input[1] if len(n.input) > 1 and n.input[1] in init else None
        if n.name not in names or n.op_type not in INT8_OPS or weight is None or attrs.get("transA", 0):
            nodes.append(n)
            continue
        w = numpy_helper.to_array(init[weight]).astype(np.float32)
        if w.ndim != 2:
            nodes.append(n)
            continue
        if n.op_type == "Gemm":
            w = (w.T if attrs.get("transB", 0) else w) * np.float32(attrs.get("alpha", 1.0))
        k, cols = w.shape
        amax = np.abs(w).max(axis=0) if per_channel else np.full(cols, np.abs(w).max())
        ws = (np.maximum(amax, 1e-12) / 127).astype(np.float32)
        wq = np.clip(np.round(w / ws), -127, 127)
        wq = (wq + 128).astype(np.uint8) if unsigned else wq.astype(np.int8)
        p = f"{n.name}.rowq"
        x = n.input[0]
        bias: list[str] = []
        if n.op_type == "Gemm" and len(n.input) > 2 and n.input[2]:  # C times beta, added after the scales
            c = numpy_helper.to_array(init[n.input[2]]).astype(np.float32) * np.float32(
                attrs.get("beta", 1.0)
            )
            if c.size not in (1, cols) or c.squeeze().ndim > 1:
                nodes.append(n)  # a C per row and column is not a bias: this Gemm stays FP32
                continue
            model.graph.initializer.append(
                numpy_helper.from_array(np.broadcast_to(c.reshape(-1), (cols,)).copy(), f"{p}.c")
            )
            bias = [f"{p}.c"]
        model.graph.initializer.extend([
            numpy_helper.from_array(wq, f"{p}.w"), numpy_helper.from_array(ws, f"{p}.ws"),
            numpy_helper.from_array(np.array([-1, k], np.int64), f"{p}.rows"),
            numpy_helper.from_array(np.array([cols], np.int64), f"{p}.cols"),
        ])  # fmt: skip
        replaced.update(n.input[1:])
        done += 1
        nodes += [
            # s = max|row| / 127, one per row
            h.make_node("Abs", [x], [f"{p}.abs"], name=f"{p}.abs"),
            row_max(f"{p}.abs", f"{p}.amax"),
            h.make_node("Max", [f"{p}.amax", "rowq.tiny"], [f"{p}.amax1"], name=f"{p}.amax1"),
            h.make_node("Mul", [f"{p}.amax1", "rowq.inv127"], [f"{p}.s"], name=f"{p}.s"),
            # rows flattened to [T, K]; QuantizeLinear per row (axis 0), zero point 128 each
            h.make_node("Reshape", [x, f"{p}.rows"], [f"{p}.x2"], name=f"{p}.x2"),
            h.make_node("Reshape", [f"{p}.s", "rowq.minus1"], [f"{p}.s1"], name=f"{p}.s1"),
            h.make_node("Reshape", [f"{p}.s", "rowq.column"], [f"{p}.s2"], name=f"{p}.s2"),
            h.make_node("Shape", [f"{p}.s1"], [f"{p}.t"], name=f"{p}.t"),
            h.make_node("Expand", ["rowq.zp", f"{p}.t"], [f"{p}.zp"], name=f"{p}.zp"),
            h.make_node("QuantizeLinear", [f"{p}.x2", f"{p}.s1", f"{p}.zp"], [f"{p}.q"], name=f"{p}.q", axis=0),
            # the INT32 product times s (a [T, 1] scale is per row) and the weight's column scales
            h.make_node("MatMulIntegerToFloat", [f"{p}.q", f"{p}.w", f"{p}.s2", f"{p}.ws", "rowq.zp", w_zp, *bias],
                        [f"{p}.y2"], name=f"{p}.mm", domain="com.microsoft"),
            # back to X's leading dims with N columns
            h.make_node("Shape", [x], [f"{p}.xshape"], name=f"{p}.xshape"),
            h.make_node("Slice", [f"{p}.xshape", "rowq.zero", "rowq.minus1"], [f"{p}.lead"], name=f"{p}.lead"),
            h.make_node("Concat", [f"{p}.lead", f"{p}.cols"], [f"{p}.yshape"], name=f"{p}.yshape", axis=0),
            h.make_node("Reshape", [f"{p}.y2", f"{p}.yshape"], [n.output[0]], name=f"{p}.y"),
        ]  # fmt: skip
    if done:
        model.graph.initializer.extend(shared)
        if not any(o.domain == "com.microsoft" for o in model.opset_import):
            model.opset_import.append(h.make_opsetid("com.microsoft", 1))
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    used = {i for nd in model.graph.node for i in nd.input} | {o.name for o in model.graph.output}
    kept = [i for i in model.graph.initializer if i.name not in replaced or i.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    return done


def build_int8(src: Path, dst: Path, calib: Rows, opts: Options, log: Log) -> dict:
    from onnxruntime.quantization import (
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_dynamic,
        quantize_static,
    )
    from onnxruntime.quantization.shape_inference import quant_pre_process

    wtype = weight_type(opts.weights)
    method = {"percentile": CalibrationMethod.Percentile, "entropy": CalibrationMethod.Entropy,
              "minmax": CalibrationMethod.MinMax}[opts.method]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="batchgate-int8-") as tmp_dir:
        tmp = Path(tmp_dir)
        pre = tmp / "pre.onnx"
        log("int8: pre-processing (ONNX Runtime's quant_pre_process: constant folding, shape inference)")
        with _quiet():
            quant_pre_process(str(src), str(pre), skip_symbolic_shape=True)
        model = _named(onnx.load(str(pre)))
        smoothed = 0
        if opts.smooth > 0:
            log(f"int8: smoothing activation outliers into the weights (SmoothQuant, alpha {opts.smooth:g})")
            smoothed = smooth(model, calib.feeds, opts.smooth)
        onnx.save(model, str(pre))
        init = {i.name for i in model.graph.initializer}
        candidates = [n.name for n in model.graph.node if n.op_type in INT8_OPS]
        if opts.smooth < 0 or opts.smooth > 1:
            raise OptimizeError(f"smooth (SmoothQuant's alpha) must be in [0, 1], got {opts.smooth}")
        if not candidates:
            raise OptimizeError(f"{src}: no {' or '.join(INT8_OPS)} node to quantise")
        weights = [
            n.name for n in model.graph.node if n.op_type in INT8_OPS and any(x in init for x in n.input[1:2])
        ]
        cache = tmp / "ranges.json"
        extra = {"CalibStridedMinMax": 1, "CalibPercentile": opts.percentile, "ActivationSymmetric": False,
                 "WeightSymmetric": True}  # fmt: skip

        if opts.scales in ("row", "dynamic"):
            # Activation x activation products (attention's) have no weight to quantise ahead.
            candidates = weights
            if not candidates:
                raise OptimizeError(
                    f"{src}: no {' or '.join(INT8_OPS)} node with a constant 2-D weight to quantise"
                )
        if opts.scales == "row":

            def quantize(out: Path, include: list[str] | None, exclude: list[str]) -> None:
                m = onnx.load(str(pre))
                row_int8(
                    m,
                    set(include if include is not None else candidates) - set(exclude),
                    opts.per_channel,
                    wtype,
                )
                onnx.save(m, str(out))

            log(f"int8: each row's own activation scale (at run time); {len(candidates)} weight GEMMs")
        elif opts.scales == "dynamic":
            # Built so the gate can be seen refusing it (thresholds.SCALES says why).

            def quantize(out: Path, include: list[str] | None, exclude: list[str]) -> None:
                with _quiet():
                    quantize_dynamic(
                        str(pre), str(out), per_channel=opts.per_channel,
                        weight_type=QuantType.QUInt8 if wtype == "uint8" else QuantType.QInt8,
                        op_types_to_quantize=list(INT8_OPS), nodes_to_quantize=include, nodes_to_exclude=exclude,
                    )  # fmt: skip

            log(f"int8: ONNX Runtime's dynamic scales (one per batch tensor); {len(candidates)} weight GEMMs")
        else:

            def quantize(out: Path, include: list[str] | None, exclude: list[str]) -> None:
                with _quiet():
                    quantize_static(
                        str(pre), str(out), _Reader(calib.feeds), quant_format=QuantFormat.QDQ,
                        per_channel=opts.per_channel, activation_type=QuantType.QUInt8,
                        weight_type=QuantType.QUInt8 if wtype == "uint8" else QuantType.QInt8,
                        calibrate_method=method,
                        op_types_to_quantize=list(INT8_OPS), nodes_to_quantize=include,
                        nodes_to_exclude=exclude, calibration_cache_path=str(cache), extra_options=extra,
                    )  # fmt: skip

            log(f"int8: calibrating activation ranges ({opts.method}"
                f"{f' p{opts.percentile:g}' if opts.method == 'percentile' else ''}) on {len(calib)} rows, one at a time")  # fmt: skip
        if opts.weights == "auto":
            why = {"uint8": "this CPU has no VNNI: ORT's UINT8 x INT8 kernel saturates, UINT8 x UINT8 is exact",
                   "int8": "this CPU multiplies UINT8 x INT8 exactly"}[wtype]  # fmt: skip
            log(f"int8: weights stored as {wtype} ({why})")
        t0 = time.perf_counter()
        trial = tmp / "trial.onnx"
        quantize(trial, None, [])
        log(f"int8: quantised in {time.perf_counter() - t0:.1f} s; {len(candidates)} quantisable nodes")
        ref_sess = session(pre)
        search = calib.feeds[: max(1, opts.search_rows)]
        ref_search = run_rows(ref_sess, search)
        ref_all = run_rows(ref_sess, calib.feeds)
        targets = opts.thresholds.tightened()
        static = opts.scales == "static"
        info: dict = {"scales": opts.scales, "method": opts.method if static else None,
                      "percentile": opts.percentile if static and opts.method == "percentile" else None,
                      "per_channel": opts.per_channel,
                      "activations": "uint8 per tensor (static)" if static else
                                     "uint8 per batch tensor (one scale for the whole batch, at run time)" if opts.scales == "dynamic" else
                                     "int8 per row (each row's own scale, at run time)",
                      "weights": f"{wtype if wtype == 'int8' else 'uint8 around 128'} per {'channel' if opts.per_channel else 'tensor'}",
                      "weight_type": wtype,
                      "quantisable_nodes": len(candidates), "fallback": opts.fallback,
                      "smooth_alpha": opts.smooth or None, "smoothed_activations": smoothed}  # fmt: skip
        excluded: list[str] = []
        damage: dict[str, float] = {}
        if opts.fallback:
            acc = accuracy(ref_all, run_rows(session(trial), calib.feeds))
            fails = judge(acc, targets)
            # The original against itself is the best any node set can do: when even that misses
            # (a target such as --min-cosine 1.5), no scan can pass, and each of its steps costs a
            # quantisation and a run over the calibration rows.
            beyond = judge(accuracy(ref_all, ref_all), targets) if fails else []
            if beyond:
                log(
                    f"int8: the targets are out of reach, the original against itself misses them ({beyond[0]})"
                )
                excluded = list(candidates)
            elif fails:
                log(
                    f"int8: everything quantised misses the calibration targets ({fails[0]}); measuring each node"
                )
                for k, name in enumerate(candidates, 1):
                    quantize(trial, [name], [])
                    damage[name] = _damage(accuracy(ref_search, run_rows(session(trial), search)))
                    log(f"int8: sensitivity {k}/{len(candidates)} {name}: {damage[name]:.2e}")
                order = sorted(candidates, key=lambda n: (-damage[n], n))
                for name in order:
                    excluded.append(name)
                    if len(excluded) == len(candidates):
                        break
                    quantize(trial, None, excluded)
                    acc = accuracy(ref_all, run_rows(session(trial), calib.feeds))
                    fails = judge(acc, targets)
                    log(f"int8: {len(excluded)} node(s) kept in FP32 (last {name}): "
                        f"{'meets the calibration targets' if not fails else fails[0]}")  # fmt: skip
                    if not fails:
                        break
            info["calibration_accuracy"] = _strip(acc)
        info["fp32_nodes"] = [{"node": n, "damage_alone": damage.get(n)} for n in excluded]
        info["int8_nodes"] = len(candidates) - len(excluded)
        info["int8_weight_nodes"] = len([n for n in weights if n not in excluded])
        info["damage_alone"] = dict(sorted(damage.items(), key=lambda kv: -kv[1])) if damage else {}
        if len(excluded) == len(candidates):
            info["nothing_quantised"] = True
            log("int8: no node stays INT8 within the targets")
        quantize(trial, None, excluded)
        _save(onnx.load(str(trial)), dst)
    return info


def build_fp16(src: Path, dst: Path, calib: Rows, opts: Options, log: Log) -> dict:
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16

    original = onnx.load(str(src))
    present = {n.op_type for n in original.graph.node}
    blocked: list[str] = []
    unsupported: list[str] = []

    def convert() -> onnx.ModelProto:
        with _quiet():
            return convert_float_to_float16(copy.deepcopy(original), keep_io_types=True,
                                            op_block_list=list(DEFAULT_OP_BLOCK_LIST) + blocked + unsupported)  # fmt: skip

    def loadable(model: onnx.ModelProto, path: Path):
        """A session on ``model``; op types ORT has no FP16 CPU kernel for go back to FP32."""
        while True:
            _save(model, path)
            try:
                return session(path)
            except Exception as exc:  # NOT_IMPLEMENTED: "Could not find an implementation for Op(13) ..."
                m = re.search(r"implementation for (\w+)\(", str(exc))
                if not m or m.group(1) in unsupported:
                    raise
                unsupported.append(m.group(1))
                log(f"fp16: ONNX Runtime has no FP16 CPU kernel for {m.group(1)}; it stays FP32")
                model = convert()

    log("fp16: converting (onnxruntime.transformers.float16, FP32 inputs and outputs kept)")
    ref = run_rows(session(src), calib.feeds[: max(1, opts.search_rows)])
    search = calib.feeds[: max(1, opts.search_rows)]
    targets = opts.thresholds.tightened()
    trial = dst.with_name(f".{dst.name}.trial")
    try:

        def measure() -> tuple[dict, list[str], float]:
            sess = loadable(convert(), trial)
            got = run_rows(sess, search)
            a = accuracy(ref, got)
            f = judge(a, targets)
            bi = batch_independence(sess, search, got)
            if bi > targets.batch_tolerance:
                f.append(f"batch_independence {bi:.3g} (needs <= {targets.batch_tolerance:g})")
            return a, f, bi

        acc, fails, indep = measure()
        while fails:
            options = [op for op in FP16_CANDIDATES if op in present and op not in blocked + unsupported]
            if not options:
                break
            log(f"fp16: misses the calibration targets ({fails[0]}); trying each op type in FP32")
            best = None
            for op in options:
                blocked.append(op)
                a, f, bi = measure()
                blocked.pop()
                key = (
                    len(f),
                    bi,
                    _damage(a),
                )  # fewest failures, then a row's drift in a batch, then accuracy
                if best is None or key < best[1]:
                    best = (op, key)
            blocked.append(best[0])
            log(f"fp16: {best[0]} stays FP32 (then {best[1][0]} failure(s), batch drift {best[1][1]:.2e}, "
                f"damage {best[1][2]:.2e})")  # fmt: skip
            acc, fails, indep = measure()
        model = convert()
    finally:
        trial.unlink(missing_ok=True)
    _save(model, dst)
    return {"blocked_measured": blocked, "no_fp16_kernel": unsupported, "calibration_accuracy": _strip(acc),
            "calibration_batch_independence": indep}  # fmt: skip


def build_openvino_int8(src: Path, dst: Path, calib: Rows, opts: Options, log: Log) -> dict:
    """NNCF's post-training quantisation (its ONNX backend: a QDQ ONNX file OpenVINO runs with INT8
    kernels), transformer preset (attention scores, softmax, LayerNorm and the like kept in the
    engine's precision; SmoothQuant on), static scales calibrated on the calibration rows."""
    try:
        import nncf
    except ImportError:
        raise OptimizeError(
            "openvino-int8 is built with NNCF, which is not installed: pip install 'batchgate[openvino-int8]'"
        ) from None
    log(
        f"openvino-int8: NNCF post-training quantisation on {len(calib)} calibration rows (transformer preset)"
    )
    # NNCF's ONNX passes read every tensor's type from value_info: infer the shapes first.
    model = onnx.shape_inference.infer_shapes(onnx.load(str(src)))
    try:
        with _quiet(), contextlib.redirect_stderr(open(os.devnull, "w")):
            quantized = nncf.quantize(
                model,
                nncf.Dataset(calib.feeds),
                model_type=nncf.ModelType.TRANSFORMER,
                subset_size=len(calib),
            )
    except Exception as exc:  # NNCF's own errors carry no common type
        raise OptimizeError(
            f"NNCF {nncf.__version__} could not quantise {src.name}: {type(exc).__name__}: {exc}"
        ) from None
    _save(quantized, dst)
    nodes = [n for n in quantized.graph.node]
    qdq = sum(n.op_type == "QuantizeLinear" for n in nodes)
    gemms = [n for n in model.graph.node if n.op_type in INT8_OPS]
    return {"nncf": nncf.__version__, "quantize_nodes": qdq, "quantisable_nodes": len(gemms),
            "compute_precision": engine_precision("openvino-int8")[1]}  # fmt: skip


def _strip(acc: dict) -> dict:
    return {k: {kk: vv for kk, vv in v.items() if kk != "per_row"} for k, v in acc.items()}


# -- the whole step ------------------------------------------------------------------------------


@dataclass(slots=True)
class Result:
    status: str  # passed | failed
    failures: list[str]
    report: dict
    variant_file: Path | None  # None: not written (failed without force)
    report_file: Path


def _spec(model_dir: Path, version: str | None) -> ModelSpec:
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


def _check_options(opts: Options) -> None:
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


def _rows(spec: ModelSpec, opts: Options) -> tuple[Rows, Rows]:
    calib = model_rows(spec, "calibration", opts.calibration)
    held = model_rows(spec, "heldout", opts.heldout)
    if calib.digest == held.digest:
        raise OptimizeError(
            "the held-out rows are the calibration rows; the gate needs rows calibration never saw"
        )
    return calib, held


def build_variant(
    src: Path, variant: str, tmp_dst: Path, calib: Rows, opts: Options, log: Log
) -> tuple[Path, dict]:
    """Build ``variant`` of ``src`` into ``tmp_dst``; (the file that runs, what the build did).
    OpenVINO's FP32 and BF16 build nothing: they run ``src`` itself."""
    if variant in SAME_FILE_VARIANTS:
        engine, precision = engine_precision(variant)
        from batchgate.workers import openvino_engine

        log(f"{variant}: nothing to build; OpenVINO {openvino_engine.version()} runs {src.name} in "
            f"{precision.upper()}")  # fmt: skip
        return src, {"openvino": openvino_engine.version(), "compute_precision": precision}
    if variant == "optimized":
        build = build_optimized(src, tmp_dst, log)
    elif variant == "int8":
        build = build_int8(src, tmp_dst, calib, dataclass_replace(opts, variant=variant), log)
    elif variant == "openvino-int8":
        build = build_openvino_int8(src, tmp_dst, calib, opts, log)
    else:
        build = build_fp16(src, tmp_dst, calib, opts, log)
    return tmp_dst, build


def batch_bound(variant: str, t: Thresholds) -> float:
    """The batch-independence bound of ``variant``: ``batch_tolerance`` where the kernels compute in
    FP32 (or INT8 with FP32 around it), ``batch_tolerance_bf16`` where they compute in BF16, whose
    blocking changes with the batch's shape (docs/engines.md says why that bound)."""
    return t.batch_tolerance_bf16 if engine_precision(variant)[1] == "bf16" else t.batch_tolerance


def by_kind(acc: dict[str, dict], kinds: list[str] | None) -> dict[str, dict[str, dict]]:
    """Per output, per kind of held-out row: rows, min and mean of the per-row figure (cosine for
    embeddings, absolute error for scores)."""
    if not kinds:
        return {}
    out: dict[str, dict[str, dict]] = {}
    for name, a in acc.items():
        vals = np.asarray(a["per_row"])
        per: dict[str, dict] = {}
        for kind in dict.fromkeys(kinds):
            sel = vals[[k == kind for k in kinds]]
            if a["kind"] == "embedding":
                per[kind] = {
                    "rows": int(len(sel)),
                    "min_cosine": float(sel.min()),
                    "mean_cosine": float(sel.mean()),
                }
            else:
                per[kind] = {
                    "rows": int(len(sel)),
                    "max_abs_err": float(sel.max()),
                    "mean_abs_err": float(sel.mean()),
                }
        out[name] = per
    return out


def gate(
    ref: dict[str, np.ndarray], file: Path, variant: str, held: Rows, opts: Options
) -> tuple[dict, list[str], dict]:
    """Accuracy against ``ref`` (the original's outputs) and batch independence of one candidate:
    (accuracy, failures, {"max_abs", "bound", "min_cosine"})."""
    sess = engine_session(file, variant)
    got = run_rows(sess, held.feeds)
    acc = accuracy(ref, got)
    failures = judge(acc, opts.thresholds)
    indep = batch_independence(sess, held.feeds, got)
    bound = batch_bound(variant, opts.thresholds)
    if indep > bound:
        failures.append(f"batch_independence {indep:.3g} (needs <= {bound:g})")
    return acc, failures, {"max_abs": indep, "bound": bound}


def _report(spec: ModelSpec, variant: str, file: Path, status: str, failures: list[str], opts: Options,
            acc: dict, indep: dict, timing: dict, memory: dict, build: dict, calib: Rows, held: Rows,
            core: int, started: float) -> dict:  # fmt: skip
    src = spec.path
    engine, precision = engine_precision(variant)
    shown = (
        VARIANT_PRECISION[variant]
        if engine == "onnxruntime" or variant == "openvino-int8"
        else precision.upper()
    )
    mine, base = timing.get(variant), timing["original"]  # (--auto times only what passed the gate)
    return {
        "model": spec.name,
        "version": spec.version,
        "variant": {
            "name": variant,
            "precision": shown,
            "engine": engine,
            "file": variant_path(src, variant).name,
            "sha256": sha256_file(file),
            "bytes": file.stat().st_size,
        },  # fmt: skip
        "original": {"file": src.name, "sha256": sha256_file(src), "bytes": src.stat().st_size},
        "status": status,
        "failures": failures,
        "thresholds": asdict(opts.thresholds),
        "accuracy": acc,
        "accuracy_by_kind": by_kind(acc, held.kinds),
        "batch_independence_max_abs": indep["max_abs"],
        "batch_independence_bound": indep["bound"],
        "speed": {k: timing[k] for k in ("original", variant) if k in timing},
        "speedup": None
        if mine is None
        else {
            "latency_p50": base["latency_ms"]["p50"] / mine["latency_ms"]["p50"],
            "peak_rows_per_s": mine["peak_rows_per_s"] / base["peak_rows_per_s"],
        },  # fmt: skip
        "memory_rss_bytes": {k: memory.get(k) for k in ("original", variant) if k in memory},
        "build": build,
        "calibration": {"source": calib.source, "rows": len(calib), "sha256": calib.digest},
        "heldout": {"source": held.source, "rows": len(held), "sha256": held.digest},
        "machine": machine(core),
        "date": datetime.date.today().isoformat(),
        "command": opts.command,
        "build_seconds": round(time.perf_counter() - started, 1),
    }


def _publish(report: dict, spec: ModelSpec, variant: str, file: Path, opts: Options) -> Path | None:
    """Write the report and, when it passed (or ``force``), move the built file into place; a
    failed rebuild removes an older file of the same variant. The file written, or None."""
    src = spec.path
    dst = variant_path(src, variant)
    write_report(report, report_path(src, variant))
    if dst == src:  # runs the original itself: nothing to move, and never anything to delete
        return src if report["status"] == "passed" or opts.force else None
    if report["status"] == "passed" or opts.force:
        os.replace(file, dst)
        return dst
    if dst.exists():
        # A failed rebuild must not leave an older variant looking current beside its new report.
        dst.unlink()
    return None


def optimize(model_dir: Path, opts: Options, log: Log = print) -> Result:
    """Build ``opts.variant`` of the model in ``model_dir``, gate it, write it and its report.
    Does not change what the model serves (``set_variant`` does)."""
    _check_options(opts)
    spec = _spec(model_dir, opts.version)
    src = spec.path
    variant = opts.variant
    dst = variant_path(src, variant)
    started = time.perf_counter()
    log(f"{spec.name} v{spec.version}: building {variant} from {src}")
    calib, held = _rows(spec, opts)
    tmp_dst = dst.with_name(f".{dst.name}.{os.getpid()}.build")
    try:
        file, build = build_variant(src, variant, tmp_dst, calib, opts, log)
        log(f"evaluating on {len(held)} held-out rows ({held.source})")
        ref = run_rows(session(src), held.feeds)
        acc, failures, indep = gate(ref, file, variant, held, opts)
        if build.get("nothing_quantised"):
            failures.append("int8_nodes 0: no node stays INT8 within the targets (needs >= 1)")
        core = _pin(opts.core)
        log(f"timing on core {core} (original and {variant} alternately, {opts.timing_repeats} repeats)")
        timing = speed({"original": (src, "fp32"), variant: (file, variant)}, held.feeds,
                       max(1, spec.max_batch_size), opts.timing_repeats)  # fmt: skip
        memory = {}
        if opts.memory:
            log("memory: RSS of each loaded engine (a child process each)")
            memory = {
                "original": engine_rss(src, held.feeds[0]),
                variant: engine_rss(file, held.feeds[0], variant),
            }
        status = "passed" if not failures else "failed"
        report = _report(spec, variant, file, status, failures, opts, acc, indep, timing, memory, build,
                         calib, held, core, started)  # fmt: skip
        written = _publish(report, spec, variant, file, opts)
        rp = report_path(src, variant)
        line = f"{spec.name} {variant}: {status.upper()}"
        if failures:
            line += " — " + "; ".join(failures)
        log(line)
        log(f"report: {rp.with_suffix('.md')}" + ("" if written else f" ({dst.name} not written)"))
        if status == "passed" and max(report["speedup"].values()) < 1.0:
            log(f"note: {variant} is not faster than the original on this CPU (x{report['speedup']['latency_p50']:.2f} "
                f"one row, x{report['speedup']['peak_rows_per_s']:.2f} peak); keep serving the original: "
                f"`batchgate optimize {spec.name} --use fp32`")  # fmt: skip
        return Result(status, failures, report, written, rp)
    finally:
        tmp_dst.unlink(missing_ok=True)


@dataclass(slots=True)
class AutoResult:
    chosen: str | None  # the variant to serve; None: no candidate passed
    serving: str  # what the model served before
    candidates: dict[str, Result]
    skipped: dict[str, str]  # candidate -> why this host does not build it
    report: dict
    report_file: Path


def auto_candidates() -> tuple[list[str], dict[str, str]]:
    """The candidates this host builds, and those it skips with the reason."""
    from batchgate.workers import openvino_engine

    take, skip = [], {}
    for v in AUTO_CANDIDATES:
        if v.startswith("openvino-") and not openvino_engine.available():
            skip[v] = "the openvino package is not installed (pip install 'batchgate[openvino]')"
        elif v == "openvino-bf16" and not openvino_engine.native_bf16():
            skip[v] = "this CPU has neither AMX nor AVX-512 BF16 (BF16 would be emulated, slower than FP32)"
        elif v == "openvino-int8" and importlib.util.find_spec("nncf") is None:
            skip[v] = "NNCF is not installed (pip install 'batchgate[openvino-int8]')"
        else:
            take.append(v)
    return take, skip


def optimize_auto(
    model_dir: Path, opts: Options, log: Log = print, candidates: list[str] | None = None
) -> AutoResult:
    """Build every candidate this host supports, gate each against the original on the same held-out
    rows, time them all (and the original, and what serves now) alternately on one pinned core in
    one run, write each candidate's report and one table of them all (``model.auto.report.md``),
    and name the fastest candidate that passed — never one slower than what serves now. Does not
    change what the model serves (``set_variant`` does)."""
    spec = _spec(model_dir, opts.version)
    serving = _serving_variant(model_dir, spec.version)
    src = spec.path
    take, skipped = auto_candidates()
    if candidates is not None:
        take = [c for c in candidates if c in take]
    for v, why in skipped.items():
        log(f"{v}: skipped: {why}")
    started = time.perf_counter()
    calib, held = _rows(spec, opts)
    log(
        f"{spec.name} v{spec.version}: candidates {', '.join(take)}; gate on {len(held)} held-out rows ({held.source})"
    )
    ref = run_rows(session(src), held.feeds)
    tmp: dict[str, Path] = {}
    built: dict[str, tuple[Path, dict, dict, list[str], dict]] = {}
    try:
        for v in take:
            o = dataclass_replace(opts, variant=v)
            _check_options(o)
            tmp[v] = variant_path(src, v).with_name(f".{variant_path(src, v).name}.{os.getpid()}.build")
            t0 = time.perf_counter()
            try:
                file, build = build_variant(src, v, tmp[v], calib, o, log)
            except OptimizeError as exc:
                skipped[v] = str(exc)
                log(f"{v}: not built: {exc}")
                continue
            acc, failures, indep = gate(ref, file, v, held, o)
            if build.get("nothing_quantised"):
                failures.append("int8_nodes 0: no node stays INT8 within the targets (needs >= 1)")
            build["build_seconds"] = round(time.perf_counter() - t0, 1)
            built[v] = (file, build, acc, failures, indep)
            log(f"{v}: gate {'passed' if not failures else 'FAILED — ' + '; '.join(failures)}")
        # Only what passed the gate is timed: a failed candidate never serves, and timing it cost a
        # base model most of --auto's ~20 minutes on one core (issue 57). The gate ran first, each
        # candidate's right after its build.
        engines = {"original": (src, "fp32")} | {v: (b[0], v) for v, b in built.items() if not b[3]}
        if serving not in ("fp32", *built):
            try:  # what serves now is measured too: --auto never picks anything slower
                engines[serving] = (check_variant(spec.name, spec.version, src, serving), serving)
            except ConfigError as exc:
                log(f"{serving} (serving now): not measured: {exc}")
        core = _pin(opts.core)
        log(f"timing on core {core}: {', '.join(engines)} alternately, {opts.timing_repeats} repeats")
        timing = speed(engines, held.feeds, max(1, spec.max_batch_size), opts.timing_repeats)
        memory: dict[str, int | None] = {}
        if opts.memory:
            log("memory: RSS of each loaded engine (a child process each)")
            memory = {k: engine_rss(p, held.feeds[0], v) for k, (p, v) in engines.items()}
        results: dict[str, Result] = {}
        for v, (file, build, acc, failures, indep) in built.items():
            o = dataclass_replace(opts, variant=v)
            status = "passed" if not failures else "failed"
            report = _report(spec, v, file, status, failures, o, acc, indep, timing, memory, build, calib, held,
                             core, started)  # fmt: skip
            written = _publish(report, spec, v, file, o)
            results[v] = Result(status, failures, report, written, report_path(src, v))
        score = {k: t["score_rows_per_s"] for k, t in timing.items()}
        now = serving if serving in timing else "original"
        passed = [v for v, r in results.items() if r.status == "passed"]
        # Never slower than what serves now at any measured batch size: a candidate that wins on
        # full batches but loses on lone rows (OpenVINO's per-call cost on a tiny model) would
        # trade its callers' latency for throughput they may not have.
        faster = [v for v in passed if v != now and not_slower(timing[v], timing[now])]
        best = max(faster, key=lambda v: score[v], default=None)
        chosen = None
        if passed:
            chosen = best or serving
        summary = _auto_report(
            spec, serving, chosen, results, skipped, timing, memory, held, opts, core, started
        )
        rp = report_path(src, "auto")
        write_auto_report(summary, rp)
        log(f"report: {rp.with_suffix('.md')}")
        if chosen is None:
            log(f"{spec.name}: no candidate passed the gate; it keeps serving {serving}")
        elif best is None:
            log(f"{spec.name}: {len(passed)} candidate(s) passed, none faster than {serving} at every batch size; "
                f"it keeps serving {serving}")  # fmt: skip
        else:
            log(f"{spec.name}: fastest passing: {best} (x{score[best] / score[now]:.2f} the rows/s of {serving}, "
                f"geometric mean over batch sizes; no slower at any); serves {chosen}")  # fmt: skip
        return AutoResult(chosen, serving, results, skipped, summary, rp)
    finally:
        for t in tmp.values():
            t.unlink(missing_ok=True)


def not_slower(cand: dict, base: dict) -> bool:
    """Whether ``cand``'s rows/s is at least ``base``'s at every measured batch size."""
    theirs = {b["batch"]: b["rows_per_s"] for b in base["batches"]}
    return all(b["rows_per_s"] >= theirs[b["batch"]] for b in cand["batches"])


def _serving_variant(model_dir: Path, version: str | None) -> str:
    try:
        specs = load_model(model_dir)
    except ConfigError:
        return "fp32"
    by_version = {s.version: s for s in specs}
    return (by_version.get(version) or specs[-1]).variant


def _auto_report(spec, serving, chosen, results, skipped, timing, memory, held, opts, core, started) -> dict:
    rows = []
    base = timing["original"]["score_rows_per_s"]
    untimed = {"latency_ms": {"p50": None, "p99": None}, "batches": [], "score_rows_per_s": None}
    for k in [*timing, *(v for v in results if v not in timing)]:  # the failed candidates last, untimed
        t = timing.get(k, untimed)
        r = results.get(k)
        rep = r.report if r else None
        entry = {
            "candidate": "fp32 (original)" if k == "original" else k,
            "engine": engine_precision(k if k != "original" else "fp32")[0],
            "precision": rep["variant"]["precision"] if rep else VARIANT_PRECISION.get(k, "FP32"),
            "status": r.status if r else "original",
            "failures": r.failures if r else [],
            "p50_ms": t["latency_ms"]["p50"],
            "p99_ms": t["latency_ms"]["p99"],
            "rows_per_s": {str(b["batch"]): b["rows_per_s"] for b in t["batches"]},
            "score_rows_per_s": t["score_rows_per_s"],
            "x_original": None if t["score_rows_per_s"] is None else t["score_rows_per_s"] / base,
            "rss_bytes": memory.get(k),
        }
        if rep:
            entry["accuracy"] = _strip(rep["accuracy"])
            entry["accuracy_by_kind"] = rep["accuracy_by_kind"]
            entry["batch_independence_max_abs"] = rep["batch_independence_max_abs"]
            entry["batch_independence_bound"] = rep["batch_independence_bound"]
        rows.append(entry)
    return {
        "model": spec.name,
        "version": spec.version,
        "serving_before": serving,
        "chosen": chosen,
        "candidates": rows,
        "skipped": skipped,
        "thresholds": asdict(opts.thresholds),
        "heldout": {"source": held.source, "rows": len(held), "sha256": held.digest},
        "machine": machine(core),
        "cpu_class": cpu_class(),
        "date": datetime.date.today().isoformat(),
        "command": opts.command,
        "seconds": round(time.perf_counter() - started, 1),
    }


def write_auto_report(r: dict, json_path: Path) -> None:
    tmp = json_path.with_name(f".{json_path.name}.tmp")
    tmp.write_text(json.dumps(r, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, json_path)
    json_path.with_suffix(".md").write_text(auto_markdown(r))


def auto_markdown(r: dict) -> str:
    sizes = list(r["candidates"][0]["rows_per_s"])
    lines = [
        f"# {r['model']} v{r['version']}: engine and precision by measurement — serves {r['chosen'] or r['serving_before']}",
        "",
        f"{r['date']}, {r['machine']} (arithmetic class {r['cpu_class']}). Command: `{r['command'] or 'batchgate optimize --auto'}`.",
        f"Gate on {r['heldout']['rows']} held-out rows from {r['heldout']['source']}; every engine timed "
        "alternately in one run on one pinned core, one thread.",
        "",
        "| candidate | engine | precision | gate | min cos | mean cos | batch indep. (bound) | p50 ms | p99 ms | "
        + " | ".join(f"rows/s @{b}" for b in sizes)
        + " | x original | RSS MiB |",
        "|---|---|---|---|---|---|---|---|---|" + "---|" * len(sizes) + "---|---|",
    ]
    for c in r["candidates"]:
        acc = next(iter(c.get("accuracy", {}).values()), None)
        if acc is None:
            cos = ("1", "1")
        elif acc["kind"] == "embedding":
            cos = (f"{acc['min_cosine']:.5f}", f"{acc['mean_cosine']:.5f}")
        else:
            cos = (f"abs {acc['max_abs_err']:.2g}", f"rank {acc['rank_agreement']:.4f}")
        bi = (f"{c['batch_independence_max_abs']:.1e} ({c['batch_independence_bound']:g})"
              if "batch_independence_max_abs" in c else "-")  # fmt: skip
        rss = c["rss_bytes"]
        if c["p50_ms"] is None:  # failed the gate: not timed
            speed = " | ".join(["-"] * (3 + len(sizes)))
        else:
            speed = (f"{c['p50_ms']:.2f} | {c['p99_ms']:.2f} | "
                     + " | ".join(f"{c['rows_per_s'][b]:.1f}" for b in sizes) + f" | {c['x_original']:.2f}")  # fmt: skip
        lines.append(
            f"| {c['candidate']} | {c['engine']} | {c['precision']} | {c['status']} | {cos[0]} | {cos[1]} | {bi} | "
            f"{speed} | {'-' if rss is None else f'{rss / 2**20:.0f}'} |"
        )
    lines.append("")
    for c in r["candidates"]:
        if c["failures"]:
            lines.append(f"- {c['candidate']} refused: {'; '.join(c['failures'])}")
    for v, why in r["skipped"].items():
        lines.append(f"- {v} not built: {why}")
    kinds = {c["candidate"]: c["accuracy_by_kind"] for c in r["candidates"] if c.get("accuracy_by_kind")}
    if kinds:
        out = next(iter(next(iter(kinds.values()))))
        names = list(next(iter(kinds.values()))[out])
        first = next(iter(kinds.values()))[out][names[0]]
        fig = "min_cosine" if "min_cosine" in first else "max_abs_err"
        lines += ["", f"Gate figure per kind of held-out row ({out}, {fig.replace('_', ' ')}):", "",
                  "| candidate | " + " | ".join(f"{n} ({first_rows})" for n, first_rows in
                                               ((n, next(iter(kinds.values()))[out][n]["rows"]) for n in names)) + " |",
                  "|---|" + "---|" * len(names)]  # fmt: skip
        for cand, per in kinds.items():
            lines.append(f"| {cand} | " + " | ".join(f"{per[out][n][fig]:.5f}" for n in names) + " |")
    lines += ["", "x original: the geometric mean of rows/s over the batch sizes, against ONNX Runtime FP32 "
              "(the original) in the same run. --auto serves the fastest (by that mean) candidate that passed "
              "the gate and is no slower than what served before at any batch size; else it keeps what served. "
              "A candidate that failed the gate is not timed (-)."]  # fmt: skip
    return "\n".join(lines) + "\n"


def machine(core: int | None = None) -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    import onnxruntime as ort

    pinned = f", pinned to core {core}" if core is not None else ""
    return f"{cpu}, {os.cpu_count()} cores{pinned}; ONNX Runtime {ort.__version__}; Python {platform.python_version()}"


# -- the report ----------------------------------------------------------------------------------


def write_report(report: dict, json_path: Path) -> None:
    """JSON (what the repository checks), Markdown (what a person reads) and a PNG beside it."""
    tmp = json_path.with_name(f".{json_path.name}.tmp")
    tmp.write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, json_path)
    png = json_path.with_suffix(".png")
    drew = plot(report, png)
    json_path.with_suffix(".md").write_text(markdown(report, png.name if drew else None))


def markdown(r: dict, png: str | None) -> str:
    v = r["variant"]["name"]
    lines = [
        f"# {r['model']} v{r['version']}: {v} ({r['variant']['precision']}) — gate {r['status'].upper()}",
        "",
        f"{r['date']}, {r['machine']}. Command: `{r['command'] or 'batchgate optimize'}`.",
        f"Held-out: {r['heldout']['rows']} rows from {r['heldout']['source']}; calibration: "
        f"{r['calibration']['rows']} rows from {r['calibration']['source']}.",
        "",
    ]
    if r["failures"]:
        lines += ["**Refused:** " + "; ".join(r["failures"]) + ".", ""]
    t = r["thresholds"]
    lines += ["| output | figure | value | threshold | |", "|---|---|---|---|---|"]
    for name, a in r["accuracy"].items():
        if a["kind"] == "embedding":
            rows = [("min cosine", a["min_cosine"], f">= {t['min_cosine']}", a["min_cosine"] >= t["min_cosine"]),
                    ("mean cosine", a["mean_cosine"], f">= {t['mean_cosine']}", a["mean_cosine"] >= t["mean_cosine"]),
                    (f"nearest neighbour agreement (near-ties within {NN_TIE:g})", a["nn_agreement"],
                     f">= {t['nn_agreement']}", a["nn_agreement"] >= t["nn_agreement"])]  # fmt: skip
            if "nn_exact" in a:
                rows.append(("nearest neighbour exactly the same", a["nn_exact"], "reported", None))
        else:
            rows = [("max abs error", a["max_abs_err"], f"<= {t['max_abs_err']}", a["max_abs_err"] <= t["max_abs_err"]),
                    ("max rel error", a["max_rel_err"], f"<= {t['max_rel_err']}", a["max_rel_err"] <= t["max_rel_err"]),
                    ("pair rank agreement", a["rank_agreement"], f">= {t['rank_agreement']}",
                     a["rank_agreement"] >= t["rank_agreement"])]  # fmt: skip
        for what, value, bound, ok in rows:
            mark = "" if ok is None else "ok" if ok else "FAIL"
            lines.append(f"| {name} | {what} | {value:.6f} | {bound} | {mark} |")
    bi = r["batch_independence_max_abs"]
    lines.append(f"| all | alone vs padded batch, max abs | {bi:.2e} | <= {t['batch_tolerance']:g} | "
                 f"{'ok' if bi <= t['batch_tolerance'] else 'FAIL'} |")  # fmt: skip
    lines += ["", "| engine | p50 ms (1 row) | p99 ms | " + " | ".join(
        f"rows/s @{b['batch']}" for b in r["speed"]["original"]["batches"]) + " | peak rows/s | RSS MiB |",
        "|---|---|---|" + "---|" * len(r["speed"]["original"]["batches"]) + "---|---|"]  # fmt: skip
    for k, s in r["speed"].items():
        rss = r["memory_rss_bytes"].get(k)
        lines.append(
            f"| {k} | {s['latency_ms']['p50']:.2f} | {s['latency_ms']['p99']:.2f} | "
            + " | ".join(f"{b['rows_per_s']:.1f}" for b in s["batches"])
            + f" | {s['peak_rows_per_s']:.1f} | {'-' if rss is None else f'{rss / 2**20:.0f}'} |"
        )
    sp = r["speedup"]
    if sp is None:
        lines += [
            "",
            "Not timed: a candidate that fails the gate never serves (--auto times only those that pass).",
            "",
        ]
    else:
        lines += ["", f"Speed-up over the original: x{sp['latency_p50']:.2f} p50 latency of one row, "
                  f"x{sp['peak_rows_per_s']:.2f} peak rows/s (one thread, pinned core, same run, same rows).", ""]  # fmt: skip
    b = r["build"]
    if "fusions" in b:
        lines.append(f"Fusions: {', '.join(f'{k} x{n}' for k, n in b['fusions'].items()) or 'none'}.")
    if "int8_nodes" in b:
        kept = ", ".join(f"`{x['node']}`" for x in b["fp32_nodes"]) or "none"
        lines.append(
            (
                f"INT8: {b['method']}{' p' + format(b['percentile'], 'g') if b.get('percentile') else ''} calibration, "
                if b.get("method")
                else "INT8: one activation scale per batch tensor at run time (ONNX Runtime's dynamic), "
                if b.get("scales") == "dynamic"
                else "INT8: activation scales per row at run time (no calibration of ranges), "
            )
            + f"SmoothQuant alpha {b.get('smooth_alpha') or 'off'} on {b.get('smoothed_activations', 0)} activations, "
            f"{b['weights']} weights, {b['activations']} activations; {b['int8_nodes']} of "
            f"{b['quantisable_nodes']} MatMul/Gemm nodes INT8; kept in FP32 (measured worst first): {kept}."
        )
    if "blocked_measured" in b:
        lines.append(
            f"FP16: op types kept FP32 by measurement: {', '.join(b['blocked_measured']) or 'none'}; "
            f"without an FP16 CPU kernel: {', '.join(b['no_fp16_kernel']) or 'none'}."
        )
    lines += ["", f"Original sha256 `{r['original']['sha256']}`, variant sha256 `{r['variant']['sha256']}`."]
    if png:
        lines += ["", f"![latency against throughput; accuracy per row]({png})"]
    return "\n".join(lines) + "\n"


def plot(r: dict, path: Path) -> bool:
    """Latency against throughput per engine (one point per batch size) and the per-row accuracy
    distribution. False (and no file) without matplotlib, which serving does not install."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for k, s in r["speed"].items():
        xs = [b["rows_per_s"] for b in s["batches"]]
        ys = [b["p50_ms"] for b in s["batches"]]
        ax1.plot(xs, ys, marker="o", label=k)
        for b, x, y in zip(s["batches"], xs, ys):
            ax1.annotate(f"b{b['batch']}", (x, y), fontsize=7)
    ax1.set_xlabel("rows/s (one thread)")
    ax1.set_ylabel("p50 ms per batch")
    ax1.set_yscale("log")
    ax1.legend()
    ax1.set_title("latency against throughput")
    for name, a in r["accuracy"].items():
        vals = np.asarray(a["per_row"])
        label = f"{name}: cosine per row" if a["kind"] == "embedding" else f"{name}: abs error per row"
        # A variant that computes what the original does has all its rows a float's step apart:
        # one bin, widened, where 40 would not fit.
        tiny = np.ptp(vals) <= 1e-6
        ax2.hist(vals, bins=1 if tiny else 40, range=(vals.min() - 1e-6, vals.max() + 1e-6) if tiny else None,
                 label=label)  # fmt: skip
    ax2.set_title(f"{r['variant']['name']} vs original, held-out rows")
    ax2.legend(fontsize=7)
    fig.suptitle(f"{r['model']} {r['variant']['name']}: {r['status']}")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True


# -- choosing what serves --------------------------------------------------------------------------

_VARIANT_LINE = re.compile(
    r'^\s*parameters\s*\{\s*key:\s*"variant"\s*value\s*\{\s*string_value:\s*"[^"]*"\s*\}\s*\}\s*$'
)


def set_variant(model_dir: Path, variant: str, version: str | None = None) -> str:
    """Make ``variant`` what the model serves on its next load (config.pbtxt parameter
    ``variant``; ``fp32`` removes it). Refused, saying why, when that variant may not serve."""
    if variant not in VARIANT_PRECISION:
        raise OptimizeError(f"variant must be one of {', '.join(VARIANT_PRECISION)}, got '{variant}'")
    spec = _spec(model_dir, version)
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
