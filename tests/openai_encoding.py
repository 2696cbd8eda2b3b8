"""tiktoken's ``cl100k_base`` offline, as a user without network provides it: tiktoken downloads
its encoding file at first use and caches it in ``TIKTOKEN_CACHE_DIR`` under the sha1 of the
file's URL, checking its sha256 on every read. ``tiktoken_cache`` writes that file from the
installed package batchgate decodes with (gateway/openai_ids.py), so clients that tokenize with
tiktoken (LangChain's ``OpenAIEmbeddings``) work in a test with no network.

Use: ``monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tiktoken_cache(tmp_path)))``, before the
client's first ``tiktoken.get_encoding("cl100k_base")`` (tiktoken keeps an encoding once loaded).
"""

from __future__ import annotations

import gzip
import hashlib
import inspect
import re
from pathlib import Path

from batchgate.gateway import openai_ids


def encoding_url(name: str = "cl100k_base") -> str:
    """The URL tiktoken loads ``name`` from, read from tiktoken's own registry (so a move of the
    file in a later tiktoken moves the cache key with it)."""
    from tiktoken_ext import openai_public

    found = re.search(rf"\"(https://[^\"]+/{name}\.tiktoken)\"", inspect.getsource(openai_public))
    if not found:
        raise RuntimeError(f"tiktoken_ext.openai_public names no URL for {name}")
    return found.group(1)


def tiktoken_cache(folder: Path) -> Path:
    """``folder`` made a tiktoken cache holding cl100k_base (sha256 as tiktoken checks it)."""
    raw = gzip.decompress(openai_ids.data_file().read_bytes())
    assert hashlib.sha256(raw).hexdigest() == openai_ids.SHA256
    folder.mkdir(parents=True, exist_ok=True)
    (folder / hashlib.sha1(encoding_url().encode()).hexdigest()).write_bytes(raw)
    return folder
