"""Rerankers of the new families from ``batchgate prepare-model``: ``*ForSequenceClassification``
of MPNet, DistilBERT, ModernBERT (cls and mean ``classifier_pooling``), DeBERTa-v2/v3
(disentangled attention) and Qwen3 (last-token ``score``, the converted Qwen3-Reranker
``-seq-cls`` form), and Qwen3-Reranker's causal-LM form (logit("yes") - logit("no") under its
card's chat template).

Each model is tiny (hidden 32, 2 layers), of the real checkpoints' config layouts: the folder is
what transformers' ``save_pretrained`` writes for it (a layout recorded by transformers from
``LAYOUTS`` below, ``python -m tests.layouts``), its weights scrambled by numpy (norm scales around
1, the rest around 0, std 0.3), beside a tokenizer built here. So preparing, serving, the configs
and the refusals run without torch; the reference tests load each folder into transformers
(``TransformersModel``: every weight read, none left over) and compare per row (1e-5), one row
alone and in padded batches of mixed lengths; the Qwen3-Reranker yes/no form against its model
card's scoring code, re-stated below. BERT and XLM-R cross-encoders are tests/test_rerank.py's.
"""

from __future__ import annotations

import functools
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from batchgate.gateway.models import deberta_v2, qwen3
from batchgate.gateway.models.hf_model import PrepareError, read_folder
from batchgate.gateway.models.prepare import prepare_model
from batchgate.gateway.repository import load_model
from batchgate.gateway.text import PAIR_SEPARATOR, TextStage
from tests.layouts import layout, write_folder
from tests.test_prepare_families import mpnet_tokenizer
from tests.test_prepare_model import WORDS, wordpiece
from tests.tiny_models import TransformersModel

ATOL = 1e-5
QUERY = "what is the man eating"
DOCS = [
    "the man is eating bread",
    "dog",
    "A woman is playing the violin on the street.",
    " ".join(WORDS),  # past every model's length: cut
    "the old train station in the city and a small river",
]
# Where the DeBERTa folder's tokenizer.json (NFKC, as sentencepiece normalises) and transformers
# 5's DebertaV2Tokenizer (NFC; tabs to spaces) disagree: the ligature, the full-width letters, the tab.
ODD = "the \ufb01ne  man\tis \uff45ating"
QWEN_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


# -- tokenizers ------------------------------------------------------------------------------------


def deberta_tokenizer(d: Path) -> None:
    """DeBERTa-v3's layout ([PAD] 0, [CLS] 1, [SEP] 2, [UNK] 3, Metaspace pieces) with the file
    normaliser transformers 4 converted (strip, sentencepiece's NFKC map, space runs), and the
    tokenizer_config.json transformers 5's DebertaV2Tokenizer builds from instead."""
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    pieces = [("[PAD]", 0.0), ("[CLS]", 0.0), ("[SEP]", 0.0), ("[UNK]", 0.0), ("[MASK]", 0.0), ("▁", -2.0)]
    pieces += [(f"▁{w}", -1.0 - len(w) / 10) for w in WORDS] + [(c, -5.0) for c in letters + [".", "\t"]]
    pieces += [("\ufb01", -6.0), ("fi", -3.0), ("ne", -3.0), ("▁fine", -1.5)]
    tok = Tokenizer(models.Unigram(pieces, unk_id=3, byte_fallback=False))
    tok.normalizer = normalizers.Sequence(
        [normalizers.Strip(), normalizers.NFKC(), normalizers.Replace(Regex(" {2,}"), " ")]
    )
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 1), ("[SEP]", 2)],
    )
    tok.add_special_tokens(["[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]"])
    tok.save(str(d / "tokenizer.json"))
    specials = dict(bos_token="[CLS]", eos_token="[SEP]", unk_token="[UNK]", sep_token="[SEP]", pad_token="[PAD]",
                    cls_token="[CLS]", mask_token="[MASK]")  # fmt: skip
    (d / "tokenizer_config.json").write_text(
        json.dumps(
            dict(specials, tokenizer_class="DebertaV2Tokenizer", do_lower_case=False, model_max_length=40)
        )
    )


