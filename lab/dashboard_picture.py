"""A picture of the Helm chart's Grafana dashboard, drawn from a live server through Prometheus.

    python -m lab.dashboard_picture --out docs/dashboard.png [--seconds 60]

1. Serves the bundled ``ranker`` and ``encoder`` (both with their result cache on) on loopback.
2. Runs Prometheus (``--prometheus``, Debian's ``prometheus`` package) scraping ``/metrics`` every
   second. Relabelling adds ``namespace``, ``job`` and ``pod`` from ``__meta_kubernetes_*`` labels,
   as the chart's ServiceMonitor does on Kubernetes, so the dashboard's selectors match unchanged.
3. Drives a mixed gRPC workload (and a little REST): both models, several batch sizes and sequence
   lengths, the ``standard`` (default), ``realtime`` and ``bulk`` classes, repeated inputs (cache
   hits), unknown-model and malformed calls, then a short open-loop burst of tight calls past what
   the machine can take, so the overload gate has something to do.
4. Evaluates every query of the dashboard (its variables through the label-values API, as Grafana's
   ``label_values()`` does; every panel target through ``/api/v1/query_range``), with Grafana's
   macros substituted, and draws the panels where their ``gridPos`` puts them (matplotlib, not
   Grafana: no Grafana runs here).
5. Writes ``<out>.json`` beside the picture: per panel and target, the query as sent and the number
   of series and points it returned. Exits 1 when Prometheus refused any query (a defect of the
   dashboard), and prints the panels that returned no data.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import multiprocessing
import os
import platform
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from batchgate.bench.loadgen import ROOT, Started, free_ports, start_batchgate
from batchgate.proto.inference.v2 import grpc_service_pb2 as pb
from batchgate.proto.inference.v2 import grpc_service_pb2_grpc as pb_grpc

DASHBOARD = ROOT / "helm" / "batchgate" / "dashboards" / "batchgate.json"
PROMETHEUS = "/usr/bin/prometheus"
# What Kubernetes service discovery would put on the target; the chart's ServiceMonitor turns
# these into `namespace`, `job` (the metrics Service) and `pod`.
K8S = {
    "__meta_kubernetes_namespace": "serving",
    "__meta_kubernetes_service_name": "batchgate-metrics",
    "__meta_kubernetes_pod_name": "batchgate-local-0",
}
SCRAPE_S = 1
STEP_S = 2


# -- the server and Prometheus --------------------------------------------------------------------


def start_server(tmp: Path) -> Started:
    repo = tmp / "repo"
    for name in ("ranker", "encoder"):
        shutil.copytree(ROOT / "model_repository" / name, repo / name)
        with (repo / name / "config.pbtxt").open("a") as f:
            f.write("\nresponse_cache { enable: true }\n")
    server = start_batchgate("--model-repository", str(repo), "--no-build-models")
    server.ready(90)
    return server


def prometheus_config(target: str) -> str:
    relabel = "\n".join(
        f"      - source_labels: [{src}]\n        target_label: {dst}"
        for src, dst in (
            ("__meta_kubernetes_namespace", "namespace"),
            ("__meta_kubernetes_service_name", "job"),
            ("__meta_kubernetes_pod_name", "pod"),
        )
    )
    labels = "\n".join(f"          {k}: {v}" for k, v in K8S.items())
    return f"""global:
  scrape_interval: {SCRAPE_S}s
  scrape_timeout: {SCRAPE_S}s
