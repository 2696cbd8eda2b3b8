"""Static engines, buckets and buffer pools in the workers, then through a real server.

Every answer is compared with ONNX Runtime run alone on the request as sent (no padding, no
batching), at the tolerances test_batching uses. GPU tests skip without a device that both
onnxruntime-gpu and CuPy can see; ``bench/gpu_check.py`` runs the GPU checks on a lent machine.
"""

from __future__ import annotations

import asyncio
import shutil
import tracemalloc
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import tritonclient.grpc.aio as tca
from onnx import TensorProto, helper
from tritonclient.grpc import InferInput

from tests.conftest import REPO, start_server
from tests.fake_cuda import FakeCuda
from batchgate.gateway.parameters import bucket_config
from batchgate.workers import Device, EngineOptions, WorkerPool, gpu_count
from batchgate.workers.buckets import read_model_io
from batchgate.workers.engine import Engine
from batchgate.workers.sessions import SessionFactory, default_cache_dir

ENCODER = REPO / "encoder" / "1" / "model.onnx"
ENCODER_PARAMS = {
    "seq_buckets": "16,32,64,128,256,512",
    "max_batch_tokens": "8192",
    "max_dim.input_ids": "512",
}
RTOL, ATOL = 1e-5, 1e-6
# Against the CPU on a GPU: ORT's CUDA provider runs FP32 matmuls as TF32 by default (10-bit
# mantissa), so answers differ by ~1e-3 relative; padding leaking into a row differs by O(1).
TF32 = (2e-2, 2e-2)


@pytest.fixture(scope="module")
def reference() -> ort.InferenceSession:
    return ort.InferenceSession(str(ENCODER), providers=["CPUExecutionProvider"])


def _request(rng: np.random.Generator, rows: int, seq: int) -> dict[str, np.ndarray]:
    mask = np.ones((rows, seq), np.int64)
    for r in range(rows):  # ragged rows inside the request, as a tokenizer pads them
        mask[r, rng.integers(1, seq + 1) :] = 0
    return {"input_ids": rng.integers(0, 1000, (rows, seq), dtype=np.int64), "attention_mask": mask}


def _pool(
    tmp_path: Path, params: dict[str, str] = ENCODER_PARAMS, device: Device = Device("cpu"), **opts
) -> WorkerPool:
    options = EngineOptions(cache_dir=tmp_path / "engines", **opts)
    pool = WorkerPool("encoder-test", ENCODER, [device], 1, options, bucket_config(params, 64, (16, 32)))
    pool.start()
    return pool


def _previous(values: tuple[int, ...], v: int) -> int:
    i = values.index(v)
    return values[i - 1] if i else 0


