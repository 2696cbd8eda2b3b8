"""CORS (setting ``cors_allowed_origins``): a page on another origin calls the REST API from headless
Chromium, its preflight answered; a page of an origin not listed is refused by the browser; every
documented route answers a preflight; a server without the setting sends no CORS headers at all."""

from __future__ import annotations

import http.server
import json
import socketserver
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from batchgate.gateway.config import Settings
from batchgate.gateway.admission.tenants import hash_key
from batchgate.gateway.transport import openapi
from tests.conftest import free_ports, start_server
from tests.test_openapi import chromium

KEY = "cors-0123456789abcdef"
TENANTS = f"""
tenants:
  - name: page
    key_hashes: ["{hash_key(KEY)}"]
    models: "*"
"""
# The page: a JSON POST with a key header (not a "simple" request, so the browser preflights it),
# its answer or its failure written into the DOM for --dump-dom to read.
PAGE = """<!doctype html><html><body><pre id="out">pending</pre><script>
fetch(API + "/embed", {method: "POST", headers: {"Content-Type": "application/json", "x-api-key": KEY,
                                                 "X-Latency-Class": "standard"},
                       body: JSON.stringify({inputs: ["A man is eating food."]})})
  .then(r => r.json().then(b => { document.getElementById("out").textContent =
      "status " + r.status + " dims " + b[0].length + " id " + r.headers.get("x-request-id"); }))
  .catch(e => { document.getElementById("out").textContent = "blocked " + e; });
</script></body></html>"""


@pytest.fixture(scope="module")
def page_port():
    return free_ports(1)[0]


@pytest.fixture(scope="module")
def srv(minilm_dir, page_port, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cors-server")
    repo = tmp / "repo"
    repo.mkdir()
    (repo / "minilm").symlink_to(minilm_dir)
    (tmp / "tenants.yaml").write_text(TENANTS)
    s = start_server(
        tmp, "--no-build-models", "--api-keys-file", str(tmp / "tenants.yaml"), repo=repo,
        env={"BATCHGATE_CORS_ALLOWED_ORIGINS": f"http://localhost:{page_port},https://other.example"},
    )  # fmt: skip
    yield s
    s.stop()


def serve_page(folder: Path, port: int, api: str):
    """A static server for the page on ``localhost:port``, another origin than the API's."""
    (folder / "index.html").write_text(PAGE.replace("API", json.dumps(api)).replace("KEY", json.dumps(KEY)))

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **kw):
            super().__init__(*a, directory=str(folder), **kw)

        def log_message(self, *_a) -> None:
            pass

    server = socketserver.TCPServer(("127.0.0.1", port), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def request(url: str, method: str, headers: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers)


def page_in_chromium(srv, port: int, tmp_path: Path) -> str:
    """The page served from ``localhost:port``, as Chromium leaves its DOM after running it."""
    server = serve_page(tmp_path, port, f"http://127.0.0.1:{srv.http_port}")
    try:
        out = chromium(tmp_path, "--dump-dom", f"http://localhost:{port}/index.html")
    finally:
        server.shutdown()
        server.server_close()
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_a_page_on_an_allowed_origin_calls_the_api_from_chromium(srv, page_port, tmp_path):
    dom = page_in_chromium(srv, page_port, tmp_path)
    assert "status 200 dims 384 id " in dom, dom[-2000:]


def test_a_page_on_another_origin_is_refused_by_the_browser(srv, tmp_path):
    dom = page_in_chromium(srv, free_ports(1)[0], tmp_path)  # an origin not in cors_allowed_origins
    assert "blocked TypeError" in dom, dom[-2000:]


def test_every_documented_route_answers_a_preflight(srv):
    base = f"http://127.0.0.1:{srv.http_port}"
    origin = "https://other.example"
    for path, item in openapi.document()["paths"].items():
        url = base + path.replace("{model}", "minilm").replace("{version}", "1").replace(
            "{name}", "swagger-ui.css"
        )
        for method in (m.upper() for m in item if m in ("get", "post")):
            status, headers = request(url, "OPTIONS", {
                "Origin": origin, "Access-Control-Request-Method": method,
                "Access-Control-Request-Headers": "content-type, authorization",
            })  # fmt: skip
            assert status == 204, (path, status)
            assert headers["Access-Control-Allow-Origin"] == origin, (path, headers)
            assert method in headers["Access-Control-Allow-Methods"], (path, headers)
            assert headers["Access-Control-Allow-Headers"] == "content-type, authorization"
    # an answer carries the origin too (refusals included), and exposes the request id
    status, headers = request(base + "/v1/models", "GET", {"Origin": origin})
    assert status == 401 and headers["Access-Control-Allow-Origin"] == origin
    assert "x-request-id" in headers["Access-Control-Expose-Headers"]
    # an origin not listed gets no CORS answer: the preflight is an OPTIONS the route does not serve
    status, headers = request(base + "/embed", "OPTIONS", {
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})  # fmt: skip
    assert status == 405 and "Access-Control-Allow-Origin" not in headers
    # and no route that does not exist is answered
    status, _ = request(base + "/nope", "OPTIONS", {"Origin": origin, "Access-Control-Request-Method": "GET"})
    assert status == 404


def test_cors_is_off_unless_configured_and_origins_are_checked():
    assert Settings().cors_allowed_origins is None
    with pytest.raises(ValueError, match="not an origin"):
        Settings(cors_allowed_origins="https://app.example/path")
    assert Settings(cors_allowed_origins="*").cors_allowed_origins == "*"


def test_a_server_without_the_setting_sends_no_cors_headers(minilm_dir, tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "minilm").symlink_to(minilm_dir)
    s = start_server(tmp_path, "--no-build-models", repo=repo)
    try:
        base = f"http://127.0.0.1:{s.http_port}"
        status, headers = request(base + "/embed", "OPTIONS", {
            "Origin": "https://other.example", "Access-Control-Request-Method": "POST"})  # fmt: skip
        assert status == 405 and not any(k.lower().startswith("access-control") for k in headers)
        status, headers = request(base + "/info", "GET", {"Origin": "https://other.example"})
        assert status == 200 and not any(k.lower().startswith("access-control") for k in headers)
    finally:
        s.stop()
