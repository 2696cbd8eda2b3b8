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