def _check_every_bucket(
    pool: WorkerPool, reference: ort.InferenceSession, seed: int = 0, tol: tuple[float, float] = (RTOL, ATOL)
) -> int:
    """For each bucket, a batch just past the previous bucket (most padding) with two lengths,
    against the CPU ``reference`` at (rtol, atol) ``tol``."""
    plan = pool.plan
    rng = np.random.default_rng(seed)
    seq_buckets = plan.groups[0].buckets
    checked = 0
    for rows, (seq,) in plan.slots():
        n = _previous(plan.batch_sizes, rows) + 1
        length = _previous(seq_buckets, seq) + 1
        sizes = [n] if n == 1 else [n // 2, n - n // 2]
        lengths = [length, max(1, length - 3)] if n > 1 else [length]
        if max(lengths) <= _previous(seq_buckets, seq):
            lengths = [seq]
        parts = [_request(rng, r, L) for r, L in zip(sizes, [max(lengths)] + lengths[1:])]
        outputs, timing = pool.submit(parts, sizes, True).result()
        assert timing.bucket == (rows, seq), (sizes, lengths)
        assert timing.padded_rows == rows and timing.rows == n
        for part, out in zip(parts, outputs):
            want = reference.run(None, part)[0]
            assert out["embedding"].shape == want.shape
            np.testing.assert_allclose(out["embedding"], want, rtol=tol[0], atol=tol[1])
        checked += 1
    return checked


# -- padding never changes an answer ----------------------------------------------------------


def test_every_bucket_of_the_shared_engine_answers_like_the_model_alone(tmp_path, reference):
    pool = _pool(tmp_path, mode="shared")
    try:
        assert _check_every_bucket(pool, reference) == len(pool.plan.slots()) == 39
    finally:
        pool.close()


def test_static_engines_fix_their_dims_and_answer_the_same(tmp_path, reference):
    params = {"seq_buckets": "16,64", "batch_buckets": "1,4,16"}
    pool = _pool(tmp_path, params, mode="static")
    try:
        engine = pool.workers[0].engine
        assert engine.mode == "static"
        assert len(engine._sessions) == len(pool.plan.slots()) == 8  # one session per bucket
        session = engine._sessions[(4, 64)]
        assert [i.shape for i in session.get_inputs()] == [[4, 64], [4, 64]]  # no symbolic dim left
        assert _check_every_bucket(pool, reference, seed=1) == 8
    finally:
        pool.close()


def test_a_batch_over_max_batch_tokens_runs_in_pieces(tmp_path, reference):
    pool = _pool(tmp_path, warmup="none")
    try:
        rng = np.random.default_rng(2)
        parts = [_request(rng, 40, 300), _request(rng, 24, 290)]
        outputs, timing = pool.submit(parts, [40, 24], True).result()
        assert timing.runs == 4 and timing.bucket == (16, 512)  # 8192 tokens = 16 rows of 512
        assert (timing.rows, timing.padded_rows) == (64, 64)
        assert (timing.tokens, timing.padded_tokens) == (40 * 300 + 24 * 290, 64 * 512)
        for part, out in zip(parts, outputs):
            np.testing.assert_allclose(out["embedding"], reference.run(None, part)[0], rtol=RTOL, atol=ATOL)
    finally:
        pool.close()


def test_lengths_past_the_last_bucket_run_at_their_own_shape(tmp_path, reference):
    pool = _pool(tmp_path, {"seq_buckets": "16,32"}, warmup="none")
    try:
        rng = np.random.default_rng(3)
        parts = [_request(rng, 2, 40), _request(rng, 3, 33)]
        outputs, timing = pool.submit(parts, [2, 3], True).result()
        assert timing.bucket is None  # the dynamic path, padded to the longest (the dim is masked)
        for part, out in zip(parts, outputs):
            np.testing.assert_allclose(out["embedding"], reference.run(None, part)[0], rtol=RTOL, atol=ATOL)
    finally:
        pool.close()


def _token_model(path: Path) -> Path:
    """tokens[b, s, 4] = (x * mask)[..., None] * w; pooled[b, 4] = sum over s. A seq-shaped output."""
    nodes = [
        helper.make_node("Cast", ["attention_mask"], ["mask_f"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["x", "mask_f"], ["xm"]),
        helper.make_node("Unsqueeze", ["xm", "axis_last"], ["xm3"]),
        helper.make_node("Mul", ["xm3", "w"], ["tokens"]),
        helper.make_node("ReduceSum", ["tokens", "axis_seq"], ["pooled"], keepdims=0),
    ]
    inits = [
        helper.make_tensor("axis_last", TensorProto.INT64, [1], [-1]),
        helper.make_tensor("axis_seq", TensorProto.INT64, [1], [1]),
        helper.make_tensor("w", TensorProto.FLOAT, [4], [1.0, -2.0, 0.5, 3.0]),
    ]
    graph = helper.make_graph(
        nodes, "tokens",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("tokens", TensorProto.FLOAT, ["batch", "seq", 4]),
         helper.make_tensor_value_info("pooled", TensorProto.FLOAT, ["batch", 4])],
        inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save(model, str(path))
    return path


def test_outputs_with_a_seq_dim_are_cut_back_to_each_request(tmp_path):
    path = _token_model(tmp_path / "tokens.onnx")
    cfg = bucket_config({"seq_buckets": "16"}, 8)
    pool = WorkerPool("tokens", path, [Device("cpu")], 1, EngineOptions(), cfg)
    pool.start()
    try:
        ref = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        rng = np.random.default_rng(4)
        parts = [
            {"x": rng.standard_normal((r, n), dtype=np.float32), "attention_mask": np.ones((r, n), np.int64)}
            for r, n in ((2, 5), (3, 9))
        ]
        outputs, timing = pool.submit(parts, [2, 3], True).result()
        assert timing.bucket == (8, 16)
        for part, out in zip(parts, outputs):
            want_tokens, want_pooled = ref.run(None, part)
            assert out["tokens"].shape == want_tokens.shape  # (rows, own length, 4), not the bucket's 16
            np.testing.assert_allclose(out["tokens"], want_tokens, rtol=RTOL, atol=ATOL)
            np.testing.assert_allclose(out["pooled"], want_pooled, rtol=RTOL, atol=ATOL)
    finally:
        pool.close()


def test_rows_of_different_lengths_on_an_unmasked_dim_never_share_a_padded_batch(tmp_path):
    path = _token_model(tmp_path / "tokens.onnx")
    # mask_input none: nothing is known to mask padding, so the dim keeps exact lengths.
    cfg = bucket_config({"mask_input": "none"}, 8)
    pool = WorkerPool("tokens", path, [Device("cpu")], 1, EngineOptions(), cfg)
    pool.start()
    try:
        x = {"x": np.ones((1, 5), np.float32), "attention_mask": np.ones((1, 5), np.int64)}
        y = {"x": np.ones((1, 6), np.float32), "attention_mask": np.ones((1, 6), np.int64)}
        assert pool.shape_key(x) != pool.shape_key(y)  # the batcher keeps them apart...
        with pytest.raises(ValueError, match="cannot share a batch"):  # ...and the engine refuses
            pool.submit([x, y], [1, 1], True).result()
    finally:
        pool.close()


# -- the pools: allocated once --------------------------------------------------------------------


def test_no_buffer_is_allocated_on_the_hot_path_after_warm_up(tmp_path, reference):
    pool = _pool(tmp_path)
    try:
        engine = pool.workers[0].engine
        slots = dict(engine._slots)
        assert len(slots) == len(pool.plan.slots())  # every bucket bound at start
        made = engine.slot_allocations
        pointers = {
            b: {n: a.ctypes.data for n, a in {**s.inputs, **s.outputs}.items()} for b, s in slots.items()
        }
        rng = np.random.default_rng(5)
        batches = []
        for _ in range(12):
            lengths = rng.integers(1, 513, int(rng.integers(1, 5)))
            top = int(lengths.max())
            parts = [_request(rng, int(rng.integers(1, 5)), int(min(L, top))) for L in lengths]
            batches.append(parts)
        big = [_request(rng, 16, 500)]  # inputs 2 x 16 x 512 x 8 B = 128 KiB in the pool
        pool.submit(big, [16], True).result()  # first call of the thread's code paths
        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            outputs, _ = pool.submit(big, [16], True).result()
            peak = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
        # Only the answer's own memory (16 x 128 float32 = 8 KiB) and small objects: a per-call
        # copy of the padded batch would be 64 KiB per input.
        assert peak < 32 * 1024, f"{peak} bytes traced while running a pooled batch"
        np.testing.assert_allclose(
            outputs[0]["embedding"], reference.run(None, big[0])[0], rtol=RTOL, atol=ATOL
        )
        for parts in batches:
            pool.submit(parts, [p["input_ids"].shape[0] for p in parts], True).result()
        assert engine.slot_allocations == made
        assert engine._slots == slots  # the same slot objects...
        for b, s in engine._slots.items():  # ...over the same memory
            assert {n: a.ctypes.data for n, a in {**s.inputs, **s.outputs}.items()} == pointers[b]
        assert sum(s.runs for s in engine._slots.values()) > 12
    finally:
        pool.close()


def test_padding_waste_and_memory_are_reported(tmp_path):
    pool = _pool(tmp_path, warmup="none")
    try:
        rng = np.random.default_rng(6)
        parts = [_request(rng, 3, 20), _request(rng, 2, 30)]
        _, timing = pool.submit(parts, [3, 2], True).result()
        assert timing.bucket == (8, 32)
        assert (timing.rows, timing.padded_rows, timing.tokens, timing.padded_tokens) == (5, 8, 120, 256)
        assert timing.row_waste == pytest.approx(8 / 5) and timing.token_waste == pytest.approx(256 / 120)
        assert pool.padding() == {"rows": 5, "padded_rows": 8, "tokens": 120, "padded_tokens": 256}
        buffers = pool.buffer_memory()["encoder-test-cpu:0-0"]
        assert buffers["buckets"] == 39 and buffers["host_bytes"] > 0 and buffers["device_bytes"] == 0
        assert pool.device_memory() == {"cpu:0": buffers["host_bytes"]}
    finally:
        pool.close()


# -- the optimised-model cache --------------------------------------------------------------------


def _encoder_feeds() -> dict[str, np.ndarray]:
    return {
        "input_ids": np.arange(32, dtype=np.int64).reshape(2, 16),
        "attention_mask": np.ones((2, 16), np.int64),
    }


def test_optimised_models_are_cached_per_shape_and_reloaded(tmp_path):
    cache = tmp_path / "cache"
    factory = SessionFactory(ENCODER, "fp", Device("cpu"), cache_dir=cache)
    first = factory.create({"batch": 2, "seq": 16})
    assert (factory.misses, factory.hits) == (1, 0)
    files = list(cache.glob("*.onnx"))
    assert len(files) == 1 and files[0].name.startswith("encoder-fp")
    again = SessionFactory(ENCODER, "fp", Device("cpu"), cache_dir=cache)
    second = again.create({"batch": 2, "seq": 16})
    assert (again.misses, again.hits) == (0, 1)
    again.create({"batch": 4, "seq": 16})  # another bucket, another entry
    assert len(list(cache.glob("*.onnx"))) == 2
    SessionFactory(ENCODER, "other-model", Device("cpu"), cache_dir=cache).create({"batch": 2, "seq": 16})
    assert len(list(cache.glob("*.onnx"))) == 3  # the fingerprint is part of the key
    feeds = _encoder_feeds()
    np.testing.assert_array_equal(first.run(None, feeds)[0], second.run(None, feeds)[0])
    assert not list(cache.glob(".*tmp"))  # written under a temporary name, then renamed


def test_cpu_sessions_skip_the_slow_skip_layernorm_fusion(tmp_path):
    """ORT left alone fuses a residual Add + LayerNormalization (as in an INT8 variant's graph)
    into its CPU SkipLayerNormalization, several times slower (docs/engines.md); a worker's CPU
    session keeps the two ops."""
    from onnx import numpy_helper

    width = 64
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "r"], ["a"]),
         helper.make_node("LayerNormalization", ["a", "g", "b"], ["y"], axis=-1, epsilon=1e-12)],
        "residual", [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", "seq", width]) for n in "xr"],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.ones(width, np.float32), "g"), numpy_helper.from_array(np.zeros(width, np.float32), "b")],
    )  # fmt: skip
    model = tmp_path / "m" / "1" / "model.onnx"
    model.parent.mkdir(parents=True)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(model))
    plain = tmp_path / "plain.onnx"
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(plain)
    ort.InferenceSession(str(model), so, providers=["CPUExecutionProvider"])
    assert "SkipLayerNormalization" in {n.op_type for n in onnx.load(str(plain)).graph.node}
    factory = SessionFactory(model, "fp", Device("cpu"), cache_dir=tmp_path / "cache")
    sess = factory.create(None)
    [cached] = (tmp_path / "cache").glob("*.onnx")
    ops = {n.op_type for n in onnx.load(str(cached)).graph.node}
    assert "SkipLayerNormalization" not in ops and "LayerNormalization" in ops
    x = np.random.default_rng(0).standard_normal((2, 3, width)).astype(np.float32)
    assert sess.run(None, {"x": x, "r": x})[0].shape == (2, 3, width)


