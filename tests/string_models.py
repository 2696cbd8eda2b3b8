"""Small ONNX models built with onnx.helper for the string tests and for Triton's example clients.

Each ``write_*`` writes ``<repo>/<name>/config.pbtxt`` and ``<repo>/<name>/1/model.onnx``. The
Triton stand-ins (``simple``, ``simple_string``, ...) have the names, tensors and answers of the
models Triton's example clients expect (server/docs/examples/model_repository and qa/), as ONNX.
"""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import TensorProto as T
from onnx import helper

OPSET = 20  # StringConcat needs 20; onnxruntime 1.32 runs it
_TYPE = {T.STRING: "TYPE_STRING", T.INT32: "TYPE_INT32", T.INT8: "TYPE_INT8", T.FLOAT: "TYPE_FP32",
         T.INT64: "TYPE_INT64", T.BOOL: "TYPE_BOOL", T.UINT8: "TYPE_UINT8", T.FLOAT16: "TYPE_FP16",
         T.DOUBLE: "TYPE_FP64"}  # fmt: skip


def _write(
    repo: Path,
    name: str,
    nodes: list,
    inputs: list[tuple[str, int, list[int]]],
    outputs: list[tuple[str, int, list[int]]],
    max_batch_size: int,
    extra: str = "",
    initializers=(),
) -> Path:
    """``inputs``/``outputs``: (name, ONNX element type, dims without the batch dim)."""
    lead = ["batch"] if max_batch_size else []

    def vi(n: str, t: int, dims: list[int]):
        shape = lead + [f"{n}_d{i}" if d == -1 else d for i, d in enumerate(dims)]
        return helper.make_tensor_value_info(n, t, shape)

    graph = helper.make_graph(
        nodes, name, [vi(*i) for i in inputs], [vi(*o) for o in outputs], initializer=list(initializers)
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    (repo / name / "1").mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(repo / name / "1" / "model.onnx"))

    def block(kind: str, tensors) -> str:
        items = ",\n".join(
            f'  {{ name: "{n}" data_type: {_TYPE[t]} dims: [ {", ".join(map(str, d))} ] }}'
            for n, t, d in tensors
        )
        return f"{kind} [\n{items}\n]\n"

    config = (
        f'name: "{name}"\nplatform: "onnxruntime_onnx"\nmax_batch_size: {max_batch_size}\n'
        + block("input", inputs) + block("output", outputs) + extra
    )  # fmt: skip
    (repo / name / "config.pbtxt").write_text(config)
    return repo / name


def _cast(src: str, dst: str, to: int):
    return helper.make_node("Cast", [src], [dst], to=to)


def write_add_sub(
    repo: Path, name: str, elem: int, dims=(16,), max_batch_size: int = 8, extra: str = ""
) -> Path:
    """Triton's ``simple``: OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1."""
    d = list(dims)
    nodes = [helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]),
             helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"])]  # fmt: skip
    io = [("INPUT0", elem, d), ("INPUT1", elem, d)]
    return _write(repo, name, nodes, io, [("OUTPUT0", elem, d), ("OUTPUT1", elem, d)], max_batch_size, extra)


def write_string_add_sub(
    repo: Path, name: str = "simple_string", max_batch_size: int = 8, extra: str = ""
) -> Path:
    """Triton's ``simple_string``: strings holding integers in, their sum and difference as strings out
    (Cast string -> INT32, Add/Sub, Cast INT32 -> string)."""
    nodes = [
        _cast("INPUT0", "a", T.INT32), _cast("INPUT1", "b", T.INT32),
        helper.make_node("Add", ["a", "b"], ["sum"]), helper.make_node("Sub", ["a", "b"], ["diff"]),
        _cast("sum", "OUTPUT0", T.STRING), _cast("diff", "OUTPUT1", T.STRING),
    ]  # fmt: skip
    s = [16]
    io = [("INPUT0", T.STRING, s), ("INPUT1", T.STRING, s)]
    outs = [("OUTPUT0", T.STRING, s), ("OUTPUT1", T.STRING, s)]
    return _write(repo, name, nodes, io, outs, max_batch_size, extra)


def write_identity(
    repo: Path,
    name: str,
    elem: int,
    dims=(-1,),
    max_batch_size: int = 8,
    extra: str = "",
    in_name: str = "INPUT0",
    out_name: str = "OUTPUT0",
) -> Path:
    nodes = [helper.make_node("Identity", [in_name], [out_name])]
    ins, outs = [(in_name, elem, list(dims))], [(out_name, elem, list(dims))]
    return _write(repo, name, nodes, ins, outs, max_batch_size, extra)


def write_mixed(repo: Path, name: str = "str_mixed", max_batch_size: int = 8, extra: str = "") -> Path:
    """A string op over a string and a number input: JOINED = TEXT ++ str(NUM) (StringConcat),
    TWICE = NUM * 2, SAME = (TEXT == SUFFIX) with SUFFIX a second string input."""
    two = helper.make_tensor("two", T.INT32, [], [2])
    nodes = [
        _cast("NUM", "num_text", T.STRING),
        helper.make_node("StringConcat", ["TEXT", "num_text"], ["JOINED"]),
        helper.make_node("Mul", ["NUM", "two"], ["TWICE"]),
        helper.make_node("Equal", ["TEXT", "OTHER"], ["SAME"]),
    ]
    ins = [("TEXT", T.STRING, [1]), ("NUM", T.INT32, [1]), ("OTHER", T.STRING, [1])]
    outs = [("JOINED", T.STRING, [1]), ("TWICE", T.INT32, [1]), ("SAME", T.BOOL, [1])]
    return _write(repo, name, nodes, ins, outs, max_batch_size, extra, initializers=[two])


def write_densenet_standin(repo: Path) -> Path:
    """``densenet_onnx`` as grpc_client.py calls it (data_0 FP32 [3,224,224] -> fc6_1 [1000,1,1],
    unbatched); computes a mean per channel spread over 1000 classes, not an image classifier."""
    w = helper.make_tensor("w", T.FLOAT, [3, 1000], [((i % 7) - 3) / 10.0 for i in range(3000)])
    shape = helper.make_tensor("shape", T.INT64, [3], [1000, 1, 1])
    row = helper.make_tensor("row", T.INT64, [2], [1, 3])
    axes = helper.make_tensor("axes", T.INT64, [2], [1, 2])  # an input of ReduceMean since opset 18
    nodes = [
        helper.make_node("ReduceMean", ["data_0", "axes"], ["m"], keepdims=0),
        helper.make_node("Reshape", ["m", "row"], ["m2"]),
        helper.make_node("MatMul", ["m2", "w"], ["scores"]),
        helper.make_node("Reshape", ["scores", "shape"], ["fc6_1"]),
    ]
    return _write(
        repo, "densenet_onnx", nodes, [("data_0", T.FLOAT, [3, 224, 224])],
        [("fc6_1", T.FLOAT, [1000, 1, 1])], 0, initializers=[w, shape, row, axes],
    )  # fmt: skip


def write_triton_examples_repo(repo: Path) -> Path:
    """The models Triton's Python example clients call, as ONNX stand-ins with the same tensors."""
    write_add_sub(repo, "simple", T.INT32)
    write_add_sub(repo, "simple_int8", T.INT8)
    write_string_add_sub(repo, "simple_string")
    write_identity(repo, "simple_identity", T.STRING)
    write_identity(repo, "custom_identity_int32", T.INT32, dims=(-1,))
    write_densenet_standin(repo)
    return repo
