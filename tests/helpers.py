"""Small helpers the tests share: free loopback ports, a server's /metrics samples, an `encoder` call.

They live here, not in bench/, so a test does not depend on a benchmark's module for a helper."""

from __future__ import annotations

import contextlib
import socket
import urllib.request

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from batchgate.proto.inference.v2 import grpc_service_pb2 as pb


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports free now (held together, so none is handed out twice)."""
    with contextlib.ExitStack() as held:
        socks = [held.enter_context(socket.create_server(("127.0.0.1", 0))) for _ in range(n)]
        return [s.getsockname()[1] for s in socks]


def metric_samples(http_port: int) -> list:
    """Every sample a server's /metrics shows now (prometheus_client's parser)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10).read().decode()
    return [sample for fam in text_string_to_metric_families(text) for sample in fam.samples]


def encoder_request(rng: np.random.Generator, rows: int, seq: int, params: dict) -> pb.ModelInferRequest:
    """One `encoder` call: ``rows`` x ``seq`` random token ids, a full mask, ``params`` set (a str as
    a string parameter, anything else as an int64 one)."""
    req = pb.ModelInferRequest(model_name="encoder")
    for name, values in (
        ("input_ids", rng.integers(0, 1000, (rows, seq), dtype=np.int64)),
        ("attention_mask", np.ones((rows, seq), np.int64)),
    ):
        req.inputs.add(name=name, datatype="INT64", shape=[rows, seq])
        req.raw_input_contents.append(values.tobytes())
    for key, value in params.items():
        if isinstance(value, str):
            req.parameters[key].string_param = value
        else:
            req.parameters[key].int64_param = value
    return req
