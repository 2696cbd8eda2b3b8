"""The call every transport translates its wire format into, and the answer it translates back.

Plain Python: no protobuf, no JSON. gRPC reads a ``ModelInferRequest`` into a ``Call``
(gateway/transport/grpc.py ``call_of``) and writes an ``Answer`` as a ``ModelInferResponse``;
REST builds the ``Call`` straight from its JSON (and binary extension) body and writes JSON from
the ``Answer``'s arrays. The pipeline (gateway/infer.py) and the codec (gateway/codec.py) see
only these types.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

# A parameter's value as the caller sent it: KServe's bool, int64/uint64, double or string.
Param = bool | int | float | str


@dataclass(slots=True)
class Tensor:
    """One input as sent: exactly one of ``raw`` (KServe's binary layout: the values' little-endian
    bytes, or for BYTES a 4-byte length before each element) and ``values`` (typed values in
    row-major order: numbers, bools, or bytes for BYTES) is set; neither when the wire carried no
    data for it (the codec names what is missing)."""

    name: str
    datatype: str
    shape: Sequence[int]
    raw: bytes | memoryview | None = None
    values: Sequence | None = None
    parameters: dict[str, Param] = field(default_factory=dict)


@dataclass(slots=True)
class Wanted:
    """An output the caller asked for by name, with its parameters (``binary_data``, …)."""

    name: str
    parameters: dict[str, Param] = field(default_factory=dict)


@dataclass(slots=True)
class Call:
    model: str
    version: str = ""
    id: str = ""
    inputs: list[Tensor] = field(default_factory=list)
    outputs: list[Wanted] = field(default_factory=list)  # none named: every output
    parameters: dict[str, Param] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        """The row count the first input declares (admission runs on it before any decoding)."""
        shape = self.inputs[0].shape if self.inputs else ()
        return max(shape[0], 0) if len(shape) else 0


@dataclass(slots=True)
class Output:
    name: str
    datatype: str
    array: np.ndarray
    binary: bool  # the caller asked for it as raw bytes (the default) rather than typed values


@dataclass(slots=True)
class Answer:
    model: str
    version: str
    id: str
    outputs: list[Output]
    tokens: list[int] | None = None  # a list of texts: each text's token count, as the model saw it
