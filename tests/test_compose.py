"""compose.yaml (the container quickstart) checked offline against the Dockerfile and the settings:
no Docker engine runs here. Where the docker client has the compose plugin, ``docker compose config``
validates the file too."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from urllib.parse import urlsplit

import pytest
import yaml

from batchgate.gateway.config import Settings
from tests.test_helm import ROOT, _dockerignore_excludes, parse_dockerfile

COMPOSE = ROOT / "compose.yaml"


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _env(service: dict) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):  # KEY=VALUE form
        env = dict(e.split("=", 1) for e in env)
    return {k: str(v) for k, v in env.items()}


def _published(service: dict) -> dict[int, int]:
    """container port -> host port."""
    out = {}
    for p in service.get("ports", []):
        host, _, container = str(p).rpartition(":")
        out[int(container.split("/")[0])] = int(host.rsplit(":", 1)[-1])
    return out


def test_services(compose):
    assert set(compose["services"]) == {"batchgate", "redis"}
    gw = compose["services"]["batchgate"]
    assert (ROOT / gw["build"]["context"] / gw["build"]["dockerfile"]).is_file()
    assert _dockerignore_excludes("compose.yaml"), "compose.yaml need not be in the build context"
    _, stages = parse_dockerfile(ROOT / gw["build"]["dockerfile"])
    build_args = {a.split("=", 1)[0] for s in stages for a in s.all("ARG")}
    assert set(gw["build"].get("args", {})) <= build_args, "compose passes a build arg the Dockerfile lacks"


def test_ports_match_the_image_and_the_settings(compose, monkeypatch):
    gw = compose["services"]["batchgate"]
    _, stages = parse_dockerfile(ROOT / "Dockerfile")
    exposed = {int(p.split("/")[0]) for e in stages[-1].all("EXPOSE") for p in e.split()}
    published = _published(gw)
    assert set(published) == exposed, (published, exposed)
    for k in list(os.environ):
        if k.startswith("BATCHGATE_"):
            monkeypatch.delenv(k)
    for k, v in _env(gw).items():
        monkeypatch.setenv(k, v)
    s = Settings()  # every BATCHGATE_* value is one the server accepts
    assert {s.grpc_port, s.http_port} == exposed


def test_environment_names_are_settings(compose):
    env = _env(compose["services"]["batchgate"])
    names = {k.removeprefix("BATCHGATE_").lower() for k in env if k.startswith("BATCHGATE_")}
    unknown = names - set(Settings.model_fields)
    assert not unknown, f"compose.yaml sets settings the server does not have: {sorted(unknown)}"


def test_redis_wiring(compose):
    gw, redis = compose["services"]["batchgate"], compose["services"]["redis"]
    url = urlsplit(_env(gw)["BATCHGATE_REDIS_URL"])
    assert url.scheme == "redis" and url.hostname == "redis"  # the service name resolves on the network
    cmd = redis.get("command", [])
    port = int(cmd[cmd.index("--port") + 1]) if "--port" in cmd else 6379
    assert (url.port or 6379) == port
    assert cmd[cmd.index("--save") + 1] == "" and "allkeys-lru" in cmd  # a cache: nothing on disk
    assert gw["depends_on"]["redis"]["condition"] == "service_healthy"


def test_healthchecks(compose):
    gw, redis = compose["services"]["batchgate"], compose["services"]["redis"]
    test = " ".join(gw["healthcheck"]["test"])
    m = re.search(r"http://127\.0\.0\.1:(\d+)/v2/health/ready", test)
    assert m, test
    assert (
        int(m.group(1)) == Settings.model_fields["http_port"].default == int(_env(gw)["BATCHGATE_HTTP_PORT"])
    )
    assert gw["healthcheck"]["test"][0] == "CMD" and gw["healthcheck"]["test"][1] == "python"  # in the image
    assert "redis-cli" in redis["healthcheck"]["test"] and "ping" in redis["healthcheck"]["test"]


def test_shutdown_and_hardening(compose):
    gw = compose["services"]["batchgate"]
    grace = int(re.fullmatch(r"(\d+)s", gw["stop_grace_period"]).group(1))
    fields = Settings.model_fields
    assert grace >= fields["drain_timeout_s"].default + fields["drain_linger_s"].default + 2
    assert gw["read_only"] is True and "/tmp" in gw["tmpfs"] and gw["cap_drop"] == ["ALL"]
    assert _env(gw)["TMPDIR"] == "/tmp"


@pytest.mark.skipif(shutil.which("docker") is None, reason="no docker client")
def test_docker_compose_config():
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip("the docker client has no compose plugin")
    out = subprocess.run(
        ["docker", "compose", "-f", str(COMPOSE), "config", "--quiet"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
