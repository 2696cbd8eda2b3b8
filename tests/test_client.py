"""batchgate.client against live servers: answers equal tritonclient's, failures are exceptions that
say what went wrong, and a replica drained in the middle of a run costs the caller nothing (the
channel's retry policy and round robin move the calls to the other replica)."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tc

from batchgate.client import (
    AsyncClient,
    Client,
    DeadlineExceeded,
    InvalidInput,
    ModelNotFound,
    PermissionDenied,
    RateLimited,
    Unauthenticated,
    Unavailable,
    service_config,
    target_of,
)
from batchgate.gateway.admission.tenants import hash_key
from batchgate.proto.inference.v2 import grpc_service_pb2 as pb
from batchgate.proto.inference.v2 import grpc_service_pb2_grpc as pb_grpc
from tests.conftest import REPO, start_server

KEY, TIGHT, RANKER_ONLY = "client-0123456789abcdef", "tight-0123456789abcd", "ranker-0123456789abcd"
TENANTS = f"""
tenants:
  - name: full
    key_hashes: ["{hash_key(KEY)}"]
  - name: tight
    key_hashes: ["{hash_key(TIGHT)}"]
    limits: {{requests_per_s: 0.01, requests_burst: 1}}
  - name: ranker-only
    key_hashes: ["{hash_key(RANKER_ONLY)}"]
    models: [ranker]
