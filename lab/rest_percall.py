"""Server CPU per REST call, this tree against another source tree, alternated in one run: KServe
REST infer on ``ranker`` (a JSON body of 2 rows) and OpenAI ``/v1/embeddings`` on ``minilm`` (one
short text), each as the server process's utime + stime (all threads, from /proc) over the calls
answered: robust on a shared machine, where calls/s are not.

    .venv/bin/python -m lab.rest_percall --before /tmp/before [--calls 2000] [--rounds 2]

``--before DIR``: a checkout of the other tree, or a ``git archive REF`` of one, served from its
own folders as ``lab.text_cpu --tree`` does (``PYTHONPATH``, checked); each tree serves the
models it builds itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import aiohttp
import numpy as np

from batchgate.bench.loadgen import PYTHON, process_cpu, start_batchgate
from lab.text_cpu import pkg_root, serving_tree

CONCURRENCY = 8
RANKER = {
    "inputs": [
        {"name": "dense", "shape": [2, 64], "datatype": "FP32", "data": np.linspace(0, 1, 128).tolist()},
        {"name": "sparse_ids", "shape": [2, 8], "datatype": "INT64", "data": list(range(16))},
    ]
}
EMBEDDINGS = {"model": "minilm", "input": "A man is eating food."}


async def _calls(url: str, body: bytes, calls: int) -> int:
    ok = 0
    async with aiohttp.ClientSession(headers={"Content-Type": "application/json"}) as session:

        async def worker(n: int) -> None:
            nonlocal ok
            for _ in range(n):
                async with session.post(url, data=body) as resp:
                    await resp.read()
                    ok += resp.status == 200

        await asyncio.gather(*(worker(calls // CONCURRENCY) for _ in range(CONCURRENCY)))
    return ok


def measure(pkg: Path, calls: int) -> dict[str, float]:
    """µs of server CPU per call, per route, for one server of ``pkg`` (``pkg_root``'s answer;
    "." this tree)."""
    with serving_tree(pkg):
        # Each tree serves the models it builds itself (its bundled ranker, its prepare-minilm):
        # an older tree refuses a config parameter it does not know.
        repo = tempfile.mkdtemp(prefix="rest-percall-")
        for build in ("build-models", "prepare-minilm"):
            subprocess.run(
                [*PYTHON, "-m", "batchgate", build, "--out", repo], check=True, stdout=subprocess.DEVNULL
            )
        server = start_batchgate("--model-repository", repo)
    try:
        server.ready(120)
        out = {}
        for name, path, body in (
            ("kserve infer", "/v2/models/ranker/infer", RANKER),
            ("/v1/embeddings", "/v1/embeddings", EMBEDDINGS),
        ):
            url = f"http://{server.http_url}{path}"
            raw = json.dumps(body).encode()
            asyncio.run(_calls(url, raw, 200))  # warm: the first calls build engines and caches
            before = process_cpu(server.proc.pid)
            ok = asyncio.run(_calls(url, raw, calls))
            sent = calls // CONCURRENCY * CONCURRENCY
            if ok < sent:
                raise SystemExit(f"{name}: {sent - ok} calls failed")
            out[name] = (process_cpu(server.proc.pid) - before) / ok * 1e6
        return out
    finally:
        server.stop()
        shutil.rmtree(repo, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, metavar="DIR")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    pkg = pkg_root(Path(args.before))
    try:
        for _ in range(args.rounds):  # alternated: a burst of other load hits one round of each
            for label, tree in (("before", pkg), ("after", Path("."))):
                runs[label].append(measure(tree, args.calls))
                print(label, {k: round(v) for k, v in runs[label][-1].items()}, flush=True)
    finally:
        shutil.rmtree(pkg, ignore_errors=True)
    for route in runs["before"][0]:
        b = min(r[route] for r in runs["before"])
        a = min(r[route] for r in runs["after"])
        print(
            f"{route:15s} server CPU per call, best round: before {b:.0f} µs, after {a:.0f} µs ({b / a:.2f}x)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
