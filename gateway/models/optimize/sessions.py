"""Sessions as a batchgate CPU worker makes them (ONNX Runtime's, or OpenVINO's behind the same
``run``/``get_outputs``), and rows run through one, each alone."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from batchgate.gateway.repository import TOKEN_MASK_OUTPUT, TOKEN_OUTPUT


def session(path: Path, threads: int = 1):
    """A session as a batchgate CPU worker makes one: one thread, no spinning, all graph passes
    but the fusions workers skip."""
    import onnxruntime as ort

    from batchgate.workers.sessions import disabled_fusions

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.log_severity_level = 3
    return ort.InferenceSession(
        str(path), so, providers=["CPUExecutionProvider"], disabled_optimizers=disabled_fusions("cpu")
    )


def engine_precision(variant: str) -> tuple[str, str]:
    """(engine, OpenVINO precision) a variant runs with; ONNX Runtime's precision is in its file."""
    if not variant.startswith("openvino-"):
        return "onnxruntime", "fp32"
    from batchgate.workers import openvino_engine

    asked = {"openvino-fp32": "fp32", "openvino-bf16": "bf16"}.get(variant, "auto")
    return "openvino", openvino_engine.resolve_precision(asked)


def engine_session(path: Path, variant: str):
    """A session of ``variant``'s engine over ``path`` as a worker makes one (one thread):
    ONNX Runtime's, or OpenVINO's behind the same ``run``/``get_outputs``."""
    engine, precision = engine_precision(variant)
    if engine == "onnxruntime":
        return session(path)
    from batchgate.workers import openvino_engine

    return openvino_engine.Session(path, precision=precision, threads=1)


def judged(sess) -> list[str]:
    """The outputs the gate judges and the timings fetch: those a call gets without asking. A
    pooled output's per-token companions (minilm's token_embeddings, given on request) are left
    out: rows of other lengths do not stack, and serving copies them only for calls that ask."""
    names = [o.name for o in sess.get_outputs()]
    return [n for n in names if n not in (TOKEN_OUTPUT, TOKEN_MASK_OUTPUT)] or names


def run_rows(sess, feeds: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Each row alone; outputs stacked by name (rows on axis 0)."""
    names = judged(sess)
    outs: dict[str, list[np.ndarray]] = {n: [] for n in names}
    for f in feeds:
        for n, v in zip(names, sess.run(names, f)):
            outs[n].append(np.asarray(v, np.float64))
    return {n: np.concatenate(v) for n, v in outs.items()}
