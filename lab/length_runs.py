"""Runs of similar length on and off (``engine_length_runs``): two servers of one model side by
side, pinned to the same core, the same fixed work sent to each in turn, round after round.

The work: ``--callers`` callers each sending ``--calls`` calls of 32 texts from the text-batches
mix (``bench/texts/mixed.txt``), stating no budget (as client libraries send documents), all
answered; per server and round, its CPU seconds over that work (user + system, all threads), so
the figure is texts per server CPU-second and the ratio on/off sums the rounds. The load generator
runs on another core.

    .venv/bin/python -m lab.length_runs [--model-dir /tmp/baserepo/mpnet_base] [--rounds 4]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
from pathlib import Path

import grpc
from batchgate.bench import text_batches as tb
from batchgate.bench.loadgen import PYTHON, Started, free_ports
from batchgate.proto.inference.v2 import grpc_service_pb2_grpc as pbg

ROOT = Path(__file__).resolve().parent.parent
PER_CALL = 32


async def work(url: str, model: str, texts: list[str], callers: int, calls: int) -> None:
    n = len(texts)
    async with grpc.aio.insecure_channel(url) as ch:
        stub = pbg.GRPCInferenceServiceStub(ch)

        async def caller(k: int) -> None:
            for j in range(calls):
                first = (k * 16 + j * PER_CALL) % n
                batch = [texts[(first + i) % n] for i in range(PER_CALL)]
                await stub.ModelInfer(tb.request(model, batch, "none"), timeout=600)

        await asyncio.gather(*(caller(k) for k in range(callers)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, default=ROOT / "model_repository" / "minilm")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--callers", type=int, default=4)
    p.add_argument("--calls", type=int, default=2, help="calls of 32 texts per caller and round")
    p.add_argument("--server-core", type=int, default=0)
    p.add_argument("--load-core", type=int, default=1)
    args = p.parse_args()
    texts = tb.texts()
    servers: dict[str, tuple[Started, str, str]] = {}
    tmps = []
    try:
        for label, on in (("on", "true"), ("off", "false")):
            tmp = Path(tempfile.mkdtemp(prefix=f"length-runs-{label}-"))
            tmps.append(tmp)
            name, _ = tb.make_repo(args.model_dir, tmp)
            grpc_port, http_port = free_ports(2)
            url = f"127.0.0.1:{grpc_port}"
            cmd = ["env", f"BATCHGATE_ENGINE_LENGTH_RUNS={on}", "taskset", "-c", str(args.server_core), *PYTHON,
                   "-m", "batchgate", "serve", "--host", "127.0.0.1", "--grpc-port", str(grpc_port),
                   "--http-port", str(http_port), "--model-repository", str(tmp), "--no-build-models",
                   "--log-level", "WARNING", "--variant-selection", "off"]  # fmt: skip
            servers[label] = (Started(f"batchgate ({label})", cmd, url), url, name)
        for server, _, _ in servers.values():
            server.ready(180)
        os.sched_setaffinity(0, {args.load_core})
        for _, url, name in servers.values():  # warm-up: the latency model and the run cost learn
            asyncio.run(work(url, name, texts, args.callers, args.calls))
        texts_per_round = args.callers * args.calls * PER_CALL
        spent = dict.fromkeys(servers, 0.0)
        print(
            f"{args.model_dir.name}: {args.callers} callers x {args.calls} calls x {PER_CALL} texts a round"
        )
        for r in range(args.rounds):
            line = []
            for label, (server, url, name) in servers.items():
                c0 = tb.cpu_s(server.proc.pid)
                asyncio.run(work(url, name, texts, args.callers, args.calls))
                used = tb.cpu_s(server.proc.pid) - c0
                spent[label] += used
                line.append(f"{label} {texts_per_round / used:7.2f}")
            print(f"round {r + 1}: texts per server CPU-second: " + "  ".join(line), flush=True)
        print(f"all rounds: on / off = {spent['off'] / spent['on']:.3f}")
    finally:
        for server, _, _ in servers.values():
            server.stop()
        for t in tmps:
            shutil.rmtree(t, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
