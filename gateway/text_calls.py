"""What a text call means for its model: every decision about a ``TextCall`` (gateway/call.py),
made once, here, whichever wire the call came on.

A wire parses its body into a ``TextCall`` and formats the ``TextAnswer``; ``Pipeline.texts``
(gateway/infer.py) looks the model up, asks ``plan`` what the call means for it (the model of
the wire's default, its kind against the output asked for, the prompt, truncation, what token ids
mean, the Matryoshka size), makes the rows (``rows``: texts, pairs, ids, cuts) and, after the
runtime, shapes the answer (``finish``: the cut, normalisation, scores' activation, quantised
forms). So the OpenAI, TEI (REST and gRPC), Cohere and infinity/vLLM wires answer alike, and a
new wire is a parser and a formatter.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np

from batchgate.gateway import openai_ids, tokens, vector_types
from batchgate.gateway.call import OUTPUTS, VECTOR_TYPES, TextAnswer, TextCall
from batchgate.gateway.errors import GatewayError, Kind, clip, invalid, not_found
from batchgate.gateway.repository import TOKEN_OUTPUT
from batchgate.gateway.text import PAIR_SEPARATOR
from batchgate.gateway.vector_types import CALIBRATED

MAX_INPUTS = 2048  # texts per call: OpenAI's own limit

# What each output is asked of: the model kinds (parameter ``kind``) that make it.
KINDS_OF = {
    "dense": ("embedding",),
    "sparse": ("sparse_embedding",),
    "tokens": ("embedding",),
    "scores": ("rerank",),
    "labels": ("classification", "rerank"),  # TEI's /predict takes a reranker's pairs: its one score
}
assert tuple(KINDS_OF) == OUTPUTS
# The call a model of each kind answers, for the refusal that points a caller at it.
ASKED_BY = {
    "embedding": "an embedding call (/v1/embeddings, /embed)",
    "multi_vector": "a token-vector call (/embed_all) or a rerank call (MaxSim)",
    "sparse_embedding": "a sparse embedding call (/embed_sparse)",
    "classification": "a classification call (/predict, /classify)",
    "rerank": "a rerank call (/rerank, /v1/rerank, /v2/rerank)",
}
# Cohere's input_type -> the prompt names a model's card may give it, in order of preference.
INPUT_TYPE_PROMPTS = {
    "search_query": ("query", "search_query", "retrieval.query"),
    "search_document": ("document", "passage", "search_document", "retrieval.passage", "doc"),
    "classification": ("classification",),
    "clustering": ("clustering",),
}
# What an embedding call does with a text over the model's length (parameter / field long_inputs).
LONG_INPUTS = ("truncate", "chunk")
# What a token-id input on the OpenAI wire means (setting / parameter ``openai_token_ids``).
OPENAI_ID_MODES = ("openai", "model", "refuse")


def text_models(plane) -> dict[str, str]:
    """Served text models -> their kind, by name (no lookup of a runtime by name: a scan)."""
    out = {}
    for name in sorted(plane.models):
        versions = plane.models[name]
        rt = versions.get(plane.latest[name]) if versions else None
        if rt is not None and rt.text is not None and rt.spec.kind is not None:
            out[name] = rt.spec.kind
    return out


def default_model(plane, settings, output: str | None) -> str:
    """The model a call that names none gets (TEI's clients assume one model per server): the
    setting ``tei_default_model``, else the only served model making ``output``, else the first
    embedding model by name."""
    served = text_models(plane)
    if not served:
        raise not_found("this server serves no text model")
    chosen = settings.tei_default_model
    if output is None:  # a call that reads the model (info, tokenize): the default model
        if chosen:
            return chosen
        return next((n for n, k in served.items() if k == "embedding"), next(iter(served)))
    kinds = KINDS_OF[output]
    if chosen and served.get(chosen, kinds[0]) in kinds:
        return chosen
    fitting = [n for n, k in served.items() if k in kinds]
    if len(fitting) == 1 or (fitting and not chosen and output in ("dense", "tokens")):
        return fitting[0]
    who = f"the default model '{chosen}' is not" if chosen else "no single served model is"
    raise invalid(
        f"'model' is required: {who} of kind {' or '.join(kinds)}; those served: {fitting} "
        "(or use the base URL /tei/<model>)",
        "model",
    )


@dataclass(slots=True)
class Plan:
    """The decisions of one call for one model, made before admission."""

    model: str
    output: str  # the model's output tensor the call reads
    prompt: str
    truncate: bool  # a text over the model's length is cut (else refused)
    dimensions: int | None  # Matryoshka size, None: the model's own
    tag: str  # a cache namespace suffix for rows made another way than the usual tokenisation
    id_mode: str | None  # token ids: "model" (used as they are) or "openai" (decoded to text)
    chunk: bool = False  # long texts split into chunks, answered as their token-weighted mean
    groups: list[int] | None = None  # rows per text of the call, where texts became several rows
    spans: list | None = None  # late chunking: per row, (text index, first token, end token) per chunk


def _a(kind: str) -> str:
    kind = kind.replace("_", " ")
    return ("an " if kind[0] in "aeiou" else "a ") + kind


def multi_output(spec, output: str) -> bool:
    """Whether a model not of ``output``'s kind still makes it from outputs beside its own: an
    embedding model with a sparse head (BGE-M3) answers sparse calls, one with score_weights
    (BGE-M3: dense, sparse and token vectors) and a ColBERT model (kind multi_vector) rerank, a
    ColBERT model answers token-vector calls."""
    kind = spec.kind
    if output == "sparse":
        return kind == "embedding" and spec.output("sparse_embedding") is not None
    if output == "scores":
        return (kind == "embedding" and spec.params.score_weights is not None) or kind == "multi_vector"
    if output == "tokens":
        return kind == "multi_vector"
    return False


def check_kind(rt, model: str, output: str, plane=None) -> None:
    """Refuses a model that does not make ``output``, naming the call it answers (and, given the
    ``plane``, the models that do make it)."""
    kind = rt.spec.kind if rt.text is not None else None
    if kind is None:
        raise invalid(f"model '{model}' does not take text", "model")
    if kind not in KINDS_OF[output] and not multi_output(rt.spec, output):
        wanted = " or ".join(k.replace("_", " ") for k in KINDS_OF[output])
        those = (
            ""
            if plane is None
            else f"; {wanted} models: {[n for n, k in text_models(plane).items() if k in KINDS_OF[output]]}"
        )
        raise invalid(
            f"model '{model}' is {_a(kind)} model, not {_a(wanted)} model: send it {ASKED_BY[kind]}{those}",
            "model",
        )
    if output == "tokens" and rt.spec.output(TOKEN_OUTPUT) is None:
        raise invalid(
            f"model '{model}' has no per-token output '{TOKEN_OUTPUT}' (batchgate prepare-model ... "
            "token_embeddings adds it)",
            "model",
        )


def output_of(rt, call: TextCall) -> str | tuple[str, ...]:
    """The model output(s) the call reads."""
    spec = rt.spec
    mask = ("token_mask",) if spec.output("token_mask") is not None else ()
    if call.output == "sparse":
        return "sparse_embedding"
    if call.output == "tokens":
        return (TOKEN_OUTPUT, *mask) if mask else TOKEN_OUTPUT
    if call.output == "scores" and spec.kind == "multi_vector":
        return (TOKEN_OUTPUT, *mask)
    if call.output == "scores" and spec.kind == "embedding":  # BGE-M3: its three outputs
        return ("embedding", "sparse_embedding", TOKEN_OUTPUT, *mask)
    if call.output == "labels" and spec.kind == "rerank":
        return "score"
    if call.output == "labels":
        return "logits" if call.raw_scores else "probabilities"
    first = next((t.name for t in spec.outputs if t.datatype == "FP32"), None)
    if first is None:
        raise invalid(f"model '{spec.name}' has no FP32 output to answer", "model")
    return "embedding" if spec.output("embedding") is not None and call.output == "dense" else first


def prompt_of(spec, name: str | None, input_type: str | None = None) -> str:
    """The prompt text a call gets: the one it names, else the one its Cohere ``input_type``
    maps to among the model's prompts, else the model's default, else none. An unknown name is
    refused with the model's prompts."""
    params = spec.params
    prompts = params.prompts
    if name is None and input_type is not None:
        name = next((p for p in INPUT_TYPE_PROMPTS.get(input_type, ()) if p in prompts), None)
        if name is None:
            return ""  # a model without such a prompt embeds the text as it is
    if name is None:
        name = params.default_prompt_name
        if name is None:
            return ""
    if name not in prompts:
        raise invalid(
            f"model '{spec.name}' has no prompt '{clip(name)}'; its prompts: {sorted(prompts)}"
            + ("" if prompts else " (none: the model's folder declared no prompts)"),
            "prompt_name",
        )
    return prompts[name]


def dimensions_of(spec, value: int | None) -> int | None:
    """The size the call's ``dimensions`` cuts vectors to (None: the model's own size)."""
    if value is None:
        return None
    output = spec.output("embedding") or next((t for t in spec.outputs if t.datatype == "FP32"), None)
    if output is None or len(output.dims) != 1:
        raise invalid(f"model '{spec.name}' does not take 'dimensions'", "dimensions")
    dim, allowed = output.dims[0], spec.params.matryoshka_dimensions
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid("'dimensions' must be an integer", "dimensions")
    if value == dim:
        return None
    if value in allowed and value < dim:
        return value
    sizes = sorted({*(a for a in allowed if a < dim), dim})
    why = (
        "its Matryoshka sizes (parameter matryoshka_dimensions) and its own"
        if allowed
        else "none declared: it returns"
    )
    raise invalid(
        f"model '{spec.name}' does not support 'dimensions' {value}: {why} {sizes}-dim vectors "
        f"(omit 'dimensions' or send one of {sizes})",
        "dimensions",
    )


def id_mode(rt, settings, call: TextCall) -> str | None:
    """What the call's token ids are: None (texts), "model" (its tokenizer's ids) or "openai"
    (OpenAI's cl100k_base ids, decoded to text): the model's parameter ``openai_token_ids``, else
    the server's setting, for the OpenAI wire; the model's own ids on TEI's."""
    if call.ids is None:
        return None
    if call.ids_from != "openai":
        return "model"
    mode = openai_ids.meaning(settings.openai_token_ids, rt.spec.params.openai_token_ids)
    if mode == "refuse":
        raise openai_ids.refusal(rt.spec.name, call.field)
    return mode


def plan(rt, plane, call: TextCall, model: str) -> Plan:
    """Every decision of ``call`` for runtime ``rt`` (its model ``model``, served by ``plane``),
    before admission."""
    if call.output not in KINDS_OF:
        raise invalid(f"unknown output {call.output!r}; one of {OUTPUTS}")
    settings = plane.settings
    check_kind(rt, model, call.output, plane)
    stage, spec = rt.text, rt.spec
    for t in call.types:
        if t not in VECTOR_TYPES:
            raise invalid(
                f"'embedding_types' holds {clip(str(t))!r}; one of {list(VECTOR_TYPES)}", "embedding_types"
            )
    prompt = prompt_of(spec, call.prompt_name, call.input_type)
    truncate = stage.settings.truncate if call.truncate is None else call.truncate
    if call.max_tokens is not None:
        truncate = True  # Cohere's max_tokens_per_doc: the caller asked for a cut
    mode = id_mode(rt, settings, call)
    if mode is not None and call.output in ("scores", "labels"):
        raise invalid(f"model '{model}' takes texts, not token ids", call.field)
    tag = f"it:{call.input_type}" if call.input_type is not None else ""
    long = call.long_inputs or spec.params.long_inputs
    if long not in LONG_INPUTS:
        raise invalid(
            f"'long_inputs' must be one of {list(LONG_INPUTS)}, not {clip(str(long))!r}", "long_inputs"
        )
    output = output_of(rt, call)
    if call.late_chunking:
        if call.output != "dense" or call.query is not None or mode is not None:
            raise invalid("'late_chunking' takes the texts of one document, for embeddings", "late_chunking")
        if spec.output(TOKEN_OUTPUT) is None:
            raise invalid(
                f"model '{model}' has no per-token output '{TOKEN_OUTPUT}', which late chunking pools "
                "(batchgate prepare-model ... --token-embeddings adds it)",
                "late_chunking",
            )
        output = TOKEN_OUTPUT
    if call.max_chunks is not None and call.output != "scores":
        raise invalid("'max_chunks_per_doc' is for rerank calls", "max_chunks_per_doc")
    chunk = long == "chunk" and call.output == "dense" and call.query is None and not call.late_chunking
    return Plan(
        model,
        output,
        prompt,
        truncate,
        dimensions_of(spec, call.dimensions),
        tag,
        mode,
        chunk=chunk and mode is None,
    )


async def rows(rt, call: TextCall, p: Plan) -> tuple[list[str], list | None, str]:
    """The call's rows as the runtime takes them: texts (queries paired with each document for
    scores; each text cut to ``max_tokens`` tokens when asked), or for token ids placeholder texts
    and the encodings they stand for; and the cache tag of rows made otherwise than by the usual
    tokenisation."""
    stage = rt.text
    tag = p.tag
    if call.ids is not None:
        if not call.ids:
            raise invalid(f"'{call.field}' is an empty list; send at least one text", call.field)
        if len(call.ids) > MAX_INPUTS:
            raise invalid(
                f"'{call.field}' holds {len(call.ids)} rows of token ids; at most {MAX_INPUTS}", call.field
            )
        if p.id_mode == "openai":
            try:
                texts = await asyncio.to_thread(openai_ids.decode_rows, call.ids, call.field)
            except openai_ids.VocabularyMissing as exc:  # the server's install, not the caller's fault
                raise GatewayError(Kind.UNSUPPORTED, str(exc)) from None
            return texts, None, tag
        if stage.settings.pair:
            raise invalid(f"model '{p.model}' takes pairs of texts, not token ids", call.field)
        ids = tokens.ids_of(call.ids, call.field, tokens.vocabulary_size(stage))
        texts, given = tokens.id_rows(ids, stage.settings.max_tokens, p.truncate, call.left, call.field)
        return texts, given, tag + "ids"
    texts = call.texts
    if not texts:
        raise invalid(f"'{call.field}' is an empty list; send at least one text", call.field)
    if len(texts) > MAX_INPUTS:
        raise GatewayError(
            Kind.TOO_LARGE,
            f"'{call.field}' holds {len(texts)} texts; at most {MAX_INPUTS} per request",
            call.field,
        )
    for i, t in enumerate(texts):
        if t == "":
            raise invalid(f"input {i}: text is empty; send at least one character", call.field)
    if call.max_tokens is not None:
        texts = await asyncio.to_thread(_cut_tokens, stage, texts, call.max_tokens)
    if p.chunk:
        pieces = await asyncio.to_thread(_chunks, stage, texts, p.prompt, rt.spec.params.chunk_overlap)
        if any(len(c) > 1 for c in pieces):
            p.groups = [len(c) for c in pieces]
            texts = [c for cs in pieces for c in cs]
    if call.late_chunking:
        rows_, made, p.spans = await asyncio.to_thread(_late_windows, stage, texts, p.prompt)
        return rows_, made, tag
    if call.output == "scores" and call.max_chunks is not None:
        query = call.query or ""
        room = (
            stage.settings.max_tokens
            - stage.specials
            - len(stage.tokenizer(False).encode(query, add_special_tokens=False).ids)
        )
        pieces = await asyncio.to_thread(_split, stage, texts, max(room, 1), 0)
        pieces = [c[: call.max_chunks] for c in pieces]
        p.groups = [len(c) for c in pieces]
        texts = [c for cs in pieces for c in cs]
    if call.output == "dense" and call.query is not None:  # similarity: the query's vector first
        return [call.query, *texts], None, tag
    if call.output == "scores" and call.pairs:  # (query, document) pairs given whole (vLLM's /score)
        _check_pairs(texts, call.field)
        return texts, None, tag
    if call.output == "scores":
        query = call.query
        if query is None or not query.strip():
            raise invalid("'query' is required: a non-empty string", "query")
        if isinstance(p.output, tuple):  # a bi-encoder's rerank: the query, then each document
            spec = rt.spec
            prompts = spec.params.prompts
            q, d = prompts.get("query", p.prompt), prompts.get("document", p.prompt)
            p.prompt = ""  # each row's own, put in here
            rows_ = [q + query, *(d + t for t in texts)]
            given = _expanded(stage, spec, rows_[:1]) if q and q == prompts.get("query") else None
            if given is not None:
                return rows_, given + [None] * len(texts), tag + "qx"
            return rows_, None, tag
        if PAIR_SEPARATOR in query:
            raise invalid("'query' may not hold U+001F (the pair separator)", "query")
        return [query + PAIR_SEPARATOR + t for t in texts], None, tag
    if (
        call.output == "tokens"
        and rt.spec.params.query_length
        and p.prompt == rt.spec.params.prompts.get("query")
    ):
        given = _expanded(stage, rt.spec, [p.prompt + t for t in texts])
        if given is not None:
            p.prompt = ""
            return (
                [p_ + t for p_, t in zip([rt.spec.params.prompts["query"]] * len(texts), texts)],
                given,
                tag + "qx",
            )
    if call.output == "labels" and call.pairs:
        _check_pairs(texts, call.field)
        if not stage.settings.pair:
            # A classifier prepared for single texts still takes a pair as its tokenizer pairs two
            # sequences (TEI does): encoded here, apart in the cache.
            made = await asyncio.to_thread(_encode_pairs, stage, texts)
            return texts, made, tag + "pair"
    elif stage.settings.pair and call.output == "labels":
        raise invalid(f"model '{p.model}' classifies a pair [text, text] per row", call.field)
    return texts, None, tag


def _split(stage, texts: list[str], size: int, overlap: int) -> list[list[str]]:
    """Each text as the texts of its consecutive chunks of at most ``size`` tokens (special tokens
    not counted), each sharing ``overlap`` tokens with the one before, cut at token boundaries."""
    tok = stage.tokenizer(False)
    step = max(size - overlap, 1)
    out = []
    for t, e in zip(texts, tok.encode_batch(texts, add_special_tokens=False), strict=True):
        n = len(e.ids)
        if n <= size:
            out.append([t])
            continue
        parts = []
        for start in range(0, n, step):
            end = min(start + size, n)
            parts.append(t[e.offsets[start][0] : e.offsets[end - 1][1]])
            if end == n:
                break
        out.append(parts)
    return out


def _chunks(stage, texts: list[str], prompt: str, overlap: int) -> list[list[str]]:
    """Chunk mode: each text as chunks that fit the model with its prompt and special tokens."""
    room = stage.settings.max_tokens - stage.specials
    if prompt:
        room -= len(stage.tokenizer(False).encode(prompt, add_special_tokens=False).ids)
    return _split(stage, texts, max(room, 1), min(overlap, max(room - 1, 0)))


def _late_windows(stage, texts: list[str], prompt: str):
    """Late chunking: the call's texts are consecutive chunks of one document, joined by a space
    and encoded as one text; where that is longer than the model takes, consecutive chunks are
    grouped into windows that fit (each window one pass; a chunk longer than a window on its own
    is cut). Returns the windows' texts, their encodings, and per window the token span of each
    chunk in it (special tokens and the prompt outside every span)."""
    tok = stage.tokenizer(False)
    room = stage.settings.max_tokens - stage.specials
    if prompt:
        room -= len(tok.encode(prompt, add_special_tokens=False).ids)
    sizes = [len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False)]
    windows: list[list[int]] = [[]]
    used = 0
    for i, n in enumerate(sizes):
        if windows[-1] and used + n > room:
            windows.append([])
            used = 0
        windows[-1].append(i)
        used += n
    rows, starts = [], []
    for w in windows:
        at, pos = [], len(prompt)
        for i in w:
            at.append((i, pos, pos + len(texts[i])))
            pos += len(texts[i]) + 1
        rows.append(" ".join(texts[i] for i in w))
        starts.append(at)
    made = stage.encode([prompt + r for r in rows])
    spans = []
    for e, at in zip(made, starts, strict=True):
        row = []
        for i, c0, c1 in at:
            inside = [k for k, ((a, b), sp) in enumerate(zip(e.offsets, e.special_tokens_mask))
                      if not sp and a >= c0 and b <= c1 and b > a]  # fmt: skip
            row.append((i, inside[0], inside[-1] + 1) if inside else (i, 0, 0))
        spans.append(row)
    return rows, made, spans