def qwen_tokenizer(d: Path) -> None:
    """Qwen's layout: byte-level BPE behind its split regex, <|endoftext|> and the chat markers
    special, <think> and </think> added; no post-processor (nothing appended), as Qwen3's own."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)  # fmt: skip
    corpus = [qwen3.RERANK_TEMPLATE, " ".join(WORDS), *DOCS, QUERY, "yes no yes no\nyes\nno"] * 3
    tok.train_from_iterator(corpus, trainer)
    tok.add_tokens(["<think>", "</think>"])
    assert tok.token_to_id("yes") is not None and tok.token_to_id("no") is not None
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<|endoftext|>", "eos_token": "<|im_end|>",
         "model_max_length": 131072}
    ))  # fmt: skip


def wordpiece_folder(d: Path) -> None:
    wordpiece().save(str(d / "tokenizer.json"))


def mpnet_folder(d: Path) -> None:
    mpnet_tokenizer().save(str(d / "tokenizer.json"))


# -- models ----------------------------------------------------------------------------------------

TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)


def make(kind: str, vocab: int, pad: int):
    """transformers' untrained model of ``kind`` (what a layout is recorded from)."""
    import transformers as t

    one = dict(num_labels=1)
    if kind == "mpnet":
        return t.MPNetForSequenceClassification(t.MPNetConfig(**TINY, **one, vocab_size=vocab, max_position_embeddings=40,
                                                               pad_token_id=1))  # fmt: skip
    if kind == "distilbert":
        return t.DistilBertForSequenceClassification(t.DistilBertConfig(
            vocab_size=vocab, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=40, **one))  # fmt: skip
    if kind.startswith("modernbert"):
        mean = kind == "modernbert_mean"  # three labels, mean-pooled, a classifier: the other head branch
        cfg = t.ModernBertConfig(**TINY, vocab_size=vocab, max_position_embeddings=40, local_attention=8,
                                 global_attn_every_n_layers=2, pad_token_id=0, bos_token_id=2, eos_token_id=3,
                                 cls_token_id=2, sep_token_id=3, classifier_pooling="mean" if mean else "cls",
                                 num_labels=3 if mean else 1, classifier_bias=mean)  # fmt: skip
        return t.ModernBertForSequenceClassification(cfg)
    if kind == "deberta_v3":  # mxbai-rerank-*-v1's layout: log buckets, shared keys, no absolute positions
        cfg = t.DebertaV2Config(**TINY, **one, vocab_size=vocab, max_position_embeddings=64, relative_attention=True,
                                position_buckets=8, max_relative_positions=-1, norm_rel_ebd="layer_norm",
                                share_att_key=True, pos_att_type=["p2c", "c2p"], position_biased_input=False,
                                type_vocab_size=0, pooler_hidden_size=32, pooler_hidden_act="gelu", pad_token_id=0,
                                layer_norm_eps=1e-7)  # fmt: skip
        return t.DebertaV2ForSequenceClassification(cfg)
    if kind == "deberta_v2":  # v2's: clipped distances, own position projections, absolute positions,
        # token types, a narrower embedding projected up; three labels
        cfg = t.DebertaV2Config(**TINY, num_labels=3, vocab_size=vocab, max_position_embeddings=64,
                                relative_attention=True, position_buckets=-1, max_relative_positions=6,
                                share_att_key=False, pos_att_type="c2p|p2c", position_biased_input=True,
                                type_vocab_size=2, embedding_size=24, pooler_hidden_size=32, pooler_hidden_act="tanh",
                                pad_token_id=0)  # fmt: skip
        return t.DebertaV2ForSequenceClassification(cfg)
    if kind == "deberta_embedder":  # the bare encoder of deberta_v3's layout, mean-pooled by its ST files
        cfg = t.DebertaV2Config(**TINY, vocab_size=vocab, max_position_embeddings=64, relative_attention=True,
                                position_buckets=8, max_relative_positions=-1, norm_rel_ebd="layer_norm",
                                share_att_key=True, pos_att_type=["p2c", "c2p"], position_biased_input=False,
                                type_vocab_size=0)  # fmt: skip
        return t.DebertaV2Model(cfg)
    # 192 positions: the card's chat around each short document fits (162 to 172 tokens here), the
    # long one (220) is cut before the suffix; at 144 every document was cut away, every row alike.
    qwen = dict(TINY, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=vocab,
                max_position_embeddings=192, rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
                pad_token_id=pad)  # fmt: skip
    if kind == "qwen3_seq_cls":
        return t.Qwen3ForSequenceClassification(t.Qwen3Config(**qwen, **one))
    return t.Qwen3ForCausalLM(t.Qwen3Config(**qwen, tie_word_embeddings=True))  # Reranker-0.6B: tied


