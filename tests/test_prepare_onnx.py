"""``batchgate prepare-model`` on an ONNX export, and sentence-transformers' Dense modules.

Architectures the weights builder does not know (ELECTRA: its embeddings are projected from 16
to the hidden 32, which encoder.py does not build; ALBERT; DeBERTa-v2) are exported with ``torch.onnx.export``
from a transformers model with scrambled weights, into folders laid out as Hub repos and
``optimum-cli`` ship them, with a ``tokenizers`` WordPiece tokenizer and sentence-transformers'
files written here. The prepared models are served by a real server and compared with
transformers' own ``last_hidden_state`` pooled, passed through the Dense modules (torch Linear
and activation) and normalised as sentence-transformers does: cosine >= 0.999999 per row on a
padded batch of mixed lengths. The weights route (BERT) is checked with Dense modules the same
way. Those are the reference tests (they skip without torch and transformers).

Everything else (the served config follows the graph, --from-onnx and --onnx choose the export,
the head's arithmetic, the refusals) runs without torch, on the same folders with an export that
numpy writes (``electra_export``): ELECTRA's own forward pass spelled with ``onnx.helper`` from
the weights of its transformers layout (``onnx_electra``), with the input and output names,
dynamic axes and opset that ``torch.onnx.export`` gives the same model. Refusals: an architecture
neither route covers names the ONNX way forward; a Dense module's pytorch_model.bin is refused by
name; Dense modules that do not chain; an export without attention_mask.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import tritonclient.grpc as tc
from onnx import TensorProto, helper, numpy_helper
from safetensors.numpy import load_file, save_file
from tokenizers import Tokenizer

from batchgate.gateway.models.hf_model import PrepareError
from batchgate.gateway.models.prepare import prepare_model
from batchgate.gateway.models.onnx_export import P, find_onnx, read_export
from batchgate.gateway.repository import load_model
from batchgate.gateway.text import TextStage
from tests.layouts import layout, save_torch_file, scrambled, write_folder
from tests.test_prepare_model import (
    MIN_COSINE,
    ST,
    TEXTS,
    TINY,
    cosines,
    prepare_cli,
    scramble,
    served_client,
    st_folder,
    st_pool,
    wordpiece,
)
from tests.tiny_models import TransformersModel, transformers_folder

ELECTRA = dict(TINY, embedding_size=16, max_position_embeddings=64)
# Two Dense modules chained, as modules.json orders them: 32 -> 24 (tanh) -> 16 (no bias).
DENSE = [(32, 24, "Tanh", True), (24, 16, "Identity", False)]
ACT = {"Tanh": "torch.nn.modules.activation.Tanh", "Identity": "torch.nn.modules.linear.Identity"}


def add_dense(folder: Path, layers=DENSE, normalize: bool = True, seed: int = 1) -> list:
    """Dense folders (config.json + model.safetensors, scrambled) after the Pooling module;
    returns [(weight, bias, activation)] for the reference."""
    rng = np.random.default_rng(seed)
    modules = [
        m for m in json.loads((folder / "modules.json").read_text()) if not m["type"].endswith("Normalize")
    ]
    made = []
    for i, (fan_in, fan_out, act, bias) in enumerate(layers):
        d = folder / f"{2 + i}_Dense"
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"in_features": fan_in, "out_features": fan_out, "bias": bias,
                                                   "activation_function": ACT[act]}))  # fmt: skip
        w = rng.normal(0, 0.3, (fan_out, fan_in)).astype(np.float32)
        b = rng.normal(0, 0.3, fan_out).astype(np.float32) if bias else None
        save_file({"linear.weight": w, **({"linear.bias": b} if bias else {})}, str(d / "model.safetensors"))
        modules.append({"idx": len(modules), "name": str(len(modules)), "path": d.name, "type": ST + "Dense"})
        made.append((w, b, act))
    if normalize:
        modules.append(
            {"idx": len(modules), "name": str(len(modules)), "path": "9_Normalize", "type": ST + "Normalize"}
        )
    (folder / "modules.json").write_text(json.dumps(modules))
    return made


def reference(
    model, tok_path: Path, max_tokens: int, pooling: str, dense: list, normalize: bool
) -> np.ndarray:
    """transformers' last_hidden_state for TEXTS in one padded batch, pooled, through the Dense
    layers and normalised as sentence-transformers does (torch for all of it)."""
    import torch

    tok = Tokenizer.from_file(str(tok_path))
    tok.enable_padding(pad_id=tok.token_to_id("[PAD]"), pad_token="[PAD]")
    tok.enable_truncation(max_tokens)
    enc = tok.encode_batch(TEXTS)
    ids = torch.tensor([e.ids for e in enc])
    mask = torch.tensor([e.attention_mask for e in enc])
    with torch.no_grad():
        states = model(input_ids=ids, attention_mask=mask).last_hidden_state
        x = st_pool(states, mask, pooling, normalize=False)  # the Dense modules come between
        for w, b, act in dense:
            x = torch.nn.functional.linear(x, torch.from_numpy(w), None if b is None else torch.from_numpy(b))
            x = torch.tanh(x) if act == "Tanh" else x
        if normalize:
            x = torch.nn.functional.normalize(x, p=2, dim=1)
    assert mask.min() == 0  # mixed lengths: the batch was padded
    return x.numpy()


class _Wrap:
    """torch.onnx.export traces a module's positional forward; transformers 5's forward takes
    other arguments in those positions, so the export goes through a wrapper."""

    @staticmethod
    def make(model, inputs: tuple[str, ...], pooled: str | None = None):
        import torch

        class Wrap(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.model = model

            def forward(self, *args):
                states = self.model(**dict(zip(inputs, args))).last_hidden_state
                if pooled is None:
                    return states
                # sentence-transformers' own export: the whole pipeline (CLS + Normalize here).
                return states, torch.nn.functional.normalize(states[:, 0], p=2, dim=1)

        return Wrap().eval()


def export(model, path: Path, inputs: tuple[str, ...], outputs: tuple[str, ...], opset: int = 17) -> None:
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    ids = torch.tensor([[2, 5, 6, 3, 0], [2, 7, 3, 0, 0]])
    feeds = {"input_ids": ids, "attention_mask": (ids != 0).long(), "token_type_ids": torch.zeros_like(ids),
             "position_ids": torch.arange(ids.shape[1]).expand(ids.shape)}  # fmt: skip
    axes = {n: {0: "batch", 1: "seq"} for n in inputs} | {outputs[0]: {0: "batch", 1: "seq"}}
    if len(outputs) > 1:
        axes[outputs[1]] = {0: "batch"}
    torch.onnx.export(
        _Wrap.make(model, inputs, pooled=outputs[1] if len(outputs) > 1 else None),
        tuple(feeds[n] for n in inputs),
        str(path),
        input_names=list(inputs),
        output_names=list(outputs),
        dynamic_axes=axes,
        opset_version=opset,
        dynamo=False,
    )


# -- the export without torch ------------------------------------------------------------------------


def _electra_model():
    """The ELECTRA of these tests, untrained (``python -m tests.layouts`` records its layout)."""
    import transformers

    model = transformers.ElectraModel(
        transformers.ElectraConfig(**ELECTRA, vocab_size=wordpiece().get_vocab_size())
    )
    model.config.architectures = ["ElectraModel"]  # as save_pretrained records it
    return model


LAYOUTS = {"onnx_electra": _electra_model}
# torch.onnx.export names a pipeline export's pooled width after the node that made it.
POOLED_DIM = "Divsentence_embedding_dim_1"


def electra_export(path: Path, inputs: tuple[str, ...], outputs: tuple[str, ...], opset: int = 17,
                   seed: int = 0) -> None:  # fmt: skip
    """What ``export`` writes for the ELECTRA of ``onnx_electra``, written without torch: the
    same input names (INT64 [batch, seq]), output names ([batch, seq, hidden]; a second output is
    sentence-transformers' CLS + Normalize, [batch, dim]), dynamic axes and opset, and ELECTRA's
    forward pass (embeddings at embedding_size, LayerNorm, projected to the hidden size, post-norm
    attention layers masked by attention_mask, GELU) in ``onnx.helper`` nodes over every tensor of
    the layout, scrambled by numpy. An input it does not take is transformers' default (positions
    0..seq-1, token type 0, no mask)."""
    lay = layout("onnx_electra")
    c = lay["config"]
    weights = scrambled({n: t["shape"] for n, t in lay["tensors"].items() if "values" not in t}, seed)
    hidden, heads, eps = c["hidden_size"], c["num_attention_heads"], c["layer_norm_eps"]
    nodes: list[onnx.NodeProto] = []
    inits: dict[str, np.ndarray] = {}

    def const(value, dtype=np.float32) -> str:
        name = f"c{len(inits)}"
        inits[name] = np.asarray(value, dtype)
        return name

    def op(op_type: str, *args: str, **attrs) -> str:
        out = f"{op_type.lower()}_{len(nodes)}"
        nodes.append(helper.make_node(op_type, list(args), [out], name=out, **attrs))
        return out

    def weight(name: str, transpose: bool = False) -> str:
        inits[name] = weights.pop(name).T.copy() if transpose else weights.pop(name)
        return name

    def linear(x: str, name: str) -> str:
        return op("Add", op("MatMul", x, weight(f"{name}.weight", transpose=True)), weight(f"{name}.bias"))

    def norm(x: str, name: str) -> str:
        return op(
            "LayerNormalization", x, weight(f"{name}.weight"), weight(f"{name}.bias"), axis=-1, epsilon=eps
        )

    def embed(table: str, ids: str) -> str:
        return op("Gather", weight(f"embeddings.{table}.weight"), ids)

    x = embed("word_embeddings", "input_ids")
    if "position_ids" in inputs:
        positions = "position_ids"
    else:
        seq = op("Gather", op("Shape", "input_ids"), const(1, np.int64), axis=0)
        positions = op("Range", const(0, np.int64), seq, const(1, np.int64))
    x = op("Add", x, embed("position_embeddings", positions))
    types = "token_type_ids" if "token_type_ids" in inputs else const(0, np.int64)
    x = op("Add", x, embed("token_type_embeddings", types))
    x = linear(norm(x, "embeddings.LayerNorm"), "embeddings_project")
    mask = None
    if "attention_mask" in inputs:  # 0 where attended, float32's lowest on padding
        keep = op("Cast", "attention_mask", to=TensorProto.FLOAT)
        low = op("Mul", op("Sub", const(1.0), keep), const(np.finfo(np.float32).min))
        mask = op("Unsqueeze", low, const([1, 2], np.int64))  # [batch, 1, 1, seq]
    split = const([0, 0, heads, hidden // heads], np.int64)
    for i in range(c["num_hidden_layers"]):
        p = f"encoder.layer.{i}."
        q, k, v = (
            op("Reshape", linear(x, f"{p}attention.self.{n}"), split) for n in ("query", "key", "value")
        )  # [batch, seq, heads, head size]
        scores = op("MatMul", op("Transpose", q, perm=[0, 2, 1, 3]), op("Transpose", k, perm=[0, 2, 3, 1]))
        scores = op("Mul", scores, const(1 / np.sqrt(hidden // heads)))
        probs = op("Softmax", op("Add", scores, mask) if mask else scores, axis=-1)
        ctx = op("Transpose", op("MatMul", probs, op("Transpose", v, perm=[0, 2, 1, 3])), perm=[0, 2, 1, 3])
        ctx = op("Reshape", ctx, const([0, 0, hidden], np.int64))
        x = norm(op("Add", linear(ctx, f"{p}attention.output.dense"), x), f"{p}attention.output.LayerNorm")
        h = linear(x, f"{p}intermediate.dense")
        gelu = op(
            "Mul", op("Mul", h, const(0.5)), op("Add", op("Erf", op("Div", h, const(np.sqrt(2)))), const(1.0))
        )
        x = norm(op("Add", linear(gelu, f"{p}output.dense"), x), f"{p}output.LayerNorm")
    assert not weights, f"the layout's tensors the graph left out: {sorted(weights)}"
    nodes.append(helper.make_node("Identity", [x], [outputs[0]], name=outputs[0]))
    graph_outputs = [helper.make_tensor_value_info(outputs[0], TensorProto.FLOAT, ["batch", "seq", hidden])]
    if len(outputs) > 1:  # CLS, then x / max(|x|, 1e-12) as torch.nn.functional.normalize
        cls = op("Gather", x, const(0, np.int64), axis=1)
        size = op("Sqrt", op("ReduceSum", op("Mul", cls, cls), const([1], np.int64), keepdims=1))
        nodes.append(
            helper.make_node("Div", [cls, op("Max", size, const(1e-12))], [outputs[1]], name=outputs[1])
        )
        graph_outputs.append(
            helper.make_tensor_value_info(outputs[1], TensorProto.FLOAT, ["batch", POOLED_DIM])
        )
    graph = helper.make_graph(
        nodes,
        "main_graph",
        [helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "seq"]) for n in inputs],
        graph_outputs,
        [numpy_helper.from_array(a, n) for n, a in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


Export = Callable[..., None]  # (path, inputs, outputs, opset=17)


def electra_folders(root: Path, write_config: Callable[[Path], None], export_to: Export) -> dict:
    """The ELECTRA folders, each with its export made by ``export_to``: name -> (folder,
    pooling, dense layers, normalize)."""
    wp = wordpiece()
    out = {}

    def folder(name: str) -> Path:
        d = root / name
        d.mkdir()
        write_config(d)  # config.json only: the route needs no weights file
        wp.save(str(d / "tokenizer.json"))
        return d

    # The Hub layout: onnx/model.onnx, three inputs, last_hidden_state; mean, two Dense, Normalize.
    d = folder("electra_dense")
    export_to(
        d / "onnx" / "model.onnx",
        ("input_ids", "attention_mask", "token_type_ids"),
        ("last_hidden_state",),
    )
    st_folder(d, "mean", True)
    out["electra_dense"] = (d, "mean", add_dense(d), True)
    # optimum's layout: model.onnx at the top, no token_type_ids, an output of another name, no
    # modules.json (mean pooling and unit vectors, as for a plain folder).
    d = folder("electra_plain")
    export_to(d / "model.onnx", ("input_ids", "attention_mask"), ("hidden",))
    out["electra_plain"] = (d, "mean", [], True)
    # position_ids as an input (decoder-style exports take it): computed in the graph, not fed.
    d = folder("electra_pos")
    export_to(
        d / "onnx" / "model.onnx",
        ("input_ids", "attention_mask", "position_ids"),
        ("last_hidden_state",),
    )
    st_folder(d, "mean", False)
    out["electra_pos"] = (d, "mean", [], False)
    # Opset 18 (ReduceMax takes its axes as an input there) and last-token pooling, not normalised.
    d = folder("electra_last")
    export_to(d / "onnx" / "model.onnx", ("input_ids", "attention_mask"), ("last_hidden_state",), opset=18)
    st_folder(d, "lasttoken", False)
    out["electra_last"] = (d, "lasttoken", [], False)
    # An export of the whole pipeline: its sentence_embedding is served as it is.
    d = folder("electra_st")
    export_to(
        d / "onnx" / "model.onnx",
        ("input_ids", "attention_mask"),
        ("token_embeddings", "sentence_embedding"),
    )
    st_folder(d, "cls", True)
    out["electra_st"] = (d, "cls", [], True)
    return out


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """The ELECTRA folders with the export numpy writes (``electra_export``): no torch."""
    config = layout("onnx_electra")["config"]
    return electra_folders(
        tmp_path_factory.mktemp("onnx-numpy"),
        lambda d: (d / "config.json").write_text(json.dumps(config, indent=2)),
        electra_export,
    )


@pytest.fixture(scope="module")
def electra(tmp_path_factory):
    """The reference: the same folders exported from transformers' model by torch.onnx, and two
    more architectures; name -> (folder, the transformers model, pooling, dense layers, normalize)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("onnx-folders")
    wp = wordpiece()
    model = _electra_model()
    scramble(model)
    model.eval()
    made = electra_folders(
        root,
        model.config.save_pretrained,
        lambda path, inputs, outputs, opset=17: export(model, path, inputs, outputs, opset),
    )
    out = {name: (d, model, *rest) for name, (d, *rest) in made.items()}
    # Two more architectures the builder does not know: ALBERT (one layer's weights shared by
    # all, factorised embeddings) and DeBERTa-v2 (relative-position attention), CLS-pooled.
    for name, cls, config in (
        ("albert_cls", transformers.AlbertModel, transformers.AlbertConfig(**TINY, embedding_size=16)),
        (
            "deberta_cls",
            transformers.DebertaV2Model,
            transformers.DebertaV2Config(**TINY, max_position_embeddings=64),
        ),
    ):
        config.vocab_size = wp.get_vocab_size()
        other = cls(config)
        scramble(other)
        other.eval().config.architectures = [cls.__name__]
        d = root / name
        d.mkdir()
        other.config.save_pretrained(d)
        wp.save(str(d / "tokenizer.json"))
        export(
            other,
            d / "onnx" / "model.onnx",
            ("input_ids", "attention_mask", "token_type_ids"),
            ("last_hidden_state",),
        )
        st_folder(d, "cls", True)
        out[name] = (d, other, "cls", [], True)
    return out


