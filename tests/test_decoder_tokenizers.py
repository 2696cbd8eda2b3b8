"""The decoder families' tokenizers as their real folders lay them out, against what transformers 5
feeds the model (the reference of sentence-transformers' decoder embedders).

transformers 5 rebuilds some tokenizers from a folder's vocabulary with its own normalizer and
pre-tokenizer instead of reading tokenizer.json as it stands (XLM-R and DeBERTa-v2 do, and
batchgate serves their rebuilt form: gateway/models/xlm_roberta.py, deberta_v2.py). For the
decoders it serves the folder's tokenizer.json as it is; this checks that transformers'
``AutoTokenizer`` gives the same ids on texts where a rebuild would show (leading, trailing and
repeated spaces, newlines, tabs, accents, full-width letters, emoji through byte fallback, CJK,
special-token text), for each family's real layout: Mistral/Llama (sentencepiece-style BPE with
byte fallback, ``Prepend`` + ``Replace`` normalizer, ``tokenizer_class`` LlamaTokenizer, as
e5-mistral and Linq ship), Gemma 3 (BPE with byte fallback, ``Replace`` normalizer and a space
split, GemmaTokenizer, as EmbeddingGemma ships) and Qwen2 (byte-level BPE, NFC, Qwen2's split
regex, Qwen2Tokenizer, as gte-Qwen2 ships). The vocabularies are trained here on a small corpus."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from batchgate.gateway.models.hf_model import SERVED_TOKENIZERS
from tests.test_prepare_decoders import QWEN2_SPLIT

CORPUS = ["the man is eating bread.", "A woman is playing the violin on the street!", "girls were riding horses",
          "Instruct: Given a web search query, retrieve relevant passages\nQuery: what is ML?", "naïve café résumé",
          "def f(x):\n    return x  # code", "numbers 12345 and 3.14", "日本語のテキスト", "emoji 😀 here",
          "task: search result | query: "] * 50  # fmt: skip
TEXTS = ["dog", "the man is eating bread", " leading space", "trailing space ", "two  spaces", "line\nbreak",
         "tab\there", "naïve café", "emoji 😀", "日本語", "Instruct: Given a web search query\nQuery: what is ML?",
         "ends with newline\n", "  ", "Ａ full width ﬁ", "e\u0301 combining", "🙂 unseen emoji"]  # fmt: skip
BYTES = [f"<0x{i:02X}>" for i in range(256)]  # sentencepiece's byte tokens


def _with_bytes(tok: Tokenizer) -> Tokenizer:
    """The trained BPE with sentencepiece's 256 byte tokens in its vocabulary (the trainer takes
    single characters only), so byte fallback has tokens to fall back to, as real files do."""
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    for b in BYTES:
        vocab.setdefault(b, len(vocab))
    return Tokenizer.from_str(json.dumps(data))


def _template(tok: Tokenizer, bos: str | None, eos: str | None) -> None:
    single = " ".join(t for t in (bos and f"{bos}:0", "$A:0", eos and f"{eos}:0") if t)
    pair = single + " " + " ".join(t for t in ("$B:1", eos and f"{eos}:1") if t)
    tok.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[(t, tok.token_to_id(t)) for t in (bos, eos) if t]
    )


def mistral(d: Path) -> dict:
    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])  # fmt: skip
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"],
                                                        initial_alphabet=BYTES))  # fmt: skip
    tok = _with_bytes(tok)
    _template(tok, "<s>", "</s>")  # e5-mistral's and Linq's append </s> for last-token pooling
    tok.save(str(d / "tokenizer.json"))
    return {"config": {"model_type": "mistral"},
            "tokenizer_config": {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>",
                                 "unk_token": "<unk>", "pad_token": "</s>", "add_bos_token": True,
                                 "add_eos_token": True, "legacy": False, "padding_side": "left"}}  # fmt: skip


def gemma(d: Path) -> dict:
    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=700, initial_alphabet=BYTES,
                                                        special_tokens=["<pad>", "<eos>", "<bos>", "<unk>"]))  # fmt: skip
    tok = _with_bytes(tok)
    _template(tok, "<bos>", "<eos>")
    tok.save(str(d / "tokenizer.json"))
    return {"config": {"model_type": "gemma3_text"},
            "tokenizer_config": {"tokenizer_class": "GemmaTokenizer", "bos_token": "<bos>", "eos_token": "<eos>",
                                 "unk_token": "<unk>", "pad_token": "<pad>", "add_bos_token": True,
                                 "add_eos_token": True, "padding_side": "right"}}  # fmt: skip


def qwen2(d: Path) -> dict:
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )  # fmt: skip
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=700, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"]))  # fmt: skip
    _template(tok, None, "<|endoftext|>")  # gte-Qwen2 appends <|endoftext|>: the pooled last token
    tok.save(str(d / "tokenizer.json"))
    return {"config": {"model_type": "qwen2"},
            "tokenizer_config": {"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|endoftext|>",
                                 "pad_token": "<|endoftext|>", "bos_token": None, "unk_token": None,
                                 "add_prefix_space": False, "padding_side": "left"}}  # fmt: skip


LAYOUTS = {"mistral": mistral, "gemma": gemma, "qwen2": qwen2}


@pytest.mark.parametrize("family", LAYOUTS)
def test_transformers_feeds_what_the_folders_tokenizer_json_gives(family, tmp_path):
    """Per family, AutoTokenizer's ids equal the served tokenizer.json's on every text."""
    transformers = pytest.importorskip("transformers")
    d = tmp_path / family
    d.mkdir()
    files = LAYOUTS[family](d)
    (d / "config.json").write_text(json.dumps(files["config"]))
    (d / "tokenizer_config.json").write_text(json.dumps(files["tokenizer_config"]))
    ours = Tokenizer.from_file(str(d / "tokenizer.json"))
    ref = transformers.AutoTokenizer.from_pretrained(str(d))
    for text in TEXTS:
        assert ours.encode(text).ids == ref(text)["input_ids"], (family, type(ref).__name__, text)
    # tokenizer_config.json's add_bos_token / add_eos_token do not rebuild the post-processor in
    # transformers 5: where they disagree with tokenizer.json, the file's template still holds
    for flag in ("add_bos_token", "add_eos_token"):
        flipped = dict(files["tokenizer_config"], **{flag: not files["tokenizer_config"].get(flag, False)})
        (d / "tokenizer_config.json").write_text(json.dumps(flipped))
        ref = transformers.AutoTokenizer.from_pretrained(str(d))
        assert ours.encode("the dog").ids == ref("the dog")["input_ids"], (family, flag)
    # not vacuous: byte fallback and multi-byte text really are in play
    unseen = ours.encode("🙂")
    assert len(unseen.ids) >= 4 and ours.token_to_id("<unk>") not in unseen.ids, unseen.tokens
    # and what is compared is what is served: prepare-model copies these families' tokenizer.json
    # as it is (the decoder tests' graphs are fed by it); only the families listed are rebuilt
    assert files["config"]["model_type"] not in SERVED_TOKENIZERS
