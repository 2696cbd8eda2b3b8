"""The result cache end to end: what the pipeline's cache does, through the real server in-process
over a fake pool (tests/harness.py); and across processes, real batchgate servers sharing a real
redis-server, with the real ONNX models.

The engine's work is read from ModelStatistics (Triton semantics: ``inference_count`` rows and
``execution_count`` batches never include cache hits; ``cache_hit`` / ``cache_miss`` count
requests)."""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from pathlib import Path

import grpc
import numpy as np
import onnx
import onnxruntime as ort
import pytest

from batchgate.proto.inference.v2 import grpc_service_pb2 as pb
from batchgate.proto.inference.v2 import grpc_service_pb2_grpc as pb_grpc
from tests.conftest import REPO, RedisServer, start_server
from tests.harness import model_repo, serving

needs_redis = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")

TIMEOUT_S = 30.0


def make_repo(root: Path, versions: tuple[str, ...] = ("1",), touch_model: bool = False) -> Path:
    """ranker (and encoder) with ``response_cache { enable: true }``; ranker in ``versions``, all
    served. ``touch_model`` changes the ranker file's bytes (its doc string) but not what it computes."""
    repo = root / "repo"
    for name in ("ranker", "encoder"):
        (repo / name).mkdir(parents=True)
        config = (REPO / name / "config.pbtxt").read_text() + "response_cache { enable: true }\n"
        if name == "ranker":
            config += "version_policy { all {} }\n"
        (repo / name / "config.pbtxt").write_text(config)
        for v in versions if name == "ranker" else ("1",):
            (repo / name / v).mkdir()
            shutil.copy(REPO / name / "1" / "model.onnx", repo / name / v / "model.onnx")
    if touch_model:
        path = repo / "ranker" / "1" / "model.onnx"
        m = onnx.load(str(path))
        m.doc_string = "same graph, other file"
        onnx.save(m, str(path))
    return repo


def ranker_rows(seeds: list[int]) -> dict[str, np.ndarray]:
    """One row per seed: the same seed, the same row."""
    return {
        "dense": np.stack([np.random.default_rng(s).standard_normal(64, dtype=np.float32) for s in seeds]),
        "sparse_ids": np.stack(
            [np.random.default_rng(s + 1).integers(0, 10_000, 8, dtype=np.int64) for s in seeds]
        ),
    }


def request(
    arrays: dict[str, np.ndarray], model: str = "ranker", version: str = "1", typed: bool = False
) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name=model, model_version=version, id="r")
    for name, a in arrays.items():
        t = req.inputs.add(
            name=name, datatype="FP32" if a.dtype == np.float32 else "INT64", shape=list(a.shape)
        )
        if typed:
            field = "fp32_contents" if a.dtype == np.float32 else "int64_contents"
            getattr(t.contents, field).extend(a.reshape(-1).tolist())
        else:
            req.raw_input_contents.append(a.tobytes())
    return req


def score(resp: pb.ModelInferResponse) -> np.ndarray:
    return np.frombuffer(resp.raw_output_contents[0], np.float32).reshape(tuple(resp.outputs[0].shape))