def _expanded(stage, spec, texts: list[str]) -> list | None:
    """A ColBERT query's encoding as PyLate makes it: cut at ``query_length`` tokens, then padded
    up to it with ``query_expansion_token_id`` at attention mask 0 (None: the model expands none)."""
    length, token = spec.params.query_length, spec.params.query_expansion_token_id
    if not length or token is None:
        return None
    out = []
    for e in stage.tokenizer(False).encode_batch(texts):
        ids = list(e.ids)
        if len(ids) > length:
            ids = ids[: length - 1] + ids[-1:]  # keep the closing special token
        n = len(ids)
        out.append(tokens.Ids(ids + [token] * (length - n), [1] * n + [0] * (length - n), [0] * length))
    return out


def _check_pairs(texts: list[str], field: str) -> None:
    for i, t in enumerate(texts):
        first, sep, second = t.partition(PAIR_SEPARATOR)
        if not sep or first == "" or second == "":
            raise invalid(f"'{field}[{i}]' must be a pair of two non-empty texts", field)


def _cut_tokens(stage, texts: list[str], n: int) -> list[str]:
    """Each text cut after its first ``n`` tokens (special tokens not counted), at the end of the
    ``n``-th token's characters."""
    tok = stage.tokenizer(False)
    out = []
    for t, e in zip(texts, tok.encode_batch(texts, add_special_tokens=False), strict=True):
        out.append(t if len(e.ids) <= n else t[: e.offsets[n - 1][1]])
    return out


