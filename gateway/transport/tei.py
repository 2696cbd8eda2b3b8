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
from batchgate.gateway.transport.fields import (
    EMPTY,
    MAX_INPUTS,
    Body,
    TextRoutes,
    dimensions_of,
    documents_of,
    flag,
    ids_rows,
    ignored,
    is_ids,
    json_object,
    json_response,
    latency_of,
    left_of,
    long_inputs_of,
    positive,
    prompt_name_of,
    ranked,
    request_echo,
    tei_error,
    texts_of,
)

if TYPE_CHECKING:
    from batchgate.gateway.transport.http import Http
    from batchgate.gateway.transport.server import Server

_COMMON = {"model", "latency_class", "latency_budget_ms", "truncate", "truncation_direction"}
BODIES = {
    "embed": Body(
        {"inputs", "normalize", "prompt_name", "dimensions", "long_inputs", "late_chunking", *_COMMON},
        "'inputs'",
    ),
    "rerank": Body(
        {"query", "texts", "raw_scores", "return_text", "top_n", "documents", "return_documents", *_COMMON},
        "'query' and 'texts'",
    ),  # fmt: skip
    "embed_all": Body({"inputs", "prompt_name", "normalize", *_COMMON}, "'inputs'"),
    "embed_sparse": Body({"inputs", "prompt_name", "top_k", *_COMMON}, "'inputs'"),
    "predict": Body({"inputs", "raw_scores", *_COMMON}, "'inputs'"),
    "similarity": Body({"inputs", "parameters", *_COMMON}, "'inputs': {'source_sentence', 'sentences'}"),
    "tokenize": Body({"inputs", "add_special_tokens", "prompt_name", "model"}, "'inputs'"),
    "decode": Body({"ids", "skip_special_tokens", "model"}, "'ids'"),
}
_SIMILARITY_PARAMETERS = ("truncate", "truncation_direction", "prompt_name")


def _model(request: web.Request, doc: Any) -> str | None:
    """The model a TEI call names: the path's (``/tei/{model}``), else the body's ``model`` (an
    extension), else None (the server's default)."""
    path = request.match_info.get("model")
    named = doc.get("model") if isinstance(doc, dict) else None
    if named is not None and (not isinstance(named, str) or not named):
        raise invalid("'model' must be the name of a served text model", "model")
    if path is not None and named is not None and named != path:
        raise invalid(f"'model' names another model than this base URL's ('{clip(path)}')", "model")
    return path or named


def _inputs(doc: dict, call: TextCall) -> TextCall:
    """TEI's ``inputs``: a text, texts, or the model's own token ids."""
    value = doc.get("inputs")
    if value is None:
        raise invalid("'inputs' is required: a string or a list of strings", "inputs")
    if value == []:
        raise invalid(EMPTY, "inputs")
    if is_ids(value):
        call.ids = ids_rows(value)
    else:
        call.texts = texts_of(value, "inputs")
    return call


def _truncation(doc: dict) -> dict:
    truncate = doc.get("truncate")
    return {
        "truncate": None if truncate is None else flag(doc, "truncate", False),
        "left": left_of(doc),
    }


def embed_call(request: web.Request, doc: dict) -> TextCall:
    call = TextCall(
        "dense", _model(request, doc), normalize=flag(doc, "normalize", True), prompt_name=prompt_name_of(doc),
        dimensions=dimensions_of(doc), parameters=latency_of(request, doc), field="inputs",
        long_inputs=long_inputs_of(doc), late_chunking=flag(doc, "late_chunking", False), **_truncation(doc),
    )  # fmt: skip
    return _inputs(doc, call)


def _headers(headers: dict, answer) -> dict:
    return {**headers, "x-compute-tokens": str(sum(answer.tokens))}


def embed_body(doc: dict, call: TextCall, answer, headers: dict) -> web.Response:
    headers = _headers(headers, answer)
    headers["x-compute-characters"] = str(sum(map(len, call.texts)))
    return json_response(answer.dense["float"].tolist(), headers)


def rerank_call(request: web.Request, doc: dict) -> TextCall:
    cohere = "documents" in doc and "texts" not in doc
    if cohere:
        texts = documents_of(doc["documents"])
    else:
        if doc.get("texts") == []:
            raise invalid(EMPTY, "texts")
        texts = texts_of(doc.get("texts"), "texts")
    query = doc.get("query")
    if not isinstance(query, str):
        raise invalid("'query' is required: a non-empty string", "query")
    positive(doc, "top_n")
    return TextCall(
        "scores", _model(request, doc), texts=texts, query=query, raw_scores=flag(doc, "raw_scores", False),
        parameters=latency_of(request, doc), field="documents" if cohere else "texts", **_truncation(doc),
    )  # fmt: skip


