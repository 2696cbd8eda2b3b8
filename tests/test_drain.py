"""SIGTERM under unary, stream and REST load, repeated: every call is answered (ok, or UNAVAILABLE /
503 / connection refused, which a client retries elsewhere), none CANCELLED, no connection reset.

Two kinds of caller, three rounds each:

- one that does what a caller of several replicas does: on UNAVAILABLE, 503 or a refused
  connection it goes to another replica (here: stops calling this one);
- one that keeps retrying the draining server itself, at once, until well after the process has
  exited. Before DrainHold (gateway/transport/server.py) this caller saw 1-7 CANCELLED per round:
  gRPC core's shutdown cancels the calls it has received but not handed to Python, and those that
  reach it before the client has read the GOAWAY, and such a caller always has one on the way
  (docs/security.md, "Drain").
"""

from __future__ import annotations

import http.client
import json
import re
import signal
import threading
import time
from collections import Counter

import grpc
import pytest

from batchgate.proto.inference.v2 import grpc_service_pb2_grpc as pb_grpc
from tests.conftest import REPO, start_server
from tests.test_front_door import ranker_request
from tests.test_http import json_body, ranker_arrays

REST_BODY = json.dumps(json_body(ranker_arrays(2))).encode()
REFUSED_PAUSE_S = 0.01  # a retrying caller's pause after a refused connection (no busy loop)


def _status(exc: grpc.RpcError) -> str:
    """The code, and for UNAVAILABLE whether the server said it (draining, or overloaded: a loaded
    machine makes the server shed) or the connection was refused; for anything else the details
    too (they say what went wrong)."""
    code, details = exc.code(), exc.details() or ""
    if code == grpc.StatusCode.UNAVAILABLE:
        for said in ("draining", "overloaded"):
            if said in details:
                return "UNAVAILABLE " + said
        return "UNAVAILABLE refused" if "refused" in details or "failed to connect" in details.lower() else (
            "UNAVAILABLE " + details[:80]
        )  # fmt: skip
    return f"{code.name} {details[:80]}"


def _unary(srv, stop: threading.Event, out: Counter, lock: threading.Lock, retry: bool) -> None:
    with grpc.insecure_channel(srv.grpc_url) as ch:
        stub = pb_grpc.GRPCInferenceServiceStub(ch)
        req = ranker_request(2)
        while not stop.is_set():
            try:
                stub.ModelInfer(req, timeout=20)
                outcome = "ok"
            except grpc.RpcError as exc:
                outcome = _status(exc)
            with lock:
                out["unary " + outcome] += 1
            if outcome.startswith("UNAVAILABLE") and outcome != "UNAVAILABLE overloaded":
                if not retry:
                    return  # this replica is going away: use another one
                if outcome == "UNAVAILABLE refused":
                    time.sleep(REFUSED_PAUSE_S)


def _stream(srv, stop: threading.Event, out: Counter, lock: threading.Lock, retry: bool) -> None:
    with grpc.insecure_channel(srv.grpc_url) as ch:
        stub = pb_grpc.GRPCInferenceServiceStub(ch)
        while not stop.is_set():
            sem = threading.Semaphore(8)

            def requests():
                while not stop.is_set():
                    if sem.acquire(timeout=0.1):
                        yield ranker_request(2)

            try:
                for answer in stub.ModelStreamInfer(requests(), timeout=30):
                    sem.release()
                    said = answer.error_message
                    if not said:
                        outcome = "ok"
                    elif "draining" in said or "overloaded" in said:
                        outcome = "UNAVAILABLE"
                    else:
                        outcome = said[:60]
                    with lock:
                        out["stream " + outcome] += 1
                outcome = "end"
            except grpc.RpcError as exc:
                outcome = "status " + _status(exc)
            with lock:
                out["stream " + outcome] += 1
            if outcome.startswith("status UNAVAILABLE") and outcome != "status UNAVAILABLE overloaded":
                if not retry:
                    return
                if outcome == "status UNAVAILABLE refused":
                    time.sleep(REFUSED_PAUSE_S)


