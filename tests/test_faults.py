"""Fault isolation (issue 10): a poisoned request fails alone, a dead worker thread is replaced.

What is tested
  * The scheduler's split-on-failure (``Scheduler(split_failures=True)``) as a state machine with
    the fake engine of tests/test_scheduler.py: a failing batch is bisected down to the failing
    request, the others are answered, statistics count one execution per successful run, queue
    time once per request, and the re-runs in ``retries``; a GatewayError is never retried.
  * ``WorkerPool`` with the real ranker and the test-only hook ``BATCHGATE_TEST_KILL_WORKER_AFTER``
    (workers/pool.py): the worker thread dies holding a batch, the batch runs again and is
    answered, the pool keeps its size with a live thread in every slot.
  * Live: a server whose ranker lacks the ``input_range`` guard, so an out-of-range id makes
    onnxruntime's Gather fail. Concurrent requests merged into one batch, one of them poisoned:
    that one gets INTERNAL naming the model and the error, the others the scores onnxruntime
    computes directly. And a server started with the kill hook keeps answering every request.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException

from batchgate.gateway.errors import GatewayError, Kind
from batchgate.gateway.scheduling import Scheduler
from batchgate.gateway.scheduling.fifo import FifoQueue
from tests.conftest import REPO, start_server
from tests.test_scheduler import (
    FakeClock,
    FakeEngine,
    answer,
    assert_own_output,
    inputs_for,
    submit_one,
    until,
)
from batchgate.workers import pool as pool_mod
from batchgate.workers.devices import Device
from batchgate.workers.engine import EngineOptions

MODEL = "fake_model"
RANKER = REPO / "ranker" / "1" / "model.onnx"
BAD_ID = 50_000  # the ranker's embedding table has 10000 rows


# ================================================================================================
# Scheduler: split a failing batch (fake engine, no threads)
# ================================================================================================


class PoisonEngine(FakeEngine):
    """Completes every call at once: fails it when it holds a poisoned request id."""

    def __init__(self, poisoned: set[int], exc: BaseException | None = None) -> None:
        super().__init__()
        self.poisoned = poisoned
        self.exc = exc

    def execute(self, parts, rows, batched):
        fut = super().execute(parts, rows, batched)
        call = self.calls[-1]
        if self.poisoned & set(call.ids):
            call.fail(self.exc or RuntimeError(f"Gather: index {BAD_ID} out of range"))
        else:
            call.succeed()
        return fut


async def _run_batch(poisoned: set[int], n: int, rows: int = 2, exc: BaseException | None = None):
    """n requests merged into one batch (it closes on size), against a PoisonEngine."""
    engine = PoisonEngine(poisoned, exc)
    queue = FifoQueue(max_batch_size=n * rows, max_delay_s=60.0)
    sched = Scheduler(MODEL, queue, engine.execute, slots=1, clock=FakeClock(), split_failures=True)
    sched.start()
    try:
        tasks = [asyncio.create_task(submit_one(sched, inputs_for(i, rows), rows, "k")) for i in range(n)]
        results = [await answer(t) for t in tasks]
    finally:
        await sched.close()
    return engine, sched.stats, results


async def test_a_poisoned_request_fails_alone_and_the_rest_are_answered():
    engine, st, results = await _run_batch({5}, n=8)
    for i, res in enumerate(results):
        if i == 5:
            assert isinstance(res, GatewayError) and res.kind is Kind.FAILED
            assert MODEL in res.message and "out of range" in res.message and "run alone" in res.message
        else:
            assert_own_output(res, i, 2)
    # 8 fail -> [0..3] ok, [4..7] fail -> [4,5] fail, [6,7] ok -> [4] ok, [5] fails alone.
    assert [c.ids for c in engine.calls] == [
        list(range(8)),
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [4, 5],
        [6, 7],
        [4],
        [5],
    ]
    assert engine.max_running == 1  # the halves took the scheduler's slots like any batch
    assert (st.success_count, st.fail_count) == (7, 1)
    assert st.execution_count == 3  # only the runs that succeeded: [0..3], [6, 7], [4]
    assert st.inference_count == 14
    assert st.retries == 6
    assert st.queue_count == 8  # once per request, not once per attempt
    assert {size: b.count for size, b in st.by_batch_size.items()} == {8: 1, 4: 1, 2: 1}  # rows


async def test_a_batch_that_fails_as_a_whole_fails_each_request_alone():
    engine, st, results = await _run_batch(set(range(3)), n=3)
    assert all(isinstance(r, GatewayError) and r.kind is Kind.FAILED for r in results)
    assert len(engine.calls) == 5  # 3, then 1 and 2, then 1 and 1
    assert (st.success_count, st.fail_count, st.execution_count) == (0, 3, 0)


async def test_a_gateway_error_is_final_and_not_split():
    engine, st, results = await _run_batch({1}, n=4, exc=GatewayError(Kind.FAILED, "the batch was cancelled"))
    assert len(engine.calls) == 1
    assert all(isinstance(r, GatewayError) and r.message == "the batch was cancelled" for r in results)
    assert (st.retries, st.fail_count) == (0, 4)


async def test_without_split_failures_a_batch_fails_whole():
    engine = PoisonEngine({0})
    sched = Scheduler(
        MODEL, FifoQueue(max_batch_size=4, max_delay_s=60.0), engine.execute, 1, clock=FakeClock()
    )
    sched.start()
    try:
        tasks = [asyncio.create_task(submit_one(sched, inputs_for(i, 1), 1, "k")) for i in range(4)]
        results = [await answer(t) for t in tasks]
    finally:
        await sched.close()
    assert len(engine.calls) == 1 and all(isinstance(r, GatewayError) for r in results)


async def test_halves_waiting_for_a_slot_are_answered_on_close():
    """A closing scheduler answers the halves it had not yet re-run (nobody hangs)."""
    engine = FakeEngine()
    sched = Scheduler(MODEL, FifoQueue(max_batch_size=4, max_delay_s=60.0), engine.execute, 1,
                      clock=FakeClock(), split_failures=True)  # fmt: skip
    sched.start()
    tasks = [asyncio.create_task(submit_one(sched, inputs_for(i, 1), 1, "k")) for i in range(4)]
    await until(lambda: len(engine.calls) == 1)
    engine.calls[0].fail(RuntimeError("boom"))
    await until(lambda: len(engine.calls) == 2)  # first half running, second half waiting
    await sched.close()
    engine.calls[1].succeed()  # completes after close: must not answer anyone twice
    results = [await answer(t) for t in tasks]
    assert all(isinstance(r, GatewayError) and r.kind is Kind.UNAVAILABLE for r in results[2:])


# ================================================================================================
# WorkerPool: a worker thread dies holding a batch (real ranker, the test-only kill hook)
# ================================================================================================


def _ranker_feed(rows: int, seed: int, bad_row: int | None = None) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 10_000, size=(rows, 8), dtype=np.int64)
    if bad_row is not None:
        ids[bad_row, 3] = BAD_ID
    return {"dense": rng.standard_normal((rows, 64), dtype=np.float32), "sparse_ids": ids}


def _reference(feed: dict[str, np.ndarray]) -> np.ndarray:
    sess = ort.InferenceSession(str(RANKER), providers=["CPUExecutionProvider"])
    return sess.run(["score"], feed)[0]


@pytest.fixture
def kill_after(monkeypatch):
    def arm(n: int) -> None:
        monkeypatch.setattr(pool_mod, "_KILL_AFTER", n)
        monkeypatch.setattr(pool_mod, "_killed", False)

    return arm


@pytest.mark.parametrize("count", [1, 2])
def test_dead_worker_is_replaced_and_its_batch_answered(kill_after, caplog, count):
    kill_after(2)  # the first worker to take its 3rd batch dies holding it
    pool = pool_mod.WorkerPool(
        "ranker-test", RANKER, [Device("cpu", 0)], count, EngineOptions(intra_op_threads=1)
    )
    pool.start()
    try:
        names_before = [w.name for w in pool.workers]
        feeds = [_ranker_feed(3, seed) for seed in range(8)]
        for feed in feeds:  # one at a time: with one worker the 3rd lands on a dying thread
            outputs, _ = pool.submit([feed], [3], True).result(timeout=60)
            np.testing.assert_allclose(outputs[0]["score"], _reference(feed), rtol=1e-5, atol=1e-6)
        assert pool_mod._killed, "the hook never fired"
        assert [w.name for w in pool.workers] == names_before and len(pool) == count
        assert all(w.thread.is_alive() for w in pool.workers)
        assert sum(w.restarts for w in pool.workers) == 1
        assert sum(w.outstanding for w in pool.workers) == 0  # the moved batch was counted right
        assert "died" in caplog.text and "runs again" in caplog.text
    finally:
        pool.close()


def test_a_batch_whose_worker_dies_twice_fails_clearly(kill_after, monkeypatch):
    """The retry is once: a batch that kills its second worker too is failed, not retried forever."""
    kill_after(-1)  # every batch taken kills its thread
    monkeypatch.setattr(pool_mod, "_test_kill", _always_kill)
    pool = pool_mod.WorkerPool(
        "ranker-test", RANKER, [Device("cpu", 0)], 1, EngineOptions(intra_op_threads=1)
    )
    pool.start()
    try:
        feed = _ranker_feed(2, 0)
        with pytest.raises(pool_mod.WorkerDied, match="died running this batch, twice"):
            pool.submit([feed], [2], True).result(timeout=60)
        monkeypatch.setattr(pool_mod, "_KILL_AFTER", 0)
        outputs, _ = pool.submit([feed], [2], True).result(timeout=60)  # the second replacement serves
        np.testing.assert_allclose(outputs[0]["score"], _reference(feed), rtol=1e-5, atol=1e-6)
        assert len(pool) == 1 and pool.workers[0].thread.is_alive() and pool.workers[0].restarts == 2
    finally:
        pool.close()


def _always_kill(name: str) -> None:
    raise SystemExit(f"worker {name} killed by the test")


# ================================================================================================
# Live: a poisoned request in a merged batch; a server whose worker dies
# ================================================================================================


def _unguarded_ranker_repo(tmp_path: Path, delay_us: int) -> Path:
    """The ranker without its input_range guard (so a bad id reaches onnxruntime's Gather)."""
    repo = tmp_path / "repo"
    (repo / "ranker" / "1").mkdir(parents=True)
    shutil.copy(RANKER, repo / "ranker" / "1" / "model.onnx")
    cfg = (REPO / "ranker" / "config.pbtxt").read_text()
    cfg = "\n".join(line for line in cfg.splitlines() if not line.startswith("parameters"))
    cfg = cfg.replace("max_queue_delay_microseconds: 2000", f"max_queue_delay_microseconds: {delay_us}")
    assert "input_range" not in cfg and str(delay_us) in cfg
    (repo / "ranker" / "config.pbtxt").write_text(cfg)
    return repo


def _infer_inputs(feed: dict[str, np.ndarray]) -> list[tc.InferInput]:
    out = []
    for name, dt in (("dense", "FP32"), ("sparse_ids", "INT64")):
        t = tc.InferInput(name, list(feed[name].shape), dt)
        t.set_data_from_numpy(feed[name])
        out.append(t)
    return out


def test_live_poisoned_request_fails_alone_in_a_merged_batch(tmp_path):
    # 300 ms of max_queue_delay and one worker: requests sent together share one batch. The FIFO
    # policy holds for the timer unconditionally (the deadline policy may send a first arrival
    # alone when it expects nobody to join, which would make this test depend on timing).
    repo = _unguarded_ranker_repo(tmp_path, 300_000)
    srv = start_server(
        tmp_path, "--workers-per-device", "1", repo=repo, env={"BATCHGATE_SCHEDULING_POLICY": "fifo"}
    )
    n, bad = 6, 3
    feeds = [_ranker_feed(2, 100 + i, bad_row=1 if i == bad else None) for i in range(n)]
    try:
        client = tc.InferenceServerClient(srv.grpc_url)
        barrier = threading.Barrier(n)

        def call(i: int):
            c = tc.InferenceServerClient(srv.grpc_url)
            barrier.wait()
            try:
                return c.infer("ranker", _infer_inputs(feeds[i]), client_timeout=30).as_numpy("score")
            except InferenceServerException as exc:
                return exc
            finally:
                c.close()

        with ThreadPoolExecutor(n) as ex:
            results = list(ex.map(call, range(n)))
        for i, res in enumerate(results):
            if i == bad:
                assert isinstance(res, InferenceServerException), res
                assert res.status() == "StatusCode.INTERNAL"
                msg = res.message()
                assert "ranker" in msg and "failed to execute" in msg and "run alone" in msg
                assert "Gather" in msg and "idx=50000" in msg, msg  # onnxruntime's own words
            else:
                assert not isinstance(res, Exception), (i, res)
                np.testing.assert_allclose(res, _reference(feeds[i]), rtol=1e-5, atol=1e-6)
        st = client.get_inference_statistics("ranker").model_stats[0]
        assert (st.inference_stats.success.count, st.inference_stats.fail.count) == (n - 1, 1)
        # A batch of several requests was attempted and split (the server's own account):
        attempted = [int(m) for m in re.findall(r"batch of (\d+) requests \(\d+ rows\) failed", srv.log())]
        assert attempted and max(attempted) >= 2, srv.log()[-3000:]
        assert any(b.batch_size >= 4 for b in st.batch_stats)  # a merged half succeeded
        # The worker is still serving.
        ok = client.infer("ranker", _infer_inputs(feeds[0])).as_numpy("score")
        np.testing.assert_allclose(ok, _reference(feeds[0]), rtol=1e-5, atol=1e-6)
        client.close()
    finally:
        assert srv.stop() == 0


def test_live_worker_death_is_survived(tmp_path):
    repo = _unguarded_ranker_repo(tmp_path, 0)
    srv = start_server(tmp_path, "--workers-per-device", "1", repo=repo,
                       env={"BATCHGATE_TEST_KILL_WORKER_AFTER": "3"})  # fmt: skip
    try:
        client = tc.InferenceServerClient(srv.grpc_url)
        for i in range(10):  # the 4th batch is held by the dying thread; the replacement runs it
            feed = _ranker_feed(2, 200 + i)
            out = client.infer("ranker", _infer_inputs(feed), client_timeout=60).as_numpy("score")
            np.testing.assert_allclose(out, _reference(feed), rtol=1e-5, atol=1e-6)
        log = srv.log()
        assert "died" in log and "test hook" in log and "replacement worker thread" in log, log[-3000:]
        st = client.get_inference_statistics("ranker").model_stats[0]
        assert (st.inference_stats.success.count, st.inference_stats.fail.count) == (10, 0)
        client.close()
    finally:
        assert srv.stop() == 0
