"""Regenerate the Python modules beside the .proto files: ``python -m batchgate.proto.generate``.

``--check`` regenerates into a scratch folder and exits 1 when a committed module differs
(the staleness test runs exactly this).

The generated modules register their descriptors in a private pool (``proto.POOL``), not
protobuf's default one: the stock ``tritonclient.grpc`` registers the same ``inference.*``
symbols under other file names, and protobuf refuses duplicate symbols in one pool, so without
this a process could not import both batchgate and the Triton client (tests, bench, user code).
"""

from __future__ import annotations

import argparse
import filecmp
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [
    "proto/inference/v2/model_config.proto",
    "proto/inference/v2/grpc_service.proto",
    # Hugging Face TEI's gRPC API (gateway/transport/tei_grpc.py serves it)
    "proto/tei/v1/tei.proto",
]
OUT_SUFFIXES = ["_pb2.py", "_pb2.pyi", "_pb2_grpc.py"]


def _generate(out: Path) -> list[Path]:
    from grpc_tools import protoc  # dev-only dependency: imported here, not at module load

    args = ["protoc", f"-I{ROOT}", f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}"]
    if protoc.main(args + SOURCES) != 0:
        raise SystemExit("protoc failed")
    produced = []
    for src in SOURCES:
        stem = src[: -len(".proto")]
        for suffix in OUT_SUFFIXES:
            path = out / (stem + suffix)
            # protoc names imports by the source path (``proto.inference.v2``); installed, these
            # modules live under ``batchgate.proto`` (a bare ``proto`` is proto-plus's name).
            text = re.sub(r"^from proto\.", "from batchgate.proto.", path.read_text(), flags=re.M)
            path.write_text(text)
            if suffix == "_pb2.py":
                text = text.replace(
                    "from google.protobuf.internal import builder as _builder\n",
                    "from google.protobuf.internal import builder as _builder\nfrom batchgate.proto import POOL as _POOL\n",
                    1,
                ).replace("_descriptor_pool.Default().AddSerializedFile(", "_POOL.AddSerializedFile(", 1)
                path.write_text(text)
            produced.append(path)
    return produced


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if committed modules are stale")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        stale = []
        for path in _generate(Path(tmp)):
            target = ROOT / path.relative_to(tmp)
            if args.check:
                if not target.exists() or not filecmp.cmp(path, target, shallow=False):
                    stale.append(str(target.relative_to(ROOT)))
            else:
                shutil.copyfile(path, target)
        if stale:
            print("stale generated modules (run: make proto):", *stale, sep="\n  ", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
