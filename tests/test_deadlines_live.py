"""Deadlines against a live server: a request whose budget cannot be met behind the queued work is
refused at once with DEADLINE_EXCEEDED, and the server's compute counters show it never ran."""

from __future__ import annotations

import shutil
import threading
import time
import urllib.request

import grpc
import numpy as np

from batchgate.proto.inference.v2 import grpc_service_pb2 as pb
from batchgate.proto.inference.v2 import grpc_service_pb2_grpc as pb_grpc
from batchgate.bench.goodput import encoder_request
from tests.conftest import REPO, start_server


def _encoder(rows: int, seq: int, **params) -> pb.ModelInferRequest:
    return encoder_request(np.random.default_rng(rows * 1000 + seq), rows, seq, params)


def _stats(stub) -> pb.ModelStatistics:
    return stub.ModelStatistics(pb.ModelStatisticsRequest(name="encoder")).model_stats[0]


def test_hopeless_budget_is_refused_at_once_and_never_computed(tmp_path):
    srv = start_server(tmp_path, "--workers-per-device", "1")
    try:
        with grpc.insecure_channel(srv.grpc_url) as ch:
            stub = pb_grpc.GRPCInferenceServiceStub(ch)
            # Warm the latency model so the server knows what a heavy batch costs.
            heavy = _encoder(16, 256, latency_class="bulk")
            t0 = time.perf_counter()
            for _ in range(4):
                stub.ModelInfer(heavy)
            one_batch_s = (time.perf_counter() - t0) / 4
            before = _stats(stub)

            # Queue a backlog of heavy bulk work from several callers.
            answered_rows = []
            lock = threading.Lock()

            def flood() -> None:
                for _ in range(3):
                    stub.ModelInfer(heavy)
                    with lock:
                        answered_rows.append(16)

            threads = [threading.Thread(target=flood) for _ in range(6)]
            for t in threads:
                t.start()
            time.sleep(one_batch_s * 1.5)  # the backlog is queued now

            probe = _encoder(7, 16, latency_class="bulk", latency_budget_ms=1)
            t0 = time.perf_counter()
            try:
                stub.ModelInfer(probe)
                raise AssertionError("a 1 ms budget behind seconds of queued work must be refused")
            except grpc.RpcError as err:
                elapsed = time.perf_counter() - t0
                assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.details()
                # Shed at admission; or, when the backlog happens to be all in the running batch
                # (nothing queued ahead) and the scheduler lets its one probe a second through,
                # dropped from the queue before compute. Never computed either way (below).
                details = err.details()
                assert "cannot be met" in details or "dropped from the queue before compute" in details
                if "cannot be met" in details:
                    # The refusal says when to come back: the queue's drain time, as gRPC's retry
                    # policy reads it and as retry-after-ms (REST turns that into Retry-After).
                    trailers = dict(err.trailing_metadata())
                    assert int(trailers["grpc-retry-pushback-ms"]) >= 1
                    assert trailers["retry-after-ms"] == trailers["grpc-retry-pushback-ms"]
            for t in threads:
                t.join(120)
            after = _stats(stub)
    finally:
        srv.stop()
    backlog_s = 18 * one_batch_s / 2  # what the queue held when the probe arrived, roughly
    assert elapsed < backlog_s / 4, f"refused after {elapsed:.3f}s; backlog was ~{backlog_s:.2f}s"
    # Rows computed = exactly the flood's rows: the probe's 7 rows never ran.
    assert after.inference_count - before.inference_count == sum(answered_rows) == 18 * 16
    assert after.inference_stats.fail.count - before.inference_stats.fail.count == 1


def test_grpc_deadline_is_the_budget(tmp_path):
    """A caller's gRPC deadline is honoured as its budget: behind a backlog it cannot wait out, the
    server sheds the call itself (its words, its fail count) and never computes its rows."""
    srv = start_server(tmp_path, "--workers-per-device", "1")
    try:
        with grpc.insecure_channel(srv.grpc_url) as ch:
            stub = pb_grpc.GRPCInferenceServiceStub(ch)
            heavy = _encoder(16, 256, latency_class="bulk")
            t0 = time.perf_counter()
            for _ in range(3):
                stub.ModelInfer(heavy)
            one_batch_s = (time.perf_counter() - t0) / 3
            before = _stats(stub)
            futures = [stub.ModelInfer.future(heavy) for _ in range(8)]
            time.sleep(one_batch_s * 1.5)  # the backlog is queued now
            deadline_s = max(one_batch_s / 4, 0.02)  # less than the running batch, more than a hop
            try:
                stub.ModelInfer(_encoder(7, 16), timeout=deadline_s)
                raise AssertionError("expected DEADLINE_EXCEEDED")
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                details = err.details()
            for f in futures:
                f.result(timeout=120)
            after = _stats(stub)
    finally:
        srv.stop()
    # the server's refusal, not the client's own timer ("Deadline Exceeded")
    assert "cannot be met" in details or "dropped from the queue before compute" in details, details
    assert after.inference_stats.fail.count - before.inference_stats.fail.count == 1
    assert after.inference_count - before.inference_count == 8 * 16  # the probe's 7 rows never ran


def test_a_model_can_keep_triton_fifo_while_the_server_schedules_by_deadline(tmp_path):
    repo = tmp_path / "repo"
    for name, policy in (("fifo-ranker", "fifo"), ("ranker", None), ("bad-ranker", "lifo")):
        shutil.copytree(REPO / "ranker", repo / name)
        cfg = repo / name / "config.pbtxt"
        text = cfg.read_text().replace('name: "ranker"', f'name: "{name}"')
        if policy:
            text += f'parameters {{ key: "scheduling_policy" value {{ string_value: "{policy}" }} }}\n'
        cfg.write_text(text)
    srv = start_server(tmp_path, "--workers-per-device", "1", repo=repo)
    try:
        with grpc.insecure_channel(srv.grpc_url) as ch:
            stub = pb_grpc.GRPCInferenceServiceStub(ch)
            index = {m.name: m for m in stub.RepositoryIndex(pb.RepositoryIndexRequest()).models}
            assert index["fifo-ranker"].state == "READY" and index["ranker"].state == "READY"
            assert index["bad-ranker"].state != "READY"
            assert "scheduling_policy" in index["bad-ranker"].reason and "lifo" in index["bad-ranker"].reason
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.http_port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        # the FIFO queue reports one line, class "fifo"; the deadline queue one per latency class
        assert 'batchgate_queue_depth{class="fifo",model="fifo-ranker",version="1"}' in text
        assert 'batchgate_queue_depth{class="realtime",model="ranker",version="1"}' in text
        assert (
            'model="fifo-ranker",version="1"}' in text and 'class="realtime",model="fifo-ranker"' not in text
        )
    finally:
        srv.stop()