def _rest(srv, stop: threading.Event, out: Counter, lock: threading.Lock, retry: bool) -> None:
    """Keep-alive: one connection until the server says ``Connection: close``."""
    conn = None
    while not stop.is_set():
        try:
            if conn is None:
                conn = http.client.HTTPConnection("127.0.0.1", srv.http_port, timeout=20)
            conn.request("POST", "/v2/models/ranker/infer", REST_BODY, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            resp.read()
            outcome = str(resp.status)
            if outcome == "503" and resp.getheader("Connection", "").lower() != "close":
                outcome = "503 keep-alive"  # the next request on it could be cut by the close
            if resp.getheader("Connection", "").lower() == "close":
                conn.close()
                conn = None
        except ConnectionRefusedError:
            outcome = "refused"
            conn = None
        except (ConnectionResetError, BrokenPipeError, http.client.RemoteDisconnected) as exc:
            outcome = "reset " + type(exc).__name__
            conn = None
        with lock:
            out["rest " + outcome] += 1
        if outcome in ("503", "refused"):
            if not retry:
                break
            if outcome == "refused":
                time.sleep(REFUSED_PAUSE_S)
    if conn is not None:
        conn.close()


def _drain_under_load(tmp_path, retry: bool) -> tuple[dict, dict, str]:
    """Serve ranker, start 8 unary, 2 stream and 4 REST callers, SIGTERM after 1.5 s; the callers
    go on 1 s after the process has exited. Returns (answers before SIGTERM, all answers, log)."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "ranker").symlink_to(REPO / "ranker", target_is_directory=True)
    srv = start_server(tmp_path, "--no-build-models", repo=repo)
    out: Counter = Counter()
    lock = threading.Lock()
    stop = threading.Event()
    threads = [threading.Thread(target=f, args=(srv, stop, out, lock, retry), daemon=True)
               for f in (_unary,) * 8 + (_stream,) * 2 + (_rest,) * 4]  # fmt: skip
    for t in threads:
        t.start()
    time.sleep(1.5)
    with lock:
        before = dict(out)
    code = srv.stop(signal.SIGTERM)
    time.sleep(1.0)  # callers keep calling a while after the process is gone
    stop.set()
    for t in threads:
        t.join(30)
    log = srv.log()
    assert code == 0, log[-3000:]
    assert sum(v for k, v in before.items() if k.endswith(" ok") or k.endswith(" 200")) > 50
    return before, dict(out), log


# Every answer a drain may give: ok, UNAVAILABLE from the server ("draining", or "overloaded" when
# the machine is busy), a refused connection, 503 with Connection: close, a stream ended by its client. Anything else is a loss:
# CANCELLED, a reset (REST) or an UNAVAILABLE the server did not say (a stream cut: "Stream removed").
GOOD = {
    "unary ok", "unary UNAVAILABLE draining", "unary UNAVAILABLE overloaded", "unary UNAVAILABLE refused",
    "stream ok", "stream UNAVAILABLE", "stream end", "stream status UNAVAILABLE draining",
    "stream status UNAVAILABLE overloaded", "stream status UNAVAILABLE refused",
    "rest 200", "rest 503", "rest refused",
}  # fmt: skip


def _bad(out: dict) -> dict:
    return {k: v for k, v in out.items() if k not in GOOD}


@pytest.mark.parametrize("run", range(3))
def test_drain_under_load_cancels_nothing_and_resets_nothing(tmp_path, run):
    before, out, _ = _drain_under_load(tmp_path, retry=False)
    print(f"run {run}: before SIGTERM {sum(before.values())} answers; all: {out}")
    assert not _bad(out), (_bad(out), out)


@pytest.mark.parametrize("run", range(3))
def test_drain_with_callers_retrying_this_server_cancels_nothing(tmp_path, run):
    """Callers that retry the draining server at once (and after it has gone) see ok, UNAVAILABLE,
    503 or a refused connection, never CANCELLED or a reset."""
    before, out, log = _drain_under_load(tmp_path, retry=True)
    print(f"run {run}: before SIGTERM {sum(before.values())} answers; all: {out}")
    assert not _bad(out), (_bad(out), out)
    # They did retry this server to the end: refused once the process was gone, on every transport.
    for transport in ("unary", "stream status", "rest"):
        assert out.get(f"{transport} {'refused' if transport == 'rest' else 'UNAVAILABLE refused'}"), out
    # ... and the gRPC ones were waiting on a held call when gRPC stopped.
    held = re.search(r"answering (\d+) held call", log)
    assert held and int(held.group(1)) >= 1, log[-3000:]
