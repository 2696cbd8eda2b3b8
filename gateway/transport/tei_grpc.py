"""Hugging Face TEI's gRPC API (package ``tei.v1``: services Info, Embed, Predict, Rerank,
Tokenize; proto/tei/v1/tei.proto) on the gRPC port beside KServe's ``inference`` service.

A translation and nothing more (DESIGN.md, "A text call is one object"): each RPC, and each
message of a stream, is read into one ``TextCall`` (gateway/call.py), sent through the pipeline
(``Pipeline.texts``) after the door, and its ``TextAnswer`` written back as TEI's message. The
pipeline picks the model (the ``model`` metadata key, else the server's default for the call's
output), its defaults, limits and vector forms; nothing here looks a model up or computes on a
vector. Refusals go through one table, ``STATUS`` (TEI's codes, router/src/grpc/server.rs).

TEI's proto3 fields cannot tell "not sent" from false: ``truncate`` false leaves the choice to the
model's ``truncate`` setting (as TEI's REST routes do for an absent field), ``normalize`` unset is
true (as TEI). Streams answer in the order the messages came (TEI keeps it); at most
``stream_window`` messages are in flight, and while that many are unanswered the stream is not
read. A refused message ends its stream with the refusal's status (TEI's messages carry no error).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable

import grpc

from batchgate.gateway.admission import Account
from batchgate.gateway.admission.door import NONE_PRIOR, PRIOR
from batchgate.gateway.call import TextAnswer, TextCall
from batchgate.gateway.errors import GatewayError, Kind, clip, invalid
from batchgate.gateway.logs import REQUEST_ID_KEY, adopt_request_id
from batchgate.gateway.text import PAIR_SEPARATOR
from batchgate.proto.tei.v1 import tei_pb2 as pb
from batchgate.proto.tei.v1 import tei_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

MODEL_KEY = "model"  # gRPC metadata key naming the model a call is for (absent: the default model)

# Kind -> status. TEI's own: validation and empty input INVALID_ARGUMENT, overloaded
# RESOURCE_EXHAUSTED, unhealthy UNAVAILABLE, a backend (model) failure FAILED_PRECONDITION.
STATUS = {
    Kind.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    Kind.TOO_LARGE: grpc.StatusCode.INVALID_ARGUMENT,
    Kind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    Kind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    Kind.EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Kind.DEADLINE: grpc.StatusCode.DEADLINE_EXCEEDED,
    Kind.SLOW: grpc.StatusCode.DEADLINE_EXCEEDED,
    Kind.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    Kind.PERMISSION: grpc.StatusCode.PERMISSION_DENIED,
    Kind.UNSUPPORTED: grpc.StatusCode.UNIMPLEMENTED,
    Kind.PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    Kind.FAILED: grpc.StatusCode.FAILED_PRECONDITION,
}

SERVICES = tuple(s.full_name for s in pb.DESCRIPTOR.services_by_name.values())  # tei.v1.Info, ...
# Every method needs the key when there is a tenant file (TEI's interceptor guards them all), and
# the auth interceptor counts a refusal at the edge its call would have been counted at.
EDGE_OF = {
    f"/{s.full_name}/{m.name}": ("grpc_stream" if m.client_streaming else "grpc")
    for s in pb.DESCRIPTOR.services_by_name.values()
    for m in s.methods
}
# The services a server's text models make useful, by model kind (TEI: Info and Tokenize always;
# Embed for an embedding model, Predict for a classifier, Predict and Rerank for a reranker).
_SERVED_BY = {
    "tei.v1.Info": None, "tei.v1.Tokenize": None,
    "tei.v1.Embed": {"embedding", "sparse_embedding"},
    "tei.v1.Predict": {"classification", "rerank"},
    "tei.v1.Rerank": {"rerank"},
}  # fmt: skip
_MODEL_TYPE = {
    "embedding": pb.MODEL_TYPE_EMBEDDING,
    "classifier": pb.MODEL_TYPE_CLASSIFIER,
    "reranker": pb.MODEL_TYPE_RERANKER,
}
_LEFT = pb.TRUNCATION_DIRECTION_LEFT
_DIRECTIONS = (pb.TRUNCATION_DIRECTION_RIGHT, _LEFT)


def serving(kinds) -> dict[str, bool]:
    """Each tei.v1 service -> whether it has a model to serve, given the served text models' kinds
    (for ``grpc.health.v1``, as TEI reports its services)."""
    kinds = set(kinds)
    return {name: bool(kinds) if need is None else bool(kinds & need) for name, need in _SERVED_BY.items()}


# -- requests into text calls ----------------------------------------------------------------------


def _left(direction: int) -> bool:
    if direction not in _DIRECTIONS:  # proto3 enums are open: any number arrives
        raise invalid(
            f"'truncation_direction' is {direction}: TRUNCATION_DIRECTION_RIGHT (0) or "
            "TRUNCATION_DIRECTION_LEFT (1)", "truncation_direction",
        )  # fmt: skip
    return direction == _LEFT


def _optional(req, name: str):
    return getattr(req, name) if req.HasField(name) else None


def embed_call(req: pb.EmbedRequest, model: str | None) -> TextCall:
    return TextCall(
        "dense", model, [req.inputs], truncate=req.truncate or None, left=_left(req.truncation_direction),
        prompt_name=_optional(req, "prompt_name"), dimensions=_optional(req, "dimensions"),
        normalize=req.normalize if req.HasField("normalize") else True, field="inputs",
    )  # fmt: skip


def sparse_call(req: pb.EmbedSparseRequest, model: str | None) -> TextCall:
    return TextCall(
        "sparse", model, [req.inputs], truncate=req.truncate or None, left=_left(req.truncation_direction),
        prompt_name=_optional(req, "prompt_name"), field="inputs",
    )  # fmt: skip


def all_call(req: pb.EmbedAllRequest, model: str | None) -> TextCall:
    return TextCall(
        "tokens", model, [req.inputs], truncate=req.truncate or None, left=_left(req.truncation_direction),
        prompt_name=_optional(req, "prompt_name"), field="inputs",
    )  # fmt: skip


def predict_call(req: pb.PredictRequest, model: str | None) -> TextCall:
    return TextCall(
        "labels", model, [req.inputs], truncate=req.truncate or None, left=_left(req.truncation_direction),
        raw_scores=req.raw_scores, field="inputs",
    )  # fmt: skip


def pair_call(req: pb.PredictPairRequest, model: str | None) -> TextCall:
    """TEI's pair: ``inputs`` holds one text (classified alone) or two (classified as a pair)."""
    inputs = list(req.inputs)
    if len(inputs) not in (1, 2):
        raise invalid(f"'inputs' must have a single or two elements. Given: {len(inputs)}", "inputs")
    if len(inputs) == 2 and PAIR_SEPARATOR in inputs[0]:
        raise invalid("'inputs[0]' may not hold U+001F (the pair separator)", "inputs")
    return TextCall(
        "labels", model, [PAIR_SEPARATOR.join(inputs)], pairs=len(inputs) == 2,
        truncate=req.truncate or None, left=_left(req.truncation_direction), raw_scores=req.raw_scores,
        field="inputs",
    )  # fmt: skip


