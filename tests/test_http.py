"""The HTTP side against the real server: health, metadata, KServe v2 REST infer (JSON and Triton's
binary tensor data extension) giving the same numbers as gRPC, and errors with the right HTTP
status and a JSON body. Plain urllib on the client side (tritonclient's HTTP client is not
installed); the translation helpers are also driven directly for BYTES, which no bundled model
takes."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as tc

from batchgate.gateway.codec import serialize_bytes
from batchgate.gateway.errors import GatewayError, Kind
from batchgate.gateway.call import Answer, Output
from batchgate.gateway.transport.kserve_rest import HEADER_LENGTH, HTTP_STATUS, build_request, build_response


def call(server, method: str, path: str, body: bytes | dict | None = None, headers: dict | None = None):
    """(status, headers, body bytes) of one HTTP request; errors are returned, not raised."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    req = urllib.request.Request(
        f"http://127.0.0.1:{server.http_port}{path}", data=data, method=method, headers=headers or {}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def get_json(server, path: str):
    status, _, body = call(server, "GET", path)
    return status, json.loads(body)


def ranker_arrays(rows: int = 3, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "dense": rng.standard_normal((rows, 64), dtype=np.float32),
        "sparse_ids": rng.integers(0, 10_000, (rows, 8), dtype=np.int64),
    }


def encoder_arrays(rows: int = 2, seq: int = 12, seed: int = 2) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    mask = np.ones((rows, seq), dtype=np.int64)
    mask[:, -3:] = 0
    return {"input_ids": rng.integers(0, 1000, (rows, seq), dtype=np.int64), "attention_mask": mask}


DATATYPE = {np.dtype(np.float32): "FP32", np.dtype(np.int64): "INT64"}


def json_body(arrays: dict[str, np.ndarray], nested: bool = False, **extra) -> dict:
    inputs = [
        {
            "name": n,
            "shape": list(a.shape),
            "datatype": DATATYPE[a.dtype],
            "data": a.tolist() if nested else a.ravel().tolist(),
        }
        for n, a in arrays.items()
    ]
    return {"inputs": inputs, **extra}


