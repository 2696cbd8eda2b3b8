"""Fuzz the live server with malformed ModelInferRequests (hypothesis).

Each example is a batch of requests sent at once on one channel: most are a valid request for a
served model (ranker, encoder, minilm, or an unknown name) bent by one to three
mutations (datatype, shape with negative, zero and huge dims, raw bytes of the wrong length,
missing, duplicated and unknown inputs, unknown and ill-typed parameters, typed contents in the
wrong field or of the wrong length, raw and typed together, extra raw entries, bad outputs,
invalid UTF-8 and over-long BYTES); among them, valid ranker requests whose answers are checked
against ONNX Runtime run directly on the model file.

The contract: every answer is OK or a client-error status (never INTERNAL, UNKNOWN or any other
code), every valid request is answered correctly, the server process stays up and logs no
traceback. A few thousand requests in well under a minute on two cores.
"""

from __future__ import annotations

import collections
import struct

import grpc
import numpy as np
import onnxruntime as ort
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchgate.proto.inference.v2 import grpc_service_pb2 as pb
from batchgate.proto.inference.v2 import grpc_service_pb2_grpc as pb_grpc
from tests.conftest import REPO, start_server

EXAMPLES = 120  # batches
BATCH = 24  # requests per batch, of which VALID are valid ranker requests
VALID = 4
TIMEOUT_S = 20.0

ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.UNIMPLEMENTED,  # e.g. the classification extension
    grpc.StatusCode.RESOURCE_EXHAUSTED,  # a limit (message size)
    grpc.StatusCode.DEADLINE_EXCEEDED,  # a budget parameter too small to meet
}

DTYPES = ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32",
          "FP64", "BF16", "BYTES", "", "fp32", "FLOAT", "TYPE_FP32", "\x00", "FP32 ", "é"]  # fmt: skip
FIELDS = ["bool_contents", "int_contents", "int64_contents", "uint_contents", "uint64_contents", "fp32_contents",
          "fp64_contents", "bytes_contents"]  # fmt: skip
DIMS = [-(2**63), -(2**62), -2, -1, 0, 1, 2, 3, 7, 8, 9, 16, 63, 64, 65, 256, 257, 512, 513, 2**31, 2**32 + 1,
        2**62, 2**63 - 1]  # fmt: skip
PARAM_KEYS = ["latency_budget_ms", "latency_class", "priority", "timeout", "binary_data_output", "sequence_id",
              "binary_data", "classification", "shared_memory_region", "x" * 300, "", "\u2603"]  # fmt: skip

_LEN = struct.Struct("<I")


# -- valid requests -------------------------------------------------------------------------------


MODELS = ["ranker", "encoder", "minilm"]  # served by this module's own server (``fuzzed``)


def bytes_raw(items: list[bytes]) -> bytes:
    return b"".join(_LEN.pack(len(b)) + b for b in items)


def valid(model: str, rows: int, seq: int, rng: np.random.Generator) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name=model)
    if model == "ranker":
        arrays = {
            "dense": rng.standard_normal((rows, 64), dtype=np.float32),
            "sparse_ids": rng.integers(0, 10_000, (rows, 8), dtype=np.int64),
        }
        dts = {"dense": "FP32", "sparse_ids": "INT64"}
    elif model == "encoder":
        arrays = {
            "input_ids": rng.integers(0, 1000, (rows, seq), dtype=np.int64),
            "attention_mask": np.ones((rows, seq), dtype=np.int64),
        }
        dts = {"input_ids": "INT64", "attention_mask": "INT64"}
    else:  # minilm: one text per row
        texts = [f"fuzz row {i} {rng.integers(1000)}".encode() for i in range(rows)]
        req.inputs.add(name="text", datatype="BYTES", shape=[rows, 1])
        req.raw_input_contents.append(bytes_raw(texts))
        return req
    for name, a in arrays.items():
        req.inputs.add(name=name, datatype=dts[name], shape=list(a.shape))
        req.raw_input_contents.append(a.tobytes())
    return req


# -- mutations ------------------------------------------------------------------------------------


