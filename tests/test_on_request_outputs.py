"""Outputs given on request (model parameter ``on_request_outputs``): the bundled minilm's
``token_embeddings`` (TEI's ``/embed_all``) beside its ``embedding``.

The graph computes the token states anyway (mean pooling sums them); what an on-request output
saves is the engines fetching, binding and copying rows x tokens x 384 floats for calls that never
read them. So: a KServe call naming no outputs gets the embedding alone, one naming the token
output gets it, model metadata lists both; ``/embed_all`` through TEI's own client answers token
vectors that pool back to the server's own ``/v1/embeddings`` vector; the engines of a real
server count the batches that fetched each output, and dense calls never fetch the token output;
a batch holding both kinds of request fetches the union; the pooled (bucketed) engine path binds
the token buffers only in slots made for a batch that asked; the result cache keeps the two
apart. Real minilm throughout, served in this process (to read its engines) on real ports.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tc
from tokenizers import Tokenizer

from batchgate.gateway.repository import ConfigError, TOKEN_OUTPUT, load_model
from batchgate.gateway.scheduling import Scheduler
from batchgate.gateway.scheduling.fifo import FifoQueue
from batchgate.gateway.text import TextStage
from batchgate.workers import EngineOptions, WorkerPool, discover
from tests.test_minilm import model_twin

MIN_COSINE = 0.9999
TEXTS = [
    "A man is eating food.",
    "The quick brown fox jumps over the lazy dog near the river bank, twice.",
    "   ",  # whitespace only: [CLS][SEP]
    "東京は日本の首都です。",
]


def _copy(repo: Path, src: Path, name: str, extra: str = "", drop: tuple[str, ...] = ()) -> Path:
    """A model directory on ``src``'s files named ``name``: one worker, ``extra`` appended to its
    config, the parameters ``drop`` removed."""
    return model_twin(repo, src, name, extra, **dict.fromkeys(drop))


@pytest.fixture(scope="module")
def repo(minilm_dir, tmp_path_factory) -> Path:
    repo = tmp_path_factory.mktemp("on-request-repo")
    _copy(repo, minilm_dir, "minilm")
    _copy(repo, minilm_dir, "minilm_cached", "response_cache { enable: true }\n")
    return repo


@pytest.fixture(scope="module")
def served(repo):
    """The real server over ``repo`` (real WorkerPools, one worker a model) in a thread of this
    process, so a test can read its engines; clients talk to it over loopback ports."""
    from batchgate.gateway import codec
    from batchgate.gateway.config import Settings
    from batchgate.gateway.transport.server import Server

    limits = codec.LIMITS  # Server() sets the process's codec limits: put them back after
    settings = Settings(
        model_repository=repo, host="127.0.0.1", grpc_port=0, http_port=0, device="cpu",
        build_bundled_models=False, drain_linger_s=0.0, variant_selection="off",
    )  # fmt: skip
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="on-request-server", daemon=True)
    thread.start()

    async def make() -> Server:
        server = Server(settings)
        await server.start()
        return server

    server = asyncio.run_coroutine_threadsafe(make(), loop).result(180)
    try:
        yield server
    finally:
        asyncio.run_coroutine_threadsafe(server.drain_and_stop(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        codec.LIMITS = limits


@pytest.fixture(scope="module")
def base(served) -> str:
    return f"http://127.0.0.1:{served.http_port}"


@pytest.fixture(scope="module")
def triton(served):
    with tc.InferenceServerClient(f"127.0.0.1:{served.grpc_port}") as c:
        yield c


def post(url: str, body) -> object:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def fetched(server, model: str) -> dict[str, int]:
    """Batches that fetched each output, over the model's engines."""
    total: dict[str, int] = {}
    for w in server.plane.runtimes(model)[-1].pool.workers:
        for name, n in w.engine.fetched.items():
            total[name] = total.get(name, 0) + n
    return total


def text_input(texts: list[str]) -> tc.InferInput:
    x = tc.InferInput("text", [len(texts), 1], "BYTES")
    x.set_data_from_numpy(np.array([[t.encode()] for t in texts], dtype=object))
    return x


def token_counts(minilm_dir: Path, texts: list[str]) -> list[int]:
    tok = Tokenizer.from_file(str(minilm_dir / "tokenizer.json"))
    tok.no_padding()
    return [len(e.ids) for e in tok.encode_batch(texts)]