def grpc_outputs(triton, model: str, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    inputs = []
    for name, a in arrays.items():
        i = tc.InferInput(name, list(a.shape), DATATYPE[a.dtype])
        i.set_data_from_numpy(a)
        inputs.append(i)
    result = triton.infer(model, inputs)
    return {o.name: result.as_numpy(o.name) for o in result.get_response().outputs}


# -- health and metadata ------------------------------------------------------------------------


def test_health_and_server_metadata(server):
    assert get_json(server, "/v2/health/live") == (200, {"live": True})
    assert get_json(server, "/v2/health/ready") == (200, {"ready": True})
    status, meta = get_json(server, "/v2")
    assert status == 200 and meta["name"] == "batchgate"
    assert "binary_tensor_data" in meta["extensions"]


def test_model_metadata_ready_config_and_stats(server, triton):
    status, meta = get_json(server, "/v2/models/ranker")
    assert status == 200
    assert meta["versions"] == ["1"]
    assert [(i["name"], i["datatype"], i["shape"]) for i in meta["inputs"]] == [
        ("dense", "FP32", [-1, 64]),
        ("sparse_ids", "INT64", [-1, 8]),
    ]
    assert get_json(server, "/v2/models/ranker/versions/1")[1] == meta
    assert get_json(server, "/v2/models/ranker/ready") == (200, {"name": "ranker", "ready": True})
    assert get_json(server, "/v2/models/ranker/versions/1/ready")[0] == 200
    status, body = get_json(server, "/v2/models/ranker/versions/2/ready")
    assert status == 404 and "no version '2'" in body["error"]
    status, body = get_json(server, "/v2/models/nope/ready")
    assert status == 404 and "unknown model 'nope'" in body["error"]
    status, cfg = get_json(server, "/v2/models/encoder/config")
    assert status == 200 and cfg["max_batch_size"] == 64 and cfg["input"][0]["data_type"] == "TYPE_INT64"
    assert cfg["dynamic_batching"]["preferred_batch_size"] == [16, 32]
    status, stats = get_json(server, "/v2/models/ranker/stats")
    assert status == 200
    (s,) = stats["model_stats"]
    assert s["name"] == "ranker" and set(s["inference_stats"]) >= {
        "success",
        "fail",
        "queue",
        "compute_infer",
    }
    grpc_stats = triton.get_inference_statistics("ranker", "1").model_stats[0]
    assert s["execution_count"] <= grpc_stats.execution_count  # read before: it can only have grown
    status, all_stats = get_json(server, "/v2/models/stats")
    assert status == 200 and {m["name"] for m in all_stats["model_stats"]} >= {"ranker", "encoder"}
    status, _, payload = call(server, "POST", "/v2/repository/index", {"ready": True})
    assert status == 200 and {"name": "ranker", "version": "1", "state": "READY"} in json.loads(payload)


# -- inference: the same numbers as gRPC ----------------------------------------------------------


@pytest.mark.parametrize(
    "model,arrays,output",
    [("ranker", ranker_arrays(), "score"), ("encoder", encoder_arrays(), "embedding")],
    ids=["ranker", "encoder"],
)
def test_rest_json_infer_matches_grpc(server, triton, model, arrays, output):
    expected = grpc_outputs(triton, model, arrays)[output]
    for nested in (False, True):
        status, _, body = call(
            server, "POST", f"/v2/models/{model}/infer", json_body(arrays, nested, id="req-7")
        )
        assert status == 200, body
        doc = json.loads(body)
        assert doc["model_name"] == model and doc["model_version"] == "1" and doc["id"] == "req-7"
        (out,) = doc["outputs"]
        assert out["name"] == output and out["datatype"] == "FP32" and out["shape"] == list(expected.shape)
        got = np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    status, _, body = call(server, "POST", f"/v2/models/{model}/versions/1/infer", json_body(arrays))
    assert status == 200, body


@pytest.mark.parametrize(
    "model,arrays,output",
    [("ranker", ranker_arrays(4, seed=5), "score"), ("encoder", encoder_arrays(3, 8, seed=6), "embedding")],
    ids=["ranker", "encoder"],
)
def test_rest_binary_extension_matches_grpc(server, triton, model, arrays, output):
    """Inputs and outputs as binary data after the JSON header (Triton's extension)."""
    expected = grpc_outputs(triton, model, arrays)[output]
    names = list(arrays)
    # first input binary, second as JSON: the two forms mix in one request
    header = {
        "inputs": [
            {"name": names[0], "shape": list(arrays[names[0]].shape), "datatype": DATATYPE[arrays[names[0]].dtype],
             "parameters": {"binary_data_size": arrays[names[0]].nbytes}},
            {"name": names[1], "shape": list(arrays[names[1]].shape), "datatype": DATATYPE[arrays[names[1]].dtype],
             "data": arrays[names[1]].ravel().tolist()},
        ],
        "outputs": [{"name": output, "parameters": {"binary_data": True}}],
    }  # fmt: skip
    head = json.dumps(header).encode()
    status, headers, body = call(
        server, "POST", f"/v2/models/{model}/infer", head + arrays[names[0]].tobytes(),
        {HEADER_LENGTH: str(len(head)), "Content-Type": "application/octet-stream"},
    )  # fmt: skip
    assert status == 200, body
    n = int(headers[HEADER_LENGTH])
    doc = json.loads(body[:n])
    (out,) = doc["outputs"]
    assert out["parameters"]["binary_data_size"] == len(body) - n
    got = np.frombuffer(body[n:], dtype=np.float32).reshape(out["shape"])
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_binary_data_output_parameter_applies_to_every_output(server):
    body = json_body(ranker_arrays(2), parameters={"binary_data_output": True})
    status, headers, payload = call(server, "POST", "/v2/models/ranker/infer", body)
    assert status == 200 and headers["Content-Type"] == "application/octet-stream"
    n = int(headers[HEADER_LENGTH])
    assert len(payload) - n == 2 * 4  # two FP32 scores


def test_request_id_is_echoed(server):
    status, headers, _ = call(
        server, "POST", "/v2/models/ranker/infer", json_body(ranker_arrays(1)), {"x-request-id": "rest-42"}
    )
    assert status == 200 and headers["x-request-id"] == "rest-42"
    status, headers, _ = call(
        server, "POST", "/v2/models/nope/infer", json_body(ranker_arrays(1)), {"x-request-id": "rest-43"}
    )
    assert status == 404 and headers["x-request-id"] == "rest-43"


# -- errors: the gRPC refusals, as HTTP statuses ----------------------------------------------------


def _without(body: dict, key: str) -> dict:
    body = json.loads(json.dumps(body))
    del body["inputs"][0][key]
    return body


def _with_input(body: dict, **changes) -> dict:
    body = json.loads(json.dumps(body))
    body["inputs"][0].update(changes)
    return body


GOOD = json_body(ranker_arrays(2))
BAD_REQUESTS = [
    ("not json", "/v2/models/ranker/infer", b"{nope", {}, 400, "not valid JSON"),
    ("no inputs", "/v2/models/ranker/infer", {"inputs": []}, {}, 400, "'inputs' must be a non-empty list"),
    ("missing input", "/v2/models/ranker/infer", {"inputs": GOOD["inputs"][:1]}, {}, 400, "missing input(s) 'sparse_ids'"),
    ("wrong datatype", "/v2/models/ranker/infer", _with_input(GOOD, datatype="FP64"), {}, 400, "expects FP32"),
    ("wrong shape", "/v2/models/ranker/infer", _with_input(GOOD, shape=[2, 63]), {}, 400, "'data' holds 128 values"),
    ("shape vs model", "/v2/models/ranker/infer", _with_input(GOOD, shape=[4, 32]), {}, 400, "expects [-1, 64]"),
    ("no data", "/v2/models/ranker/infer", _without(GOOD, "data"), {}, 400, "neither 'data' nor a binary_data_size"),
    ("string data", "/v2/models/ranker/infer", _with_input(GOOD, data=["x"] * 128), {}, 400, "not FP32"),
    ("bytes input", "/v2/models/ranker/infer", _with_input(GOOD, datatype="BYTES", data=["a"] * 128), {}, 400, "expects FP32"),
    ("unknown output", "/v2/models/ranker/infer", {**GOOD, "outputs": [{"name": "nope"}]}, {}, 400, "no output named 'nope'"),
    ("classification", "/v2/models/ranker/infer",
     {**GOOD, "outputs": [{"name": "score", "parameters": {"classification": 2}}]}, {}, 501, "classification"),
    ("unknown model", "/v2/models/nope/infer", GOOD, {}, 404, "unknown model 'nope'"),
    ("unknown version", "/v2/models/ranker/versions/9/infer", GOOD, {}, 404, "no version '9'"),
    ("header length past body", "/v2/models/ranker/infer", json.dumps(GOOD).encode(), {HEADER_LENGTH: "99999"}, 400,
     HEADER_LENGTH),
    ("binary size past body", "/v2/models/ranker/infer",
     _with_input(_without(GOOD, "data"), parameters={"binary_data_size": 512}), {}, 400, "runs past the end"),
    ("unknown route", "/v2/nothing/here", GOOD, {}, 404, "Not Found"),
]  # fmt: skip


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_rest_requests_get_the_right_status(server, case):
    _, path, body, headers, want_status, want_text = case
    status, resp_headers, payload = call(server, "POST", path, body, headers)
    assert status == want_status, payload
    assert resp_headers["Content-Type"].startswith("application/json")
    assert want_text in json.loads(payload)["error"]


def test_model_metadata_errors_and_wrong_method(server):
    status, body = get_json(server, "/v2/models/nope")
    assert status == 404 and "unknown model" in body["error"]
    status, _, payload = call(server, "GET", "/v2/models/ranker/infer")
    assert status == 405 and "error" in json.loads(payload)


def test_every_kind_has_an_http_status():
    assert set(HTTP_STATUS) == set(Kind)
    assert (
        HTTP_STATUS[Kind.EXHAUSTED] == 429
        and HTTP_STATUS[Kind.DEADLINE] == 504
        and HTTP_STATUS[Kind.UNAVAILABLE] == 503
    )


# -- translation helpers (BYTES: no bundled model takes strings) ---------------------------------


def test_json_bytes_input_becomes_typed_bytes_values():
    body = {
        "inputs": [{"name": "text", "shape": [2], "datatype": "BYTES", "data": ["héllo", "x"]}],
        "id": "b",
    }
    call, _ = build_request("m", "", json.dumps(body).encode(), None)
    t = call.inputs[0]
    assert t.values == ["héllo".encode(), b"x"] and t.raw is None and call.id == "b"


def test_binary_input_is_a_view_of_the_body_and_json_inputs_stay_typed():
    """No protobuf between: a binary chunk is the body's own bytes (no copy), a JSON input its
    typed values, each in its own form (the protobuf rule of one form for all is gRPC's)."""
    chunk = serialize_bytes(np.array([b"ab", b""], dtype=object))
    head = json.dumps(
        {"inputs": [
            {"name": "text", "shape": [2], "datatype": "BYTES", "parameters": {"binary_data_size": len(chunk)}},
            {"name": "n", "shape": [2], "datatype": "INT32", "data": [1, 2]},
            {"name": "more", "shape": [1], "datatype": "BYTES", "data": ["z"]},
            {"name": "h", "shape": [2], "datatype": "FP16", "data": [0.5, 2]},
        ]}
    ).encode()  # fmt: skip
    body = head + chunk
    call, _ = build_request("m", "1", body, str(len(head)))
    text, n, more, h = call.inputs
    assert isinstance(text.raw, memoryview) and text.raw.obj is body and bytes(text.raw) == chunk
    assert n.values == [1, 2] and more.values == [b"z"]
    assert np.frombuffer(h.raw, np.float16).tolist() == [0.5, 2.0]  # FP16 has no typed form


@pytest.mark.parametrize(
    "datatype, value", [("INT64", 1.5), ("FP32", "1"), ("BOOL", "yes"), ("BYTES", 3), ("UINT8", None)]
)
def test_json_values_of_the_wrong_type_are_refused_by_name(datatype, value):
    body = {"inputs": [{"name": "x", "shape": [1], "datatype": datatype, "data": [value]}]}
    with pytest.raises(GatewayError) as err:
        build_request("m", "", json.dumps(body).encode(), None)
    assert err.value.kind is Kind.INVALID
    assert f"input 'x': 'data' holds a value that is not {datatype}" in err.value.message


def test_bytes_output_in_json_and_binary():
    arr = np.array([b"hi", "ünï".encode()], dtype=object)
    answer = Answer("m", "1", "", [Output("text", "BYTES", arr, True)])
    body, n = build_response(answer, {"": False})
    assert n is None and json.loads(body)["outputs"][0]["data"] == ["hi", "ünï"]
    body, n = build_response(answer, {"": True})
    assert body[n:] == serialize_bytes(arr)
    answer.outputs[0].array = np.array([b"\xff"], dtype=object)
    with pytest.raises(GatewayError) as err:
        build_response(answer, {"": False})
    assert err.value.kind is Kind.INVALID and "binary_data" in err.value.message


def test_parameters_pass_through_typed():
    body = {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}],
            "parameters": {"latency_budget_ms": 25, "latency_class": "realtime", "flag": True, "w": 0.5}}  # fmt: skip
    call, _ = build_request("m", "", json.dumps(body).encode(), None)
    assert call.parameters == {"latency_budget_ms": 25, "latency_class": "realtime", "flag": True, "w": 0.5}
    assert type(call.parameters["flag"]) is bool


