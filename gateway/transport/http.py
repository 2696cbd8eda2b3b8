"""The HTTP listener every REST wire shares (aiohttp): the listening socket and its connection cap,
the one body reader, the middlewares, and ``app()``, which collects every wire's route table:
KServe v2 REST (kserve_rest.py), OpenAI (openai.py), TEI and rerank (tei.py, tei_surface.py), the
OpenAPI contract (openapi.py), and ``/metrics``; CORS when configured (cors.py).

Cheap refusals first: a body larger than the limit is refused from its Content-Length; a body that
takes longer than ``http_body_timeout_s`` to arrive gets 408 and the connection closes; connections
are capped and a connection that does not send a whole request head in ``http_header_timeout_s`` is
closed (``Listener``). The wires get the body reader as an ``Http`` (they import nothing from here,
so this module can import them).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from aiohttp import web

from batchgate.gateway import tracing
from batchgate.gateway.errors import GatewayError, Kind, clip, too_large
from batchgate.gateway.metrics import CONTENT_TYPE_LATEST
from batchgate.gateway.config import cors_origins
from batchgate.gateway.transport import cohere, cors, kserve_rest, openai, openapi, tei, vllm

if TYPE_CHECKING:
    from batchgate.gateway.transport.server import Server

log = logging.getLogger(__name__)

JSON_TYPE = "application/json"
BODY_REFUSED = "batchgate.body_refused"  # a request mark: its answer ends the connection (``_close_refused``)
_KEY_HEADERS = ("x-api-key", "authorization")


class Http:
    """What every route table gets from the listener: the body reader under the server's caps."""

    def __init__(self, max_body: int, body_timeout_s: float) -> None:
        self.max_body = max_body
        self.body_timeout_s = body_timeout_s

    async def body(self, req: web.Request) -> bytes:
        """The one reader of every REST route's body: refused by its declared length when too large,
        cut off at ``max_body`` when undeclared (chunked), and within the body deadline (a client
        trickling its body holds a connection, not the server). A refused body (``Kind.TOO_LARGE``,
        ``Kind.SLOW``) ends its connection with the route's answer: the rest is never read."""
        n = req.content_length
        max_body, timeout_s = self.max_body, self.body_timeout_s
        if n is not None and n > max_body:
            req[BODY_REFUSED] = True
            raise too_large(
                f"the request body is {n} bytes; at most {max_body} are accepted (max_http_body_bytes)"
            )
        try:
            async with asyncio.timeout(timeout_s):
                return await req.read()
        except TimeoutError:
            req[BODY_REFUSED] = True
            raise GatewayError(
                Kind.SLOW, f"the request body did not arrive within {timeout_s:g} s (http_body_timeout_s)",
                outcome="invalid",
            ) from None  # fmt: skip
        except web.HTTPRequestEntityTooLarge:
            req[BODY_REFUSED] = True
            raise too_large(
                f"the request body is larger than {max_body} bytes (max_http_body_bytes)"
            ) from None

    @staticmethod
    def metadata(req: web.Request) -> list[tuple[str, str]]:
        """The headers the door reads, as gRPC-style metadata (lower-case keys; aiohttp's headers
        are case-insensitive)."""
        h = req.headers
        keys = (*_KEY_HEADERS, *tracing.HEADERS) if tracing.TRACER is not None else _KEY_HEADERS
        return [(k, h[k]) for k in keys if k in h]


def _error(status: int, message: str, headers: dict | None = None) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers)


@web.middleware
async def _close_refused(request: web.Request, handler):
    """After the answer to a refused body, the connection closes at once: aiohttp would otherwise
    keep reading and discarding the rest of the body for its lingering time (10 s), on which a
    trickling client holds the connection."""
    resp = await handler(request)
    if request.get(BODY_REFUSED):
        resp.force_close()
        await resp.prepare(request)
        await resp.write_eof()
        if request.transport is not None:
            request.transport.close()  # after the answer: asyncio flushes what is written first
    return resp


