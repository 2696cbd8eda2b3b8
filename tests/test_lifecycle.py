"""Whole-process behaviour: repositories with broken or config-less models, the first-run build of
the bundled models, a worker exception, and SIGTERM under load."""

from __future__ import annotations

import shutil
import signal
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException

from tests.conftest import REPO, start_server


def _copy_model(src: str, dst_repo: Path, name: str | None = None, config: str | None = None) -> Path:
    dst = dst_repo / (name or src)
    (dst / "1").mkdir(parents=True)
    shutil.copy(REPO / src / "1" / "model.onnx", dst / "1" / "model.onnx")
    if config is not None:
        (dst / "config.pbtxt").write_text(config)
    return dst


def _ranker_inputs(rows: int, ids_value: int = 1, seed: int = 0) -> list[tc.InferInput]:
    rng = np.random.default_rng(seed)
    dense = tc.InferInput("dense", [rows, 64], "FP32")
    dense.set_data_from_numpy(rng.standard_normal((rows, 64), dtype=np.float32))
    ids = tc.InferInput("sparse_ids", [rows, 8], "INT64")
    ids.set_data_from_numpy(np.full((rows, 8), ids_value, np.int64))
    return [dense, ids]


def test_broken_models_are_reported_and_the_rest_serve(tmp_path):
    repo = tmp_path / "repo"
    _copy_model(
        "ranker", repo, "good", (REPO / "ranker" / "config.pbtxt").read_text().replace('"ranker"', '"good"')
    )
    _copy_model("ranker", repo, "typo", 'name: "typo"\nmax_batch_size: 8\nbogus_field: 1\n')
    _copy_model("ranker", repo, "seq", 'name: "seq"\nmax_batch_size: 8\nsequence_batching { }\n')
    _copy_model("ranker", repo, "wrongtype", 'name: "wrongtype"\nmax_batch_size: 8\n'
                'input [ { name: "dense" data_type: TYPE_FP64 dims: [ 64 ] }, '
                '{ name: "sparse_ids" data_type: TYPE_INT64 dims: [ 8 ] } ]\n')  # fmt: skip
    _copy_model(
        "ranker", repo, "hinted", 'name: "hinted"\nmax_batch_size: 8\noptimization { graph { level: 1 } }\n'
    )
    srv = start_server(tmp_path, repo=repo)
    try:
        client = tc.InferenceServerClient(srv.grpc_url)
        assert client.is_model_ready("good")
        assert client.is_model_ready("hinted")  # a tuning hint is ignored, by name, in the log
        assert "config field 'optimization' is not implemented by batchgate and is ignored" in srv.log()
        index = {m.name: m for m in client.get_model_repository_index().models}
        for name, words in {
            "typo": ["bogus_field"],
            "seq": ["sequence_batching", "not supported"],
            "wrongtype": ["dense", "TYPE_FP64", "FP64", "FP32"],
        }.items():
            assert not client.is_model_ready(name)
            assert index[name].state == "UNAVAILABLE"
            for w in words:
                if w in index[name].reason:
                    break
            else:
                raise AssertionError(f"{name}: reason {index[name].reason!r} names none of {words}")
        with pytest.raises(InferenceServerException) as err:
            client.infer("typo", _ranker_inputs(1))
        assert err.value.status() == "StatusCode.UNAVAILABLE" and "bogus_field" in err.value.message()
        assert client.infer("good", _ranker_inputs(3)).as_numpy("score").shape == (3, 1)
    finally:
        assert srv.stop() == 0


def test_model_without_config_is_completed_from_the_onnx_file(tmp_path):
    repo = tmp_path / "repo"
    _copy_model("ranker", repo, "bare")
    srv = start_server(tmp_path, "--no-build-models", repo=repo)
    try:
        client = tc.InferenceServerClient(srv.grpc_url)
        cfg = client.get_model_config("bare").config
        assert cfg.max_batch_size == 64  # default for a model whose first dims are all dynamic
        assert [(i.name, list(i.dims)) for i in cfg.input] == [("dense", [64]), ("sparse_ids", [8])]
        assert [(o.name, list(o.dims)) for o in cfg.output] == [("score", [1])]
        assert client.infer("bare", _ranker_inputs(2)).as_numpy("score").shape == (2, 1)
    finally:
        srv.stop()


