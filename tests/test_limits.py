"""Request limits: message size, rows, elements per tensor, string length, number of inputs.

Each refusal is a client-error status whose message names the limit, and it happens before the
request's data is allocated: a dim of 2^62 must neither overflow nor allocate. The codec is
tested directly (fast, exact) and through a live server with small limits set by environment.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

import grpc
import numpy as np
import pytest

from batchgate.gateway import codec as codec_mod
from batchgate.gateway.codec import Codec, Limits, deserialize_bytes, set_limits
from batchgate.gateway.errors import GatewayError, Kind
from batchgate.gateway.repository import load_model
from batchgate.gateway.transport.grpc import call_of
from batchgate.proto.inference.v2 import grpc_service_pb2 as pb
from batchgate.proto.inference.v2 import grpc_service_pb2_grpc as pb_grpc
from tests.conftest import REPO, ROOT, start_server


class Wire:
    """The codec as the gRPC transport drives it: the message translated to a ``Call`` first."""

    def __init__(self, codec: Codec) -> None:
        self.codec = codec

    def decode(self, req):
        return self.codec.decode(call_of(req))

    def _decode(self, req):
        return self.codec._decode(call_of(req).inputs)

    def _decode_fast(self, req):
        return self.codec._decode_fast(call_of(req).inputs)

    def __getattr__(self, name):
        return getattr(self.codec, name)


_LEN = struct.Struct("<I")


def open_encoder(dst: Path) -> Path:
    """The encoder without its max_dim parameters: variable dims bounded by nothing but the
    server-wide limits."""
    model = dst / "encoder"
    model.mkdir(parents=True)
    (model / "1").symlink_to(REPO / "encoder" / "1", target_is_directory=True)
    text = (REPO / "encoder" / "config.pbtxt").read_text()
    (model / "config.pbtxt").write_text(
        "\n".join(line for line in text.splitlines() if "max_dim." not in line)
    )
    return model


@pytest.fixture
def limits():
    """Small limits for one test; the defaults come back after."""
    old = codec_mod.LIMITS
    set_limits(Limits(max_tensor_elements=1000, max_string_bytes=100, max_inputs=4))
    yield codec_mod.LIMITS
    set_limits(old)


def refusal(fn) -> str:
    with pytest.raises(GatewayError) as info:
        fn()
    assert info.value.kind is Kind.INVALID
    return info.value.message


def encoder_request(shape, raw: bytes | None = b"", typed: list | None = None) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name="encoder")
    for name in ("input_ids", "attention_mask"):
        t = req.inputs.add(name=name, datatype="INT64", shape=shape)
        if typed is not None:
            t.contents.int64_contents.extend(typed)
    if raw is not None and typed is None:
        req.raw_input_contents.extend([raw, raw])
    return req


def test_settings_defaults_and_env(monkeypatch):
    from batchgate.gateway.config import Settings

    s = Settings()
    assert Limits.from_settings(s) == Limits()
    monkeypatch.setenv("BATCHGATE_MAX_TENSOR_ELEMENTS", "77")
    monkeypatch.setenv("BATCHGATE_MAX_STRING_BYTES", "88")
    monkeypatch.setenv("BATCHGATE_MAX_INPUTS", "3")
    assert Limits.from_settings(Settings()) == Limits(77, 88, 3)


def test_huge_dims_refused_before_allocation(tmp_path, limits):
    (spec,) = load_model(open_encoder(tmp_path))
    c = Wire(Codec(spec))
    for shape in ([1, 2**62], [1, 2**63 - 1], [64, 2**57], [2, 501]):
        for req in (encoder_request(shape), encoder_request(shape, typed=[1, 2, 3])):
            msg = refusal(lambda: c.decode(req))
            assert "max_tensor_elements" in msg and "BATCHGATE_MAX_TENSOR_ELEMENTS" in msg
            assert str(int(np.prod(shape, dtype=object))) in msg
    # at the limit: accepted
    arrays, rows = c.decode(encoder_request([2, 500], raw=np.zeros((2, 500), np.int64).tobytes()))
    assert rows == 2 and arrays["input_ids"].shape == (2, 500)


def test_huge_dims_with_default_limits_do_not_allocate(tmp_path):
    (spec,) = load_model(open_encoder(tmp_path))
    c = Wire(Codec(spec))
    msg = refusal(lambda: c.decode(encoder_request([1, 2**62])))
    assert "at most 16777216 per tensor (limit max_tensor_elements" in msg


def test_typed_count_checked_before_conversion(tmp_path):
    """Typed contents of the wrong length are refused by count, before np.array sees them."""
    (spec,) = load_model(open_encoder(tmp_path))
    msg = refusal(lambda: Wire(Codec(spec)).decode(encoder_request([1, 4], typed=[1, 2, 3])))
    assert "int64_contents holds 3 values" in msg and "needs 4" in msg


def test_rows_over_max_batch_size():
    (spec,) = load_model(REPO / "ranker")
    req = pb.ModelInferRequest(model_name="ranker")
    req.inputs.add(name="dense", datatype="FP32", shape=[257, 64])
    req.inputs.add(name="sparse_ids", datatype="INT64", shape=[257, 8])
    msg = refusal(lambda: Wire(Codec(spec)).decode(req))
    assert "max_batch_size=256" in msg


def test_number_of_inputs_capped_before_any_work(limits):
    (spec,) = load_model(REPO / "ranker")
    req = pb.ModelInferRequest(model_name="ranker")
    for i in range(5):
        req.inputs.add(name=f"x{i}", datatype="FP32", shape=[2**62])
    msg = refusal(lambda: Wire(Codec(spec)).decode(req))
    assert "5 inputs" in msg and "max_inputs" in msg and "BATCHGATE_MAX_INPUTS" in msg
    req = pb.ModelInferRequest(model_name="ranker", raw_input_contents=[b""] * 10)
    assert "max_inputs" in refusal(lambda: Wire(Codec(spec)).decode(req))


def test_raw_bytes_count_checked_before_allocation(limits):
    # 2^40 elements claimed, 8 bytes sent: refused by arithmetic, no 8 TiB object array
    msg = refusal(lambda: deserialize_bytes(b"\x00" * 8, 2**40, "text"))
    assert "too few for 1099511627776 elements" in msg
    # a length prefix over the limit is refused before the element is copied
    buf = _LEN.pack(101) + b"a" * 101
    msg = refusal(lambda: deserialize_bytes(buf, 1, "text", max_len=100))
    assert "101 bytes" in msg and "max_string_bytes" in msg
    assert deserialize_bytes(_LEN.pack(100) + b"a" * 100, 1, "text", 100)[0] == b"a" * 100


def test_string_length_limit_raw_and_typed(limits, minilm_dir):
    (spec,) = load_model(minilm_dir)
    c = Wire(Codec(spec))
    long = b"word " * 21  # 105 bytes > 100
    raw = pb.ModelInferRequest(
        model_name="minilm", raw_input_contents=[_LEN.pack(3) + b"abc" + _LEN.pack(len(long)) + long]
    )
    raw.inputs.add(name="text", datatype="BYTES", shape=[2, 1])
    msg = refusal(lambda: c.decode(raw))
    assert "element 1 is 105 bytes" in msg and "max_string_bytes" in msg
    typed = pb.ModelInferRequest(model_name="minilm")
    t = typed.inputs.add(name="text", datatype="BYTES", shape=[2])
    t.contents.bytes_contents.extend([b"abc", long])
    assert "max_string_bytes" in refusal(lambda: c.decode(typed))


def test_no_code_executing_deserialisation():
    """No pickle (or marshal, shelve, unsafe yaml, numpy pickles, eval/exec) anywhere in the code."""
    pattern = re.compile(
        r"\bc?[Pp]ickle\b|\bmarshal\b|\bshelve\b|\bdill\b|joblib|allow_pickle|yaml\.load\(|yaml\.unsafe_load"
        r"|torch\.load|(?<![.\w])eval\(|(?<![.\w])exec\("
    )
    hits = []
    for folder in ("gateway", "cache", "workers", "proto", "bench"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if pattern.search(line):
                    hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, "\n".join(hits)


# -- live ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def limited(tmp_path_factory, minilm_dir):
    tmp = tmp_path_factory.mktemp("limits")
    repo = tmp / "repo"
    open_encoder(repo)
    (repo / "ranker").symlink_to(REPO / "ranker", target_is_directory=True)
    (repo / "minilm").symlink_to(minilm_dir, target_is_directory=True)
    env = {
        "BATCHGATE_MAX_TENSOR_ELEMENTS": "1000",
        "BATCHGATE_MAX_STRING_BYTES": "100",
        "BATCHGATE_MAX_INPUTS": "4",
        "BATCHGATE_MAX_HTTP_BODY_BYTES": "65536",
    }
    srv = start_server(tmp, "--no-build-models", "--max-message-bytes", "65536", repo=repo, env=env)
    ch = grpc.insecure_channel(srv.grpc_url, options=[("grpc.max_send_message_length", 2**26)])
    yield srv, pb_grpc.GRPCInferenceServiceStub(ch)
    ch.close()
    assert srv.stop() == 0


def live_refusal(stub, req) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(req, timeout=10)
    return info.value


def test_live_limits(limited):
    srv, stub = limited
    # message size: gRPC refuses it itself, saying how large against what maximum
    big = encoder_request([1, 5000], raw=b"\x00" * 40_000)
    err = live_refusal(stub, big)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert re.search(r"larger than max \(\d+ vs\. 65536\)", err.details()), err.details()
    # elements per tensor (and a dim of 2^62)
    for shape in ([2, 501], [1, 2**62]):
        err = live_refusal(stub, encoder_request(shape))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_tensor_elements" in err.details()
    # number of inputs
    req = encoder_request([1, 4], raw=np.zeros(4, np.int64).tobytes())
    for i in range(3):
        req.inputs.add(name=f"extra{i}", datatype="INT64", shape=[1])
        req.raw_input_contents.append(b"\x00" * 8)
    err = live_refusal(stub, req)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_inputs" in err.details()
    # rows
    req = pb.ModelInferRequest(model_name="ranker")
    req.inputs.add(name="dense", datatype="FP32", shape=[300, 64])
    req.inputs.add(name="sparse_ids", datatype="INT64", shape=[300, 8])
    err = live_refusal(stub, req)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_batch_size=256" in err.details()
    long = b"word " * 30
    req = pb.ModelInferRequest(model_name="minilm", raw_input_contents=[_LEN.pack(len(long)) + long])
    req.inputs.add(name="text", datatype="BYTES", shape=[1, 1])
    err = live_refusal(stub, req)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_string_bytes" in err.details()
    # within every limit: served
    ok = encoder_request([2, 8], raw=np.ones((2, 8), np.int64).tobytes())
    resp = stub.ModelInfer(ok, timeout=10)
    assert list(resp.outputs[0].shape) == [2, 128]


def test_live_http_body_limit(limited):
    import urllib.error
    import urllib.request

    srv, _ = limited
    body = b'{"inputs": [' + b" " * 70_000 + b"]}"
    request = urllib.request.Request(
        f"http://127.0.0.1:{srv.http_port}/v2/models/encoder/infer", data=body, method="POST",
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=10)
    assert info.value.code == 413
    assert "65536" in info.value.read().decode()
    # a shape number beyond int64 is refused by name, not a 500
    doc = b'{"inputs": [{"name": "input_ids", "shape": [1, 100000000000000000000], "datatype": "INT64", "data": [1]}]}'
    request = urllib.request.Request(
        f"http://127.0.0.1:{srv.http_port}/v2/models/encoder/infer", data=doc, method="POST"
    )
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=10)
    assert info.value.code == 400 and "64-bit" in info.value.read().decode()


def _ranker_request(rows: int, ids: np.ndarray | None = None) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name="ranker")
    req.inputs.add(name="dense", datatype="FP32", shape=[rows, 64])
    req.inputs.add(name="sparse_ids", datatype="INT64", shape=[rows, 8])
    dense = np.arange(rows * 64, dtype=np.float32).reshape(rows, 64)
    ids = np.arange(rows * 8, dtype=np.int64).reshape(rows, 8) if ids is None else ids
    req.raw_input_contents.extend([dense.tobytes(), ids.tobytes()])
    return req


def test_fast_decode_agrees_with_the_full_checks_and_refuses_the_same(limits):
    """The one-pass decode of the common request gives what the general path gives, and every
    request it does not take falls through to the general path's refusal, word for word."""
    (spec,) = load_model(REPO / "ranker")
    c = Wire(Codec(spec))
    assert c._fast is not None  # ranker: numeric, fixed dims, batched
    for rows in (1, 3, 15):  # 15 x 64 elements: within the fixture's max_tensor_elements
        req = _ranker_request(rows)
        (fast, n), (full, m) = c.decode(req), c._decode(req)
        assert n == m == rows and fast.keys() == full.keys()
        for name in full:
            assert fast[name].dtype == full[name].dtype and fast[name].shape == full[name].shape
            assert np.array_equal(fast[name], full[name])
    bad = [
        _ranker_request(1, np.array([[0, 1, 2, 3, 4, 5, 6, 10000]], np.int64)),  # outside input_range
        _ranker_request(1, np.array([[-1, 1, 2, 3, 4, 5, 6, 7]], np.int64)),
        _ranker_request(257),  # over max_batch_size
    ]
    req = _ranker_request(2)
    req.inputs[1].shape[:] = [3, 8]  # rows disagree
    bad.append(req)
    req = _ranker_request(1)
    req.raw_input_contents[0] = req.raw_input_contents[0][:-4]  # a short buffer
    bad.append(req)
    req = _ranker_request(1)
    req.inputs[0].datatype = "FP64"
    bad.append(req)
    req = _ranker_request(1)
    req.inputs[1].name = "dense"  # given twice
    bad.append(req)
    req = _ranker_request(1)
    req.inputs[0].contents.fp32_contents.extend([0.0] * 64)  # both forms: the gRPC translation's to refuse
    assert "both typed contents and raw_input_contents" in refusal(lambda r=req: call_of(r))
    for req in bad:
        assert c._decode_fast(req) is None
        assert refusal(lambda r=req: c.decode(r)) == refusal(lambda r=req: c._decode(r))
    set_limits(Limits(max_tensor_elements=100))  # 64 x 2 rows: over the limit
    assert c._decode_fast(_ranker_request(2)) is None
    assert "max_tensor_elements" in refusal(lambda: c.decode(_ranker_request(2)))


