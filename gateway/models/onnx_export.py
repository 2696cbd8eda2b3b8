"""An ONNX export of any architecture as a served text model: the route for an encoder the
weights builder (``encoder.py``) does not know, torch-free.

A folder (or Hub snapshot) carrying ``onnx/model.onnx`` (as many Hub repos ship it) or
``model.onnx`` (as ``optimum-cli export onnx`` writes it), its ``tokenizer.json`` and
sentence-transformers' configuration becomes a text model: the export's token states are pooled,
passed through the ``Dense`` modules and normalised as ``modules.json`` declares them, by nodes
appended to the export's own graph (``onnx.helper``; the export's nodes are not touched). The
outputs are found by name, not assumed: ``sentence_embedding`` (an export of the whole
sentence-transformers pipeline) is served as it is; otherwise ``last_hidden_state`` or
``token_embeddings``, or the one rank-3 float output. The served inputs are the graph's own:
the text stage feeds ``token_type_ids`` only to a graph that takes it, and a ``position_ids``
input is computed in the graph (0..seq-1, transformers' default) rather than fed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from batchgate.gateway.models.encoder import NORM_EPSILON, POOL_EPSILON, Head, add_dense
from batchgate.gateway.models.hf_model import (
    Log,
    VERSION,
    PrepareError,
    _embedding_head,
    _json,
    _max_tokens,
    _modules,
    render_config,
    text_settings,
)
from batchgate.gateway.models.onnx_graph import (
    PROTOBUF_LIMIT,
    GraphBuilder,
    model_bytes,
    write_atomic,
    write_model,
)

ONNX_FILES = ("onnx/model.onnx", "model.onnx")
EXPORT_HINT = "or provide an ONNX export (onnx/model.onnx)"
# What the text stage can feed (gateway/repository.py TOKEN_INPUTS).
TOKEN_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
# Not fed: computed in the graph as transformers computes it when a caller passes none.
POSITION_IDS = "position_ids"
STATE_OUTPUTS = ("last_hidden_state", "token_embeddings")
POOLED_OUTPUT = "sentence_embedding"
# Unsqueeze and ReduceSum take their axes as inputs from opset 13; older exports are rare.
MIN_OPSET = 13
# Families whose position ids start after padding_idx, so their table holds fewer tokens.
_OFFSET_POSITIONS = ("roberta", "xlm-roberta", "camembert", "mpnet", "longformer")
# Every name the head adds starts with this, so none can collide with the export's own.
P = "batchgate.head/"


def find_onnx(*folders: Path) -> Path | None:
    for folder in folders:
        for rel in ONNX_FILES:
            if (folder / rel).is_file():
                return folder / rel
    return None


@dataclass(frozen=True)
class ExportPlan:
    """What the folder and its export declare, read and checked before anything is built."""

    source: Path
    model_dir: Path
    onnx_file: Path
    tokenizer: Path
    architecture: str
    model_type: str
    head: Head
    hidden: int
    dim: int  # the served vector's length
    output: str  # the export's output the head reads (or serves, when pooled)
    pooled: bool  # the export already ends in sentence-transformers' pipeline
    inputs: tuple[str, ...]
    max_tokens: int
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    rerank = False

    @property
    def summary(self) -> str:
        where = (
            self.onnx_file.relative_to(self.model_dir)
            if self.onnx_file.is_relative_to(self.model_dir)
            else self.onnx_file.name
        )
        return f"ONNX export {where} of {self.architecture}, output {self.output}, hidden {self.hidden}"


def _dims(v: onnx.ValueInfoProto) -> list[int | str]:
    return [
        d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in v.type.tensor_type.shape.dim
    ]


def _opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def _locate(source: Path, model_dir: Path, onnx_file: Path | None) -> Path:
    if onnx_file is None:
        found = find_onnx(model_dir, source)
        if found is None:
            raise PrepareError(f"{model_dir}: no ONNX export (looked for {', '.join(ONNX_FILES)})")
        return found
    for path in (onnx_file,) if onnx_file.is_absolute() else (model_dir / onnx_file, source / onnx_file):
        if path.is_file():
            return path
    raise PrepareError(f"--onnx {onnx_file}: no such file in {model_dir}")


def _check_inputs(graph: onnx.GraphProto, where: Path) -> tuple[str, ...]:
    weights = {t.name for t in graph.initializer}
    inputs = [v for v in graph.input if v.name not in weights]
    names = tuple(v.name for v in inputs)
    fed = tuple(n for n in names if n != POSITION_IDS)
    if "input_ids" not in fed or "attention_mask" not in fed or any(n not in TOKEN_INPUTS for n in fed):
        # Without attention_mask the encoder would attend to the padding of a batch's shorter rows.
        raise PrepareError(
            f"{where}: inputs {list(names)}; supported: input_ids and attention_mask, optionally "
            f"token_type_ids and {POSITION_IDS} (re-export with these names)"
        )
    for v in inputs:
        kind = TensorProto.DataType.Name(v.type.tensor_type.elem_type)
        dims = _dims(v)
        if kind != "INT64" or len(dims) != 2 or any(isinstance(d, int) and d > 0 for d in dims):
            raise PrepareError(
                f"{where}: input {v.name} is {kind} {dims}; supported: INT64 [batch, sequence] with both "
                "dimensions dynamic (re-export with dynamic axes)"
            )
    return fed


def _find_output(graph: onnx.GraphProto, where: Path) -> tuple[onnx.ValueInfoProto, bool]:
    """(the output the head reads, whether it is already the pooled sentence embedding)."""
    outputs = {o.name: o for o in graph.output}
    if POOLED_OUTPUT in outputs:
        return outputs[POOLED_OUTPUT], True
    for name in STATE_OUTPUTS:
        if name in outputs:
            return outputs[name], False
    states = [o for o in graph.output if len(_dims(o)) == 3]
    if len(states) == 1:
        return states[0], False
    raise PrepareError(
        f"{where}: outputs {list(outputs)}; expected {POOLED_OUTPUT}, one of {', '.join(STATE_OUTPUTS)}, "
        "or a single [batch, sequence, hidden] output"
    )


def read_export(source: Path, *, onnx_file: Path | None = None, pooling: str | None = None,
                normalize: bool | None = None) -> ExportPlan:  # fmt: skip
    """Read and check the folder and its export; PrepareError (one line) on anything it would
    not serve as sentence-transformers would."""
    source = Path(source)
    if not source.is_dir():
        raise PrepareError(f"{source} is not a directory (expected a model folder with an ONNX export)")
    modules = _modules(source)
    model_dir = modules.transformer if modules else source
    path = _locate(source, model_dir, onnx_file)
    if not (model_dir / "tokenizer.json").is_file():
        raise PrepareError(f"{model_dir / 'tokenizer.json'} is missing")
    config = _json(model_dir / "config.json", required=False) or {}
    model_type = str(config.get("model_type", "")) or "unknown"
    archs = config.get("architectures") or []
    arch = str(archs[0]) if archs else f"model_type {model_type}"

    model = onnx.load(str(path), load_external_data=False)  # the graph's shape, not its weights
    if _opset(model) < MIN_OPSET:
        raise PrepareError(f"{path}: opset {_opset(model)}; supported: {MIN_OPSET} or later (re-export)")
    inputs = _check_inputs(model.graph, path)
    out, pooled = _find_output(model.graph, path)
    if TensorProto.DataType.Name(out.type.tensor_type.elem_type) not in ("FLOAT", "FLOAT16", "BFLOAT16"):
        raise PrepareError(f"{path}: output {out.name} is not a float tensor")

    # The token states' width: the state output's last dimension, else config.json's.
    states = {o.name: o for o in model.graph.output}.get("token_embeddings") if pooled else out
    last = _dims(states)[-1] if states is not None else None
    hidden = last if isinstance(last, int) and last > 0 else config.get("hidden_size")
    if not isinstance(hidden, int):
        raise PrepareError(
            f"{path}: the hidden size is neither in the graph nor in config.json (hidden_size)"
        )

    prompts, default_prompt = text_settings(source, model_dir)
    if pooled and (pooling is not None or normalize is not None):
        raise PrepareError(
            f"{path}: --pooling and --normalize cannot change an export that outputs {POOLED_OUTPUT}"
        )
    head = _embedding_head(source, modules, hidden, prompts, pooling, normalize)
    dim = head.dim(hidden)
    if pooled:
        got = _dims(out)[-1]
        if len(_dims(out)) != 2 or (isinstance(got, int) and got > 0 and got != dim):
            raise PrepareError(
                f"{path}: {POOLED_OUTPUT} is {_dims(out)}; the folder's modules make [batch, {dim}]"
            )

    positions = config.get("max_position_embeddings")
    limit = _NO_POSITIONS
    if isinstance(positions, int):
        offset = int(config.get("pad_token_id", 1)) + 1 if model_type in _OFFSET_POSITIONS else 0
        limit = positions - offset
    max_tokens = _max_tokens(config, model_dir, limit)
    if max_tokens >= _NO_POSITIONS:
        raise PrepareError(
            f"{model_dir}: no max length (sentence_bert_config.json max_seq_length, tokenizer_config.json "
            "model_max_length or config.json max_position_embeddings)"
        )
    _check_vocab(model_dir, config)
    return ExportPlan(
        source=source,
        model_dir=model_dir,
        onnx_file=path,
        tokenizer=model_dir / "tokenizer.json",
        architecture=arch,
        model_type=model_type,
        head=head,
        hidden=hidden,
        dim=dim,
        output=out.name,
        pooled=pooled,
        inputs=inputs,
        max_tokens=max_tokens,
        prompts=prompts,
        default_prompt_name=default_prompt,
    )


_NO_POSITIONS = 1 << 30


def _check_vocab(model_dir: Path, config: dict) -> None:
    from tokenizers import Tokenizer

    rows = config.get("vocab_size")
    tokens = Tokenizer.from_file(str(model_dir / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    if isinstance(rows, int) and tokens > rows:
        raise PrepareError(
            f"{model_dir / 'tokenizer.json'} has {tokens} tokens; config.json's vocab_size is {rows}"
        )


# --------------------------------------------------------------------------------------------
# the head, appended to the export's graph


class _Head(GraphBuilder):
    """Nodes at the export's opset: from 18 the Reduce ops all take axes as an input."""

    def __init__(self, opset: int) -> None:
        super().__init__()
        self.opset = opset

    def reduce(self, op: str, x: str, axes: list[int], output: str, keepdims: int) -> str:
        if op == "ReduceSum" or self.opset >= 18:
            axes_name = self.const(f"{output}.axes", np.array(axes, np.int64))
            return self.op(op, [x, axes_name], output, keepdims=keepdims)
        return self.op(op, [x], output, axes=axes, keepdims=keepdims)


