"""The metadata answers are plain types (gateway/metadata.py) each transport writes in its own wire
form: gateway/infer.py imports no protobuf, and KServe REST's JSON is the gRPC message as Triton's
JSON, field for field (64-bit ints as numbers, statistics with their zeros), as it was when REST
turned the pipeline's protobuf messages into JSON."""

from __future__ import annotations

import ast
import json
import urllib.request

import numpy as np

from batchgate.gateway.transport.kserve_rest import _to_json
from batchgate.proto.inference.v2 import grpc_service_pb2 as pb
from tests.conftest import ROOT


def _rest(server, path: str, body: dict | None = None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{server.http_port}{path}", data=data)
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def test_the_pipeline_imports_no_protobuf():
    tree = ast.parse((ROOT / "gateway" / "infer.py").read_text())
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    imported += [
        f"{n.module}.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names
    ]
    wire = [m for m in imported if "_pb2" in m or "protobuf" in m or m.startswith("batchgate.proto")]
    assert wire == [], wire


def test_rest_metadata_is_the_grpc_message_as_json(server, stub, triton):
    import tritonclient.grpc as tc

    # one batch on the ranker so its statistics hold a batch size and non-zero times
    x = tc.InferInput("dense", [2, 64], "FP32")
    x.set_data_from_numpy(np.zeros((2, 64), np.float32))
    ids = tc.InferInput("sparse_ids", [2, 8], "INT64")
    ids.set_data_from_numpy(np.ones((2, 8), np.int64))
    triton.infer("ranker", [x, ids])

    assert _rest(server, "/v2") == _to_json(stub.ServerMetadata(pb.ServerMetadataRequest()))
    meta = _rest(server, "/v2/models/ranker")
    assert meta.pop("batchgate")["variant"] == "fp32"  # batchgate's extension, REST only
    assert meta == _to_json(stub.ModelMetadata(pb.ModelMetadataRequest(name="ranker")))
    grpc_stats = stub.ModelStatistics(pb.ModelStatisticsRequest(name=""))
    rest_stats = _rest(server, "/v2/models/stats")
    assert rest_stats == _to_json(grpc_stats, defaults=True)
    ranker = next(s for s in rest_stats["model_stats"] if s["name"] == "ranker")
    assert ranker["batch_stats"] and ranker["inference_stats"]["compute_infer"]["ns"] > 0
    assert ranker["inference_stats"]["cache_hit"] == {"count": 0, "ns": 0}  # no result cache: zeros
    index = stub.RepositoryIndex(pb.RepositoryIndexRequest(ready=False))
    assert _rest(server, "/v2/repository/index", {}) == [_to_json(m) for m in index.models]
