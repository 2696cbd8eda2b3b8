"""OpenAI ``/v1/embeddings`` + ``/v1/models`` and TEI ``/embed`` against a live server, driven by
the official ``openai`` SDK and plain HTTP, each vector compared with the KServe path's
(tritonclient over gRPC, the same texts in the same request shape): identical, bit for bit.

One server with a tenant file, so every call also goes through authentication and limits."""

from __future__ import annotations

import base64
import json
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import openai
import pytest
import tritonclient.grpc as tc
from tokenizers import Tokenizer

from batchgate.gateway.text import TextStage
from batchgate.gateway.repository import load_model
from batchgate.gateway.admission.tenants import hash_key
from batchgate.proto.inference.v2 import grpc_service_pb2 as pb
from batchgate.proto.inference.v2 import grpc_service_pb2_grpc as pb_grpc
from tests.conftest import REPO, start_server

FULL, TIGHT, RANKER_ONLY = "full-0123456789abcdef", "tight-0123456789abcd", "ranker-0123456789abcd"
ONCE = "once-0123456789abcdef-once"  # one request, ever (within the test)
ONCE_MORE = "once-more-0123456789abcdef"  # the same, for the 2,048-text call
TENANTS = f"""
tenants:
  - name: full
    key_hashes: ["{hash_key(FULL)}"]
    models: "*"
  - name: tight
    key_hashes: ["{hash_key(TIGHT)}"]
    limits: {{requests_per_s: 0.01, requests_burst: 1}}
  - name: ranker-only
    key_hashes: ["{hash_key(RANKER_ONLY)}"]
    models: [ranker]
  - name: once
    key_hashes: ["{hash_key(ONCE)}"]
    limits: {{requests_per_s: 0.001, requests_burst: 1}}
  - name: once-more
    key_hashes: ["{hash_key(ONCE_MORE)}"]
    limits: {{requests_per_s: 0.001, requests_burst: 1}}
"""

LONG = " ".join(["the quick brown fox jumps over the lazy dog near the river bank"] * 40)  # > 256 tokens
TEXTS = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "Café au lait, s'il vous plaît — 東京タワー 🗼",
    LONG,
    "Short.",
]


def _variant(repo: Path, src: Path, name: str, extra: str) -> None:
    d = repo / name
    (d / "1").mkdir(parents=True)
    (d / "1" / "model.onnx").symlink_to(src / "1" / "model.onnx")
    shutil.copy(src / "tokenizer.json", d / "tokenizer.json")
    config = (src / "config.pbtxt").read_text().splitlines()
    lines = [f'name: "{name}"' if ln.startswith("name:") else ln for ln in config]
    (d / "config.pbtxt").write_text("\n".join(lines) + "\n" + extra)


@pytest.fixture(scope="module")
def repo(minilm_dir, tmp_path_factory) -> Path:
    repo = tmp_path_factory.mktemp("embed-repo")
    (repo / "ranker").symlink_to(REPO / "ranker")
    (repo / "minilm").symlink_to(minilm_dir)
    _variant(repo, minilm_dir, "minilm_cached", "response_cache { enable: true }\n")
    return repo