# name -> (model kind, folder name, tokenizer writer, pad token)
CASES = {
    "mpnet_ce": ("mpnet", "mpnet-ce", mpnet_folder, "<pad>"),
    "distilbert_ce": ("distilbert", "distilbert-ce", wordpiece_folder, "[PAD]"),
    "modernbert_ce": ("modernbert", "modernbert-ce", wordpiece_folder, "[PAD]"),
    "modernbert_mean": ("modernbert_mean", "modernbert-mean-cls", wordpiece_folder, "[PAD]"),
    "deberta_v3_ce": ("deberta_v3", "mxbai-rerank-tiny-v1", deberta_tokenizer, "[PAD]"),
    "deberta_v2_cls": ("deberta_v2", "deberta-v2-cls", deberta_tokenizer, "[PAD]"),
    "qwen3_seq_cls": ("qwen3_seq_cls", "Qwen3-Reranker-tiny-seq-cls", qwen_tokenizer, "<|endoftext|>"),
    "qwen3_reranker": ("qwen3_reranker", "Qwen3-Reranker-tiny", qwen_tokenizer, "<|endoftext|>"),
}


CLASSIFIERS = ("modernbert_mean", "deberta_v2_cls")
EMBEDDER = ("deberta_embedder", "deberta-embedder", deberta_tokenizer, "[PAD]")
LAYOUT = "rerankers_"  # tests/data/layouts/rerankers_<name>.json


def _untrained(kind: str, tokenizer, pad: str):
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer(Path(tmp))
        tok = Tokenizer.from_file(str(Path(tmp) / "tokenizer.json"))
        return make(kind, tok.get_vocab_size(), tok.token_to_id(pad))


# Recorded by transformers (python -m tests.layouts): layout name -> the untrained model.
LAYOUTS = {
    LAYOUT + name: functools.partial(_untrained, kind, tokenizer, pad)
    for name, (kind, _, tokenizer, pad) in {**CASES, "deberta_embedder": EMBEDDER}.items()
}


def scrambled_folder(d: Path, name: str, seed: int) -> Path:
    """Case ``name``'s folder: its tokenizer, and its layout's weights scrambled from ``seed``."""
    _kind, _, tokenizer, pad = {**CASES, "deberta_embedder": EMBEDDER}[name]
    d.mkdir(parents=True)
    tokenizer(d)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    config = layout(LAYOUT + name)["config"]
    fits = (config["vocab_size"], config["pad_token_id"]) == (tok.get_vocab_size(), tok.token_to_id(pad))
    assert fits, f"the tokenizer built here no longer fits layout {LAYOUT + name}: python -m tests.layouts"
    return write_folder(d, LAYOUT + name, seed)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """name -> its folder (written without torch)."""
    root = tmp_path_factory.mktemp("ce-folders")
    return {
        name: scrambled_folder(root / f, name, 100 + i) for i, (name, (_, f, *_)) in enumerate(CASES.items())
    }


@pytest.fixture(scope="module")
def hf_models(folders):
    """name -> transformers' model of its folder, loaded on first use (a reference test's)."""
    return {name: TransformersModel(folder) for name, folder in folders.items()}


@pytest.fixture(scope="module")
def repo(folders, tmp_path_factory):
    repo = tmp_path_factory.mktemp("ce-repo")
    for name, folder in folders.items():
        # (a three-label classifier scores pairs when asked: --text-pair)
        prepare_model(folder, name, repo, log=print, text_pair=True if name in CLASSIFIERS else None)
    return repo


def stage(repo: Path, name: str) -> TextStage:
    (spec,) = load_model(repo / name)
    return TextStage(spec)


