"""The REST contract (gateway/transport/openapi.py): valid OpenAPI 3.1, in step with the routes the
app really registers, honoured by a live server under schemathesis, and browsable at /docs in a real
headless Chromium.

The drift test builds the app the REST listener serves (``http.app()``, the real function,
over a stand-in server object: registering routes touches nothing else) and compares method + path
template both ways, so a route added without its contract (or a contract left for a route gone)
fails here.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from batchgate.gateway.admission.tenants import hash_key
from batchgate.gateway.transport import openapi
from batchgate.gateway.transport.fields import LATENCY_BUDGET_HEADER
from batchgate.gateway.transport import http
from batchgate.gateway.models.prepare import prepare_model
from tests.conftest import REPO, start_server
from tests.test_tei_surface import folders  # noqa: F401  (a module fixture)
from tests.test_front_door import PeakRss

KEY = "openapi-0123456789abcdef"
TENANTS = f"""
tenants:
  - name: fuzz
    key_hashes: ["{hash_key(KEY)}"]
    models: "*"
"""
AUTH = {"Authorization": f"Bearer {KEY}"}
SEED = int(os.environ.get("BATCHGATE_FUZZ_SEED", "20261203"))  # fixed; the variable explores others
EXAMPLES = int(
    os.environ.get("BATCHGATE_FUZZ_EXAMPLES", "14")
)  # per operation and generation mode (positive, negative); 14 keeps the suite within CI's 8 minutes
MiB = 1 << 20
# A generated latency budget may be 2 ms: the server then answers 504 (the budget cannot be met),
# which is the contract, not a server error (under 1 ms it is 400). Only 504s of calls asking less
# than this count so.
TIGHT_BUDGET_MS = 1000.0
FUZZ_MODELS = ("sentiment", "nli", "splade", "tokens", "ce")  # beside minilm and ranker
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


# -- the document and the routes --------------------------------------------------------------------


def registered_routes(app) -> set[tuple[str, str]]:
    """(METHOD, path template) of every route on ``app``; HEAD is left out: aiohttp adds it to
    every GET itself."""
    out = set()
    for resource in app.router.resources():
        for route in resource:
            if route.method != "HEAD":
                out.add((route.method, resource.canonical))
    return out


def documented_routes(doc: dict) -> set[tuple[str, str]]:
    methods = {"get", "put", "post", "delete", "options", "head", "patch", "trace"}
    return {(m.upper(), path) for path, item in doc["paths"].items() for m in item if m in methods}


def drift(app, doc: dict) -> dict[str, list]:
    routes, documented = registered_routes(app), documented_routes(doc)
    return {
        "served but not documented": sorted(routes - documented),
        "documented but not served": sorted(documented - routes),
    }


def rest_app():
    """The REST listener's real app, over a stand-in server (routes are all this reads)."""
    settings = SimpleNamespace(
        max_http_body_bytes=1 << 20, http_body_timeout_s=30.0, cors_allowed_origins=None
    )
    metrics = SimpleNamespace(transport=lambda _name: None)
    server = SimpleNamespace(
        settings=settings, pipeline=None, plane=None, door=None, metrics=metrics, max_message_bytes=1 << 20
    )
    return http.app(server)


def test_document_is_valid_openapi_3_1():
    from openapi_spec_validator import OpenAPIV31SpecValidator

    doc = openapi.document()
    assert doc["openapi"] == "3.1.0"
    OpenAPIV31SpecValidator(doc).validate()  # raises with the first error and where it is
    # ...and the validator does refuse what is not 3.1 (an error shape made invalid):
    broken = copy.deepcopy(doc)
    broken["components"]["schemas"]["KServeError"]["required"] = "error"
    with pytest.raises(Exception, match="is not of type 'array'"):
        OpenAPIV31SpecValidator(broken).validate()


