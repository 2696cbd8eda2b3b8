"""Usage metering: per tenant and model on /metrics, OpenAI's usage API and the record sink,
against the real server in this process (tests/harness.py) serving minilm's real tokenizer.

The usage export's token totals must equal the sum of the ``usage`` fields the calls received,
per tenant, exactly, and a tenant must not see another's figures."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from batchgate.gateway.admission.usage import Usage
from batchgate.gateway.errors import GatewayError
from batchgate.gateway.admission.tenants import hash_key
from tests.harness import REPO, serving

ADMIN, BLUE, GREEN = "bg_admin_key", "bg_blue_key", "bg_green_key"
TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "Tokenizers count word pieces: antidisestablishmentarianism is several.",
    "short",
    "数字と漢字も数えます",
]


def _repo(root: Path) -> Path:
    repo = root / "repo"
    repo.mkdir(parents=True)
    (repo / "minilm").symlink_to(REPO / "minilm")
    cached = repo / "minilm_cached"
    cached.mkdir()
    (cached / "1").symlink_to(REPO / "minilm" / "1", target_is_directory=True)
    (cached / "tokenizer.json").symlink_to(REPO / "minilm" / "tokenizer.json")
    text = (REPO / "minilm" / "config.pbtxt").read_text().replace('name: "minilm"', 'name: "minilm_cached"')
    (cached / "config.pbtxt").write_text(text + "response_cache { enable: true }\n")
    return repo


def _tenants(root: Path) -> Path:
    path = root / "tenants.json"
    path.write_text(json.dumps({"tenants": [
        {"name": "ops", "key_hashes": [hash_key(ADMIN)], "admin": True},
        {"name": "blue", "key_hashes": [hash_key(BLUE)]},
        {"name": "green", "key_hashes": [hash_key(GREEN)]},
    ]}))  # fmt: skip
    return path


async def _embed(gw, key: str, texts, model: str = "minilm") -> tuple[int, dict, dict]:
    async with gw.http.post(
        "/v1/embeddings", json={"model": model, "input": texts}, headers={"Authorization": f"Bearer {key}"}
    ) as r:
        return r.status, await r.json(), dict(r.headers)


async def _usage(gw, key: str, query: str) -> tuple[int, dict]:
    async with gw.http.get(
        f"/v1/organization/usage/embeddings?{query}", headers={"Authorization": f"Bearer {key}"}
    ) as r:
        return r.status, await r.json()


def _by(page: dict, field: str) -> dict:
    out: dict = {}
    for bucket in page["data"]:
        for r in bucket["results"]:
            acc = out.setdefault(r[field], [0, 0])
            acc[0] += r["input_tokens"]
            acc[1] += r["num_model_requests"]
    return out


async def test_usage_export_equals_the_usage_fields_per_tenant_and_hides_other_tenants(tmp_path):
    sink = tmp_path / "usage.jsonl"
    async with serving(
        _repo(tmp_path), api_keys_file=_tenants(tmp_path), usage_sink=str(sink), usage_sink_interval_s=0.1,
        cache_tiers="memory",
    ) as gw:  # fmt: skip
        start = int(time.time())
        sent = {"blue": 0, "green": 0}
        calls = {"blue": 0, "green": 0}
        for i in range(6):
            for name, key in (("blue", BLUE), ("green", GREEN)):
                texts = TEXTS[: 1 + (i + len(name)) % 4] if name == "blue" else TEXTS[i % 4] * (i + 1)
                model = "minilm_cached" if i % 2 else "minilm"
                status, body, _ = await _embed(gw, key, texts, model)
                assert status == 200, body
                sent[name] += body["usage"]["prompt_tokens"]
                calls[name] += 1
        assert (await _embed(gw, BLUE, [""]))[0] == 400  # refused: counted apart, no tokens

        status, page = await _usage(gw, ADMIN, f"start_time={start}&bucket_width=1m&group_by=project_id")
        assert status == 200, page
        assert page["object"] == "page" and page["data"][0]["object"] == "bucket"
        assert _by(page, "project_id") == {
            "blue": [sent["blue"], calls["blue"]],
            "green": [sent["green"], calls["green"]],
        }

        status, page = await _usage(gw, BLUE, f"start_time={start}&bucket_width=1d&group_by=project_id,model")
        assert status == 200, page
        assert {r["project_id"] for b in page["data"] for r in b["results"]} == {"blue"}
        assert sum(t for t, _ in _by(page, "model").values()) == sent["blue"]
        # asking for another tenant's figures by name gives nothing, not an error that confirms it exists
        status, page = await _usage(gw, BLUE, f"start_time={start}&project_ids=green&group_by=project_id")
        assert status == 200 and _by(page, "project_id") == {}

        samples = await gw.metrics()
        per_tenant: dict = {}
        for s in samples:
            if s.name == "batchgate_usage_tokens_total":
                per_tenant[s.labels["tenant"]] = per_tenant.get(s.labels["tenant"], 0) + s.value
        assert per_tenant == {"blue": sent["blue"], "green": sent["green"], "ops": 0}  # ops: a zero series
        hits = sum(s.value for s in samples if s.name == "batchgate_usage_cache_hits_total")
        assert hits > 0  # the cached twin answered repeated texts from the cache
        compute = [s.value for s in samples if s.name == "batchgate_usage_compute_seconds_total"]
        assert sum(compute) > 0
        refusals = {
            (s.labels["tenant"], s.labels["cause"]): s.value
            for s in samples if s.name == "batchgate_usage_refusals_total"
        }  # fmt: skip
        assert refusals[("blue", "invalid")] == 1

        await asyncio.sleep(0.3)  # one sink interval
    records = [json.loads(line) for line in sink.read_text().splitlines()]
    for name in ("blue", "green"):
        mine = [r for r in records if r["tenant"] == name and r["outcome"] == "ok"]
        assert sum(r["tokens"] for r in mine) == sent[name]
        assert len(mine) == calls[name]


async def test_usage_api_refuses_bad_queries_naming_the_parameter(tmp_path):
    async with serving(_repo(tmp_path), api_keys_file=_tenants(tmp_path)) as gw:
        for query, param in (
            ("bucket_width=1m", "start_time"),
            ("start_time=0&bucket_width=1w", "bucket_width"),
            ("start_time=0&group_by=user_id", "group_by"),
            ("start_time=abc", "start_time"),
            ("start_time=0&bucket_width=1d&limit=32", "limit"),
        ):
            status, body = await _usage(gw, ADMIN, query)
            assert status == 400 and body["error"]["param"] == param, (query, body)
        async with gw.http.get("/v1/organization/usage/embeddings?start_time=0") as r:
            assert r.status == 401  # no key: no figures


def test_usage_buckets_and_pages():
    now = [3600 * 100 + 30.0]
    u = Usage(clock=lambda: now[0])
    u.answered("a", "m", 2, 10, None)
    now[0] += 60
    u.answered("a", "m", 1, 5, None)
    u.answered("b", "m", 1, 7, None)
    page = u.page({"start_time": [str(3600 * 100)], "bucket_width": ["1m"], "limit": ["1"]}, None)
    assert page["has_more"] and page["next_page"] == str(3600 * 100 + 60)
    assert page["data"][0]["results"][0]["input_tokens"] == 10
    nxt = u.page({"start_time": [str(3600 * 100)], "bucket_width": ["1m"], "page": [page["next_page"]]}, None)
    assert nxt["data"][0]["results"][0]["input_tokens"] == 12  # not grouped: both tenants together
    only = u.page({"start_time": [str(3600 * 100)], "bucket_width": ["1h"]}, "b")
    assert [r["input_tokens"] for b in only["data"] for r in b["results"]] == [7]
    with pytest.raises(GatewayError):
        u.page({"start_time": ["-1"]}, None)


async def test_metering_off_counts_nothing_and_says_so(tmp_path):
    async with serving(_repo(tmp_path), api_keys_file=_tenants(tmp_path), usage_metering=False) as gw:
        status, body, _ = await _embed(gw, BLUE, TEXTS)
        assert status == 200 and body["usage"]["prompt_tokens"] > 0  # the answer still counts
        assert (await _embed(gw, BLUE, [""]))[0] == 400
        assert not [s for s in await gw.metrics() if s.name.startswith("batchgate_usage_")]
        status, body = await _usage(gw, ADMIN, "start_time=0")
        assert status == 501 and "usage_metering" in body["error"]["message"], body