def _encoder_request(rows: int, seq: int, mask_seq: int | None = None) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name="encoder")
    req.inputs.add(name="input_ids", datatype="INT64", shape=[rows, seq])
    req.inputs.add(name="attention_mask", datatype="INT64", shape=[rows, mask_seq or seq])
    ids = (np.arange(rows * seq, dtype=np.int64) % 1000).reshape(rows, seq)
    mask = np.ones((rows, mask_seq or seq), np.int64)
    req.raw_input_contents.extend([ids.tobytes(), mask.tobytes()])
    return req


def test_fast_decode_takes_variable_dims_within_max_dim_and_tied_lengths(limits):
    """A token model (encoder: input_ids and attention_mask [-1], one tied length, max_dim 512)
    goes through the one-pass decode too; a length over max_dim, lengths that disagree, a zero
    length or a wrong rank fall through to the general path's refusal, word for word."""
    (spec,) = load_model(REPO / "encoder")
    c = Wire(Codec(spec))
    assert c._fast is not None and c.tied and c.max_dim
    for rows, seq in ((1, 1), (2, 16), (3, 300)):
        set_limits(Limits(max_tensor_elements=rows * seq))
        req = _encoder_request(rows, seq)
        fast = c._decode_fast(req)
        assert fast is not None
        (arrays, n), (full, m) = fast, c._decode(req)
        assert n == m == rows and arrays.keys() == full.keys()
        for name in full:
            assert arrays[name].shape == full[name].shape == (rows, seq)
            assert np.array_equal(arrays[name], full[name])
    set_limits(Limits())
    bad = [_encoder_request(1, 513), _encoder_request(2, 16, mask_seq=15), _encoder_request(1, 16)]
    bad[2].inputs[0].shape[:] = [1, 0]  # a zero length (and a buffer that does not match it)
    req = _encoder_request(1, 16)
    req.inputs[1].shape[:] = [1, 4, 4]  # a wrong rank
    bad.append(req)
    req = _encoder_request(1, 16)
    req.raw_input_contents[0] = (np.full(16, 1000, np.int64)).tobytes()  # outside input_range
    bad.append(req)
    for req in bad:
        assert c._decode_fast(req) is None
        assert refusal(lambda r=req: c.decode(r)) == refusal(lambda r=req: c._decode(r))
