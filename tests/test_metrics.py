"""Observability: a scrape of /metrics after a known workload shows the counts that workload must
produce; ModelStatistics through tritonclient agrees with it; JSON logs carry one line per
lifecycle event and the request id of the call being served.

The scrape test gets a server of its own (module scope, ``--log-format json``), so every count is
exact rather than a difference; the collector-level tests need no server at all.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import re
import shutil
import signal
import urllib.request
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tc
from prometheus_client.parser import text_string_to_metric_families

from batchgate.gateway import logs
from batchgate.gateway.errors import GatewayError, Kind, invalid
from batchgate.gateway.metrics import BatchObserver, Histogram, Metrics, outcome_of
from batchgate.proto.inference.v2 import grpc_service_pb2 as pb
from batchgate.proto.inference.v2 import grpc_service_pb2_grpc as pb_grpc
from tests.conftest import REPO, ROOT, start_server


def scrape(server) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one scrape."""
    with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/metrics", timeout=10) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def ranker_request(rows: int, seed: int = 0, rid: str = "") -> pb.ModelInferRequest:
    rng = np.random.default_rng(seed)
    req = pb.ModelInferRequest(model_name="ranker", id=rid)
    req.inputs.add(name="dense", datatype="FP32", shape=[rows, 64])
    req.inputs.add(name="sparse_ids", datatype="INT64", shape=[rows, 8])
    req.raw_input_contents.append(rng.standard_normal((rows, 64), dtype=np.float32).tobytes())
    req.raw_input_contents.append(rng.integers(0, 10_000, (rows, 8), dtype=np.int64).tobytes())
    return req


@pytest.fixture(scope="module")
def obs_server(tmp_path_factory):
    """The bundled ranker (with its result cache on) and encoder, logging JSON."""
    tmp = tmp_path_factory.mktemp("obs")
    repo = tmp / "repo"
    for name in ("ranker", "encoder"):
        shutil.copytree(REPO / name, repo / name)
    with (repo / "ranker" / "config.pbtxt").open("a") as f:
        f.write("\nresponse_cache { enable: true }\n")
    srv = start_server(tmp, "--log-format", "json", repo=repo)
    srv.first_scrape = scrape(srv)  # before any call, whichever test runs first
    yield srv
    srv.stop()


# The workload; every request is sent alone (the next one after the answer), so each runs as a
# batch of its own and the batch counts are exact. All inputs differ, except one unary request
# sent twice: its second answer comes from the result cache and never reaches the scheduler.
UNARY_ROWS = [1, 3, 5, 2, 4]
REPEATED = 1  # index into UNARY_ROWS
STREAM_ROWS = [2, 6]
HTTP_ROWS = [3]
ENCODER = (2, 16)  # rows, seq


