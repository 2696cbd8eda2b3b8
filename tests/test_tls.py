"""TLS and mutual TLS on both transports, certificate reload, and Redis over TLS with a password.

Every certificate is made here (the ``cryptography`` package): a CA, a server certificate for
127.0.0.1/localhost, a client certificate from the same CA, and a rogue client certificate from
another CA. Servers serve a one-model repository (the ranker) so they start quickly.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import grpc
import numpy as np
import onnxruntime as ort
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from batchgate.gateway.transport.tls import CertStore, TLSConfigError
from batchgate.proto.inference.v2 import grpc_service_pb2 as pb
from batchgate.proto.inference.v2 import grpc_service_pb2_grpc as pb_grpc
from tests.conftest import REPO, ROOT, RedisServer, ServerProcess, free_ports, start_server

TIMEOUT_S = 10.0

# -- certificates ---------------------------------------------------------------------------------


@dataclass
class Issued:
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    @property
    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    @property
    def key_pem(self) -> bytes:
        return self.key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    @property
    def serial(self) -> int:
        return self.cert.serial_number

    def write(self, folder: Path, stem: str) -> tuple[Path, Path]:
        """Write cert and key atomically (rename), as a Secret mount or cert-manager would."""
        cert, key = folder / f"{stem}.crt", folder / f"{stem}.key"
        for path, data in ((key, self.key_pem), (cert, self.cert_pem)):
            tmp = path.with_suffix(path.suffix + ".tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
        return cert, key


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_ca(cn: str) -> Issued:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(_name(cn))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),  # fmt: skip
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return Issued(cert, key)


def issue(ca: Issued, cn: str, *, server: bool) -> Issued:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    b = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), critical=False
        )
    )
    if server:
        b = b.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
    return Issued(b.sign(ca.key, hashes.SHA256()), key)


@dataclass
class PKI:
    dir: Path
    ca: Issued
    server: Issued
    client: Issued
    rogue: Issued  # a client certificate from another CA
    ca_file: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_cert: Path
    rogue_key: Path


def make_pki(folder: Path) -> PKI:
    folder.mkdir(parents=True, exist_ok=True)
    ca, other = make_ca("batchgate test CA"), make_ca("rogue CA")
    server, client, rogue = (
        issue(ca, "batchgate", server=True),
        issue(ca, "good client", server=False),
        issue(other, "rogue client", server=False),
    )
    ca_file = folder / "ca.crt"
    ca_file.write_bytes(ca.cert_pem)
    sc, sk = server.write(folder, "server")
    cc, ck = client.write(folder, "client")
    rc, rk = rogue.write(folder, "rogue")
    return PKI(folder, ca, server, client, rogue, ca_file, sc, sk, cc, ck, rc, rk)


# -- a TLS server process -----------------------------------------------------------------------


def ranker_repo(tmp: Path) -> Path:
    repo = tmp / "repo"
    repo.mkdir()
    (repo / "ranker").symlink_to(REPO / "ranker", target_is_directory=True)
    return repo


def grpc_creds(pki: PKI, client: str | None = "client") -> grpc.ChannelCredentials:
    if client is None:
        return grpc.ssl_channel_credentials(root_certificates=pki.ca.cert_pem)
    who: Issued = getattr(pki, client)
    return grpc.ssl_channel_credentials(pki.ca.cert_pem, who.key_pem, who.cert_pem)


def start_tls_server(
    tmp: Path, pki: PKI, *, mutual: bool, env: dict | None = None, timeout: float = 60.0
) -> ServerProcess:
    args = ["--tls-cert-file", str(pki.server_cert), "--tls-key-file", str(pki.server_key)]
    if mutual:
        args += ["--tls-client-ca-file", str(pki.ca_file)]
    return start_server(
        tmp, "--no-build-models", *args, repo=ranker_repo(tmp), env=env, ready_timeout=timeout,
        credentials=grpc_creds(pki, "client" if mutual else None),
    )  # fmt: skip


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> PKI:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def mtls_server(tmp_path_factory, pki) -> ServerProcess:
    srv = start_tls_server(tmp_path_factory.mktemp("mtls"), pki, mutual=True)
    yield srv
    assert srv.stop() == 0


# -- requests -------------------------------------------------------------------------------------


def ranker_request(rows: int = 3, seed: int = 0) -> tuple[pb.ModelInferRequest, np.ndarray]:
    rng = np.random.default_rng(seed)
    dense = rng.standard_normal((rows, 64), dtype=np.float32)
    ids = rng.integers(0, 10_000, (rows, 8), dtype=np.int64)
    req = pb.ModelInferRequest(model_name="ranker")
    req.inputs.add(name="dense", datatype="FP32", shape=[rows, 64])
    req.inputs.add(name="sparse_ids", datatype="INT64", shape=[rows, 8])
    req.raw_input_contents.extend([dense.tobytes(), ids.tobytes()])
    sess = ort.InferenceSession(str(REPO / "ranker" / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    (want,) = sess.run(None, {"dense": dense, "sparse_ids": ids})
    return req, want


def infer_over(channel: grpc.Channel) -> None:
    req, want = ranker_request()
    resp = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(req, timeout=TIMEOUT_S)
    got = np.frombuffer(resp.raw_output_contents[0], dtype=np.float32).reshape(want.shape)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def refused(channel: grpc.Channel) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        pb_grpc.GRPCInferenceServiceStub(channel).ServerLive(pb.ServerLiveRequest(), timeout=3.0)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value
    return info.value


def peer_serial(port: int, pki: PKI, alpn: str, client: str | None = None) -> int:
    """A fresh TLS connection's server certificate serial (raw ssl: what a new client is shown)."""
    ctx = ssl.create_default_context(cadata=pki.ca.cert_pem.decode())
    ctx.set_alpn_protocols([alpn])
    if client:
        ctx.load_cert_chain(getattr(pki, f"{client}_cert"), getattr(pki, f"{client}_key"))
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            der = tls.getpeercert(binary_form=True)
    return x509.load_der_x509_certificate(der).serial_number


