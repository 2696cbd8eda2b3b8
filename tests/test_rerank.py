"""Rerank over REST: TEI's ``POST /rerank`` and the Cohere/Jina-style ``POST /v1/rerank``, answered
by a cross-encoder made with ``batchgate prepare-model`` from a random-weight transformers model
(tests/test_prepare_model.py builds it), checked against KServe requests for the same pairs and
against transformers' own logits."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as tc

from tests.conftest import start_server
from tests.test_prepare_model import folders, reference, repo  # noqa: F401  (module fixtures)

QUERY = "which river flooded the villages"
DOCS = [
    "After days of rain the river overflowed its banks.",
    "The recipe needs two eggs and a cup of flour.",
    "Villages downstream were flooded.",
    "A short one.",
]


@pytest.fixture(scope="module")
def served(repo, tmp_path_factory):  # noqa: F811
    srv = start_server(
        tmp_path_factory.mktemp("rerank-server"), "--no-build-models", repo=repo, ready_timeout=120
    )
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


def kserve_scores(srv, model: str, pairs: list[str]) -> np.ndarray:
    client = tc.InferenceServerClient(srv.grpc_url)
    try:
        inp = tc.InferInput("text", [len(pairs), 1], "BYTES")
        inp.set_data_from_numpy(np.array([p.encode() for p in pairs], dtype=object).reshape(-1, 1))
        return client.infer(model, [inp], client_timeout=60).as_numpy("score")[:, 0]
    finally:
        client.close()


def sigmoid(x):
    return 1 / (1 + np.exp(-np.asarray(x, np.float64)))


@pytest.mark.parametrize("model", ["bert_ce", "xlmr_ce"])
def test_the_kserve_scores_are_transformers(served, folders, model):  # noqa: F811
    raw = kserve_scores(served, model, [QUERY + "\x1f" + d for d in DOCS])
    folder, ref_model, *_ = folders[model]
    np.testing.assert_allclose(
        raw, reference(folder, ref_model, None, None, [(QUERY, d) for d in DOCS]), atol=1e-4
    )


@pytest.mark.parametrize("model", ["bert_ce", "xlmr_ce"])
def test_both_rerank_routes_give_the_kserve_scores_sorted(served, model):
    raw = kserve_scores(served, model, [QUERY + "\x1f" + d for d in DOCS])

    status, body = post(served, "/rerank", {"model": model, "query": QUERY, "texts": DOCS, "raw_scores": True, "truncate": True,
                                            "return_text": True})  # fmt: skip
    assert status == 200, body
    assert [b["index"] for b in body] == list(np.argsort(-raw, kind="stable"))
    for b in body:
        assert b["score"] == pytest.approx(float(raw[b["index"]]), abs=1e-6) and b["text"] == DOCS[b["index"]]
    status, body = post(served, "/rerank", {"model": model, "query": QUERY, "texts": DOCS, "truncate": True})
    assert status == 200 and "text" not in body[0]
    assert [b["score"] for b in body] == pytest.approx(sorted(sigmoid(raw), reverse=True), abs=1e-6)

    status, body = post(served, "/v1/rerank", {"model": model, "query": QUERY, "documents": DOCS, "top_n": 2,
                                               "return_documents": True})  # fmt: skip
    assert status == 200, body
    top = list(np.argsort(-raw, kind="stable")[:2])
    assert [r["index"] for r in body["results"]] == top
    for r in body["results"]:
        assert r["relevance_score"] == pytest.approx(float(sigmoid(raw[r["index"]])), abs=1e-6)
        assert r["document"] == {"text": DOCS[r["index"]]}
    assert body["model"] == model and body["usage"]["total_tokens"] > 0
    # Jina's and Cohere's object form of a document
    status, again = post(
        served, "/v1/rerank", {"model": model, "query": QUERY, "documents": [{"text": d} for d in DOCS]}
    )
    assert status == 200 and [r["index"] for r in again["results"]] == list(np.argsort(-raw, kind="stable"))


def test_rerank_refuses_what_it_cannot_rank_by_name(served):
    # truncate: false (TEI's default; here the model's own setting is): a pair over the model's
    # length is refused, with its token count
    status, body = post(
        served, "/rerank", {"model": "xlmr_ce", "query": QUERY, "texts": DOCS, "truncate": False}
    )
    assert status == 413 and "tokens; model 'xlmr_ce' takes at most" in body["error"], body
    status, body = post(served, "/rerank", {"model": "bert_mean", "query": QUERY, "texts": DOCS})
    assert status == 422 and "not a rerank model" in body["error"] and "bert_ce" in body["error"], body
    status, body = post(served, "/rerank", {"query": QUERY, "texts": DOCS})  # two rerank models here
    assert status == 422 and "'model' is required" in body["error"], body
    status, body = post(served, "/v1/rerank", {"model": "bert_ce", "query": "", "documents": DOCS})
    assert status == 400 and body["error"]["param"] == "query", body
    status, body = post(
        served, "/v1/rerank", {"model": "bert_ce", "query": QUERY, "documents": DOCS, "top_n": 0}
    )
    assert status == 400 and body["error"]["param"] == "top_n", body
    status, body = post(served, "/rerank", {"model": "bert_ce", "query": QUERY, "texts": []})
    assert status == 400 and body["error_type"] == "empty", body
    # and an embedding route does not take a rerank model
    status, body = post(served, "/v1/embeddings", {"model": "bert_ce", "input": DOCS})
    assert status == 400 and "is a rerank model" in body["error"]["message"], body


def test_the_python_client_reranks_and_picks_prompts(served):
    from batchgate.client import Client

    with Client(served.grpc_url) as c:
        got = c.rerank(QUERY, DOCS, model="bert_ce")
        assert got.shape == (len(DOCS),)
        np.testing.assert_allclose(
            got, kserve_scores(served, "bert_ce", [QUERY + "\x1f" + d for d in DOCS]), atol=1e-6
        )
        plain, prompted = (
            c.embed("a text", model="bert_mean"),
            c.embed("a text", model="bert_mean", prompt_name="query"),
        )
        np.testing.assert_allclose(prompted, c.embed("query: a text", model="bert_mean"), atol=1e-6)
        assert not np.allclose(plain, prompted)


def test_the_official_cohere_client_reranks_unchanged(served):
    import cohere  # a test dependency: `make test` installs it

    raw = kserve_scores(served, "bert_ce", [QUERY + "\x1f" + d for d in DOCS])
    co = cohere.Client(api_key="any", base_url=f"http://127.0.0.1:{served.http_port}")
    resp = co.rerank(model="bert_ce", query=QUERY, documents=DOCS, top_n=3)
    assert [r.index for r in resp.results] == list(np.argsort(-raw, kind="stable")[:3])
    for r in resp.results:
        assert r.relevance_score == pytest.approx(float(sigmoid(raw[r.index])), abs=1e-6)
