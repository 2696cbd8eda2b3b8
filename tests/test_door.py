"""The door (gateway/admission/door.py): every transport's calls are counted at the one overload
gate, so REST-only traffic whose calls are all wasted drives the gate into shedding (before the
door, REST calls were counted as ended but never as arrived while the gate was not shedding, so
the share it computed never fell below 1 and it could not start). Once through the real pipeline
in-process (tests/harness.py), the wasted calls expiring in the queue; once against a live server
process with its ONNX engines."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
from collections import Counter

import numpy as np
import pytest

from tests.conftest import REPO, start_server
from tests.harness import model_repo, rest_body, serving
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


@pytest.mark.serial
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


@pytest.mark.serial
async def test_rest_only_calls_expiring_in_the_queue_start_the_gate_shedding(tmp_path):
    """REST callers whose 1 ms budgets no batch meets, on a model that does not shed at admission:
    every call is taken; those that find the worker busy are dropped from the queue before compute
    (the fake engine's 10 ms batches), the rest are answered late. The gate, seeing only REST
    calls, must start refusing at the door once at least 16 have ended and over a tenth of them
    were dropped."""
    noshed = 'parameters { key: "shed_at_admission" value { string_value: "false" } }\n'
    repo = model_repo(tmp_path, {"encoder": noshed})
    async with serving(repo, workers_per_device=1, overload_min_in_flight=2) as gw:
        pool = gw.pool("encoder")
        pool.per_batch_s = 0.010
        ids = np.ones((4, 16), np.int64)
        body = rest_body({"input_ids": ids, "attention_mask": ids}, latency_budget_ms=1.0)
        statuses: Counter = Counter()
        overloaded = asyncio.Event()

        async def caller() -> None:
            while not overloaded.is_set():
                async with gw.http.post("/v2/models/encoder/infer", json=body) as resp:
                    text = await resp.text()
                statuses[resp.status] += 1
                if resp.status == 503 and "server overloaded" in text:
                    overloaded.set()

        callers = [asyncio.ensure_future(caller()) for _ in range(8)]
        try:
            await asyncio.wait_for(overloaded.wait(), 20)
        except TimeoutError:
            raise AssertionError(f"REST calls all wasted for 20 s, the gate never shed: {statuses}") from None
        finally:
            overloaded.set()
            await asyncio.gather(*callers)
        refused = await gw.metric("batchgate_overload_refused_total")
        expired = await gw.metric("batchgate_class_requests_total", model="encoder", outcome="expired")
        shed = await gw.metric("batchgate_class_requests_total", model="encoder", outcome="shed")
        print(f"REST-only, in-process: statuses {dict(statuses)}; {expired:.0f} expired in the queue, "
              f"{shed:.0f} shed; the gate refused {refused:.0f}")  # fmt: skip
        ended = statuses[504] + statuses[200]  # 504: DEADLINE_EXCEEDED over REST; 200: answered late
        assert refused >= 1 and ended >= 16 and statuses[504] > 0.1 * ended, statuses
        assert expired == statuses[504] and shed == 0  # wasted in the queue, as the model was told
        assert await gw.metric("batchgate_inflight_requests") == 0  # every call was answered
        # the share grows back within two seconds once the waste stops; then a call that can be met is answered
        await gw.wait_metric("batchgate_overload_admitted_ratio", 1.0, timeout_s=5)
        good = rest_body({"input_ids": ids, "attention_mask": ids}, latency_budget_ms=5000)
        status, doc = await gw.rest_infer("encoder", good)
        assert status == 200, doc
        want = pool.expected({"input_ids": ids, "attention_mask": ids})["embedding"]
        assert doc["outputs"][0]["data"] == want.ravel().tolist()


async def test_every_call_the_door_takes_is_counted_once_when_it_ends(tmp_path, minilm_dir):
    """The gate's ended calls must match the calls it took: a call refused after the door but
    before the pipeline (a bad field, bad JSON, a missing model on the OpenAI/TEI/rerank routes; a
    bad KServe body) still ends at the door, and an answered call is not counted twice. The gate's
    looks are stopped so that its decaying counts stay whole."""
    repo = model_repo(tmp_path, {})
    (repo / "minilm").symlink_to(minilm_dir, target_is_directory=True)
    async with serving(repo) as gw:
        gate = gw.server.door.shedder
        gate.stop()
        calls = [
            ("/v1/embeddings", {"model": "minilm", "input": "x", "temperature": 1}, 400),
            ("/v1/embeddings", {"model": "nope", "input": "x"}, 404),
            ("/v1/embeddings", b"{not json", 400),
            ("/embed", {"inputs": []}, 400),  # TEI's "empty"
            ("/embed", {"inputs": "x", "truncation_direction": "Middle"}, 422),  # TEI's validation
            ("/rerank", {"query": "q", "texts": []}, 400),
            ("/v1/rerank", {"query": "q", "documents": "not a list"}, 400),
            ("/v2/models/encoder/infer", {"inputs": "not a list"}, 400),
        ]
        for path, body, status in calls:
            arrived, ended = gate.arrived, gate.ended
            kw = (
                {"data": body, "headers": {"Content-Type": "application/json"}}
                if isinstance(body, bytes)
                else {"json": body}
            )
            async with gw.http.post(path, **kw) as resp:
                assert resp.status == status, (path, body, resp.status, await resp.text())
            assert (gate.arrived - arrived, gate.ended - ended) == (1, 1), (path, body)
        arrived, ended = gate.arrived, gate.ended
        async with gw.http.post("/v1/embeddings", json={"model": "minilm", "input": ["a b", "c"]}) as resp:
            assert resp.status == 200, await resp.text()
        assert (gate.arrived - arrived, gate.ended - ended, gate.dropped) == (1, 1, 0)
