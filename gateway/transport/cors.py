"""CORS for the REST listener (setting ``cors_allowed_origins``; off when unset): a browser page
from an allowed origin may call every REST route, its preflight (``OPTIONS`` with
``Access-Control-Request-Method``) answered for every route that exists, with that route's methods.

No credentials are allowed: keys travel in headers (``Authorization``, ``x-api-key``) a page sets
itself, never in cookies, so no page can spend a user's ambient credentials.
"""

from __future__ import annotations

from aiohttp import web

from batchgate.gateway.errors import clip

PREFLIGHT_MAX_AGE_S = 600  # how long a browser may reuse a preflight's answer
# Headers a page may read from an answer beside the CORS-safelisted ones.
EXPOSED = ("x-request-id", "x-compute-tokens", "x-compute-characters", "Retry-After", "retry-after-ms")


def middleware(origins: tuple[str, ...]):
    """The middleware for ``origins`` (``*``: any origin)."""
    any_origin = "*" in origins
    allowed = frozenset(origins)

    @web.middleware
    async def cors(request: web.Request, handler):
        origin = request.headers.get("Origin")
        if origin is None or not (any_origin or origin in allowed):
            return await handler(request)
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            refused = request.match_info.http_exception
            if isinstance(refused, web.HTTPMethodNotAllowed):  # a route, without an OPTIONS handler
                return web.Response(status=204, headers={
                    **_origin(origin, any_origin),
                    "Access-Control-Allow-Methods": ", ".join(sorted(refused.allowed_methods)),
                    # what the page asks to send: its key, content type, budget and class headers
                    "Access-Control-Allow-Headers": clip(request.headers.get("Access-Control-Request-Headers", ""), 1024),
                    "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S),
                })  # fmt: skip
        resp = await handler(request)
        resp.headers.update(_origin(origin, any_origin))
        resp.headers["Access-Control-Expose-Headers"] = ", ".join(EXPOSED)
        return resp

    return cors


def _origin(origin: str, any_origin: bool) -> dict:
    if any_origin:
        return {"Access-Control-Allow-Origin": "*"}
    return {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