def pooled(vectors: np.ndarray) -> np.ndarray:
    """sentence-transformers' mean pooling over the given (real) tokens, then L2 normalisation."""
    m = np.asarray(vectors, np.float64).mean(0)
    return m / np.linalg.norm(m)


# -- KServe ----------------------------------------------------------------------------------------


def test_metadata_lists_the_token_output_and_a_call_naming_none_gets_the_embedding_alone(triton, base):
    meta = triton.get_model_metadata("minilm")
    assert [(o.name, list(o.shape)) for o in meta.outputs] == [
        ("embedding", [-1, 384]),
        (TOKEN_OUTPUT, [-1, -1, 384]),
    ]
    res = triton.infer("minilm", [text_input(TEXTS[:2])]).get_response()
    assert [o.name for o in res.outputs] == ["embedding"]
    doc = {"inputs": [{"name": "text", "shape": [1, 1], "datatype": "BYTES", "data": ["one text"]}]}
    body = post(base + "/v2/models/minilm/infer", doc)
    assert [o["name"] for o in body["outputs"]] == ["embedding"]


def test_a_kserve_call_naming_the_token_output_gets_it(triton, minilm_dir):
    texts = TEXTS[:2]
    only = triton.infer("minilm", [text_input(texts)], outputs=[tc.InferRequestedOutput(TOKEN_OUTPUT)])
    assert [o.name for o in only.get_response().outputs] == [TOKEN_OUTPUT]
    both = triton.infer(
        "minilm",
        [text_input(texts)],
        outputs=[tc.InferRequestedOutput("embedding"), tc.InferRequestedOutput(TOKEN_OUTPUT)],
    )
    tokens, dense = both.as_numpy(TOKEN_OUTPUT), both.as_numpy("embedding")
    counts = token_counts(minilm_dir, texts)
    assert tokens.shape == (2, max(counts), 384)
    np.testing.assert_array_equal(tokens, only.as_numpy(TOKEN_OUTPUT))
    for i, n in enumerate(counts):
        assert not tokens[i, n:].any()  # zero past the row's own tokens
        assert float(pooled(tokens[i, :n]) @ dense[i]) >= MIN_COSINE


# -- TEI's /embed_all --------------------------------------------------------------------------------


def test_embed_all_on_minilm_pools_to_the_servers_own_embedding(base, minilm_dir):
    """TEI's own client (tei-client, the test extra) at the root: minilm's token vectors, one per
    token of each text, mean-pooled and normalised, are the server's /v1/embeddings vectors."""
    tei_client = pytest.importorskip("tei_client")
    got = tei_client.HttpClient(base, timeout=120).embed_all(TEXTS)
    own = post(base + "/v1/embeddings", {"model": "minilm", "input": TEXTS})
    want = np.array([d["embedding"] for d in own["data"]], np.float32)
    assert [len(v) for v in got] == token_counts(minilm_dir, TEXTS)
    for vectors, vector in zip(got, want, strict=True):
        assert float(pooled(vectors) @ vector) >= MIN_COSINE


def test_dense_calls_never_fetch_the_token_output(served, base, triton):
    """Every dense wire (/v1/embeddings, TEI's /embed, KServe naming no outputs) runs batches that
    fetch the embedding alone; /embed_all's batches fetch the token output."""
    before = fetched(served, "minilm")
    post(base + "/v1/embeddings", {"model": "minilm", "input": TEXTS})
    post(base + "/embed", {"inputs": TEXTS})
    triton.infer("minilm", [text_input(TEXTS)])
    after = fetched(served, "minilm")
    assert after["embedding"] > before["embedding"]
    assert after[TOKEN_OUTPUT] == before[TOKEN_OUTPUT], (before, after)
    post(base + "/embed_all", {"inputs": TEXTS[:1]})
    assert fetched(served, "minilm")[TOKEN_OUTPUT] == after[TOKEN_OUTPUT] + 1


# -- the result cache --------------------------------------------------------------------------------