@pytest.fixture(scope="module")
def bert_dense(tmp_path_factory):
    """The weights route with Dense modules: a BERT folder (written by numpy in transformers'
    layout), CLS pooling, two Dense, Normalize."""
    wp = wordpiece()
    config = dict(TINY, vocab_size=wp.get_vocab_size(), max_position_embeddings=64)
    d = transformers_folder(
        tmp_path_factory.mktemp("bert-dense") / "bert_dense", "BertModel", config, wp, seed=0
    )
    st_folder(d, "cls", True)
    return d, TransformersModel(d), "cls", add_dense(d, seed=2), True


@pytest.fixture(scope="module")
def repo(exports, bert_dense, tmp_path_factory):
    """The numpy exports and bert_dense prepared; electra_dense through the command line, with the
    route chosen by itself (ELECTRA is unknown to the builder)."""
    repo = tmp_path_factory.mktemp("onnx-repo")
    proc = prepare_cli(
        str(exports["electra_dense"][0]), "--name", "electra_dense", "--model-repository", str(repo)
    )
    assert proc.returncode == 0, proc.stderr
    assert "ONNX export, embedding, mean pooling, 2 Dense, normalised, 16 dims" in proc.stdout, proc.stdout
    for name, (folder, *_rest) in exports.items():
        if name != "electra_dense":
            prepare_model(folder, name, repo, log=print)
    prepare_model(bert_dense[0], "bert_dense", repo, log=print)
    return repo


