"""TEI's whole surface against a live server: ``/info``, ``/health``, ``/tokenize``, ``/decode``,
``/similarity``, ``/predict``, ``/embed_sparse``, ``/embed_all``, vLLM's ``/classify``, each TEI
route again under ``/tei/{model}``; the model's ``truncate`` as every route's default; Left
truncation; token-id inputs on ``/v1/embeddings``; latency budgets no call can meet; and the real
``tei-client`` 0.2.4 from PyPI, unchanged, against the root and against ``/tei/{model}``.

The models: minilm (and a ``reject`` copy of it), and tiny scrambled random-weight transformers
models written by numpy in transformers' layout (tests/tiny_models.py) and made servable here with
``prepare-model``: a three-label classifier, a multi-label one, a pair (NLI) one, a SPLADE encoder,
an embedding model with token vectors and prompts, and a one-label cross-encoder (a reranker).
Each route's numbers are checked against KServe's answer for the same model and rows, and the
models' tokenizers; KServe's answer against transformers' own outputs in one reference test (the
graphs' own tests are tests/test_classify.py, test_sparse.py, test_token_embeddings.py), so the
rest run without torch.
"""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as tc
from tokenizers import Tokenizer

from batchgate.gateway.models.hf_model import read_folder
from batchgate.gateway.models.prepare import prepare_model
from batchgate.gateway.text import PAIR_SEPARATOR
from tests.conftest import REPO, start_server
from tests.test_classify import SENTIMENT, TOPICS
from tests.test_classify import reference as classifier_reference
from tests.prepared import server, tiny_configs  # noqa: F401  (server: a module fixture over repo)
from tests.test_prepare_model import PAIRS, TEXTS, st_folder
from tests.test_sparse import check_sparse, splade_folder
from tests.test_sparse import reference as sparse_reference
from tests.test_token_embeddings import reference as token_reference
from tests.tiny_models import TransformersModel, transformers_folder

MAX_PROB_DIFF = 1e-5
MAX_DIFF = 1e-4
LONG = " ".join(["the quick brown fox jumps over the lazy dog near the river bank"] * 40)  # > 256 tokens


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """name -> (folder, transformers' model of it: loaded by the reference test alone)."""
    bert, xlmr, wp, ug = tiny_configs()
    root = tmp_path_factory.mktemp("tei-folders")
    made = {
        "sentiment": ("BertForSequenceClassification", dict(bert, id2label=SENTIMENT), wp),
        "topics": ("XLMRobertaForSequenceClassification",
                   dict(xlmr, id2label=TOPICS, problem_type="multi_label_classification"), ug),
        "nli": ("BertForSequenceClassification", dict(bert, num_labels=3), wp),
        "splade": ("BertForMaskedLM", bert, wp),
        "tokens": ("BertModel", bert, wp),
        "ce": ("BertForSequenceClassification", dict(bert, num_labels=1), wp),
    }  # fmt: skip
    out = {}
    for seed, (name, (architecture, config, tok)) in enumerate(made.items()):
        d = transformers_folder(root / name, architecture, config, tok, seed=40 + seed)
        out[name] = (d, TransformersModel(d))
    config = json.loads((root / "nli" / "config.json").read_text())
    config["sentence_transformers"] = {"activation_fn": "torch.nn.modules.activation.Softmax"}
    (root / "nli" / "config.json").write_text(json.dumps(config))
    splade_folder(root / "splade")
    st_folder(root / "tokens", "mean", True, **{
        "config_sentence_transformers.json": {"prompts": {"query": "query: ", "passage": ""},
                                              "default_prompt_name": None}})  # fmt: skip
    return out


@pytest.fixture(scope="module")
def repo(folders, minilm_dir, tmp_path_factory):
    repo = tmp_path_factory.mktemp("tei-repo")
    for name, (folder, _model) in folders.items():
        prepare_model(folder, name, repo, token_embeddings=name == "tokens", log=print)
    (repo / "minilm").symlink_to(minilm_dir)
    d = repo / "minilm_reject"
    (d / "1").mkdir(parents=True)
    (d / "1" / "model.onnx").symlink_to(minilm_dir / "1" / "model.onnx")
    shutil.copy(minilm_dir / "tokenizer.json", d / "tokenizer.json")
    config = (minilm_dir / "config.pbtxt").read_text().replace('name: "minilm"', 'name: "minilm_reject"')
    config = config.replace('value { string_value: "truncate" }', 'value { string_value: "reject" }')
    assert "reject" in config
    (d / "config.pbtxt").write_text(config)
    return repo


