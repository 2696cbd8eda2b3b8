"""Per-call CPU profile of a server under load: CPU µs per call, by thread and by stage.

For each target (the no-op server, batchgate) and each API (unary, stream) it sends a fixed number
of single-row ``ranker`` calls from C concurrent callers and reads the server's CPU time
(utime + stime from ``/proc/PID/stat`` and, per thread, ``/proc/PID/task/TID/stat``) before and
after. CPU time per call does not depend on how many other processes share the machine, so the
figures are comparable between runs on a loaded 2-core machine, where calls/s are not.

A second pass of the same length runs ``py-spy record --nonblocking`` (a sampling profiler that
reads the server's memory without stopping it) and splits each Python thread's CPU into stages:
a sample goes to the innermost frame of our own code on its stack (``gateway/server.py`` →
transport, ``codec.py`` → codec, ``scheduler.py`` → scheduler, ...), or, with none, to the
library it is in (the asyncio loop with the grpc.aio Cython beneath it, the grpc poller thread).
Threads without Python frames (ONNX Runtime's) keep their /proc figure as one row.

    .venv/bin/python -m lab.profile [--targets noop,batchgate] [--apis unary,stream]
        [--calls 20000] [--concurrency 64] [--no-py-spy] [--pin-server 0 --pin-client 1] [--json F]

py-spy is in the ``dev`` extra (``pip install py-spy``); it needs ptrace rights over the server
(root, or ``kernel.yama.ptrace_scope=0``). Without it, ``--no-py-spy`` gives the per-thread table.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from lab import loopcount
from batchgate.bench.loadgen import (
    Started,
    Workload,
    _Stream,
    process_cpu,
    self_cpu,
    start_target,
    thread_cpu,
)
from batchgate.proto.inference.v2 import grpc_service_pb2_grpc as pb_grpc

# -- stages ---------------------------------------------------------------------------------------

# Our modules by file name (so the table survives the moves into transport/, scheduling/, ...).
STAGES = {
    "transport": ("server.py", "grpc.py", "http.py", "rest.py", "infer.py", "errors.py", "noop_server.py"),
    "admission": ("admission.py", "gate.py", "tenants.py", "ratelimit.py"),
    "codec": ("codec.py", "dtypes.py"),
    "result cache": ("caching.py", "result_cache.py"),
    "scheduler": (
        "scheduler.py", "queues.py", "budgets.py", "latency.py", "interface.py", "request.py", "fifo.py",
        "deadline.py", "stats.py",
    ),
    "dataplane/runtime": ("dataplane.py", "runtime.py"),
    "text stage": ("text.py",),
    "metrics": ("metrics.py",),
}  # fmt: skip
_OUR_DIRS = ("gateway/", "workers/", "cache/", "bench/noop_server.py")


def _frame_file(frame: str) -> str:
    """'func (path/to/file.py:123)' -> 'path/to/file.py'."""
    i = frame.rfind(" (")
    return frame[i + 2 :].rsplit(":", 1)[0] if i >= 0 else ""


def stage_of(frames: list[str]) -> str:
    """The stage of one sampled stack (root first): its innermost frame in our code, or else the
    library its innermost frame is in. Frames above the event loop's dispatch (``Handle._run``:
    our entry point, ``asyncio.run``) belong to no stage: the loop itself runs there."""
    files = [_frame_file(f) for f in frames]
    for i in range(len(files) - 1, -1, -1):
        if files[i].endswith("asyncio/events.py"):
            files = files[i + 1 :]
            break
    else:
        if any(f.startswith(("BaseEventLoop._run_once ", "BaseEventLoop.run_forever ")) for f in frames):
            return "asyncio loop (select, _run_once)"
    leaf = files[-1] if files else ""
    if "onnxruntime/" in leaf:
        return "onnxruntime (run)"
    if "prometheus_client/" in leaf:
        return "metrics"
    for path in reversed(files):
        if not any(d in path for d in _OUR_DIRS):
            continue
        if "workers/" in path:
            return "workers (engine, buffers, pool)"
        if "cache/" in path and "gateway/" not in path:
            return "result cache"
        name = path.rsplit("/", 1)[-1]
        for stage, names in STAGES.items():
            if name in names:
                return stage
        return f"gateway (other: {name})"
    if any("grpc/" in p for p in files):
        return "grpc.aio (python: interceptors, call objects)"
    if any("asyncio/" in p for p in files):
        return "asyncio (futures, tasks, queues)"
    if not files:
        return "loop callbacks in C (grpc.aio cython, protobuf)"
    if any(p.endswith("threading.py") or "concurrent/" in p for p in files):
        return "threads, futures"
    return "other"


def parse_raw(path: str) -> tuple[dict[int, Counter], dict[int, str]]:
    """py-spy ``--format raw --threads`` output -> ({tid: Counter(stage -> samples)}, {tid: name})."""
    per_thread: dict[int, Counter] = defaultdict(Counter)
    names: dict[int, str] = {}
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            frames = stack.split(";")
            tid = -1
            if frames and frames[0].startswith("thread ("):
                head, _, name = frames[0][len("thread (") :].partition(")")
                tid = int(head, 0)
                names[tid] = name.lstrip(": ").strip() or names.get(tid, "")
                frames = frames[1:]
            per_thread[tid][stage_of(frames)] += int(count)
    return dict(per_thread), names


def _thread_names(pid: int) -> dict[int, str]:
    names = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            names[int(tid)] = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        except OSError:
            pass
    return names


# -- the load -------------------------------------------------------------------------------------


@dataclass
class Window:
    """One measured window: server and client CPU over a fixed number of calls."""

    calls: int = 0
    errors: int = 0
    wall_s: float = 0.0
    server_cpu_s: float = 0.0
    client_cpu_s: float = 0.0
    threads_s: dict[int, float] = field(default_factory=dict)
    stages: dict[int, Counter] = field(default_factory=dict)  # from py-spy, when it ran
    names: dict[int, str] = field(default_factory=dict)  # Python thread names, from py-spy
    loop: dict[str, float] = field(default_factory=dict)  # loop turns, callbacks per call (--loop-turns)

    def us_per_call(self, seconds: float) -> float:
        return seconds / max(self.calls, 1) * 1e6


async def _drive(send, concurrency: int, calls: int) -> tuple[int, int]:
    remaining = calls
    ok = errors = 0

    async def caller(slot: int) -> None:
        nonlocal remaining, ok, errors
        k = slot
        while remaining > 0:
            remaining -= 1
            try:
                await send(slot, k)
                ok += 1
            except Exception:  # noqa: BLE001 - every failed call (status, timeout, stream error) counts
                errors += 1
            k += 1

    await asyncio.gather(*(caller(i) for i in range(concurrency)))
    return ok, errors


async def read_loop_counts(pid: int, path: str, timeout_s: float = 5.0) -> dict:
    """Ask the server (run under lab/loopcount.py) for its loop counts so far."""
    before = json.loads(Path(path).read_text())["signals"] if os.path.exists(path) else 0
    os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        await asyncio.sleep(0.02)
        if os.path.exists(path):
            counts = json.loads(Path(path).read_text())
            if counts["signals"] > before:
                return counts
    raise RuntimeError(f"no loop counts in {path}: is the server running under lab/loopcount.py?")


def start_server(target: str, serve_args: list[str], loop_counts: str | None) -> Started:
    """The target, started plainly or under lab/loopcount.py."""
    server = start_target(target, *serve_args)
    if not loop_counts:
        return server
    server.proc.kill()  # only its command line was wanted: start it again under the counter
    server.proc.wait()
    cmd = server.proc.args
    return Started(server.name, loopcount.wrap(list(cmd), loop_counts), server.url)


def _pyspy() -> str | None:
    exe = Path(sys.executable).with_name("py-spy")
    return str(exe) if exe.exists() else shutil.which("py-spy")


def ranker_sender(chans: list, api: str, rows: int):
    """``(streams, send)``: ``send(slot, k)`` makes one ``ranker`` call of ``rows`` rows, unary or
    on one of the streams (one per channel; the caller closes them)."""
    stubs = [pb_grpc.GRPCInferenceServiceStub(ch) for ch in chans]
    streams = [_Stream(ch, 10.0) for ch in chans] if api == "stream" else []
    pool = Workload("ranker", rows=rows).requests()
    ids = itertools.count()

    async def send(slot: int, k: int) -> None:
        req = pool[k % len(pool)]
        if api == "unary":
            await stubs[slot % len(stubs)].ModelInfer(req, timeout=10)
        else:
            await streams[slot % len(streams)].infer(req, str(next(ids)))

    return streams, send


async def measure(
    server: Started,
    api: str,
    concurrency: int,
    calls: int,
    rows: int,
    py_spy: bool,
    rate: int,
    loop_counts: str | None = None,
) -> list[Window]:
    """Warm up, then one window without the profiler and (``py_spy``) one with it. With
    ``loop_counts`` (the file lab/loopcount.py writes) the first window also counts loop turns."""
    pid = server.proc.pid
    chans = [
        grpc.aio.insecure_channel(server.url, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(4)
    ]
    streams, send = ranker_sender(chans, api, rows)

    windows = []
    try:
        await _drive(send, concurrency, max(calls // 10, 500))  # warm-up: connections, engines, caches
        for profiled in (False, True) if py_spy else (False,):
            spy = raw = None
            if profiled:
                fd, raw = tempfile.mkstemp(suffix=".raw")
                os.close(fd)
                spy = subprocess.Popen(  # noqa: ASYNC220 - started once per window, before the clock
                    [_pyspy(), "record", "-p", str(pid), "--nonblocking", "--threads", "--format", "raw",
                     "-r", str(rate), "-o", raw, "-d", "3600"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                )  # fmt: skip
                await _drive(send, concurrency, 300)  # while py-spy attaches
            w = Window()
            lc0 = await read_loop_counts(pid, loop_counts) if loop_counts and not profiled else None
            t0, c0, s0, th0 = time.perf_counter(), self_cpu(), process_cpu(pid), thread_cpu(pid)
            w.calls, w.errors = await _drive(send, concurrency, calls)
            t1, c1, s1, th1 = time.perf_counter(), self_cpu(), process_cpu(pid), thread_cpu(pid)
            if lc0 is not None:
                lc1 = await read_loop_counts(pid, loop_counts)
                w.loop = {k: (lc1[k] - lc0[k]) / max(w.calls, 1) for k in ("turns", "callbacks")}
            w.wall_s, w.client_cpu_s, w.server_cpu_s = t1 - t0, c1 - c0, s1 - s0
            w.threads_s = {tid: th1[tid] - th0.get(tid, 0.0) for tid in th1}
            if spy is not None:
                spy.send_signal(signal.SIGINT)  # py-spy writes its file on ^C
                try:
                    _, err = spy.communicate(timeout=30)
                except subprocess.TimeoutExpired:
                    spy.kill()
                    _, err = spy.communicate()
                if not os.path.getsize(raw):
                    raise RuntimeError(f"py-spy wrote nothing: {err.decode(errors='replace')[-500:]}")
                w.stages, w.names = parse_raw(raw)
                if os.environ.get("BATCHGATE_PROFILE_KEEP_RAW"):  # for a finer look than the stages
                    print(f"py-spy's raw samples kept in {raw}", file=sys.stderr)
                else:
                    os.unlink(raw)
            windows.append(w)
    finally:
        for s in streams:
            await s.close()
        for ch in chans:
            await ch.close()
    return windows


# -- report ---------------------------------------------------------------------------------------


def stage_table(w: Window, sampled: Window, names: dict[int, str]) -> list[tuple[str, str, float]]:
    """(thread, stage, µs/call): each thread's CPU in ``w`` split by the shares of its stages in
    the samples of ``sampled`` (the window py-spy ran in: same threads, same load)."""
    rows = []
    for tid, cpu in sorted(w.threads_s.items(), key=lambda kv: -kv[1]):
        us = w.us_per_call(cpu)
        if us < 0.5:
            continue
        samples = sampled.stages.get(tid)
        label = names.get(tid, str(tid))
        if "_poll_wrapper" in label:  # grpc.aio's poller: C core under a Python thread's root
            rows.append((label, "grpc.aio poller (C core)", us))
            continue
        if not samples:
            native = "grpc C core" if label == "event_engine" else "native thread"
            rows.append((label, f"({native}: no Python frames)", us))
            continue
        total = sum(samples.values())
        for stage, n in samples.most_common():
            rows.append((label, stage, us * n / total))
    return rows


def top_stages(table: list[tuple[str, str, float]]) -> list[tuple[str, float]]:
    """Stages summed over threads (event_engine threads as one), largest first."""
    total: Counter = Counter()
    for _, stage, us in table:
        total[stage] += us
    return [(s, round(us, 1)) for s, us in total.most_common()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--targets",
        default="noop,batchgate",
        help="comma-separated: noop, noop-suspend (its handler waits once per request), noop-batch (the least "
        "dynamic batcher: bench/noop_server.py --batch), batchgate",
    )
    ap.add_argument("--apis", default="unary,stream")
    ap.add_argument("--calls", type=int, default=20000, help="calls per measured window")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--no-py-spy", dest="py_spy", action="store_false", help="CPU per thread only")
    ap.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    ap.add_argument("--pin-server", help="taskset CPU list for the server (e.g. 0)")
    ap.add_argument("--pin-client", help="CPU list for this load generator (e.g. 1)")
    ap.add_argument(
        "--loop-turns",
        action="store_true",
        help="run the servers under lab/loopcount.py and count event-loop turns and callbacks per "
        "call (the counters cost CPU: take CPU figures from a run without this)",
    )
    ap.add_argument("--json", help="write the figures to this file too")
    ap.add_argument("serve_args", nargs="*", help="extra `batchgate serve` flags (after --)")
    args = ap.parse_args(argv)
    if args.py_spy and not _pyspy():
        ap.error("py-spy not found (pip install py-spy), or pass --no-py-spy")
    if args.pin_client:
        os.sched_setaffinity(0, {int(c) for c in args.pin_client.split(",")})

    out = []
    for target in args.targets.split(","):
        loop_counts = None
        if args.loop_turns:
            fd, loop_counts = tempfile.mkstemp(suffix=".json", prefix="loopcount-")
            os.close(fd)
            os.unlink(loop_counts)
        server = start_server(target, args.serve_args, loop_counts)
        if args.pin_server:
            subprocess.run(["taskset", "-a", "-p", "-c", args.pin_server, str(server.proc.pid)],
                           check=True, stdout=subprocess.DEVNULL)  # fmt: skip
        try:
            server.ready()
            for api in args.apis.split(","):
                windows = asyncio.run(
                    measure(
                        server,
                        api,
                        args.concurrency,
                        args.calls,
                        args.rows,
                        args.py_spy,
                        args.rate,
                        loop_counts,
                    )
                )
                names = _thread_names(server.proc.pid)
                for w in windows:
                    names.update({t: n for t, n in w.names.items() if n})
                out.append((target, api, windows, names))
                _print_point(target, api, windows, names, args)
        finally:
            server.stop()
    _print_summary(out)
    if args.json:
        Path(args.json).write_text(json.dumps([_as_dict(*o) for o in out], indent=2))
    return 0


def _print_point(target: str, api: str, windows: list[Window], names: dict[int, str], args) -> None:
    w = windows[0]
    print(
        f"\n## {target} {api}: {w.calls} calls ({w.errors} errors), {args.concurrency} callers, "
        f"{args.rows} row(s); {w.calls / w.wall_s:.0f} calls/s on this (shared) machine"
    )
    print(
        f"server CPU {w.us_per_call(w.server_cpu_s):7.1f} µs/call   "
        f"client CPU {w.us_per_call(w.client_cpu_s):7.1f} µs/call"
    )
    if w.loop:
        print(
            f"event loop: {w.loop['turns']:.2f} turns and {w.loop['callbacks']:.2f} callbacks per call "
            "(counted under lab/loopcount.py: CPU figures of this run include its counters)"
        )
    print(f"{'thread':<28} {'µs/call':>8}")
    for tid, cpu in sorted(w.threads_s.items(), key=lambda kv: -kv[1]):
        if w.us_per_call(cpu) >= 0.5:
            print(f"{names.get(tid, str(tid))[:28]:<28} {w.us_per_call(cpu):>8.1f}")
    if len(windows) > 1:
        p = windows[1]
        print(
            f"with py-spy attached: server CPU {p.us_per_call(p.server_cpu_s):.1f} µs/call, "
            f"{p.calls / p.wall_s:.0f} calls/s; by stage (µs/call of the window without it, split by "
            "the profiled window's shares):"
        )
        print(f"{'thread':<22} {'stage':<48} {'µs/call':>8}")
        table = stage_table(w, p, names)
        for thread, stage, us in table:
            if us >= 0.5:
                print(f"{thread[:22]:<22} {stage[:48]:<48} {us:>8.1f}")
        print("top stages, all threads together:")
        for stage, us in top_stages(table):
            print(f"  {stage[:60]:<60} {us:>8.1f} µs/call")


def _print_summary(out) -> None:
    print("\n## summary (server CPU µs per call; calls/s from a loaded machine)")
    print(f"{'target':<10} {'api':<7} {'server µs/call':>14} {'client µs/call':>14} {'calls/s':>8}  loop")
    for target, api, windows, _ in out:
        w = windows[0]
        loop = f"  {w.loop['turns']:.2f} turns, {w.loop['callbacks']:.2f} callbacks/call" if w.loop else ""
        print(
            f"{target:<10} {api:<7} {w.us_per_call(w.server_cpu_s):>14.1f} "
            f"{w.us_per_call(w.client_cpu_s):>14.1f} {w.calls / w.wall_s:>8.0f}{loop}"
        )
    by = {(t, a): ws[0] for t, a, ws, _ in out}
    for api in ("unary", "stream"):
        if ("noop", api) in by and ("batchgate", api) in by:
            n, b = by[("noop", api)], by[("batchgate", api)]
            print(
                f"{api}: batchgate/noop server CPU per call = "
                f"{b.us_per_call(b.server_cpu_s) / n.us_per_call(n.server_cpu_s):.2f}x"
            )


def _as_dict(target: str, api: str, windows: list[Window], names: dict[int, str]) -> dict:
    w = windows[0]
    d = {
        "target": target,
        "api": api,
        "calls": w.calls,
        "errors": w.errors,
        "calls_per_s_loaded_machine": w.calls / w.wall_s,
        "server_cpu_us_per_call": w.us_per_call(w.server_cpu_s),
        "client_cpu_us_per_call": w.us_per_call(w.client_cpu_s),
        **({"loop_per_call": w.loop} if w.loop else {}),
        "threads_us_per_call": {
            names.get(t, str(t)) + f"/{t}": w.us_per_call(c) for t, c in w.threads_s.items()
        },
    }
    if len(windows) > 1:
        p = windows[1]
        d["profiled_server_cpu_us_per_call"] = p.us_per_call(p.server_cpu_s)
        d["top_stages_us_per_call"] = dict(top_stages(stage_table(w, p, names)))
        d["stages_us_per_call"] = [
            {"thread": t, "stage": s, "us_per_call": round(us, 2)} for t, s, us in stage_table(w, p, names)
        ]
    return d


if __name__ == "__main__":
    sys.exit(main())
