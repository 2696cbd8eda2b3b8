"""Traces from a live server to a real OTLP/HTTP receiver in this process: callers' W3C
``traceparent`` (gRPC metadata, an HTTP header) parents each call's span; a batch that served
several callers is one span linked to each of their calls, with its compute span under it."""

from __future__ import annotations

import http.server
import json
import os
import threading
import time
import urllib.request

import grpc
import numpy as np
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from batchgate.proto.inference.v2 import grpc_service_pb2_grpc as pb_grpc
from tests.conftest import REPO, start_server
from tests.helpers import encoder_request, free_ports


class Receiver:
    """An OTLP/HTTP trace receiver: POST /v1/traces, protobuf bodies, spans kept in order."""

    def __init__(self) -> None:
        self.spans: list = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                req = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
                for rs in req.resource_spans:
                    for ss in rs.scope_spans:
                        outer.spans.extend(ss.spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()
                self.wfile.write(trace_service_pb2.ExportTraceServiceResponse().SerializeToString())

            def log_message(self, *args):
                pass

        (self.port,) = free_ports(1)
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()


def _traceparent(i: int) -> tuple[str, str]:
    trace_id, span_id = f"{i + 1:032x}", f"{i + 1:016x}"
    return f"00-{trace_id}-{span_id}-01", trace_id


def test_a_batched_call_gives_the_span_tree(tmp_path):
    receiver = Receiver()
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "encoder").symlink_to(REPO / "encoder", target_is_directory=True)
    env = {"BATCHGATE_OTEL_ENDPOINT": f"http://127.0.0.1:{receiver.port}", "OTEL_BSP_SCHEDULE_DELAY": "100"}
    srv = start_server(tmp_path, "--no-build-models", "--workers-per-device", "1", repo=repo, env=env)
    try:
        with grpc.insecure_channel(srv.grpc_url) as ch:
            stub = pb_grpc.GRPCInferenceServiceStub(ch)
            rng = np.random.default_rng(0)
            heavy = encoder_request(rng, 16, 256, {"latency_class": "bulk"})
            stub.ModelInfer(heavy)  # warm
            # Four in flight hold the worker long enough, even on a busy machine, for the small calls
            # to queue and batch behind them (one ran out before they arrived on a loaded CI host).
            running = [stub.ModelInfer.future(heavy) for _ in range(4)]
            time.sleep(0.02)
            small = encoder_request(rng, 1, 16, {})
            parents = [_traceparent(i) for i in range(6)]
            calls = [stub.ModelInfer.future(small, metadata=(("traceparent", tp),)) for tp, _ in parents]
            for c in calls:
                c.result(timeout=60)
            for r in running:
                r.result(timeout=60)
        # and a REST call with the header
        tp, rest_trace = _traceparent(100)
        ids = [[1] * 16]
        body = json.dumps({"inputs": [
            {"name": "input_ids", "shape": [1, 16], "datatype": "INT64", "data": ids},
            {"name": "attention_mask", "shape": [1, 16], "datatype": "INT64", "data": ids},
        ]}).encode()  # fmt: skip
        req = urllib.request.Request(
            f"http://127.0.0.1:{srv.http_port}/v2/models/encoder/infer", data=body, method="POST",
            headers={"traceparent": tp, "Content-Type": "application/json"},
        )  # fmt: skip
        assert urllib.request.urlopen(req, timeout=30).status == 200
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and sum(s.name == "batchgate.infer" for s in receiver.spans) < 9:
            time.sleep(0.1)
    finally:
        srv.stop()
        receiver.close()
    spans = list(receiver.spans)
    by_trace: dict[str, list] = {}
    for s in spans:
        by_trace.setdefault(s.trace_id.hex(), []).append(s)
    call_ids = {}
    for tp, trace_id in [*parents, (tp, rest_trace)]:
        mine = by_trace.get(trace_id, [])
        (call,) = [s for s in mine if s.name == "batchgate.infer"]
        assert call.parent_span_id.hex() == tp.split("-")[2]  # the caller's span is the parent
        names = sorted(s.name for s in mine if s.parent_span_id == call.span_id)
        assert "response" in names and "queue" in names, names
        call_ids[call.span_id] = trace_id
    transports = {
        a.value.string_value for s in spans if s.name == "batchgate.infer" for a in s.attributes
        if a.key == "batchgate.transport"
    }  # fmt: skip
    assert {"grpc", "http"} <= transports
    batches = [s for s in spans if s.name == "batch"]
    served = [{link.span_id for link in b.links} & set(call_ids) for b in batches]
    assert max(len(s) for s in served) >= 2, served  # one batch served several callers' calls
    assert set().union(*served) == set(call_ids)  # every call is linked from the batch that served it
    big = batches[max(range(len(batches)), key=lambda i: len(served[i]))]
    attrs = {a.key: a.value for a in big.attributes}
    assert attrs["batchgate.batch.requests"].int_value == len(big.links)
    assert attrs["batchgate.batch.rows"].int_value >= 2 and attrs["batchgate.batch.bucket"].string_value
    (compute,) = [s for s in spans if s.name == "compute" and s.parent_span_id == big.span_id]
    assert big.start_time_unix_nano <= compute.start_time_unix_nano <= compute.end_time_unix_nano
    print(f"{len(spans)} spans; the largest batch served {len(served[batches.index(big)])} traced calls")


def test_tracing_is_off_by_default(server):
    assert "tracing on" not in server.log()
    assert os.environ.get("BATCHGATE_OTEL_ENDPOINT") is None
