"""The performance benches (issue 15): the no-op yardstick server, the per-call CPU profile, the
process hand-off prototype, N processes on one port, and the quick bench's collapse guard.
Real processes on loopback, real clients (tritonclient against the no-op), short runs."""

from __future__ import annotations

import asyncio
import json
import os
import shutil

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tgrpc
from batchgate.bench import quick
from batchgate.bench.loadgen import Workload, model_statistics, served_from, start_noop
from batchgate.proto.inference.v2 import grpc_service_pb2 as pb
from batchgate.proto.inference.v2 import grpc_service_pb2_grpc as pb_grpc
from lab import handoff, perf_analyzer, profile, reuseport

# Not serial but for the loop-turn count: every other bound is a count or a share, not a time.


@pytest.fixture(scope="module")
def noop():
    srv = start_noop()
    srv.ready(30)
    yield srv
    srv.stop()


def test_noop_answers_unary_and_stream_and_counts_them(noop):
    reqs = Workload("ranker", rows=3, variants=4).requests()

    async def go() -> tuple[pb.ModelInferResponse, list[pb.ModelStreamInferResponse], dict, dict]:
        before = await model_statistics(noop.url, "ranker")
        async with grpc.aio.insecure_channel(noop.url) as ch:
            stub = pb_grpc.GRPCInferenceServiceStub(ch)
            unary = await stub.ModelInfer(reqs[0], timeout=5)
            ids = [f"m{i}" for i in range(4)]

            async def messages():
                for rid, r in zip(ids, reqs):
                    m = pb.ModelInferRequest()
                    m.CopyFrom(r)
                    m.id = rid
                    yield m

            answers = [a async for a in stub.ModelStreamInfer(messages(), timeout=5)]
        after = await model_statistics(noop.url, "ranker")
        return unary, answers, before, after

    unary, answers, before, after = asyncio.run(go())
    assert list(unary.outputs[0].shape) == [3, 1] and len(unary.raw_output_contents[0]) == 3 * 4
    assert [a.infer_response.id for a in answers] == ["m0", "m1", "m2", "m3"]  # in order, ids echoed
    assert all(not a.error_message and list(a.infer_response.outputs[0].shape) == [3, 1] for a in answers)
    assert after["requests"] - before["requests"] == 5


def test_noop_describes_ranker_to_the_stock_triton_client(noop):
    client = tgrpc.InferenceServerClient(noop.url)
    meta = client.get_model_metadata("ranker", as_json=True)
    assert [(i["name"], i["datatype"], i["shape"]) for i in meta["inputs"]] == [
        ("dense", "FP32", ["-1", "64"]),
        ("sparse_ids", "INT64", ["-1", "8"]),
    ]
    cfg = client.get_model_config("ranker", as_json=True)["config"]
    assert cfg["max_batch_size"] == 256 and [o["name"] for o in cfg["output"]] == ["score"]
    inputs = [tgrpc.InferInput("dense", [2, 64], "FP32"), tgrpc.InferInput("sparse_ids", [2, 8], "INT64")]
    inputs[0].set_data_from_numpy(np.ones((2, 64), np.float32))
    inputs[1].set_data_from_numpy(np.ones((2, 8), np.int64))
    assert client.infer("ranker", inputs).as_numpy("score").shape == (2, 1)
    client.close()


# -- the profile's stage attribution ------------------------------------------------------------

_LOOP = [
    "<module> (gateway/__main__.py:5)",
    "main (gateway/cli.py:80)",
    "run (asyncio/runners.py:190)",
    "BaseEventLoop.run_forever (asyncio/base_events.py:607)",
    "BaseEventLoop._run_once (asyncio/base_events.py:1922)",
    "Handle._run (asyncio/events.py:80)",
]