@pytest.fixture(scope="module")
def reference_repo(electra, bert_dense, tmp_path_factory):
    """The torch.onnx exports and bert_dense prepared, for the reference tests."""
    repo = tmp_path_factory.mktemp("onnx-reference-repo")
    for name, (folder, *_rest) in electra.items():
        prepare_model(folder, name, repo, log=print)
    prepare_model(bert_dense[0], "bert_dense", repo, log=print)
    return repo


def _cases(electra, bert_dense) -> dict:
    return {**electra, "bert_dense": bert_dense}


def _spec(model_dir: Path):
    (spec,) = load_model(model_dir)
    return spec


@pytest.mark.parametrize(
    "name",
    [
        "electra_dense",
        "electra_plain",
        "electra_pos",
        "electra_last",
        "electra_st",
        "albert_cls",
        "deberta_cls",
        "bert_dense",
    ],
)
def test_graph_matches_transformers(name, electra, bert_dense, reference_repo):
    folder, model, pooling, dense, normalize = _cases(electra, bert_dense)[name]
    spec = _spec(reference_repo / name)
    expected = reference(model, folder / "tokenizer.json", spec.params.max_tokens, pooling, dense, normalize)
    feeds = TextStage(spec)({"text": np.array(TEXTS, dtype=object)})
    sess = ort.InferenceSession(
        str(reference_repo / name / "1" / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    assert {i.name for i in sess.get_inputs()} == set(feeds)  # the graph's inputs are what is fed
    got = sess.run(None, feeds)[0]
    cos = cosines(got, expected)
    print(f"{name}: min cosine {cos.min():.8f}, dims {got.shape[1]}")
    assert got.shape == expected.shape and cos.min() >= MIN_COSINE, cos
    if normalize:
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def _np_head(states: np.ndarray, mask: np.ndarray, pooling: str, dense: list, normalize: bool) -> np.ndarray:
    """sentence-transformers' Pooling, Dense and Normalize in numpy."""
    if pooling == "cls":
        x = states[:, 0]
    elif pooling == "lasttoken":
        last = mask.shape[1] - 1 - np.argmax(mask[:, ::-1], axis=1)
        x = states[np.arange(len(states)), last]
    else:
        m = mask[..., None].astype(np.float32)
        x = (states * m).sum(1) / np.maximum(m.sum(1), 1e-9)
    for w, b, act in dense:
        x = x @ w.T + (0 if b is None else b)
        x = np.tanh(x) if act == "Tanh" else x
    if normalize:
        x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
    return x


@pytest.mark.parametrize(
    "name", ["electra_dense", "electra_plain", "electra_pos", "electra_last", "electra_st"]
)
def test_head_on_the_export_matches_numpy(name, exports, repo):
    """The served graph is the export's own, then the head: its output is the export's run by
    onnxruntime on the same feeds, pooled, through the Dense modules and normalised in numpy."""
    folder, pooling, dense, normalize = exports[name]
    spec = _spec(repo / name)
    feeds = TextStage(spec)({"text": np.array(TEXTS, dtype=object)})
    mask = feeds["attention_mask"]
    assert mask.min() == 0  # mixed lengths: the batch was padded
    sess = ort.InferenceSession(str(repo / name / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    assert {i.name for i in sess.get_inputs()} == set(feeds)
    got = sess.run(None, feeds)[0]
    source = ort.InferenceSession(str(find_onnx(folder)), providers=["CPUExecutionProvider"])
    names = [i.name for i in source.get_inputs()]
    positions = np.broadcast_to(np.arange(mask.shape[1], dtype=np.int64), mask.shape)
    source_feeds = {n: positions if n == "position_ids" else feeds[n] for n in names}
    if name == "electra_st":
        expected = source.run(["sentence_embedding"], source_feeds)[0]
    else:
        states = source.run([source.get_outputs()[0].name], source_feeds)[0]
        expected = _np_head(states, mask, pooling, dense, normalize)
    cos = cosines(got, expected)
    assert got.shape == expected.shape and cos.min() >= MIN_COSINE, cos
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_config_follows_the_graph(repo):
    dense = _spec(repo / "electra_dense")
    assert [(o.name, list(o.dims)) for o in dense.outputs] == [("embedding", [16])]  # the last Dense
    assert set(dense.model_inputs) == {"input_ids", "attention_mask", "token_type_ids"}
    assert (dense.params.pooling, dense.params.normalize, dense.params.max_tokens) == ("mean", True, 64)
    assert set(_spec(repo / "electra_plain").model_inputs) == {"input_ids", "attention_mask"}
    assert set(_spec(repo / "electra_pos").model_inputs) == {"input_ids", "attention_mask"}
    assert [list(o.dims) for o in _spec(repo / "bert_dense").outputs] == [[16]]
    # The pipeline export is served as it is: nothing of batchgate's but the renaming Identity.
    graph = onnx.load(str(repo / "electra_st" / "1" / "model.onnx")).graph
    assert not [n for n in graph.node if n.name.startswith(P)]
    assert [o.name for o in graph.output] == ["embedding"]
    # The other outputs' nodes are pruned: the head's output is the only one.
    graph = onnx.load(str(repo / "electra_dense" / "1" / "model.onnx")).graph
    assert [o.name for o in graph.output] == ["embedding"]


@pytest.fixture(scope="module")
def client(reference_repo, tmp_path_factory):
    with served_client(reference_repo, tmp_path_factory.mktemp("onnx-server")) as c:
        yield c


@pytest.mark.parametrize("name", ["electra_dense", "electra_plain", "deberta_cls", "bert_dense"])
def test_served_embeddings_match_transformers(name, electra, bert_dense, reference_repo, client):
    folder, model, pooling, dense, normalize = _cases(electra, bert_dense)[name]
    inp = tc.InferInput("text", [len(TEXTS), 1], "BYTES")
    inp.set_data_from_numpy(np.array([t.encode() for t in TEXTS], dtype=object).reshape(-1, 1))
    got = client.infer(name, [inp], client_timeout=60).as_numpy("embedding")
    max_tokens = _spec(reference_repo / name).params.max_tokens
    cos = cosines(got, reference(model, folder / "tokenizer.json", max_tokens, pooling, dense, normalize))
    print(f"{name} served: min cosine {cos.min():.8f}, dims {got.shape[1]}")
    assert cos.min() >= MIN_COSINE, cos


# -- choosing the route, and refusals ---------------------------------------------------------------


def test_from_onnx_forces_the_export_of_a_known_architecture(exports, bert_dense, tmp_path):
    """A BERT folder that also ships an export: the weights are built unless --from-onnx."""
    folder = tmp_path / "both"
    shutil.copytree(bert_dense[0], folder)
    (folder / "onnx").mkdir()
    shutil.copy(exports["electra_plain"][0] / "model.onnx", folder / "onnx" / "model.onnx")
    lines: list[str] = []
    prepare_model(folder, "built", tmp_path / "repo", log=lines.append)
    assert "ONNX export" not in lines[-1] and "(BertModel," in lines[-1]
    prepare_model(folder, "exported", tmp_path / "repo", from_onnx=True, log=lines.append)
    assert "ONNX export" in lines[-1]
    graph = onnx.load(str(tmp_path / "repo" / "exported" / "1" / "model.onnx")).graph
    assert any(n.name.startswith(P) for n in graph.node)


def test_onnx_path_names_the_export_to_serve(exports, tmp_path):
    """--onnx PATH (relative to the model folder) over the folder's own onnx/model.onnx."""
    folder = tmp_path / "two-exports"
    shutil.copytree(exports["electra_dense"][0], folder)
    (folder / "exports").mkdir()
    shutil.copy(exports["electra_last"][0] / "onnx" / "model.onnx", folder / "exports" / "last.onnx")

    def cli(*extra: str) -> subprocess.CompletedProcess:
        return prepare_cli(str(folder), "--name", "x", "--model-repository", str(tmp_path / "repo"), *extra)

    proc = cli("--onnx", "exports/last.onnx")
    assert proc.returncode == 0, proc.stderr
    assert f"from {folder / 'exports' / 'last.onnx'} " in proc.stdout
    # The named export takes no token_type_ids; the folder's own does.
    assert set(_spec(tmp_path / "repo" / "x").model_inputs) == {"input_ids", "attention_mask"}
    proc = cli("--onnx", "exports/missing.onnx")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "--onnx exports/missing.onnx: no such file" in proc.stderr


def test_an_architecture_neither_route_covers_names_the_onnx_way(exports, tmp_path):
    folder = tmp_path / "no-export"
    shutil.copytree(exports["electra_plain"][0], folder)
    (folder / "model.onnx").unlink()
    proc = prepare_cli(str(folder), "--name", "x", "--model-repository", str(tmp_path / "repo"))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "unsupported architecture ElectraModel (model_type 'electra')" in proc.stderr
    assert "or provide an ONNX export (onnx/model.onnx)" in proc.stderr


def test_dense_weights_in_pytorch_bin_are_read_without_torch(bert_dense, repo, tmp_path):
    """Older sentence-transformers saved Dense with torch.save (LaBSE, distiluse-*): the same
    weights read from pytorch_model.bin build the same graph, byte for byte; a file that is not
    a torch.save zip archive is refused naming it."""
    folder = tmp_path / "bin"
    shutil.copytree(bert_dense[0], folder)
    dense = folder / "2_Dense"
    save_torch_file(dense / "pytorch_model.bin", load_file(str(dense / "model.safetensors")))
    (dense / "model.safetensors").unlink()
    prepare_model(folder, "bert_dense", tmp_path / "repo", log=print)
    built = (tmp_path / "repo" / "bert_dense" / "1" / "model.onnx").read_bytes()
    assert built == (repo / "bert_dense" / "1" / "model.onnx").read_bytes()
    (dense / "pytorch_model.bin").write_bytes(b"\x80\x02legacy torch.save, before torch 1.6")
    with pytest.raises(PrepareError, match=r"2_Dense/pytorch_model.bin is not a torch.save zip archive"):
        prepare_model(folder, "x", tmp_path / "repo2", log=print)
    (dense / "pytorch_model.bin").unlink()
    with pytest.raises(PrepareError, match=r"2_Dense/model.safetensors is missing"):
        prepare_model(folder, "x", tmp_path / "repo3", log=print)
    # a Hub download fetches a Dense module's pytorch_model.bin, and not the model's own
    from fnmatch import fnmatch

    from batchgate.gateway.models.sources import ALLOW_PATTERNS

    assert any(fnmatch("2_Dense/pytorch_model.bin", p) for p in ALLOW_PATTERNS)
    assert not any(fnmatch("pytorch_model.bin", p) for p in ALLOW_PATTERNS)


def test_dense_that_does_not_chain_is_refused(bert_dense, tmp_path):
    folder = tmp_path / "chain"
    shutil.copytree(bert_dense[0], folder)
    cfg = json.loads((folder / "3_Dense" / "config.json").read_text())
    (folder / "3_Dense" / "config.json").write_text(json.dumps({**cfg, "in_features": 32}))
    with pytest.raises(
        PrepareError, match="3_Dense/config.json: in_features 32; the vector before it has 24"
    ):
        prepare_model(folder, "x", tmp_path / "repo", log=print)


def test_an_export_without_attention_mask_is_refused(exports, tmp_path):
    folder = tmp_path / "ids-only"
    shutil.copytree(exports["electra_plain"][0], folder)
    electra_export(folder / "model.onnx", ("input_ids",), ("hidden",))
    with pytest.raises(
        PrepareError, match=r"model.onnx: inputs \['input_ids'\]; supported: input_ids and attention_mask"
    ):
        read_export(folder)


def test_the_numpy_export_is_transformers_electra(exports, tmp_path):
    """The export the tests above prepare without torch is ELECTRA's forward pass: given the
    layout's weights (drawn from the same seed), transformers gives the same last_hidden_state on
    a padded batch, and the pipeline export's sentence_embedding is its CLS row normalised."""
    torch = pytest.importorskip("torch")
    model = TransformersModel(write_folder(tmp_path / "electra", "onnx_electra", seed=0))
    ids = np.array([[2, 5, 6, 7, 3, 0, 0], [2, 7, 8, 9, 10, 11, 3]])
    feeds = {"input_ids": ids, "attention_mask": (ids != 0).astype(np.int64), "token_type_ids": (ids > 8) * 1}
    with torch.no_grad():  # every tensor of the folder read, none left over (TransformersModel)
        expected = model(**{n: torch.from_numpy(a) for n, a in feeds.items()}).last_hidden_state.numpy()
    kept = feeds["attention_mask"][..., None] == 1  # the padding's states are not compared
    (states,) = ort.InferenceSession(str(find_onnx(exports["electra_dense"][0]))).run(None, feeds)
    np.testing.assert_allclose(np.where(kept, states, 0), np.where(kept, expected, 0), atol=1e-4)
    del feeds["token_type_ids"]
    expected = model(**{n: torch.from_numpy(a) for n, a in feeds.items()}).last_hidden_state.detach().numpy()
    _, pooled = ort.InferenceSession(str(find_onnx(exports["electra_st"][0]))).run(None, feeds)
    cls = expected[:, 0]
    np.testing.assert_allclose(pooled, cls / np.linalg.norm(cls, axis=1, keepdims=True), atol=1e-5)