def test_a_broken_cache_file_is_rebuilt(tmp_path, caplog):
    cache = tmp_path / "cache"
    SessionFactory(ENCODER, "fp", Device("cpu"), cache_dir=cache).create(None)
    [path] = cache.glob("*.onnx")
    path.write_bytes(b"not an onnx model")
    factory = SessionFactory(ENCODER, "fp", Device("cpu"), cache_dir=cache)
    sess = factory.create(None)
    assert factory.misses == 1 and "rebuilding" in caplog.text
    assert sess.run(None, _encoder_feeds())[0].shape == (2, 128)
    assert path.stat().st_size > 1000


def test_an_unwritable_cache_dir_only_turns_the_cache_off(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    factory = SessionFactory(ENCODER, "fp", Device("cpu"), cache_dir=blocker / "engines")
    assert factory.cache_dir is None
    assert factory.create(None).run(None, _encoder_feeds())[0].shape == (2, 128)
    # Default dir: ~/.cache (here XDG_CACHE_HOME) when writable, else the temp dir.
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    (tmp_path / "tmp").mkdir()
    assert str(default_cache_dir()).startswith(str(tmp_path / "tmp"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "batchgate" / "engines"


# -- through a real server ------------------------------------------------------------------------


def _encoder_only_repo(tmp_path: Path, queue_delay_us: int) -> Path:
    """The bundled encoder alone, with a longer batching window so concurrent calls surely meet,
    and power-of-two length buckets (so 17..32 all fall in the bucket of 32)."""
    repo = tmp_path / "repo"
    shutil.copytree(REPO / "encoder", repo / "encoder")
    cfg = repo / "encoder" / "config.pbtxt"
    lines = [line for line in cfg.read_text().splitlines() if '"seq_buckets"' not in line]
    text = (
        "\n".join(lines)
        + '\nparameters { key: "seq_buckets" value { string_value: "16,32,64,128,256,512" } }\n'
    )
    assert "max_queue_delay_microseconds: 2000" in text
    cfg.write_text(
        text.replace("max_queue_delay_microseconds: 2000", f"max_queue_delay_microseconds: {queue_delay_us}")
    )
    return repo


def test_requests_of_different_lengths_share_padded_batches_through_the_server(tmp_path, reference):
    import tritonclient.grpc as tc

    # FIFO holds for the 100 ms timer unconditionally; the deadline policy may send a lone first
    # arrival at once when it expects nobody to join, which would make the merge timing-dependent.
    srv = start_server(
        tmp_path, repo=_encoder_only_repo(tmp_path, 100_000), env={"BATCHGATE_SCHEDULING_POLICY": "fifo"}
    )
    try:
        rng = np.random.default_rng(7)
        # 16 requests, every length different (17..32, 20 and 30 among them): with exact-shape
        # keys no two could merge; in bucket 32 they can.
        lengths = list(range(17, 33))
        rng.shuffle(lengths)
        jobs = [_request(rng, 1, int(n)) for n in lengths]

        async def run_all() -> list[np.ndarray]:
            client = tca.InferenceServerClient(srv.grpc_url)
            try:

                async def one(arrays):
                    inputs = []
                    for name, arr in arrays.items():
                        i = InferInput(name, list(arr.shape), "INT64")
                        i.set_data_from_numpy(arr)
                        inputs.append(i)
                    return (await client.infer("encoder", inputs)).as_numpy("embedding")

                return await asyncio.gather(*(one(a) for a in jobs))
            finally:
                await client.close()

        results = asyncio.run(run_all())
        for arrays, got in zip(jobs, results):
            want = reference.run(None, arrays)[0]  # ORT alone, on the request as sent
            assert got.shape == want.shape
            np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
        client = tc.InferenceServerClient(srv.grpc_url)
        stats = client.get_inference_statistics("encoder").model_stats[0]
        client.close()
        assert stats.inference_stats.success.count == len(jobs)
        assert stats.execution_count < len(jobs), (
            f"{stats.execution_count} executions for {len(jobs)} requests"
        )
        assert max(b.batch_size for b in stats.batch_stats) >= 2  # rows of different lengths, one batch
    finally:
        srv.stop()


# -- GPU (skipped without a device) -------------------------------------------------------------------


def needs_gpu(test):
    """Marked `gpu` (bench/gpu_check.py runs `pytest -m gpu`) and skipped without a device."""
    skip = pytest.mark.skipif(
        gpu_count() == 0, reason="no CUDA device usable by both onnxruntime-gpu and CuPy"
    )
    return pytest.mark.gpu(skip(test))


@needs_gpu
@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_gpu_buckets_answer_like_the_model_alone(tmp_path, reference, cuda_graphs):
    params = {"seq_buckets": "16,64,256", "batch_buckets": "1,8,32", "max_batch_tokens": "8192"}
    pool = _pool(tmp_path, params, device=Device("gpu", 0), cuda_graphs=cuda_graphs)
    try:
        engine = pool.workers[0].engine
        assert engine.device.kind == "gpu"
        assert _check_every_bucket(pool, reference, seed=8, tol=TF32) == len(pool.plan.slots())
        assert pool.device_memory()["gpu:0"] > 0
        assert pool.buffer_memory()[pool.workers[0].name]["device_bytes"] > 0
        if cuda_graphs:
            assert engine.cuda_graphs and engine.graph_slots == set(engine._slots)
    finally:
        pool.close()


@needs_gpu
def test_workers_per_gpu_each_have_their_own_stream(reference):
    # workers_per_device means N workers on each GPU, each with its own engine, CuPy stream and pool.
    pool = WorkerPool("x", ENCODER, [Device("gpu", 0)], 2, EngineOptions(), bucket_config({}, 8))
    pool.start()
    try:
        assert len(pool) == 2
        a, b = (w.engine for w in pool.workers)
        assert a._stream is not b._stream and a._cupy_pool is not b._cupy_pool
        rng = np.random.default_rng(3)
        ids = rng.integers(0, 1000, (3, 16), dtype=np.int64)
        parts = [{"input_ids": ids, "attention_mask": np.ones_like(ids)}]
        futures = [pool.submit(parts, [3], True) for _ in range(8)]
        want = reference.run(None, parts[0])[0]
        for f in futures:
            np.testing.assert_allclose(f.result()[0][0]["embedding"], want, rtol=TF32[0], atol=TF32[1])
    finally:
        pool.close()


def test_model_io_of_the_bundled_encoder():
    inputs, outputs = read_model_io(ENCODER)
    assert [(t.name, t.dims) for t in inputs] == [
        ("input_ids", ("batch", "seq")),
        ("attention_mask", ("batch", "seq")),
    ]
    assert [(t.name, t.dims) for t in outputs] == [("embedding", ("batch", 128))]


def test_a_plain_engine_without_a_plan_still_runs(reference):
    engine = Engine(ENCODER, Device("cpu"), EngineOptions())
    rng = np.random.default_rng(9)
    parts = [_request(rng, 2, 8), _request(rng, 1, 8)]
    outputs, timing = engine.run_batch(parts, [2, 1], True)
    assert timing.bucket is None and timing.rows == 3
    for part, out in zip(parts, outputs):
        np.testing.assert_allclose(out["embedding"], reference.run(None, part)[0], rtol=RTOL, atol=ATOL)


# -- the GPU data path, on the CPU, with a stand-in for CuPy -------------------------------------


@pytest.mark.parametrize(
    ("mode", "graphs", "dev"),
    [("auto", False, 0), ("auto", True, 1), ("shared", True, 0), ("shared", False, 1)],
)
def test_cuda_data_path_with_a_fake_cupy(tmp_path, reference, mode, graphs, dev):
    """Pinned host buffers -> device buffers bound by pointer -> run -> device -> host, checked on
    the CPU (tests/fake_cuda.py): every binding and every session's CUDA provider say the worker's
    device, every run is copies in, synchronise, run, copies out, synchronise on the engine's
    stream, and the answers are the CPU's (the fake's copies land only at a synchronise, as a stream's do)."""
    with FakeCuda(devices=2).installed() as fake:
        params = {"seq_buckets": "16,64", "batch_buckets": "1,4,16"}
        pool = _pool(tmp_path, params, device=Device("gpu", dev), mode=mode, cuda_graphs=graphs)
        try:
            engine = pool.workers[0].engine
            # auto: static for graphs; a GPU's warm-up runs every bucket (3 times for graph capture).
            assert engine.mode == ("static" if mode == "auto" and graphs else "shared")
            assert engine.graph_slots == (set(engine._slots) if graphs else set())
            assert all(s.runs == (3 if graphs else 1) for s in engine._slots.values())
            n_in, n_out = len(engine.input_names), len(engine.output_names)
            warm = fake.runs_in_order(engine._stream, n_in, n_out)
            assert warm == sum(s.runs for s in engine._slots.values())
            assert _check_every_bucket(pool, reference, seed=10) == len(pool.plan.slots()) == 8
            runs = fake.runs_in_order(engine._stream, n_in, n_out)
            assert runs == sum(s.runs for s in engine._slots.values()) == warm + 8
            if graphs and mode == "shared":  # a graph id per bucket; other shapes skip the graphs
                ids = {s.run_options.get_run_config_entry("gpu_graph_id") for s in engine._slots.values()}
                assert ids == {str(i) for i in range(8)}
                assert engine._no_graph.get_run_config_entry("gpu_graph_id") == "-1"
            # Each slot binds each input and output once, on the worker's device.
            assert len(fake.binds) == len(engine._slots) * (n_in + n_out)
            assert {(t, i, on) for _, _, t, i, on in fake.binds} == {("cuda", dev, dev)}
            # ... and every session runs on that device too (ORT's device_id), not on GPU 0.
            assert fake.session_devices and set(fake.session_devices) == {dev}
            host, dev_bytes = engine.buffer_bytes()
            assert dev_bytes == engine._cupy_pool.used_bytes() > 0 and host > 0  # all from the pool
            gpu = f"gpu:{dev}"
            assert pool.device_memory() == {gpu: 2 << 30}  # the driver's used = total - free
            # batchgate_device_memory_bytes{device,pool}: the same figures, by memory pool.
            mem = {(gpu, "io_buffers"): dev_bytes, (gpu, "pinned_host"): host, (gpu, "driver_used"): 2 << 30}
            assert pool.memory_by_pool() == mem
        finally:
            pool.close()


def test_fixed_shape_batches_answer_each_request_like_the_model_alone(tmp_path):
    """ranker (no variable dim): the parts go into the pooled buffer in one copy per input and
    each answer is a view of one copy of the output, cut at the request's rows; padding rows
    (a batch under its bucket) and a batch past the largest bucket (run in pieces) included."""
    model = REPO / "ranker" / "1" / "model.onnx"
    reference = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    options = EngineOptions(cache_dir=tmp_path / "engines")
    pool = WorkerPool("ranker-test", model, [Device("cpu")], 1, options, bucket_config({}, 256, (64, 128)))
    pool.start()
    try:
        assert pool.plan.pooled and not pool.plan.groups
        rng = np.random.default_rng(3)
        for sizes in ([1], [3], [1, 2, 1], [5, 1, 7, 2], [200, 56], [256, 256, 3]):
            parts = [
                {
                    "dense": rng.standard_normal((n, 64)).astype(np.float32),
                    "sparse_ids": rng.integers(0, 10000, (n, 8), dtype=np.int64),
                }
                for n in sizes
            ]
            outputs, timing = pool.submit(parts, sizes, True).result(timeout=60)
            assert timing.rows == sum(sizes) and len(outputs) == len(parts)
            for part, out in zip(parts, outputs):
                want = reference.run(None, part)[0]
                assert out["score"].shape == want.shape
                np.testing.assert_allclose(out["score"], want, rtol=RTOL, atol=ATOL)
    finally:
        pool.close()


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="Linux /proc only")
def test_worker_threads_carry_their_name_at_the_os_level(tmp_path):
    """top -H, /proc/PID/task/*/comm and bench.goodput's per-thread CPU tell the model's workers
    from gRPC's threads and the event loop: the worker names its OS thread bg:<worker>."""
    pool = _pool(tmp_path)
    try:
        comms = {p.read_text().strip() for p in Path("/proc/self/task").glob("*/comm")}
        want = ("bg:" + pool.workers[0].name)[:15]  # Linux keeps 15 bytes of a thread's name
        assert want in comms, comms
    finally:
        pool.close()
