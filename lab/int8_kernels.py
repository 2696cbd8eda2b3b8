"""ONNX Runtime's INT8 GEMM kernels on this CPU: speed against FP32, and exactness, in one run.

What ``batchgate optimize --int8``'s weight storage (``--int8-weights``) rests on. One minilm-sized
weight GEMM (a batch of 16 rows of 40 tokens, 384 -> 1536), on one thread:

* FP32 ``MatMul``;
* ``MatMulIntegerToFloat`` with UINT8 activations and INT8 weights (what ``row_int8`` writes with
  ``--int8-weights int8``);
* the same with UINT8 weights around 128 (``--int8-weights uint8``).

Each integer product is compared with the exact product of the same quantised values, computed
in int64: where the CPU has no VNNI, ORT's UINT8 x INT8 kernel multiplies with VPMADDUBSW, whose
16-bit pairwise sums saturate, and the error shows here. The activations are the worst case that
kernel meets: every row's largest value quantises to 255, and so do many others.

    .venv/bin/python -m lab.int8_kernels [--repeats 200]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto
from onnx import helper as h
from onnx import numpy_helper

from batchgate.gateway.models.optimize import machine
from batchgate.workers.devices import int8_saturates

M, K, N = 640, 384, 1536


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _fp32(w: np.ndarray) -> ort.InferenceSession:
    g = h.make_graph(
        [h.make_node("MatMul", ["x", "w"], ["y"])], "fp32",
        [h.make_tensor_value_info("x", TensorProto.FLOAT, [M, K])],
        [h.make_tensor_value_info("y", TensorProto.FLOAT, [M, N])], [numpy_helper.from_array(w, "w")],
    )  # fmt: skip
    return _session(h.make_model(g, opset_imports=[h.make_opsetid("", 17)]))


def _int8(wq: np.ndarray, zp: np.ndarray | None) -> ort.InferenceSession:
    inits = [numpy_helper.from_array(wq, "w"), numpy_helper.from_array(np.ones(N, np.float32), "ws"),
             numpy_helper.from_array(np.array(128, np.uint8), "azp")]  # fmt: skip
    if zp is not None:
        inits.append(numpy_helper.from_array(zp, "wzp"))
    node = h.make_node("MatMulIntegerToFloat", ["q", "w", "s", "ws", "azp", "wzp" if zp is not None else ""],
                       ["y"], domain="com.microsoft")  # fmt: skip
    g = h.make_graph(
        [node], "int8",
        [h.make_tensor_value_info("q", TensorProto.UINT8, [M, K]),
         h.make_tensor_value_info("s", TensorProto.FLOAT, [M, 1])],
        [h.make_tensor_value_info("y", TensorProto.FLOAT, [M, N])], inits,
    )  # fmt: skip
    return _session(
        h.make_model(g, opset_imports=[h.make_opsetid("", 17), h.make_opsetid("com.microsoft", 1)])
    )


def _time(sess: ort.InferenceSession, feeds: dict, repeats: int) -> float:
    for _ in range(5):
        sess.run(None, feeds)
    best = []
    for _ in range(3):  # the best of three medians: this machine is shared
        t = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            sess.run(None, feeds)
            t.append(time.perf_counter() - t0)
        best.append(float(np.median(t)))
    return min(best) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args(argv)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    rng = np.random.default_rng(0)
    w = rng.standard_normal((K, N)).astype(np.float32)
    wq = np.clip(np.round(w / (np.abs(w).max(axis=0) / 127)), -127, 127)
    x = np.abs(rng.standard_normal((M, K))).astype(np.float32)
    q = np.clip(np.round(x / (x.max(axis=1, keepdims=True) / 127)) + 128, 0, 255).astype(np.uint8)
    exact = (q.astype(np.int64) - 128) @ wq.astype(np.int64)
    feeds = {"q": q, "s": np.ones((M, 1), np.float32)}
    cases = {
        "fp32 MatMul": (_fp32(w), {"x": x}, None),
        "uint8 x int8 weights": (_int8(wq.astype(np.int8), None), feeds, exact),
        "uint8 x uint8 weights (around 128)": (_int8((wq + 128).astype(np.uint8), np.array(128, np.uint8)), feeds, exact),
    }  # fmt: skip
    print(f"{machine()}")
    print(f"int8_saturates() says {int8_saturates()} for this CPU; one GEMM {M}x{K} @ {K}x{N}, one thread")
    base = None
    for name, (sess, f, want) in cases.items():
        ms = _time(sess, f, args.repeats)
        base = base or ms
        err = ""
        if want is not None:
            got = sess.run(None, f)[0].astype(np.float64)
            err = f"  max rel error vs exact {np.abs(got - want).max() / np.abs(want).max():.2e}"
        print(f"{name:36s} {ms:7.3f} ms  x{base / ms:.2f} of fp32{err}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
