"""Token vectors (TEI's ``/embed_all``): ``batchgate prepare-model ... token_embeddings`` adds an
output ``token_embeddings`` FP32 [-1, hidden] to an embedding model, each token's final state.

The length dim is the input's ``seq`` (the same ONNX dim_param), so it travels as any per-token
output does: the engine trims a batch to its own longest row, the runtime pads a call whose rows
ran in batches of different lengths to the longest of them (gateway/runtime.py ``_assemble``), and
KServe answers [rows, longest, hidden]. The graph zeroes every position past a row's tokens, so a
row's own vectors are its first ``len(tokens)``, and the rest are exactly 0. Checked here against
transformers' ``last_hidden_state`` on texts of mixed lengths (several length buckets in one call,
and past the model's limit), and the pooled embedding beside it is unchanged.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnxruntime as ort
import pytest

from batchgate.gateway.models.prepare import prepare_model
from batchgate.gateway.repository import load_model
from batchgate.gateway.text import TextStage
from batchgate.workers import EngineOptions, WorkerPool, discover
from tests.prepared import client, kserve_grpc, kserve_rest, server, tiny_configs, torch_feeds  # noqa: F401  (fixtures)
from tests.test_prepare_model import TEXTS, cosines, st_folder
from tests.tiny_models import TransformersModel, transformers_folder

MAX_DIFF = 1e-4
MIN_COSINE = 0.9999


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    bert, xlmr, wp, ug = tiny_configs()
    root = tmp_path_factory.mktemp("token-folders")
    made = {
        "bert_tokens": ("BertModel", bert, wp, "mean", True),
        "xlmr_tokens": ("XLMRobertaModel", xlmr, ug, "cls", False),
    }
    out = {}
    for seed, (name, (architecture, config, tok, pooling, normalize)) in enumerate(made.items()):
        d = transformers_folder(root / name, architecture, config, tok, seed=30 + seed)
        st_folder(d, pooling, normalize, **{"sentence_bert_config.json": {"max_seq_length": 36}})
        # transformers' model of it, loaded by the reference tests alone
        out[name] = (d, TransformersModel(d), pooling, normalize)
    return out


@pytest.fixture(scope="module")
def repo(folders, tmp_path_factory):
    repo = tmp_path_factory.mktemp("token-repo")
    for name, (folder, *_rest) in folders.items():
        if name == "bert_tokens":  # one through the command line a user types
            cmd = [sys.executable, "-m", "batchgate", "prepare-model", str(folder), "--name", name,
                   "--model-repository", str(repo), "--token-embeddings"]  # fmt: skip
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            assert proc.returncode == 0, proc.stderr
        else:
            prepare_model(folder, name, repo, token_embeddings=True, log=print)
        prepare_model(folder, name + "_plain", repo, log=print)
    return repo


def reference(folder, model, rows: list[str]) -> tuple[np.ndarray, list[int]]:
    """(transformers' last_hidden_state for the padded batch, each row's token count)."""
    torch = pytest.importorskip("torch")

    feeds = torch_feeds(folder, model, rows)
    with torch.no_grad():
        states = model(**feeds).last_hidden_state.numpy()
    return states, [int(n) for n in feeds["attention_mask"].sum(1)]


def check_rows(got: np.ndarray, want: np.ndarray, counts: list[int], name: str) -> None:
    """Each row's first ``count`` vectors are transformers'; every vector past them is 0."""
    assert got.shape[0] == len(counts) and got.shape[2] == want.shape[2]
    assert got.shape[1] == max(counts)  # padded to the longest row of the answer, no further
    worst = 0.0
    for i, n in enumerate(counts):
        np.testing.assert_allclose(got[i, :n], want[i, :n], atol=MAX_DIFF, rtol=0)
        worst = max(worst, float(np.abs(got[i, :n] - want[i, :n]).max()))
        assert not got[i, n:].any(), f"row {i}: padding positions are not zero"
    print(f"{name}: token counts {counts}, max |diff| {worst:.2e}")


def test_config_adds_the_output_beside_the_embedding(repo):
    spec = load_model(repo / "bert_tokens")[0]
    assert spec.kind == "embedding"
    assert [(t.name, t.dims) for t in spec.outputs] == [("embedding", (32,)), ("token_embeddings", (-1, 32))]
    assert [t.name for t in load_model(repo / "bert_tokens_plain")[0].outputs] == ["embedding"]


@pytest.mark.parametrize("name", ["bert_tokens", "xlmr_tokens"])
def test_graph_matches_transformers(name, folders, repo):
    folder, model, *_ = folders[name]
    spec = load_model(repo / name)[0]
    feeds = TextStage(spec)({"text": np.array([t.encode() for t in TEXTS], dtype=object).reshape(-1, 1)})
    (got,) = ort.InferenceSession(str(repo / name / "1" / "model.onnx")).run(["token_embeddings"], feeds)
    check_rows(got, *reference(folder, model, TEXTS), name)


@pytest.mark.parametrize("length_runs", [False, True], ids=["one-padded-run", "runs-by-length"])
def test_a_request_batched_with_longer_rows_gets_its_own_length(folders, repo, length_runs):
    """Two callers' rows in one batch: tokenised and run padded to its longest row, or cut into
    runs of similar length (``length_runs``, workers/runs.py); either way each request's token
    vectors come back at its own longest row (the shape of an answer never depends on whose rows
    shared its batch), equal to the request run alone."""
    folder, model, *_ = folders["bert_tokens"]
    spec = load_model(repo / "bert_tokens")[0]
    options = EngineOptions(preprocess=TextStage(spec), length_runs=length_runs)
    pool = WorkerPool("tokens", spec.path, discover("cpu")[:1], 1, options, spec.buckets)
    pool.start()
    try:
        short, long = [TEXTS[0], TEXTS[4]], [TEXTS[5]]
        parts = [{"text": np.array([[t.encode()] for t in rows], dtype=object)} for rows in (short, long)]
        (a, b), timing = pool.submit(parts, [2, 1], True).result(timeout=60)
        alone = pool.submit(parts[:1], [2], True).result(timeout=60)[0][0]
    finally:
        pool.close()
    counts = reference(folder, model, short)[1] + reference(folder, model, long)[1]
    assert timing.tokens == sum(counts)  # the rows' own tokens, whatever ran
    if length_runs:  # the long row alone, the short ones at their own width
        assert timing.runs == 2 and timing.padded_tokens == 2 * max(counts[:2]) + counts[2]
    else:
        assert timing.runs == 1 and timing.padded_tokens == 3 * max(counts)
    states, counts = reference(folder, model, short)
    check_rows(a["token_embeddings"], states, counts, "short rows batched with a long one")
    np.testing.assert_array_equal(a["token_embeddings"].shape, alone["token_embeddings"].shape)
    np.testing.assert_allclose(a["token_embeddings"], alone["token_embeddings"], atol=1e-5, rtol=0)
    check_rows(b["token_embeddings"], *reference(folder, model, long), "the long row")


def test_rows_cut_into_runs_by_length_come_back_in_their_order(repo):
    """A batch whose rows' lengths interleave (long, short, middle, short, ...) runs as several
    runs of similar length; every row's embedding and token vectors are what it gets run alone,
    in the batch's order, and its token vectors are zero past its own tokens."""
    spec = load_model(repo / "bert_tokens")[0]
    pool = WorkerPool("tokens", spec.path, discover("cpu")[:1], 1, EngineOptions(preprocess=TextStage(spec)),
                      spec.buckets)  # fmt: skip
    rows = [TEXTS[6], TEXTS[0], TEXTS[2], TEXTS[7], TEXTS[5], TEXTS[1], TEXTS[0], TEXTS[3]]

    def part(texts):
        return {"text": np.array([[t.encode()] for t in texts], dtype=object)}

    pool.start()
    try:
        (got,), timing = pool.submit([part(rows)], [len(rows)], True).result(timeout=60)
        alone = [pool.submit([part([t])], [1], True).result(timeout=60)[0][0] for t in rows]
    finally:
        pool.close()
    assert timing.runs >= 3 and timing.padded_tokens < len(rows) * got["token_embeddings"].shape[1]
    assert got["token_embeddings"].shape[1] == max(a["token_embeddings"].shape[1] for a in alone)
    for i, a in enumerate(alone):
        n = a["token_embeddings"].shape[1]
        np.testing.assert_allclose(got["embedding"][i], a["embedding"][0], atol=1e-5, rtol=0)
        np.testing.assert_allclose(
            got["token_embeddings"][i, :n], a["token_embeddings"][0], atol=1e-5, rtol=0
        )
        assert not got["token_embeddings"][i, n:].any(), f"row {i}: past its tokens is not zero"


