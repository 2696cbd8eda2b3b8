"""``batchgate prepare-model`` for decoder-style embedders: EmbeddingGemma (Gemma3's text model
with bidirectional attention, its sliding/full layer pattern, query/key norms, (1 + w) RMSNorm,
scaled embeddings, per-layer-type rotary bases, mean pooling, two Dense modules and Normalize,
task prompts) and Mistral, Llama and Qwen2 embedders (causal attention, grouped-query attention,
last-token pooling, left padding, instruction prompts), each built by gateway/models/decoder.py
without PyTorch and checked against sentence-transformers loading the same folder.

Each model is tiny (hidden 32, 2-3 layers), made with transformers' config and model classes,
scrambled (random weights far from init), saved as a sentence-transformers folder by
sentence-transformers itself (its tokenizer padding on the left where the family's does), with a
tokenizer.json made here. The texts are of mixed lengths in one padded batch (past the window of
the sliding layers, past max_seq_length), encoded by sentence-transformers with the folder's
prompts; per row cosine >= 0.999999.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

from batchgate.gateway.models import decoder
from batchgate.gateway.models.hf_model import PrepareError, read_folder
from batchgate.gateway.models.prepare import prepare_model
from batchgate.gateway.repository import load_model
from batchgate.gateway.text import TextStage
from tests.test_prepare_model import MIN_COSINE, TEXTS, WORDS, cosines

HIDDEN = 32
STD = 0.3
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
# EmbeddingGemma's prompts (config_sentence_transformers.json), shortened to the tiny vocabulary's words.
GEMMA_PROMPTS = {"query": "task: search result | query: ", "document": "title: none | text: ",
                 "Clustering": "task: clustering | query: "}  # fmt: skip
INSTRUCT = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery: "


def decoder_tokenizer(*, eos: bool) -> Tokenizer:
    """A Llama-like tokenizer: <s> first; </s> appended when ``eos`` (e5-mistral's and Linq's
    tokenizers append it for last-token pooling; Gemma's does too)."""
    extra = ["task", "search", "result", "query", "title", "none", "text", "clustering", "|", ":", ".", "instruct",
             "given", "web", "retrieve", "relevant", "passages", "that", "answer"]  # fmt: skip
    vocab = {t: i for i, t in enumerate([PAD, BOS, EOS, "<unk>"] + WORDS + extra)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace()])
    tok.add_special_tokens([PAD, BOS, EOS])
    single = f"{BOS} $A" + (f" {EOS}" if eos else "")
    specials = [(BOS, vocab[BOS])] + ([(EOS, vocab[EOS])] if eos else [])
    tok.post_processor = processors.TemplateProcessing(
        single=single, pair=f"{single} $B:1", special_tokens=specials
    )
    return tok


def scramble(model) -> None:
    """Every weight random around 0 (std 0.3); Llama-style norm scales around 1, Gemma's (whose
    norm multiplies by 1 + w) around 0 as well."""
    import torch

    gemma = "gemma" in type(model).__name__.lower()
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_scale = "norm" in name.lower() and name.endswith("weight") and not gemma
            p.normal_(1.0 if is_scale else 0.0, STD)


def make(kind: str, vocab: int):
    import transformers as t

    tiny = dict(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=64, vocab_size=vocab, max_position_embeddings=64, pad_token_id=0,
                bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)  # fmt: skip
    if kind == "gemma":
        # EmbeddingGemma's layout: sliding, sliding, full (pattern 3 here; 6 in the real one),
        # a window saved as 4 (|q - k| < 3 both ways) on rows of 30+ tokens, head_dim 16 with query_pre_attn_scalar 16 of
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
        return t.LlamaForCausalLM(cfg)
    cfg = t.Qwen2Config(**tiny, rope_parameters={"rope_type": "default", "rope_theta": 900.0})  # q/k/v biases
    return t.Qwen2ForCausalLM(cfg)


# name -> (model kind, the tokenizer appends </s>, pooling, Dense layers, prompts, default prompt)
CASES = {
    "gemma": ("gemma", True, "mean", ((HIDDEN, 48), (48, 24)), GEMMA_PROMPTS, None),
    "mistral": ("mistral", True, "lasttoken", (), {"query": INSTRUCT, "document": ""}, None),
    "llama": ("llama", True, "lasttoken", (), {"web_search_query": INSTRUCT}, "web_search_query"),
    "qwen2": ("qwen2", False, "lasttoken", (), {"query": INSTRUCT, "document": ""}, None),
}


