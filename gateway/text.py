"""The text stage: strings in, a BERT-style ONNX model's token inputs out.

A model whose config.pbtxt sets parameter ``tokenizer`` takes one TYPE_STRING input (dims
[ 1 ], one text per row) and this stage feeds its ONNX inputs (``input_ids`` and any of
``attention_mask``, ``token_type_ids``) with a Hugging Face ``tokenizers`` tokenizer. The work is
split so the event loop never tokenizes on the common path:

* on the event loop, per call (``TextStage.check``): check every text (UTF-8, not empty, not
  over ``max_text_bytes``; over ``max_tokens`` when ``truncate`` is ``reject``) and give each
  row its own batching key, the length bucket of that text *estimated* from its words. Exact
  counts need a tokenizer pass, too dear for a loop that answers thousands of calls a second
  (docs/performance.md, "Figures the code cites"); the estimate only decides which rows
  share a batch, and a batch is still padded by its real token counts. The runtime queues a
  call's rows by bucket, so a call of mixed lengths never pays padding to its longest text.
* in the worker thread, per batch (``TextStage.__call__``, handed to the engine as its
  ``preprocess`` hook): one ``encode_batch`` (truncation to ``max_tokens``, padding to the
  batch's longest real text) of texts decoded once, on the loop. ``tokenizers`` releases the GIL
  while it encodes. The scheduler's queue already holds each batch to ``max_batch_tokens``
  (``row_limit``); the engine's own limit stays only as a guard.
* a list of texts (OpenAI, TEI, rerank: ``Pipeline.texts``) is held to the same limits before
  it is admitted (``check_list``: with the caller's own token limit, or the cut it asked for),
  then tokenised whole, once, in a thread before it is queued (``check_encoded``, ``encode``):
  the caller's usage needs every text's count anyway, and the worker then reads those encodings
  as they are instead of tokenising again (``batchgate_texts_tokenized_total`` counts every
  text the tokenizer encodes).

Every text limit (bytes, tokens, empty, pairs) is checked and refused in this stage, each refusal
naming the row as its route does: ``input 'text' row i`` for a KServe call, ``input i`` (field
``input``) for a list of texts.

Parameters (all ``string_value``):

  tokenizer         tokenizer.json, relative to the model directory                (required)
  max_tokens        longest token sequence the model sees, special tokens included
                    (default: the tokenizer file's truncation length, else 512)
  truncate          "truncate" (default): longer texts are cut to max_tokens;
                    "reject": they are refused with INVALID_ARGUMENT
  max_text_bytes    longest text accepted at all, in UTF-8 bytes (default 32768)
  length_buckets    ascending token lengths rows are grouped by (default 16,32,64,128,256,512,
                    capped at max_tokens); the engines pad to the same buckets
  max_batch_tokens  token budget of one batch, rows x length bucket; 0 = none (the queue
                    forms batches within it; workers/buckets.py keeps it as a guard)
  text_pair         "true": each row is two texts joined by PAIR_SEPARATOR (U+001F), a
                    cross-encoder's query and document, encoded as the tokenizer pairs two
                    sequences (its pair template; truncation longest-first, as transformers'
                    tokenizers truncate a pair). One string per row keeps everything before
                    the worker (validation, length estimate, cache key, batching) as it is.
  pair_template     with text_pair: a pair is tokenised as this one text, its query and document
                    put in at ``{query}`` and ``{document}``, no special tokens added (the
                    tokenizer's pair template is not used); the text after ``{document}`` is
                    tokenised alone and appended whole, so a cut shortens the document, never the
                    end of the chat (Qwen3-Reranker's card: prefix + middle cut to fit + suffix).
"""

from __future__ import annotations

import asyncio
import bisect
import json
import re
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from batchgate.gateway.errors import GatewayError, invalid, too_large
from batchgate.gateway.repository import TOKEN_INPUTS, ConfigError, ModelSpec