scrape_configs:
  - job_name: static
    metrics_path: /metrics
    static_configs:
      - targets: ["{target}"]
        labels:
{labels}
    relabel_configs:
{relabel}
"""


class Prometheus:
    def __init__(self, exe: str, tmp: Path, target: str) -> None:
        (port,) = free_ports(1)
        self.url = f"http://127.0.0.1:{port}"
        cfg = tmp / "prometheus.yml"
        cfg.write_text(prometheus_config(target))
        self.log = (tmp / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [exe, f"--config.file={cfg}", f"--storage.tsdb.path={tmp / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout.split()[2]

    def get(self, path: str, **params) -> dict:
        url = f"{self.url}{path}?{urllib.parse.urlencode(params, doseq=True)}"
        try:
            with urllib.request.urlopen(url, timeout=30) as r:
                return json.load(r)
        except urllib.error.HTTPError as e:  # 400/422: Prometheus's error document; 503 while it starts
            body = e.read().decode(errors="replace")
            try:
                return json.loads(body)
            except ValueError:
                return {"status": "error", "error": f"HTTP {e.code}: {body.strip()[:200]}"}

    def wait_up(self, timeout_s: float = 30, scraped: bool = True) -> None:
        """Until Prometheus answers queries and (``scraped``) has scraped the server once."""
        query = f'up{{job="{K8S["__meta_kubernetes_service_name"]}"}} == 1' if scraped else "vector(1)"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}")
            try:
                if self.get("/api/v1/query", query=query).get("data", {}).get("result"):
                    return
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.3)
        raise RuntimeError("prometheus did not scrape the server in time")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# -- the workload -----------------------------------------------------------------------------------


def ranker_request(rows: int, seed: int, cls: str | None) -> pb.ModelInferRequest:
    rng = np.random.default_rng(seed)
    req = pb.ModelInferRequest(model_name="ranker")
    req.inputs.add(name="dense", datatype="FP32", shape=[rows, 64])
    req.inputs.add(name="sparse_ids", datatype="INT64", shape=[rows, 8])
    req.raw_input_contents.append(rng.standard_normal((rows, 64), dtype=np.float32).tobytes())
    req.raw_input_contents.append(rng.integers(0, 10_000, (rows, 8), dtype=np.int64).tobytes())
    if cls:
        req.parameters["latency_class"].string_param = cls
    return req


def encoder_request(rows: int, seq: int, seed: int, cls: str | None) -> pb.ModelInferRequest:
    rng = np.random.default_rng(seed)
    req = pb.ModelInferRequest(model_name="encoder")
    ids = rng.integers(1, 1000, (rows, seq), dtype=np.int64)
    mask = np.ones((rows, seq), np.int64)
    for r in range(rows):  # ragged texts, so batches carry padding
        mask[r, rng.integers(seq // 2, seq + 1) :] = 0
    req.inputs.add(name="input_ids", datatype="INT64", shape=[rows, seq])
    req.inputs.add(name="attention_mask", datatype="INT64", shape=[rows, seq])
    req.raw_input_contents.extend([ids.tobytes(), mask.tobytes()])
    if cls:
        req.parameters["latency_class"].string_param = cls
    return req


CLASSES = (None, None, "realtime", "bulk")  # None: the default class (standard)
# well formed, so the REST door answers it as an unknown model and not as a malformed body
UNKNOWN_BODY = json.dumps(
    {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]}
).encode()


@dataclass
class Tally:
    codes: dict[str, int] = field(default_factory=dict)

    def add(self, what: str) -> None:
        self.codes[what] = self.codes.get(what, 0) + 1


async def _call(stub, req, tally: Tally, timeout: float | None) -> None:
    try:
        await stub.ModelInfer(req, timeout=timeout)
        tally.add(f"{req.model_name} OK")
    except grpc.aio.AioRpcError as e:
        tally.add(f"{req.model_name} {e.code().name}")


async def _ranker_caller(stub, stop: float, rng: random.Random, tally: Tally) -> None:
    while time.monotonic() < stop:
        rows = rng.choice((1, 1, 4, 16, 64))
        # a pool of 12 inputs per size: about half the calls repeat one already answered
        seed = rng.randrange(12) if rng.random() < 0.5 else rng.randrange(10**9)
        await _call(stub, ranker_request(rows, seed * 100 + rows, rng.choice(CLASSES)), tally, 30)


async def _encoder_caller(stub, stop: float, rng: random.Random, tally: Tally) -> None:
    while time.monotonic() < stop:
        rows, seq = rng.choice(((1, 13), (2, 30), (4, 60), (8, 20), (1, 120), (4, 200)))
        seed = rng.randrange(8) if rng.random() < 0.3 else rng.randrange(10**9)
        await _call(stub, encoder_request(rows, seq, seed * 1000 + seq, rng.choice(CLASSES)), tally, 30)


async def _refusals(stub, http: str, stop: float, tally: Tally) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        n = 0
        while time.monotonic() < stop:
            n += 1
            await _call(stub, pb.ModelInferRequest(model_name="no-such-model"), tally, 5)
            if n % 2 == 0:
                await _call(stub, pb.ModelInferRequest(model_name="ranker"), tally, 5)  # no inputs
            if n % 3 == 0:  # the REST door: an unknown model and a body that is not JSON
                for path, body in (
                    ("/v2/models/no-such-model/infer", UNKNOWN_BODY),
                    ("/v2/models/ranker/infer", b"{"),
                ):
                    async with session.post(f"http://{http}{path}", data=body) as r:
                        tally.add(f"rest {r.status}")
            await asyncio.sleep(0.5)


async def _burst(url: str, seconds: float, rate: float) -> dict[str, int]:
    """Open loop: calls leave at ``rate`` whatever happens to earlier ones, each with a 100 ms
    gRPC deadline (the realtime class), so what the server cannot take is dropped or shed."""
    tally = Tally()
    # every input new: the result cache must not answer the burst
    reqs = [encoder_request(8, 64, 10**6 + s, "realtime") for s in range(int(seconds * rate))]
    tasks = []
    async with grpc.aio.insecure_channel(url) as ch:
        stub = pb_grpc.GRPCInferenceServiceStub(ch)
        t0 = time.monotonic()
        for i in range(int(seconds * rate)):
            delay = t0 + i / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_call(stub, reqs[i], tally, 0.1)))
        await asyncio.gather(*tasks)
    return tally.codes


def burst_process(url: str, delay: float, seconds: float, rate: float) -> dict[str, int]:
    # A process of its own: the closed-loop callers would otherwise hold the rate down.
    time.sleep(delay)
    return asyncio.run(_burst(url, seconds, rate))


async def workload(url: str, http: str, seconds: float, burst_s: float, burst_rate: float) -> Tally:
    tally = Tally()
    rng = random.Random(33)
    stop = time.monotonic() + seconds
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        # two thirds into the run, so the panels show before, during and after
        delay = max(0.0, seconds * 2 / 3 - burst_s / 2)
        burst = pool.submit(burst_process, url, delay, burst_s, burst_rate) if burst_s > 0 else None
        async with grpc.aio.insecure_channel(url) as ch:
            stub = pb_grpc.GRPCInferenceServiceStub(ch)
            jobs = [_ranker_caller(stub, stop, random.Random(rng.random()), tally) for _ in range(8)]
            jobs += [_encoder_caller(stub, stop, random.Random(rng.random()), tally) for _ in range(4)]
            jobs.append(_refusals(stub, http, stop, tally))
            await asyncio.gather(*jobs)
        if burst is not None:
            for what, n in (await asyncio.wrap_future(burst)).items():
                tally.codes[f"burst {what}"] = n
    return tally


# -- the queries --------------------------------------------------------------------------------------


def rate_interval(scrape_s: float, step_s: float) -> str:
    """Grafana's $__rate_interval: max($__interval + scrape interval, 4 × scrape interval), with
    the data source's scrape interval set to what this Prometheus scrapes at."""
    return f"{max(step_s + scrape_s, 4 * scrape_s):g}s"


