"""A base-size embedder for speed figures: all-mpnet-base-v2's layout (MPNet, 12 layers, hidden
768, 12 heads, FFN 3072, 514 positions, vocabulary 30,527; mean pooling, normalised, 384 tokens),
written as a sentence-transformers folder and prepared into a repository with
``batchgate prepare-model``.

The real weights are not reachable from the machines this runs on (no network but the package
registries), so the weights are transformers' own initialisation (seeded): the same shapes and
the same computation per row as the real model, which is what its speed depends on; answers are
not meaningful. The tokenizer is minilm's WordPiece (BERT's uncased vocabulary, which MPNet's
extends by five tokens), so texts split into the same number of tokens as the real model's.

    .venv/bin/python -m lab.base_embedder OUT_REPOSITORY [--name mpnet_base]

Needs the ``reference`` extra (torch, transformers) to write the folder.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MPNET_BASE = dict(vocab_size=30527, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                  intermediate_size=3072, max_position_embeddings=514, pad_token_id=1, bos_token_id=0,
                  eos_token_id=2, layer_norm_eps=1e-5, relative_attention_num_buckets=32)  # fmt: skip
MAX_SEQ_LENGTH = 384


def write_folder(folder: Path, seed: int = 0) -> Path:
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.MPNetModel(transformers.MPNetConfig(**MPNET_BASE)).eval()
    model.save_pretrained(folder)
    tok = json.loads((ROOT / "model_repository" / "minilm" / "tokenizer.json").read_text())
    tok["truncation"] = tok["padding"] = None
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"do_lower_case": True, "model_max_length": 512})
    )
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]))  # fmt: skip
    (folder / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": MAX_SEQ_LENGTH, "do_lower_case": False})
    )
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 768, "pooling_mode_mean_tokens": True})
    )
    (folder / "2_Normalize").mkdir(exist_ok=True)
    return folder


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("repository", type=Path)
    p.add_argument("--name", default="mpnet_base")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_folder(Path(tmp) / "all-mpnet-base-v2-layout")
        subprocess.run([sys.executable, "-m", "batchgate", "prepare-model", str(folder), "--name", args.name,
                        "--model-repository", str(args.repository)], check=True)  # fmt: skip
    print(f"wrote {args.repository / args.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
