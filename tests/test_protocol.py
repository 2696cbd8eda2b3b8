"""The KServe v2 / Triton surface through stock clients: metadata, config, index, statistics,
health (server and per model) and reflection."""

from __future__ import annotations

import grpc
import numpy as np
import tritonclient.grpc as tc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from batchgate.proto.inference.v2 import grpc_service_pb2 as pb


def test_live_ready_and_server_metadata(triton):
    assert triton.is_server_live()
    assert triton.is_server_ready()
    meta = triton.get_server_metadata()
    assert meta.name == "batchgate"
    assert "statistics" in meta.extensions


def test_model_ready_and_metadata(triton):
    assert triton.is_model_ready("ranker")
    assert triton.is_model_ready("ranker", "1")
    assert not triton.is_model_ready("ranker", "2")
    assert not triton.is_model_ready("nope")
    meta = triton.get_model_metadata("ranker")
    assert meta.versions == ["1"]
    assert meta.platform == "onnxruntime_onnx"
    assert [(i.name, i.datatype, list(i.shape)) for i in meta.inputs] == [
        ("dense", "FP32", [-1, 64]),
        ("sparse_ids", "INT64", [-1, 8]),
    ]
    assert [(o.name, o.datatype, list(o.shape)) for o in meta.outputs] == [("score", "FP32", [-1, 1])]


def test_model_config_round_trips_the_pbtxt(triton):
    cfg = triton.get_model_config("encoder").config
    assert cfg.name == "encoder"
    assert cfg.max_batch_size == 64
    assert [i.name for i in cfg.input] == ["input_ids", "attention_mask"]
    assert list(cfg.input[0].dims) == [-1]
    assert list(cfg.dynamic_batching.preferred_batch_size) == [16, 32]
    assert cfg.dynamic_batching.default_queue_policy.max_queue_size == 2048
    assert cfg.instance_group[0].count == 2


def test_repository_index_lists_models_ready(triton):
    index = triton.get_model_repository_index()
    states = {(m.name, m.version): m.state for m in index.models}
    assert states[("ranker", "1")] == "READY"
    assert states[("encoder", "1")] == "READY"


def test_statistics_count_rows_and_executions(triton):
    before = triton.get_inference_statistics("ranker", "1").model_stats[0]
    x = tc.InferInput("dense", [5, 64], "FP32")
    x.set_data_from_numpy(np.ones((5, 64), np.float32))
    ids = tc.InferInput("sparse_ids", [5, 8], "INT64")
    ids.set_data_from_numpy(np.zeros((5, 8), np.int64))
    triton.infer("ranker", [x, ids])
    after = triton.get_inference_statistics("ranker", "1").model_stats[0]
    assert after.inference_count - before.inference_count == 5
    assert after.execution_count - before.execution_count == 1
    assert after.inference_stats.success.count - before.inference_stats.success.count == 1
    assert after.inference_stats.compute_infer.ns > before.inference_stats.compute_infer.ns
    assert after.last_inference > 0
    all_stats = triton.get_inference_statistics()
    assert {s.name for s in all_stats.model_stats} >= {"ranker", "encoder"}


def test_outputs_as_typed_contents_when_binary_data_is_false(stub):
    rows = 2
    req = pb.ModelInferRequest(model_name="ranker", id="typed-out")
    req.inputs.add(name="dense", datatype="FP32", shape=[rows, 64]).contents.fp32_contents.extend(
        [0.5] * rows * 64
    )
    req.inputs.add(name="sparse_ids", datatype="INT64", shape=[rows, 8]).contents.int64_contents.extend(
        [1] * rows * 8
    )
    out = req.outputs.add(name="score")
    out.parameters["binary_data"].bool_param = False
    resp = stub.ModelInfer(req)
    assert resp.id == "typed-out"
    assert not resp.raw_output_contents
    assert len(resp.outputs[0].contents.fp32_contents) == rows
    # Same request, raw outputs (the default): same numbers.
    del req.outputs[:]
    raw = stub.ModelInfer(req)
    np.testing.assert_array_equal(
        np.frombuffer(raw.raw_output_contents[0], np.float32),
        np.array(resp.outputs[0].contents.fp32_contents, np.float32),
    )


def test_grpc_health_server_and_per_model(server):
    with grpc.insecure_channel(server.grpc_url) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        serving = health_pb2.HealthCheckResponse.SERVING
        assert health.Check(health_pb2.HealthCheckRequest(service="")).status == serving
        assert (
            health.Check(health_pb2.HealthCheckRequest(service="inference.GRPCInferenceService")).status
            == serving
        )
        assert health.Check(health_pb2.HealthCheckRequest(service="ranker")).status == serving
        try:
            health.Check(health_pb2.HealthCheckRequest(service="no-such-model"))
            raise AssertionError("unknown service should be NOT_FOUND")
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_and_describes_the_inference_service(server):
    with grpc.insecure_channel(server.grpc_url) as ch:
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        reqs = [
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol="inference.GRPCInferenceService"),
        ]
        listed, described = list(refl.ServerReflectionInfo(iter(reqs)))
        names = {s.name for s in listed.list_services_response.service}
        assert {"inference.GRPCInferenceService", "grpc.health.v1.Health"} <= names
        assert described.file_descriptor_response.file_descriptor_proto


def test_unimplemented_extensions_say_so(stub):
    try:
        stub.SystemSharedMemoryStatus(pb.SystemSharedMemoryStatusRequest())
        raise AssertionError("expected UNIMPLEMENTED")
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.UNIMPLEMENTED


def test_http_health(server):
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/v2/health/ready", timeout=5) as r:
        assert r.status == 200
    with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/v2/health/live", timeout=5) as r:
        assert r.status == 200