def st_save(kind: str, d: Path, seed: int):
    """A sentence-transformers folder made by sentence-transformers: (folder, SentenceTransformer)."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Dense, Normalize, Pooling, Transformer
    from transformers import PreTrainedTokenizerFast

    _, eos, pooling, dense, prompts, default = CASES[kind]
    torch.manual_seed(seed)
    tok = decoder_tokenizer(eos=eos)
    model = make(CASES[kind][0], tok.get_vocab_size())
    scramble(model)
    hf = d.parent / f"{d.name}-hf"
    model.eval().save_pretrained(hf)
    # Decoder embedders pad on the left (their tokenizer_config.json says so); Gemma's on the right.
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   unk_token="<unk>", padding_side="right" if kind == "gemma" else "left")  # fmt: skip
    fast.save_pretrained(hf)
    modules = [Transformer(str(hf), max_seq_length=40), Pooling(HIDDEN, pooling_mode=pooling)]
    for i, (n_in, n_out) in enumerate(dense):
        modules.append(Dense(n_in, n_out, bias=i == 0, activation_function=torch.nn.Identity()))
    modules.append(Normalize())
    st = SentenceTransformer(modules=modules, prompts=prompts, default_prompt_name=default, device="cpu")
    with torch.no_grad():
        for m in st.modules():
            if isinstance(m, torch.nn.Linear) and not any(m is p for p in model.modules()):
                m.weight.normal_(0.0, STD)
    st.save(str(d))
    shutil.rmtree(hf)
    return d, SentenceTransformer(str(d), device="cpu")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    pytest.importorskip("sentence_transformers")
    root = tmp_path_factory.mktemp("decoder-folders")
    return {name: st_save(name, root / name, seed) for seed, name in enumerate(CASES)}


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


# -- numerics --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_graph_matches_sentence_transformers_with_prompts(name, folders, repo):
    """Each of the folder's prompts (and none: the default prompt where the folder names one),
    the text stage's right-padded batch against sentence-transformers' own (left-padded for the
    decoders)."""
    folder, st = folders[name]
    spec = spec_of(repo / name)
    assert st.tokenizer.padding_side == ("right" if name == "gemma" else "left")
    for prompt_name in [None, *sorted(CASES[name][4])]:
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


def test_gemma_is_bidirectional_with_its_window(folders, repo):
    """EmbeddingGemma attends both ways: a word added at the END of a text changes its first
    token's state (it would not under a causal mask). The sliding layers' window is what
    Gemma3TextConfig makes of the saved one (4: |q - k| < 3), covered by the rows above."""
    _, st = folders["gemma"]
    cfg = read_folder(folders["gemma"][0]).cfg
    assert (cfg.causal, cfg.window, cfg.layer_types) == (
        False,
        3,
        ("sliding_attention",) * 2 + ("full_attention",),
    )
    a, b = st_encode(st, ["the man is eating", "the man is eating bread"])
    assert cosines(a[None], b[None]).max() < 0.999


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
        assert saved.items() >= CASES[name][4].items()
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


def test_sharded_weights_build_the_same_model(folders, repo, tmp_path):
    """A 7B decoder ships its weights in shards named by model.safetensors.index.json
    (save_pretrained's max_shard_size): read through the index, the build is byte-identical."""
    import transformers as t

    folder = tmp_path / "sharded"
    shutil.copytree(folders["mistral"][0], folder)
    (folder / "model.safetensors").unlink()
    model = t.AutoModel.from_pretrained(folders["mistral"][0])
    model.save_pretrained(folder, max_shard_size="20KB")
    assert (
        len(list(folder.glob("model-*-of-*.safetensors"))) > 2
        and (folder / "model.safetensors.index.json").is_file()
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


def test_qwen2_is_causal_false_attends_both_ways(folders, tmp_path):
    """gte-Qwen2's config.json says is_causal: false (its own modeling code attends both ways):
    against transformers' Qwen2Model handed a padding-only mask for its layers, last token
    pooled and normalised as its sentence-transformers config does."""
    import torch
    import transformers as t

    folder = tmp_path / "gte"
    shutil.copytree(folders["qwen2"][0], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "is_causal": False}))
    out = prepare_model(folder, "gte", tmp_path / "repo", log=print)
    spec = spec_of(out)
    feeds = TextStage(spec)({"text": np.array(TEXTS, dtype=object)})
    got = run_graph(out, feeds)
    model = t.Qwen2Model.from_pretrained(folders["qwen2"][0]).eval()
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