def test_the_cache_keeps_a_dense_row_apart_from_its_token_vectors(triton, base):
    """A text first asked without outputs (the embedding cached alone), then with the token output
    (alone, then beside the embedding): computed again each time, never answered from another
    set's entry; asked once more: a hit."""
    text = ["a text for the cache and its token vectors"]
    stats = lambda: triton.get_inference_statistics("minilm_cached").model_stats[0].inference_count  # noqa: E731
    triton.infer("minilm_cached", [text_input(text)])
    n0 = stats()
    alone = triton.infer("minilm_cached", [text_input(text)], outputs=[tc.InferRequestedOutput(TOKEN_OUTPUT)])
    assert [o.name for o in alone.get_response().outputs] == [TOKEN_OUTPUT]
    assert stats() == n0 + 1  # as many outputs as the defaults, but not them: its own entry
    n0 = stats()
    named = [tc.InferRequestedOutput("embedding"), tc.InferRequestedOutput(TOKEN_OUTPUT)]
    first = triton.infer("minilm_cached", [text_input(text)], outputs=named)
    assert stats() == n0 + 1  # computed: the dense entry does not answer it
    again = triton.infer("minilm_cached", [text_input(text)], outputs=named)
    assert stats() == n0 + 1  # a hit
    np.testing.assert_array_equal(again.as_numpy(TOKEN_OUTPUT), first.as_numpy(TOKEN_OUTPUT))
    plain = triton.infer("minilm", [text_input(text)], outputs=named)
    np.testing.assert_allclose(first.as_numpy(TOKEN_OUTPUT), plain.as_numpy(TOKEN_OUTPUT), atol=1e-5)
    tokens = post(base + "/tei/minilm_cached/embed_all", {"inputs": text})
    np.testing.assert_allclose(np.float32(tokens[0]), plain.as_numpy(TOKEN_OUTPUT)[0], atol=1e-5)


# -- the scheduler and the engines, with the real model ----------------------------------------------


def _pool(spec, stage) -> WorkerPool:
    options = EngineOptions(preprocess=stage, on_request=spec.params.on_request_outputs)
    pool = WorkerPool("on-request", spec.path, discover("cpu")[:1], 1, options, spec.buckets)
    pool.start()
    return pool


def _part(stage, text: str):
    column = np.array([[text.encode()]], dtype=object)
    return {stage.input: column}, 1, stage.row_keys({stage.input: column})[0]


async def test_a_batch_fetches_the_union_of_its_requests_outputs(minilm_dir):
    """A dense request and a token request queued together run as one batch that fetches both
    outputs once; each caller gets what it asked for, and a dense batch alone fetches the embedding."""
    spec = load_model(minilm_dir)[0]
    stage = TextStage(spec)
    pool = await asyncio.to_thread(_pool, spec, stage)
    sched = Scheduler("minilm", FifoQueue(64), pool.submit, 1, default_outputs=spec.default_outputs)
    sched.start()
    try:
        a, b = _part(stage, "a dense row"), _part(stage, "a token row")
        assert a[2] == b[2]  # one length bucket: they may share a batch
        dense, tokens = await asyncio.gather(sched.submit([a]), sched.submit([b], None, (TOKEN_OUTPUT,)))
        engine = pool.workers[0].engine
        assert sched.stats.execution_count == 1 and engine.fetched == {"embedding": 1, TOKEN_OUTPUT: 1}
        assert TOKEN_OUTPUT in tokens[0] and "embedding" in dense[0]
        (alone,) = await sched.submit([a])
        assert sorted(alone) == ["embedding"] and engine.fetched == {"embedding": 2, TOKEN_OUTPUT: 1}
        np.testing.assert_allclose(alone["embedding"], dense[0]["embedding"], atol=1e-6)
    finally:
        await sched.close()
        await asyncio.to_thread(pool.close)


def test_pooled_slots_bind_the_token_output_only_for_batches_that_ask(repo, tmp_path):
    """With seq_buckets removed (the GPU setting: bucketed engines over pooled, bound buffers), a
    dense batch's slot binds the embedding alone and no token buffer exists; a token batch gets a
    slot of its own, and its vectors equal the dynamic path's."""
    d = _copy(tmp_path, repo / "minilm", "bucketed", drop=("seq_buckets",))
    spec = load_model(d)[0]
    stage = TextStage(spec)
    pool = _pool(spec, stage)
    try:
        engine = pool.workers[0].engine
        assert engine.pooled
        parts = [_part(stage, t)[0] for t in TEXTS[:2]]
        dense, _ = pool.submit(parts, [1, 1], True).result(timeout=120)
        assert all(sorted(o) == ["embedding"] for o in dense)
        assert {n for s in engine._slots.values() for n in s.outputs} == {"embedding"}
        assert all(TOKEN_OUTPUT not in b.outputs for b in engine._buffers.values())
        both, _ = pool.submit(parts, [1, 1], True, ("embedding", TOKEN_OUTPUT)).result(timeout=120)
        assert any(TOKEN_OUTPUT in s.outputs for s in engine._slots.values())
        slots = len(engine._slots)
        pool.submit(parts, [1, 1], True, (TOKEN_OUTPUT, "embedding")).result(timeout=120)
        assert len(engine._slots) == slots  # the same set named in another order: the same slot
        with pytest.raises(ValueError, match="no output \\['token_embedings'\\]"):
            pool.submit(parts, [1, 1], True, ("token_embedings",)).result(timeout=120)
    finally:
        pool.close()
    flat = load_model(repo / "minilm")[0]
    plain = _pool(flat, TextStage(flat))
    try:
        want, _ = plain.submit(parts, [1, 1], True, (TOKEN_OUTPUT,)).result(timeout=120)
    finally:
        plain.close()
    for got, ref, d in zip(both, want, dense, strict=True):
        np.testing.assert_allclose(got[TOKEN_OUTPUT], ref[TOKEN_OUTPUT], atol=1e-5)
        np.testing.assert_allclose(got["embedding"], d["embedding"], atol=1e-6)


