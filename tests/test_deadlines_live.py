"""Deadlines through the real pipeline (tests/harness.py: the server in-process over a fake pool
whose batches cost what the test says): a request whose budget cannot be met behind the queued
work is refused at once with DEADLINE_EXCEEDED, and the pool's own record shows it never ran."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import numpy as np

from batchgate.proto.inference.v2 import grpc_service_pb2 as pb
from tests.harness import model_repo, serving, until
from tests.helpers import encoder_request

pytestmark = pytest.mark.serial  # refusal times in milliseconds: alone (tests/parallel.py)

BATCH_S = 0.05  # what one fake batch costs, any size: the latency model learns it


def _encoder(rows: int, seq: int, **params):
    return encoder_request(np.random.default_rng(rows * 1000 + seq), rows, seq, params)


async def _backlog(gw, pool, heavy, calls: int) -> list[asyncio.Future]:
    """``calls`` heavy calls queued behind a held engine: the first batch is on the worker, stuck,
    the rest wait in the queue (seen on /metrics)."""
    pool.hold()
    flood = [asyncio.ensure_future(gw.stub.ModelInfer(heavy, timeout=60)) for _ in range(calls)]
    await until(lambda: pool.running == 1, what="the first batch on the worker")
    while await gw.metric("batchgate_queue_depth", model="encoder") < calls - 2:  # 2 calls fit a batch
        await asyncio.sleep(0.005)
    return flood


async def test_hopeless_budget_is_refused_at_once_and_never_computed(tmp_path):
    async with serving(model_repo(tmp_path), workers_per_device=1) as gw:
        pool = gw.pool("encoder")
        pool.per_batch_s = BATCH_S
        heavy = _encoder(16, 256, latency_class="bulk")
        for req in (heavy, _encoder(7, 16, latency_class="bulk")) * 3:  # both buckets: ~50 ms each
            await gw.stub.ModelInfer(req, timeout=10)
        before = await gw.statistics("encoder")
        flood = await _backlog(gw, pool, heavy, 18)

        probe = _encoder(7, 16, latency_class="bulk", latency_budget_ms=1)
        t0 = time.perf_counter()
        try:
            # no gRPC deadline: it would be the budget (test_grpc_deadline_is_the_budget)
            await asyncio.wait_for(gw.stub.ModelInfer(probe), 10)
            raise AssertionError("a 1 ms budget behind seconds of queued work must be refused")
        except grpc.aio.AioRpcError as err:
            elapsed = time.perf_counter() - t0
            assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.details()
            # shed at admission: its own batch alone costs ~50 ms, the engine is stuck, 18 calls wait
            assert "cannot be met" in err.details(), err.details()
            # The refusal says when to come back: the queue's drain time, as gRPC's retry policy
            # reads it and as retry-after-ms (REST turns that into Retry-After).
            trailers = dict(err.trailing_metadata())
            assert int(trailers["grpc-retry-pushback-ms"]) >= 1
            assert trailers["retry-after-ms"] == trailers["grpc-retry-pushback-ms"]
        assert pool.running == 1 and len(pool.batches) == 6  # answered while the engine was stuck
        pool.release()
        await asyncio.gather(*flood)
        after = await gw.statistics("encoder")
    print(f"refused after {elapsed * 1e3:.1f} ms, 18 calls queued behind a stuck batch")
    # measured 1.6-2.1 ms; the backlog is ~0.5 s (the stuck engine above is the proof it did not wait)
    assert elapsed < 0.05, f"refused after {elapsed:.3f}s"
    # Rows computed = exactly the flood's rows: the probe's 7 rows never ran.
    assert after.inference_count - before.inference_count == 18 * 16
    assert all(7 not in b.rows for b in pool.batches[6:])
    assert after.inference_stats.fail.count - before.inference_stats.fail.count == 1


async def test_grpc_deadline_is_the_budget(tmp_path):
    """A caller's gRPC deadline is honoured as its budget: behind a backlog it cannot wait out, the
    server sheds the call itself (its words, its fail count) and never computes its rows."""
    async with serving(model_repo(tmp_path), workers_per_device=1) as gw:
        pool = gw.pool("encoder")
        pool.per_batch_s = BATCH_S
        heavy = _encoder(16, 256, latency_class="bulk")
        for req in (heavy, _encoder(7, 16)) * 3:
            await gw.stub.ModelInfer(req, timeout=10)
        before = await gw.statistics("encoder")
        flood = await _backlog(gw, pool, heavy, 8)
        try:
            # no budget parameter: the standard class's budget, were the deadline not read
            await gw.stub.ModelInfer(_encoder(7, 16), timeout=0.015)  # less than its own ~50 ms batch
            raise AssertionError("expected DEADLINE_EXCEEDED")
        except grpc.aio.AioRpcError as err:
            assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            details = err.details()
        pool.release()
        await asyncio.gather(*flood)
        after = await gw.statistics("encoder")
    # the server's refusal, not the client's own timer ("Deadline Exceeded"): shed at admission, or
    # (when the estimate's recent ratio says the call might still make it) dropped before compute
    assert "cannot be met" in details or "dropped from the queue before compute" in details, details
    assert after.inference_stats.fail.count - before.inference_stats.fail.count == 1
    assert after.inference_count - before.inference_count == 8 * 16  # the probe's 7 rows never ran


async def test_a_model_can_keep_triton_fifo_while_the_server_schedules_by_deadline(tmp_path):
    policy = 'parameters {{ key: "scheduling_policy" value {{ string_value: "{}" }} }}\n'
    models = {
        "ranker:fifo-ranker": policy.format("fifo"),
        "ranker": "",
        "ranker:bad-ranker": policy.format("lifo"),
    }
    async with serving(model_repo(tmp_path, models), workers_per_device=1) as gw:
        index = {m.name: m for m in (await gw.stub.RepositoryIndex(pb.RepositoryIndexRequest())).models}
        assert index["fifo-ranker"].state == "READY" and index["ranker"].state == "READY"
        assert index["bad-ranker"].state != "READY"
        assert "scheduling_policy" in index["bad-ranker"].reason and "lifo" in index["bad-ranker"].reason
        async with gw.http.get("/metrics") as resp:
            text = await resp.text()
    # the FIFO queue reports one line, class "fifo"; the deadline queue one per latency class
    assert 'batchgate_queue_depth{class="fifo",model="fifo-ranker",version="1"}' in text
    assert 'batchgate_queue_depth{class="realtime",model="ranker",version="1"}' in text
    assert 'model="fifo-ranker",version="1"}' in text and 'class="realtime",model="fifo-ranker"' not in text
