"""Tiny models made with numpy alone (no torch): a BERT cross-encoder folder with scrambled
weights and minilm's real WordPiece tokenizer, for the tests that need a rerank or classifier
model beside the bundled ones (tests/test_clients.py). ``batchgate prepare-model`` builds its
ONNX graph from the folder, as from any Hugging Face folder."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

HIDDEN, LAYERS, HEADS, INTERMEDIATE, POSITIONS = 32, 2, 4, 64, 128


def bert_cross_encoder(
    folder: Path, tokenizer: Path, labels: int = 1, seed: int = 7, head: bool = True
) -> Path:
    """A ``BertForSequenceClassification`` folder (``labels`` 1: a reranker) with random weights;
    ``head`` False: a ``BertModel`` (an embedder, pooled as ``prepare-model`` is told)."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    vocab = len(json.loads(tokenizer.read_text())["model"]["vocab"])

    def w(*shape, scale=0.2):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    t: dict[str, np.ndarray] = {
        "bert.embeddings.word_embeddings.weight": w(vocab, HIDDEN),
        "bert.embeddings.position_embeddings.weight": w(POSITIONS, HIDDEN),
        "bert.embeddings.token_type_embeddings.weight": w(2, HIDDEN),
        "bert.embeddings.LayerNorm.weight": 1 + w(HIDDEN, scale=0.05),
        "bert.embeddings.LayerNorm.bias": w(HIDDEN, scale=0.05),
        "bert.pooler.dense.weight": w(HIDDEN, HIDDEN),
        "bert.pooler.dense.bias": w(HIDDEN),
        "classifier.weight": w(labels, HIDDEN, scale=1.0),
        "classifier.bias": w(labels),
    }
    for i in range(LAYERS):
        p = f"bert.encoder.layer.{i}."
        for name in ("query", "key", "value"):
            t[p + f"attention.self.{name}.weight"] = w(HIDDEN, HIDDEN)
            t[p + f"attention.self.{name}.bias"] = w(HIDDEN)
        t[p + "attention.output.dense.weight"] = w(HIDDEN, HIDDEN)
        t[p + "attention.output.dense.bias"] = w(HIDDEN)
        t[p + "attention.output.LayerNorm.weight"] = 1 + w(HIDDEN, scale=0.05)
        t[p + "attention.output.LayerNorm.bias"] = w(HIDDEN, scale=0.05)
        t[p + "intermediate.dense.weight"] = w(INTERMEDIATE, HIDDEN)
        t[p + "intermediate.dense.bias"] = w(INTERMEDIATE)
        t[p + "output.dense.weight"] = w(HIDDEN, INTERMEDIATE)
        t[p + "output.dense.bias"] = w(HIDDEN)
        t[p + "output.LayerNorm.weight"] = 1 + w(HIDDEN, scale=0.05)
        t[p + "output.LayerNorm.bias"] = w(HIDDEN, scale=0.05)
    if not head:
        t = {k.removeprefix("bert."): v for k, v in t.items() if not k.startswith("classifier.")}
    folder.mkdir(parents=True, exist_ok=True)
    save_file(t, str(folder / "model.safetensors"))
    config = {
        "architectures": ["BertForSequenceClassification" if head else "BertModel"], "model_type": "bert",
        "vocab_size": vocab,
        "hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "intermediate_size": INTERMEDIATE, "hidden_act": "gelu", "max_position_embeddings": POSITIONS,
        "type_vocab_size": 2, "layer_norm_eps": 1e-12, "pad_token_id": 0,
        "id2label": {str(i): f"LABEL_{i}" for i in range(labels)},
        "label2id": {f"LABEL_{i}": i for i in range(labels)},
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    shutil.copy(tokenizer, folder / "tokenizer.json")
    return folder


def prepare(folder: Path, name: str, repo: Path, *flags: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "batchgate", "prepare-model", str(folder), "--name", name,
         "--model-repository", str(repo), *flags],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip


# -- transformers' own folder layout, written with numpy ---------------------------------------------

# What transformers 5 writes into config.json for these families, beside the sizes a test gives.
_BASE = {
    "bert": {"model_type": "bert", "hidden_act": "gelu", "type_vocab_size": 2, "layer_norm_eps": 1e-12,
             "pad_token_id": 0, "bos_token_id": None, "eos_token_id": None},
    "xlm-roberta": {"model_type": "xlm-roberta", "hidden_act": "gelu", "type_vocab_size": 1,
                    "layer_norm_eps": 1e-5, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2},
    "distilbert": {"model_type": "distilbert", "activation": "gelu", "sinusoidal_pos_embds": False,
                   "pad_token_id": 0, "dropout": 0.1, "attention_dropout": 0.1, "qa_dropout": 0.1,
                   "seq_classif_dropout": 0.2},
}  # fmt: skip
_COMMON = {"attention_probs_dropout_prob": 0.1, "hidden_dropout_prob": 0.1, "classifier_dropout": None,
           "initializer_range": 0.02, "is_decoder": False, "use_cache": True, "add_cross_attention": False}  # fmt: skip
# architecture -> (family, prefix of the encoder's weights, head)
_ARCHITECTURES = {
    "BertModel": ("bert", "", "pooler"),
    "BertForSequenceClassification": ("bert", "bert.", "bert-classifier"),
    "BertForMaskedLM": ("bert", "bert.", "bert-mlm"),
    "XLMRobertaModel": ("xlm-roberta", "", "pooler"),
    "XLMRobertaForSequenceClassification": ("xlm-roberta", "roberta.", "roberta-classifier"),
    "XLMRobertaForMaskedLM": ("xlm-roberta", "roberta.", "roberta-mlm"),
    "DistilBertForMaskedLM": ("distilbert", "distilbert.", "distil-mlm"),
}
SCRAMBLE_STD = 0.3  # tests/test_prepare_model.py's scramble(): far from transformers' init


def transformers_folder(
    folder: Path, architecture: str, config: dict, tokenizer, seed: int, std: float = SCRAMBLE_STD
) -> Path:
    """A folder as transformers' ``save_pretrained`` writes it for ``architecture`` (the names,
    shapes, tied weights left out and config.json fields it writes), with scrambled random weights
    drawn by numpy: served and prepared without torch; the reference tests load it into transformers
    (``TransformersModel``). ``config``: the sizes (BERT's names, or DistilBERT's dim/n_layers/...),
    ``num_labels`` or ``id2label`` for a classifier, any other field as is; ``tokenizer``: a
    ``tokenizers.Tokenizer`` saved beside."""
    from safetensors.numpy import save_file

    family, pre, head = _ARCHITECTURES[architecture]
    c = {"architectures": [architecture], **_BASE[family], **({} if family == "distilbert" else _COMMON),
         "dtype": "float32", "tie_word_embeddings": True, **config}  # fmt: skip
    labels = c.pop("num_labels", None)
    if labels is not None:
        c["id2label"] = {i: f"LABEL_{i}" for i in range(labels)}
    if "id2label" in c:
        c["id2label"] = {str(i): n for i, n in c["id2label"].items()}
        c["label2id"] = {n: int(i) for i, n in c["id2label"].items()}
    distil = family == "distilbert"
    h, layers = (c["dim"], c["n_layers"]) if distil else (c["hidden_size"], c["num_hidden_layers"])
    inter, vocab = c["hidden_dim"] if distil else c["intermediate_size"], c["vocab_size"]
    rng = np.random.default_rng(seed)
    shapes: dict[str, tuple[int, ...]] = {}

    def linear(name: str, n_out: int, n_in: int) -> None:
        shapes[name + ".weight"], shapes[name + ".bias"] = (n_out, n_in), (n_out,)

    def norm(name: str) -> None:
        shapes[name + ".weight"] = shapes[name + ".bias"] = (h,)

    shapes[pre + "embeddings.word_embeddings.weight"] = (vocab, h)
    shapes[pre + "embeddings.position_embeddings.weight"] = (c["max_position_embeddings"], h)
    if not distil:
        shapes[pre + "embeddings.token_type_embeddings.weight"] = (c["type_vocab_size"], h)
    norm(pre + "embeddings.LayerNorm")
    for i in range(layers):
        if distil:
            p = f"{pre}transformer.layer.{i}."
            for name in ("q_lin", "k_lin", "v_lin", "out_lin"):
                linear(p + "attention." + name, h, h)
            norm(p + "sa_layer_norm")
            linear(p + "ffn.lin1", inter, h)
            linear(p + "ffn.lin2", h, inter)
            norm(p + "output_layer_norm")
            continue
        p = f"{pre}encoder.layer.{i}."
        for name in ("query", "key", "value"):
            linear(p + "attention.self." + name, h, h)
        linear(p + "attention.output.dense", h, h)
        norm(p + "attention.output.LayerNorm")
        linear(p + "intermediate.dense", inter, h)
        linear(p + "output.dense", h, inter)
        norm(p + "output.LayerNorm")
    n = len(c.get("id2label", ()))
    if head in ("pooler", "bert-classifier"):
        linear(pre + "pooler.dense", h, h)
    if head == "bert-classifier":
        linear("classifier", n, h)
    elif head == "roberta-classifier":
        linear("classifier.dense", h, h)
        linear("classifier.out_proj", n, h)
    elif head == "bert-mlm":  # the decoder's weight is the word embeddings (tied, not saved)
        linear("cls.predictions.transform.dense", h, h)
        norm("cls.predictions.transform.LayerNorm")
        shapes["cls.predictions.bias"] = (vocab,)
    elif head == "roberta-mlm":
        linear("lm_head.dense", h, h)
        norm("lm_head.layer_norm")
        shapes["lm_head.bias"] = (vocab,)
    elif head == "distil-mlm":
        linear("vocab_transform", h, h)
        norm("vocab_layer_norm")
        shapes["vocab_projector.bias"] = (vocab,)
    tensors = {}
    for name, shape in shapes.items():
        mean = 1.0 if name.endswith(("LayerNorm.weight", "layer_norm.weight")) else 0.0
        tensors[name] = (mean + std * rng.standard_normal(shape)).astype(np.float32)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(c, indent=2))
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


