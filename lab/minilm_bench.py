"""minilm benchmark: text in, embedding out, five ways behind the same gRPC stack, in one run.

One server process serves five models on the same ONNX file and tokenizer, differing only in
config.pbtxt parameters:

* ``batchgate``   minilm as served: rows grouped by estimated length bucket, batched while the
                  workers are busy (no wait timer), each batch at most max_batch_tokens (rows x
                  bucket) and run at its own longest length, tokenised in the workers;
* ``bg-buckets``  the same grouping, run on the static bucket engines (rows padded up to a batch
                  bucket, lengths to the length bucket, pooled buffers): the GPU setting;
* ``per-call``    (a) one ONNX Runtime call per request at the text's own length (max_batch_size 1);
* ``padded``      (b) batches padded to the longest text: one length group for every row, no token
                  budget, no learned batch limit (batchgate's deadline queue still caps batch time);
* ``padded-fifo`` (b) as a Triton-like server would batch it: the same, on the FIFO + timer queue.

Closed loop: C callers, each sending one text per ModelInfer (BYTES raw input) as fast as
answers come back, for D seconds per model and workload, in rounds (the models take turns, so a
shared machine's load drift hits all alike). Workloads: ``mixed`` (80% texts of 4-14 words, 15% of
25-60, 5% of 120-200) and ``short`` (all 4-14 words). Prints texts/s, p50/p99, mean rows per
execution, and the ratios to (a) and (b).

    .venv/bin/python -m lab.minilm_bench [--concurrency 64] [--seconds 24] [--rounds 4] [--json]

Needs model_repository/minilm (``batchgate prepare-minilm``), or builds it into a temporary
repository.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np

from batchgate.proto.inference.v2 import grpc_service_pb2 as pb
from batchgate.proto.inference.v2 import grpc_service_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from batchgate.bench.loadgen import free_ports, wait_ready  # noqa: E402

# Parameter changes per variant over minilm's own config.pbtxt.
VARIANTS: dict[str, dict[str, str | None]] = {
    "batchgate": {},
    # batchgate's grouping with the static bucket engines (seq_buckets removed): the GPU setting
    "bg-buckets": {"seq_buckets": None},
    "per-call": {"max_batch_size": "1"},
    "padded": {"length_buckets": "256", "max_batch_tokens": "0", "learned_batch_limit": "false"},
    # (b) as a Triton-like server runs it: FIFO + timer batcher, whatever is queued, padded
    "padded-fifo": {"length_buckets": "256", "max_batch_tokens": "0", "scheduling_policy": "fifo"},
}

WORDS = (
    "the of and to in is was for on that with as by at from his her they this be are it an which one had "
    "not but were all their there been has when who will more no if out so said what up its about into "
    "than them can only other new some could time these two may then do first any my now such like our "
    "over man me even most made after also did many before must through back years where much your way "
    "well down should because each just those people how too little state good very make world still own "
    "see men work long get here between both life being under never day same another know while last "
    "might us great old year off come since against go came right used take three system network server "
    "request batch model latency throughput memory engine service cluster replica deadline budget queue"
).split()


def _text(rng: np.random.Generator, low: int, high: int) -> str:
    words = rng.choice(WORDS, int(rng.integers(low, high + 1)))
    return " ".join(words).capitalize() + "."


def workload(name: str, n: int = 2000, seed: int = 7) -> list[str]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        u = rng.random() if name == "mixed" else 0.0
        out.append(
            _text(rng, 4, 14) if u < 0.80 else _text(rng, 25, 60) if u < 0.95 else _text(rng, 120, 200)
        )
    return out


def _request(model: str, text: str) -> pb.ModelInferRequest:
    b = text.encode()
    req = pb.ModelInferRequest(model_name=model)
    req.inputs.add(name="text", datatype="BYTES", shape=[1, 1])
    req.raw_input_contents.append(struct.pack("<I", len(b)) + b)
    return req


def make_repo(src: Path, dst: Path) -> None:
    """minilm's files under each variant's name; model.onnx is linked, not copied."""
    for name, changes in VARIANTS.items():
        d = dst / name
        (d / "1").mkdir(parents=True)
        (d / "1" / "model.onnx").symlink_to((src / "1" / "model.onnx").resolve())
        shutil.copy(src / "tokenizer.json", d / "tokenizer.json")
        lines = []
        for line in (src / "config.pbtxt").read_text().splitlines():
            if line.startswith("name:"):
                line = f'name: "{name}"'
            if line.startswith("max_batch_size:") and "max_batch_size" in changes:
                line = f"max_batch_size: {changes['max_batch_size']}"
            if "max_queue_delay_microseconds" in line and "max_queue_delay_us" in changes:
                line = f"  max_queue_delay_microseconds: {changes['max_queue_delay_us']}"
            if line.startswith("parameters") and line.split('"')[1] in changes:
                continue
            lines.append(line)
        lines += [
            f'parameters {{ key: "{k}" value {{ string_value: "{v}" }} }}'
            for k, v in changes.items()
            if k not in ("max_batch_size", "max_queue_delay_us") and v is not None
        ]
        (d / "config.pbtxt").write_text("\n".join(lines) + "\n")


async def _load(url: str, model: str, texts: list[str], concurrency: int, seconds: float) -> dict:
    requests = [_request(model, t) for t in texts]
    latencies: list[float] = []
    errors: list[str] = []
    channels = [grpc.aio.insecure_channel(url) for _ in range(4)]
    stubs = [pb_grpc.GRPCInferenceServiceStub(ch) for ch in channels]
    stop_at = time.perf_counter() + seconds
    next_text = 0

    async def caller(i: int) -> None:
        nonlocal next_text
        stub = stubs[i % len(stubs)]
        while (t0 := time.perf_counter()) < stop_at:
            req = requests[next_text % len(requests)]  # every variant sees the same sequence
            next_text += 1
            try:
                await stub.ModelInfer(req, timeout=60)
                latencies.append(time.perf_counter() - t0)
            except grpc.RpcError as exc:
                errors.append(exc.details() or str(exc.code()))

    t0 = time.perf_counter()
    await asyncio.gather(*(caller(i) for i in range(concurrency)))
    elapsed = time.perf_counter() - t0
    for ch in channels:
        await ch.close()
    return {"latencies": latencies, "elapsed": elapsed, "errors": errors}


def _cpu_s(pid: int) -> float:
    """CPU seconds the process (all its threads) has used: utime + stime from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _summary(runs: list[dict]) -> dict:
    latencies = [x for r in runs for x in r["latencies"]]
    errors = [e for r in runs for e in r["errors"]]
    lat = np.array(latencies or [float("nan")]) * 1e3
    cpu_ms = 1e3 * sum(r["server_cpu_s"] for r in runs) / max(len(latencies), 1)
    return {
        "texts_per_s": len(latencies) / sum(r["elapsed"] for r in runs),
        # Server CPU per text: what the texts cost, whoever else shares the machine; on C idle
        # cores the server could answer about C / cpu-seconds-per-text texts a second.
        "server_cpu_ms_per_text": cpu_ms,
        "texts_per_s_per_core": 1e3 / cpu_ms if cpu_ms else float("nan"),
        "p50_ms": float(np.percentile(lat, 50)),
        "p99_ms": float(np.percentile(lat, 99)),
        "errors": len(errors),
        "first_error": errors[0] if errors else "",
    }