@pytest.mark.parametrize("name", ["bert_tokens", "xlmr_tokens"])
def test_served_token_vectors_across_length_buckets(name, folders, client):  # noqa: F811
    """One call whose rows fall in several length buckets (so they run as separate requests and
    come back from batches of different lengths), then calls of short rows alone."""
    folder, model, *_ = folders[name]
    got = kserve_grpc(client, name, TEXTS, ["token_embeddings", "embedding"])
    check_rows(got.as_numpy("token_embeddings"), *reference(folder, model, TEXTS), name)
    plain = kserve_grpc(client, name + "_plain", TEXTS, ["embedding"]).as_numpy("embedding")
    assert cosines(got.as_numpy("embedding"), plain).min() >= MIN_COSINE  # the extra output changes nothing
    short = TEXTS[:2]
    got = kserve_grpc(client, name, short, ["token_embeddings"]).as_numpy("token_embeddings")
    check_rows(got, *reference(folder, model, short), name)


def test_served_over_kserve_rest(folders, server):  # noqa: F811
    folder, model, *_ = folders["xlmr_tokens"]
    got = kserve_rest(server, "xlmr_tokens", TEXTS, ["token_embeddings"])["token_embeddings"]
    check_rows(got, *reference(folder, model, TEXTS), "xlmr_tokens over REST")
