"""Triton's perf_analyzer (a C++ client) against batchgate and the no-op server, unary and streamed.

``ranker``, one row per request, 64 concurrent requests by default. For each target and API it
prints perf_analyzer's throughput and latency percentiles and the server's CPU µs per request
(utime + stime from /proc over the run, divided by the requests ModelStatistics counted: robust on
a shared machine, where the throughput is not).

perf_analyzer comes from PyPI (``pip install perf-analyzer``). Its 2.x wheels are tagged
manylinux_2_38 and need glibc 2.38 and GLIBCXX_3.4.32, so on an older system (Debian 12 has glibc
2.36) pip picks the empty 0.1.0 or refuses the wheel. There ``--setup-libs DIR`` does, once:
``pip download perf-analyzer==2.60.0 --platform manylinux_2_38_x86_64 --only-binary=:all:
--no-deps`` and unzips the wheel under DIR; fetches Debian 13's libc6, libstdc++6 and libgcc-s1
with ``apt-get download`` (a private apt state under DIR: the system's apt lists are not touched)
and unpacks them under DIR. ``--libs DIR`` then runs the binary through that glibc's loader:
``DIR/root/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2 --library-path ...:/lib/x86_64-linux-gnu
perf_analyzer ...``.

    .venv/bin/python -m lab.perf_analyzer --setup-libs /tmp/pa-libs   # once
    .venv/bin/python -m lab.perf_analyzer --libs /tmp/pa-libs (or PERF_ANALYZER_LIBS=/tmp/pa-libs)
        [--perf-analyzer PATH] [--targets noop,batchgate] [--apis unary,stream] [--concurrency 64]

``--targets`` takes any of bench.loadgen's targets: ``noop``, ``noop-suspend``, ``noop-batch`` (the
least dynamic batcher, bench/noop_server.py --batch) and ``batchgate``; each is set against the
no-op in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from batchgate.bench.loadgen import model_statistics, process_cpu, start_target

_MULTIARCH = "usr/lib/x86_64-linux-gnu"
_PACKAGES = ("libc6", "libstdc++6", "libgcc-s1")
_WHEEL = "perf-analyzer==2.60.0"


def setup_libs(dest: Path, suite: str = "trixie") -> Path:
    """Debian ``suite``'s libc and libstdc++ unpacked under ``dest``; returns the library folder."""
    dest.mkdir(parents=True, exist_ok=True)
    state = dest / "apt"
    for d in ("parts", "lists/partial", "cache/archives/partial"):
        (state / d).mkdir(parents=True, exist_ok=True)
    (state / "parts" / f"{suite}.sources").write_text(
        f"Types: deb\nURIs: http://deb.debian.org/debian\nSuites: {suite}\nComponents: main\n"
        "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n"
    )
    opts = [
        "-o", "Dir::Etc::sourcelist=/dev/null", "-o", f"Dir::Etc::sourceparts={state / 'parts'}",
        "-o", f"Dir::State::Lists={state / 'lists'}", "-o", f"Dir::Cache={state / 'cache'}",
        "-o", "Debug::NoLocking=1",
    ]  # fmt: skip
    subprocess.run(["apt-get", *opts, "update", "-qq"], check=True, timeout=600)
    debs = dest / "debs"
    debs.mkdir(exist_ok=True)
    subprocess.run(["apt-get", *opts, "download", *_PACKAGES], check=True, cwd=debs, timeout=600)
    for deb in debs.glob("*.deb"):
        subprocess.run(["dpkg-deb", "-x", str(deb), str(dest / "root")], check=True)
    wheels = dest / "wheel"
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", _WHEEL, "--platform", "manylinux_2_38_x86_64",
         "--only-binary=:all:", "--no-deps", "--python-version", "3.11", "-d", str(wheels)],
        check=True, timeout=600,
    )  # fmt: skip
    for whl in wheels.glob("perf_analyzer-*.whl"):
        with zipfile.ZipFile(whl) as z:
            z.extractall(wheels)
    exe = wheels / "perf_analyzer" / "bin" / "perf_analyzer"
    exe.chmod(0o755)
    return dest / "root" / _MULTIARCH


