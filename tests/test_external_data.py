"""Models past 2 GiB: ``prepare-model`` writes the graph with ONNX external data
(``1/model.onnx`` + ``1/model.onnx.data``) once the model passes ``BATCHGATE_ONNX_EXTERNAL_BYTES``
(just under protobuf's 2 GiB by default; 0 here, so a tiny model takes the same path).

A tiny Qwen3 embedder (the decoder family whose 0.6B model is 2.4 GiB as float32) is written with
numpy, prepared once as one file and once with external data, and the two must answer alike:
through ONNX Runtime, OpenVINO and a real server on loopback. The fingerprint covers the data
file; ONNX Runtime's optimised-model cache skips such a model; ``batchgate optimize`` refuses it
by name; an ONNX export whose weights sit in ``model.onnx_data`` is carried along.

The real shape (Qwen3-Embedding-0.6B, random weights) is too slow for the suite:
``tests/real_shape_qwen3.py`` runs it by hand (docs/embeddings.md has its figures).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx.external_data_helper import _get_all_tensors
import pytest
from safetensors.numpy import save_file

from batchgate.gateway.models.hf_model import PrepareError
from batchgate.gateway.models.prepare import prepare_model
from batchgate.gateway.models.onnx_graph import EXTERNAL_BYTES_ENV, external_bytes
from batchgate.gateway.models.optimize import OptimizeError, Options, optimize
from batchgate.gateway.repository import load_model
from batchgate.gateway.text import TextStage
from batchgate.workers import openvino_engine
from batchgate.workers.buckets import read_model_io
from batchgate.workers.devices import Device
from batchgate.workers.fingerprint import external_files, file_fingerprint
from batchgate.workers.sessions import SessionFactory
from tests.test_prepare_families import DOCS, EOT, QUERIES, _post, qwen_tokenizer
from tests.test_prepare_model import TEXTS

TINY = dict(hidden=32, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=64)
SAME = 1e-6  # the two builds hold the same float32 weights: their answers agree to rounding


def qwen3_folder(d: Path, *, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int,
                 intermediate: int, vocab: int | None = None, std: float = 0.3, seed: int = 0,
                 dtype=np.float32) -> Path:  # fmt: skip
    """A Qwen3-Embedding folder (config.json, model.safetensors, tokenizer.json) with random
    weights written by numpy: no torch, no download. Weights are named as the Hub's checkpoint
    names them (no ``model.`` prefix); norms' scales around 1, the rest around 0."""
    tok = qwen_tokenizer()
    vocab = vocab or tok.get_vocab_size()
    rng = np.random.default_rng(seed)

    def w(*shape: int, center: float = 0.0) -> np.ndarray:
        x = rng.standard_normal(shape, dtype=np.float32)
        x *= std
        x += center
        return x.astype(dtype, copy=False)

    tensors = {"embed_tokens.weight": w(vocab, hidden), "norm.weight": w(hidden, center=1.0)}
    for i in range(layers):
        p, a = f"layers.{i}", f"layers.{i}.self_attn"
        tensors |= {
            f"{p}.input_layernorm.weight": w(hidden, center=1.0),
            f"{p}.post_attention_layernorm.weight": w(hidden, center=1.0),
            f"{a}.q_proj.weight": w(heads * head_dim, hidden),
            f"{a}.k_proj.weight": w(kv_heads * head_dim, hidden),
            f"{a}.v_proj.weight": w(kv_heads * head_dim, hidden),
            f"{a}.o_proj.weight": w(hidden, heads * head_dim),
            f"{a}.q_norm.weight": w(head_dim, center=1.0),
            f"{a}.k_norm.weight": w(head_dim, center=1.0),
            f"{p}.mlp.gate_proj.weight": w(intermediate, hidden),
            f"{p}.mlp.up_proj.weight": w(intermediate, hidden),
            f"{p}.mlp.down_proj.weight": w(hidden, intermediate),
        }
    d.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(d / "model.safetensors"))
    config = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": hidden,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "intermediate_size": intermediate, "vocab_size": vocab,
        "max_position_embeddings": 32768, "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6,
        "hidden_act": "silu", "tie_word_embeddings": True, "eos_token_id": tok.token_to_id(EOT),
    }  # fmt: skip
    (d / "config.json").write_text(json.dumps(config))
    tok.save(str(d / "tokenizer.json"))
    return d


