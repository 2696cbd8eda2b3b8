"""TEI's gRPC API (``tei.v1``) on batchgate's gRPC port, driven as a TEI user drives it: client
stubs generated here from the proto by ``grpc_tools.protoc`` (what TEI's docs tell users to run),
against a real server with a tenant file, every RPC answered as the same server's REST routes
answer the same text (``/v1/embeddings``, ``/v1/rerank``, ``/predict``, ``/embed_sparse``,
``/embed_all``, ``/tokenize``, ``/decode``).

The models: the bundled minilm (the default model) and tiny scrambled transformers models (written
by numpy in transformers' layout, tests/tiny_models.py) made servable with ``prepare-model``: a cross-encoder (rerank), a three-label classifier, a pair classifier, a
SPLADE encoder, and an embedding model with token vectors and prompts.
"""

from __future__ import annotations

import importlib
import json
import sys
import threading
import time
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from batchgate.gateway.admission.tenants import hash_key
from batchgate.gateway.models.prepare import prepare_model
from tests.conftest import ROOT, start_server
from tests.prepared import tiny_configs
from tests.test_classify import SENTIMENT
from tests.test_prepare_model import PAIRS, TEXTS, st_folder
from tests.test_sparse import splade_folder
from tests.tiny_models import transformers_folder

ALL = "tei-grpc-all-models-key-0001"
SOLO = "tei-grpc-minilm-only-key-002"
ALL_MD = (("authorization", f"Bearer {ALL}"),)
SOLO_MD = (("authorization", f"Bearer {SOLO}"),)
WINDOW = 3  # stream_window: the streams below hold more messages than this
DOCS = ["the man is eating bread", "a small red cat", "Tokyo 東京 tower", "what is the man eating", "dog"]
QUERY = "what is the man eating"


def md(model: str | None = None, key: tuple = ALL_MD) -> tuple:
    return key + ((("model", model),) if model is not None else ())


@pytest.fixture(scope="module")
def tei(tmp_path_factory):
    """(messages, stubs) generated from proto/tei/v1/tei.proto as a TEI user generates them. Their
    descriptors go to a pool of their own, not protobuf's default: the stock tei-client (the TEI
    surface tests, maybe in this same worker process) registers its own, older tei.proto there,
    and one pool cannot hold two different files of one name, whichever comes second fails."""
    from grpc_tools import protoc

    out = tmp_path_factory.mktemp("tei-stubs")
    args = [
        "protoc",
        f"-I{ROOT / 'proto/tei/v1'}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        "tei.proto",
    ]
    assert protoc.main(args) == 0
    messages = out / "tei_pb2.py"
    source = messages.read_text()
    assert source.count("_descriptor_pool.Default()") == 1, "protoc's output changed"
    messages.write_text(source.replace("_descriptor_pool.Default()", "_descriptor_pool.DescriptorPool()"))
    sys.path.insert(0, str(out))
    try:
        yield importlib.import_module("tei_pb2"), importlib.import_module("tei_pb2_grpc")
    finally:
        sys.path.remove(str(out))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    bert, _xlmr, wp, _ug = tiny_configs()
    root = tmp_path_factory.mktemp("tei-grpc-folders")
    made = {
        "sentiment": ("BertForSequenceClassification", dict(bert, id2label=SENTIMENT)),
        "nli": ("BertForSequenceClassification", dict(bert, num_labels=3)),
        "splade": ("BertForMaskedLM", bert),
        "tokens": ("BertModel", bert),
        "ce": ("BertForSequenceClassification", dict(bert, num_labels=1)),
    }
    for seed, (name, (architecture, config)) in enumerate(made.items()):
        transformers_folder(root / name, architecture, config, wp, seed=50 + seed)
    config = json.loads((root / "nli" / "config.json").read_text())
    config["sentence_transformers"] = {
        "activation_fn": "torch.nn.modules.activation.Softmax"
    }  # a pair classifier
    (root / "nli" / "config.json").write_text(json.dumps(config))
    splade_folder(root / "splade")
    st_folder(root / "tokens", "mean", False, **{  # vectors not unit length: TEI's normalize shows
        "config_sentence_transformers.json": {"prompts": {"query": "query: ", "passage": ""},
                                              "default_prompt_name": None}})  # fmt: skip
    return root


