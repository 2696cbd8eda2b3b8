"""One model file under every engine and precision this host has, per shape, in one run.

ms per row at batch 1, 8 and 32 for rows of 16 and 64 tokens (random token ids, every position
real), one thread, pinned to one core, each engine at its quickest of ``--repeats``, alternated;
then each engine's cosine to ONNX Runtime FP32 on the same rows. The CPU is named first.

    .venv/bin/python -m batchgate.bench.engines [--model-dir model_repository/minilm] [--core 0]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def cpu_line() -> str:
    from batchgate.gateway.models.optimize import machine
    from batchgate.workers.devices import cpu_class

    return f"{machine()}; arithmetic class {cpu_class()}"


def feeds(names: list[str], rows: int, tokens: int, seed: int) -> dict[str, np.ndarray]:
    ids = np.random.default_rng(seed).integers(1000, 20000, (rows, tokens)).astype(np.int64)
    out = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
    return {n: out[n] for n in names}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, default=ROOT / "model_repository" / "minilm")
    p.add_argument("--core", type=int, default=0)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    path = args.model_dir / "1" / "model.onnx"
    if not path.is_file():
        print(f"{path} is missing (minilm: `batchgate prepare-minilm`)", file=sys.stderr)
        return 2
    os.sched_setaffinity(0, {args.core})
    from batchgate.gateway.models.optimize import session
    from batchgate.workers import openvino_engine

    engines = {"onnxruntime FP32": session(path)}
    if openvino_engine.available():
        engines["openvino FP32"] = openvino_engine.Session(path, precision="fp32")
        if openvino_engine.native_bf16():
            engines["openvino BF16"] = openvino_engine.Session(path, precision="bf16")
    names = [i.name for i in engines["onnxruntime FP32"].get_inputs()]
    print(cpu_line())
    print(f"{path}, one thread on core {args.core}, ms per row (min of {args.repeats}):")
    print(f"{'engine':<18} " + " ".join(f"{f'{t} tok @{b}':>11}" for t in (16, 64) for b in (1, 8, 32)))
    times = {k: [] for k in engines}
    for tokens in (16, 64):
        for rows in (1, 8, 32):
            x = feeds(names, rows, tokens, tokens * 100 + rows)
            best = {k: float("inf") for k in engines}
            for s in engines.values():
                s.run(None, x)
            for _ in range(args.repeats):
                for k, s in engines.items():
                    t0 = time.perf_counter()
                    s.run(None, x)
                    best[k] = min(best[k], time.perf_counter() - t0)
            for k in engines:
                times[k].append(best[k] / rows * 1e3)
    for k, ts in times.items():
        print(f"{k:<18} " + " ".join(f"{t:>11.2f}" for t in ts))
    base = times["onnxruntime FP32"]
    for k, ts in times.items():
        print(f"{k:<18} " + " ".join(f"{b / t:>10.2f}x" for b, t in zip(base, ts)))
    x = feeds(names, 32, 40, 7)
    ref = engines["onnxruntime FP32"].run(None, x)[0]
    for k, s in engines.items():
        got = s.run(None, x)[0]
        cos = (ref * got).sum(1) / np.linalg.norm(ref, axis=1) / np.linalg.norm(got, axis=1)
        print(f"{k}: cosine to ONNX Runtime FP32 on 32 rows of 40 random tokens: min {cos.min():.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
