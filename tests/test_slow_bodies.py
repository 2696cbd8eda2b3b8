"""Keyed POSTs whose bodies trickle in, on every REST route that reads a body: the server answers
408 in the route's own error shape at the body deadline and closes the connection, so slow
callers cannot hold the REST port (one body reader for all of them: gateway/transport/http.py)."""

from __future__ import annotations

import json
import socket
import time

import pytest

from batchgate.gateway.admission.tenants import hash_key
from tests.conftest import REPO, start_server


# Beside other tests, not alone: it mostly waits, and its bounds (deadline -0.5 s, +3 s) are far
# wider than a busy loop's lag.
KEY = "slow-" + "k" * 40
BODY_TIMEOUT_S = 2.0
CONNECTIONS = 12  # per route


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("slowbodies")
    repo = tmp / "repo"
    repo.mkdir()
    (repo / "ranker").symlink_to(REPO / "ranker", target_is_directory=True)
    path = tmp / "tenants.json"
    path.write_text(json.dumps({"tenants": [{"name": "t", "key_hashes": [hash_key(KEY)], "admin": True}]}))
    env = {"BATCHGATE_HTTP_BODY_TIMEOUT_S": str(BODY_TIMEOUT_S), "BATCHGATE_MODEL_CONTROL": "true"}
    srv = start_server(tmp, "--api-keys-file", str(path), "--no-build-models", repo=repo, env=env)
    yield srv
    srv.stop()


def _error_of(path: str, doc: dict) -> str:
    """The message in the route's documented error shape (fails if the shape is another's)."""
    if path.startswith("/v1/"):
        err = doc["error"]
        assert err["code"] == "request_timeout" and err["type"] == "invalid_request_error", doc
        return err["message"]
    if path in ("/embed", "/rerank"):
        assert doc["error_type"] == "validation", doc
    return doc["error"]


ROUTES = [
    "/v2/models/ranker/infer",
    "/v2/repository/index",
    "/v2/repository/models/ranker/load",
    "/v1/embeddings",
    "/embed",
    "/rerank",
    "/v1/rerank",
]


@pytest.mark.parametrize("path", ROUTES)
def test_a_trickled_body_is_cut_at_the_body_deadline(server, path):
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        "Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{"
    ).encode()
    conns = [socket.create_connection(("127.0.0.1", server.http_port), timeout=5) for _ in range(CONNECTIONS)]
    for s in conns:
        s.sendall(head)
        s.settimeout(0.01)
    t0 = time.monotonic()
    answers: dict[int, bytes] = {}
    closed_at: dict[int, float] = {}
    while len(closed_at) < len(conns) and time.monotonic() - t0 < BODY_TIMEOUT_S + 10:
        for i, s in enumerate(conns):
            if i in closed_at:
                continue
            try:
                s.sendall(b" ")  # one byte of the body at a time
                chunk = s.recv(65536)
                if chunk == b"":
                    closed_at[i] = time.monotonic() - t0
                else:
                    answers[i] = answers.get(i, b"") + chunk
            except TimeoutError:
                pass
            except OSError:  # reset: closed by the server
                closed_at[i] = time.monotonic() - t0
        time.sleep(0.1)
    for s in conns:
        s.close()
    assert len(closed_at) == len(conns), f"{len(conns) - len(closed_at)} of {len(conns)} still open on {path}"
    assert max(closed_at.values()) < BODY_TIMEOUT_S + 3, closed_at
    assert min(closed_at.values()) >= BODY_TIMEOUT_S - 0.5, closed_at  # cut by the deadline, not before
    assert len(answers) == len(conns), f"{len(conns) - len(answers)} closed without an answer on {path}"
    for raw in answers.values():
        status_line, _, rest = raw.partition(b"\r\n")
        assert b" 408 " in status_line, raw[:200]
        body = rest.split(b"\r\n\r\n", 1)[1]
        assert "did not arrive within 2 s" in _error_of(path, json.loads(body))
    print(f"{path}: {len(conns)} trickled bodies answered 408 and closed in "
          f"{min(closed_at.values()):.1f}-{max(closed_at.values()):.1f} s (deadline {BODY_TIMEOUT_S:g} s)")  # fmt: skip