def test_first_serve_builds_the_bundled_models(tmp_path):
    srv = start_server(tmp_path, repo=tmp_path / "fresh-repo", ready_timeout=120)
    try:
        client = tc.InferenceServerClient(srv.grpc_url)
        assert client.is_model_ready("ranker") and client.is_model_ready("encoder")
        built = (tmp_path / "fresh-repo" / "ranker" / "1" / "model.onnx").read_bytes()
        assert built == (REPO / "ranker" / "1" / "model.onnx").read_bytes()  # same seeds, same bytes
    finally:
        srv.stop()


def test_worker_exception_fails_only_its_request(tmp_path):
    """Without the input_range guard, an out-of-range id makes onnxruntime's Gather fail: the
    caller gets INTERNAL naming the model, and the worker goes on serving. (A failing batch of
    several requests is split until the failing one is alone: tests/test_faults.py.)"""
    repo = tmp_path / "repo"
    cfg = (REPO / "ranker" / "config.pbtxt").read_text()
    cfg = "\n".join(line for line in cfg.splitlines() if not line.startswith("parameters"))
    cfg = cfg.replace("max_queue_delay_microseconds: 2000", "max_queue_delay_microseconds: 0")
    _copy_model("ranker", repo, config=cfg)
    srv = start_server(tmp_path, "--workers-per-device", "1", repo=repo)
    try:
        client = tc.InferenceServerClient(srv.grpc_url)
        with pytest.raises(InferenceServerException) as err:
            client.infer("ranker", _ranker_inputs(2, ids_value=50_000))
        assert err.value.status() == "StatusCode.INTERNAL"
        assert "ranker" in err.value.message() and "failed to execute" in err.value.message()
        for _ in range(3):  # the same worker keeps serving
            assert client.infer("ranker", _ranker_inputs(4)).as_numpy("score").shape == (4, 1)
        st = client.get_inference_statistics("ranker").model_stats[0]
        assert st.inference_stats.fail.count == 1 and st.inference_stats.success.count == 3
    finally:
        srv.stop()


def test_sigterm_under_load_loses_no_accepted_request(tmp_path):
    srv = start_server(tmp_path)
    outcomes: list[str] = []
    lock = threading.Lock()
    stop = threading.Event()

    def client_loop(seed: int) -> None:
        client = tc.InferenceServerClient(srv.grpc_url)
        i = 0
        while not stop.is_set():
            i += 1
            try:
                r = client.infer("ranker", _ranker_inputs(4, seed=seed * 1000 + i), client_timeout=20)
                ok = r.as_numpy("score").shape == (4, 1)
                outcome = "ok" if ok else "bad-shape"
            except InferenceServerException as exc:
                outcome = exc.status() or "none"
                if "UNAVAILABLE" in outcome:
                    outcome = "unavailable"
                else:
                    outcome = f"{outcome}: {exc.message()}"
            with lock:
                outcomes.append(outcome)
            if outcome == "unavailable":
                return  # as a real caller would: this replica is going away, use another one

    threads = [threading.Thread(target=client_loop, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    time.sleep(1.5)
    served_before = len(outcomes)
    code = srv.stop(signal.SIGTERM)
    stop.set()
    for t in threads:
        t.join(30)
        assert not t.is_alive(), "a client hung"
    assert code == 0, srv.log()
    assert served_before > 50, f"load too light to mean anything: {served_before}"
    unexpected = [o for o in outcomes if o not in ("ok", "unavailable")]
    assert not unexpected, unexpected[:5]
    log = srv.log()
    assert "draining" in log and log.index("draining") < log.index("stopped")


def test_sigint_exits_cleanly_when_idle(tmp_path):
    srv = start_server(tmp_path)
    assert srv.stop(signal.SIGINT) == 0
    with grpc.insecure_channel(srv.grpc_url) as ch:
        with pytest.raises(grpc.FutureTimeoutError):
            grpc.channel_ready_future(ch).result(timeout=0.5)