def _pool(h: _Head, states: str, pooling: str) -> str:
    """sentence-transformers' Pooling over [batch, seq, hidden] -> [batch, hidden]; the same
    arithmetic as encoder.py's (whose node spelling is pinned for MiniLM's bytes)."""
    if pooling == "cls":
        first = h.const(f"{P}first", np.array(0, np.int64))
        return h.op("Gather", [states, first], f"{P}pooled", axis=1)
    mask = h.op("Cast", ["attention_mask"], f"{P}mask_f", to=TensorProto.FLOAT)
    axis2 = h.const(f"{P}axis2", np.array([2], np.int64))
    if pooling == "lasttoken":
        # The last position whose mask is 1, whichever side the padding is on.
        one = h.const(f"{P}one", np.array(1.0, np.float32))
        zero = h.const(f"{P}zero", np.array(0.0, np.float32))
        ones = h.op("Add", [h.op("Mul", [mask, zero], f"{P}zeros"), one], f"{P}ones")
        index = h.op("CumSum", [ones, h.const(f"{P}axis1", np.array(1, np.int64))], f"{P}index_plus1")
        rank = h.op("Mul", [index, mask], f"{P}rank")
        last = h.reduce("ReduceMax", rank, [1], f"{P}last_rank", keepdims=1)
        pick = h.op("Cast", [h.op("Equal", [rank, last], f"{P}is_last")], f"{P}pick", to=TensorProto.FLOAT)
        weights = h.op("Unsqueeze", [pick, axis2], f"{P}pick_3d")
        return h.reduce("ReduceSum", h.op("Mul", [states, weights], f"{P}picked"), [1], f"{P}pooled", 0)
    mask_3d = h.op("Unsqueeze", [mask, axis2], f"{P}mask_3d")
    total = h.reduce("ReduceSum", h.op("Mul", [states, mask_3d], f"{P}masked"), [1], f"{P}sum", 0)
    count = h.reduce("ReduceSum", mask, [1], f"{P}count", 1)
    eps = h.const(f"{P}pool_eps", np.array(POOL_EPSILON, np.float32))
    return h.op("Div", [total, h.op("Max", [count, eps], f"{P}count_clamped")], f"{P}pooled")


