"""Texts longer than the model takes: chunk-and-pool (each chunk embedded in the same batches as
other rows, answered as the chunks' token-weighted mean: vLLM's chunked processing), late
chunking (Jina's ``late_chunking``: the inputs are consecutive chunks of one document, embedded
in one pass and pooled per chunk), and rerank's ``max_chunks_per_doc`` (a document scored by its
best chunk). Models: the bundled minilm, a numpy-built BERT embedder with a per-token output and a
numpy-built cross-encoder (tests/tiny_models.py): no torch."""

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

WORDS = ("river bank flood village rain storm bridge road field harvest market school doctor letter "
         "mountain valley forest winter summer evening morning garden kitchen window").split()  # fmt: skip
LONG = " ".join(WORDS[(i * 7) % len(WORDS)] + ("." if i % 11 == 10 else "") for i in range(700))
QUERY = "which river flooded the villages"


@pytest.fixture(scope="module")
def emb_folder(minilm_dir, tmp_path_factory):
    """A BertModel folder (numpy-made weights) served as 'tok': mean pooled, with token vectors."""
    return bert_cross_encoder(
        tmp_path_factory.mktemp("emb"), minilm_dir / "tokenizer.json", head=False, seed=3
    )


@pytest.fixture(scope="module")
def repo(minilm_dir, emb_folder, tmp_path_factory):
    repo = tmp_path_factory.mktemp("long-repo")
    shutil.copytree(minilm_dir, repo / "minilm", symlinks=True)
    over = repo / "minilm_o"
    (over / "1").mkdir(parents=True)
    (over / "1" / "model.onnx").symlink_to(minilm_dir / "1" / "model.onnx")
    shutil.copy(minilm_dir / "tokenizer.json", over / "tokenizer.json")
    config = (minilm_dir / "config.pbtxt").read_text().replace('name: "minilm"', 'name: "minilm_o"')
    (over / "config.pbtxt").write_text(
        config + 'parameters { key: "long_inputs" value { string_value: "chunk" } }\n'
        'parameters { key: "chunk_overlap" value { string_value: "32" } }\n'
    )
    tok = minilm_dir / "tokenizer.json"
    prepare(emb_folder, "tok", repo, "--pooling", "mean", "--normalize", "--token-embeddings")
    prepare(bert_cross_encoder(tmp_path_factory.mktemp("ce"), tok), "ce", repo)
    # an embedder without a per-token output: late chunking is refused on it
    prepare(bert_cross_encoder(tmp_path_factory.mktemp("plain"), tok, head=False, seed=4), "plain", repo,
            "--pooling", "mean", "--normalize")  # fmt: skip
    return repo


@pytest.fixture(scope="module")
def base(repo, tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("long"), "--no-build-models", repo=repo, ready_timeout=120)
    yield f"http://127.0.0.1:{srv.http_port}"
    srv.stop()


@pytest.fixture(scope="module")
def tok(minilm_dir):
    t = Tokenizer.from_file(str(minilm_dir / "tokenizer.json"))
    t.no_padding()
    t.no_truncation()
    return t


def post(url: str, body) -> tuple[int, object]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def embed(base: str, model: str, texts: list[str], **extra) -> np.ndarray:
    status, body = post(base + "/v1/embeddings", {"model": model, "input": texts, **extra})
    assert status == 200, body
    return np.array([d["embedding"] for d in body["data"]], dtype=np.float64)


def chunks_of(tok: Tokenizer, text: str, size: int, overlap: int) -> list[str]:
    """The split restated: token windows of ``size`` (no special tokens), ``overlap`` shared."""
    e = tok.encode(text, add_special_tokens=False)
    out, start = [], 0
    while True:
        end = min(start + size, len(e.ids))
        out.append(text[e.offsets[start][0] : e.offsets[end - 1][1]])
        if end == len(e.ids):
            return out
        start += size - overlap


