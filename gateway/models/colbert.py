"""ColBERT late-interaction models in PyLate's folder layout (``modules.json``: Transformer, then
its Dense projection(s), no Pooling; ``config_sentence_transformers.json``: ``query_prefix`` /
``document_prefix`` markers, ``query_length`` / ``document_length``, ``do_query_expansion``,
``attend_to_expansion_tokens``, ``skiplist_words``), built as PyLate's ``ColBERT.encode``
computes:

* the marker token right after CLS ("[Q] " for a query, "[D] " for a document: PyLate adds them to
  the tokenizer, so the folder's tokenizer.json holds each as one token; a text's prompt is the
  marker, prepended to it, which tokenizes to the same ids as PyLate's insertion);
* the encoder's token states through the Dense modules, each vector L2-normalised;
* ``token_embeddings`` [-1, dim] aligned with the input's positions and ``token_mask`` [-1],
  1 for the rows that are the text's vectors: a query's every token, its expansion tokens
  included (PyLate pads a query to ``query_length`` with the mask token and keeps all of them;
  they are masked as attention keys: ``attend_to_expansion_tokens`` true is refused); a document's
  attended tokens, less the skiplist's (punctuation by default).

Which kind of row the graph sees is read from the marker at position 1, so one graph answers
both; padding a query to ``query_length`` with the expansion token (attention mask 0) is the text
stage's part (parameters ``query_length`` and ``query_expansion_token_id``).
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from onnx import TensorProto

from batchgate.gateway.models.encoder import NORM_EPSILON, Dense, add_dense
from batchgate.gateway.models.onnx_graph import GraphBuilder

# PyLate's defaults for what its config leaves out.
DEFAULTS = {"query_prefix": "[Q] ", "document_prefix": "[D] ", "query_length": 32, "document_length": 180,
            "do_query_expansion": True, "attend_to_expansion_tokens": False}  # fmt: skip
# Keys that mark a config_sentence_transformers.json as PyLate's.
MARKERS = ("query_prefix", "document_prefix", "query_length", "document_length", "do_query_expansion",
           "attend_to_expansion_tokens", "skiplist_words")  # fmt: skip


@dataclass(frozen=True, eq=False)
class ColBERTHead:
    dense: tuple[Dense, ...]
    query_id: int  # the query marker's token id
    document_id: int
    expansion_id: int | None  # the token a query is padded with (None: no expansion)
    attend_expansion: bool  # always False: attend_to_expansion_tokens is refused
    skip_ids: tuple[int, ...]  # left out of a document's vectors
    query_length: int
    document_length: int
    query_prefix: str
    document_prefix: str

    def dim(self, hidden: int) -> int:
        return self.dense[-1].out_features if self.dense else hidden

    def add(self, g: GraphBuilder, x: str, mask: str) -> None:
        add_head(g, x, mask, self)


def is_pylate(st_config: dict) -> bool:
    return st_config.get("model_type") == "ColBERT" or any(k in st_config for k in MARKERS)


def read_head(st_config: dict, dense: tuple[Dense, ...], tokenizer: Path, where: Path) -> ColBERTHead:
    """The head from PyLate's config and the folder's tokenizer.json; ValueError naming what is missing."""
    from tokenizers import Tokenizer

    cfg = {**DEFAULTS, **{k: v for k, v in st_config.items() if v is not None}}
    tok = Tokenizer.from_file(str(tokenizer))
    ids = {}
    for key in ("query_prefix", "document_prefix"):
        prefix = str(cfg[key])
        if not prefix:
            raise ValueError(
                f"{where}: {key} is empty; a ColBERT model is served with its query and document markers "
                "(they tell the graph which rows are queries)"
            )
        token = tok.token_to_id(prefix)
        if token is None:
            raise ValueError(
                f"{where}: {key} {prefix!r} is not one token of {tokenizer} (PyLate adds its markers to the "
                "tokenizer when it saves the model)"
            )
        ids[key] = token
    if cfg["do_query_expansion"] and cfg["attend_to_expansion_tokens"]:
        raise ValueError(
            f"{where}: attend_to_expansion_tokens true is not supported; supported: false (PyLate's default: "
            "expansion tokens attend to the query, the query does not attend to them)"
        )
    expansion = None
    if cfg["do_query_expansion"]:
        # PyLate pads queries with the tokenizer's mask token.
        expansion = next(
            (tok.token_to_id(t) for t in ("[MASK]", "<mask>") if tok.token_to_id(t) is not None), None
        )
        if expansion is None:
            raise ValueError(
                f"{where}: do_query_expansion needs a mask token; {tokenizer} has neither [MASK] nor <mask>"
            )
    words = cfg.get("skiplist_words")
    words = list(string.punctuation) if words is None else list(words)
    skip = sorted({i for w in words if (i := tok.token_to_id(w)) is not None})
    return ColBERTHead(
        dense=dense,
        query_id=ids["query_prefix"],
        document_id=ids["document_prefix"],
        expansion_id=expansion,
        attend_expansion=False,
        skip_ids=tuple(skip),
        query_length=int(cfg["query_length"]),
        document_length=int(cfg["document_length"]),
        query_prefix=str(cfg["query_prefix"]),
        document_prefix=str(cfg["document_prefix"]),
    )


def _is(g: GraphBuilder, name: str, ids: str, values: tuple[int, ...]) -> str:
    """float [batch, seq]: 1 where ``ids`` is one of ``values``."""
    ids3 = g.op("Unsqueeze", [ids, g.const(f"{name}.axes", np.array([2], np.int64))], f"{name}.ids3")
    hit = g.op("Equal", [ids3, g.const(f"{name}.values", np.array(values, np.int64))], f"{name}.hit")
    hit = g.op("Cast", [hit], f"{name}.hit_f", to=TensorProto.FLOAT)
    return g.op("ReduceMax", [hit], f"{name}.any", axes=[2], keepdims=0)


def add_head(g: GraphBuilder, x: str, mask: str, head: ColBERTHead) -> None:
    """``token_embeddings`` and ``token_mask`` from the final states ``x`` [batch, seq, hidden]."""
    ids = "input_ids"
    second = g.op(
        "Gather", [ids, GraphBuilder.const(g, "cb.second", np.array(1, np.int64))], "cb.marker", axis=1
    )
    marker = g.op("Unsqueeze", [second, g.const("cb.marker_axes", np.array([1], np.int64))], "cb.marker2")

    def row_is(name: str, token: int) -> str:  # [batch, 1] float: the row's marker is ``token``
        hit = g.op("Equal", [marker, g.const(f"cb.{name}_id", np.array([token], np.int64))], f"cb.is_{name}")
        return g.op("Cast", [hit], f"cb.is_{name}_f", to=TensorProto.FLOAT)

    query, document = row_is("query", head.query_id), row_is("document", head.document_id)
    keep = mask
    if head.expansion_id is not None:  # a query keeps its expansion tokens (mask 0 unless attended)
        expansion = g.op("Mul", [_is(g, "cb.exp", ids, (head.expansion_id,)), query], "cb.query_expansion")
        keep = g.op("Max", [keep, expansion], "cb.keep_expansion")
    if head.skip_ids:  # a document drops its skiplist tokens
        skipped = g.op("Mul", [_is(g, "cb.skip", ids, head.skip_ids), document], "cb.doc_skipped")
        keep = g.op("Mul", [keep, g.op("Sub", ["one_f", skipped], "cb.not_skipped")], "cb.keep_skip")
    g.op("Identity", [keep], "token_mask")
    v = add_dense(g, x, head.dense, prefix="cb.dense")
    v = g.op("Mul", [v, g.op("Unsqueeze", [keep, g.const("cb.keep_axes", np.array([2], np.int64))], "cb.keep3")],
             "cb.kept")  # fmt: skip
    norm = g.op("ReduceL2", [v], "cb.norm", axes=[2], keepdims=1)
    norm = g.op("Max", [norm, g.const("cb.norm_eps", np.array(NORM_EPSILON, np.float32))], "cb.norm_clamped")
    g.op("Div", [v, norm], "token_embeddings")
