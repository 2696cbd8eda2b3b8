"""Bad requests against the real server: each gets the exact gRPC status code and a message that
names the offending input (or model) and what was expected, never INTERNAL or UNKNOWN; the
server keeps serving afterwards.

Requests are built with tritonclient wherever it will send the bad request, and as raw
``ModelInferRequest`` messages on the stub where tritonclient refuses to build it (negative
dims, mismatched raw byte counts, typed contents, raw/typed mixes).

Every case is registered once in ``CASES`` (one parametrized test each) so that the final test
can replay them all before checking that valid requests still succeed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from batchgate.proto.inference.v2 import grpc_service_pb2 as pb

TIMEOUT_S = 30.0
INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND

# -- valid data ---------------------------------------------------------------------------------


def ranker_data(rows: int = 2, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "dense": rng.standard_normal((rows, 64), dtype=np.float32),
        "sparse_ids": rng.integers(0, 10_000, (rows, 8), dtype=np.int64),
    }


def encoder_data(rows: int = 2, seq: int = 16, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    mask = np.ones((rows, seq), dtype=np.int64)
    mask[:, seq - seq // 4 :] = 0  # some padding
    return {"input_ids": rng.integers(0, 1000, (rows, seq), dtype=np.int64), "attention_mask": mask}


def with_(data: dict[str, np.ndarray], **changes: np.ndarray) -> dict[str, np.ndarray]:
    return {**data, **changes}


# -- tritonclient requests ------------------------------------------------------------------------


def tc_input(name: str, arr: np.ndarray) -> tc.InferInput:
    inp = tc.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
    inp.set_data_from_numpy(arr)
    return inp


def tc_infer(triton, model: str, inputs, *, version: str = "", outputs: tuple[str, ...] = ()):
    """``inputs``: a dict of arrays, or a list of (name, array) pairs (to repeat a name)."""
    pairs = inputs.items() if isinstance(inputs, dict) else inputs
    return triton.infer(
        model,
        [tc_input(n, a) for n, a in pairs],
        model_version=version,
        outputs=[tc.InferRequestedOutput(o) for o in outputs] or None,
        client_timeout=TIMEOUT_S,
    )


# -- raw protobuf requests ------------------------------------------------------------------------


@dataclass(frozen=True)
class In:
    """One input as it goes on the wire; ``datatype``/``shape`` default to the array's own."""

    name: str
    arr: np.ndarray
    datatype: str | None = None
    shape: tuple[int, ...] | None = None
    raw: bytes | None = None  # override the raw bytes (default: arr.tobytes())
    typed: bool = False  # send as InferTensorContents instead of raw

    def tensor(self) -> pb.ModelInferRequest.InferInputTensor:
        dt = self.datatype or np_to_triton_dtype(self.arr.dtype)
        t = pb.ModelInferRequest.InferInputTensor(
            name=self.name, datatype=dt, shape=list(self.shape if self.shape is not None else self.arr.shape)
        )
        if self.typed:
            field = {np.dtype(np.float32): "fp32_contents", np.dtype(np.int64): "int64_contents",
                     np.dtype(np.float64): "fp64_contents"}[self.arr.dtype]  # fmt: skip
            getattr(t.contents, field).extend(self.arr.reshape(-1).tolist())
        return t

    def raw_bytes(self) -> bytes:
        return self.raw if self.raw is not None else self.arr.tobytes()


def ins(data: dict[str, np.ndarray], **kw) -> list[In]:
    return [In(n, a, **kw) for n, a in data.items()]


def pb_request(model: str, inputs: list[In], *, raw: list[bytes] | None = None) -> pb.ModelInferRequest:
    """Raw contents for every non-typed input unless ``raw`` gives the list explicitly."""
    if raw is None:
        raw = [] if all(i.typed for i in inputs) else [i.raw_bytes() for i in inputs]
    return pb.ModelInferRequest(model_name=model, inputs=[i.tensor() for i in inputs], raw_input_contents=raw)


def stub_infer(stub, model: str, inputs: list[In], **kw) -> pb.ModelInferResponse:
    return stub.ModelInfer(pb_request(model, inputs, **kw), timeout=TIMEOUT_S)


