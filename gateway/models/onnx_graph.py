"""The ONNX graph builder shared by the bundled models and MiniLM: nodes and initializers
accumulated by name, the finished model at batchgate's pinned opset and IR version, an atomic
file write, and the two pieces of transformer arithmetic both graphs spell out (erf GELU and the
attention core).

Both callers' graphs must stay byte-identical to the files already built (the committed
``ranker`` and ``encoder``, and MiniLM's deterministic build), so where the two spell the same
arithmetic differently (GELU's constants and the order of its products; the score scale applied
in the graph or folded into the query weights) the difference is an argument here, not a second
copy of the function.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import set_external_data, write_external_data_tensors

# Pinned rather than taken from the installed onnx, whose defaults move between releases and
# would change the bytes (and could exceed what the deployed onnxruntime accepts).
OPSET = 17
IR_VERSION = 9
PRODUCER = "batchgate.bundled_models"  # written into the files: part of their bytes
# One protobuf message cannot pass 2 GiB, so a model past it keeps its weights in a second file.
PROTOBUF_LIMIT = 2**31
EXTERNAL_BYTES_ENV = "BATCHGATE_ONNX_EXTERNAL_BYTES"
# A little under the limit: serialising a message near it already fails.
DEFAULT_EXTERNAL_BYTES = 2**31 - 64 * 2**20
# Every tensor past this size goes to the data file; smaller ones (shapes, scalars) stay inline.
_EXTERNAL_TENSOR_BYTES = 1024


class GraphBuilder:
    """Accumulates nodes and initializers; names are prefixed by the caller for uniqueness."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []

    def op(self, op_type: str, inputs: Sequence[str], output: str, **attrs: object) -> str:
        self.nodes.append(helper.make_node(op_type, list(inputs), [output], name=output, **attrs))
        return output

    def ops(self, op_type: str, inputs: Sequence[str], outputs: Sequence[str], **attrs: object) -> list[str]:
        """A node with several outputs, named after the first."""
        self.nodes.append(helper.make_node(op_type, list(inputs), list(outputs), name=outputs[0], **attrs))
        return list(outputs)

    def const(self, name: str, value: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(value, name))
        return name

    def weight(self, name: str, value: np.ndarray, *, fp16: bool = False) -> str:
        """Add a float32 weight; ``fp16`` stores it half-size and casts it back in the graph.

        The encoder's ~455k parameters are 1.8 MB as float32; stored as float16 the file halves.
        onnxruntime folds the Cast at session load, so inference still runs in float32 (on
        weights that happen to be float16-representable).
        """
        value = value.astype(np.float32)
        if not fp16:
            return self.const(name, value)
        self.const(f"{name}_fp16", value.astype(np.float16))
        return self.op("Cast", [f"{name}_fp16"], name, to=TensorProto.FLOAT)


def finish_model(
    graph: GraphBuilder,
    name: str,
    inputs: list[onnx.ValueInfoProto],
    outputs: list[onnx.ValueInfoProto],
    producer: str = PRODUCER,
) -> onnx.ModelProto:
    """The graph as a checked model at batchgate's opset and IR version. The builder's
    initializers move into the model (the builder is left without them)."""
    model = helper.make_model(
        helper.make_graph(graph.nodes, name, inputs, outputs),
        opset_imports=[helper.make_opsetid("", OPSET)],
        producer_name=producer,
        producer_version="1",
    )
    # One tensor at a time, in order: make_graph and make_model would each copy them all, which
    # for Qwen3-Embedding-0.6B (2.4 GB of weights) held three copies at once.
    tensors, graph.initializers = graph.initializers, []
    for i, tensor in enumerate(tensors):
        model.graph.initializer.append(tensor)
        tensors[i] = None
    model.ir_version = IR_VERSION
    if model_bytes(model) < PROTOBUF_LIMIT:
        onnx.checker.check_model(model, full_check=True)
    # else the checker refuses the message in memory; write_model checks the written file.
    return model


def model_bytes(model: onnx.ModelProto) -> int:
    """About the serialised size of ``model`` (its initializers and nodes, the rest is small),
    measured part by part: protobuf's ByteSize serialises the whole message to measure it,
    which for Qwen3-Embedding-0.6B (2.4 GB) held 10 GB more at once."""
    graph = model.graph
    return sum(t.ByteSize() for t in graph.initializer) + sum(n.ByteSize() for n in graph.node)


def external_bytes() -> int:
    """The model size past which write_model stores the weights beside the graph: the env
    setting ``BATCHGATE_ONNX_EXTERNAL_BYTES`` (so a test can send a tiny model down that path),
    else just under protobuf's 2 GiB."""
    raw = os.environ.get(EXTERNAL_BYTES_ENV, "").strip()
    if not raw:
        return DEFAULT_EXTERNAL_BYTES
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not 0 <= value <= DEFAULT_EXTERNAL_BYTES:
        raise ValueError(
            f"{EXTERNAL_BYTES_ENV}={raw!r}: expected a byte count from 0 to {DEFAULT_EXTERNAL_BYTES}"
        )
    return value


