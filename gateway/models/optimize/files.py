"""What every candidate's build shares: ONNX Runtime's tools kept quiet, a model written in
place without a half-written file."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import onnx


@contextlib.contextmanager
def quiet():
    """ORT's Python tools log warnings per call (pre-processing advice, producer names) that say
    nothing about this build; the report says what happened."""
    loggers = [logging.getLogger(), logging.getLogger("onnxruntime"), logging.getLogger("onnx_model"),
               logging.getLogger("fusion_base"), logging.getLogger("optimizer")]  # fmt: skip
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):  # the calibrator prints
            yield
    finally:
        for lg, lv in zip(loggers, levels):
            lg.setLevel(lv)


def save_model(model: onnx.ModelProto, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    onnx.save(model, str(tmp))
    os.replace(tmp, path)
