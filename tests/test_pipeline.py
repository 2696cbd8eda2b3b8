"""The pipeline in-process (tests/harness.py): the real server, scheduler and data plane over a
fake pool whose batches the test times, fails or holds. What the scheduler does with concurrent
callers, a poisoned request and a hung engine, seen from the callers (gRPC and REST) and from the
pool's own record of the batches it ran. The real engines under batching: tests/test_batching.py
and tests/test_faults.py."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np

from tests.harness import model_repo, output, request, rest_body, serving, until


def _ranker(rng: np.random.Generator, rows: int) -> dict[str, np.ndarray]:
    return {
        "dense": rng.standard_normal((rows, 64), dtype=np.float32),
        "sparse_ids": rng.integers(0, 10_000, (rows, 8), dtype=np.int64),
    }


def _encoder(rng: np.random.Generator, rows: int, seq: int) -> dict[str, np.ndarray]:
    return {
        "input_ids": rng.integers(0, 1000, (rows, seq), dtype=np.int64),
        "attention_mask": np.ones((rows, seq), dtype=np.int64),
    }


async def test_concurrent_calls_are_merged_into_batches_and_each_gets_its_own_rows(tmp_path):
    """300 concurrent calls on both transports, 1-16 rows each: the scheduler merges them (fewer
    batches than calls, batches larger than any call) and every caller gets exactly its own rows
    back, in order."""
    rng = np.random.default_rng(7)
    jobs = []
    for i in range(300):
        rows = int(rng.integers(1, 17))
        if i % 5 == 4:
            jobs.append(("encoder", "embedding", _encoder(rng, rows, int(rng.choice([8, 16, 24])))))
        else:
            jobs.append(("ranker", "score", _ranker(rng, rows)))
    async with serving(model_repo(tmp_path)) as gw:
        for model in ("ranker", "encoder"):
            gw.pool(model).per_batch_s = 0.005  # a batch takes time: callers arriving meanwhile wait together
        before = {m: await gw.statistics(m) for m in ("ranker", "encoder")}

        async def one(k: int, model: str, name: str, arrays: dict[str, np.ndarray]) -> np.ndarray:
            if k % 3 == 0:  # a third over REST
                status, doc = await gw.rest_infer(model, rest_body(arrays, latency_class="bulk"))
                assert status == 200, doc
                out = doc["outputs"][0]
                return np.array(out["data"], np.float32).reshape(out["shape"])
            resp = await gw.stub.ModelInfer(request(model, arrays, latency_class="bulk"), timeout=30)
            return output(resp, name)

        results = await asyncio.gather(*(one(k, *job) for k, job in enumerate(jobs)))
        after = {m: await gw.statistics(m) for m in ("ranker", "encoder")}
        pools = {m: gw.pool(m) for m in ("ranker", "encoder")}
    for (model, name, arrays), got in zip(jobs, results):
        want = pools[model].expected(arrays)[name]
        assert got.shape == want.shape and got.tobytes() == want.tobytes()
    for model, pool in pools.items():
        sent = [a for m, _, a in jobs if m == model]
        requests = after[model].inference_stats.success.count - before[model].inference_stats.success.count
        executions = after[model].execution_count - before[model].execution_count
        rows = after[model].inference_count - before[model].inference_count
        assert requests == len(sent) and rows == sum(len(next(iter(a.values()))) for a in sent)
        assert executions == len(pool.batches) and rows == pool.rows_computed
        print(
            f"{model}: {requests} calls in {executions} batches, largest {max(b.total for b in pool.batches)} rows"
        )
        assert executions < requests / 4, f"{model}: {executions} batches for {requests} calls"
        assert max(b.total for b in pool.batches) > 16  # more rows than any one call


async def test_a_poisoned_request_fails_alone_and_the_rest_are_answered(tmp_path):
    """Six calls queued behind a held engine run as one batch; one of them makes the engine fail.
    The batch is split until that call runs alone: it gets INTERNAL, the others their rows."""
    async with serving(model_repo(tmp_path), workers_per_device=1) as gw:
        pool = gw.pool("ranker")
        pool.fail_when(lambda inputs: bool((inputs["sparse_ids"] == 9_999).any()))
        rng = np.random.default_rng(3)
        calls = [_ranker(rng, 2) for _ in range(6)]
        calls[3]["sparse_ids"][1, 0] = 9_999  # the poisoned row
        pool.hold()
        first = asyncio.ensure_future(gw.stub.ModelInfer(request("ranker", _ranker(rng, 1)), timeout=30))
        await until(lambda: pool.running == 1, what="the first call on the worker")

        async def call(arrays):
            try:
                return output(await gw.stub.ModelInfer(request("ranker", arrays), timeout=30))
            except grpc.aio.AioRpcError as exc:
                return exc

        answers = [asyncio.ensure_future(call(a)) for a in calls]
        await gw.wait_metric("batchgate_queue_depth", 6, model="ranker")
        pool.release()
        results = await asyncio.gather(*answers)
        await first
    for i, res in enumerate(results):
        if i == 3:
            assert isinstance(res, grpc.aio.AioRpcError) and res.code() == grpc.StatusCode.INTERNAL, res
            assert "failed to execute" in res.details() and "run alone" in res.details(), res.details()
            assert "fail_when" in res.details()  # the engine's own words
        else:
            assert not isinstance(res, Exception), (i, res)
            assert res.tobytes() == pool.expected(calls[i])["score"].tobytes()
    ran = pool.batches[1:]
    assert ran[0].failed and len(ran[0].rows) == 6  # all six merged, and the batch failed
    assert [b.rows for b in ran if b.failed][-1] == (2,)  # ... split down to the poisoned call alone
    assert sum(b.total for b in ran if not b.failed) == 5 * 2  # every other call answered once


async def test_a_hung_engine_answers_every_waiter(tmp_path):
    """The engine stops on a batch. Calls queued behind it are dropped from the queue when their
    budgets can no longer be met (the server's words, not the client's timer); the caller of the
    stuck batch is let go at its deadline; once the engine is back, calls are served again."""
    async with serving(model_repo(tmp_path), workers_per_device=1) as gw:
        pool = gw.pool("ranker")
        rng = np.random.default_rng(5)
        pool.hold()
        stuck = asyncio.ensure_future(gw.stub.ModelInfer(request("ranker", _ranker(rng, 1)), timeout=0.5))
        await until(lambda: pool.running == 1, what="the stuck batch on the worker")

        async def queued():
            req = request("ranker", _ranker(rng, 1), latency_budget_ms=200)
            try:
                await asyncio.wait_for(gw.stub.ModelInfer(req), 5)  # the budget, no gRPC deadline
            except grpc.aio.AioRpcError as exc:
                return exc
            raise AssertionError("a call queued behind a hung engine was answered")

        waiters = await asyncio.gather(*(queued() for _ in range(3)))
        try:
            await stuck
            raise AssertionError("the stuck batch's caller was answered while the engine hung")
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        pool.release()
        arrays = _ranker(rng, 2)
        resp = await gw.stub.ModelInfer(request("ranker", arrays), timeout=10)
        assert output(resp).tobytes() == pool.expected(arrays)["score"].tobytes()
        expired = await gw.metric("batchgate_class_requests_total", model="ranker", outcome="expired")
    for exc in waiters:
        assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "dropped from the queue before compute" in exc.details(), exc.details()
    assert expired == 3
    assert [b.rows for b in pool.batches] == [(1,), (2,)]  # the stuck one finished; none of the waiters ran
