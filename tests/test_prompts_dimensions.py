"""Prompts and Matryoshka ``dimensions`` on a live server, with a model made by ``batchgate
prepare-model`` (tests/test_prepare_model.py: ``bert_mean`` declares the prompts ``query`` =
"query: " and ``passage`` = ""): a prompt changes the vector exactly as prefixing the text would,
on every route and through the per-row cache; ``dimensions`` cuts and re-normalises where the
model declares the size, and is refused by name elsewhere."""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as tc

from tests.conftest import start_server
from tests.test_prepare_model import folders, repo  # noqa: F401  (module fixtures)

TEXT = "rivers flood villages after rain"


@pytest.fixture(scope="module")
def served(repo, tmp_path_factory):  # noqa: F811
    """bert_mean as prepared, a cached twin with a default prompt and Matryoshka sizes."""
    root = tmp_path_factory.mktemp("prompts")
    r = root / "repo"
    shutil.copytree(repo / "bert_mean", r / "bert_mean")
    twin = r / "bert_twin"
    shutil.copytree(repo / "bert_mean", twin)
    cfg = (twin / "config.pbtxt").read_text().replace('name: "bert_mean"', 'name: "bert_twin"')
    cfg += 'parameters { key: "default_prompt_name" value { string_value: "query" } }\n'
    cfg += 'parameters { key: "matryoshka_dimensions" value { string_value: "8,16" } }\n'
    cfg += "response_cache { enable: true }\n"
    (twin / "config.pbtxt").write_text(cfg)
    srv = start_server(root, "--no-build-models", repo=r, ready_timeout=120)
    yield srv
    srv.stop()


def post(srv, path: str, body: dict) -> tuple[int, object]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{srv.http_port}{path}", data=json.dumps(body).encode(), method="POST",
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def openai(srv, model: str, text: str, **extra) -> np.ndarray:
    status, body = post(srv, "/v1/embeddings", {"model": model, "input": [text], **extra})
    assert status == 200, body
    return np.float32(body["data"][0]["embedding"])


def kserve(srv, model: str, text: str, prompt_name: str | None = None) -> np.ndarray:
    c = tc.InferenceServerClient(srv.grpc_url)
    try:
        inp = tc.InferInput("text", [1, 1], "BYTES")
        inp.set_data_from_numpy(np.array([[text.encode()]], dtype=object))
        params = {"prompt_name": prompt_name} if prompt_name else None
        return c.infer(model, [inp], parameters=params).as_numpy("embedding")[0]
    finally:
        c.close()


def cache_hits(srv, model: str) -> int:
    c = tc.InferenceServerClient(srv.grpc_url)
    try:
        stats = c.get_inference_statistics(model, as_json=True)["model_stats"][0]["inference_stats"]
        return int(stats["cache_hit"].get("count", 0))  # (protobuf's JSON writes int64 as a string)
    finally:
        c.close()


def test_a_prompt_is_exactly_its_prefix_on_every_route(served):
    plain = openai(served, "bert_mean", TEXT)
    prefixed = openai(served, "bert_mean", "query: " + TEXT)
    assert not np.array_equal(plain, prefixed)
    assert np.array_equal(openai(served, "bert_mean", TEXT, prompt_name="query"), prefixed)
    assert np.array_equal(kserve(served, "bert_mean", TEXT, "query"), prefixed)
    status, body = post(served, "/embed", {"model": "bert_mean", "inputs": [TEXT], "prompt_name": "query"})
    assert status == 200 and np.allclose(np.float32(body[0]), prefixed, atol=1e-6), body
    assert np.array_equal(openai(served, "bert_mean", TEXT, prompt_name="passage"), plain)  # an empty prompt


def test_the_default_prompt_applies_and_the_cache_keeps_prompts_apart(served):
    hits = cache_hits(served, "bert_twin")
    with_default = openai(served, "bert_twin", TEXT)  # the model's default prompt: "query: "
    assert np.array_equal(with_default, openai(served, "bert_mean", "query: " + TEXT))
    assert cache_hits(served, "bert_twin") == hits
    other = openai(served, "bert_twin", TEXT, prompt_name="passage")  # the same text, another prompt
    assert cache_hits(served, "bert_twin") == hits  # not answered from the first prompt's row
    assert np.array_equal(other, openai(served, "bert_mean", TEXT))
    assert np.array_equal(openai(served, "bert_twin", TEXT), with_default)
    assert cache_hits(served, "bert_twin") == hits + 1  # the same prompt again: its own row


def test_an_unknown_prompt_is_refused_with_the_models_prompts(served):
    status, body = post(
        served, "/v1/embeddings", {"model": "bert_mean", "input": [TEXT], "prompt_name": "nope"}
    )
    assert status == 400 and body["error"]["param"] == "prompt_name", body
    assert (
        "no prompt 'nope'" in body["error"]["message"] and "['passage', 'query']" in body["error"]["message"]
    )
    status, body = post(served, "/embed", {"model": "bert_mean", "inputs": [TEXT], "prompt_name": 3})
    assert status == 422 and "prompt_name" in body["error"], body


def test_matryoshka_dimensions_cut_and_renormalise(served):
    full = openai(served, "bert_twin", TEXT)
    for size in (8, 16):
        got = openai(served, "bert_twin", TEXT, dimensions=size)
        want = full[:size] / np.linalg.norm(full[:size])
        assert got.shape == (size,) and np.allclose(got, want, atol=1e-6)
    status, body = post(served, "/embed", {"model": "bert_twin", "inputs": [TEXT], "dimensions": 8})
    assert status == 200 and np.allclose(np.float32(body[0]), full[:8] / np.linalg.norm(full[:8]), atol=1e-6)
    status, body = post(served, "/v1/embeddings", {"model": "bert_twin", "input": [TEXT], "dimensions": 12})
    assert status == 400 and "[8, 16, 32]" in body["error"]["message"], body
    status, body = post(served, "/v1/embeddings", {"model": "bert_mean", "input": [TEXT], "dimensions": 8})
    assert status == 400 and "none declared" in body["error"]["message"], body