def graph_scores(repo: Path, name: str, pairs: list[tuple[str, str]]) -> np.ndarray:
    """batchgate's answer: its text stage's inputs (right padded) through the built graph."""
    feeds = stage(repo, name)({"text": np.array([q + PAIR_SEPARATOR + d for q, d in pairs], dtype=object)})
    sess = ort.InferenceSession(str(repo / name / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    outputs = [o.name for o in sess.get_outputs()]
    return sess.run(["logits" if "logits" in outputs else "score"], feeds)[0]  # a classifier's raw logits


# -- the references --------------------------------------------------------------------------------


def hf_scores(folder: Path, model, pairs: list[tuple[str, str]]) -> np.ndarray:
    """transformers' logits for the pairs in one right-padded batch, tokenised by the reference's
    tokenizer: transformers' own class for DeBERTa (the issue's note), tokenizer.json for the rest."""
    torch = pytest.importorskip("torch")
    AutoTokenizer = pytest.importorskip("transformers").AutoTokenizer

    limit = read_folder(folder).max_tokens
    if json.loads((folder / "config.json").read_text())["model_type"] == "deberta-v2":
        tok = AutoTokenizer.from_pretrained(folder)
        enc = tok([q for q, _ in pairs], [d for _, d in pairs], padding=True, truncation=True, max_length=limit,
                  return_tensors="pt")  # fmt: skip
        feeds = {k: enc[k] for k in ("input_ids", "attention_mask", "token_type_ids")}
    else:
        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        pad = next(p for p in ("[PAD]", "<pad>") if tok.token_to_id(p) is not None)
        tok.enable_padding(pad_id=tok.token_to_id(pad), pad_token=pad)
        tok.enable_truncation(limit)
        rows = tok.encode_batch(pairs)
        feeds = {"input_ids": torch.tensor([e.ids for e in rows]),
                 "attention_mask": torch.tensor([e.attention_mask for e in rows])}  # fmt: skip
    with torch.no_grad():
        return model(**feeds).logits.numpy()


def card_inputs(folder: Path, pairs: list[tuple[str, str]], max_length: int):
    """Qwen3-Reranker's card: prefix tokens + the instruction/query/document text (cut to fit) +
    suffix tokens, padded on the LEFT (re-stated from the card's process_inputs)."""
    AutoTokenizer = pytest.importorskip("transformers").AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    prefix = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
              "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")  # fmt: skip
    suffix = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    prefix_tokens = tokenizer.encode(prefix, add_special_tokens=False)
    suffix_tokens = tokenizer.encode(suffix, add_special_tokens=False)
    instruction = "Given a web search query, retrieve relevant passages that answer the query"
    texts = [f"<Instruct>: {instruction}\n<Query>: {q}\n<Document>: {d}" for q, d in pairs]
    inputs = tokenizer(texts, padding=False, truncation="longest_first", return_attention_mask=False,
                       max_length=max_length - len(prefix_tokens) - len(suffix_tokens))  # fmt: skip
    for i, ids in enumerate(inputs["input_ids"]):
        inputs["input_ids"][i] = prefix_tokens + ids + suffix_tokens
    return tokenizer, tokenizer.pad(inputs, padding=True, return_tensors="pt", max_length=max_length)


def card_yes_probability(folder: Path, model, pairs, max_length: int) -> tuple[np.ndarray, np.ndarray]:
    """The card's compute_logits: softmax over ("no", "yes") at the last position -> P(yes); and
    the two logits' difference."""
    torch = pytest.importorskip("torch")

    tokenizer, inputs = card_inputs(folder, pairs, max_length)
    token_false_id, token_true_id = (
        tokenizer.convert_tokens_to_ids("no"),
        tokenizer.convert_tokens_to_ids("yes"),
    )
    with torch.no_grad():
        batch_scores = model(**inputs).logits[:, -1, :]
    true_vector, false_vector = batch_scores[:, token_true_id], batch_scores[:, token_false_id]
    scores = torch.nn.functional.log_softmax(torch.stack([false_vector, true_vector], dim=1), dim=1)
    return scores[:, 1].exp().numpy(), (true_vector - false_vector).numpy()


def sigmoid(x):
    return 1 / (1 + np.exp(-np.asarray(x, np.float64)))


# -- numerics --------------------------------------------------------------------------------------

PAIRS = [(QUERY, d) for d in DOCS]
ENCODERS = [n for n in CASES if not n.startswith("qwen3")]


@pytest.mark.parametrize("name", ENCODERS)
def test_scores_equal_transformers_alone_and_in_padded_batches(name, folders, hf_models, repo):
    want = hf_scores(folders[name], hf_models[name], PAIRS)
    got = graph_scores(repo, name, PAIRS)
    print(f"{name}: max |diff| {np.abs(got - want).max():.2e}")
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    for i in (0, 3):  # the shortest and the cut one, each alone
        np.testing.assert_allclose(
            graph_scores(repo, name, PAIRS[i : i + 1]), want[i : i + 1], atol=ATOL, rtol=0
        )
    assert np.ptp(got[:, 0]) > 0.05  # scrambled: the rows really differ


def test_qwen3_reranker_equals_its_card(folders, hf_models, repo):
    """The causal-LM form: sigmoid(score) is the card's P(yes); the score its logit difference.
    The card pads on the left; batchgate's stage pads on the right and reads the last real token."""
    folder, model = folders["qwen3_reranker"], hf_models["qwen3_reranker"]
    limit = read_folder(folder).max_tokens
    p_yes, diff = card_yes_probability(folder, model, PAIRS, limit)
    got = graph_scores(repo, "qwen3_reranker", PAIRS)[:, 0]
    print(f"qwen3 reranker: max |diff| {np.abs(got - diff).max():.2e}, P(yes) {np.round(p_yes, 4)}")
    np.testing.assert_allclose(got, diff, atol=ATOL, rtol=0)
    np.testing.assert_allclose(sigmoid(got), p_yes, atol=ATOL, rtol=0)
    assert np.ptp(got) > 0.05  # the documents reach the score
    alone = graph_scores(repo, "qwen3_reranker", PAIRS[1:2])[:, 0]
    np.testing.assert_allclose(alone, diff[1:2], atol=ATOL, rtol=0)
    # The stage's tokens are the card's, row by row (the template, the cut before the suffix).
    _, inputs = card_inputs(folder, PAIRS, limit)
    feeds = stage(repo, "qwen3_reranker")(
        {"text": np.array([q + PAIR_SEPARATOR + d for q, d in PAIRS], dtype=object)}
    )
    for i in range(len(PAIRS)):
        card_row = inputs["input_ids"][i][inputs["attention_mask"][i].bool()].tolist()
        assert feeds["input_ids"][i][feeds["attention_mask"][i] == 1].tolist() == card_row, i


def test_qwen3_seq_cls_equals_transformers_on_the_card_inputs(folders, hf_models, repo):
    """The converted -seq-cls form: Qwen3ForSequenceClassification's score of the last token, fed
    the same chat (its folder name says Qwen3-Reranker, so the card's template is recorded)."""
    torch = pytest.importorskip("torch")

    folder, model = folders["qwen3_seq_cls"], hf_models["qwen3_seq_cls"]
    _, inputs = card_inputs(folder, PAIRS, read_folder(folder).max_tokens)
    with torch.no_grad():
        want = model(**inputs).logits.numpy()
    got = graph_scores(repo, "qwen3_seq_cls", PAIRS)
    print(f"qwen3 seq-cls: max |diff| {np.abs(got - want).max():.2e}")
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    assert np.ptp(got[:, 0]) > 0.05  # the documents reach the score
    np.testing.assert_allclose(graph_scores(repo, "qwen3_seq_cls", PAIRS[4:5]), want[4:5], atol=ATOL, rtol=0)


def test_deberta_buckets_equal_transformers():
    """Every (query, key) distance of a 512-position DeBERTa-v3, log-bucketed as transformers does."""
    torch = pytest.importorskip("torch")
    from transformers.models.deberta_v2.modeling_deberta_v2 import build_relative_position

    n = 512
    x = torch.zeros(1, n, 1)
    want = build_relative_position(x, x, bucket_size=256, max_position=512)[0].numpy()
    cfg = deberta_v2.encoder_config(
        {"hidden_size": 32, "num_attention_heads": 2, "num_hidden_layers": 1, "intermediate_size": 4,
         "relative_attention": True, "position_buckets": 256, "max_relative_positions": -1}, 512)  # fmt: skip
    np.testing.assert_array_equal(deberta_v2.relative_positions(n, cfg), want)


def test_deberta_is_fed_what_transformers_tokenises(folders, repo):
    """transformers 5's DebertaV2Tokenizer ignores tokenizer.json's normaliser; the served
    tokenizer tokenises as the reference does, on a text where the folder's file does not."""
    AutoTokenizer = pytest.importorskip("transformers").AutoTokenizer

    folder = folders["deberta_v3_ce"]
    want = AutoTokenizer.from_pretrained(folder)(QUERY, ODD)["input_ids"]
    file_ids = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(QUERY, ODD).ids
    assert file_ids != want  # the text tells the two apart
    feeds = stage(repo, "deberta_v3_ce")({"text": np.array([QUERY + PAIR_SEPARATOR + ODD], dtype=object)})
    assert feeds["input_ids"][0].tolist() == want


# -- what the config records, and refusals -----------------------------------------------------------


def test_configs_record_kind_and_template(repo):
    for name in CASES:
        (spec,) = load_model(repo / name)
        p = spec.params
        want = "classification" if name in CLASSIFIERS else "rerank"
        assert spec.kind == want and p.text_pair, name
        assert (p.pair_template == qwen3.RERANK_TEMPLATE) == name.startswith("qwen3"), name
    assert "logit('yes') - logit('no')" in (repo / "qwen3_reranker" / "config.pbtxt").read_text()


def test_reranker_flag_and_name(folders, tmp_path):
    """A Qwen3ForCausalLM folder not named a reranker is an embedder; --reranker makes it one."""
    folder = tmp_path / "plain-qwen3"
    shutil.copytree(folders["qwen3_reranker"], folder)
    assert read_folder(folder).head.kind == "embedding"
    plan = read_folder(folder, reranker=True)
    assert plan.head.classifier == "qwen3_yes_no" and plan.pair_template == qwen3.RERANK_TEMPLATE
    assert read_folder(folders["qwen3_reranker"], reranker=False).head.kind == "embedding"
    with pytest.raises(PrepareError, match="--reranker is for Qwen3-Reranker"):
        read_folder(folders["mpnet_ce"], reranker=True)


def test_unsupported_family_is_refused_naming_it_and_the_supported(tmp_path):
    d = tmp_path / "electra"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["ElectraForSequenceClassification"],
                                               "model_type": "electra"}))  # fmt: skip
    with pytest.raises(PrepareError) as err:
        prepare_model(d, "electra", tmp_path / "repo", log=print)
    msg = str(err.value)
    assert "ElectraForSequenceClassification (model_type 'electra')" in msg
    for family in ("DeBERTa-v2", "ModernBERT", "Qwen3ForSequenceClassification", "Qwen3-Reranker", "MPNet"):
        assert family in msg, family


