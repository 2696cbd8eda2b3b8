"""The REST bodies' types (gateway/transport/bodies.py): what a refusal says and names, which bodies
refuse unknown fields and which ignore them (logged once per name), and that the OpenAPI document
describes each route's body by the type its wire decodes. No server: the types and the table."""

from __future__ import annotations

import json
import logging

import msgspec
import pytest

from batchgate.gateway.errors import GatewayError, Kind
from batchgate.gateway.transport import bodies, openapi
from batchgate.gateway.transport.kserve_rest import build_request

TENSOR = {"name": "dense", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}


def refused(raw, cls) -> GatewayError:
    raw = raw if isinstance(raw, bytes) else json.dumps(raw).encode()
    with pytest.raises(GatewayError) as err:
        bodies.decode(raw, cls)
    assert err.value.kind is Kind.INVALID
    return err.value


@pytest.mark.parametrize(
    "cls, body, field, needle",
    [
        (bodies.EmbeddingsRequest, {"model": "m"}, "input", "'input' is required: a string, a list of strings"),
        (bodies.EmbeddingsRequest, {"input": "x"}, "model", "'model' is required: the name of a text model"),
        (bodies.EmbeddingsRequest, {"model": "m", "input": "x", "top_k": 1}, "top_k",
         "unrecognized request argument(s): ['top_k']"),
        (bodies.EmbeddingsRequest, {"model": "m", "input": 5}, "input", "'input' must be a string or a list, not an integer"),
        (bodies.EmbeddingsRequest, {"model": "m", "input": "x", "dimensions": 0}, "dimensions",
         "'dimensions' must be an integer >= 1"),
        (bodies.EmbeddingsRequest, {"model": "m", "input": "x", "dimensions": True}, "dimensions",
         "'dimensions' must be an integer, not a boolean"),
        (bodies.EmbeddingsRequest, {"model": "m", "input": "x", "encoding_format": "int8"}, "encoding_format",
         "'encoding_format' must be 'float' or 'base64', not 'int8'"),
        (bodies.EmbedRequest, {"inputs": "x", "truncation_direction": "up"}, "truncation_direction",
         "'truncation_direction' must be 'Left' or 'Right'"),
        (bodies.EmbedRequest, {"inputs": "x", "latency_budget_ms": 0.5}, "latency_budget_ms",
         "'latency_budget_ms' must be a number >= 1"),
        (bodies.V2RerankRequest, {"query": "q", "documents": ["a", {"text": "b"}, 3]}, "documents",
         "'documents[2]' must be a string or an object, not an integer"),
        (bodies.V2EmbedRequest, {"texts": ["a"], "embedding_types": ["float", "int4"]}, "embedding_types",
         "'embedding_types[1]' must be 'float' or 'int8'"),
        (bodies.SimilarityRequest, {"inputs": {"sentences": ["a"]}}, "inputs",
         "'inputs.source_sentence' is required"),
        (bodies.InferenceRequest, {"inputs": []}, "inputs", "'inputs' must be a non-empty list"),
        (bodies.InferenceRequest, {"inputs": [{**TENSOR, "shape": [1, 2**63]}]}, "inputs",
         "input 'dense': 'shape[1]' must be a 64-bit integer"),
        (bodies.InferenceRequest, {"inputs": [{**TENSOR, "parameters": [1]}]}, "inputs",
         "input 'dense': 'parameters' must be an object, not a list"),
        (bodies.InferenceRequest, {"inputs": [{**TENSOR, "name": "x" * 129}]}, "inputs",
         "'inputs[0].name' must be a string of length <= 128"),
    ],
)  # fmt: skip
def test_a_refusal_names_the_field_and_what_it_must_be(cls, body, field, needle):
    err = refused(body, cls)
    assert err.field == field and needle in err.message, err.message


@pytest.mark.parametrize(
    "raw, needle",
    [
        (b"[1,", "the request body is not valid JSON"),  # msgspec sees a list first: still "not JSON"
        (b"[1]", "the request body must be a JSON object, not a list"),
        (b'{"inputs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    ],
)
def test_a_body_that_is_no_json_object_says_which(raw, needle):
    assert needle in refused(raw, bodies.EmbedRequest).message


def _route_bodies() -> set[type]:
    out = set()
    for r in openapi.ROUTES:
        out.update(r.body if isinstance(r.body, tuple) else (r.body,) if r.body else ())
    return out


def test_only_openais_body_refuses_unknown_fields_and_every_other_ignores_them():
    """OpenAI refuses a field it does not know; TEI, infinity, vLLM, Cohere and KServe ignore them."""
    closed = {cls for cls in _route_bodies() if cls.__struct_config__.forbid_unknown_fields}
    assert closed == {bodies.EmbeddingsRequest}
    body = {"model": "m", "input": "x", "options": {"wait_for_model": True}}
    assert refused(body, bodies.EmbeddingsRequest).field == "options"
    got = bodies.decode(json.dumps({"inputs": "x", "options": {}}).encode(), bodies.EmbedRequest)
    assert got.inputs == "x"


def test_ignored_fields_are_logged_once_per_name(caplog):
    raw = json.dumps({"inputs": "x", "zz_first": 1, "zz_second": 2}).encode()
    with caplog.at_level(logging.INFO, logger=bodies.__name__):
        for _ in range(3):
            assert bodies.read(raw, bodies.EmbedRequest, "/embed").inputs == "x"
    logged = [r.getMessage() for r in caplog.records if "ignoring unknown field" in r.getMessage()]
    assert len(logged) == 2 and "'zz_first'" in logged[0] and "'zz_second'" in logged[1], logged


def test_the_document_describes_each_body_by_the_type_its_wire_decodes():
    """Every request schema in the document is generated from the body's type: its properties are
    the type's fields, its required ones the fields without a default, closed only where the type
    refuses unknown fields."""
    doc = openapi.document()
    schemas = doc["components"]["schemas"]
    for r in openapi.ROUTES:
        if r.body is None:
            continue
        schema = doc["paths"][r.path][r.method.lower()]["requestBody"]["content"]["application/json"][
            "schema"
        ]
        types = r.body if isinstance(r.body, tuple) else (r.body,)
        refs = [s["$ref"] for s in schema.get("anyOf", [schema])]
        assert refs == [f"#/components/schemas/{t.__name__}" for t in types], (r.path, refs)
        for t in types:
            described = schemas[t.__name__]
            info = msgspec.inspect.type_info(t)
            assert set(described["properties"]) == {f.encode_name for f in info.fields}, t
            assert set(described.get("required", ())) == {f.encode_name for f in info.fields if f.required}, t
            assert (
                described.get("additionalProperties") is False
            ) == t.__struct_config__.forbid_unknown_fields


def test_kserve_infer_body_keeps_binary_data_a_view_and_refuses_by_the_tensors_name():
    head = json.dumps(
        {"inputs": [{"name": "b", "shape": [2], "datatype": "FP32", "parameters": {"binary_data_size": 8}}]}
    ).encode()
    body = head + b"\0" * 8
    call, _ = build_request("m", "", body, str(len(head)))
    assert isinstance(call.inputs[0].raw, memoryview) and call.inputs[0].raw.obj is body
    bad = json.dumps({"inputs": [{**TENSOR, "datatype": 7}]}).encode()
    with pytest.raises(GatewayError) as err:
        build_request("m", "", bad, None)
    assert "input 'dense': 'datatype' must be a string, not an integer" in err.value.message
