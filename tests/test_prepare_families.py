"""``batchgate prepare-model`` for the families beyond BERT/RoBERTa: MPNet, DistilBERT,
ModernBERT and Qwen3 (a decoder embedder), each graph built from safetensors weights without
PyTorch and checked against transformers.

Each model is tiny (hidden 32, 2-3 layers; its config is ``make``'s, in transformers' own config
classes), written by numpy in the layout transformers saved for it (``LAYOUTS``, recorded by
``python -m tests.layouts``: tests/layouts.py) with SCRAMBLED weights (random, far from init: a
wrong position, window, rotary base, pooled token or activation would not hide under near-uniform
attention), beside a tokenizer.json made with ``tokenizers``. Only the tests that compare with
transformers load its model of a folder (and skip without it); the others run without torch. The texts
are of mixed lengths in one padded batch, past each model's limit, so padding masks, truncation,
relative buckets past the exact range, ModernBERT's sliding window and the causal mask are all
exercised. Per row cosine >= 0.999999 against transformers, pooled as sentence-transformers pools.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

from batchgate.gateway.models import modernbert, mpnet, qwen3
from batchgate.gateway.models.hf_model import PrepareError, read_folder
from batchgate.gateway.models.prepare import prepare_model
from batchgate.gateway.repository import load_model
from batchgate.gateway.text import TextStage
from tests.layouts import write_folder
from tests.test_prepare_model import MIN_COSINE, TEXTS, WORDS, cosines, st_folder, st_pool, wordpiece
from tests.tiny_models import TransformersModel

HIDDEN = 32
STD = 0.3
EOT = "<|endoftext|>"


# -- tokenizers ----------------------------------------------------------------------------------


def mpnet_tokenizer() -> Tokenizer:
    """MPNet's layout: <s>=0, <pad>=1, </s>=2, <unk>=3, WordPiece, <s> $A </s>."""
    specials = ["<s>", "<pad>", "</s>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials + WORDS + ["##s", "##ing", "##ed", "."])}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)]
    )
    return tok