def output_array(resp: pb.ModelInferResponse, name: str) -> np.ndarray:
    for i, o in enumerate(resp.outputs):
        if o.name == name:
            assert o.datatype == "FP32"
            return np.frombuffer(resp.raw_output_contents[i], dtype=np.float32).reshape(list(o.shape))
    raise AssertionError(f"no output {name!r} in response: {[o.name for o in resp.outputs]}")


# -- the cases ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    id: str
    send: Callable[[object, object], object]  # (triton, stub) -> response; must raise
    code: grpc.StatusCode
    needles: tuple[str, ...]  # case-insensitive substrings the message must contain


CASES: list = []  # one pytest.param(Case, id=...) per case, in registration order


def case(id: str, code: grpc.StatusCode, *needles: str, marks=()):
    def register(send):
        CASES.append(pytest.param(Case(id, send, code, needles), id=id, marks=marks))
        return send

    return register


def rejection(send: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    """Run ``send``; return the status code and message it was refused with."""
    try:
        resp = send()
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    except InferenceServerException as exc:
        status = (exc.status() or "").removeprefix("StatusCode.")
        assert status in grpc.StatusCode.__members__, f"not a server status: {exc}"
        return grpc.StatusCode[status], exc.message() or ""
    pytest.fail(f"the server accepted a bad request: {resp}")


# One valid ranker request's arrays (read-only), reused by the cases below.
DENSE, SPARSE = ranker_data()["dense"], ranker_data()["sparse_ids"]

# unknown model / version
case("unknown-model", NOT_FOUND, "Request for unknown model: 'no_such_model' is not found")(
    lambda triton, stub: tc_infer(triton, "no_such_model", ranker_data())
)
case(
    "unknown-version",
    NOT_FOUND,
    "Request for unknown model: 'ranker' version 7 is not found",
    "served versions",
)(lambda triton, stub: tc_infer(triton, "ranker", ranker_data(), version="7"))

# the set of inputs
case("missing-input", INVALID, "missing input", "sparse_ids", "INT64", "[-1, 8]")(
    lambda triton, stub: tc_infer(triton, "ranker", {"dense": DENSE})
)
case("extra-input", INVALID, "no input named 'bogus'", "dense", "sparse_ids")(
    lambda triton, stub: tc_infer(triton, "ranker", with_(ranker_data(), bogus=np.zeros((2, 3), np.float32)))
)
case("duplicated-input", INVALID, "'dense'", "more than once")(
    lambda triton, stub: tc_infer(
        triton, "ranker", [("dense", DENSE), ("dense", DENSE), ("sparse_ids", SPARSE)]
    )
)

# datatype
for _dt in (np.float64, np.int32):
    _name = np_to_triton_dtype(np.dtype(_dt))
    case(f"wrong-datatype-{_name}", INVALID, "'dense'", _name, "expects FP32")(
        lambda triton, stub, _dt=_dt: tc_infer(
            triton, "ranker", {"dense": DENSE.astype(_dt), "sparse_ids": SPARSE}
        )
    )


# shape (tritonclient sends any non-negative shape its numpy array has)
def _dense_shaped(shape: tuple[int, ...]) -> dict[str, np.ndarray]:
    return {"dense": np.zeros(shape, np.float32), "sparse_ids": np.zeros((shape[0], 8), np.int64)}


for _id, _shape in {
    "wrong-dim": (2, 63),
    "wrong-rank-3": (2, 64, 1),
    "wrong-rank-1": (128,),
    "zero-rows": (0, 64),
    "zero-feature-dim": (2, 0),
}.items():
    case(_id, INVALID, "'dense'", f"shape {list(_shape)}", "expects [-1, 64]")(
        lambda triton, stub, _shape=_shape: tc_infer(triton, "ranker", _dense_shaped(_shape))
    )
case("zero-length-sequence", INVALID, "'input_ids'", "shape [2, 0]", "expects [-1, -1]")(
    lambda triton, stub: tc_infer(triton, "encoder", encoder_data(rows=2, seq=0))
)
# negative dims: numpy cannot make such an array, so the shape is written into the message
for _id, _shape in {
    "negative-rows": (-3, 64),
    "wildcard-rows": (-1, 64),
    "negative-feature-dim": (2, -64),
}.items():
    case(_id, INVALID, "'dense'", f"shape {list(_shape)}", "expects [-1, 64]")(
        lambda triton, stub, _shape=_shape: stub_infer(
            stub, "ranker", [In("dense", DENSE, shape=_shape), In("sparse_ids", SPARSE)]
        )
    )

# contents vs shape
case("raw-bytes-short", INVALID, "'dense'", "holds 511 bytes", "needs 512")(
    lambda triton, stub: stub_infer(
        stub, "ranker", [In("dense", DENSE, raw=DENSE.tobytes()[:-1]), In("sparse_ids", SPARSE)]
    )
)
case("raw-bytes-long", INVALID, "'sparse_ids'", "holds 256 bytes", "needs 128")(
    lambda triton, stub: stub_infer(
        stub, "ranker", [In("dense", DENSE), In("sparse_ids", SPARSE, raw=SPARSE.tobytes() * 2)]
    )
)
case("typed-value-count", INVALID, "'dense'", "fp32_contents holds 127 values", "needs 128")(
    lambda triton, stub: stub_infer(
        stub,
        "ranker",
        [
            In("dense", DENSE.reshape(-1)[:-1], shape=(2, 64), typed=True),
            In("sparse_ids", SPARSE, typed=True),
        ],
    )  # fmt: skip
)
case("typed-wrong-field", INVALID, "'dense'", "fp32_contents holds 0 values", "needs 128")(
    lambda triton, stub: stub_infer(  # FP32 declared, values sent in fp64_contents
        stub,
        "ranker",
        [
            In("dense", DENSE.astype(np.float64), datatype="FP32", typed=True),
            In("sparse_ids", SPARSE, typed=True),
        ],
    )  # fmt: skip
)
case("raw-count-too-few", INVALID, "raw_input_contents has 1 entr", "2 inputs")(
    lambda triton, stub: stub_infer(stub, "ranker", ins(ranker_data()), raw=[DENSE.tobytes()])
)
case("raw-count-too-many", INVALID, "raw_input_contents has 3 entr", "2 inputs")(
    lambda triton, stub: stub_infer(
        stub, "ranker", ins(ranker_data()), raw=[DENSE.tobytes(), SPARSE.tobytes(), b""]
    )
)
case("typed-and-raw", INVALID, "'dense'", "both typed contents and raw_input_contents")(
    lambda triton, stub: stub_infer(
        stub,
        "ranker",
        [In("dense", DENSE, typed=True), In("sparse_ids", SPARSE)],
        raw=[DENSE.tobytes(), SPARSE.tobytes()],
    )  # fmt: skip
)

# batch
case("over-max-batch-size-ranker", INVALID, "257 rows", "'ranker'", "max_batch_size=256")(
    lambda triton, stub: tc_infer(triton, "ranker", ranker_data(rows=257))
)
case("over-max-batch-size-encoder", INVALID, "65 rows", "'encoder'", "max_batch_size=64")(
    lambda triton, stub: tc_infer(triton, "encoder", encoder_data(rows=65))
)
case("batch-size-mismatch", INVALID, "'sparse_ids'", "batch size 3", "earlier input has 2")(
    lambda triton, stub: tc_infer(
        triton, "ranker", {"dense": DENSE, "sparse_ids": ranker_data(rows=3)["sparse_ids"]}
    )
)

# values
for _id, _bad in {"sparse-id-too-large": 10_000, "sparse-id-negative": -1}.items():
    case(_id, INVALID, "'sparse_ids'", "outside [0, 10000)", str(_bad))(
        lambda triton, stub, _bad=_bad: tc_infer(
            triton, "ranker", {"dense": DENSE, "sparse_ids": np.full((2, 8), _bad, np.int64)}
        )
    )
case("input-id-out-of-vocab", INVALID, "'input_ids'", "outside [0, 1000)", "1000")(
    lambda triton, stub: tc_infer(
        triton, "encoder", with_(encoder_data(), input_ids=np.full((2, 16), 1000, np.int64))
    )
)
case("attention-mask-not-binary", INVALID, "'attention_mask'", "outside [0, 2)", "2")(
    lambda triton, stub: tc_infer(
        triton, "encoder", with_(encoder_data(), attention_mask=np.full((2, 16), 2, np.int64))
    )
)
case("sequence-too-long", INVALID, "'input_ids'", "shape [1, 513]", "at most 512")(
    lambda triton, stub: tc_infer(triton, "encoder", encoder_data(rows=1, seq=513))
)
case(
    "sequence-length-mismatch", INVALID, "input_ids", "attention_mask", "[1, 12]",
)(
    lambda triton, stub: tc_infer(
        triton, "encoder",
        {"input_ids": np.ones((1, 10), np.int64), "attention_mask": np.ones((1, 12), np.int64)},
    )
)  # fmt: skip

# outputs
case("unknown-output", INVALID, "no output named 'nope'", "score")(
    lambda triton, stub: tc_infer(triton, "ranker", ranker_data(), outputs=("nope",))
)


# -- tests ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("c", CASES)
def test_bad_input_is_refused(triton, stub, c: Case):
    code, message = rejection(lambda: c.send(triton, stub))
    assert code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), f"{code.name}: {message}"
    assert code == c.code, f"expected {c.code.name}, got {code.name}: {message}"
    missing = [n for n in c.needles if n.lower() not in message.lower()]
    assert not missing, f"message lacks {missing}: {message!r}"


