"""PNG plots of a bench run (matplotlib, Agg backend: no display needed).

* ``latency_vs_throughput``: p50 and p99 latency against achieved throughput, one line per
  series (e.g. unary and stream), each point labelled with its concurrency or offered rate.
* ``latency_distribution``: the empirical CDF of each point's latencies on a log axis.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # before pyplot: a headless CI machine has no display

import matplotlib.pyplot as plt
import numpy as np

from batchgate.bench.loadgen import Point


def _series(points: Sequence[Point]) -> dict[str, list[Point]]:
    out: dict[str, list[Point]] = {}
    for p in points:
        out.setdefault(f"{p.mode} {p.api}", []).append(p)
    return out


def _label(p: Point) -> str:
    return f"c={int(p.level)}" if p.mode == "closed" else f"{p.level:g}/s"


def latency_vs_throughput(
    points: Sequence[Point], path: Path, title: str = "", budget_ms: float | None = None
) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    for (name, pts), color in zip(_series(points).items(), plt.rcParams["axes.prop_cycle"].by_key()["color"]):
        pts = [p for p in pts if p.latencies_s.size]
        if not pts:
            continue
        x = [p.completed / p.duration_s for p in pts]
        p50 = [np.percentile(p.latencies_s, 50) * 1e3 for p in pts]
        p99 = [np.percentile(p.latencies_s, 99) * 1e3 for p in pts]
        ax.plot(x, p50, "o-", color=color, label=f"{name} p50")
        ax.plot(x, p99, "s--", color=color, alpha=0.7, label=f"{name} p99")
        for xi, yi, p in zip(x, p99, pts):
            ax.annotate(
                _label(p), (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=7, color=color
            )
    if budget_ms:
        ax.axhline(budget_ms, color="grey", linewidth=0.8, linestyle=":", label=f"budget {budget_ms:g} ms")
    ax.set_yscale("log")
    ax.set_xlabel("throughput (responses/s)")
    ax.set_ylabel("latency (ms)")
    ax.set_title(title or "latency vs throughput")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def latency_distribution(points: Sequence[Point], path: Path, title: str = "") -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    for p in points:
        if not p.latencies_s.size:
            continue
        lat = np.sort(p.latencies_s * 1e3)
        cdf = np.arange(1, lat.size + 1) / lat.size
        ax.plot(lat, cdf, label=f"{p.mode} {p.api} {_label(p)}")
    ax.set_xscale("log")
    ax.set_xlabel("latency (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.001)
    ax.set_title(title or "latency distribution (CDF)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
