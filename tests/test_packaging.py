"""Packaging: one distribution, one import namespace (``batchgate.``), and a built wheel that serves
beside ``proto-plus`` (which owns the bare ``proto`` name and broke the first build's imports)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import sysconfig
import time
import tomllib
import zipfile
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from tests.helpers import free_ports

ROOT = Path(__file__).resolve().parent.parent
TOP_LEVEL = ["gateway", "workers", "cache", "bench", "client", "proto"]


def test_every_package_folder_is_packaged():
    """A subpackage folder missing from pyproject's explicit list would be absent from the wheel."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    found = {"batchgate"}
    for top in TOP_LEVEL:
        assert tool["package-dir"][f"batchgate.{top}"] == top
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT).parts
            found.add(".".join(("batchgate", *rel)))
    assert found == listed, (
        f"packages in folders but not listed: {found - listed}; listed but absent: {listed - found}"
    )


def test_no_bare_top_level_imports():
    """Every import of our own code goes through ``batchgate.`` (a bare ``proto`` is proto-plus's)."""
    bare = re.compile(r"^\s*(from|import)\s+(proto|gateway|workers|cache|bench|client)(\.|\s|$)", re.M)
    offenders = []
    for top in [*TOP_LEVEL, "batchgate", "tests"]:
        for path in (ROOT / top).rglob("*.py"):
            for m in bare.finditer(path.read_text()):
                offenders.append(f"{path.relative_to(ROOT)}: {m.group(0).strip()}")
    assert not offenders, "\n".join(offenders)


def _ranker_reference(dense: np.ndarray, ids: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(
        str(ROOT / "model_repository/ranker/1/model.onnx"), providers=["CPUExecutionProvider"]
    )
    names = [i.name for i in sess.get_inputs()]
    return sess.run(None, dict(zip(names, [dense, ids], strict=True)))[0]


@pytest.mark.timeout(600)
@pytest.mark.holds("build")  # pip wheel builds in the checkout's build/ (tests/parallel.py)
def test_wheel_serves_beside_proto_plus(tmp_path):
    """Build the wheel, install it (no extra deps: those come from this venv) into a fresh venv that
    also has proto-plus, serve ``ranker`` from outside the checkout and answer a Triton client."""
    import tritonclient.grpc as tc

    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), str(ROOT)],
        check=True, capture_output=True,
    )  # fmt: skip
    (wheel,) = wheels.glob("batchgate-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    # The dependencies (proto-plus among them: the dev extra has it) come from this venv's
    # site-packages, added as a plain path: its editable-install hook is not run there, so the
    # only batchgate the fresh venv can import is the wheel's.
    deps = [p for p in sys.path if p.endswith("site-packages")] or [sysconfig.get_paths()["purelib"]]
    Path(site, "_deps.pth").write_text("\n".join(deps) + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q", str(wheel)],
        check=True, capture_output=True,
    )  # fmt: skip
    # The wheel's benches are bench/'s and nothing of lab/; each imports from the wheel alone.
    shipped = {
        n.removeprefix("batchgate/bench/")
        for n in zipfile.ZipFile(wheel).namelist()
        if n.startswith("batchgate/bench/")
    }
    assert shipped == {p.name for p in (ROOT / "bench").glob("*.py")} | {"gpu_machine_packages.txt"}, shipped
    probe = subprocess.run(
        [str(py), "-c", "import proto, batchgate.gateway.transport.server as s; print(proto.__file__, hasattr(proto, 'Message'));"
         " print(s.__file__); import importlib, pkgutil, batchgate.bench as b;"
         " [importlib.import_module('batchgate.bench.' + m.name) for m in pkgutil.iter_modules(b.__path__)]"],
        cwd=tmp_path, capture_output=True, text=True,
    )  # fmt: skip
    assert probe.returncode == 0, (
        f"the installed wheel cannot import its own modules:\n{probe.stderr[-3000:]}"
    )
    proto_file, is_proto_plus, server_file = probe.stdout.split()
    # The bare name is proto-plus's (it has Message), not our folder; our server is the wheel's.
    assert is_proto_plus == "True" and Path(proto_file).parent != ROOT / "proto", probe.stdout
    assert server_file.startswith(site), probe.stdout

    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "ranker").symlink_to(ROOT / "model_repository/ranker", target_is_directory=True)
    grpc_port, http_port = free_ports(2)
    log = (tmp_path / "server.log").open("w")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"BATCHGATE_VARIANT_SELECTION": "off"}
    proc = subprocess.Popen(
        [str(venv / "bin" / "batchgate"), "serve", "--model-repository", str(repo), "--host", "127.0.0.1",
         "--grpc-port", str(grpc_port), "--http-port", str(http_port)],
        cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip
    try:
        client = tc.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        deadline = time.monotonic() + 60
        while not _ready(client):
            assert proc.poll() is None, (tmp_path / "server.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "server.log").read_text()
            time.sleep(0.2)
        rng = np.random.default_rng(3)
        dense = rng.standard_normal((4, 64), dtype=np.float32)
        ids = rng.integers(0, 10000, (4, 8), dtype=np.int64)
        inputs = [tc.InferInput("dense", [4, 64], "FP32"), tc.InferInput("sparse_ids", [4, 8], "INT64")]
        inputs[0].set_data_from_numpy(dense)
        inputs[1].set_data_from_numpy(ids)
        got = client.infer("ranker", inputs).as_numpy("score")
        np.testing.assert_allclose(got, _ranker_reference(dense, ids), rtol=1e-5, atol=1e-6)
        client.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def _ready(client) -> bool:
    try:
        return client.is_model_ready("ranker")
    except Exception:  # noqa: BLE001 - not up yet: any transport error means "try again"
        return False


def test_python_dash_m_batchgate():
    out = subprocess.run(
        [sys.executable, "-m", "batchgate", "--help"], capture_output=True, text=True, check=True
    )
    assert "serve" in out.stdout