def find_binary(explicit: str | None, libs: str | None = None) -> str:
    if explicit:
        return explicit
    if libs and (Path(libs) / "wheel" / "perf_analyzer" / "bin" / "perf_analyzer").exists():
        return str(Path(libs) / "wheel" / "perf_analyzer" / "bin" / "perf_analyzer")
    if os.environ.get("PERF_ANALYZER"):
        return os.environ["PERF_ANALYZER"]
    try:  # the PyPI wheel puts it inside its package
        import perf_analyzer  # type: ignore[import-not-found]

        exe = Path(perf_analyzer.__file__).parent / "bin" / "perf_analyzer"
        if exe.exists():
            return str(exe)
    except ImportError:
        pass
    found = shutil.which("perf_analyzer")
    if not found:
        raise SystemExit("perf_analyzer not found: pip install perf-analyzer, or pass --perf-analyzer PATH")
    return found


def command(binary: str, libs: str | None) -> list[str]:
    """How to start the binary: directly, or through a newer glibc's loader."""
    if not libs:
        return [binary]
    lib = Path(libs)
    for cand in (lib / "root" / _MULTIARCH, lib / _MULTIARCH, lib):  # --setup-libs' DIR, a root, the folder
        if (cand / "ld-linux-x86-64.so.2").exists():
            lib = cand
            break
    return [str(lib / "ld-linux-x86-64.so.2"), "--library-path", f"{lib}:/lib/x86_64-linux-gnu", binary]


_FIELDS = {
    "throughput_infer_per_s": r"Throughput:\s*([\d.]+) infer/sec",
    "avg_latency_us": r"Avg latency:\s*(\d+) usec",
    "p50_us": r"p50 latency:\s*(\d+) usec",
    "p90_us": r"p90 latency:\s*(\d+) usec",
    "p99_us": r"p99 latency:\s*(\d+) usec",
}


def parse(out: str) -> dict:
    # The last block is the measured concurrency (earlier blocks are per-window stabilisation).
    tail = out[out.rfind("Request concurrency") :] if "Request concurrency" in out else out
    res = {}
    for key, pat in _FIELDS.items():
        found = re.findall(pat, tail)
        if found:
            res[key] = float(found[-1])
    return res


