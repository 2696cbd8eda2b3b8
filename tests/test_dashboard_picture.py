"""lab/dashboard_picture.py: every query of the Helm chart's dashboard, run by a real Prometheus
over a live server, returns without error, and the panels the workload reaches have data."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from lab import dashboard_picture as dp

# Timing decides whether a short run has a late, shed or expired call; an empty answer is the
# query's right answer then.
MAY_BE_EMPTY = {"Deadline misses by class"}


def test_rate_interval_follows_grafana():
    # max($__interval + scrape interval, 4 × scrape interval)
    assert dp.rate_interval(1, 2) == "4s"
    assert dp.rate_interval(15, 30) == "60s"
    assert dp.rate_interval(15, 60) == "75s"


def test_every_query_is_left_without_a_grafana_variable():
    dash = json.loads(dp.DASHBOARD.read_text())
    variables = {"namespace": "serving", "job": "batchgate-metrics", "model": ".*"}
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 25
    for expr in exprs:
        query = dp.substitute(expr, variables, "4s")
        assert "$" not in query, query
        assert set(re.findall(r"\[([^\]]*)\]", query)) <= {"4s"}, query


@pytest.mark.skipif(
    not Path(dp.PROMETHEUS).exists(), reason="no /usr/bin/prometheus (apt-get install prometheus)"
)
def test_every_panel_query_runs_in_prometheus(tmp_path):
    out = tmp_path / "dashboard.png"
    rc = dp.main(
        ["--out", str(out), "--seconds", "8", "--burst-seconds", "2", "--burst-rate", "300", "--dpi", "40"]
    )
    summary = json.loads(out.with_suffix(".json").read_text())
    errors = [
        (p["title"], t["error"]) for p in summary["panels"] for t in p["targets"] if t["status"] != "success"
    ]
    assert rc == 0 and not errors, errors
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    chosen = {v["name"]: v for v in summary["variables"]}
    assert chosen["namespace"]["values"] == ["serving"]
    assert chosen["job"]["values"] == ["batchgate-metrics"]
    assert set(chosen["model"]["values"]) == {"ranker", "encoder"}
    titles = {p["title"] for p in summary["panels"]}
    assert MAY_BE_EMPTY <= titles and len(titles) >= 20
    empty = {
        f"{p['title']} {t['refId']}: {t['query']}"
        for p in summary["panels"]
        if p["title"] not in MAY_BE_EMPTY
        for t in p["targets"]
        if not t["series"] or not t["points"]
    }
    assert not empty, sorted(empty)


@pytest.mark.skipif(
    not Path(dp.PROMETHEUS).exists(), reason="no /usr/bin/prometheus (apt-get install prometheus)"
)
def test_a_query_prometheus_refuses_is_reported(tmp_path):
    # What makes the command fail: Prometheus's own verdict on a query, kept per target.
    (port,) = dp.free_ports(1)
    prom = dp.Prometheus(dp.PROMETHEUS, tmp_path, f"127.0.0.1:{port}")  # nothing serves there
    try:
        prom.wait_up(scraped=False)
        good = {"refId": "A", "expr": 'sum(rate(batchgate_requests_total{job="$job"}[$__rate_interval]))'}
        bad = {"refId": "B", "expr": "sumx(rate(batchgate_requests_total[$__rate_interval]))"}
        dash = {"templating": {"list": []}, "panels": [{"id": 1, "title": "t", "type": "timeseries",
                                                       "gridPos": {}, "targets": [good, bad]}]}  # fmt: skip
        now = time.time()
        (panel,) = dp.evaluate(prom, dash, now - 10, now)["panels"]
    finally:
        prom.stop()
    a, b = panel["targets"]
    assert a["status"] == "success" and a["series"] == 0 and a["query"].endswith("[4s]))")
    assert b["status"] == "error" and "sumx" in b["error"], b
