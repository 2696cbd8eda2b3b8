"""INT8 rewrites of a graph: SmoothQuant folded into the weights (``smooth``) and weight GEMMs with
each row's own activation scale (``row_int8``), plus what ONNX Runtime's static quantiser reads
calibration rows through. candidates.py decides which nodes they touch."""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import numpy as np
import onnx

from batchgate.gateway.models.optimize.options import OptimizeError
from batchgate.gateway.models.optimize.sessions import session


# Op types INT8 quantises: the GEMMs, where the time goes; the rest stays FP32 (QDQ around an
# element-wise op costs more than it saves on a CPU).
INT8_OPS = ("MatMul", "Gemm")


class RowReader:
    """CalibrationDataReader over rows of their own lengths: with ``CalibStridedMinMax`` 1 the
    calibrator collects one row per pass (``set_range``), so rows of different lengths never have
    to share a tensor (it refuses those) and no padding enters the ranges."""

    def __init__(self, feeds: list[dict[str, np.ndarray]]) -> None:
        self.feeds, self.i, self.end = feeds, 0, len(feeds)

    def __len__(self) -> int:
        return len(self.feeds)

    def set_range(self, start_index: int, end_index: int) -> None:
        self.i, self.end = start_index, end_index

    def get_next(self):
        if self.i >= self.end:
            return None
        self.i += 1
        return self.feeds[self.i - 1]


def named_nodes(model: onnx.ModelProto) -> onnx.ModelProto:
    """Every node named (the quantiser's include/exclude lists go by name)."""
    for i, n in enumerate(model.graph.node):
        if not n.name:
            n.name = f"{n.op_type}_{i}"
    return model