@pytest.fixture(scope="module")
def srv(server):  # noqa: F811
    return server


@pytest.fixture(scope="module")
def base(srv) -> str:
    return f"http://127.0.0.1:{srv.http_port}"


def call(url: str, body=None, headers: dict | None = None) -> tuple[int, object, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            raw = r.read()
            return r.status, json.loads(raw) if raw else None, dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null"), dict(e.headers)


def tokenizer_of(folder) -> Tokenizer:
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    return tok


def kserve(srv, model: str, rows: list[str], output: str) -> np.ndarray:
    with tc.InferenceServerClient(srv.grpc_url) as c:
        x = tc.InferInput("text", [len(rows), 1], "BYTES")
        x.set_data_from_numpy(np.array([[r.encode()] for r in rows], dtype=object))
        return c.infer(model, [x], outputs=[tc.InferRequestedOutput(output)]).as_numpy(output)


def served_scores(srv, name: str, rows: list) -> tuple[np.ndarray, np.ndarray]:
    """(probabilities, logits) of a classifier over KServe (pairs joined as its wire joins them)."""
    rows = [PAIR_SEPARATOR.join(r) if isinstance(r, tuple) else r for r in rows]
    return kserve(srv, name, rows, "probabilities"), kserve(srv, name, rows, "logits")


def served_tokens(srv, folder, rows: list[str]) -> tuple[np.ndarray, list[int]]:
    """(the "tokens" model's token vectors over KServe, each row's token count by its tokenizer)."""
    tok = tokenizer_of(folder)
    tok.enable_truncation(read_folder(folder).max_tokens)
    return kserve(srv, "tokens", rows, "token_embeddings"), [len(e.ids) for e in tok.encode_batch(rows)]


# -- /info ----------------------------------------------------------------------------------------


def test_info_describes_each_model_truly(base, repo):
    status, root, _ = call(base + "/info")
    assert status == 200 and root["model_id"] == "minilm", root  # the first text embedding model by name
    assert root["model_type"] == {"embedding": {"pooling": "mean"}}
    assert (root["max_input_length"], root["auto_truncate"], root["max_batch_requests"]) == (256, True, 64)
    assert root["model_dtype"] == "float32" and root["max_batch_tokens"] == 1024
    want = {
        "sentiment": {"classifier": {"id2label": {str(i): n for i, n in SENTIMENT.items()},
                                     "label2id": {n: i for i, n in SENTIMENT.items()}}},
        "topics": {"classifier": {"id2label": {str(i): n for i, n in TOPICS.items()},
                                  "label2id": {n: i for i, n in TOPICS.items()}}},
        "nli": {"classifier": {"id2label": {"0": "LABEL_0", "1": "LABEL_1", "2": "LABEL_2"},
                               "label2id": {"LABEL_0": 0, "LABEL_1": 1, "LABEL_2": 2}}},
        "splade": {"embedding": {"pooling": "splade"}},
        "tokens": {"embedding": {"pooling": "mean"}},
        "ce": {"reranker": {"id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}},
        "minilm_reject": {"embedding": {"pooling": "mean"}},
    }  # fmt: skip
    for name, model_type in want.items():
        status, info, _ = call(f"{base}/tei/{name}/info")
        assert status == 200 and info["model_id"] == name and info["model_type"] == model_type, info
        assert info["auto_truncate"] is (name != "minilm_reject")
        assert info["pairs"] is (name in ("nli", "ce"))
    status, info, _ = call(base + "/tei/splade/info")
    assert info["max_input_length"] == 40  # sentence_bert_config's max_seq_length
    status, body, _ = call(base + "/tei/nope/info")
    assert status == 404 and body["error_type"] == "validation", body
    assert call(base + "/health")[0] == 200 and call(base + "/tei/ce/health")[0] == 200
    assert call(base + "/tei/nope/health")[0] == 404


# -- tokens ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("special", [True, False])
def test_tokenize_equals_the_tokenizer(base, minilm_dir, repo, special):
    texts = ["Hello world, café!", "Tokyo 東京 🗼 tower", LONG[:300]]
    # the tokenizer each model is served with (XLM-R's as transformers 5 builds it: xlm_roberta.py)
    for url, folder in ((base, minilm_dir), (base + "/tei/topics", repo / "topics")):
        status, body, _ = call(url + "/tokenize", {"inputs": texts, "add_special_tokens": special})
        assert status == 200, body
        tok = tokenizer_of(folder)
        for text, got, e in zip(
            texts, body, tok.encode_batch(texts, add_special_tokens=special), strict=True
        ):
            assert [t["id"] for t in got] == e.ids
            assert [t["special"] for t in got] == [bool(m) for m in e.special_tokens_mask]
            assert any(t["special"] for t in got) is special
            raw = text.encode()
            for t, (start, stop) in zip(got, e.offsets, strict=True):
                if not t["special"]:  # TEI's offsets count UTF-8 bytes; Python's tokenizers count characters
                    assert t["text"] == text[start:stop] == raw[t["start"] : t["stop"]].decode(), (t, text)
                    assert t["start"] == len(text[:start].encode()) and t["stop"] == len(text[:stop].encode())


def test_tokenize_names_the_prompts_and_applies_one(base, folders):
    status, body, _ = call(base + "/tei/tokens/tokenize", {"inputs": "dog", "prompt_name": "nope"})
    assert status == 422 and 'Available prompts: ["passage", "query"]' in body["error"], body
    status, body, _ = call(base + "/tei/tokens/tokenize", {"inputs": "dog", "prompt_name": "query"})
    want = tokenizer_of(folders["tokens"][0]).encode("query: dog").ids
    assert status == 200 and [t["id"] for t in body[0]] == want


def test_decode_equals_the_tokenizer(base, minilm_dir):
    tok = tokenizer_of(minilm_dir)
    rows = [tok.encode(t).ids for t in ("Hello world, café!", "A man is eating food.")]
    for skip in (True, False):
        status, body, _ = call(base + "/decode", {"ids": rows, "skip_special_tokens": skip})
        assert status == 200 and body == tok.decode_batch(rows, skip_special_tokens=skip), body
    status, body, _ = call(base + "/decode", {"ids": rows[0]})
    assert body == [tok.decode(rows[0])]
    status, body, _ = call(base + "/decode", {"ids": [101, tok.get_vocab_size()]})
    assert status == 422 and "vocabulary" in body["error"], body


# -- vectors --------------------------------------------------------------------------------------


def test_similarity_is_the_cosine_of_the_served_embeddings(base):
    source, sentences = "A man is eating food.", ["A man is eating bread.", "A car drives fast.", LONG]
    status, got, _ = call(
        base + "/similarity", {"inputs": {"source_sentence": source, "sentences": sentences}}
    )
    assert status == 200, got
    _, vectors, _ = call(base + "/embed", {"inputs": [source, *sentences]})
    v = np.array(vectors, dtype=np.float64)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    np.testing.assert_allclose(got, v[1:] @ v[0], atol=1e-6)
    assert got[0] > got[1]  # a real similarity: the paraphrase is closer


def test_embed_sparse_equals_the_models_vectors(base, srv):
    status, body, _ = call(base + "/embed_sparse", {"inputs": TEXTS})  # the only sparse model
    assert status == 200, body
    want = kserve(srv, "splade", TEXTS, "sparse_embedding")
    got = np.zeros_like(want)
    for i, row in enumerate(body):
        idx = [p["index"] for p in row]
        assert idx == sorted(idx)
        got[i, idx] = [p["value"] for p in row]
    check_sparse(got, want, "splade")
    status, top, _ = call(base + "/tei/splade/embed_sparse", {"inputs": TEXTS[:2], "top_k": 3})
    for i, row in enumerate(top):
        assert [p["index"] for p in row] == sorted(np.argsort(-want[i], kind="stable")[:3].tolist())


def test_embed_all_gives_every_token_its_vector(base, srv, folders):
    rows = TEXTS[:6]
    status, body, _ = call(base + "/tei/tokens/embed_all", {"inputs": rows})
    assert status == 200, body
    states, counts = served_tokens(srv, folders["tokens"][0], rows)
    for i, n in enumerate(counts):
        got = np.array(body[i], dtype=np.float32)
        assert got.shape == (n, states.shape[2])
        np.testing.assert_allclose(got, states[i, :n], atol=MAX_DIFF, rtol=0)
        assert not states[i, n:].any()  # the count is the tokenizer's: the graph zeroes the rest
    # minilm (the root's model) serves its token vectors too: [CLS] dog [SEP]
    status, body, _ = call(base + "/embed_all", {"inputs": "dog"})
    assert status == 200 and np.array(body).shape == (1, 3, 384), body


# -- classifiers ----------------------------------------------------------------------------------


def test_predict_scores_are_the_models(base, srv):
    for name, multi in (("sentiment", False), ("topics", True)):
        probs, logits = served_scores(srv, name, TEXTS)
        labels = SENTIMENT if name == "sentiment" else TOPICS
        status, body, _ = call(f"{base}/tei/{name}/predict", {"inputs": [[t] for t in TEXTS]})
        assert status == 200 and len(body) == len(TEXTS), body
        for row, want in zip(body, probs, strict=True):
            scores = [p["score"] for p in row]
            assert scores == sorted(scores, reverse=True)
            got = {p["label"]: p["score"] for p in row}
            np.testing.assert_allclose([got[labels[j]] for j in range(len(labels))], want, atol=MAX_PROB_DIFF)
            if not multi:
                assert abs(sum(scores) - 1) < 1e-5
        status, body, _ = call(f"{base}/predict", {"model": name, "inputs": TEXTS[1], "raw_scores": True})
        got = {p["label"]: p["score"] for p in body}  # a single text: one list, not a batch
        np.testing.assert_allclose([got[labels[j]] for j in range(len(labels))], logits[1], atol=MAX_DIFF)
    # a pair model takes [a, b]; a single-text model refuses one
    probs, _ = served_scores(srv, "nli", PAIRS)
    status, body, _ = call(base + "/tei/nli/predict", {"inputs": [list(p) for p in PAIRS]})
    assert status == 200, body
    for row, want in zip(body, probs, strict=True):
        got = {p["label"]: p["score"] for p in row}
        np.testing.assert_allclose([got[f"LABEL_{j}"] for j in range(3)], want, atol=MAX_PROB_DIFF)
    # a classifier prepared for single texts takes a pair too, as its tokenizer pairs two texts
    # (TEI tokenizes a pair for any classifier; its numbers: test_the_served_numbers_equal_transformers)
    status, body, _ = call(base + "/tei/sentiment/predict", {"inputs": [list(p) for p in PAIRS]})
    assert status == 200 and len(body) == len(PAIRS), body
    singles = served_scores(srv, "sentiment", [" ".join(p) for p in PAIRS])[0]
    for row, single in zip(body, singles, strict=True):
        got = [{p["label"]: p["score"] for p in row}[SENTIMENT[j]] for j in range(3)]
        assert abs(sum(got) - 1) < 1e-5 and not np.allclose(got, single, atol=1e-4)  # a pair, not one text
    # a pair model refuses a single text
    status, body, _ = call(base + "/tei/nli/predict", {"inputs": [["a"], ["b"]]})
    assert status == 422 and "pair" in body["error"], body


def test_classify_answers_in_vllms_shape(base, srv):
    probs, _ = served_scores(srv, "sentiment", TEXTS[:3])
    status, body, _ = call(base + "/classify", {"model": "sentiment", "input": TEXTS[:3]})
    assert status == 200 and body["object"] == "list" and body["model"] == "sentiment", body
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    for i, d in enumerate(body["data"]):
        assert d["index"] == i and d["num_classes"] == 3
        np.testing.assert_allclose(d["probs"], probs[i], atol=MAX_PROB_DIFF)
        assert d["label"] == SENTIMENT[int(np.argmax(probs[i]))]
    status, body, _ = call(base + "/v1/classify", {"model": "minilm", "input": "x"})
    assert status == 400 and body["error"]["param"] == "model" and "/embed" in body["error"]["message"], body


# -- defaults from the model, truncation, token ids -----------------------------------------------


def test_the_models_truncate_setting_is_every_routes_default(base, srv, minilm_dir):
    first = kserve(srv, "minilm", [LONG], "embedding")  # KServe: the model keeps its first 256 tokens
    status, body, _ = call(base + "/v1/embeddings", {"model": "minilm", "input": LONG})
    assert status == 200 and body["usage"]["prompt_tokens"] == 256, body
    np.testing.assert_array_equal(np.float32([body["data"][0]["embedding"]]), first)
    status, body, _ = call(base + "/embed", {"inputs": LONG})
    assert status == 200
    np.testing.assert_array_equal(np.float32(body), first)
    # the call's own field still wins
    status, body, _ = call(base + "/embed", {"inputs": LONG, "truncate": False})
    assert status == 413 and "256" in body["error"], body
    # a reject model refuses as before
    status, body, _ = call(base + "/v1/embeddings", {"model": "minilm_reject", "input": LONG})
    assert status == 400 and body["error"]["param"] == "input" and "256" in body["error"]["message"], body
    status, body, _ = call(base + "/tei/minilm_reject/embed", {"inputs": LONG})
    assert status == 413, body


def test_left_truncation_keeps_the_last_tokens(base, minilm_dir):
    tok = tokenizer_of(minilm_dir)
    tok.enable_truncation(256, direction="left")
    ids = tok.encode(LONG + " and the final words here").ids
    assert len(ids) == 256 and ids[0] == 101 and ids[-1] == 102
    status, want, headers = call(base + "/embed", {"inputs": [ids]})  # the model's own ids
    assert status == 200 and headers["x-compute-tokens"] == "256", want
    status, got, _ = call(
        base + "/embed", {"inputs": LONG + " and the final words here", "truncation_direction": "Left"}
    )
    assert status == 200, got
    np.testing.assert_allclose(np.float32(got[0]), want[0], atol=1e-6)
    _, right, _ = call(base + "/embed", {"inputs": LONG + " and the final words here"})
    assert not np.allclose(right[0], got[0], atol=1e-3)  # not the right end's vector
    status, body, _ = call(base + "/embed", {"inputs": "x", "truncation_direction": "Middle"})
    assert status == 422 and "truncation_direction" in body["error"], body


def test_token_ids_on_teis_embed_are_the_models_own(base, minilm_dir):
    """TEI's routes take the model's own token ids, as TEI does (OpenAI's route reads OpenAI's:
    tests/test_clients.py, tests/test_openai_ids.py)."""
    tok = tokenizer_of(minilm_dir)
    texts = ["A man is eating food.", "Hello world"]
    rows = [e.ids for e in tok.encode_batch(texts)]
    status, by_text, _ = call(base + "/embed", {"inputs": texts})
    status, by_ids, headers = call(base + "/embed", {"inputs": rows})
    assert status == 200, by_ids
    np.testing.assert_allclose(by_ids, by_text, atol=1e-6)
    assert int(headers["x-compute-tokens"]) == sum(map(len, rows))
    status, one, _ = call(base + "/embed", {"inputs": rows[1]})  # a flat list: one row
    assert status == 200 and len(one) == 1
    np.testing.assert_allclose(one[0], by_text[1], atol=1e-6)
    size = tok.get_vocab_size()
    for bad in ([101, size], [[101, -1]], [[101, 1.5]]):
        status, body, _ = call(base + "/embed", {"inputs": bad})
        assert status == 422 and body["error_type"] == "validation", (bad, body)
    status, body, _ = call(base + "/tei/minilm_reject/embed", {"inputs": [[101] * 300]})
    assert status == 422 and "300 tokens" in body["error"], body


# -- budgets --------------------------------------------------------------------------------------


@pytest.mark.parametrize("budget", ["5e-324", "0.5", "0", "-3", "inf", "nan", "1e309", "soon"])
def test_a_budget_no_call_can_meet_is_invalid_input(base, budget):
    header = {"X-Latency-Budget-Ms": budget}
    status, body, headers = call(base + "/v1/embeddings", {"model": "minilm", "input": "hi"}, header)
    assert status == 400 and body["error"]["param"] == "X-Latency-Budget-Ms", body
    assert "Retry-After" not in headers
    status, body, _ = call(base + "/embed", {"inputs": "hi"}, header)
    assert status == 422 and "X-Latency-Budget-Ms" in body["error"], body
    try:
        value = float(budget)
    except ValueError:
        return
    if value == value and abs(value) != float("inf") and value < 1e308:
        status, body, _ = call(base + "/embed", {"inputs": "hi", "latency_budget_ms": value})
        assert status == 422 and "'latency_budget_ms'" in body["error"], body


# -- the real TEI client ---------------------------------------------------------------------------


def test_the_real_tei_client_at_the_root_and_per_model(base, srv, folders, minilm_dir):
    tei_client = pytest.importorskip("tei_client")  # tei-client==0.2.4, the test extra
    root = tei_client.HttpClient(base, timeout=60)
    assert root.health()
    info = root.info()
    assert info.server_model_id == "minilm" and info.server_model_type.value == "embedding"
    vectors = root.embed(["A man is eating food.", "Hello"])
    _, want, _ = call(base + "/embed", {"inputs": ["A man is eating food.", "Hello"]})
    assert vectors == want
    tok = tokenizer_of(minilm_dir)
    tokens = root.tokenize("Hello world")
    assert tokens[0].get_ids() == tok.encode("Hello world").ids
    assert root.decode(tokens[0].get_ids()) == [tok.decode(tokens[0].get_ids())]
    assert root.prompt_names() == [""] or root.prompt_names() == []

    per = tei_client.HttpClient(base + "/tei/tokens", timeout=60)
    assert per.info().server_model_id == "tokens"
    assert sorted(per.prompt_names()) == ["passage", "query"]
    states, counts = served_tokens(srv, folders["tokens"][0], TEXTS[:2])
    got = per.embed_all(TEXTS[:2])
    for i, n in enumerate(counts):
        np.testing.assert_allclose(np.float32(got[i]), states[i, :n], atol=MAX_DIFF, rtol=0)

    clf = tei_client.HttpClient(base + "/tei/sentiment", timeout=60)
    assert clf.health() and clf.info().server_model_type.value == "classifier"
    probs, _ = served_scores(srv, "sentiment", TEXTS[:3])
    results = clf.classify(TEXTS[:3])
    for r, want in zip(results, probs, strict=True):
        got = {s.label: s.score for s in r.scores}
        np.testing.assert_allclose([got[SENTIMENT[j]] for j in range(3)], want, atol=MAX_PROB_DIFF)

    ranker = tei_client.HttpClient(base + "/tei/ce", timeout=60)
    assert ranker.info().server_model_type.value == "reranker"
    ranks = ranker.rerank(
        "what is the man eating", ["the man is eating bread", "a small red cat"], return_text=True
    )
    _, want, _ = call(base + "/tei/ce/rerank", {"query": "what is the man eating",
                                                "texts": ["the man is eating bread", "a small red cat"]})  # fmt: skip
    ranked = ranks.ranks if hasattr(ranks, "ranks") else ranks
    assert [(r.index, r.score) for r in ranked] == [(w["index"], w["score"]) for w in want]


# -- batchgate's own client (gRPC) ---------------------------------------------------------------


def test_the_batchgate_client_classifies_and_gives_sparse_and_token_vectors(srv, folders):
    from batchgate.client import AsyncClient, Client

    probs, logits = served_scores(srv, "sentiment", TEXTS)
    with Client(srv.grpc_url, timeout=60) as bg:
        np.testing.assert_allclose(bg.classify(TEXTS, model="sentiment"), probs, atol=MAX_PROB_DIFF)
        np.testing.assert_allclose(
            bg.classify(TEXTS, model="sentiment", raw_scores=True), logits, atol=MAX_DIFF
        )
        want = kserve(srv, "splade", TEXTS, "sparse_embedding")
        rows = bg.embed_sparse(TEXTS, model="splade")
        got = np.zeros_like(want)
        for i, row in enumerate(rows):
            got[i, list(row)] = list(row.values())
        check_sparse(got, want, "splade (client)")
        assert list(bg.embed_sparse(TEXTS[:1], model="splade", top_k=2)[0]) == sorted(
            np.argsort(-want[0], kind="stable")[:2].tolist()
        )
        states, counts = served_tokens(srv, folders["tokens"][0], TEXTS)
        for i, vectors in enumerate(bg.embed_all(TEXTS, model="tokens")):
            assert vectors.shape == (counts[i], states.shape[2])
            np.testing.assert_allclose(vectors, states[i, : counts[i]], atol=MAX_DIFF, rtol=0)

    async def run():
        async with AsyncClient(srv.grpc_url, timeout=60) as bg:
            return await bg.classify(TEXTS[:3], model="sentiment")

    import asyncio

    np.testing.assert_allclose(asyncio.run(run()), probs[:3], atol=MAX_PROB_DIFF)


def test_a_server_without_text_models_says_so_on_teis_routes(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "ranker").symlink_to(REPO / "ranker")  # a tensor model only
    s = start_server(tmp_path, "--no-build-models", repo=repo)
    try:
        base = f"http://127.0.0.1:{s.http_port}"
        for url, body in ((base + "/info", None), (base + "/embed", {"inputs": "x"})):
            status, got, _ = call(url, body)
            assert status == 404 and "serves no text model" in got["error"], got
        status, got, _ = call(base + "/tei/ranker/info")
        assert status == 422 and "does not take text" in got["error"], got
    finally:
        s.stop()


def test_the_default_model_is_a_setting(repo, folders, tmp_path):
    tei_client = pytest.importorskip("tei_client")
    s = start_server(
        tmp_path, "--no-build-models", "--tei-default-model", "tokens", repo=repo, ready_timeout=180
    )
    try:
        root = tei_client.HttpClient(f"http://127.0.0.1:{s.http_port}", timeout=60)
        assert root.info().server_model_id == "tokens"
        states, counts = served_tokens(s, folders["tokens"][0], TEXTS[:3])
        for i, got in enumerate(root.embed_all(TEXTS[:3])):
            np.testing.assert_allclose(np.float32(got), states[i, : counts[i]], atol=MAX_DIFF, rtol=0)
    finally:
        s.stop()


# -- the reference --------------------------------------------------------------------------------


def test_the_served_numbers_equal_transformers(base, srv, folders):
    """The routes above answer what KServe answers for the same model; KServe's answers here are
    transformers' own (the reference extra), and a single-text classifier's pair scores, which
    only a TEI route asks for."""
    for name, multi, rows in (("sentiment", False, TEXTS), ("topics", True, TEXTS), ("nli", False, PAIRS)):
        probs, logits = classifier_reference(*folders[name], rows, multi)
        got_p, got_l = served_scores(srv, name, rows)
        np.testing.assert_allclose(got_p, probs, atol=MAX_PROB_DIFF, rtol=0)
        np.testing.assert_allclose(got_l, logits, atol=MAX_DIFF, rtol=0)
    check_sparse(kserve(srv, "splade", TEXTS, "sparse_embedding"),
                 sparse_reference(*folders["splade"], "relu", "max", TEXTS), "splade")  # fmt: skip
    states, counts = token_reference(*folders["tokens"], TEXTS)
    got, want_counts = served_tokens(srv, folders["tokens"][0], TEXTS)
    assert counts == want_counts
    for i, n in enumerate(counts):
        np.testing.assert_allclose(got[i, :n], states[i, :n], atol=MAX_DIFF, rtol=0)
    probs, _ = classifier_reference(*folders["sentiment"], PAIRS, False)
    status, body, _ = call(base + "/tei/sentiment/predict", {"inputs": [list(p) for p in PAIRS]})
    assert status == 200, body
    for row, want in zip(body, probs, strict=True):
        got = {p["label"]: p["score"] for p in row}
        np.testing.assert_allclose([got[SENTIMENT[j]] for j in range(3)], want, atol=MAX_PROB_DIFF)
