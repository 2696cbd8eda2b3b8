"""``batchgate prepare-model`` for decoder-style embedders: EmbeddingGemma (Gemma3's text model
with bidirectional attention, its sliding/full layer pattern, query/key norms, (1 + w) RMSNorm,
scaled embeddings, per-layer-type rotary bases, mean pooling, two Dense modules and Normalize,
task prompts) and Mistral, Llama and Qwen2 embedders (causal attention, grouped-query attention,
last-token pooling, left padding, instruction prompts), each built by gateway/models/decoder.py
without PyTorch and checked against sentence-transformers loading the same folder.

Each model is tiny (hidden 32, 2-3 layers; its config is ``make``'s, in transformers' own config
classes), written by numpy in the layout transformers saved for it (``LAYOUTS``, recorded by
``python -m tests.layouts``: tests/layouts.py) with SCRAMBLED weights (random, far from init),
beside the files ``SentenceTransformer.save`` writes for it (modules.json, the prompts in
config_sentence_transformers.json, Pooling, Dense, Normalize, its tokenizer_config.json padding on
the left where the family's does) and a tokenizer.json made here (Qwen2's byte-level, as
transformers rebuilds it). ``test_folders_are_what_sentence_transformers_saves`` checks that
sentence-transformers loads and saves them as they are. Only the tests that compare with
sentence-transformers or transformers load them (and skip without them): the folder as
``SentenceTransformer(folder)`` (``SentenceTransformerModel``); the others run without torch. The
texts are of mixed lengths in one padded batch (past the window of the sliding layers, past
max_seq_length), encoded by sentence-transformers with the folder's prompts; per row cosine
>= 0.999999.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from batchgate.gateway.models import decoder
from batchgate.gateway.models.hf_model import PrepareError, read_folder
from batchgate.gateway.models.prepare import prepare_model
from batchgate.gateway.repository import load_model
from batchgate.gateway.text import TextStage
from tests.layouts import is_norm_scale, write_folder
from tests.test_prepare_model import MIN_COSINE, TEXTS, WORDS, cosines
from tests.tiny_models import SentenceTransformerModel, TransformersModel

HIDDEN = 32
STD = 0.3
BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
# EmbeddingGemma's prompts (config_sentence_transformers.json), shortened to the tiny vocabulary's words.
GEMMA_PROMPTS = {"query": "task: search result | query: ", "document": "title: none | text: ",
                 "Clustering": "task: clustering | query: "}  # fmt: skip
INSTRUCT = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery: "
EXTRA = ["task", "search", "result", "query", "title", "none", "text", "clustering", "|", ":", ".", "instruct",
         "given", "web", "retrieve", "relevant", "passages", "that", "answer"]  # fmt: skip
# Qwen2Tokenizer's pre-tokenizer split (transformers' tokenization_qwen2.PRETOKENIZE_REGEX).
QWEN2_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


def decoder_tokenizer(*, eos: bool) -> Tokenizer:
    """A Llama-like tokenizer: <s> first; </s> appended when ``eos`` (e5-mistral's and Linq's
    tokenizers append it for last-token pooling; Gemma's does too). <unk> is special, as
    transformers saves it."""
    vocab = {t: i for i, t in enumerate([PAD, BOS, EOS, UNK] + WORDS + EXTRA)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace()])
    tok.add_special_tokens([PAD, BOS, EOS, UNK])
    single = f"{BOS} $A" + (f" {EOS}" if eos else "")
    specials = [(BOS, vocab[BOS])] + ([(EOS, vocab[EOS])] if eos else [])
    tok.post_processor = processors.TemplateProcessing(
        single=single, pair=f"{single} $B:1", special_tokens=specials
    )
    return tok


def _qwen2_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )  # fmt: skip


def qwen2_tokenizer() -> Tokenizer:
    """gte-Qwen2's kind: byte-level BPE, <s> first and nothing appended. transformers 5 loads a
    qwen2 folder's tokenizer as Qwen2Tokenizer, which rebuilds it from the vocabulary and merges
    with its own normalizer (NFC), split and byte-level pre-tokenizer; this one is built so
    already (every byte; merges that make each vocabulary word, with and without its leading
    space, and each piece of the instruction one token), so sentence-transformers reads the rows
    the served tokenizer.json reads, and they are words. (A WordLevel tokenizer came back from that
    rebuild with no merges: its rows were <s> and a few letters.)"""
    vocab = {t: i for i, t in enumerate([PAD, BOS, EOS, UNK])}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    words = WORDS + EXTRA
    pieces = [p for p, _ in _qwen2_pre_tokenizer().pre_tokenize_str(INSTRUCT)]
    ranks: dict[tuple[str, str], int] = {}
    for form in [*words, *pieces, *("\u0120" + w for w in words)]:  # \u0120 (Ġ): the byte-level space
        parts = list(form)
        while len(parts) > 1:  # the merges known so far, lowest rank first (as BPE applies them) ...
            i = min(range(len(parts) - 1), key=lambda j: ranks.get((parts[j], parts[j + 1]), len(ranks)))
            if (parts[i], parts[i + 1]) not in ranks:  # ... then a new one (last: the rest stay as they were)
                ranks[(parts[i], parts[i + 1])] = len(ranks)
                vocab.setdefault(parts[i] + parts[i + 1], len(vocab))
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
    merges = sorted(ranks, key=ranks.get)
    tok = Tokenizer(models.BPE(vocab, merges, unk_token=None, continuing_subword_prefix="",
                               end_of_word_suffix="", fuse_unk=False, byte_fallback=False))  # fmt: skip
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = _qwen2_pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([PAD, BOS, EOS, UNK])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B:1", special_tokens=[(BOS, vocab[BOS])]
    )
    return tok


def make(kind: str, vocab: int):
    """transformers' untrained model of ``kind``, as its sentence-transformers folder holds it
    (the bare *Model: sentence-transformers saves its Transformer module's AutoModel, which sets
    use_cache false). For ``LAYOUTS``."""
    import transformers as t

    tiny = dict(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=64, vocab_size=vocab, max_position_embeddings=64, pad_token_id=0,
                bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, use_cache=False)  # fmt: skip
    if kind == "gemma":
        # EmbeddingGemma's layout: sliding, sliding, full (pattern 3 here; 6 in the real one),
        # a window saved as 4 (|q - k| < 3 both ways) on rows of 30+ tokens, head_dim 16 with query_pre_attn_scalar 12 of
        # its own, per-type rotary bases, bidirectional attention.
        cfg = t.Gemma3TextConfig(**dict(tiny, num_hidden_layers=3), head_dim=16, query_pre_attn_scalar=12,
                                 layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                 sliding_window=4, use_bidirectional_attention=True,
                                 rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 50_000.0},
                                                  "sliding_attention": {"rope_type": "default", "rope_theta": 300.0}},
                                 hidden_activation="gelu_pytorch_tanh")  # fmt: skip
        return t.Gemma3TextModel(cfg)
    if kind == "mistral":  # a sliding window of 6 tokens on every layer (e5-mistral: 4096)
        cfg = t.MistralConfig(
            **tiny, sliding_window=6, rope_parameters={"rope_type": "default", "rope_theta": 700.0}
        )
        return t.MistralModel(cfg)
    if kind == "llama":  # Llama 3's rope scaling and attention/MLP biases
        rope = {"rope_type": "llama3", "rope_theta": 5000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}  # fmt: skip
        cfg = t.LlamaConfig(**tiny, rope_parameters=rope, attention_bias=True, mlp_bias=True)
        return t.LlamaModel(cfg)
    cfg = t.Qwen2Config(**tiny, rope_parameters={"rope_type": "default", "rope_theta": 900.0})  # q/k/v biases
    return t.Qwen2Model(cfg)


# name -> (tokenizer, pooling, Dense layers, prompts, default prompt)
CASES = {
    "gemma": (lambda: decoder_tokenizer(eos=True), "mean", ((HIDDEN, 48), (48, 24)), GEMMA_PROMPTS, None),
    "mistral": (lambda: decoder_tokenizer(eos=True), "lasttoken", (), {"query": INSTRUCT, "document": ""}, None),
    "llama": (lambda: decoder_tokenizer(eos=True), "lasttoken", (), {"web_search_query": INSTRUCT},
              "web_search_query"),
    "qwen2": (qwen2_tokenizer, "lasttoken", (), {"query": INSTRUCT, "document": ""}, None),
}  # fmt: skip
# The layouts of the folders' transformer (tests/data/layouts/decoders_NAME.json), recorded by transformers.
LAYOUTS = {
    f"decoders_{name}": (lambda name=name: make(name, CASES[name][0]().get_vocab_size())) for name in CASES
}

# -- sentence-transformers' files, as SentenceTransformer.save (sentence-transformers 6) writes them

_ST_BASE = "sentence_transformers.base.modules."
_ST_TYPES = {"Transformer": _ST_BASE + "transformer.Transformer", "Dense": _ST_BASE + "dense.Dense",
             "Normalize": _ST_BASE + "normalize.Normalize",
             "Pooling": "sentence_transformers.sentence_transformer.modules.pooling.Pooling"}  # fmt: skip
# What the save records of the versions that wrote it (nothing reads it back).
_ST_VERSIONS = {"pytorch": "2.13.0+cpu", "sentence_transformers": "6.3.0", "transformers": "5.24.0"}
_IO = {"module_input_name": "sentence_embedding", "module_output_name": "sentence_embedding"}


def _json4(path: Path, content: object) -> None:  # the modules' own configs: indent 4, no newline
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(content, indent=4))


def st_files(d: Path, name: str, seed: int) -> None:
    """What ``SentenceTransformer.save`` writes beside the transformer's config.json and weights:
    modules.json, config_sentence_transformers.json (the prompts, "query" and "document" saved
    empty where the model has none), sentence_bert_config.json, tokenizer_config.json (max length
    40, padding side), Pooling, each Dense (weights scrambled, std 0.3) and Normalize."""
    from safetensors.numpy import save_file

    _, pooling, dense, prompts, default = CASES[name]
    normalize = f"{2 + len(dense)}_Normalize"
    modules = [("", "Transformer"), ("1_Pooling", "Pooling")]
    modules += [*((f"{2 + i}_Dense", "Dense") for i in range(len(dense))), (normalize, "Normalize")]
    (d / "modules.json").write_text(json.dumps(
        [{"idx": i, "name": str(i), "path": path, "type": _ST_TYPES[kind]} for i, (path, kind) in enumerate(modules)],
        indent=2))  # fmt: skip
    config = {"__version__": _ST_VERSIONS, "default_prompt_name": default, "model_type": "SentenceTransformer",
              "prompts": {"query": "", "document": "", **prompts}, "similarity_fn_name": "cosine"}  # fmt: skip
    (d / "config_sentence_transformers.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    _json4(d / "sentence_bert_config.json", {
        "transformer_task": "feature-extraction",
        "modality_config": {"text": {"method": "forward", "method_output_name": "last_hidden_state"}},
        "module_output_name": "token_embeddings"})  # fmt: skip
    tokenizer_config = {"backend": "tokenizers", "bos_token": BOS, "eos_token": EOS, "is_local": True,
                        "local_files_only": False, "model_max_length": 40, "pad_token": PAD,
                        "padding_side": "right" if name == "gemma" else "left",
                        "tokenizer_class": "TokenizersBackend", "unk_token": UNK}  # fmt: skip
    if name == "qwen2":  # loaded (and saved again) as transformers' Qwen2Tokenizer
        tokenizer_config.update(add_prefix_space=None, tokenizer_class="Qwen2Tokenizer")
    (d / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")
    _json4(d / "1_Pooling" / "config.json",
           {"embedding_dimension": HIDDEN, "pooling_mode": pooling, "include_prompt": True})  # fmt: skip
    rng = np.random.default_rng(1000 + seed)
    for i, (n_in, n_out) in enumerate(dense):
        folder = d / f"{2 + i}_Dense"
        _json4(folder / "config.json", {"in_features": n_in, "out_features": n_out, "bias": i == 0,
                                        "activation_function": "torch.nn.modules.linear.Identity", **_IO})  # fmt: skip
        tensors = {"linear.weight": STD * rng.standard_normal((n_out, n_in))}
        if i == 0:
            tensors["linear.bias"] = STD * rng.standard_normal(n_out)
        tensors = {key: t.astype(np.float32) for key, t in sorted(tensors.items())}
        save_file(tensors, str(folder / "model.safetensors"))
    _json4(d / normalize / "config.json", _IO)


def st_folder(d: Path, name: str, seed: int) -> Path:
    """``name``'s sentence-transformers folder, written by numpy: the transformer in its layout,
    every weight random around 0 (std 0.3) but the norm scales around 1 (``write_folder``; Gemma's
    norm multiplies by 1 + w, so its scales are moved back to around 0), the tokenizer made here
    and sentence-transformers' files (``st_files``)."""
    from safetensors.numpy import load_file, save_file

    write_folder(d, f"decoders_{name}", seed, std=STD)
    if name == "gemma":
        path = str(d / "model.safetensors")
        tensors = load_file(path)
        for key, t in tensors.items():
            if is_norm_scale(key):
                tensors[key] = (t - 1.0).astype(np.float32)
        save_file(tensors, path, metadata={"format": "pt"})
    CASES[name][0]().save(str(d / "tokenizer.json"))
    st_files(d, name, seed)
    return d


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """name -> (folder, sentence-transformers' model of it, loaded when a reference test first
    touches it). The folders are written by numpy; no torch is needed to make them."""
    root = tmp_path_factory.mktemp("decoder-folders")
    out = {}
    for seed, name in enumerate(CASES):
        d = st_folder(root / name, name, seed)
        out[name] = (d, SentenceTransformerModel(d))
    return out


@pytest.fixture(scope="module")
def repo(folders, tmp_path_factory):
    repo = tmp_path_factory.mktemp("decoder-repo")
    for name, (folder, _) in folders.items():
        prepare_model(folder, name, repo, log=print)
    return repo


def spec_of(model_dir: Path):
    (spec,) = load_model(model_dir)
    return spec


def run_graph(model_dir: Path, feeds: dict) -> np.ndarray:
    sess = ort.InferenceSession(str(model_dir / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    return sess.run(["embedding"], feeds)[0]


def st_encode(st, texts: list[str], prompt_name: str | None = None) -> np.ndarray:
    kwargs = {"prompt_name": prompt_name} if prompt_name else {}
    return st.encode(texts, batch_size=len(texts), convert_to_numpy=True, **kwargs)


def served_rows(spec, texts: list[str], prompt_name: str | None) -> list[str]:
    """What the pipeline feeds the text stage: the named prompt (else the model's default) in front."""
    name = prompt_name or spec.params.default_prompt_name
    prompt = spec.params.prompts.get(name, "") if name else ""
    return [prompt + t for t in texts]


def left_padded(folder: Path, rows: list[str], max_tokens: int) -> dict:
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.enable_padding(pad_id=0, pad_token=PAD, direction="left")
    tok.enable_truncation(max_tokens)
    enc = tok.encode_batch(rows)
    return {"input_ids": np.array([e.ids for e in enc], np.int64),
            "attention_mask": np.array([e.attention_mask for e in enc], np.int64)}  # fmt: skip


# -- the folders ---------------------------------------------------------------------------------


def _contents(folder: Path) -> dict[str, object]:
    """Each file's content: JSON parsed (less the versions that wrote it), tensors as arrays."""
    from safetensors.numpy import load_file

    out: dict[str, object] = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != "README.md"):
        if path.suffix == ".json":
            content = json.loads(path.read_text())
            if isinstance(content, dict):
                content = {
                    k: v for k, v in content.items() if k not in ("__version__", "transformers_version")
                }
        elif path.suffix == ".safetensors":
            content = {k: v.tolist() for k, v in load_file(str(path)).items()}
        else:
            content = path.read_bytes()
        out[str(path.relative_to(folder))] = content
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_folders_are_what_sentence_transformers_saves(name, folders, tmp_path):
    """The folders numpy writes are sentence-transformers' own: loaded by it (every weight of the
    transformer and of each Dense read, none left over) and saved again, every file holds what it
    held (its model card aside), the tokenizer too (Qwen2's rebuilt by Qwen2Tokenizer)."""
    folder, st = folders[name]
    st.save(str(tmp_path / name))
    assert _contents(tmp_path / name) == _contents(folder)


# -- numerics --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_graph_matches_sentence_transformers_with_prompts(name, folders, repo):
    """Each of the folder's prompts (and none: the default prompt where the folder names one),
    the text stage's right-padded batch against sentence-transformers' own (left-padded for the
    decoders)."""
    folder, st = folders[name]
    spec = spec_of(repo / name)
    assert st.tokenizer.padding_side == ("right" if name == "gemma" else "left")
    for prompt_name in [None, *sorted(CASES[name][3])]:
        expected = st_encode(st, TEXTS, prompt_name)
        feeds = TextStage(spec)({"text": np.array(served_rows(spec, TEXTS, prompt_name), dtype=object)})
        assert feeds["attention_mask"].min() == 0  # mixed lengths: padded
        got = run_graph(repo / name, feeds)
        cos = cosines(got, expected)
        print(f"{name} prompt {prompt_name}: min cosine {cos.min():.8f}")
        assert got.shape == expected.shape and cos.min() >= MIN_COSINE, (prompt_name, cos)


@pytest.mark.parametrize("name", ["mistral", "llama", "qwen2"])
def test_decoders_pool_the_last_real_token_of_a_left_padded_batch(name, folders, repo):
    """The same graph fed a LEFT-padded batch (as the family's tokenizer pads) answers the same
    vectors: last-token pooling reads the last position whose mask is 1, not the row's end."""
    folder, st = folders[name]
    spec = spec_of(repo / name)
    rows = served_rows(spec, TEXTS, None)
    feeds = left_padded(repo / name, rows, spec.params.max_tokens)
    assert feeds["attention_mask"][:, 0].min() == 0 and feeds["attention_mask"][:, -1].min() == 1
    cos = cosines(run_graph(repo / name, feeds), st_encode(st, TEXTS))
    assert cos.min() >= MIN_COSINE, cos


@pytest.mark.parametrize("name", ["mistral", "llama", "qwen2"])
def test_decoders_left_padded_batch_answers_the_right_padded_vectors(name, repo):
    """Without a reference: the graph fed a LEFT-padded batch answers what it answers for the text
    stage's right-padded one (compared with sentence-transformers above), so last-token pooling
    reads the last position whose mask is 1 whichever side the padding is on."""
    spec = spec_of(repo / name)
    rows = served_rows(spec, TEXTS, None)
    left = left_padded(repo / name, rows, spec.params.max_tokens)
    right = TextStage(spec)({"text": np.array(rows, dtype=object)})
    assert left["attention_mask"][:, 0].min() == 0 and right["attention_mask"][:, -1].min() == 0
    cos = cosines(run_graph(repo / name, left), run_graph(repo / name, right))
    assert cos.min() >= MIN_COSINE, cos


def test_gemma_is_bidirectional_with_its_window(folders):
    """EmbeddingGemma's folder reads as bidirectional, its sliding layers' window what
    Gemma3TextConfig makes of the saved one (4: |q - k| < 3), covered by the rows above."""
    cfg = read_folder(folders["gemma"][0]).cfg
    assert (cfg.causal, cfg.window, cfg.layer_types) == (
        False,
        3,
        ("sliding_attention",) * 2 + ("full_attention",),
    )


def test_gemma_reference_attends_both_ways(folders):
    """The reference the rows above are checked against attends both ways: a word added at the END
    of a text changes its first token's state (it would not under a causal mask)."""
    _, st = folders["gemma"]
    torch = pytest.importorskip("torch")
    enc = st.tokenizer(["the man is eating", "the man is eating bread"], padding=True, return_tensors="pt")
    with torch.no_grad():
        states = st[0].auto_model(**enc).last_hidden_state  # padded on the right: token 0 is <s>
    a, b = states[0, :2].numpy(), states[1, :2].numpy()
    assert cosines(a, b).max() < 0.999


def test_config_records_prompts_pooling_and_dense(folders, repo):
    expected = {"gemma": ("mean", 24, None), "mistral": ("lasttoken", HIDDEN, None),
                "llama": ("lasttoken", HIDDEN, "web_search_query"), "qwen2": ("lasttoken", HIDDEN, None)}  # fmt: skip
    for name, (pooling, dim, default) in expected.items():
        spec = spec_of(repo / name)
        p = spec.params
        assert (p.pooling, p.normalize, p.max_tokens) == (pooling, True, 40), name
        assert list(spec.output("embedding").dims) == [dim], name
        # sentence-transformers 6 saves "query" and "document" (empty) beside the model's own prompts.
        saved = json.loads((folders[name][0] / "config_sentence_transformers.json").read_text())["prompts"]
        assert saved.items() >= CASES[name][3].items()
        assert dict(p.prompts) == saved and p.default_prompt_name == default, name
    text = (repo / "gemma" / "config.pbtxt").read_text()
    assert "Dense modules after pooling (in the graph): 32->48 Identity, 48->24 Identity" in text
    assert "lasttoken pools </s>" in (repo / "mistral" / "config.pbtxt").read_text()
    assert "appends no special token" in (repo / "qwen2" / "config.pbtxt").read_text()


def test_plain_decoder_folder_gets_last_token_and_the_card_instruction(folders, tmp_path):
    """A bare Hugging Face folder (no modules.json): last-token pooling, unit vectors and the
    cards' query instruction; a plain Gemma3 folder mean-pools without prompts."""
    hf = tmp_path / "plain"
    shutil.copytree(folders["mistral"][0], hf)
    for extra in ("modules.json", "config_sentence_transformers.json"):
        (hf / extra).unlink()
    plan = read_folder(hf)
    assert (plan.head.pooling, plan.head.normalize, plan.prompts) == (
        "lasttoken",
        True,
        decoder.WEB_SEARCH_PROMPTS,
    )


def test_rope_scaling_and_layer_types_from_released_config_spellings():
    """Released checkpoints (transformers 4) say rope_theta / rope_scaling and, for Gemma3,
    rope_local_base_freq and sliding_window_pattern; transformers 5 saves rope_parameters and
    layer_types. Both read the same."""
    gemma = decoder.FAMILIES["gemma3_text"]
    base = dict(hidden_size=32, num_hidden_layers=6, num_attention_heads=2, intermediate_size=8, head_dim=16,
                sliding_window=512, query_pre_attn_scalar=256, use_bidirectional_attention=True)  # fmt: skip
    legacy = gemma.encoder_config(
        dict(base, rope_theta=1e6, rope_local_base_freq=1e4, sliding_window_pattern=6), 64
    )
    new = gemma.encoder_config(dict(base, layer_types=["sliding_attention"] * 5 + ["full_attention"],
                                    rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                                     "sliding_attention": {"rope_type": "default",
                                                                           "rope_theta": 1e4}}), 64)  # fmt: skip
    assert legacy == new and new.score_scale == 256**-0.5
    llama = decoder.FAMILIES["llama"]
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}  # fmt: skip
    old = llama.encoder_config(dict(base, rope_theta=5e5, rope_scaling=dict(scaling)), 64)
    new = llama.encoder_config(dict(base, rope_parameters=dict(scaling, rope_theta=5e5)), 64)
    assert old == new


