"""The rest of TEI's API beside ``/embed`` and ``/rerank`` (tei.py): ``GET /info``, ``GET /health``,
``POST /tokenize``, ``/decode``, ``/similarity``, ``/predict`` (classifiers), ``/embed_sparse``
(SPLADE) and ``/embed_all`` (token vectors); vLLM's ``POST /classify``; and every TEI route again
under ``/tei/{model}``, so a one-model TEI client works with any model by its base URL
(tei_models.py says which model a route serves).

Only translation lives here, as in tei.py: the body's fields into one ``Pipeline.texts`` call naming
the output the route reads (parameter ``kind``'s outputs, gateway/repository.py ``KIND_OUTPUTS``),
errors in TEI's shape (``tei.tei_error``; ``/classify`` in OpenAI's, as vLLM answers).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import TYPE_CHECKING, Any

import numpy as np
from aiohttp import web

from batchgate.gateway import tokens
from batchgate.gateway.errors import GatewayError, clip, invalid, not_found
from batchgate.gateway.infer import prompt_of
from batchgate.gateway.repository import TOKEN_OUTPUT
from batchgate.gateway.text import PAIR_SEPARATOR
from batchgate.gateway.transport import tei_models as tm
from batchgate.gateway.transport.fields import (
    MAX_INPUTS,
    TextRoutes,
    flag,
    json_object,
    latency_of,
    prompt_name_of,
    request_echo,
    texts_of,
)
from batchgate.gateway.transport.openai import openai_error
from batchgate.gateway.transport.tei import EMPTY, Tei, _sigmoid, tei_error

if TYPE_CHECKING:
    from batchgate.gateway.call import Answer
    from batchgate.gateway.transport.http import Http
    from batchgate.gateway.transport.server import Server

_COMMON = {"model", "latency_class", "latency_budget_ms"}
_FIELDS = {
    "embed_all": {"inputs", "truncate", "truncation_direction", "prompt_name", "normalize", *_COMMON},
    "embed_sparse": {"inputs", "truncate", "truncation_direction", "prompt_name", "top_k", *_COMMON},
    "predict": {"inputs", "raw_scores", "truncate", "truncation_direction", *_COMMON},
    "similarity": {"inputs", "parameters", *_COMMON},
    "tokenize": {"inputs", "add_special_tokens", "prompt_name", "model"},
    "decode": {"ids", "skip_special_tokens", "model"},
    "classify": {"model", "input", "user", "truncate", "truncation_direction", *_COMMON},
}
_SIMILARITY_PARAMETERS = {"truncate", "truncation_direction", "prompt_name"}


def _json(body: Any, headers: dict | None = None) -> web.Response:
    return web.Response(
        text=json.dumps(body, separators=(",", ":")), content_type="application/json", headers=headers
    )


def _headers(echo: dict, answer: Answer) -> dict:
    return {**echo, "x-compute-tokens": str(sum(answer.tokens))}


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


class TeiSurface(TextRoutes):
    async def _body(self, request: web.Request, route: str, needs: str) -> dict:
        return await json_object(self.http, request, _FIELDS[route], needs, "unknown field(s)")

    async def _texts(
        self, request, pass_, doc, model, value, *, output, field="inputs", params=None, pairs=False
    ):
        """One pipeline call for the route's texts (or token ids) with the model's truncate default
        and the call's direction; the answer and its texts."""
        server = self.server
        params = doc if params is None else params
        truncate = flag(params, "truncate", tm.truncates(server, model))
        left = tm.left_of(params)
        texts, given = tm.inputs_of(server, model, value, field, truncate, left)
        answer = await server.pipeline.texts(
            pass_, self.edge, model, texts, latency_of(request, doc), prompt_name=prompt_name_of(params),
            exact_limit=not truncate, cut=truncate and given is None, output=output, left=left, encodings=given,
            pairs=pairs,
        )  # fmt: skip
        return answer, texts

    # -- model information --------------------------------------------------------------------

    def _visible(self, request: web.Request, model: str) -> None:
        """Refuses a model the caller may not call (as unknown, so nothing is disclosed)."""
        account = self.server.pipeline.identify(self.http.metadata(request))
        if account is not None and account.models is not None and model not in account.models:
            raise not_found(f"unknown model '{clip(model)}'")

    async def info(self, request: web.Request) -> web.Response:
        try:
            model = tm.model_for(self.server, request, None, tuple(tm.TEI_TYPE))
            self._visible(request, model)
            return web.json_response(tm.info(self.server, model))
        except GatewayError as exc:
            return tei_error(exc)

    async def health(self, request: web.Request) -> web.Response:
        """200 while the route's model is loaded and the server is not draining, else 503 (TEI's
        words); no key needed, as for the other probes."""
        try:
            model = tm.model_for(self.server, request, None, tuple(tm.TEI_TYPE))
            tm.runtime_of(self.server, model)
        except GatewayError as exc:
            return tei_error(exc)
        return web.Response(status=200)

    # -- tokens ---------------------------------------------------------------------------------

    async def _tokenizer_call(self, request: web.Request, route: str, needs: str):
        """The body of a call that only tokenises (no pass to the pipeline) and its model's runtime,
        which the caller must be allowed to call."""
        doc = await self._body(request, route, needs)
        model = tm.model_for(self.server, request, doc, tuple(tm.TEI_TYPE))
        rt = tm.runtime_of(self.server, model)
        self._visible(request, model)
        return doc, rt

    async def tokenize(self, request: web.Request) -> web.Response:
        echo = request_echo(request)
        try:
            with self.door.enter(self.http.metadata(request)):
                doc, rt = await self._tokenizer_call(request, "tokenize", "'inputs'")
                if doc.get("inputs") == []:
                    raise invalid(EMPTY, "inputs")
                texts = texts_of(doc.get("inputs"), "inputs")
                special = flag(doc, "add_special_tokens", True)
                name = prompt_name_of(doc)
                if name is not None and name not in rt.spec.params.prompts:
                    prompts = ", ".join(json.dumps(p) for p in sorted(rt.spec.params.prompts))
                    raise invalid(
                        f"Prompt name '{clip(name)}' was not found. Available prompts: [{prompts}]",
                        "prompt_name",
                    )
                prompt = prompt_of(rt.spec, name)
                limit = rt.text.settings.max_text_bytes
                for i, t in enumerate(texts):
                    if len(t.encode()) > limit:
                        raise invalid(
                            f"inputs {i}: text is over {limit} bytes (parameter max_text_bytes)", "inputs"
                        )
                body = await asyncio.to_thread(tokens.tokenize, rt.text, [prompt + t for t in texts], special)
        except GatewayError as exc:
            return tei_error(exc, echo)
        return _json(body, echo)

    async def decode(self, request: web.Request) -> web.Response:
        echo = request_echo(request)
        try:
            with self.door.enter(self.http.metadata(request)):
                doc, rt = await self._tokenizer_call(request, "decode", "'ids'")
                ids = doc.get("ids")
                if not tm.is_ids(ids):
                    raise invalid("'ids' must be a list of token ids or a list of such lists", "ids")
                rows = ids if isinstance(ids[0], list) else [ids]
                if len(rows) > MAX_INPUTS:
                    raise invalid(f"'ids' holds {len(rows)} rows; at most {MAX_INPUTS} per request", "ids")
                rows = tokens.ids_of(rows, "ids", tokens.vocabulary_size(rt.text))
                skip = flag(doc, "skip_special_tokens", True)
                body = await asyncio.to_thread(tokens.decode, rt.text, rows, skip)
        except GatewayError as exc:
            return tei_error(exc, echo)
        return _json(body, echo)

    # -- vectors --------------------------------------------------------------------------------

    async def embed_all(self, request: web.Request) -> web.Response:
        """Every token's vector of each text (its own tokens, special ones included)."""
        echo = request_echo(request)
        try:
            with self.door.enter(self.http.metadata(request)) as pass_:
                doc = await self._body(request, "embed_all", "'inputs'")
                if doc.get("inputs") == []:
                    raise invalid(EMPTY, "inputs")
                flag(doc, "normalize", True)  # sent by TEI's clients; TEI does not normalise token vectors
                model = tm.model_for(self.server, request, doc, ("embedding",))
                rt = tm.runtime_of(self.server, model, ("embedding",))
                if rt.spec.output(TOKEN_OUTPUT) is None:
                    raise invalid(
                        f"model '{model}' has no per-token output '{TOKEN_OUTPUT}' (batchgate prepare-model "
                        "... token_embeddings adds it)", "model",
                    )  # fmt: skip
                answer, _ = await self._texts(
                    request, pass_, doc, model, doc.get("inputs"), output=TOKEN_OUTPUT
                )
        except GatewayError as exc:
            return tei_error(exc, echo)
        vectors = answer.outputs[0].array
        body = [vectors[i, :n].tolist() for i, n in enumerate(answer.tokens)]
        return _json(body, _headers(echo, answer))

    async def embed_sparse(self, request: web.Request) -> web.Response:
        """Each text's non-zero vocabulary weights as ``{index, value}`` by index; ``top_k``
        (an extension) keeps the k largest."""
        echo = request_echo(request)
        try:
            with self.door.enter(self.http.metadata(request)) as pass_:
                doc = await self._body(request, "embed_sparse", "'inputs'")
                if doc.get("inputs") == []:
                    raise invalid(EMPTY, "inputs")
                top_k = doc.get("top_k")
                if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
                    raise invalid(
                        "'top_k' must be a positive integer: the number of largest weights kept", "top_k"
                    )
                model = tm.model_for(self.server, request, doc, ("sparse_embedding",))
                tm.runtime_of(self.server, model, ("sparse_embedding",))
                answer, _ = await self._texts(
                    request, pass_, doc, model, doc.get("inputs"), output="sparse_embedding"
                )
        except GatewayError as exc:
            return tei_error(exc, echo)
        body = []
        for row in answer.outputs[0].array:
            index = np.flatnonzero(row)
            if top_k is not None and len(index) > top_k:
                index = np.sort(index[np.argsort(-row[index], kind="stable")[:top_k]])
            body.append([{"index": int(i), "value": float(row[i])} for i in index])
        return _json(body, _headers(echo, answer))

    async def similarity(self, request: web.Request) -> web.Response:
        """The cosine of ``source_sentence``'s embedding with each of ``sentences``'."""
        echo = request_echo(request)
        try:
            with self.door.enter(self.http.metadata(request)) as pass_:
                doc = await self._body(request, "similarity", "'inputs': {'source_sentence', 'sentences'}")
                inputs = doc.get("inputs")
                if not isinstance(inputs, dict) or set(inputs) - {"source_sentence", "sentences"}:
                    raise invalid(
                        "'inputs' must be an object {'source_sentence': text, 'sentences': [text]}", "inputs"
                    )
                source = inputs.get("source_sentence")
                if not isinstance(source, str):
                    raise invalid("'inputs.source_sentence' must be a text", "inputs")
                sentences = inputs.get("sentences")
                if sentences == []:
                    raise invalid(EMPTY, "inputs")
                sentences = texts_of(sentences, "inputs")
                if len(sentences) >= MAX_INPUTS:
                    raise invalid(
                        f"'inputs.sentences' holds {len(sentences)} texts; at most {MAX_INPUTS - 1}", "inputs"
                    )
                params = doc.get("parameters") or {}
                if not isinstance(params, dict) or set(params) - _SIMILARITY_PARAMETERS:
                    raise invalid(
                        f"'parameters' must be an object with {sorted(_SIMILARITY_PARAMETERS)}", "parameters"
                    )
                model = tm.model_for(self.server, request, doc, ("embedding",))
                tm.runtime_of(self.server, model, ("embedding",))
                answer, _ = await self._texts(
                    request, pass_, doc, model, [source, *sentences], output="embedding", params=params
                )
        except GatewayError as exc:
            return tei_error(exc, echo)
        v = answer.outputs[0].array.astype(np.float64)
        v /= np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)
        return _json([float(c) for c in v[1:] @ v[0]], _headers(echo, answer))

    # -- classifiers ----------------------------------------------------------------------------

    async def _classify(self, request, pass_, doc, model, rows: list[list[str]], raw: bool, field: str):
        rt = tm.runtime_of(self.server, model, ("classification", "rerank"))
        rerank = rt.spec.kind == "rerank"  # TEI's /predict takes a reranker too: its one score
        pairs = rt.text.settings.pair
        for i, row in enumerate(rows):
            if (len(row) == 2) != pairs:
                want = "a pair [text, text]" if pairs else "a single text"
                raise invalid(f"'{field}[{i}]': model '{model}' classifies {want} per row", field)
            if pairs and PAIR_SEPARATOR in row[0]:
                raise invalid(
                    f"'{field}[{i}]': the first text may not hold U+001F (the pair separator)", field
                )
        texts = [PAIR_SEPARATOR.join(r) for r in rows]
        answer, _ = await self._texts(
            request,
            pass_,
            doc,
            model,
            texts,
            output="score" if rerank else "logits" if raw else "probabilities",
            field=field,
            pairs=pairs,
        )
        # (a rerank model's one label: transformers' default name, as its id2label has it)
        return answer, ("LABEL_0",) if rerank else rt.spec.labels

    async def predict(self, request: web.Request) -> web.Response:
        """TEI's ``POST /predict``: per row every label's score, highest first; probabilities
        (softmax, or each label's sigmoid for a multi-label model) unless ``raw_scores``. A rerank
        model's pairs get their one score, through a sigmoid unless ``raw_scores``, as TEI's."""
        echo = request_echo(request)
        try:
            with self.door.enter(self.http.metadata(request)) as pass_:
                doc = await self._body(request, "predict", "'inputs'")
                if doc.get("inputs") == []:
                    raise invalid(EMPTY, "inputs")
                rows, batch = _predict_rows(doc.get("inputs"))
                raw = flag(doc, "raw_scores", False)
                model = tm.model_for(self.server, request, doc, ("classification", "rerank"))
                answer, labels = await self._classify(request, pass_, doc, model, rows, raw, "inputs")
        except GatewayError as exc:
            return tei_error(exc, echo)
        out = []
        scores = answer.outputs[0].array
        if answer.outputs[0].name == "score" and not raw:
            scores = _sigmoid(scores)
        for row in scores:
            order = np.argsort(-row, kind="stable")
            out.append([{"score": float(row[j]), "label": labels[j]} for j in order])
        return _json(out if batch else out[0], _headers(echo, answer))

    async def classify(self, request: web.Request) -> web.Response:
        """vLLM's (and SGLang's) ``POST /classify``: ``{data: [{index, label, probs,
        num_classes}], usage}``, the label being the most probable one."""
        echo = request_echo(request)
        try:
            with self.door.enter(self.http.metadata(request)) as pass_:
                doc = await self._body(request, "classify", "'input'")
                if "input" not in doc:
                    raise invalid("'input' is required: a text or a list of texts", "input")
                if "user" in doc and not isinstance(doc["user"], str):
                    raise invalid("'user' must be a string", "user")
                value = doc["input"]
                if isinstance(value, list) and value and all(isinstance(v, list) for v in value):
                    rows, _ = _predict_rows(value)  # rows of [text] or [text, text], as TEI's batch
                else:
                    rows = [[t] for t in texts_of(value, "input")]
                model = tm.model_for(self.server, request, doc, ("classification",))
                answer, labels = await self._classify(request, pass_, doc, model, rows, False, "input")
        except GatewayError as exc:
            return openai_error(exc, echo)
        data = []
        for i, row in enumerate(answer.outputs[0].array):
            data.append({"index": i, "label": labels[int(np.argmax(row))], "probs": row.tolist(),
                         "num_classes": len(labels)})  # fmt: skip
        total = sum(answer.tokens)
        body = {
            "id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": answer.model, "data": data,
            "usage": {"prompt_tokens": total, "total_tokens": total, "completion_tokens": 0,
                      "prompt_tokens_details": None},
        }  # fmt: skip
        return _json(body, echo)


def routes(server: Server, http: Http) -> list[web.RouteDef]:
    """TEI's routes beside tei.py's, vLLM's ``/classify``, and every TEI route under
    ``/tei/{model}`` (the HTTP listener's ``app()`` adds them)."""
    api = TeiSurface(server, http)
    tei = Tei(server, http)
    table = [
        ("GET", "/info", api.info), ("GET", "/health", api.health),
        ("POST", "/tokenize", api.tokenize), ("POST", "/decode", api.decode),
        ("POST", "/embed_all", api.embed_all), ("POST", "/embed_sparse", api.embed_sparse),
        ("POST", "/similarity", api.similarity), ("POST", "/predict", api.predict),
    ]  # fmt: skip
    out = [web.route(method, path, handler) for method, path, handler in table]
    out += [web.post("/classify", api.classify), web.post("/v1/classify", api.classify)]
    under = [*table, ("POST", "/embed", tei.embed), ("POST", "/rerank", tei.rerank)]
    out += [web.route(method, "/tei/{model}" + path, handler) for method, path, handler in under]
    return out