def rerank_call(req: pb.RerankRequest, model: str | None) -> TextCall:
    if not req.texts:
        raise invalid("'texts' cannot be empty", "texts")  # TEI's check and words
    return TextCall(
        "scores", model, list(req.texts), query=req.query, truncate=req.truncate or None,
        left=_left(req.truncation_direction), raw_scores=req.raw_scores, field="texts",
    )  # fmt: skip


# -- text answers into TEI's messages --------------------------------------------------------------


def _metadata(answer: TextAnswer, chars: int, t0: float) -> pb.Metadata:
    """TEI's per-call figures this server knows at its edge (the stages' own times stay 0)."""
    return pb.Metadata(
        compute_chars=chars, compute_tokens=sum(answer.tokens), total_time_ns=time.perf_counter_ns() - t0
    )


def embed_message(req, answer: TextAnswer, t0: float) -> pb.EmbedResponse:
    return pb.EmbedResponse(
        embeddings=answer.dense["float"][0], metadata=_metadata(answer, len(req.inputs), t0)
    )


def sparse_message(req, answer: TextAnswer, t0: float) -> pb.EmbedSparseResponse:
    indices, values = answer.sparse[0]
    return pb.EmbedSparseResponse(
        sparse_embeddings=[
            pb.SparseValue(index=i, value=v) for i, v in zip(indices.tolist(), values.tolist())
        ],
        metadata=_metadata(answer, len(req.inputs), t0),
    )


