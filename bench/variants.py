"""minilm's engine variants served end to end, against ONNX Runtime alone on the FP32 model, in one run.

The served half of issue 29's acceptance: one server pinned to one core serves minilm once per
variant (``minilm_fp32``, ``minilm_int8``, ...: the same files, config parameter ``variant``
set), the load generator runs on another core, many callers, the mixed-length texts of
``bench/texts/mixed.txt``. The limit is bench.text_batches' (ONNX Runtime alone, one thread, on the
server's core, the FP32 model, each text unpadded and alone), measured before and after the load in
the same run (the ratios use the mean).
Printed per variant and shape: texts/s, texts per server CPU-second and their ratios to the limit,
p50/p99; then the served embeddings of the held-out sentences (gateway/models/texts/heldout.txt)
from each variant against the served FP32 ones (cosine min/mean).

A variant is served only when its gate report passed (``batchgate optimize minilm --int8`` first).

    .venv/bin/python -m batchgate.bench.variants [--variants fp32,int8] [--seconds 15] [--shapes 64x1:standard]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import struct
import sys
import tempfile
from pathlib import Path

import grpc
import numpy as np

from batchgate.bench.loadgen import Started, free_ports
from batchgate.bench.text_batches import cpu_s, load, ort_limit, texts
from batchgate.gateway.repository import report_path, variant_path
from batchgate.proto.inference.v2 import grpc_service_pb2 as pb
from batchgate.proto.inference.v2 import grpc_service_pb2_grpc as pbg

ROOT = Path(__file__).resolve().parent.parent
HELDOUT = ROOT / "gateway" / "models" / "texts" / "heldout.txt"


def make_repo(src: Path, dst: Path, variants: list[str]) -> None:
    """``minilm_<variant>`` per variant: minilm's files linked, its config naming the variant."""
    for v in variants:
        d = dst / f"minilm_{v}"
        (d / "1").mkdir(parents=True)
        names = {"model.onnx"}
        if v != "fp32":
            names |= {
                variant_path(src / "1" / "model.onnx", v).name,
                report_path(src / "1" / "model.onnx", v).name,
            }
        for n in sorted(names):
            if not (src / "1" / n).is_file():
                raise SystemExit(
                    f"{src}/1/{n} is missing: run `batchgate optimize minilm --auto` (or --{v}) first"
                )
            (d / "1" / n).symlink_to((src / "1" / n).resolve())
        shutil.copy(src / "tokenizer.json", d / "tokenizer.json")
        cfg = (src / "config.pbtxt").read_text().replace('name: "minilm"', f'name: "{d.name}"')
        cfg = "\n".join(ln for ln in cfg.splitlines() if '"variant"' not in ln) + "\n"
        cfg += f'parameters {{ key: "variant" value {{ string_value: "{v}" }} }}\n'
        (d / "config.pbtxt").write_text(cfg)


