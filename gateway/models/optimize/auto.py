"""``batchgate optimize --auto`` (and the background selection, gateway/selection.py): every candidate
this host builds, gated against the original on the same held-out rows; those that pass timed with the
original and what serves now in one run; the choice is the fastest that passed, never one slower than
what serves now at any batch size."""

from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass
from dataclasses import replace as dataclass_replace
from pathlib import Path

from batchgate.gateway.models.optimize.candidates import build_variant
from batchgate.gateway.models.optimize.gate import gate_variant
from batchgate.gateway.models.optimize.options import Log, OptimizeError, Options, check_options, model_spec
from batchgate.gateway.models.optimize.report import auto_report, publish, variant_report, write_auto_report
from batchgate.gateway.models.optimize.rows import calibration_and_heldout
from batchgate.gateway.models.optimize.serving import serving_variant
from batchgate.gateway.models.optimize.sessions import run_rows, session
from batchgate.gateway.models.optimize.single import Result
from batchgate.gateway.models.optimize.timing import engine_rss, pin_core, speed
from batchgate.gateway.repository import ConfigError, build_path, check_variant, report_path, variant_path


# What `--auto` builds and measures on a host, in this order (the original, ONNX Runtime FP32, is
# measured beside them as the baseline): ONNX Runtime's INT8 and OpenVINO's FP32, BF16 (where the
# CPU computes it natively) and INT8 (where NNCF is installed), and ONNX Runtime's INT8 with the
# GEMMs measured sensitive on odd tuning rows kept FP32 (int8-mixed, gateway/models/optimize/mixed.py).
AUTO_CANDIDATES = ("int8", "openvino-fp32", "openvino-bf16", "openvino-int8", "int8-mixed")


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
    spec = model_spec(model_dir, opts.version)
    serving = serving_variant(model_dir, spec.version)
    src = spec.path
    take, skipped = auto_candidates()
    if candidates is not None:
        take = [c for c in candidates if c in take]
    for v, why in skipped.items():
        log(f"{v}: skipped: {why}")
    started = time.perf_counter()
    calib, held = calibration_and_heldout(spec, opts)
    log(
        f"{spec.name} v{spec.version}: candidates {', '.join(take)}; gate on {len(held)} held-out rows ({held.source})"
    )
    ref = run_rows(session(src), held.feeds)
    tmp: dict[str, Path] = {}
    built: dict[str, tuple[Path, dict, dict, list[str], dict]] = {}
    try:
        for v in take:
            o = dataclass_replace(opts, variant=v)
            check_options(o)
            tmp[v] = build_path(variant_path(src, v))
            t0 = time.perf_counter()
            try:
                file, build = build_variant(src, v, tmp[v], calib, o, log)
            except OptimizeError as exc:
                skipped[v] = str(exc)
                log(f"{v}: not built: {exc}")
                continue
            acc, failures, indep = gate_variant(ref, file, v, held, o)
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
        core = pin_core(opts.core)
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
            report = variant_report(spec, v, file, status, failures, o, acc, indep, timing, memory, build, calib, held,
                             core, started)  # fmt: skip
            written = publish(report, spec, v, file, o)
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
        summary = auto_report(
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
