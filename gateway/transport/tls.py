"""TLS for both transports, with certificates that are re-read when their files change.

``CertStore`` owns the files (server certificate chain, its key, and optionally a client CA that
turns on mutual TLS). Every new connection asks it for the current material; it compares the
files' mtimes (and sizes) with the last load and re-reads them when any changed, so rotating a
certificate (cert-manager rewriting a mounted Secret, say) needs no restart. Connections already
open keep the certificate they shook hands with.

A half-written or mismatched pair (key not matching the certificate, unreadable PEM) is refused
by the reload: the previous certificate keeps being served and the failure is logged; the next
handshake after the files change again tries once more.

- gRPC: ``grpc_credentials()`` returns ``grpc.dynamic_ssl_server_credentials`` whose fetcher,
  called by gRPC core for each handshake, answers a new certificate configuration only when the
  files changed (``None`` = keep the current one).
- HTTP: ``ssl_context()`` returns the context given to aiohttp's ``TCPSite``. Its SNI callback
  (OpenSSL runs it for every ClientHello, with or without a server name) swaps the connection
  over to a context built from the current files.

With TLS configured the ports speak TLS only: a plaintext client fails its handshake. With a
client CA, a client must present a certificate signed by it (gRPC: the handshake fails; HTTP:
the same). Whether client certificates are required is fixed at start; the CA file itself is
reloaded with the rest.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc

log = logging.getLogger(__name__)

# Modern clients only; gRPC core applies its own minimum (TLS 1.2) on the gRPC port.
MIN_VERSION = ssl.TLSVersion.TLSv1_2


class TLSConfigError(OSError):
    """The TLS files cannot be read or do not form a usable certificate/key pair (an OSError so the
    CLI reports it as a start failure, like a port that cannot be bound)."""


@dataclass(frozen=True, slots=True)
class _Material:
    stamp: tuple  # (mtime_ns, size) of each file: what "changed" is measured against
    cert: bytes
    key: bytes
    client_ca: bytes | None
    context: ssl.SSLContext  # for the HTTP side, built (and so validated) from the same bytes


def _stamp(paths: list[Path]) -> tuple:
    out = []
    for p in paths:
        st = os.stat(p)
        out.append((st.st_mtime_ns, st.st_size, st.st_ino))
    return tuple(out)


class CertStore:
    def __init__(self, cert_file: Path, key_file: Path, client_ca_file: Path | None = None) -> None:
        self.cert_file = Path(cert_file)
        self.key_file = Path(key_file)
        self.client_ca_file = Path(client_ca_file) if client_ca_file else None
        self.mutual = self.client_ca_file is not None
        self._paths = [self.cert_file, self.key_file] + ([self.client_ca_file] if self.client_ca_file else [])
        self._lock = threading.Lock()  # gRPC core calls the fetcher from its own threads
        self.reloads = 0  # successful loads after the first
        self.reload_failures = 0
        self._bad_stamp: tuple | None = None  # files that failed to load: not retried until they change
        self._served_grpc: tuple | None = None  # stamp of the material gRPC core has now
        try:
            self._current = self._load()
        except (OSError, ssl.SSLError, ValueError) as exc:
            raise TLSConfigError(f"TLS: {exc}") from None

    @classmethod
    def from_settings(cls, settings) -> CertStore | None:
        if not settings.tls_cert_file:
            return None
        return cls(settings.tls_cert_file, settings.tls_key_file, settings.tls_client_ca_file)

    # -- loading ----------------------------------------------------------------------------------

    def _read(self, path: Path, what: str) -> bytes:
        try:
            return path.read_bytes()
        except OSError as exc:
            raise OSError(f"cannot read the {what} {path}: {exc.strerror or exc}") from None

    def _load(self) -> _Material:
        try:
            stamp = _stamp(self._paths)
        except OSError as exc:
            raise OSError(f"cannot read {exc.filename}: {exc.strerror or exc}") from None
        cert = self._read(self.cert_file, "certificate file (tls_cert_file)")
        key = self._read(self.key_file, "key file (tls_key_file)")
        ca = None
        if self.client_ca_file:
            ca = self._read(self.client_ca_file, "client CA file (tls_client_ca_file)")
        context = self._context(cert, key, ca)
        if _stamp(self._paths) != stamp:  # a writer was busy while we read: try on the next handshake
            raise OSError("the TLS files changed while being read")
        return _Material(stamp, cert, key, ca, context)

    def _context(self, cert: bytes, key: bytes, ca: bytes | None) -> ssl.SSLContext:
        """An SSLContext from PEM bytes; raises when the key does not match the certificate."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = MIN_VERSION
        try:
            # From the files themselves (load_cert_chain takes paths); _load checks afterwards that
            # they did not change since the bytes for gRPC were read. The password callback keeps
            # an encrypted key from prompting on a terminal.
            ctx.load_cert_chain(self.cert_file, self.key_file, password=lambda: b"")
        except ssl.SSLError as exc:
            raise ValueError(
                f"certificate {self.cert_file} and key {self.key_file} do not form a usable pair "
                f"(a PEM certificate chain and its unencrypted private key): {exc.reason or exc}"
            ) from None
        if ca is not None:
            try:
                ctx.load_verify_locations(cadata=ca.decode("ascii", "replace"))
            except ssl.SSLError as exc:
                raise ValueError(
                    f"client CA file {self.client_ca_file} holds no usable PEM certificate: {exc}"
                ) from None
            ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.set_alpn_protocols(["http/1.1"])
        return ctx

    def current(self) -> _Material:
        """The material for a new connection, re-read first when the files changed."""
        with self._lock:
            try:
                stamp = _stamp(self._paths)
            except OSError as exc:  # a file missing for a moment (a Secret being swapped)
                self._note_failure(None, exc)
                return self._current
            if stamp == self._current.stamp or stamp == self._bad_stamp:
                return self._current
            try:
                material = self._load()
            except (OSError, ssl.SSLError, ValueError) as exc:
                self._note_failure(stamp, exc)
                return self._current
            self._current = material
            self._bad_stamp = None
            self.reloads += 1
            log.info("TLS: reloaded the certificate from %s", self.cert_file, extra={"event": "tls_reload"})
            return material

    def _note_failure(self, stamp: tuple | None, exc: Exception) -> None:
        if stamp is not None and stamp == self._bad_stamp:
            return
        self._bad_stamp = stamp
        self.reload_failures += 1
        log.error(
            "TLS: keeping the previous certificate; reload failed: %s",
            exc,
            extra={"event": "tls_reload_failed"},
        )

    # -- gRPC -------------------------------------------------------------------------------------

    def _grpc_config(self, m: _Material):
        return grpc.ssl_server_certificate_configuration([(m.key, m.cert)], root_certificates=m.client_ca)

    def _fetch(self):
        """gRPC core's fetcher: a new configuration when the files changed, else None (keep)."""
        try:
            m = self.current()
            if m.stamp == self._served_grpc:
                return None
            self._served_grpc = m.stamp
            return self._grpc_config(m)
        except Exception:  # noqa: BLE001 - never let an exception into gRPC core's handshake
            log.exception("TLS: certificate fetch for gRPC failed; keeping the current one")
            return None

    def grpc_credentials(self) -> grpc.ServerCredentials:
        m = self._current
        self._served_grpc = m.stamp
        return grpc.dynamic_ssl_server_credentials(
            self._grpc_config(m), self._fetch, require_client_authentication=self.mutual
        )

    # -- HTTP -------------------------------------------------------------------------------------

    def ssl_context(self) -> ssl.SSLContext:
        """The listening context for aiohttp; each handshake is moved onto the current material's
        context (same verify mode, so mTLS holds throughout)."""
        base = self._current.context

        def on_hello(sslobj, _server_name, _ctx):
            try:
                ctx = self.current().context
                if sslobj.context is not ctx:
                    sslobj.context = ctx
            except Exception:  # noqa: BLE001 - keep the handshake going on the current context
                log.exception("TLS: certificate reload for HTTP failed")
            return None

        base.sni_callback = on_hello
        return base
