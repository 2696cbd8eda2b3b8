"""A small Python client for batchgate over gRPC (KServe v2), sync and asyncio.

    from batchgate.client import Client

    with Client("dns:///batchgate-headless.default.svc.cluster.local:8001", api_key="...") as bg:
        vectors = bg.embed(["A man is eating food.", "A man is eating bread."])   # float32 [2, 384]
        scores = bg.score(dense, sparse_ids)                                       # float32 [n]
        outputs = bg.infer("ranker", dense=dense, sparse_ids=sparse_ids)          # {name: array}

What the channel does, all from gRPC's own machinery (a service config), not a loop of ours:

* **Round robin** over every address the target resolves to: ``dns:///host:port`` re-resolves a
  headless Service's pod IPs when connections end (the server ages them out,
  ``--max-connection-age-s``); a list of addresses is a static resolver target
  (``ipv4:a:p,b:p``), names in the list resolved once when the client is made.
* **Retries** UNAVAILABLE (a draining replica, a queue that is full, a connection that failed) with
  exponential backoff, up to ``max_attempts`` tries and never past the call's deadline; each
  attempt is a fresh pick, so a retry lands on another replica. Client-side health checking
  (``healthCheckConfig``) stops sending to a replica as soon as it reports NOT_SERVING.
* **Deadline** (``timeout`` seconds) is the gRPC deadline, which batchgate also uses as the
  request's latency budget; ``latency_class`` is sent as the request parameter of that name.

Every failure is a ``BatchgateError`` subclass naming the call, the model, the status and the
server's message (``RateLimited.retry_after_s`` from the server's ``retry-after-ms``).
"""

from __future__ import annotations

import asyncio

import ipaddress
import json
import socket
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
import numpy as np

from batchgate.proto.inference.v2 import grpc_service_pb2 as pb
from batchgate.proto.inference.v2 import grpc_service_pb2_grpc as pb_grpc

SERVICE = "inference.GRPCInferenceService"
_NUMPY_TO_KSERVE = {
    np.dtype(np.bool_): "BOOL", np.dtype(np.uint8): "UINT8", np.dtype(np.uint16): "UINT16",
    np.dtype(np.uint32): "UINT32", np.dtype(np.uint64): "UINT64", np.dtype(np.int8): "INT8",
    np.dtype(np.int16): "INT16", np.dtype(np.int32): "INT32", np.dtype(np.int64): "INT64",
    np.dtype(np.float16): "FP16", np.dtype(np.float32): "FP32", np.dtype(np.float64): "FP64",
}  # fmt: skip
_KSERVE_TO_NUMPY = {v: k.newbyteorder("<") for k, v in _NUMPY_TO_KSERVE.items()}
_LEN = struct.Struct("<I")


# -- errors -----------------------------------------------------------------------------------------


class BatchgateError(Exception):
    """A call that failed: ``code`` (grpc.StatusCode), ``details`` (the server's message),
    ``method`` and ``model``."""

    def __init__(self, method: str, model: str, code: grpc.StatusCode, details: str, target: str) -> None:
        self.method = method
        self.model = model
        self.code = code
        self.details = details
        self.target = target
        what = f"{method} model '{model}'" if model else method
        super().__init__(f"{what} at {target}: {code.name}: {details}{self._hint()}")

    def _hint(self) -> str:
        return ""


class InvalidInput(BatchgateError):
    """INVALID_ARGUMENT: the request does not fit the model (the message names the input)."""


class ModelNotFound(BatchgateError):
    """NOT_FOUND: no such model or version on the server."""


class Unauthenticated(BatchgateError):
    def _hint(self) -> str:
        return " (pass api_key=... to the client)"


class PermissionDenied(BatchgateError):
    """The API key's tenant may not call this model."""


class RateLimited(BatchgateError):
    """RESOURCE_EXHAUSTED: the tenant is over a limit; ``retry_after_s`` says when to try again."""

    retry_after_s: float | None = None


class Unavailable(BatchgateError):
    """UNAVAILABLE after every retry: no replica could take the call."""

    def _hint(self) -> str:
        return " (retried with backoff; no replica accepted the call)"