def reference(arrays: dict[str, np.ndarray], model: str = "ranker") -> np.ndarray:
    sess = ort.InferenceSession(str(REPO / model / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    return sess.run(None, arrays)[0]


def stats(stub, model: str = "ranker", version: str = "1", metadata=()):
    req = pb.ModelStatisticsRequest(name=model, version=version)
    return stub.ModelStatistics(req, metadata=metadata, timeout=TIMEOUT_S).model_stats[0]


def delta(after, before) -> dict[str, int]:
    a, b = after.inference_stats, before.inference_stats
    return {
        "rows": after.inference_count - before.inference_count,
        "executions": after.execution_count - before.execution_count,
        "hit": a.cache_hit.count - b.cache_hit.count,
        "miss": a.cache_miss.count - b.cache_miss.count,
        "success": a.success.count - b.success.count,
    }


def env(redis: RedisServer, **extra: str) -> dict[str, str]:
    # A lookup timeout far above the default: these tests count hits exactly, on a shared machine
    # where a 5 ms lookup can time out (which would be a miss, and a flaky test).
    return {"BATCHGATE_REDIS_URL": redis.url, "BATCHGATE_CACHE_TIERS": "memory+redis",
            "BATCHGATE_CACHE_LOOKUP_TIMEOUT_MS": "200", **extra}  # fmt: skip


@pytest.fixture(scope="module")
def redis_module(tmp_path_factory):
    srv = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield srv
    srv.kill()


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    return make_repo(tmp_path_factory.mktemp("cache-repo"), versions=("1", "2"))


@pytest.fixture(scope="module")
def cached(tmp_path_factory, repo, redis_module):
    srv = start_server(tmp_path_factory.mktemp("cached"), repo=repo, env=env(redis_module))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def cstub(cached):
    with grpc.insecure_channel(cached.grpc_url) as ch:
        yield pb_grpc.GRPCInferenceServiceStub(ch)


# -- the pipeline's cache, in-process (tests/harness.py: the fake pool answers each row with its own
# value and records every batch it runs) ----------------------------------------------------------

CACHED = "response_cache { enable: true }\n"


def cached_repo(tmp_path: Path) -> Path:
    """ranker (versions 1 and 2, both served) and encoder with the response cache on."""
    return model_repo(
        tmp_path,
        {"ranker": CACHED + "version_policy { all {} }\n", "encoder": CACHED},
        {"ranker": ("1", "2")},
    )


async def test_response_cache_is_a_supported_config_field(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="batchgate")
    async with serving(cached_repo(tmp_path), cache_tiers="memory") as gw:
        cfg = (await gw.stub.ModelConfig(pb.ModelConfigRequest(name="ranker"), timeout=TIMEOUT_S)).config
    assert cfg.response_cache.enable
    assert "loaded model ranker" in caplog.text  # the load was logged here ...
    assert "response_cache" not in caplog.text  # ... and the field not reported as ignored


@pytest.mark.parametrize("typed_out", [False, True], ids=["raw-outputs", "typed-outputs"])
async def test_cached_response_is_byte_identical_to_the_computed_one(tmp_path, typed_out):
    async with serving(cached_repo(tmp_path), cache_tiers="memory") as gw:
        arrays = ranker_rows([101, 102, 103])
        req = request(arrays, version="1")
        if typed_out:
            req.outputs.add(name="score").parameters["binary_data"].bool_param = False
        before = await gw.statistics("ranker", "1")
        computed = await gw.stub.ModelInfer(req, timeout=TIMEOUT_S)
        cached_resp = await gw.stub.ModelInfer(req, timeout=TIMEOUT_S)
        typed_in = await gw.stub.ModelInfer(request(arrays, version="1", typed=True), timeout=TIMEOUT_S)
        d = delta(await gw.statistics("ranker", "1"), before)
        want = gw.pool("ranker", "1").expected(arrays)["score"]
    assert (d["rows"], d["executions"], d["hit"], d["miss"], d["success"]) == (3, 1, 2, 1, 3)
    assert cached_resp.SerializeToString(deterministic=True) == computed.SerializeToString(deterministic=True)
    if typed_out:
        assert list(computed.outputs[0].contents.fp32_contents) == want.ravel().tolist()
    else:
        # typed inputs: the same rows, the same keys
        assert typed_in.raw_output_contents == computed.raw_output_contents
        assert score(computed).tobytes() == want.tobytes()


async def test_partial_hits_compute_only_new_rows_and_keep_order(tmp_path):
    async with serving(cached_repo(tmp_path), cache_tiers="memory") as gw:
        pool = gw.pool("ranker", "1")
        await gw.stub.ModelInfer(request(ranker_rows([201, 202, 203])), timeout=TIMEOUT_S)
        seeds = [301, 202, 302, 201, 303, 203, 304]
        arrays = ranker_rows(seeds)
        before = await gw.statistics("ranker", "1")
        got = score(await gw.stub.ModelInfer(request(arrays), timeout=TIMEOUT_S))
        d = delta(await gw.statistics("ranker", "1"), before)
        assert d["rows"] == 4 and d["executions"] == 1 and d["miss"] == 1
        assert pool.batches[-1].rows == (4,)  # the four new rows, and only they, went to the engine
        assert got.tobytes() == pool.expected(arrays)["score"].tobytes()
        # Each row's bytes are what the row computed alone gives.
        alone = [score(await gw.stub.ModelInfer(request(ranker_rows([s])), timeout=TIMEOUT_S)) for s in seeds]
    assert got.tobytes() == np.concatenate(alone).tobytes()


async def test_a_new_model_version_misses(tmp_path):
    async with serving(cached_repo(tmp_path), cache_tiers="memory") as gw:
        arrays = ranker_rows([401, 402])
        await gw.stub.ModelInfer(request(arrays, version="1"), timeout=TIMEOUT_S)
        b1, b2 = await gw.statistics("ranker", "1"), await gw.statistics("ranker", "2")
        await gw.stub.ModelInfer(request(arrays, version="1"), timeout=TIMEOUT_S)
        await gw.stub.ModelInfer(request(arrays, version="2"), timeout=TIMEOUT_S)
        d1 = delta(await gw.statistics("ranker", "1"), b1)
        d2 = delta(await gw.statistics("ranker", "2"), b2)
    assert (d1["rows"], d1["hit"]) == (0, 1)
    assert (d2["rows"], d2["miss"], d2["hit"]) == (2, 1, 0)  # same file, same rows: another version


async def test_100_identical_concurrent_requests_run_the_engine_once(tmp_path):
    async with serving(cached_repo(tmp_path), cache_tiers="memory") as gw:
        pool = gw.pool("ranker", "1")
        pool.per_batch_s = 0.05  # the first call is still computing when the other 99 arrive
        arrays = ranker_rows([501, 502, 503, 504])
        req = request(arrays)
        before = await gw.statistics("ranker", "1")
        responses = await asyncio.gather(*(gw.stub.ModelInfer(req, timeout=TIMEOUT_S) for _ in range(100)))
        d = delta(await gw.statistics("ranker", "1"), before)
        ran = list(pool.batches)
    assert (d["rows"], d["executions"]) == (4, 1), d
    assert (d["miss"], d["hit"], d["success"]) == (1, 99, 100), d
    assert [b.rows for b in ran] == [(4,)]
    first = responses[0].raw_output_contents
    assert all(r.raw_output_contents == first for r in responses)
    assert score(responses[0]).tobytes() == pool.expected(arrays)["score"].tobytes()


async def test_variable_length_inputs_are_cached_per_shape(tmp_path):
    rng = np.random.default_rng(5)
    ids = rng.integers(0, 1000, (3, 12), dtype=np.int64)
    mask = np.ones((3, 12), np.int64)
    mask[1, 8:] = 0
    async with serving(cached_repo(tmp_path), cache_tiers="memory") as gw:
        before = await gw.statistics("encoder")
        first = await gw.stub.ModelInfer(
            request({"input_ids": ids, "attention_mask": mask}, "encoder"), timeout=TIMEOUT_S
        )
        again = await gw.stub.ModelInfer(
            request({"input_ids": ids[::-1].copy(), "attention_mask": mask[::-1].copy()}, "encoder"),
            timeout=TIMEOUT_S,
        )
        # The same tokens padded to another length are another row (another shape).
        pad = ((0, 0), (0, 4))
        padded = await gw.stub.ModelInfer(
            request({"input_ids": np.pad(ids[:1], pad), "attention_mask": np.pad(mask[:1], pad)}, "encoder"),
            timeout=TIMEOUT_S,
        )
        d = delta(await gw.statistics("encoder"), before)
    assert d["rows"] == 3 + 1 and d["hit"] == 1
    emb = np.frombuffer(first.raw_output_contents[0], np.float32).reshape(3, 128)
    emb_rev = np.frombuffer(again.raw_output_contents[0], np.float32).reshape(3, 128)
    assert emb_rev.tobytes() == emb[::-1].tobytes()
    assert padded.outputs[0].shape == [1, 128]


async def test_cache_off_serves_uncached(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="batchgate")
    async with serving(cached_repo(tmp_path), cache_tiers="off") as gw:
        req = request(ranker_rows([801, 802]))
        a = await gw.stub.ModelInfer(req, timeout=TIMEOUT_S)
        b = await gw.stub.ModelInfer(req, timeout=TIMEOUT_S)
        st = await gw.statistics("ranker", "1")
    assert a.raw_output_contents == b.raw_output_contents
    assert (st.inference_count, st.execution_count, st.inference_stats.cache_hit.count) == (4, 2, 0)
    assert "result cache is off" in caplog.text


# -- across processes: Redis shared by real servers --------------------------------------------------


@needs_redis
def test_another_replica_hits_through_redis_and_a_changed_model_file_misses(
    tmp_path, repo, redis_module, cached, cstub
):  # fmt: skip
    arrays = ranker_rows([601, 602, 603])
    computed = cstub.ModelInfer(request(arrays, version="1"), timeout=TIMEOUT_S)
    np.testing.assert_allclose(score(computed), reference(arrays), rtol=1e-5, atol=1e-6)  # the real engine
    time.sleep(0.3)  # the write to Redis happens behind the response
    replica = start_server(tmp_path, repo=repo, env=env(redis_module))
    other_file = start_server(
        tmp_path, repo=make_repo(tmp_path / "touched", touch_model=True), env=env(redis_module)
    )
    try:
        for srv, expect_hit in ((replica, True), (other_file, False)):
            with grpc.insecure_channel(srv.grpc_url) as ch:
                stub = pb_grpc.GRPCInferenceServiceStub(ch)
                resp = stub.ModelInfer(request(arrays, version="1"), timeout=TIMEOUT_S)
                st = stats(stub)
            assert resp.raw_output_contents == computed.raw_output_contents  # same answer either way
            if expect_hit:  # empty memory tier: the rows came from Redis
                assert (st.inference_count, st.inference_stats.cache_hit.count) == (0, 1)
            else:  # another fingerprint: other keys
                assert (st.inference_count, st.inference_stats.cache_miss.count) == (3, 1)
    finally:
        replica.stop()
        other_file.stop()


@needs_redis
def test_redis_killed_mid_run_fails_no_request_and_hits_resume_after_restart(tmp_path, redis_server):
    repo = make_repo(tmp_path)
    srv = start_server(
        tmp_path, repo=repo,
        env={"BATCHGATE_REDIS_URL": redis_server.url, "BATCHGATE_CACHE_TIERS": "redis",  # hits only from Redis
             "BATCHGATE_CACHE_BREAKER_OPEN_S": "0.2", "BATCHGATE_CACHE_LOOKUP_TIMEOUT_MS": "50"},
    )  # fmt: skip
    pool = [request(ranker_rows([700 + 10 * i + r for r in range(4)])) for i in range(40)]
    outcome = {"ok": 0, "failed": []}

    async def load(seconds: float) -> None:
        async with grpc.aio.insecure_channel(srv.grpc_url) as ch:
            stub = pb_grpc.GRPCInferenceServiceStub(ch)
            end = time.monotonic() + seconds

            async def caller(k: int) -> None:
                while time.monotonic() < end:
                    try:
                        await stub.ModelInfer(pool[k % len(pool)], timeout=TIMEOUT_S)
                        outcome["ok"] += 1
                    except grpc.RpcError as exc:
                        outcome["failed"].append(f"{exc.code().name}: {exc.details()}")
                    k += 7

            await asyncio.gather(*(caller(i) for i in range(8)))

    try:
        with grpc.insecure_channel(srv.grpc_url) as ch:
            stub = pb_grpc.GRPCInferenceServiceStub(ch)
            asyncio.run(load(1.5))
            warm = stats(stub).inference_stats.cache_hit.count
            assert warm > 0, "no Redis hits before the outage"
            redis_server.kill()
            asyncio.run(load(1.5))
            during = stats(stub)
            redis_server.restart()  # same port, empty
            time.sleep(0.3)  # past the breaker's open time: the next lookup probes
            before = stats(stub)
            asyncio.run(load(2.0))
            after = stats(stub)
        assert not outcome["failed"], outcome["failed"][:5]
        assert outcome["ok"] > 100
        assert after.inference_stats.cache_hit.count - before.inference_stats.cache_hit.count > 0, (
            "hits did not resume"
        )
        assert during.inference_count > 0
        import redis as redis_py

        assert redis_py.Redis(host="127.0.0.1", port=redis_server.port).dbsize() > 0  # writes resumed
    finally:
        srv.stop()
    assert "Traceback" not in srv.log()