@pytest.fixture(scope="module")
def srv(folders, minilm_dir, tmp_path_factory):
    repo = tmp_path_factory.mktemp("tei-grpc-repo")
    for name in ("sentiment", "nli", "splade", "tokens", "ce"):
        prepare_model(folders / name, name, repo, token_embeddings=name == "tokens", log=print)
    (repo / "minilm").symlink_to(minilm_dir)
    with (repo / "tokens" / "config.pbtxt").open("a") as f:  # Matryoshka sizes: `dimensions` reaches gRPC
        f.write('parameters { key: "matryoshka_dimensions" value { string_value: "8,16" } }\n')
    tmp = tmp_path_factory.mktemp("tei-grpc-server")
    (tmp / "tenants.yaml").write_text(
        f'tenants:\n  - name: all\n    key_hashes: ["{hash_key(ALL)}"]\n'
        f'  - name: solo\n    key_hashes: ["{hash_key(SOLO)}"]\n    models: [minilm]\n'
    )
    env = {"BATCHGATE_STREAM_WINDOW": str(WINDOW), "BATCHGATE_MAX_STREAMS_PER_CONNECTION": "2"}
    server = start_server(
        tmp, "--no-build-models", "--api-keys-file", str(tmp / "tenants.yaml"), repo=repo, env=env,
        ready_timeout=120,
    )  # fmt: skip
    yield server
    server.stop()


@pytest.fixture(scope="module")
def channel(srv):
    with grpc.insecure_channel(srv.grpc_url) as ch:
        yield ch


def rest(srv, path: str, body=None, key: str = ALL):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{srv.http_port}{path}", data=data,
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise AssertionError(f"{path}: {e.code} {e.read()[:500]!r}") from None