def _head_nodes(h: _Head, plan: ExportPlan, states: str) -> None:
    """Pooling, the Dense modules and Normalize after ``states``; the last node is ``embedding``."""
    if plan.pooled:
        h.op("Identity", [states], "embedding")
        return
    x = add_dense(h, _pool(h, states, plan.head.pooling), plan.head.dense, prefix=f"{P}dense")
    if plan.head.normalize:
        norm = h.reduce("ReduceL2", x, [1], f"{P}norm", keepdims=1)
        eps = h.const(f"{P}norm_eps", np.array(NORM_EPSILON, np.float32))
        h.op("Div", [x, h.op("Max", [norm, eps], f"{P}norm_clamped")], "embedding")
    else:
        h.op("Identity", [x], "embedding")


def _positions(graph: onnx.GraphProto) -> None:
    """position_ids computed in the graph, 0..seq-1 for every row: what transformers uses when
    a caller (sentence-transformers among them) passes none, whichever side the padding is on."""
    if not any(v.name == POSITION_IDS for v in graph.input):
        return
    h = GraphBuilder()
    shape = h.op("Shape", ["input_ids"], f"{P}ids_shape")
    seq = h.op("Gather", [shape, h.const(f"{P}one_i", np.array(1, np.int64))], f"{P}seq", axis=0)
    steps = h.op(
        "Range",
        [h.const(f"{P}zero_i", np.array(0, np.int64)), seq, h.const(f"{P}step", np.array(1, np.int64))],
        f"{P}steps",
    )
    row = h.op("Unsqueeze", [steps, h.const(f"{P}axis0", np.array([0], np.int64))], f"{P}row")
    h.op("Expand", [row, shape], POSITION_IDS)
    keep = [v for v in graph.input if v.name != POSITION_IDS]
    del graph.input[:]
    graph.input.extend(keep)
    # Topological order: the new nodes first, before anything reads position_ids.
    nodes = h.nodes + list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.extend(h.initializers)