def _prepare(folder: Path, name: str, repo: Path, monkeypatch, *, external: bool, **kw) -> Path:
    with monkeypatch.context() as m:
        if external:
            m.setenv(EXTERNAL_BYTES_ENV, "0")
        else:
            m.delenv(EXTERNAL_BYTES_ENV, raising=False)
        return prepare_model(folder, name, repo, log=print, **kw)


def _answer(model_file: Path, texts: list[str]) -> np.ndarray:
    (spec,) = load_model(model_file.parent.parent)
    feeds = TextStage(spec)({"text": np.array(texts, dtype=object)})
    sess = ort.InferenceSession(str(model_file), providers=["CPUExecutionProvider"])
    return sess.run(["embedding"], feeds)[0]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return qwen3_folder(tmp_path_factory.mktemp("qwen3-tiny") / "qwen3", **TINY)


@pytest.fixture(scope="module")
def repo(folder, tmp_path_factory):
    """``single``: one file; ``external``: graph + model.onnx.data; the same folder."""
    repo = tmp_path_factory.mktemp("external-repo")
    with pytest.MonkeyPatch.context() as m:
        _prepare(folder, "single", repo, m, external=False)
        _prepare(folder, "external", repo, m, external=True)
    return repo


def test_external_build_writes_the_weights_beside_the_graph(repo):
    single, external = repo / "single" / "1", repo / "external" / "1"
    assert sorted(p.name for p in single.iterdir()) == ["model.onnx"]
    assert sorted(p.name for p in external.iterdir()) == ["model.onnx", "model.onnx.data"]
    graph = onnx.load(str(external / "model.onnx"), load_external_data=False)
    # Every tensor over 1 KiB lives in the data file (the tiny model has many under it).
    assert (external / "model.onnx").stat().st_size < 64 * 1024
    assert (external / "model.onnx.data").stat().st_size > 0.8 * (single / "model.onnx").stat().st_size
    assert {e.value for t in graph.graph.initializer for e in t.external_data if e.key == "location"} == {
        "model.onnx.data"
    }


def test_external_build_answers_as_the_single_file_build(repo):
    single = _answer(repo / "single" / "1" / "model.onnx", TEXTS)
    external = _answer(repo / "external" / "1" / "model.onnx", TEXTS)
    assert single.shape == (len(TEXTS), TINY["hidden"])
    assert np.abs(single - external).max() <= SAME


def test_a_data_file_in_the_working_directory_is_no_obstacle(folder, tmp_path, monkeypatch):
    """onnx.save_model refuses when the working directory holds a file of the data file's name
    (a user preparing from inside a model's version folder); the writer does not."""
    (tmp_path / "model.onnx.data").write_bytes(b"another model's weights")
    monkeypatch.chdir(tmp_path)
    _prepare(folder, "m", tmp_path / "repo", monkeypatch, external=True)
    assert (tmp_path / "model.onnx.data").read_bytes() == b"another model's weights"
    assert (tmp_path / "repo" / "m" / "1" / "model.onnx.data").is_file()


def test_a_smaller_rebuild_removes_the_old_data_file(folder, tmp_path, monkeypatch):
    _prepare(folder, "m", tmp_path, monkeypatch, external=True)
    assert (tmp_path / "m" / "1" / "model.onnx.data").is_file()
    _prepare(folder, "m", tmp_path, monkeypatch, external=False)
    assert sorted(p.name for p in (tmp_path / "m" / "1").iterdir()) == ["model.onnx"]


def test_a_bad_threshold_is_refused_by_name(folder, tmp_path, monkeypatch):
    monkeypatch.setenv(EXTERNAL_BYTES_ENV, "two gigs")
    with pytest.raises(ValueError, match=f"{EXTERNAL_BYTES_ENV}='two gigs': expected a byte count"):
        prepare_model(folder, "m", tmp_path, log=print)


def test_the_threshold_stays_under_protobufs_2_gib(monkeypatch):
    """One protobuf message cannot pass 2 GiB (2**31 bytes, written out here rather than taken from
    onnx_graph, so a wrong constant there cannot move the bar): by default, and at the most the env
    setting allows, a model that big already keeps its weights beside the graph."""
    monkeypatch.delenv(EXTERNAL_BYTES_ENV, raising=False)
    default = external_bytes()
    assert 2**30 < default < 2**31
    monkeypatch.setenv(EXTERNAL_BYTES_ENV, str(default))
    assert external_bytes() == default
    monkeypatch.setenv(EXTERNAL_BYTES_ENV, str(2**31))
    with pytest.raises(ValueError, match="expected a byte count from 0 to"):
        external_bytes()