def refusal(fn, *args, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        out = fn(*args, **kwargs)
        if not hasattr(out, "DESCRIPTOR"):
            list(out)  # a stream: the status comes with the iteration
    return err.value


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


# -- vectors ---------------------------------------------------------------------------------------


def test_embed_equals_the_servers_own_v1_embeddings(tei, channel, srv):
    pb, g = tei
    stub = g.EmbedStub(channel)
    texts = ["A man is eating food.", "Tokyo 東京 🗼 tower", "   ", "café " * 300]  # blank; over 256 tokens
    want = rest(srv, "/v1/embeddings", {"model": "minilm", "input": texts})["data"]
    for text, w in zip(texts, want, strict=True):
        got = stub.Embed(pb.EmbedRequest(inputs=text), metadata=md())  # no model: the default, minilm
        assert len(got.embeddings) == 384
        assert cosine(got.embeddings, w["embedding"]) >= 0.9999, text
        assert got.metadata.compute_chars == len(text) and got.metadata.compute_tokens > 0
    # the `model` metadata key picks another model, with its prompts
    want = rest(srv, "/v1/embeddings", {"model": "tokens", "input": ["query: dog", "dog"]})["data"]
    got = stub.Embed(pb.EmbedRequest(inputs="dog", prompt_name="query"), metadata=md("tokens"))
    assert len(got.embeddings) == len(want[0]["embedding"]) != 384
    assert cosine(got.embeddings, want[0]["embedding"]) >= 0.9999
    assert cosine(got.embeddings, want[1]["embedding"]) < 0.9999  # the prompt was applied
    # normalize unset is TEI's true; false gives the model's own vector
    assert (
        abs(np.linalg.norm(got.embeddings) - 1) < 1e-5
        and abs(np.linalg.norm(want[0]["embedding"]) - 1) > 1e-2
    )
    raw = stub.Embed(
        pb.EmbedRequest(inputs="dog", prompt_name="query", normalize=False), metadata=md("tokens")
    )
    np.testing.assert_allclose(raw.embeddings, want[0]["embedding"], atol=1e-5)
    # a Matryoshka size the model declares: the pipeline's cut, as /v1/embeddings makes it
    (cut,) = rest(srv, "/v1/embeddings", {"model": "tokens", "input": "query: dog", "dimensions": 8})["data"]
    got = stub.Embed(pb.EmbedRequest(inputs="dog", prompt_name="query", dimensions=8), metadata=md("tokens"))
    assert len(got.embeddings) == 8 and cosine(got.embeddings, cut["embedding"]) >= 0.9999


def test_embed_sparse_and_embed_all_equal_the_rest_routes(tei, channel, srv):
    pb, g = tei
    stub = g.EmbedStub(channel)
    want = rest(srv, "/tei/splade/embed_sparse", {"inputs": TEXTS[:3]})
    for text, w in zip(TEXTS[:3], want, strict=True):
        got = stub.EmbedSparse(pb.EmbedSparseRequest(inputs=text), metadata=md("splade"))
        assert [v.index for v in got.sparse_embeddings] == [v["index"] for v in w]
        np.testing.assert_allclose(
            [v.value for v in got.sparse_embeddings], [v["value"] for v in w], atol=1e-5
        )
    want = rest(srv, "/tei/tokens/embed_all", {"inputs": TEXTS[:3]})
    for text, w in zip(TEXTS[:3], want, strict=True):
        got = stub.EmbedAll(pb.EmbedAllRequest(inputs=text), metadata=md("tokens"))
        rows = np.array([list(t.embeddings) for t in got.token_embeddings], dtype=np.float32)
        assert rows.shape == np.shape(w)
        np.testing.assert_allclose(rows, w, atol=1e-5)


# -- scores ----------------------------------------------------------------------------------------


def test_rerank_equals_the_servers_own_v1_rerank(tei, channel, srv):
    pb, g = tei
    stub = g.RerankStub(channel)
    want = rest(srv, "/v1/rerank", {"model": "ce", "query": QUERY, "documents": DOCS})["results"]
    got = stub.Rerank(
        pb.RerankRequest(query=QUERY, texts=DOCS, return_text=True), metadata=md()
    )  # the one reranker
    assert [r.index for r in got.ranks] == [w["index"] for w in want]  # highest first
    np.testing.assert_allclose([r.score for r in got.ranks], [w["relevance_score"] for w in want], atol=1e-5)
    assert [r.text for r in got.ranks] == [DOCS[r.index] for r in got.ranks]
    assert got.metadata.compute_tokens > 0
    raw = stub.Rerank(pb.RerankRequest(query=QUERY, texts=DOCS, raw_scores=True), metadata=md("ce"))
    logits = {r["index"]: r["score"] for r in rest(srv, "/rerank", {"model": "ce", "query": QUERY, "texts": DOCS,
                                                                   "raw_scores": True})}  # fmt: skip
    np.testing.assert_allclose([r.score for r in raw.ranks], [logits[r.index] for r in raw.ranks], atol=1e-5)
    assert not any(r.HasField("text") for r in raw.ranks)
    err = refusal(stub.Rerank, pb.RerankRequest(query=QUERY, texts=[]), metadata=md("ce"))
    assert (
        err.code() == grpc.StatusCode.INVALID_ARGUMENT and "'texts' cannot be empty" in err.details()
    )  # TEI's
    # the client stream: one (query, text) per message, one ranking at the end; flags from the first
    msgs = [pb.RerankStreamRequest(query=QUERY, text=d, return_text=i == 0) for i, d in enumerate(DOCS)]
    streamed = stub.RerankStream(iter(msgs), metadata=md("ce"))
    assert [(r.index, r.text) for r in streamed.ranks] == [(r.index, r.text) for r in got.ranks]
    np.testing.assert_allclose([r.score for r in streamed.ranks], [r.score for r in got.ranks], atol=1e-5)


def test_predict_and_predict_pair_equal_the_rest_route(tei, channel, srv):
    pb, g = tei
    stub = g.PredictStub(channel)
    for text in TEXTS[:3]:
        want = rest(srv, "/tei/sentiment/predict", {"inputs": text})
        got = stub.Predict(pb.PredictRequest(inputs=text), metadata=md("sentiment"))
        assert [p.label for p in got.predictions] == [w["label"] for w in want]  # highest first
        np.testing.assert_allclose([p.score for p in got.predictions], [w["score"] for w in want], atol=1e-5)
        assert set(SENTIMENT.values()) == {p.label for p in got.predictions}
    raw = stub.Predict(pb.PredictRequest(inputs=TEXTS[1], raw_scores=True), metadata=md("sentiment"))
    want = rest(srv, "/tei/sentiment/predict", {"inputs": TEXTS[1], "raw_scores": True})
    np.testing.assert_allclose([p.score for p in raw.predictions], [w["score"] for w in want], atol=1e-5)
    for a, b in PAIRS[:2]:
        want = rest(srv, "/tei/nli/predict", {"inputs": [a, b]})
        got = stub.PredictPair(pb.PredictPairRequest(inputs=[a, b]), metadata=md("nli"))
        assert [p.label for p in got.predictions] == [w["label"] for w in want]
        np.testing.assert_allclose([p.score for p in got.predictions], [w["score"] for w in want], atol=1e-5)
    # one text is classified alone (a single-text classifier takes it), three are TEI's refusal
    one = stub.PredictPair(pb.PredictPairRequest(inputs=[TEXTS[2]]), metadata=md("sentiment"))
    alone = stub.Predict(pb.PredictRequest(inputs=TEXTS[2]), metadata=md("sentiment"))
    assert [(p.label, p.score) for p in one.predictions] == [(p.label, p.score) for p in alone.predictions]
    err = refusal(stub.PredictPair, pb.PredictPairRequest(inputs=["a", "b", "c"]), metadata=md("nli"))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "must have a single or two elements. Given: 3" in err.details()  # TEI's words


# -- tokens ----------------------------------------------------------------------------------------


def test_tokenize_and_decode_equal_the_rest_routes(tei, channel, srv):
    pb, g = tei
    stub = g.TokenizeStub(channel)
    for text in ("Hello world, café!", "Tokyo 東京 🗼 tower"):
        for special in (True, False):
            (want,) = rest(srv, "/tokenize", {"inputs": text, "add_special_tokens": special})
            got = stub.Tokenize(pb.EncodeRequest(inputs=text, add_special_tokens=special), metadata=md())
            assert [(t.id, t.text, t.special) for t in got.tokens] == [
                (w["id"], w["text"], w["special"]) for w in want
            ]
            assert [(t.start, t.stop) if t.HasField("start") else None for t in got.tokens] == [
                (w["start"], w["stop"]) if w["start"] is not None else None for w in want
            ]
            ids = [t.id for t in got.tokens]
            for skip in (True, False):
                (text_back,) = rest(srv, "/decode", {"ids": [ids], "skip_special_tokens": skip})
                assert (
                    stub.Decode(pb.DecodeRequest(ids=ids, skip_special_tokens=skip), metadata=md()).text
                    == text_back
                )
    (want,) = rest(
        srv, "/tei/tokens/tokenize", {"inputs": "dog", "prompt_name": "query", "add_special_tokens": True}
    )
    got = stub.Tokenize(
        pb.EncodeRequest(inputs="dog", prompt_name="query", add_special_tokens=True), metadata=md("tokens")
    )
    assert [t.id for t in got.tokens] == [w["id"] for w in want]


# -- streams ---------------------------------------------------------------------------------------


def test_streams_answer_each_message_in_order(tei, channel, srv):
    """More messages than the stream window, of very different lengths (so they finish out of
    order), each answered as its unary call, in the order sent."""
    pb, g = tei
    texts = [("word " * (1 + (7 * i) % 60)).strip() + f" {i}" for i in range(3 * WINDOW + 2)]
    embed = g.EmbedStub(channel)
    want = [embed.Embed(pb.EmbedRequest(inputs=t), metadata=md()).embeddings for t in texts]
    got = list(embed.EmbedStream(iter(pb.EmbedRequest(inputs=t) for t in texts), metadata=md()))
    assert len(got) == len(texts)
    for g_, w in zip(got, want, strict=True):
        assert cosine(g_.embeddings, w) >= 0.9999
    got = list(
        embed.EmbedSparseStream(iter(pb.EmbedSparseRequest(inputs=t) for t in TEXTS), metadata=md("splade"))
    )
    for g_, t in zip(got, TEXTS, strict=True):
        one = embed.EmbedSparse(pb.EmbedSparseRequest(inputs=t), metadata=md("splade"))
        assert [v.index for v in g_.sparse_embeddings] == [v.index for v in one.sparse_embeddings]
    got = list(embed.EmbedAllStream(iter(pb.EmbedAllRequest(inputs=t) for t in TEXTS), metadata=md("tokens")))
    assert [len(a.token_embeddings) for a in got] == [
        len(embed.EmbedAll(pb.EmbedAllRequest(inputs=t), metadata=md("tokens")).token_embeddings)
        for t in TEXTS
    ]
    predict = g.PredictStub(channel)
    got = list(
        predict.PredictStream(iter(pb.PredictRequest(inputs=t) for t in TEXTS), metadata=md("sentiment"))
    )
    assert [[p.label for p in a.predictions] for a in got] == [
        [p.label for p in predict.Predict(pb.PredictRequest(inputs=t), metadata=md("sentiment")).predictions]
        for t in TEXTS
    ]
    pairs = [pb.PredictPairRequest(inputs=list(p)) for p in PAIRS]
    got = list(predict.PredictPairStream(iter(pairs), metadata=md("nli")))
    assert [a.predictions[0].score for a in got] == pytest.approx(
        [predict.PredictPair(p, metadata=md("nli")).predictions[0].score for p in pairs], abs=1e-5
    )
    tok = g.TokenizeStub(channel)
    got = list(tok.TokenizeStream(iter(pb.EncodeRequest(inputs=t) for t in texts), metadata=md()))
    assert [len(a.tokens) for a in got] == [
        len(tok.Tokenize(pb.EncodeRequest(inputs=t), metadata=md()).tokens) for t in texts
    ]
    decoded = list(
        tok.DecodeStream(iter(pb.DecodeRequest(ids=[t.id for t in a.tokens]) for a in got), metadata=md())
    )
    assert [d.text for d in decoded] == [t.lower() for t in texts]


def test_a_refused_message_ends_its_stream_after_the_answers_before_it(tei, channel):
    pb, g = tei
    msgs = [pb.EmbedRequest(inputs="first"), pb.EmbedRequest(inputs="second"), pb.EmbedRequest(inputs=""),
            pb.EmbedRequest(inputs="never")]  # fmt: skip
    call = g.EmbedStub(channel).EmbedStream(iter(msgs), metadata=md())
    answers = []
    with pytest.raises(grpc.RpcError) as err:
        for a in call:
            answers.append(a)
    assert len(answers) == 2
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "inputs" in err.value.details()


def test_streams_take_a_slot_per_connection(tei, srv):
    pb, g = tei
    gate = threading.Event()

    def idle():
        gate.wait(20)
        return
        yield  # noqa: B901 - a generator that sends nothing until the gate opens

    with grpc.insecure_channel(srv.grpc_url) as ch:
        stub = g.EmbedStub(ch)
        held = [stub.EmbedStream(idle(), metadata=md(), timeout=30) for _ in range(2)]
        time.sleep(0.5)
        err = refusal(stub.EmbedStream, iter([pb.EmbedRequest(inputs="x")]), metadata=md(), timeout=10)
        gate.set()
        for h in held:
            assert list(h) == []
        assert (
            err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_streams_per_connection" in err.details()
        )
        (answer,) = list(
            stub.EmbedStream(iter([pb.EmbedRequest(inputs="x")]), metadata=md(), timeout=10)
        )  # given back
        assert len(answer.embeddings) == 384


# -- refusals --------------------------------------------------------------------------------------


def test_an_unknown_model_is_not_found_by_name(tei, channel):
    pb, g = tei
    for fn, req in ((g.EmbedStub(channel).Embed, pb.EmbedRequest(inputs="x")),
                    (g.InfoStub(channel).Info, pb.InfoRequest()),
                    (g.TokenizeStub(channel).Tokenize, pb.EncodeRequest(inputs="x")),
                    (g.RerankStub(channel).Rerank, pb.RerankRequest(query="q", texts=["x"]))):  # fmt: skip
        err = refusal(fn, req, metadata=md("no-such-model"))
        assert err.code() == grpc.StatusCode.NOT_FOUND and "no-such-model" in err.details(), err.details()
    err = refusal(
        g.EmbedStub(channel).EmbedStream, iter([pb.EmbedRequest(inputs="x")]), metadata=md("no-such-model")
    )
    assert err.code() == grpc.StatusCode.NOT_FOUND and "no-such-model" in err.details()


@pytest.mark.parametrize(
    "rpc, request_, model, field",
    [
        ("Embed", {"inputs": ""}, None, "inputs"),
        ("Embed", {"inputs": "x", "truncation_direction": 7}, None, "truncation_direction"),
        ("Embed", {"inputs": "x", "prompt_name": "nope"}, "tokens", "prompt_name"),
        ("Embed", {"inputs": "x", "dimensions": 7}, None, "dimensions"),
        ("Embed", {"inputs": "x"}, "ce", "model"),  # a reranker does not embed
        ("Rerank", {"query": "q", "texts": []}, "ce", "texts"),
        ("PredictPair", {"inputs": ["a", "b", "c"]}, "nli", "inputs"),
        ("Predict", {"inputs": "x", "truncation_direction": 2}, "sentiment", "truncation_direction"),
    ],
)
def test_bad_input_is_invalid_argument_naming_the_field(tei, channel, rpc, request_, model, field):
    pb, g = tei
    service = {"Embed": "Embed", "Rerank": "Rerank", "PredictPair": "Predict", "Predict": "Predict"}[rpc]
    message = getattr(pb, {"Embed": "EmbedRequest", "Rerank": "RerankRequest", "PredictPair": "PredictPairRequest",
                           "Predict": "PredictRequest"}[rpc])  # fmt: skip
    fn = getattr(getattr(g, f"{service}Stub")(channel), rpc)
    err = refusal(fn, message(**request_), metadata=md(model))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
    assert field in err.details(), err.details()


def test_with_a_tenant_file_every_rpc_needs_a_key(tei, channel):
    pb, g = tei
    calls = [
        (g.InfoStub(channel).Info, pb.InfoRequest()),
        (g.EmbedStub(channel).Embed, pb.EmbedRequest(inputs="x")),
        (g.TokenizeStub(channel).Decode, pb.DecodeRequest(ids=[101])),
        (g.EmbedStub(channel).EmbedStream, iter([pb.EmbedRequest(inputs="x")])),
        (g.RerankStub(channel).RerankStream, iter([pb.RerankStreamRequest(query="q", text="x")])),
    ]
    for fn, req in calls:
        for key in ((), (("authorization", "Bearer not-a-key-of-anyone-000"),)):
            err = refusal(fn, req, metadata=key)
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED, (fn, err.details())
    # a tenant limited to minilm: its models only, the others as if unknown
    assert g.EmbedStub(channel).Embed(pb.EmbedRequest(inputs="x"), metadata=SOLO_MD).embeddings
    err = refusal(g.EmbedStub(channel).Embed, pb.EmbedRequest(inputs="x"), metadata=md("tokens", SOLO_MD))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "tokens" in err.details()
    err = refusal(g.InfoStub(channel).Info, pb.InfoRequest(), metadata=md("tokens", SOLO_MD))
    assert err.code() == grpc.StatusCode.NOT_FOUND


def test_a_keyless_call_is_refused_on_its_metadata_before_its_message(srv, channel):
    """The auth interceptor refuses TEI's methods as KServe's: a unary call whose message never
    comes is refused at once, not held until its deadline (its handler would wait for the message)."""
    gate = threading.Event()

    def nothing():
        gate.wait(10)
        return
        yield  # noqa: B901 - a request stream that sends no message

    call = channel.stream_stream("/tei.v1.Embed/Embed")  # bytes in, bytes out: as any client's first frames
    t0 = time.monotonic()
    err = refusal(call, nothing(), timeout=5)
    gate.set()
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED and time.monotonic() - t0 < 4


# -- information -----------------------------------------------------------------------------------


def test_info_equals_the_rest_info_per_model(tei, channel, srv):
    pb, g = tei
    stub = g.InfoStub(channel)
    types = {"minilm": pb.MODEL_TYPE_EMBEDDING, "tokens": pb.MODEL_TYPE_EMBEDDING, "splade": pb.MODEL_TYPE_EMBEDDING,
             "sentiment": pb.MODEL_TYPE_CLASSIFIER, "nli": pb.MODEL_TYPE_CLASSIFIER, "ce": pb.MODEL_TYPE_RERANKER}  # fmt: skip
    for name, kind in types.items():
        want = rest(srv, f"/tei/{name}/info")
        got = stub.Info(pb.InfoRequest(), metadata=md(name))
        assert got.model_id == name and got.model_type == kind
        assert (got.max_input_length, got.max_batch_tokens, got.max_client_batch_size, got.model_sha) == (
            want["max_input_length"], want["max_batch_tokens"], want["max_client_batch_size"], want["model_sha"],
        )  # fmt: skip
        assert got.version == want["version"] and got.max_batch_requests == want["max_batch_requests"]
        assert not got.HasField("sha") and not got.HasField("docker_label")
    assert stub.Info(pb.InfoRequest(), metadata=md()).model_id == "minilm"  # the default model


def test_health_and_reflection_list_teis_services(srv, channel):
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("tei.v1.Info", "tei.v1.Embed", "tei.v1.Predict", "tei.v1.Rerank", "tei.v1.Tokenize"):
        resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING, service
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    (resp,) = list(
        stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    )
    names = {s.name for s in resp.list_services_response.service}
    assert {"tei.v1.Info", "tei.v1.Embed", "tei.v1.Predict", "tei.v1.Rerank", "tei.v1.Tokenize"} <= names
    assert "inference.GRPCInferenceService" in names
    (resp,) = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
        file_containing_symbol="tei.v1.Embed")])))  # fmt: skip
    assert resp.file_descriptor_response.file_descriptor_proto  # what grpcurl reads the methods from