def cosine(a, b) -> float:
    return float(np.dot(a, b) / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.mark.parametrize(
    "model, overlap, field", [("minilm", 0, {"long_inputs": "chunk"}), ("minilm_o", 32, {})]
)
def test_chunk_and_pool_is_the_token_weighted_mean_of_the_chunks(base, tok, model, overlap, field):
    chunks = chunks_of(tok, LONG, 254, overlap)  # minilm: 256 tokens, 2 of them [CLS] [SEP]
    assert len(chunks) >= 3
    alone = embed(base, model, chunks)
    weights = np.array([len(tok.encode(c).ids) for c in chunks], dtype=np.float64)
    want = (alone * weights[:, None]).sum(0) / weights.sum()
    want /= np.linalg.norm(want)  # minilm's vectors are unit length, so is their mean's answer
    status, body = post(base + "/v1/embeddings", {"model": model, "input": [LONG, "short one"], **field})
    assert status == 200, body
    got = np.array(body["data"][0]["embedding"])
    assert cosine(got, want) >= 0.999999
    assert body["usage"]["prompt_tokens"] == int(weights.sum()) + len(tok.encode("short one").ids)
    cut = embed(base, "minilm", [LONG])[0]  # truncation (the default) answers the first 256 tokens only
    assert cosine(cut, want) < 0.9999
    np.testing.assert_allclose(
        body["data"][1]["embedding"], embed(base, "minilm", ["short one"])[0], atol=1e-6
    )


def span_means(joined: str, chunks: list[str], enc, hidden: np.ndarray) -> list[np.ndarray]:
    """Each chunk's tokens (by the encoding's offsets into ``joined``, special tokens left out) of
    ``hidden`` mean-pooled and normalised: late chunking's vector per span."""
    want, at = [], 0
    for c in chunks:
        start = joined.index(c, at)
        span = [k for k, (a, b) in enumerate(enc.offsets) if not enc.special_tokens_mask[k] and a >= start and b <= start + len(c) and b > a]  # fmt: skip
        v = hidden[span[0] : span[-1] + 1].mean(0)
        want.append(v / np.linalg.norm(v))
        at = start + len(c)
    return want


@pytest.mark.parametrize("model", ["tok", "minilm"])  # minilm: its token output, given on request
def test_late_chunking_pools_each_chunk_from_one_pass(base, tok, model):
    chunks = ["The river rose after three days of rain.", "It flooded the low villages downstream.",
              "Their people moved to the hills.", "Nobody was hurt."]  # fmt: skip
    joined = " ".join(chunks)
    status, tokens = post(base + "/embed_all", {"model": model, "inputs": joined})
    assert status == 200, tokens
    hidden = np.array(tokens[0], dtype=np.float64)  # the pass's token vectors, [CLS] first
    enc = tok.encode(joined)
    want = span_means(joined, chunks, enc, hidden)
    got = embed(base, model, chunks, late_chunking=True)
    for g, w in zip(got, want, strict=True):
        assert cosine(g, w) >= 0.999999
    alone = embed(base, model, chunks)
    assert min(cosine(g, a) for g, a in zip(got, alone)) < 0.9999  # context changed them
    status, body = post(base + "/v1/embeddings", {"model": "plain", "input": chunks, "late_chunking": True})
    assert status == 400 and body["error"]["param"] == "late_chunking" and "token" in body["error"]["message"]


def test_late_chunking_equals_transformers_last_hidden_state_pooled_per_span(base, tok, emb_folder):
    """The reference: transformers' BertModel over the joined text, its last hidden state
    mean-pooled over each chunk's tokens (Jina's late chunking), normalised."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    chunks = ["The river rose after three days of rain.", "It flooded the low villages downstream.",
              "Their people moved to the hills.", "Nobody was hurt."]  # fmt: skip
    joined = " ".join(chunks)
    enc = tok.encode(joined)
    model = transformers.BertModel.from_pretrained(str(emb_folder), add_pooling_layer=False).eval()
    with torch.no_grad():
        hidden = model(input_ids=torch.tensor([enc.ids]), token_type_ids=torch.tensor([enc.type_ids]),
                       attention_mask=torch.tensor([enc.attention_mask])).last_hidden_state[0].double().numpy()  # fmt: skip
    want = span_means(joined, chunks, enc, hidden)
    got = embed(base, "tok", chunks, late_chunking=True)
    for g, w in zip(got, want, strict=True):
        assert cosine(g, w) >= 0.999999


def test_late_chunking_past_the_models_length_windows_consecutive_chunks(base, tok):
    """The documented fallback: chunks grouped into windows that fit, one pass each."""
    chunks = [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(40)) for i in range(12)]  # ~480 tokens
    got = embed(base, "tok", chunks, late_chunking=True)
    assert got.shape[0] == len(chunks) and np.isfinite(got).all()
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1, atol=1e-5)
    # the last window's chunks equal late chunking of that window alone
    half = embed(base, "tok", chunks[-3:], late_chunking=True)
    assert all(cosine(a, b) >= 0.99999 for a, b in zip(got[-3:], half))


def test_rerank_max_chunks_per_doc_scores_the_best_chunk(base, tok):
    q = len(tok.encode(QUERY, add_special_tokens=False).ids)
    with urllib.request.urlopen(base + "/tei/ce/info", timeout=10) as resp:
        longest = json.loads(resp.read())["max_input_length"]
    doc = LONG
    chunks = chunks_of(tok, doc, longest - 3 - q, 0)[:2]  # [CLS] query [SEP] chunk [SEP]
    scores = {}
    status, body = post(base + "/v1/rerank", {"model": "ce", "query": QUERY, "documents": chunks})
    assert status == 200, body
    scores = [r["relevance_score"] for r in sorted(body["results"], key=lambda r: r["index"])]
    best = max(scores)
    assert abs(scores[0] - scores[1]) > 1e-4  # which chunk wins matters
    status, body = post(base + "/v1/rerank", {"model": "ce", "query": QUERY, "documents": [doc, "short"],
                                              "max_chunks_per_doc": 2})  # fmt: skip
    assert status == 200, body
    got = {r["index"]: r["relevance_score"] for r in body["results"]}
    assert got[0] == pytest.approx(best, abs=1e-6)
