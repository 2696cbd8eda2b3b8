"""A REST caller that hangs up stops costing compute: its handler is cancelled, its queued rows
leave the queue before they run, and the server counts the call as cancelled."""

from __future__ import annotations

import json
import socket
import time

import grpc
import numpy as np

from batchgate.bench.goodput import encoder_request
from batchgate.bench.loadgen import metric_samples
from batchgate.proto.inference.v2 import grpc_service_pb2 as pb
from batchgate.proto.inference.v2 import grpc_service_pb2_grpc as pb_grpc
from tests.conftest import start_server


def _cancelled(http_port: int) -> float:
    return sum(
        s.value for s in metric_samples(http_port)
        if s.name == "batchgate_requests_total" and s.labels.get("transport") == "http"
        and s.labels.get("outcome") == "cancelled"
    )  # fmt: skip


def test_a_rest_caller_that_hangs_up_leaves_no_computed_rows(tmp_path):
    srv = start_server(tmp_path, "--workers-per-device", "1")
    try:
        with grpc.insecure_channel(srv.grpc_url) as ch:
            stub = pb_grpc.GRPCInferenceServiceStub(ch)
            heavy = encoder_request(np.random.default_rng(1), 16, 256, {"latency_class": "bulk"})
            t0 = time.perf_counter()
            for _ in range(3):
                stub.ModelInfer(heavy)
            one_batch_s = (time.perf_counter() - t0) / 3
            before = stub.ModelStatistics(pb.ModelStatisticsRequest(name="encoder")).model_stats[0]
            backlog = [stub.ModelInfer.future(heavy) for _ in range(8)]
            time.sleep(one_batch_s * 1.5)
            ids = [[1] * 16] * 7  # 7 rows: none of the backlog's calls has that many
            body = json.dumps({
                "inputs": [
                    {"name": "input_ids", "shape": [7, 16], "datatype": "INT64", "data": ids},
                    {"name": "attention_mask", "shape": [7, 16], "datatype": "INT64", "data": ids},
                ],
                "parameters": {"latency_class": "bulk"},
            }).encode()  # fmt: skip
            s = socket.create_connection(("127.0.0.1", srv.http_port), timeout=10)
            s.sendall(
                b"POST /v2/models/encoder/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            time.sleep(min(one_batch_s, 0.3))  # queued behind the backlog (bulk: after it)
            s.close()  # the caller hangs up
            for f in backlog:
                f.result(timeout=120)
            time.sleep(one_batch_s * 2)  # anything still queued would have run by now
            after = stub.ModelStatistics(pb.ModelStatisticsRequest(name="encoder")).model_stats[0]
        cancelled = _cancelled(srv.http_port)
    finally:
        srv.stop()
    assert after.inference_count - before.inference_count == 8 * 16  # the 7 rows never ran
    assert cancelled == 1
