"""Hugging Face TEI's REST API on the listener: ``POST /embed``, ``/rerank``, ``/embed_all``,
``/embed_sparse``, ``/similarity``, ``/predict``, ``/tokenize``, ``/decode``, ``GET /info``,
``/health``; TEI's entry routes ``POST /`` and ``POST /invocations`` (answered by the model's kind,
as TEI's router does: what ``huggingface_hub.InferenceClient(base_url=...)`` and the HF-API
embedders of Haystack, LlamaIndex and LiteLLM post to), ``GET /`` and ``GET /ping``; and all of
it again under ``/tei/{model}``, so a one-model TEI client works with any model by its base URL.

Only translation lives here: each body into one ``TextCall`` (gateway/call.py), the
``TextAnswer`` into TEI's JSON. Which model a call without one gets is the pipeline's (setting
``tei_default_model``). TEI ignores body fields it does not know, and so do these routes (logged
once per name). ``/rerank`` also takes the Cohere-shaped body infinity and vLLM serve there
(``documents``, ``top_n``, ``return_documents``) and answers in that shape. Errors are TEI's
``{"error", "error_type"}`` (``fields.tei_error``).
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

import numpy as np
from aiohttp import web

from batchgate.gateway.call import TextCall
from batchgate.gateway.errors import GatewayError, clip, invalid, not_found
from batchgate.gateway.text import PAIR_SEPARATOR
from batchgate.gateway.transport.bodies import (
    DecodeRequest,
    SimilarityParameters,
    EmbedAllRequest,
    EmbedRequest,
    EmbedSparseRequest,
    PredictRequest,
    RerankRequest,
    SimilarityRequest,
    TokenizeRequest,
    keys,
    model_field,
    read,
)
from batchgate.gateway.transport.fields import (
    EMPTY,
    MAX_INPUTS,
    TextRoutes,
    documents_of,
    either,
    ids_rows,
    is_ids,
    json_response,
    latency_of,
    left_of,
    ranked,
    request_echo,
    tei_error,
    texts_of,
)

if TYPE_CHECKING:
    from batchgate.gateway.transport.http import Http
    from batchgate.gateway.transport.server import Server


def _model(request: web.Request, named: str | None) -> str | None:
    """The model a TEI call names: the path's (``/tei/{model}``), else the body's ``model`` (an
    extension), else None (the server's default)."""
    path = request.match_info.get("model")
    if path is not None and named is not None and named != path:
        raise invalid(f"'model' names another model than this base URL's ('{clip(path)}')", "model")
    return path or named


def _inputs(value: str | list, call: TextCall) -> TextCall:
    """TEI's ``inputs``: a text, texts, or the model's own token ids."""
    if value == []:
        raise invalid(EMPTY, "inputs")
    if is_ids(value):
        call.ids = ids_rows(value)
    else:
        call.texts = texts_of(value, "inputs")
    return call


def _truncation(body) -> dict:
    return {"truncate": body.truncate, "left": left_of(body.truncation_direction)}


def embed_call(request: web.Request, body: EmbedRequest) -> TextCall:
    call = TextCall(
        "dense", _model(request, body.model), normalize=either(body.normalize, True), prompt_name=body.prompt_name,
        dimensions=body.dimensions, parameters=latency_of(request, body), field="inputs",
        long_inputs=body.long_inputs, late_chunking=either(body.late_chunking, False), **_truncation(body),
    )  # fmt: skip
    return _inputs(body.inputs, call)


def _headers(headers: dict, answer) -> dict:
    return {**headers, "x-compute-tokens": str(sum(answer.tokens))}


def embed_body(body: EmbedRequest, call: TextCall, answer, headers: dict) -> web.Response:
    headers = _headers(headers, answer)
    headers["x-compute-characters"] = str(sum(map(len, call.texts)))
    return json_response(answer.dense["float"].tolist(), headers)


def rerank_call(request: web.Request, body: RerankRequest) -> TextCall:
    cohere = body.documents is not None and body.texts is None
    if cohere:
        texts = documents_of(body.documents)
    else:
        if body.texts is None:
            raise invalid("'texts' is required: a list of texts", "texts")
        if body.texts == []:
            raise invalid(EMPTY, "texts")
        texts = texts_of(body.texts, "texts")
    return TextCall(
        "scores", _model(request, body.model), texts=texts, query=body.query,
        raw_scores=either(body.raw_scores, False), parameters=latency_of(request, body),
        field="documents" if cohere else "texts", **_truncation(body),
    )  # fmt: skip


def rerank_body(body: RerankRequest, call: TextCall, answer, headers: dict) -> web.Response:
    top_n = body.top_n
    if call.field == "documents":  # infinity's and vLLM's Cohere-shaped answer
        total = sum(answer.tokens)
        out = {
            "object": "rerank", "id": f"rerank-{uuid.uuid4().hex}", "created": int(time.time()),
            "model": answer.model, "results": ranked(answer, top_n, either(body.return_documents, False)),
            "usage": {"prompt_tokens": total, "total_tokens": total},
        }  # fmt: skip
        return json_response(out, _headers(headers, answer))
    scores = answer.scores
    order = sorted(range(len(scores)), key=lambda i: -float(scores[i]))[: top_n or len(scores)]
    return_text = either(body.return_text, False)
    items = []
    for i in order:
        item: dict[str, Any] = {"index": i, "score": float(scores[i])}
        if return_text:
            item["text"] = call.texts[i]
        items.append(item)
    return json_response(items, _headers(headers, answer))


def embed_all_call(request: web.Request, body: EmbedAllRequest) -> TextCall:
    call = TextCall(
        "tokens", _model(request, body.model), prompt_name=body.prompt_name, parameters=latency_of(request, body),
        field="inputs", **_truncation(body),
    )  # fmt: skip
    return _inputs(body.inputs, call)


def embed_all_body(body: EmbedAllRequest, call: TextCall, answer, headers: dict) -> web.Response:
    return json_response([v.tolist() for v in answer.token_vectors], _headers(headers, answer))


def embed_sparse_call(request: web.Request, body: EmbedSparseRequest) -> TextCall:
    call = TextCall(
        "sparse", _model(request, body.model), prompt_name=body.prompt_name, parameters=latency_of(request, body),
        field="inputs", **_truncation(body),
    )  # fmt: skip
    return _inputs(body.inputs, call)


def embed_sparse_body(body: EmbedSparseRequest, call: TextCall, answer, headers: dict) -> web.Response:
    """Each text's non-zero vocabulary weights as ``{index, value}`` by index; ``top_k`` (an
    extension) keeps the k largest."""
    top_k = body.top_k
    out = []
    for index, values in answer.sparse:
        if top_k is not None and len(index) > top_k:
            keep = np.sort(np.argsort(-values, kind="stable")[:top_k])
            index, values = index[keep], values[keep]
        out.append([{"index": int(i), "value": float(v)} for i, v in zip(index, values)])
    return json_response(out, _headers(headers, answer))


def similarity_call(request: web.Request, body: SimilarityRequest) -> TextCall:
    """TEI's (and ``InferenceClient.sentence_similarity``'s) ``{inputs: {source_sentence,
    sentences}, parameters}``: the cosine of the source's embedding with each sentence's."""
    sentences = body.inputs.sentences
    if sentences == []:
        raise invalid(EMPTY, "inputs")
    sentences = texts_of(sentences, "inputs")
    if len(sentences) >= MAX_INPUTS:
        raise invalid(f"'inputs.sentences' holds {len(sentences)} texts; at most {MAX_INPUTS - 1}", "inputs")
    params = body.parameters or SimilarityParameters()
    return TextCall(
        "dense", _model(request, body.model), texts=sentences, query=body.inputs.source_sentence,
        prompt_name=params.prompt_name, parameters=latency_of(request, body), field="inputs", **_truncation(params),
    )  # fmt: skip


def similarity_body(body: SimilarityRequest, call: TextCall, answer, headers: dict) -> web.Response:
    return json_response([float(c) for c in answer.scores], _headers(headers, answer))


def _predict_rows(value: Any) -> tuple[list[list[str]], bool]:
    """TEI's ``PredictInput``: a text, a pair ``[a, b]``, or a batch of ``[text]`` / ``[a, b]``;
    (the rows, whether it was a batch)."""
    if isinstance(value, str):
        return [[value]], False
    if isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) for v in value):
        return [value], False
    if not isinstance(value, list) or not value:
        raise invalid(
            "'inputs' must be a text, a pair [text, text], or a batch of [text] or [text, text]", "inputs"
        )
    if len(value) > MAX_INPUTS:
        raise invalid(f"'inputs' holds {len(value)} rows; at most {MAX_INPUTS} per request", "inputs")
    for i, row in enumerate(value):
        if not (isinstance(row, list) and len(row) in (1, 2) and all(isinstance(t, str) for t in row)):
            raise invalid(f"'inputs[{i}]' must be [text] or [text, text]", "inputs")
    return value, True