class DeadlineExceeded(BatchgateError):
    """The deadline passed (on the way, in the server's queue, or the server refused a budget it
    could not meet)."""


class ServerError(BatchgateError):
    """Anything else (INTERNAL, UNIMPLEMENTED, ...)."""


_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidInput,
    grpc.StatusCode.NOT_FOUND: ModelNotFound,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.RESOURCE_EXHAUSTED: RateLimited,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
}


def _error(exc: grpc.RpcError, method: str, model: str, target: str) -> BatchgateError:
    code = exc.code() if callable(getattr(exc, "code", None)) else grpc.StatusCode.UNKNOWN
    details = (exc.details() if callable(getattr(exc, "details", None)) else None) or str(exc)
    err = _ERRORS.get(code, ServerError)(method, model, code, details, target)
    if isinstance(err, RateLimited):
        trailing = exc.trailing_metadata() if callable(getattr(exc, "trailing_metadata", None)) else None
        for key, value in trailing or ():
            if key == "retry-after-ms":
                try:
                    err.retry_after_s = float(value) / 1000
                except ValueError:
                    pass
    return err


# -- channel ----------------------------------------------------------------------------------------


def service_config(max_attempts: int = 5, initial_backoff_s: float = 0.05, max_backoff_s: float = 1.0) -> str:
    """The channel's service config: round robin over the resolved addresses, client-side health
    checks, and retries of UNAVAILABLE with exponential backoff (gRPC caps attempts at 5)."""
    return json.dumps({
        "loadBalancingConfig": [{"round_robin": {}}],
        "healthCheckConfig": {"serviceName": ""},
        "methodConfig": [{
            "name": [{"service": SERVICE}],
            "retryPolicy": {
                "maxAttempts": max(2, min(int(max_attempts), 5)),
                "initialBackoff": f"{initial_backoff_s:.3f}s",
                "maxBackoff": f"{max_backoff_s:.3f}s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"],
            },
        }],
    })  # fmt: skip


def target_of(addresses: str | Sequence[str]) -> str:
    """A gRPC target: a string is used as is (``dns:///svc:8001``, ``host:port``, ``ipv4:...``);
    a list of ``host:port`` becomes a static ``ipv4:``/``ipv6:`` list, names resolved now."""
    if isinstance(addresses, str):
        return addresses
    if not addresses:
        raise ValueError("no addresses given")
    v4, v6 = [], []
    for addr in addresses:
        host, sep, port = addr.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"address '{addr}' must be host:port")
        host = host.strip("[]")
        try:
            ips = [ipaddress.ip_address(host)]
        except ValueError:
            try:
                infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
            except socket.gaierror as exc:
                raise ValueError(f"address '{addr}': cannot resolve '{host}': {exc}") from None
            ips = list(dict.fromkeys(ipaddress.ip_address(i[4][0]) for i in infos))
        for ip in ips:
            (v4 if ip.version == 4 else v6).append(f"{ip}:{port}" if ip.version == 4 else f"[{ip}]:{port}")
    if v4 and v6:  # gRPC's static resolvers take one address family per target
        raise ValueError(f"addresses {list(addresses)} mix IPv4 and IPv6; give one family")
    return "ipv4:" + ",".join(v4) if v4 else "ipv6:" + ",".join(v6)


def channel_options(max_attempts: int, message_bytes: int) -> list[tuple[str, Any]]:
    return [
        ("grpc.service_config", service_config(max_attempts)),
        ("grpc.enable_retries", 1),
        ("grpc.max_receive_message_length", message_bytes),
        ("grpc.max_send_message_length", message_bytes),
    ]


# -- requests and answers ---------------------------------------------------------------------------


def _bytes_array(values: Any) -> np.ndarray:
    arr = np.asarray(values, dtype=object)
    return np.vectorize(lambda v: v.encode() if isinstance(v, str) else bytes(v), otypes=[object])(arr)


