"""A REST caller that hangs up stops costing compute: its handler is cancelled, its queued rows
leave the queue before they run, and the server counts the call as cancelled. Through the real
REST listener and pipeline in-process (tests/harness.py), over a fake pool held busy meanwhile."""

from __future__ import annotations

import asyncio
import json

import numpy as np

from tests.helpers import encoder_request
from tests.harness import model_repo, serving


async def test_a_rest_caller_that_hangs_up_leaves_no_computed_rows(tmp_path):
    async with serving(model_repo(tmp_path), workers_per_device=1) as gw:
        pool = gw.pool("encoder")
        heavy = encoder_request(np.random.default_rng(1), 16, 256, {"latency_class": "bulk"})
        await gw.stub.ModelInfer(heavy, timeout=10)
        before = await gw.statistics("encoder")
        pool.hold()  # the engine is stuck on the first batch of the backlog: the rest stays queued
        backlog = [asyncio.ensure_future(gw.stub.ModelInfer(heavy, timeout=60)) for _ in range(8)]
        inflight = "batchgate_scheduler_inflight_requests"
        await gw.wait_metric(inflight, 8, model="encoder")  # all taken; one batch stuck on the worker
        ids = [[1] * 16] * 7  # 7 rows: none of the backlog's calls has that many
        body = json.dumps({
            "inputs": [
                {"name": "input_ids", "shape": [7, 16], "datatype": "INT64", "data": ids},
                {"name": "attention_mask", "shape": [7, 16], "datatype": "INT64", "data": ids},
            ],
            "parameters": {"latency_class": "bulk"},
        }).encode()  # fmt: skip
        _, writer = await asyncio.open_connection("127.0.0.1", gw.server.http_port)
        writer.write(
            b"POST /v2/models/encoder/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        await gw.wait_metric(inflight, 9, model="encoder")  # queued behind the backlog (bulk: after it)
        writer.close()  # the caller hangs up
        await writer.wait_closed()
        await gw.wait_metric("batchgate_requests_total", 1, transport="http", outcome="cancelled")
        pool.release()
        await asyncio.gather(*backlog)
        after = await gw.statistics("encoder")
        cancelled = await gw.metric("batchgate_requests_total", transport="http", outcome="cancelled")
        dropped = await gw.metric("batchgate_queue_dropped_total", model="encoder")
    assert after.inference_count - before.inference_count == 8 * 16  # the 7 rows never ran
    assert all(7 not in b.rows for b in pool.batches)
    assert cancelled == 1 and dropped == 1  # left the queue before compute
