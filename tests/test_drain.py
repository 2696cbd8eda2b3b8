"""SIGTERM under unary, stream and REST load, repeated: every call is answered (ok, or UNAVAILABLE /
503 / connection refused, which a client retries elsewhere), none CANCELLED, no connection reset.

Each caller does what a caller of several replicas does: on UNAVAILABLE, 503 or a refused
connection it goes to another replica (here: stops calling this one). A caller that keeps
retrying the draining replica itself can still see a rare CANCELLED: gRPC core cancels the calls
it has received but not yet handed to Python at the moment the server shuts down (see
docs/security.md, "Drain").
"""

from __future__ import annotations

import http.client
import json
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


def _unary(srv, stop: threading.Event, out: Counter, lock: threading.Lock) -> None:
    with grpc.insecure_channel(srv.grpc_url) as ch:
        stub = pb_grpc.GRPCInferenceServiceStub(ch)
        req = ranker_request(2)
        while not stop.is_set():
            try:
                stub.ModelInfer(req, timeout=20)
                outcome = "ok"
            except grpc.RpcError as exc:
                outcome = exc.code().name
                if exc.code() == grpc.StatusCode.CANCELLED:
                    outcome += " " + (exc.details() or "")[:80]
            with lock:
                out["unary " + outcome] += 1
            if outcome.startswith("UNAVAILABLE"):
                return  # this replica is going away: use another one


def _stream(srv, stop: threading.Event, out: Counter, lock: threading.Lock) -> None:
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
                    outcome = (
                        "ok"
                        if not answer.error_message
                        else (
                            "UNAVAILABLE" if "draining" in answer.error_message else answer.error_message[:60]
                        )
                    )
                    with lock:
                        out["stream " + outcome] += 1
                outcome = "end"
            except grpc.RpcError as exc:
                outcome = "status " + exc.code().name
                if exc.code() == grpc.StatusCode.CANCELLED:
                    outcome += " " + (exc.details() or "")[:80]
            with lock:
                out["stream " + outcome] += 1
            if outcome == "status UNAVAILABLE":
                return


def _rest(srv, stop: threading.Event, out: Counter, lock: threading.Lock) -> None:
    conn = None
    while not stop.is_set():
        try:
            if conn is None:
                conn = http.client.HTTPConnection("127.0.0.1", srv.http_port, timeout=20)
            conn.request("POST", "/v2/models/ranker/infer", REST_BODY, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            resp.read()
            outcome = str(resp.status)
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
            break
    if conn is not None:
        conn.close()


@pytest.mark.parametrize("run", range(3))
def test_drain_under_load_cancels_nothing_and_resets_nothing(tmp_path, run):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "ranker").symlink_to(REPO / "ranker", target_is_directory=True)
    srv = start_server(tmp_path, "--no-build-models", repo=repo)
    out: Counter = Counter()
    lock = threading.Lock()
    stop = threading.Event()
    threads = [threading.Thread(target=f, args=(srv, stop, out, lock), daemon=True)
               for f in (_unary,) * 8 + (_stream,) * 2 + (_rest,) * 4]  # fmt: skip
    for t in threads:
        t.start()
    time.sleep(1.5)
    before = dict(out)
    code = srv.stop(signal.SIGTERM)
    time.sleep(0.5)  # callers keep calling a while after the process is gone
    stop.set()
    for t in threads:
        t.join(30)
    print(f"run {run}: before SIGTERM {sum(before.values())} answers; all: {dict(out)}")
    assert code == 0, srv.log()[-3000:]
    assert sum(v for k, v in before.items() if k.endswith(" ok") or k.endswith(" 200")) > 50
    bad = {k: v for k, v in out.items() if "CANCELLED" in k or "reset" in k or "INTERNAL" in k
           or "UNKNOWN" in k or " 500" in k}  # fmt: skip
    assert not bad, (bad, dict(out))
