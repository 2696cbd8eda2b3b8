"""A fully used server is not an overloaded one, against a live server and real gRPC clients.

- Closed loops (each caller sends its next call when the last is answered) cannot overload a
  server: at capacity, with budgets the server meets, nothing is refused, neither by the overload
  gate at the door nor by the admission estimate. (Before: 4 callers of 32 mixed-length texts
  each were refused hundreds of times in 10 s, first by the estimate, which charged every part
  of a call a batch of its own, then by the gate, which counted the immediate retries as waste.)
- A sudden spike, calls waiting in gRPC core until their deadlines pass, is still shed at the
  door, and the server takes every call again once it ends.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import struct
import threading
import time

import grpc
import pytest
import numpy as np

from batchgate.proto.inference.v2 import grpc_service_pb2 as pb
from batchgate.proto.inference.v2 import grpc_service_pb2_grpc as pb_grpc
from tests.conftest import ROOT, start_server
from tests.helpers import encoder_request, metric_samples

pytestmark = pytest.mark.serial  # capacity and a spike, timed: alone (tests/parallel.py)

TEXTS = [t for t in (ROOT / "bench" / "texts" / "mixed.txt").read_text().splitlines() if t.strip()]


def _metric(http_port: int, name: str, **labels) -> float:
    return sum(
        s.value
        for s in metric_samples(http_port)
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def _texts_call(model: str, texts: list[str], budget_ms: float) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name=model)
    req.inputs.add(name="text", datatype="BYTES", shape=[len(texts), 1])
    req.raw_input_contents.append(
        b"".join(struct.pack("<I", len(b)) + b for b in (t.encode() for t in texts))
    )
    req.parameters["latency_budget_ms"].int64_param = int(budget_ms)
    return req


def _minilm_repo(minilm_dir, dst):
    """minilm as built, and a twin that does not shed at admission (it measures what the loop needs)."""
    noshed = 'parameters { key: "shed_at_admission" value { string_value: "false" } }\n'
    for name, extra in (("minilm", ""), ("minilm_noshed", noshed)):
        d = dst / name
        (d / "1").mkdir(parents=True)
        (d / "1" / "model.onnx").symlink_to((minilm_dir / "1" / "model.onnx").resolve())
        (d / "tokenizer.json").symlink_to((minilm_dir / "tokenizer.json").resolve())
        cfg = (minilm_dir / "config.pbtxt").read_text().replace('name: "minilm"', f'name: "{name}"')
        (d / "config.pbtxt").write_text(cfg + extra)
    return dst


def _closed_loop(url: str, model: str, calls, callers: int, seconds: float, budget_ms: float):
    """``callers`` closed loops for ``seconds``: (latencies of answered calls, other outcomes).
    A call's gRPC deadline is its budget, as a caller with that budget sets it (the server takes
    the deadline as the budget)."""
    refused: dict[str, int] = {}
    latencies: list[float] = []
    lock = threading.Lock()
    stop = time.perf_counter() + seconds

    def caller(k: int) -> None:
        with grpc.insecure_channel(url) as ch:
            stub = pb_grpc.GRPCInferenceServiceStub(ch)
            j = k * 5
            while time.perf_counter() < stop:
                t0 = time.perf_counter()
                try:
                    stub.ModelInfer(
                        _texts_call(model, calls[j % len(calls)], budget_ms), timeout=budget_ms / 1e3
                    )
                    with lock:
                        latencies.append(time.perf_counter() - t0)
                except grpc.RpcError as exc:
                    why = f"{exc.code().name}: {exc.details()[:120]}"
                    with lock:
                        refused[why] = refused.get(why, 0) + 1
                j += 1

    threads = [threading.Thread(target=caller, args=(k,)) for k in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return latencies, refused


def _measured_budget(srv, calls, callers: int) -> tuple[float, str]:
    """What the loop needs, on the twin that never sheds: 1.25x the slowest call seen; and a
    second loop at that budget whose shadow check must find no call the estimate would have
    refused that made its deadline."""
    need, refused = _closed_loop(srv.grpc_url, "minilm_noshed", calls, callers, 5.0, 60_000)
    assert not refused and len(need) >= 2 * callers
    budget_ms = 1.25 * max(need) * 1e3
    where = f"budget {budget_ms:.0f} ms, the loop needed {statistics.median(need) * 1e3:.0f} ms (p50)"
    before = _metric(srv.http_port, "batchgate_shed_shadow_total", verdict="would_have_made_it")
    _closed_loop(srv.grpc_url, "minilm_noshed", calls, callers, 5.0, budget_ms)
    false = _metric(srv.http_port, "batchgate_shed_shadow_total", verdict="would_have_made_it") - before
    assert false == 0, f"the estimate would have refused {false:.0f} calls that made it ({where})"
    return budget_ms, where


def test_a_closed_loop_at_capacity_is_refused_nothing(tmp_path, minilm_dir):
    """4 callers x 32 mixed-length texts (bench/texts/mixed.txt, long ones included), the server
    on one core. What the loop needs is measured first on the twin that never sheds; then, with
    budgets 1.25x the slowest call seen, the twin's shadow check finds no call the estimate would
    have refused that made its deadline, and minilm itself refuses nothing (a try that refuses is
    measured and run again once: this VM's speed drifts between the measurement and the loop)."""
    repo = _minilm_repo(minilm_dir, tmp_path / "repo")
    # the server on one core, the callers on the other (as bench.text_batches runs it)
    srv = start_server(tmp_path, "--no-build-models", repo=repo, ready_timeout=120, cpus="0")
    try:
        n = len(TEXTS)
        calls = [[TEXTS[(s * 7 + i) % n] for i in range(32)] for s in range(n)]
        with grpc.insecure_channel(srv.grpc_url) as ch:
            stub = pb_grpc.GRPCInferenceServiceStub(ch)
            for model in ("minilm_noshed", "minilm"):  # every length bucket, and the latency models
                for k in range(4):
                    stub.ModelInfer(_texts_call(model, calls[k], 60_000), timeout=60)
        callers = 4
        for _ in range(2):
            gate0 = _metric(srv.http_port, "batchgate_overload_refused_total")
            budget_ms, where = _measured_budget(srv, calls, callers)
            shed0 = _metric(srv.http_port, "batchgate_class_requests_total", model="minilm", outcome="shed")
            latencies, refused = _closed_loop(srv.grpc_url, "minilm", calls, callers, 6.0, budget_ms)
            # This VM's speed drifts by a third over minutes: a try in which it slowed after the
            # need was measured meets budgets that are no longer 1.25x the need (seen on a fresh
            # clone: one call dropped from the queue 3.7 ms short of its estimate). So a try that refused is
            # measured and run again, once; a real bias in the estimate or the gate refuses in both.
            if not refused:
                break
        assert not refused, f"refused at capacity ({where}): {refused}"
        assert len(latencies) >= 2 * callers
        assert _metric(srv.http_port, "batchgate_overload_refused_total") == gate0
        assert (
            _metric(srv.http_port, "batchgate_class_requests_total", model="minilm", outcome="shed") == shed0
        )
    finally:
        srv.stop()


def test_a_sudden_spike_is_still_shed_at_the_door_and_the_server_recovers(tmp_path):
    """6,000 one-row encoder calls in 3 s, 250 ms deadlines, on a server that was idle: they
    wait in gRPC core, most reach Python with their deadlines nearly spent, and the gate refuses a
    share of new calls at the door (UNAVAILABLE, 'server overloaded'); once the spike is over it
    takes every call again and an ordinary call is answered. The server runs on one core and the
    callers on the other: unpinned, a fast two-core host answered all 6,000 in time (nothing to
    shed, and the test failed for it)."""
    two = len(os.sched_getaffinity(0)) >= 2
    srv = start_server(tmp_path, "--workers-per-device", "1", cpus="0" if two else None)
    mine = os.sched_getaffinity(0)
    if two:
        os.sched_setaffinity(0, mine - {0})
    try:
        rng = np.random.default_rng(7)
        req = encoder_request(rng, 1, 64, {"latency_class": "standard"})

        async def spike() -> dict[str, int]:
            out: dict[str, int] = {}
            channels = [grpc.aio.insecure_channel(srv.grpc_url) for _ in range(4)]
            stubs = [pb_grpc.GRPCInferenceServiceStub(c) for c in channels]
            for s in stubs:  # warm: the latency model and the connections
                for _ in range(20):
                    await s.ModelInfer(req, timeout=5)

            async def one(k: int) -> None:
                try:
                    await stubs[k % 4].ModelInfer(req, timeout=0.250)
                    why = "OK"
                except grpc.aio.AioRpcError as exc:
                    why = "gate" if "server overloaded" in (exc.details() or "") else exc.code().name
                out[why] = out.get(why, 0) + 1

            # ~2,000 calls a second for 3 s (a one-core server answers ~500): launched in steps of
            # 10 every 5 ms, not all at once, so they reach the server rather than expiring in
            # the client
            tasks = []
            t0 = time.perf_counter()
            for step in range(600):
                tasks += [asyncio.ensure_future(one(step * 10 + i)) for i in range(10)]
                await asyncio.sleep(max(0.0, t0 + (step + 1) * 0.005 - time.perf_counter()))
            await asyncio.gather(*tasks)
            for c in channels:
                await c.close()
            return out

        outcomes = asyncio.run(spike())
        refused_at_door = _metric(srv.http_port, "batchgate_overload_refused_total")
        print(f"spike of 6,000 calls in 3 s: {outcomes}; refused at the door {refused_at_door:.0f}")
        assert outcomes.get("gate", 0) > 0 and refused_at_door > 0, outcomes
        assert outcomes.get("OK", 0) > 0, outcomes  # it kept answering what it could
        deadline = time.monotonic() + 15
        while _metric(srv.http_port, "batchgate_overload_admitted_ratio") < 1.0:
            assert time.monotonic() < deadline, "the gate did not take every call again after the spike"
            time.sleep(0.2)
        with grpc.insecure_channel(srv.grpc_url) as ch:
            resp = pb_grpc.GRPCInferenceServiceStub(ch).ModelInfer(req, timeout=10)
        assert resp.outputs
    finally:
        os.sched_setaffinity(0, mine)
        srv.stop()