def test_fingerprint_covers_the_data_file(repo, tmp_path):
    model_dir = tmp_path / "external"
    shutil.copytree(repo / "external", model_dir)
    data = model_dir / "1" / "model.onnx.data"
    (before,) = load_model(model_dir)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # one bit of one weight
    data.write_bytes(bytes(raw))
    (after,) = load_model(model_dir)
    assert before.fingerprint != after.fingerprint
    # A single-file model keeps the fingerprint it always had: its bytes' sha256.
    import hashlib

    single = repo / "single" / "1" / "model.onnx"
    (spec,) = load_model(repo / "single")
    assert (
        spec.fingerprint == file_fingerprint(single) == hashlib.sha256(single.read_bytes()).hexdigest()[:16]
    )


def test_the_graph_is_parsed_once_per_version_of_its_file(repo, tmp_path, monkeypatch):
    """The repository reads the graph for its config; the fingerprint and each worker's session
    factory ask which data files it names, the placement and each pool what its inputs are: one
    parse for each question, until the file changes."""
    model_dir = tmp_path / "external"
    shutil.copytree(repo / "external", model_dir)
    graph = model_dir / "1" / "model.onnx"
    parsed: list[str] = []
    real_load = onnx.load

    def counted_load(f, *args, **kwargs):
        parsed.append(str(f))
        return real_load(f, *args, **kwargs)

    monkeypatch.setattr(onnx, "load", counted_load)
    (spec,) = load_model(model_dir)
    for _ in range(3):
        SessionFactory(graph, spec.fingerprint, Device("cpu", 0), cache_dir=tmp_path / "cache")
        assert [t.name for t in read_model_io(graph)[0]] == ["input_ids", "attention_mask"]
    assert parsed.count(str(graph)) == 3, parsed
    # The graph rewritten to read its weights from another file is read anew.
    model = real_load(str(graph), load_external_data=False)
    for t in _get_all_tensors(model):
        for entry in t.external_data:
            if entry.key == "location":
                entry.value = "weights.bin"
    (model_dir / "1" / "model.onnx.data").rename(model_dir / "1" / "weights.bin")
    onnx.save_model(model, str(graph))
    assert external_files(graph) == [model_dir / "1" / "weights.bin"]


def test_engine_cache_is_skipped_for_external_data(repo, tmp_path):
    """ORT would save the optimised graph as one protobuf: weights copied into the cache (per
    shape in static mode), and past 2 GiB not saved at all. One file caches; external data not."""
    answers = {}
    for name in ("single", "external"):
        cache = tmp_path / name
        model = repo / name / "1" / "model.onnx"
        factory = SessionFactory(model, "", Device("cpu", 0), cache_dir=cache)
        (spec,) = load_model(repo / name)
        feeds = TextStage(spec)({"text": np.array(TEXTS, dtype=object)})
        answers[name] = factory.create().run(["embedding"], feeds)[0]
        cached = sorted(p.name for p in cache.iterdir())
        assert (len(cached) == 1) if name == "single" else (cached == []), (name, cached)
    assert np.abs(answers["single"] - answers["external"]).max() <= SAME


@pytest.mark.skipif(not openvino_engine.available(), reason="openvino is not installed")
def test_openvino_reads_the_external_data_and_its_cache_follows_the_weights(
    folder, repo, tmp_path, monkeypatch
):
    """OpenVINO's ONNX frontend reads model.onnx.data from beside the graph; its blob cache
    (CACHE_DIR) keys on the weights, so new weights under the same file names are recompiled."""
    (spec,) = load_model(repo / "external")
    feeds = TextStage(spec)({"text": np.array(TEXTS, dtype=object)})
    want = _answer(repo / "single" / "1" / "model.onnx", TEXTS)
    served = tmp_path / "external"
    shutil.copytree(repo / "external", served)
    model = served / "1" / "model.onnx"

    def ov() -> np.ndarray:
        factory = openvino_engine.SessionFactory(model, precision="fp32", cache_dir=tmp_path / "ov-cache")
        return factory.create().run(["embedding"], feeds)[0]

    assert np.abs(ov() - want).max() <= 1e-5
    other = qwen3_folder(tmp_path / "other", **TINY, seed=1)
    _prepare(other, "other", tmp_path / "repo2", monkeypatch, external=True)
    # Other weights under the same graph file (its inline tensors, those under 1 KiB, stay).
    shutil.copy(tmp_path / "repo2" / "other" / "1" / "model.onnx.data", served / "1" / "model.onnx.data")
    want_other = _answer(model, TEXTS)
    assert np.abs(want_other - want).max() > 0.1
    assert np.abs(ov() - want_other).max() <= 1e-5


