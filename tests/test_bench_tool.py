"""The bench tool against the live server: short closed, open and streamed runs write their JSON,
CSV and PNG outputs, and the `batchgate bench` subcommand reaches the same tool."""

from __future__ import annotations

import asyncio
import csv
import importlib
import json

import pytest

from batchgate.bench.__main__ import main as bench_main
from batchgate.bench.loadgen import ROOT, Workload, run_point

SHORT = ["--duration", "0.6", "--warmup", "0.2", "--channels", "2", "--no-progress"]
PNG = b"\x89PNG\r\n\x1a\n"


def test_closed_loop_sweep_writes_json_csv_and_plots(server, tmp_path, capsys):
    rc = bench_main(
        ["--url", server.grpc_url, "--mode", "closed", "--api", "unary", "--concurrency", "1,4", *SHORT,
         "--json", str(tmp_path / "r.json"), "--csv", str(tmp_path / "r.csv"), "--plot-dir", str(tmp_path)]
    )  # fmt: skip
    assert rc == 0
    doc = json.loads((tmp_path / "r.json").read_text())
    points = doc["points"]
    assert [(p["api"], p["concurrency"]) for p in points] == [("unary", 1), ("unary", 4)]
    for p in points:
        assert p["errors"] == 0 and p["ok"] > 0 and p["throughput_rps"] > 0
        assert p["p50_ms"] <= p["p90_ms"] <= p["p99_ms"] <= p["p99_9_ms"] <= p["max_ms"]
        assert 0 < p["goodput_rps"] <= p["throughput_rps"]
        assert p["server_rows_per_batch"] >= 1  # batching figures from ModelStatistics
    with (tmp_path / "r.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 and float(rows[0]["throughput_rps"]) > 0
    for name in ("ranker-latency-throughput.png", "ranker-latency-cdf.png"):
        data = (tmp_path / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 5000
    out = capsys.readouterr().out
    assert "p99.9 ms" in out and "c=4" in out


def test_open_loop_stream_on_the_encoder(server, tmp_path):
    rc = bench_main(
        ["--url", server.grpc_url, "--model", "encoder", "--rows", "2", "--seq", "16", "--mode", "open",
         "--api", "stream", "--rate", "60", *SHORT, "--json", str(tmp_path / "o.json")]
    )  # fmt: skip
    assert rc == 0
    (p,) = json.loads((tmp_path / "o.json").read_text())["points"]
    assert p["mode"] == "open" and p["offered_rps"] == 60 and p["rows_per_request"] == 2
    assert p["errors"] == 0 and p["ok"] >= 10  # ~36 expected in 0.6 s; Poisson and a busy machine


class _UnknownModel(Workload):
    def requests(self, seed: int = 0):
        reqs = super().requests(seed)
        for r in reqs:
            r.model_name = "no-such-model"
        return reqs


def test_refusals_are_counted_by_code_not_raised(server):
    point = asyncio.run(
        run_point(
            server.grpc_url, _UnknownModel(), "closed", "unary", 2, duration_s=0.3, warmup_s=0.0, channels=1
        )
    )
    assert point.completed == 0 and set(point.errors) == {"NOT_FOUND"} and point.errors["NOT_FOUND"] > 0
    s = point.summary(budget_ms=10)
    assert s["ok"] == 0 and s["error_codes"].startswith("NOT_FOUND=")


def test_batchgate_bench_subcommand(server, tmp_path):
    from batchgate.gateway.cli import main as cli_main

    rc = cli_main(
        ["bench", "--url", server.grpc_url, "--mode", "closed", "--api", "stream", "--concurrency", "4", *SHORT,
         "--csv", str(tmp_path / "c.csv")]
    )  # fmt: skip
    assert rc == 0
    with (tmp_path / "c.csv").open() as f:
        (row,) = list(csv.DictReader(f))
    assert row["api"] == "stream" and row["errors"] == "0" and int(row["ok"]) > 0
    with pytest.raises(SystemExit) as exc:
        cli_main(["bench", "--help"])
    assert exc.value.code == 0


@pytest.mark.parametrize(
    "module",
    [
        f"batchgate.bench.{p.stem}"
        for p in sorted((ROOT / "bench").glob("*.py"))
        if p.stem not in ("__init__", "__main__")
    ]
    + [f"lab.{p.stem}" for p in sorted((ROOT / "lab").glob("*.py")) if p.stem != "__init__"],
)
def test_every_benchmark_module_imports(module):
    # The benchmarks run outside the test suite (and on a GPU machine); an import that broke in a
    # refactor would only show there. Importing runs nothing: each keeps its work under main().
    importlib.import_module(module)


def test_text_workload_on_every_endpoint(server, tmp_path):
    """minilm's shipped texts over gRPC unary/stream, KServe REST and /v1/embeddings, 1 and 3 texts
    a request, in one run; every request answered 200/OK and counted as its texts."""
    from batchgate.bench.texts import TEXTS

    words = sorted(len(t.split()) for t in TEXTS)
    assert len(TEXTS) == 512 and words[0] <= 14 and words[-1] >= 120  # mixed lengths, as shipped
    rc = bench_main(
        ["--url", server.grpc_url, "--http-url", f"127.0.0.1:{server.http_port}", "--model", "minilm",
         "--api", "unary,stream,rest,openai", "--rows", "1,3", "--concurrency", "2", "--latency-class", "bulk",
         "--duration", "0.8", "--warmup", "0.2", "--channels", "2", "--no-progress",
         "--timeout-s", "30", "--json", str(tmp_path / "t.json")]
    )  # fmt: skip
    assert rc == 0
    points = json.loads((tmp_path / "t.json").read_text())["points"]
    assert [(p["api"], p["rows_per_request"]) for p in points] == [
        (api, rows) for rows in (1, 3) for api in ("unary", "stream", "rest", "openai")
    ]
    for p in points:
        assert p["errors"] == 0 and p["ok"] > 0, p
        assert p["rows_per_s"] == pytest.approx(p["throughput_rps"] * p["rows_per_request"])


def test_text_workload_requests_carry_the_same_texts_on_every_api():
    w = Workload("minilm", rows=3)
    grpc_req = w.requests()[5]
    (path, body), (opath, obody) = w.http_requests("rest")[5], w.http_requests("openai")[5]
    texts = json.loads(obody)["input"]
    assert opath == "/v1/embeddings" and len(texts) == 3 and json.loads(obody)["encoding_format"] == "base64"
    (inp,) = json.loads(body)["inputs"]
    assert path == "/v2/models/minilm/infer" and inp["data"] == texts and inp["shape"] == [3, 1]
    assert list(grpc_req.inputs[0].shape) == [3, 1] and texts[0].encode() in grpc_req.raw_input_contents[0]
    with pytest.raises(ValueError, match="text workload only"):
        Workload("ranker").http_requests("openai")
