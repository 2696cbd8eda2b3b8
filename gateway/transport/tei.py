"""Hugging Face TEI's API on the REST listener: ``POST /embed`` and ``POST /rerank``, and the
Cohere/Jina-style ``POST /v1/rerank`` beside them.

Only translation lives here: the body's fields into one ``Pipeline.texts`` call (gateway/infer.py),
as the OpenAI routes do. Errors are TEI's ``{"error", "error_type"}`` with the statuses TEI uses
(table ``TEI``); ``/v1/rerank`` answers in OpenAI's shape (``openai.openai_error``), as Cohere's and
Jina's clients read it.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import numpy as np
from aiohttp import web

from batchgate.gateway.admission.door import Pass
from batchgate.gateway.errors import GatewayError, Kind, invalid, retry_headers
from batchgate.gateway.text import PAIR_SEPARATOR
from batchgate.gateway.transport import tei_models
from batchgate.gateway.transport.fields import (
    dimensions_for,
    TextRoutes,
    json_object,
    flag,
    latency_of,
    prompt_name_of,
    request_echo,
    texts_of,
)
from batchgate.gateway.transport.openai import openai_error

if TYPE_CHECKING:
    from batchgate.gateway.call import Answer
    from batchgate.gateway.transport.http import Http
    from batchgate.gateway.transport.server import Server

EMPTY = "Input cannot be empty"  # TEI's words, answered 400 "empty"

_TEI_FIELDS = {
    "inputs", "normalize", "truncate", "truncation_direction", "prompt_name", "dimensions", "model",
    "latency_class", "latency_budget_ms",
}  # fmt: skip
_TEI_RERANK_FIELDS = {
    "query", "texts", "truncate", "truncation_direction", "raw_scores", "return_text", "model",
    "latency_class", "latency_budget_ms",
}  # fmt: skip
_V1_RERANK_FIELDS = {
    "model", "query", "documents", "top_n", "return_documents", "max_chunks_per_doc", "rank_fields",
    "latency_class", "latency_budget_ms",
}  # fmt: skip

# Kind -> (HTTP status, TEI error_type); TEI answers input validation 413, JSON it cannot read
# 422, an empty batch 400, a full queue 429, a backend failure 424 (router/src/http/server.rs).
TEI = {
    Kind.INVALID: (422, "validation"),
    Kind.NOT_FOUND: (404, "validation"),
    Kind.UNAUTHENTICATED: (401, "unauthorized"),
    Kind.PERMISSION: (403, "unauthorized"),
    Kind.EXHAUSTED: (429, "overloaded"),
    Kind.UNAVAILABLE: (503, "unhealthy"),
    Kind.DEADLINE: (504, "backend"),
    Kind.UNSUPPORTED: (501, "backend"),
    Kind.PRECONDITION: (422, "validation"),
    Kind.FAILED: (424, "backend"),
    Kind.TOO_LARGE: (413, "validation"),
    Kind.SLOW: (408, "validation"),
}


def tei_error(exc: GatewayError, echo: dict | None = None) -> web.Response:
    status, type_ = TEI[exc.kind]
    if exc.message == EMPTY:
        status, type_ = 400, "empty"
    body = {"error": exc.message, "error_type": type_}
    return web.json_response(body, status=status, headers=retry_headers(exc, echo or {}))


def _unit(vectors: np.ndarray) -> np.ndarray:
    """Rows scaled to unit length; rows already unit length (minilm's graph ends in L2
    normalisation) are returned bit for bit as the model computed them."""
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    off = np.abs(norms - 1.0) > 1e-5
    if not off.any():
        return vectors
    return np.where(off, vectors / np.maximum(norms, 1e-12), vectors).astype(np.float32)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return (1.0 / (1.0 + np.exp(-x.astype(np.float64)))).astype(np.float32)


def _query(doc: dict) -> str:
    q = doc.get("query")
    if not isinstance(q, str) or not q.strip():
        raise invalid("'query' is required: a non-empty string", "query")
    if PAIR_SEPARATOR in q:
        raise invalid("'query' may not hold U+001F (the pair separator)", "query")
    return q


def _documents(value: Any) -> list[str]:
    """Cohere's and Jina's ``documents``: strings, or objects with a ``text``."""
    if not isinstance(value, list):
        raise invalid("'documents' must be a list of strings or {'text': ...} objects", "documents")
    out = []
    for i, d in enumerate(value):
        if isinstance(d, dict) and isinstance(d.get("text"), str):
            d = d["text"]
        if not isinstance(d, str):
            raise invalid(f"'documents[{i}]' must be a string or an object with 'text'", "documents")
        out.append(d)
    return texts_of(out, "documents")


class Tei(TextRoutes):
    async def embed(self, request: web.Request) -> web.Response:
        echo = request_echo(request)
        try:
            with self.door.enter(self.http.metadata(request)) as pass_:
                doc = await json_object(self.http, request, _TEI_FIELDS, "'inputs'", "unknown field(s)")
                if "inputs" not in doc:
                    raise invalid("'inputs' is required: a string or a list of strings", "inputs")
                if doc["inputs"] == []:
                    raise invalid(EMPTY, "inputs")
                normalize = flag(doc, "normalize", True)
                model = tei_models.model_for(self.server, request, doc, ("embedding",))
                tei_models.runtime_of(self.server, model, ("embedding",))
                truncate = flag(
                    doc, "truncate", tei_models.truncates(self.server, model)
                )  # the model's by default
                left = tei_models.left_of(doc)
                texts, given = tei_models.inputs_of(
                    self.server, model, doc["inputs"], "inputs", truncate, left
                )
                prompt_name = prompt_name_of(doc)
                params = latency_of(request, doc)
                size = dimensions_for(self.server, model, doc.get("dimensions"))
                answer = await self.server.pipeline.texts(
                    pass_, self.edge, model, texts, params, exact_limit=not truncate, prompt_name=prompt_name,
                    cut=truncate and given is None, left=left, encodings=given,
                )  # fmt: skip
        except GatewayError as exc:
            return tei_error(exc, echo)
        vectors = answer.outputs[0].array
        if size is not None:  # TEI: cut, then normalised only if asked
            vectors = vectors[:, :size].copy()
        if normalize:
            vectors = _unit(vectors)
        total = sum(answer.tokens)
        return web.Response(
            text=json.dumps(vectors.tolist(), separators=(",", ":")),
            content_type="application/json",
            headers={
                **echo,
                "x-compute-tokens": str(total),
                "x-compute-characters": str(sum(map(len, texts))),
            },
        )

    async def _rerank(self, request: web.Request, pass_: Pass, doc: dict, texts: list[str],
                      exact_limit: bool, cut: bool | None = False, left: bool = False) -> tuple[np.ndarray, Answer]:  # fmt: skip
        """The raw scores of (query, text) for each text, in the caller's order; ``cut`` None: the
        model's own truncate setting."""
        pipeline = self.server.pipeline
        model = request.match_info.get("model") or doc.get("model")
        if model is None:
            names = pipeline.text_models(pairs=True)
            if len(names) != 1:
                raise invalid(f"'model' is required: this server serves rerank models {names}", "model")
            model = names[0]
        if not isinstance(model, str) or not model:
            raise invalid("'model' must be the name of a rerank model", "model")
        query = _query(doc)
        params = latency_of(request, doc)
        rows = [query + PAIR_SEPARATOR + t for t in texts]
        if cut is None:
            cut = tei_models.truncates(self.server, model)
            exact_limit = not cut
        answer = await pipeline.texts(
            pass_, self.edge, model, rows, params, exact_limit=exact_limit, pairs=True, cut=cut, left=left
        )
        return answer.outputs[0].array[:, 0].copy(), answer

    async def rerank(self, request: web.Request) -> web.Response:
        """TEI's ``POST /rerank``: ``[{index, score, text?}]`` sorted by score, highest first;
        scores through a sigmoid unless ``raw_scores`` (what TEI answers for a one-label model)."""
        echo = request_echo(request)
        try:
            with self.door.enter(self.http.metadata(request)) as pass_:
                doc = await json_object(
                    self.http, request, _TEI_RERANK_FIELDS, "'query' and 'texts'", "unknown field(s)"
                )
                if doc.get("texts") == []:
                    raise invalid(EMPTY, "texts")
                texts = texts_of(doc.get("texts"), "texts")
                truncate = flag(doc, "truncate", False) if doc.get("truncate") is not None else None
                raw = flag(doc, "raw_scores", False)
                return_text = flag(doc, "return_text", False)
                left = tei_models.left_of(doc)
                scores, answer = await self._rerank(
                    request, pass_, doc, texts, exact_limit=not truncate, cut=truncate, left=left
                )
        except GatewayError as exc:
            return tei_error(exc, echo)
        if not raw:
            scores = _sigmoid(scores)
        order = sorted(range(len(texts)), key=lambda i: -float(scores[i]))
        body = []
        for i in order:
            item: dict[str, Any] = {"index": i, "score": float(scores[i])}
            if return_text:
                item["text"] = texts[i]
            body.append(item)
        return web.Response(
            text=json.dumps(body, separators=(",", ":")), content_type="application/json",
            headers={**echo, "x-compute-tokens": str(sum(answer.tokens))},
        )  # fmt: skip

    async def v1_rerank(self, request: web.Request) -> web.Response:
        """Cohere's / Jina's ``POST /v1/rerank``: ``{results: [{index, relevance_score,
        document?}]}`` sorted by relevance, the first ``top_n``; relevance through a sigmoid."""
        echo = request_echo(request)
        try:
            with self.door.enter(self.http.metadata(request)) as pass_:
                doc = await json_object(
                    self.http,
                    request,
                    _V1_RERANK_FIELDS,
                    "'query' and 'documents'",
                    "unrecognized request argument(s)",
                )
                if "documents" not in doc:
                    raise invalid("'documents' is required: a list of texts", "documents")
                texts = _documents(doc["documents"])
                top_n = doc.get("top_n")
                if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1):
                    raise invalid("'top_n' must be a positive integer", "top_n")
                return_documents = flag(doc, "return_documents", False)
                scores, answer = await self._rerank(request, pass_, doc, texts, exact_limit=False)
        except GatewayError as exc:
            return openai_error(exc, echo)
        relevance = _sigmoid(scores)
        order = sorted(range(len(texts)), key=lambda i: -float(relevance[i]))[: top_n or len(texts)]
        results = []
        for i in order:
            item: dict[str, Any] = {"index": i, "relevance_score": float(relevance[i])}
            if return_documents:
                item["document"] = {"text": texts[i]}
            results.append(item)
        body = {
            "model": answer.model, "results": results,
            "usage": {"total_tokens": sum(answer.tokens)}, "meta": {"billed_units": {"search_units": 1}},
        }  # fmt: skip
        return web.Response(
            text=json.dumps(body, separators=(",", ":")), content_type="application/json", headers=echo
        )


def routes(server: Server, http: Http) -> list[web.RouteDef]:
    """TEI's routes and the Cohere/Jina rerank route (the HTTP listener's ``app()`` adds them)."""
    api = Tei(server, http)
    return [
        web.post("/embed", api.embed),
        web.post("/rerank", api.rerank),
        web.post("/v1/rerank", api.v1_rerank),
    ]
