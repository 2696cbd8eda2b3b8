"""The gate: a candidate's answers on the held-out rows against the original's (accuracy per output
and per kind of row, batch independence) and the thresholds' verdict. A candidate that misses one
never serves. The same figures steer the builds on the calibration rows (candidates.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from batchgate.gateway.models.optimize.options import Options
from batchgate.gateway.models.optimize.rows import Rows, pad_batch, row_len
from batchgate.gateway.models.optimize.sessions import engine_precision, engine_session, judged, run_rows
from batchgate.gateway.models.thresholds import NN_TIE, Thresholds


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


def worst_harm(acc: dict[str, dict]) -> float:
    """One number per candidate model for the sensitivity scan: the worst row's harm."""
    worst = 0.0
    for a in acc.values():
        worst = max(worst, 1 - a["min_cosine"] if a["kind"] == "embedding" else a["max_abs_err"])
    return worst


def batch_independence(sess, feeds: list[dict[str, np.ndarray]], alone: dict[str, np.ndarray]) -> float:
    """Largest difference between a row's output alone and in a batch with rows of other lengths
    padded to the longest (groups of 8 spread over the lengths, as a length bucket holds)."""
    order = sorted(range(len(feeds)), key=lambda i: row_len(feeds[i]))
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


def gate_variant(
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


def without_per_row(acc: dict) -> dict:
    return {k: {kk: vv for kk, vv in v.items() if kk != "per_row"} for k, v in acc.items()}