def _encode_pairs(stage, texts: list[str]) -> list:
    tok = stage.tokenizer(stage.settings.truncate, pad=False)
    stage._counted(len(texts))
    return tok.encode_batch([tuple(t.split(PAIR_SEPARATOR, 1)) for t in texts])


def _kept(arrays: dict, i: int, n: int) -> np.ndarray:
    """Row ``i``'s token vectors: where ``token_mask`` is 1 (BGE-M3 and ColBERT drop [CLS],
    padding and ColBERT's skiplist), else its first ``n``."""
    vectors = arrays[TOKEN_OUTPUT][i]
    mask = arrays.get("token_mask")
    if mask is None:
        return vectors[:n]
    return vectors[: mask.shape[1]][mask[i] != 0]


def _maxsim(q: np.ndarray, d: np.ndarray) -> float:
    """Each query vector's best dot product with the document's vectors, summed."""
    if not len(q) or not len(d):
        return 0.0
    return float((q.astype(np.float64) @ d.astype(np.float64).T).max(axis=1).sum())


def _finish_multi(call: TextCall, p: Plan, rt, arrays: dict, counts: list[int]) -> TextAnswer:
    spec = rt.spec
    if call.output == "tokens":
        answer = TextAnswer(spec.name, spec.version, spec.kind, counts, texts=call.texts)
        answer.token_vectors = [_kept(arrays, i, n) for i, n in enumerate(counts)]
        return answer
    # a bi-encoder's rerank: row 0 the query
    q = _kept(arrays, 0, counts[0])
    n = len(counts) - 1
    scores = np.empty(n, dtype=np.float32)
    weights = spec.params.score_weights
    for j in range(n):
        d = _kept(arrays, j + 1, counts[j + 1])
        if spec.kind == "multi_vector":  # ColBERT: MaxSim
            scores[j] = _maxsim(q, d)
            continue
        # BGE-M3: the card's weighted mean of its three scores; ColBERT's part averaged over the query
        dense = float(np.dot(arrays["embedding"][0], arrays["embedding"][j + 1]))
        sparse = float(
            np.dot(arrays["sparse_embedding"][0].astype(np.float64), arrays["sparse_embedding"][j + 1])
        )
        colbert = _maxsim(q, d) / max(len(q), 1)
        scores[j] = (weights[0] * dense + weights[1] * sparse + weights[2] * colbert) / sum(weights)
    tokens_ = counts[1:]
    if tokens_:
        tokens_[0] += counts[0]  # the query's tokens billed with the first document
    answer = TextAnswer(spec.name, spec.version, spec.kind, tokens_, texts=call.texts)
    answer.scores = scores  # similarities, not logits: no sigmoid
    return answer