@web.middleware
async def _json_errors(request: web.Request, handler):
    """aiohttp's own refusals (no such route, wrong method, body too large) as JSON errors too."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400 or exc.content_type == JSON_TYPE:
            raise
        headers = (
            {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        )  # a 405 names the methods
        return _error(exc.status, exc.reason if exc.status != 413 else exc.text or exc.reason, headers)
    except Exception as exc:  # a bug: say so, keep serving
        log.exception("HTTP %s %s failed", request.method, clip(request.path))
        return _error(500, f"internal error: {type(exc).__name__}: {clip(exc, 512)}")


def app(server: Server) -> web.Application:
    """The REST listener's application: every wire's routes, behind the shared middlewares."""
    plane, metrics = server.plane, server.metrics
    s = server.settings
    max_body = s.max_http_body_bytes or 6 * server.max_message_bytes
    http = Http(max_body, s.http_body_timeout_s)

    @web.middleware
    async def close_when_draining(request: web.Request, handler):
        # While draining, the connection ends with this answer (Connection: close), so the
        # client opens a new one for its next request (refused: the listener is closed) and
        # none is left open for a later close to cut under a request. Raised answers too.
        try:
            resp = await handler(request)
        except web.HTTPException as exc:
            if plane.draining:
                exc.force_close()
            raise
        if plane.draining:
            resp.force_close()
        return resp

    async def scrape(_req: web.Request) -> web.Response:
        return web.Response(body=metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    middlewares = [_close_refused, close_when_draining, _json_errors]
    origins = cors_origins(s.cors_allowed_origins)
    if origins:  # outside _json_errors: its answers carry the CORS headers too
        middlewares.insert(2, cors.middleware(origins))
    application = web.Application(client_max_size=max_body, middlewares=middlewares)
    r = application.router
    r.add_get("/metrics", scrape)
    r.add_routes(kserve_rest.routes(server, http))
    r.add_routes(openai.routes(server, http))
    r.add_routes(tei.routes(server, http))
    r.add_routes(cohere.routes(server, http))
    r.add_routes(vllm.routes(server, http))
    r.add_routes(openapi.routes())
    return application


class _Refuse(asyncio.Protocol):
    """A connection over ``http_max_connections``: one 503 and closed, before any parsing."""

    def connection_made(self, transport) -> None:
        transport.write(
            b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
            b'Content-Length: 49\r\n\r\n{"error": "too many connections; try again later"}'
        )
        transport.close()


class Listener:
    """A listening socket for an aiohttp runner, through public API only (the runner's protocol
    factory and asyncio's ``create_server``), with an optional connection cap in front of the
    factory: a connection over it gets ``_Refuse`` before any parsing."""

    def __init__(self, server: asyncio.Server, cap: _Cap | None) -> None:
        self._listening = server
        self._cap = cap
        self.port = (
            server.sockets[0].getsockname()[1] if server.sockets else 0
        )  # the real port when 0 was asked

    @property
    def refused(self) -> int:
        return self._cap.refused if self._cap is not None else 0

    @classmethod
    async def open(
        cls, runner: web.AppRunner, host: str, port: int, *, reuse_port: bool = False,
        ssl_context=None, max_connections: int | None = None,
    ) -> Listener:  # fmt: skip
        factory = runner.server
        if factory is None:
            raise RuntimeError("the runner is not set up")
        cap = _Cap(factory, max_connections) if max_connections else None
        server = await asyncio.get_running_loop().create_server(
            cap or factory, host, port, ssl=ssl_context, reuse_address=True, reuse_port=reuse_port or None,
        )  # fmt: skip
        return cls(server, cap)

    def stop_accepting(self) -> None:
        """Close the listening socket only; connections already open go on being served."""
        self._listening.close()


class _Cap:
    def __init__(self, factory: web.Server, max_connections: int) -> None:
        self.factory = factory
        self.max_connections = max_connections
        self.refused = 0

    def __call__(self):
        if len(self.factory.connections) >= self.max_connections:
            self.refused += 1
            return _Refuse()
        return self.factory()


async def start(server: Server) -> tuple[web.AppRunner, Listener]:
    """Serve the HTTP side for ``server``; returns the runner (for cleanup) and its listener."""
    s = server.settings
    # keepalive_timeout is aiohttp's one timer for a connection waiting for a request head: it
    # runs from the connection's start and from each answer, and data arriving does not reset it
    # (aiohttp >= 3.10), so it is the header deadline too (idle keep-alive connections close then).
    runner = web.AppRunner(
        app(server), access_log=None, keepalive_timeout=s.http_header_timeout_s,
        max_field_size=16 * 1024, max_line_size=16 * 1024,
        # A caller that hangs up cancels its handler: its queued rows leave the queue before
        # compute (counted as outcome "cancelled"), as a gRPC cancellation does.
        handler_cancellation=True,
    )  # fmt: skip
    await runner.setup()
    tls = server.tls
    listener = await Listener.open(
        runner, s.host, s.http_port, reuse_port=s.reuse_port, ssl_context=tls.ssl_context() if tls else None,
        max_connections=s.http_max_connections,
    )  # fmt: skip
    return runner, listener