def embed(url: str, model: str, batch: list[str]) -> np.ndarray:
    req = pb.ModelInferRequest(model_name=model)
    req.inputs.add(name="text", datatype="BYTES", shape=[len(batch), 1])
    req.raw_input_contents.append(
        b"".join(struct.pack("<I", len(b)) + b for b in (t.encode() for t in batch))
    )
    with grpc.insecure_channel(url) as ch:
        resp = pbg.GRPCInferenceServiceStub(ch).ModelInfer(req, timeout=120)
    return np.frombuffer(resp.raw_output_contents[0], np.float32).reshape(len(batch), -1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, default=ROOT / "model_repository" / "minilm")
    p.add_argument("--variants", default="fp32,int8")
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--shapes", default="64x1:standard,8x32:bulk")
    p.add_argument("--server-core", type=int, default=0)
    p.add_argument("--load-core", type=int, default=1)
    p.add_argument(
        "--server-args", default="", help="more `batchgate serve` flags, e.g. '--workers-per-device 1'"
    )
    args = p.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    if not (args.model_dir / "1" / "model.onnx").exists():
        print(f"{args.model_dir} has no model: run `batchgate prepare-minilm` first", file=sys.stderr)
        return 2
    all_texts = texts()
    os.sched_setaffinity(0, {args.server_core})
    per_text, _ = ort_limit(args.model_dir, all_texts)
    before = len(all_texts) / sum(per_text.values())
    tmp = Path(tempfile.mkdtemp(prefix="variants-"))
    make_repo(args.model_dir, tmp, variants)
    grpc_port, http_port = free_ports(2)
    url = f"127.0.0.1:{grpc_port}"
    cmd = ["taskset", "-c", str(args.server_core), sys.executable, "-m", "batchgate", "serve",
           "--host", "127.0.0.1", "--grpc-port", str(grpc_port), "--http-port", str(http_port),
           "--model-repository", str(tmp), "--no-build-models", "--log-level", "WARNING", *args.server_args.split()]  # fmt: skip
    server = Started("batchgate", cmd, url)
    proc = server.proc
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    os.sched_setaffinity(0, {args.load_core})
    try:
        server.ready(300)
        results = []
        for item in args.shapes.split(","):
            dims, _, cls = item.partition(":")
            callers, per_call = (int(x) for x in dims.split("x"))
            for v in variants:
                model = f"minilm_{v}"
                asyncio.run(load(url, model, all_texts, callers, per_call, cls or "standard", args.warmup))
                c0 = cpu_s(proc.pid)
                r = asyncio.run(
                    load(url, model, all_texts, callers, per_call, cls or "standard", args.seconds)
                )
                used = cpu_s(proc.pid) - c0
                results.append((v, item, r, r["texts"] / used if used else float("nan")))
        # The limit again, after the load (the server idle on that core): a VM's core changes speed
        # over minutes (the same limit measured 158 and 211 texts/s an hour apart), so the ratios
        # use the mean of both, and the two are printed.
        os.sched_setaffinity(0, {args.server_core})
        per_text, _ = ort_limit(args.model_dir, all_texts)
        os.sched_setaffinity(0, {args.load_core})
        after = len(all_texts) / sum(per_text.values())
        limit = (before + after) / 2
        print(f"ONNX Runtime alone, FP32, 1 thread, core {args.server_core}: {limit:.1f} texts per CPU-second, "
              f"each text alone and unpadded ({before:.1f} before the load, {after:.1f} after)")  # fmt: skip
        print(f"\n{'variant':<14} {'shape':<14} {'texts/s':>8} {'texts/cpu-s':>11} {'vs limit':>8} {'wall x':>6} "
              f"{'p50 ms':>7} {'p99 ms':>7}  refused")  # fmt: skip
        for v, item, r, per_cpu in results:
            print(f"{v:<14} {item:<14} {r['texts_per_s']:>8.1f} {per_cpu:>11.1f} {per_cpu / limit:>8.2f} "
                  f"{r['texts_per_s'] / limit:>6.2f} {r['p50_ms']:>7.0f} {r['p99_ms']:>7.0f}  {r['refused'] or ''}")  # fmt: skip
        held = [t for t in HELDOUT.read_text().splitlines() if t.strip() and not t.startswith("#")]
        ref = np.concatenate([embed(url, "minilm_fp32" if "fp32" in variants else f"minilm_{variants[0]}",
                                    held[i : i + 32]) for i in range(0, len(held), 32)])  # fmt: skip
        print(f"\nserved embeddings of {len(held)} held-out sentences against the served FP32:")
        for v in variants:
            if v == "fp32":
                continue
            got = np.concatenate(
                [embed(url, f"minilm_{v}", held[i : i + 32]) for i in range(0, len(held), 32)]
            )
            cos = (ref * got).sum(1) / np.linalg.norm(ref, axis=1) / np.linalg.norm(got, axis=1)
            worst = int(cos.argmin())
            print(f"  {v}: cosine min {cos.min():.5f} mean {cos.mean():.5f} (worst: {held[worst][:40]!r})")
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