def _combine(array: np.ndarray, counts: list[int], groups: list[int], output: str):
    """Rows of chunks back to one row per text: embeddings as their chunks' token-weighted mean
    (re-normalised where the model's vectors are unit length), scores as the best chunk's."""
    out, tokens, at = [], [], 0
    for n in groups:
        rows, w = array[at : at + n], np.asarray(counts[at : at + n], dtype=np.float64)
        if output == "scores":
            out.append(rows.max(axis=0))
        elif n == 1:
            out.append(rows[0])
        else:
            mean = (rows.astype(np.float64) * w[:, None]).sum(0) / w.sum()
            if np.allclose(np.linalg.norm(rows, axis=1), 1.0, atol=1e-4):
                mean /= max(np.linalg.norm(mean), 1e-12)
            out.append(mean.astype(np.float32))
        tokens.append(int(w.sum()))
        at += n
    return np.stack(out), tokens


def _pool_spans(array: np.ndarray, spans: list, texts: int, normalize: bool):
    """Late chunking: each chunk's mean token vector over its span of its window's pass."""
    dim = array.shape[-1]
    out = np.zeros((texts, dim), dtype=np.float32)
    tokens = [0] * texts
    for w, row in enumerate(spans):
        for i, t0, t1 in row:
            if t1 > t0:
                v = array[w, t0:t1].astype(np.float64).mean(0)
                if normalize:
                    v /= max(np.linalg.norm(v), 1e-12)
                out[i] = v
            tokens[i] = t1 - t0
    return out, tokens


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


