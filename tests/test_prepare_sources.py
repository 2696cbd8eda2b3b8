"""``batchgate prepare-model ORG/NAME``: a Hugging Face model ID read through the hub cache.

The cache is laid out on disk here as huggingface_hub writes it (``refs/<branch>`` holding a
commit, ``snapshots/<commit>/`` of relative links into ``blobs/``), around a tiny BERT folder,
and the model is prepared from its ID with ``HF_HUB_OFFLINE=1``: nothing is fetched. The
written entry is byte-identical to preparing the folder itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from batchgate.gateway.models import sources
from batchgate.gateway.models.hf_model import PrepareError
from batchgate.gateway.models.prepare import prepare_model
from tests.conftest import free_ports
from tests.test_prepare_model import TINY, prepare_cli, st_folder, wordpiece
from tests.tiny_models import transformers_folder

REPO_ID = "acme/tiny-bert"
MAIN = "a" * 40
V1 = "b" * 40


def cache_layout(cache: Path, repo_id: str, folder: Path, commit: str, refs: tuple[str, ...]) -> Path:
    """``folder`` as the snapshot ``commit`` of ``repo_id``, with ``refs`` pointing at it."""
    model = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = model / "snapshots" / commit
    for src in sorted(p for p in folder.rglob("*") if p.is_file()):
        blob = model / "blobs" / hashlib.sha256(src.read_bytes()).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, blob)
        link = snapshot / src.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (model / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (model / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Two revisions of one tiny BERT (the same weights, written by numpy in transformers' layout):
    main pools the mean, v1 the CLS token."""
    root = tmp_path_factory.mktemp("hub-folders")
    wp = wordpiece()
    config = dict(TINY, vocab_size=wp.get_vocab_size(), max_position_embeddings=64)
    folders = {}
    for pooling in ("mean", "cls"):
        folders[pooling] = transformers_folder(root / pooling, "BertModel", config, wp, seed=0)
        st_folder(folders[pooling], pooling, True)
    return folders