def ort_alone_rows_per_s(batch: int, seconds: float = 2.0) -> float:
    """ranker's rows/s in ONNX Runtime alone, in this process, one thread, at ``batch`` rows."""
    import numpy as np
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = opts.inter_op_num_threads = 1
    model = Path(__file__).resolve().parent.parent / "model_repository" / "ranker" / "1" / "model.onnx"
    sess = ort.InferenceSession(str(model), opts, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feeds = {"dense": rng.standard_normal((batch, 64), dtype=np.float32),
             "sparse_ids": rng.integers(0, 10_000, (batch, 8), dtype=np.int64)}  # fmt: skip
    for _ in range(20):
        sess.run(None, feeds)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        sess.run(None, feeds)
        n += 1
    return n * batch / (time.perf_counter() - t0)


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def input_data(path: Path, variants: int = 64, seed: int = 0) -> Path:
    """perf_analyzer's --input-data file: ``variants`` distinct valid ranker rows (its random data
    would put sparse_ids outside [0, 10000), which batchgate refuses, and zeros would be one row)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    data = [
        {
            "dense": {"content": rng.standard_normal(64).astype(np.float32).round(4).tolist(), "shape": [64]},
            "sparse_ids": {"content": rng.integers(0, 10_000, 8).tolist(), "shape": [8]},
        }
        for _ in range(variants)
    ]
    path.write_text(json.dumps({"data": data}))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--setup-libs", metavar="DIR", help="fetch and unpack Debian 13's libc/libstdc++ into DIR, then exit"
    )
    ap.add_argument(
        "--libs",
        metavar="DIR",
        default=os.environ.get("PERF_ANALYZER_LIBS"),
        help="run perf_analyzer through the glibc unpacked in DIR (default $PERF_ANALYZER_LIBS)",
    )
    ap.add_argument("--perf-analyzer", help="path of the binary (default: the pip wheel's, or PATH)")
    ap.add_argument("--targets", default="noop,batchgate", help="noop, noop-suspend, noop-batch, batchgate")
    ap.add_argument("--apis", default="unary,stream")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--interval-ms", type=int, default=3000, help="perf_analyzer's measurement window")
    ap.add_argument("--batch", type=int, default=1, help="rows per request (perf_analyzer's -b)")
    ap.add_argument("--json", help="write the figures to this file too")
    args = ap.parse_args(argv)
    if args.setup_libs:
        lib = setup_libs(Path(args.setup_libs))
        print(f"unpacked under {lib}; run with --libs {args.setup_libs}")
        return 0
    base = command(find_binary(args.perf_analyzer, args.libs), args.libs)
    probe = subprocess.run([*base, "--version"], capture_output=True, text=True, timeout=30, check=False)
    if probe.returncode != 0:
        print(
            f"perf_analyzer does not start: {(probe.stderr or probe.stdout).strip()[-600:]}", file=sys.stderr
        )
        if "GLIBC" in probe.stderr:
            print("its 2.x wheels need glibc 2.38: try --setup-libs DIR, then --libs DIR", file=sys.stderr)
        return 2

    results = []
    data = input_data(Path(tempfile.mkdtemp(prefix="pa-")) / "ranker.json")
    for target in args.targets.split(","):
        server = start_target(target)
        try:
            server.ready()
            for api in args.apis.split(","):
                before = asyncio.run(model_statistics(server.url, "ranker"))
                cpu0, kids0 = process_cpu(server.proc.pid), _children_cpu()
                cmd = [
                    *base, "-m", "ranker", "-u", server.url, "-i", "grpc", "-b", str(args.batch),
                    "--concurrency-range", str(args.concurrency),
                    "--measurement-interval", str(args.interval_ms),
                    "--stability-percentage", "100", "--max-trials", "6", "--input-data", str(data),
                ]  # fmt: skip
                if api == "stream":
                    cmd.append("--streaming")
                with tempfile.TemporaryFile("w+") as log:
                    rc = subprocess.run(
                        cmd, stdout=log, stderr=subprocess.STDOUT, timeout=300, check=False
                    ).returncode
                    log.seek(0)
                    out = log.read()
                cpu1, kids1 = process_cpu(server.proc.pid), _children_cpu()
                after = asyncio.run(model_statistics(server.url, "ranker"))
                r = {"target": target, "api": api, "concurrency": args.concurrency, "rc": rc, **parse(out)}
                if before and after and after["requests"] > before["requests"]:
                    r["requests"] = after["requests"] - before["requests"]
                    r["server_cpu_us_per_request"] = (cpu1 - cpu0) / r["requests"] * 1e6
                    # perf_analyzer is the only child that ended meanwhile: its CPU, per request
                    r["client_cpu_us_per_request"] = (kids1 - kids0) / r["requests"] * 1e6
                if rc != 0 or "throughput_infer_per_s" not in r:
                    r["error"] = out.strip()[-800:]
                results.append(r)
                _print(r)
        finally:
            server.stop()
    by = {(r["target"], r["api"]): r for r in results}
    for api in args.apis.split(","):
        n = by.get(("noop", api))
        for target in (t for t in args.targets.split(",") if t != "noop"):
            b = by.get((target, api))
            if not (n and b and n.get("throughput_infer_per_s") and b.get("throughput_infer_per_s")):
                continue
            tput = b["throughput_infer_per_s"] / n["throughput_infer_per_s"]
            line = f"{api}: {target}/noop throughput {tput:.2f}"
            if n.get("server_cpu_us_per_request") and b.get("server_cpu_us_per_request"):
                cpu = b["server_cpu_us_per_request"] / n["server_cpu_us_per_request"]
                line += f", server CPU per request {cpu:.2f}x"
            print(line + " (throughput from a shared, loaded machine)")
    if args.batch > 1:
        ort = ort_alone_rows_per_s(args.batch)
        for r in results:
            if r["target"] == "batchgate" and r.get("throughput_infer_per_s"):
                print(f"{r['api']}: batchgate {r['throughput_infer_per_s']:,.0f} rows/s in {args.batch}-row calls = "
                      f"{r['throughput_infer_per_s'] / ort:.2f} of ONNX Runtime alone in process "
                      f"({ort:,.0f} rows/s at batch {args.batch}, one thread, this run)")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0 if all(r["rc"] == 0 for r in results) else 1


def _print(r: dict) -> None:
    if "error" in r:
        print(f"{r['target']:<10} {r['api']:<7} perf_analyzer failed (rc {r['rc']}): {r['error']}")
        return
    cpu = (
        f"{r['server_cpu_us_per_request']:6.1f} µs/request (client {r['client_cpu_us_per_request']:.1f})"
        if "server_cpu_us_per_request" in r
        else "n/a"
    )
    print(
        f"{r['target']:<10} {r['api']:<7} {r['throughput_infer_per_s']:8.0f} infer/s  "
        f"p50 {r.get('p50_us', float('nan')) / 1e3:6.2f} ms  "
        f"p99 {r.get('p99_us', float('nan')) / 1e3:6.2f} ms  "
        f"server CPU {cpu}"
    )


if __name__ == "__main__":
    sys.exit(main())