# -- the stream's window and order, without sockets ------------------------------------------------


class _Edge:
    name = "grpc_stream"

    def failed(self, *_args) -> None:
        pass


class _HeldPipeline:
    """The pipeline's ``texts`` as a state machine the test drives: each call waits on its own gate."""

    def __init__(self, door, window: int) -> None:
        import asyncio
        from types import SimpleNamespace

        self.door = door
        self.settings = SimpleNamespace(stream_window=window)
        self.plane = SimpleNamespace(draining=False)
        self.gates: dict[int, asyncio.Event] = {}
        self.asyncio = asyncio

    async def texts(self, pass_, edge, call):
        from batchgate.gateway.call import TextAnswer

        with pass_:
            i = int(call.texts[0])
            gate = self.gates[i] = self.asyncio.Event()
            await gate.wait()
            return TextAnswer("m", "1", "embedding", [1], dense={"float": np.float32([[i]])})


class _Context:
    def __init__(self) -> None:
        self.written: list[float] = []

    def invocation_metadata(self):
        return ()

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    def set_trailing_metadata(self, _md) -> None:
        pass

    async def write(self, message) -> None:
        self.written.append(message.embeddings[0])

    async def abort(self, code, details, _trailing=()):
        raise AssertionError(f"aborted {code}: {details}")