@pytest.fixture(scope="module")
def workload(obs_server):
    with grpc.insecure_channel(obs_server.grpc_url) as ch:
        stub = pb_grpc.GRPCInferenceServiceStub(ch)
        for i, rows in enumerate(UNARY_ROWS):
            _, call = stub.ModelInfer.with_call(
                ranker_request(rows, i), metadata=[("x-request-id", f"w-{i}")]
            )
            assert dict(call.trailing_metadata())["x-request-id"] == f"w-{i}"
        stub.ModelInfer(ranker_request(UNARY_ROWS[REPEATED], REPEATED))  # a cache hit
        with pytest.raises(grpc.RpcError) as err:  # invalid: one input missing
            bad = ranker_request(2)
            del bad.inputs[1]
            del bad.raw_input_contents[1]
            stub.ModelInfer(bad)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as err:
            stub.ModelInfer(pb.ModelInferRequest(model_name="no-such-model"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        for i, rows in enumerate(STREAM_ROWS):  # one stream per request: sent alone, batched alone
            (resp,) = list(stub.ModelStreamInfer(iter([ranker_request(rows, 10 + i, rid=f"s{i}")])))
            assert not resp.error_message and resp.infer_response.id == f"s{i}"
        rows, seq = ENCODER
        enc = pb.ModelInferRequest(model_name="encoder")
        enc.inputs.add(name="input_ids", datatype="INT64", shape=[rows, seq])
        enc.inputs.add(name="attention_mask", datatype="INT64", shape=[rows, seq])
        enc.raw_input_contents.extend([np.ones((rows, seq), np.int64).tobytes()] * 2)
        stub.ModelInfer(enc)
    for rows in HTTP_ROWS:
        a = np.arange(rows * 64, dtype=np.float32) / 100  # distinct rows (identical ones share a cache entry)
        body = {"inputs": [
            {"name": "dense", "shape": [rows, 64], "datatype": "FP32", "data": a.tolist()},
            {"name": "sparse_ids", "shape": [rows, 8], "datatype": "INT64", "data": [7] * rows * 8},
        ]}  # fmt: skip
        req = urllib.request.Request(
            f"http://127.0.0.1:{obs_server.http_port}/v2/models/ranker/infer", data=json.dumps(body).encode()
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert resp.status == 200
    return obs_server


def test_scrape_counts_the_workload(workload):
    s = scrape(workload)
    ranker = {"model": "ranker", "version": "1"}
    req = "batchgate_requests_total"
    assert value(s, req, **ranker, transport="grpc", outcome="success") == len(UNARY_ROWS) + 1
    assert value(s, req, **ranker, transport="grpc", outcome="invalid") == 1
    assert value(s, req, model="", version="", transport="grpc", outcome="not_found") == 1
    assert value(s, req, **ranker, transport="grpc_stream", outcome="success") == len(STREAM_ROWS)
    assert value(s, req, **ranker, transport="http", outcome="success") == len(HTTP_ROWS)
    assert value(s, req, model="encoder", version="1", transport="grpc", outcome="success") == 1
    assert (
        value(s, "batchgate_request_duration_seconds_count", **ranker, transport="grpc")
        == len(UNARY_ROWS) + 1
    )
    assert (
        value(s, "batchgate_request_duration_seconds_bucket", **ranker, transport="grpc", le="+Inf")
        == len(UNARY_ROWS) + 1
    )

    n_batches = len(UNARY_ROWS) + len(STREAM_ROWS) + len(HTTP_ROWS)
    n_rows = sum(UNARY_ROWS) + sum(STREAM_ROWS) + sum(HTTP_ROWS)
    assert value(s, "batchgate_batches_total", **ranker) == n_batches
    assert value(s, "batchgate_inference_rows_total", **ranker) == n_rows
    assert value(s, "batchgate_batch_size_rows_count", **ranker) == n_batches
    assert value(s, "batchgate_batch_size_rows_sum", **ranker) == n_rows
    assert value(s, "batchgate_batch_size_rows_bucket", **ranker, le="2.0") == sum(
        r <= 2 for r in UNARY_ROWS + STREAM_ROWS + HTTP_ROWS
    )
    assert value(s, "batchgate_queue_duration_seconds_count", **ranker) == n_batches
    assert value(s, "batchgate_compute_duration_seconds_count", **ranker) == n_batches
    # the result cache: the repeated request's rows were hits, every other row a miss
    hit_rows = UNARY_ROWS[REPEATED]
    lookups = "batchgate_cache_lookups_total"
    assert value(s, lookups, **ranker, tier="all", result="hit") == hit_rows
    assert value(s, lookups, **ranker, tier="all", result="miss") == n_rows
    assert value(s, lookups, model="", version="", tier="memory", result="hit") == hit_rows
    assert value(s, "batchgate_cache_stat", model="", version="", tier="memory", stat="entries") == n_rows
    rows, seq = ENCODER
    assert value(s, "batchgate_batch_size_tokens_sum", model="encoder", version="1") == rows * seq
    assert ("batchgate_batch_size_tokens_count", tuple(sorted(ranker.items()))) not in s  # no -1 dims
    busy = sum(
        v
        for (name, labels), v in s.items()
        if name == "batchgate_worker_busy_seconds_total" and ("model", "ranker") in labels
    )
    assert busy > 0
    assert value(s, "batchgate_inflight_requests", transport="grpc") == 0
    assert value(s, "batchgate_model_ready", **ranker) == 1
    assert value(s, "batchgate_server_ready") == 1
    assert any(name == "batchgate_queue_depth" for name, _ in s)
    assert any(name == "process_cpu_seconds_total" for name, _ in s)  # the per-process registry has them too


def test_every_family_the_dashboard_queries_exists_before_the_first_call(obs_server):
    """A new server's panels read 0, not "no data": each family a dashboard query names has
    zero-valued series for the served models from the first scrape."""
    dashboard = (ROOT / "helm" / "batchgate" / "dashboards" / "batchgate.json").read_text()
    queried = set(re.findall(r"batchgate_[a-z_]+", dashboard))
    first = obs_server.first_scrape
    exposed = {name for name, _ in first}
    assert queried - exposed == set()
    for model in ("ranker", "encoder"):
        ok = {"model": model, "version": "1", "transport": "grpc", "outcome": "success"}
        assert ("batchgate_requests_total", tuple(sorted(ok.items()))) in first and value(
            first, "batchgate_requests_total", **ok
        ) == 0
        labels = {"model": model, "version": "1", "class": "bulk", "outcome": "success"}
        assert ("batchgate_class_requests_total", tuple(sorted(labels.items()))) in first and value(
            first, "batchgate_class_requests_total", **labels
        ) == 0
    tiers = {dict(labels)["tier"] for name, labels in first if name == "batchgate_cache_lookups_total"}
    # the shared memory tier, the ranker's own view of it, the encoder's absence of a cache
    assert tiers == {"memory", "all", "none"}


def test_time_to_answer_is_exported_by_class(workload):
    """p50/p99 by class come from this histogram: one observation per request the scheduler
    answered, under the class it was queued in, each no longer than the whole call took."""
    s = scrape(workload)

    def per_class(name: str, **want) -> dict[str, float]:
        out: dict[str, float] = {}
        for (n, labels), v in s.items():
            d = dict(labels)
            if n == name and d.get("model") == "ranker" and all(d.get(k) == w for k, w in want.items()):
                out[d["class"]] = out.get(d["class"], 0) + v
        return out

    answered = per_class("batchgate_class_requests_total", outcome="success")
    late = per_class("batchgate_class_requests_total", outcome="late")
    for cls, n in late.items():
        answered[cls] = answered.get(cls, 0) + n
    counts = per_class("batchgate_class_request_duration_seconds_count")
    assert counts and counts == answered
    # every request of the workload ran alone, so all of them are counted (the cache hit is not)
    assert sum(counts.values()) == len(UNARY_ROWS) + len(STREAM_ROWS) + len(HTTP_ROWS)
    assert per_class("batchgate_class_request_duration_seconds_bucket", le="+Inf") == counts
    seconds = sum(per_class("batchgate_class_request_duration_seconds_sum").values())
    edge = sum(v for (n, labels), v in s.items()
               if n == "batchgate_request_duration_seconds_sum" and ("model", "ranker") in labels)  # fmt: skip
    assert 0 < seconds <= edge


def test_the_overload_gate_is_exported_and_sheds_nothing_under_a_light_workload(workload):
    s = scrape(workload)
    assert value(s, "batchgate_overload_admitted_ratio") == 1.0
    for where in ("door", "pipeline"):  # present (value() would read a missing sample as 0)
        assert s[("batchgate_overload_refused_total", (("where", where),))] == 0


def test_latency_model_is_exported_per_bucket_and_batch_size(workload):
    s = scrape(workload)
    fit = {dict(labels)["term"]: v for (name, labels), v in s.items()
           if name == "batchgate_batch_time_fit_seconds" and ("model", "ranker") in labels}  # fmt: skip
    assert set(fit) == {"intercept", "per_row"}
    assert all(v >= 0 for v in fit.values()) and fit["intercept"] + fit["per_row"] > 0
    sizes = {dict(labels)["batch_size"]: v for (name, labels), v in s.items()
             if name == "batchgate_batch_time_estimate_seconds" and ("model", "ranker") in labels}  # fmt: skip
    assert sizes and all(0 < v < 1 for v in sizes.values())  # seconds per batch, per size class
    assert all(int(k) & (int(k) - 1) == 0 for k in sizes)  # classes are powers of two
    encoder = [dict(labels)["bucket"] for (name, labels) in s
               if name == "batchgate_batch_time_fit_seconds" and ("model", "encoder") in labels]  # fmt: skip
    assert set(encoder) == {str(ENCODER[1])}  # the sequence bucket of the one encoder request
    assert ("batchgate_event_loop_lag_seconds", ()) in s and s[("batchgate_event_loop_lag_seconds", ())] >= 0


def test_statistics_through_tritonclient_match_the_workload(workload):
    client = tc.InferenceServerClient(workload.grpc_url)
    try:
        st = client.get_inference_statistics("ranker", "1").model_stats[0]
    finally:
        client.close()
    sizes = UNARY_ROWS + STREAM_ROWS + HTTP_ROWS
    assert st.inference_count == sum(sizes)
    assert st.execution_count == len(sizes)
    s = st.inference_stats
    # Triton: success includes the cache hit; queue and compute do not; neither count includes it
    assert s.success.count == len(sizes) + 1 and s.success.ns > 0
    assert s.cache_hit.count == 1 and s.cache_miss.count == len(sizes)
    assert s.fail.count == 0  # the invalid request never reached the model, as in Triton
    assert s.queue.count == len(sizes)
    assert s.compute_infer.count == len(sizes) and s.compute_infer.ns > 0
    assert s.compute_input.count == s.compute_output.count == len(sizes)
    by_size = {b.batch_size: b.compute_infer.count for b in st.batch_stats}
    assert by_size == {n: sizes.count(n) for n in set(sizes)}
    assert st.last_inference > 0


def test_json_logs_have_lifecycle_events_and_no_tensor_data(workload):
    workload.stop(signal.SIGTERM)
    lines = [json.loads(line) for line in workload.log().splitlines() if line.startswith("{")]
    assert lines and all({"ts", "level", "logger", "msg"} <= set(line) for line in lines)
    events = [(line.get("event"), line.get("model")) for line in lines if line.get("event")]
    assert ("model_ready", "ranker") in events and ("model_ready", "encoder") in events
    names = [e for e, _ in events]
    assert names.index("ready") < names.index("drain") < names.index("unload") < names.index("stopped")
    assert ("unload", "ranker") in events
    assert "raw_input_contents" not in workload.log() and "fp32_contents" not in workload.log()


# -- without a server -----------------------------------------------------------------------------


def test_histogram_buckets_are_cumulative_and_inclusive():
    h = Histogram((1, 2, 4))
    for v in (0.5, 1, 1.5, 2, 3, 9):
        h.observe(v)
    assert h.buckets() == [("1.0", 2), ("2.0", 4), ("4.0", 5), ("+Inf", 6)]
    assert h.count == 6 and h.sum == pytest.approx(17.0)


def test_batch_observer_fills_time_size_token_and_padding_histograms():
    obs = BatchObserver("input_ids")
    batch = [
        SimpleNamespace(arrival=0.0, rows=2, inputs={"input_ids": np.zeros((2, 8))}),
        SimpleNamespace(arrival=0.5, rows=1, inputs={"input_ids": np.zeros((1, 8))}),
    ]
    timing = SimpleNamespace(input_ns=1_000_000, infer_ns=2_000_000, output_ns=0, tokens=24, padded_tokens=32)
    obs(batch, 1.0, 3, timing)
    assert obs.queue.count == 2 and obs.queue.sum == pytest.approx(1.5)
    assert obs.compute.sum == pytest.approx(0.003)
    assert obs.rows.sum == 3 and obs.tokens.sum == 24 and obs.padding.sum == pytest.approx(0.25)
    # a batch with no padding (exact lengths): tokens counted, no padding figure
    obs(batch, 1.0, 3, SimpleNamespace(input_ns=0, infer_ns=0, output_ns=0, tokens=24, padded_tokens=0))
    assert obs.tokens.sum == 48 and obs.padding.count == 1


def test_outcome_labels():
    assert outcome_of(invalid("x")) == "invalid"
    assert outcome_of(GatewayError(Kind.EXHAUSTED, "slow down")) == "rate_limited"
    assert outcome_of(GatewayError(Kind.UNAVAILABLE, "full")) == "unavailable"
    assert outcome_of(GatewayError(Kind.DEADLINE, "deadline passed while queued")) == "expired"
    assert outcome_of(GatewayError(Kind.DEADLINE, "cannot be met ...; shed before queueing")) == "shed"
    assert outcome_of(GatewayError(Kind.FAILED, "boom")) == "error"
    assert outcome_of(asyncio.CancelledError()) == "cancelled"
    assert outcome_of(RuntimeError()) == "error"
    e = GatewayError(Kind.DEADLINE, "x")
    e.outcome = "shed"
    assert outcome_of(e) == "shed"


class _Cache:
    def __init__(self, stats):
        self._stats = stats

    def stats(self):
        if isinstance(self._stats, Exception):
            raise self._stats
        return self._stats


def _plane(**extra):
    fields = {
        "models": {}, "latest": {}, "failures": {}, "ready": True, "runtimes": lambda *a: [], "cache": None,
        "lag": SimpleNamespace(s=0.0), **extra,
    }  # fmt: skip
    return SimpleNamespace(**fields)


def _exposition(plane) -> dict:
    text = Metrics(plane, "test").exposition().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def test_cache_stats_are_read_at_scrape_time_per_tier():
    stats = {"memory": {"hits": 7, "misses": 3, "entries": 10}, "redis": {"hits": 1, "misses": 2}}
    s = _exposition(_plane(cache=_Cache(stats)))
    assert value(s, "batchgate_cache_lookups_total", model="", version="", tier="memory", result="hit") == 7
    assert value(s, "batchgate_cache_lookups_total", model="", version="", tier="redis", result="miss") == 2
    assert value(s, "batchgate_cache_stat", model="", version="", tier="memory", stat="entries") == 10
    flat = _exposition(_plane(cache=_Cache({"hits": 4, "misses": 1})))
    assert value(flat, "batchgate_cache_lookups_total", model="", version="", tier="all", result="hit") == 4


def test_per_model_cache_views_carry_the_model_labels():
    from batchgate.gateway.metrics import _caches

    shared = _Cache({"memory": {"hits": 5, "misses": 2, "breaker_state": "closed"}})
    rt = SimpleNamespace(
        spec=SimpleNamespace(name="ranker", version="1"), cache=_Cache({"hits": 5, "misses": 2})
    )
    plane = _plane(cache=shared, runtimes=lambda *a: [rt])
    assert [(m, v) for m, v, _ in _caches(plane)] == [("", ""), ("ranker", "1")]


def test_a_cache_that_cannot_say_does_not_break_the_scrape():
    s = _exposition(_plane(cache=_Cache(RuntimeError("redis down"))))
    assert value(s, "batchgate_server_ready") == 1
    assert not any(name.startswith("batchgate_cache_lookups") for name, _ in s)
    assert value(_exposition(_plane()), "batchgate_server_ready") == 1  # no cache at all


def test_each_metrics_object_has_its_own_registry():
    plane = _plane()
    a, b = Metrics(plane, "a"), Metrics(plane, "b")
    a.transport("grpc").ok("m", "1", 0.001)
    ta, tb = a.exposition().decode(), b.exposition().decode()
    assert 'batchgate_requests_total{model="m",outcome="success",transport="grpc",version="1"} 1.0' in ta
    assert "batchgate_requests_total{" not in tb


def test_unknown_models_are_counted_under_empty_labels():
    plane = _plane(models={"ranker": {"1": object()}}, latest={"ranker": "1"})
    t = Metrics(plane).transport("http")
    t.failed("ranker", "", invalid("x"))
    t.failed("ranker", "7", GatewayError(Kind.NOT_FOUND, "no version"))
    t.failed("attacker-chosen-name", "", GatewayError(Kind.NOT_FOUND, "unknown"))
    labels = {(e.model, e.version): e.outcomes for e in t.edges()}
    assert labels == {
        ("ranker", "1"): {"invalid": 1},
        ("ranker", ""): {"not_found": 1},
        ("", ""): {"not_found": 1},
    }


# -- logs -----------------------------------------------------------------------------------------


def _capture(fmt: str) -> tuple[logging.Logger, io.StringIO, logging.Handler]:
    buf = io.StringIO()
    handler = logs.make_handler(fmt, buf)
    logger = logging.getLogger(f"test.logs.{fmt}")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    return logger, buf, handler


def test_json_log_lines_carry_request_id_extra_fields_and_mask_secrets():
    logger, buf, handler = _capture("json")
    token = logs.REQUEST_ID.set("abc-123")
    try:
        logger.info(
            "connecting to %s", "redis://app:s3cret@cache:6379/0", extra={"event": "load", "model": "ranker"}
        )
    finally:
        logs.REQUEST_ID.reset(token)
    logger.info("no request here")
    logger.removeHandler(handler)
    first, second = (json.loads(line) for line in buf.getvalue().splitlines())
    assert first["request_id"] == "abc-123" and first["event"] == "load" and first["model"] == "ranker"
    assert "s3cret" not in first["msg"] and "redis://app:***@cache" in first["msg"]
    assert "request_id" not in second


def test_text_log_lines_name_the_request():
    logger, buf, handler = _capture("text")
    token = logs.REQUEST_ID.set("r-9")
    try:
        logger.warning("something about this call")
    finally:
        logs.REQUEST_ID.reset(token)
    logger.removeHandler(handler)
    assert buf.getvalue().rstrip().endswith("[request_id=r-9]")


def test_request_ids_are_cleaned():
    assert logs.clean_request_id("ok-1") == "ok-1"
    assert logs.clean_request_id("a\nb\x00c") == "abc"
    assert len(logs.clean_request_id("x" * 1000)) == logs.MAX_REQUEST_ID_CHARS
    assert logs.clean_request_id(None) == ""


class _Aborted(Exception):
    pass


class _FakeContext:
    def __init__(self, metadata):
        self.metadata = metadata
        self.trailing = ()

    def invocation_metadata(self):
        return self.metadata

    def set_trailing_metadata(self, md):
        self.trailing = tuple(md)

    def time_remaining(self):
        return None

    async def abort(self, code, details="", trailing_metadata=()):
        raise _Aborted(code, details)


async def test_request_id_reaches_the_log_lines_of_its_call():
    """A call that fails inside the gateway logs a traceback; that line names the caller's id,
    the id is echoed back, and the failure is counted as an error at the edge."""
    from batchgate.gateway.admission import Admission
    from batchgate.gateway.admission.door import Door, StreamSlots
    from batchgate.gateway.admission.gate import LoadShedder
    from batchgate.gateway.config import Settings
    from batchgate.gateway.infer import Pipeline
    from batchgate.gateway.transport.grpc import InferenceServicer

    def broken_get(name, version=""):
        raise RuntimeError("engine on fire")

    plane = _plane(draining=False, get=broken_get, settings=Settings())
    door = Door(Admission(), LoadShedder(0.02, 32), StreamSlots(8, 8))  # an open server's door
    servicer = InferenceServicer(Pipeline(plane, door), Metrics(plane, "test"))
    buf = io.StringIO()
    handler = logs.make_handler("json", buf)
    server_log = logging.getLogger("batchgate.gateway.transport.grpc")
    server_log.addHandler(handler)
    try:
        ctx = _FakeContext((("user-agent", "t"), ("x-request-id", "rid-5")))
        with pytest.raises(_Aborted) as err:
            await servicer.ModelInfer(pb.ModelInferRequest(model_name="ranker"), ctx)
        assert err.value.args[0] == grpc.StatusCode.INTERNAL
        with pytest.raises(_Aborted):  # the next call carries no id: none is left over
            await servicer.ModelInfer(pb.ModelInferRequest(model_name="ranker"), _FakeContext(()))
    finally:
        server_log.removeHandler(handler)
    first, second = (json.loads(line) for line in buf.getvalue().splitlines())
    assert first["request_id"] == "rid-5" and "engine on fire" in first["exc"]
    assert "request_id" not in second
    assert ctx.trailing == (("x-request-id", "rid-5"),)
    (edge,) = servicer.metrics.transport("grpc").edges()
    assert edge.outcomes == {"error": 2}