TYPED_CONTROLS = [
    pytest.param("ranker", ranker_data(rows=1, seed=1), "score", id="ranker-1-row"),
    pytest.param("ranker", ranker_data(rows=7, seed=2), "score", id="ranker-7-rows"),
    pytest.param("ranker", ranker_data(rows=256, seed=3), "score", id="ranker-max-batch"),
    pytest.param("encoder", encoder_data(rows=1, seq=5, seed=4), "embedding", id="encoder-1-row"),
    pytest.param("encoder", encoder_data(rows=3, seq=40, seed=5), "embedding", id="encoder-3-rows"),
]


@pytest.mark.parametrize(("model", "data", "output"), TYPED_CONTROLS)
def test_typed_contents_match_raw(triton, stub, model, data, output):
    """Positive control: the typed-contents path decodes to the same tensors as the raw path."""
    typed_req = pb_request(model, ins(data, typed=True))
    assert not typed_req.raw_input_contents
    assert all(t.HasField("contents") for t in typed_req.inputs)
    typed = output_array(stub.ModelInfer(typed_req, timeout=TIMEOUT_S), output)
    raw = tc_infer(triton, model, data).as_numpy(output)
    rows = next(iter(data.values())).shape[0]
    assert typed.shape == raw.shape and typed.shape[0] == rows
    assert np.isfinite(typed).all()
    np.testing.assert_allclose(typed, raw, rtol=1e-6, atol=1e-7)


def test_server_keeps_serving_after_bad_input(server, triton, stub):
    """Last in the file; it replays every bad request itself so it does not depend on order."""
    log_before = len(server.log())
    for p in CASES:
        c: Case = p.values[0]
        code, message = rejection(lambda c=c: c.send(triton, stub))
        assert code != grpc.StatusCode.UNKNOWN, f"{c.id}: {message}"
    assert server.proc.poll() is None, f"server exited with {server.proc.returncode}\n{server.log()}"
    assert triton.is_server_live() and triton.is_server_ready()
    for model, data, output, shape in (
        ("ranker", ranker_data(5), "score", (5, 1)),
        ("encoder", encoder_data(3), "embedding", (3, 128)),
    ):
        assert triton.is_model_ready(model)
        out = tc_infer(triton, model, data).as_numpy(output)
        assert out.shape == shape and np.isfinite(out).all(), f"{model}: {out}"
    assert "Traceback" not in server.log()[log_before:], "a bad request raised an unhandled exception"
    assert server.proc.poll() is None
