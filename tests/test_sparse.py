"""Sparse encoders (SPLADE) through ``batchgate prepare-model``: a masked-LM folder that
sentence-transformers' ``modules.json`` declares a ``SparseEncoder`` (``MLMTransformer`` then
``SpladePooling``) served as ``sparse_embedding``, FP32 [vocab].

The reference is transformers' own masked-LM logits, then what SpladePooling computes:
log(1 + relu(logits)) (``log1p_relu``: log1p once more), padding masked, max (or sum) over the
tokens. Tiny scrambled BERT, XLM-R and DistilBERT masked LMs, texts of mixed lengths past the
models' limits, in onnxruntime and over KServe gRPC.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnxruntime as ort
import pytest

from batchgate.gateway.models.hf_model import PrepareError, read_folder
from batchgate.gateway.models.prepare import prepare_model
from batchgate.gateway.repository import load_model
from batchgate.gateway.text import TextStage
from tests.prepared import client, kserve_grpc, kserve_rest, server, tiny_configs, torch_feeds  # noqa: F401  (fixtures)
from tests.test_prepare_model import TEXTS, TINY, wordpiece
from tests.tiny_models import TransformersModel, transformers_folder

MAX_DIFF = 1e-4  # the acceptance bound
ST = "sentence_transformers.sparse_encoder.models."


def splade_folder(
    d, activation: str = "relu", pooling: str = "max", transformer: str = "MLMTransformer"
) -> None:
    """sentence-transformers v5's files beside a saved masked LM (as SparseEncoder.save writes)."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": ST + transformer},
               {"idx": 1, "name": "1", "path": "1_SpladePooling", "type": ST + "SpladePooling"}]  # fmt: skip
    (d / "modules.json").write_text(json.dumps(modules))
    (d / "1_SpladePooling").mkdir(exist_ok=True)
    (d / "1_SpladePooling" / "config.json").write_text(
        json.dumps(
            {"pooling_strategy": pooling, "activation_function": activation, "word_embedding_dimension": None}
        )
    )
    (d / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 40, "do_lower_case": False}))
    (d / "config_sentence_transformers.json").write_text(
        json.dumps({"model_type": "SparseEncoder", "prompts": {}, "default_prompt_name": None,
                    "similarity_fn_name": "dot"})
    )  # fmt: skip


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """name -> (folder, transformers' masked LM of it (loaded by the reference tests alone),
    activation, pooling)."""
    bert, xlmr, wp, ug = tiny_configs()
    root = tmp_path_factory.mktemp("splade")
    distil = dict(vocab_size=wp.get_vocab_size(), dim=32, n_layers=2, n_heads=2, hidden_dim=64,
                  max_position_embeddings=64)  # fmt: skip
    made = {
        "bert_splade": ("BertForMaskedLM", bert, wp, "relu", "max"),
        "xlmr_splade": ("XLMRobertaForMaskedLM", xlmr, ug, "log1p_relu", "max"),
        "distil_splade": ("DistilBertForMaskedLM", distil, wp, "relu", "sum"),
    }
    out = {}
    for seed, (name, (architecture, config, tok, activation, pooling)) in enumerate(made.items()):
        d = transformers_folder(root / name, architecture, config, tok, seed=20 + seed)
        splade_folder(d, activation, pooling)
        out[name] = (d, TransformersModel(d), activation, pooling)
    return out


@pytest.fixture(scope="module")
def repo(folders, tmp_path_factory):
    repo = tmp_path_factory.mktemp("splade-repo")
    for name, (folder, *_rest) in folders.items():
        prepare_model(folder, name, repo, log=print)
    return repo


def reference(folder, model, activation: str, pooling: str, rows: list[str]) -> np.ndarray:
    """SpladePooling over transformers' masked-LM logits, one padded batch."""
    torch = pytest.importorskip("torch")

    feeds = torch_feeds(folder, model, rows)
    mask = feeds["attention_mask"]
    with torch.no_grad():
        logits = model(**feeds).logits
    scores = torch.log1p(torch.relu(logits * mask.unsqueeze(-1)))
    if activation == "log1p_relu":
        scores = torch.log1p(scores)
    pooled = scores.max(1).values if pooling == "max" else scores.sum(1)
    return pooled.numpy()


