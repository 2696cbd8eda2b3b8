"""vLLM's (and SGLang's) scoring routes on the REST listener: ``POST /classify`` and
``/v1/classify`` for classifiers, ``POST /score`` and ``/v1/score`` (``text_1``, ``text_2``) for
cross-encoders.

Only translation lives here: each body into one ``TextCall`` (gateway/call.py), the
``TextAnswer`` into vLLM's JSON. Errors in OpenAI's shape, as vLLM answers.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

import numpy as np
from aiohttp import web

from batchgate.gateway.call import TextCall
from batchgate.gateway.errors import invalid
from batchgate.gateway.text import PAIR_SEPARATOR
from batchgate.gateway.transport.bodies import ClassifyRequest, ScoreRequest
from batchgate.gateway.transport.fields import (
    MAX_INPUTS,
    TextRoutes,
    json_response,
    latency_of,
    left_of,
    openai_error,
    texts_of,
)

if TYPE_CHECKING:
    from batchgate.gateway.transport.http import Http
    from batchgate.gateway.transport.server import Server


def _truncation(body: ClassifyRequest | ScoreRequest) -> dict:
    return {"truncate": body.truncate, "left": left_of(body.truncation_direction)}


def _rows(value: Any) -> tuple[list[str], bool]:
    """``input``: a text, texts, or rows of ``[text]`` / ``[text, text]`` (all alike)."""
    if isinstance(value, list) and value and all(isinstance(v, list) for v in value):
        if len(value) > MAX_INPUTS:
            raise invalid(f"'input' holds {len(value)} rows; at most {MAX_INPUTS} per request", "input")
        width = len(value[0])
        for i, row in enumerate(value):
            if len(row) != width or width not in (1, 2) or not all(isinstance(t, str) for t in row):
                raise invalid(f"'input[{i}]' must be [text] or [text, text], as every other row", "input")
            if width == 2 and PAIR_SEPARATOR in row[0]:
                raise invalid(f"'input[{i}]': the first text may not hold U+001F", "input")
        return [PAIR_SEPARATOR.join(r) for r in value], width == 2
    return texts_of(value, "input"), False


def classify_call(request: web.Request, body: ClassifyRequest) -> TextCall:
    texts, pairs = _rows(body.input)
    return TextCall(
        "labels", body.model, texts=texts, pairs=pairs, parameters=latency_of(request, body), field="input",
        **_truncation(body),
    )  # fmt: skip


def _head(kind: str, answer) -> dict:
    total = sum(answer.tokens)
    return {
        "id": f"{kind}-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": answer.model,
        "usage": {"prompt_tokens": total, "total_tokens": total, "completion_tokens": 0,
                  "prompt_tokens_details": None},
    }  # fmt: skip


def classify_body(body: ClassifyRequest, call: TextCall, answer, headers: dict) -> web.Response:
    data = []
    for i, row in enumerate(answer.scores):
        data.append({"index": i, "label": answer.labels[int(np.argmax(row))], "probs": row.tolist(),
                     "num_classes": len(answer.labels)})  # fmt: skip
    return json_response({**_head("classify", answer), "data": data}, headers)


def score_call(request: web.Request, body: ScoreRequest) -> TextCall:
    """``text_1`` against ``text_2``: one query against many texts, or pairs index by index."""
    first, second = body.text_1, body.text_2
    seconds = texts_of(second, "text_2")
    if isinstance(first, str) or (isinstance(first, list) and len(first) == 1):
        query = first if isinstance(first, str) else texts_of(first, "text_1")[0]
        return TextCall(
            "scores", body.model, texts=seconds, query=query, parameters=latency_of(request, body),
            field="text_2", **_truncation(body),
        )  # fmt: skip
    firsts = texts_of(first, "text_1")
    if len(firsts) != len(seconds):
        raise invalid(
            f"'text_1' holds {len(firsts)} texts and 'text_2' {len(seconds)}: send one 'text_1', or as many "
            "as 'text_2'", "text_1",
        )  # fmt: skip
    for i, t in enumerate(firsts):
        if PAIR_SEPARATOR in t:
            raise invalid(f"'text_1[{i}]' may not hold U+001F", "text_1")
    return TextCall(
        "scores", body.model, texts=[a + PAIR_SEPARATOR + b for a, b in zip(firsts, seconds)], pairs=True,
        parameters=latency_of(request, body), field="text_2", **_truncation(body),
    )  # fmt: skip


def score_body(body: ScoreRequest, call: TextCall, answer, headers: dict) -> web.Response:
    data = [{"index": i, "object": "score", "score": float(s)} for i, s in enumerate(answer.scores)]
    return json_response({**_head("score", answer), "data": data}, headers)


class Vllm(TextRoutes):
    async def classify(self, request: web.Request) -> web.Response:
        """``{data: [{index, label, probs, num_classes}], usage}``, the label the most probable one."""
        return await self.answer(request, ClassifyRequest, classify_call, classify_body, openai_error)

    async def score(self, request: web.Request) -> web.Response:
        """``{data: [{index, object: "score", score}], usage}``: each pair's relevance (sigmoid)."""
        return await self.answer(request, ScoreRequest, score_call, score_body, openai_error)


def routes(server: Server, http: Http) -> list[web.RouteDef]:
    api = Vllm(server, http)
    return [
        web.post("/classify", api.classify),
        web.post("/v1/classify", api.classify),
        web.post("/score", api.score),
        web.post("/v1/score", api.score),
    ]
