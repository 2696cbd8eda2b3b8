"""Many texts in one call: mixed-length texts, served by minilm, against ONNX Runtime alone.

Texts: ``bench/texts/mixed.txt`` (64 lines: most 3-40 tokens, one of ~130, four cut at the model's
256). The server is pinned to one core (taskset), the load generator to another. In the same run
ONNX Runtime alone, one thread on the server's core, computes each text unpadded, one at a time:
the limit every figure is a ratio to. Shapes are callers x texts per call : latency class, closed
loop (a caller sends its next call as soon as it has an answer or a refusal):

    1x32:bulk  8x32:bulk  4x32:standard  64x1:standard

(class ``none``: the call states no class and no deadline, as client libraries send it; counted
in time against the server's default for it, bulk for several texts and standard for one.)

Printed per shape: texts/s answered, texts per server CPU-second and its ratio to the limit (ONNX
Runtime's texts per CPU-second: CPU time, so a shared machine's other load does not count), the
wall-clock ratio, calls answered, refusals by cause (gate: the overload gate at the door; estimate:
the scheduler's admission estimate; expiry: dropped from the queue before compute; other statuses
after them), p50/p99 of answered calls, and the false-refusal rate: the same load with shedding at
admission off (model parameter ``shed_at_admission: false``): calls the server answered within
their budget without shedding and not with it, as a share of the former (refusals are retried at
once, so their count is no measure; the in-time answers they cost are). Under it, the server's own
shadow check of the estimate (``batchgate_shed_shadow_total``): the calls it would have refused,
queued anyway, and how many of them were answered in time. Also one 32-text call with all four
long texts on an idle server, against the unpadded cost of its texts.

    .venv/bin/python -m batchgate.bench.text_batches [--seconds 20] [--shapes 1x32:bulk,...]
        [--model-dir model_repository/minilm] [--variant openvino-bf16]

Another model: ``--model-dir`` (any text embedder's folder in a repository; e.g. the base-size
one ``python -m lab.base_embedder`` prepares), ``--variant`` one its ``optimize`` built.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import signal
import struct
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
from batchgate.bench.loadgen import Started, free_ports, metric_samples
from batchgate.proto.inference.v2 import grpc_service_pb2 as pb
from batchgate.proto.inference.v2 import grpc_service_pb2_grpc as pbg

ROOT = Path(__file__).resolve().parent.parent
TEXTS = Path(__file__).resolve().parent / "texts" / "mixed.txt"
BUDGET_S = {"realtime": 0.025, "standard": 2.0, "bulk": 10.0}  # the server's default classes
SHAPES = "1x32:bulk,8x32:bulk,4x32:standard,64x1:standard"


def texts() -> list[str]:
    return [line for line in TEXTS.read_text().splitlines() if line.strip()]


def model_name(src: Path) -> str:
    return re.search(r'^name: "([^"]+)"', (src / "config.pbtxt").read_text(), re.M).group(1)


def max_tokens(src: Path) -> int:
    found = re.search(r'key: "max_tokens" value \{ string_value: "(\d+)"', (src / "config.pbtxt").read_text())
    return int(found.group(1)) if found else 256


def make_repo(src: Path, dst: Path, variant: str | None = None) -> tuple[str, str]:
    """The model as it ships (every file of its version folder, ``variant`` pinned where given),
    and a twin that does not shed at admission (the false-refusal check): their names."""
    name = model_name(src)
    pin = f'parameters {{ key: "variant" value {{ string_value: "{variant}" }} }}\n' if variant else ""
    noshed = 'parameters { key: "shed_at_admission" value { string_value: "false" } }\n'
    for twin, extra in ((name, pin), (f"{name}_noshed", pin + noshed)):
        d = dst / twin
        (d / "1").mkdir(parents=True)
        for f in (src / "1").iterdir():
            (d / "1" / f.name).symlink_to(f.resolve())
        shutil.copy(src / "tokenizer.json", d / "tokenizer.json")
        cfg = (src / "config.pbtxt").read_text().replace(f'name: "{name}"', f'name: "{twin}"')
        (d / "config.pbtxt").write_text(cfg + extra)
    return name, f"{name}_noshed"


def budget_s(cls: str, per_call: int) -> float:
    """The budget a call of ``cls`` gets; ``none`` states no class and no deadline (as client
    libraries call): the server's default, bulk for several texts and standard for one."""
    if cls == "none":
        return BUDGET_S["bulk" if per_call > 1 else "standard"]
    return BUDGET_S[cls]


