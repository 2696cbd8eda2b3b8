"""Every GPU check of the engines in one run, for a lent GPU machine (a few minutes on one GPU).

    .venv/bin/python -m batchgate.bench.gpu_check [--device 0] [--seconds-per-bucket 0.15] [--skip-server]

Needs onnxruntime-gpu and CuPy that see a device (``make clean && make test RUNTIME=gpu``);
exits 2 saying what is missing otherwise. It runs, and prints as it goes:

1. the GPU tests of tests/test_engines.py (pytest -k gpu);
2. for each engine configuration — shared session, static sessions, static + CUDA graphs,
   shared + CUDA graphs (a graph per bucket under gpu_graph_id) — on the bundled encoder with
   power-of-two buckets (seq 16..512, batch 1..64, max_batch_tokens 8192; 39 buckets):
   start-up time, whether CUDA graphs engaged (and on how many buckets), device memory (driver
   view, and the pooled buffers), padded-vs-unpadded agreement on every bucket (against the same
   GPU running the unpadded request at its own shape), and throughput per bucket (rows/s and
   tokens/s of the bound run, host->device and device->host copies included);
3. a real server with the encoder on KIND_GPU (CUDA graphs on): mixed-length requests answered
   like the CPU model alone, and ModelStatistics.

A JSON summary goes to $OUT/gpu_check.json when $OUT is set (the device runner's output dir).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ENCODER_DIR = ROOT / "model_repository" / "encoder"
ENCODER = ENCODER_DIR / "1" / "model.onnx"
PARAMS = {"seq_buckets": "16,32,64,128,256,512", "batch_buckets": "1,2,4,8,16,32,64", "max_batch_tokens": "8192",
          "max_dim.input_ids": "512"}  # fmt: skip
CONFIGS = [("shared", False), ("static", False), ("static", True), ("shared", True)]
# GPU fp32 matmuls may run as TF32: agreement is checked loosely; padding that leaked into a real
# row would differ by O(1), far above these.
RTOL, ATOL = 2e-2, 2e-2


def log(msg: str) -> None:
    print(msg, flush=True)


def environment() -> dict:
    import onnxruntime as ort

    env = {
        "onnxruntime": ort.__version__,
        "providers": ort.get_available_providers(),
        "python": sys.version.split()[0],
    }
    try:
        import cupy

        env["cupy"] = cupy.__version__
        n = cupy.cuda.runtime.getDeviceCount()
        env["devices"] = []
        for i in range(n):
            p = cupy.cuda.runtime.getDeviceProperties(i)
            name = p["name"].decode() if isinstance(p["name"], bytes) else str(p["name"])
            with cupy.cuda.Device(i):
                free, total = cupy.cuda.runtime.memGetInfo()
            env["devices"].append({"id": i, "name": name, "total_gib": round(total / 2**30, 1),
                                   "used_gib": round((total - free) / 2**30, 2)})  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        env["cupy_error"] = repr(exc)
    return env


def run_pytest() -> dict:
    t = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_engines.py", "-k", "gpu"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
    log(tail)
    return {"rc": proc.returncode, "seconds": round(time.perf_counter() - t, 1), "tail": tail}


def check_config(mode: str, graphs: bool, device_id: int, seconds_per_bucket: float, rng) -> dict:
    import cupy

    from batchgate.gateway.parameters import bucket_config
    from batchgate.workers import Device, EngineOptions, WorkerPool
    from batchgate.workers.sessions import SessionFactory

    name = f"{mode}{' + CUDA graphs' if graphs else ''}"
    with cupy.cuda.Device(device_id):
        free0, total = cupy.cuda.runtime.memGetInfo()
    cache = Path(tempfile.mkdtemp(prefix="bg-gpu-cache-"))
    options = EngineOptions(mode=mode, cuda_graphs=graphs, warmup="all", cache_dir=cache)
    pool = WorkerPool(f"encoder-{mode}", ENCODER, [Device("gpu", device_id)], 1, options,
                      bucket_config(PARAMS, 64, (16, 32)))  # fmt: skip
    t = time.perf_counter()
    pool.start()
    start_s = time.perf_counter() - t
    engine = pool.workers[0].engine
    out: dict = {"config": name, "mode": engine.mode, "start_s": round(start_s, 2), "buckets": len(engine._slots),
                 "cuda_graphs_engaged": bool(engine.cuda_graphs), "graph_buckets": len(engine.graph_slots)}  # fmt: skip
    try:
        # The unpadded reference on the same GPU (same math library, same TF32 policy).
        ref = SessionFactory(ENCODER, "", Device("gpu", device_id)).create(None)
        plan = pool.plan
        seqs_all = plan.groups[0].buckets
        worst = 0.0
        failures = []
        for rows, (seq,) in plan.slots():
            prev_b = plan.batch_sizes[plan.batch_sizes.index(rows) - 1] if rows != plan.batch_sizes[0] else 0
            prev_s = seqs_all[seqs_all.index(seq) - 1] if seq != seqs_all[0] else 0
            n, length = prev_b + 1, prev_s + 1
            parts = []
            for k in [n] if n == 1 else [n // 2, n - n // 2]:
                L = length if not parts else max(1, length - 3)
                mask = np.ones((k, L), np.int64)
                mask[:, max(1, L // 2) :] = rng.integers(0, 2, (k, L - max(1, L // 2)))
                parts.append(
                    {"input_ids": rng.integers(0, 1000, (k, L), dtype=np.int64), "attention_mask": mask}
                )
            outs, timing = pool.submit(parts, [p["input_ids"].shape[0] for p in parts], True).result()
            if timing.bucket != (rows, seq):
                failures.append(f"bucket {(rows, seq)}: ran as {timing.bucket}")
            for p, o in zip(parts, outs):
                want = ref.run(None, p)[0]
                diff = float(np.abs(o["embedding"] - want).max())
                worst = max(worst, diff)
                if not np.allclose(o["embedding"], want, rtol=RTOL, atol=ATOL):
                    failures.append(f"bucket {(rows, seq)}: max |diff| {diff:.3g}")
        out["agreement"] = {"max_abs_diff": worst, "failures": failures[:10], "ok": not failures}
        log(f"  {name}: agreement on {len(plan.slots())} buckets: max |diff| {worst:.3g} "
            f"{'OK' if not failures else 'FAILED ' + '; '.join(failures[:3])}")  # fmt: skip
        # Throughput per bucket: the bound run alone (copies in and out included).
        per_bucket = []
        for (rows, seq), slot in sorted(engine._slots.items()):
            slot.run()
            k, t0 = 0, time.perf_counter()
            while True:
                slot.run()
                k += 1
                el = time.perf_counter() - t0
                if el >= seconds_per_bucket and k >= 3:
                    break
            per_bucket.append({"rows": rows, "seq": seq, "ms": round(el / k * 1e3, 3),
                               "rows_per_s": round(rows * k / el), "tokens_per_s": round(rows * seq * k / el)})  # fmt: skip
        out["per_bucket"] = per_bucket
        with cupy.cuda.Device(device_id):
            free1, _ = cupy.cuda.runtime.memGetInfo()
        out["memory"] = {
            "device_used_bytes": pool.device_memory().get(f"gpu:{device_id}", 0),
            "this_config_bytes": int(free0 - free1),
            "pooled_buffers": pool.buffer_memory(),
        }
        log(f"  {name}: start {start_s:.1f}s, CUDA graphs {'on for ' + str(len(engine.graph_slots)) + ' buckets' if engine.cuda_graphs else 'off'}, "
            f"device memory for this config {(free0 - free1) / 2**20:.0f} MiB (pooled buffers "
            f"{engine.buffer_bytes()[1] / 2**20:.1f} MiB device, {engine.buffer_bytes()[0] / 2**20:.1f} MiB pinned)")  # fmt: skip
        del ref
    finally:
        pool.close()
        gc.collect()
        cupy.get_default_memory_pool().free_all_blocks()
        shutil.rmtree(cache, ignore_errors=True)
    return out


def print_buckets(results: list[dict]) -> None:
    by = {r["config"]: {(b["rows"], b["seq"]): b for b in r.get("per_bucket", [])} for r in results}
    names = list(by)
    keys = sorted({k for v in by.values() for k in v})
    log("\nthroughput per bucket, rows/s (ms per run):")
    log(f"{'rows x seq':>12}" + "".join(f"{n:>28}" for n in names))
    for k in keys:
        cells = []
        for n in names:
            b = by[n].get(k)
            cells.append(f"{b['rows_per_s']:>16,} ({b['ms']:>7.3f})" if b else f"{'-':>26}")
        log(f"{k[0]:>5} x {k[1]:<4}" + "".join(f"{c:>28}" for c in cells))
    if "static" in by and "static + CUDA graphs" in by:
        ratios = [by["static"][k]["ms"] / by["static + CUDA graphs"][k]["ms"] for k in keys
                  if k in by["static"] and k in by["static + CUDA graphs"]]  # fmt: skip
        if ratios:
            log(f"CUDA graphs speed-up per bucket (static): median x{np.median(ratios):.2f}, "
                f"min x{min(ratios):.2f}, max x{max(ratios):.2f}")  # fmt: skip


def server_check(device_id: int, rng) -> dict:
    import asyncio

    import onnxruntime as ort
    import tritonclient.grpc as tc
    import tritonclient.grpc.aio as tca
    from tritonclient.grpc import InferInput

    from tests.conftest import start_server

    tmp = Path(tempfile.mkdtemp(prefix="bg-gpu-server-"))
    repo = tmp / "repo"
    shutil.copytree(ENCODER_DIR, repo / "encoder")
    cfg = repo / "encoder" / "config.pbtxt"
    # One worker on the GPU; power-of-two buckets (39 static sessions) keep the start short.
    lines = [
        ln for ln in cfg.read_text().splitlines() if '"seq_buckets"' not in ln and '"batch_buckets"' not in ln
    ]
    text = "\n".join(lines).replace("kind: KIND_CPU", f"kind: KIND_GPU\n    gpus: [ {device_id} ]")
    seq = PARAMS["seq_buckets"]
    text += f'\nparameters {{ key: "seq_buckets" value {{ string_value: "{seq}" }} }}\n'
    cfg.write_text(text)
    srv = start_server(tmp, repo=repo, env={"BATCHGATE_CUDA_GRAPHS": "1"}, ready_timeout=240)
    try:
        ready_log = [line for line in srv.log().splitlines() if "bucket" in line or "loaded model" in line]
        jobs = []
        for _ in range(96):
            L = int(np.clip(rng.lognormal(np.log(24), 0.9), 2, 512))
            rows = int(rng.integers(1, 4))
            jobs.append({"input_ids": rng.integers(0, 1000, (rows, L), dtype=np.int64),
                         "attention_mask": np.ones((rows, L), np.int64)})  # fmt: skip

        async def run_all():
            client = tca.InferenceServerClient(srv.grpc_url)
            try:

                async def one(a):
                    ins = []
                    for n, arr in a.items():
                        i = InferInput(n, list(arr.shape), "INT64")
                        i.set_data_from_numpy(arr)
                        ins.append(i)
                    return (await client.infer("encoder", ins)).as_numpy("embedding")

                return await asyncio.gather(*(one(a) for a in jobs))
            finally:
                await client.close()

        t = time.perf_counter()
        got = asyncio.run(run_all())
        el = time.perf_counter() - t
        cpu = ort.InferenceSession(str(ENCODER), providers=["CPUExecutionProvider"])
        worst = max(float(np.abs(g - cpu.run(None, a)[0]).max()) for g, a in zip(got, jobs))
        client = tc.InferenceServerClient(srv.grpc_url)
        st = client.get_inference_statistics("encoder").model_stats[0]
        client.close()
        out = {"requests": len(jobs), "seconds": round(el, 2), "executions": st.execution_count,
               "max_abs_diff_vs_cpu": worst, "ok": worst < ATOL * 5 and st.execution_count < len(jobs),
               "load_log": ready_log[-6:]}  # fmt: skip
        log(f"  server on gpu:{device_id}: {len(jobs)} requests in {el:.2f}s, {st.execution_count} executions, "
            f"max |diff| vs CPU {worst:.3g}")  # fmt: skip
        for line in ready_log[-6:]:
            log(f"    {line}")
        return out
    finally:
        srv.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--seconds-per-bucket", type=float, default=0.15)
    ap.add_argument("--configs", default=",".join(f"{m}{'+graphs' if g else ''}" for m, g in CONFIGS))
    ap.add_argument("--skip-pytest", action="store_true")
    ap.add_argument("--skip-server", action="store_true")
    args = ap.parse_args(argv)
    t_all = time.perf_counter()
    summary: dict = {"environment": environment()}
    log(json.dumps(summary["environment"], indent=1))

    from batchgate.workers import gpu_count

    if gpu_count() == 0:
        log("no GPU usable by both onnxruntime-gpu (CUDAExecutionProvider) and CuPy: nothing to check")
        _write(summary)
        return 2
    rng = np.random.default_rng(0)
    if not args.skip_pytest:
        log("\n== pytest tests/test_engines.py -k gpu")
        summary["pytest"] = run_pytest()
    log("\n== engine configurations on the encoder")
    results = []
    for spec in args.configs.split(","):
        mode, _, g = spec.strip().partition("+")
        try:
            results.append(check_config(mode, g == "graphs", args.device, args.seconds_per_bucket, rng))
        except Exception as exc:  # noqa: BLE001 - one failing configuration must not hide the others
            log(f"  {spec}: FAILED {exc!r}")
            results.append({"config": spec, "error": repr(exc)})
    summary["configs"] = results
    print_buckets([r for r in results if "per_bucket" in r])
    if not args.skip_server:
        log("\n== server, encoder on KIND_GPU with CUDA graphs")
        try:
            summary["server"] = server_check(args.device, rng)
        except Exception as exc:  # noqa: BLE001
            log(f"  server check FAILED {exc!r}")
            summary["server"] = {"error": repr(exc)}
    summary["seconds"] = round(time.perf_counter() - t_all, 1)
    ok = all(r.get("agreement", {}).get("ok") for r in results)
    ok = (
        ok
        and summary.get("pytest", {"rc": 0})["rc"] == 0
        and summary.get("server", {"ok": True}).get("ok", False)
    )
    log(f"\nGPU check {'PASSED' if ok else 'FAILED'} in {summary['seconds']}s")
    _write(summary)
    return 0 if ok else 1


def _write(summary: dict) -> None:
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "gpu_check.json").write_text(json.dumps(summary, indent=1, default=str))


if __name__ == "__main__":
    sys.exit(main())
