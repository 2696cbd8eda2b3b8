"""Which model a TEI route serves, and what TEI's ``GET /info`` says about it.

TEI's clients assume one model per server. At the root, TEI's routes serve the default model
(setting ``tei_default_model``; unset: the first text embedding model by name) unless the body
names another (``model``, an extension); under ``/tei/{model}`` each text model is a TEI server of
its own, the path's model answering every route and its own ``/info``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiohttp import web

from batchgate.gateway import tokens
from batchgate.gateway.errors import GatewayError, clip, invalid, not_found
from batchgate.gateway.infer import VERSION
from batchgate.gateway.transport.fields import MAX_INPUTS, texts_of

if TYPE_CHECKING:
    from batchgate.gateway.runtime import ModelRuntime
    from batchgate.gateway.transport.server import Server

# Parameter kind -> TEI's model type (a sparse encoder is TEI's embedding model with SPLADE pooling).
TEI_TYPE = {"embedding": "embedding", "sparse_embedding": "embedding", "classification": "classifier",
            "rerank": "reranker"}  # fmt: skip
_POOLING = {"mean": "mean", "cls": "cls", "lasttoken": "last_token"}
_DTYPE = {"FP32": "float32", "FP16": "float16", "BF16": "bfloat16", "INT8": "int8"}
# The route each kind is asked through, for the refusal that points a caller at it.
ROUTE_OF = {"embedding": "/embed", "sparse_embedding": "/embed_sparse", "classification": "/predict",
            "rerank": "/rerank"}  # fmt: skip


def text_models(server: Server) -> dict[str, str]:
    """Served text models -> their kind, by name."""
    plane = server.plane
    out = {}
    for name in sorted(plane.models):
        versions = plane.models[name]
        rt = versions.get(plane.latest[name]) if versions else None
        if rt is not None and rt.text is not None and rt.spec.kind is not None:
            out[name] = rt.spec.kind
    return out


def default_model(server: Server) -> str | None:
    """What the root's TEI routes serve when a call names no model."""
    chosen = server.settings.tei_default_model
    if chosen:
        return chosen
    kinds = text_models(server)
    return next((n for n, k in kinds.items() if k == "embedding"), next(iter(kinds), None))


def model_for(server: Server, request: web.Request, doc: Any, kinds: tuple[str, ...]) -> str:
    """The model a TEI route serves: the path's (``/tei/{model}``), else the body's ``model``, else
    the default model when it is of ``kinds``, else the only served model of ``kinds``."""
    path = request.match_info.get("model")
    named = doc.get("model") if isinstance(doc, dict) else None
    if named is not None and (not isinstance(named, str) or not named):
        raise invalid("'model' must be the name of a served text model", "model")
    if path is not None:
        if named is not None and named != path:
            raise invalid(f"'model' names another model than this base URL's ('{path}')", "model")
        return path
    if named is not None:
        return named
    served = text_models(server)
    if not served:
        raise not_found("this server serves no text model: TEI's routes have nothing to serve")
    default = default_model(server)
    if default is not None and served.get(default, kinds[0]) in kinds:
        return default
    fitting = [n for n, k in served.items() if k in kinds]
    if len(fitting) == 1:
        return fitting[0]
    raise invalid(
        f"'model' is required: the default model '{default}' is not of kind {' or '.join(kinds)}; "
        f"those served: {fitting} (or use the base URL /tei/<model>)", "model",
    )  # fmt: skip


def runtime_of(server: Server, model: str, kinds: tuple[str, ...] | None = None) -> ModelRuntime:
    """The served text model ``model``, refused naming ``model`` when it is not one of ``kinds``."""
    try:
        rt = server.plane.get(model)
    except GatewayError as exc:
        exc.field = "model"
        raise
    kind = rt.spec.kind if rt.text is not None else None
    if kind is None:
        raise invalid(
            f"model '{model}' does not take text; text models: {sorted(text_models(server))}", "model"
        )
    if kinds is not None and kind not in kinds:
        raise invalid(
            f"model '{model}' is a {kind.replace('_', ' ')} model, not {' or '.join(kinds)}: "
            f"send it to {ROUTE_OF[kind]}", "model",
        )  # fmt: skip
    return rt


