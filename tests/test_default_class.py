"""Defaults that fit what callers send (issue 57): a call of several rows (texts) that states no
budget is bulk work unless its tenant names a class, a single row or a stated budget keeps the
default class; and a budget even an idle server cannot meet is refused at admission, with the same
words, whichever route the call came by (it was shed on one route and queued to be dropped before
compute on others, or let through by the idle probe)."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from batchgate.gateway.admission.gate import wasted
from batchgate.gateway.config import Settings
from batchgate.gateway.errors import GatewayError, Kind
from batchgate.gateway.scheduling.request import resolve
from tests.harness import REPO, model_repo, serving
from tests.helpers import encoder_request
from tests.test_deadlines import CLASSES, _schedule, _settle, budget, one_slot
from tests.test_scheduler import submit_one


def _class(params: dict, rows: int, time_left=None, batch_class="bulk", default="standard") -> str:
    return resolve(params, time_left, 0.0, CLASSES, default, _schedule(), rows, batch_class).cls.name


def test_several_rows_stating_no_budget_are_bulk_work():
    assert _class({}, 32) == "bulk"
    assert _class({}, 2) == "bulk"
    assert _class({}, 1) == "standard"  # one text: the default class
    assert _class({}, 0) == "standard"


def test_a_stated_budget_or_class_keeps_its_class():
    b = resolve({"latency_budget_ms": 300}, None, 0.0, CLASSES, "standard", _schedule(), 32, "bulk")
    assert b.cls.name == "standard" and b.deadline == pytest.approx(0.3)
    b = resolve({}, 0.2, 0.0, CLASSES, "standard", _schedule(), 32, "bulk")  # a gRPC deadline
    assert b.cls.name == "standard" and b.deadline == pytest.approx(0.2)
    assert _class({}, 32, time_left=1e9) == "bulk"  # grpc.aio's "no deadline"
    assert _class({"latency_class": "realtime"}, 32) == "realtime"
    # A tenant that names a class: the pipeline passes no batch class, its class serves every call.
    assert _class({}, 32, batch_class=None, default="realtime") == "realtime"


def test_the_batch_class_setting():
    assert Settings().batch_class == "bulk"
    assert Settings(batch_latency_class="").batch_class is None
    assert Settings(batch_latency_class="realtime").batch_class == "realtime"
    # classes without a bulk one: every call keeps the default class
    assert (
        Settings(latency_classes="fast=20ms/64/0,slow=500ms/512/0", default_latency_class="slow").batch_class
        is None
    )
    with pytest.raises(ValueError, match="batch_latency_class 'nope'"):
        Settings(batch_latency_class="nope")


async def test_an_impossible_budget_is_refused_on_an_idle_server_every_time():
    """The model knows a 10 ms batch; a 5 ms budget is refused at admission, every time, on an idle
    server whose admission estimate has not been checked yet (before: the probe let one a second
    through, to be dropped from the queue before compute)."""
    clock, engine, q, s = one_slot(calibrated=False)
    try:
        for _ in range(3):
            with pytest.raises(GatewayError) as never:
                await submit_one(s, {"x": 1}, 1, None, budget("standard", clock.now, 0.005))
            e = never.value
            assert e.kind is Kind.DEADLINE and e.retry_after_s is None
            assert "not even an idle server" in e.message and "retry" not in e.message
            # the caller's budget, not the load: the overload gate does not count it
            assert e.outcome == "impossible" and not wasted(e)
        await _settle()
        assert engine.calls == [] and s.stats.expired == 0 and s.stats.shed == 3
        # a budget its compute fits is admitted and computed
        task = asyncio.create_task(submit_one(s, {"x": 1}, 1, None, budget("standard", clock.now, 0.05)))
        await _settle()
        assert len(engine.calls) == 1
        engine.finish(0)
        await asyncio.wait_for(task, 2)
    finally:
        await s.close()


# -- through the server -----------------------------------------------------------------------------

BATCH_S = 0.02  # what one fake batch costs: the latency model learns it


def _repo(tmp_path):
    repo = model_repo(tmp_path, {"encoder": ""})
    (repo / "minilm").symlink_to(REPO / "minilm")
    return repo


def _by_class(gw, model: str) -> dict[str, int]:
    st = gw.server.plane.runtimes(model)[0].scheduler.stats
    return {c: sum(v for k, v in d.items() if k in ("success", "late")) for c, d in st.by_class.items()}


async def _embed(gw, texts, **extra) -> tuple[int, dict]:
    async with gw.http.post("/v1/embeddings", json={"model": "minilm", "input": texts, **extra}) as resp:
        return resp.status, await resp.json(content_type=None)


async def test_the_class_of_a_call_follows_its_rows_on_every_route(tmp_path):
    async with serving(_repo(tmp_path), workers_per_device=1) as gw:
        rng = np.random.default_rng(0)
        await gw.stub.ModelInfer(encoder_request(rng, 4, 16, {}), timeout=None)
        await gw.stub.ModelInfer(encoder_request(rng, 1, 16, {}), timeout=None)
        await gw.stub.ModelInfer(encoder_request(rng, 4, 16, {"latency_budget_ms": 5000}), timeout=None)
        assert _by_class(gw, "encoder") == {"bulk": 1, "standard": 2}
        ids = rng.integers(0, 1000, (4, 16)).astype(np.int64)
        doc = {"inputs": [
            {"name": n, "shape": [4, 16], "datatype": "INT64", "data": a.ravel().tolist()}
            for n, a in (("input_ids", ids), ("attention_mask", np.ones_like(ids)))
        ]}  # fmt: skip
        status, body = await gw.rest_infer("encoder", doc)
        assert status == 200, body
        assert _by_class(gw, "encoder") == {"bulk": 2, "standard": 2}
        for texts in (["a b c", "d e f", "g h i"], ["one text"]):
            status, body = await _embed(gw, texts)
            assert status == 200, body
        status, body = await _embed(gw, ["x y", "z w"], latency_class="standard")  # a class named: kept
        assert status == 200, body
        assert _by_class(gw, "minilm") == {"bulk": 1, "standard": 2}


@pytest.mark.serial  # refusal times in milliseconds
async def test_an_impossible_budget_gets_the_same_refusal_on_every_route(tmp_path):
    async with serving(_repo(tmp_path), workers_per_device=1) as gw:
        for model in ("encoder", "minilm"):
            gw.pool(model).per_batch_s = BATCH_S
        rng = np.random.default_rng(1)
        for _ in range(5):  # each bucket run often enough for its estimate to refuse work
            await gw.stub.ModelInfer(encoder_request(rng, 2, 16, {}), timeout=None)
            status, body = await _embed(gw, ["hello world"])
            assert status == 200, body
        ran = {m: len(gw.pool(m).batches) for m in ("encoder", "minilm")}
        said = []
        for _ in range(2):  # twice: the idle probe let the first through
            try:
                await gw.stub.ModelInfer(encoder_request(rng, 2, 16, {"latency_budget_ms": 5}), timeout=None)
                raise AssertionError("a 5 ms budget for a 20 ms batch must be refused")
            except grpc.aio.AioRpcError as err:
                assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                said.append(err.details())
            ids = rng.integers(0, 1000, (2, 16)).astype(np.int64)
            doc = {
                "inputs": [
                    {"name": n, "shape": [2, 16], "datatype": "INT64", "data": a.ravel().tolist()}
                    for n, a in (("input_ids", ids), ("attention_mask", np.ones_like(ids)))
                ],
                "parameters": {"latency_budget_ms": 5},
            }
            status, body = await gw.rest_infer("encoder", doc)
            assert status == 504, body
            said.append(body["error"])
            status, body = await _embed(gw, ["hello world"], latency_budget_ms=5)
            assert status == 504, body
            said.append(body["error"]["message"])
        assert all("not even an idle server could meet it" in m for m in said), said
        assert not any("dropped from the queue" in m for m in said), said
        assert {m: len(gw.pool(m).batches) for m in ("encoder", "minilm")} == ran  # nothing computed


async def test_a_tenant_that_names_a_class_keeps_it_for_calls_of_several_rows(tmp_path):
    from batchgate.gateway.admission.tenants import hash_key

    keys = {"named": "tenant-named-0123456789", "plain": "tenant-plain-0123456789"}
    path = tmp_path / "tenants.yaml"
    path.write_text(f"""
