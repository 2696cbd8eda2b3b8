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
    """--dry-run-cpu: the checks' own code, end to end on the CPU provider (the GPU is the only
    thing left for the GPU machine): JSON per stage, a real server, five engine configurations."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "batchgate.bench.gpu_check", "--checks", "--dry-run-cpu", "--quick",
           "--models", "encoder", "--seconds-per-bucket", "0.001", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert files == [
        f"{n}.json" for n in ("accuracy", "configs", "environment", "pytest", "server", "summary", "workers")
    ]
    assert len(files) <= 8  # what the device tool brings back
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] and not summary["skipped"]
    configs = json.loads((out / "configs.json").read_text())
    assert [c["config"] for c in configs] == [
        "encoder: dynamic", "encoder: shared", "encoder: static", "encoder: static + CUDA graphs",
        "encoder: shared + CUDA graphs",
    ]  # fmt: skip
    for c in configs:
        assert c["agreement"]["ok"] and c["agreement"]["cases"] > 0 and c["per_bucket"], c["config"]
    server = json.loads((out / "server.json").read_text())
    assert server["ok"] and server["requests"] == 96
    assert all("on cpu:0" in ln for ln in server["startup_lines"])
    workers = json.loads((out / "workers.json").read_text())
    assert workers["workers_1"]["rows_per_s"] > 0 and workers["workers_2"]["rows_per_s"] > 0


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
