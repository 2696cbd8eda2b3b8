"""The GPU check: prepared here, carried to an air-gapped GPU machine in parts, run there in one go.

Here (any machine with the checkout and the test venv):

    .venv/bin/python -m batchgate.bench.gpu_check --prepare --out gpu-travel

writes into gpu-travel/ (git-ignored) what must travel: the onnxruntime-gpu 1.31.1 wheel for
CPython 3.12 (downloaded once), the project's wheel, the wheels of its dependencies the GPU machine
lacks, and the git-ignored minilm model, packed into one payload and split into parts that each fit
a 64 MiB transfer beside the checkout; then prints the plan (bench/gpu_travel.py): one device call
per part, each within 30 s of the last, and the GPU-machine time they take by its estimates.

There, call k of the plan runs ``python3 bench/gpu_check.py --receive gpu-travel`` (standard
library only, nothing installed yet); the last adds ``--run --out $OUT``: the payload is
reassembled and checked, the wheels installed into a folder, and ``--checks`` runs with that folder
first on PYTHONPATH. ``--checks`` (also usable directly on a GPU box with ``make test
RUNTIME=gpu``) writes JSON into --out as each stage ends, so a run cut short still reports:

1. environment.json: versions, providers, devices;
2. pytest.json: every GPU test (``pytest -m gpu``: the tests marked gpu, not those merely named so);
   fails unless they ran and passed with none skipped (a GPU test skips where it finds no GPU);
3. accuracy.json: encoder and minilm on the CUDA provider against the CPU, TF32 off (near exact)
   and TF32 on (ORT's default; loose);
4. server.json: a real server with ``--device gpu`` (the bundled configs say KIND_CPU) answering
   the stock Triton client, its startup lines, answers against the CPU;
5. configs.json: each engine configuration (dynamic shapes; shared session with buckets and
   IOBinding on CuPy pools; static sessions; static and shared with CUDA graphs) on encoder and
   minilm: start-up, whether graphs engaged, device memory, agreement with the CPU on every bucket
   at TF32 tolerances, device buffers of the plan's sizes on the device asked for, and a CUDA graph
   on every bucket where asked (an engine that fell back to running without fails), rows/s and
   tokens/s per bucket;
6. workers.json: one against two workers on one GPU (``workers_per_device``), rows/s; fails unless
   each worker's engine holds its device buffers on that GPU, ran batches, and answered as the CPU;
7. summary.json: pass/fail per stage and the seconds taken.

``--checks --dry-run-cpu`` runs every stage's own code on the CPU provider (``--quick``: a few
small buckets), with tests/fake_cuda.py standing in for CuPy and CUDA, so the engines build, bind
and run their device buffers and the script is proven on a machine without a GPU
(tests/test_gpu_check.py). Its pytest stage fails there, as it should: every GPU test skips.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

try:
    from batchgate.bench import gpu_travel
except ImportError:  # run as a script on the GPU machine, before anything of ours is installed
    import gpu_travel  # type: ignore[no-redef]

CHECKOUT = Path(__file__).resolve().parent.parent  # the checkout when run from it
ENCODER_PARAMS = {"seq_buckets": "16,32,64,128,256,512", "batch_buckets": "1,2,4,8,16,32,64",
                  "max_batch_tokens": "8192", "max_dim.input_ids": "512"}  # fmt: skip
MINILM_PARAMS = {"seq_buckets": "16,64,256", "batch_buckets": "1,8,32", "max_batch_tokens": "8192"}
# --quick (the dry run's test): a handful of buckets, batches up to 8 rows.
QUICK_PARAMS = {"seq_buckets": "16,64", "batch_buckets": "1,4", "max_dim.input_ids": "512"}
MAX_BATCH = 64
CONFIGS = [("dynamic", False), ("shared", False), ("static", False), ("static", True), ("shared", True)]
# Against the CPU, TF32 on: padding that leaked into a real row would differ by O(1), far above these.
TF32_RTOL, TF32_ATOL = 2e-2, 2e-2
# An FP16 variant against the FP32 model on the CPU: half precision in every op, not only matmuls.
FP16_TOL = (5e-2, 5e-2)
# TF32 off: FP32 on both sides, only the order of the sums differs.
EXACT_RTOL, EXACT_ATOL = 1e-3, 1e-4


# "cpu" with --dry-run-cpu: every stage runs its own code on the CPU provider, so the script
# itself is proven here (tests/test_gpu_check.py) and a GPU's minutes go to the GPU.
KIND = "gpu"


def _device(device_id: int):
    """Always a GPU device: in the dry run tests/fake_cuda.py stands in for CuPy and CUDA, so the
    engines still build their device buffers, bind them and run the GPU data path (on the CPU
    provider), and a fault there fails the dry run as it would fail the GPU."""
    from batchgate.workers import Device

    return Device("gpu", device_id)


def device_buffer_failures(engine, device_id: int) -> list[str]:
    """What is wrong with a pooled engine's device buffers: each length bucket the plan names
    must hold CuPy buffers on ``device_id``, of the shapes the plan gives for its most rows, all
    from the engine's own pool; [] when all is as it should be."""
    import numpy as np

    plan = engine.plan
    if plan is None or not plan.pooled:
        return []
    out = []
    if engine.device != _device(device_id):
        out.append(f"the engine runs on {engine.device}, not gpu:{device_id}")
    expected = 0
    for seqs in dict.fromkeys(s for _, s in plan.slots()):
        buffers = engine._buffers.get(seqs)
        if buffers is None or not hasattr(buffers, "dev_in"):
            out.append(f"lengths {seqs}: no device buffers ({type(buffers).__name__})")
            continue
        cap = plan.max_rows(seqs)
        want = {t.name: (plan.input_shape(t.name, cap, seqs), t.dtype) for t in plan.inputs}
        want |= {t.name: (plan.output_shape(t.name, cap, seqs), t.dtype) for t in plan.outputs}
        for name, a in {**buffers.dev_in, **buffers.dev_out}.items():
            shape, dtype = want[name]
            expected += int(np.prod(shape)) * np.dtype(dtype).itemsize
            if tuple(a.shape) != shape or a.dtype != np.dtype(dtype):
                got = f"{tuple(a.shape)} {a.dtype}"
                out.append(f"lengths {seqs}, {name}: {got}, want {shape} {np.dtype(dtype)}")
            if a.device.id != device_id:
                out.append(f"lengths {seqs}, {name}: on device {a.device.id}, not {device_id}")
    held = engine.buffer_bytes()[1]
    if held != expected or engine._cupy_pool.used_bytes() < expected:
        out.append(f"device buffers hold {held} bytes (pool {engine._cupy_pool.used_bytes()}); the plan needs "
                   f"{expected}")  # fmt: skip
    return out