def test_optimize_refuses_external_data_by_name(repo, tmp_path):
    shutil.copytree(repo / "external", tmp_path / "external")
    with pytest.raises(OptimizeError) as err:
        optimize(tmp_path / "external", Options("int8"))
    msg = str(err.value)
    assert "model 'external' version 1: model.onnx keeps its weights in model.onnx.data" in msg
    assert "single-file models only" in msg
    assert sorted(p.name for p in (tmp_path / "external" / "1").iterdir()) == [
        "model.onnx",
        "model.onnx.data",
    ]


def _export_folder(repo: Path, folder: Path, dest: Path) -> Path:
    """An export as optimum writes one for a large model: ``onnx/model.onnx`` ending in
    sentence_embedding, its weights in ``onnx/model.onnx_data``, tokenizer and config beside."""
    model = onnx.load(str(repo / "single" / "1" / "model.onnx"))
    for node in model.graph.node:
        node.output[:] = ["sentence_embedding" if o == "embedding" else o for o in node.output]
        node.name = "sentence_embedding" if node.name == "embedding" else node.name
    model.graph.output[0].name = "sentence_embedding"
    (dest / "onnx").mkdir(parents=True)
    onnx.save_model(
        model, str(dest / "onnx" / "model.onnx"), save_as_external_data=True, location="model.onnx_data"
    )
    for f in ("config.json", "tokenizer.json"):
        shutil.copy(folder / f, dest / f)
    return dest


def test_an_export_with_external_data_is_carried_along(folder, repo, tmp_path, monkeypatch):
    export = _export_folder(repo, folder, tmp_path / "export")
    assert (export / "onnx" / "model.onnx_data").is_file()
    want = _answer(repo / "single" / "1" / "model.onnx", TEXTS)
    for external in (False, True):
        name = f"exported_{'ext' if external else 'one'}"
        _prepare(export, name, tmp_path / "repo", monkeypatch, external=external)
        files = sorted(p.name for p in (tmp_path / "repo" / name / "1").iterdir())
        assert files == (["model.onnx", "model.onnx.data"] if external else ["model.onnx"])
        assert np.abs(_answer(tmp_path / "repo" / name / "1" / "model.onnx", TEXTS) - want).max() <= SAME
    (export / "onnx" / "model.onnx_data").unlink()
    with pytest.raises(PrepareError, match=r"onnx/model.onnx: cannot read the export's weights"):
        _prepare(export, "broken", tmp_path / "repo", monkeypatch, external=False)


def test_served_external_model_answers_as_the_single_file_one(repo, tmp_path):
    """Both builds served by one real server on loopback; OpenAI, TEI and KServe gRPC routes."""
    import tritonclient.grpc as tc

    from tests.conftest import start_server

    served = tmp_path / "repo"
    for name in ("single", "external"):
        shutil.copytree(repo / name, served / name)
    srv = start_server(tmp_path, "--no-build-models", repo=served, ready_timeout=120)
    got = {}
    try:
        base = f"http://127.0.0.1:{srv.http_port}"
        client = tc.InferenceServerClient(srv.grpc_url)
        for name in ("single", "external"):
            body = {"model": name, "input": QUERIES, "prompt_name": "query"}
            oai = np.array([d["embedding"] for d in _post(base + "/v1/embeddings", body)["data"]], np.float32)
            tei = np.array(_post(base + "/embed", {"model": name, "inputs": DOCS}), np.float32)
            inp = tc.InferInput("text", [len(DOCS), 1], "BYTES")
            inp.set_data_from_numpy(np.array([d.encode() for d in DOCS], dtype=object).reshape(-1, 1))
            kserve = client.infer(name, [inp], client_timeout=60).as_numpy("embedding")
            got[name] = (oai, tei, kserve)
        client.close()
    finally:
        srv.stop()
    assert "external data; optimised models are not cached" in srv.log()
    for route, one, ext in zip(("openai", "tei", "kserve"), got["single"], got["external"], strict=True):
        assert one.shape == ext.shape and np.abs(one - ext).max() <= SAME, route
    assert np.abs(got["external"][2] - _answer(repo / "single" / "1" / "model.onnx", DOCS)).max() <= SAME