def _param(p: pb.InferParameter, draw) -> None:
    kind = draw(st.sampled_from(["bool", "int", "uint", "double", "string", "none"]))
    if kind == "bool":
        p.bool_param = draw(st.booleans())
    elif kind == "int":
        p.int64_param = draw(st.sampled_from([-(2**63), -1, 0, 1, 5, 10**6, 2**63 - 1]))
    elif kind == "uint":
        p.uint64_param = draw(st.sampled_from([0, 1, 2**64 - 1]))
    elif kind == "double":
        p.double_param = draw(
            st.sampled_from([float("nan"), float("inf"), -float("inf"), -0.0, 1e-300, 0.5, 1e300])
        )
    elif kind == "string":
        p.string_param = draw(
            st.sampled_from(["", "nan", "inf", "-1", "1e999", "realtime", "bulk", "nope", "\u2603"])
        )


def _typed(t, draw) -> None:
    """Typed contents in a random field (maybe the right one), of a random length."""
    field = draw(st.sampled_from(FIELDS))
    n = draw(st.sampled_from([0, 1, 7, 8, 63, 64, 65, 128, 200]))
    values = {
        "bool_contents": [True] * n,
        "int_contents": [-1] * n,
        "int64_contents": [3] * n,
        "uint_contents": [2**32 - 1] * n,
        "uint64_contents": [2**64 - 1] * n,
        "fp32_contents": [0.5] * n,
        "fp64_contents": [1e300] * n,
        "bytes_contents": [b"\xff\xfe"] * n,
    }[field]
    getattr(t.contents, field).extend(values)


MUTATIONS = [
    "datatype", "shape", "dim_huge", "raw_len", "drop_input", "dup_input", "unknown_input", "rename", "params",
    "input_params", "to_typed", "both", "extra_raw", "fewer_raw", "outputs", "version", "model", "utf8",
    "long_string", "bytes_prefix", "empty", "many_inputs",
]  # fmt: skip


