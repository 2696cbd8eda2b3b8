"""Plaintext health and metrics ports beside TLS service ports (gateway/transport/probes.py).

A TLS server (certificates made by tests/test_tls.py's helpers) with ``--health-port`` and
``--metrics-port``: Kubernetes-style plaintext gRPC health checks and HTTP probes, and a Prometheus
scrape, work without certificates; nothing else is reachable there; the service ports still refuse
plaintext; the probe ports report the drain until the process exits.
"""

from __future__ import annotations

import re
import signal
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from batchgate.proto.inference.v2 import grpc_service_pb2 as pb
from batchgate.proto.inference.v2 import grpc_service_pb2_grpc as pb_grpc
from tests.test_tls import make_pki, refused, start_tls_server

SERVING = health_pb2.HealthCheckResponse.SERVING


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _health(port: int, service: str = "") -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("probes")
    pki = make_pki(tmp / "pki")
    srv = start_tls_server(
        tmp, pki, mutual=True, env={"BATCHGATE_HEALTH_PORT": "0", "BATCHGATE_METRICS_PORT": "0"}
    )
    m = re.search(r"plaintext probes: gRPC health [\d.]+:(\d+), HTTP metrics\+health [\d.]+:(\d+)", srv.log())
    assert m, srv.log()
    srv.health_port, srv.metrics_port = int(m.group(1)), int(m.group(2))
    yield srv
    srv.stop()


def test_plaintext_grpc_health(tls_server):
    assert _health(tls_server.health_port) == SERVING
    assert _health(tls_server.health_port, "ranker") == SERVING
    assert _health(tls_server.health_port, "inference.GRPCInferenceService") == SERVING


def test_plaintext_health_port_serves_nothing_else(tls_server):
    with grpc.insecure_channel(f"127.0.0.1:{tls_server.health_port}") as ch:
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.GRPCInferenceServiceStub(ch).ServerLive(pb.ServerLiveRequest(), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_plaintext_http_probes_and_metrics(tls_server):
    port = tls_server.metrics_port
    assert _get(port, "/v2/health/live") == (200, '{"live": true}')
    assert _get(port, "/v2/health/ready") == (200, '{"ready": true}')
    status, body = _get(port, "/metrics")
    assert status == 200
    assert re.search(r"^batchgate_\w+", body, re.M), body[:500]
    for path in ("/v2/models/ranker", "/v2", "/v2/models/ranker/config"):
        assert _get(port, path)[0] == 404, path


def test_service_ports_still_refuse_plaintext(tls_server):
    with grpc.insecure_channel(tls_server.grpc_url) as ch:
        refused(ch)
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(f"http://127.0.0.1:{tls_server.http_port}/v2/health/ready", timeout=5)


def test_probe_ports_report_the_drain(tmp_path):
    pki = make_pki(tmp_path / "pki")
    srv = start_tls_server(
        tmp_path, pki, mutual=False,
        env={"BATCHGATE_HEALTH_PORT": "0", "BATCHGATE_METRICS_PORT": "0", "BATCHGATE_DRAIN_LINGER_S": "3"},
    )  # fmt: skip
    m = re.search(r"gRPC health [\d.]+:(\d+), HTTP metrics\+health [\d.]+:(\d+)", srv.log())
    health_port, metrics_port = int(m.group(1)), int(m.group(2))
    assert _health(health_port) == SERVING
    srv.proc.send_signal(signal.SIGTERM)
    seen_grpc = seen_http = None
    deadline = time.monotonic() + 20
    while srv.proc.poll() is None and time.monotonic() < deadline and not (seen_grpc and seen_http):
        try:
            if _health(health_port) != SERVING:
                seen_grpc = True
            if _get(metrics_port, "/v2/health/ready")[0] == 503:
                seen_http = True
        except (grpc.RpcError, OSError):
            break  # closed: the process is on its way out
        time.sleep(0.02)
    assert seen_grpc and seen_http, srv.log()
    assert srv.stop() == 0
