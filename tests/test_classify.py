"""Sequence classifiers through ``batchgate prepare-model``: any number of labels, softmax or
(``problem_type`` multi_label_classification) each label's sigmoid, ``id2label`` recorded as
parameters, rows of single texts or of pairs; served over KServe gRPC as ``probabilities`` and
``logits``.

The models are tiny random-weight transformers classifiers (BERT and XLM-R), SCRAMBLED as in
tests/test_prepare_model.py so a wrong pooled token, position or activation cannot hide, written
by numpy in ``save_pretrained``'s layout beside a ``tokenizers`` tokenizer (tests/tiny_models.py).
References are transformers' own logits and torch's softmax/sigmoid of them, on the same texts of
mixed lengths (past the models' limits) and pairs.
"""

from __future__ import annotations

import json
import re

import numpy as np
import onnxruntime as ort
import pytest

from batchgate.gateway.models.hf_model import PrepareError, read_folder
from batchgate.gateway.models.prepare import prepare_model
from batchgate.gateway.repository import ConfigError, load_model
from batchgate.gateway.text import PAIR_SEPARATOR, TextStage
from tests.prepared import client, kserve_grpc, kserve_rest, server, tiny_configs, torch_feeds  # noqa: F401  (fixtures)
from tests.test_prepare_model import PAIRS, TEXTS
from tests.tiny_models import TransformersModel, transformers_folder

MAX_PROB_DIFF = 1e-5  # the acceptance bound against torch's softmax / sigmoid
MAX_LOGIT_DIFF = 1e-4
SENTIMENT = {0: "negative", 1: "neutral", 2: "positive"}
TOPICS = {0: "sport", 1: "music", 2: "food", 3: 'odd "quoted" \\ label'}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """name -> (folder, transformers' model of it (loaded by the reference tests alone), multi_label,
    pairs)."""
    bert, xlmr, wp, ug = tiny_configs()
    root = tmp_path_factory.mktemp("classifiers")
    made = {
        # three labels, softmax, single texts
        "sentiment": ("BertForSequenceClassification", dict(bert, id2label=SENTIMENT), wp, False, False),
        # four labels, each its own sigmoid
        "topics": ("XLMRobertaForSequenceClassification",
                   dict(xlmr, id2label=TOPICS, problem_type="multi_label_classification"), ug, True, False),
        # an NLI-style pair classifier, as sentence-transformers saves a CrossEncoder
        "nli": ("BertForSequenceClassification", dict(bert, num_labels=3, sentence_transformers={
            "activation_fn": "torch.nn.modules.activation.Softmax"}), wp, False, True),
    }  # fmt: skip
    out = {}
    for seed, (name, (architecture, config, tok, multi, pairs)) in enumerate(made.items()):
        d = transformers_folder(root / name, architecture, config, tok, seed=10 + seed)
        out[name] = (d, TransformersModel(d), multi, pairs)
    return out


@pytest.fixture(scope="module")
def repo(folders, tmp_path_factory):
    repo = tmp_path_factory.mktemp("classify-repo")
    for name, (folder, *_rest) in folders.items():
        prepare_model(folder, name, repo, log=print)
    return repo


def rows_of(name: str, folders) -> list:
    return PAIRS if folders[name][3] else TEXTS


def reference(folder, model, rows: list, multi: bool) -> tuple[np.ndarray, np.ndarray]:
    """(probabilities, logits) from transformers, one padded batch."""
    torch = pytest.importorskip("torch")

    feeds = torch_feeds(folder, model, rows)
    with torch.no_grad():
        logits = model(**feeds).logits
    probs = torch.sigmoid(logits) if multi else torch.softmax(logits, dim=-1)
    return probs.numpy(), logits.numpy()


def _wire(rows: list) -> list[str]:
    return [PAIR_SEPARATOR.join(r) if isinstance(r, tuple) else r for r in rows]


# -- the prepared model ---------------------------------------------------------------------------


