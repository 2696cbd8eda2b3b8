"""The gateway's CPU per text, by thread, at 64 callers x 1 text (or --callers x --per-call; KServe gRPC, minilm, the
text-batches texts), against the engine alone on the batches the scheduler forms.

The server is pinned to one core (``--server-core``), this load generator to the other. Per
measured window: every thread's CPU (utime + stime of ``/proc/PID/task/TID/stat``) before and
after, as ms per answered text, grouped by role: the event loop (the main thread), the model's
worker threads (``bg:…``, tokenizing and ONNX Runtime's run), grpc's own threads, and the rest;
the rows per batch the server ran (``ModelStatistics``); then ONNX Runtime FP32 alone, one thread
on the server's core, on the batches the scheduler would form from that many outstanding texts
(bucketed as minilm's length buckets, each batch at its longest row: ``lab.text_ceiling``'s
replay), in the same run. CPU time, so the other load of a shared machine does not count.

``--loop-turns`` runs the server under ``lab/loopcount.py`` and prints its loop's turns
(wake-ups) and callbacks per call (answered or refused).

``--tree LABEL=DIR`` (repeatable) serves the code of another checkout (its top-level folders
put first on PYTHONPATH, e.g. an exported older commit), and the trees alternate round by round:
before/after in one run.

    .venv/bin/python -m lab.text_cpu [--rounds 2] [--seconds 15] [--tree before=/tmp/old --tree after=.]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import grpc
import numpy as np

from batchgate.bench.loadgen import PYTHON, Started, free_ports, served_from, thread_cpu
from lab import loopcount
from lab.profile import _pyspy, read_loop_counts
from lab.text_ceiling import BUCKETS, scheduler_batches
from batchgate.bench.text_batches import load, make_repo, padded_feeds, texts
from batchgate.proto.inference.v2 import grpc_service_pb2 as pb
from batchgate.proto.inference.v2 import grpc_service_pb2_grpc as pbg

ROOT = Path(__file__).resolve().parent.parent


def pkg_root(tree: Path) -> Path:
    """A folder holding ``batchgate`` as ``tree``'s top-level folders (what pyproject maps)."""
    tree = tree.resolve()
    if tree == ROOT:
        return Path()
    root = Path(tempfile.mkdtemp(prefix="text-cpu-pkg-"))
    pkg = root / "batchgate"
    shutil.copytree(tree / "batchgate", pkg)
    for name in ("bench", "cache", "client", "gateway", "proto", "workers"):
        (pkg / name).symlink_to(tree / name)
    return root


@contextlib.contextmanager
def serving_tree(pkg: Path):
    """While inside, servers started import their code from ``pkg`` (``pkg_root``'s answer; "."
    for this tree): it is put on PYTHONPATH, and where they would import from is checked."""
    before = os.environ.get("PYTHONPATH")
    if str(pkg) != ".":
        os.environ["PYTHONPATH"] = str(pkg)
    try:
        want = (ROOT / "gateway" if str(pkg) == "." else pkg / "batchgate" / "gateway").resolve()
        got = served_from()
        if got != want:
            raise SystemExit(f"a server started now would import {got}, not {want}")
        yield
    finally:
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before