# -- tenants: the same admission as gRPC, as HTTP statuses -----------------------------------------


def test_auth_and_rate_limits_over_rest(tmp_path):
    from batchgate.gateway.admission.tenants import hash_key
    from tests.conftest import start_server
    from tests.test_metrics import scrape, value

    key = "k-" + "7" * 40
    tenants = {"tenants": [{
        "name": "t", "key_hashes": [hash_key(key)], "models": ["ranker"],
        "limits": {"requests_per_s": 0.2, "requests_burst": 1},
    }]}  # fmt: skip
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps(tenants))
    srv = start_server(tmp_path, "--api-keys-file", str(path))
    try:
        body = json_body(ranker_arrays(1))
        status, _, payload = call(srv, "POST", "/v2/models/ranker/infer", body)
        assert status == 401, payload
        status, _, payload = call(srv, "POST", "/v2/models/ranker/infer", body, {"x-api-key": "wrong"})
        assert status == 401, payload
        status, _, payload = call(
            srv, "POST", "/v2/models/encoder/infer", json_body(encoder_arrays()), {"x-api-key": key}
        )
        assert status == 403, payload
        auth = {"authorization": f"Bearer {key}", "x-request-id": "limited-1"}
        status, _, payload = call(srv, "POST", "/v2/models/ranker/infer", body, auth)
        assert status == 200, payload
        status, headers, payload = call(srv, "POST", "/v2/models/ranker/infer", body, auth)
        assert status == 429, payload
        assert int(headers["Retry-After"]) >= 1 and float(headers["retry-after-ms"]) > 0
        assert headers["x-request-id"] == "limited-1" and "error" in json.loads(payload)
        s = scrape(srv)
        ranker = {"model": "ranker", "version": "1", "transport": "http"}
        assert value(s, "batchgate_requests_total", **ranker, outcome="unauthenticated") == 2
        assert (
            value(
                s,
                "batchgate_requests_total",
                model="encoder",
                version="1",
                transport="http",
                outcome="permission_denied",
            )
            == 1
        )
        assert value(s, "batchgate_requests_total", **ranker, outcome="rate_limited") == 1
        assert value(s, "batchgate_requests_total", **ranker, outcome="success") == 1
    finally:
        srv.stop()