def dense(vectors: np.ndarray, size: int | None, normalize: bool | None) -> np.ndarray:
    """The Matryoshka cut and normalisation, in one place for every wire: the leading ``size``
    values re-normalised (unless the call said ``normalize: false``); without a cut, rows made unit
    length when the call asked for it, else as the model made them."""
    if size is not None:  # the cut the int8/uint8 ranges were calibrated on (vector_types.cut)
        return (
            np.ascontiguousarray(vectors[:, :size], dtype=np.float32)
            if normalize is False
            else vector_types.cut(vectors, size)
        )
    return _unit(vectors) if normalize else vectors


def finish(call: TextCall, p: Plan, rt, array: np.ndarray, counts: list[int], ranges=None) -> TextAnswer:
    """The runtime's ``array`` for the call's rows, shaped as the call asked."""
    spec = rt.spec
    if isinstance(array, dict):
        return _finish_multi(call, p, rt, array, counts)
    if p.spans is not None:  # late chunking: each text's vector pooled from its span of the pass
        array, counts = _pool_spans(array, p.spans, len(call.texts), bool(spec.params.normalize))
    elif p.groups is not None:
        array, counts = _combine(array, counts, p.groups, call.output)
    answer = TextAnswer(spec.name, spec.version, spec.kind, counts, texts=call.texts)
    if call.output == "dense" and call.query is not None:  # the cosine of each text with the query
        v = array.astype(np.float64)
        v /= np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)
        answer.scores = (v[1:] @ v[0]).astype(np.float32)
    elif call.output == "dense":
        vectors = dense(array, p.dimensions, call.normalize)
        for t in call.types:
            size = vectors.shape[1]
            answer.dense[t] = vector_types.quantize(
                vectors, t, ranges.for_size(size) if t in CALIBRATED else None
            )
    elif call.output == "scores":
        scores = array[:, 0].copy()
        answer.scores = scores if call.raw_scores else _sigmoid(scores)
    elif call.output == "labels" and spec.kind == "rerank":  # one label, transformers' default name
        answer.scores = array if call.raw_scores else _sigmoid(array)
        answer.labels = ("LABEL_0",)
    elif call.output == "labels":
        answer.scores = array
        answer.labels = spec.labels
    elif call.output == "sparse":
        for row in array:
            index = np.flatnonzero(row)
            answer.sparse.append((index, row[index]))
    else:  # tokens
        answer.token_vectors = [array[i, :n] for i, n in enumerate(counts)]
    return answer