def _used_in_subgraphs(node: onnx.NodeProto) -> set[str]:
    """Names an If/Loop/Scan body reads from the enclosing graph."""
    names: set[str] = set()
    for attr in node.attribute:
        for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
            for n in sub.node:
                names.update(n.input)
                names |= _used_in_subgraphs(n)
    return names


def _prune(graph: onnx.GraphProto) -> None:
    """Drop what no longer leads to the outputs (the export's other outputs, a pooler)."""
    needed = {o.name for o in graph.output}
    kept = []
    for node in reversed(graph.node):
        if any(o in needed for o in node.output):
            kept.append(node)
            needed.update(node.input)
            needed |= _used_in_subgraphs(node)
    kept.reverse()
    del graph.node[:]
    graph.node.extend(kept)
    for container in (graph.initializer, graph.value_info):
        keep = [t for t in container if t.name in needed]
        del container[:]
        container.extend(keep)
    # An input nothing reads is not fed (token_type_ids of a model that ignores it); input_ids stays.
    keep_in = [v for v in graph.input if v.name in needed or v.name == "input_ids"]
    del graph.input[:]
    graph.input.extend(keep_in)


def build_export(plan: ExportPlan, name: str) -> onnx.ModelProto:
    try:
        # The weights too, also those an export past 2 GiB keeps beside it (optimum writes
        # model.onnx_data); write_model stores them again, beside the served graph when large.
        model = onnx.load(str(plan.onnx_file))
    except (OSError, ValueError, onnx.checker.ValidationError) as exc:
        raise PrepareError(f"{plan.onnx_file}: cannot read the export's weights: {exc}") from None
    graph = model.graph
    taken = {v.name for v in (*graph.input, *graph.output, *graph.value_info, *graph.initializer)}
    taken |= {o for n in graph.node for o in n.output} | {n.name for n in graph.node}
    if "embedding" in taken or any(t.startswith(P) for t in taken):
        raise PrepareError(f"{plan.onnx_file}: already has a tensor or node named embedding or {P}*")
    h = _Head(_opset(model))
    (out,) = [o for o in graph.output if o.name == plan.output]
    states = out.name
    if out.type.tensor_type.elem_type != TensorProto.FLOAT:  # a half-precision export
        states = h.op("Cast", [states], f"{P}states_f", to=TensorProto.FLOAT)
    _head_nodes(h, plan, states)
    _positions(graph)
    graph.node.extend(h.nodes)
    graph.initializer.extend(h.initializers)
    del graph.output[:]
    graph.output.append(helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["batch", plan.dim]))
    _prune(graph)
    model.doc_string = (
        f"{plan.onnx_file.name} with batchgate's head ({P}*: pooling, Dense, Normalize) as {name}"
    )
    if model_bytes(model) < PROTOBUF_LIMIT:
        onnx.checker.check_model(model)  # else write_model checks the file it writes
    return model


