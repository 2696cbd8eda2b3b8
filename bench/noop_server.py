"""A no-op KServe v2 server: answers ModelInfer with a fixed-size response and does nothing else.

It is the yardstick for batchgate's per-call cost: same protocol, same grpc.aio event loop, zero
gateway work. ``python -m batchgate.bench.noop_server PORT``.
"""

from __future__ import annotations

import asyncio
import sys

import grpc
import numpy as np

from batchgate.proto.inference.v2 import grpc_service_pb2 as pb
from batchgate.proto.inference.v2 import grpc_service_pb2_grpc as pb_grpc


class Noop(pb_grpc.GRPCInferenceServiceServicer):
    async def ModelInfer(self, request, context):
        rows = request.inputs[0].shape[0] if request.inputs else 1
        resp = pb.ModelInferResponse(model_name=request.model_name, model_version="1", id=request.id)
        resp.outputs.add(name="score", datatype="FP32", shape=[rows, 1])
        resp.raw_output_contents.append(np.zeros((rows, 1), np.float32).tobytes())
        return resp

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=True)


async def main(port: int) -> None:
    server = grpc.aio.server()
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(Noop(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1])))
