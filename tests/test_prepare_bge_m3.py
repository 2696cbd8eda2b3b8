"""``batchgate prepare-model`` for BGE-M3: its XLM-R encoder and FlagEmbedding's two extra heads
(``colbert_linear.pt``, ``sparse_linear.pt``, torch.save files read without torch) in one graph
that answers all three outputs in one pass.

The reference is FlagEmbedding's own computation, restated here from its source
(``FlagEmbedding/finetune/embedder/encoder_only/m3/modeling.py`` ``_dense_embedding`` (cls),
``_sparse_embedding``, ``_colbert_embedding`` and ``EncoderOnlyEmbedderM3ModelForInference``;
``inference/embedder/encoder_only/m3.py`` ``_process_token_weights``, ``_process_colbert_vecs``,
``compute_lexical_matching_score``, ``colbert_score``), with transformers' ``XLMRobertaModel`` as
the encoder. FlagEmbedding 1.4.2 does not import beside transformers 5 (its package __init__
imports ``transformers.modeling_attn_mask_utils``, gone in transformers 5), so ``BGEM3FlagModel``
itself runs in an interpreter of its own where one is named (``BATCHGATE_FLAGEMBEDDING_PYTHON``:
``test_flagembedding_itself_answers_what_is_served``).

The folder is tiny (hidden 32, 2 layers, scrambled), laid out as BAAI/bge-m3 is: a
sentence-transformers folder (Transformer, CLS Pooling, Normalize) with the two head files
beside the weights, all written with numpy (tests/layouts.py), so the tests that only prepare or
read it run without torch; those that compare with FlagEmbedding's computation ask for the
``flag`` fixture, which loads the folder into transformers and the heads with torch.load. Rows of
mixed lengths in one padded batch, words repeated in a row (so the sparse weights' max per id is
not a sum), per-row cosine >= 0.999999 for each output.
"""

from __future__ import annotations

import json
import shutil
from fnmatch import fnmatch
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from tokenizers import Tokenizer

from batchgate.gateway.models import bge_m3, sources
from batchgate.gateway.models.hf_model import PrepareError
from batchgate.gateway.models.prepare import prepare_model
from batchgate.gateway.models.torch_file import TorchFileError, read_state_dict
from batchgate.gateway.repository import load_model
from batchgate.gateway.text import TextStage
from tests.layouts import save_torch_file, write_folder
from tests.test_prepare_model import MIN_COSINE, TEXTS, TINY, cosines, st_folder, unigram
from tests.test_prepare_sources import cache_layout

COLBERT_DIM = TINY["hidden_size"]  # BGE-M3's, and what FlagEmbedding builds: its hidden size
ROWS = TEXTS + ["the dog and the cat and the dog", "the the the the"]


def xlm_roberta():
    """The encoder, as FlagEmbedding's folder holds it: an XLMRobertaModel without the pooler."""
    import transformers as t

    cfg = t.XLMRobertaConfig(**TINY, vocab_size=unigram().get_vocab_size(), max_position_embeddings=40,
                             pad_token_id=1, bos_token_id=0, eos_token_id=2)  # fmt: skip
    return t.XLMRobertaModel(cfg, add_pooling_layer=False)


LAYOUTS = {"bge_m3_xlm_roberta": xlm_roberta}
SPECIAL = {"bos_token": "<s>", "cls_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>",
           "sep_token": "</s>", "mask_token": "<mask>"}  # fmt: skip


@pytest.fixture(scope="module")
def m3(tmp_path_factory):
    """A folder as BAAI/bge-m3 is laid out, written with numpy (no torch): the encoder in
    transformers' layout, the tokenizer, sentence-transformers' files (CLS pooling, Normalize) and
    the two head files as FlagEmbedding's save() writes them (torch.save of each Linear's state
    dict)."""
    root = tmp_path_factory.mktemp("bge-m3")
    d = write_folder(root / "bge-m3", "bge_m3_xlm_roberta", seed=0)
    unigram().save(str(d / "tokenizer.json"))
    (d / "special_tokens_map.json").write_text(json.dumps(SPECIAL))
    st_folder(d, "cls", True)
    rng = np.random.default_rng(0)
    hidden = TINY["hidden_size"]
    colbert_w, colbert_b, sparse_w = (
        (0.3 * rng.standard_normal(shape)).astype(np.float32)
        for shape in ((COLBERT_DIM, hidden), (COLBERT_DIM,), (1, hidden))
    )
    sparse_b = sparse_bias(d, sparse_w, root / "probe")
    save_torch_file(d / bge_m3.COLBERT_FILE, {"weight": colbert_w, "bias": colbert_b})
    save_torch_file(d / bge_m3.SPARSE_FILE, {"weight": sparse_w, "bias": np.array([sparse_b], np.float32)})
    return d