def test_stage_is_the_innermost_frame_of_our_code_below_the_loop():
    codec = [*_LOOP, "ModelInfer (gateway/transport/server.py:200)", "decode (gateway/codec.py:50)",
             "FromString (google/protobuf/message.py:1)"]  # fmt: skip
    assert profile.stage_of(codec) == "codec"
    assert profile.stage_of([*_LOOP, "submit (gateway/scheduling/scheduler.py:10)"]) == "scheduler"
    # Our entry point (cli.py) above the loop's dispatch is not a stage: the loop runs there.
    assert profile.stage_of(_LOOP) == "loop callbacks in C (grpc.aio cython, protobuf)"
    assert profile.stage_of(_LOOP[:5] + ["EpollSelector.select (selectors.py:468)"]) == (
        "asyncio loop (select, _run_once)"
    )
    worker = ["Thread._bootstrap (threading.py:1002)", "_main (workers/pool.py:90)",
              "run (onnxruntime/capi/onnxruntime_inference_collection.py:220)"]  # fmt: skip
    assert profile.stage_of(worker) == "onnxruntime (run)"
    assert profile.stage_of(worker[:2]) == "workers (engine, buffers, pool)"


def test_raw_py_spy_output_is_split_by_thread_and_stage(tmp_path):
    raw = tmp_path / "p.raw"
    raw.write_text(
        "thread (101): MainThread;" + ";".join([*_LOOP, "decode (gateway/codec.py:50)"]) + " 7\n"
        "thread (101): MainThread;" + ";".join(_LOOP) + " 3\n"
        "thread (0x66): ranker-v1-cpu:0-0;Thread.run (threading.py:982);_main (workers/pool.py:90) 5\n"
    )
    stages, names = profile.parse_raw(str(raw))
    assert stages[101] == {"codec": 7, "loop callbacks in C (grpc.aio cython, protobuf)": 3}
    assert stages[0x66] == {"workers (engine, buffers, pool)": 5}
    assert names == {101: "MainThread", 0x66: "ranker-v1-cpu:0-0"}
    w = profile.Window(calls=1000, threads_s={101: 0.2, 0x66: 0.01, 7: 0.005})
    table = profile.stage_table(w, profile.Window(stages=stages), {**names, 7: "event_engine"})
    got = {(t, s): round(us, 1) for t, s, us in table}
    # 200 µs/call on the loop thread split 7:3; threads without samples keep their /proc figure.
    assert got == {
        ("MainThread", "codec"): 140.0,
        ("MainThread", "loop callbacks in C (grpc.aio cython, protobuf)"): 60.0,
        ("ranker-v1-cpu:0-0", "workers (engine, buffers, pool)"): 10.0,
        ("event_engine", "(grpc C core: no Python frames)"): 5.0,
    }


def test_profile_measures_server_cpu_per_call_of_the_noop(tmp_path):
    out = tmp_path / "p.json"
    rc = profile.main(["--targets", "noop", "--apis", "unary,stream", "--calls", "1500", "--concurrency", "8",
                       "--no-py-spy", "--json", str(out)])  # fmt: skip
    assert rc == 0
    points = {p["api"]: p for p in json.loads(out.read_text())}
    for api in ("unary", "stream"):
        p = points[api]
        assert p["calls"] == 1500 and p["errors"] == 0
        # A grpc.aio call costs tens to hundreds of µs of CPU; 0 would mean the server's CPU was not read.
        assert 10 < p["server_cpu_us_per_call"] < 5000
        # The live threads' figures add up to the process's, within the rounding of each thread's
        # clock ticks (1/CLK_TCK s each, spread over the window's calls); grpc's core may end a
        # thread mid-window, whose time stays in the process's figure only.
        tick_us = 1e6 / os.sysconf("SC_CLK_TCK") / p["calls"]
        slack = 2 * tick_us * (len(p["threads_us_per_call"]) + 1)
        threads = sum(p["threads_us_per_call"].values())
        assert 0.5 * p["server_cpu_us_per_call"] - slack <= threads <= p["server_cpu_us_per_call"] + slack


@pytest.mark.serial  # a busy machine batches completions into fewer loop turns per call
def test_loop_turns_are_counted_per_call(tmp_path):
    out = tmp_path / "p.json"
    rc = profile.main(["--targets", "noop", "--apis", "unary,stream", "--calls", "1000", "--concurrency", "8",
                       "--no-py-spy", "--loop-turns", "--json", str(out)])  # fmt: skip
    assert rc == 0
    loops = {p["api"]: p["loop_per_call"] for p in json.loads(out.read_text())}
    # grpc.aio wakes the loop per completion: a few turns per unary call, fewer per stream message.
    assert 1 <= loops["unary"]["turns"] <= 10 and loops["unary"]["callbacks"] >= loops["unary"]["turns"]
    assert 0 < loops["stream"]["turns"] <= loops["unary"]["turns"]