# Parameter kind -> TEI's model type (a sparse encoder is TEI's embedding model with SPLADE pooling).
TEI_TYPE = {"embedding": "embedding", "sparse_embedding": "embedding", "classification": "classifier",
            "rerank": "reranker", "multi_vector": "embedding"}  # fmt: skip
_POOLING = {"mean": "mean", "cls": "cls", "lasttoken": "last_token"}
_DTYPE = {"FP32": "float32", "FP16": "float16", "BF16": "bfloat16", "INT8": "int8"}


def describe(rt, settings, version: str, ranges=None) -> dict:
    """TEI's ``/info`` for a text model's runtime, with batchgate's own fields after TEI's."""
    spec, stage = rt.spec, rt.text
    kind = spec.kind
    if kind == "classification" or kind == "rerank":
        labels = spec.labels if kind == "classification" else ("LABEL_0",)
        meta: dict = {"id2label": {str(i): n for i, n in enumerate(labels)},
                      "label2id": {n: i for i, n in enumerate(labels)}}  # fmt: skip
    elif kind == "sparse_embedding":
        meta = {"pooling": "splade"}
    elif kind == "multi_vector":
        meta = {"pooling": "colbert"}
    else:
        meta = {"pooling": _POOLING.get(spec.params.pooling or "mean", "mean")}
    s = stage.settings
    batch = spec.max_batch_size or 1
    info = {
        "model_id": spec.name,
        "model_sha": spec.fingerprint,
        "model_dtype": _DTYPE.get(spec.precision, spec.precision.lower()),
        "model_type": {TEI_TYPE[kind]: meta},
        "max_concurrent_requests": settings.http_max_connections,
        "max_input_length": s.max_tokens,
        # no token budget (max_batch_tokens 0): a batch holds max_batch_size rows of any length
        "max_batch_tokens": s.max_batch_tokens or batch * s.max_tokens,
        "max_batch_requests": batch,
        "max_client_batch_size": MAX_INPUTS,
        "auto_truncate": s.truncate,
        "tokenization_workers": len(rt.pool.workers),
        "version": version,
        "sha": None,
        "docker_label": None,
        # batchgate's own: the model's text limits and what it is served as
        "kind": kind,
        "max_text_bytes": s.max_text_bytes,
        "pairs": s.pair,
        "prompts": sorted(spec.params.prompts),
        "matryoshka_dimensions": list(spec.params.matryoshka_dimensions),
    }
    if ranges is not None:  # int8/uint8 vectors' ranges (Cohere's embedding_types), once calibrated
        info["vector_ranges"] = ranges.describe()
    selection = getattr(rt, "selection", None)
    if selection:
        info["selection"] = selection
    return info
