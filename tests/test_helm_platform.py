"""What a platform team asks of the chart beyond tests/test_helm.py: network policies, spreading,
the replica count passed down, external Redis TLS with a private CA, metrics on their own Service,
liveness apart from readiness, KEDA autoscaling, a Grafana dashboard, and a policy scan.

Renders use tests/test_helm.py's helpers (Helm's own engine, kubernetes-validate strict). Where a
rendered setting only means something to a running process, it is run:

- the dashboard's every query (and the default KEDA query) is resolved against a live server's
  /metrics: metric names, the labels of every selector and `by` clause, and literal label values;
- the probes: a server with a model that fails to load stays live on the liveness probe's path while
  the readiness probe's gRPC health check says NOT_SERVING;
- the Redis URL the chart composes for a private CA reaches a TLS redis-server signed by that CA;
- the in-chart Redis container's command runs with the local sh and redis-server.

The KEDA ScaledObject is validated against KEDA's own CRD schema (``KEDA_SCALEDOBJECT_SCHEMA``)
made strict the way kubernetes-validate is (unknown fields refused). checkov scans every value set,
and its findings must be exactly the table in docs/kubernetes.md.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import jsonschema
import numpy as np
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from batchgate.gateway.config import Settings
from batchgate.proto.inference.v2 import grpc_service_pb2 as pb
from batchgate.proto.inference.v2 import grpc_service_pb2_grpc as pb_grpc
from tests.conftest import REPO, ROOT, ServerProcess, start_server
from tests.helpers import free_ports
from tests.test_helm import (
    CHART,
    CRD_KINDS,
    FULLNAME,
    K8S_VERSIONS,
    NAMESPACE,
    PASSWORD,
    RELEASE,
    VALUE_SETS,
    Rendered,
    _check_service_monitor,
    _merge,
    _selects,
    helm,
    kubernetes_validate,
    render,
)
from tests.test_metrics import ranker_request
from tests.test_tls import make_pki

DASHBOARD = CHART / "dashboards" / "batchgate.json"
DOCS = ROOT / "docs" / "kubernetes.md"
METRICS_SVC = f"{FULLNAME}-metrics"
CA_DIR = "/etc/batchgate/redis-ca"
PROMETHEUS = "http://prometheus-operated.monitoring.svc:9090"

PLATFORM_SETS: dict[str, dict] = {
    "keda": {
        "autoscaling": {"keda": {"enabled": True, "serverAddress": PROMETHEUS}},
        "metrics": {"serviceMonitor": {"enabled": True}},
    },
    "keda-custom": {
        "autoscaling": {
            "minReplicas": 3,
            "maxReplicas": 30,
            "keda": {
                "enabled": True,
                "serverAddress": "https://thanos.example:9091",
                "query": 'sum(batchgate_scheduler_inflight_requests{namespace="serving"})',
                "threshold": "500m",
                "authenticationRef": "prometheus-creds",
            },
            "behavior": {"scaleUp": {"stabilizationWindowSeconds": 0}},
        },
        "tls": {"enabled": True, "existingSecret": "gateway-tls"},
    },
    "netpol-restricted": {
        "networkPolicy": {
            "from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "apps"}}}],
            "metricsFrom": [
                {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}},
                {"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}},
            ],
        },
        "redis": {"mode": "internal"},
    },
    "netpol-off": {"networkPolicy": {"enabled": False}, "redis": {"mode": "internal"}},
    "redis-ca-secret": {
        "redis": {
            "mode": "external",
            "host": "redis.cache.svc",
            "tls": True,
            "password": PASSWORD,
            "tlsCA": {"existingSecret": "redis-ca"},
        },
    },
    "redis-ca-configmap-url": {
        "redis": {
            "mode": "external",
            "url": f"rediss://:{PASSWORD}@redis.example:6380/1?socket_keepalive=true",
            "tlsCA": {"existingConfigMap": "corp-ca", "key": "corp.pem"},
        },
    },
    "dashboard": {
        "dashboard": {
            "enabled": True,
            "namespace": "monitoring",
            "annotations": {"grafana_folder": "Serving"},
        },
    },
    "spread-custom": {
        "topologySpread": {"whenUnsatisfiable": "DoNotSchedule", "maxSkew": 2},
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": "topology.kubernetes.io/zone",
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": {"app.kubernetes.io/component": "gateway"}},
            }
        ],
    },
}
ALL_SETS = {**VALUE_SETS, **PLATFORM_SETS}
DEFAULTS = yaml.safe_load((CHART / "values.yaml").read_text())


@functools.cache
def rendered(name: str) -> Rendered:
    with helm.Chart.load(CHART) as c:
        return render(c, ALL_SETS[name])


def values_of(name: str) -> dict:
    return _merge(DEFAULTS, ALL_SETS[name])


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(CHART) as c:
        yield c


def refuses(chart, values: dict, needle: str) -> None:
    with pytest.raises(helm.HelmRenderError, match=re.escape(needle)):
        chart.render(values, name=RELEASE, namespace=NAMESPACE)


def pod_labels(r: Rendered, name: str) -> dict:
    return r.one("Deployment", name)["spec"]["template"]["metadata"]["labels"]


# -- KEDA's ScaledObject CRD schema -----------------------------------------------------------------

# openAPIV3Schema of keda.sh/v1alpha1 ScaledObject from kedacore/keda config/crd/bases/
# keda.sh_scaledobjects.yaml at 8b4f083 (v2.20.1-117, 2026-08-20), descriptions and status dropped.
# kubernetes-validate ships no CRDs, and no Python package on PyPI carries KEDA's.
KEDA_SCALEDOBJECT_SCHEMA = json.loads(
    r"""
{"properties":{"apiVersion":{"type":"string"},"kind":{"type":"string"},"metadata":{"type":"object"},"spe
c":{"properties":{"advanced":{"properties":{"horizontalPodAutoscalerConfig":{"properties":{"behavior":{"
properties":{"scaleDown":{"properties":{"policies":{"items":{"properties":{"periodSeconds":{"format":"int
32","type":"integer"},"type":{"type":"string"},"value":{"format":"int32","type":"integer"}},"required":["
periodSeconds","type","value"],"type":"object"},"type":"array","x-kubernetes-list-type":"atomic"},"selec
tPolicy":{"type":"string"},"stabilizationWindowSeconds":{"format":"int32","type":"integer"},"tolerance":
{"anyOf":[{"type":"integer"},{"type":"string"}],"pattern":"^(\\+|-)?(([0-9]+(\\.[0-9]*)?)|(\\.[0-9]+))((
[KMGTPE]i)|[numkMGTPE]|([eE](\\+|-)?(([0-9]+(\\.[0-9]*)?)|(\\.[0-9]+))))?$","x-kubernetes-int-or-string"
:true}},"type":"object"},"scaleUp":{"properties":{"policies":{"items":{"properties":{"periodSeconds":{"fo
rmat":"int32","type":"integer"},"type":{"type":"string"},"value":{"format":"int32","type":"integer"}},"r
equired":["periodSeconds","type","value"],"type":"object"},"type":"array","x-kubernetes-list-type":"atom
ic"},"selectPolicy":{"type":"string"},"stabilizationWindowSeconds":{"format":"int32","type":"integer"},"
tolerance":{"anyOf":[{"type":"integer"},{"type":"string"}],"pattern":"^(\\+|-)?(([0-9]+(\\.[0-9]*)?)|(\\
.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\\+|-)?(([0-9]+(\\.[0-9]*)?)|(\\.[0-9]+))))?$","x-kubernetes-int
-or-string":true}},"type":"object"}},"type":"object"},"name":{"type":"string"}},"type":"object"},"restor
eToOriginalReplicaCount":{"type":"boolean"},"scalingModifiers":{"properties":{"activationTarget":{"type":
"string"},"formula":{"type":"string"},"metricType":{"type":"string"},"target":{"type":"string"}},"type":"
object"}},"type":"object"},"cooldownPeriod":{"format":"int32","type":"integer"},"fallback":{"properties":
{"behavior":{"default":"static","enum":["static","currentReplicas","currentReplicasIfHigher","currentRep
licasIfLower"],"type":"string"},"failureThreshold":{"format":"int32","type":"integer"},"replicas":{"forma
t":"int32","type":"integer"}},"required":["failureThreshold","replicas"],"type":"object"},"idleReplicaCou
nt":{"format":"int32","type":"integer"},"initialCooldownPeriod":{"format":"int32","type":"integer"},"maxR
eplicaCount":{"format":"int32","type":"integer"},"minReplicaCount":{"format":"int32","type":"integer"},"p
ollingInterval":{"format":"int32","type":"integer"},"scaleTargetRef":{"properties":{"apiVersion":{"type":
"string"},"envSourceContainerName":{"type":"string"},"kind":{"type":"string"},"name":{"type":"string"}},"
required":["name"],"type":"object"},"triggers":{"items":{"properties":{"authenticationRef":{"properties":
{"kind":{"enum":["TriggerAuthentication","ClusterTriggerAuthentication"],"type":"string"},"name":{"type":
"string"}},"required":["name"],"type":"object"},"metadata":{"additionalProperties":{"type":"string"},"typ
e":"object"},"metricType":{"type":"string"},"name":{"type":"string"},"type":{"minLength":1,"type":"strin
g"},"useCachedMetrics":{"type":"boolean"}},"required":["metadata","type"],"type":"object"},"minItems":1,"
type":"array"}},"required":["scaleTargetRef","triggers"],"type":"object"}},"required":["spec"],"type":"ob
ject"}
""".replace("\n", "")
)
# The trigger's metadata is a free map in the CRD; what KEDA's prometheus scaler reads (keda docs,
# scalers/prometheus): anything else is ignored by KEDA, so a typo here would pass silently.
PROMETHEUS_TRIGGER_KEYS = {
    "serverAddress", "query", "threshold", "activationThreshold", "namespace", "customHeaders",
    "ignoreNullValues", "unsafeSsl", "queryParameters", "timeout",
}  # fmt: skip
QUANTITY = re.compile(r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE])?$")


def _strict(schema):
    """The apiserver prunes unknown fields of a CRD object (kubectl's strict field validation turns
    that into an error): refuse them here, as kubernetes-validate's strict mode does for built-ins."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out:
            if not out.get("x-kubernetes-preserve-unknown-fields"):
                out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def validate_scaled_object(doc: dict) -> None:
    jsonschema.validate(doc, _strict(KEDA_SCALEDOBJECT_SCHEMA))
    assert (doc["apiVersion"], doc["kind"]) == ("keda.sh/v1alpha1", "ScaledObject")
    for trigger in doc["spec"]["triggers"]:
        assert trigger["type"] == "prometheus"
        assert trigger["metricType"] in ("AverageValue", "Value")
        meta = trigger["metadata"]
        assert set(meta) <= PROMETHEUS_TRIGGER_KEYS, set(meta) - PROMETHEUS_TRIGGER_KEYS
        assert meta["serverAddress"].startswith(("http://", "https://")) and meta["query"]
        assert QUANTITY.match(meta["threshold"]), meta["threshold"]
        assert meta.get("ignoreNullValues", "false") in ("true", "false")


def test_the_keda_schema_is_strict():
    # The check must refuse what the apiserver would drop: a misspelt field, a number as string.
    doc = rendered("keda").one("ScaledObject")
    validate_scaled_object(doc)
    for bad in (
        _merge(doc, {"spec": {"minReplicas": 2}}),  # HPA's name, not KEDA's minReplicaCount
        _merge(doc, {"spec": {"maxReplicaCount": "10"}}),
        _merge(doc, {"spec": {"scaleTargetRef": {"nme": "x"}}}),
    ):
        with pytest.raises(jsonschema.ValidationError):
            validate_scaled_object(bad)


# -- render, lint, schema ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PLATFORM_SETS))
def test_platform_sets_lint_and_pass_the_schema(chart, name):
    chart.validate_schema(PLATFORM_SETS[name])
    report = helm.lint(CHART, PLATFORM_SETS[name], strict=True, namespace=NAMESPACE, kube_version="v1.30.0")
    bad = [m for m in report["messages"] if m["severity"] >= 2]
    assert not bad and not report["errors"], f"helm lint ({name}): {bad} {report['errors']}"


@pytest.mark.parametrize("name", sorted(PLATFORM_SETS))
def test_platform_sets_validate_strictly(name):
    r = rendered(name)
    for doc in r.docs:
        key = (doc["apiVersion"], doc["kind"])
        if key == ("keda.sh/v1alpha1", "ScaledObject"):
            validate_scaled_object(doc)
        elif key in CRD_KINDS:
            if doc["kind"] == "ServiceMonitor":
                _check_service_monitor(doc)
        else:
            for version in K8S_VERSIONS:
                kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize(
    "values, needle",
    [
        ({"networkPolicy": {"form": []}}, "form"),
        ({"networkPolicy": {"from": [{"podSelectr": {}}]}}, "podSelectr"),
        ({"networkPolicy": {"from": [{}]}}, "from"),
        ({"networkPolicy": {"metricsFrom": [{"ipBlock": {"except": ["10.0.0.0/8"]}}]}}, "cidr"),
        ({"topologySpread": {"whenUnsatisfiable": "Maybe"}}, "whenUnsatisfiable"),
        ({"topologySpread": {"maxSkew": 0}}, "maxSkew"),
        ({"autoscaling": {"keda": {"treshold": "8"}}}, "treshold"),
        ({"autoscaling": {"keda": {"threshold": "eight"}}}, "threshold"),
        ({"autoscaling": {"keda": {"threshold": 8}}}, "threshold"),
        ({"autoscaling": {"keda": {"serverAddress": "prometheus:9090"}}}, "serverAddress"),
        ({"autoscaling": {"keda": {"authenticationRef": "Creds_1"}}}, "authenticationRef"),
        ({"redis": {"tlsCA": {"secret": "x"}}}, "secret"),
        ({"redis": {"tlsCA": {"key": "../ca.crt"}}}, "key"),
        ({"redis": {"internal": {"image": {"digest": "sha256:abc"}}}}, "digest"),
        ({"dashboard": {"enable": True}}, "enable"),
        ({"dashboard": {"labels": {"grafana_dashboard": 1}}}, "grafana_dashboard"),
    ],
)
def test_schema_refuses_new_values_misspelt_or_mistyped(chart, values, needle):
    with pytest.raises(helm.HelmValuesError, match=needle):
        chart.validate_schema(values)


# -- NetworkPolicy ---------------------------------------------------------------------------------


def _ingress_ports(rule: dict) -> set[int]:
    return {p["port"] for p in rule["ports"]}


def test_network_policy_is_on_by_default_and_opens_only_the_gateway_ports():
    r = rendered("defaults")
    (pol,) = r.of("NetworkPolicy")
    spec = pol["spec"]
    assert _selects(spec["podSelector"], pod_labels(r, FULLNAME))
    assert spec["policyTypes"] == ["Ingress"]  # egress (Redis, DNS, collectors) left to the operator
    ports = [_ingress_ports(rule) for rule in spec["ingress"]]
    assert ports == [{8001, 8000}, {8002}, {8003}]
    # Empty `from` lists: any source on those ports, so enabling it by default breaks no caller.
    assert all("from" not in rule for rule in spec["ingress"])
    assert {p["containerPort"] for p in r.gateway["ports"]} == set().union(*ports)


def test_network_policy_restricts_callers_and_scrapers_when_told():
    r = rendered("netpol-restricted")
    v = values_of("netpol-restricted")["networkPolicy"]
    gw = r.one("NetworkPolicy", FULLNAME)["spec"]["ingress"]
    assert gw[0]["from"] == v["from"] and _ingress_ports(gw[0]) == {8001, 8000}
    assert gw[1]["from"] == v["metricsFrom"] and _ingress_ports(gw[1]) == {8002}
    assert "from" not in gw[2]  # grpc.health.v1 only


def test_in_chart_redis_takes_only_the_gateway_pods_and_makes_no_connections():
    for name in ("redis-internal", "netpol-restricted"):
        r = rendered(name)
        redis_name = f"{FULLNAME}-redis"
        spec = r.one("NetworkPolicy", redis_name)["spec"]
        redis_labels, gateway_labels = pod_labels(r, redis_name), pod_labels(r, FULLNAME)
        assert _selects(spec["podSelector"], redis_labels)
        assert not _selects(spec["podSelector"], gateway_labels)
        assert not _selects(r.one("NetworkPolicy", FULLNAME)["spec"]["podSelector"], redis_labels)
        assert spec["policyTypes"] == ["Ingress", "Egress"] and spec["egress"] == []
        (rule,) = spec["ingress"]
        (peer,) = rule["from"]
        assert set(peer) == {"podSelector"}  # this namespace's pods only, and only the gateway's
        assert _selects(peer["podSelector"], gateway_labels)
        assert not _selects(peer["podSelector"], redis_labels)
        assert _ingress_ports(rule) == {6379}
    # No Redis in the chart: no policy for it.
    assert [p["metadata"]["name"] for p in rendered("redis-external-parts").of("NetworkPolicy")] == [FULLNAME]


def test_network_policy_off():
    assert not rendered("netpol-off").of("NetworkPolicy")


# -- spreading over nodes ---------------------------------------------------------------------------


def test_replicas_spread_over_nodes_by_default_softly():
    r = rendered("defaults")
    (c,) = r.pod["topologySpreadConstraints"]
    assert (c["topologyKey"], c["whenUnsatisfiable"], c["maxSkew"]) == (
        "kubernetes.io/hostname", "ScheduleAnyway", 1)  # fmt: skip
    assert _selects(c["labelSelector"], pod_labels(r, FULLNAME))
    assert c["matchLabelKeys"] == ["pod-template-hash"]  # one rollout's pods are counted together
    for name in ("redis-internal",):  # never counts the Redis pod
        rr = rendered(name)
        (c,) = rr.pod["topologySpreadConstraints"]
        assert not _selects(c["labelSelector"], pod_labels(rr, f"{FULLNAME}-redis"))


def test_spread_is_tunable_and_extra_constraints_are_appended(chart):
    own, zone = rendered("spread-custom").pod["topologySpreadConstraints"]
    assert (own["whenUnsatisfiable"], own["maxSkew"]) == ("DoNotSchedule", 2)
    assert zone == PLATFORM_SETS["spread-custom"]["topologySpreadConstraints"][0]
    r = render(chart, {"topologySpread": {"enabled": False}})
    assert "topologySpreadConstraints" not in r.pod
    # The same key and mode twice is a pair Kubernetes refuses; the render says so first.
    dup = {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway"}
    refuses(chart, {"topologySpreadConstraints": [dup]}, "repeats topologySpread's")


# -- the replica count passed down ------------------------------------------------------------------


@pytest.mark.parametrize(
    "values, want",
    [
        ({}, 2),
        ({"replicaCount": 5}, 5),
        ({"replicaCount": 0}, 1),  # no pod reads it then; the setting's floor is 1
        ({"autoscaling": {"enabled": True, "minReplicas": 3, "maxReplicas": 9}}, 3),
        (
            {
                "autoscaling": {"minReplicas": 4, "keda": {"enabled": True, "serverAddress": PROMETHEUS}},
                "metrics": {"serviceMonitor": {"enabled": True}},
            },
            4,
        ),
        ({"replicaCount": 5, "config": {"ratelimit_expected_replicas": 12}}, 12),  # yours wins
    ],
)
def test_ratelimit_expected_replicas_follows_the_replica_count(chart, monkeypatch, values, want):
    r = render(chart, values)
    assert r.config["BATCHGATE_RATELIMIT_EXPECTED_REPLICAS"] == str(want)
    for k in list(os.environ):
        if k.startswith("BATCHGATE_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv(
        "BATCHGATE_RATELIMIT_EXPECTED_REPLICAS", r.config["BATCHGATE_RATELIMIT_EXPECTED_REPLICAS"]
    )
    assert Settings().ratelimit_expected_replicas == want


# -- external Redis TLS with a private CA -----------------------------------------------------------


def _ca_volume(r: Rendered) -> tuple[dict, dict]:
    (vol,) = [v for v in r.pod["volumes"] if v["name"] == "redis-ca"]
    (mount,) = [m for m in r.gateway["volumeMounts"] if m["name"] == "redis-ca"]
    return vol, mount


def test_redis_ca_is_mounted_and_named_in_the_url(chart):
    r = rendered("redis-ca-secret")
    url = r.env()["BATCHGATE_REDIS_URL"]["value"]
    # No password in it: the server adds the one of BATCHGATE_REDIS_PASSWORD_FILE (a mounted Secret).
    assert url == f"rediss://redis.cache.svc:6379/0?ssl_ca_certs={CA_DIR}/ca.crt"
    assert r.env()["BATCHGATE_REDIS_PASSWORD_FILE"]["value"] == "/etc/batchgate/redis/password"
    vol, mount = _ca_volume(r)
    assert vol["secret"]["secretName"] == "redis-ca"
    assert vol["secret"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}]
    # A directory mount, no subPath: a rotated CA reaches the pod.
    assert mount == {"name": "redis-ca", "mountPath": CA_DIR, "readOnly": True}

    r = rendered("redis-ca-configmap-url")
    stored = base64.b64decode(r.one("Secret", FULLNAME)["data"]["redis-url"]).decode()
    assert stored == (
        f"rediss://:{PASSWORD}@redis.example:6380/1?socket_keepalive=true&ssl_ca_certs={CA_DIR}/corp.pem"
    )
    vol, _ = _ca_volume(r)
    assert vol["configMap"] == {
        "name": "corp-ca",
        "defaultMode": 0o444,
        "items": [{"key": "corp.pem", "path": "corp.pem"}],
    }

    # A URL of yours, from your Secret: mounted, and NOTES says what the URL must name.
    r = render(chart, {"redis": {"mode": "external", "existingSecret": "creds", "existingSecretUrlKey": "url",
                                 "tlsCA": {"existingSecret": "redis-ca"}}})  # fmt: skip
    assert _ca_volume(r)[1]["mountPath"] == CA_DIR
    assert f"?ssl_ca_certs={CA_DIR}/ca.crt" in r.files["batchgate/templates/NOTES.txt"]

    for name in ("defaults", "redis-external-parts", "redis-internal"):
        r = rendered(name)
        assert not any(v["name"] == "redis-ca" for v in r.pod["volumes"]), name
        assert "ssl_ca_certs" not in r.env().get("BATCHGATE_REDIS_URL", {}).get("value", ""), name


@pytest.mark.parametrize(
    "values, needle",
    [
        ({"redis": {"mode": "external", "host": "r", "tlsCA": {"existingSecret": "ca"}}}, "redis.tls=true"),
        (
            {"redis": {"mode": "external", "url": "redis://r:6379", "tlsCA": {"existingSecret": "ca"}}},
            "rediss://",
        ),
        ({"redis": {"mode": "internal", "tlsCA": {"existingSecret": "ca"}}}, "redis.mode=external"),
        (
            {
                "redis": {
                    "mode": "external",
                    "host": "r",
                    "tls": True,
                    "tlsCA": {"existingSecret": "ca", "existingConfigMap": "ca"},
                }
            },
            "not both",
        ),  # fmt: skip
    ],
)
def test_redis_ca_refuses_what_would_not_verify(chart, values, needle):
    refuses(chart, values, needle)


def _tls_redis(tmp: Path, pki) -> tuple[subprocess.Popen, int]:
    (port,) = free_ports(1)
    args = ["redis-server", "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
            "--tls-cert-file", str(pki.server_cert), "--tls-key-file", str(pki.server_key),
            "--tls-ca-cert-file", str(pki.ca_file), "--tls-auth-clients", "no",
            "--save", "", "--appendonly", "no", "--dir", str(tmp)]  # fmt: skip
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, port


def test_the_composed_ca_url_reaches_a_redis_signed_by_that_ca(tmp_path):
    """The server has no Redis CA setting of its own: the URL's ssl_ca_certs query is what redis-py
    (both the cache tier and the rate limiter build their clients with from_url) verifies with. A
    gateway given the chart's URL, with the CA at the mount's path swapped for a local one, writes
    its cache rows to a TLS Redis whose certificate a private CA signed; without the query the
    handshake fails."""
    import redis

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    pki = make_pki(tmp_path / "pki")
    proc, port = _tls_redis(tmp_path, pki)
    try:
        rendered_url = rendered("redis-ca-secret").env()["BATCHGATE_REDIS_URL"]["value"]
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(rendered_url).query)
        assert query == {"ssl_ca_certs": [f"{CA_DIR}/ca.crt"]}
        url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={pki.ca_file}"
        deadline = time.monotonic() + 10
        while True:  # the TLS port is up
            try:
                if redis.from_url(url, socket_timeout=1).ping():
                    break
            except redis.RedisError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail("redis-server with TLS did not start (built without TLS?)")
                time.sleep(0.1)
        with pytest.raises(redis.ConnectionError, match="(?i)certificate"):
            redis.from_url(f"rediss://127.0.0.1:{port}/0", socket_timeout=1).ping()

        repo = tmp_path / "repo"
        shutil.copytree(REPO / "ranker", repo / "ranker")
        with (repo / "ranker" / "config.pbtxt").open("a") as f:
            f.write("\nresponse_cache { enable: true }\n")
        srv = start_server(tmp_path, "--no-build-models", repo=repo, env={"BATCHGATE_REDIS_URL": url})
        try:
            with grpc.insecure_channel(srv.grpc_url) as ch:
                pb_grpc.GRPCInferenceServiceStub(ch).ModelInfer(ranker_request(3, seed=7))
            client = redis.from_url(url, socket_timeout=1)
            deadline = time.monotonic() + 10
            while client.dbsize() < 3:  # written behind the answer
                assert time.monotonic() < deadline, srv.log()
                time.sleep(0.1)
        finally:
            srv.stop()
    finally:
        proc.kill()
        proc.wait()


# -- the in-chart Redis container, run ----------------------------------------------------------------


def test_in_chart_redis_reads_its_password_from_the_secret_file(tmp_path):
    """The rendered command, run with the local sh and redis-server (paths moved under tmp_path):
    the password from the mounted file is required, and it is in no process's argv or env."""
    import redis

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    r = rendered("redis-internal-password")
    pod = r.one("Deployment", f"{FULLNAME}-redis")["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert "env" not in c
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert mounts == {"/data": "data", "/run/redis": "run", "/etc/redis-auth": "auth"}
    run_vol = {v["name"]: v for v in pod["volumes"]}["run"]
    assert run_vol["emptyDir"]["medium"] == "Memory"  # the config file never reaches the node's disk
    moved = {p: tmp_path / n for p, n in mounts.items()}
    for d in moved.values():
        d.mkdir()
    (moved["/etc/redis-auth"] / "password").write_text(PASSWORD)
    script = c["command"][2]
    # redis-server rewrites its process title, which would hide a password in its argv from the
    # check below: so the exec'd command line itself must not carry it.
    assert "requirepass" not in " ".join(c["args"]) and "$(" not in script.split("exec ", 1)[1]
    for path, local in moved.items():
        script = script.replace(path + "/", f"{local}/")
    (port,) = free_ports(1)
    args = [str(moved["/data"]) if a == "/data" else (str(port) if a == "6379" else a) for a in c["args"]]
    proc = subprocess.Popen([*c["command"][:2], script, *c["command"][3:], *args, "--bind", "127.0.0.1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        client = redis.Redis(port=port, password=PASSWORD, socket_timeout=1)
        deadline = time.monotonic() + 10
        while True:
            try:
                assert client.ping()
                break
            except redis.ConnectionError:
                assert proc.poll() is None and time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, socket_timeout=1).set("k", "v")
        assert proc.poll() is None  # exec'd: redis-server is the process sh was
        seen = Path(f"/proc/{proc.pid}/cmdline").read_bytes() + Path(f"/proc/{proc.pid}/environ").read_bytes()
        assert PASSWORD.encode() not in seen
        conf = moved["/run/redis"] / "auth.conf"
        assert conf.stat().st_mode & 0o077 == 0
    finally:
        proc.kill()
        proc.wait()


# -- metrics on their own Service ---------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ALL_SETS))
def test_metrics_port_is_on_its_own_service_and_scraped_there(name):
    r = rendered(name)
    main = r.one("Service", FULLNAME)
    assert "metrics" not in {p["name"] for p in main["spec"]["ports"]}
    assert 8002 not in {p["port"] for p in main["spec"]["ports"]}
    metrics = r.one("Service", METRICS_SVC)
    assert [(p["name"], p["port"], p["targetPort"]) for p in metrics["spec"]["ports"]] == [
        ("metrics", 8002, "metrics")
    ]
    assert _selects({"matchLabels": metrics["spec"]["selector"]}, pod_labels(r, FULLNAME))
    for sm in r.of("ServiceMonitor"):
        selected = [
            s["metadata"]["name"]
            for s in r.of("Service")
            if _selects(sm["spec"]["selector"], s["metadata"]["labels"])
        ]
        assert selected == [METRICS_SVC], name
        assert [ep["port"] for ep in sm["spec"]["endpoints"]] == ["metrics"]


# -- liveness is not readiness, on a live server ------------------------------------------------------


def _start_unready(tmp: Path, repo: Path, env: dict) -> tuple[ServerProcess, dict[str, int]]:
    """A server that will never report SERVING (start_server waits for that): started here, ready
    to be probed once its log says loading ended."""
    grpc_port, http_port, metrics_port, health_port = free_ports(4)
    log_path = tmp / "server.log"
    cmd = [sys.executable, "-m", "batchgate", "serve", "--no-build-models", "--model-repository", str(repo),
           "--host", "127.0.0.1", "--grpc-port", str(grpc_port), "--http-port", str(http_port)]  # fmt: skip
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "BATCHGATE_VARIANT_SELECTION": "off", **env,
                "BATCHGATE_METRICS_PORT": str(metrics_port), "BATCHGATE_HEALTH_PORT": str(health_port)}  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=log_path.open("w"), stderr=subprocess.STDOUT)
    srv = ServerProcess(proc, grpc_port, http_port, log_path, env)
    deadline = time.monotonic() + 60
    while "ready: " not in srv.log():
        if proc.poll() is not None or time.monotonic() > deadline:
            srv.stop()
            pytest.fail(f"server did not finish loading\n{srv.log()}")
        time.sleep(0.1)
    return srv, {"grpc": grpc_port, "http": http_port, "metrics": metrics_port, "health": health_port}


def test_a_model_that_fails_to_load_makes_the_pod_unready_not_dead(tmp_path):
    """The gpu value set (strict_readiness, what gpu.enabled sets): its probes, asked of a server
    whose second model cannot load. Liveness (and startup) answers; readiness refuses. With both on
    the readiness signal, as before, the kubelet would restart this pod every few minutes."""
    r = rendered("gpu")
    assert r.config["BATCHGATE_STRICT_READINESS"] == "true"
    live, startup, ready = (r.gateway[p] for p in ("livenessProbe", "startupProbe", "readinessProbe"))
    assert live["httpGet"] == startup["httpGet"]
    repo = tmp_path / "repo"
    shutil.copytree(REPO / "ranker", repo / "ranker")
    shutil.copytree(REPO / "ranker", repo / "broken")
    cfg = repo / "broken" / "config.pbtxt"
    cfg.write_text(cfg.read_text().replace('name: "ranker"', 'name: "broken"'))
    (repo / "broken" / "1" / "model.onnx").write_bytes(b"not an onnx model")
    srv, ports = _start_unready(tmp_path, repo, {"BATCHGATE_STRICT_READINESS": "true"})
    try:
        get = live["httpGet"]
        url = f"{get['scheme'].lower()}://127.0.0.1:{ports[get['port']]}{get['path']}"
        with urllib.request.urlopen(url, timeout=5) as resp:
            assert resp.status == 200
        (health_port,) = [
            ports[p["name"]] for p in r.gateway["ports"] if p["containerPort"] == ready["grpc"]["port"]
        ]
        with grpc.insecure_channel(f"127.0.0.1:{health_port}") as ch:
            status = (
                health_pb2_grpc.HealthStub(ch)
                .Check(health_pb2.HealthCheckRequest(service=ready["grpc"]["service"]), timeout=5)
                .status
            )
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        scrape = (
            urllib.request.urlopen(f"http://127.0.0.1:{ports['metrics']}/metrics", timeout=5).read().decode()
        )
        assert re.search(r'^batchgate_model_ready\{model="broken",version="\d*"\} 0\.0$', scrape, re.M), (
            scrape
        )
    finally:
        srv.stop()


# -- KEDA -----------------------------------------------------------------------------------------------


def test_keda_scales_the_deployment_on_calls_in_flight():
    r = rendered("keda")
    assert not r.of("HorizontalPodAutoscaler")  # KEDA makes its own; two would fight
    assert "replicas" not in r.deployment["spec"]  # or every upgrade would reset KEDA's count
    so = r.one("ScaledObject", FULLNAME)
    spec = so["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": FULLNAME}
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (2, 10)
    assert (
        spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] == DEFAULTS["autoscaling"]["behavior"]
    )
    (trigger,) = spec["triggers"]
    assert trigger["metricType"] == "AverageValue"  # the query is the total; the HPA divides by pods
    meta = trigger["metadata"]
    assert meta["serverAddress"] == PROMETHEUS and meta["threshold"] == "6"
    assert meta["ignoreNullValues"] == "false"
    # The job label Prometheus Operator gives the scrape is the scraped Service's name.
    sm = r.one("ServiceMonitor")
    (scraped,) = [s for s in r.of("Service") if _selects(sm["spec"]["selector"], s["metadata"]["labels"])]
    sel = f'namespace="{NAMESPACE}",job="{scraped["metadata"]["name"]}"'
    assert meta["query"] == (
        f"sum(rate(batchgate_request_duration_seconds_sum{{{sel}}}[1m])) or 0 * sum(batchgate_build_info{{{sel}}})"
    )
    assert "authenticationRef" not in trigger


def test_keda_takes_a_custom_query_and_credentials():
    r = rendered("keda-custom")
    spec = r.one("ScaledObject")["spec"]
    (trigger,) = spec["triggers"]
    keda = PLATFORM_SETS["keda-custom"]["autoscaling"]["keda"]
    assert trigger["metadata"]["query"] == keda["query"] and trigger["metadata"]["threshold"] == "500m"
    assert trigger["authenticationRef"] == {"name": "prometheus-creds"}
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (3, 30)
    assert spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleUp"] == {
        "stabilizationWindowSeconds": 0
    }
    assert r.config["BATCHGATE_RATELIMIT_EXPECTED_REPLICAS"] == "3"
    assert not rendered("defaults").of("ScaledObject")


@pytest.mark.parametrize(
    "values, needle",
    [
        (
            {
                "autoscaling": {"enabled": True, "keda": {"enabled": True, "serverAddress": PROMETHEUS}},
                "metrics": {"serviceMonitor": {"enabled": True}},
            },
            "enable one",
        ),  # fmt: skip
        (
            {"autoscaling": {"keda": {"enabled": True}}, "metrics": {"serviceMonitor": {"enabled": True}}},
            "serverAddress",
        ),
        (
            {"autoscaling": {"keda": {"enabled": True, "serverAddress": PROMETHEUS}}},
            "metrics.serviceMonitor.enabled",
        ),
        (
            {
                "autoscaling": {
                    "minReplicas": 5,
                    "maxReplicas": 3,
                    "keda": {"enabled": True, "serverAddress": PROMETHEUS, "query": "sum(up)"},
                }
            },
            "above autoscaling.maxReplicas",
        ),  # fmt: skip
    ],
)
def test_keda_refuses_inconsistent_values(chart, values, needle):
    refuses(chart, values, needle)


# -- the dashboard -------------------------------------------------------------------------------------

# Labels Prometheus adds to every series of a target (the Prometheus Operator's relabelling of a
# ServiceMonitor endpoint: namespace, pod, job = the Service's name); the server's /metrics cannot
# show them. The dashboard may select and group by these, and nothing else that the scrape lacks.
TARGET_LABELS = {"namespace", "job", "pod"}
PROMQL_FUNCTIONS = {
    "sum", "min", "max", "avg", "count", "rate", "irate", "increase", "histogram_quantile", "vector",
    "avg_over_time", "max_over_time", "clamp_min", "topk",
}  # fmt: skip
PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless"}  # fmt: skip
_TOKEN = re.compile(
    r'\s*(?:(?P<str>"(?:[^"\\]|\\.)*")|(?P<range>\[[^\]]+\])|(?P<num>\d+(?:\.\d+)?)'
    r"|(?P<id>[A-Za-z_:][\w:]*)|(?P<op>=~|!~|!=|==|>=|<=|[-+*/^%(){},=<>]))"
)


@dataclass
class PromQL:
    selectors: list[tuple[str, list[tuple[str, str, str]]]] = field(default_factory=list)  # name, matchers
    grouping: set[str] = field(default_factory=set)  # labels of by / without / on / ignoring / group_*


def parse_promql(expr: str) -> PromQL:
    """Just enough PromQL for the dashboard: every identifier is a function (called), a keyword, a
    label in a grouping list or a selector, or else a metric name; anything else fails the test."""
    tokens, pos = [], 0
    while pos < len(expr.rstrip()):
        m = _TOKEN.match(expr, pos)
        assert m, f"cannot read {expr[pos : pos + 30]!r} in {expr!r}"
        tokens.append((m.lastgroup, m.group(m.lastgroup)))
        pos = m.end()
    out, i = PromQL(), 0
    while i < len(tokens):
        kind, text = tokens[i]
        nxt = tokens[i + 1][1] if i + 1 < len(tokens) else None
        if kind == "id" and text in PROMQL_KEYWORDS:
            if nxt == "(":
                j = tokens.index((("op", ")")), i)
                out.grouping |= {t for k, t in tokens[i + 2 : j] if k == "id"}
                i = j
        elif kind == "id" and (nxt == "(" or nxt in ("by", "without")):  # `sum by (x) (...)` too
            assert text in PROMQL_FUNCTIONS, f"unknown function {text} in {expr!r}"
        elif kind == "id":
            matchers = []
            if nxt == "{":
                j = tokens.index(("op", "}"), i)
                body = [t for t in tokens[i + 2 : j] if t != ("op", ",")]
                assert len(body) % 3 == 0, f"matchers of {text} in {expr!r}"
                for n in range(0, len(body), 3):
                    (k1, label), (_, op), (k3, value) = body[n : n + 3]
                    assert k1 == "id" and k3 == "str", f"matcher {body[n : n + 3]} in {expr!r}"
                    matchers.append((label, op, json.loads(value)))
                i = j
            out.selectors.append((text, matchers))
        else:
            assert text != "{", f"a selector without a metric name in {expr!r}"
        i += 1
    return out


def dashboard_queries(dash: dict) -> list[tuple[str, str, set[str]]]:
    """(where, PromQL, labels the legend names) for every panel target and query variable."""
    out = []
    for p in dash["panels"]:
        for t in p.get("targets", []):
            out.append(
                (
                    f"panel {p['title']!r}",
                    t["expr"],
                    set(re.findall(r"\{\{(\w+)\}\}", t.get("legendFormat", ""))),
                )
            )
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", v["query"]["query"])
            assert m, v
            out.append((f"variable {v['name']}", m.group(1), {m.group(2)}))
    return out


def _grafana_free(expr: str) -> str:
    """Grafana's interval macros are durations by the time Prometheus sees them."""
    return re.sub(r"\$__(rate_interval|interval|range)", "5m", expr)


@pytest.fixture(scope="module")
def live_scrape(tmp_path_factory) -> dict[str, dict[str, set[str]]]:
    """{sample name: {label: values}} from a live server after a small workload that reaches every
    panel's metrics: the ranker with its result cache (a hit among misses), the encoder (padded,
    variable-length batches), an unknown model and a malformed call (refusals)."""
    tmp = tmp_path_factory.mktemp("dash")
    repo = tmp / "repo"
    for name in ("ranker", "encoder"):
        shutil.copytree(REPO / name, repo / name)
    with (repo / "ranker" / "config.pbtxt").open("a") as f:
        f.write("\nresponse_cache { enable: true }\n")
    srv = start_server(tmp, "--no-build-models", repo=repo)
    try:
        with grpc.insecure_channel(srv.grpc_url) as ch:
            stub = pb_grpc.GRPCInferenceServiceStub(ch)
            for seed in (1, 2, 1):
                stub.ModelInfer(ranker_request(2, seed))
            for seq in (13, 30):
                enc = pb.ModelInferRequest(model_name="encoder")
                for name in ("input_ids", "attention_mask"):
                    enc.inputs.add(name=name, datatype="INT64", shape=[2, seq])
                    enc.raw_input_contents.append(np.ones((2, seq), np.int64).tobytes())
                stub.ModelInfer(enc)
            for bad in (
                pb.ModelInferRequest(model_name="no-such-model"),
                pb.ModelInferRequest(model_name="ranker"),
            ):
                with pytest.raises(grpc.RpcError):
                    stub.ModelInfer(bad)
        text = urllib.request.urlopen(f"http://127.0.0.1:{srv.http_port}/metrics", timeout=10).read().decode()
    finally:
        srv.stop()
    out: dict[str, dict[str, set[str]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = out.setdefault(s.name, {})
            for k, v in s.labels.items():
                labels.setdefault(k, set()).add(v)
    return out


def unresolved(expr: str, legend: set[str], scrape: dict[str, dict[str, set[str]]]) -> list[str]:
    q = parse_promql(_grafana_free(expr))
    problems = []
    names = [n for n, _ in q.selectors]
    if not names:
        problems.append("no metric")
    for name, matchers in q.selectors:
        if name not in scrape:
            problems.append(f"metric {name} is not exported")
            continue
        for label, op, value in matchers:
            if label in TARGET_LABELS:
                continue
            if label not in scrape[name]:
                problems.append(f"{name} has no label {label}")
            elif op == "=" and "$" not in value and value not in scrape[name][label]:
                problems.append(
                    f'{name}{{{label}="{value}"}} matches no series (seen {sorted(scrape[name][label])})'
                )
    known = set().union(*(scrape.get(n, {}).keys() for n in names), TARGET_LABELS)
    problems += [f"by/on label {label} is on none of {names}" for label in sorted(q.grouping - known)]
    # A legend can only name labels the query keeps.
    keeps = q.grouping or known
    problems += [f"legend label {label} is not kept by the query" for label in sorted(legend - keeps)]
    return problems


def test_every_dashboard_query_resolves_against_a_live_scrape(live_scrape):
    dash = json.loads(DASHBOARD.read_text())
    queries = dashboard_queries(dash)
    assert len(queries) >= 25
    bad = {
        f"{where}: {expr}": p
        for where, expr, legend in queries
        if (p := unresolved(expr, legend, live_scrape))
    }
    assert not bad, json.dumps(bad, indent=1)


def test_the_dashboard_covers_what_an_operator_asks_for():
    """Issue 33's list, as metric names: calls and refusals by status and class, latency, queue depth
    and wait, batch size and padding, cache hits, rows/s per model, the overload gate, device memory,
    and the autoscaling signal."""
    exprs = " ".join(expr for _, expr, _ in dashboard_queries(json.loads(DASHBOARD.read_text())))
    for name in (
        "batchgate_requests_total", "batchgate_class_requests_total", "batchgate_request_duration_seconds_bucket",
        "batchgate_queue_depth", "batchgate_queue_duration_seconds_bucket", "batchgate_batch_size_rows_sum",
        "batchgate_batch_padding_ratio_sum", "batchgate_cache_lookups_total", "batchgate_inference_rows_total",
        "batchgate_overload_admitted_ratio", "batchgate_overload_refused_total", "batchgate_device_memory_bytes",
        "batchgate_inflight_requests", "batchgate_class_request_duration_seconds_bucket",
    ):  # fmt: skip
        assert name in exprs, name
    assert "histogram_quantile(0.5," in exprs and "histogram_quantile(0.99," in exprs
    assert "by (class" in exprs and "by (le, class)" in exprs


def test_the_query_checker_catches_what_it_should(live_scrape):
    # The checker itself must fail on each kind of mistake, or the test above proves nothing.
    ok = 'sum by (model) (rate(batchgate_requests_total{job="$job",outcome="success"}[$__rate_interval]))'
    assert unresolved(ok, {"model"}, live_scrape) == []
    for bad in (
        "sum(rate(batchgate_request_total[5m]))",  # a name the server does not export
        'sum(rate(batchgate_requests_total{klass="x"}[5m]))',  # a label it does not have
        'sum(rate(batchgate_requests_total{outcome="sucess"}[5m]))',  # a value no series has
        "sum by (class) (rate(batchgate_requests_total[5m]))",  # grouping by a label of another metric
        "histogram_quantile(0.99, sum by (le) (rate(batchgate_queue_duration_seconds[5m])))",  # not _bucket
    ):
        assert unresolved(bad, set(), live_scrape), bad
    assert unresolved(ok, {"pod"}, live_scrape)  # a legend naming a label the query drops
    for unreadable in (
        'sum(rate({__name__="batchgate_requests_total"}[5m]))',  # no name to check
        "sum(rate(batchgate_requests_total[5m])) @ 1700000000",
        "sumx(rate(batchgate_requests_total[5m]))",  # an unknown function
    ):
        with pytest.raises(AssertionError):
            unresolved(unreadable, set(), live_scrape)


def test_the_default_keda_query_resolves_against_a_live_scrape(live_scrape):
    (trigger,) = rendered("keda").one("ScaledObject")["spec"]["triggers"]
    assert unresolved(trigger["metadata"]["query"], set(), live_scrape) == []


def test_the_dashboard_is_well_formed():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "batchgate" and dash["schemaVersion"] >= 36
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"] == {**variables["datasource"], "type": "datasource", "query": "prometheus"}
    for p in dash["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"] and len({t["refId"] for t in p["targets"]}) == len(p["targets"]), p["title"]
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"]
            # Every query is scoped to the chosen release; a panel summing all namespaces would mislead.
            assert 'namespace="$namespace"' in t["expr"] and 'job="$job"' in t["expr"], (
                p["title"],
                t["expr"],
            )
    # Panels do not overlap.
    cells = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, p["title"]
        cells |= mine


def test_the_dashboard_ships_as_a_configmap_for_the_grafana_sidecar():
    assert not rendered("defaults").of("ConfigMap", f"{FULLNAME}-dashboard")  # off by default
    cm = rendered("dashboard").one("ConfigMap", f"{FULLNAME}-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "Serving"}
    assert json.loads(cm["data"]["batchgate.json"]) == json.loads(DASHBOARD.read_text())


# -- checkov ------------------------------------------------------------------------------------------

NETWORK_POLICY_CHECKS = {"CKV2_K8S_6"}  # pods without a NetworkPolicy
# Secrets as env variables; service-account tokens mounted; accounts able to read all Secrets.
SECRET_CHECKS = {"CKV_K8S_35", "CKV_K8S_38", "CKV2_K8S_5"}
# Non-root, a high uid, read-only root, no escalation, capabilities (and NET_RAW) dropped, seccomp.
POD_HARDENING = {"CKV_K8S_20", "CKV_K8S_22", "CKV_K8S_23", "CKV_K8S_28", "CKV_K8S_31", "CKV_K8S_37", "CKV_K8S_40"}  # fmt: skip


@dataclass(frozen=True)
class Finding:
    check: str
    pod: str  # gateway | redis
    value_set: str


def _pod_of(resource: str) -> str:
    # "Deployment.serving.rel-batchgate-redis", or for graph checks "Pod.serving.rel-batchgate-redis.<labels>"
    name = resource.split(".")[2]
    return "redis" if name.startswith(f"{FULLNAME}-redis") else "gateway"


@pytest.fixture(scope="module")
def checkov(tmp_path_factory) -> tuple[list[Finding], list[Finding]]:
    """(failed, passed) over every value set, one file per set, one checkov run."""
    # make test installs checkov into a venv of its own (.venv-checkov: its pins clash with ours)
    own = Path(__file__).resolve().parents[1] / ".venv-checkov" / "bin" / "checkov"
    exe = str(own) if own.exists() else shutil.which("checkov", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.fail("checkov is not installed: make test installs it into .venv-checkov (Makefile)")
    folder = tmp_path_factory.mktemp("checkov")
    for name in ALL_SETS:
        docs = rendered(name).files
        text = "\n---\n".join(t for p, t in sorted(docs.items()) if not p.endswith("NOTES.txt") and t.strip())
        (folder / f"{name}.yaml").write_text(text)
    # --skip-download: no call to Prisma Cloud for guidelines (there is no network here either).
    run = subprocess.run(
        [exe, "-d", str(folder), "--framework", "kubernetes", "-o", "json", "--skip-download"],
        capture_output=True, text=True, timeout=300, cwd=folder,
    )  # fmt: skip
    assert run.returncode in (0, 1), run.stderr[-3000:]
    reports = json.loads(run.stdout)
    failed, passed = [], []
    for report in reports if isinstance(reports, list) else [reports]:
        for bucket, sink in (("failed_checks", failed), ("passed_checks", passed)):
            for f in report["results"][bucket]:
                sink.append(Finding(f["check_id"], _pod_of(f["resource"]), Path(f["file_path"]).stem))
    assert {f.value_set for f in passed} == set(ALL_SETS)
    return failed, passed


def documented_findings() -> dict[str, set[str]]:
    """docs/kubernetes.md's table of accepted checkov failures: check id -> pods."""
    section = DOCS.read_text().split("### checkov findings", 1)[1].split("\n#", 1)[0]
    rows = re.findall(r"^\| `(CKV2?_K8S_\d+)` [^|]*\| ([a-z, ]+) \| (.+) \|$", section, re.M)
    assert rows, "docs/kubernetes.md: no checkov table found"
    out: dict[str, set[str]] = {}
    for check, pods, why in rows:
        assert len(why.strip()) > 20, f"{check}: say why it stays"
        out[check] = {p.strip() for p in pods.split(",")}
    return out


def test_checkov_findings_are_exactly_the_documented_ones(checkov):
    failed, _ = checkov
    found: dict[str, set[str]] = {}
    for f in failed:
        found.setdefault(f.check, set()).add(f.pod)
    assert found == documented_findings(), (
        "checkov's findings changed: fix the chart, or justify each new one in docs/kubernetes.md "
        f"(### checkov findings); found {found}"
    )


def test_checkov_passes_network_policies_and_pod_hardening(checkov):
    failed, passed = checkov
    assert not [f for f in failed if f.check in NETWORK_POLICY_CHECKS | POD_HARDENING]
    ran = {(f.check, f.pod) for f in passed}
    # The checks ran on both pods (a check that never runs passes nothing).
    for check in NETWORK_POLICY_CHECKS | POD_HARDENING:
        assert {(check, "gateway"), (check, "redis")} <= ran, check


def test_checkov_finds_no_secret_handling_failures(checkov):
    failed, passed = checkov
    assert not [f for f in failed if f.check in SECRET_CHECKS]
    ran = {(f.check, f.pod) for f in passed}
    for check in SECRET_CHECKS - {"CKV2_K8S_5"}:  # a graph check over RBAC, not over the pods
        assert {(check, "gateway"), (check, "redis")} <= ran, check


def test_the_gateway_takes_no_secret_from_env(checkov):
    """CKV_K8S_35 passes on the gateway in every value set, Redis ones included: the Redis URL or
    password reaches it as a file of a mounted Secret (tests/test_helm.py builds Settings from it)."""
    failed, passed = checkov
    assert not [f for f in failed if f.check == "CKV_K8S_35"]
    redis_sets = {n for n, v in ALL_SETS.items() if v.get("redis", {}).get("mode", "none") != "none"}
    checked = {f.value_set for f in passed if f.check == "CKV_K8S_35" and f.pod == "gateway"}
    assert redis_sets and redis_sets <= checked, redis_sets - checked
