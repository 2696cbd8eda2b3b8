"""``python -m batchgate.bench`` (or ``batchgate bench``): load a KServe v2 gRPC server and report latency,
throughput and goodput, as a table, JSON, CSV and PNG plots.

    # a sweep over concurrency, unary and streamed, against a server started for the run
    python -m batchgate.bench --start-server --model ranker --mode closed --api unary,stream \\
        --concurrency 1,4,16,64 --duration 5 --json out/ranker.json --csv out/ranker.csv --plot-dir out

    # open loop (Poisson arrivals) at fixed rates against a running server
    python -m batchgate.bench --url 127.0.0.1:8001 --mode open --rate 200,500,1000 --budget-ms 25

    # the text workload (minilm, shipped texts of mixed length) on every endpoint, 1 and 32 texts a request
    python -m batchgate.bench --start-server --model minilm --api unary,stream,rest,openai --rows 1,32 \
        --concurrency 16 --duration 10
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import math
import sys
from pathlib import Path

from batchgate.bench.loadgen import (
    APIS,
    Point,
    Progress,
    Workload,
    batching,
    model_statistics,
    run_point,
    start_batchgate,
)


def _floats(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas, got '{text}'") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError("every value must be > 0")
    return values


def _apis(text: str) -> list[str]:
    apis = [a.strip() for a in text.split(",") if a.strip()]
    if not apis or any(a not in APIS for a in apis):
        raise argparse.ArgumentTypeError(f"api is one or more of {','.join(APIS)}, separated by commas")
    return apis


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got '{text}'") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("every value must be >= 1")
    return values


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="batchgate bench", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="The machine running the client also runs the server in most setups: figures are noisy on a small "
        "machine; compare points measured in one run.",
    )  # fmt: skip
    target = p.add_mutually_exclusive_group()
    target.add_argument(
        "--url", default="127.0.0.1:8001", help="gRPC address of the server (default %(default)s)"
    )
    target.add_argument(
        "--start-server", action="store_true", help="start a batchgate server for this run, stop it after"
    )
    p.add_argument(
        "--http-url", default="127.0.0.1:8000",
        help="REST address for --api rest/openai (default %(default)s; with --start-server, the server's)",
    )  # fmt: skip
    p.add_argument(
        "--model", default="ranker", choices=["ranker", "encoder", "minilm"],
        help="workload (default %(default)s); minilm: the shipped texts (bench/texts.py), mixed lengths",
    )  # fmt: skip
    p.add_argument(
        "--rows", type=_ints, default=[1], help="rows (texts) per request, a sweep such as 1,32 (default 1)"
    )
    p.add_argument(
        "--latency-class", help="latency class every request asks for (default: the server's default class)"
    )
    p.add_argument(
        "--openai-format", choices=["base64", "float"], default="base64",
        help="encoding_format the openai api asks for (default %(default)s, the openai SDK's)",
    )  # fmt: skip
    p.add_argument("--seq", type=int, default=32, help="encoder sequence length (default %(default)s)")
    p.add_argument(
        "--mode",
        choices=["closed", "open"],
        default="closed",
        help="closed: fixed concurrency; open: Poisson rate",
    )
    p.add_argument(
        "--api", type=_apis, default=["unary"],
        help="unary, stream (gRPC), rest (KServe v2 JSON), openai (/v1/embeddings); e.g. unary,openai",
    )  # fmt: skip
    p.add_argument(
        "--concurrency", type=_floats, default=[1, 4, 16, 64], help="closed loop sweep, e.g. 1,4,16,64"
    )
    p.add_argument(
        "--rate", type=_floats, default=[100, 300, 1000], help="open loop sweep in requests/s, e.g. 200,500"
    )
    p.add_argument(
        "--duration", type=float, default=5.0, help="measured seconds per point (default %(default)s)"
    )
    p.add_argument(
        "--warmup", type=float, default=1.0, help="unrecorded seconds before each point (default %(default)s)"
    )
    p.add_argument(
        "--channels",
        type=int,
        default=4,
        help="gRPC connections (streams, for --api stream) (default %(default)s)",
    )
    p.add_argument(
        "--budget-ms",
        type=float,
        default=50.0,
        help="goodput counts answers within this (default %(default)s)",
    )
    p.add_argument(
        "--timeout-s", type=float, default=10.0, help="per-request client timeout (default %(default)s)"
    )
    p.add_argument("--max-outstanding", type=int, default=4096, help="open loop: cap on requests in flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write the summaries as JSON here")
    p.add_argument("--csv", type=Path, help="write the summaries as CSV here")
    p.add_argument("--plot-dir", type=Path, help="write PNG plots here (latency vs throughput, latency CDF)")
    p.add_argument(
        "--plot-prefix", default="", help="file name prefix for the plots (default: the model name)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    return p


def run(args: argparse.Namespace, url: str, http_url: str | None = None) -> list[Point]:
    progress = Progress(enabled=not args.no_progress)
    levels = args.concurrency if args.mode == "closed" else args.rate
    points = []
    for rows in args.rows:
        workload = Workload(
            args.model, rows, args.seq, openai_format=args.openai_format, latency_class=args.latency_class
        )
        for api in args.api:
            for level in levels:
                before = asyncio.run(model_statistics(url, args.model))
                point = asyncio.run(
                    run_point(
                        url, workload, args.mode, api, level, args.duration, args.warmup, args.channels,
                        args.timeout_s, args.max_outstanding, progress, args.seed, http_url or args.http_url,
                    )
                )  # fmt: skip
                point.server = batching(before, asyncio.run(model_statistics(url, args.model)))
                s = point.summary(args.budget_ms)
                progress.finish(
                    f"{args.mode} {api} rows={rows} "
                    f"{'c=' + str(int(level)) if args.mode == 'closed' else f'{level:g}/s'}",
                    f"{s['throughput_rps']:.0f} ok/s, {s['rows_per_s']:.0f} rows/s, "
                    f"p50 {s['p50_ms']:.2f} ms, p99 {s['p99_ms']:.2f} ms, {s['errors']} errors",
                )
                points.append(point)
    return points


def table(summaries: list[dict]) -> str:
    cols = [
        ("api", "{}", 6), ("rows", "{}", 4), ("level", "{}", 9), ("ok/s", "{:.0f}", 8), ("rows/s", "{:.0f}", 8), ("good/s", "{:.0f}", 8),
        ("p50 ms", "{:.2f}", 8), ("p90 ms", "{:.2f}", 8), ("p99 ms", "{:.2f}", 8), ("p99.9 ms", "{:.2f}", 9),
        ("errors", "{}", 6), ("rows/batch", "{}", 10),
    ]  # fmt: skip
    lines = ["  ".join(f"{name:>{w}}" for name, _, w in cols)]
    for s in summaries:
        level = f"c={s['concurrency']}" if s["mode"] == "closed" else f"{s['offered_rps']:g}/s"
        values = [
            s["api"], s["rows_per_request"], level, s["throughput_rps"], s["rows_per_s"], s["goodput_rps"], s["p50_ms"], s["p90_ms"],
            s["p99_ms"], s["p99_9_ms"], s["errors"], s.get("server_rows_per_batch", "-"),
        ]  # fmt: skip
        cells = []
        for (_, fmt, w), v in zip(cols, values):
            text = "nan" if isinstance(v, float) and math.isnan(v) else fmt.format(v)
            cells.append(f"{text:>{w}}")
        lines.append("  ".join(cells))
    return "\n".join(lines)


def write_outputs(args: argparse.Namespace, points: list[Point], summaries: list[dict]) -> None:
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        args.json.write_text(json.dumps({"config": config, "points": summaries}, indent=2) + "\n")
    if args.csv:
        args.csv.parent.mkdir(parents=True, exist_ok=True)
        keys = list(dict.fromkeys(k for s in summaries for k in s))
        with args.csv.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(summaries)
    if args.plot_dir:
        from batchgate.bench import plots  # matplotlib only when plots are asked for

        args.plot_dir.mkdir(parents=True, exist_ok=True)
        prefix = args.plot_prefix or args.model
        what = f"{args.model}, {','.join(map(str, args.rows))} row(s)/request, {args.mode} loop"
        plots.latency_vs_throughput(
            points,
            args.plot_dir / f"{prefix}-latency-throughput.png",
            f"{what}: latency vs throughput",
            args.budget_ms,
        )
        plots.latency_distribution(
            points, args.plot_dir / f"{prefix}-latency-cdf.png", f"{what}: latency distribution"
        )


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.seq < 1 or args.duration <= 0 or args.warmup < 0 or args.channels < 1:
        print("bench: --seq, --duration and --channels must be >= 1 (warmup >= 0)", file=sys.stderr)
        return 2
    if "openai" in args.api and args.model != "minilm":
        print("bench: --api openai takes the text workload only (--model minilm)", file=sys.stderr)
        return 2
    started = None
    url, http_url = args.url, args.http_url
    try:
        if args.start_server:
            started = start_batchgate()
            started.ready()
            url, http_url = started.url, started.http_url
        points = run(args, url, http_url)
    finally:
        if started is not None:
            started.stop()
    summaries = [p.summary(args.budget_ms) for p in points]
    print(table(summaries))
    write_outputs(args, points, summaries)
    return 0


if __name__ == "__main__":
    sys.exit(main())
