"""Where ``prepare-model`` reads a model from: a local folder, or a Hugging Face model ID.

An ID (``ORG/NAME``) is resolved through the Hugging Face cache layout, the one
``huggingface_hub`` writes and ``transformers`` and ``sentence-transformers`` read::

    <cache>/models--ORG--NAME/refs/<revision>        the commit a branch or tag points at
    <cache>/models--ORG--NAME/snapshots/<commit>/... the files (links into blobs/)

``<cache>`` is ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub``,
else ``~/.cache/huggingface/hub`` (huggingface_hub's own order). When ``huggingface_hub`` is
installed and ``HF_HUB_OFFLINE`` is not set, the model is downloaded into that cache first
(``snapshot_download``, only the files a build reads); otherwise the cache alone answers.
``huggingface_hub`` is optional (the ``hub`` extra): serving never needs it.

A path that exists wins over an ID, so a local folder named like ``org/model`` is read as is.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path

Log = Callable[[str], object]

# The files a build reads: configs, tokenizers, the weights and an ONNX export (with its
# external data); not the other ONNX variants (O1-O4, quantised) or other frameworks' weights
# that Hub repos often carry beside them.
ALLOW_PATTERNS = (
    "*.json",
    "*.txt",
    "model.safetensors",
    "*/model.safetensors",
    "model-*-of-*.safetensors",  # a large model's shards (model.safetensors.index.json names them)
    "model.onnx",
    "model.onnx_data",
    "onnx/model.onnx",
    "onnx/model.onnx_data",
    # BGE-M3's ColBERT and sparse heads, and a Dense module saved by older sentence-transformers
    # (torch.save files, read without torch: torch_file.py)
    "colbert_linear.pt",
    "sparse_linear.pt",
    "*_Dense/pytorch_model.bin",
)
# huggingface_hub's repo ID rule, narrowed to ORG/NAME: a bare NAME is a local path's typo
# far more often than one of the few legacy un-namespaced repos.
_PART = r"[A-Za-z0-9](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?"
_REPO_ID = re.compile(rf"{_PART}/{_PART}")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_TRUE = ("1", "on", "yes", "true")


class SourceError(ValueError):
    """The source names no folder and no model the cache holds; the message is one line."""


def hub_cache() -> Path:
    """The Hugging Face hub cache directory, as huggingface_hub computes it."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "huggingface" / "hub"


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def is_repo_id(text: str) -> bool:
    return bool(_REPO_ID.fullmatch(text)) and ".." not in text and "--" not in text


def from_cache(repo_id: str, revision: str | None = None, cache: Path | None = None) -> Path:
    """The snapshot folder of ``repo_id`` at ``revision`` (a branch, tag or commit; default
    ``main``) in the cache, or SourceError naming the directory looked in."""
    cache = cache or hub_cache()
    rev = revision or "main"
    model = cache / f"models--{repo_id.replace('/', '--')}"
    if ".." in Path(rev).parts or Path(rev).is_absolute():
        raise SourceError(f"--revision '{rev}' is not a branch, tag or commit")
    if _COMMIT.fullmatch(rev):
        commit = rev
    else:
        ref = model / "refs" / rev
        if not ref.is_file():
            raise SourceError(
                f"{repo_id}: not a local folder, and the Hugging Face cache {cache} does not hold revision "
                f"'{rev}' of it (no {ref.relative_to(cache)}; download it where the network allows, "
                f"e.g. `hf download {repo_id}`, or point HF_HUB_CACHE at a cache that holds it)"
            )
        commit = ref.read_text().strip()
    snapshot = model / "snapshots" / commit
    if not snapshot.is_dir():
        raise SourceError(
            f"{repo_id}: not a local folder, and the Hugging Face cache {cache} has no snapshot "
            f"{commit} of it (no {snapshot.relative_to(cache)})"
        )
    return snapshot


def _download(repo_id: str, revision: str | None, cache: Path) -> Path | None:
    """The snapshot through huggingface_hub when it is installed and allowed online; None
    otherwise (then the cache alone answers)."""
    if offline():
        return None
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    try:
        return Path(
            snapshot_download(
                repo_id, revision=revision, cache_dir=cache, allow_patterns=list(ALLOW_PATTERNS)
            )
        )
    except Exception as exc:  # no network, no such repo, gated: the cache may still hold it
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise _Unreachable(f"{type(exc).__name__}: {first[:200]}") from None


class _Unreachable(Exception):
    pass


def resolve(source: str | Path, revision: str | None = None, *, log: Log = print) -> Path:
    """A local folder as given (``revision`` refused), else the snapshot of the Hub model ID
    ``source``; SourceError (one line) when neither is found."""
    text = str(source)
    path = Path(text).expanduser()
    if path.exists() or not is_repo_id(text):
        if revision is not None:
            raise SourceError(f"--revision is for a Hugging Face model ID; {text} is a local path")
        return path
    cache = hub_cache()
    try:
        snapshot = _download(text, revision, cache)
    except _Unreachable as exc:
        try:
            snapshot = from_cache(text, revision, cache)
        except SourceError as missing:
            raise SourceError(f"{missing} (the download failed: {exc})") from None
        log(f"{text}: download failed ({exc}); using the cached snapshot {snapshot}")
        return snapshot
    return snapshot if snapshot is not None else from_cache(text, revision, cache)


def tokenizer_config(model_dir: Path) -> dict:
    """The folder's tokenizer_config.json, or {} where it has none."""
    path = Path(model_dir) / "tokenizer_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def special_token(config: dict, key: str, default: str) -> str:
    """A special token's text from tokenizer_config.json: a string, or an AddedToken as saved."""
    value = config.get(key) or default
    return str(value["content"] if isinstance(value, dict) else value)
