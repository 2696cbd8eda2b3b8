"""The generated protocol modules are committed; this fails when they no longer match the .proto."""

import subprocess
import sys

from tests.conftest import ROOT


def test_generated_modules_are_fresh():
    result = subprocess.run(
        [sys.executable, "-m", "batchgate.proto.generate", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr


def test_wire_compatible_with_tritonclient_messages():
    """Same package, names and field numbers as Triton: bytes from one parse in the other."""
    from tritonclient.grpc import service_pb2

    from batchgate.proto.inference.v2 import grpc_service_pb2 as pb

    ours = pb.ModelInferRequest(model_name="m", model_version="2", id="x", raw_input_contents=[b"\x01\x02"])
    ours.inputs.add(name="a", datatype="FP32", shape=[1, 2]).contents.fp32_contents.extend([1.0, 2.0])
    ours.parameters["latency_budget_ms"].int64_param = 25
    theirs = service_pb2.ModelInferRequest.FromString(ours.SerializeToString())
    assert theirs.model_name == "m" and theirs.inputs[0].contents.fp32_contents == [1.0, 2.0]
    assert theirs.parameters["latency_budget_ms"].int64_param == 25
    assert pb.ModelInferRequest.FromString(theirs.SerializeToString()) == ours
    assert (
        pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name == "inference.GRPCInferenceService"
    )
