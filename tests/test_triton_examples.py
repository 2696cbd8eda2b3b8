"""Triton's own Python example clients, unmodified, against batchgate serving ONNX stand-ins of the
models they call (tests/string_models.py builds them).

The scripts are read from a copy of triton-inference-server/client (not vendored here): set
``BATCHGATE_TRITON_CLIENT_REPO`` to a checkout or a bare git directory of it, e.g.
``git clone --depth 1 https://github.com/triton-inference-server/client``. Without it the test
skips. Each script runs as a subprocess; it passes when it exits 0 and, where its source prints a
"PASS" line, when that line was printed (some scripts exit 0 after an unmet check).

Not run, because they need what batchgate does not offer or a server named "triton": the shared
memory and CUDA shared memory clients, the sequence clients, the decoupled ``repeat_int32`` one,
the image/ensemble clients (classification extension, Pillow), ``reuse_infer_objects_client``
(shared memory), the ``*_health_metadata`` ones (they check the server's name is "triton"), and the
``*_model_control`` ones (they need Triton's config override on load and a fixed model count).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ServerProcess, start_server
from tests.string_models import write_triton_examples_repo

EXAMPLES = "src/python/examples"
GRPC = [
    "grpc_client.py",
    "grpc_explicit_byte_content_client.py",
    "grpc_explicit_int8_content_client.py",
    "grpc_explicit_int_content_client.py",
    "simple_grpc_aio_infer_client.py",
    "simple_grpc_async_infer_client.py",
    "simple_grpc_custom_args_client.py",
    "simple_grpc_infer_client.py",
    "simple_grpc_keepalive_client.py",
    "simple_grpc_string_infer_client.py",
]
HTTP = [
    "simple_http_aio_infer_client.py",
    "simple_http_async_infer_client.py",
    "simple_http_infer_client.py",
    "simple_http_string_infer_client.py",
]
FIXED_PORTS = ["memory_growth_test.py"]  # no --url flag: localhost:8000 (HTTP) and :8001 (gRPC)
SCRIPT_TIMEOUT_S = 120


def _source() -> Path | None:
    path = os.environ.get("BATCHGATE_TRITON_CLIENT_REPO")
    return Path(path) if path else None


def _read(root: Path, name: str) -> str:
    if (root / EXAMPLES).is_dir():
        return (root / EXAMPLES / name).read_text()
    return subprocess.run(
        ["git", f"--git-dir={root}", "show", f"HEAD:{EXAMPLES}/{name}"],
        check=True, capture_output=True, text=True, timeout=30,
    ).stdout  # fmt: skip


pytestmark = pytest.mark.skipif(
    _source() is None,
    reason="BATCHGATE_TRITON_CLIENT_REPO (a copy of triton-inference-server/client) is not set",
)


@pytest.fixture(scope="module")
def scripts(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("triton-examples")
    for name in GRPC + HTTP + FIXED_PORTS:
        (out / name).write_text(_read(_source(), name))
    return out


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    return write_triton_examples_repo(tmp_path_factory.mktemp("triton-models") / "repo")


@pytest.fixture(scope="module")
def srv(repo, tmp_path_factory) -> ServerProcess:
    s = start_server(tmp_path_factory.mktemp("triton-srv"), repo=repo)
    yield s
    s.stop()


def _run(scripts: Path, name: str, *args: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(scripts / name), *args], cwd=scripts, capture_output=True, text=True,
        timeout=SCRIPT_TIMEOUT_S,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{out[-3000:]}"
    if "PASS" in (scripts / name).read_text():
        assert "PASS" in proc.stdout, f"{name} exited 0 without its PASS line:\n{out[-3000:]}"
    print(f"{name}: exit 0{', PASS' if 'PASS' in proc.stdout else ''}")


@pytest.mark.parametrize("name", GRPC)
def test_grpc_example(name, scripts, srv):
    _run(scripts, name, "-u", srv.grpc_url)


@pytest.mark.parametrize("name", HTTP)
def test_http_example(name, scripts, srv):
    _run(scripts, name, "-u", f"127.0.0.1:{srv.http_port}")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_memory_growth_example_on_the_default_ports(protocol, scripts, repo, tmp_path):
    if not (_free(8000) and _free(8001)):
        pytest.skip("ports 8000/8001 are taken; memory_growth_test.py has no flag to point it elsewhere")
    s = start_server(tmp_path, repo=repo, ports=(8001, 8000))
    try:
        _run(scripts, "memory_growth_test.py", "-i", protocol, "-r", "20")
    finally:
        s.stop()