def test_every_route_is_in_the_document_and_back():
    app = rest_app()
    doc = openapi.document()
    assert drift(app, doc) == {"served but not documented": [], "documented but not served": []}
    routes = registered_routes(app)
    assert len(routes) >= 27, routes  # the whole REST surface was registered, not a stub of it
    for must in [("POST", "/v2/models/{model}/infer"), ("POST", "/v1/embeddings"), ("POST", "/v1/rerank"),
                 ("GET", "/openapi.json"), ("GET", "/docs")]:  # fmt: skip
        assert must in routes

    # The comparison does catch a route the document lacks, and a documented route not served.
    fewer = copy.deepcopy(doc)
    del fewer["paths"]["/embed"]
    assert drift(app, fewer)["served but not documented"] == [("POST", "/embed")]
    more = copy.deepcopy(doc)
    more["paths"]["/v2/new"] = {"get": {"responses": {"200": {"description": "x"}}}}
    assert drift(app, more)["documented but not served"] == [("GET", "/v2/new")]


def test_every_operation_documents_its_error_shape():
    """Every operation that can refuse says with which body; the three shapes by API family."""
    doc = openapi.document()
    family = {"/v1/embeddings": "OpenAIError", "/v1/models": "OpenAIError", "/v1/models/{model}": "OpenAIError",
              "/v1/rerank": "OpenAIError", "/classify": "OpenAIError", "/v1/classify": "OpenAIError",
              "/v1/organization/usage/embeddings": "OpenAIError", "/embeddings": "OpenAIError",
              "/score": "OpenAIError", "/v1/score": "OpenAIError",
              "/v2/rerank": "CohereError", "/v2/embed": "CohereError"}  # fmt: skip
    tei = ("/embed", "/rerank", "/info", "/health", "/tokenize", "/decode", "/similarity", "/predict",
           "/embed_sparse", "/embed_all", "/ping", "/invocations")  # fmt: skip
    family.update({p: "TEIError" for p in tei})
    family.update({"/tei/{model}" + p: "TEIError" for p in tei})
    family.update({"/": "TEIError", "/tei/{model}": "TEIError"})  # TEI's entry routes (POST) and health (GET)
    for path, item in doc["paths"].items():
        for method, op in item.items():
            if method == "parameters":
                continue
            for status, resp in op["responses"].items():
                if int(status) < 400 or path == "/v2/health/ready":
                    continue
                ref = resp["content"]["application/json"]["schema"]["$ref"]
                assert ref.endswith("/" + family.get(path, "KServeError")), (method, path, status)


# -- a live server ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def srv(minilm_dir, folders, tmp_path_factory):  # noqa: F811
    """minilm (text routes), ranker (numeric KServe) and tiny models of every text kind (a
    classifier, a pair classifier, a SPLADE encoder, an embedding model with token vectors and
    prompts, a reranker: tests/test_tei_surface.py's) behind a tenant file: one key, every model."""
    tmp = tmp_path_factory.mktemp("openapi-server")
    repo = tmp / "repo"
    repo.mkdir()
    (repo / "ranker").symlink_to(REPO / "ranker")
    (repo / "minilm").symlink_to(minilm_dir)
    for name in FUZZ_MODELS:
        prepare_model(folders[name][0], name, repo, token_embeddings=name == "tokens", log=print)
    (tmp / "tenants.yaml").write_text(TENANTS)
    s = start_server(tmp, "--no-build-models", "--api-keys-file", str(tmp / "tenants.yaml"), repo=repo)
    yield s
    s.stop()


def base_of(srv) -> str:
    return f"http://127.0.0.1:{srv.http_port}"


def get(url: str, headers: dict | None = None) -> tuple[int, bytes, dict]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read(), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), dict(exc.headers)