def _free_bytes(device_id: int) -> int:
    if KIND != "gpu":
        return 0
    import cupy

    with cupy.cuda.Device(device_id):
        return int(cupy.cuda.runtime.memGetInfo()[0])


def log(msg: str) -> None:
    print(msg, flush=True)


class Report:
    """One JSON file per stage in ``out``, written as soon as the stage ends (at most 8 files: the
    device tool brings back no more)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.stages: dict[str, dict] = {}

    def write(self, name: str, data, ok: bool | None = None, seconds: float | None = None) -> None:
        tmp = self.out / f".{name}.json.tmp"
        tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
        tmp.replace(self.out / f"{name}.json")
        if name != "summary":
            self.stages[name] = {"ok": ok, "seconds": None if seconds is None else round(seconds, 1)}

    def summary(self, started: float, **extra) -> dict:
        done = [s["ok"] for s in self.stages.values() if s["ok"] is not None]
        data = {"ok": bool(done) and all(done), "seconds": round(time.perf_counter() - started, 1),
                "stages": self.stages, **extra}  # fmt: skip
        self.write("summary", data)
        return data


# -- the checks (need batchgate, onnxruntime-gpu and CuPy) ---------------------------------------


def environment() -> dict:
    import onnxruntime as ort

    if KIND == "gpu" and hasattr(ort, "preload_dlls"):
        try:  # the CUDA and cuDNN libraries of the nvidia-* wheels, besides LD_LIBRARY_PATH
            ort.preload_dlls()
        except Exception as exc:  # noqa: BLE001 - reported by the provider check below
            log(f"onnxruntime.preload_dlls: {exc!r}")

    env = {"onnxruntime": ort.__version__, "onnxruntime_file": ort.__file__,
           "providers": ort.get_available_providers(), "python": sys.version.split()[0]}  # fmt: skip
    try:
        import cupy

        env["cupy"] = cupy.__version__
        env["devices"] = []
        for i in range(cupy.cuda.runtime.getDeviceCount()):
            p = cupy.cuda.runtime.getDeviceProperties(i)
            name = p["name"].decode() if isinstance(p["name"], bytes) else str(p["name"])
            with cupy.cuda.Device(i):
                free, total = cupy.cuda.runtime.memGetInfo()
            env["devices"].append({"id": i, "name": name, "total_gib": round(total / 2**30, 1),
                                   "used_gib": round((total - free) / 2**30, 2)})  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        env["cupy_error"] = repr(exc)
    return env


def model_file(work: Path, name: str) -> Path | None:
    f = work / "model_repository" / name / "1" / "model.onnx"
    return f if f.exists() else None


def feeds(path: Path, rng, rows: int, seq: int, ragged: bool = True) -> dict:
    """Token-model inputs of (rows, seq): ids below 1000, a padded mask, zero token types."""
    import numpy as np

    from batchgate.workers import read_model_io

    out = {}
    for t in read_model_io(path)[0]:
        if "mask" in t.name:
            m = np.ones((rows, seq), t.dtype)
            if ragged and seq > 1:
                for r in range(rows):
                    m[r, rng.integers(1, seq + 1) :] = 0
            out[t.name] = m
        elif "type" in t.name:
            out[t.name] = np.zeros((rows, seq), t.dtype)
        else:
            out[t.name] = rng.integers(0, 1000, (rows, seq)).astype(t.dtype)
    return out


def _compare(got, want) -> dict:
    import numpy as np

    diff = np.abs(got.astype(np.float64) - want)
    flat_g, flat_w = got.reshape(len(got), -1).astype(np.float64), want.reshape(len(want), -1)
    cos = (flat_g * flat_w).sum(1) / (np.linalg.norm(flat_g, axis=1) * np.linalg.norm(flat_w, axis=1) + 1e-30)
    return {"max_abs_diff": float(diff.max()), "min_cosine": float(cos.min())}


PYTEST_FILES = ("tests/test_engines.py", "tests/test_strings.py")


def check_pytest(work: Path, files: tuple[str, ...] = PYTEST_FILES) -> tuple[dict, bool]:
    """``pytest -m gpu`` on ``files``. Passes only when GPU tests ran, passed and none skipped: a
    GPU test skips when it finds no GPU, and a stage that counted skips as passes would pass
    on a machine where nothing was checked."""
    import xml.etree.ElementTree as ET

    t = time.perf_counter()
    files = [f for f in files if (work / f).exists()]
    junit = Path(tempfile.mkdtemp(prefix="bg-gpu-pytest-")) / "junit.xml"
    # Only the plugins the suite needs: a machine's own pytest plugins (pytest-cov, -benchmark, …)
    # were built for its pytest, not for the carried one, and one that fails to load stops pytest.
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "pytest_asyncio.plugin",
         "-p", "pytest_timeout", "-m", "gpu", f"--junitxml={junit}", *files],
        cwd=work, capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-25:])
    log(tail)
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    skipped: list[str] = []
    if junit.exists():
        for case in ET.parse(junit).iter("testcase"):
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            if (s := case.find("skipped")) is not None:
                counts["skipped"] += 1
                skipped.append(f"{name}: {s.get('message', '')}")
            elif case.find("failure") is not None or case.find("error") is not None:
                counts["failed"] += 1
            else:
                counts["passed"] += 1
    shutil.rmtree(junit.parent, ignore_errors=True)
    problems = []
    if proc.returncode != 0:
        problems.append(f"pytest exited {proc.returncode}")
    total = sum(counts.values())
    if not total:
        problems.append("no GPU test ran")
    elif counts["skipped"] == total:
        problems.append("every GPU test skipped")
    elif counts["skipped"]:
        problems.append(f"{counts['skipped']} GPU test(s) skipped")
    ok = not problems
    log(f"  pytest -m gpu: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped "
        f"{'OK' if ok else 'FAILED: ' + '; '.join(problems)}")  # fmt: skip
    return {
        "rc": proc.returncode,
        "seconds": round(time.perf_counter() - t, 1),
        **counts,
        "skipped_tests": skipped[:20],
        "problems": problems,
        "tail": tail,
    }, ok


def check_accuracy(models: dict[str, Path], device_id: int) -> tuple[dict, bool]:
    """Each model on the CUDA provider against the CPU: TF32 off near-exactly, TF32 on loosely."""
    import numpy as np
    import onnxruntime as ort

    rng = np.random.default_rng(1)
    out, ok = {}, True
    for name, path in models.items():
        cpu = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        res = {}
        for tf32 in (0, 1):
            opts = {"device_id": device_id, "use_tf32": str(tf32)}
            provider = ("CUDAExecutionProvider", opts) if KIND == "gpu" else "CPUExecutionProvider"
            try:
                gpu = ort.InferenceSession(str(path), providers=[provider])
            except Exception as exc:  # noqa: BLE001 - e.g. an option this ORT does not know
                res[f"tf32_{tf32}"] = {"error": repr(exc)}
                ok = False
                continue
            worst = {"max_abs_diff": 0.0, "min_cosine": 1.0}
            for rows, seq in ((1, 7), (4, 33), (16, 128), (32, 256)):
                f = feeds(path, rng, rows, seq)
                c = _compare(gpu.run(None, f)[0], cpu.run(None, f)[0].astype(np.float64))
                worst = {"max_abs_diff": max(worst["max_abs_diff"], c["max_abs_diff"]),
                         "min_cosine": min(worst["min_cosine"], c["min_cosine"])}  # fmt: skip
            atol = EXACT_ATOL if tf32 == 0 else TF32_ATOL
            worst["ok"] = worst["max_abs_diff"] <= atol and worst["min_cosine"] >= (
                0.99999 if tf32 == 0 else 0.999
            )
            worst["providers"] = gpu.get_providers()
            if KIND == "gpu" and worst["providers"][0] != "CUDAExecutionProvider":
                # ORT falls back to the CPU, with only a warning, when the CUDA provider cannot load.
                worst["ok"] = False
                worst["error"] = f"the session runs on {worst['providers']}, not the CUDA provider"
            ok = ok and worst["ok"]
            res[f"tf32_{tf32}"] = worst
            log(f"  {name} TF32 {'on' if tf32 else 'off'}: max |diff| vs CPU {worst['max_abs_diff']:.3g}, "
                f"min cosine {worst['min_cosine']:.6f} {'OK' if worst['ok'] else 'FAILED'}")  # fmt: skip
        out[name] = res
    return out, ok


def check_config(name: str, path: Path, params: dict, mode: str, graphs: bool, device_id: int,
                 seconds_per_bucket: float, rng, reference: Path | None = None,
                 tol: tuple[float, float] = (TF32_RTOL, TF32_ATOL)) -> dict:  # fmt: skip
    """One engine configuration on one model: start, graphs, memory, agreement on every bucket with
    ``reference`` (default the model itself) on the CPU at ``tol`` (rtol, atol), rows/s per bucket."""
    import gc

    import numpy as np
    import onnxruntime as ort

    from batchgate.gateway.parameters import bucket_config
    from batchgate.workers import EngineOptions, WorkerPool

    label = f"{name}: {mode}{' + CUDA graphs' if graphs else ''}"
    free0 = _free_bytes(device_id)
    cache = Path(tempfile.mkdtemp(prefix="bg-gpu-cache-"))
    options = EngineOptions(mode="shared" if mode == "dynamic" else mode, cuda_graphs=graphs, warmup="all",
                            cache_dir=cache)  # fmt: skip
    buckets = None if mode == "dynamic" else bucket_config(params, MAX_BATCH)
    pool = WorkerPool(f"{name}-{mode}", path, [_device(device_id)], 1, options, buckets)
    t = time.perf_counter()
    with _engine_warnings() as warned:  # the engine says here when it falls back from CUDA graphs
        pool.start()
    start_s = time.perf_counter() - t
    engine = pool.workers[0].engine
    out: dict = {"model": name, "config": label, "mode": engine.mode, "start_s": round(start_s, 2),
                 "buckets": len(engine._slots), "cuda_graphs_engaged": bool(engine.cuda_graphs),
                 "graph_buckets": len(engine.graph_slots)}  # fmt: skip
    session = engine.session or next(iter(engine._sessions.values()), None)
    providers = session.get_providers() if hasattr(session, "get_providers") else []
    out["providers"] = providers
    try:
        cpu = ort.InferenceSession(str(reference or path), providers=["CPUExecutionProvider"])
        worst, failures, checked = 0.0, [], 0
        if pool.plan is None or not pool.plan.pooled:  # dynamic: a spread of shapes
            cases = [((r, s), [feeds(path, rng, r, s)]) for r, s in ((1, 5), (3, 17), (8, 64), (32, 200))]
        else:
            plan = pool.plan
            seqs = plan.groups[0].buckets
            cases = []
            for rows, (seq,) in plan.slots():
                i, j = plan.batch_sizes.index(rows), seqs.index(seq)
                n = (plan.batch_sizes[i - 1] if i else 0) + 1  # just past the previous bucket: most padding
                length = (seqs[j - 1] if j else 0) + 1
                sizes = [n] if n == 1 else [n // 2, n - n // 2]
                parts = [
                    feeds(path, rng, k, length if not p else max(1, length - 3)) for p, k in enumerate(sizes)
                ]
                cases.append(((rows, seq), parts))
        for bucket, parts in cases:
            outs, timing = pool.submit(parts, [next(iter(p.values())).shape[0] for p in parts], True).result()
            if pool.plan is not None and pool.plan.pooled and timing.bucket != bucket:
                failures.append(f"bucket {bucket}: ran as {timing.bucket}")
            for p, o in zip(parts, outs):
                (key,) = list(o)[:1]
                want = cpu.run([key], p)[0].astype(np.float64)
                diff = float(np.abs(o[key] - want).max())
                worst = max(worst, diff)
                if not np.allclose(o[key], want, rtol=tol[0], atol=tol[1]):
                    failures.append(f"bucket {bucket}: max |diff| {diff:.3g}")
            checked += 1
        if KIND == "gpu" and (not providers or providers[0] != "CUDAExecutionProvider"):
            failures.insert(0, f"the engine's session runs on {providers}, not the CUDA provider")
        out["agreement"] = {"vs": f"CPU, {(reference or path).name}", "rtol": tol[0], "atol": tol[1], "cases": checked,
                            "max_abs_diff": worst, "failures": failures[:10], "ok": not failures}  # fmt: skip
        log(f"  {label}: {checked} cases vs CPU, max |diff| {worst:.3g} "
            f"{'OK' if not failures else 'FAILED ' + '; '.join(failures[:3])}")  # fmt: skip
        # Right answers are not enough: the run must also have used what this configuration is
        # about, device buffers on this GPU and, when asked for, a CUDA graph on every bucket.
        other = device_buffer_failures(engine, device_id)
        if graphs and not (engine.cuda_graphs and engine._slots and engine.graph_slots == set(engine._slots)):
            why = "; ".join(warned) or "no warning logged"
            other.append(f"CUDA graphs asked for, engaged on {len(engine.graph_slots)} of {len(engine._slots)} "
                         f"buckets ({why})")  # fmt: skip
        out["cuda_graphs"] = {"asked": graphs, "engaged": bool(engine.cuda_graphs), "warnings": warned}
        out["failures"] = other
        out["ok"] = not failures and not other
        if other:
            log(f"  {label}: FAILED {'; '.join(other[:3])}")
        per_bucket = []
        if not engine._slots:  # dynamic shapes: the whole batch path at each case's shape
            for (rows, seq), parts in cases:
                sizes = [next(iter(p.values())).shape[0] for p in parts]
                k, t0 = 0, time.perf_counter()
                while True:
                    pool.submit(parts, sizes, True).result()
                    k += 1
                    el = time.perf_counter() - t0
                    if el >= seconds_per_bucket and k >= 3:
                        break
                per_bucket.append({"rows": sum(sizes), "seq": seq, "ms": round(el / k * 1e3, 3),
                                   "rows_per_s": round(sum(sizes) * k / el)})  # fmt: skip
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
        free1 = _free_bytes(device_id)
        out["memory"] = {"this_config_bytes": int(free0 - free1), "by_pool": {f"{d}/{p}": b for (d, p), b in
                         pool.memory_by_pool().items()}}  # fmt: skip
        log(f"  {label}: start {start_s:.1f}s, {len(engine._slots)} buckets, CUDA graphs "
            f"{'on for ' + str(len(engine.graph_slots)) if engine.cuda_graphs else 'off'}, "
            f"{(free0 - free1) / 2**20:.0f} MiB device memory")  # fmt: skip
    finally:
        pool.close()
        gc.collect()
        if KIND == "gpu":
            import cupy

            cupy.get_default_memory_pool().free_all_blocks()
        shutil.rmtree(cache, ignore_errors=True)
    return out


@contextlib.contextmanager
def _engine_warnings():
    """The warnings the engines log meanwhile (from their worker threads too), as text."""
    import logging

    got: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            got.append(record.getMessage())

    handler = Keep(logging.WARNING)
    logger = logging.getLogger("batchgate.workers.engine")
    logger.addHandler(handler)
    try:
        yield got
    finally:
        logger.removeHandler(handler)


def check_workers(path: Path, params: dict, device_id: int, seconds: float = 2.0) -> tuple[dict, bool]:
    """workers_per_device 1 against 2 on one GPU: closed-loop batches of 32 x 64 tokens, 4 in
    flight, rows/s. It passes only if every worker's engine holds its device buffers on this GPU,
    with its own stream and pool, ran batches of its own, and every answer matches the CPU."""
    import numpy as np
    import onnxruntime as ort

    from batchgate.gateway.parameters import bucket_config
    from batchgate.workers import EngineOptions, WorkerPool

    rng = np.random.default_rng(2)
    rows = min(32, MAX_BATCH)
    batch = [feeds(path, rng, rows, 64, ragged=False)]
    cpu = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    want = dict(zip([o.name for o in cpu.get_outputs()], cpu.run(None, batch[0])))
    out: dict = {}
    failures: list[str] = []
    for n in (1, 2):
        pool = WorkerPool(f"w{n}", path, [_device(device_id)], n, EngineOptions(warmup="all"),
                          bucket_config(params, MAX_BATCH))  # fmt: skip
        pool.start()
        try:
            engines = [w.engine for w in pool.workers]
            for i, e in enumerate(engines):
                failures += [f"{n} worker(s), worker {i}: {f}" for f in device_buffer_failures(e, device_id)]
            if len({id(e._stream) for e in engines}) != n or len({id(e._cupy_pool) for e in engines}) != n:
                failures.append(f"{n} worker(s) share a CUDA stream or memory pool")
            warm = [sum(s.runs for s in e._slots.values()) for e in engines]
            worst = 0.0

            def check(f) -> None:
                nonlocal worst
                for name, got in f.result()[0][0].items():
                    worst = max(worst, float(np.abs(got - want[name]).max()))
                    if not np.allclose(got, want[name], rtol=TF32_RTOL, atol=TF32_ATOL):
                        failures.append(f"{n} worker(s): '{name}' differs from the CPU by {worst:.3g}")

            done, t0, inflight = 0, time.perf_counter(), [pool.submit(batch, [rows], True) for _ in range(4)]
            while time.perf_counter() - t0 < seconds:
                check(inflight.pop(0))
                done += 1
                inflight.append(pool.submit(batch, [rows], True))
            for f in inflight:
                check(f)
                done += 1
            el = time.perf_counter() - t0
            ran = [sum(s.runs for s in e._slots.values()) - w for e, w in zip(engines, warm)]
            if not all(ran):
                failures.append(f"{n} worker(s): batches run per worker {ran}: a worker did none")
            out[f"workers_{n}"] = {"rows_per_s": round(done * rows / el), "batches_per_worker": ran,
                                   "max_abs_diff_vs_cpu": worst}  # fmt: skip
        finally:
            pool.close()
    out["ratio_2_over_1"] = round(out["workers_2"]["rows_per_s"] / out["workers_1"]["rows_per_s"], 3)
    out["failures"] = failures[:10]
    log(f"  encoder {rows} x 64: 1 worker {out['workers_1']['rows_per_s']:,} rows/s, 2 workers "
        f"{out['workers_2']['rows_per_s']:,} rows/s (x{out['ratio_2_over_1']})"
        f"{'; FAILED ' + '; '.join(failures[:3]) if failures else ''}")  # fmt: skip
    return out, not failures


def check_server(work: Path, models: dict[str, Path], device_id: int, rng) -> tuple[dict, bool]:
    """A real server, --device gpu over the bundled (KIND_CPU) configs, and the stock client."""
    import asyncio

    import numpy as np
    import onnxruntime as ort
    import tritonclient.grpc as tc
    import tritonclient.grpc.aio as tca
    from tritonclient.grpc import InferInput

    from tests.conftest import start_server

    tmp = Path(tempfile.mkdtemp(prefix="bg-gpu-server-"))
    repo = tmp / "repo"
    for name in models:
        shutil.copytree(work / "model_repository" / name, repo / name)
    cfg = repo / "encoder" / "config.pbtxt"
    # Power-of-two buckets (39 of them) keep the start short; the config keeps KIND_CPU on purpose.
    lines = [
        ln for ln in cfg.read_text().splitlines() if '"seq_buckets"' not in ln and '"batch_buckets"' not in ln
    ]
    cfg.write_text("\n".join(lines) + f'\nparameters {{ key: "seq_buckets" value {{ string_value: '
                   f'"{ENCODER_PARAMS["seq_buckets"]}" }} }}\n')  # fmt: skip
    env = {"BATCHGATE_DEVICE": KIND, "BATCHGATE_CUDA_GRAPHS": "1", "CUDA_VISIBLE_DEVICES": str(device_id)}
    srv = start_server(tmp, repo=repo, env=env, ready_timeout=240)
    try:
        loaded = [ln for ln in srv.log().splitlines() if "loaded model" in ln or "failed to start" in ln]
        jobs = []
        for _ in range(96):
            length = int(np.clip(rng.lognormal(np.log(24), 0.9), 2, 512))
            rows = int(rng.integers(1, 4))
            jobs.append({"input_ids": rng.integers(0, 1000, (rows, length), dtype=np.int64),
                         "attention_mask": np.ones((rows, length), np.int64)})  # fmt: skip

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
        cpu = ort.InferenceSession(str(models["encoder"]), providers=["CPUExecutionProvider"])
        worst = max(float(np.abs(g - cpu.run(None, a)[0]).max()) for g, a in zip(got, jobs))
        client = tc.InferenceServerClient(srv.grpc_url)
        st = client.get_inference_statistics("encoder").model_stats[0]
        out = {"requests": len(jobs), "seconds": round(el, 2), "executions": st.execution_count,
               "max_abs_diff_vs_cpu": worst, "startup_lines": loaded}  # fmt: skip
        on_gpu = all(f"on {KIND}:" in ln for ln in loaded if "loaded model" in ln) and len(loaded) == len(
            models
        )
        ok = on_gpu and worst <= TF32_ATOL * 5 and st.execution_count < len(jobs)
        if "minilm" in models:
            try:
                meta = client.get_model_metadata("minilm").inputs[0]
                shape = [2] + [1] * (len(meta.shape) - 1)
                texts = np.array([b"a short sentence", b"GPU pods that use the GPU, for real"], dtype=object)
                i = InferInput(meta.name, shape, "BYTES")
                i.set_data_from_numpy(texts.reshape(shape))
                res = client.infer("minilm", [i])
                emb = res.as_numpy(res.get_response().outputs[0].name)
                out["minilm"] = {"shape": list(emb.shape), "finite": bool(np.isfinite(emb).all())}
            except Exception as exc:  # noqa: BLE001 - the encoder's figures still count
                out["minilm"] = {"error": repr(exc), "finite": False}
            ok = ok and out["minilm"]["finite"]
        client.close()
        out["ok"] = ok
        log(f"  server --device {KIND}: {len(jobs)} encoder requests in {el:.2f}s, {st.execution_count} executions, "
            f"max |diff| vs CPU {worst:.3g}; {'OK' if ok else 'FAILED'}")  # fmt: skip
        for line in loaded:
            log(f"    {line[-220:]}")
        return out, ok
    finally:
        srv.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def print_buckets(results: list[dict]) -> None:
    for model in sorted({r["model"] for r in results}):
        rs = [r for r in results if r["model"] == model and r.get("per_bucket")]
        by = {r["config"]: {(b["rows"], b["seq"]): b for b in r["per_bucket"]} for r in rs}
        keys = sorted({k for v in by.values() for k in v})
        log(f"\n{model}: rows/s per bucket (ms per run)")
        log(f"{'rows x seq':>12}" + "".join(f"{n.split(': ')[1]:>28}" for n in by))
        for k in keys:
            cells = [
                f"{b['rows_per_s']:>16,} ({b['ms']:>7.3f})" if (b := by[n].get(k)) else f"{'-':>26}"
                for n in by
            ]
            log(f"{k[0]:>5} x {k[1]:<4}" + "".join(f"{c:>28}" for c in cells))


def checks(work: Path, out: Path, device_id: int = 0, seconds_per_bucket: float = 0.1,
           budget_s: float = 330.0, stages: str = "pytest,accuracy,server,configs,workers",
           models_wanted: str = "encoder,minilm") -> int:  # fmt: skip
    """Every GPU check, each stage's JSON written as it ends; stages past ``budget_s`` are skipped
    (recorded as such), so the report comes back inside the machine's time."""
    import numpy as np

    started = time.perf_counter()
    report = Report(out)
    env = environment()
    log(json.dumps(env, indent=1))
    from batchgate.workers import gpu_probe

    n, why = gpu_probe()
    report.write("environment", {**env, "usable_gpus": n, "why_none": why, "kind": KIND},
                 ok=n > 0 if KIND == "gpu" else None)  # fmt: skip
    if n == 0 and KIND == "gpu":
        log(f"no GPU usable by both onnxruntime-gpu and CuPy ({why}): nothing to check")
        report.summary(started, reason=why)
        return 2
    models = {m: f for m in models_wanted.split(",") if (f := model_file(work, m)) is not None}
    params = {"encoder": ENCODER_PARAMS, "minilm": MINILM_PARAMS}
    if MAX_BATCH < 64:
        params = {"encoder": QUICK_PARAMS, "minilm": QUICK_PARAMS}
    rng = np.random.default_rng(0)
    wanted = stages.split(",")
    skipped = []

    def stage(name: str, fn) -> None:
        if name not in wanted:
            return
        if time.perf_counter() - started > budget_s:
            skipped.append(name)
            report.write(name, {"skipped": f"past the {budget_s:.0f}s budget"}, ok=None)
            return
        log(f"\n== {name}")
        t = time.perf_counter()
        try:
            data, ok = fn()
        except Exception as exc:  # noqa: BLE001 - one failing stage must not hide the others
            log(f"  {name} FAILED {exc!r}")
            data, ok = {"error": repr(exc)}, False
        report.write(name, data, ok=ok, seconds=time.perf_counter() - t)

    stage("pytest", lambda: check_pytest(work))
    stage("accuracy", lambda: check_accuracy(models, device_id))

    def configs():
        results = []
        for m, path in models.items():
            for mode, graphs in CONFIGS:
                if time.perf_counter() - started > budget_s:
                    results.append(
                        {
                            "model": m,
                            "config": f"{m}: {mode}{' + CUDA graphs' if graphs else ''}",
                            "skipped": "budget",
                        }
                    )
                    continue
                try:
                    results.append(
                        check_config(m, path, params[m], mode, graphs, device_id, seconds_per_bucket, rng)
                    )
                except Exception as exc:  # noqa: BLE001
                    log(f"  {m} {mode}{'+graphs' if graphs else ''}: FAILED {exc!r}")
                    results.append({"model": m, "config": f"{m}: {mode}", "error": repr(exc)})
                report.write("configs", results)  # so far, in case the machine's time runs out
            fp16 = path.parent / "model.fp16.onnx"  # `batchgate optimize --fp16` builds it beside the model
            if fp16.exists() and time.perf_counter() - started <= budget_s:
                try:
                    results.append(check_config(f"{m} fp16", fp16, params[m], "shared", False, device_id,
                                                seconds_per_bucket, rng, reference=path, tol=FP16_TOL))  # fmt: skip
                except Exception as exc:  # noqa: BLE001
                    log(f"  {m} fp16: FAILED {exc!r}")
                    results.append({"model": f"{m} fp16", "config": f"{m} fp16: shared", "error": repr(exc)})
                report.write("configs", results)  # so far, in case the machine's time runs out
        print_buckets([r for r in results if "per_bucket" in r])
        ok = all(r.get("ok", False) for r in results if "skipped" not in r)
        return results, ok

    stage("server", lambda: check_server(work, models, device_id, rng))
    stage("configs", configs)
    stage(
        "workers",
        lambda: check_workers(
            models["encoder"], params["encoder"], device_id, 2.0 if MAX_BATCH == 64 else 0.3
        ),
    )
    s = report.summary(started, skipped=skipped, models=sorted(models))
    log(f"\nGPU check {'PASSED' if s['ok'] else 'FAILED'} in {s['seconds']}s; JSON in {out}")
    return 0 if s["ok"] else 1


