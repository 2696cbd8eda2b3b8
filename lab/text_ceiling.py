"""What OpenVINO BF16 could serve on bench.variants' texts if the gateway cost nothing: the engine's
ceiling, against the limit bench.variants divides by (ONNX Runtime FP32, each text alone and
unpadded), on one pinned core, one thread, CPU time of this thread.

Printed: the texts' token lengths; BF16 with each text alone; BF16 on the batches the scheduler
forms (rows grouped by minilm's length buckets, each batch at its longest row) from K texts
outstanding, for K in ``--outstanding``. Served figures can only be lower: the gateway's own work
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", type=Path, default=ROOT / "model_repository" / "minilm")
    ap.add_argument("--core", type=int, default=0)
    ap.add_argument("--outstanding", default="8,16,32,64")
    ap.add_argument("--repeats", type=int, default=6)
    args = ap.parse_args()
    os.sched_setaffinity(0, {args.core})

    import onnxruntime as ort
    import openvino as ov
    from tokenizers import Tokenizer

    from batchgate.bench.engines import cpu_line
    from batchgate.bench.text_batches import texts

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
        ids = np.zeros((len(rows), max(len(e.ids) for e in rows)), np.int64)
        mask = np.zeros_like(ids)
        for i, e in enumerate(rows):
            ids[i, : len(e.ids)] = e.ids
            mask[i, : len(e.ids)] = 1
        f = {"input_ids": ids, "attention_mask": mask}
        if "token_type_ids" in names:
            f["token_type_ids"] = np.zeros_like(ids)
        return f

    def timed(run, f) -> float:
        run(f)  # a new shape's first run is not the steady state
        t0 = time.thread_time()
        run(f)
        return time.thread_time() - t0

    def ort_run(f):
        session.run(None, f)

    ort_s = sum(timed(ort_run, feeds([e])) for e in enc) / len(enc)
    alone = sum(timed(request.infer, feeds([e])) for e in enc) / len(enc)
    print(cpu_line())
    print(f"{len(enc)} texts, tokens p10 {np.percentile(lengths, 10):.0f}, median {np.median(lengths):.0f}, "
          f"p90 {np.percentile(lengths, 90):.0f}, max {max(lengths)}")  # fmt: skip
    print(f"ONNX Runtime FP32, each text alone, unpadded: {ort_s * 1e3:.2f} ms a text (the limit)")
    print(f"OpenVINO BF16, each text alone:               {alone * 1e3:.2f} ms a text  x{ort_s / alone:.2f}")
    rng = random.Random(1)
    for k in (int(x) for x in args.outstanding.split(",")):
        spent, rows = 0.0, 0
        for _ in range(args.repeats):
            picked = rng.sample(range(len(enc)), min(k, len(enc)))
            groups: dict[int, list] = {}
            for i in picked:
                groups.setdefault(next(b for b in BUCKETS if lengths[i] <= b), []).append(enc[i])
            for g in groups.values():
                spent += timed(request.infer, feeds(g))
                rows += len(g)
        print(f"OpenVINO BF16, batches from {k:>3} outstanding:     {spent / rows * 1e3:.2f} ms a text  "
              f"x{ort_s / (spent / rows):.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