def labels_call(request: web.Request, body, rows: list[list[str]], field: str, raw: bool) -> TextCall:
    """Rows of one text or of a pair as one classification call (all rows alike)."""
    pairs = len(rows[0]) == 2
    for i, row in enumerate(rows):
        if (len(row) == 2) != pairs:
            raise invalid(f"'{field}[{i}]': every row must be a single text or every row a pair", field)
        if pairs and PAIR_SEPARATOR in row[0]:
            raise invalid(f"'{field}[{i}]': the first text may not hold U+001F (the pair separator)", field)
    return TextCall(
        "labels", _model(request, body.model), texts=[PAIR_SEPARATOR.join(r) for r in rows], pairs=pairs,
        raw_scores=raw, parameters=latency_of(request, body), field=field, **_truncation(body),
    )  # fmt: skip


def predict_call(request: web.Request, body: PredictRequest) -> TextCall:
    if body.inputs == []:
        raise invalid(EMPTY, "inputs")
    rows, _ = _predict_rows(body.inputs)
    return labels_call(request, body, rows, "inputs", either(body.raw_scores, False))


def predict_body(body: PredictRequest, call: TextCall, answer, headers: dict) -> web.Response:
    """Per row every label's score, highest first."""
    out = []
    for row in answer.scores:
        order = np.argsort(-row, kind="stable")
        out.append([{"score": float(row[j]), "label": answer.labels[j]} for j in order])
    _, batch = _predict_rows(body.inputs)
    return json_response(out if batch else out[0], _headers(headers, answer))


