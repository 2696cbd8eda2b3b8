"""A text model's tokenizer for the routes that show tokens rather than vectors (TEI's
``/tokenize`` and ``/decode``), for left truncation (TEI's ``truncation_direction: Left``) and for
token-id inputs (OpenAI's ``input`` as lists of ints).

The tokenizers are the text stage's own (``TextStage.tokenizer``: one per thread and mode, so
their settings never change under another caller); these run in helper threads.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from batchgate.gateway.errors import invalid
from batchgate.gateway.text import TextStage


def encode_left(stage: TextStage, texts: list[str]) -> list:
    """Each text's encoding keeping its last ``max_tokens`` tokens (special tokens kept)."""
    return stage.tokenizer(True, pad=False, left=True).encode_batch(stage.inputs(texts))


def vocabulary_size(stage: TextStage) -> int:
    return stage.tokenizer(False).get_vocab_size(with_added_tokens=True)


def tokenize(stage: TextStage, texts: list[str], add_special_tokens: bool) -> list[list[dict]]:
    """TEI's ``/tokenize`` answer: per text, each token's id, text, whether it is special, and its
    offsets in the text's UTF-8 bytes (``start``/``stop``, as TEI gives them; Python's tokenizers
    count characters); none for a special token, whose text is the token itself."""
    tok = stage.tokenizer(False)
    out = []
    for text, e in zip(texts, tok.encode_batch(texts, add_special_tokens=add_special_tokens), strict=True):
        at = _byte_positions(text)
        row = []
        for tid, token, special, (start, stop) in zip(e.ids, e.tokens, e.special_tokens_mask, e.offsets):
            if special:
                row.append({"id": tid, "text": token, "special": True, "start": None, "stop": None})
            else:
                row.append({"id": tid, "text": text[start:stop], "special": False,
                            "start": at[start] if at else start, "stop": at[stop] if at else stop})  # fmt: skip
        out.append(row)
    return out


def _byte_positions(text: str) -> list[int] | None:
    """Where each character of ``text`` starts in its UTF-8 bytes, and its end (None for ASCII,
    where the two counts agree)."""
    if text.isascii():
        return None
    return [0, *itertools.accumulate(len(c.encode()) for c in text)]


def decode(stage: TextStage, rows: list[list[int]], skip_special_tokens: bool) -> list[str]:
    return stage.tokenizer(False).decode_batch(rows, skip_special_tokens=skip_special_tokens)


def ids_of(value, field_name: str, size: int) -> list[list[int]]:
    """Token-id rows from a JSON value (a list of ints, or a list of such lists), each id checked
    against the vocabulary (``size`` ids); the refusal names ``field_name``."""
    rows = value if value and isinstance(value[0], list) else [value]
    for i, row in enumerate(rows):
        if not isinstance(row, list) or not row:
            raise invalid(f"'{field_name}[{i}]' must be a non-empty list of token ids", field_name)
        for t in row:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < size:
                raise invalid(
                    f"'{field_name}[{i}]' holds {t!r}, not a token id of this model's vocabulary "
                    f"(integers 0..{size - 1})", field_name,
                )  # fmt: skip
    return rows


@dataclass(frozen=True, slots=True)
class Ids:
    """Token ids a caller sent, as the worker reads an encoding: the model's input as it is."""

    ids: list[int]
    attention_mask: list[int]
    type_ids: list[int]
    overflowing: list = field(default_factory=list)

    @classmethod
    def of(cls, ids: list[int]) -> Ids:
        return cls(list(ids), [1] * len(ids), [0] * len(ids))


def id_rows(rows: list[list[int]], max_tokens: int, truncate: bool, left: bool, field_name: str):
    """Placeholder texts (they key the cache, apart from texts: the pipeline's ``ids`` tag) and
    the rows' ``Ids``, each cut to ``max_tokens`` when ``truncate``, else refused over it."""
    texts, encodings = [], []
    for i, row in enumerate(rows):
        if len(row) > max_tokens:
            if not truncate:
                raise invalid(
                    f"{field_name} {i} is {len(row)} tokens; the model takes at most {max_tokens} "
                    "(send truncate: true to keep its first tokens)", field_name,
                )  # fmt: skip
            row = row[len(row) - max_tokens :] if left else row[:max_tokens]
        # one word per id: the length estimate (a token per word) never puts the row in a bucket
        # shorter than its ids
        texts.append(" ".join(map(str, row)))
        encodings.append(Ids.of(row))
    return texts, encodings