def all_message(req, answer: TextAnswer, t0: float) -> pb.EmbedAllResponse:
    return pb.EmbedAllResponse(
        token_embeddings=[pb.TokenEmbedding(embeddings=row) for row in answer.token_vectors[0]],
        metadata=_metadata(answer, len(req.inputs), t0),
    )


def predict_message(req, answer: TextAnswer, t0: float) -> pb.PredictResponse:
    """Every label's score, highest first (TEI's order)."""
    scores = answer.scores[0].tolist()
    order = sorted(range(len(scores)), key=lambda j: -scores[j])
    chars = sum(map(len, req.inputs)) if isinstance(req, pb.PredictPairRequest) else len(req.inputs)
    return pb.PredictResponse(
        predictions=[pb.Prediction(score=scores[j], label=answer.labels[j]) for j in order],
        metadata=_metadata(answer, chars, t0),
    )


def ranks_of(scores: list[float], texts: list[str] | None) -> list[pb.Rank]:
    """TEI's ranks: each text's index and score (and the text, if asked), highest score first."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    if texts is None:
        return [pb.Rank(index=i, score=scores[i]) for i in order]
    return [pb.Rank(index=i, score=scores[i], text=texts[i]) for i in order]


def rerank_message(req: pb.RerankRequest, answer: TextAnswer, t0: float) -> pb.RerankResponse:
    texts = list(req.texts)
    chars = len(req.query) * len(texts) + sum(map(len, texts))
    return pb.RerankResponse(
        ranks=ranks_of(answer.scores.tolist(), texts if req.return_text else None),
        metadata=_metadata(answer, chars, t0),
    )


def _model_of(context) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == MODEL_KEY:
            return value if isinstance(value, str) else value.decode("utf-8", "replace")
    return None


def _request_id(context) -> None:
    """Adopt the caller's ``x-request-id`` for the call's log lines and echo it back."""
    md = context.invocation_metadata() or ()
    rid = adopt_request_id(next((value for key, value in md if key == REQUEST_ID_KEY), None))
    if rid:
        context.set_trailing_metadata(((REQUEST_ID_KEY, rid),))


class TeiServicer(
    pb_grpc.InfoServicer, pb_grpc.EmbedServicer, pb_grpc.PredictServicer, pb_grpc.RerankServicer,
    pb_grpc.TokenizeServicer,
):  # fmt: skip
    """TEI's five services in one servicer over the server's pipeline and door."""

    def __init__(self, pipeline, metrics) -> None:
        self.pipeline = pipeline
        self.door = pipeline.door
        self.streams = pipeline.door.streams
        self.window = pipeline.settings.stream_window
        self._unary_edge = metrics.transport("grpc")
        self._stream_edge = metrics.transport("grpc_stream")
        self._readers: set[asyncio.Task] = set()  # each open stream's reader, stopped by a drain

    def add_to(self, server: grpc.aio.Server) -> None:
        for add in (pb_grpc.add_InfoServicer_to_server, pb_grpc.add_EmbedServicer_to_server,
                    pb_grpc.add_PredictServicer_to_server, pb_grpc.add_RerankServicer_to_server,
                    pb_grpc.add_TokenizeServicer_to_server):  # fmt: skip
            add(self, server)

    def end_streams(self) -> None:
        """Drain: every open stream stops being read, answers what it holds, then ends UNAVAILABLE."""
        for t in list(self._readers):
            t.cancel()

    async def _abort(self, context, exc: GatewayError) -> None:
        message = exc.message
        if exc.field and exc.field not in message:  # gRPC has no place for it but the words
            message = f"'{exc.field}': {message}"
        await context.abort(STATUS[exc.kind], message, getattr(exc, "trailing_metadata", ()))

    def _enter(self, context, model: str | None, edge):
        """The door's pass for a unary call (its refusal counted at ``edge``)."""
        try:
            return self.door.enter(context.invocation_metadata(), context.time_remaining())
        except GatewayError as exc:
            edge.failed(model or "", "", exc)
            raise

    # -- unary text calls -----------------------------------------------------------------------

    async def _text(self, request, context, parse: Callable, write: Callable):
        """One unary RPC: ``parse`` the request into a ``TextCall``, the pipeline's answer through
        ``write`` into TEI's response."""
        t0 = time.perf_counter_ns()
        _request_id(context)
        model = _model_of(context)
        edge = self._unary_edge
        try:
            with self._enter(context, model, edge) as pass_:
                try:
                    call = parse(request, model)
                except GatewayError as exc:  # taken, then refused before the pipeline: counted here
                    edge.failed(model or "", "", exc)
                    raise
                answer = await self.pipeline.texts(pass_, edge, call)
            return write(request, answer, t0)
        except GatewayError as exc:
            await self._abort(context, exc)
        except Exception as exc:  # a bug, not the client's fault: say so, keep serving
            log.exception("TEI gRPC call failed")
            await context.abort(
                grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {clip(exc, 512)}"
            )

    async def Embed(self, request, context):
        return await self._text(request, context, embed_call, embed_message)

    async def EmbedSparse(self, request, context):
        return await self._text(request, context, sparse_call, sparse_message)

    async def EmbedAll(self, request, context):
        return await self._text(request, context, all_call, all_message)

    async def Predict(self, request, context):
        return await self._text(request, context, predict_call, predict_message)

    async def PredictPair(self, request, context):
        return await self._text(request, context, pair_call, predict_message)

    async def Rerank(self, request, context):
        return await self._text(request, context, rerank_call, rerank_message)

    # -- streams of text calls ------------------------------------------------------------------

    async def EmbedStream(self, request_iterator, context):
        await self._text_stream(request_iterator, context, embed_call, embed_message)

    async def EmbedSparseStream(self, request_iterator, context):
        await self._text_stream(request_iterator, context, sparse_call, sparse_message)

    async def EmbedAllStream(self, request_iterator, context):
        await self._text_stream(request_iterator, context, all_call, all_message)

    async def PredictStream(self, request_iterator, context):
        await self._text_stream(request_iterator, context, predict_call, predict_message)

    async def PredictPairStream(self, request_iterator, context):
        await self._text_stream(request_iterator, context, pair_call, predict_message)

    async def _text_stream(self, request_iterator, context, parse: Callable, write: Callable) -> None:
        edge, texts = self._stream_edge, self.pipeline.texts

        def run(pass_, call: TextCall):  # the pipeline leaves the pass as the message's call ends
            return texts(pass_, edge, call)

        async def answered(request, answer: TextAnswer, t0: int) -> None:
            await context.write(write(request, answer, t0))

        await self._stream(request_iterator, context, parse, run, answered)

    async def RerankStream(self, request_iterator, context):
        """TEI's client stream: each message one (query, text) call, answered once the client has
        sent them all, as one ranking; ``raw_scores`` and ``return_text`` are the first message's."""
        first: list[pb.RerankStreamRequest] = []
        scores: list[float] = []
        texts: list[str] = []
        tokens = chars = 0
        t0 = time.perf_counter_ns()
        edge, run_texts = self._stream_edge, self.pipeline.texts

        def parse(req: pb.RerankStreamRequest, model: str | None) -> TextCall:
            if not first:
                first.append(req)
            return TextCall(
                "scores", model, [req.text], query=req.query, truncate=req.truncate or None,
                left=_left(req.truncation_direction), raw_scores=first[0].raw_scores, field="text",
            )  # fmt: skip

        def run(pass_, call: TextCall):
            return run_texts(pass_, edge, call)

        async def answered(req, answer: TextAnswer, _t0: int) -> None:
            nonlocal tokens, chars
            scores.append(float(answer.scores[0]))
            texts.append(req.text)
            tokens += sum(answer.tokens)
            chars += len(req.query) + len(req.text)

        await self._stream(request_iterator, context, parse, run, answered)
        if not first:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the stream held no text to rerank")
        meta = pb.Metadata(
            compute_chars=chars, compute_tokens=tokens, total_time_ns=time.perf_counter_ns() - t0
        )
        return pb.RerankResponse(
            ranks=ranks_of(scores, texts if first[0].return_text else None), metadata=meta
        )

    def _caller(self, context) -> Account | None:
        if self.door.open:
            return None
        caller = PRIOR.get().caller  # set by the auth interceptor, on the stream's metadata
        return caller if caller is not None else self.door.identify(context.invocation_metadata())

    async def _stream(
        self, request_iterator, context, parse: Callable, run: Callable, answered: Callable
    ) -> None:
        """Each message read as one call: ``parse(message, model)``, then ``run(pass_, call)`` once
        the door has taken it (the coroutine must leave the pass as it ends), its answer handed to
        ``answered(message, answer, t0)`` in the order the messages came. The key is checked once,
        as the stream opens; the stream holds a stream slot (per tenant and per connection)."""
        _request_id(context)
        model = _model_of(context)
        try:
            caller = self._caller(context)
            PRIOR.set(NONE_PRIOR)  # a call taker may have taken the stream; each message asks the shedder
            tenant = caller.tenant.name if caller is not None else ""
            peer = context.peer() or ""
            self.streams.take(tenant, peer)
        except GatewayError as exc:
            await self._abort(context, exc)
        try:
            await self._in_order(request_iterator, context, caller, model, parse, run, answered)
        finally:
            self.streams.give(tenant, peer)

    async def _in_order(self, request_iterator, context, caller, model, parse, run, answered) -> None:
        loop = asyncio.get_running_loop()
        door, edge, window = self.door, self._stream_edge, self.window
        plane = self.pipeline.plane
        # (message, its call's task or its refusal, when it was read) in the order read; None: the end
        order: deque = deque()
        ready = asyncio.Event()  # the head of ``order`` may be answerable
        room = asyncio.Event()  # the window has room again
        cut = False  # a drain ended the reading, not the client

        def start(request) -> tuple[asyncio.Future, int]:
            t0 = time.perf_counter_ns()
            pass_ = None
            try:
                pass_ = door.enter((), None, caller)  # each message is a call at the door
                call = parse(request, model)
            except GatewayError as exc:
                if pass_ is not None:  # taken, then refused before the pipeline
                    door.leave(exc, pass_)
                edge.failed(model or "", "", exc)
                refused = loop.create_future()
                refused.set_exception(exc)
                return refused, t0
            task = loop.create_task(run(pass_, call))
            task.add_done_callback(lambda _t: ready.set())
            return task, t0

        async def reader() -> None:
            nonlocal cut
            it = request_iterator.__aiter__()
            client_done = False
            try:
                while not plane.draining:
                    while len(order) >= window:  # backpressure: a full window stops the reading
                        room.clear()
                        await room.wait()
                    try:
                        request = await it.__anext__()
                    except StopAsyncIteration:
                        client_done = True
                        break
                    order.append((request, *start(request)))
                    ready.set()
            except asyncio.CancelledError:
                if not plane.draining:
                    raise
            cut = plane.draining and not client_done  # end_streams: answer what was read, then end
            order.append(None)
            ready.set()

        def reader_done(t: asyncio.Task) -> None:
            # a reader cancelled before it ran (a drain as the stream opened) or failed put no end mark
            if t.cancelled() or t.exception() is not None:
                order.append(None)
                ready.set()

        read_task = loop.create_task(reader())
        read_task.add_done_callback(reader_done)
        self._readers.add(read_task)
        try:
            while True:
                head = order[0] if order else False
                if head is False or (head is not None and not head[1].done()):
                    ready.clear()
                    await ready.wait()
                    continue
                if head is None:
                    break
                request, done, t0 = head
                if done.exception() is not None:
                    raise done.exception()
                await answered(request, done.result(), t0)
                order.popleft()
                room.set()
            if read_task.done() and not read_task.cancelled() and read_task.exception() is not None:
                raise read_task.exception()  # the reader's own failure (a bug) surfaces here
        except GatewayError as exc:
            await self._abort(context, exc)
        except Exception as exc:
            log.exception("TEI gRPC stream failed")
            await context.abort(
                grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {clip(exc, 512)}"
            )
        finally:
            self._readers.discard(read_task)
            read_task.cancel()
            for item in order:
                if item is None:
                    continue
                if not item[1].done():
                    item[1].cancel()
                elif not item[1].cancelled():
                    item[1].exception()  # retrieved: an answer nobody reads is not an error to log
        if cut:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "server is draining; retry on another replica")

    # -- model information and tokens -----------------------------------------------------------

    async def Info(self, request, context):
        """TEI's ``/info`` of the model the call names (metadata ``model``), else the default."""
        model = _model_of(context)
        try:
            caller = self._caller(context)
            doc = self.pipeline.text_info(model)
            if caller is not None and not caller.tenant.allows(doc["model_id"]):
                raise GatewayError(Kind.NOT_FOUND, f"unknown model '{clip(doc['model_id'])}'")
        except GatewayError as exc:
            await self._abort(context, exc)
        (kind,) = doc["model_type"]
        out = pb.InfoResponse(
            version=doc["version"], model_id=doc["model_id"], model_dtype=doc["model_dtype"],
            model_type=_MODEL_TYPE[kind], max_concurrent_requests=doc["max_concurrent_requests"],
            max_input_length=doc["max_input_length"], max_batch_tokens=doc["max_batch_tokens"],
            max_client_batch_size=doc["max_client_batch_size"],
            tokenization_workers=doc["tokenization_workers"],
        )  # fmt: skip
        for key in ("sha", "docker_label", "model_sha", "max_batch_requests"):
            if doc.get(key) is not None:
                setattr(out, key, doc[key])
        return out

    def _visible(self, pass_, model: str | None) -> str:
        """The model a tokenizer call reads (``model`` or the default), refused as unknown when the
        caller may not call it (so nothing is disclosed), as TEI's REST routes refuse it."""
        name, _kind = self.pipeline.kind_of(model)
        caller = pass_.caller
        if caller is not None and not caller.tenant.allows(name):
            raise GatewayError(Kind.NOT_FOUND, f"unknown model '{clip(name)}'")
        return name

    async def _tokenize(self, pass_, model, request) -> pb.EncodeResponse:
        with pass_:  # the door is left as the call ends
            name = self._visible(pass_, model)
            prompt = _optional(request, "prompt_name")
            (row,) = await self.pipeline.tokenize(name, [request.inputs], request.add_special_tokens, prompt)
        return pb.EncodeResponse(tokens=[pb.SimpleToken(**t) for t in row])

    async def _decode(self, pass_, model, request) -> pb.DecodeResponse:
        with pass_:
            name = self._visible(pass_, model)
            (text,) = await self.pipeline.decode(name, [list(request.ids)], request.skip_special_tokens)
        return pb.DecodeResponse(text=text)

    async def _unary_tokens(self, request, context, work: Callable):
        _request_id(context)
        model = _model_of(context)
        try:
            return await work(self._enter(context, model, self._unary_edge), model, request)
        except GatewayError as exc:
            await self._abort(context, exc)
        except Exception as exc:  # a bug, not the client's fault: say so, keep serving
            log.exception("TEI gRPC call failed")
            await context.abort(
                grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {clip(exc, 512)}"
            )

    async def _token_stream(self, request_iterator, context, work: Callable) -> None:
        async def answered(_request, message, _t0: int) -> None:
            await context.write(message)

        def parse(request, model: str | None):
            return model, request

        def run(pass_, call):
            return work(pass_, *call)

        await self._stream(request_iterator, context, parse, run, answered)

    async def Tokenize(self, request, context):
        return await self._unary_tokens(request, context, self._tokenize)

    async def Decode(self, request, context):
        return await self._unary_tokens(request, context, self._decode)

    async def TokenizeStream(self, request_iterator, context):
        await self._token_stream(request_iterator, context, self._tokenize)

    async def DecodeStream(self, request_iterator, context):
        await self._token_stream(request_iterator, context, self._decode)
