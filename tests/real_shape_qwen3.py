"""Qwen3-Embedding-0.6B's real shape through the external-data path, by hand (too slow and large
for the suite): a folder with its config (hidden 1024, 28 layers, 16 heads, 8 KV heads, head_dim
128, intermediate 3072, vocab 151669) and random bfloat16 weights written by numpy (no download,
no torch), prepared (2.4 GiB as float32: model.onnx + model.onnx.data), served by a real server on
loopback, and one /v1/embeddings call with the "query" prompt answered and compared with ONNX
Runtime run on the prepared graph directly. Prints the times, sizes and peak RSS that
docs/embeddings.md quotes.

    .venv/bin/python -m tests.real_shape_qwen3 [--keep DIR]

Needs about 6 GiB of free memory and 6 GiB of disk; a few minutes on two cores.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np

from tests.test_external_data import qwen3_folder
from tests.test_prepare_families import QUERIES, _post

SHAPE = dict(hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=3072, vocab=151669)


def _child(args: list[str]) -> tuple[float, int]:
    """Run ``args``; (seconds, the child's peak RSS in bytes)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(args)
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{args} failed")
    return time.monotonic() - t0, usage.ru_maxrss * 1024


def _status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", type=Path, help="work here and keep the files (default: a temp dir, removed)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="qwen3-real-shape-") as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        folder, repo = root / "Qwen3-Embedding-0.6B-random", root / "repo"
        gib = 2**30

        t0 = time.monotonic()
        qwen3_folder(folder, **SHAPE, std=0.02, dtype=ml_dtypes.bfloat16)
        print(
            f"folder: {time.monotonic() - t0:.1f}s, model.safetensors {(folder / 'model.safetensors').stat().st_size / gib:.2f} GiB (bfloat16)"
        )

        py = sys.executable
        secs, rss = _child([py, "-m", "batchgate", "prepare-model", str(folder), "--name", "qwen3",
                            "--model-repository", str(repo)])  # fmt: skip
        v1 = repo / "qwen3" / "1"
        sizes = {p.name: p.stat().st_size for p in v1.iterdir()}
        print(f"prepare-model: {secs:.1f}s, peak RSS {rss / gib:.2f} GiB, files {sizes}")

        from batchgate.workers.fingerprint import file_fingerprint

        t0 = time.monotonic()
        file_fingerprint(v1 / "model.onnx")
        print(f"fingerprint (graph + data): {time.monotonic() - t0:.1f}s")

        from tests.conftest import start_server

        t0 = time.monotonic()
        srv = start_server(root, "--no-build-models", repo=repo, ready_timeout=900)
        ready = time.monotonic() - t0
        try:
            base = f"http://127.0.0.1:{srv.http_port}"
            body = {"model": "qwen3", "input": QUERIES[:1], "prompt_name": "query"}
            t0 = time.monotonic()
            got = np.array(_post(base + "/v1/embeddings", body)["data"][0]["embedding"], np.float32)
            call = time.monotonic() - t0
            rss_now, rss_peak = _status(srv.proc.pid, "VmRSS"), _status(srv.proc.pid, "VmHWM")
        finally:
            srv.stop()
        print(f"serve: ready in {ready:.1f}s; one /v1/embeddings call (1 query, 'query' prompt) {call * 1e3:.0f} ms; "
              f"server RSS {rss_now / gib:.2f} GiB after the call, peak {rss_peak / gib:.2f} GiB")  # fmt: skip

        import onnxruntime as ort

        from batchgate.gateway.repository import load_model
        from batchgate.gateway.text import TextStage

        (spec,) = load_model(repo / "qwen3")
        prompt = spec.params.prompts["query"]
        feeds = TextStage(spec)({"text": np.array([prompt + QUERIES[0]], dtype=object)})
        for level in ("ORT_ENABLE_ALL", "ORT_DISABLE_ALL"):
            so = ort.SessionOptions()
            so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
            t0 = time.monotonic()
            sess = ort.InferenceSession(str(v1 / "model.onnx"), so, providers=["CPUExecutionProvider"])
            print(f"ORT session ({level}): {time.monotonic() - t0:.1f}s")
        want = sess.run(["embedding"], feeds)[0][0]
        cos = float(got @ want / np.linalg.norm(got) / np.linalg.norm(want))
        print(
            f"served vs ONNX Runtime direct: cosine {cos:.8f}, max |diff| {np.abs(got - want).max():.2e}, dim {got.size}"
        )
        print(f"this process's peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")
        if cos < 0.99999:
            raise SystemExit("served answer differs from ONNX Runtime's")


if __name__ == "__main__":
    main()
