"""Tenants: the tenant file (schema, hashes, mistakes it refuses), reading the key from metadata,
and authentication, permissions and limits through the real server in-process (tests/harness.py)
with stock and raw clients; a bad tenant file against the real process."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException

from batchgate.gateway.admission import Admission
from batchgate.gateway.config import Settings
from batchgate.gateway.admission.tenants import (
    TenantFileError,
    generate_key,
    hash_key,
    load_tenants,
    parse_tenants,
    presented_key,
)
from batchgate.proto.inference.v2 import grpc_service_pb2 as pb
from tests.conftest import ROOT
from tests.harness import model_repo, serving

ALPHA, BETA, TIGHT, SOLO = (
    "alpha-0123456789abcdef",
    "beta-0123456789abcdef",
    "tight-0123456789ab",
    "solo-0123456789ab",
)

TENANT_YAML = f"""
# keys below are hashes; the clear keys live only in this test
tenants:
  - name: alpha
    key_hashes: ["{hash_key(ALPHA)}"]
    models: [ranker]
    default_class: realtime
    cache_namespace: alpha
    limits: {{rows_per_s: 100000, rows_burst: 64}}
  - name: beta
    key_hashes: ["{hash_key(BETA)}", "{hash_key("beta-second-key-000000")}"]
    models: "*"
  - name: tight
    key_hashes: ["{hash_key(TIGHT)}"]
    limits: {{requests_per_s: 0.5, requests_burst: 2}}
  - name: solo
    key_hashes: ["{hash_key(SOLO)}"]
    models: [ranker]
    limits: {{max_in_flight: 1}}