@pytest.fixture
def cache(folders, tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    cache_layout(cache, REPO_ID, folders["mean"], MAIN, ("main",))
    cache_layout(cache, REPO_ID, folders["cls"], V1, ("v1",))
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # no ./acme/tiny-bert here
    return cache


def _entry(path: Path) -> dict[str, bytes]:
    return {f: (path / f).read_bytes() for f in ("1/model.onnx", "tokenizer.json", "config.pbtxt")}


def test_a_model_id_is_read_from_the_cache_offline(folders, cache, tmp_path):
    lines: list[str] = []
    out = prepare_model(REPO_ID, "from_id", tmp_path / "repo", log=lines.append)
    assert len(lines) == 1, lines  # offline: no download tried
    assert f"from {cache / 'models--acme--tiny-bert' / 'snapshots' / MAIN}" in lines[-1]
    direct = prepare_model(folders["mean"], "from_id", tmp_path / "direct", log=print)
    assert _entry(out) == _entry(direct)


def test_revision_names_a_branch_tag_or_commit(cache, tmp_path):
    for rev in ("v1", V1):
        out = prepare_model(REPO_ID, "cls", tmp_path / rev, revision=rev, log=print)
        assert 'string_value: "cls"' in (out / "config.pbtxt").read_text()
    out = prepare_model(REPO_ID, "main", tmp_path / "main", revision=MAIN, log=print)
    assert 'string_value: "mean"' in (out / "config.pbtxt").read_text()


def test_hf_home_and_the_default_cache(folders, cache, monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert sources.hub_cache() == tmp_path / "home" / "hub"
    shutil.copytree(cache, tmp_path / "home" / "hub", symlinks=True)
    assert (
        sources.resolve(REPO_ID) == tmp_path / "home" / "hub" / "models--acme--tiny-bert" / "snapshots" / MAIN
    )
    monkeypatch.delenv("HF_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert sources.hub_cache() == tmp_path / "user" / ".cache" / "huggingface" / "hub"


def test_xdg_cache_home_moves_the_default_cache(folders, cache, monkeypatch, tmp_path):
    """Without HF_HUB_CACHE or HF_HOME, huggingface_hub caches under $XDG_CACHE_HOME (a Linux
    desktop or a container that sets it): a model it downloaded there is found, offline."""
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    hub = tmp_path / "xdg" / "huggingface" / "hub"
    assert sources.hub_cache() == hub
    shutil.copytree(cache, hub, symlinks=True)
    assert sources.resolve(REPO_ID) == hub / "models--acme--tiny-bert" / "snapshots" / MAIN


def test_a_local_folder_wins_over_an_id(folders, cache, tmp_path):
    shutil.copytree(folders["cls"], tmp_path / "acme" / "tiny-bert")  # cwd is tmp_path
    lines: list[str] = []
    out = prepare_model(REPO_ID, "local", tmp_path / "repo", log=lines.append)
    assert "from acme/tiny-bert (" in lines[-1]
    assert 'string_value: "cls"' in (out / "config.pbtxt").read_text()
    with pytest.raises(
        PrepareError, match="--revision is for a Hugging Face model ID; acme/tiny-bert is a local"
    ):
        prepare_model(REPO_ID, "local", tmp_path / "repo", revision="v1", log=print)


def test_without_huggingface_hub_the_cache_alone_answers(cache, monkeypatch, tmp_path):
    """Online, but the optional package is not installed: no download is tried."""
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # `import huggingface_hub` fails
    lines: list[str] = []
    assert (
        sources.resolve(REPO_ID, log=lines.append) == cache / "models--acme--tiny-bert" / "snapshots" / MAIN
    )
    assert lines == []  # no download was tried, so none failed


def test_a_model_missing_offline_is_one_line_naming_the_cache(cache, tmp_path):
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    proc = prepare_cli(
        "acme/absent", "--name", "x", "--model-repository", str(tmp_path / "repo"), env=env, cwd=tmp_path
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "acme/absent: not a local folder" in proc.stderr
    assert f"the Hugging Face cache {cache} " in proc.stderr
    assert not (tmp_path / "repo").exists()
    with pytest.raises(PrepareError, match="revision 'v2'"):
        prepare_model(REPO_ID, "x", tmp_path / "repo", revision="v2", log=print)


@pytest.mark.parametrize("text", ["acme/tiny-bert", "org/model.v2", "BAAI/bge-small-en-v1.5"])
def test_repo_ids(text):
    assert sources.is_repo_id(text)


@pytest.mark.parametrize("text", ["model", "./acme/x", "/abs/path", "a/b/c", "a--b/c", "a/../b", "a/"])
def test_not_repo_ids(text):
    assert not sources.is_repo_id(text)


def test_online_with_huggingface_hub_a_failed_download_falls_back_to_the_cache(cache, tmp_path):
    """huggingface_hub installed and online, but the endpoint refuses (a local port nothing
    listens on, so nothing leaves the machine): the cached model is used, a missing one is one
    line with the download's error."""
    pytest.importorskip("huggingface_hub")
    (port,) = free_ports(1)
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env |= {"HF_HUB_CACHE": str(cache), "HF_ENDPOINT": f"http://127.0.0.1:{port}"}
    code = "from batchgate.gateway.models.sources import resolve; print(resolve('acme/tiny-bert'))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0 and proc.stdout.strip().endswith(MAIN), proc.stderr
    proc = prepare_cli(
        "acme/absent", "--name", "x", "--model-repository", str(tmp_path / "repo"), env=env, cwd=tmp_path
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert f"the Hugging Face cache {cache} " in proc.stderr and "(the download failed: " in proc.stderr


def test_special_tokens_read_as_strings_or_as_saved_added_tokens(tmp_path):
    # transformers saves a special token either as its text or as an AddedToken's fields
    added = {"content": "[CLS]", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"cls_token": added, "sep_token": "[SEP]"}))
    config = sources.tokenizer_config(tmp_path)
    assert sources.special_token(config, "cls_token", "<s>") == "[CLS]"
    assert sources.special_token(config, "sep_token", "</s>") == "[SEP]"
    assert sources.special_token(config, "pad_token", "[PAD]") == "[PAD]"
    assert sources.tokenizer_config(tmp_path / "missing") == {}