def _may_ptrace() -> bool:
    scope = "/proc/sys/kernel/yama/ptrace_scope"
    return os.geteuid() == 0 or not os.path.exists(scope) or open(scope).read().strip() == "0"


@pytest.mark.skipif(not profile._pyspy() or not _may_ptrace(), reason="py-spy or ptrace rights missing")
def test_profile_with_py_spy_attributes_the_noop_loop_thread(tmp_path):
    out = tmp_path / "p.json"
    assert profile.main(["--targets", "noop", "--apis", "unary", "--calls", "3000", "--json", str(out)]) == 0
    (p,) = json.loads(out.read_text())
    stages = p["top_stages_us_per_call"]
    loop_stages = [s for s in stages if "loop" in s or s == "transport"]
    assert loop_stages and sum(stages[s] for s in loop_stages) > 10  # the loop thread's share was sampled
    assert all(s["us_per_call"] >= 0 for s in p["stages_us_per_call"])


# -- hand-off prototype -------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [1, 64])
def test_handoff_round_trips_rows_through_shared_memory(rows):
    # Each mode checks the engine's scores against the rows it was handed (AssertionError if not).
    for r in (
        handoff.pingpong(400, rows),
        handoff.asyncio_mode(400, rows, 4),
        handoff.thread_mode(400, rows, 4),
    ):
        assert r["rows"] == rows and r["handoffs"] == 400
        assert r["wall_us_per_handoff_loaded_machine"] > 0 and r["total_cpu_us_per_handoff"] >= 0


def test_two_noop_processes_share_one_port_and_both_answer():
    servers = reuseport.start("noop", 2)
    try:
        r = asyncio.run(
            reuseport.measure(servers[0].url, [s.proc.pid for s in servers], "unary", 2000, 16, 16)
        )
    finally:
        for s in servers:
            s.stop()
    assert r["errors"] == 0 and r["calls"] == 2000
    # 16 connections spread by the kernel's SO_REUSEPORT hash: each process got some of them
    # (all on one has probability 2 * 2**-16).
    assert min(r["cpu_share_per_process"]) > 0.05


# -- quick bench guard, perf_analyzer helpers ---------------------------------------------------


def test_quick_fails_only_on_a_collapse():
    assert quick.verdict({"unary": 0.62, "stream": 0.9}, 0.3) == (True, "ok")
    ok, text = quick.verdict({"unary": 0.62, "stream": 0.2}, 0.3)
    assert not ok and "stream" in text and "unary" not in text
    assert not quick.verdict({"unary": float("nan")}, 0.3)[0]


def test_perf_analyzer_output_parse_and_input_data(tmp_path):
    out = (
        "Request concurrency: 64\n  Client: \n    Request count: 1000\n    Throughput: 3609.5 infer/sec\n"
        "    p50 latency: 17000 usec\n    p90 latency: 21000 usec\n    p99 latency: 30500 usec\n"
        "    Avg latency: 17500 usec (standard deviation 100 usec)\n"
    )
    assert perf_analyzer.parse(out) == {
        "throughput_infer_per_s": 3609.5, "avg_latency_us": 17500,
        "p50_us": 17000, "p90_us": 21000, "p99_us": 30500,
    }  # fmt: skip
    data = json.loads(perf_analyzer.input_data(tmp_path / "d.json", variants=8).read_text())["data"]
    assert len(data) == 8 and len({tuple(d["sparse_ids"]["content"]) for d in data}) == 8
    assert all(0 <= v < 10_000 for d in data for v in d["sparse_ids"]["content"])
    assert all(len(d["dense"]["content"]) == 64 for d in data)


@pytest.mark.skipif(
    not shutil.which("perf_analyzer") and not os.environ.get("PERF_ANALYZER_LIBS"),
    reason="perf_analyzer not installed (python -m lab.perf_analyzer --setup-libs DIR, then "
    "PERF_ANALYZER_LIBS=DIR)",
)
def test_perf_analyzer_runs_against_the_noop(tmp_path):
    out = tmp_path / "pa.json"
    rc = perf_analyzer.main(["--targets", "noop", "--apis", "unary", "--concurrency", "8",
                             "--interval-ms", "500",
                             "--json", str(out)])  # fmt: skip
    (r,) = json.loads(out.read_text())
    assert rc == 0 and r["throughput_infer_per_s"] > 0 and r["server_cpu_us_per_request"] > 0


