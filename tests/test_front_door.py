"""The front door against a real server process: what a caller without a key, or a hostile
client, costs the server before it is refused (RSS read from /proc, a concurrent call's latency),
model control, the caps, and the protocol surface (reflection v1, the REST repository API,
server metadata's extensions)."""

from __future__ import annotations

import json
import socket
import threading
import time

import grpc
import numpy as np
import pytest
from grpc_reflection.v1alpha import reflection_pb2

from batchgate.gateway.admission.tenants import hash_key
from batchgate.proto.inference.v2 import grpc_service_pb2 as pb
from batchgate.proto.inference.v2 import grpc_service_pb2_grpc as pb_grpc
from tests.conftest import REPO, start_server
from tests.test_http import call, json_body, ranker_arrays

ADMIN = "admin-" + "a" * 40
USER = "user-" + "u" * 40
MiB = 2**20


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


class PeakRss:
    """The server's RSS sampled every 20 ms while the block runs; ``growth`` = peak - before."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.before = rss_bytes(pid)
        self.peak = self.before
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, rss_bytes(self.pid))

    def __enter__(self) -> PeakRss:
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join(5)
        self.peak = max(self.peak, rss_bytes(self.pid))

    @property
    def growth(self) -> int:
        return self.peak - self.before


def ranker_request(rows: int = 2, **params) -> pb.ModelInferRequest:
    a = ranker_arrays(rows)
    req = pb.ModelInferRequest(model_name="ranker")
    req.inputs.add(name="dense", datatype="FP32", shape=[rows, 64])
    req.inputs.add(name="sparse_ids", datatype="INT64", shape=[rows, 8])
    req.raw_input_contents.extend([a["dense"].tobytes(), a["sparse_ids"].tobytes()])
    for k, v in params.items():
        req.parameters[k].string_param = v
    return req


def encoder_request(rows: int, seq: int) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name="encoder")
    ids = np.ones((rows, seq), np.int64)
    req.inputs.add(name="input_ids", datatype="INT64", shape=[rows, seq])
    req.inputs.add(name="attention_mask", datatype="INT64", shape=[rows, seq])
    req.raw_input_contents.extend([ids.tobytes(), ids.tobytes()])
    return req


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """Tenants (one admin), model control on, small HTTP deadlines so the slow-client test is quick."""
    tmp = tmp_path_factory.mktemp("frontdoor")
    repo = tmp / "repo"
    repo.mkdir()
    for m in ("ranker", "encoder"):
        (repo / m).symlink_to(REPO / m, target_is_directory=True)
    path = tmp / "tenants.json"
    path.write_text(json.dumps({"tenants": [
        {"name": "ops", "key_hashes": [hash_key(ADMIN)], "admin": True},
        {"name": "app", "key_hashes": [hash_key(USER)], "models": ["ranker", "encoder"]},
    ]}))  # fmt: skip
    env = {
        "BATCHGATE_MODEL_CONTROL": "true",
        "BATCHGATE_HTTP_HEADER_TIMEOUT_S": "3",
        "BATCHGATE_MAX_STREAMS_PER_CONNECTION": "2",
    }
    srv = start_server(
        tmp,
        "--api-keys-file",
        str(path),
        "--workers-per-device",
        "1",
        "--no-build-models",
        repo=repo,
        env=env,
    )
    yield srv
    assert srv.stop() == 0


def _stub(srv, **opts) -> tuple[grpc.Channel, pb_grpc.GRPCInferenceServiceStub]:
    options = [("grpc.max_send_message_length", 256 * MiB), ("grpc.max_receive_message_length", 256 * MiB)]
    ch = grpc.insecure_channel(srv.grpc_url, options=options + list(opts.items()))
    return ch, pb_grpc.GRPCInferenceServiceStub(ch)


USER_MD = (("x-api-key", USER),)
ADMIN_MD = (("x-api-key", ADMIN),)


def _keyed_latency(stub) -> float:
    t0 = time.perf_counter()
    stub.ModelInfer(ranker_request(), metadata=USER_MD, timeout=10)
    return time.perf_counter() - t0


# -- attacks without a key ----------------------------------------------------------------------------


@pytest.mark.serial
def test_keyless_60mib_rest_body_is_refused_from_its_headers(keyed):
    ch, stub = _stub(keyed)
    with ch:
        _keyed_latency(stub)  # warm
        body_len = 60 * MiB
        head = (
            f"POST /v2/models/ranker/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {body_len}\r\n\r\n"
        ).encode()
        latencies: list[float] = []
        with PeakRss(keyed.proc.pid) as rss:
            s = socket.create_connection(("127.0.0.1", keyed.http_port), timeout=10)
            t0 = time.perf_counter()
            s.sendall(head)

            def send_body() -> None:
                chunk = b"[" * MiB
                try:
                    for _ in range(60):
                        s.sendall(chunk)
                except OSError:
                    pass  # the server answered and closed: the rest is never read

            sender = threading.Thread(target=send_body, daemon=True)
            sender.start()
            answer = b""
            while b"\r\n\r\n" not in answer:
                data = s.recv(65536)
                if not data:
                    break
                answer += data
            elapsed = time.perf_counter() - t0
            for _ in range(5):
                latencies.append(_keyed_latency(stub))
            s.close()
            sender.join(15)
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    assert elapsed < 1.0, elapsed
    assert rss.growth < 150 * MiB, rss.growth / MiB
    assert max(latencies) < 0.25, latencies
    print(f"keyless 60 MiB REST: 401 in {elapsed * 1e3:.0f} ms, RSS +{rss.growth / MiB:.1f} MiB, "
          f"concurrent keyed call max {max(latencies) * 1e3:.1f} ms")  # fmt: skip


def _unauthenticated(server) -> float:
    """Keyless gRPC calls the server itself refused on their metadata (the interceptor counts them
    under empty model labels): a refusal core made on the message size never reaches it."""
    from tests.helpers import metric_samples

    return sum(
        s.value for s in metric_samples(server.http_port)
        if s.name == "batchgate_requests_total" and s.labels.get("outcome") == "unauthenticated"
        and s.labels.get("transport") == "grpc"
    )  # fmt: skip


def test_eight_keyless_60mib_grpc_messages_are_refused(keyed):
    big = pb.ModelInferRequest(model_name="ranker", raw_input_contents=[b"\x00" * (60 * MiB)])
    codes: list[grpc.StatusCode] = []
    ch, stub = _stub(keyed)
    before = _unauthenticated(keyed)
    with ch, PeakRss(keyed.proc.pid) as rss:

        def one() -> None:
            try:
                stub.ModelInfer(big, timeout=30)
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as exc:
                codes.append(exc.code())

        threads = [threading.Thread(target=one) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        latency = _keyed_latency(stub)
    assert len(codes) == 8 and grpc.StatusCode.OK not in codes, codes
    assert set(codes) <= {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
    # The key is refused before the size: the server's own count of keyless refusals saw all
    # eight (a server without auth answers RESOURCE_EXHAUSTED too, and counts none of them).
    assert _unauthenticated(keyed) - before == 8
    assert rss.growth < 200 * MiB, rss.growth / MiB
    print(f"8 keyless 60 MiB gRPC: {sorted({c.name for c in codes})}, RSS +{rss.growth / MiB:.1f} MiB, "
          f"keyed call after {latency * 1e3:.1f} ms")  # fmt: skip


def test_made_up_name_unloads_cost_nothing(keyed):
    ch, stub = _stub(keyed)
    with ch:

        def unloads(md, start: int, n: int) -> set:
            futures = [
                stub.RepositoryModelUnload.future(
                    pb.RepositoryModelUnloadRequest(model_name=f"made-up-{i}-{'x' * 100}"),
                    metadata=md,
                    timeout=30,
                )
                for i in range(start, start + n)
            ]
            codes = set()
            for f in futures:
                try:
                    f.result()
                    codes.add(grpc.StatusCode.OK)
                except grpc.RpcError as exc:
                    codes.add(exc.code())
            return codes

        for md in ((), ADMIN_MD):
            unloads(md, 0, 100)  # warm: gRPC's own pools for 100 calls at once
            before = rss_bytes(keyed.proc.pid)
            codes = set()
            for k in range(40):  # 4,000 names, 100 at a time: what stays, not what 4,000 at once cost
                codes |= unloads(md, 1000 + 100 * k, 100)
            growth = rss_bytes(keyed.proc.pid) - before
            want = grpc.StatusCode.NOT_FOUND if md else grpc.StatusCode.UNAUTHENTICATED
            assert codes == {want}, codes
            assert growth < 30 * MiB, growth / MiB
            print(f"4000 unloads of made-up names ({want.name}): RSS +{growth / MiB:.1f} MiB")
        assert stub.ModelReady(pb.ModelReadyRequest(name="ranker"), timeout=5).ready


def test_slow_http_connections_are_closed_by_the_server(keyed):
    conns = []
    for _ in range(200):
        s = socket.create_connection(("127.0.0.1", keyed.http_port), timeout=5)
        s.sendall(b"POST /v2/models/ranker/infer HTTP/1.1\r\nHost: x\r\n")  # the head never ends
        conns.append(s)
    t0 = time.monotonic()
    open_ = set(range(len(conns)))
    while open_ and time.monotonic() - t0 < 30:
        for i in list(open_):
            s = conns[i]
            s.settimeout(0.01)
            try:
                s.sendall(b"X")  # trickle
                if s.recv(1) == b"":
                    open_.discard(i)
            except TimeoutError:
                pass
            except OSError:
                open_.discard(i)
        time.sleep(0.2)
    elapsed = time.monotonic() - t0
    for s in conns:
        s.close()
    assert not open_, f"{len(open_)} of 200 still open after {elapsed:.1f}s"
    print(f"200 slow HTTP connections closed by the server within {elapsed:.1f} s (header timeout 3 s)")
    status, _, _ = call(keyed, "GET", "/v2/health/ready")
    assert status == 200


@pytest.mark.serial
def test_a_stream_that_never_reads_is_held_by_its_window(keyed):
    ch, stub = _stub(keyed)
    stop = threading.Event()
    sent = [0]
    req = encoder_request(64, 64)

    def requests():
        while not stop.is_set():
            sent[0] += 1
            yield req

    with ch:
        with PeakRss(keyed.proc.pid) as rss:
            call_ = stub.ModelStreamInfer(requests(), metadata=USER_MD, timeout=60)  # never iterated
            time.sleep(4.0)
            latency = _keyed_latency(stub)
            stop.set()
            call_.cancel()
        time.sleep(1.0)
        after = rss_bytes(keyed.proc.pid) - rss.before
    assert rss.growth < 300 * MiB, rss.growth / MiB
    assert latency < 0.25, latency
    print(f"never-reading stream: {sent[0]} messages taken by the client's side, RSS +{rss.growth / MiB:.1f} MiB "
          f"(+{after / MiB:.1f} MiB after it left), concurrent keyed call {latency * 1e3:.1f} ms")  # fmt: skip


def test_streams_are_capped_per_connection(keyed):
    ch, stub = _stub(keyed)
    with ch:
        gate = threading.Event()

        def idle():
            gate.wait(20)
            return
            yield  # noqa: B901 - a generator that sends nothing until the gate opens

        held = [stub.ModelStreamInfer(idle(), metadata=USER_MD, timeout=30) for _ in range(2)]
        time.sleep(0.5)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.ModelStreamInfer(iter([ranker_request()]), metadata=USER_MD, timeout=10))
        gate.set()
        for h in held:
            list(h)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_streams_per_connection" in err.value.details()
    # the slots came back
    ch, stub = _stub(keyed)
    with ch:
        (answer,) = list(stub.ModelStreamInfer(iter([ranker_request()]), metadata=USER_MD, timeout=10))
    assert not answer.error_message


# -- model control ------------------------------------------------------------------------------------


def test_model_control_is_admin_only_on_grpc_and_rest(keyed):
    ch, stub = _stub(keyed)
    unload = pb.RepositoryModelUnloadRequest(model_name="encoder")
    with ch:
        for md, code in (((), grpc.StatusCode.UNAUTHENTICATED), (USER_MD, grpc.StatusCode.PERMISSION_DENIED)):
            with pytest.raises(grpc.RpcError) as err:
                stub.RepositoryModelUnload(unload, metadata=md, timeout=10)
            assert err.value.code() == code, err.value.details()
        assert stub.ModelReady(pb.ModelReadyRequest(name="encoder"), timeout=5).ready
        # REST: same rule, same answers
        for headers, status in (({}, 401), ({"x-api-key": USER}, 403)):
            got, _, body = call(keyed, "POST", "/v2/repository/models/encoder/unload", b"", headers)
            assert got == status, body
        assert stub.ModelReady(pb.ModelReadyRequest(name="encoder"), timeout=5).ready
        # the admin unloads over REST, gRPC sees it, and loads it back over gRPC
        got, _, body = call(keyed, "POST", "/v2/repository/models/encoder/unload", b"", {"x-api-key": ADMIN})
        assert got == 200, body
        assert not stub.ModelReady(pb.ModelReadyRequest(name="encoder"), timeout=5).ready
        got, _, body = call(keyed, "POST", "/v2/repository/models/encoder/unload", b"", {"x-api-key": ADMIN})
        assert got == 404 and "not loaded" in json.loads(body)["error"]
        stub.RepositoryModelLoad(
            pb.RepositoryModelLoadRequest(model_name="encoder"), metadata=ADMIN_MD, timeout=60
        )
        assert stub.ModelReady(pb.ModelReadyRequest(name="encoder"), timeout=5).ready
        # REST load: the repository's names only; inline overrides refused as on gRPC
        got, _, body = call(
            keyed, "POST", "/v2/repository/models/..%2Franker/load", b"", {"x-api-key": ADMIN}
        )
        assert got == 404, body
        got, _, body = call(keyed, "POST", "/v2/repository/models/ranker/load",
                            {"parameters": {"config": "{}"}}, {"x-api-key": ADMIN})  # fmt: skip
        assert got == 501 and "config" in json.loads(body)["error"]
        got, _, body = call(keyed, "POST", "/v2/repository/models/ranker/load", b"", {"x-api-key": ADMIN})
        assert got == 200, body
        status, _, body = call(keyed, "POST", "/v2/repository/index", b"", {"x-api-key": USER})
        assert status == 200 and {m["name"] for m in json.loads(body)} == {"ranker", "encoder"}
        status, _, _ = call(keyed, "POST", "/v2/repository/index", b"")
        assert status == 401


def test_model_control_is_off_by_default(server):
    """The session server: open, default settings."""
    with grpc.insecure_channel(server.grpc_url) as ch:
        stub = pb_grpc.GRPCInferenceServiceStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name="ranker"), timeout=10)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "model_control" in err.value.details()
        assert stub.ModelReady(pb.ModelReadyRequest(name="ranker"), timeout=5).ready
    status, _, body = call(server, "POST", "/v2/repository/models/ranker/unload", b"")
    assert status == 403 and "model_control" in json.loads(body)["error"]
    status, _, body = call(server, "POST", "/v2/repository/models/ranker/load", b"")
    assert status == 403


# -- what errors give away -------------------------------------------------------------------------


def test_errors_echo_bounded_text_and_no_model_list(server):
    with grpc.insecure_channel(server.grpc_url) as ch:
        stub = pb_grpc.GRPCInferenceServiceStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.ModelInfer(ranker_request(latency_class="x" * MiB), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert len(err.value.details()) < 400, len(err.value.details())
        with pytest.raises(grpc.RpcError) as err:
            stub.ModelInfer(pb.ModelInferRequest(model_name="nope-" + "y" * 10_000), timeout=10)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert len(err.value.details()) < 400 and "ranker" not in err.value.details()
        req = ranker_request()
        req.model_name = "nope"
        with pytest.raises(grpc.RpcError) as err:
            stub.ModelInfer(req, timeout=10)
        assert "ranker" not in err.value.details() and "encoder" not in err.value.details()


BAD_REST = [
    ("int64 parameter", {**json_body(ranker_arrays(1)), "parameters": {"priority": 2**63}}, "int64"),
    ("deep nesting", b'{"inputs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    ("deep data", {"inputs": [{"name": "dense", "shape": [1, 64], "datatype": "FP32",
                               "data": json.loads("[" * 40 + "1" + "]" * 40)}]}, "nested deeper"),
    ("shape too big for data", {"inputs": [{"name": "dense", "shape": [2**40, 64], "datatype": "FP32",
                                            "data": [1]}]}, "max_tensor_elements"),
    ("parameters not an object", {"inputs": [{"name": "dense", "shape": [1], "datatype": "FP32", "data": [1],
                                              "parameters": [1]}]}, "'parameters' must be an object"),
    ("bool binary size", {"inputs": [{"name": "dense", "shape": [1], "datatype": "FP32",
                                      "parameters": {"binary_data_size": True}}]}, "binary_data_size"),
]  # fmt: skip


@pytest.mark.parametrize("case", BAD_REST, ids=[c[0] for c in BAD_REST])
def test_rest_bad_input_is_400(server, case):
    _, body, text = case
    before = server.log().count("Traceback")
    status, _, payload = call(server, "POST", "/v2/models/ranker/infer", body)
    assert status == 400, payload[:300]
    assert text in json.loads(payload)["error"]
    assert server.log().count("Traceback") == before


# -- protocol surface ---------------------------------------------------------------------------------


def test_reflection_v1_and_v1alpha(server):
    from google.protobuf import descriptor_pb2

    for package in ("grpc.reflection.v1", "grpc.reflection.v1alpha"):
        with grpc.insecure_channel(server.grpc_url) as ch:
            # v1 and v1alpha are the same messages under two package names
            call_ = ch.stream_stream(
                f"/{package}.ServerReflection/ServerReflectionInfo",
                request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
            )
            reqs = [
                reflection_pb2.ServerReflectionRequest(list_services=""),
                reflection_pb2.ServerReflectionRequest(
                    file_containing_symbol="inference.GRPCInferenceService"
                ),
                reflection_pb2.ServerReflectionRequest(file_containing_symbol=f"{package}.ServerReflection"),
            ]
            listed, described, own = list(call_(iter(reqs), timeout=10))
        names = {s.name for s in listed.list_services_response.service}
        assert {"inference.GRPCInferenceService", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
                "grpc.reflection.v1alpha.ServerReflection"} <= names, names  # fmt: skip
        assert described.file_descriptor_response.file_descriptor_proto
        fd = descriptor_pb2.FileDescriptorProto.FromString(
            own.file_descriptor_response.file_descriptor_proto[0]
        )
        assert fd.package == package


def test_server_metadata_lists_exactly_the_extensions_served(server):
    with grpc.insecure_channel(server.grpc_url) as ch:
        meta = pb_grpc.GRPCInferenceServiceStub(ch).ServerMetadata(pb.ServerMetadataRequest(), timeout=5)
    want = {"model_repository", "model_configuration", "statistics", "binary_tensor_data"}
    assert set(meta.extensions) == want
    status, _, body = call(server, "GET", "/v2")
    assert status == 200 and set(json.loads(body)["extensions"]) == want


@pytest.mark.serial
def test_concurrent_rpc_cap_refuses_before_python(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "ranker").symlink_to(REPO / "ranker", target_is_directory=True)
    srv = start_server(tmp_path, repo=repo, env={"BATCHGATE_MAX_CONCURRENT_RPCS": "2"})
    try:
        gate = threading.Event()

        def one_then_idle():
            yield ranker_request()
            gate.wait(20)

        chans = [grpc.insecure_channel(srv.grpc_url) for _ in range(3)]
        held = []
        for c in chans[:2]:
            end = time.monotonic() + 10
            while True:  # the start-up health checks may still be counted for a moment
                h = pb_grpc.GRPCInferenceServiceStub(c).ModelStreamInfer(one_then_idle(), timeout=30)
                try:
                    next(h)  # answered: this stream is open and holds its slot
                    break
                except grpc.RpcError as exc:
                    if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > end:
                        raise
                    time.sleep(0.05)
            held.append(h)
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.GRPCInferenceServiceStub(chans[2]).ModelInfer(ranker_request(), timeout=10)
        gate.set()
        for h in held:
            list(h)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        end = time.monotonic() + 10  # the server counts a call done a moment after the client does
        while True:
            try:
                pb_grpc.GRPCInferenceServiceStub(chans[2]).ModelInfer(ranker_request(), timeout=10)
                break
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > end:
                    raise
                time.sleep(0.05)
        for c in chans:
            c.close()
    finally:
        assert srv.stop() == 0


def test_a_second_server_on_a_busy_port_exits_with_address_in_use(server, tmp_path):
    import subprocess
    import sys

    from tests.conftest import ROOT

    for grpc_port, http_port in ((server.grpc_port, 0), (0, server.http_port)):
        proc = subprocess.run(
            [sys.executable, "-m", "batchgate", "serve", "--model-repository", str(REPO), "--no-build-models",
             "--host", "127.0.0.1", "--grpc-port", str(grpc_port), "--http-port", str(http_port)],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode != 0
        assert "address in use" in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-2000:]


def test_message_limit_follows_the_served_models():
    from batchgate.gateway.codec import Limits
    from batchgate.gateway.repository import load_model
    from batchgate.gateway.transport.server import MIN_MESSAGE_BYTES, derived_message_bytes, request_bytes

    limits = Limits()
    ranker = load_model(REPO / "ranker")[0]
    encoder = load_model(REPO / "encoder")[0]
    assert request_bytes(ranker, limits) == 256 * (64 * 4 + 8 * 10)  # typed INT64: up to 10 bytes each
    assert request_bytes(encoder, limits) == 2 * 64 * 512 * 10  # max_dim.<input> bounds the -1 dim
    assert derived_message_bytes([ranker, encoder], limits) == MIN_MESSAGE_BYTES
    # a variable dim without max_dim: the element cap bounds it, and the limit follows
    import dataclasses

    encoder = dataclasses.replace(
        encoder, params=dataclasses.replace(encoder.params, max_dim={"attention_mask": 512})
    )
    assert request_bytes(encoder, limits) == (1 << 24) * 10 + 64 * 512 * 10
    assert derived_message_bytes([ranker, encoder], limits) == 64 * MiB  # capped: set it for more