"""

# -- the file -------------------------------------------------------------------------------------


def test_yaml_file_loads_with_defaults(tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text(TENANT_YAML)
    tenants = {t.name: t for t in load_tenants(path)}
    alpha = tenants["alpha"]
    assert alpha.models == frozenset({"ranker"})
    assert alpha.allows("ranker") and not alpha.allows("encoder")
    assert (alpha.default_class, alpha.cache_namespace) == ("realtime", "alpha")
    assert alpha.limits.rows.burst == 64 and alpha.limits.requests is None
    assert tenants["beta"].models is None and tenants["beta"].allows("anything")
    assert len(tenants["beta"].key_hashes) == 2
    tight = tenants["tight"].limits.requests
    assert (tight.per_s, tight.burst) == (0.5, 2)
    assert tenants["solo"].limits.max_in_flight == 1
    assert tenants["beta"].default_class is None and tenants["beta"].cache_namespace is None


def test_json_file_and_burst_defaults_to_one_second(tmp_path):
    path = tmp_path / "tenants.json"
    doc = {
        "tenants": [
            {
                "name": "j",
                "key_hashes": [hash_key("k" * 20).removeprefix("sha256:").upper()],  # bare hex, any case
                "global_limits": {"requests_per_s": 250, "rows_per_s": 0.5},
                "model_limits": {"encoder": {"global_limits": {"requests_per_s": 5}}},
            }
        ]
    }
    path.write_text(json.dumps(doc))
    (t,) = load_tenants(path)
    assert t.global_limits.requests.burst == 250
    assert t.global_limits.rows.burst == 1  # at least one, even for fractional rates
    _, glob = t.limits_for("encoder")
    assert glob.requests.per_s == 5 and glob.rows.per_s == 0.5  # merged field by field
    assert t.limits_for("ranker")[1].requests.per_s == 250


@pytest.mark.parametrize(
    "tenant, expected",
    [
        ({"name": "x", "key_hashes": ["my-secret-key"]}, "64 hex digits"),
        ({"name": "x", "key_hashes": []}, "key_hashes"),
        ({"name": "x", "key_hashes": [hash_key("a")], "limit": {}}, "limit"),
        ({"name": "x y", "key_hashes": [hash_key("a")]}, "name"),
        ({"name": "x", "key_hashes": [hash_key("a")], "limits": {"requests_burst": 5}}, "requests_burst needs"),
        ({"name": "x", "key_hashes": [hash_key("a")], "limits": {"requests_per_s": 0}}, "greater than 0"),
        ({"name": "x", "key_hashes": [hash_key("a")], "global_limits": {"max_in_flight": 3}}, "per replica"),
        ({"name": "x", "key_hashes": [hash_key("a")], "models": ["ranker"], "model_limits": {"encoder": {}}},
         "may not call: ['encoder']"),
    ],
)  # fmt: skip
def test_mistakes_are_refused_with_where_and_how(tenant, expected):
    with pytest.raises(TenantFileError) as e:
        parse_tenants({"tenants": [tenant]})
    assert expected in str(e.value)
    assert "my-secret-key" not in str(e.value)  # a key pasted in clear is never echoed


def test_duplicates_and_empty_files_are_refused(tmp_path):
    a = {"name": "a", "key_hashes": [hash_key("same")]}
    with pytest.raises(TenantFileError, match="both 'a' and 'b'"):
        parse_tenants({"tenants": [a, {"name": "b", "key_hashes": [hash_key("same")]}]})
    with pytest.raises(TenantFileError, match="defined twice"):
        parse_tenants({"tenants": [a, {"name": "a", "key_hashes": [hash_key("other")]}]})
    with pytest.raises(TenantFileError, match="tenants"):
        parse_tenants({"tenants": []})  # an empty secret must not silently open the server
    with pytest.raises(TenantFileError, match="cannot read"):
        load_tenants(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("tenants: [unclosed")
    with pytest.raises(TenantFileError, match="not valid YAML"):
        load_tenants(bad)


def test_key_from_metadata_both_styles():
    assert presented_key([("x-api-key", " k1 ")]) == "k1"
    assert presented_key([("authorization", "Bearer k2")]) == "k2"
    assert presented_key([("authorization", "bearer   k3")]) == "k3"
    assert presented_key([("user-agent", "x"), ("authorization", "Basic a2V5"), ("x-api-key", "k4")]) == "k4"
    assert presented_key([("authorization", "Bearer ")]) is None
    assert presented_key([]) is None and presented_key(None) is None


def test_generated_keys_are_random_and_hash_stably():
    a, b = generate_key(), generate_key()
    assert a != b and len(a) > 40
    assert hash_key(a) == hash_key(a) and hash_key(a).startswith("sha256:") and len(hash_key(a)) == 7 + 64


def test_hash_key_cli_reads_stdin(monkeypatch, capsys):
    from batchgate.gateway.cli import main

    monkeypatch.setattr(sys, "stdin", io.StringIO("secret\n"))
    assert main(["hash-key"]) == 0
    assert capsys.readouterr().out.strip() == hash_key("secret")
    assert main(["hash-key", "--generate"]) == 0
    key, digest = capsys.readouterr().out.split()
    assert hash_key(key) == digest


def test_no_tenant_file_is_an_open_server():
    adm = Admission.from_settings(Settings())
    assert adm.open and adm.limiter is None


def test_a_bad_tenant_file_stops_the_server_with_its_reason(tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text('tenants:\n  - name: x\n    key_hashes: ["clear-text-key"]\n')
    out = subprocess.run(
        [sys.executable, "-m", "batchgate", "serve", "--api-keys-file", str(path), "--grpc-port", "0", "--http-port",
         "0", "--host", "127.0.0.1"],
        capture_output=True, text=True, cwd=ROOT, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 1
    assert "key_hashes" in out.stderr and "hash-key" in out.stderr
    assert "clear-text-key" not in out.stderr


# -- through the real server, in-process (tests/harness.py: the transports, the door and the
# pipeline as served, over a fake pool that records what it computes) -----------------------------


@contextlib.asynccontextmanager
async def keyed(tmp_path, **settings):
    path = tmp_path / "tenants.yaml"
    path.write_text(TENANT_YAML)
    async with serving(model_repo(tmp_path), api_keys_file=path, **settings) as gw:
        yield gw


def ranker(rows: int = 2, model: str = "ranker") -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name=model, id="t")
    req.inputs.add(name="dense", datatype="FP32", shape=[rows, 64])
    req.inputs.add(name="sparse_ids", datatype="INT64", shape=[rows, 8])
    req.raw_input_contents.append(np.zeros((rows, 64), np.float32).tobytes())
    req.raw_input_contents.append(np.ones((rows, 8), np.int64).tobytes())
    return req


def encoder(rows: int = 2) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name="encoder")
    req.inputs.add(name="input_ids", datatype="INT64", shape=[rows, 8])
    req.inputs.add(name="attention_mask", datatype="INT64", shape=[rows, 8])
    req.raw_input_contents.append(np.ones((rows, 8), np.int64).tobytes())
    req.raw_input_contents.append(np.ones((rows, 8), np.int64).tobytes())
    return req


async def code_of(stub, req, metadata=(), timeout=10.0, details: list | None = None) -> grpc.StatusCode:
    try:
        await stub.ModelInfer(req, metadata=metadata, timeout=timeout)
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as exc:
        if details is not None:
            details.append(exc.details())
        return exc.code()


async def refused(stub, req, metadata=()) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.ModelInfer(req, metadata=metadata, timeout=10)
    return e.value


async def test_no_key_is_unauthenticated(tmp_path):
    async with keyed(tmp_path) as gw:
        err = await refused(gw.stub, ranker())
        assert gw.pool("ranker").batches == []
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "x-api-key" in err.details()


async def test_wrong_key_is_unauthenticated_without_echo(tmp_path):
    async with keyed(tmp_path) as gw:
        for md in ((("x-api-key", "wrong-key-123"),), (("authorization", "Bearer wrong-key-123"),),
                   (("authorization", f"Basic {ALPHA}"),)):  # fmt: skip
            err = await refused(gw.stub, ranker(), md)
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED, md
            assert "wrong-key" not in err.details() and ALPHA not in err.details()


async def test_unknown_model_needs_a_key_first(tmp_path):
    async with keyed(tmp_path) as gw:
        assert await code_of(gw.stub, ranker(model="nope")) == grpc.StatusCode.UNAUTHENTICATED
        assert (
            await code_of(gw.stub, ranker(model="nope"), (("x-api-key", BETA),)) == grpc.StatusCode.NOT_FOUND
        )


async def test_key_for_another_model_is_permission_denied(tmp_path):
    async with keyed(tmp_path) as gw:
        err = await refused(gw.stub, encoder(), (("x-api-key", ALPHA),))
        assert gw.pool("encoder").batches == []
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "alpha" in err.details() and "encoder" in err.details()


async def test_valid_key_both_header_styles(tmp_path):
    async with keyed(tmp_path) as gw:
        resp = await gw.stub.ModelInfer(ranker(), metadata=(("x-api-key", ALPHA),), timeout=10)
        assert resp.outputs[0].name == "score" and list(resp.outputs[0].shape) == [2, 1]
        await gw.stub.ModelInfer(ranker(), metadata=(("authorization", f"Bearer {ALPHA}"),), timeout=10)
        await gw.stub.ModelInfer(encoder(), metadata=(("authorization", f"Bearer {BETA}"),), timeout=10)
        await gw.stub.ModelInfer(encoder(), metadata=(("x-api-key", "beta-second-key-000000"),), timeout=10)


async def test_stock_triton_client_with_headers(tmp_path):
    import tritonclient.grpc.aio as tca

    async with keyed(tmp_path) as gw:
        client = tca.InferenceServerClient(gw.grpc_url)
        try:
            x = tc.InferInput("dense", [3, 64], "FP32")
            x.set_data_from_numpy(np.ones((3, 64), np.float32))
            ids = tc.InferInput("sparse_ids", [3, 8], "INT64")
            ids.set_data_from_numpy(np.zeros((3, 8), np.int64))
            # a deadline of its own: alpha's default class is realtime (25 ms), which a loaded
            # machine's loop lag alone can use up on a server's first call (this test is about headers)
            out = await client.infer(
                "ranker", [x, ids], headers={"authorization": f"Bearer {ALPHA}"}, client_timeout=30
            )
            assert out.as_numpy("score").shape == (3, 1)
            with pytest.raises(InferenceServerException) as e:
                await client.infer("ranker", [x, ids])
            assert "UNAUTHENTICATED" in str(e.value.status())
            assert await client.is_server_ready()  # health and metadata stay open for probes and clients
            assert (await client.get_model_metadata("ranker")).name == "ranker"
        finally:
            await client.close()


async def test_rate_limited_with_retry_after(tmp_path):
    async with keyed(tmp_path) as gw:
        md = (("x-api-key", TIGHT),)
        codes = []
        for _ in range(3):
            try:
                await gw.stub.ModelInfer(ranker(1), metadata=md, timeout=10)
                codes.append(grpc.StatusCode.OK)
            except grpc.aio.AioRpcError as exc:
                codes.append(exc.code())
                trailing = dict(exc.trailing_metadata())
                retry_ms = int(trailing["retry-after-ms"])
                assert 0 < retry_ms <= 2000
                assert f"retry after {retry_ms} ms" in exc.details()
        computed = gw.pool("ranker").rows_computed
    assert codes == [grpc.StatusCode.OK, grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert computed == 2  # the limited call's row never reached the engine


async def test_more_rows_than_the_rows_burst_is_invalid(tmp_path):
    async with keyed(tmp_path) as gw:
        md = (("x-api-key", ALPHA),)
        await gw.stub.ModelInfer(ranker(64), metadata=md, timeout=10)
        err = await refused(gw.stub, ranker(65), md)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "at most 64 rows" in err.details()


async def test_stream_checks_the_key_once_and_limits_per_request(tmp_path):
    async with keyed(tmp_path) as gw:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            [a async for a in gw.stub.ModelStreamInfer(iter([ranker()]), timeout=10)]
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        call = gw.stub.ModelStreamInfer(
            iter([ranker(), encoder()]), metadata=(("x-api-key", ALPHA),), timeout=10
        )
        errors = sorted([a.error_message async for a in call])
        assert errors[0] == "" and "may not call model 'encoder'" in errors[1]
        call = gw.stub.ModelStreamInfer(iter([ranker(1) for _ in range(4)]), metadata=(("x-api-key", TIGHT),),
                                        timeout=10)  # fmt: skip
        limited = [a.error_message async for a in call if a.error_message]
        assert limited and all("retry after" in m for m in limited)


async def test_in_flight_cap_and_slots_come_back_after_errors_and_cancels(tmp_path):
    async with keyed(tmp_path) as gw:
        gw.pool("ranker").per_batch_s = 0.01  # calls overlap: one is in flight while the others arrive
        stub, md = gw.stub, (("x-api-key", SOLO),)
        results = await asyncio.gather(*(code_of(stub, ranker(2), md) for _ in range(16)))
        assert grpc.StatusCode.OK in results and grpc.StatusCode.RESOURCE_EXHAUSTED in results
        # bad input (rejected after admission), and calls whose deadline passes mid-flight
        bad = ranker(2)
        bad.raw_input_contents[0] = b"\0" * 10
        for _ in range(5):
            assert await code_of(stub, bad, md) == grpc.StatusCode.INVALID_ARGUMENT
        for _ in range(20):
            await code_of(stub, ranker(2), md, timeout=0.0005)
        # every slot was given back: one at a time, all admitted
        why: list[str] = []
        codes = [await code_of(stub, ranker(2), md, details=why) for _ in range(10)]
        assert codes == [grpc.StatusCode.OK] * 10, why


# -- what a tenant's settings do ----------------------------------------------------------------------


async def test_cache_namespace_separates_tenants_rows_and_default_class_is_their_budget(tmp_path):
    """Two tenants sending the same rows: the one with its own namespace is never answered from the
    other's cached rows (the engine computes them again), two keys of one namespace share them; each
    tenant's calls are scheduled in its default class (the scheduler's per-class counts)."""
    keys = {"a1": "ns-a-first-0123456789", "a2": "ns-a-second-0123456789", "b": "ns-b-only-0123456789"}
    path = tmp_path / "tenants.yaml"
    path.write_text(f"""