def test_config_records_kind_labels_and_problem_type(repo):
    specs = {n: load_model(repo / n)[0] for n in ("sentiment", "topics", "nli")}
    for name, spec in specs.items():
        assert spec.kind == "classification", name
        assert [(t.name, t.datatype, t.dims) for t in spec.outputs] == [
            ("probabilities", "FP32", (len(spec.labels),)),
            ("logits", "FP32", (len(spec.labels),)),
        ]
    assert specs["sentiment"].labels == ("negative", "neutral", "positive")
    assert specs["sentiment"].params.problem_type == "single_label_classification"
    assert specs["topics"].labels == tuple(TOPICS.values())  # quotes and backslashes survive the pbtxt
    assert specs["topics"].params.problem_type == "multi_label_classification"
    assert specs["nli"].labels == ("LABEL_0", "LABEL_1", "LABEL_2")
    # rows are pairs where sentence-transformers saved a CrossEncoder; single texts otherwise
    assert [specs[n].params.text_pair for n in ("sentiment", "topics", "nli")] == [False, False, True]


@pytest.mark.parametrize("name", ["sentiment", "topics", "nli"])
def test_graph_matches_transformers(name, folders, repo):
    folder, model, multi, _pairs = folders[name]
    rows = rows_of(name, folders)
    want_p, want_l = reference(folder, model, rows, multi)
    spec = load_model(repo / name)[0]
    feeds = TextStage(spec)(
        {"text": np.array([r.encode() for r in _wire(rows)], dtype=object).reshape(-1, 1)}
    )
    probs, logits = ort.InferenceSession(str(repo / name / "1" / "model.onnx")).run(
        ["probabilities", "logits"], feeds
    )
    print(
        f"{name}: max |prob diff| {np.abs(probs - want_p).max():.2e}, |logit diff| {np.abs(logits - want_l).max():.2e}"
    )
    np.testing.assert_allclose(probs, want_p, atol=MAX_PROB_DIFF, rtol=0)
    np.testing.assert_allclose(logits, want_l, atol=MAX_LOGIT_DIFF, rtol=0)
    if multi:  # independent sigmoids: rows need not sum to 1, and these do not
        assert np.abs(probs.sum(1) - 1).max() > 0.1
    else:
        np.testing.assert_allclose(probs.sum(1), 1, atol=1e-6)


# -- over the wire ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["sentiment", "topics", "nli"])
def test_served_probabilities_and_logits_match_transformers(name, folders, client):  # noqa: F811
    folder, model, multi, _pairs = folders[name]
    rows = rows_of(name, folders)
    want_p, want_l = reference(folder, model, rows, multi)
    got = kserve_grpc(client, name, _wire(rows))
    np.testing.assert_allclose(got.as_numpy("probabilities"), want_p, atol=MAX_PROB_DIFF, rtol=0)
    np.testing.assert_allclose(got.as_numpy("logits"), want_l, atol=MAX_LOGIT_DIFF, rtol=0)
    # one output asked for: that one alone, the same numbers
    only = kserve_grpc(client, name, _wire(rows), ["logits"])
    assert only.as_numpy("probabilities") is None
    np.testing.assert_allclose(only.as_numpy("logits"), want_l, atol=MAX_LOGIT_DIFF, rtol=0)


def test_served_over_kserve_rest(folders, server):  # noqa: F811
    folder, model, multi, _pairs = folders["topics"]
    want_p, want_l = reference(folder, model, TEXTS, multi)
    got = kserve_rest(server, "topics", TEXTS)
    assert sorted(got) == ["logits", "probabilities"]
    np.testing.assert_allclose(got["probabilities"], want_p, atol=MAX_PROB_DIFF, rtol=0)
    np.testing.assert_allclose(got["logits"], want_l, atol=MAX_LOGIT_DIFF, rtol=0)


