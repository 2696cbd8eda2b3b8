"""Datatype names: config TYPE_* enums, KServe v2 strings, numpy dtypes, typed-contents fields."""

from __future__ import annotations

import numpy as np

from batchgate.proto.inference.v2 import model_config_pb2 as mc

# KServe v2 datatype string -> numpy dtype (BYTES travels as an object array of bytes).
NUMPY = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(object),
}

# Which InferTensorContents field carries each datatype (FP16/BF16 only travel raw).
CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}

# ONNX TensorProto element type -> KServe datatype.
ONNX_TO_KSERVE = {
    1: "FP32",
    2: "UINT8",
    3: "INT8",
    4: "UINT16",
    5: "INT16",
    6: "INT32",
    7: "INT64",
    8: "BYTES",
    9: "BOOL",
    10: "FP16",
    11: "FP64",
    12: "UINT32",
    13: "UINT64",
    16: "BF16",
}


def from_config(data_type: int) -> str:
    """``TYPE_FP32`` -> ``FP32``; ``TYPE_STRING`` -> ``BYTES`` (Triton's spelling on the wire)."""
    name = mc.DataType.Name(data_type)
    if name == "TYPE_STRING":
        return "BYTES"
    return name.removeprefix("TYPE_")


def to_config(datatype: str) -> int:
    return mc.DataType.Value("TYPE_STRING" if datatype == "BYTES" else "TYPE_" + datatype)
