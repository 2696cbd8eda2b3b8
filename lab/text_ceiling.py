"""What OpenVINO BF16 could serve on bench.variants' texts if the gateway cost nothing: the engine's
ceiling, against the limit bench.variants divides by (ONNX Runtime FP32, each text alone and
unpadded), on one pinned core, one thread, CPU time of this thread.

Printed: the texts' token lengths; BF16 with each text alone; BF16 on the batches the scheduler
forms (rows grouped by minilm's length buckets, each batch at its longest row) from K texts
outstanding, for K in ``--outstanding`` (every text once a repeat, K at a time). Served figures can only be lower: the gateway's own work
shares the core.

    .venv/bin/python -m lab.text_ceiling [--model-dir model_repository/minilm] [--core 0]
"""

from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
BUCKETS = (16, 24, 32, 48, 64, 96, 128, 192, 256)  # minilm's length_buckets


def scheduler_batches(order: list[int], k: int, lengths: list[int]) -> list[list[int]]:
    """The batches the scheduler forms from ``k`` outstanding texts at a time (``order`` their
    indices): each group of k split by length bucket."""
    batches = []
    for start in range(0, len(order), k):
        groups: dict[int, list[int]] = {}
        for i in order[start : start + k]:
            groups.setdefault(next(b for b in BUCKETS if lengths[i] <= b), []).append(i)
        batches += groups.values()
    return batches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", type=Path, default=ROOT / "model_repository" / "minilm")
    ap.add_argument("--core", type=int, default=0)
    ap.add_argument("--outstanding", default="8,16,32,64")
    ap.add_argument("--repeats", type=int, default=5, help="rounds")
    args = ap.parse_args()
    os.sched_setaffinity(0, {args.core})

    import onnxruntime as ort
    import openvino as ov
    from tokenizers import Tokenizer

    from batchgate.bench.engines import cpu_line
    from batchgate.bench.text_batches import padded_feeds, texts

    model = str(args.model_dir / "1" / "model.onnx")
    tok = Tokenizer.from_file(str(args.model_dir / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(BUCKETS[-1])
    enc = tok.encode_batch(texts())
    lengths = [len(e.ids) for e in enc]
    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    session = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
    names = {i.name for i in session.get_inputs()}
    config = {"INFERENCE_NUM_THREADS": 1, "NUM_STREAMS": 1, "PERFORMANCE_HINT": "LATENCY",
              "INFERENCE_PRECISION_HINT": "bf16"}  # fmt: skip
    request = ov.Core().compile_model(model, "CPU", config).create_infer_request()

    def feeds(rows) -> dict[str, np.ndarray]:
        return padded_feeds(rows, names)

    def timed(run, f) -> float:
        run(f)  # a new shape's first run is not the steady state
        t0 = time.thread_time()
        run(f)
        return time.thread_time() - t0

    def ort_run(f):
        session.run(None, f)

    print(cpu_line())
    print(f"{len(enc)} texts, tokens p10 {np.percentile(lengths, 10):.0f}, median {np.median(lengths):.0f}, "
          f"p90 {np.percentile(lengths, 90):.0f}, max {max(lengths)}")  # fmt: skip
    rng = random.Random(1)
    outstanding = [int(x) for x in args.outstanding.split(",")]

    def batched(k: int) -> float:
        """ms a text on the batches the scheduler would form from k outstanding: every text once,
        k at a time, in a new order."""
        spent, rows = 0.0, 0
        order = rng.sample(range(len(enc)), len(enc))
        for batch in scheduler_batches(order, k, lengths):
            spent += timed(request.infer, feeds([enc[i] for i in batch]))
            rows += len(batch)
        return spent / rows

    # Rounds, each timing the limit and every case: this VM's core changes speed within a minute,
    # so each ratio is taken within its round and the median of the rounds is printed.
    rounds = []
    for _ in range(args.repeats):
        limit = sum(timed(ort_run, feeds([e])) for e in enc) / len(enc)
        alone = sum(timed(request.infer, feeds([e])) for e in enc) / len(enc)
        rounds.append((limit, alone, [batched(k) for k in outstanding]))

    def median(xs) -> float:
        return float(np.median(xs))

    limit = median([r[0] for r in rounds])
    print(f"ONNX Runtime FP32, each text alone, unpadded: {limit * 1e3:.2f} ms a text (the limit; median of "
          f"{len(rounds)} rounds, {min(r[0] for r in rounds) * 1e3:.2f}-{max(r[0] for r in rounds) * 1e3:.2f})")  # fmt: skip
    alone_x = median([r[0] / r[1] for r in rounds])
    print(f"OpenVINO BF16, each text alone:                x{alone_x:.2f}")
    for j, k in enumerate(outstanding):
        x = [r[0] / r[2][j] for r in rounds]
        print(
            f"OpenVINO BF16, batches from {k:>3} outstanding:    x{median(x):.2f} (rounds {min(x):.2f}-{max(x):.2f})"
        )


if __name__ == "__main__":
    main()
