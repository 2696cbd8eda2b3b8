"""``batchgate prepare-model`` for ColBERT models in PyLate's folder layout: a BERT encoder, its
Dense projection per token, ``[Q] ``/``[D] `` markers added to the tokenizer, queries expanded
with the mask token up to ``query_length``, documents' punctuation skipped; served as one graph
(kind ``multi_vector``: ``token_embeddings`` and ``token_mask``).

The reference is PyLate's ``ColBERT.encode`` and ``colbert_scores`` (MaxSim), restated here from
its source (pylate 1.6.0 ``models/colbert.py``: ``tokenize`` with ``insert_prefix_token``,
padding queries to ``query_length`` with the mask token, the skiplist mask for documents, every
query position kept, ``F.normalize`` per vector): PyLate pins transformers <= 5.3 and
sentence-transformers 5.3, which the reference extra's transformers 5.24 and
sentence-transformers 6.3 rule out, so it is not installed. The encoder is transformers'
``BertModel``; the tokenizer is the folder's, read by ``PreTrainedTokenizerFast`` as PyLate
reads it.

The folder is written with numpy and ``tokenizers`` (tests/layouts.py), so the tests that only
prepare or read it run without torch; those that compare with PyLate's computation ask for the
``pylate`` fixture, which loads the folder into transformers (and checks that the tokenizer files
are the ones transformers writes for PyLate's tokenizer).
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from tokenizers import AddedToken, Tokenizer

from batchgate.gateway.models.hf_model import PrepareError, read_folder
from batchgate.gateway.models.prepare import prepare_model
from batchgate.gateway.repository import load_model
from batchgate.gateway.text import TextStage
from tests.layouts import write_folder
from tests.test_prepare_model import MIN_COSINE, TINY, cosines, wordpiece

DIM = 16
QUERY_LENGTH, DOCUMENT_LENGTH = 12, 24
QUERIES = ["what is the man eating", "who plays the violin", "dog", " ".join(["the old train station"] * 4)]
DOCS = ["the man is eating bread.", "A woman is playing the violin on the street.", "dog . cat .",
        " ".join(["the old train station in the city."] * 3)]  # fmt: skip
PYLATE_CONFIG = {"prompts": {}, "default_prompt_name": None, "similarity_fn_name": "MaxSim", "query_prefix": "[Q] ",
                 "document_prefix": "[D] ", "query_length": QUERY_LENGTH, "document_length": DOCUMENT_LENGTH,
                 "attend_to_expansion_tokens": False, "skiplist_words": list(string.punctuation),
                 "do_query_expansion": True}  # fmt: skip


MARKERS = ["[Q] ", "[D] "]  # PyLate's ColBERT.__init__ adds its prefixes to the tokenizer
SPECIAL = {"pad_token": "[PAD]", "mask_token": "[MASK]", "cls_token": "[CLS]", "sep_token": "[SEP]",
           "unk_token": "[UNK]"}  # fmt: skip
# What transformers 5's save_pretrained writes beside tokenizer.json (checked in ``pylate``).
TOKENIZER_CONFIG = {"backend": "tokenizers", **SPECIAL, "model_max_length": int(1e30),
                    "tokenizer_class": "TokenizersBackend"}  # fmt: skip


def bert():
    import transformers as t

    config = t.BertConfig(
        **TINY, vocab_size=wordpiece().get_vocab_size() + len(MARKERS), max_position_embeddings=40
    )
    return t.BertModel(config, add_pooling_layer=False)


LAYOUTS = {"colbert_bert": bert}


def tokenizer() -> Tokenizer:
    """The tokenizer as transformers' ``PreTrainedTokenizerFast(tokenizer_object=wordpiece(),
    **SPECIAL)`` with ``add_tokens(MARKERS)`` holds it: the special tokens marked special and not
    normalised, the markers added (normalised, not special) after the vocabulary."""
    tok = wordpiece()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL.values()])
    tok.add_tokens([AddedToken(t, special=False, normalized=True) for t in MARKERS])
    return tok


@pytest.fixture(scope="module")
def colbert(tmp_path_factory):
    """A folder as PyLate saves one, written with numpy (no torch): the BERT encoder in
    transformers' layout, the tokenizer with the markers, the Dense projection as
    sentence-transformers' Dense.save writes it (config.json, model.safetensors)."""
    from safetensors.numpy import save_file

    d = write_folder(tmp_path_factory.mktemp("colbert") / "colbert", "colbert_bert", seed=0)
    tokenizer().save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2))
    weight = (0.3 * np.random.default_rng(0).standard_normal((DIM, TINY["hidden_size"]))).astype(np.float32)
    (d / "1_Dense").mkdir()
    save_file({"linear.weight": weight}, str(d / "1_Dense" / "model.safetensors"))
    (d / "1_Dense" / "config.json").write_text(json.dumps({"in_features": TINY["hidden_size"], "out_features": DIM,
                                                           "bias": False, "activation_function":
                                                           "torch.nn.modules.linear.Identity"}))  # fmt: skip
    (d / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Dense", "type": "pylate.models.Dense.Dense"}]))  # fmt: skip
    (d / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": DOCUMENT_LENGTH - 1}))
    (d / "config_sentence_transformers.json").write_text(json.dumps(PYLATE_CONFIG))
    return d


@pytest.fixture(scope="module")
def repo(colbert, tmp_path_factory):
    repo = tmp_path_factory.mktemp("colbert-repo")
    prepare_model(colbert, "colbert", repo, log=print)
    return repo


@pytest.fixture(scope="module")
def pylate(colbert, tmp_path_factory):
    """PyLate's ColBERT.encode (restated) of the folder: ``encode(texts, is_query)`` answers the
    kept, normalised token vectors of each text. Only the tests that compare with it ask for it
    (they skip without the reference extra)."""
    torch = pytest.importorskip("torch")
    t = pytest.importorskip("transformers")
    from safetensors.numpy import load_file

    # The folder's tokenizer files are what transformers writes for PyLate's tokenizer.
    fast = t.PreTrainedTokenizerFast(tokenizer_object=wordpiece(), **SPECIAL)
    fast.add_tokens(MARKERS)
    saved = tmp_path_factory.mktemp("colbert-tokenizer")
    fast.save_pretrained(saved)
    assert sorted(p.name for p in saved.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert json.loads((colbert / name).read_text()) == json.loads((saved / name).read_text()), name
    model, info = t.BertModel.from_pretrained(colbert, add_pooling_layer=False, output_loading_info=True)
    # every weight read from the folder, none left at transformers' random init
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    model.eval()
    weight = torch.from_numpy(load_file(str(colbert / "1_Dense" / "model.safetensors"))["linear.weight"])
    tok = t.PreTrainedTokenizerFast.from_pretrained(colbert)
    tok.pad_token_id = tok.mask_token_id  # PyLate pads with the mask token

    def encode(texts: list[str], is_query: bool) -> list[np.ndarray]:
        prefix = tok.convert_tokens_to_ids(PYLATE_CONFIG["query_prefix" if is_query else "document_prefix"])
        length = QUERY_LENGTH if is_query else DOCUMENT_LENGTH
        enc = tok(texts, padding="max_length" if is_query else True, truncation=True, max_length=length - 1,
                  return_tensors="pt")  # fmt: skip

        def insert(t, value):
            return torch.cat([t[:, :1], torch.full((t.shape[0], 1), value), t[:, 1:]], dim=1)

        ids, mask = insert(enc["input_ids"], prefix), insert(enc["attention_mask"], 1)
        with torch.no_grad():
            states = model(
                input_ids=ids, attention_mask=mask, token_type_ids=torch.zeros_like(ids)
            ).last_hidden_state
            vectors = states @ weight.T
        if is_query:
            keep = torch.ones_like(ids, dtype=torch.bool)  # expansion tokens included
        else:
            skip = [tok.convert_tokens_to_ids(w) for w in PYLATE_CONFIG["skiplist_words"]]
            keep = mask.bool() & ~torch.isin(ids, torch.tensor(skip))
        return [torch.nn.functional.normalize(v[k], p=2, dim=1).numpy() for v, k in zip(vectors, keep)]

    return encode


def maxsim(q: np.ndarray, d: np.ndarray) -> float:
    """PyLate's colbert_scores for one pair: each query vector's best dot product, summed."""
    return float((q @ d.T).max(1).sum())


def served_feeds(model_dir: Path, texts: list[str], is_query: bool) -> dict:
    """What the text stage feeds a multi_vector model (the pipeline part, spelled out): the
    prompt (the marker) in front; a query cut at query_length and padded to it with the
    expansion token at mask 0; a document through the text stage as any text."""
    (spec,) = load_model(model_dir)
    p = spec.params
    rows = [p.prompts["query" if is_query else "document"] + t for t in texts]
    if not is_query:
        return TextStage(spec)({"text": np.array(rows, dtype=object)})
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tok.enable_truncation(p.query_length)
    tok.enable_padding(pad_id=p.query_expansion_token_id, length=p.query_length)
    enc = tok.encode_batch(rows)
    feeds = {"input_ids": np.array([e.ids for e in enc], np.int64),
             "attention_mask": np.array([e.attention_mask for e in enc], np.int64)}  # fmt: skip
    if "token_type_ids" in spec.model_inputs:
        feeds["token_type_ids"] = np.zeros_like(feeds["input_ids"])
    return feeds


def run(model_dir: Path, feeds: dict) -> list[np.ndarray]:
    sess = ort.InferenceSession(str(model_dir / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    vectors, mask = sess.run(["token_embeddings", "token_mask"], feeds)
    np.testing.assert_array_equal(vectors[mask == 0], 0.0)
    return [v[m == 1] for v, m in zip(vectors, mask)]


@pytest.mark.parametrize("is_query", [True, False], ids=["queries", "documents"])
def test_token_vectors_equal_pylate(colbert, pylate, repo, is_query):
    texts = QUERIES if is_query else DOCS
    got = run(repo / "colbert", served_feeds(repo / "colbert", texts, is_query))
    want = pylate(texts, is_query)
    for text, g, w in zip(texts, got, want):
        assert g.shape == w.shape, text
        assert cosines(g, w).min() >= MIN_COSINE, text
    if is_query:  # every query answers query_length vectors, expansion tokens included
        assert {len(g) for g in got} == {QUERY_LENGTH}
    else:  # punctuation left out of documents' vectors
        period = Tokenizer.from_file(str(colbert / "tokenizer.json")).token_to_id(".")
        feeds = served_feeds(repo / "colbert", DOCS, False)
        assert len(got[2]) == int(feeds["attention_mask"][2].sum()) - int(
            (feeds["input_ids"][2] == period).sum()
        )


def test_maxsim_equals_pylate(pylate, repo):
    q = run(repo / "colbert", served_feeds(repo / "colbert", QUERIES, True))
    d = run(repo / "colbert", served_feeds(repo / "colbert", DOCS, False))
    want_q, want_d = pylate(QUERIES, True), pylate(DOCS, False)
    got = np.array([[maxsim(a, b) for b in d] for a in q])
    want = np.array([[maxsim(a, b) for b in want_d] for a in want_q])
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_prepared_from_a_hub_id_in_an_offline_cache(colbert, repo, tmp_path, monkeypatch):
    """A PyLate folder from its Hub ID in an offline Hugging Face cache (1_Dense beside the
    weights): the same files as from the folder."""
    from tests.test_prepare_sources import cache_layout

    cache = tmp_path / "hub"
    cache_layout(cache, "acme/tiny-colbert", colbert, "e" * 40, ("main",))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    out = prepare_model("acme/tiny-colbert", "colbert", tmp_path / "repo", log=print)
    for f in ("1/model.onnx", "config.pbtxt", "tokenizer.json"):
        assert (out / f).read_bytes() == (repo / "colbert" / f).read_bytes(), f


def test_config_records_markers_lengths_and_kind(repo):
    (spec,) = load_model(repo / "colbert")
    p = spec.params
    assert spec.kind == "multi_vector" and p.kind == "multi_vector"
    assert dict(p.prompts) == {"query": "[Q] ", "document": "[D] "} and p.default_prompt_name is None
    assert (p.query_length, p.max_tokens) == (QUERY_LENGTH, DOCUMENT_LENGTH)
    tok = Tokenizer.from_file(str(repo / "colbert" / "tokenizer.json"))
    assert p.query_expansion_token_id == tok.token_to_id("[MASK]")
    assert {t.name: list(t.dims) for t in spec.outputs} == {"token_embeddings": [-1, DIM], "token_mask": [-1]}


@pytest.mark.parametrize(
    "change, named",
    [
        ({"attend_to_expansion_tokens": True}, "attend_to_expansion_tokens true is not supported"),
        ({"query_prefix": "[QUERY] "}, "is not one token of"),
        ({"document_prefix": ""}, "document_prefix is empty"),
    ],
)
def test_pylate_settings_the_graph_does_not_do_are_refused(colbert, tmp_path, change, named):
    import shutil

    folder = tmp_path / "cb"
    shutil.copytree(colbert, folder)
    (folder / "config_sentence_transformers.json").write_text(json.dumps({**PYLATE_CONFIG, **change}))
    with pytest.raises(PrepareError, match=named):
        read_folder(folder)


def test_served_documents_equal_pylate(pylate, repo, tmp_path):
    """A multi_vector model loads and serves as is: KServe rows with the document marker in
    front answer PyLate's document vectors (queries need the text stage's expansion, which the
    pipeline adds); /v1/models and /info list the model."""
    import shutil
    import urllib.request

    import tritonclient.grpc as tc

    from tests.conftest import start_server

    served = tmp_path / "repo"
    shutil.copytree(repo / "colbert", served / "colbert")
    srv = start_server(tmp_path, "--no-build-models", repo=served, ready_timeout=120)
    try:
        client = tc.InferenceServerClient(srv.grpc_url)
        inp = tc.InferInput("text", [len(DOCS), 1], "BYTES")
        inp.set_data_from_numpy(np.array([("[D] " + d).encode() for d in DOCS], dtype=object).reshape(-1, 1))
        names = ["token_embeddings", "token_mask"]
        res = client.infer(
            "colbert", [inp], outputs=[tc.InferRequestedOutput(n) for n in names], client_timeout=60
        )
        vectors, mask = res.as_numpy("token_embeddings"), res.as_numpy("token_mask")
        client.close()
        base = f"http://127.0.0.1:{srv.http_port}"
        with urllib.request.urlopen(base + "/v1/models", timeout=30) as r:
            assert "colbert" in r.read().decode()
    finally:
        srv.stop()
    for text, v, m, want in zip(DOCS, vectors, mask, pylate(DOCS, False)):
        assert cosines(v[m == 1], want).min() >= MIN_COSINE, text


def test_served_queries_expand_and_rerank_is_maxsim(pylate, repo, tmp_path):
    """Through the text routes: TEI's /embed_all with the query prompt answers PyLate's expanded
    query vectors, documents PyLate's document vectors, and /rerank scores by MaxSim."""
    import shutil
    import urllib.request

    from tests.conftest import start_server

    served = tmp_path / "repo"
    shutil.copytree(repo / "colbert", served / "colbert")
    srv = start_server(tmp_path, "--no-build-models", repo=served, ready_timeout=120)

    def post(path, body):
        req = urllib.request.Request(f"http://127.0.0.1:{srv.http_port}{path}", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())

    try:
        queries = post("/embed_all", {"model": "colbert", "inputs": QUERIES, "prompt_name": "query"})
        docs = post("/embed_all", {"model": "colbert", "inputs": DOCS, "prompt_name": "document"})
        ranked = post("/rerank", {"model": "colbert", "query": QUERIES[0], "texts": DOCS, "raw_scores": True})
    finally:
        srv.stop()
    want_q, want_d = pylate(QUERIES, True), pylate(DOCS, False)
    for got, want in zip(queries, want_q, strict=True):
        assert np.shape(got) == want.shape and cosines(np.array(got), want).min() >= MIN_COSINE
    for got, want in zip(docs, want_d, strict=True):
        assert np.shape(got) == want.shape and cosines(np.array(got), want).min() >= MIN_COSINE
    scores = {r["index"]: r["score"] for r in ranked}
    for j, d in enumerate(want_d):
        assert scores[j] == pytest.approx(maxsim(want_q[0], d), abs=1e-4)


# -- PyLate itself, in an interpreter of its own -----------------------------------------------------

# Run by BATCHGATE_PYLATE_PYTHON: PyLate's ColBERT on the folder, the vectors of the queries and the
# documents, and colbert_scores per pair, as JSON on stdout.
PYLATE_CHILD = r"""
import json, sys
import numpy as np
import torch
from pylate import models
from pylate.scores import colbert_scores

folder, queries, docs = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
model = models.ColBERT(model_name_or_path=folder, device="cpu")
q = model.encode(queries, is_query=True, batch_size=len(queries))
d = model.encode(docs, is_query=False, batch_size=len(docs))
scores = [[float(colbert_scores(torch.as_tensor(a)[None], torch.as_tensor(b)[None])[0][0]) for b in d] for a in q]
print(json.dumps({"queries": [np.asarray(v).tolist() for v in q], "documents": [np.asarray(v).tolist() for v in d],
                  "scores": scores}))
"""


def test_pylate_itself_answers_what_is_served(colbert, repo):
    """PyLate's ``ColBERT`` itself, not its computation restated: PyLate 1.6 pins transformers <=
    5.3, sentence-transformers 5.3 and (through fast-plaid) torch 2.7-2.10, so it runs in another
    interpreter, named by ``BATCHGATE_PYLATE_PYTHON`` (docs/models.md, ColBERT); skipped where
    none is named. Every query's and document's vectors, and MaxSim per pair, equal its answers."""
    import os
    import subprocess

    python = os.environ.get("BATCHGATE_PYLATE_PYTHON")
    if not python:
        pytest.skip("BATCHGATE_PYLATE_PYTHON (an interpreter with PyLate) is not set")
    child = subprocess.run([python, "-c", PYLATE_CHILD, str(colbert), json.dumps(QUERIES), json.dumps(DOCS)],
                           capture_output=True, text=True, timeout=600, cwd=colbert.parent)  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]
    ref = json.loads(child.stdout.strip().splitlines()[-1])
    q = run(repo / "colbert", served_feeds(repo / "colbert", QUERIES, True))
    d = run(repo / "colbert", served_feeds(repo / "colbert", DOCS, False))
    for got, want, texts in ((q, ref["queries"], QUERIES), (d, ref["documents"], DOCS)):
        for text, g, w in zip(texts, got, want):
            w = np.array(w, np.float32)
            assert g.shape == w.shape, text
            assert cosines(g, w).min() >= MIN_COSINE, text
    assert {len(v) for v in q} == {QUERY_LENGTH}  # expansion tokens kept, as PyLate keeps them
    got = np.array([[maxsim(a, b) for b in d] for a in q])
    np.testing.assert_allclose(got, np.array(ref["scores"]), atol=1e-5)