async def _stats(url: str, model: str) -> tuple[int, int]:
    async with grpc.aio.insecure_channel(url) as ch:
        stub = pb_grpc.GRPCInferenceServiceStub(ch)
        st = (await stub.ModelStatistics(pb.ModelStatisticsRequest(name=model))).model_stats[0]
        return st.execution_count, st.inference_count


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=24.0, help="per model and workload, over all rounds")
    ap.add_argument(
        "--rounds",
        type=int,
        default=4,
        help="the models take turns this many times, so drift in a shared machine's load hits all alike",
    )
    ap.add_argument("--workloads", default="mixed,short")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--model-dir", type=Path, default=ROOT / "model_repository" / "minilm")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="minilm-bench-"))
    src = args.model_dir
    if not (src / "config.pbtxt").is_file():
        from batchgate.gateway.models.minilm import prepare_minilm

        prepare_minilm(tmp / "built", log=lambda m: print(m, file=sys.stderr))
        src = tmp / "built" / "minilm"
    make_repo(src, tmp / "repo")
    grpc_port, http_port = free_ports(2)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "batchgate",
            "serve",
            "--model-repository",
            str(tmp / "repo"),
            "--no-build-models",
            "--host",
            "127.0.0.1",
            "--grpc-port",
            str(grpc_port),
            "--http-port",
            str(http_port),
            "--log-level",
            "WARNING",
        ],
        cwd=ROOT,
        env=env,
    )
    url = f"127.0.0.1:{grpc_port}"
    results: dict[str, dict[str, dict]] = {}
    try:
        asyncio.run(wait_ready(url, timeout_s=180))
        variants = args.variants.split(",")
        for wl in args.workloads.split(","):
            texts = workload(wl)
            runs: dict[str, list[dict]] = {v: [] for v in variants}
            before = {}
            for variant in variants:
                asyncio.run(_load(url, variant, texts[::-1], args.concurrency, 2.0))  # warm-up
                before[variant] = asyncio.run(_stats(url, variant))
            for k in range(args.rounds):
                for variant in variants:
                    print(
                        f"  {wl} / {variant} round {k + 1}/{args.rounds}: {args.concurrency} callers for "
                        f"{args.seconds / args.rounds:.1f}s ...",
                        file=sys.stderr,
                    )
                    offset = len(texts) * k // args.rounds  # each round its own stretch of the sequence
                    cpu0 = _cpu_s(server.pid)
                    run = asyncio.run(
                        _load(
                            url,
                            variant,
                            texts[offset:] + texts[:offset],
                            args.concurrency,
                            args.seconds / args.rounds,
                        )
                    )
                    run["server_cpu_s"] = _cpu_s(server.pid) - cpu0
                    runs[variant].append(run)
            results[wl] = {}
            for variant in variants:
                after = asyncio.run(_stats(url, variant))
                r = _summary(runs[variant])
                r["rows_per_execution"] = (after[1] - before[variant][1]) / max(
                    after[0] - before[variant][0], 1
                )
                results[wl][variant] = r
    finally:
        server.terminate()
        server.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)

    ratios = {}
    for wl, rs in results.items():
        for ours in ("batchgate", "bg-buckets"):
            for other in ("per-call", "padded", "padded-fifo"):
                if ours in rs and other in rs:
                    ratios[f"{wl}: {ours} / {other}"] = {
                        "texts_per_s": rs[ours]["texts_per_s"] / rs[other]["texts_per_s"],
                        "texts_per_cpu_s": rs[ours]["texts_per_s_per_core"]
                        / rs[other]["texts_per_s_per_core"],
                        "p99_ms": rs[ours]["p99_ms"] / rs[other]["p99_ms"],
                    }
    if args.json:
        print(
            json.dumps(
                {"args": {k: str(v) for k, v in vars(args).items()}, "results": results, "ratios": ratios},
                indent=2,
            )
        )
        return 0
    print(
        f"{'workload':<8} {'model':<10} {'texts/s':>8} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'rows/exec':>9} {'cpu ms/text':>11} {'texts/cpu-s':>11} {'errors':>6}"
    )
    for wl, rs in results.items():
        for variant, r in rs.items():
            print(
                f"{wl:<8} {variant:<10} {r['texts_per_s']:>8.1f} {r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f} "
                f"{r['rows_per_execution']:>9.1f} {r['server_cpu_ms_per_text']:>11.2f} "
                f"{r['texts_per_s_per_core']:>11.1f} {r['errors']:>6}  {r['first_error'][:60]}"
            )
    for name, ratio in ratios.items():
        print(
            f"{name:<30} texts/s x{ratio['texts_per_s']:.2f}   texts per server CPU-second "
            f"x{ratio['texts_per_cpu_s']:.2f}   p99 x{ratio['p99_ms']:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
