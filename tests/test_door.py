"""The door (gateway/admission/door.py) against a live server: every transport's calls are counted
at the one overload gate, so REST-only traffic whose calls are all wasted drives the gate into
shedding (before the door, REST calls were counted as ended but never as arrived while the gate
was not shedding, so the share it computed never fell below 1 and it could not start)."""

from __future__ import annotations

import http.client
import json
import threading
import time

import numpy as np

from tests.conftest import REPO, start_server
from tests.test_capacity_live import _metric


def _encoder_body(rows: int, seq: int, budget_ms: float) -> bytes:
    ids = np.ones((rows, seq), np.int64).ravel().tolist()
    return json.dumps({
        "inputs": [
            {"name": "input_ids", "shape": [rows, seq], "datatype": "INT64", "data": ids},
            {"name": "attention_mask", "shape": [rows, seq], "datatype": "INT64", "data": ids},
        ],
        "parameters": {"latency_budget_ms": budget_ms},
    }).encode()  # fmt: skip


def test_rest_only_traffic_that_wastes_its_calls_starts_the_gate_shedding(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "encoder").symlink_to(REPO / "encoder", target_is_directory=True)
    env = {"BATCHGATE_OVERLOAD_MIN_IN_FLIGHT": "2"}
    srv = start_server(tmp_path, "--no-build-models", "--workers-per-device", "1", repo=repo, env=env)
    try:
        body = _encoder_body(32, 128, 1.0)  # a 1 ms budget no 32x128 batch meets: every call wasted
        statuses: dict[int, int] = {}
        overloaded: list[str] = []
        stop = threading.Event()

        def caller() -> None:
            conn = http.client.HTTPConnection("127.0.0.1", srv.http_port, timeout=30)
            while not stop.is_set():
                conn.request("POST", "/v2/models/encoder/infer", body, {"Content-Type": "application/json"})
                resp = conn.getresponse()
                text = resp.read()
                statuses[resp.status] = statuses.get(resp.status, 0) + 1
                if resp.status == 503 and b"server overloaded" in text:
                    overloaded.append(text.decode())
                    stop.set()

        threads = [threading.Thread(target=caller, daemon=True) for _ in range(6)]
        for t in threads:
            t.start()
        stop.wait(20)
        stop.set()
        for t in threads:
            t.join(30)
        refused = _metric(srv.http_port, "batchgate_overload_refused_total")
        share = _metric(srv.http_port, "batchgate_overload_admitted_ratio")
        assert overloaded, f"REST calls all wasted for 20 s and the gate never shed: statuses {statuses}"
        assert refused >= 1
        print(
            f"REST-only wasted calls: statuses {statuses}; gate refused {refused:.0f}, admitting {share:.0%}"
        )
        # and the server still answers a call it can meet once the load is gone
        time.sleep(2.5)  # the share grows back within two seconds
        conn = http.client.HTTPConnection("127.0.0.1", srv.http_port, timeout=30)
        conn.request("POST", "/v2/models/encoder/infer", _encoder_body(1, 16, 5000.0))
        assert conn.getresponse().status == 200
    finally:
        srv.stop()
