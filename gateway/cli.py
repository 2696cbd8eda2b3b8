"""``batchgate`` command line: ``serve`` (the default) and ``build-models``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from pydantic import ValidationError

from gateway.config import Settings

# flag -> settings field; every flag is also BATCHGATE_<FIELD> in the environment.
SERVE_FLAGS = {
    "--model-repository": ("model_repository", str),
    "--host": ("host", str),
    "--grpc-port": ("grpc_port", int),
    "--http-port": ("http_port", int),
    "--workers-per-device": ("workers_per_device", int),
    "--intra-op-threads": ("intra_op_threads", int),
    "--device": ("device", str),
    "--max-message-bytes": ("max_message_bytes", int),
    "--drain-timeout-s": ("drain_timeout_s", float),
    "--log-level": ("log_level", str),
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="batchgate", description="Dynamic-batching inference gateway (KServe v2 gRPC)")
    sub = p.add_subparsers(dest="command")
    serve = sub.add_parser("serve", help="serve a model repository (default command)")
    for flag, (field, typ) in SERVE_FLAGS.items():
        info = Settings.model_fields[field]
        serve.add_argument(
            flag, type=typ, default=None,
            help=f"{info.description} (env BATCHGATE_{field.upper()}, default {info.default})",
        )  # fmt: skip
    serve.add_argument("--no-build-models", action="store_true", help="do not build missing bundled models")
    build = sub.add_parser("build-models", help="(re)build the bundled ranker and encoder models")
    build.add_argument("--out", default="model_repository", help="repository folder to write into")
    build.add_argument("--force", action="store_true", help="overwrite existing model files")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "build-models":
        from gateway.bundled_models import build_bundled_models

        build_bundled_models(Path(args.out), force=args.force)
        return 0
    overrides = {}
    for flag, (field, _) in SERVE_FLAGS.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"), None)
        if value is not None:
            overrides[field] = value
    if getattr(args, "no_build_models", False):
        overrides["build_bundled_models"] = False
    try:
        settings = Settings(**overrides)
    except ValidationError as exc:
        print(f"batchgate: invalid settings:\n{exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    repo = Path(settings.model_repository)
    if settings.build_bundled_models and (not repo.exists() or not any(repo.iterdir())):
        from gateway.bundled_models import build_bundled_models

        logging.getLogger("batchgate").info("building the bundled models into %s", repo)
        build_bundled_models(repo, log=logging.getLogger("batchgate").info)
    from gateway.server import serve

    try:
        asyncio.run(serve(settings))
    except OSError as exc:
        logging.getLogger("batchgate").error("%s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
