"""A no-op KServe v2 server: answers inference with a fixed-size response and does nothing else.

It is the yardstick for batchgate's per-call cost: same protocol, same grpc.aio event loop, zero
gateway work. ``ModelInfer`` answers one call; ``ModelStreamInfer`` answers each message of a
stream as it is read (in order, ``id`` echoed), the least a streaming server can do.
``ModelMetadata``/``ModelConfig``/``ModelReady`` describe ``ranker`` (the bundled model's inputs and
outputs) so that clients that ask first, such as Triton's ``perf_analyzer``, run against it too;
``ModelStatistics`` counts the requests answered (one integer added per request), so a bench can
divide the server's CPU time by them whichever client drove it.

``--suspend`` makes each request wait once for a future that another loop callback completes,
as any batching server's handler must wait for its batch: the floor of a handler that suspends
(one suspension and resumption of grpc.aio's coroutine chain, one extra callback per request).

    python -m batchgate.bench.noop_server PORT [--suspend]
"""

from __future__ import annotations

import asyncio
import sys

import grpc
import numpy as np
from batchgate.proto.inference.v2 import grpc_service_pb2 as pb
from batchgate.proto.inference.v2 import grpc_service_pb2_grpc as pb_grpc
from batchgate.proto.inference.v2 import model_config_pb2 as mc

# The bundled ranker's signature (model_repository/ranker/config.pbtxt), for the metadata calls.
_INPUTS = (("dense", "FP32", mc.TYPE_FP32, 64), ("sparse_ids", "INT64", mc.TYPE_INT64, 8))
_OUTPUT = ("score", "FP32", mc.TYPE_FP32, 1)
_MAX_BATCH = 256


def _answer(request: pb.ModelInferRequest) -> pb.ModelInferResponse:
    rows = request.inputs[0].shape[0] if request.inputs and request.inputs[0].shape else 1
    resp = pb.ModelInferResponse(model_name=request.model_name, model_version="1", id=request.id)
    resp.outputs.add(name="score", datatype="FP32", shape=[rows, 1])
    resp.raw_output_contents.append(np.zeros((rows, 1), np.float32).tobytes())
    return resp


async def _suspended() -> None:
    """Wait for a future another callback completes (what waiting for a batch costs at least)."""
    fut = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_soon(fut.set_result, None)
    await fut


class Noop(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, suspend: bool = False) -> None:
        self.answered = 0
        self.suspend = suspend

    async def ModelInfer(self, request, context):
        self.answered += 1
        if self.suspend:
            await _suspended()
        return _answer(request)

    async def ModelStreamInfer(self, request_iterator, context):
        async for request in request_iterator:
            self.answered += 1
            if self.suspend:
                await _suspended()
            yield pb.ModelStreamInferResponse(infer_response=_answer(request))

    async def ModelStatistics(self, request, context):
        resp = pb.ModelStatisticsResponse()
        st = resp.model_stats.add(name=request.name or "ranker", version="1")
        st.inference_stats.success.count = self.answered
        return resp

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=True)

    async def ModelReady(self, request, context):
        return pb.ModelReadyResponse(ready=True)

    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(name="noop", version="0")

    async def ModelMetadata(self, request, context):
        resp = pb.ModelMetadataResponse(
            name=request.name or "ranker", versions=["1"], platform="onnxruntime_onnx"
        )
        for name, dt, _, width in _INPUTS:
            resp.inputs.add(name=name, datatype=dt, shape=[-1, width])
        name, dt, _, width = _OUTPUT
        resp.outputs.add(name=name, datatype=dt, shape=[-1, width])
        return resp

    async def ModelConfig(self, request, context):
        cfg = mc.ModelConfig(
            name=request.name or "ranker", platform="onnxruntime_onnx", max_batch_size=_MAX_BATCH
        )
        for name, _, t, width in _INPUTS:
            cfg.input.add(name=name, data_type=t, dims=[width])
        name, _, t, width = _OUTPUT
        cfg.output.add(name=name, data_type=t, dims=[width])
        return pb.ModelConfigResponse(config=cfg)


async def main(port: int, suspend: bool = False) -> None:
    server = grpc.aio.server()
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(Noop(suspend), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), "--suspend" in sys.argv[2:]))
