"""The quick benchmark CI runs after the tests (well under a minute).

batchgate's request rate on ``ranker`` with single-row requests, unary (``ModelInfer``) and
streamed (``ModelStreamInfer``), each as a ratio to the no-op grpc.aio server (bench/noop_server.py)
answering the same API, measured in the same run with the same client. It is printed; the run
fails only on a collapse (a ratio below ``--min-ratio``, default 0.3), so a regression cannot land
unseen while the noise of a shared CI machine does not fail builds. The pairs are measured in
``--rounds`` alternating rounds and the best round's ratio is the one judged: a real collapse shows
in every round, a burst of someone else's load on a shared machine seldom does.

    .venv/bin/python -m batchgate.bench.quick [--concurrency 32] [--seconds 1.5] [--rounds 2]
        [--min-ratio 0.3] [--apis unary,stream] [--serve "--api-keys-file t.yaml ..."] [--api-key KEY]

``--serve`` passes flags to the batchgate server, ``--api-key`` sends a key with every call (a
server with a tenant file): e.g. the cost of usage metering, alternated with ``--no-usage-metering``.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys

from batchgate.bench.loadgen import (
    Workload,
    batching,
    model_statistics,
    run_point,
    start_batchgate,
    start_noop,
)


def verdict(ratios: dict[str, float], min_ratio: float) -> tuple[bool, str]:
    """ok unless some API's ratio collapsed below ``min_ratio``."""
    low = [api for api, r in ratios.items() if not r >= min_ratio]  # `not >=` also catches NaN
    return (not low, "ok" if not low else f"COLLAPSE ({', '.join(low)} below {min_ratio})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=1.5, help="measured seconds per target, API and round")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds; the best ratio is judged")
    ap.add_argument("--warmup", type=float, default=0.5)
    ap.add_argument("--apis", default="unary,stream", help="unary, stream or both (comma-separated)")
    ap.add_argument(
        "--min-ratio", type=float, default=0.3, help="fail below this batchgate/noop request rate"
    )
    ap.add_argument("--serve", default="", help="flags for the batchgate server, as one string")
    ap.add_argument("--api-key", default="", help="sent to batchgate as 'authorization: Bearer KEY'")
    args = ap.parse_args(argv)
    apis = args.apis.split(",")
    if not set(apis) <= {"unary", "stream"}:
        ap.error("--apis takes unary and/or stream")

    servers = [start_noop(), start_batchgate(*shlex.split(args.serve))]
    key = (("authorization", f"Bearer {args.api_key}"),) if args.api_key else ()
    workload = Workload("ranker", rows=1)
    rounds: list[dict[tuple[str, str], dict]] = []
    try:
        for s in servers:
            s.ready()
        for _ in range(max(args.rounds, 1)):
            results: dict[tuple[str, str], dict] = {}
            for api in apis:
                for srv in servers:
                    stats = srv.name == "batchgate"
                    before = asyncio.run(model_statistics(srv.url, "ranker")) if stats else None
                    point = asyncio.run(
                        run_point(
                            srv.url,
                            workload,
                            "closed",
                            api,
                            args.concurrency,
                            args.seconds,
                            args.warmup,
                            metadata=key if stats else (),
                        )  # fmt: skip
                    )
                    if before is not None:
                        point.server = batching(before, asyncio.run(model_statistics(srv.url, "ranker")))
                    results[(srv.name, api)] = point.summary(budget_ms=50.0)
            rounds.append(results)
    finally:
        for s in servers:
            s.stop()
    per_round = [
        {
            api: res[("batchgate", api)]["throughput_rps"] / max(res[("noop", api)]["throughput_rps"], 1e-9)
            for api in apis
        }
        for res in rounds
    ]
    # The best round per API is the one judged and shown.
    best = {api: max(range(len(rounds)), key=lambda i, a=api: per_round[i][a]) for api in apis}
    ratios = {api: per_round[best[api]][api] for api in apis}
    for api in apis:
        for name in ("noop", "batchgate"):
            r = rounds[best[api]][(name, api)]
            extra = f", {r['server_rows_per_batch']} rows/batch" if "server_rows_per_batch" in r else ""
            print(
                f"quick bench {name:>9} {api:<6}: {r['throughput_rps']:7.0f} req/s, "
                f"p50 {r['p50_ms']:6.2f} ms, "
                f"p99 {r['p99_ms']:6.2f} ms, {r['errors']} errors{extra}"
            )
    if len(rounds) > 1:
        print("quick bench: ratio per round: " + "; ".join(
            ", ".join(f"{api} {r[api]:.2f}" for api in apis) for r in per_round))  # fmt: skip
    results = rounds[-1]
    ok, text = verdict(ratios, args.min_ratio)
    shown = ", ".join(f"{api} {r:.2f}" for api, r in ratios.items())
    print(
        f"quick bench: batchgate/noop request rate = {shown} (ranker, 1 row, {args.concurrency} callers, "
        f"{args.seconds:g}s each, best of {len(rounds)}; shared machine, noisy) -> {text}"
    )
    for api in apis:
        if results[("batchgate", api)]["errors"]:
            print(
                f"quick bench: batchgate {api} answered {results[('batchgate', api)]['error_codes']}",
                file=sys.stderr,
            )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