tenants:
  - name: a
    key_hashes: ["{hash_key(keys["a1"])}", "{hash_key(keys["a2"])}"]
    cache_namespace: team-a
    default_class: bulk
  - name: b
    key_hashes: ["{hash_key(keys["b"])}"]
    cache_namespace: team-b
""")
    repo = model_repo(tmp_path, {"ranker": "response_cache { enable: true }\n"})
    async with serving(repo, api_keys_file=path, cache_tiers="memory") as gw:
        pool = gw.pool("ranker")

        async def stats():
            s = (await gw.statistics("ranker", metadata=(("x-api-key", keys["a1"]),))).inference_stats
            return s.cache_hit.count, s.cache_miss.count

        req = ranker(3)
        answers = {}
        seen = []
        computed = []
        for who in ("a1", "a1", "b", "a2", "b"):
            resp = await gw.stub.ModelInfer(req, metadata=(("x-api-key", keys[who]),), timeout=10)
            answers[who] = resp.raw_output_contents[0]
            seen.append(await stats())
            computed.append(pool.rows_computed)
        classes = {
            s.labels["class"]: s.value
            for s in await gw.metrics()
            if s.name == "batchgate_class_requests_total" and s.labels.get("model") == "ranker"
            and s.labels.get("outcome") == "success"
        }  # fmt: skip
    # (hits, misses) after each call: a1 computes; a1 hits; b misses (its own namespace); a2 hits
    # (a1's namespace); b hits its own row
    assert seen == [(0, 1), (1, 1), (1, 2), (2, 2), (3, 2)], seen
    # rows the engine ran (the call's three rows are identical: one is computed): a's, then b's own
    assert computed == [1, 1, 2, 2, 2], computed
    assert len(set(answers.values())) == 1  # the same model, the same answer
    # a's default class is bulk, b has none: the server's default (standard)
    assert classes == {"realtime": 0, "bulk": 1, "standard": 1}, classes  # every class is exported


@pytest.mark.serial
async def test_a_revoked_key_is_refused_within_seconds_without_a_restart(tmp_path, caplog):
    keys = {
        "old": "revoked-soon-0123456789",
        "kept": "kept-key-0123456789ab",
        "new": "added-later-0123456789",
    }

    def write(names: list[str], text: str | None = None) -> None:
        tmp = tmp_path / "tenants.next"
        tmp.write_text(text if text is not None else "tenants:\n" + "".join(
            f'  - name: {n}\n    key_hashes: ["{hash_key(keys[n])}"]\n' for n in names
        ))  # fmt: skip
        tmp.replace(tmp_path / "tenants.yaml")  # one rename, as a mounted Secret's update swaps a link

    write(["old", "kept"])
    caplog.set_level(logging.INFO, logger="batchgate")
    async with serving(
        model_repo(tmp_path), api_keys_file=tmp_path / "tenants.yaml", tenants_reload_s=0.2
    ) as gw:

        async def code(who: str) -> grpc.StatusCode:
            return await code_of(gw.stub, ranker(1), (("x-api-key", keys[who]),))

        assert (await code("old"), await code("kept"), await code("new")) == (
            grpc.StatusCode.OK, grpc.StatusCode.OK, grpc.StatusCode.UNAUTHENTICATED,
        )  # fmt: skip
        write(["kept", "new"])
        t0 = time.monotonic()
        while await code("old") == grpc.StatusCode.OK and time.monotonic() - t0 < 10:
            await asyncio.sleep(0.1)
        took = time.monotonic() - t0
        assert await code("old") == grpc.StatusCode.UNAUTHENTICATED
        assert (await code("kept"), await code("new")) == (grpc.StatusCode.OK, grpc.StatusCode.OK)
        assert took < 2.0, took
        # a file that does not parse changes nothing: the tenants read before stay
        write([], text="tenants: [")
        await asyncio.sleep(1.0)
        assert (await code("kept"), await code("new"), await code("old")) == (
            grpc.StatusCode.OK, grpc.StatusCode.OK, grpc.StatusCode.UNAUTHENTICATED,
        )  # fmt: skip
    assert "cannot be used (the previous tenants stay)" in caplog.text
    print(f"revoked key refused {took:.2f} s after the file changed (checked every 0.2 s)")