def truncates(server: Server, model: str) -> bool:
    """The model's own ``truncate`` setting, the default of every route that serves it (False for
    a model not served: the pipeline answers for it)."""
    try:
        rt = server.plane.get(model)
    except GatewayError:
        return False
    return rt.text is not None and rt.text.settings.truncate


def info(server: Server, model: str) -> dict:
    """TEI's ``/info`` for text model ``model``."""
    rt = runtime_of(server, model)
    spec, stage = rt.spec, rt.text
    kind = spec.kind
    if kind == "classification" or kind == "rerank":
        labels = spec.labels if kind == "classification" else ("LABEL_0",)
        meta: dict = {"id2label": {str(i): n for i, n in enumerate(labels)},
                      "label2id": {n: i for i, n in enumerate(labels)}}  # fmt: skip
    elif kind == "sparse_embedding":
        meta = {"pooling": "splade"}
    else:
        meta = {"pooling": _POOLING.get(spec.params.pooling or "mean", "mean")}
    s = stage.settings
    batch = spec.max_batch_size or 1
    return {
        "model_id": spec.name,
        "model_sha": spec.fingerprint,
        "model_dtype": _DTYPE.get(spec.precision, spec.precision.lower()),
        "model_type": {TEI_TYPE[kind]: meta},
        "max_concurrent_requests": server.settings.http_max_connections,
        "max_input_length": s.max_tokens,
        # no token budget (max_batch_tokens 0): a batch holds max_batch_size rows of any length
        "max_batch_tokens": s.max_batch_tokens or batch * s.max_tokens,
        "max_batch_requests": batch,
        "max_client_batch_size": MAX_INPUTS,
        "auto_truncate": s.truncate,
        "tokenization_workers": len(rt.pool.workers),
        "version": VERSION,
        "sha": None,
        "docker_label": None,
        # batchgate's own: the model's text limits and what it is served as
        "kind": kind,
        "max_text_bytes": s.max_text_bytes,
        "pairs": s.pair,
    }


def left_of(doc: dict) -> bool:
    """TEI's ``truncation_direction``: whether a text over the model's length keeps its last
    tokens (``Left``) rather than its first (``Right``, the default)."""
    value = doc.get("truncation_direction")
    if value is None or value in ("Right", "right"):
        return False
    if value in ("Left", "left"):
        return True
    raise invalid(
        f"'truncation_direction' must be 'Left' or 'Right', not {clip(value)!r}", "truncation_direction"
    )


def is_ids(value: Any) -> bool:
    """Whether a JSON ``input`` is token ids: a list of ints, or a list of such lists."""
    if not isinstance(value, list) or not value:
        return False
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return True
    return all(isinstance(v, list) and v and all(isinstance(x, int) for x in v) for v in value)


def inputs_of(server: Server, model: str, value: Any, field: str, truncate: bool, left: bool):
    """A call's texts, or for token ids (``is_ids``) placeholder texts and the rows as the model's
    input (``tokens.Ids``): (texts, encodings or None)."""
    if not is_ids(value):
        return texts_of(value, field), None
    rt = runtime_of(server, model)
    stage = rt.text
    rows = value if isinstance(value[0], list) else [value]
    if len(rows) > MAX_INPUTS:
        raise invalid(
            f"'{field}' holds {len(rows)} rows of token ids; at most {MAX_INPUTS} per request", field
        )
    if stage.settings.pair:
        raise invalid(f"model '{model}' takes pairs of texts, not token ids", field)
    rows = tokens.ids_of(rows, field, tokens.vocabulary_size(stage))
    return tokens.id_rows(rows, stage.settings.max_tokens, truncate, left, field)