def test_served_classifier_row_shapes(client):  # noqa: F811
    """A pair model refuses a single text by row; a single-text model reads a pair's separator as
    text (no refusal), so the route must send what the model's text_pair says."""
    with pytest.raises(Exception, match="INVALID_ARGUMENT.*row 1.*U\\+001F"):
        kserve_grpc(client, "nli", ["a dog\x1fa cat", "no separator here"])
    meta = client.get_model_metadata("sentiment", as_json=True)
    assert [(o["name"], o["shape"]) for o in meta["outputs"]] == [
        ("probabilities", ["-1", "3"]),
        ("logits", ["-1", "3"]),
    ]
    config = client.get_model_config("sentiment", as_json=True)["config"]["parameters"]
    assert config["kind"]["string_value"] == "classification"
    assert config["label.2"]["string_value"] == "positive"


# -- refusals -----------------------------------------------------------------------------------------


def _edit_config(folders, tmp_path, **changes):
    import shutil

    folder = tmp_path / "edited"
    shutil.copytree(folders["sentiment"][0], folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_regression_and_mismatched_labels_are_refused(folders, tmp_path):
    with pytest.raises(PrepareError, match="problem_type 'regression' with 3 labels is not supported"):
        read_folder(_edit_config(folders, tmp_path, problem_type="regression"))
    folder = _edit_config(folders, tmp_path / "b", id2label={"0": "a", "1": "b"}, label2id={"a": 0, "b": 1})
    with pytest.raises(PrepareError, match="classifier.weight has 3 labels; config.json's id2label names 2"):
        prepare_model(folder, "x", tmp_path / "repo", log=print)
    with pytest.raises(PrepareError, match="token embeddings are for embedding models"):
        prepare_model(folders["sentiment"][0], "x", tmp_path / "repo", token_embeddings=True, log=print)


def _rewrite(repo, tmp_path, old: str, new: str):
    """The sentiment model with ``old`` replaced in its config (``new`` None: the classifier's
    label and problem_type lines dropped too)."""
    import shutil

    d = tmp_path / "sentiment"
    shutil.copytree(repo / "sentiment", d)
    text = (d / "config.pbtxt").read_text()
    assert old in text
    if new is None:
        text = "\n".join(
            line for line in text.splitlines() if '"label.' not in line and "problem_type" not in line
        )
        new = old
    (d / "config.pbtxt").write_text(text.replace(old, new))
    return d


@pytest.mark.parametrize(
    "old, new, named",
    [
        ('key: "label.1"', 'key: "label.5"', "must number the labels 0..2, each once"),
        ('key: "label.2" value { string_value: "positive" } }', 'key: "label.2" value { string_value: "positive" } }\n'
         'parameters { key: "label.3" value { string_value: "extra" } }', "(4 labels: parameters label.<index>)"),
        ('string_value: "classification"', 'string_value: "rerank"', "parameter label.<index> is for kind 'classification'"),
        ('string_value: "single_label_classification"', 'string_value: "regression"', "parameter 'problem_type' must be"),
    ],
)  # fmt: skip
def test_a_config_that_contradicts_its_kind_fails_the_load(repo, tmp_path, old, new, named):
    with pytest.raises(ConfigError, match=re.escape(named)):
        load_model(_rewrite(repo, tmp_path, old, new))


@pytest.mark.parametrize("kind", ["sparse_embedding", "rerank", "embedding"])
def test_a_kind_without_its_outputs_fails_the_load(repo, tmp_path, kind):
    d = _rewrite(repo, tmp_path, 'string_value: "classification"', None)
    (d / "config.pbtxt").write_text((d / "config.pbtxt").read_text().replace('"classification"', f'"{kind}"'))
    output = {"sparse_embedding": "sparse_embedding", "rerank": "score", "embedding": "embedding"}[kind]
    with pytest.raises(ConfigError, match=f"parameter kind '{kind}' needs output '{output}'.*no such output"):
        load_model(d)
    (d / "config.pbtxt").write_text((d / "config.pbtxt").read_text().replace(f'"{kind}"', '"classification"'))
    assert load_model(d)[0].labels == (
        "LABEL_0",
        "LABEL_1",
        "LABEL_2",
    )  # no label.<index>: transformers' names
