"""Plaintext listeners for health and metrics only, beside TLS service ports.

With TLS on, the service ports refuse plaintext, yet Kubernetes' gRPC probes speak no TLS, and a
Prometheus scrape should not need a client certificate. So, as Triton does with ``--metrics-port``,
these ports carry nothing a caller could use to reach a model:

- ``health_port`` (gRPC): ``grpc.health.v1.Health`` only, the same servicer (so the same statuses,
  NOT_SERVING while draining) as the service port; no inference, no reflection.
- ``metrics_port`` (HTTP): ``GET /metrics``, ``/v2/health/live`` and ``/v2/health/ready``, answered as
  the service port answers them; every other path is 404.

Both are off unless set. They stop last on shutdown, so probes see the drain through to the end.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
from aiohttp import web
from grpc_health.v1 import health_pb2_grpc
from prometheus_client import CONTENT_TYPE_LATEST

from batchgate.gateway.transport.http import Listener

if TYPE_CHECKING:
    from batchgate.gateway.transport.server import Server

log = logging.getLogger(__name__)


@dataclass
class Probes:
    health_port: int | None = None  # the bound ports (the real ones when 0 was asked)
    metrics_port: int | None = None
    _grpc: grpc.aio.Server | None = None
    _http: web.AppRunner | None = None
    _listener: Listener | None = None  # its socket is not the runner's to close

    async def stop(self) -> None:
        if self._grpc is not None:
            await self._grpc.stop(grace=0.5)
        if self._listener is not None:
            self._listener.stop_accepting()
        if self._http is not None:
            await self._http.cleanup()


def _app(server: Server) -> web.Application:
    plane, metrics = server.plane, server.metrics

    async def live(_req: web.Request) -> web.Response:
        return web.json_response({"live": True})

    async def ready(_req: web.Request) -> web.Response:
        ok = plane.ready
        return web.json_response({"ready": ok}, status=200 if ok else 503)

    async def scrape(_req: web.Request) -> web.Response:
        return web.Response(body=metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    # GETs carry no body; a small cap keeps an unauthenticated port from buffering anything large.
    app = web.Application(client_max_size=4096)
    app.router.add_get("/v2/health/live", live)
    app.router.add_get("/v2/health/ready", ready)
    app.router.add_get("/metrics", scrape)
    return app


async def start(server: Server) -> Probes:
    """Open the configured plaintext ports for ``server`` (a ``gateway.transport.server.Server`` that has its
    health servicer, data plane and metrics); returns what ``stop`` closes."""
    s = server.settings
    probes = Probes()
    if s.health_port is not None:
        g = grpc.aio.server(options=[("grpc.so_reuseport", 1 if s.reuse_port else 0)])
        health_pb2_grpc.add_HealthServicer_to_server(server.health, g)
        probes.health_port = g.add_insecure_port(f"{s.host}:{s.health_port}")
        if probes.health_port == 0:
            raise OSError(f"cannot listen on {s.host}:{s.health_port} for gRPC health")
        await g.start()
        probes._grpc = g
    if s.metrics_port is not None:
        runner = web.AppRunner(_app(server), access_log=None)
        await runner.setup()
        probes._http = runner
        probes._listener = await Listener.open(runner, s.host, s.metrics_port, reuse_port=s.reuse_port)
        probes.metrics_port = probes._listener.port
    opened = [
        f"{what} {s.host}:{port}"
        for what, port in (("gRPC health", probes.health_port), ("HTTP metrics+health", probes.metrics_port))
        if port
    ]
    if opened:
        log.info("plaintext probes: %s", ", ".join(opened))
    return probes