def padded_feeds(encs, names) -> dict[str, np.ndarray]:
    """The model's inputs for tokenizer encodings ``encs``, padded to the longest (``names``: the
    graph's input names; token_type_ids only where it has them)."""
    ids = np.zeros((len(encs), max(len(e.ids) for e in encs)), np.int64)
    mask = np.zeros_like(ids)
    for i, e in enumerate(encs):
        ids[i, : len(e.ids)] = e.ids
        mask[i, : len(e.ids)] = 1
    f = {"input_ids": ids, "attention_mask": mask}
    if "token_type_ids" in names:
        f["token_type_ids"] = np.zeros_like(ids)
    return f


def ort_limit(src: Path, all_texts: list[str], rounds: int = 3) -> tuple[dict[str, float], float]:
    """Seconds per text, each run alone at its own length (median of ``rounds``), and the time of
    the idle-call set as one batch padded to its longest: ONNX Runtime, one thread."""
    import onnxruntime as ort
    from tokenizers import Tokenizer

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    session = ort.InferenceSession(str(src / "1" / "model.onnx"), so, providers=["CPUExecutionProvider"])
    names = {i.name for i in session.get_inputs()}
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    tok.no_padding()  # the file pads to a fixed length: each text at its own length here
    tok.enable_truncation(max_tokens(src))

    def feeds(encs) -> dict:
        return padded_feeds(encs, names)

    # CPU time of this thread (ORT runs on it with one intra-op thread): on a shared machine wall
    # time counts whoever else ran on the core; CPU time is the work itself.
    per_text: dict[str, float] = {}
    for t in all_texts:
        f = feeds([tok.encode(t)])
        session.run(None, f)
        samples = []
        for _ in range(rounds):
            t0 = time.thread_time()
            session.run(None, f)
            samples.append(time.thread_time() - t0)
        per_text[t] = float(np.median(samples))
    idle = idle_call(all_texts)
    f = feeds(tok.encode_batch(idle))
    session.run(None, f)
    t0 = time.thread_time()
    session.run(None, f)
    return per_text, time.thread_time() - t0


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def idle_call(all_texts: list[str]) -> list[str]:
    """32 texts with every long one in them (the call the issue measured)."""
    long = sorted(all_texts, key=len)[-4:]
    return long + [t for t in all_texts if t not in long][:28]


def request(model: str, batch: list[str], cls: str) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name=model)
    req.inputs.add(name="text", datatype="BYTES", shape=[len(batch), 1])
    req.raw_input_contents.append(
        b"".join(struct.pack("<I", len(b)) + b for b in (t.encode() for t in batch))
    )
    if cls != "none":
        req.parameters["latency_class"].string_param = cls
    return req


def _outcome(exc: grpc.aio.AioRpcError) -> str:
    """The refusal's cause: gate (the overload gate, UNAVAILABLE at the door), estimate (the
    scheduler's estimate at admission), expiry (dropped from the queue before compute), late (the
    caller's own deadline passed first), or the status's name."""
    details = exc.details() or ""
    if "server overloaded" in details:
        return "gate"
    if "shed before queueing" in details:
        return "estimate"
    if "dropped from the queue" in details:
        return "expiry"
    if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
        return "late"
    return exc.code().name


def shadow(http_port: int, model: str) -> dict[str, float]:
    """The server's shadow check of its estimate for ``model`` (shedding off): calls the estimate
    would have refused, by verdict (would_have_made_it, missed), summed over classes."""
    out = {"would_have_made_it": 0.0, "missed": 0.0}
    for sample in metric_samples(http_port):
        if sample.name == "batchgate_shed_shadow_total" and sample.labels.get("model") == model:
            out[sample.labels["verdict"]] += sample.value
    return out


