"""Correctness under batching: many concurrent requests, merged by the server, each answered with
exactly what the model file computes for that request alone."""

from __future__ import annotations

import asyncio

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc.aio as tca
from tritonclient.grpc import InferInput

from tests.conftest import REPO


def _session(model: str) -> ort.InferenceSession:
    return ort.InferenceSession(str(REPO / model / "1" / "model.onnx"), providers=["CPUExecutionProvider"])


def _ranker_request(rng: np.random.Generator, rows: int) -> dict[str, np.ndarray]:
    return {
        "dense": rng.standard_normal((rows, 64), dtype=np.float32),
        "sparse_ids": rng.integers(0, 10_000, (rows, 8), dtype=np.int64),
    }


def _encoder_request(rng: np.random.Generator, rows: int, seq: int) -> dict[str, np.ndarray]:
    mask = np.ones((rows, seq), dtype=np.int64)
    # Ragged rows inside one request: right padding with mask 0, as a tokenizer would send.
    for r in range(rows):
        mask[r, rng.integers(1, seq + 1) :] = 0
    return {"input_ids": rng.integers(0, 1000, (rows, seq), dtype=np.int64), "attention_mask": mask}


def _inputs(arrays: dict[str, np.ndarray], datatypes: dict[str, str]) -> list[InferInput]:
    out = []
    for name, arr in arrays.items():
        i = InferInput(name, list(arr.shape), datatypes[name])
        i.set_data_from_numpy(arr)
        out.append(i)
    return out


DTYPES = {"dense": "FP32", "sparse_ids": "INT64", "input_ids": "INT64", "attention_mask": "INT64"}


async def _run_concurrently(url: str, jobs: list[tuple[str, dict[str, np.ndarray]]]) -> list[np.ndarray]:
    client = tca.InferenceServerClient(url)
    try:

        async def one(model: str, arrays: dict[str, np.ndarray]) -> np.ndarray:
            # A burst of 500 from one client on a busy 2-core box can queue for seconds: this test
            # is about correctness, so the requests say they are bulk work (10 s budget).
            result = await client.infer(model, _inputs(arrays, DTYPES), parameters={"latency_class": "bulk"})
            return result.as_numpy("score" if model == "ranker" else "embedding")

        return await asyncio.gather(*(one(m, a) for m, a in jobs))
    finally:
        await client.close()


def _stats(triton, model: str):
    return triton.get_inference_statistics(model).model_stats[0]


def test_500_concurrent_requests_match_the_model_run_alone(server, triton):
    rng = np.random.default_rng(7)
    jobs: list[tuple[str, dict[str, np.ndarray]]] = []
    for i in range(500):
        rows = int(rng.integers(1, 17))
        if i % 5 == 4:  # a fifth go to the encoder, on a few shared lengths so they can merge
            jobs.append(("encoder", _encoder_request(rng, rows, int(rng.choice([8, 16, 24])))))
        else:
            jobs.append(("ranker", _ranker_request(rng, rows)))
    before = {m: _stats(triton, m) for m in ("ranker", "encoder")}

    results = asyncio.run(_run_concurrently(server.grpc_url, jobs))

    sessions = {m: _session(m) for m in ("ranker", "encoder")}
    for (model, arrays), got in zip(jobs, results):
        want = sessions[model].run(None, arrays)[0]
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

    for model in ("ranker", "encoder"):
        after = _stats(triton, model)
        requests = after.inference_stats.success.count - before[model].inference_stats.success.count
        executions = after.execution_count - before[model].execution_count
        rows = after.inference_count - before[model].inference_count
        sent = [j for j in jobs if j[0] == model]
        assert requests == len(sent)
        assert rows == sum(next(iter(a.values())).shape[0] for _, a in sent)
        if model == "ranker":
            # Batches of more than one request formed: fewer executions than requests, and
            # batches with more rows than any one request. (The encoder may legitimately run
            # requests alone: its latency model says holding them buys little on a CPU.)
            assert executions < requests, f"{model}: {executions} executions for {requests} requests"
            assert max(b.batch_size for b in after.batch_stats) > 16


def test_requests_of_different_lengths_are_not_merged_wrongly(server):
    """Rows only merge where non-batch dims agree; mixed lengths still all come back right."""
    rng = np.random.default_rng(11)
    jobs = [
        ("encoder", _encoder_request(rng, int(rng.integers(1, 5)), seq)) for seq in (3, 5, 7, 3, 5, 7, 64, 1)
    ]
    results = asyncio.run(_run_concurrently(server.grpc_url, jobs))
    sess = _session("encoder")
    for (_, arrays), got in zip(jobs, results):
        np.testing.assert_allclose(got, sess.run(None, arrays)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stream_count", [64])
def test_stream_infer_answers_every_request_with_its_id(server, stream_count):
    import queue

    import tritonclient.grpc as tc

    rng = np.random.default_rng(3)
    sess = _session("ranker")
    answers: queue.Queue = queue.Queue()
    client = tc.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    sent = {}
    try:
        for i in range(stream_count):
            arrays = _ranker_request(rng, int(rng.integers(1, 9)))
            sent[str(i)] = arrays
            client.async_stream_infer("ranker", _inputs(arrays, DTYPES), request_id=str(i))
        # One bad request in the stream is answered with an error; the stream goes on.
        bad = InferInput("dense", [1, 63], "FP32")
        bad.set_data_from_numpy(np.zeros((1, 63), np.float32))
        client.async_stream_infer("ranker", [bad], request_id="bad")
        got = {}
        errors = []
        for _ in range(stream_count + 1):
            result, error = answers.get(timeout=30)
            if error is not None:
                errors.append(str(error))
            else:
                got[result.get_response().id] = result.as_numpy("score")
    finally:
        client.stop_stream()
        client.close()
    assert len(errors) == 1 and "dense" in errors[0]
    assert set(got) == set(sent)
    for rid, arrays in sent.items():
        np.testing.assert_allclose(got[rid], sess.run(None, arrays)[0], rtol=1e-5, atol=1e-6)