class LazyReference:
    """A reference library's model of a folder, made on first use (``make``): only the tests that
    compare with the reference touch it (they skip where the reference extra is not installed), so
    a module's other tests run without torch. Read as the model itself."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._model = None

    def make(self):
        raise NotImplementedError

    def load(self):
        if self._model is None:
            self._model = self.make()
        return self._model

    def __getattr__(self, name: str):
        if name.startswith("__") or name == "_model":  # copy/pickle probing a half-made instance
            raise AttributeError(name)
        return getattr(self.load(), name)


class TransformersModel(LazyReference):
    """transformers' model of a ``transformers_folder`` (the class its config.json names), every
    weight read from the folder and none left over. Called as the model itself."""

    def make(self):
        import pytest

        pytest.importorskip("torch")
        transformers = pytest.importorskip("transformers")
        architecture = json.loads((self.folder / "config.json").read_text())["architectures"][0]
        model, info = getattr(transformers, architecture).from_pretrained(
            self.folder, output_loading_info=True
        )
        # every weight read from the folder, none left at transformers' random init
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        return model.eval()

    def __call__(self, *args, **kwargs):
        return self.load()(*args, **kwargs)


class SentenceTransformerModel(LazyReference):
    """sentence-transformers' model of a folder (``SentenceTransformer(folder)``), after transformers
    has loaded the folder's transformer with every weight read and none left over
    (``TransformersModel``): the layout is still transformers' own. Indexed as its modules."""

    def make(self):
        import pytest

        pytest.importorskip("torch")
        st = pytest.importorskip("sentence_transformers")
        TransformersModel(self.folder).load()
        return st.SentenceTransformer(str(self.folder), device="cpu")

    def __getitem__(self, index: int):  # its modules: [0] the Transformer
        return self.load()[index]