def build_request(model: str, arrays: Mapping[str, Any], params: Mapping[str, Any]) -> pb.ModelInferRequest:
    """A ModelInferRequest with raw contents; strings and bytes become BYTES."""
    req = pb.ModelInferRequest(model_name=model)
    for name, value in arrays.items():
        arr = value if isinstance(value, np.ndarray) else np.asarray(value)
        if arr.dtype.kind in "OUS":
            arr = _bytes_array(arr)
            datatype = "BYTES"
            raw = b"".join(_LEN.pack(len(b)) + b for b in arr.reshape(-1))
        else:
            datatype = _NUMPY_TO_KSERVE.get(arr.dtype.newbyteorder("="))
            if datatype is None:
                raise TypeError(f"input '{name}': numpy dtype {arr.dtype} has no KServe datatype")
            raw = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).tobytes()
        req.inputs.add(name=name, datatype=datatype, shape=list(arr.shape))
        req.raw_input_contents.append(raw)
    for key, value in params.items():
        if value is None:
            continue
        p = req.parameters[key]
        if isinstance(value, bool):
            p.bool_param = value
        elif isinstance(value, int):
            p.int64_param = value
        elif isinstance(value, float):
            p.double_param = value
        else:
            p.string_param = str(value)
    return req


def decode_response(resp: pb.ModelInferResponse) -> dict[str, np.ndarray]:
    out = {}
    for i, t in enumerate(resp.outputs):
        shape = tuple(t.shape)
        raw = resp.raw_output_contents[i] if i < len(resp.raw_output_contents) else None
        if t.datatype == "BYTES":
            items, pos = [], 0
            data = raw if raw is not None else b""
            if raw is None:
                items = list(t.contents.bytes_contents)
            while pos < len(data):
                (n,) = _LEN.unpack_from(data, pos)
                items.append(bytes(data[pos + 4 : pos + 4 + n]))
                pos += 4 + n
            out[t.name] = np.array(items, dtype=object).reshape(shape)
            continue
        dtype = _KSERVE_TO_NUMPY.get(t.datatype)
        if dtype is None:
            raise ServerError(
                "infer", resp.model_name, grpc.StatusCode.UNIMPLEMENTED,
                f"output '{t.name}' has datatype {t.datatype}, which this client cannot decode", "",
            )  # fmt: skip
        if raw is not None:
            out[t.name] = np.frombuffer(raw, dtype=dtype).reshape(shape)
        else:  # typed contents (a server that does not answer raw)
            field = {"FP32": "fp32_contents", "FP64": "fp64_contents", "INT64": "int64_contents",
                     "INT32": "int_contents", "BOOL": "bool_contents"}.get(t.datatype, "")  # fmt: skip
            out[t.name] = np.array(list(getattr(t.contents, field, [])), dtype=dtype).reshape(shape)
    return out


def _text_arrays(texts: str | Sequence[str]) -> tuple[dict[str, np.ndarray], bool]:
    single = isinstance(texts, str)
    items = [texts] if single else list(texts)
    if not items:
        raise ValueError("embed: no texts given")
    return {"text": _bytes_array(items).reshape(-1, 1)}, single


PAIR_SEPARATOR = "\x1f"  # a rerank model's row: query and document joined by U+001F
DEFAULT_BATCH = 64  # texts per request when the model's config cannot be read


def _chunks(column: np.ndarray, size: int) -> list[np.ndarray]:
    return [column[a : a + size] for a in range(0, len(column), size)]


def _pairs(query: str, texts: Sequence[str]) -> list[str]:
    if isinstance(texts, str):
        raise TypeError("rerank: texts must be a list of strings, not one string")
    return [query + PAIR_SEPARATOR + t for t in texts]


def _join(parts: list[np.ndarray]) -> np.ndarray:
    """Chunks' answers in order; per-token answers (each chunk as long as its own longest row)
    padded with zeros to the longest."""
    if len(parts) == 1:
        return parts[0]
    if parts[0].ndim == 3:
        width = max(p.shape[1] for p in parts)
        parts = [np.pad(p, ((0, 0), (0, width - p.shape[1]), (0, 0))) for p in parts]
    return np.concatenate(parts)