@pytest.fixture(scope="module")
def srv(repo, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("embed-server")
    (tmp / "tenants.yaml").write_text(TENANTS)
    s = start_server(tmp, "--no-build-models", "--api-keys-file", str(tmp / "tenants.yaml"), repo=repo)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def base(srv) -> str:
    return f"http://127.0.0.1:{srv.http_port}"


@pytest.fixture(scope="module")
def oai(base):
    return openai.OpenAI(base_url=base + "/v1", api_key=FULL, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def triton(srv):
    c = tc.InferenceServerClient(srv.grpc_url)
    yield c
    c.close()


@pytest.fixture(scope="module")
def tokenizer(minilm_dir):
    tok = Tokenizer.from_file(str(minilm_dir / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    return tok


@pytest.fixture(scope="module")
def stage(minilm_dir) -> TextStage:
    return TextStage(load_model(minilm_dir)[0])


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal as the same rows through the same path: the measured batch limit (scheduling/latency.py)
    may split one call's rows into other batches than the next call's, which moves a value by a
    float32 rounding step, never more."""
    return a.shape == b.shape and float(np.abs(a - b).max()) <= 1e-6


def kserve(triton, texts: list[str], model: str = "minilm") -> np.ndarray:
    """One KServe request (tritonclient, BYTES [n, 1]) holding ``texts``."""
    arr = np.array([[t.encode()] for t in texts], dtype=object)
    inp = tc.InferInput("text", list(arr.shape), "BYTES")
    inp.set_data_from_numpy(arr)
    return triton.infer(model, [inp], headers={"authorization": f"Bearer {FULL}"}).as_numpy("embedding")


def post(url: str, body, key: str | None = FULL, headers: dict | None = None) -> tuple[int, dict, object]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    h = {"Content-Type": "application/json", **(headers or {})}
    if key:
        h["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=data, headers=h, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


# -- OpenAI -----------------------------------------------------------------------------------------


def test_float_many_texts_equal_the_kserve_path_and_usage_counts_real_tokens(oai, triton, tokenizer, stage):
    resp = oai.embeddings.create(
        model="minilm", input=TEXTS, encoding_format="float", extra_body={"truncate": True}
    )
    got = np.array([d.embedding for d in resp.data], dtype=np.float32)
    assert [d.index for d in resp.data] == list(range(len(TEXTS)))
    assert resp.model == "minilm" and resp.object == "list" and resp.data[0].object == "embedding"
    # the scheduler splits its rows by length, as it does any KServe request's
    assert same(got, kserve(triton, TEXTS))
    # and the same texts as a KServe request each (batches of other lengths pad differently, so
    # equal to float rounding, not bit for bit)
    single = np.concatenate([kserve(triton, [t]) for t in TEXTS])
    assert np.abs(got - single).max() < 1e-5
    expected = sum(min(len(e.ids), 256) for e in tokenizer.encode_batch(TEXTS))  # minilm truncates at 256
    assert resp.usage.prompt_tokens == resp.usage.total_tokens == expected
    assert expected > 256 + 5 * 3  # the long text counted as what the model saw


def test_base64_one_string_equals_the_kserve_path(oai, triton, stage):
    resp = oai.embeddings.create(model="minilm", input=TEXTS[0], encoding_format="base64")
    raw = resp.data[0].embedding
    assert isinstance(raw, str)  # the SDK hands base64 back untouched when asked for it
    vec = np.frombuffer(base64.b64decode(raw), dtype="<f4")
    assert vec.shape == (384,) and same(vec, kserve(triton, [TEXTS[0]])[0])
    # the SDK's own default (encoding_format omitted: base64 on the wire, decoded by the SDK)
    default = oai.embeddings.create(model="minilm", input=TEXTS[:2])
    vectors = np.array([d.embedding for d in default.data], np.float32)
    assert same(vectors, kserve(triton, TEXTS[:2]))


def test_float_one_string_and_more_texts_than_max_batch_size(oai, triton):
    one = oai.embeddings.create(model="minilm", input="Short.", encoding_format="float")
    assert len(one.data) == 1
    assert same(np.float32(one.data[0].embedding), kserve(triton, ["Short."])[0])
    texts = [f"sentence number {i} about batching" for i in range(100)]  # 64 + 36: two KServe requests
    resp = oai.embeddings.create(model="minilm", input=texts, encoding_format="float")
    got = np.array([d.embedding for d in resp.data], dtype=np.float32)
    assert same(got, np.concatenate([kserve(triton, texts[:64]), kserve(triton, texts[64:])]))


def test_unknown_model_is_404_with_openais_error_json(oai, base):
    with pytest.raises(openai.NotFoundError) as e:
        oai.embeddings.create(model="no-such-model", input="hi")
    assert e.value.status_code == 404 and e.value.code == "model_not_found"
    status, _, body = post(base + "/v1/embeddings", {"model": "no-such-model", "input": "hi"})
    assert status == 404 and set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", "model", "model_not_found")
    assert "no-such-model" in err["message"]


@pytest.mark.parametrize(
    "body, param, needle",
    [
        ({"model": "minilm", "input": "x", "dimensions": 128}, "dimensions", "384"),
        ({"model": "minilm", "input": "x", "encoding_format": "int8"}, "encoding_format", "'float' or"),
        ({"model": "minilm", "input": [1, 2, 99999999]}, "input", "not an id of cl100k_base"),
        ({"model": "minilm", "input": []}, "input", "empty list"),
        ({"model": "minilm", "input": ["ok", ""]}, "input", "input 1: text is empty"),
        ({"model": "minilm", "input": ["ok", 5]}, "input", "'input[1]' must be a string"),
        ({"model": "minilm"}, "input", "'input' is required"),
        ({"model": "ranker", "input": "x"}, "model", "does not take text"),
        ({"model": "minilm", "input": "x", "temperature": 1}, "temperature", "unrecognized"),
        ({"model": "minilm", "input": "x", "latency_class": "urgent"}, None, "latency_class"),
    ],
)
def test_bad_requests_are_400_naming_the_field(base, body, param, needle):
    status, _, resp = post(base + "/v1/embeddings", body)
    assert status == 400, resp
    assert resp["error"]["param"] == param and needle in resp["error"]["message"], resp
    assert resp["error"]["type"] == "invalid_request_error"


def test_dimensions_equal_to_the_models_and_user_are_accepted(oai):
    resp = oai.embeddings.create(
        model="minilm", input="x", dimensions=384, user="someone", encoding_format="float"
    )
    assert len(resp.data[0].embedding) == 384


def test_models_lists_the_text_models_the_key_may_call(oai, base):
    ids = sorted(m.id for m in oai.models.list())
    assert ids == ["minilm", "minilm_cached"]  # not the ranker: it takes no text
    assert oai.models.retrieve("minilm").id == "minilm"
    ranker_only = openai.OpenAI(base_url=base + "/v1", api_key=RANKER_ONLY, max_retries=0)
    assert list(ranker_only.models.list()) == []


def test_auth_limits_and_permissions_are_the_kserve_paths(base):
    no_key = openai.OpenAI(base_url=base + "/v1", api_key="wrong-key-000000000000", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        no_key.embeddings.create(model="minilm", input="x")
    assert e.value.status_code == 401 and "invalid API key" in e.value.message
    # an unauthenticated caller learns nothing about which models exist
    with pytest.raises(openai.AuthenticationError):
        no_key.embeddings.create(model="no-such-model", input="x")
    status, _, body = post(base + "/v1/embeddings", {"model": "minilm", "input": "x"}, key=None)
    assert status == 401 and "missing API key" in body["error"]["message"]

    with pytest.raises(openai.PermissionDeniedError) as e:
        openai.OpenAI(base_url=base + "/v1", api_key=RANKER_ONLY, max_retries=0).embeddings.create(
            model="minilm", input="x"
        )
    assert "may not call model 'minilm'" in e.value.message

    tight = openai.OpenAI(base_url=base + "/v1", api_key=TIGHT, max_retries=0)
    # the burst of 1: one call of many texts of many lengths is one request against the limit
    assert len(
        tight.embeddings.create(model="minilm", input=TEXTS, extra_body={"truncate": True}).data
    ) == len(TEXTS)
    with pytest.raises(openai.RateLimitError) as e:
        tight.embeddings.create(model="minilm", input="x")
    assert e.value.status_code == 429 and e.value.code == "rate_limit_exceeded"
    assert int(e.value.response.headers["Retry-After"]) >= 1 and "retry-after-ms" in e.value.response.headers


def test_latency_class_header_and_field_reach_the_scheduler(base):
    url = base + "/v1/embeddings"
    status, _, body = post(url, {"model": "minilm", "input": "x"}, headers={"X-Latency-Class": "nope"})
    assert status == 400 and "parameter 'latency_class' is 'nope'" in body["error"]["message"]
    status, _, body = post(url, {"model": "minilm", "input": "x", "latency_class": "bulk"})
    assert status == 200, body
    # a budget under the floor is invalid input naming where it came from
    status, _, body = post(url, {"model": "minilm", "input": "x"}, headers={"X-Latency-Budget-Ms": "0.001"})
    assert status == 400 and body["error"]["param"] == "X-Latency-Budget-Ms", body
    status, _, body = post(url, {"model": "minilm", "input": "x", "latency_budget_ms": 0.001})
    assert status == 400 and body["error"]["param"] == "latency_budget_ms", body
    # the floor itself, less than minilm's compute, is shed or expires: the header reached the scheduler
    status, _, body = post(url, {"model": "minilm", "input": "x"}, headers={"X-Latency-Budget-Ms": "1"})
    assert status == 504 and body["error"]["code"] == "deadline_exceeded", body


def test_result_cache_answers_repeated_texts(oai, srv):
    def hits() -> int:
        with grpc.insecure_channel(srv.grpc_url) as ch:
            stub = pb_grpc.GRPCInferenceServiceStub(ch)
            auth = (("authorization", f"Bearer {FULL}"),)
            stats = stub.ModelStatistics(pb.ModelStatisticsRequest(name="minilm_cached"), metadata=auth)
        return stats.model_stats[0].inference_stats.cache_hit.count

    texts = [f"cached text {time.time()}", "another cached text"]
    first = oai.embeddings.create(model="minilm_cached", input=texts, encoding_format="float")
    before = hits()
    again = oai.embeddings.create(model="minilm_cached", input=texts, encoding_format="float")
    assert hits() > before
    assert [d.embedding for d in again.data] == [d.embedding for d in first.data]


def test_oversized_requests_are_refused_before_any_work(base):
    t0 = time.perf_counter()
    status, _, body = post(base + "/v1/embeddings", {"model": "minilm", "input": ["x"] * 2049})
    assert status == 400 and "at most 2048" in body["error"]["message"]
    assert time.perf_counter() - t0 < 2.0
    status, _, body = post(base + "/v1/embeddings", b"{not json")
    assert status == 400 and "not valid JSON" in body["error"]["message"]


# -- TEI --------------------------------------------------------------------------------------------


def test_tei_embed_one_string_and_many_equal_the_kserve_path(base, triton, stage):
    status, headers, body = post(base + "/embed", {"inputs": TEXTS[0]})
    assert status == 200 and same(np.float32(body), kserve(triton, [TEXTS[0]]))
    many = [t for t in TEXTS if t is not LONG]
    status, headers, body = post(base + "/embed", {"inputs": many, "normalize": True})
    assert status == 200 and same(np.float32(body), kserve(triton, many))
    assert int(headers["x-compute-tokens"]) > 0
    # minilm's graph normalises: normalize false returns the model's vectors as they are
    status, _, raw = post(base + "/embed", {"inputs": many, "normalize": False})
    assert status == 200 and same(np.float32(raw), kserve(triton, many))


def test_tei_truncate(base, triton, stage):
    """minilm's own setting (truncate) is the default; a call's ``truncate: false`` still refuses."""
    status, _, body = post(base + "/embed", {"inputs": ["fine", LONG], "truncate": False})
    assert status == 413 and body["error_type"] == "validation", body
    assert "input 1 is" in body["error"] and "at most 256" in body["error"]
    for asked in ({"truncate": True}, {}):
        status, _, body = post(base + "/embed", {"inputs": ["fine", LONG], **asked})
        assert status == 200 and same(np.float32(body), kserve(triton, ["fine", LONG]))


@pytest.mark.parametrize(
    "body, status, error_type, needle",
    [
        ({"inputs": []}, 400, "empty", "empty"),
        ({"inputs": ["x"] * 2049}, 413, "validation", "at most 2048"),
        ({"inputs": 5}, 422, "validation", "string or a list"),
        ({"inputs": "x", "normalize": "yes"}, 422, "validation", "'normalize'"),
        ({"inputs": "x", "truncation_direction": "Middle"}, 422, "validation", "'Left' or 'Right'"),
        ({"inputs": "x", "model": "nope"}, 404, "validation", "unknown model 'nope'"),
        ({"inputs": ["x", ""]}, 422, "validation", "text is empty"),
        (b"[1,", 422, "validation", "not valid JSON"),
    ],
)
def test_tei_errors(base, body, status, error_type, needle):
    got, _, resp = post(base + "/embed", body)
    assert (got, set(resp), resp["error_type"]) == (status, {"error", "error_type"}, error_type), resp
    assert needle in resp["error"]


def test_tei_overloaded_is_429(base):
    post(base + "/embed", {"inputs": "x"}, key=TIGHT)
    status, headers, body = post(base + "/embed", {"inputs": "x"}, key=TIGHT)
    assert status == 429 and body["error_type"] == "overloaded" and "Retry-After" in headers


def test_request_id_is_echoed(base):
    for path, body in (("/v1/embeddings", {"model": "minilm", "input": "x"}), ("/embed", {"inputs": "x"})):
        status, headers, _ = post(base + path, body, headers={"X-Request-Id": "embed-test-42"})
        assert status == 200 and {k.lower(): v for k, v in headers.items()}["x-request-id"] == "embed-test-42"


def test_a_list_of_texts_is_one_call_at_the_door_and_against_the_tenants_limits(base):
    """200 texts go to the model as four requests of 64, but the caller made one call: a tenant
    allowed one request is answered, whole, and refused the next (before, each of the four parts
    was admitted on its own and the second was refused its rate)."""
    texts = [f"text number {i} of a long list" for i in range(200)]
    status, _, body = post(base + "/v1/embeddings", {"model": "minilm", "input": texts}, key=ONCE)
    assert status == 200, body
    assert [d["index"] for d in body["data"]] == list(range(200))
    status, headers, body = post(base + "/v1/embeddings", {"model": "minilm", "input": texts[:1]}, key=ONCE)
    assert status == 429 and body["error"]["code"] == "rate_limit_exceeded", body


def test_2048_texts_are_one_admission_and_each_text_is_tokenised_once(base, srv):
    """OpenAI's largest call: one admission for its 2,048 rows (a tenant allowed one request is
    answered, then refused the next), and the tokenizer encodes each text once, in the gateway;
    the worker reads those encodings (the call's usage comes from them too). With the result
    cache, the repeated call computes nothing and still tokenises each text once (its usage)."""
    from tests.test_metrics import scrape, value

    texts = [f"text {i} of the longest list OpenAI sends, about {i % 7} things" for i in range(2048)]
    # 2,048 rows are computed once: the tenant's one call fills the cache, another tenant's repeat
    # of it is answered from there
    for model, key, computed in (("minilm_cached", ONCE_MORE, 2048), ("minilm_cached", FULL, 0)):
        before = scrape(srv)
        slow = {"X-Latency-Budget-Ms": "300000"}  # ~15 s of compute on 2 shared cores: no budget to miss
        status, _, body = post(
            base + "/v1/embeddings", {"model": model, "input": texts}, key=key, headers=slow
        )
        after = scrape(srv)
        assert status == 200, body
        assert len(body["data"]) == 2048 and body["usage"]["prompt_tokens"] > 2048 * 10

        def delta(name: str) -> float:
            return value(after, name, model=model, version="1") - value(
                before, name, model=model, version="1"
            )

        assert delta("batchgate_texts_tokenized_total") == 2048
        assert delta("batchgate_inference_rows_total") == computed  # the repeated call: all from the cache
    status, _, body = post(base + "/v1/embeddings", {"model": "minilm", "input": texts[:1]}, key=ONCE_MORE)
    assert status == 429 and body["error"]["code"] == "rate_limit_exceeded", body


def test_an_over_length_text_is_cut_by_the_models_setting_unless_the_call_refuses_it(oai, triton, base):
    with pytest.raises(openai.BadRequestError) as e:
        oai.embeddings.create(model="minilm", input=["fine", LONG], extra_body={"truncate": False})
    assert "input 1 is" in str(e.value) and "tokens; model 'minilm' takes at most 256" in str(e.value)
    for asked in ({"truncate": True}, None):  # minilm's own setting: truncate
        resp = oai.embeddings.create(model="minilm", input=["fine", LONG], extra_body=asked)
        assert same(np.float32([d.embedding for d in resp.data]), kserve(triton, ["fine", LONG]))
    # over the 32 KiB text bound: refused by its size when the call refuses truncation, else cut
    huge = "word " * 8000  # 40,000 bytes
    status, _, body = post(base + "/v1/embeddings", {"model": "minilm", "input": [huge], "truncate": False})
    assert status == 400 and "40000 bytes" in body["error"]["message"], body
    status, _, body = post(base + "/v1/embeddings", {"model": "minilm", "input": [huge]})
    assert status == 200, body
    want = kserve(triton, [huge[:32768]])[0]
    assert np.allclose(np.float32(body["data"][0]["embedding"]), want, atol=1e-6)
