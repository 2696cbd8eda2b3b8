"""What batching can buy MiniLM on this machine: ONNX Runtime alone, no server, in one run.

The goals of lab/minilm_bench.py rest on two properties of the hardware, measured here:

* batching gain per length: time per row at batch sizes 1..32 for each sequence length, relative
  to batch 1 (what one call per text pays). A batched server cannot beat one call per text by
  more than this on compute, whatever it does;
* the cost of padding: a batch of the mixed workload's texts padded to its longest text, against
  the same texts run one by one at their own lengths.

Each figure is for one session with ``--threads`` intra-op threads (1: as each of the server's
workers runs it).

    .venv/bin/python -m lab.minilm_ort [--threads 1] [--seconds 0.5]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def _session(path: Path, threads: int):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _feeds(session, rows: int, seq: int, rng: np.random.Generator, lengths: list[int] | None = None) -> dict:
    ids = rng.integers(1000, 2000, (rows, seq)).astype(np.int64)
    mask = np.ones((rows, seq), np.int64)
    for i, n in enumerate(lengths or []):
        mask[i, n:] = 0
    names = {i.name for i in session.get_inputs()}
    feeds = {"input_ids": ids, "attention_mask": mask}
    if "token_type_ids" in names:
        feeds["token_type_ids"] = np.zeros((rows, seq), np.int64)
    return feeds


def _time(session, feeds: dict, seconds: float) -> float:
    """Seconds per run: the median of several timed stretches after two warm-up runs."""
    for _ in range(2):
        session.run(None, feeds)
    samples = []
    stop = time.perf_counter() + seconds
    while time.perf_counter() < stop or len(samples) < 3:
        t0 = time.perf_counter()
        session.run(None, feeds)
        samples.append(time.perf_counter() - t0)
    return float(np.median(samples))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / "model_repository" / "minilm" / "1" / "model.onnx")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=0.3, help="per measured point")
    args = ap.parse_args()
    if not args.model.is_file():
        print(f"{args.model} is missing: run `batchgate prepare-minilm` first", file=sys.stderr)
        return 2
    session = _session(args.model, args.threads)
    rng = np.random.default_rng(0)
    sizes = (1, 4, 8, 16, 32)
    print(f"ms per row by batch size ({args.threads} intra-op thread(s)); x = gain over batch 1")
    print(f"{'tokens':>6} " + " ".join(f"{'bs' + str(b):>14}" for b in sizes))
    for seq in (16, 24, 32, 64, 128, 256):
        per_row = [_time(session, _feeds(session, b, seq, rng), args.seconds) / b * 1e3 for b in sizes]
        print(f"{seq:>6} " + " ".join(f"{ms:>7.2f} (x{per_row[0] / ms:.2f})" for ms in per_row))

    from lab.minilm_bench import workload

    tok = None
    tokenizer = args.model.parent.parent / "tokenizer.json"
    if tokenizer.is_file():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tokenizer))
        tok.no_padding()
        tok.enable_truncation(256)
    texts = workload("mixed")[:256]
    lengths = [len(tok.encode(t).ids) if tok else min(256, len(t.split()) + 2) for t in texts]
    print(
        "\npadding, mixed workload: batches of B texts padded to their longest vs the same texts one by one"
    )
    for b in (8, 16, 32):
        padded = alone = 0.0
        for start in range(0, 64, b):
            chunk = lengths[start : start + b]
            padded += _time(session, _feeds(session, len(chunk), max(chunk), rng, chunk), args.seconds / 10)
            alone += sum(_time(session, _feeds(session, 1, n, rng), args.seconds / 20) for n in chunk)
        print(
            f"  B={b:<3} padded {padded * 1e3:8.1f} ms, one by one {alone * 1e3:8.1f} ms: padded x{padded / alone:.2f} slower"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