# -- served ----------------------------------------------------------------------------------------


def _post(base: str, path: str, body: dict):
    import urllib.request

    req = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def test_served_by_every_rerank_route(repo, tmp_path):
    """DeBERTa-v3 and Qwen3-Reranker through TEI /rerank and /predict, Cohere-style /v1/rerank and KServe gRPC;
    the three-label DeBERTa-v2 classifier's pairs through TEI /predict: each the prepared graph's
    scores (which the tests above hold to transformers, and to the card's logit difference and
    P(yes) for Qwen3-Reranker), ordered, cut and put through a sigmoid as each route states."""
    import tritonclient.grpc as tc

    from tests.conftest import start_server

    served = tmp_path / "repo"
    for name in ("deberta_v3_ce", "qwen3_reranker", "deberta_v2_cls"):
        shutil.copytree(repo / name, served / name)
    srv = start_server(tmp_path, "--no-build-models", repo=served, ready_timeout=120)
    try:
        base = f"http://127.0.0.1:{srv.http_port}"
        client = tc.InferenceServerClient(srv.grpc_url)
        for name in ("deberta_v3_ce", "qwen3_reranker"):
            raw = graph_scores(repo, name, PAIRS)[:, 0]
            assert np.ptp(raw) > 0.05 and len(set(raw.round(3))) == len(raw), (name, raw)  # an order to keep
            tei = _post(base, "/rerank", {"model": name, "query": QUERY, "texts": DOCS, "raw_scores": True})
            assert [r["index"] for r in tei] == list(np.argsort(-raw, kind="stable")), name
            np.testing.assert_allclose([r["score"] for r in tei], np.sort(raw)[::-1], atol=ATOL, rtol=0)
            cohere = _post(base, "/v1/rerank", {"model": name, "query": QUERY, "documents": DOCS, "top_n": 2})
            top = np.argsort(-raw, kind="stable")[:2]
            assert [r["index"] for r in cohere["results"]] == list(top), name
            np.testing.assert_allclose(
                [r["relevance_score"] for r in cohere["results"]], sigmoid(raw[top]), atol=ATOL, rtol=0
            )
            inp = tc.InferInput("text", [len(DOCS), 1], "BYTES")
            rows = [(QUERY + PAIR_SEPARATOR + d).encode() for d in DOCS]
            inp.set_data_from_numpy(np.array(rows, dtype=object).reshape(-1, 1))
            kserve = client.infer(name, [inp], client_timeout=60).as_numpy("score")[:, 0]
            np.testing.assert_allclose(kserve, raw, atol=ATOL, rtol=0)
            # TEI's /predict takes a reranker's pairs too: its one score, through a sigmoid.
            predicted = _post(base, "/predict", {"model": name, "inputs": [[QUERY, d] for d in DOCS]})
            assert {r[0]["label"] for r in predicted} == {"LABEL_0"}, name
            np.testing.assert_allclose([r[0]["score"] for r in predicted], sigmoid(raw), atol=ATOL, rtol=0)
        client.close()
        want = graph_scores(repo, "deberta_v2_cls", PAIRS[:2])
        got = _post(base, "/predict", {"model": "deberta_v2_cls", "inputs": [[q, d] for q, d in PAIRS[:2]],
                                       "raw_scores": True})  # fmt: skip
        for row, logits in zip(got, want, strict=True):
            by_label = {r["label"]: r["score"] for r in row}
            np.testing.assert_allclose([by_label[f"LABEL_{i}"] for i in range(3)], logits, atol=ATOL, rtol=0)
    finally:
        srv.stop()