def http_ssl(pki: PKI, client: str | None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cadata=pki.ca.cert_pem.decode())
    if client:
        ctx.load_cert_chain(getattr(pki, f"{client}_cert"), getattr(pki, f"{client}_key"))
    return ctx


async def http_get(url: str, ssl_ctx) -> tuple[int, str]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
        async with s.get(url, ssl=ssl_ctx) as r:
            return r.status, await r.text()


# -- mutual TLS -----------------------------------------------------------------------------------


def test_mtls_grpc_right_client_cert_is_served(mtls_server, pki):
    with grpc.secure_channel(mtls_server.grpc_url, grpc_creds(pki, "client")) as ch:
        infer_over(ch)


def test_mtls_grpc_tritonclient_with_ssl_options(mtls_server, pki):
    import tritonclient.grpc as tc

    req, want = ranker_request(rows=2, seed=3)
    dense = np.frombuffer(req.raw_input_contents[0], dtype=np.float32).reshape(2, 64)
    ids = np.frombuffer(req.raw_input_contents[1], dtype=np.int64).reshape(2, 8)
    client = tc.InferenceServerClient(
        mtls_server.grpc_url, ssl=True, root_certificates=str(pki.ca_file),
        private_key=str(pki.client_key), certificate_chain=str(pki.client_cert),
    )  # fmt: skip
    try:
        a, b = tc.InferInput("dense", [2, 64], "FP32"), tc.InferInput("sparse_ids", [2, 8], "INT64")
        a.set_data_from_numpy(dense)
        b.set_data_from_numpy(ids)
        got = client.infer("ranker", [a, b], client_timeout=TIMEOUT_S).as_numpy("score")
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        assert client.is_server_ready()
    finally:
        client.close()


def test_mtls_grpc_plaintext_refused(mtls_server):
    with grpc.insecure_channel(mtls_server.grpc_url) as ch:
        refused(ch)


def test_mtls_grpc_without_client_cert_refused(mtls_server, pki):
    with grpc.secure_channel(mtls_server.grpc_url, grpc_creds(pki, None)) as ch:
        refused(ch)


def test_mtls_grpc_rogue_client_cert_refused(mtls_server, pki):
    with grpc.secure_channel(mtls_server.grpc_url, grpc_creds(pki, "rogue")) as ch:
        refused(ch)


def test_mtls_http(mtls_server, pki):
    base = f"https://127.0.0.1:{mtls_server.http_port}"

    async def run():
        # the right client certificate: health and a JSON inference
        status, body = await http_get(base + "/v2/health/ready", http_ssl(pki, "client"))
        assert status == 200 and json.loads(body) == {"ready": True}
        req, want = ranker_request(rows=1, seed=5)
        dense = np.frombuffer(req.raw_input_contents[0], dtype=np.float32)
        ids = np.frombuffer(req.raw_input_contents[1], dtype=np.int64)
        doc = {"inputs": [
            {"name": "dense", "shape": [1, 64], "datatype": "FP32", "data": dense.tolist()},
            {"name": "sparse_ids", "shape": [1, 8], "datatype": "INT64", "data": ids.tolist()},
        ]}  # fmt: skip
        async with aiohttp.ClientSession() as s:
            async with s.post(base + "/v2/models/ranker/infer", json=doc, ssl=http_ssl(pki, "client")) as r:
                assert r.status == 200, await r.text()
                out = (await r.json())["outputs"][0]["data"]
        np.testing.assert_allclose(np.array(out, dtype=np.float32), want.reshape(-1), rtol=1e-5, atol=1e-6)
        # no client certificate, a rogue one, plaintext: refused at the handshake
        for ctx in (http_ssl(pki, None), http_ssl(pki, "rogue")):
            with pytest.raises((aiohttp.ClientError, ssl.SSLError, ConnectionError)):
                await http_get(base + "/v2/health/live", ctx)
        with pytest.raises((aiohttp.ClientError, ConnectionError)):
            await http_get(f"http://127.0.0.1:{mtls_server.http_port}/v2/health/live", None)

    asyncio.run(run())