def rerank_body(doc: dict, call: TextCall, answer, headers: dict) -> web.Response:
    top_n = doc.get("top_n")
    if call.field == "documents":  # infinity's and vLLM's Cohere-shaped answer
        total = sum(answer.tokens)
        body = {
            "object": "rerank", "id": f"rerank-{uuid.uuid4().hex}", "created": int(time.time()),
            "model": answer.model, "results": ranked(answer, top_n, flag(doc, "return_documents", False)),
            "usage": {"prompt_tokens": total, "total_tokens": total},
        }  # fmt: skip
        return json_response(body, _headers(headers, answer))
    scores = answer.scores
    order = sorted(range(len(scores)), key=lambda i: -float(scores[i]))[: top_n or len(scores)]
    return_text = flag(doc, "return_text", False)
    body = []
    for i in order:
        item: dict[str, Any] = {"index": i, "score": float(scores[i])}
        if return_text:
            item["text"] = call.texts[i]
        body.append(item)
    return json_response(body, _headers(headers, answer))


def embed_all_call(request: web.Request, doc: dict) -> TextCall:
    flag(doc, "normalize", True)  # sent by TEI's clients; TEI does not normalise token vectors
    call = TextCall(
        "tokens", _model(request, doc), prompt_name=prompt_name_of(doc), parameters=latency_of(request, doc),
        field="inputs", **_truncation(doc),
    )  # fmt: skip
    return _inputs(doc, call)


def embed_all_body(doc: dict, call: TextCall, answer, headers: dict) -> web.Response:
    return json_response([v.tolist() for v in answer.token_vectors], _headers(headers, answer))


def embed_sparse_call(request: web.Request, doc: dict) -> TextCall:
    positive(doc, "top_k")
    call = TextCall(
        "sparse", _model(request, doc), prompt_name=prompt_name_of(doc), parameters=latency_of(request, doc),
        field="inputs", **_truncation(doc),
    )  # fmt: skip
    return _inputs(doc, call)


def embed_sparse_body(doc: dict, call: TextCall, answer, headers: dict) -> web.Response:
    """Each text's non-zero vocabulary weights as ``{index, value}`` by index; ``top_k`` (an
    extension) keeps the k largest."""
    top_k = doc.get("top_k")
    body = []
    for index, values in answer.sparse:
        if top_k is not None and len(index) > top_k:
            keep = np.sort(np.argsort(-values, kind="stable")[:top_k])
            index, values = index[keep], values[keep]
        body.append([{"index": int(i), "value": float(v)} for i, v in zip(index, values)])
    return json_response(body, _headers(headers, answer))


def similarity_call(request: web.Request, doc: dict) -> TextCall:
    """TEI's (and ``InferenceClient.sentence_similarity``'s) ``{inputs: {source_sentence,
    sentences}, parameters}``: the cosine of the source's embedding with each sentence's."""
    inputs = doc.get("inputs")
    if not isinstance(inputs, dict):
        raise invalid("'inputs' must be an object {'source_sentence': text, 'sentences': [text]}", "inputs")
    source = inputs.get("source_sentence")
    if not isinstance(source, str):
        raise invalid("'inputs.source_sentence' must be a text", "inputs")
    sentences = inputs.get("sentences")
    if sentences == []:
        raise invalid(EMPTY, "inputs")
    sentences = texts_of(sentences, "inputs")
    if len(sentences) >= MAX_INPUTS:
        raise invalid(f"'inputs.sentences' holds {len(sentences)} texts; at most {MAX_INPUTS - 1}", "inputs")
    params = doc.get("parameters") or {}
    if not isinstance(params, dict):
        raise invalid(f"'parameters' must be an object with {list(_SIMILARITY_PARAMETERS)}", "parameters")
    return TextCall(
        "dense", _model(request, doc), texts=sentences, query=source, prompt_name=prompt_name_of(params),
        parameters=latency_of(request, doc), field="inputs", **_truncation(params),
    )  # fmt: skip


def similarity_body(doc: dict, call: TextCall, answer, headers: dict) -> web.Response:
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