def describe(plan: ExportPlan) -> str:
    """What the served model does, for the command's one line."""
    dense = f", {len(plan.head.dense)} Dense" if plan.head.dense else ""
    norm = ", normalised" if plan.head.normalize else ""
    prompts = f", prompts {sorted(plan.prompts)}" if plan.prompts else ""
    return f"embedding, {plan.head.pooling} pooling{dense}{norm}, {plan.dim} dims, max {plan.max_tokens} tokens{prompts}"


def prepare_export(source: Path, name: str, repo: Path, *, onnx_file: Path | None = None,
                   pooling: str | None = None, normalize: bool | None = None, log: Log = print,
                   t0: float | None = None) -> Path:  # fmt: skip
    t0 = time.monotonic() if t0 is None else t0
    plan = read_export(source, onnx_file=onnx_file, pooling=pooling, normalize=normalize)
    model = build_export(plan, name)
    out = Path(repo) / name
    write_model(out / VERSION / "model.onnx", model)
    write_atomic(out / "tokenizer.json", plan.tokenizer.read_bytes())
    # Config last, so a repository scan never finds a config whose other files are missing.
    write_atomic(out / "config.pbtxt", render_config(name, plan).encode())
    log(
        f"{name}: wrote {out} from {plan.onnx_file} ({plan.architecture}, ONNX export, {describe(plan)}) "
        f"in {time.monotonic() - t0:.1f}s"
    )
    return out