# A model's kind -> the TEI route ``POST /`` answers it with (TEI's router does the same).
_BY_KIND = {
    "embedding": (EmbedRequest, embed_call, embed_body),
    "sparse_embedding": (EmbedSparseRequest, embed_sparse_call, embed_sparse_body),
    "rerank": (RerankRequest, rerank_call, rerank_body),
    "classification": (PredictRequest, predict_call, predict_body),
}
_SIMILARITY = (SimilarityRequest, similarity_call, similarity_body)


class Tei(TextRoutes):
    def _route(self, name: str):
        body, parse, fmt = {
            "embed": _BY_KIND["embedding"], "rerank": _BY_KIND["rerank"], "predict": _BY_KIND["classification"],
            "embed_sparse": _BY_KIND["sparse_embedding"], "similarity": _SIMILARITY,
            "embed_all": (EmbedAllRequest, embed_all_call, embed_all_body),
        }[name]  # fmt: skip

        async def handler(request: web.Request) -> web.Response:
            return await self.answer(request, body, parse, fmt, tei_error)

        return handler

    async def entry(self, request: web.Request) -> web.Response:
        """``POST /`` and ``/invocations``: the call the model's kind answers (an ``inputs``
        object with ``source_sentence`` is a similarity call, as ``InferenceClient`` sends it)."""
        echo = request_echo(request)
        try:
            with self.door.enter(self.http.metadata(request)) as pass_:
                raw = await self.http.body(request)
                fields = keys(raw, "'inputs'")
                inputs = fields.get("inputs")
                if inputs is not None and bytes(inputs).lstrip().startswith(b"{"):  # an object: similarity
                    cls, parse, fmt = _SIMILARITY
                else:
                    named = model_field(fields["model"]) if "model" in fields else None
                    _, kind = self.pipeline.kind_of(_model(request, named))
                    cls, parse, fmt = _BY_KIND[kind]
                doc = read(raw, cls, request.path, fields)
                call = parse(request, doc)
                answer = await self.pipeline.texts(pass_, self.edge, call)
        except GatewayError as exc:
            return tei_error(exc, echo)
        return fmt(doc, call, answer, {**echo, **dict(pass_.limits)})

    # -- model information --------------------------------------------------------------------

    def _visible(self, request: web.Request, model: str) -> None:
        """Refuses a model the caller may not call (as unknown, so nothing is disclosed)."""
        account = self.pipeline.identify(self.http.metadata(request))
        if account is not None and account.models is not None and model not in account.models:
            raise not_found(f"unknown model '{clip(model)}'")

    async def info(self, request: web.Request) -> web.Response:
        try:
            info = self.pipeline.text_info(_model(request, None))  # (the path's model, or the default)
            self._visible(request, info["model_id"])
            return web.json_response(info)
        except GatewayError as exc:
            return tei_error(exc)

    async def health(self, request: web.Request) -> web.Response:
        """200 while the route's model is loaded and the server is not draining, else 503 (TEI's
        words); no key needed, as for the other probes."""
        try:
            self.pipeline.kind_of(_model(request, None))
        except GatewayError as exc:
            return tei_error(exc)
        return web.Response(status=200)

    # -- tokens ---------------------------------------------------------------------------------

    async def tokenize(self, request: web.Request) -> web.Response:
        echo = request_echo(request)
        try:
            with self.door.enter(self.http.metadata(request)):
                doc = read(await self.http.body(request), TokenizeRequest, request.path)
                model = _model(request, doc.model)
                if doc.inputs == []:
                    raise invalid(EMPTY, "inputs")
                texts = texts_of(doc.inputs, "inputs")
                special = either(doc.add_special_tokens, True)
                name, _ = self.pipeline.kind_of(model)
                self._visible(request, name)
                tokens = await self.pipeline.tokenize(name, texts, special, doc.prompt_name)
        except GatewayError as exc:
            return tei_error(exc, echo)
        return json_response(tokens, echo)

    async def decode(self, request: web.Request) -> web.Response:
        echo = request_echo(request)
        try:
            with self.door.enter(self.http.metadata(request)):
                doc = read(await self.http.body(request), DecodeRequest, request.path)
                if not is_ids(doc.ids):
                    raise invalid("'ids' must be a list of token ids or a list of such lists", "ids")
                skip = either(doc.skip_special_tokens, True)
                name, _ = self.pipeline.kind_of(_model(request, doc.model))
                self._visible(request, name)
                texts = await self.pipeline.decode(name, ids_rows(doc.ids), skip)
        except GatewayError as exc:
            return tei_error(exc, echo)
        return json_response(texts, echo)


def routes(server: Server, http: Http) -> list[web.RouteDef]:
    """TEI's routes at the root and under ``/tei/{model}`` (the HTTP listener's ``app()`` adds them)."""
    api = Tei(server, http)
    table = [
        ("GET", "/info", api.info), ("GET", "/health", api.health),
        ("POST", "/tokenize", api.tokenize), ("POST", "/decode", api.decode),
        *[("POST", f"/{name}", api._route(name))
          for name in ("embed", "rerank", "embed_all", "embed_sparse", "similarity", "predict")],
        ("POST", "/invocations", api.entry),
        ("GET", "/ping", api.health),
    ]  # fmt: skip
    out = [web.route(method, path, handler) for method, path, handler in table]
    out += [web.post("/", api.entry), web.get("/", api.health)]
    out += [web.route(method, "/tei/{model}" + path, handler) for method, path, handler in table]
    out += [web.post("/tei/{model}", api.entry), web.get("/tei/{model}", api.health)]
    return out