# -- server-only TLS, and reloading the certificate -----------------------------------------------


def test_tls_and_certificate_reload(tmp_path, pki):
    """TLS without client certificates: served with the CA alone, plaintext refused; then the files
    are replaced and new connections on both ports see the new certificate, while an open channel
    keeps working; a broken replacement (key of another certificate) keeps the last good one."""
    certs = tmp_path / "certs"
    certs.mkdir()
    for name in ("server.crt", "server.key"):
        shutil.copy(pki.dir / name, certs / name)
    local = PKI(**{**pki.__dict__, "server_cert": certs / "server.crt", "server_key": certs / "server.key"})
    srv = start_tls_server(tmp_path, local, mutual=False)
    try:
        with grpc.insecure_channel(srv.grpc_url) as ch:
            refused(ch)
        first = pki.server.serial
        assert peer_serial(srv.grpc_port, pki, "h2") == first
        assert peer_serial(srv.http_port, pki, "http/1.1") == first
        status, _ = asyncio.run(
            http_get(f"https://127.0.0.1:{srv.http_port}/v2/health/live", http_ssl(pki, None))
        )
        assert status == 200
        with pytest.raises(Exception):
            asyncio.run(http_get(f"http://127.0.0.1:{srv.http_port}/v2/health/live", None))

        with grpc.secure_channel(srv.grpc_url, grpc_creds(pki, None)) as open_channel:
            infer_over(open_channel)
            renewed = issue(pki.ca, "batchgate renewed", server=True)
            renewed.write(certs, "server")
            assert peer_serial(srv.grpc_port, pki, "h2") == renewed.serial
            assert peer_serial(srv.http_port, pki, "http/1.1") == renewed.serial
            infer_over(open_channel)  # the connection made before the swap still serves
            with grpc.secure_channel(srv.grpc_url, grpc_creds(pki, None)) as fresh:
                infer_over(fresh)

            # a broken pair: this key belongs to another certificate; the renewed one stays
            other = issue(pki.ca, "other", server=True)
            (certs / "server.key").write_bytes(other.key_pem)
            assert peer_serial(srv.grpc_port, pki, "h2") == renewed.serial
            assert peer_serial(srv.http_port, pki, "http/1.1") == renewed.serial
            with grpc.secure_channel(srv.grpc_url, grpc_creds(pki, None)) as fresh:
                infer_over(fresh)
            assert "keeping the previous certificate" in srv.log()
            (certs / "server.crt").write_bytes(other.cert_pem)  # now the pair is whole again
            assert peer_serial(srv.grpc_port, pki, "h2") == other.serial
            assert peer_serial(srv.http_port, pki, "http/1.1") == other.serial
    finally:
        assert srv.stop() == 0