DEFAULT_BUCKETS = (16, 32, 64, 128, 256, 512)
DEFAULT_MAX_TOKENS = 512
# ASCII's unit separator: a control character no text a caller means to embed contains.
PAIR_SEPARATOR = "\x1f"
# ASCII punctuation: BERT-style pre-tokenizers make each mark a token of its own.
_PUNCT = re.compile(rb"[!-/:-@\[-`{-~]")


def _cut(text: str, max_bytes: int, left: bool = False) -> str:
    """The first ``max_bytes`` bytes of ``text`` (``left``: the last), at a character."""
    raw = text.encode()
    if len(raw) <= max_bytes:
        return text
    keep = max(max_bytes, 0)
    raw = raw[len(raw) - keep :] if left else raw[:keep]
    return raw.decode("utf-8", "ignore")  # (a character cut in two is dropped)


def estimate_tokens(text: bytes, specials: int) -> int:
    """Token count of ``text`` guessed without tokenizing: a token per word and per punctuation
    mark, more for long (rarer) words, and for non-ASCII text at least one per 3 bytes (CJK
    characters are a token each). Close to the tokenizer's count, far closer than a byte-length
    rule (docs/performance.md, "Figures the code cites")."""
    words = text.split()
    n = specials + len(words) + len(_PUNCT.findall(text)) + sum(len(w) // 5 for w in words if len(w) > 9)
    if not text.isascii():
        n = max(n, specials + len(text) // 3)
    return n


@dataclass(frozen=True, slots=True)
class TextSettings:
    tokenizer_path: Path
    max_tokens: int
    truncate: bool
    length_buckets: tuple[int, ...]
    max_text_bytes: int
    max_batch_tokens: int  # 0: no token budget
    pair: bool = False  # rows are PAIR_SEPARATOR-joined text pairs
    pair_template: str | None = None  # a pair tokenised as this text ({query}, {document})

    @classmethod
    def from_spec(cls, spec: ModelSpec) -> TextSettings:
        """Parse and check the model's parameters; ConfigError names the parameter and the fix."""
        name, p = spec.name, spec.params  # typed and bounded at load (gateway/parameters.py)
        path = spec.path.parent.parent / p.tokenizer
        if not path.is_file():
            raise ConfigError(f"model '{name}': parameter 'tokenizer' names {path}, which does not exist")
        try:
            file_limit = (json.loads(path.read_text()).get("truncation") or {}).get("max_length")
        except (OSError, ValueError) as exc:
            raise ConfigError(f"model '{name}': cannot read tokenizer {path}: {exc}") from None
        max_tokens = p.max_tokens or int(file_limit or DEFAULT_MAX_TOKENS)
        if p.pair_template is not None and not p.text_pair:
            raise ConfigError(f"model '{name}': parameter 'pair_template' is for pairs; set text_pair true")
        buckets = p.length_buckets or DEFAULT_BUCKETS
        buckets = tuple(b for b in buckets if b < max_tokens) + (max_tokens,)
        return cls(
            tokenizer_path=path,
            max_tokens=max_tokens,
            truncate=p.truncate == "truncate",
            length_buckets=buckets,
            max_text_bytes=p.max_text_bytes,
            max_batch_tokens=p.max_batch_tokens,
            pair=p.text_pair,
            pair_template=p.pair_template,
        )


class TextStage:
    """Built once per served model version; shared by the event loop and the model's workers."""

    def __init__(self, spec: ModelSpec) -> None:
        from tokenizers import Tokenizer  # only text models pay for the import

        self.settings = s = TextSettings.from_spec(spec)
        self.model = spec.name
        self.input = spec.inputs[0].name
        self.outputs = tuple(n for n in TOKEN_INPUTS if n in spec.model_inputs)
        self._json = s.tokenizer_path.read_text()
        try:
            probe = Tokenizer.from_str(self._json)
        except Exception as exc:
            raise ConfigError(
                f"model '{spec.name}': {s.tokenizer_path} is not a tokenizers file: {exc}"
            ) from None
        padding = json.loads(self._json).get("padding") or {}
        pad_token = padding.get("pad_token") or "[PAD]"
        pad_id = padding.get("pad_id", probe.token_to_id(pad_token))
        self._pad = {
            "pad_id": int(pad_id or 0),
            "pad_token": pad_token,
            "pad_type_id": int(padding.get("pad_type_id", 0)),
        }
        self.specials = probe.num_special_tokens_to_add(s.pair)
        self._template: tuple[str, str, str] | None = None  # (before query, between, after document)
        self._suffix = None  # the text after {document}, encoded once
        if s.pair_template is not None:
            before, rest = s.pair_template.split("{query}", 1)
            between, after = rest.split("{document}", 1)
            self._template = (before, between, after)
            self._suffix = probe.encode(after, add_special_tokens=False)
            self.specials = len(probe.encode(before + between + after, add_special_tokens=False).ids)
            if len(self._suffix.ids) >= s.max_tokens:
                raise ConfigError(
                    f"model '{spec.name}': parameter 'pair_template' ends in {len(self._suffix.ids)} tokens after "
                    f"{{document}}; max_tokens is {s.max_tokens}"
                )
        # Every token covers at least one byte of the text, so a text of at most this many bytes
        # cannot exceed max_tokens; only longer ones need an exact count in reject mode.
        self._surely_fits = s.max_tokens - self.specials
        self._short = min(self._surely_fits, s.max_text_bytes)  # within both limits, by its bytes alone
        self._local = threading.local()
        self.tokenized = 0  # texts the tokenizer has encoded, every mode (a metric: each text once per call)
        self._count_lock = threading.Lock()

    # -- event loop side -------------------------------------------------------------------------

    async def check(self, arrays: dict[str, np.ndarray]) -> tuple[list[int], list[str]]:
        """Check the call's texts; return each row's batching key (its length bucket) and its
        text, decoded here once for the worker's tokenizer."""
        texts = arrays[self.input].reshape(-1)
        keys: list[int] = []
        decoded: list[str] = []
        unsure = []
        s = self.settings
        for i, b in enumerate(texts):
            text = self._checked(i, b)
            if not s.truncate and len(b) > self._surely_fits:
                unsure.append((i, text))
            keys.append(self.bucket(estimate_tokens(b, self.specials)))
            decoded.append(text)
        if unsure:
            counts = await asyncio.to_thread(self.count_tokens, [t for _, t in unsure])
            for (i, _), count in zip(unsure, counts, strict=True):
                self._check_tokens(i, count)
                keys[i] = self.bucket(count)  # exact where it was counted
        return keys, decoded

    async def check_list(
        self, texts: list[str], prompt: str = "", *, cut: bool = False, exact: bool = False,
        left: bool = False, given: list | None = None,
    ) -> tuple[list[str], list, list[int]]:  # fmt: skip
        """A list of texts (``Pipeline.texts``: OpenAI, TEI, rerank) held to the model's limits
        before the call is admitted, each refusal naming ``input i`` (the caller's list index).

        ``prompt`` goes before every text (what the model, the limits and the cache see).
        ``cut``: the caller asked for truncation, so a text over ``max_text_bytes`` is cut to it
        (at a character) instead of refused. ``exact``: a text over ``max_tokens`` is refused
        (the caller did not ask for truncation) whatever the model's ``truncate``; only the texts
        that could be over it are tokenised (in a thread), and their encodings go on with the call
        (``check_encoded``), so no text is tokenised twice. ``left``: a cut keeps the text's end.
        ``given``: per row, the token ids the caller sent instead of a text (None for a text);
        those rows are checked by their route. Returns the texts as the model sees them, each
        one's encoding (None where none was made) and the rows that may be over ``max_tokens``."""
        s = self.settings
        if cut:
            if not s.truncate:
                raise invalid(
                    f"model '{self.model}' does not truncate (parameter truncate is 'reject')", "truncate"
                )
            # Every token covers at least one byte: the first max_text_bytes bytes hold more tokens
            # than max_tokens for any text this bound was made for; cutting first bounds the work.
            room = s.max_text_bytes - len(prompt.encode())
            texts = [_cut(t, room, left) if len(t) * 4 > room else t for t in texts]
        if prompt:
            texts = [prompt + t for t in texts]
        encodings: list = [None] * len(texts)
        short = self._short  # a text of at most this many bytes is within both limits
        long = []
        for i, t in enumerate(texts):
            if given is not None and given[i] is not None:
                continue  # token ids, checked against the model's limits by their route
            if len(t) * 4 > short:  # (a character is at most 4 UTF-8 bytes)
                n = len(t.encode())
                self._check_bytes(i, n, listed=True)  # before the tokenizer ever sees it
                if n > self._surely_fits:
                    long.append(i)
        if exact and long:
            made = await asyncio.to_thread(self.encode, [texts[i] for i in long])
            for i, e in zip(long, made, strict=True):
                self._check_tokens(i, len(e.ids), listed=True, exact=True, cut=bool(e.overflowing))
                encodings[i] = e
        return texts, encodings, long

    async def check_encoded(
        self, arrays: dict[str, np.ndarray], encodings: list | None = None
    ) -> tuple[list[int], list]:
        """``check`` for a list of texts (rows named as ``check_list`` names them) that is
        tokenised whole, once (``encode``, in a thread; ``encodings`` holds the ones made already,
        else None): each row's batching key and its encoding, which the worker reads as it is. The
        keys are the ones ``check`` gives, so a text is batched, padded and answered alike by
        every route."""
        texts = arrays[self.input].reshape(-1)
        decoded = [self._checked(i, b, listed=True) for i, b in enumerate(texts)]
        encodings = list(encodings) if encodings is not None else [None] * len(decoded)
        todo = [i for i, e in enumerate(encodings) if e is None]
        if todo:
            made = await asyncio.to_thread(self.encode, [decoded[i] for i in todo])
            for i, e in zip(todo, made, strict=True):
                encodings[i] = e
        keys = self.row_keys(arrays)
        if not self.settings.truncate:
            for i, e in enumerate(encodings):
                self._check_tokens(i, len(e.ids), listed=True)
                if len(texts[i]) > self._surely_fits:
                    keys[i] = self.bucket(len(e.ids))  # exact where check counts
        return keys, encodings

    # -- the text limits: every route's texts are held to them here, and refused here ----------

    def _refusal(self, i: int, what: str, listed: bool, large: bool = False) -> GatewayError:
        """Row ``i`` refused for ``what``: named ``input i`` with field ``input`` in a list of texts
        (``large``: over a size limit, which those wires answer as too large), else as the row of
        the model's input."""
        if listed:
            return (too_large if large else invalid)(f"input {i}: {what}", "input")
        return invalid(f"input '{self.input}' row {i}: {what}")

    def _check_bytes(self, i: int, n: int, listed: bool = False) -> None:
        if n > self.settings.max_text_bytes:
            raise self._refusal(
                i, f"text is {n} bytes; model '{self.model}' accepts at most {self.settings.max_text_bytes} "
                "(parameter max_text_bytes)", listed, large=True,
            )  # fmt: skip

    def _check_tokens(
        self, i: int, count: int, listed: bool = False, exact: bool = False, cut: bool = False
    ) -> None:
        """``exact``: the caller's limit (it did not ask for truncation), else the model's in
        reject mode; ``cut``: the count stopped at max_tokens (the text is longer)."""
        limit = self.settings.max_tokens
        if not cut and count <= limit:
            return
        if exact:
            n = f"more than {limit}" if cut else count
            raise too_large(
                f"input {i} is {n} tokens; model '{self.model}' takes at most {limit} "
                "(send truncate: true to keep its first tokens)", "input",
            )  # fmt: skip
        raise self._refusal(
            i, f"text is {count} tokens; model '{self.model}' takes at most {limit} "
            "(parameter max_tokens; truncate is 'reject')", listed,
        )  # fmt: skip

    def _checked(self, i: int, b, listed: bool = False) -> str:
        """Row ``i``'s text decoded, or the refusal naming what is wrong with it."""
        self._check_bytes(i, len(b), listed)
        try:
            text = b.decode()
        except UnicodeDecodeError as exc:
            raise self._refusal(
                i, f"text is not valid UTF-8 ({exc.reason} at byte {exc.start})", listed
            ) from None
        except AttributeError:  # not bytes: cannot come from the codec, but never a bare INTERNAL
            raise self._refusal(i, "expected BYTES holding UTF-8 text", listed) from None
        if self.settings.pair:
            self._check_pair(i, text, listed)
        elif not text:
            # only the empty string: a whitespace-only text (a splitter's chunk, an empty table
            # cell) is embedded as TEI and sentence-transformers embed it, [CLS][SEP]
            raise self._refusal(i, "text is empty; send at least one character", listed)
        return text

    def _check_pair(self, i: int, text: str, listed: bool = False) -> None:
        first, sep, second = text.partition(PAIR_SEPARATOR)
        if not sep or not first or not second:
            raise self._refusal(
                i, f"model '{self.model}' takes a pair per row, two non-empty texts joined by U+001F "
                "(parameter text_pair)", listed,
            )  # fmt: skip

    @property
    def pad_id(self) -> int:
        """The id rows are padded with, always on the right (``input_ids``): what the engine may
        leave off a row when it cuts a batch into runs of similar length (workers/runs.py)."""
        return self._pad["pad_id"]

    def row_keys(self, arrays: dict[str, np.ndarray]) -> list[int]:
        """Each row's length bucket for texts ``check`` already passed (the rows the result cache
        did not answer)."""
        return [self.bucket(estimate_tokens(b, self.specials)) for b in arrays[self.input].reshape(-1)]

    def bucket(self, tokens: int) -> int:
        buckets = self.settings.length_buckets
        return buckets[min(bisect.bisect_left(buckets, tokens), len(buckets) - 1)]

    # -- worker thread side ----------------------------------------------------------------------

    def tokenizer(self, truncate: bool, pad: bool = True, left: bool = False):
        """One tokenizer per thread and mode: its settings are never changed once made. ``left``:
        truncation keeps a text's last tokens (TEI's ``truncation_direction: Left``)."""
        cache = self._local.__dict__
        mode = (truncate, truncate and pad, truncate and left)
        tok = cache.get(mode)
        if tok is None:
            from tokenizers import Tokenizer

            tok = Tokenizer.from_str(self._json)
            tok.no_padding()
            tok.no_truncation()
            if truncate:
                # A templated pair is cut before its fixed ending is appended (``encode_rows``).
                keep = len(self._suffix.ids) if self._suffix is not None and not left else 0
                tok.enable_truncation(self.settings.max_tokens - keep, direction="left" if left else "right")
                if pad:
                    tok.enable_padding(**self._pad)  # to the batch's longest
            cache[mode] = tok
        return tok

    def inputs(self, texts: list[str]) -> list:
        # A pair row splits at its first separator: the query cannot hold one, the document may.
        if self._template is not None:  # (left truncation: the whole chat, cut from its start)
            return [self._body(t) + self._template[2] for t in texts]
        return [tuple(t.split(PAIR_SEPARATOR, 1)) for t in texts] if self.settings.pair else texts

    def _body(self, text: str) -> str:
        """A pair row in the template, up to the end of its document."""
        query, document = text.split(PAIR_SEPARATOR, 1)
        before, between, _ = self._template
        return before + query + between + document

    def encode_rows(self, tok, texts: list[str]) -> list:
        """``tok``'s encodings of the rows as the model takes them: the tokenizer's own (a pair
        by its pair template), or with a pair_template the templated text up to the document
        (cut by ``tok``'s truncation, which leaves room for the rest) and then the rest, whole."""
        if self._template is None:
            return tok.encode_batch(self.inputs(texts))
        from tokenizers import Encoding

        bodies = tok.encode_batch([self._body(t) for t in texts], add_special_tokens=False)
        return [Encoding.merge([e, self._suffix], growing_offsets=True) for e in bodies]

    def _counted(self, n: int) -> None:
        with self._count_lock:  # (worker threads and the loop's helper threads count alike)
            self.tokenized += n

    def count_tokens(self, texts: list[str]) -> list[int]:
        self._counted(len(texts))
        return [len(e.ids) for e in self.encode_rows(self.tokenizer(False), texts)]

    def encode(self, texts: list[str]) -> list:
        """Each text's encoding as the model will see it, unpadded: truncated to max_tokens when
        the model truncates (``overflowing`` then says whether it was cut), whole in reject mode.
        Counts for the caller and, unchanged, the worker's input (``__call__``)."""
        self._counted(len(texts))
        return self.encode_rows(self.tokenizer(self.settings.truncate, pad=False), texts)

    def __call__(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The engine's preprocess hook: the merged batch's texts -> the model's token inputs.
        A row is a text (tokenised here) or the encoding ``encode`` made of it already.

        Truncation is on in reject mode too: texts were counted at admission, so it only ever
        guards the model against a count that disagreed."""
        rows = feeds[self.input].reshape(-1)
        if self._template is None and all(isinstance(t, (str, bytes)) for t in rows):
            texts = [t if isinstance(t, str) else t.decode() for t in rows]
            self._counted(len(texts))
            encodings = self.tokenizer(True).encode_batch(self.inputs(texts))
            return self._feeds([e.ids for e in encodings], [e.attention_mask for e in encodings],
                               [e.type_ids for e in encodings])  # fmt: skip
        todo = [i for i, t in enumerate(rows) if isinstance(t, (str, bytes))]
        encodings = list(rows)
        if todo:  # a batch that merged encoded rows with other callers' texts
            texts = [rows[i] if isinstance(rows[i], str) else rows[i].decode() for i in todo]
            self._counted(len(texts))
            for i, e in zip(todo, self.encode_rows(self.tokenizer(True, pad=False), texts)):
                encodings[i] = e
        limit = self.settings.max_tokens
        width = min(max(len(e.ids) for e in encodings), limit)
        pad_id, pad_type = self._pad["pad_id"], self._pad["pad_type_id"]
        ids, mask, types = [], [], []
        for e in encodings:
            n = min(len(e.ids), limit)
            fill = width - n
            ids.append(e.ids[:n] + [pad_id] * fill)
            mask.append(e.attention_mask[:n] + [0] * fill)
            types.append(e.type_ids[:n] + [pad_type] * fill)
        return self._feeds(ids, mask, types)

    def _feeds(self, ids: list, mask: list, types: list) -> dict[str, np.ndarray]:
        out = {"input_ids": np.array(ids, dtype=np.int64)}
        if "attention_mask" in self.outputs:
            out["attention_mask"] = np.array(mask, dtype=np.int64)
        if "token_type_ids" in self.outputs:
            out["token_type_ids"] = np.array(types, dtype=np.int64)
        return out

    # -- token budget ----------------------------------------------------------------------------

    def row_limit(self, bucket: int) -> int:
        """Rows of length bucket ``bucket`` (the batching key) that fit max_batch_tokens; the
        queue holds each batch to it, and the runtime never queues a request larger."""
        budget = self.settings.max_batch_tokens
        return max(1, budget // bucket) if budget and isinstance(bucket, int) and bucket > 0 else 1 << 30