def mutate(req: pb.ModelInferRequest, how: str, draw) -> None:
    ins = req.inputs
    raw = req.raw_input_contents
    i = draw(st.integers(0, max(len(ins) - 1, 0)))
    if how == "datatype" and ins:
        ins[i].datatype = draw(st.sampled_from(DTYPES))
    elif how == "shape" and ins:
        del ins[i].shape[:]
        ins[i].shape.extend(draw(st.lists(st.sampled_from(DIMS), max_size=5)))
    elif how == "dim_huge" and ins and ins[i].shape:
        ins[i].shape[draw(st.integers(0, len(ins[i].shape) - 1))] = draw(
            st.sampled_from([2**62, 2**63 - 1, 2**40, 2**31])
        )
    elif how == "raw_len" and raw:
        j = draw(st.integers(0, len(raw) - 1))
        cut = draw(st.sampled_from([-9, -8, -4, -1, 1, 3, 4, 8, 1000]))
        raw[j] = raw[j][:cut] if cut < 0 else raw[j] + b"\x00" * cut
    elif how == "drop_input" and ins:
        del ins[i]
        if i < len(raw):
            del raw[i]
    elif how == "dup_input" and ins:
        ins.add().CopyFrom(ins[i])
        if i < len(raw):
            raw.append(raw[i])
    elif how == "unknown_input":
        ins.add(
            name=draw(st.sampled_from(["x", "", "dense ", "DENSE", "\u2603", "a" * 1000])),
            datatype="FP32",
            shape=[1, 64],
        )
        if raw:
            raw.append(b"\x00" * 256)
    elif how == "rename" and ins:
        ins[i].name = draw(
            st.sampled_from(["dense", "sparse_ids", "input_ids", "attention_mask", "text", "score", ""])
        )
    elif how == "params":
        for _ in range(draw(st.integers(1, 3))):
            _param(req.parameters[draw(st.sampled_from(PARAM_KEYS))], draw)
    elif how == "input_params" and ins:
        _param(ins[i].parameters[draw(st.sampled_from(PARAM_KEYS))], draw)
    elif how == "to_typed" and ins:
        del raw[:]
        for t in ins:
            _typed(t, draw)
    elif how == "both" and ins:
        _typed(ins[i], draw)
    elif how == "extra_raw":
        raw.append(draw(st.binary(max_size=64)))
    elif how == "fewer_raw" and raw:
        del raw[-1]
    elif how == "outputs":
        for _ in range(draw(st.integers(1, 3))):
            o = req.outputs.add(name=draw(st.sampled_from(["score", "embedding", "nope", ""])))
            if draw(st.booleans()):
                _param(o.parameters[draw(st.sampled_from(["binary_data", "classification", "x"]))], draw)
    elif how == "version":
        req.model_version = draw(st.sampled_from(["1", "2", "0", "-1", "abc", "1" * 40, "\u2603"]))
    elif how == "model":
        req.model_name = draw(
            st.sampled_from(["", "nope", "RANKER", "ranker/1", "../ranker", "\u2603", "x" * 500])
        )
    elif how == "utf8" and ins:  # invalid UTF-8 (and other awkward texts) in BYTES
        bad = draw(
            st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"ok \x80 ok", b"", b"   ", b"\x00"])
        )
        n = ins[0].shape[0] if ins[0].shape and 0 < ins[0].shape[0] <= 8 else 1
        ins[0].datatype = "BYTES"
        if raw:
            raw[0] = bytes_raw([bad] * n)
        else:
            del ins[0].contents.bytes_contents[:]
            ins[0].contents.bytes_contents.extend([bad] * n)
    elif how == "long_string" and raw and ins:
        ins[0].datatype = "BYTES"
        raw[0] = bytes_raw([b"a" * draw(st.sampled_from([40_000, 300_000]))])
    elif how == "bytes_prefix" and raw:  # a BYTES length prefix that lies
        j = draw(st.integers(0, len(raw) - 1))
        raw[j] = _LEN.pack(draw(st.sampled_from([0, 5, 2**31, 2**32 - 1]))) + raw[j][4:]
    elif how == "empty":
        del ins[:]
        del raw[:]
    elif how == "many_inputs":
        n = draw(st.sampled_from([65, 500]))
        for k in range(n):
            ins.add(name=f"in{k}", datatype="FP32", shape=[1])
        if raw:
            raw.extend([b"\x00\x00\x00\x00"] * n)


@st.composite
def malformed(draw) -> pb.ModelInferRequest:
    model = draw(st.sampled_from(MODELS))
    rows = draw(st.integers(1, 4))
    seq = draw(st.sampled_from([1, 3, 16]))
    req = valid(model, rows, seq, np.random.default_rng(draw(st.integers(0, 2**16))))
    if draw(st.booleans()) and model != "minilm":  # typed contents as the starting point
        for t, r in zip(req.inputs, req.raw_input_contents):
            dt = np.float32 if t.datatype == "FP32" else np.int64
            field = "fp32_contents" if t.datatype == "FP32" else "int64_contents"
            getattr(t.contents, field).extend(np.frombuffer(r, dtype=dt).tolist())
        del req.raw_input_contents[:]
    # text inputs get the BYTES mutations (invalid UTF-8, long texts, lying prefixes) more often
    choices = (
        MUTATIONS + ["utf8"] * 6 + ["long_string", "bytes_prefix"] * 2 if model == "minilm" else MUTATIONS
    )
    for how in draw(st.lists(st.sampled_from(choices), min_size=1, max_size=3)):
        mutate(req, how, draw)
    return req