async def test_a_stream_holds_at_most_its_window_and_answers_in_order():
    """Window 3: a fourth message is not read while three are unanswered; answers finishing in
    reverse order are written in the order the messages came."""
    import asyncio
    from types import SimpleNamespace

    from batchgate.gateway.admission import Admission
    from batchgate.gateway.admission.door import Door, StreamSlots
    from batchgate.gateway.admission.gate import LoadShedder
    from batchgate.gateway.transport.tei_grpc import TeiServicer
    from batchgate.proto.tei.v1 import tei_pb2 as ours

    door = Door(Admission(), LoadShedder(0.02, 32), StreamSlots(8, 8))
    pipeline = _HeldPipeline(door, window=3)
    servicer = TeiServicer(pipeline, SimpleNamespace(transport=lambda _n: _Edge()))
    read = []

    async def messages():
        for i in range(8):
            read.append(i)
            yield ours.EmbedRequest(inputs=str(i))

    async def turns(n: int = 50) -> None:
        for _ in range(n):
            await asyncio.sleep(0)

    context = _Context()
    stream = asyncio.create_task(servicer.EmbedStream(messages(), context))
    await turns()
    assert sorted(pipeline.gates) == [0, 1, 2] and read == [0, 1, 2]  # the window is full: not read on
    pipeline.gates[2].set()
    pipeline.gates[1].set()
    await turns()
    assert context.written == [] and read == [0, 1, 2]  # the first is still unanswered: nothing written
    pipeline.gates[0].set()
    await turns()
    assert context.written == [0, 1, 2] and sorted(pipeline.gates) == [0, 1, 2, 3, 4, 5]
    for i in (5, 4):
        pipeline.gates[i].set()
    await turns()
    assert context.written == [0, 1, 2] and read == [0, 1, 2, 3, 4, 5]
    pipeline.gates[3].set()
    await turns()
    assert context.written == [0, 1, 2, 3, 4, 5] and sorted(pipeline.gates) == list(range(8))
    for i in (7, 6):
        pipeline.gates[i].set()
        await turns()
    await asyncio.wait_for(stream, 5)
    assert context.written == list(range(8))
    assert door.streams.connections == {}  # the stream's slot was given back


async def test_a_tei_grpc_call_looks_its_model_up_twice(tmp_path, monkeypatch):
    """As every text wire (tests/test_text_call.py): the pipeline looks the model up, the servicer never."""
    from batchgate.proto.tei.v1 import tei_pb2 as ours
    from batchgate.proto.tei.v1 import tei_pb2_grpc as ours_grpc
    from tests.harness import serving
    from tests.test_text_call import _repo

    async with serving(_repo(tmp_path)) as gw:
        plane = gw.server.plane
        real, seen = type(plane).get, []

        def counted(self, name, version=""):
            seen.append(name)
            return real(self, name, version)

        monkeypatch.setattr(type(plane), "get", counted)
        stub = ours_grpc.EmbedStub(gw.channel)
        assert len((await stub.Embed(ours.EmbedRequest(inputs="one"))).embeddings) == 384
        assert seen == ["minilm", "minilm"]
        seen.clear()
        answers = [a async for a in stub.EmbedStream(iter([ours.EmbedRequest(inputs=t) for t in ("a", "b")]))]
        assert len(answers) == 2 and seen == ["minilm"] * 4
