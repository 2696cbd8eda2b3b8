"""``batchgate optimize MODEL --int8`` (or any one named variant), the whole step: build it, gate it on
the held-out rows, time it against the original, write its report, and put the file in place only
when it passed."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from batchgate.gateway.models.optimize.candidates import build_variant
from batchgate.gateway.models.optimize.gate import gate_variant
from batchgate.gateway.models.optimize.options import Log, Options, check_options, model_spec
from batchgate.gateway.models.optimize.report import publish, variant_report
from batchgate.gateway.models.optimize.rows import calibration_and_heldout
from batchgate.gateway.models.optimize.sessions import run_rows, session
from batchgate.gateway.models.optimize.timing import engine_rss, pin_core, speed
from batchgate.gateway.repository import build_path, report_path, variant_path


@dataclass(slots=True)
class Result:
    status: str  # passed | failed
    failures: list[str]
    report: dict
    variant_file: Path | None  # None: not written (failed without force)
    report_file: Path


def optimize(model_dir: Path, opts: Options, log: Log = print) -> Result:
    """Build ``opts.variant`` of the model in ``model_dir``, gate it, write it and its report.
    Does not change what the model serves (``set_variant`` does)."""
    check_options(opts)
    spec = model_spec(model_dir, opts.version)
    src = spec.path
    variant = opts.variant
    dst = variant_path(src, variant)
    started = time.perf_counter()
    log(f"{spec.name} v{spec.version}: building {variant} from {src}")
    calib, held = calibration_and_heldout(spec, opts)
    tmp_dst = build_path(dst)
    try:
        file, build = build_variant(src, variant, tmp_dst, calib, opts, log)
        log(f"evaluating on {len(held)} held-out rows ({held.source})")
        ref = run_rows(session(src), held.feeds)
        acc, failures, indep = gate_variant(ref, file, variant, held, opts)
        if build.get("nothing_quantised"):
            failures.append("int8_nodes 0: no node stays INT8 within the targets (needs >= 1)")
        core = pin_core(opts.core)
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
        report = variant_report(spec, variant, file, status, failures, opts, acc, indep, timing, memory, build,
                         calib, held, core, started)  # fmt: skip
        written = publish(report, spec, variant, file, opts)
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