def test_suspending_noop_still_answers_every_request(tmp_path):
    out = tmp_path / "p.json"
    rc = profile.main(["--targets", "noop-suspend", "--apis", "unary,stream", "--calls", "800",
                       "--concurrency", "8", "--no-py-spy", "--json", str(out)])  # fmt: skip
    assert rc == 0
    for p in json.loads(out.read_text()):
        assert p["target"] == "noop-suspend" and p["calls"] == 800 and p["errors"] == 0


def test_batching_noop_answers_with_the_rankers_own_scores_in_batches():
    """bench/noop_server.py --batch, the floor of a dynamic batcher: each request's rows scored by
    ONNX Runtime on the bundled ranker (the same scores the model gives alone), over unary calls
    and a read-ahead stream, with concurrent calls sharing batches."""
    import onnxruntime as ort

    from batchgate.bench.loadgen import ROOT, start_target

    reqs = Workload("ranker", rows=3, variants=8).requests()
    sess = ort.InferenceSession(str(ROOT / "model_repository/ranker/1/model.onnx"))

    def expected(r: pb.ModelInferRequest) -> np.ndarray:
        dense = np.frombuffer(r.raw_input_contents[0], np.float32).reshape(-1, 64)
        ids = np.frombuffer(r.raw_input_contents[1], np.int64).reshape(-1, 8)
        return sess.run(None, {"dense": dense, "sparse_ids": ids})[0]

    srv = start_target("noop-batch")
    try:
        srv.ready(60)

        async def go():
            async with grpc.aio.insecure_channel(srv.url) as ch:
                stub = pb_grpc.GRPCInferenceServiceStub(ch)
                unary = await asyncio.gather(*(stub.ModelInfer(r, timeout=10) for r in reqs))

                async def messages():
                    for i, r in enumerate(reqs):
                        m = pb.ModelInferRequest()
                        m.CopyFrom(r)
                        m.id = f"m{i}"
                        yield m

                streamed = [a.infer_response async for a in stub.ModelStreamInfer(messages(), timeout=10)]
                stats = await model_statistics(srv.url, "ranker")
            return unary, streamed, stats

        unary, streamed, stats = asyncio.run(go())
    finally:
        srv.stop()
    for r, a in zip(reqs, unary):
        got = np.frombuffer(a.raw_output_contents[0], np.float32).reshape(list(a.outputs[0].shape))
        np.testing.assert_allclose(got, expected(r), rtol=1e-5)
    assert sorted(a.id for a in streamed) == [f"m{i}" for i in range(len(reqs))]
    for a in streamed:
        r = reqs[int(a.id[1:])]
        got = np.frombuffer(a.raw_output_contents[0], np.float32).reshape(list(a.outputs[0].shape))
        np.testing.assert_allclose(got, expected(r), rtol=1e-5)
    assert stats["requests"] == 2 * len(reqs)


def test_a_before_after_run_serves_the_tree_it_names(tmp_path):
    """lab.text_cpu --tree, lab.rest_percall --before and lab.loop_calls start servers in this
    checkout's root with another tree on PYTHONPATH. ``python -m`` puts the working directory
    first on sys.path, and the root's batchgate/ folder then shadowed the other tree: both sides of
    a before/after run were this checkout."""
    from lab.text_cpu import ROOT, pkg_root, serving_tree

    tree = tmp_path / "other"
    (tree / "batchgate").mkdir(parents=True)
    (tree / "batchgate" / "__init__.py").write_text("")
    for name in ("bench", "cache", "client", "gateway", "proto", "workers"):
        (tree / name).mkdir()
    (tree / "gateway" / "__init__.py").write_text("")
    pkg = pkg_root(tree)
    try:
        with serving_tree(pkg):
            assert served_from() == (tree / "gateway").resolve()
        with serving_tree(pkg_root(ROOT)):
            assert served_from() == (ROOT / "gateway").resolve()
    finally:
        shutil.rmtree(pkg)
