"""Model reload and unload (Triton's RepositoryModelLoad / RepositoryModelUnload), live.

A reload re-reads the model's directory, starts and warms the new runtime beside the serving one
and swaps it in; a reload that fails (corrupt model file, broken config.pbtxt) answers
FAILED_PRECONDITION with the reason and leaves the previous load serving and READY. Calls running
during a reload are all answered by one runtime or the other.
"""

from __future__ import annotations

import shutil
import threading

import numpy as np
import pytest
import tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException

from tests.conftest import REPO, start_server

CONTROL = {"BATCHGATE_MODEL_CONTROL": "true"}  # load/unload are off unless enabled


def _inputs(rows: int, seed: int) -> list[tc.InferInput]:
    rng = np.random.default_rng(seed)
    dense = tc.InferInput("dense", [rows, 64], "FP32")
    dense.set_data_from_numpy(rng.standard_normal((rows, 64), dtype=np.float32))
    ids = tc.InferInput("sparse_ids", [rows, 8], "INT64")
    ids.set_data_from_numpy(rng.integers(0, 10_000, (rows, 8), dtype=np.int64))
    return [dense, ids]


def _status(exc: InferenceServerException) -> str:
    return (exc.status() or "").replace("StatusCode.", "")


@pytest.fixture
def served(tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(REPO / "ranker", repo / "ranker")
    srv = start_server(tmp_path, "--workers-per-device", "1", repo=repo, env=CONTROL)
    client = tc.InferenceServerClient(srv.grpc_url)
    yield srv, client, repo / "ranker"
    client.close()
    assert srv.stop() == 0


def _serving(client: tc.InferenceServerClient) -> None:
    assert client.is_model_ready("ranker")
    assert client.infer("ranker", _inputs(3, 7)).as_numpy("score").shape == (3, 1)
    index = {(m.name, m.version): m.state for m in client.get_model_repository_index().models}
    assert index == {("ranker", "1"): "READY"}


def test_failed_reload_keeps_the_previous_version_serving(served):
    srv, client, model_dir = served
    good_model = (model_dir / "1" / "model.onnx").read_bytes()
    good_cfg = (model_dir / "config.pbtxt").read_text()
    assert client.get_model_config("ranker").config.max_batch_size == 256

    # A corrupt model file.
    (model_dir / "1" / "model.onnx").write_bytes(b"\x08\x07 definitely not onnx " * 50)
    with pytest.raises(InferenceServerException) as err:
        client.load_model("ranker")
    assert _status(err.value) == "FAILED_PRECONDITION"
    assert "ranker" in err.value.message() and "model.onnx" in err.value.message()
    assert "previous load keeps serving" in err.value.message()
    _serving(client)

    # A config.pbtxt that does not parse; then one that parses but asks for an unsupported field.
    (model_dir / "1" / "model.onnx").write_bytes(good_model)
    (model_dir / "config.pbtxt").write_text(good_cfg.replace("max_batch_size: 256", "max_batch_size: [oops"))
    with pytest.raises(InferenceServerException) as err:
        client.load_model("ranker")
    assert _status(err.value) == "FAILED_PRECONDITION" and "config.pbtxt" in err.value.message()
    _serving(client)
    (model_dir / "config.pbtxt").write_text(good_cfg + "\nsequence_batching { }\n")
    with pytest.raises(InferenceServerException) as err:
        client.load_model("ranker")
    assert _status(err.value) == "FAILED_PRECONDITION" and "sequence_batching" in err.value.message()
    _serving(client)
    assert client.get_model_config("ranker").config.max_batch_size == 256  # still the first load
    assert srv.log().count("reload of model ranker failed; version(s) ['1'] keep serving") == 3

    # Fixed, with a change: the new config is what serves.
    (model_dir / "config.pbtxt").write_text(good_cfg.replace("max_batch_size: 256", "max_batch_size: 128"))
    client.load_model("ranker")
    assert client.get_model_config("ranker").config.max_batch_size == 128
    _serving(client)
    with pytest.raises(InferenceServerException) as err:  # validated against the new config
        client.infer("ranker", _inputs(200, 1))
    assert _status(err.value) == "INVALID_ARGUMENT"
    assert "reloaded model ranker" in srv.log()


def test_reload_under_load_answers_every_call(served):
    srv, client, _ = served
    outcomes: list[str] = []
    stop = threading.Event()

    def loop(seed: int) -> None:
        c = tc.InferenceServerClient(srv.grpc_url)
        i = 0
        while not stop.is_set():
            i += 1
            try:
                ok = c.infer("ranker", _inputs(4, seed * 10_000 + i), client_timeout=30).as_numpy(
                    "score"
                ).shape == (4, 1)
                outcomes.append("ok" if ok else "bad-shape")
            except InferenceServerException as exc:
                outcomes.append(f"{_status(exc)}: {exc.message()}")
        c.close()

    threads = [threading.Thread(target=loop, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    try:
        for _ in range(3):
            client.load_model("ranker")
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert len(outcomes) > 20, "load too light to mean anything"
    bad = [o for o in outcomes if o != "ok"]
    assert not bad, bad[:5]
    assert srv.log().count("reloaded model ranker") == 3


def test_unload_then_load(served):
    _, client, _ = served
    client.unload_model("ranker")
    assert not client.is_model_ready("ranker")
    with pytest.raises(InferenceServerException) as err:
        client.infer("ranker", _inputs(1, 0))
    assert _status(err.value) == "NOT_FOUND"
    with pytest.raises(InferenceServerException) as err:
        client.unload_model("ranker")
    assert _status(err.value) == "NOT_FOUND"
    client.load_model("ranker")
    _serving(client)


def test_load_refusals_name_the_problem(served):
    _, client, _ = served
    with pytest.raises(InferenceServerException) as err:
        client.load_model("nosuchmodel")
    assert _status(err.value) == "NOT_FOUND" and "nosuchmodel" in err.value.message()
    with pytest.raises(InferenceServerException) as err:
        client.load_model("../ranker")
    assert _status(err.value) == "NOT_FOUND"
    with pytest.raises(InferenceServerException) as err:  # Triton's inline config override
        client.load_model("ranker", config='{"max_batch_size": 8}')
    assert _status(err.value) == "UNIMPLEMENTED" and "config" in err.value.message()
    _serving(client)


def test_loading_a_model_that_failed_at_start(tmp_path):
    """A model broken at start is UNAVAILABLE with its reason; fixed and loaded, it serves."""
    repo = tmp_path / "repo"
    shutil.copytree(REPO / "ranker", repo / "ranker")
    good_model = (repo / "ranker" / "1" / "model.onnx").read_bytes()
    (repo / "ranker" / "1" / "model.onnx").write_bytes(b"garbage")
    srv = start_server(tmp_path, "--workers-per-device", "1", repo=repo, env=CONTROL)
    client = tc.InferenceServerClient(srv.grpc_url)
    try:
        assert not client.is_model_ready("ranker")
        (repo / "ranker" / "1" / "model.onnx").write_bytes(good_model)
        client.load_model("ranker")
        _serving(client)
    finally:
        client.close()
        assert srv.stop() == 0