"""
TEXTS = ["A man is eating food.", "A man is eating a piece of bread.", "Café — 東京 🗼", "Short."]
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def srv(minilm_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("client-server")
    repo = tmp / "repo"
    repo.mkdir()
    (repo / "ranker").symlink_to(REPO / "ranker")
    (repo / "minilm").symlink_to(minilm_dir)
    (tmp / "tenants.yaml").write_text(TENANTS)
    s = start_server(tmp, "--no-build-models", "--api-keys-file", str(tmp / "tenants.yaml"), repo=repo)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def triton(srv):
    c = tc.InferenceServerClient(srv.grpc_url)
    yield c
    c.close()


@pytest.fixture(scope="module")
def bg(srv):
    with Client(srv.grpc_url, api_key=KEY) as c:
        yield c


def _ranker_inputs(n: int = 5, seed: int = 3) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 64), dtype=np.float32), rng.integers(0, 10_000, (n, 8), dtype=np.int64)


def triton_embed(triton, texts: list[str]) -> np.ndarray:
    arr = np.array([[t.encode()] for t in texts], dtype=object)
    inp = tc.InferInput("text", list(arr.shape), "BYTES")
    inp.set_data_from_numpy(arr)
    return triton.infer("minilm", [inp], headers=AUTH).as_numpy("embedding")


def triton_score(triton, dense: np.ndarray, ids: np.ndarray) -> np.ndarray:
    a = tc.InferInput("dense", list(dense.shape), "FP32")
    a.set_data_from_numpy(dense)
    b = tc.InferInput("sparse_ids", list(ids.shape), "INT64")
    b.set_data_from_numpy(ids)
    return triton.infer("ranker", [a, b], headers=AUTH).as_numpy("score")


def test_embed_score_and_infer_equal_tritonclients(bg, triton):
    vectors = bg.embed(TEXTS)
    assert vectors.dtype == np.float32 and vectors.shape == (4, 384)
    assert np.array_equal(vectors, triton_embed(triton, TEXTS))
    one = bg.embed(TEXTS[0])
    assert one.shape == (384,) and np.array_equal(one, triton_embed(triton, TEXTS[:1])[0])
    dense, ids = _ranker_inputs()
    expected = triton_score(triton, dense, ids)
    assert np.array_equal(bg.score(dense, ids), expected.reshape(-1))
    out = bg.infer("ranker", dense=dense, sparse_ids=ids, latency_class="bulk", timeout=5)
    assert set(out) == {"score"} and np.array_equal(out["score"], expected)


def test_async_client_equals_tritonclient(srv, triton):
    dense, ids = _ranker_inputs(7, seed=9)

    async def go():
        async with AsyncClient([srv.grpc_url], api_key=KEY, latency_class="realtime") as c:
            return await asyncio.gather(c.embed(TEXTS), c.score(dense, ids), c.infer("minilm", text=[["x"]]))

    vectors, scores, out = asyncio.run(go())
    assert np.array_equal(vectors, triton_embed(triton, TEXTS))
    assert np.array_equal(scores, triton_score(triton, dense, ids).reshape(-1))
    assert np.array_equal(out["embedding"], triton_embed(triton, ["x"]))


def test_exceptions_say_what_went_wrong(srv, bg):
    with pytest.raises(ModelNotFound, match=r"infer model 'nope' at .*NOT_FOUND: .*'nope'"):
        bg.infer("nope", x=np.zeros((1, 1), np.float32))
    with pytest.raises(InvalidInput, match="dense"):
        bg.score(np.zeros((2, 63), np.float32), np.zeros((2, 8), np.int64))
    with pytest.raises(InvalidInput, match="latency_class"):
        bg.embed(["x"], latency_class="urgent")
    with pytest.raises(Unauthenticated, match="pass api_key"):
        with Client(srv.grpc_url) as anon:
            anon.embed(["x"])
    with pytest.raises(PermissionDenied, match="may not call model 'minilm'"):
        with Client(srv.grpc_url, api_key=RANKER_ONLY) as c:
            c.embed(["x"])
    with Client(srv.grpc_url, api_key=TIGHT) as c:
        c.embed(["x"])
        with pytest.raises(RateLimited) as e:
            c.embed(["x"])
    assert e.value.retry_after_s is not None and e.value.retry_after_s > 1
    with pytest.raises(DeadlineExceeded):
        bg.embed(["a text " * 50] * 32, timeout=0.001)


def test_no_server_is_unavailable_after_retries():
    from tests.helpers import free_ports

    (port,) = free_ports(1)
    t0 = time.monotonic()
    with Client(f"127.0.0.1:{port}", timeout=3) as c, pytest.raises(Unavailable, match="no replica accepted"):
        c.score(*_ranker_inputs(1))
    assert time.monotonic() - t0 < 3.5


def test_targets_and_service_config():
    assert target_of("dns:///bg-headless.ns.svc:8001") == "dns:///bg-headless.ns.svc:8001"
    assert target_of(["10.0.0.1:8001", "10.0.0.2:8001"]) == "ipv4:10.0.0.1:8001,10.0.0.2:8001"
    assert target_of(["[::1]:8001"]) == "ipv6:[::1]:8001"
    assert target_of(["localhost:8001"]).startswith(("ipv4:127.0.0.1:8001", "ipv6:[::1]:8001"))
    with pytest.raises(ValueError, match="host:port"):
        target_of(["10.0.0.1"])
    with pytest.raises(ValueError, match="mix IPv4 and IPv6"):
        target_of(["10.0.0.1:1", "[::1]:1"])
    import json

    cfg = json.loads(service_config(max_attempts=9))
    assert cfg["loadBalancingConfig"] == [{"round_robin": {}}]
    policy = cfg["methodConfig"][0]["retryPolicy"]
    assert policy["maxAttempts"] == 5 and policy["retryableStatusCodes"] == ["UNAVAILABLE"]


# -- a drain in the middle of a run -----------------------------------------------------------------


def _executions(url: str) -> int:
    with grpc.insecure_channel(url) as ch:
        stub = pb_grpc.GRPCInferenceServiceStub(ch)
        stats = stub.ModelStatistics(pb.ModelStatisticsRequest(name="ranker"), timeout=5)
    return stats.model_stats[0].inference_stats.success.count


def test_a_drain_mid_run_is_retried_on_the_other_server(tmp_path: Path):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "ranker").symlink_to(REPO / "ranker")
    args = ("--no-build-models", "--drain-timeout-s", "5")
    a = start_server(tmp_path, *args, repo=repo)
    b = start_server(tmp_path, *args, repo=repo)
    errors: list[BaseException] = []
    done = [0]
    stop = threading.Event()
    dense, ids = _ranker_inputs(4)
    try:
        with Client([a.grpc_url, b.grpc_url], timeout=10) as c:

            def caller() -> None:
                while not stop.is_set():
                    try:
                        c.score(dense, ids)
                        done[0] += 1
                    except Exception as exc:  # any error that reaches the caller fails the test
                        errors.append(exc)

            threads = [threading.Thread(target=caller) for _ in range(8)]
            for t in threads:
                t.start()
            time.sleep(1.5)
            served_by_a = _executions(a.grpc_url)
            before_b = _executions(b.grpc_url)
            assert a.stop(signal.SIGTERM, timeout=30) == 0  # drains, then exits 0
            after_drain = done[0]
            time.sleep(1.0)
            stop.set()
            for t in threads:
                t.join(15)
            assert not errors, f"{len(errors)} errors reached the caller, first: {errors[0]}"
            assert served_by_a > 0 and before_b > 0  # round robin used both before the drain
            assert done[0] > after_drain and _executions(b.grpc_url) > before_b  # B took the rest
    finally:
        stop.set()
        a.stop()
        b.stop()


def test_embed_of_a_thousand_texts_is_a_thousand_vectors_in_order(srv, bg, triton):
    texts = [f"sentence {i}: " + " ".join(["word"] * (i % 23)) for i in range(1000)]
    # minilm takes 64 a request: 16 requests, in flight together. A minute each, not the client's
    # default 10 s: this runs beside other tests, and took 9.6 s of a loaded CI run.
    vectors = bg.embed(texts, timeout=60)
    assert vectors.shape == (1000, 384)
    for i in (0, 1, 63, 64, 65, 500, 998, 999):
        np.testing.assert_allclose(vectors[i], bg.embed(texts[i]), atol=1e-6)
    np.testing.assert_allclose(vectors[128:192], triton_embed(triton, texts[128:192]), atol=1e-6)

    async def run():
        async with AsyncClient(srv.grpc_url, api_key=KEY) as c:
            return await c.embed(texts, timeout=60)

    np.testing.assert_allclose(asyncio.run(run()), vectors, atol=1e-6)