@pytest.mark.parametrize(
    "config, named",
    [
        ({"architectures": ["MistralModel"], "model_type": "mistral", "hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"architectures": ["LlamaModel"], "model_type": "llama",
          "rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}}, "rope_type 'yarn'"),
        ({"architectures": ["Gemma3TextModel"], "model_type": "gemma3_text", "attn_logit_softcapping": 50.0},
         "attn_logit_softcapping"),
        ({"architectures": ["Qwen2ForSequenceClassification"], "model_type": "qwen2"}, "unsupported architecture"),
    ],
)  # fmt: skip
def test_unsupported_decoder_settings_are_refused(tmp_path, config, named):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(PrepareError, match=named):
        read_folder(tmp_path)


# -- sources: shards, the hub cache ----------------------------------------------------------------


def _entry(path: Path) -> dict[str, bytes]:
    return {f: (path / f).read_bytes() for f in ("1/model.onnx", "tokenizer.json", "config.pbtxt")}


def shard(folder: Path, max_bytes: int) -> None:
    """``folder``'s model.safetensors as ``save_pretrained(max_shard_size=...)`` shards it: the
    tensors in name order, a new shard where the next would pass ``max_bytes``, and the index
    (model.safetensors.index.json) naming each tensor's shard."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    shards: list[dict] = [{}]
    for key in sorted(tensors):
        if shards[-1] and sum(t.nbytes for t in shards[-1].values()) + tensors[key].nbytes > max_bytes:
            shards.append({})
        shards[-1][key] = tensors[key]
    weight_map = {}
    for i, part in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(part, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {"total_parameters": sum(t.size for t in tensors.values()),
                          "total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}  # fmt: skip
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def test_sharded_weights_build_the_same_model(folders, repo, tmp_path):
    """A 7B decoder ships its weights in shards named by model.safetensors.index.json
    (save_pretrained's max_shard_size): read through the index, the build is byte-identical."""
    folder = tmp_path / "sharded"
    shutil.copytree(folders["mistral"][0], folder)
    shard(folder, 20_000)
    assert (
        len(list(folder.glob("model-*-of-*.safetensors"))) > 2
        and (folder / "model.safetensors.index.json").is_file()
        and not (folder / "model.safetensors").exists()
    )
    out = prepare_model(folder, "mistral", tmp_path / "repo", log=print)
    assert _entry(out) == _entry(repo / "mistral")
    # A shard the index names and the folder lacks is named.
    next(iter(sorted(folder.glob("model-*-of-*.safetensors")))).unlink()
    with pytest.raises(PrepareError, match="which is not a file beside it"):
        prepare_model(folder, "mistral", tmp_path / "repo2", log=print)


@pytest.mark.parametrize("name", list(CASES))
def test_each_family_from_a_hub_id_in_an_offline_cache(name, folders, repo, tmp_path, monkeypatch):
    """EmbeddingGemma, Mistral, Llama and Qwen2 from a Hub ID, offline: the same files as
    from the folder."""
    from tests.test_prepare_sources import cache_layout

    cache = tmp_path / "hub"
    cache_layout(cache, f"acme/tiny-{name}", folders[name][0], "d" * 40, ("main",))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    out = prepare_model(f"acme/tiny-{name}", name, tmp_path / "repo", log=print)
    assert _entry(out) == _entry(repo / name)


def gte_folder(folders, tmp_path: Path) -> Path:
    """The Qwen2 folder with gte-Qwen2's is_causal: false in its config.json."""
    folder = tmp_path / "gte"
    shutil.copytree(folders["qwen2"][0], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "is_causal": False}))
    return folder


def test_qwen2_is_causal_false_is_read(folders, repo, tmp_path):
    """gte-Qwen2's config.json says is_causal: false: the folder reads as bidirectional and its
    graph answers otherwise than the causal Qwen2's (checked against transformers below)."""
    folder = gte_folder(folders, tmp_path)
    assert (read_folder(folder).cfg.causal, read_folder(folders["qwen2"][0]).cfg.causal) == (False, True)
    out = prepare_model(folder, "gte", tmp_path / "repo", log=print)
    feeds = TextStage(spec_of(out))({"text": np.array(TEXTS, dtype=object)})
    assert cosines(run_graph(out, feeds), run_graph(repo / "qwen2", feeds)).min() < 0.99


def test_qwen2_is_causal_false_attends_both_ways(folders, tmp_path):
    """gte-Qwen2's config.json says is_causal: false (its own modeling code attends both ways):
    against transformers' Qwen2Model handed a padding-only mask for its layers, last token
    pooled and normalised as its sentence-transformers config does."""
    model = TransformersModel(folders["qwen2"][0])
    model.load()  # skips without the reference extra
    import torch

    out = prepare_model(gte_folder(folders, tmp_path), "gte", tmp_path / "repo", log=print)
    spec = spec_of(out)
    feeds = TextStage(spec)({"text": np.array(TEXTS, dtype=object)})
    got = run_graph(out, feeds)
    ids, mask = torch.tensor(feeds["input_ids"]), torch.tensor(feeds["attention_mask"])
    keys = torch.where(mask[:, None, None, :].bool(), 0.0, torch.finfo(torch.float32).min)
    both_ways = keys.expand(-1, 1, ids.shape[1], -1)
    with torch.no_grad():
        states = model(input_ids=ids, attention_mask={"full_attention": both_ways}).last_hidden_state
    last = mask.sum(1) - 1  # the text stage pads on the right
    want = torch.nn.functional.normalize(states[torch.arange(len(ids)), last], dim=-1).numpy()
    assert cosines(got, want).min() >= MIN_COSINE
    # and it is not the causal model's answer
    causal = st_encode(folders["qwen2"][1], TEXTS)
    assert cosines(got, causal).min() < 0.99


def test_external_data_path_covers_the_decoder_graph(folders, repo, tmp_path, monkeypatch):
    """Past 2 GiB the weights go beside the graph (model.onnx.data); sent down that path with a
    0-byte threshold, EmbeddingGemma's graph answers the same."""
    from batchgate.gateway.models.onnx_graph import EXTERNAL_BYTES_ENV, external_data_path

    monkeypatch.setenv(EXTERNAL_BYTES_ENV, "0")
    out = prepare_model(folders["gemma"][0], "gemma", tmp_path / "repo", log=print)
    model_file = out / "1" / "model.onnx"
    assert external_data_path(model_file).stat().st_size > model_file.stat().st_size
    feeds = TextStage(spec_of(out))({"text": np.array(TEXTS, dtype=object)})
    np.testing.assert_array_equal(run_graph(out, feeds), run_graph(repo / "gemma", feeds))
