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

``--batch`` is the least a dynamic-batching server can do on grpc.aio, with nothing of
batchgate's: each request's inputs are read with ``np.frombuffer`` (no checks), queued; when no
batch is running the queue is taken whole as one batch (up to 256 rows), run by ONNX Runtime on
the bundled ``ranker`` in one worker thread, and handed back to the loop with one
``call_soon_threadsafe`` per batch, which resolves each request's future; each answer is a slice
of the batch's output. A stream reads ahead as batchgate does (a task-free done-callback per
message puts its answer on a deque that a writer drains). No auth, limits, classes, cache,
metrics or timers: the floor that issue 15's "0.8 of the no-op" asks batchgate to reach beside
the no-op, measured in the same run (``lab.perf_analyzer --targets noop,noop-batch,batchgate``).

    python -m batchgate.bench.noop_server PORT [--suspend | --batch]
"""

from __future__ import annotations

import asyncio
import sys
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
from batchgate.proto.inference.v2 import grpc_service_pb2 as pb
from batchgate.proto.inference.v2 import grpc_service_pb2_grpc as pb_grpc
from batchgate.proto.inference.v2 import model_config_pb2 as mc

# The bundled ranker's signature (model_repository/ranker/config.pbtxt), for the metadata calls.
_INPUTS = (("dense", "FP32", mc.TYPE_FP32, 64), ("sparse_ids", "INT64", mc.TYPE_INT64, 8))
_OUTPUT = ("score", "FP32", mc.TYPE_FP32, 1)
_MAX_BATCH = 256


def _answer(request: pb.ModelInferRequest, score: np.ndarray | None = None) -> pb.ModelInferResponse:
    """The answer to ``request``: ``score`` (rows x 1), or zeros of the request's rows."""
    if score is None:
        rows = request.inputs[0].shape[0] if request.inputs and request.inputs[0].shape else 1
        score = np.zeros((rows, 1), np.float32)
    resp = pb.ModelInferResponse(model_name=request.model_name, model_version="1", id=request.id)
    resp.outputs.add(name="score", datatype="FP32", shape=score.shape)
    resp.raw_output_contents.append(score.tobytes())
    return resp


async def _suspended() -> None:
    """Wait for a future another callback completes (what waiting for a batch costs at least)."""
    fut = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_soon(fut.set_result, None)
    await fut


_RANKER = Path(__file__).resolve().parent.parent / "model_repository" / "ranker" / "1" / "model.onnx"


class Batcher:
    """The least dynamic batcher: the queue taken whole whenever no batch runs, one worker thread,
    one loop wake-up per batch (``--batch``)."""

    MAX_ROWS = _MAX_BATCH

    def __init__(self) -> None:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        self.session = ort.InferenceSession(str(_RANKER), opts, providers=["CPUExecutionProvider"])
        self.pool = ThreadPoolExecutor(1)
        self.queue: list = []  # (dense, ids, future) per request, oldest first
        self.running = False
        self.loop: asyncio.AbstractEventLoop | None = None

    def submit(self, request: pb.ModelInferRequest) -> asyncio.Future:
        loop = self.loop or asyncio.get_running_loop()
        self.loop = loop
        raw = request.raw_input_contents
        dense = np.frombuffer(raw[0], np.float32).reshape(-1, 64)
        ids = np.frombuffer(raw[1], np.int64).reshape(-1, 8)
        fut = loop.create_future()
        self.queue.append((dense, ids, fut))
        if not self.running:
            self._start()
        return fut

    def _start(self) -> None:
        batch, rows = [], 0
        while self.queue and rows + len(self.queue[0][0]) <= self.MAX_ROWS:
            item = self.queue.pop(0)
            batch.append(item)
            rows += len(item[0])
        self.running = True
        self.pool.submit(self._run, batch)

    def _run(self, batch: list) -> None:
        dense = np.concatenate([b[0] for b in batch])
        ids = np.concatenate([b[1] for b in batch])
        (score,) = self.session.run(None, {"dense": dense, "sparse_ids": ids})
        self.loop.call_soon_threadsafe(self._deliver, batch, score)

    def _deliver(self, batch: list, score: np.ndarray) -> None:
        at = 0
        for dense, _, fut in batch:
            n = len(dense)
            if not fut.done():
                fut.set_result(score[at : at + n])
            at += n
        self.running = False
        if self.queue:
            self._start()


class Noop(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, suspend: bool = False, batch: bool = False) -> None:
        self.answered = 0
        self.suspend = suspend
        self.batcher = Batcher() if batch else None

    async def ModelInfer(self, request, context):
        self.answered += 1
        if self.batcher is not None:
            return _answer(request, await self.batcher.submit(request))
        if self.suspend:
            await _suspended()
        return _answer(request)

    async def ModelStreamInfer(self, request_iterator, context):
        if self.batcher is not None:
            async for answer in self._batched_stream(request_iterator):
                yield answer
            return
        async for request in request_iterator:
            self.answered += 1
            if self.suspend:
                await _suspended()
            yield pb.ModelStreamInferResponse(infer_response=_answer(request))

    async def _batched_stream(self, request_iterator):
        """Read ahead: every message goes to the batcher as it is read; a done-callback puts its
        answer on a deque, drained here (as batchgate's stream does, without its window)."""
        loop = asyncio.get_running_loop()
        ready: deque = deque()
        wake: asyncio.Future | None = None  # the writer's, while it waits
        pending = 0  # read, not yet answered
        closed = False  # the client has sent its last message

        def wake_writer() -> None:
            if wake is not None and not wake.done():
                wake.set_result(None)

        def done(request, fut) -> None:
            nonlocal pending
            ready.append(pb.ModelStreamInferResponse(infer_response=_answer(request, fut.result())))
            pending -= 1
            wake_writer()

        async def reader() -> None:
            nonlocal pending, closed
            async for request in request_iterator:
                self.answered += 1
                pending += 1
                self.batcher.submit(request).add_done_callback(lambda f, r=request: done(r, f))
            closed = True
            wake_writer()

        task = loop.create_task(reader())
        try:
            while True:
                while ready:
                    yield ready.popleft()
                if closed and not pending:
                    break
                wake = loop.create_future()
                await wake
                wake = None
        finally:
            task.cancel()

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


async def main(port: int, suspend: bool = False, batch: bool = False) -> None:
    server = grpc.aio.server()
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(Noop(suspend, batch), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), "--suspend" in sys.argv[2:], "--batch" in sys.argv[2:]))