# -- the test -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory, minilm_dir):
    """ranker, encoder and minilm, whatever the checkout holds: minilm is built for a fresh clone
    (``minilm_dir``), so its text path is fuzzed everywhere, CI included."""
    tmp = tmp_path_factory.mktemp("fuzz")
    repo = tmp / "repo"
    repo.mkdir()
    for m in ("ranker", "encoder"):
        (repo / m).symlink_to(REPO / m, target_is_directory=True)
    (repo / "minilm").symlink_to(minilm_dir.resolve(), target_is_directory=True)
    srv = start_server(tmp, "--no-build-models", repo=repo)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def ranker_ref():
    sess = ort.InferenceSession(str(REPO / "ranker" / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    return lambda dense, ids: sess.run(None, {"dense": dense, "sparse_ids": ids})[0]


def test_fuzz_malformed_requests(fuzzed, ranker_ref):
    server = fuzzed
    log_start = len(server.log())
    seen: collections.Counter = collections.Counter()
    bad: list[str] = []
    counts = {"sent": 0, "valid": 0}
    ch = grpc.insecure_channel(server.grpc_url, options=[("grpc.max_send_message_length", 256 * 2**20)])
    stub = pb_grpc.GRPCInferenceServiceStub(ch)

    @settings(
        max_examples=EXAMPLES, deadline=None, database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
    )  # fmt: skip
    @given(
        reqs=st.lists(malformed(), min_size=BATCH - VALID, max_size=BATCH - VALID),
        seed=st.integers(0, 2**32 - 1),
    )
    def batch(reqs, seed):
        rng = np.random.default_rng(seed)
        everything = list(reqs)
        expected = {}  # index -> ONNX Runtime's answer
        for k in range(VALID):
            rows = int(rng.integers(1, 9))
            r = valid("ranker", rows, 0, rng)
            dense = np.frombuffer(r.raw_input_contents[0], dtype=np.float32)
            ids = np.frombuffer(r.raw_input_contents[1], dtype=np.int64)
            if k % 2:  # half as typed contents, half raw
                r.inputs[0].contents.fp32_contents.extend(dense.tolist())
                r.inputs[1].contents.int64_contents.extend(ids.tolist())
                del r.raw_input_contents[:]
            expected[len(everything)] = ranker_ref(dense.reshape(rows, 64), ids.reshape(rows, 8))
            everything.append(r)
        order = list(range(len(everything)))
        rng.shuffle(order)  # the valid ones interleaved with the malformed, all in flight together
        futures = {i: stub.ModelInfer.future(everything[i], timeout=TIMEOUT_S) for i in order}
        for i, fut in futures.items():
            try:
                resp = fut.result()
                code = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                resp, code = None, exc.code()
                if code not in ALLOWED:
                    bad.append(f"{code.name}: {exc.details()}\n  request: {_brief(everything[i])}")
            seen[code.name] += 1
            counts["sent"] += 1
            if i in expected:
                counts["valid"] += 1
                want = expected[i]
                assert code == grpc.StatusCode.OK, f"a valid request failed: {code}"
                got = np.frombuffer(resp.raw_output_contents[0], dtype=np.float32).reshape(want.shape)
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        assert not bad, "statuses outside the contract:\n" + "\n".join(bad[:10])

    try:
        batch()
    finally:
        ch.close()
        print(f"\nfuzz: {counts['sent']} requests ({counts['valid']} valid), statuses {dict(seen)}")
    assert server.proc.poll() is None, "the server died"
    new_log = server.log()[log_start:]
    assert "Traceback" not in new_log, new_log[-3000:]
    assert counts["valid"] >= VALID * EXAMPLES // 2
    assert seen["INVALID_ARGUMENT"] > counts["sent"] // 2
    # every model's path was fuzzed: the server itself counted answers for each of them
    from tests.helpers import metric_samples

    answered = collections.Counter()
    for m in metric_samples(server.http_port):
        if m.name == "batchgate_requests_total":
            answered[m.labels.get("model")] += m.value
    assert all(answered[name] >= 100 for name in MODELS), answered
    # and it still serves
    with grpc.insecure_channel(server.grpc_url) as ch2:
        assert pb_grpc.GRPCInferenceServiceStub(ch2).ServerReady(pb.ServerReadyRequest(), timeout=5).ready


def _brief(req: pb.ModelInferRequest) -> str:
    ins = [(t.name, t.datatype, list(t.shape), "typed" if t.HasField("contents") else "") for t in req.inputs]
    return (
        f"model={req.model_name!r} version={req.model_version!r} inputs={ins} "
        f"raw={[len(r) for r in req.raw_input_contents]} params={dict((k, str(v).strip()) for k, v in req.parameters.items())} "
        f"outputs={[o.name for o in req.outputs]}"
    )[:1500]