def sparse_bias(folder: Path, weight: np.ndarray, probe: Path) -> float:
    """A sparse bias that leaves about half of the rows' token weights positive, so relu and the
    w > 0 filter both matter (scrambled states share a direction that a random head reads one way),
    and none at 0 (where float rounding would decide whether relu keeps it): between the two
    middle values of w . h over ROWS' tokens.

    w . h per token read without torch from batchgate's own graph, through a probe ColBERT head
    of two rows: (w, bias 0) and (0, bias 1). Its normalised vector is (x, 1) / |(x, 1)| with
    x = w . h, so x is the ratio of the two (every token after CLS, special tokens included)."""
    hidden = TINY["hidden_size"]
    probe_w = np.stack([weight[0], np.zeros(hidden, np.float32)])
    save_torch_file(
        folder / bge_m3.COLBERT_FILE, {"weight": probe_w, "bias": np.array([0.0, 1.0], np.float32)}
    )
    save_torch_file(folder / bge_m3.SPARSE_FILE, {"weight": weight, "bias": np.zeros(1, np.float32)})
    prepare_model(folder, "probe", probe, log=print)
    out, _ = run(probe / "probe", ROWS)
    vecs = out["token_embeddings"][out["token_mask"] == 1]
    # Rows cut at the same 38 tokens (TEXTS' two longest) answer equal values: rounded, they are one.
    raw = np.sort(np.round(vecs[:, 0] / vecs[:, 1], 4))
    upper = raw[len(raw) // 2]
    lower = raw[raw < upper].max()
    assert upper - lower > 1e-3, (lower, upper)  # far from float rounding on either side
    return -float(lower + upper) / 2


@pytest.fixture(scope="module")
def repo(m3, tmp_path_factory):
    repo = tmp_path_factory.mktemp("bge-m3-repo")
    prepare_model(m3, "m3", repo, log=print)
    return repo


@pytest.fixture(scope="module")
def flag(m3):
    """FlagEmbedding's dense_vecs, lexical_weights and colbert_vecs of a list of texts (restated),
    from transformers' XLMRobertaModel of the folder and the heads read by torch.load: only the
    tests that compare with it ask for it (and skip without the reference extra)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model, info = transformers.XLMRobertaModel.from_pretrained(
        m3, add_pooling_layer=False, output_loading_info=True
    )
    # every weight read from the folder, none left at transformers' random init
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    model.eval()
    heads = []
    for name, n_out in ((bge_m3.COLBERT_FILE, COLBERT_DIM), (bge_m3.SPARSE_FILE, 1)):
        head = torch.nn.Linear(TINY["hidden_size"], n_out)
        head.load_state_dict(torch.load(m3 / name, weights_only=True))
        heads.append(head)
    colbert, sparse = heads
    tok = Tokenizer.from_file(str(m3 / "tokenizer.json"))
    tok.enable_truncation(38)  # max_position_embeddings 40 less XLM-R's padding_idx + 1
    tok.enable_padding(pad_id=1, pad_token="<pad>")
    # tokenizer.cls_token_id, eos_token_id, pad_token_id, unk_token_id
    unused = {tok.token_to_id(t) for t in ("<s>", "</s>", "<pad>", "<unk>")}

    def reference(texts: list[str]) -> tuple[np.ndarray, list[dict[int, float]], list[np.ndarray]]:
        enc = tok.encode_batch(texts)
        ids = torch.tensor([e.ids for e in enc])
        mask = torch.tensor([e.attention_mask for e in enc])
        with torch.no_grad():
            h = model(input_ids=ids, attention_mask=mask).last_hidden_state
            dense = torch.nn.functional.normalize(h[:, 0], dim=-1)
            token_weights = torch.relu(sparse(h)).squeeze(-1)
            vecs = colbert(h[:, 1:]) * mask[:, 1:][:, :, None].float()
            vecs = torch.nn.functional.normalize(vecs, dim=-1)
        lexical = []
        for weights, row in zip(token_weights.numpy(), ids.numpy()):
            result: dict[int, float] = {}
            for w, idx in zip(weights, row):
                if idx not in unused and w > 0 and w > result.get(int(idx), 0):
                    result[int(idx)] = float(w)
            lexical.append(result)
        colbert_vecs = [v[: int(m.sum()) - 1] for v, m in zip(vecs.numpy(), mask.numpy())]
        return dense.numpy(), lexical, colbert_vecs

    return reference


def run(model_dir: Path, texts: list[str]) -> tuple[dict[str, np.ndarray], dict]:
    (spec,) = load_model(model_dir)
    feeds = TextStage(spec)({"text": np.array(texts, dtype=object)})
    sess = ort.InferenceSession(str(model_dir / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, feeds))), feeds


def as_dict(row: np.ndarray) -> dict[int, float]:
    return {int(i): float(row[i]) for i in np.flatnonzero(row)}


def test_one_pass_answers_flagembedding_three_outputs(m3, flag, repo):
    out, feeds = run(repo / "m3", ROWS)
    assert feeds["attention_mask"].min() == 0  # mixed lengths: padded
    dense, lexical, colbert = flag(ROWS)
    # dense: the CLS state, normalised
    cos = cosines(out["embedding"], dense)
    assert cos.min() >= MIN_COSINE, cos
    # sparse: the same ids, the same weights (max per id), special tokens and padding dropped
    assert out["sparse_embedding"].shape == (
        len(ROWS),
        Tokenizer.from_file(str(m3 / "tokenizer.json")).get_vocab_size(),
    )
    for got, want in zip(out["sparse_embedding"], lexical):
        got = as_dict(got)
        assert got.keys() == want.keys()
        np.testing.assert_allclose([got[k] for k in want], list(want.values()), rtol=1e-5, atol=1e-5)
    # Not vacuous: most rows have weights, some tokens none; a repeated word has one weight (its max).
    assert sum(bool(w) for w in lexical) > len(ROWS) // 2 and sum(map(len, lexical)) < sum(
        len(r.split()) for r in ROWS
    )
    ids = Tokenizer.from_file(str(m3 / "tokenizer.json")).encode("the dog and the cat and the dog").ids
    assert len(ids) - len(set(ids)) >= 3
    # ColBERT: the rows token_mask keeps, in order, are FlagEmbedding's colbert_vecs
    for vecs, keep, want in zip(out["token_embeddings"], out["token_mask"], colbert):
        got = vecs[keep == 1]
        assert got.shape == want.shape
        assert cosines(got, want).min() >= MIN_COSINE
        np.testing.assert_allclose(vecs[keep == 0], 0.0)


def test_card_scores_from_the_outputs(flag, repo):
    """The card's compute_score, per pair, from the served outputs equals FlagEmbedding's: dense
    dot product, lexical matching score, ColBERT MaxSim (mean over the query's vectors), and
    their weighted mean with the card's weights."""
    queries, docs = (
        ["what is the man eating", "who plays the violin"],
        ["the man is eating bread", "a violin"],
    )
    out_q, _ = run(repo / "m3", queries)
    out_d, _ = run(repo / "m3", docs)
    ref_q, ref_d = flag(queries), flag(docs)
    w = bge_m3.CARD_WEIGHTS
    for i in range(len(queries)):
        dense = float(out_q["embedding"][i] @ out_d["embedding"][i])
        sparse = float(out_q["sparse_embedding"][i] @ out_d["sparse_embedding"][i])
        q = out_q["token_embeddings"][i][out_q["token_mask"][i] == 1]
        p = out_d["token_embeddings"][i][out_d["token_mask"][i] == 1]
        colbert = float((q @ p.T).max(1).sum() / len(q))
        want_dense = float(ref_q[0][i] @ ref_d[0][i])
        want_sparse = sum(v * ref_d[1][i][k] for k, v in ref_q[1][i].items() if k in ref_d[1][i])
        want_colbert = float((ref_q[2][i] @ ref_d[2][i].T).max(1).sum() / len(ref_q[2][i]))
        np.testing.assert_allclose(
            [dense, sparse, colbert], [want_dense, want_sparse, want_colbert], atol=1e-5
        )
        combined = (w[0] * dense + w[1] * sparse + w[2] * colbert) / sum(w)
        want = (w[0] * want_dense + w[1] * want_sparse + w[2] * want_colbert) / sum(w)
        assert abs(combined - want) < 1e-5


def test_config_declares_the_three_outputs(repo):
    (spec,) = load_model(repo / "m3")
    assert spec.kind == "embedding" and spec.params.pooling == "cls" and spec.params.normalize
    assert spec.params.score_weights == bge_m3.CARD_WEIGHTS
    dims = {t.name: list(t.dims) for t in spec.outputs}
    assert dims == {"embedding": [TINY["hidden_size"]], "sparse_embedding": [dims["sparse_embedding"][0]],
                    "token_embeddings": [-1, COLBERT_DIM], "token_mask": [-1]}  # fmt: skip
    assert "BGE-M3, one pass, three outputs" in (repo / "m3" / "config.pbtxt").read_text()


def test_prepare_from_a_hub_id_in_an_offline_cache(m3, tmp_path, monkeypatch):
    """BAAI/bge-m3's layout read from the hub cache with HF_HUB_OFFLINE=1: the heads' .pt files
    are among the files a build reads, and the entry equals the folder's."""
    cache = tmp_path / "hub"
    cache_layout(cache, "acme/tiny-m3", m3, "c" * 40, ("main",))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    out = prepare_model("acme/tiny-m3", "m3", tmp_path / "repo", log=print)
    direct = prepare_model(m3, "m3", tmp_path / "direct", log=print)
    for f in ("1/model.onnx", "tokenizer.json", "config.pbtxt"):
        assert (out / f).read_bytes() == (direct / f).read_bytes()
    # a download (online) fetches the heads too
    assert all(
        any(fnmatch(n, p) for p in sources.ALLOW_PATTERNS) for n in (bge_m3.COLBERT_FILE, bge_m3.SPARSE_FILE)
    )


def test_torch_file_reader_refuses_what_is_not_a_state_dict(m3, tmp_path):
    import pickle
    import zipfile

    state = read_state_dict(m3 / bge_m3.SPARSE_FILE)
    assert state["weight"].shape == (1, TINY["hidden_size"]) and state["bias"].shape == (1,)
    # A pickle naming anything beyond a tensor's rebuild (here os.system) is refused by name.
    bad = tmp_path / "bad.pt"
    with zipfile.ZipFile(bad, "w") as z:
        z.writestr("bad/data.pkl", b"cos\nsystem\n(S'true'\ntR.")
    with pytest.raises(TorchFileError, match="os.system is not part of a plain tensor state dict"):
        read_state_dict(bad)
    (tmp_path / "legacy.pt").write_bytes(pickle.dumps({"weight": 1}))
    with pytest.raises(TorchFileError, match="legacy format"):
        read_state_dict(tmp_path / "legacy.pt")


def test_a_head_of_the_wrong_size_is_refused(m3, tmp_path):
    folder = tmp_path / "m3"
    shutil.copytree(m3, folder)
    wrong = {"weight": np.ones((1, TINY["hidden_size"] + 1), np.float32), "bias": np.zeros(1, np.float32)}
    save_torch_file(folder / bge_m3.SPARSE_FILE, wrong)  # a Linear(hidden + 1, 1)'s state dict
    with pytest.raises(PrepareError, match="sparse_linear.pt: expected a Linear's weight"):
        prepare_model(folder, "m3", tmp_path / "repo", log=print)


def test_served_one_call_answers_all_three(flag, repo, tmp_path):
    """Served as is: one KServe call asks for all four outputs (one engine run), each equal to
    FlagEmbedding's; OpenAI /v1/embeddings answers the dense vector."""
    import urllib.request

    import tritonclient.grpc as tc

    from tests.conftest import start_server

    served = tmp_path / "repo"
    shutil.copytree(repo / "m3", served / "m3")
    srv = start_server(tmp_path, "--no-build-models", repo=served, ready_timeout=120)
    try:
        client = tc.InferenceServerClient(srv.grpc_url)
        inp = tc.InferInput("text", [len(ROWS), 1], "BYTES")
        inp.set_data_from_numpy(np.array([r.encode() for r in ROWS], dtype=object).reshape(-1, 1))
        names = ["embedding", "sparse_embedding", "token_embeddings", "token_mask"]
        res = client.infer(
            "m3", [inp], outputs=[tc.InferRequestedOutput(n) for n in names], client_timeout=60
        )
        out = {n: res.as_numpy(n) for n in names}
        client.close()
        body = json.dumps({"model": "m3", "input": ROWS[:3]}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{srv.http_port}/v1/embeddings", body,
                                     {"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=60) as r:
            oai = np.array([d["embedding"] for d in json.loads(r.read())["data"]], np.float32)
    finally:
        srv.stop()
    dense, lexical, colbert = flag(ROWS)
    assert cosines(out["embedding"], dense).min() >= MIN_COSINE
    assert cosines(oai, dense[:3]).min() >= MIN_COSINE
    for row, want in zip(out["sparse_embedding"], lexical):
        assert as_dict(row).keys() == want.keys()
    for vecs, keep, want in zip(out["token_embeddings"], out["token_mask"], colbert):
        assert cosines(vecs[keep == 1], want).min() >= MIN_COSINE


def test_served_text_routes_read_each_output_and_rerank_by_the_card(flag, repo, tmp_path):
    """TEI's /embed_sparse reads the sparse head, /embed_all the ColBERT vectors (token_mask's),
    and /rerank scores with the card's weighted mean of the three, each equal to FlagEmbedding's."""
    import urllib.request

    from tests.conftest import start_server

    served = tmp_path / "repo"
    shutil.copytree(repo / "m3", served / "m3")
    srv = start_server(tmp_path, "--no-build-models", repo=served, ready_timeout=120)

    def post(path, body):
        req = urllib.request.Request(f"http://127.0.0.1:{srv.http_port}{path}", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())

    query, docs = "what is the man eating", ["the man is eating bread", "a violin", "bread"]
    try:
        sparse = post("/embed_sparse", {"model": "m3", "inputs": ROWS[:3]})
        tokens = post("/embed_all", {"model": "m3", "inputs": ROWS[:3]})
        ranked = post("/rerank", {"model": "m3", "query": query, "texts": docs, "raw_scores": True})
    finally:
        srv.stop()
    dense, lexical, colbert = flag(ROWS[:3])
    for got, want in zip(sparse, lexical, strict=True):
        assert {g["index"]: g["value"] for g in got} == pytest.approx(want, abs=1e-5)
    for got, want in zip(tokens, colbert, strict=True):
        assert np.shape(got) == want.shape and cosines(np.array(got), want).min() >= MIN_COSINE
    ref_q, ref_d = flag([query]), flag(docs)
    w = bge_m3.CARD_WEIGHTS
    scores = {r["index"]: r["score"] for r in ranked}
    for j in range(len(docs)):
        d = float(ref_q[0][0] @ ref_d[0][j])
        s = sum(v * ref_d[1][j][k] for k, v in ref_q[1][0].items() if k in ref_d[1][j])
        c = float((ref_q[2][0] @ ref_d[2][j].T).max(1).sum() / len(ref_q[2][0]))
        assert scores[j] == pytest.approx((w[0] * d + w[1] * s + w[2] * c) / sum(w), abs=1e-5)


# -- FlagEmbedding itself, in an interpreter of its own ---------------------------------------------

# Run by BATCHGATE_FLAGEMBEDDING_PYTHON: BGEM3FlagModel on the folder, its three outputs for the
# rows, its token ids, and compute_score's modes for the pairs, as JSON on stdout.
FLAG_CHILD = r"""
import json, sys
import numpy as np
from FlagEmbedding import BGEM3FlagModel

folder, rows, pairs, max_length, weights = sys.argv[1], *map(json.loads, sys.argv[2:6])
model = BGEM3FlagModel(folder, use_fp16=False, devices="cpu", normalize_embeddings=True)
out = model.encode(rows, batch_size=len(rows), max_length=max_length, return_dense=True,
                   return_sparse=True, return_colbert_vecs=True)
scores = model.compute_score(pairs, batch_size=len(pairs), max_query_length=max_length,
                             max_passage_length=max_length, weights_for_different_modes=weights)
ids = model.tokenizer(rows, truncation=True, max_length=max_length)["input_ids"]
print(json.dumps({
    "dense": np.asarray(out["dense_vecs"]).tolist(),
    "lexical": [{str(k): float(v) for k, v in w.items()} for w in out["lexical_weights"]],
    "colbert": [np.asarray(v).tolist() for v in out["colbert_vecs"]],
    "scores": {k: [float(x) for x in v] for k, v in scores.items()},
    "ids": ids,
}))
"""
FLAG_PAIRS = [["what is the man eating", "the man is eating bread"], ["who plays the violin", "a violin"],
              ["dog", "the dog and the cat and the dog"]]  # fmt: skip


def test_flagembedding_itself_answers_what_is_served(repo, m3):
    """``BGEM3FlagModel`` itself, not its computation restated: FlagEmbedding 1.4.2 imports only
    beside transformers 4, so it runs in another interpreter, named by
    ``BATCHGATE_FLAGEMBEDDING_PYTHON`` (one with FlagEmbedding 1.4.2, transformers<5 and torch:
    docs/models.md, BGE-M3); skipped where none is named. The served graph's three outputs per
    row and the card's combined score per pair equal what it answers."""
    import os
    import subprocess

    python = os.environ.get("BATCHGATE_FLAGEMBEDDING_PYTHON")
    if not python:
        pytest.skip("BATCHGATE_FLAGEMBEDDING_PYTHON (an interpreter with FlagEmbedding) is not set")
    # transformers 4 reads tokenizer.json as it is; the rows avoid what transformers 5's rebuilt
    # XLM-R tokenizer (the one served) splits otherwise: trailing whitespace, tabs, space runs.
    rows = ROWS
    child = subprocess.run(
        [python, "-c", FLAG_CHILD, str(m3), json.dumps(rows), json.dumps(FLAG_PAIRS), "38",
         json.dumps(list(bge_m3.CARD_WEIGHTS))],
        capture_output=True, text=True, timeout=600, cwd=m3.parent,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]
    ref = json.loads(child.stdout.strip().splitlines()[-1])
    out, feeds = run(repo / "m3", rows)
    for i, want in enumerate(ref["ids"]):
        assert feeds["input_ids"][i][: len(want)].tolist() == want, rows[i]
    assert cosines(out["embedding"], np.array(ref["dense"], np.float32)).min() >= MIN_COSINE
    for got, want in zip(out["sparse_embedding"], ref["lexical"]):
        got, want = as_dict(got), {int(k): v for k, v in want.items()}
        assert got.keys() == want.keys()
        np.testing.assert_allclose([got[k] for k in want], list(want.values()), rtol=1e-5, atol=1e-5)
    assert sum(bool(w) for w in ref["lexical"]) > len(rows) // 2  # not vacuous
    for vecs, keep, want in zip(out["token_embeddings"], out["token_mask"], ref["colbert"]):
        want = np.array(want, np.float32)
        assert vecs[keep == 1].shape == want.shape
        assert cosines(vecs[keep == 1], want).min() >= MIN_COSINE
    q, _ = run(repo / "m3", [p[0] for p in FLAG_PAIRS])
    d, _ = run(repo / "m3", [p[1] for p in FLAG_PAIRS])
    w = bge_m3.CARD_WEIGHTS
    for i in range(len(FLAG_PAIRS)):
        qv, dv = (
            q["token_embeddings"][i][q["token_mask"][i] == 1],
            d["token_embeddings"][i][d["token_mask"][i] == 1],
        )
        modes = {
            "dense": float(q["embedding"][i] @ d["embedding"][i]),
            "sparse": float(q["sparse_embedding"][i] @ d["sparse_embedding"][i]),
            "colbert": float((qv @ dv.T).max(1).sum() / len(qv)),
        }
        modes["colbert+sparse+dense"] = (w[0] * modes["dense"] + w[1] * modes["sparse"]
                                         + w[2] * modes["colbert"]) / sum(w)  # fmt: skip
        for mode, got in modes.items():
            assert abs(got - ref["scores"][mode][i]) < 1e-5, (mode, i, got, ref["scores"][mode][i])