def check_sparse(got: np.ndarray, want: np.ndarray, name: str) -> None:
    assert got.shape == want.shape
    same = (got > 0) == (want > 0)
    print(f"{name}: {(want > 0).sum()} non-zero of {want.size}, max |diff| {np.abs(got - want).max():.2e}")
    assert same.all(), np.argwhere(~same)
    assert (want == 0).any() and (want > 0).any()  # a vector of one kind would prove nothing
    np.testing.assert_allclose(got, want, atol=MAX_DIFF, rtol=0)


def test_config_says_sparse_and_vocabulary_sized(repo, folders):
    for name, (folder, *_rest) in folders.items():
        spec = load_model(repo / name)[0]
        assert spec.kind == "sparse_embedding"
        vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
        assert [(t.name, t.datatype, t.dims) for t in spec.outputs] == [
            ("sparse_embedding", "FP32", (vocab,))
        ]
        assert not spec.params.text_pair and spec.params.pooling is None


@pytest.mark.parametrize("name", ["bert_splade", "xlmr_splade", "distil_splade"])
def test_graph_matches_transformers(name, folders, repo):
    folder, model, activation, pooling = folders[name]
    spec = load_model(repo / name)[0]
    feeds = TextStage(spec)({"text": np.array([t.encode() for t in TEXTS], dtype=object).reshape(-1, 1)})
    (got,) = ort.InferenceSession(str(repo / name / "1" / "model.onnx")).run(["sparse_embedding"], feeds)
    check_sparse(got, reference(folder, model, activation, pooling, TEXTS), name)


@pytest.mark.parametrize("name", ["bert_splade", "xlmr_splade"])
def test_served_sparse_vectors_match_transformers(name, folders, client):  # noqa: F811
    folder, model, activation, pooling = folders[name]
    got = kserve_grpc(client, name, TEXTS).as_numpy("sparse_embedding")
    check_sparse(got, reference(folder, model, activation, pooling, TEXTS), name)


def test_served_over_kserve_rest(folders, server):  # noqa: F811
    folder, model, activation, pooling = folders["distil_splade"]
    got = kserve_rest(server, "distil_splade", TEXTS, ["sparse_embedding"])["sparse_embedding"]
    check_sparse(got, reference(folder, model, activation, pooling, TEXTS), "distil_splade over REST")


def test_what_a_sparse_encoder_cannot_be_is_refused(folders, tmp_path):
    # no masked-LM head: a bare encoder's checkpoint
    bare = tmp_path / "bare"
    config = dict(TINY, vocab_size=wordpiece().get_vocab_size(), max_position_embeddings=64)
    transformers_folder(bare, "BertModel", config, wordpiece(), seed=0)
    splade_folder(bare)
    with pytest.raises(PrepareError, match="a sparse encoder needs a masked-LM checkpoint .* not BertModel"):
        read_folder(bare)
    # a SpladePooling this graph does not compute
    odd = tmp_path / "odd"
    shutil.copytree(folders["bert_splade"][0], odd)
    splade_folder(odd, activation="gelu")
    with pytest.raises(
        PrepareError, match="activation_function 'gelu'.*supported: activation relu or log1p_relu"
    ):
        read_folder(odd)
    # embedding-only options
    with pytest.raises(
        PrepareError, match="--pooling, --normalize and token embeddings are for embedding models"
    ):
        read_folder(folders["bert_splade"][0], pooling="mean")
    # a tied decoder that is not tied: its weight must be in the file
    untied = tmp_path / "untied"
    shutil.copytree(folders["bert_splade"][0], untied)
    config = json.loads((untied / "config.json").read_text())
    (untied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    with pytest.raises(PrepareError, match="has no tensor cls.predictions.decoder.weight"):
        prepare_model(untied, "untied", tmp_path / "repo", log=print)
