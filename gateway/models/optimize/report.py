"""The reports: each candidate's (JSON the repository checks before it serves a variant, Markdown a
person reads, a PNG) and ``--auto``'s one table of them all; ``publish`` moves a candidate's file into
place only when its report passed."""

from __future__ import annotations

import datetime
import json
import os
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from batchgate.workers.devices import cpu_class

from batchgate.gateway.models.optimize.gate import by_kind, without_per_row
from batchgate.gateway.models.optimize.options import Options
from batchgate.gateway.models.optimize.rows import Rows
from batchgate.gateway.models.optimize.sessions import engine_precision
from batchgate.gateway.models.optimize.timing import machine
from batchgate.gateway.models.thresholds import NN_TIE
from batchgate.gateway.repository import VARIANT_PRECISION, ModelSpec, report_path, sha256_file, variant_path


def variant_report(spec: ModelSpec, variant: str, file: Path, status: str, failures: list[str], opts: Options,
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


def publish(report: dict, spec: ModelSpec, variant: str, file: Path, opts: Options) -> Path | None:
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


def auto_report(spec, serving, chosen, results, skipped, timing, memory, held, opts, core, started) -> dict:
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
            entry["accuracy"] = without_per_row(rep["accuracy"])
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
