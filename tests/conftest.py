"""Fixtures that start the real thing: a batchgate server process on free loopback ports."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
REPO = ROOT / "model_repository"


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports (all held open while choosing, so they differ)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    grpc_port: int
    http_port: int
    log_path: Path
    env: dict = field(default_factory=dict)

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"server did not exit within {timeout}s after signal {sig}\n{self.log()}")
        return self.proc.returncode


def start_server(tmp: Path, *args: str, repo: Path = REPO, env: dict | None = None, ready_timeout: float = 60.0) -> ServerProcess:
    grpc_port, http_port = free_ports(2)
    log_path = tmp / f"server-{grpc_port}.log"
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    cmd = [
        sys.executable, "-m", "gateway", "serve",
        "--model-repository", str(repo), "--host", "127.0.0.1",
        "--grpc-port", str(grpc_port), "--http-port", str(http_port), *args,
    ]  # fmt: skip
    log_file = log_path.open("w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=log_file, stderr=subprocess.STDOUT)
    server = ServerProcess(proc, grpc_port, http_port, log_path, env or {})
    deadline = time.monotonic() + ready_timeout
    with grpc.insecure_channel(server.grpc_url) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"server exited with {proc.returncode} during start\n{server.log()}")
            try:
                resp = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    break
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                server.stop(signal.SIGKILL)
                raise AssertionError(f"server not ready within {ready_timeout}s\n{server.log()}")
            time.sleep(0.1)
    return server


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    """The bundled repository served with default settings, shared by the read-mostly tests."""
    srv = start_server(tmp_path_factory.mktemp("server"))
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def triton(server):
    import tritonclient.grpc as tc

    client = tc.InferenceServerClient(server.grpc_url)
    yield client
    client.close()


@pytest.fixture(scope="session")
def stub(server):
    from proto.inference.v2 import grpc_service_pb2_grpc as pb_grpc

    with grpc.insecure_channel(server.grpc_url) as ch:
        yield pb_grpc.GRPCInferenceServiceStub(ch)