def post(url: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST",
        headers={"Content-Type": "application/json", **(headers or {})},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


# The bodies of other servers' wires follow those servers: TEI, Cohere, infinity and vLLM ignore a
# field they do not know, OpenAI refuses it. One call per text route, each with such a field.
UNKNOWN = {"options": {"wait_for_model": True}}  # what LangChain's HuggingFaceInferenceAPIEmbeddings adds
IGNORING = {
    "/embed": {"inputs": "a text"},
    "/rerank": {"model": "ce", "query": "a query", "texts": ["a text"], "top_n": 1},
    "/tokenize": {"inputs": "a text"},
    "/decode": {"ids": [101, 102]},
    "/embed_all": {"model": "tokens", "inputs": "a text"},
    "/embed_sparse": {"model": "splade", "inputs": "a text"},
    "/similarity": {"inputs": {"source_sentence": "a text", "sentences": ["another"]}},
    "/predict": {"model": "sentiment", "inputs": ["a text", "another"]},
    "/": {"inputs": "a text"},
    "/invocations": {"model": "ce", "query": "a query", "texts": ["a text"]},
    "/classify": {"model": "sentiment", "input": "a text"},
    "/v1/classify": {"model": "nli", "input": [["a text", "another"]]},
    "/score": {"model": "ce", "text_1": "a query", "text_2": ["a text"]},
    "/v1/score": {"model": "ce", "text_1": ["a query"], "text_2": ["a text"]},
    "/v1/rerank": {"model": "ce", "query": "a query", "documents": ["a text"]},
    "/v2/rerank": {"model": "ce", "query": "a query", "documents": ["a text"], "max_tokens_per_doc": 2},
    "/v2/embed": {"model": "minilm", "texts": ["a text"], "input_type": "search_query", "embedding_types": ["float"]},
}  # fmt: skip
REFUSING = ("/v1/embeddings", "/embeddings")


def _closed(schema, schemas: dict) -> bool:
    """Whether ``schema`` (refs followed) closes any object in it (``additionalProperties: false``)."""
    if isinstance(schema, dict):
        if "$ref" in schema:
            return _closed(schemas[schema["$ref"].rsplit("/", 1)[1]], schemas)
        return schema.get("additionalProperties") is False or any(
            _closed(v, schemas) for v in schema.values()
        )
    if isinstance(schema, list):
        return any(_closed(v, schemas) for v in schema)
    return False


def test_the_document_leaves_open_the_bodies_that_ignore_unknown_fields():
    doc = openapi.document()
    schemas = doc["components"]["schemas"]
    bodies = {path: item["post"]["requestBody"]["content"]["application/json"]["schema"]
              for path, item in doc["paths"].items() if "post" in item and "requestBody" in item["post"]}  # fmt: skip
    text = {p for p in bodies if not p.startswith(("/v2/models", "/v2/repository"))}
    closed = {p for p in text if _closed(bodies[p], schemas)}
    assert closed == set(REFUSING)
    # every text route's body is called below (under /tei/{model} too, by the same schema)
    assert {p.removeprefix("/tei/{model}") or "/" for p in text} - set(REFUSING) == set(IGNORING)


def test_unknown_fields_are_ignored_on_tei_cohere_and_vllm_routes_refused_on_openais(srv):
    base = base_of(srv)
    for path, body in IGNORING.items():
        status, answer = post(base + path, {**body, **UNKNOWN}, AUTH)
        assert status == 200, (path, answer)
    status, answer = post(base + "/tei/minilm", {"inputs": "a text", **UNKNOWN}, AUTH)
    assert status == 200, answer
    for path in REFUSING:
        status, answer = post(base + path, {"model": "minilm", "input": "a text", **UNKNOWN}, AUTH)
        assert status == 400 and answer["error"]["param"] == "options", (path, answer)


def test_contract_and_page_are_served_without_a_key(srv):
    base = base_of(srv)
    status, body, headers = get(base + "/openapi.json")
    assert status == 200 and headers["Content-Type"].startswith("application/json")
    assert json.loads(body) == openapi.document()
    status, page, headers = get(base + "/docs")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    for asset in ("docs/static/swagger-ui-bundle.js", "docs/static/swagger-ui.css"):
        assert asset.encode() in page
        status, data, headers = get(f"{base}/{asset}")
        assert status == 200 and len(data) > 100_000, asset  # the real bundle, not a stub
    assert b"cdn" not in page.lower() and b"https://" not in page  # nothing from elsewhere
    assert get(base + "/docs/static/..%2Fopenapi.py")[0] == 404  # an allow-list, no path walking
    # The server does ask for keys elsewhere: the contract is open by choice, not by accident.
    status, body, _ = get(base + "/v1/models")
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"


def asked_budget_ms(case) -> float | None:
    """The latency budget a generated call asked for, if a number: the body's field when the body
    has one (it wins over the header, as the server reads it: fields.latency_of), else the header."""
    if isinstance(case.body, dict) and "latency_budget_ms" in case.body:
        value = case.body["latency_budget_ms"]
    else:
        value = (case.headers or {}).get(LATENCY_BUDGET_HEADER)
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _checks():
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    return [
        not_a_server_error,
        status_code_conformance,
        response_schema_conformance,
        content_type_conformance,
    ]


def test_the_fuzz_checks_refuse_an_answer_the_document_does_not_describe(srv):
    """The checks the fuzz test relies on do fail: against a document that lacks the 404 of model
    metadata, or whose KServe error shape wants another field, the same real answer is refused."""
    import schemathesis
    from schemathesis.core.failures import FailureGroup

    for doctor, code in [
        (lambda d: d["paths"]["/v2/models/{model}"]["get"]["responses"].pop("404"), "Undocumented status code"),
        (lambda d: d["components"]["schemas"]["KServeError"]["required"].append("message"), "required property"),
    ]:  # fmt: skip
        doc = copy.deepcopy(openapi.document())
        doctor(doc)
        op = schemathesis.openapi.from_dict(doc)["/v2/models/{model}"]["GET"]
        case = op.Case(path_parameters={"model": "no-such-model"})
        response = case.call(base_url=base_of(srv), headers=AUTH, timeout=30)
        assert response.status_code == 404
        with pytest.raises(FailureGroup, match=code):
            case.validate_response(response, checks=_checks(), headers=AUTH)


def test_schemathesis_finds_no_5xx_and_no_undocumented_answer(srv):
    """schemathesis generates calls for every operation from the live /openapi.json (valid ones and,
    negative mode, ones that break the schema), with a fixed seed and a bounded number of examples;
    every answer must be no 5xx, of a documented status, with a body matching that status's schema
    (the error shapes included) and its content type. The server's RSS stays bounded, and a normal
    call still works afterwards."""
    import hypothesis
    import requests
    import schemathesis
    from hypothesis import HealthCheck, Phase, settings
    from hypothesis import strategies as st
    from schemathesis import GenerationMode
    from schemathesis.core.failures import FailureGroup

    base = base_of(srv)
    schema = schemathesis.openapi.from_url(base + "/openapi.json")
    checks = _checks()
    statuses: Counter = Counter()
    by_operation: dict[str, Counter] = {}
    failures: list[str] = []
    deadlines: list[str] = []  # 504s of calls that asked for a budget under TIGHT_BUDGET_MS
    tried = 0
    session = requests.Session()

    def fuzz(op, strategy, label: str, examples: int) -> None:
        seen = by_operation.setdefault(op.label, Counter())

        @hypothesis.seed(SEED)
        @settings(
            max_examples=examples, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )  # fmt: skip
        @hypothesis.given(
            case=strategy, model=st.sampled_from([None, None, "minilm", "ranker", *FUZZ_MODELS])
        )
        def run(case, model) -> None:
            nonlocal tried
            if model is not None:  # half the calls name a served model, so they get past the lookup
                if "model" in (case.path_parameters or {}):
                    case.path_parameters["model"] = model
                if isinstance(case.body, dict) and "model" in case.body:
                    case.body["model"] = model
            tried += 1
            response = case.call(base_url=base, session=session, headers=AUTH, timeout=60)
            status = response.status_code
            statuses[status] += 1
            seen[status] += 1
            asked = status == 504 and (asked_budget_ms(case) or math.inf) < TIGHT_BUDGET_MS
            if asked:  # the caller asked for a budget no call meets: 504 is the right answer
                deadlines.append(f"{op.label}: {asked_budget_ms(case):g} ms")
            try:
                case.validate_response(
                    response, checks=[c for c in checks if not (asked and c.__name__ == "not_a_server_error")],
                    headers=AUTH,
                )  # fmt: skip
            except FailureGroup as exc:  # kept, not raised: every operation gets its run
                failures.append(f"{op.label} ({label}): {exc}")

        try:
            run()
        except hypothesis.errors.Unsatisfiable:  # nothing to break (no parameters, no body)
            assert label == "negative", op.label

    t0 = time.monotonic()
    with PeakRss(srv.proc.pid) as rss:
        for result in schema.get_all_operations():
            op = result.ok()
            from_examples = schema.get_strategies_from_examples(op)
            if from_examples:  # the document's own examples first: each a call that should work
                fuzz(op, st.one_of(from_examples), "examples", 4)
            fuzz(op, op.as_strategy(generation_mode=GenerationMode.POSITIVE), "positive", EXAMPLES)
            fuzz(op, op.as_strategy(generation_mode=GenerationMode.NEGATIVE), "negative", EXAMPLES)
    elapsed = time.monotonic() - t0
    print(
        f"\nschemathesis {schemathesis.__version__}, seed {SEED}: {tried} calls over {len(by_operation)} "
        f"operations in {elapsed:.1f} s; statuses {dict(sorted(statuses.items()))}; server RSS "
        f"{rss.before / MiB:.0f} MiB -> peak {rss.peak / MiB:.0f} MiB (+{rss.growth / MiB:.0f} MiB); "
        f"504 to a budget asked under {TIGHT_BUDGET_MS:g} ms: {len(deadlines)} {deadlines[:3]}"
    )
    for label, seen in by_operation.items():
        print(f"  {label}: {dict(sorted(seen.items()))}")
    assert not failures, "\n".join(failures[:20]) + f"\n({len(failures)} failing calls)"
    # every operation was called (one whose strategy made nothing would fail here), but the one
    # serving the document, which schemathesis leaves out itself
    called = {tuple(label.split(" ", 1)) for label in by_operation}
    assert called == documented_routes(openapi.document()) - {("GET", "/openapi.json")}, called
    assert all(sum(seen.values()) for seen in by_operation.values()), by_operation
    assert sum(n for s, n in statuses.items() if s >= 500) == len(deadlines), (statuses, deadlines)
    assert rss.growth < 300 * MiB, f"RSS grew {rss.growth / MiB:.0f} MiB"
    assert srv.proc.poll() is None, srv.log()[-3000:]

    # ...and it still answers a normal call, on each API.
    status, doc = post(base + "/v1/embeddings", {"model": "minilm", "input": ["a normal call"]}, AUTH)
    assert status == 200 and len(doc["data"][0]["embedding"]) == 384, doc
    status, vectors = post(base + "/embed", {"inputs": "a normal call"}, AUTH)
    assert status == 200 and len(vectors[0]) == 384, vectors
    infer = {"inputs": [{"name": "dense", "shape": [1, 64], "datatype": "FP32", "data": [0.5] * 64},
                        {"name": "sparse_ids", "shape": [1, 8], "datatype": "INT64", "data": list(range(8))}]}  # fmt: skip
    status, doc = post(base + "/v2/models/ranker/infer", infer, AUTH)
    assert status == 200 and doc["outputs"][0]["shape"] == [1, 1], doc


# -- the page in a real browser ---------------------------------------------------------------------


def chromium_or_skip() -> str:
    """The browser; missing, the test fails under `make test` (which installs it, as it does
    redis-server) and is skipped elsewhere with the reason."""
    if CHROMIUM is not None:
        return CHROMIUM
    if os.environ.get("MAKELEVEL"):  # make exports it to every recipe: this is `make test`
        pytest.fail("chromium is not installed, though `make test` installs it (Makefile: chromium)")
    pytest.skip("chromium is not installed (apt-get install chromium; `make test` installs it)")


def chromium(tmp: Path, *args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    exe = chromium_or_skip()
    cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
           f"--user-data-dir={tmp / 'profile'}", "--virtual-time-budget=10000", *args]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=tmp)


def test_docs_page_renders_every_operation_in_chromium(srv, tmp_path):
    url = base_of(srv) + "/docs"
    out = chromium(tmp_path, "--dump-dom", url)
    assert out.returncode == 0, out.stderr[-2000:]
    dom = out.stdout
    assert "Unable to render" not in dom, dom[:2000]
    assert dom.count('class="opblock opblock-') >= len(documented_routes(openapi.document())), dom[:3000]
    for path in openapi.document()["paths"]:
        assert f'data-path="{path}"' in dom, path  # each path's operation block rendered
    assert "OAS 3.1" in dom

    shot = tmp_path / "docs.png"
    out = chromium(tmp_path, "--hide-scrollbars", "--window-size=1280,1600", f"--screenshot={shot}", url)
    assert out.returncode == 0 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", out.stderr[-2000:]
    assert shot.stat().st_size > 50_000  # a rendered page, not a blank one