def substitute(expr: str, variables: dict[str, str], interval: str) -> str:
    expr = re.sub(r"\$__rate_interval\b", interval, expr)
    expr = re.sub(r"\$__interval\b", f"{STEP_S}s", expr)
    for name, value in sorted(variables.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(f"${{{name}}}", value).replace(f"${name}", value)
    return expr


def label_values(prom: Prometheus, definition: str, variables: dict[str, str], start: float, end: float):
    """Grafana's label_values(selector, label) is the label-values API with a match[]."""
    m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", definition.strip())
    if not m:
        raise ValueError(f"unreadable variable query {definition!r}")
    selector = substitute(m.group(1), variables, "")
    res = prom.get(f"/api/v1/label/{m.group(2)}/values", **{"match[]": selector, "start": start, "end": end})
    return selector, res


def legend(fmt: str, labels: dict[str, str]) -> str:
    if not fmt:
        return "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt).strip()


def evaluate(prom: Prometheus, dash: dict, start: float, end: float) -> dict:
    interval = rate_interval(SCRAPE_S, STEP_S)
    variables: dict[str, str] = {}
    report_vars = []
    for var in dash["templating"]["list"]:
        if var["type"] != "query":
            continue
        selector, res = label_values(prom, var["definition"], variables, start, end)
        values = res.get("data") or []
        if var.get("includeAll"):
            chosen = var.get("allValue", ".*")  # All, as the dashboard opens
        else:
            chosen = values[0] if values else ""
        variables[var["name"]] = chosen
        report_vars.append(
            {"name": var["name"], "match": selector, "status": res["status"], "error": res.get("error"),
             "values": values, "chosen": chosen}
        )  # fmt: skip
    panels = []
    for p in dash["panels"]:
        entry = {
            "id": p["id"],
            "title": p["title"],
            "type": p["type"],
            "gridPos": p["gridPos"],
            "targets": [],
        }
        for t in p.get("targets", []):
            query = substitute(t["expr"], variables, interval)
            res = prom.get("/api/v1/query_range", query=query, start=start, end=end, step=STEP_S)
            result = res.get("data", {}).get("result", []) if res["status"] == "success" else []
            entry["targets"].append(
                {
                    "refId": t["refId"], "expr": t["expr"], "query": query, "legendFormat": t.get("legendFormat", ""),
                    "status": res["status"], "error": res.get("error"), "series": len(result),
                    "points": sum(len(s["values"]) for s in result),
                    "data": [
                        {"legend": legend(t.get("legendFormat", ""), s["metric"]),
                         "values": [[float(ts), float(v)] for ts, v in s["values"]]}
                        for s in result
                    ],
                }
            )  # fmt: skip
        panels.append(entry)
    return {"rate_interval": interval, "step_s": STEP_S, "variables": report_vars, "panels": panels}


# -- the drawing ----------------------------------------------------------------------------------------


def fmt_value(v: float, unit: str | None) -> str:
    if not math.isfinite(v):
        return str(v)
    if unit == "percentunit":
        return f"{v * 100:.3g}%"
    if unit == "s":
        if v == 0:
            return "0 s"
        return f"{v * 1e3:.3g} ms" if abs(v) < 1 else f"{v:.3g} s"
    if unit == "bytes":
        for scale, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
            if abs(v) >= scale:
                return f"{v / scale:.3g} {name}"
        return f"{v:.0f} B"
    short = f"{v:.3g}" if abs(v) < 1000 else f"{v / 1000:.3g} K"
    return f"{short} req/s" if unit == "reqps" else short


def draw(report: dict, out: Path, heading: str, start: float, end: float, dpi: int) -> None:
    import matplotlib

    matplotlib.use("Agg")  # before pyplot: no display here
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    dash = json.loads(DASHBOARD.read_text())
    by_id = {p["id"]: p for p in dash["panels"]}
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in dash["panels"])
    width, height = 24.0, 30.0
    top_in = 0.75 + 0.27 * (len(heading) - 1)  # the heading
    unit_h = (height - top_in - 0.1) / rows  # inches per grid row
    fig = plt.figure(figsize=(width, height), dpi=dpi)
    fig.text(0.006, 1 - 0.25 / height, heading[0], fontsize=19, weight="bold", va="top")
    for i, line in enumerate(heading[1:]):
        fig.text(0.006, 1 - (0.68 + 0.27 * i) / height, line, fontsize=13, va="top", color="#333")

    def box(g: dict, below_in: float, left_in: float) -> tuple[float, float, float, float]:
        """The axes of a panel in figure fractions: its grid cell less a gap, the title above
        and ``below_in`` (time axis and legend) and ``left_in`` (value axis) inside."""
        gap = 0.12
        left = g["x"] * width / 24 + gap + left_in
        right = (g["x"] + g["w"]) * width / 24 - gap
        top = top_in + g["y"] * unit_h + 0.32
        bottom = top_in + (g["y"] + g["h"]) * unit_h - gap - below_in
        return left / width, 1 - bottom / height, (right - left) / width, (bottom - top) / height

    def frame(g: dict) -> None:
        # the panel's outline, as Grafana draws one around each panel
        gap = 0.06
        x0, x1 = g["x"] * width / 24 + gap, (g["x"] + g["w"]) * width / 24 - gap
        y0, y1 = top_in + g["y"] * unit_h + gap, top_in + (g["y"] + g["h"]) * unit_h - gap
        fig.add_artist(
            plt.Rectangle((x0 / width, 1 - y1 / height), (x1 - x0) / width, (y1 - y0) / height,
                          fill=False, ec="#c8c8c8", lw=0.8)
        )  # fmt: skip

    t0 = dt.datetime.fromtimestamp(start, dt.UTC)
    t1 = dt.datetime.fromtimestamp(end, dt.UTC)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for entry in report["panels"]:
        p, g = by_id[entry["id"]], entry["gridPos"]
        if p["type"] == "row":
            y = 1 - (top_in + (g["y"] + 0.8) * unit_h) / height
            fig.text(0.006, y, p["title"], fontsize=15, weight="bold", va="bottom")
            fig.add_artist(plt.Line2D([0.006, 0.994], [y - 0.002, y - 0.002], color="#888", lw=0.8))
            continue
        frame(g)
        unit = p.get("fieldConfig", {}).get("defaults", {}).get("unit")
        series = [s for t in entry["targets"] for s in t["data"]]
        errors = [t["error"] for t in entry["targets"] if t["status"] != "success"]
        ncol = max(1, min(len(series), g["w"] // 2))
        legend_in = 0.05 + 0.22 * math.ceil(len(series) / ncol) if p["type"] == "timeseries" else 0.0
        plotted = p["type"] == "timeseries" and series and not errors
        ax = fig.add_axes(box(g, 0.3 + legend_in if plotted else 0.0, 0.75 if plotted else 0.0))
        fig.text(box(g, 0, 0)[0] + 0.002, 1 - (top_in + g["y"] * unit_h + 0.12) / height, p["title"],
                 fontsize=12, weight="bold", va="top")  # fmt: skip
        if errors or not series:
            ax.set_axis_off()
            msg = "query error: " + errors[0] if errors else "No data"
            ax.text(0.5, 0.5, msg, ha="center", va="center", fontsize=13, color="#a00" if errors else "#777",
                    transform=ax.transAxes, wrap=True)  # fmt: skip
            continue
        if p["type"] == "stat":
            s = series[0]
            ts = [dt.datetime.fromtimestamp(t, dt.UTC) for t, _ in s["values"]]
            vs = [v for _, v in s["values"]]
            last = next((v for v in reversed(vs) if math.isfinite(v)), float("nan"))
            ax.set_axis_off()
            ax.fill_between(ts, vs, color="#73bf69", alpha=0.25, lw=0)  # graphMode: area
            ax.set_xlim(t0, t1)
            ax.set_ylim(bottom=min(0.0, min(vs)), top=max(max(vs), 1e-12) * 1.6)
            ax.text(0.5, 0.5, fmt_value(last, unit), ha="center", va="center", fontsize=34, weight="bold",
                    color="#37872d", transform=ax.transAxes)  # fmt: skip
            ax.text(0.98, 0.06, s["legend"], ha="right", fontsize=10, color="#555", transform=ax.transAxes)
            continue
        for i, s in enumerate(series):
            ts = [dt.datetime.fromtimestamp(t, dt.UTC) for t, _ in s["values"]]
            vs = [v if math.isfinite(v) else np.nan for _, v in s["values"]]
            ax.plot(ts, vs, lw=1.5, color=colors[i % len(colors)], label=s["legend"])
        ax.set_xlim(t0, t1)
        ax.set_ylim(bottom=0)
        ax.xaxis.set_major_locator(mdates.AutoDateLocator(minticks=3, maxticks=7))
        ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S", tz=dt.UTC))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos, unit=unit: fmt_value(v, unit)))
        ax.yaxis.set_major_locator(plt.MaxNLocator(5))
        ax.tick_params(labelsize=9.5)
        ax.grid(alpha=0.3)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
        # below the plot, as Grafana's legend placement "bottom"
        ax.legend(fontsize=9.5, loc="upper left", bbox_to_anchor=(-0.01, -0.3 / (ax.get_position().height * height)),
                  ncol=ncol, frameon=False, handlelength=1.5, columnspacing=1.2, borderaxespad=0)  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    from PIL import Image

    # 256 colours are plenty for lines on white, and a third of the bytes in the repository
    with Image.open(out) as img:
        small = img.convert("RGB").quantize(256, method=Image.Quantize.MEDIANCUT)
    small.save(out, optimize=True)


# -- main --------------------------------------------------------------------------------------------------


def collect(args: argparse.Namespace) -> dict:
    """Serve, scrape, load, query: everything the picture and its JSON are drawn from."""
    dash = json.loads(DASHBOARD.read_text())
    machine = args.machine or f"{os.cpu_count()}-core {platform.machine()} {platform.system()}, CPU only"
    with tempfile.TemporaryDirectory(prefix="dashboard-") as tmp_name:
        tmp = Path(tmp_name)
        server = start_server(tmp)
        prom = None
        try:
            prom = Prometheus(args.prometheus, tmp, server.http_url)
            prom.wait_up()
            start = time.time() - 2
            tally = asyncio.run(
                workload(server.url, server.http_url, args.seconds, args.burst_seconds, args.burst_rate)
            )
            # the range ends with the workload (a stat's last value is then the load's, not the
            # idle after it); the wait lets the last scrapes land before the queries
            end = time.time()
            time.sleep(3 * SCRAPE_S)
            report = evaluate(prom, dash, start, end)
        finally:
            if prom is not None:
                prom.stop()
            server.stop()
    stamp = dt.datetime.fromtimestamp(end, dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    heading = [
        f"batchgate dashboard — queries evaluated by Prometheus {prom.version} over a live server, "
        "drawn by lab/dashboard_picture.py (not Grafana)",
        f"{stamp} · {machine} · {args.seconds:g} s mixed gRPC workload: ranker and encoder, several sizes, classes "
        f"standard / realtime / bulk, repeated inputs (cache hits),",
        f"unknown-model and malformed calls (also REST), and a {args.burst_seconds:g} s open-loop burst of "
        f"realtime encoder calls with a 100 ms deadline at {args.burst_rate:g}/s, past what the machine can take",
        f"helm/batchgate/dashboards/batchgate.json, every target as it is but for Grafana's variables: "
        f"namespace = {K8S['__meta_kubernetes_namespace']}, job = {K8S['__meta_kubernetes_service_name']}, "
        f"model = All (.*), $__rate_interval = {report['rate_interval']} (scrape {SCRAPE_S} s, step {STEP_S} s); "
        "times UTC",
    ]
    return {
        "heading": heading, "prometheus": prom.version, "start": start, "end": end,
        "client_tally": dict(sorted(tally.codes.items())), **report,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "dashboard.png")
    ap.add_argument("--seconds", type=float, default=60.0, help="how long the workload runs")
    ap.add_argument("--burst-seconds", type=float, default=6.0, help="the overload burst (0: none)")
    ap.add_argument("--burst-rate", type=float, default=400.0, help="calls/s of the burst")
    ap.add_argument("--prometheus", default=PROMETHEUS)
    ap.add_argument("--dpi", type=int, default=100)
    ap.add_argument("--machine", default="", help="how the picture names the machine (default: cores and OS)")
    ap.add_argument("--data", type=Path, help="also keep every series returned here (JSON), for --redraw")
    ap.add_argument("--redraw", type=Path, help="draw from a --data file instead of running anything")
    args = ap.parse_args(argv)
    if args.redraw:
        full = json.loads(args.redraw.read_text())
    else:
        if not Path(args.prometheus).exists():
            print(f"no Prometheus at {args.prometheus} (apt-get install prometheus)", file=sys.stderr)
            return 2
        full = collect(args)
        if args.data:
            args.data.write_text(json.dumps(full) + "\n")
    draw(full, args.out, full["heading"], full["start"], full["end"], args.dpi)
    # the JSON says what each query returned; the series themselves are in the picture
    summary = {
        **{k: v for k, v in full.items() if k != "panels"},
        "panels": [
            {**{k: v for k, v in pnl.items() if k != "targets"},
             "targets": [{k: v for k, v in t.items() if k != "data"} for t in pnl["targets"]]}
            for pnl in full["panels"] if pnl["type"] != "row"
        ],
    }  # fmt: skip
    side = args.out.with_suffix(".json")
    side.write_text(json.dumps(summary, indent=1) + "\n")
    failed = [
        (p["title"], t["refId"], t["error"]) for p in summary["panels"] for t in p["targets"] if t["error"]
    ]
    failed += [
        (f"variable {v['name']}", "", v["error"]) for v in summary["variables"] if v["status"] != "success"
    ]
    empty = [p["title"] for p in summary["panels"] if not any(t["series"] for t in p["targets"])]
    partly = [
        f"{p['title']} ({t['refId']})"
        for p in summary["panels"]
        if p["title"] not in empty
        for t in p["targets"]
        if not t["series"]
    ]
    n = len(summary["panels"])
    print(f"{args.out} and {side}: {n - len(empty)} of {n} panels with data")
    print(f"client: {summary['client_tally']}")
    if empty:
        print("no data: " + "; ".join(empty))
    if partly:
        print("targets with no data: " + "; ".join(partly))
    for title, ref, err in failed:
        print(f"QUERY ERROR {title} {ref}: {err}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