tenants:
  - name: named
    key_hashes: ["{hash_key(keys["named"])}"]
    default_class: standard
  - name: plain
    key_hashes: ["{hash_key(keys["plain"])}"]
""")
    async with serving(model_repo(tmp_path, {"encoder": ""}), api_keys_file=path) as gw:
        rng = np.random.default_rng(2)
        for who in ("named", "plain"):
            md = (("x-api-key", keys[who]),)
            await gw.stub.ModelInfer(encoder_request(rng, 4, 16, {}), metadata=md, timeout=None)
        assert _by_class(gw, "encoder") == {"standard": 1, "bulk": 1}  # named: its class; else bulk


def test_the_batch_class_deadline_is_soft_a_stated_one_firm():
    """The batch class's budget is the server's target, not the caller's: the call stated none. It
    orders the queue; the call is answered late rather than refused or dropped (on a host where 4
    callers x 32 texts of a base-size model take ~10 s a call, a bulk budget of 10 s dropped a third
    of the calls part-computed, and in a 20 s run at warm-up all of them)."""
    assert resolve({}, None, 0.0, CLASSES, "standard", _schedule(), 32, "bulk").soft
    assert not resolve({}, None, 0.0, CLASSES, "standard", _schedule(), 1, "bulk").soft  # one text
    assert not resolve({}, 5.0, 0.0, CLASSES, "standard", _schedule(), 32, "bulk").soft  # a gRPC deadline
    assert not resolve(
        {"latency_budget_ms": 9000}, None, 0.0, CLASSES, "standard", _schedule(), 32, "bulk"
    ).soft
    assert not resolve(
        {"latency_class": "bulk"}, None, 0.0, CLASSES, "standard", _schedule(), 32, "bulk"
    ).soft


def test_a_soft_deadline_is_never_refused_nor_dropped_and_still_orders_the_queue():
    from tests.test_deadlines import make_req, names, queue, trained

    q = queue(max_bs=8, latency=trained(a=0.020, b=0.0))  # every batch takes 20 ms
    firm, soft = make_req("firm", "bulk", 0.0, budget_s=0.030), make_req("soft", "bulk", 0.0, budget_s=0.030)
    soft.soft = True
    assert q.refuse([soft], 0.015, 1.0, 1) is None  # a second of work running: the firm one is refused
    assert q.refuse([firm], 0.015, 1.0, 1) is not None
    q.push([firm])
    q.push([soft])
    expired, wake = q.take_expired(0.020)  # 10 ms left, 20 ms of compute: hopeless by its deadline
    assert names(expired) == ["firm"] and wake is None  # the soft one stays, with no timer for it
    assert q.wake_at([soft]) is None
    late = make_req("later", "bulk", 0.0, budget_s=5.0)
    q.push([late])
    assert names(q.pop_batch(0.040)[0])[0] == "soft"  # its deadline still puts it first