def own_repo(pkg: Path, repo: Path, model_dir: Path) -> Path:
    """``repo`` holding the model ``pkg``'s code serves: ``model_dir`` for this tree or a model
    of one's own, and for another tree the minilm its own ``prepare-minilm`` builds (an older
    tree refuses a config parameter it does not know, and its minilm is what it shipped)."""
    repo.mkdir(parents=True)
    if str(pkg) == "." or model_dir.resolve() != (ROOT / "model_repository" / "minilm").resolve():
        make_repo(model_dir, repo)
        return repo
    built = repo.with_name(repo.name + "-built")  # beside, not inside: the server reads every folder of repo
    env = {**os.environ, "PYTHONPATH": str(pkg)}
    subprocess.run([*PYTHON, "-m", "batchgate", "prepare-minilm", "--out", str(built)], env=env, cwd=ROOT,
                   check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    make_repo(built / "minilm", repo)
    return repo


def role(tid: int, pid: int, comm: str) -> str:
    if tid == pid:
        return "event loop (main thread)"
    if comm.startswith("bg:"):
        return "model workers (tokenize + run)"
    if "grpc" in comm or comm in ("event_engine", "default-executo", "resolver-execut"):
        return "grpc threads"
    return f"other ({comm})"


def batch_stats(url: str, model: str) -> tuple[int, int]:
    """(rows, batches) the server has run for ``model``."""
    for attempt in range(20):  # the overload gate may still refuse right after the load
        try:
            with grpc.insecure_channel(url) as ch:
                stub = pbg.GRPCInferenceServiceStub(ch)
                st = stub.ModelStatistics(pb.ModelStatisticsRequest(name=model), timeout=10)
            break
        except grpc.RpcError:
            if attempt == 19:
                raise
            time.sleep(0.5)
    m = st.model_stats[0]
    return m.inference_count, m.execution_count


def serve_window(label: str, pkg: Path, repo: Path, args, all_texts) -> dict:
    grpc_port, http_port = free_ports(2)
    url = f"127.0.0.1:{grpc_port}"
    counts = None
    if args.loop_turns:  # the server under lab/loopcount.py: its loop's turns and callbacks counted
        fd, counts = tempfile.mkstemp(suffix=".json", prefix="text-cpu-loop-")
        os.close(fd)
        os.unlink(counts)
    wrap = [loopcount.__file__, counts] if counts else []  # (a file: see loopcount.wrap)
    cmd = ["taskset", "-c", str(args.server_core), *PYTHON, *wrap, "-m", "batchgate", "serve",
           "--host", "127.0.0.1", "--grpc-port", str(grpc_port), "--http-port", str(http_port),
           "--model-repository", str(repo), "--no-build-models", "--log-level", "WARNING"]  # fmt: skip
    with serving_tree(pkg):
        server = Started("batchgate", cmd, url)
    pid = server.proc.pid
    try:
        server.ready(180)
        asyncio.run(load(url, "minilm", all_texts, args.callers, args.per_call, args.cls, args.warmup))
        names = {}
        for tid in os.listdir(f"/proc/{pid}/task"):
            names[int(tid)] = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        r0, b0 = batch_stats(url, "minilm")
        spy = None
        if args.py_spy:
            out = f"{args.py_spy}.{label}.{time.strftime('%H%M%S')}.raw"
            spy = subprocess.Popen(  # the sampler reads the server's memory without stopping it
                [_pyspy(), "record", "-p", str(pid), "--nonblocking", "--threads", "--format", "raw",
                 "-r", "200", "-o", out, "-d", "3600"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            time.sleep(1.0)  # while it attaches
        lc0 = asyncio.run(read_loop_counts(pid, counts)) if counts else None
        th0 = thread_cpu(pid)
        r = asyncio.run(load(url, "minilm", all_texts, args.callers, args.per_call, args.cls, args.seconds))
        th1 = thread_cpu(pid)
        if lc0 is not None:
            lc1 = asyncio.run(read_loop_counts(pid, counts))
            calls = r["answered"] + sum(r["refused"].values())
            r["loop"] = {k: (lc1[k] - lc0[k]) / max(calls, 1) for k in ("turns", "callbacks")}
        if spy is not None:
            spy.send_signal(signal.SIGINT)  # py-spy writes its file on ^C
            spy.wait(30)
        r1, b1 = batch_stats(url, "minilm")
        for tid in th1:
            if tid not in names:
                try:
                    names[tid] = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
                except OSError:
                    names[tid] = "?"
        groups: dict[str, float] = defaultdict(float)
        per_tid = {}
        for tid, c in th1.items():
            d = c - th0.get(tid, 0.0)
            groups[role(tid, pid, names.get(tid, "?"))] += d
            per_tid[(tid, names.get(tid, "?"))] = d
        r["groups"] = dict(groups)
        r["per_tid"] = per_tid
        r["rows_per_batch"] = (r1 - r0) / max(b1 - b0, 1)
        return r
    finally:
        server.stop()
        if counts and os.path.exists(counts):
            os.unlink(counts)


def engine_alone(model_dir: Path, all_texts: list[str], k: int, rounds: int) -> float:
    """ONNX Runtime FP32 CPU seconds a text on the batches ``k`` outstanding texts make (each
    text once a round, in a new order, grouped by length bucket, each batch at its longest)."""
    import onnxruntime as ort
    from tokenizers import Tokenizer

    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(
        str(model_dir / "1" / "model.onnx"), so, providers=["CPUExecutionProvider"]
    )
    names = {i.name for i in session.get_inputs()}
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(BUCKETS[-1])
    enc = tok.encode_batch(all_texts)
    lengths = [len(e.ids) for e in enc]
    rng = random.Random(1)
    spent, rows = 0.0, 0
    for _ in range(rounds):
        order = rng.sample(range(len(enc)), len(enc))
        for batch in scheduler_batches(order, k, lengths):
            f = padded_feeds([enc[i] for i in batch], names)
            session.run(None, f)  # a new shape's first run is not the steady state
            t0 = time.thread_time()
            session.run(None, f)
            spent += time.thread_time() - t0
            rows += len(batch)
    return spent / rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--tree", action="append", default=[], help="LABEL=DIR, repeatable (default: this checkout)"
    )
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--warmup", type=float, default=4.0)
    p.add_argument("--callers", type=int, default=64)
    p.add_argument(
        "--per-call", type=int, default=1, help="texts per call (4 callers x 32: --callers 4 --per-call 32)"
    )
    p.add_argument("--server-core", type=int, default=0)
    p.add_argument("--load-core", type=int, default=1)
    p.add_argument("--model-dir", type=Path, default=ROOT / "model_repository" / "minilm")
    p.add_argument(
        "--cls", default="standard", help="latency class of the calls (bulk: no refusal on a busy core)"
    )
    p.add_argument("--py-spy", help="record py-spy raw samples of each window to PREFIX.LABEL.TIME.raw")
    p.add_argument("--loop-turns", action="store_true", help="count the loop's turns and callbacks per call")
    p.add_argument("--per-thread", action="store_true", help="print every thread, not only the roles")
    args = p.parse_args()
    trees = [t.split("=", 1) for t in args.tree] or [["this", str(ROOT)]]
    pkgs = [(label, pkg_root(Path(d))) for label, d in trees]
    all_texts = texts()
    repo = Path(tempfile.mkdtemp(prefix="text-cpu-"))
    repos = {label: own_repo(pkg, repo / label, args.model_dir) for label, pkg in pkgs}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results: dict[str, list[dict]] = defaultdict(list)
    alone = []
    try:
        for _ in range(args.rounds):
            os.sched_setaffinity(0, {args.server_core})
            alone.append(engine_alone(args.model_dir, all_texts, args.callers * args.per_call, 2))
            os.sched_setaffinity(0, {args.load_core})
            for label, pkg in pkgs:
                r = serve_window(label, pkg, repos[label], args, all_texts)
                results[label].append(r)
                print(f"[{label}] {r['texts_per_s']:.1f} texts/s, {r['rows_per_batch']:.1f} rows/batch, "
                      f"refused {r['refused'] or 0}", file=sys.stderr, flush=True)  # fmt: skip
    finally:
        shutil.rmtree(repo, ignore_errors=True)
        for _, pkg in pkgs:
            if str(pkg) != ".":  # a copy made by pkg_root
                shutil.rmtree(pkg, ignore_errors=True)
    a = float(np.median(alone))
    print(f"ONNX Runtime FP32 alone on the batches of {args.callers * args.per_call} outstanding, core {args.server_core}: "
          f"{a * 1e3:.2f} ms CPU a text ({', '.join(f'{x * 1e3:.2f}' for x in alone)}): {1 / a:.1f} texts per CPU-s")  # fmt: skip
    roles = sorted({g for rs in results.values() for r in rs for g in r["groups"]})
    print(f"\nms of server CPU per answered text, {args.callers} x {args.per_call}, each round:")
    head = f"{'thread role':<34}" + "".join(f"{label:>22}" for label, _ in pkgs)
    print(head)
    for g in roles + ["all threads"]:
        cells = []
        for label, _ in pkgs:
            vals = [
                (sum(r["groups"].values()) if g == "all threads" else r["groups"].get(g, 0.0)) / max(r["texts"], 1)
                for r in results[label]
            ]  # fmt: skip
            cells.append(" ".join(f"{v * 1e3:6.2f}" for v in vals))
        print(f"{g[:34]:<34}" + "".join(f"{c:>22}" for c in cells))
    print()
    for label, _ in pkgs:
        for r in results[label]:
            total = sum(r["groups"].values()) / r["texts"]
            work = r["groups"].get("model workers (tokenize + run)", 0.0) / r["texts"]
            print(f"[{label}] {r['texts_per_s']:6.1f} texts/s, {r['rows_per_batch']:5.1f} rows/batch, "
                  f"{1 / total:6.1f} texts per server CPU-s = x{a / total:.2f} the engine alone; "
                  f"worker threads x{a / work:.2f} (tokenizing included); p50 {r['p50_ms']:.0f} ms, "
                  f"p99 {r['p99_ms']:.0f} ms, refused {r['refused'] or 0}")  # fmt: skip
            if "loop" in r:
                print(f"    event loop: {r['loop']['turns']:.2f} turns and {r['loop']['callbacks']:.2f} callbacks "
                      "per call (under lab/loopcount.py: its counters cost CPU, so take CPU from a run without)")  # fmt: skip
            if args.per_thread:
                for (tid, comm), c in sorted(r["per_tid"].items(), key=lambda kv: -kv[1]):
                    if c / r["texts"] > 1e-5:
                        print(f"    {tid:>8} {comm:<18} {c / r['texts'] * 1e3:7.3f} ms/text")
    return 0


if __name__ == "__main__":
    sys.exit(main())
