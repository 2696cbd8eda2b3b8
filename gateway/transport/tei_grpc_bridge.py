"""TEMPORARY: the text-call pipeline API (``texts(pass_, edge, TextCall) -> TextAnswer``,
``text_info``, ``tokenize``, ``decode``) over today's ``Pipeline.texts`` keyword call and the TEI
helpers, for as long as the pipeline does not offer it itself. tei_grpc.py uses the pipeline's own
methods when they exist; delete this file then.
"""

from __future__ import annotations

import asyncio

import numpy as np

from batchgate.gateway import tokens
from batchgate.gateway.call import TextAnswer, TextCall
from batchgate.gateway.errors import GatewayError, invalid, not_found
from batchgate.gateway.infer import prompt_of
from batchgate.gateway.repository import TOKEN_OUTPUT
from batchgate.gateway.text import PAIR_SEPARATOR
from batchgate.gateway.transport import tei_models as tm
from batchgate.gateway.transport.fields import dimensions_for

_KINDS = {"dense": ("embedding",), "sparse": ("sparse_embedding",), "tokens": ("embedding",),
          "labels": ("classification",), "scores": ("rerank",)}  # fmt: skip


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return (1.0 / (1.0 + np.exp(-x.astype(np.float64)))).astype(np.float32)


class Bridge:
    def __init__(self, server) -> None:
        self.server = server
        self.pipeline = server.pipeline
        self.door = server.pipeline.door
        self.settings = server.pipeline.settings
        self.plane = server.pipeline.plane

    def _model(self, model: str | None, kinds: tuple[str, ...] | None) -> str:
        if model is not None:
            if len(model) > 128:
                raise not_found("unknown model")
            return model
        served = tm.text_models(self.server)
        if kinds is None:
            default = tm.default_model(self.server)
            if default is None:
                raise not_found("this server serves no text model")
            return default
        default = tm.default_model(self.server)
        if default is not None and served.get(default) in kinds:
            return default
        fitting = [n for n, k in served.items() if k in kinds]
        if fitting:
            return fitting[0]
        raise not_found(f"this server serves no {' or '.join(kinds)} model")

    def text_info(self, model: str | None) -> dict:
        return tm.info(self.server, self._model(model, None))

    async def texts(self, pass_, edge, call: TextCall) -> TextAnswer:
        server = self.server
        model = self._model(call.model, _KINDS[call.output])
        rt = tm.runtime_of(server, model, _KINDS[call.output])
        truncate = call.truncate if call.truncate is not None else tm.truncates(server, model)
        texts, output, pairs = call.texts, None, False
        for t in texts:
            if t == "":
                raise invalid("Input cannot be empty", call.field)
        if call.output == "sparse":
            output = "sparse_embedding"
        elif call.output == "tokens":
            output = TOKEN_OUTPUT
            if rt.spec.output(TOKEN_OUTPUT) is None:
                raise invalid(f"model '{model}' has no per-token output", "model")
        elif call.output == "labels":
            output = "logits" if call.raw_scores else "probabilities"
            pairs = rt.text.settings.pair
            if call.pairs != pairs:
                raise invalid(
                    f"model '{model}' classifies {'pairs' if pairs else 'single texts'}", call.field
                )
        elif call.output == "scores":
            if not call.query:
                raise invalid("'query' is required: a non-empty string", "query")
            texts = [call.query + PAIR_SEPARATOR + t for t in texts]
            pairs = True
        if call.dimensions is not None:
            call.dimensions = dimensions_for(server, model, call.dimensions)
        a = await self.pipeline.texts(
            pass_, edge, model, texts, dict(call.parameters), exact_limit=not truncate,
            prompt_name=call.prompt_name, cut=truncate, output=output, left=call.left, pairs=pairs,
        )  # fmt: skip
        arr = a.outputs[0].array
        spec = rt.spec
        out = TextAnswer(spec.name, spec.version, spec.kind, a.tokens)
        if call.output == "dense":
            v = arr[:, : call.dimensions].copy() if call.dimensions else arr
            if call.normalize:
                n = np.linalg.norm(v, axis=1, keepdims=True)
                v = (v / np.maximum(n, 1e-12)).astype(np.float32)
            out.dense = {"float": v}
        elif call.output == "sparse":
            out.sparse = [(np.flatnonzero(r), r[np.flatnonzero(r)]) for r in arr]
        elif call.output == "tokens":
            out.token_vectors = [arr[i, :n] for i, n in enumerate(a.tokens)]
        elif call.output == "labels":
            out.scores, out.labels = arr, tuple(spec.labels)
        else:
            out.scores = arr[:, 0] if call.raw_scores else _sigmoid(arr[:, 0])
        return out

    async def tokenize(self, pass_, model, texts, add_special_tokens, prompt_name) -> list[list[dict]]:
        rt = tm.runtime_of(self.server, self._model(model, None))
        if pass_.caller is not None and not pass_.caller.tenant.allows(rt.spec.name):
            raise not_found(f"unknown model '{rt.spec.name}'")
        try:
            prompt = prompt_of(rt.spec, prompt_name)
        except GatewayError as exc:
            exc.field = "prompt_name"
            raise
        return await asyncio.to_thread(
            tokens.tokenize, rt.text, [prompt + t for t in texts], add_special_tokens
        )

    async def decode(self, pass_, model, ids, skip_special_tokens) -> list[str]:
        rt = tm.runtime_of(self.server, self._model(model, None))
        if pass_.caller is not None and not pass_.caller.tenant.allows(rt.spec.name):
            raise not_found(f"unknown model '{rt.spec.name}'")
        rows = tokens.ids_of(ids, "ids", tokens.vocabulary_size(rt.text))
        return await asyncio.to_thread(tokens.decode, rt.text, rows, skip_special_tokens)
