"""``int8-mixed`` beside the candidates it competes with, through ``optimize --auto`` itself.

Copies a model folder from the repository into a temporary one (nothing in the repository
changes), runs ``optimize_auto`` with the chosen candidates (the gate on the held-out rows, then
every candidate that passed timed with ONNX Runtime FP32 alternately on one pinned core), and
prints its table, the gate figure per kind of row, and what the mixed build kept in FP32.

    .venv/bin/python -m lab.int8_mixed [--model minilm] [--candidates int8,openvino-bf16,int8-mixed]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

from batchgate.gateway.models.optimize import Options, auto_markdown, optimize_auto

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="minilm")
    p.add_argument("--model-repository", type=Path, default=ROOT / "model_repository")
    p.add_argument("--candidates", default="int8,openvino-bf16,int8-mixed")
    p.add_argument("--repeats", type=int, default=3, help="timing repeats (optimize's default 3)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="int8-mixed-") as tmp:
        model = Path(tmp) / args.model
        shutil.copytree(args.model_repository / args.model, model)
        for f in model.glob("*/model.*.*"):  # variants and reports built before: not this run's
            f.unlink()
        t0 = time.perf_counter()
        res = optimize_auto(
            model, Options("int8", timing_repeats=args.repeats, memory=False, command=" ".join(sys.argv)),
            log=lambda m: print(m, flush=True), candidates=args.candidates.split(","),
        )  # fmt: skip
        print(f"\n--auto took {time.perf_counter() - t0:.0f} s\n")
        print(auto_markdown(res.report))
        mixed = res.candidates.get("int8-mixed")
        if mixed is not None:
            b = mixed.report["build"]
            print(f"int8-mixed: {b['int8_nodes']} of {b['quantisable_nodes']} weight GEMMs INT8; kept FP32 "
                  f"(worst alone first): {', '.join(k['node'] for k in b['fp32_nodes']) or 'none'}; "
                  f"search {b['search_seconds']} s on {b['tuning']['rows']} tuning rows")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