def external_data_path(model_file: Path) -> Path:
    """Where write_model puts a large model's weights: ``model.onnx`` -> ``model.onnx.data``."""
    return model_file.with_name(model_file.name + ".data")


def write_model(path: Path, model: onnx.ModelProto) -> None:
    """Write ``model`` to ``path`` atomically: one file, or past external_bytes() the graph in
    ``path`` and every tensor over 1 KiB in ``<path>.data`` beside it (ONNX external data, which
    ONNX Runtime and OpenVINO read from beside the graph). The external write moves the weights
    out of ``model``'s tensors: the caller is done with it."""
    data = external_data_path(path)
    if model_bytes(model) <= external_bytes():
        write_atomic(path, model.SerializeToString(deterministic=True))
        data.unlink(missing_ok=True)  # a previous large build's weights, read by nothing now
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.name}.") as tmp:
        staged = Path(tmp) / path.name
        # What onnx.save_model(save_as_external_data=True) does, less its check that no file of
        # the data file's name exists in the *working* directory (it refuses one that does).
        for tensor in model.graph.initializer:
            if tensor.HasField("raw_data") and len(tensor.raw_data) >= _EXTERNAL_TENSOR_BYTES:
                set_external_data(tensor, data.name)
        write_external_data_tensors(model, tmp)
        staged.write_bytes(model.SerializeToString(deterministic=True))
        onnx.checker.check_model(str(staged))  # the data file is where the graph says, and long enough
        # Weights first, the graph that names them last: a load between the two renames (a
        # model reloaded while it is being prepared) pairs the old graph with the new weights.
        os.replace(Path(tmp) / data.name, data)
        os.replace(staged, path)


def write_atomic(path: Path, data: bytes) -> None:
    # A gateway polling the repository must never load a half-written model.
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def gelu(
    g: GraphBuilder, name: str, x: str, *, one: str, half: str | None = None, sqrt2: str | None = None
) -> str:
    """Exact (erf) GELU, ``x * (1 + erf(x / sqrt 2)) / 2``, spelled out: the Gelu op only exists
    from opset 20, and onnxruntime fuses this pattern back into its Gelu kernel either way.

    ``one`` names a float 1. With ``sqrt2`` and ``half`` naming shared constants (MiniLM) the
    graph divides by sqrt 2 and halves last; without them (the bundled encoder) each call adds
    its own 1/sqrt 2 and 0.5 and halves x first. Same function, two spellings kept for the bytes.
    """
    if sqrt2 is not None and half is not None:
        erf = g.op("Erf", [g.op("Div", [x, sqrt2], f"{name}.scaled")], f"{name}.erf")
        one_plus = g.op("Add", [erf, one], f"{name}.one_plus")
        return g.op("Mul", [g.op("Mul", [x, one_plus], f"{name}.x_one_plus"), half], name)
    inv_sqrt2 = g.const(f"{name}.inv_sqrt2", np.array(1 / math.sqrt(2), np.float32))
    half = g.const(f"{name}.half", np.array(0.5, np.float32))
    erf = g.op("Erf", [g.op("Mul", [x, inv_sqrt2], f"{name}.scaled")], f"{name}.erf")
    one_plus = g.op("Add", [erf, one], f"{name}.one_plus")
    return g.op("Mul", [g.op("Mul", [x, half], f"{name}.half_x"), one_plus], name)


def split_heads(
    g: GraphBuilder, x: str, perm: list[int], suffix: str, heads_shape: str = "heads_shape"
) -> str:
    """[batch, seq, hidden] -> heads, transposed by ``perm`` ([0, 2, 1, 3] for Q and V: [batch,
    heads, seq, head_dim]; [0, 2, 3, 1] for K, so Q @ K needs no extra transpose). Reshape's 0
    entries in ``heads_shape`` copy batch and seq from the input: no runtime shape arithmetic."""
    return g.op("Transpose", [g.op("Reshape", [x, heads_shape], f"{x}.heads")], f"{x}.{suffix}", perm=perm)


def attend(
    g: GraphBuilder,
    name: str,
    q: str,
    k: str,
    v: str,
    key_bias: str,
    *,
    scale: str | None = None,
    merge_shape: str = "merge_shape",
) -> str:
    """softmax(Q K * scale + key_bias) V, heads merged back to [batch, seq, hidden] (before the
    output projection). ``key_bias`` is 0 for real keys and a large negative for padding.
    ``scale`` names the 1/sqrt(head_dim) constant; None when it is folded into the query weights
    (MiniLM), which saves a Mul over every [heads, seq, seq] score tensor."""
    scores = g.op("MatMul", [q, k], f"{name}.qk")
    if scale is not None:
        scores = g.op("Add", [g.op("Mul", [scores, scale], f"{name}.scores"), key_bias], f"{name}.masked")
    else:
        scores = g.op("Add", [scores, key_bias], f"{name}.scores")
    probs = g.op("Softmax", [scores], f"{name}.probs", axis=-1)
    context = g.op("MatMul", [probs, v], f"{name}.context")
    merged = g.op("Transpose", [context], f"{name}.context_t", perm=[0, 2, 1, 3])
    return g.op("Reshape", [merged, merge_shape], f"{name}.merged")