def qwen_tokenizer() -> Tokenizer:
    """Qwen3-Embedding's post-processor: the text, then <|endoftext|> (the token last-token
    pooling reads). No padding block: its tokenizer pads on the left in transformers."""
    vocab = {t: i for i, t in enumerate(WORDS + [".", ":", "instruct", "query", "<unk>", EOT])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([EOT])
    tok.post_processor = processors.TemplateProcessing(
        single=f"$A {EOT}", pair=f"$A {EOT} $B:1 {EOT}:1", special_tokens=[(EOT, vocab[EOT])]
    )
    return tok


# -- models --------------------------------------------------------------------------------------


def make(kind: str, tok: Tokenizer):
    """transformers' untrained model of ``kind`` (for ``LAYOUTS``: what its folder holds)."""
    import transformers as t

    vocab = tok.get_vocab_size()
    tiny = dict(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    if kind == "mpnet":  # positions from padding_idx + 1: 40 rows hold 38 tokens
        cfg = t.MPNetConfig(**tiny, vocab_size=vocab, max_position_embeddings=40, pad_token_id=1)
        return t.MPNetModel(cfg)
    if kind in ("distilbert", "distilbert_mlm"):
        cfg = t.DistilBertConfig(vocab_size=vocab, dim=HIDDEN, n_layers=2, n_heads=2, hidden_dim=64,
                                 max_position_embeddings=48, sinusoidal_pos_embds=kind == "distilbert_mlm")  # fmt: skip
        return (t.DistilBertForMaskedLM if kind == "distilbert_mlm" else t.DistilBertModel)(cfg)
    if kind == "modernbert":
        # Three layers: global, local, local; a window of 8 (4 each side) on 48-token rows, and
        # rotary bases of their own so a swapped base shows.
        cfg = t.ModernBertConfig(**dict(tiny, num_hidden_layers=3), vocab_size=vocab, max_position_embeddings=48,
                                 local_attention=8, global_attn_every_n_layers=3, global_rope_theta=40_000.0,
                                 local_rope_theta=500.0, pad_token_id=0, bos_token_id=2, eos_token_id=3,
                                 cls_token_id=2, sep_token_id=3)  # fmt: skip
        return t.ModernBertModel(cfg)
    # Qwen3: grouped-query attention (4 query heads, 2 key/value heads), head_dim 16 (not
    # hidden / heads), a rotary base of its own.
    cfg = t.Qwen3Config(**dict(tiny, num_attention_heads=4), num_key_value_heads=2, head_dim=16, vocab_size=vocab,
                        max_position_embeddings=48, rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
                        tie_word_embeddings=False, eos_token_id=tok.token_to_id(EOT))  # fmt: skip
    return (t.Qwen3ForCausalLM if kind == "qwen3_lm" else t.Qwen3Model)(cfg)


# name -> (model kind, tokenizer, pooling (None: a plain folder, no modules.json), normalize)
CASES = {
    "mpnet_mean": ("mpnet", mpnet_tokenizer, "mean", True),
    "distilbert_cls": ("distilbert", wordpiece, "cls", False),
    "distilbert_plain": ("distilbert_mlm", wordpiece, None, True),
    "modernbert_mean": ("modernbert", wordpiece, "mean", True),
    "qwen3_last": ("qwen3", qwen_tokenizer, "lasttoken", True),
    "qwen3_plain": ("qwen3_lm", qwen_tokenizer, None, True),
}
# The layouts of the folders (tests/data/layouts/families_KIND.json), recorded by transformers.
LAYOUTS = {
    f"families_{kind}": (lambda kind=kind, tokenizer=tokenizer: make(kind, tokenizer()))
    for kind, tokenizer, _pooling, _normalize in CASES.values()
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """name -> (folder, transformers' model of it (loaded when a reference test first touches it),
    pooling, normalize). The folders are written by numpy; no torch is needed to make them."""
    root = tmp_path_factory.mktemp("family-folders")
    out = {}
    for seed, (name, (kind, tokenizer, pooling, normalize)) in enumerate(CASES.items()):
        d = write_folder(root / name, f"families_{kind}", seed, std=STD)
        tokenizer().save(str(d / "tokenizer.json"))
        if pooling is not None:
            st_folder(d, pooling, normalize)
        plain = "lasttoken" if kind.startswith("qwen3") else "mean"  # a plain folder's pooling
        out[name] = (d, TransformersModel(d), pooling or plain, normalize)
    return out


@pytest.fixture(scope="module")
def repo(folders, tmp_path_factory):
    repo = tmp_path_factory.mktemp("family-repo")
    for name, (folder, *_rest) in folders.items():
        prepare_model(folder, name, repo, log=print)
    return repo


def spec_of(model_dir: Path):
    (spec,) = load_model(model_dir)
    return spec


def padded_feeds(folder: Path, texts: list[str], *, left: bool = False) -> dict:
    """``texts`` tokenised by the folder's tokenizer in one padded batch (``left``: padded on the
    left, as Qwen3-Embedding's tokenizer pads), cut at the folder's length: numpy feeds."""
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    pad = next(p for p in ("[PAD]", "<pad>", EOT) if tok.token_to_id(p) is not None)
    tok.enable_padding(pad_id=tok.token_to_id(pad), pad_token=pad, direction="left" if left else "right")
    tok.enable_truncation(read_folder(folder).max_tokens)
    enc = tok.encode_batch(texts)
    ids = np.array([e.ids for e in enc], np.int64)
    mask = np.array([e.attention_mask for e in enc], np.int64)
    return {"input_ids": ids, "attention_mask": mask}


def reference(folder: Path, model, pooling: str, normalize: bool, texts: list[str], *,
              left: bool = False) -> tuple[np.ndarray, dict]:  # fmt: skip
    """transformers' pooled (and normalised) vectors for ``texts`` in one padded batch
    (``left``: padded on the left, as Qwen3-Embedding's tokenizer pads), and the feeds. ``model``:
    the folder's ``TransformersModel``; its bare encoder runs (a *ForMaskedLM/*ForCausalLM's base)."""
    torch = pytest.importorskip("torch")  # a reference test's: it skips without the reference extra

    feeds = padded_feeds(folder, texts, left=left)
    ids, mask = torch.tensor(feeds["input_ids"]), torch.tensor(feeds["attention_mask"])
    with torch.no_grad():
        states = model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state
    pooled = st_pool(states, mask, pooling, normalize)
    return pooled.numpy(), feeds


def run_graph(model_dir: Path, feeds: dict) -> np.ndarray:
    sess = ort.InferenceSession(str(model_dir / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    assert {i.name for i in sess.get_inputs()} == set(feeds)
    return sess.run(None, feeds)[0]


# -- numerics in onnxruntime -----------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_graph_matches_transformers(name, folders, repo):
    folder, model, pooling, normalize = folders[name]
    expected, _ = reference(folder, model, pooling, normalize, TEXTS)
    # batchgate's own text stage makes the inputs, as the worker does (right padding, its pad id).
    feeds = TextStage(spec_of(repo / name))({"text": np.array(TEXTS, dtype=object)})
    assert feeds["attention_mask"].min() == 0  # mixed lengths: the batch was padded
    got = run_graph(repo / name, feeds)
    cos = cosines(got, expected)
    print(f"{name}: min cosine {cos.min():.8f}")
    assert got.shape == expected.shape and cos.min() >= MIN_COSINE, cos
    if normalize:
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_qwen3_pools_the_end_of_text_token(folders, repo):
    """The tokenizer's post-processor appends <|endoftext|> (read from tokenizer.json, not added
    by the graph), and the graph pools each row's last real token whichever side the padding is:
    a left-padded batch gives the vectors of the right-padded one."""
    folder = folders["qwen3_last"][0]
    eot = Tokenizer.from_file(str(folder / "tokenizer.json")).token_to_id(EOT)
    feeds = TextStage(spec_of(repo / "qwen3_last"))({"text": np.array(TEXTS, dtype=object)})
    last = feeds["attention_mask"].sum(1) - 1  # right padded: the last real token's index
    assert (feeds["input_ids"][np.arange(len(TEXTS)), last] == eot).all()
    left_feeds = padded_feeds(folder, TEXTS, left=True)
    assert left_feeds["attention_mask"][:, 0].min() == 0  # padded on the left
    right, left = run_graph(repo / "qwen3_last", feeds), run_graph(repo / "qwen3_last", left_feeds)
    cos = cosines(left, right)
    assert cos.min() >= MIN_COSINE, cos


def test_qwen3_pools_the_end_of_text_token_with_left_or_right_padding(folders, repo):
    """transformers on a LEFT-padded batch, as Qwen3-Embedding runs, against the graph fed the same
    batch and fed batchgate's own right-padded one."""
    folder, model, pooling, normalize = folders["qwen3_last"]
    feeds = TextStage(spec_of(repo / "qwen3_last"))({"text": np.array(TEXTS, dtype=object)})
    expected, left_feeds = reference(folder, model, pooling, normalize, TEXTS, left=True)
    assert left_feeds["attention_mask"][:, 0].min() == 0  # padded on the left
    for got in (run_graph(repo / "qwen3_last", left_feeds), run_graph(repo / "qwen3_last", feeds)):
        cos = cosines(got, expected)
        print(f"qwen3 left/right: min cosine {cos.min():.8f}")
        assert cos.min() >= MIN_COSINE, cos


# -- what the config records -------------------------------------------------------------------------


def test_config_records_pooling_length_and_prompts(repo):
    expected = {
        "mpnet_mean": (38, "mean", True),  # 40 position rows less padding_idx + 1
        "distilbert_cls": (48, "cls", False),
        "distilbert_plain": (48, "mean", True),  # a plain folder: mean, unit vectors
        "modernbert_mean": (48, "mean", True),
        "qwen3_last": (48, "lasttoken", True),
        "qwen3_plain": (48, "lasttoken", True),  # a plain Qwen3 folder: its card's last token
    }
    for name, (tokens, pooling, normalize) in expected.items():
        spec = spec_of(repo / name)
        p = spec.params
        assert (p.max_tokens, p.pooling, p.normalize) == (tokens, pooling, normalize), name
        assert set(spec.model_inputs) == {"input_ids", "attention_mask"}, name  # no token types
    # Qwen3 without prompts of its own: the card's query instruction, documents none.
    p = spec_of(repo / "qwen3_plain").params
    assert dict(p.prompts) == qwen3.DEFAULT_PROMPTS and p.default_prompt_name is None
    assert dict(spec_of(repo / "mpnet_mean").params.prompts) == {}
    # Which token last-token pooling reads is taken from tokenizer.json and said in the config.
    assert "lasttoken pools <|endoftext|>" in (repo / "qwen3_last" / "config.pbtxt").read_text()


def test_qwen3_folder_prompts_win_over_the_card_default(folders, tmp_path):
    folder = tmp_path / "q"
    shutil.copytree(folders["qwen3_last"][0], folder)
    prompts = {"query": "Instruct: Find code\nQuery:", "document": ""}
    (folder / "config_sentence_transformers.json").write_text(json.dumps({"prompts": prompts}))
    assert read_folder(folder).prompts == prompts


def test_modernbert_reads_both_config_spellings(folders):
    """transformers 5 saves layer_types and rope_parameters; the released checkpoints say
    global_attn_every_n_layers and global/local_rope_theta."""
    saved = json.loads((folders["modernbert_mean"][0] / "config.json").read_text())
    new = modernbert.encoder_config(saved, 48)
    legacy = {k: v for k, v in saved.items() if k not in ("layer_types", "rope_parameters")}
    legacy.update(global_attn_every_n_layers=3, global_rope_theta=40_000.0, local_rope_theta=500.0)
    assert modernbert.encoder_config(legacy, 48) == new
    assert (new.global_layers, new.global_theta, new.local_theta, new.window) == ((True, False, False), 40_000.0,
                                                                                  500.0, 4)  # fmt: skip


def test_mpnet_relative_buckets_equal_transformers():
    """Every (query, key) distance a 514-row MPNet can see, bucketed as transformers does."""
    torch = pytest.importorskip("torch")
    from transformers.models.mpnet.modeling_mpnet import MPNetEncoder

    n = 512
    rel = torch.arange(n)[None, :] - torch.arange(n)[:, None]
    expected = MPNetEncoder.relative_position_bucket(rel, num_buckets=32).numpy()
    np.testing.assert_array_equal(mpnet.relative_buckets(n), expected)


# -- served by every route --------------------------------------------------------------------------

QUERIES = ["what is the man eating", "who plays the violin", "where is the train station"]
DOCS = ["the man is eating bread", "A woman is playing the violin on the street.", "dog",
        "the old train station in the city and a small river"]  # fmt: skip


def _post(url: str, body: dict):
    import urllib.request

    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def test_served_qwen3_matches_transformers_on_every_route(folders, repo, tmp_path):
    """A prepared Qwen3 folder served as is: queries through OpenAI /v1/embeddings naming the
    card's "query" prompt (the instruction goes in front, EOS after), documents through KServe
    gRPC and TEI /embed with none; each row against transformers on a left-padded batch."""
    import tritonclient.grpc as tc

    from tests.conftest import start_server

    folder, model, pooling, normalize = folders["qwen3_plain"]
    model.load()  # transformers first: without it the test skips before a server starts
    served = tmp_path / "repo"
    shutil.copytree(repo / "qwen3_plain", served / "qwen3_plain")
    srv = start_server(tmp_path, "--no-build-models", repo=served, ready_timeout=120)
    try:
        base = f"http://127.0.0.1:{srv.http_port}"
        body = {"model": "qwen3_plain", "input": QUERIES, "prompt_name": "query"}
        oai = np.array([d["embedding"] for d in _post(base + "/v1/embeddings", body)["data"]], np.float32)
        tei = np.array(_post(base + "/embed", {"model": "qwen3_plain", "inputs": DOCS}), np.float32)
        client = tc.InferenceServerClient(srv.grpc_url)
        inp = tc.InferInput("text", [len(DOCS), 1], "BYTES")
        inp.set_data_from_numpy(np.array([d.encode() for d in DOCS], dtype=object).reshape(-1, 1))
        kserve = client.infer("qwen3_plain", [inp], client_timeout=60).as_numpy("embedding")
        client.close()
    finally:
        srv.stop()
    prompt = qwen3.DEFAULT_PROMPTS["query"]
    want_q, _ = reference(folder, model, pooling, normalize, [prompt + q for q in QUERIES], left=True)
    want_d, _ = reference(folder, model, pooling, normalize, DOCS, left=True)
    for route, got, want in (("openai", oai, want_q), ("tei", tei, want_d), ("kserve", kserve, want_d)):
        cos = cosines(got, want)
        print(f"qwen3 served via {route}: min cosine {cos.min():.8f}")
        assert got.shape == want.shape and cos.min() >= MIN_COSINE, (route, cos)
    # The prompt changed the vectors: a query without it is another vector.
    plain_q, _ = reference(folder, model, pooling, normalize, QUERIES, left=True)
    assert cosines(oai, plain_q).max() < 0.99


# -- refusals --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config, named",
    [
        ({"architectures": ["MPNetForQuestionAnswering"], "model_type": "mpnet"}, "unsupported architecture"),
        ({"architectures": ["DistilBertModel"], "model_type": "distilbert", "activation": "relu"}, "activation 'relu'"),
        ({"architectures": ["Qwen3Model"], "model_type": "qwen3", "use_sliding_window": True}, "use_sliding_window"),
        ({"architectures": ["ModernBertModel"], "model_type": "modernbert",
          "rope_parameters": {"full_attention": {"rope_type": "yarn"}}}, "rope_type 'yarn'"),
        ({"architectures": ["Phi3Model"], "model_type": "phi3"}, "unsupported architecture Phi3Model"),
    ],
)  # fmt: skip
def test_unsupported_family_settings_are_refused(tmp_path, config, named):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(PrepareError, match=named) as err:
        read_folder(tmp_path)
    if "unsupported architecture" in named:
        # One sentence naming what is refused, then the list (the ONNX route's hint may follow).
        assert "MPNet, DistilBERT and ModernBERT" in str(err.value) and "Qwen3" in str(err.value)


def test_prepare_runs_without_torch(folders, tmp_path):
    """Every family prepared in a process where importing torch (or transformers) fails."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\n"
        "from pathlib import Path\n"
        "from batchgate.gateway.models.prepare import prepare_model\n"
        f"for name, folder in {[(n, str(f[0])) for n, f in folders.items()]!r}:\n"
        f"    prepare_model(Path(folder), name, Path({str(tmp_path)!r}), log=print)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert all((tmp_path / n / "1" / "model.onnx").is_file() for n in folders)