# -- the parameter -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "needles"),
    [
        ("token_embedings", ["on_request_outputs", "no output 'token_embedings'", "token_embeddings"]),
        ("embedding,token_embeddings", ["on_request_outputs", "every output", "leave at least one"]),
        ("token_embeddings,token_embeddings", ["on_request_outputs", "each once"]),
    ],
)
def test_a_bad_on_request_outputs_fails_the_load_naming_it(repo, tmp_path, value, needles):
    param = f'parameters {{ key: "on_request_outputs" value {{ string_value: "{value}" }} }}\n'
    d = _copy(tmp_path, repo / "minilm", "bad", param, drop=("on_request_outputs",))
    with pytest.raises(ConfigError) as err:
        load_model(d)
    for needle in needles:
        assert needle in str(err.value), err.value


# -- the build --------------------------------------------------------------------------------------


def test_the_token_output_is_the_tensor_mean_pooling_sums():
    """Nothing extra in the graph (built here by the code, not read from a folder an older build
    may have written): token_embeddings is the masked states the pooling's ReduceSum reads, and
    no other node multiplies the final states by the mask."""
    from safetensors.numpy import load

    from batchgate.gateway.models.minilm import BertConfig, build_onnx, load_source

    src = load_source(None)
    graph = build_onnx(load(src.weights), BertConfig.from_files(src.config, src.st_config)).graph
    assert [o.name for o in graph.output] == ["embedding", TOKEN_OUTPUT]
    (made,) = [n for n in graph.node if TOKEN_OUTPUT in n.output]
    readers = [n.op_type for n in graph.node if TOKEN_OUTPUT in n.input]
    assert made.op_type == "Mul" and readers == ["ReduceSum"]
    assert not [n for n in graph.node if n.op_type == "Mul" and n is not made and made.input[0] in n.input]


def test_serve_rebuilds_a_minilm_built_before_its_token_output(minilm_dir, tmp_path):
    """A repository whose minilm an older batchgate wrote (no token output in its config) is rebuilt
    by serve's first-use step; a config not written by the build is left alone."""
    import logging

    from batchgate.gateway.models.minilm import outdated, prepare_missing

    d = tmp_path / "minilm"
    (d / "1").mkdir(parents=True)
    (d / "1" / "model.onnx").write_bytes(b"an older build")
    shutil.copy(minilm_dir / "tokenizer.json", d / "tokenizer.json")
    text = (minilm_dir / "config.pbtxt").read_text()
    old = text.replace(
        text[text.index(',\n  {\n    name: "token_embeddings"') : text.index("\n]\ndynamic")], ""
    )
    old = "\n".join(
        line for line in old.splitlines() if "on_request" not in line and TOKEN_OUTPUT not in line
    )
    (d / "config.pbtxt").write_text(old + "\n")
    assert TOKEN_OUTPUT not in old and outdated(tmp_path)
    prepare_missing(tmp_path, logging.getLogger("batchgate"))
    assert not outdated(tmp_path)
    assert (d / "1" / "model.onnx").read_bytes() == (minilm_dir / "1" / "model.onnx").read_bytes()
    assert (d / "config.pbtxt").read_text() == text
    mine = old.replace("# Generated by gateway/models/minilm.py", "# mine")
    (d / "config.pbtxt").write_text(mine)
    assert not outdated(tmp_path)
    prepare_missing(tmp_path, logging.getLogger("batchgate"))
    assert (d / "config.pbtxt").read_text() == mine