def _channel_absmax(model: onnx.ModelProto, names: list[str], feeds) -> dict[str, np.ndarray]:
    """Largest |value| per last-axis channel of each tensor in ``names`` over ``feeds``."""
    probe = copy.deepcopy(model)
    have = {o.name for o in probe.graph.output}
    for n in names:
        if n not in have:
            probe.graph.output.append(onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "probe.onnx"
        onnx.save(probe, str(path))
        sess = session(path)
        outs = [o.name for o in sess.get_outputs()]
        want = set(names)
        amax: dict[str, np.ndarray] = {}
        for f in feeds:
            for k, v in zip(outs, sess.run(None, f)):
                if k in want:
                    a = np.abs(np.asarray(v, np.float32)).reshape(-1, v.shape[-1]).max(0)
                    amax[k] = np.maximum(amax[k], a) if k in amax else a
    return amax


def smooth(model: onnx.ModelProto, feeds, alpha: float) -> int:
    """SmoothQuant (Xiao et al. 2023), folded in place: per input channel j of each weight GEMM,
    X[:, j] / s_j and W[j, :] * s_j with s_j = max|X_j|^alpha / max|W_j|^(1 - alpha), so the
    product is unchanged and the few channels with outlier activations (a transformer's
    LayerNorm outputs have them) no longer set one per-tensor scale for all. The division is a
    Mul node before the GEMM, because the same activation also feeds residual paths. ORT's own
    SmoothQuant needs Intel Neural Compressor's ONNX adaptor, which its current releases dropped.
    Returns the number of activations smoothed."""
    from onnx import numpy_helper

    init = {i.name: i for i in model.graph.initializer}
    groups: dict[str, list[onnx.NodeProto]] = {}
    for n in model.graph.node:
        attrs = {a.name: a for a in n.attribute}
        if n.op_type not in INT8_OPS or len(n.input) < 2 or n.input[1] not in init:
            continue
        if "transA" in attrs and attrs["transA"].i:
            continue
        groups.setdefault(n.input[0], []).append(n)
    amax = _channel_absmax(model, sorted(groups), feeds)

    def trans_b(n):
        return any(a.name == "transB" and a.i for a in n.attribute)

    nodes = list(model.graph.node)
    for x in sorted(groups):
        consumers = groups[x]
        weights = {id(n): numpy_helper.to_array(init[n.input[1]]).astype(np.float32) for n in consumers}
        rows = [(w.T if trans_b(n) else w) for n in consumers for w in [weights[id(n)]]]  # K x N each
        wmax = np.max([np.abs(r).max(1) for r in rows], axis=0)
        if x not in amax or len(amax[x]) != len(wmax):
            continue
        s = np.where(
            (amax[x] > 0) & (wmax > 0), amax[x] ** alpha / np.maximum(wmax, 1e-12) ** (1 - alpha), 1.0
        )
        s = np.clip(s, 1e-4, 1e4).astype(np.float32)
        inv = numpy_helper.from_array((1.0 / s).astype(np.float32), f"{x}.smooth_inv")
        model.graph.initializer.append(inv)
        mul = onnx.helper.make_node("Mul", [x, inv.name], [f"{x}.smoothed"], name=f"{x}.smooth")
        nodes.insert(nodes.index(consumers[0]), mul)
        for n in consumers:
            w = weights[id(n)]
            w = w * s[None, :] if trans_b(n) else w * s[:, None]
            init[n.input[1]].CopyFrom(numpy_helper.from_array(w.astype(np.float32), n.input[1]))
            n.input[0] = f"{x}.smoothed"
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return len(groups)


WEIGHT_TYPES = ("auto", "int8", "uint8")


def weight_type(asked: str) -> str:
    """The INT8 weights' storage: "int8" where ONNX Runtime's UINT8 x INT8 kernel is exact (VNNI, or
    off x86), "uint8" where it saturates (x86 without VNNI, see ``int8_saturates``)."""
    from batchgate.workers.devices import int8_saturates

    if asked not in WEIGHT_TYPES:
        raise OptimizeError(f"INT8 weights must be one of {', '.join(WEIGHT_TYPES)}, got {asked!r}")
    if asked != "auto":
        return asked
    return "uint8" if int8_saturates() else "int8"


def row_int8(model: onnx.ModelProto, names: set[str], per_channel: bool, weights: str = "int8") -> int:
    """Rewrite the weight GEMMs in ``names`` (MatMul or Gemm with a constant 2-D weight) to INT8
    with each row's own activation scale, computed at run time: for every row (a token) of the
    activation X, s = max|X_row| / 127 and X_row quantised to UINT8 around 128 (QuantizeLinear per
    row), so ONNX Runtime takes its UINT8 x INT8 kernel (VNNI where the CPU has it); the product
    against INT8 weights (per output channel, symmetric) comes back as FP32 through ORT's fused
    MatMulIntegerToFloat, which also applies s. A row's scale depends on that row alone, never on its
    batch-mates or its padding: dynamic quantisation that is batch-independent. The fused ops,
    against the same arithmetic written out op by op, are measured in docs/engines.md. Returns the
    number of GEMMs rewritten; the FP32 weights they no longer read are dropped.

    ``weights="uint8"`` stores the same symmetric levels shifted by 128 with zero point 128, so ORT
    takes its UINT8 x UINT8 kernel instead: the same product, exact on x86 CPUs without VNNI where
    the UINT8 x INT8 one saturates (``weight_type``)."""
    from onnx import helper as h
    from onnx import numpy_helper

    opset = max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0)
    if opset < 13:
        raise OptimizeError(
            f"row INT8 needs ONNX opset 13 or later (per-row QuantizeLinear); the model has {opset}: "
            "use --scales static"
        )
    if weights not in ("int8", "uint8"):
        raise OptimizeError(f"row INT8 weights must be int8 or uint8, got {weights!r}")
    unsigned = weights == "uint8"
    w_zp = "rowq.zp" if unsigned else ""
    init = {i.name: i for i in model.graph.initializer}
    shared = [numpy_helper.from_array(np.array(1 / 127, np.float32), "rowq.inv127"),
              numpy_helper.from_array(np.array(1e-12, np.float32), "rowq.tiny"),
              numpy_helper.from_array(np.array([-1, 1], np.int64), "rowq.column"),
              numpy_helper.from_array(np.array(128, np.uint8), "rowq.zp"),
              numpy_helper.from_array(np.array([-1], np.int64), "rowq.minus1"),
              numpy_helper.from_array(np.array([0], np.int64), "rowq.zero")]  # fmt: skip

    def row_max(src: str, dst: str) -> onnx.NodeProto:
        if opset >= 18:  # ReduceMax's axes became an input
            return h.make_node("ReduceMax", [src, "rowq.minus1"], [dst], name=dst, keepdims=1)
        return h.make_node("ReduceMax", [src], [dst], name=dst, axes=[-1], keepdims=1)

    nodes: list[onnx.NodeProto] = []
    replaced: set[str] = set()  # the rewritten GEMMs' weights (and Gemm's C)
    done = 0
    for n in model.graph.node:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        weight = n.input[1] if len(n.input) > 1 and n.input[1] in init else None
        if n.name not in names or n.op_type not in INT8_OPS or weight is None or attrs.get("transA", 0):
            nodes.append(n)
            continue
        w = numpy_helper.to_array(init[weight]).astype(np.float32)
        if w.ndim != 2:
            nodes.append(n)
            continue
        if n.op_type == "Gemm":
            w = (w.T if attrs.get("transB", 0) else w) * np.float32(attrs.get("alpha", 1.0))
        k, cols = w.shape
        amax = np.abs(w).max(axis=0) if per_channel else np.full(cols, np.abs(w).max())
        ws = (np.maximum(amax, 1e-12) / 127).astype(np.float32)
        wq = np.clip(np.round(w / ws), -127, 127)
        wq = (wq + 128).astype(np.uint8) if unsigned else wq.astype(np.int8)
        p = f"{n.name}.rowq"
        x = n.input[0]
        bias: list[str] = []
        if n.op_type == "Gemm" and len(n.input) > 2 and n.input[2]:  # C times beta, added after the scales
            c = numpy_helper.to_array(init[n.input[2]]).astype(np.float32) * np.float32(
                attrs.get("beta", 1.0)
            )
            if c.size not in (1, cols) or c.squeeze().ndim > 1:
                nodes.append(n)  # a C per row and column is not a bias: this Gemm stays FP32
                continue
            model.graph.initializer.append(
                numpy_helper.from_array(np.broadcast_to(c.reshape(-1), (cols,)).copy(), f"{p}.c")
            )
            bias = [f"{p}.c"]
        model.graph.initializer.extend([
            numpy_helper.from_array(wq, f"{p}.w"), numpy_helper.from_array(ws, f"{p}.ws"),
            numpy_helper.from_array(np.array([-1, k], np.int64), f"{p}.rows"),
            numpy_helper.from_array(np.array([cols], np.int64), f"{p}.cols"),
        ])  # fmt: skip
        replaced.update(n.input[1:])
        done += 1
        nodes += [
            # s = max|row| / 127, one per row
            h.make_node("Abs", [x], [f"{p}.abs"], name=f"{p}.abs"),
            row_max(f"{p}.abs", f"{p}.amax"),
            h.make_node("Max", [f"{p}.amax", "rowq.tiny"], [f"{p}.amax1"], name=f"{p}.amax1"),
            h.make_node("Mul", [f"{p}.amax1", "rowq.inv127"], [f"{p}.s"], name=f"{p}.s"),
            # rows flattened to [T, K]; QuantizeLinear per row (axis 0), zero point 128 each
            h.make_node("Reshape", [x, f"{p}.rows"], [f"{p}.x2"], name=f"{p}.x2"),
            h.make_node("Reshape", [f"{p}.s", "rowq.minus1"], [f"{p}.s1"], name=f"{p}.s1"),
            h.make_node("Reshape", [f"{p}.s", "rowq.column"], [f"{p}.s2"], name=f"{p}.s2"),
            h.make_node("Shape", [f"{p}.s1"], [f"{p}.t"], name=f"{p}.t"),
            h.make_node("Expand", ["rowq.zp", f"{p}.t"], [f"{p}.zp"], name=f"{p}.zp"),
            h.make_node("QuantizeLinear", [f"{p}.x2", f"{p}.s1", f"{p}.zp"], [f"{p}.q"], name=f"{p}.q", axis=0),
            # the INT32 product times s (a [T, 1] scale is per row) and the weight's column scales
            h.make_node("MatMulIntegerToFloat", [f"{p}.q", f"{p}.w", f"{p}.s2", f"{p}.ws", "rowq.zp", w_zp, *bias],
                        [f"{p}.y2"], name=f"{p}.mm", domain="com.microsoft"),
            # back to X's leading dims with N columns
            h.make_node("Shape", [x], [f"{p}.xshape"], name=f"{p}.xshape"),
            h.make_node("Slice", [f"{p}.xshape", "rowq.zero", "rowq.minus1"], [f"{p}.lead"], name=f"{p}.lead"),
            h.make_node("Concat", [f"{p}.lead", f"{p}.cols"], [f"{p}.yshape"], name=f"{p}.yshape", axis=0),
            h.make_node("Reshape", [f"{p}.y2", f"{p}.yshape"], [n.output[0]], name=f"{p}.y"),
        ]  # fmt: skip
    if done:
        model.graph.initializer.extend(shared)
        if not any(o.domain == "com.microsoft" for o in model.opset_import):
            model.opset_import.append(h.make_opsetid("com.microsoft", 1))
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    used = {i for nd in model.graph.node for i in nd.input} | {o.name for o in model.graph.output}
    kept = [i for i in model.graph.initializer if i.name not in replaced or i.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    return done
