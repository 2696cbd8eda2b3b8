"""bench/gpu_check.py as far as a machine without a GPU can take it: the preparation (with small
stand-in wheels, offline), the parts received one transfer at a time and reassembled byte for
byte, the install into a folder, the run up to where a GPU is needed, and the report.

The real preparation downloads the 244 MiB onnxruntime-gpu wheel; docs/engines.md ("The GPU
check") gives the command and what it printed."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from batchgate.bench import gpu_check, gpu_travel
from tests.conftest import ROOT

MIB = gpu_travel.MIB


def fake_wheel(folder: Path, dist: str, version: str, files: dict[str, bytes]) -> Path:
    """A minimal valid wheel (METADATA, WHEEL, RECORD) that pip installs."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    info = f"{dist}-{version}.dist-info"
    entries = dict(files)
    entries[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n".encode()
    entries[f"{info}/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    record = []
    for name, data in entries.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append(f"{info}/RECORD,,")
    entries[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in entries.items():
            z.writestr(name, data)
    return path


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """A stand-in onnxruntime-gpu wheel of ~2.5 MiB of incompressible bytes (so it spans parts),
    one dependency wheel and a minilm folder."""
    tmp = tmp_path_factory.mktemp("inputs")
    blob = os.urandom(5 * MIB // 2)
    ort = fake_wheel(
        tmp / "ort", "onnxruntime_gpu", "1.31.1", {"ortfake/__init__.py": b"", "ortfake/lib.so": blob}
    )
    deps = tmp / "deps"
    fake_wheel(deps, "depfake", "0.1", {"depfake/__init__.py": b"VALUE = 42\n"})
    minilm = tmp / "minilm"
    (minilm / "1").mkdir(parents=True)
    (minilm / "config.pbtxt").write_text('name: "minilm"\n')
    (minilm / "1" / "model.onnx").write_bytes(os.urandom(MIB + 12345))
    return {"ort": ort, "deps": deps, "minilm": minilm, "blob_sha": hashlib.sha256(blob).hexdigest()}


def _prepare(out: Path, inputs, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "batchgate.bench.gpu_check", "--prepare", "--out", str(out),
           "--ort-wheel", str(inputs["ort"]), "--wheel-dir", str(inputs["deps"]), "--minilm", str(inputs["minilm"]),
           "--part-mib", "1", *extra]  # fmt: skip
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, inputs) -> Path:
    out = tmp_path_factory.mktemp("travel") / "gpu-travel"
    proc = _prepare(out, inputs)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def test_prepare_writes_parts_that_fit_and_a_plan_that_leaves_half(prepared, inputs):
    manifest = json.loads((prepared / "manifest.json").read_text())
    parts = manifest["parts"]
    assert len(parts) >= 4  # 2.5 MiB + 1 MiB in 1 MiB parts
    assert all(p["bytes"] <= MIB for p in parts)
    assert sorted(f.name for f in prepared.glob("part-*")) == [p["name"] for p in parts]
    for p in parts:
        assert gpu_travel.sha256(prepared / p["name"]) == p["sha256"]
        assert (prepared / p["name"]).stat().st_size == p["bytes"]
    assert sum(p["bytes"] for p in parts) == manifest["payload_bytes"]
    roles = {c["path"]: c["role"] for c in manifest["contents"]}
    assert roles[f"wheels/{inputs['ort'].name}"] == "ort"
    assert roles["models/minilm/1/model.onnx"] == "model"
    plan = manifest["plan"]
    assert plan["ok"] and len(plan["calls"]) == len(parts)
    assert all(c["bytes"] <= gpu_travel.TRANSFER_LIMIT for c in plan["calls"])
    e = plan["estimate_s"]
    assert e["left_for_checks"] >= e["budget"] / 2 == 450
    assert plan["calls"][-1]["command"].endswith("--run --out $OUT")
    assert all(c["carry"][0].endswith("manifest.json") for c in plan["calls"])


def test_prepare_prints_the_plan(tmp_path, inputs):
    proc = _prepare(tmp_path / "t", inputs)
    assert "device calls, one after another" in proc.stdout
    assert "left for the checks" in proc.stdout and "(at least half)" in proc.stdout
    assert proc.stdout.count("[ok]") == len(
        json.loads((tmp_path / "t" / "manifest.json").read_text())["parts"]
    )


def test_prepare_is_deterministic(tmp_path, inputs, prepared):
    # The same inputs give the same payload: a part prepared twice can be sent from either run.
    _prepare(tmp_path / "again", inputs)
    a = json.loads((prepared / "manifest.json").read_text())
    b = json.loads((tmp_path / "again" / "manifest.json").read_text())
    assert a["payload_sha256"] == b["payload_sha256"] and a["parts"] == b["parts"]


def test_a_plan_that_does_not_fit_says_so():
    parts = [{"name": "part-01", "bytes": 63 * MIB, "sha256": ""}]
    assert not gpu_travel.plan(parts, 2 * MIB, "gpu-travel")["ok"]  # over 64 MiB with the checkout
    many = [{"name": f"part-{i:02d}", "bytes": MIB, "sha256": ""} for i in range(1, 13)]
    p = gpu_travel.plan(many, MIB, "gpu-travel")  # 12 transfers: 120 + 360 + 45 > 450 s
    assert all(c["fits"] for c in p["calls"]) and not p["ok"]
    with pytest.raises(ValueError, match="part size must be at least 1 MiB"):
        gpu_travel.split(Path(__file__), Path("."), 1000)


def test_prepare_needs_an_out_folder():
    proc = subprocess.run([sys.executable, "-m", "batchgate.bench.gpu_check", "--prepare"], cwd=ROOT,
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 2 and "--prepare needs --out DIR" in proc.stderr


def _receive(transfer: Path, stash: Path, *extra: str) -> subprocess.CompletedProcess:
    """As on the GPU machine: a script run with no site-packages at all (python -S), so nothing of
    ours, not even numpy, is importable yet."""
    cmd = [sys.executable, "-S", str(ROOT / "bench" / "gpu_check.py"), "--receive", str(transfer),
           "--stash", str(stash), *extra]  # fmt: skip
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_parts_arrive_one_transfer_at_a_time_and_reassemble_byte_exact(prepared, inputs, tmp_path):
    manifest = json.loads((prepared / "manifest.json").read_text())
    stash = tmp_path / "stash"
    for i, p in enumerate(manifest["parts"]):
        transfer = tmp_path / f"call-{i + 1}"  # each call carries the manifest and one part, nothing else
        transfer.mkdir()
        shutil.copy(prepared / "manifest.json", transfer)
        shutil.copy(prepared / p["name"], transfer)
        proc = _receive(transfer, stash)
        assert proc.returncode == 0, proc.stderr
        assert f"{i + 1} of {len(manifest['parts'])} part(s)" in proc.stdout
    # Too early to run is refused, saying what is missing (here: nothing, so reassemble instead).
    payload = gpu_travel.reassemble(stash)
    assert gpu_travel.sha256(payload) == manifest["payload_sha256"]
    with tarfile.open(payload) as tar:
        names = tar.getnames()
        model = tar.extractfile("models/minilm/1/model.onnx").read()
        ort = tar.extractfile(f"wheels/{inputs['ort'].name}").read()
    assert model == (inputs["minilm"] / "1" / "model.onnx").read_bytes()
    assert ort == inputs["ort"].read_bytes()
    assert set(names) == {c["path"] for c in manifest["contents"]}
    assert not (stash / "parts").exists()  # removed once the payload is whole


def test_a_corrupt_part_is_refused_and_running_early_says_what_is_missing(prepared, tmp_path):
    manifest = json.loads((prepared / "manifest.json").read_text())
    first = manifest["parts"][0]["name"]
    transfer = tmp_path / "call-1"
    transfer.mkdir()
    shutil.copy(prepared / "manifest.json", transfer)
    data = bytearray((prepared / first).read_bytes())
    data[1000] ^= 0xFF
    (transfer / first).write_bytes(data)
    proc = _receive(transfer, tmp_path / "stash")
    assert proc.returncode != 0 and "not the part the manifest names" in proc.stderr
    (transfer / first).write_bytes((prepared / first).read_bytes())
    proc = _receive(transfer, tmp_path / "stash", "--run", "--out", str(tmp_path / "out"))
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "cannot run yet: parts ['part-02'" in proc.stdout


def test_the_run_installs_into_a_folder_and_stops_where_a_gpu_is_needed(prepared, inputs, tmp_path):
    """The last call of the plan, end to end: receive, reassemble, pip install --target, the work
    folder, then --checks with the installed folder first, which here finds no GPU and says so."""
    stash, out = tmp_path / "stash", tmp_path / "out"
    for i, p in enumerate(json.loads((prepared / "manifest.json").read_text())["parts"]):
        transfer = tmp_path / f"call-{i}"
        transfer.mkdir()
        shutil.copy(prepared / "manifest.json", transfer)
        shutil.copy(prepared / p["name"], transfer)
        last = _receive(transfer, stash, "--run", "--out", str(out))
    assert last.returncode == 2, last.stdout + last.stderr  # no GPU here
    site = stash / "site"
    assert (site / "depfake" / "__init__.py").read_text() == "VALUE = 42\n"
    assert hashlib.sha256((site / "ortfake" / "lib.so").read_bytes()).hexdigest() == inputs["blob_sha"]
    work = stash / "work"
    assert (work / "tests" / "conftest.py").exists() and not (work / "batchgate").exists()
    assert (work / "model_repository" / "minilm" / "1" / "model.onnx").read_bytes() == (
        inputs["minilm"] / "1" / "model.onnx"
    ).read_bytes()
    env = json.loads((out / "environment.json").read_text())
    assert env["usable_gpus"] == 0 and "CUDAExecutionProvider" in env["why_none"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] is False and summary["reason"] == env["why_none"]


def test_report_writes_each_stage_and_a_summary(tmp_path):
    r = gpu_check.Report(tmp_path)
    r.write("accuracy", {"encoder": {"tf32_0": {"ok": True}}}, ok=True, seconds=1.234)
    r.write("configs", [{"config": "encoder: shared"}])  # a stage in progress: no verdict yet
    s = r.summary(0.0, skipped=["workers"])
    assert s["ok"] is True and s["stages"]["accuracy"] == {"ok": True, "seconds": 1.2}
    assert s["stages"]["configs"]["ok"] is None and s["skipped"] == ["workers"]
    r.write("server", {"error": "x"}, ok=False)
    assert r.summary(0.0)["ok"] is False
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "accuracy.json",
        "configs.json",
        "server.json",
        "summary.json",
    ]
    assert json.loads((tmp_path / "summary.json").read_text())["ok"] is False


def test_buckets_table_prints(capsys):
    rows = [
        {"rows": 1, "seq": 16, "ms": 0.2, "rows_per_s": 5000},
        {"rows": 8, "seq": 16, "ms": 0.3, "rows_per_s": 26000},
    ]
    gpu_check.print_buckets([{"model": "encoder", "config": "encoder: shared", "per_bucket": rows},
                             {"model": "encoder", "config": "encoder: static", "per_bucket": rows[:1]}])  # fmt: skip
    text = capsys.readouterr().out
    assert "encoder: rows/s per bucket" in text and "26,000" in text


def test_what_travels_is_what_the_gpu_machine_lacks():
    carry = gpu_travel.wheels_to_carry(gpu_travel._project_requirements())
    assert {
        "pydantic",
        "pydantic-settings",
        "grpcio-health-checking",
        "tritonclient",
        "pytest-asyncio",
    } <= set(carry)
    assert {"grpcio", "protobuf"} <= set(carry)  # there, but needed in exactly these versions
    assert not {"numpy", "onnx", "aiohttp", "tokenizers", "onnxruntime", "batchgate"} & set(carry)


def test_every_stage_runs_its_code_on_the_cpu(tmp_path):
    """--dry-run-cpu: the checks' own code, end to end on the CPU provider, with tests/fake_cuda.py
    standing in for CuPy and CUDA (the GPU is the only thing left for the GPU machine): JSON per
    stage, a real server, five engine configurations whose engines build, bind and run device
    buffers on the GPU asked for (here gpu:1). The pytest stage fails, as it must with no GPU:
    every GPU test skipped, so nothing was checked and the whole check says FAILED."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "batchgate.bench.gpu_check", "--checks", "--dry-run-cpu", "--quick",
           "--models", "encoder", "--device", "1", "--seconds-per-bucket", "0.001", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert files == [
        f"{n}.json" for n in ("accuracy", "configs", "environment", "pytest", "server", "summary", "workers")
    ]
    assert len(files) <= 8  # what the device tool brings back
    summary = json.loads((out / "summary.json").read_text())
    stages = {name: st["ok"] for name, st in summary["stages"].items()}
    assert stages == {"environment": None, "pytest": False, "accuracy": True, "server": True, "configs": True,
                      "workers": True}, proc.stdout[-3000:]  # fmt: skip
    assert summary["ok"] is False and not summary["skipped"]
    pytest_stage = json.loads((out / "pytest.json").read_text())
    assert pytest_stage["passed"] == 0 and pytest_stage["skipped"] >= 4
    assert pytest_stage["problems"] == ["every GPU test skipped"]
    assert json.loads((out / "environment.json").read_text())["cupy"] == "fake"
    configs = json.loads((out / "configs.json").read_text())
    assert [c["config"] for c in configs] == [
        "encoder: dynamic", "encoder: shared", "encoder: static", "encoder: static + CUDA graphs",
        "encoder: shared + CUDA graphs",
    ]  # fmt: skip
    for c in configs:
        name = c["config"]
        assert c["ok"] and c["agreement"]["ok"] and c["agreement"]["cases"] > 0 and c["per_bucket"], name
        assert c["failures"] == [] and c["cuda_graphs"]["engaged"] == c["cuda_graphs"]["asked"], name
    pooled = [c for c in configs if c["buckets"]]
    assert len(pooled) == 4 and all(c["memory"]["by_pool"]["gpu:1/io_buffers"] > 0 for c in pooled)
    server = json.loads((out / "server.json").read_text())
    assert server["ok"] and server["requests"] == 96
    assert all("on cpu:0" in ln for ln in server["startup_lines"])  # a server process has no fake
    workers = json.loads((out / "workers.json").read_text())
    assert workers["failures"] == []
    assert workers["workers_1"]["rows_per_s"] > 0 and workers["workers_2"]["rows_per_s"] > 0
    assert all(n > 0 for n in workers["workers_2"]["batches_per_worker"])
    assert workers["workers_2"]["max_abs_diff_vs_cpu"] <= gpu_check.TF32_ATOL


GPU_TESTS = """
import pytest

@pytest.mark.gpu
@pytest.mark.skipif({skip_a}, reason="no GPU here")
def test_a():
    pass

@pytest.mark.gpu
@pytest.mark.skipif({skip_b}, reason="no GPU here")
def test_b():
    assert {b_passes}

def test_not_a_gpu_test():
    pass
"""


@pytest.mark.parametrize(
    ("skip_a", "skip_b", "b_passes", "gpu_marks", "problems"),
    [
        (True, True, True, True, ["every GPU test skipped"]),
        (False, True, True, True, ["1 GPU test(s) skipped"]),
        (False, False, True, False, ["pytest exited 5", "no GPU test ran"]),  # 5: pytest selected nothing
        (False, False, False, True, ["pytest exited 1"]),
        (False, False, True, True, []),
    ],
)
def test_the_pytest_stage_passes_only_when_gpu_tests_ran(
    tmp_path, skip_a, skip_b, b_passes, gpu_marks, problems
):
    """A GPU test skips where it finds no GPU: skips are not passes, and none selected is no check."""
    text = GPU_TESTS.format(skip_a=skip_a, skip_b=skip_b, b_passes=b_passes)
    if not gpu_marks:
        text = text.replace("@pytest.mark.gpu\n", "")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text(text)
    (tmp_path / "pyproject.toml").write_text('[tool.pytest.ini_options]\nmarkers = ["gpu: needs a GPU"]\n')
    data, ok = gpu_check.check_pytest(tmp_path, files=("tests/test_x.py",))
    assert data["problems"] == problems and ok is (not problems), data["tail"]
    assert data["passed"] == (2 - skip_a - skip_b - (not b_passes) if gpu_marks else 0)


@pytest.fixture
def fake_gpu(monkeypatch):
    """check_config and check_workers in this process, as the dry run runs them."""
    from tests.fake_cuda import FakeCuda

    monkeypatch.setattr(gpu_check, "KIND", "cpu")
    monkeypatch.setattr(gpu_check, "MAX_BATCH", 8)
    with FakeCuda().installed() as fake:
        yield fake


ENCODER = ROOT / "model_repository" / "encoder" / "1" / "model.onnx"


@pytest.mark.parametrize("mode", ["static", "shared"])
def test_a_cuda_graph_capture_that_falls_back_fails_its_config(fake_gpu, monkeypatch, mode):
    """ORT refusing a graph (a node off the GPU) leaves the engine running without one, with the
    right answers: only the CUDA-graph check itself can tell, and it must fail."""
    import numpy as np

    from batchgate.workers.sessions import SessionFactory

    rng = np.random.default_rng(0)
    ok = gpu_check.check_config("encoder", ENCODER, gpu_check.QUICK_PARAMS, mode, True, 1, 0.001, rng)
    assert ok["ok"] and ok["cuda_graphs"] == {"asked": True, "engaged": True, "warnings": []}

    create = SessionFactory.create

    def refuse_graphs(self, overrides=None, shared_arena=False, cuda_graphs=None):
        if cuda_graphs:  # ORT's words when a graph cannot be captured
            raise RuntimeError("This session cannot use the CUDA Graph feature as requested by the user "
                               "as all compute graph nodes have not been partitioned to the CUDA EP.")  # fmt: skip
        return create(self, overrides, shared_arena=shared_arena, cuda_graphs=cuda_graphs)

    monkeypatch.setattr(SessionFactory, "create", refuse_graphs)
    out = gpu_check.check_config("encoder", ENCODER, gpu_check.QUICK_PARAMS, mode, True, 1, 0.001, rng)
    assert out["agreement"]["ok"]  # the answers are right all the same
    assert not out["ok"] and not out["cuda_graphs"]["engaged"]
    (failure,) = out["failures"]
    assert failure.startswith("CUDA graphs asked for, engaged on 0 of") and "CUDA Graph feature" in failure


def test_device_buffers_are_checked_for_device_shape_and_size(fake_gpu):
    """What the configs and workers stages hold every pooled engine to, beside its answers."""
    from batchgate.gateway.parameters import bucket_config
    from batchgate.workers import Device, EngineOptions
    from batchgate.workers.engine import Engine
    from batchgate.workers.pool import WorkerPool

    pool = WorkerPool("b", ENCODER, [Device("gpu", 1)], 1, EngineOptions(warmup="none"),
                      bucket_config(gpu_check.QUICK_PARAMS, 8))  # fmt: skip
    pool.start()
    try:
        engine: Engine = pool.workers[0].engine
        assert gpu_check.device_buffer_failures(engine, 1) == []
        assert gpu_check.device_buffer_failures(engine, 0)[0] == "the engine runs on gpu:1, not gpu:0"
        seqs = next(iter(engine._buffers))
        buffers = engine._buffers[seqs]
        buffers.dev_out["embedding"] = buffers.dev_out["embedding"][:1]  # too small for the bucket
        got = gpu_check.device_buffer_failures(engine, 1)
        assert any("embedding" in f and "want" in f for f in got) and "the plan needs" in got[-1]
        del engine._buffers[seqs]
        got = gpu_check.device_buffer_failures(engine, 1)
        assert got[0] == f"lengths {seqs}: no device buffers (NoneType)"
    finally:
        pool.close()


def test_the_workers_stage_fails_on_answers_unlike_the_cpu(fake_gpu, monkeypatch):
    import numpy as np

    from batchgate.workers.buffers import Slot

    data, ok = gpu_check.check_workers(ENCODER, gpu_check.QUICK_PARAMS, 1, seconds=0.05)
    assert ok and data["failures"] == [] and all(data["workers_2"]["batches_per_worker"])
    run = Slot.run

    def off_by_one(self) -> None:  # a data path that loses nothing but the right answer
        run(self)
        for a in self.outputs.values():
            a += np.float32(1)

    monkeypatch.setattr(Slot, "run", off_by_one)
    data, ok = gpu_check.check_workers(ENCODER, gpu_check.QUICK_PARAMS, 1, seconds=0.05)
    assert not ok and "differs from the CPU by 1" in data["failures"][0]


def test_an_fp16_variant_beside_the_model_is_checked_against_the_fp32_one(tmp_path):
    # A stand-in: the FP32 file copied as model.fp16.onnx (what `batchgate optimize --fp16` writes).
    work = tmp_path / "work"
    shutil.copytree(ROOT / "model_repository" / "encoder", work / "model_repository" / "encoder")
    shutil.copy(
        work / "model_repository/encoder/1/model.onnx", work / "model_repository/encoder/1/model.fp16.onnx"
    )
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "batchgate.bench.gpu_check", "--checks", "--dry-run-cpu", "--quick", "--models",
           "encoder", "--stages", "configs", "--seconds-per-bucket", "0.001", "--work", str(work), "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (fp16,) = [c for c in json.loads((out / "configs.json").read_text()) if c["model"] == "encoder fp16"]
    assert fp16["agreement"]["ok"] and fp16["agreement"]["vs"] == "CPU, model.onnx"
    assert fp16["agreement"]["atol"] == gpu_check.FP16_TOL[1]