def test_prepared_from_a_hub_id_offline_as_from_the_folder(folders, repo, tmp_path, monkeypatch):
    """Each family from its Hub ID in an offline Hugging Face cache: the same files as from its
    folder (Qwen3-Reranker known by the ID's name, models--Qwen--Qwen3-Reranker-tiny)."""
    from tests.test_prepare_sources import cache_layout

    cache = tmp_path / "hub"
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    for i, (name, folder) in enumerate(folders.items()):
        repo_id = f"acme/{folder.name}" if not name.startswith("qwen3") else f"Qwen/{folder.name}"
        cache_layout(cache, repo_id, folder, f"{i:040x}", ("main",))
        out = prepare_model(
            repo_id, name, tmp_path / "repo", log=print, text_pair=True if name in CLASSIFIERS else None
        )
        for f in ("1/model.onnx", "tokenizer.json", "config.pbtxt"):
            assert (out / f).read_bytes() == (repo / name / f).read_bytes(), (name, f)


def test_deberta_embedder_equals_transformers(tmp_path):
    """The bare encoder (DebertaV2Model) mean-pooled as sentence-transformers pools it: the same
    graph without the classifier head."""
    torch = pytest.importorskip("torch")
    AutoTokenizer = pytest.importorskip("transformers").AutoTokenizer

    from tests.test_prepare_model import MIN_COSINE, cosines, st_folder, st_pool

    d = scrambled_folder(tmp_path / EMBEDDER[1], "deberta_embedder", 7)
    model = TransformersModel(d)
    st_folder(d, "mean", True)
    out = prepare_model(d, "deberta_embed", tmp_path / "repo", log=print)
    texts = [d for d in DOCS] + [ODD]
    enc = AutoTokenizer.from_pretrained(d)(
        texts, padding=True, truncation=True, max_length=40, return_tensors="pt"
    )
    with torch.no_grad():
        states = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).last_hidden_state
    want = st_pool(states, enc["attention_mask"], "mean", True).numpy()
    (spec,) = load_model(out)
    feeds = TextStage(spec)({"text": np.array(texts, dtype=object)})
    sess = ort.InferenceSession(str(out / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    got = sess.run(["embedding"], feeds)[0]
    assert cosines(got, want).min() >= MIN_COSINE