async def load(url: str, model: str, all_texts: list[str], callers: int, per_call: int, cls: str,
               seconds: float) -> dict:  # fmt: skip
    n = len(all_texts)
    reqs = [request(model, [all_texts[(s + i) % n] for i in range(per_call)], cls) for s in range(n)]
    answered: list[float] = []
    refused: dict[str, int] = {}
    channels = [grpc.aio.insecure_channel(url) for _ in range(min(callers, 4))]
    stubs = [pbg.GRPCInferenceServiceStub(c) for c in channels]
    stop = time.perf_counter() + seconds

    async def caller(k: int) -> None:
        stub = stubs[k % len(stubs)]
        j = k * 7
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            try:
                # The call's deadline is its class budget, as a caller with that budget would set it;
                # a call of no class states no deadline.
                await stub.ModelInfer(reqs[j % n], timeout=None if cls == "none" else BUDGET_S[cls])
                answered.append(time.perf_counter() - t0)
            except grpc.aio.AioRpcError as exc:
                why = _outcome(exc)
                refused[why] = refused.get(why, 0) + 1
            j += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(caller(k) for k in range(callers)))
    elapsed = time.perf_counter() - t0
    for c in channels:
        await c.close()
    lat = sorted(answered)
    in_time = sum(1 for x in lat if x <= budget_s(cls, per_call))
    return {
        "elapsed": elapsed,
        "texts": len(lat) * per_call,
        "texts_per_s": len(lat) * per_call / elapsed,
        "answered": len(lat),
        "in_time": in_time,
        "refused": refused,
        "p50_ms": 1e3 * lat[len(lat) // 2] if lat else float("nan"),
        "p99_ms": 1e3 * lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else float("nan"),
    }


CAUSES = ("gate", "estimate", "expiry")


def _line(label: str, r: dict, limit: float, false_ref: str) -> str:
    by = r["refused"]
    causes = " ".join(f"{by.get(c, 0):>8}" for c in CAUSES)
    other = {k: v for k, v in by.items() if k not in CAUSES}
    return (
        f"{label:<16} {r['texts_per_s']:>8.1f} {r['per_cpu_s']:>11.1f} {r['per_cpu_s'] / limit:>8.2f} "
        f"{r['texts_per_s'] / limit:>6.2f} {r['answered']:>8} {causes} {r['p50_ms']:>8.0f} "
        f"{r['p99_ms']:>8.0f} {false_ref:>9}  {other or ''}"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=20.0, help="measured seconds per shape and mode")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds of load before each measured stretch")
    p.add_argument("--shapes", default=SHAPES)
    p.add_argument("--server-core", type=int, default=0)
    p.add_argument("--load-core", type=int, default=1)
    p.add_argument("--no-shed-check", action="store_true", help="skip the shedding-off runs")
    p.add_argument("--model-dir", type=Path, default=ROOT / "model_repository" / "minilm")
    p.add_argument("--variant", help="serve this variant of the model (its report must have passed)")
    args = p.parse_args()
    src = args.model_dir
    if not (src / "1" / "model.onnx").is_file():
        print(f"{src} has no model: run `batchgate prepare-minilm` first", file=sys.stderr)
        return 2
    all_texts = texts()
    shapes = []
    for item in args.shapes.split(","):
        dims, _, cls = item.partition(":")
        callers, per_call = (int(x) for x in dims.split("x"))
        shapes.append((callers, per_call, cls or "standard"))

    os.sched_setaffinity(0, {args.server_core})  # the limit runs where the server will
    per_text, padded_s = ort_limit(src, all_texts)
    limit = len(all_texts) / sum(per_text.values())
    idle_unpadded = sum(per_text[t] for t in idle_call(all_texts))
    print(
        f"ONNX Runtime alone, 1 thread, core {args.server_core}: {limit:.1f} texts per CPU-second unpadded, "
        f"one at a time; the 32-text idle call: {idle_unpadded * 1e3:.0f} ms CPU unpadded, "
        f"{padded_s * 1e3:.0f} ms as one padded batch"
    )

    tmp = Path(tempfile.mkdtemp(prefix="text-batches-"))
    name, noshed_name = make_repo(src, tmp, args.variant)
    grpc_port, http_port = free_ports(2)
    url = f"127.0.0.1:{grpc_port}"
    cmd = ["taskset", "-c", str(args.server_core), sys.executable, "-m", "batchgate", "serve",
           "--host", "127.0.0.1", "--grpc-port", str(grpc_port), "--http-port", str(http_port),
           "--model-repository", str(tmp), "--no-build-models", "--log-level", "WARNING",
           "--variant-selection", "off"]  # fmt: skip
    # --variant-selection off: the engine measured is the one named, not one a background
    # selection switches to mid-run.
    server = Started("batchgate", cmd, url)
    proc = server.proc
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the server is stopped below
    os.sched_setaffinity(0, {args.load_core})
    try:
        server.ready(180)

        async def idle() -> float:
            async with grpc.aio.insecure_channel(url) as ch:
                stub = pbg.GRPCInferenceServiceStub(ch)
                req = request(name, idle_call(all_texts), "bulk")
                for _ in range(2):
                    await stub.ModelInfer(req, timeout=60)
                samples, cpu = [], []
                for _ in range(3):
                    t0, c0 = time.perf_counter(), cpu_s(proc.pid)
                    await stub.ModelInfer(req, timeout=60)
                    samples.append(time.perf_counter() - t0)
                    cpu.append(cpu_s(proc.pid) - c0)
                return float(np.median(samples)), float(np.median(cpu))

        idle_s, idle_cpu = asyncio.run(idle())
        print(
            f"idle server, one 32-text call (bulk): {idle_s * 1e3:.0f} ms wall, {idle_cpu * 1e3:.0f} ms "
            f"server CPU = x{idle_cpu / idle_unpadded:.2f} its texts' unpadded CPU cost (goal <= 1.3)\n"
        )
        print(
            f"{'shape':<16} {'texts/s':>8} {'texts/cpu-s':>11} {'vs limit':>8} {'wall x':>6} {'answered':>8} "
            f"{'gate':>8} {'estimate':>8} {'expiry':>8} {'p50 ms':>8} {'p99 ms':>8} {'false-ref':>9}  other"
        )
        for callers, per_call, cls in shapes:
            label = f"{callers}x{per_call}:{cls}"
            rows = {}
            for model in (name,) + (() if args.no_shed_check else (noshed_name,)):
                asyncio.run(load(url, model, all_texts, callers, per_call, cls, args.warmup))
                c0, s0 = cpu_s(proc.pid), shadow(http_port, model)
                rows[model] = asyncio.run(load(url, model, all_texts, callers, per_call, cls, args.seconds))
                used = cpu_s(proc.pid) - c0
                rows[model]["per_cpu_s"] = rows[model]["texts"] / used if used else float("nan")
                rows[model]["shadow"] = {k: v - s0[k] for k, v in shadow(http_port, model).items()}
            r = rows[name]
            n_ref = sum(r["refused"].values())
            false_ref = "-"
            if noshed_name in rows:
                off = rows[noshed_name]
                # Calls answered in time without shedding that were not with it: each stands for
                # (at least) one refusal that should not have been, over the calls it answered.
                would = min(max(off["in_time"] - r["in_time"], 0), n_ref)  # no refusal, no false one
                false_ref = f"{would / off['in_time']:.1%}" if off["in_time"] else "0.0%"
            print(_line(label, r, limit, false_ref))
            if noshed_name in rows:
                off = rows[noshed_name]
                sh = off["shadow"]
                print(_line("  shedding off", off, limit, ""))
                # The estimate checked against what happened: of the calls it would have refused
                # (queued anyway), how many made their deadline (each a false refusal avoided).
                print(
                    f"{'':<16} estimate, shadow check: {sh['would_have_made_it'] + sh['missed']:.0f} calls "
                    f"it would have refused, {sh['would_have_made_it']:.0f} of them answered in time "
                    f"(false refusals), {sh['missed']:.0f} missed"
                )
        print(
            "\n'vs limit': texts per server CPU-second over ONNX Runtime's texts per CPU-second, each text "
            "alone and unpadded (CPU time: other load on a shared core does not count); on a quiet machine "
            "with the core saturated it is also the texts/s ratio ('wall x': wall-clock texts/s).\n"
            "Goal: every shape refuses nothing and reaches >= 0.9."
        )
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