def test_rest_bytes_input_matches_grpc_on_minilm(server, triton):
    """BYTES over REST, JSON strings and binary: the text model, when this checkout has built it."""
    if call(server, "GET", "/v2/models/minilm/ready")[0] != 200:
        pytest.skip("minilm is not built here (batchgate prepare-minilm)")
    texts = ["a quick brown fox", "héllo wörld"]
    arr = np.array([[t.encode()] for t in texts], dtype=object)
    inp = tc.InferInput("text", [2, 1], "BYTES")
    inp.set_data_from_numpy(arr)
    expected = triton.infer("minilm", [inp]).as_numpy("embedding")
    body = {"inputs": [{"name": "text", "shape": [2, 1], "datatype": "BYTES", "data": texts}]}
    status, _, payload = call(server, "POST", "/v2/models/minilm/infer", body)
    assert status == 200, payload
    (out,) = json.loads(payload)["outputs"]
    np.testing.assert_allclose(
        np.asarray(out["data"], np.float32).reshape(out["shape"]), expected, rtol=1e-4, atol=1e-5
    )
    chunk = serialize_bytes(arr)
    head = json.dumps(
        {
            "inputs": [
                {
                    "name": "text",
                    "shape": [2, 1],
                    "datatype": "BYTES",
                    "parameters": {"binary_data_size": len(chunk)},
                }
            ]
        }
    ).encode()
    status, _, payload = call(
        server, "POST", "/v2/models/minilm/infer", head + chunk, {HEADER_LENGTH: str(len(head))}
    )
    assert status == 200, payload
    (out,) = json.loads(payload)["outputs"]
    np.testing.assert_allclose(
        np.asarray(out["data"], np.float32).reshape(out["shape"]), expected, rtol=1e-4, atol=1e-5
    )


def test_a_wrong_method_names_the_allowed_ones_and_ready_must_be_a_bool(server):
    status, headers, body = call(server, "DELETE", "/v2/repository/index")
    assert status == 405 and "POST" in headers.get("Allow", ""), headers
    assert json.loads(body)["error"]
    status, _, body = call(server, "POST", "/v2/repository/index", {"ready": -13941})
    assert status == 400 and "ready" in json.loads(body)["error"], body