def sparse_rows(vectors: np.ndarray, top_k: int | None = None) -> list[dict[int, float]]:
    """Vocabulary-sized sparse vectors as {token id: weight} of their non-zero weights (``top_k``:
    the k largest only), as TEI's ``/embed_sparse`` answers them."""
    out = []
    for row in vectors:
        index = np.flatnonzero(row)
        if top_k is not None and len(index) > top_k:
            index = index[np.argsort(-row[index], kind="stable")[:top_k]]
        out.append({int(i): float(row[i]) for i in sorted(index)})
    return out


def token_rows(states: np.ndarray) -> list[np.ndarray]:
    """Per-token vectors [rows, longest, hidden] as each row's own [tokens, hidden]: the graph
    zeroes the positions past a row's tokens, and no token's vector is all zeros."""
    out = []
    for row in states:
        used = np.flatnonzero(np.any(row != 0, axis=1))
        out.append(row[: used[-1] + 1 if len(used) else 0])
    return out


class _Base:
    def __init__(
        self, addresses: str | Sequence[str] = "127.0.0.1:8001", *, api_key: str | None = None,
        latency_class: str | None = None, timeout: float | None = 10.0, max_attempts: int = 5,
        embed_model: str = "minilm", score_model: str = "ranker", max_message_bytes: int = 64 << 20,
        credentials: grpc.ChannelCredentials | None = None, rerank_model: str | None = None,
    ) -> None:  # fmt: skip
        self.target = target_of(addresses)
        self.rerank_model = rerank_model
        self._batch: dict[str, int] = {}  # model -> its max_batch_size (texts per request)
        self.api_key = api_key
        self.latency_class = latency_class
        self.timeout = timeout
        self.embed_model = embed_model
        self.score_model = score_model
        self._options = channel_options(max_attempts, max_message_bytes)
        self._credentials = credentials

    def _call_args(
        self, latency_class: str | None, budget_ms: float | None, timeout: float | None,
    ) -> tuple[dict, tuple, float | None]:  # fmt: skip
        params: dict[str, Any] = {"latency_class": latency_class or self.latency_class}
        if budget_ms is not None:
            params["latency_budget_ms"] = float(budget_ms)
        metadata = (("authorization", f"Bearer {self.api_key}"),) if self.api_key else ()
        return params, metadata, self.timeout if timeout is None else timeout