def test_bad_tls_files_stop_the_start(tmp_path, pki):
    """A key that does not match the certificate is a start failure with a message, not a server
    that fails every handshake."""
    grpc_port, http_port = free_ports(2)
    other = issue(pki.ca, "other", server=True)
    key = tmp_path / "wrong.key"
    key.write_bytes(other.key_pem)
    out = subprocess.run(
        [sys.executable, "-m", "batchgate", "serve", "--model-repository", str(ranker_repo(tmp_path)),
         "--host", "127.0.0.1", "--grpc-port", str(grpc_port), "--http-port", str(http_port),
         "--no-build-models", "--tls-cert-file", str(pki.server_cert), "--tls-key-file", str(key)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode != 0
    assert "do not form a usable pair" in out.stdout + out.stderr
    with pytest.raises(TLSConfigError, match="cannot read"):
        CertStore(tmp_path / "missing.crt", key)


def test_settings_need_cert_and_key_together(pki):
    from pydantic import ValidationError

    from batchgate.gateway.config import Settings

    with pytest.raises(ValidationError, match="go together"):
        Settings(tls_cert_file=pki.server_cert)
    with pytest.raises(ValidationError, match="needs tls_cert_file"):
        Settings(tls_client_ca_file=pki.ca_file)


# -- Redis over TLS, with a password ---------------------------------------------------------------


class RedisTLSServer(RedisServer):
    """redis-server listening on TLS only (``--port 0``), requiring a password and a client
    certificate signed by the test CA."""

    def __init__(self, workdir: Path, pki: PKI, password: str) -> None:
        super().__init__(workdir, password=password)
        self.pki = pki
        rc, rk = issue(pki.ca, "redis", server=True).write(workdir, "redis")
        self.cert, self.key = rc, rk

    @property
    def url(self) -> str:
        q = f"ssl_ca_certs={self.pki.ca_file}&ssl_certfile={self.pki.client_cert}&ssl_keyfile={self.pki.client_key}"
        return f"rediss://:{self.password}@127.0.0.1:{self.port}/0?{q}"

    def start(self, timeout: float = 10.0) -> RedisTLSServer:
        import redis

        args = ["redis-server", "--port", "0", "--tls-port", str(self.port), "--bind", "127.0.0.1",
                "--tls-cert-file", str(self.cert), "--tls-key-file", str(self.key),
                "--tls-ca-cert-file", str(self.pki.ca_file), "--tls-auth-clients", "yes",
                "--requirepass", self.password, "--save", "", "--appendonly", "no",
                "--dir", str(self.workdir), "--loglevel", "warning"]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        client = redis.Redis.from_url(self.url, socket_timeout=0.5)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if client.ping():
                    break
            except redis.RedisError:
                pass
            if self.proc.poll() is not None:
                out = self.proc.stdout.read().decode(errors="replace")
                if "TLS" in out and (
                    "not supported" in out or "Unrecognized" in out or "Bad directive" in out
                ):
                    pytest.skip(f"this redis-server has no TLS support: {out.strip()[-200:]}")
                raise AssertionError(f"TLS redis-server did not start:\n{out}")
            if time.monotonic() > deadline:
                raise AssertionError(f"TLS redis-server on port {self.port} did not answer")
            time.sleep(0.05)
        client.close()
        return self


@pytest.fixture
def redis_tls(tmp_path, pki):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    srv = RedisTLSServer(tmp_path, pki, password="s3cret-pw").start()
    yield srv
    srv.kill()


def test_redis_over_tls_with_auth(redis_tls):
    """The cache tier and the global rate limiter take a ``rediss://`` URL with a password and TLS
    options as they are (redis-py parses them); plaintext and a wrong password are refused."""
    import redis

    from batchgate.cache.breaker import Breaker
    from batchgate.cache.redis_tier import RedisTier
    from batchgate.gateway.admission.ratelimit import GlobalSpec, Rate, RedisLimiter

    async def run():
        tier = RedisTier(
            redis_tls.url, ttl_s=60.0, lookup_timeout_s=2.0, breaker=Breaker(3, 0.2), key_prefix=b"t:"
        )
        assert await tier.warm(connections=2, timeout_s=5.0)
        tier.put_many([b"t:k1", b"t:k2"], [b"v1", b"v2"])
        assert await tier.flush(5.0)
        got = None
        for _ in range(50):
            got = await tier.get_many([b"t:k1", b"t:k2", b"t:none"])
            if got is not None:
                break
            await asyncio.sleep(0.05)
        assert got == [b"v1", b"v2", None]
        assert tier.stats.write_errors == 0
        await tier.close()

        lim = RedisLimiter.from_url(redis_tls.url, timeout_s=1.0, connect_timeout_s=5.0)
        await lim.start()
        try:
            spec = GlobalSpec("t/*", ("bg:{t}:*:req",), Rate(10, 5), None, share=1.0)
            waits = [await lim.decide(spec, 1) for _ in range(8)]
            assert lim.up and lim.errors == 0
            assert sum(w == 0.0 for w in waits) == 5  # the burst, decided in Redis
        finally:
            await lim.close()

    asyncio.run(run())
    # what was written is in that Redis, and it reads the same through a plain client
    r = redis.Redis.from_url(redis_tls.url)
    (key,) = r.keys("*k1")  # (the tier adds its own prefix)
    assert r.get(key) == b"v1" and r.pttl(key) > 0
    r.close()
    # plaintext to the TLS port, a wrong password, or no client certificate: refused
    with pytest.raises(redis.RedisError):
        redis.Redis(host="127.0.0.1", port=redis_tls.port, password="s3cret-pw", socket_timeout=1).ping()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(redis_tls.url.replace("s3cret-pw", "wrong")).ping()
    no_cert = redis_tls.url.split("&ssl_certfile")[0]
    with pytest.raises(redis.RedisError):
        redis.Redis.from_url(no_cert, socket_timeout=2).ping()