def labels_call(request: web.Request, doc: dict, rows: list[list[str]], field: str, raw: bool) -> TextCall:
    """Rows of one text or of a pair as one classification call (all rows alike)."""
    pairs = len(rows[0]) == 2
    for i, row in enumerate(rows):
        if (len(row) == 2) != pairs:
            raise invalid(f"'{field}[{i}]': every row must be a single text or every row a pair", field)
        if pairs and PAIR_SEPARATOR in row[0]:
            raise invalid(f"'{field}[{i}]': the first text may not hold U+001F (the pair separator)", field)
    return TextCall(
        "labels", _model(request, doc), texts=[PAIR_SEPARATOR.join(r) for r in rows], pairs=pairs,
        raw_scores=raw, parameters=latency_of(request, doc), field=field, **_truncation(doc),
    )  # fmt: skip


def predict_call(request: web.Request, doc: dict) -> TextCall:
    if doc.get("inputs") == []:
        raise invalid(EMPTY, "inputs")
    rows, _ = _predict_rows(doc.get("inputs"))
    return labels_call(request, doc, rows, "inputs", flag(doc, "raw_scores", False))


def predict_body(doc: dict, call: TextCall, answer, headers: dict) -> web.Response:
    """Per row every label's score, highest first."""
    out = []
    for row in answer.scores:
        order = np.argsort(-row, kind="stable")
        out.append([{"score": float(row[j]), "label": answer.labels[j]} for j in order])
    _, batch = _predict_rows(doc.get("inputs"))
    return json_response(out if batch else out[0], _headers(headers, answer))


# A model's kind -> the TEI route ``POST /`` answers it with (TEI's router does the same).
_BY_KIND = {
    "embedding": (BODIES["embed"], embed_call, embed_body),
    "sparse_embedding": (BODIES["embed_sparse"], embed_sparse_call, embed_sparse_body),
    "rerank": (BODIES["rerank"], rerank_call, rerank_body),
    "classification": (BODIES["predict"], predict_call, predict_body),
}
_SIMILARITY = (BODIES["similarity"], similarity_call, similarity_body)


class Tei(TextRoutes):
    def _route(self, name: str):
        body, parse, fmt = {
            "embed": _BY_KIND["embedding"], "rerank": _BY_KIND["rerank"], "predict": _BY_KIND["classification"],
            "embed_sparse": _BY_KIND["sparse_embedding"], "similarity": _SIMILARITY,
            "embed_all": (BODIES["embed_all"], embed_all_call, embed_all_body),
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
                doc = await json_object(self.http, request, None, "'inputs'")
                inputs = doc.get("inputs")
                if isinstance(inputs, dict) and "source_sentence" in inputs:
                    body, parse, fmt = _SIMILARITY
                else:
                    _, kind = self.pipeline.kind_of(_model(request, doc))
                    body, parse, fmt = _BY_KIND[kind]
                unknown = [k for k in doc if k not in body.fields]
                if unknown:
                    ignored(request.path, unknown)
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
            info = self.pipeline.text_info(_model(request, None))
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
                b = BODIES["tokenize"]
                doc = await json_object(self.http, request, b.fields, b.shape)
                model = _model(request, doc)
                if doc.get("inputs") == []:
                    raise invalid(EMPTY, "inputs")
                texts = texts_of(doc.get("inputs"), "inputs")
                special = flag(doc, "add_special_tokens", True)
                name, _ = self.pipeline.kind_of(model)
                self._visible(request, name)
                body = await self.pipeline.tokenize(name, texts, special, prompt_name_of(doc))
        except GatewayError as exc:
            return tei_error(exc, echo)
        return json_response(body, echo)

    async def decode(self, request: web.Request) -> web.Response:
        echo = request_echo(request)
        try:
            with self.door.enter(self.http.metadata(request)):
                b = BODIES["decode"]
                doc = await json_object(self.http, request, b.fields, b.shape)
                ids = doc.get("ids")
                if not is_ids(ids):
                    raise invalid("'ids' must be a list of token ids or a list of such lists", "ids")
                skip = flag(doc, "skip_special_tokens", True)
                name, _ = self.pipeline.kind_of(_model(request, doc))
                self._visible(request, name)
                body = await self.pipeline.decode(name, ids_rows(ids), skip)
        except GatewayError as exc:
            return tei_error(exc, echo)
        return json_response(body, echo)


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