# -- the GPU machine's side of the transfers ----------------------------------------------------------


def run_installed(out: Path, stash: Path, extra: list[str]) -> int:
    """Reassemble and install the payload, then run --checks with the installed folder first."""
    site = gpu_travel.install(stash, log=log)
    work = gpu_travel.work_dir(stash, CHECKOUT)
    shutil.copy(CHECKOUT / "pyproject.toml", work / "pyproject.toml")  # pytest's settings and markers
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH", "")) if p)
    libs = gpu_travel.cuda_library_path()
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libs, env.get("LD_LIBRARY_PATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    # From the work folder (no batchgate/ in it), so the installed batchgate is the one imported.
    cmd = [
        sys.executable,
        "-m",
        "batchgate.bench.gpu_check",
        "--checks",
        "--work",
        str(work),
        "--out",
        str(out),
        *extra,
    ]
    return subprocess.run(cmd, cwd=work, env=env).returncode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prepare", action="store_true", help="here: write what must travel into --out")
    ap.add_argument("--receive", type=Path, metavar="DIR", help="there: stash the parts carried in DIR")
    ap.add_argument(
        "--run", action="store_true", help="there: once every part is in, install and run the checks"
    )
    ap.add_argument("--checks", action="store_true", help="run the checks in this environment (GPU needed)")
    ap.add_argument(
        "--out", type=Path, help="--prepare: the folder to fill; --run/--checks: where the JSON goes"
    )
    ap.add_argument("--stash", type=Path, default=gpu_travel.STASH)
    ap.add_argument(
        "--ort-wheel", type=Path, help="--prepare: this onnxruntime-gpu wheel instead of downloading it"
    )
    ap.add_argument(
        "--wheel-dir", type=Path, help="--prepare: carry these wheels instead of building/downloading"
    )
    ap.add_argument("--minilm", type=Path, default=CHECKOUT / "model_repository" / "minilm",
                    help="--prepare: the minilm folder to carry (default the checkout's, when built)")  # fmt: skip
    ap.add_argument("--no-minilm", action="store_true")
    ap.add_argument("--part-mib", type=float, default=gpu_travel.DEFAULT_PART / gpu_travel.MIB)
    ap.add_argument(
        "--work", type=Path, default=CHECKOUT, help="--checks: the folder with tests/ and model_repository/"
    )
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--seconds-per-bucket", type=float, default=0.1)
    ap.add_argument(
        "--budget-s",
        type=float,
        default=330.0,
        help="--checks: stages that would start later are skipped (the last one started may take ~2 min)",
    )
    ap.add_argument("--stages", default="pytest,accuracy,server,configs,workers")
    ap.add_argument("--models", default="encoder,minilm", help="--checks: the models to check (when present)")
    ap.add_argument("--quick", action="store_true", help="--checks: a few small buckets (the dry run's test)")
    ap.add_argument(
        "--dry-run-cpu",
        action="store_true",
        help="--checks: run every stage's code on the CPU provider (proves the script, not a GPU)",
    )
    args = ap.parse_args(argv)
    if sum([args.prepare, args.checks, args.receive is not None or args.run]) != 1:
        ap.error("one of --prepare, --receive/--run, --checks")
    if args.prepare:
        if args.out is None:
            ap.error("--prepare needs --out DIR (a git-ignored folder inside the checkout, e.g. gpu-travel)")
        minilm = None
        if not args.no_minilm:
            if (args.minilm / "1" / "model.onnx").exists():
                minilm = args.minilm
            else:
                log(
                    f"no minilm in {args.minilm} (batchgate prepare-minilm builds it): the checks run on encoder only"
                )
        manifest = gpu_travel.prepare(
            args.out, CHECKOUT, ort_wheel=args.ort_wheel, wheel_dir=args.wheel_dir, minilm=minilm,
            part_bytes=int(args.part_mib * gpu_travel.MIB), log=log,
        )  # fmt: skip
        return 0 if manifest["plan"]["ok"] else 1
    if args.checks:
        if args.out is None:
            ap.error("--checks needs --out DIR")
        global KIND, MAX_BATCH
        KIND = "cpu" if args.dry_run_cpu else "gpu"
        MAX_BATCH = 8 if args.quick else 64
        extra = dict(
            device_id=args.device, seconds_per_bucket=args.seconds_per_bucket, budget_s=args.budget_s
        )
        fake = contextlib.nullcontext()
        if args.dry_run_cpu:
            # CuPy and CUDA are what this machine lacks: the fake stands in for them alone (it checks
            # bindings and stream order), so the engines' GPU data path runs for real on the CPU.
            from tests.fake_cuda import FakeCuda

            fake = FakeCuda().installed()
        with fake:
            return checks(args.work.resolve(), args.out, stages=args.stages, models_wanted=args.models,
                          **extra)  # fmt: skip
    missing = gpu_travel.receive(args.receive, args.stash, log=log) if args.receive is not None else []
    if not args.run:
        return 0
    if missing:
        log(f"cannot run yet: parts {missing} have not arrived")
        return 3
    if args.out is None:
        ap.error("--run needs --out DIR")
    extra = ["--device", str(args.device), "--seconds-per-bucket", str(args.seconds_per_bucket),
             "--budget-s", str(args.budget_s), "--stages", args.stages, "--models", args.models,
             *(["--dry-run-cpu"] if args.dry_run_cpu else []), *(["--quick"] if args.quick else [])]  # fmt: skip
    return run_installed(args.out.resolve(), args.stash, extra)


if __name__ == "__main__":
    sys.exit(main())