class Client(_Base):
    """Blocking client; thread-safe (one channel, many calls). Use as a context manager or ``close()``."""

    def __init__(self, addresses: str | Sequence[str] = "127.0.0.1:8001", **kwargs: Any) -> None:
        super().__init__(addresses, **kwargs)
        if self._credentials is not None:
            self._channel = grpc.secure_channel(self.target, self._credentials, options=self._options)
        else:
            self._channel = grpc.insecure_channel(self.target, options=self._options)
        self._stub = pb_grpc.GRPCInferenceServiceStub(self._channel)

    def infer(
        self, model: str, *, latency_class: str | None = None, budget_ms: float | None = None,
        timeout: float | None = None, **arrays: Any,
    ) -> dict[str, np.ndarray]:  # fmt: skip
        """Run ``model`` on named input arrays; returns {output name: array}."""
        params, metadata, deadline = self._call_args(latency_class, budget_ms, timeout)
        req = build_request(model, arrays, params)
        try:
            resp = self._stub.ModelInfer(req, timeout=deadline, metadata=metadata)
        except grpc.RpcError as exc:
            raise _error(exc, "infer", model, self.target) from None
        return decode_response(resp)

    def embed(
        self, texts: str | Sequence[str], *, model: str | None = None, prompt_name: str | None = None,
        latency_class: str | None = None, budget_ms: float | None = None, timeout: float | None = None,
    ) -> np.ndarray:  # fmt: skip
        """Embeddings of ``texts``: float32 [n, dim] for a list (any length: sent as requests of
        the model's batch size, in flight together, answered in order), [dim] for one string.
        ``prompt_name``: one of the model's prompts (else its default, if it has one)."""
        arrays, single = _text_arrays(texts)
        vectors = self._texts(
            model or self.embed_model, arrays["text"], prompt_name, latency_class, budget_ms, timeout
        )
        return vectors[0] if single else vectors

    def rerank(
        self, query: str, texts: Sequence[str], *, model: str | None = None, latency_class: str | None = None,
        budget_ms: float | None = None, timeout: float | None = None,
    ) -> np.ndarray:  # fmt: skip
        """A rerank model's raw score of (query, text) for each text, float32 [n], in order."""
        name = model or self.rerank_model
        if name is None:
            raise ValueError("rerank: name the rerank model (model=..., or rerank_model= on the client)")
        column = _bytes_array(_pairs(query, texts)).reshape(-1, 1)
        return self._texts(name, column, None, latency_class, budget_ms, timeout).reshape(-1)

    def _batch_size(self, model: str) -> int:
        size = self._batch.get(model)
        if size is None:
            try:
                cfg = self._stub.ModelConfig(pb.ModelConfigRequest(name=model), timeout=self.timeout).config
                size = cfg.max_batch_size or 1
            except grpc.RpcError:
                size = DEFAULT_BATCH  # the calls themselves will say what is wrong
            self._batch[model] = size
        return size

    def classify(
        self, texts: Sequence[str], *, model: str, raw_scores: bool = False, **kw: Any
    ) -> np.ndarray:  # fmt: skip
        """A classifier's probabilities of each label, float32 [n, labels] (``raw_scores``: its
        logits); a pair classifier's texts are pairs joined by U+001F."""
        column = _bytes_array(list(texts)).reshape(-1, 1)
        return self._texts(model, column, None, output="logits" if raw_scores else "probabilities", **kw)

    def embed_sparse(
        self, texts: Sequence[str], *, model: str, top_k: int | None = None, **kw: Any
    ) -> list[dict[int, float]]:  # fmt: skip
        """A sparse (SPLADE) model's vectors as {token id: weight} per text."""
        column = _bytes_array(list(texts)).reshape(-1, 1)
        return sparse_rows(self._texts(model, column, None, output="sparse_embedding", **kw), top_k)

    def embed_all(self, texts: Sequence[str], *, model: str, **kw: Any) -> list[np.ndarray]:
        """Every token's vector of each text, float32 [tokens, hidden] (an embedding model with the
        output ``token_embeddings``)."""
        column = _bytes_array(list(texts)).reshape(-1, 1)
        return token_rows(self._texts(model, column, None, output="token_embeddings", **kw))

    def _texts(
        self, model, column, prompt_name, latency_class=None, budget_ms=None, timeout=None, output=None
    ) -> np.ndarray:  # fmt: skip
        params, metadata, deadline = self._call_args(latency_class, budget_ms, timeout)
        if prompt_name is not None:
            params["prompt_name"] = prompt_name
        chunks = _chunks(column, self._batch_size(model)) if len(column) > 1 else [column]
        futures = [
            self._stub.ModelInfer.future(
                build_request(model, {"text": c}, params), timeout=deadline, metadata=metadata
            )
            for c in chunks
        ]
        parts = []
        try:
            for f in futures:
                outs = decode_response(f.result())
                parts.append(outs[output] if output else next(iter(outs.values())))
        except grpc.RpcError as exc:
            for f in futures:
                f.cancel()
            raise _error(exc, "infer", model, self.target) from None
        return _join(parts)

    def score(self, dense: Any, sparse_ids: Any, *, model: str | None = None, **kw: Any) -> np.ndarray:
        """Ranker scores: float32 [n] for dense [n, 64] and sparse_ids [n, 8]."""
        dense = np.asarray(dense, dtype=np.float32)
        ids = np.asarray(sparse_ids, dtype=np.int64)
        out = self.infer(model or self.score_model, **kw, dense=dense, sparse_ids=ids)
        return next(iter(out.values())).reshape(-1)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(_Base):
    """asyncio client (grpc.aio): make it inside the event loop that uses it; ``await close()``."""

    def __init__(self, addresses: str | Sequence[str] = "127.0.0.1:8001", **kwargs: Any) -> None:
        super().__init__(addresses, **kwargs)
        if self._credentials is not None:
            self._channel = grpc.aio.secure_channel(self.target, self._credentials, options=self._options)
        else:
            self._channel = grpc.aio.insecure_channel(self.target, options=self._options)
        self._stub = pb_grpc.GRPCInferenceServiceStub(self._channel)

    async def infer(
        self, model: str, *, latency_class: str | None = None, budget_ms: float | None = None,
        timeout: float | None = None, **arrays: Any,
    ) -> dict[str, np.ndarray]:  # fmt: skip
        params, metadata, deadline = self._call_args(latency_class, budget_ms, timeout)
        req = build_request(model, arrays, params)
        try:
            resp = await self._stub.ModelInfer(req, timeout=deadline, metadata=metadata)
        except grpc.RpcError as exc:
            raise _error(exc, "infer", model, self.target) from None
        return decode_response(resp)

    async def embed(
        self, texts: str | Sequence[str], *, model: str | None = None, prompt_name: str | None = None,
        latency_class: str | None = None, budget_ms: float | None = None, timeout: float | None = None,
    ) -> np.ndarray:  # fmt: skip
        arrays, single = _text_arrays(texts)
        vectors = await self._texts(
            model or self.embed_model, arrays["text"], prompt_name, latency_class, budget_ms, timeout
        )
        return vectors[0] if single else vectors

    async def rerank(
        self, query: str, texts: Sequence[str], *, model: str | None = None, latency_class: str | None = None,
        budget_ms: float | None = None, timeout: float | None = None,
    ) -> np.ndarray:  # fmt: skip
        name = model or self.rerank_model
        if name is None:
            raise ValueError("rerank: name the rerank model (model=..., or rerank_model= on the client)")
        column = _bytes_array(_pairs(query, texts)).reshape(-1, 1)
        return (await self._texts(name, column, None, latency_class, budget_ms, timeout)).reshape(-1)

    async def _batch_size(self, model: str) -> int:
        size = self._batch.get(model)
        if size is None:
            try:
                resp = await self._stub.ModelConfig(pb.ModelConfigRequest(name=model), timeout=self.timeout)
                size = resp.config.max_batch_size or 1
            except grpc.RpcError:
                size = DEFAULT_BATCH
            self._batch[model] = size
        return size

    async def classify(
        self, texts: Sequence[str], *, model: str, raw_scores: bool = False, **kw: Any
    ) -> np.ndarray:  # fmt: skip
        column = _bytes_array(list(texts)).reshape(-1, 1)
        return await self._texts(
            model, column, None, output="logits" if raw_scores else "probabilities", **kw
        )

    async def embed_sparse(
        self, texts: Sequence[str], *, model: str, top_k: int | None = None, **kw: Any
    ) -> list[dict[int, float]]:  # fmt: skip
        column = _bytes_array(list(texts)).reshape(-1, 1)
        return sparse_rows(await self._texts(model, column, None, output="sparse_embedding", **kw), top_k)

    async def embed_all(self, texts: Sequence[str], *, model: str, **kw: Any) -> list[np.ndarray]:
        column = _bytes_array(list(texts)).reshape(-1, 1)
        return token_rows(await self._texts(model, column, None, output="token_embeddings", **kw))

    async def _texts(
        self, model, column, prompt_name, latency_class=None, budget_ms=None, timeout=None, output=None
    ) -> np.ndarray:  # fmt: skip
        params, metadata, deadline = self._call_args(latency_class, budget_ms, timeout)
        if prompt_name is not None:
            params["prompt_name"] = prompt_name
        chunks = _chunks(column, await self._batch_size(model)) if len(column) > 1 else [column]
        calls = [
            self._stub.ModelInfer(
                build_request(model, {"text": c}, params), timeout=deadline, metadata=metadata
            )
            for c in chunks
        ]
        try:
            answers = await asyncio.gather(*calls)
        except grpc.RpcError as exc:
            for c in calls:
                c.cancel()
            raise _error(exc, "infer", model, self.target) from None
        outs = [decode_response(a) for a in answers]
        return _join([o[output] if output else next(iter(o.values())) for o in outs])

    async def score(self, dense: Any, sparse_ids: Any, *, model: str | None = None, **kw: Any) -> np.ndarray:
        dense = np.asarray(dense, dtype=np.float32)
        ids = np.asarray(sparse_ids, dtype=np.int64)
        out = await self.infer(model or self.score_model, **kw, dense=dense, sparse_ids=ids)
        return next(iter(out.values())).reshape(-1)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
