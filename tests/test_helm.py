"""The Helm chart (helm/batchgate) and the container images, checked offline: no cluster, no helm
binary, no Docker daemon.

- The chart is linted and rendered by Helm's own Go engine (helm-python-sdk binds Helm's SDK as a C
  library) for several value sets; every rendered manifest is validated by kubernetes-validate in
  strict mode against Kubernetes 1.30 and the newest schema it bundles.
- The chart cannot drift from the code: values.schema.json's ``config`` section is derived from
  ``gateway.config.Settings`` (``python tests/test_helm.py --sync-schema`` rewrites it), and every
  BATCHGATE_* name the chart renders must be a Settings field whose value Settings accepts.
- The Dockerfiles are parsed and checked for what a build would need and what the image must be.
"""

from __future__ import annotations

import base64
import fnmatch
import functools
import json
import os
import re
import shlex
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script (--sync-schema) from anywhere
    sys.path.insert(0, str(ROOT))

import annotated_types  # noqa: E402
import helm_python as helm  # noqa: E402
import kubernetes_validate  # noqa: E402
from kubernetes_validate.utils import SchemaNotFoundError  # noqa: E402

from batchgate.gateway.config import Settings  # noqa: E402

CHART = ROOT / "helm" / "batchgate"
SCHEMA_PATH = CHART / "values.schema.json"
RELEASE, NAMESPACE = "rel", "serving"
FULLNAME = "rel-batchgate"
K8S_VERSIONS = ("1.30", kubernetes_validate.utils.latest_version())

# Settings the chart sets from structured values (so probes, volumes and the grace period agree
# with them); values.schema.json refuses them under `config`.
MANAGED = {
    "grpc_port": "containerPorts.grpc",
    "http_port": "containerPorts.http",
    "model_repository": "modelRepository",
    "drain_timeout_s": "drain.timeoutSeconds",
    "drain_linger_s": "drain.lingerSeconds",
    "redis_url": "redis",
    "redis_url_file": "redis",
    "redis_password_file": "redis",
    "api_keys_file": "auth",
    "tls_cert_file": "tls",
    "tls_key_file": "tls",
    "tls_client_ca_file": "tls.clientAuth",
    "metrics_port": "containerPorts.metrics",
    "health_port": "containerPorts.health",
}
# Kinds kubernetes-validate has no schema for (CRDs); each gets its own shape check below.
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("cert-manager.io/v1", "Certificate")}

# Stand-ins for secrets: the tests assert they never appear in clear in any rendered file.
PASSWORD = "Pw-9d2Xq7vLr"
API_KEYS_MARKER = "5e884898da28047151d0e56f8dc6292773603d0d1aa8e1f2b3c4d5e6f708192a"
API_KEYS_FILE = f'tenants:\n  - name: acme\n    key_hashes: ["sha256:{API_KEYS_MARKER}"]\n    models: "*"\n'

VALUE_SETS: dict[str, dict] = {
    "defaults": {},
    "headless": {"service": {"headless": {"enabled": True}}},
    "redis-internal": {"redis": {"mode": "internal"}},
    "redis-internal-password": {"redis": {"mode": "internal", "password": PASSWORD}},
    "redis-external-parts": {
        "redis": {
            "mode": "external",
            "host": "redis.cache.svc",
            "port": 6380,
            "db": 2,
            "tls": True,
            "username": "gateway",
            "password": PASSWORD,
        },
    },
    "redis-external-url": {
        "redis": {"mode": "external", "url": f"rediss://:{PASSWORD}@redis.example:6379/0"},
    },
    "existing-secrets": {
        "redis": {"mode": "external", "host": "redis.cache.svc", "existingSecret": "redis-creds"},
        "auth": {"enabled": True, "existingSecret": "tenants", "secretKey": "tenants.yaml"},
    },
    "existing-url-secret": {
        "redis": {"mode": "external", "existingSecret": "redis-creds", "existingSecretUrlKey": "url"},
    },
    "auth-inline": {"auth": {"enabled": True, "apiKeysFile": API_KEYS_FILE}},
    "gpu": {
        "gpu": {
            "enabled": True,
            "count": 2,
            "runtimeClassName": "nvidia",
            "nodeSelector": {"nvidia.com/gpu.present": "true"},
        },
        "config": {"workers_per_device": 2},
    },
    "pvc": {"modelRepository": {"source": "pvc", "pvc": {"existingClaim": "models", "subPath": "v3"}}},
    "pvc-selection": {
        "modelRepository": {"source": "pvc", "pvc": {"existingClaim": "models", "subPath": "v3"}},
        "variantSelection": {"initContainer": {"enabled": True}},
    },
    "init-container": {
        "modelRepository": {
            "source": "initContainer",
            "initContainer": {"image": {"repository": "registry.example/models", "tag": "2025-01"}},
        },
    },
    "scaling": {
        "autoscaling": {
            "enabled": True,
            "minReplicas": 3,
            "maxReplicas": 12,
            # The custom-metric example from values.yaml, through a Prometheus adapter.
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": "batchgate_queue_duration_seconds"},
                        "target": {"type": "AverageValue", "averageValue": "20m"},
                    },
                }
            ],
        },
        "podDisruptionBudget": {"maxUnavailable": None, "minAvailable": "50%"},
        "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}}},
        "service": {"headless": {"enabled": True}},
    },
    "tls-existing-secret": {
        "tls": {"enabled": True, "existingSecret": "gateway-tls", "clientAuth": True},
        "metrics": {"serviceMonitor": {"enabled": True}},
        "service": {"headless": {"enabled": True}},
    },
    "tls-cert-manager": {
        "tls": {
            "enabled": True,
            "certManager": {
                "enabled": True,
                "issuerRef": {"name": "internal-ca", "kind": "ClusterIssuer"},
                "dnsNames": ["batchgate.example.com"],
            },
        },
        "metrics": {"serviceMonitor": {"enabled": True}},
        "service": {"headless": {"enabled": True}},
    },
    "custom-drain": {
        "drain": {
            "timeoutSeconds": 90.5,
            "lingerSeconds": 4,
            "preStopSleepSeconds": 10,
            "preStopMode": "sleep",
        }
    },
    "everything": {
        "gpu": {"enabled": True},
        "redis": {"mode": "internal"},
        "auth": {"enabled": True, "apiKeysFile": API_KEYS_FILE},
        "autoscaling": {"enabled": True},
        "metrics": {"serviceMonitor": {"enabled": True}},
        "service": {"headless": {"enabled": True}},
        "modelRepository": {"source": "pvc", "pvc": {"existingClaim": "models"}},
        "config": {"log_level": "DEBUG", "max_message_bytes": 134217728, "strict_readiness": True},
        "terminationGracePeriodSeconds": 120,
        "tls": {"enabled": True, "certManager": {"enabled": True, "issuerRef": {"name": "ca"}}},
    },
}


# -- Settings -> values.schema.json `config` ------------------------------------------------------

_JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string", Path: "string"}
_BOUNDS = {
    annotated_types.Ge: ("minimum", "ge"),
    annotated_types.Gt: ("exclusiveMinimum", "gt"),
    annotated_types.Le: ("maximum", "le"),
    annotated_types.Lt: ("exclusiveMaximum", "lt"),
    annotated_types.MinLen: ("minLength", "min_length"),
    annotated_types.MaxLen: ("maxLength", "max_length"),
}


def _field_schema(name: str, info) -> dict:
    ann, nullable = info.annotation, False
    if typing.get_origin(ann) in (typing.Union, types.UnionType) and type(None) in typing.get_args(ann):
        nullable = True
        (ann,) = [a for a in typing.get_args(ann) if a is not type(None)]
    if typing.get_origin(ann) is typing.Literal:
        out: dict[str, Any] = {"enum": [*typing.get_args(ann), *([None] if nullable else [])]}
    elif ann in _JSON_TYPES:
        t = _JSON_TYPES[ann]
        out = {"type": [t, "null"] if nullable else t}
    else:
        raise AssertionError(f"Settings.{name}: no env/JSON-schema mapping for {ann!r}; extend _JSON_TYPES")
    for meta in info.metadata:
        if type(meta) not in _BOUNDS:
            raise AssertionError(f"Settings.{name}: no JSON-schema mapping for {meta!r}; extend _BOUNDS")
        key, attr = _BOUNDS[type(meta)]
        out[key] = getattr(meta, attr)
    if info.description:
        out["description"] = info.description
    return out


def config_schema() -> dict:
    """The `config` section values.schema.json must hold: one property per unmanaged Settings field."""
    return {
        "type": "object",
        "description": "Server settings (gateway.config.Settings) by field name, rendered as "
        "BATCHGATE_<NAME>; generated by `python tests/test_helm.py --sync-schema`. "
        "Fields the chart sets itself are refused: "
        + ", ".join(f"{k} (use {v})" for k, v in MANAGED.items()),
        "additionalProperties": False,
        "properties": {
            name: _field_schema(name, info)
            for name, info in Settings.model_fields.items()
            if name not in MANAGED
        },
    }


def sync_schema() -> None:
    schema = json.loads(SCHEMA_PATH.read_text())
    schema["properties"]["config"] = config_schema()
    SCHEMA_PATH.write_text(json.dumps(schema, indent=2) + "\n")


def _example_value(name: str, info) -> Any:
    """A valid, non-default-looking value for a Settings field, to prove it reaches the server."""
    if info.examples:  # a field whose values have a form of their own says so
        return info.examples[0]
    if info.default is not None and not isinstance(info.default, bool):
        return str(info.default) if isinstance(info.default, Path) else info.default
    ann = info.annotation
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        (ann,) = [a for a in typing.get_args(ann) if a is not type(None)]
    if ann is bool:
        return not info.default
    if typing.get_origin(ann) is typing.Literal:
        return typing.get_args(ann)[0]
    bounds = {type(m): m for m in info.metadata}
    if ann is int:
        ge = getattr(bounds.get(annotated_types.Ge), "ge", 1)
        gt = getattr(bounds.get(annotated_types.Gt), "gt", 0)
        return max(ge, gt + 1)
    if ann is float:
        if annotated_types.Le in bounds:
            return float(bounds[annotated_types.Le].le)
        return 1.5
    return "/srv/example" if ann is Path else "example"


# -- rendering ------------------------------------------------------------------------------------


@dataclass
class Rendered:
    files: dict[str, str]  # template path -> rendered text (NOTES.txt included)
    docs: list[dict] = field(default_factory=list)

    def of(self, kind: str, name: str | None = None) -> list[dict]:
        return [d for d in self.docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]

    def one(self, kind: str, name: str | None = None) -> dict:
        found = self.of(kind, name)
        names = [d["metadata"]["name"] for d in found]
        assert len(found) == 1, f"expected one {kind} {name or ''}, found {names}"
        return found[0]

    @property
    def deployment(self) -> dict:
        return self.one("Deployment", FULLNAME)

    @property
    def pod(self) -> dict:
        return self.deployment["spec"]["template"]["spec"]

    @property
    def gateway(self) -> dict:
        (c,) = [c for c in self.pod["containers"] if c["name"] == "gateway"]
        return c

    @property
    def config(self) -> dict[str, str]:
        return self.one("ConfigMap", FULLNAME)["data"]

    def env(self) -> dict[str, dict]:
        return {e["name"]: e for e in self.gateway.get("env", [])}


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(CHART) as c:
        yield c


def render(chart, values: dict) -> Rendered:
    files = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    out = Rendered(files)
    for path, text in sorted(files.items()):
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                out.docs.append(doc)
    return out


@functools.cache
def _cached(name: str) -> Rendered:
    with helm.Chart.load(CHART) as c:
        return render(c, VALUE_SETS[name])


@pytest.fixture(params=sorted(VALUE_SETS))
def rendered(request) -> tuple[str, dict, Rendered]:
    name = request.param
    return name, _merge(yaml.safe_load((CHART / "values.yaml").read_text()), VALUE_SETS[name]), _cached(name)


# -- lint, schema, kubernetes validation ----------------------------------------------------------


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_lint_has_no_findings_above_info(name):
    # helm lint reports problems as data; strict mode turns warnings into errors. Lint mode only
    # logs the chart's `fail` checks, so test_render_refuses_inconsistent_values covers those.
    report = helm.lint(CHART, VALUE_SETS[name], strict=True, namespace=NAMESPACE, kube_version="v1.30.0")
    bad = [m for m in report["messages"] if m["severity"] >= 2]
    assert not bad and not report["errors"], f"helm lint ({name}): {bad} {report['errors']}"
    assert report["total_charts_linted"] == 1


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_schema_accepts_value_set(chart, name):
    chart.validate_schema(VALUE_SETS[name])


@pytest.mark.parametrize(
    "values, needle",
    [
        ({"config": {"log_levle": "DEBUG"}}, "log_levle"),  # a typo is refused, not silently ignored
        ({"config": {"grpc_port": 9001}}, "grpc_port"),  # managed: containerPorts.grpc
        ({"config": {"redis_url": "redis://x"}}, "redis_url"),  # secrets never via the ConfigMap
        ({"config": {"device": "tpu"}}, "device"),
        ({"config": {"intra_op_threads": 0}}, "intra_op_threads"),
        ({"redis": {"mode": "cluster"}}, "mode"),
        ({"redis": {"password": "p@ss/word"}}, "password"),
        ({"gpu": {"count": 0}}, "count"),
        ({"modelRepository": {"source": "s3"}}, "source"),
        ({"drain": {"preStopMode": "http"}}, "preStopMode"),
        ({"extraEnv": [{"name": "BATCHGATE_LOG_LEVEL", "value": "DEBUG"}]}, "extraEnv"),
        ({"unknownTopLevel": 1}, "unknownTopLevel"),
        ({"tls": {"certManager": {"issuerRef": {"kind": "Vault"}}}}, "kind"),
        ({"config": {"tls_cert_file": "/x.crt"}}, "tls_cert_file"),  # managed: tls.*
    ],
)
def test_schema_refuses(chart, values, needle):
    with pytest.raises(helm.HelmValuesError, match=needle):
        chart.validate_schema(values)
    with pytest.raises(helm.HelmError):  # and a render (what install does) refuses them too
        chart.render(values, name=RELEASE, namespace=NAMESPACE)


@pytest.mark.parametrize(
    "values, needle",
    [
        ({"modelRepository": {"source": "pvc"}}, "existingClaim"),
        ({"modelRepository": {"source": "initContainer"}}, "initContainer.image.repository"),
        ({"auth": {"enabled": True}}, "apiKeysFile"),
        ({"redis": {"mode": "external"}}, "redis.host"),
        (
            {"redis": {"mode": "external", "url": "redis://h:6379", "existingSecret": "s"}},
            "existingSecretUrlKey",
        ),
        ({"redis": {"mode": "internal", "host": "elsewhere"}}, "mode=internal"),
        ({"terminationGracePeriodSeconds": 10}, "shorter than the drain"),
        ({"containerPorts": {"grpc": 8000, "http": 8000}}, "three different ports"),
        ({"podDisruptionBudget": {"minAvailable": 1}}, "exactly one"),
        ({"tls": {"enabled": True}}, "exactly one of tls.existingSecret"),
        (
            {
                "tls": {
                    "enabled": True,
                    "existingSecret": "s",
                    "certManager": {"enabled": True, "issuerRef": {"name": "ca"}},
                }
            },
            "exactly one of tls.existingSecret",
        ),
        ({"tls": {"enabled": True, "certManager": {"enabled": True}}}, "issuerRef.name"),
        (
            {"tls": {"enabled": True, "existingSecret": "s"}, "containerPorts": {"metrics": 8001}},
            "four different ports",
        ),
        ({"containerPorts": {"health": 8000}}, "three different ports"),  # the probes' port, TLS or not
        ({"autoscaling": {"enabled": True}, "resources": {"requests": {"cpu": None}}}, "requests.cpu"),
        (
            {"modelRepository": {"source": "initContainer", "initContainer": {"image": {"repository": "m"}}}},
            "needs a tag (a fixed version) or a digest",
        ),
        (
            {
                "modelRepository": {
                    "source": "initContainer",
                    "initContainer": {"image": {"repository": "m", "tag": "latest"}},
                }
            },
            "tag latest is mutable",
        ),  # fmt: skip
    ],
)
def test_render_refuses_inconsistent_values(chart, values, needle):
    with pytest.raises(helm.HelmRenderError, match=re.escape(needle)):
        chart.render(values, name=RELEASE, namespace=NAMESPACE)


def test_every_manifest_validates_strictly(rendered):
    name, _, r = rendered
    assert r.docs
    for doc in r.docs:
        if (doc["apiVersion"], doc["kind"]) in CRD_KINDS:
            with pytest.raises(SchemaNotFoundError):  # if it ever ships one, validate with it instead
                kubernetes_validate.validate(doc, K8S_VERSIONS[-1], strict=True)
            (_check_service_monitor if doc["kind"] == "ServiceMonitor" else _check_certificate)(doc)
            continue
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                where = ".".join(str(p) for p in exc.path)
                what = f"{doc['kind']}/{doc['metadata']['name']}"
                pytest.fail(f"{name}: {what} invalid for {version} at {where}: {exc.message}")


def _check_service_monitor(doc: dict) -> None:
    spec = doc["spec"]
    assert set(spec) <= {"selector", "namespaceSelector", "endpoints", "jobLabel"}
    assert spec["selector"]["matchLabels"]["app.kubernetes.io/component"] == "gateway"
    for ep in spec["endpoints"]:
        assert set(ep) <= {"port", "path", "interval", "scrapeTimeout"}
        for key in ("interval", "scrapeTimeout"):
            assert re.fullmatch(r"\d+(ms|s|m|h)", ep[key]), ep


def _check_certificate(doc: dict) -> None:
    spec = doc["spec"]
    assert set(spec) <= {
        "secretName", "duration", "renewBefore", "issuerRef", "privateKey", "usages", "dnsNames"}  # fmt: skip
    assert set(spec["issuerRef"]) == {"name", "kind", "group"} and spec["issuerRef"]["name"]
    assert spec["issuerRef"]["kind"] in ("Issuer", "ClusterIssuer")
    for key in ("duration", "renewBefore"):
        assert re.fullmatch(r"(\d+(\.\d+)?(h|m|s|ms))+", spec[key]), spec
    assert set(spec["privateKey"]) <= {"algorithm", "size", "rotationPolicy", "encoding"}
    assert spec["privateKey"]["rotationPolicy"] in ("Always", "Never")
    usages = ("server auth", "client auth", "digital signature", "key encipherment")
    assert all(u in usages for u in spec["usages"])
    dns = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")
    assert spec["dnsNames"] and all(dns.fullmatch(n) for n in spec["dnsNames"])


# -- the chart and the code agree ------------------------------------------------------------------


def test_config_schema_is_derived_from_settings():
    schema = json.loads(SCHEMA_PATH.read_text())["properties"]["config"]
    assert schema == config_schema(), (
        "values.schema.json `config` no longer matches gateway.config.Settings; "
        "run: .venv/bin/python tests/test_helm.py --sync-schema (and add chart-managed fields to MANAGED)"
    )


def test_managed_settings_exist():
    assert set(MANAGED) <= set(Settings.model_fields), set(MANAGED) - set(Settings.model_fields)


def _settings_env_names(r: Rendered) -> set[str]:
    names = set(r.config)
    for c in r.pod["containers"] + r.pod.get("initContainers", []):
        names |= {e["name"] for e in c.get("env", [])}
    return {n for n in names if n.startswith("BATCHGATE_")}


def test_rendered_env_names_are_settings_fields(rendered):
    name, _, r = rendered
    fields = {f.upper() for f in Settings.model_fields}
    unknown = {n.removeprefix("BATCHGATE_") for n in _settings_env_names(r)} - fields
    # pydantic-settings ignores unknown BATCHGATE_* variables, so a stale name would do nothing.
    assert not unknown, f"{name}: the chart renders settings the server does not have: {sorted(unknown)}"


REDIS_MOUNT = "/etc/batchgate/redis"
# Stand-ins for the Secrets of the user's that the value sets name: what the kubelet would find.
EXISTING_SECRETS = {"redis-creds": {"redis-password": "stubpw", "url": "redis://:stubpw@stub:6379/0"}}


def secret_data(r: Rendered, name: str, existing: dict[str, dict[str, str]]) -> dict[str, str]:
    """A Secret's data, decoded: the chart's own as rendered, else the stand-in for one of the user's."""
    (own,) = r.of("Secret", name) or [None]
    if own is None:
        assert name in existing, (
            f"the pod mounts Secret {name}, which neither the chart renders nor the test knows"
        )
        return existing[name]
    return {k: base64.b64decode(v).decode() for k, v in own.get("data", {}).items()}


def mount_secret_files(
    r: Rendered,
    root: Path,
    existing: dict[str, dict[str, str]],
    volumes: tuple[str, ...] = ("redis-credentials",),
) -> dict[str, str]:
    """Write the gateway's Secret volumes named in ``volumes`` under ``root`` the way the kubelet
    projects them: each item's key of the Secret as the file <mountPath>/<path>. A key the Secret
    lacks fails here, as the pod would fail to start. Returns {mountPath: local folder}."""
    vols = {v["name"]: v for v in r.pod["volumes"]}
    moved: dict[str, str] = {}
    for m in r.gateway.get("volumeMounts", []):
        if m["name"] not in volumes:
            continue
        src = vols[m["name"]]["secret"]
        data = secret_data(r, src["secretName"], existing)
        local = root / m["name"]
        local.mkdir(parents=True)
        for item in src["items"]:
            assert item["key"] in data, (
                f"Secret {src['secretName']} has no key {item['key']!r}: {sorted(data)}"
            )
            (local / item["path"]).write_text(data[item["key"]])
        moved[m["mountPath"]] = str(local)
    return moved


def _effective_env(
    r: Rendered, root: Path, existing: dict[str, dict[str, str]] = EXISTING_SECRETS
) -> dict[str, str]:
    """The gateway's BATCHGATE_* environment as the kubelet would build it, with its Redis Secret
    volume written under ``root`` and every path into that mount moved there."""
    moved = mount_secret_files(r, root, existing)
    env = dict(r.config)
    for e in r.gateway.get("env", []):
        value = e.get("value", "stub")
        for path, local in moved.items():
            if value == path or value.startswith(path + "/"):
                value = local + value[len(path) :]
        env[e["name"]] = value
    return {k: v for k, v in env.items() if k.startswith("BATCHGATE_")}


def _clean_settings_env(monkeypatch) -> None:
    for k in list(os.environ):
        if k.startswith("BATCHGATE_"):
            monkeypatch.delenv(k)


def test_rendered_env_is_accepted_by_settings(rendered, monkeypatch, tmp_path):
    name, values, r = rendered
    _clean_settings_env(monkeypatch)
    for k, v in _effective_env(r, tmp_path).items():
        monkeypatch.setenv(k, v)
    s = Settings()
    assert s.grpc_port == values["containerPorts"]["grpc"] and s.http_port == values["containerPorts"]["http"]
    assert str(s.model_repository) == values["modelRepository"]["path"]
    assert s.drain_timeout_s == values["drain"]["timeoutSeconds"]
    assert s.drain_linger_s == values["drain"]["lingerSeconds"]
    assert (s.redis_url is not None) == (values["redis"]["mode"] != "none"), name
    assert (s.api_keys_file is not None) == values["auth"]["enabled"], name
    for k, v in values["config"].items():
        if v is not None:
            assert getattr(s, k) == (Path(v) if isinstance(getattr(s, k), Path) else v), (name, k)


def test_every_setting_is_reachable_through_values(chart, monkeypatch):
    config = {n: _example_value(n, f) for n, f in Settings.model_fields.items() if n not in MANAGED}
    chart.validate_schema({"config": config})
    r = render(chart, {"config": config})
    for n, v in config.items():
        key = f"BATCHGATE_{n.upper()}"
        assert key in r.config, f"config.{n} did not reach the ConfigMap"
        got = r.config[key]
        if isinstance(v, float):
            assert float(got) == v, (n, got, v)
        else:
            assert got == (str(v).lower() if isinstance(v, bool) else str(v)), (n, got, v)
    for k in list(os.environ):
        if k.startswith("BATCHGATE_"):
            monkeypatch.delenv(k)
    for k, v in r.config.items():
        monkeypatch.setenv(k, v)
    s = Settings()
    for n, v in config.items():
        got = getattr(s, n)
        assert got == (Path(v) if isinstance(got, Path) else v), n


def test_large_and_fractional_numbers_render_exactly(chart):
    r = render(chart, {"config": {"max_message_bytes": 134217728}, "drain": {"timeoutSeconds": 12.5}})
    # Helm carries numbers as float64; 1.34217728e+08 would not parse as an int.
    assert r.config["BATCHGATE_MAX_MESSAGE_BYTES"] == "134217728"
    assert r.config["BATCHGATE_DRAIN_TIMEOUT_S"] == "12.5"


def test_null_and_empty_settings_are_left_to_the_server(chart):
    r = render(chart, {"config": {"workers_per_device": None, "log_level": ""}})
    assert "BATCHGATE_WORKERS_PER_DEVICE" not in r.config and "BATCHGATE_LOG_LEVEL" not in r.config


# -- what the Deployment must get right -----------------------------------------------------------


def test_probes_use_the_plaintext_probe_ports(rendered):
    """Never the service ports: under overload the service port's door refuses a share of every new
    call, health checks included, and a failed liveness probe would restart a busy pod; the
    kubelet's probes speak no TLS either. Readiness is the gRPC health signal; startup and liveness
    are /v2/health/live on the metrics port, which a model that failed to load does not turn off
    (tests/test_helm_platform.py checks that on a live server)."""
    name, values, r = rendered
    ports = {p["name"]: p["containerPort"] for p in r.gateway["ports"]}
    assert ports == {"grpc": 8001, "http": 8000, "metrics": 8002, "health": 8003}
    assert (r.config["BATCHGATE_HEALTH_PORT"], r.config["BATCHGATE_METRICS_PORT"]) == ("8003", "8002")
    ready = r.gateway["readinessProbe"]
    assert ready["grpc"] == {"port": 8003, "service": ""}, name
    assert not {"httpGet", "exec", "tcpSocket"} & set(ready), name
    for probe in ("startupProbe", "livenessProbe"):
        p = r.gateway[probe]
        assert p["httpGet"] == {"path": "/v2/health/live", "port": "metrics", "scheme": "HTTP"}, (name, probe)
        assert not {"grpc", "exec", "tcpSocket"} & set(p), (name, probe)
    # The startup probe is the warm-up budget: minutes, not the liveness probe's seconds.
    st = r.gateway["startupProbe"]
    assert st["periodSeconds"] * st["failureThreshold"] >= 120


def test_security_context(rendered):
    name, _, r = rendered
    pods = [r.pod] + [d["spec"]["template"]["spec"] for d in r.of("Deployment") if d is not r.deployment]
    for pod in pods:
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        assert pod["automountServiceAccountToken"] is False
        for c in pod["containers"] + pod.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["runAsNonRoot"] is True, (name, c["name"])
            assert sc["readOnlyRootFilesystem"] is True, (name, c["name"])
            assert sc["allowPrivilegeEscalation"] is False, (name, c["name"])
            assert sc["capabilities"]["drop"] == ["ALL"], (name, c["name"])
            assert "add" not in sc["capabilities"]
            assert c.get("resources"), (name, c["name"])
    assert r.pod["securityContext"]["runAsUser"] != 0
    # Writable scratch on the read-only root: /tmp and the engine cache, both on an emptyDir.
    volumes = {v["name"]: v for v in r.pod["volumes"]}
    mounts = {m["mountPath"]: m for m in r.gateway["volumeMounts"]}
    for path in ("/tmp", "/var/cache/batchgate"):
        assert "emptyDir" in volumes[mounts[path]["name"]], path
        assert not mounts[path].get("readOnly")
    env = r.env()
    assert env["TMPDIR"]["value"] == "/tmp"
    assert env["CUPY_CACHE_DIR"]["value"].startswith("/var/cache/batchgate")
    assert r.pod["enableServiceLinks"] is False


def test_termination_grace_covers_the_drain(rendered):
    name, values, r = rendered
    d = values["drain"]
    grace = r.pod["terminationGracePeriodSeconds"]
    assert grace >= d["preStopSleepSeconds"] + d["timeoutSeconds"] + d["lingerSeconds"], name
    if values["terminationGracePeriodSeconds"] is not None:
        assert grace == values["terminationGracePeriodSeconds"]
    pre = r.gateway["lifecycle"]["preStop"]
    if d["preStopMode"] == "sleep":
        assert pre == {"sleep": {"seconds": d["preStopSleepSeconds"]}}
    else:
        assert pre == {"exec": {"command": ["sleep", str(d["preStopSleepSeconds"])]}}
    assert float(r.config["BATCHGATE_DRAIN_TIMEOUT_S"]) == d["timeoutSeconds"]
    assert float(r.config["BATCHGATE_DRAIN_LINGER_S"]) == d["lingerSeconds"]


def test_no_prestop_hook_when_sleep_is_zero(chart):
    r = render(chart, {"drain": {"preStopSleepSeconds": 0}})
    assert "lifecycle" not in r.gateway
    assert r.pod["terminationGracePeriodSeconds"] >= 32


def test_gpu_only_when_enabled(rendered):
    name, values, r = rendered
    on = values["gpu"]["enabled"]
    limits = r.gateway["resources"].get("limits", {})
    requests = r.gateway["resources"].get("requests", {})
    assert ("nvidia.com/gpu" in limits) == on, name
    assert "nvidia.com/gpu" not in requests
    assert r.deployment["spec"]["template"]["spec"]["containers"][0]["image"].endswith("-cuda") == on
    tolerations = r.pod.get("tolerations", [])
    assert any(t.get("key") == "nvidia.com/gpu" for t in tolerations) == on
    assert ("runtimeClassName" in r.pod) == (on and bool(values["gpu"]["runtimeClassName"]))
    if on:
        assert limits["nvidia.com/gpu"] == values["gpu"]["count"]
        assert limits["memory"] == values["gpu"]["resources"]["limits"]["memory"]  # merged, not replaced
        assert r.config.get("BATCHGATE_DEVICE") == values["config"].get("device", "gpu")
        for k, v in values["gpu"]["nodeSelector"].items():
            assert r.pod["nodeSelector"][k] == v
    else:
        assert "BATCHGATE_DEVICE" not in r.config and "nodeSelector" not in r.pod


def test_gpu_workers_per_device(chart):
    r = _cached("gpu")
    assert r.config["BATCHGATE_WORKERS_PER_DEVICE"] == "2"


def test_gpu_pods_are_ready_only_with_every_model(chart):
    # device=gpu on a node without a usable GPU fails each model's load (gpu_fallback fail): such a
    # pod must not report ready and take traffic it cannot answer.
    assert _cached("gpu").config["BATCHGATE_STRICT_READINESS"] == "true"
    assert "BATCHGATE_STRICT_READINESS" not in _cached("defaults").config
    r = render(chart, {"gpu": {"enabled": True}, "config": {"strict_readiness": False}})
    assert r.config["BATCHGATE_STRICT_READINESS"] == "false"


def test_gpu_pods_replace_one_at_a_time(rendered):
    # A surge pod needs a spare GPU: on a cluster without one it stays Pending and the rollout hangs.
    name, values, r = rendered
    strategy = r.deployment["spec"]["strategy"]
    assert strategy["type"] == "RollingUpdate"
    if values["gpu"]["enabled"]:
        assert strategy["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}, name
        pdb = r.of("PodDisruptionBudget")
        assert not pdb or pdb[0]["spec"].get("maxUnavailable", 1) >= 1  # the budget allows that one pod
    else:
        assert strategy["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}, name


def test_gpu_update_strategy_is_a_value(chart):
    custom = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    r = render(chart, {"gpu": {"enabled": True, "updateStrategy": custom}})
    assert r.deployment["spec"]["strategy"] == custom


def test_gpu_pods_get_gpu_sized_resources(rendered):
    name, values, r = rendered
    res = r.gateway["resources"]
    if values["gpu"]["enabled"]:
        assert res["requests"] == {"cpu": "4", "memory": "8Gi"}, name
        assert res["limits"] == {"memory": "8Gi", "nvidia.com/gpu": values["gpu"]["count"]}, name
    else:
        assert res == {"requests": {"cpu": "2", "memory": "2Gi"}, "limits": {"memory": "2Gi"}}, name


def test_gpu_resources_are_a_value_and_the_hpa_measures_against_them(chart):
    mine = {"requests": {"cpu": "6", "memory": "12Gi"}, "limits": {"memory": "12Gi"}}
    r = render(chart, {"gpu": {"enabled": True, "resources": mine}})
    assert r.gateway["resources"]["requests"] == mine["requests"]
    with pytest.raises(helm.HelmRenderError, match=re.escape("gpu.resources.requests.cpu")):
        chart.render({"gpu": {"enabled": True, "resources": {"requests": {"cpu": None}}},
                      "autoscaling": {"enabled": True}}, name=RELEASE, namespace=NAMESPACE)  # fmt: skip


def test_a_pod_without_gpu_enabled_sees_no_gpu(rendered):
    # The CUDA image's base sets NVIDIA_VISIBLE_DEVICES=all; a -cuda tag on a GPU node without
    # gpu.enabled would see every GPU of the node. With gpu.enabled the device plugin sets it.
    name, values, r = rendered
    env = r.env()
    if values["gpu"]["enabled"]:
        assert "NVIDIA_VISIBLE_DEVICES" not in env, name
    else:
        assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "void", name


def test_a_cuda_tag_without_gpu_enabled_sees_no_gpu(chart):
    r = render(chart, {"image": {"tag": "0.1.0-cuda"}})
    assert r.gateway["image"].endswith(":0.1.0-cuda")
    assert r.env()["NVIDIA_VISIBLE_DEVICES"]["value"] == "void"


def test_the_model_image_is_pinned_by_digest_or_tag(chart):
    digest = "sha256:" + "ab" * 32
    base = {
        "modelRepository": {
            "source": "initContainer",
            "initContainer": {"image": {"repository": "reg/models"}},
        }
    }

    def init_image(image: dict) -> str:
        values = _merge(base, {"modelRepository": {"initContainer": {"image": image}}})
        (init,) = render(chart, values).pod["initContainers"]
        return init["image"]

    assert init_image({"tag": "2025-01"}) == "reg/models:2025-01"
    assert init_image({"tag": "2025-01", "digest": digest}) == f"reg/models@{digest}"  # the digest wins
    assert init_image({"digest": digest}) == f"reg/models@{digest}"
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())["modelRepository"]["initContainer"][
        "image"
    ]
    assert defaults["tag"] != "latest" and defaults["digest"] == ""


def test_services(rendered):
    name, values, r = rendered
    gateway_labels = r.deployment["spec"]["template"]["metadata"]["labels"]
    main = r.one("Service", FULLNAME)
    assert main["spec"]["type"] == "ClusterIP"
    # The service ports only; the plaintext metrics port has its own Service (never on this one).
    want = {"grpc": (8001, "grpc"), "http": (8000, "http")}
    assert {p["name"]: (p["port"], p["targetPort"]) for p in main["spec"]["ports"]} == want
    headless = r.of("Service", f"{FULLNAME}-headless")
    assert bool(headless) == values["service"]["headless"]["enabled"], name
    for svc in [main, *headless]:
        sel = svc["spec"]["selector"]
        assert sel.items() <= gateway_labels.items()
        for d in r.of("Deployment"):  # never the in-chart Redis
            if d is not r.deployment:
                assert not sel.items() <= d["spec"]["template"]["metadata"]["labels"].items()
    if headless:
        h = headless[0]["spec"]
        assert h["clusterIP"] == "None"
        assert h["publishNotReadyAddresses"] is False  # draining pods leave DNS
        assert {p["name"]: p["port"] for p in h["ports"]}["grpc"] == 8001
    assert r.deployment["spec"]["selector"]["matchLabels"].items() <= gateway_labels.items()


def test_secrets_are_never_rendered_in_clear(rendered):
    name, values, r = rendered
    for path, text in r.files.items():
        assert PASSWORD not in text, f"{name}: Redis password in clear in {path}"
        assert API_KEYS_MARKER not in text, f"{name}: API-key file in clear in {path}"
    for cm in r.of("ConfigMap"):
        assert not any("REDIS_URL" in k or "PASSWORD" in k for k in cm["data"])
    secrets = r.of("Secret")
    decoded = {k: base64.b64decode(v).decode() for s in secrets for k, v in s.get("data", {}).items()}
    assert all("stringData" not in s for s in secrets)
    if values["redis"]["password"] and values["redis"]["mode"] != "none":
        assert decoded["redis-password"] == PASSWORD
    if values["redis"]["url"]:
        assert decoded["redis-url"] == values["redis"]["url"]
    if values["auth"]["enabled"] and not values["auth"]["existingSecret"]:
        assert decoded[values["auth"]["secretKey"]] == API_KEYS_FILE
    chart_holds_redis = values["redis"]["mode"] == "internal" or values["redis"]["url"]
    if values["auth"]["existingSecret"] and not chart_holds_redis:
        assert not secrets, f"{name}: everything comes from existing Secrets; the chart needs none"


def _redis_credentials(r: Rendered) -> tuple[dict, dict] | None:
    """The gateway's Redis Secret volume's source and its mount; None when it has none."""
    vols = [v for v in r.pod["volumes"] if v["name"] == "redis-credentials"]
    mounts = [m for m in r.gateway["volumeMounts"] if m["name"] == "redis-credentials"]
    assert len(vols) == len(mounts) <= 1, (vols, mounts)
    return (vols[0]["secret"], mounts[0]) if vols else None


def test_redis_url_wiring():
    def url_env(r: Rendered) -> tuple[list[str], dict]:
        names = [e["name"] for e in r.gateway["env"]]
        return names, r.env().get("BATCHGATE_REDIS_URL")

    names, env = url_env(_cached("defaults"))
    assert env is None and not [n for n in names if "REDIS" in n]
    assert _redis_credentials(_cached("defaults")) is None

    # From parts: the URL without the password in env, the password as a file of the Secret's.
    r = _cached("redis-external-parts")
    names, env = url_env(r)
    assert env["value"] == "rediss://gateway@redis.cache.svc:6380/2"
    assert r.env()["BATCHGATE_REDIS_PASSWORD_FILE"]["value"] == f"{REDIS_MOUNT}/password"
    src, mount = _redis_credentials(r)
    assert src == {
        "secretName": FULLNAME,
        "defaultMode": 0o440,
        "items": [{"key": "redis-password", "path": "password"}],
    }
    # A directory mount, no subPath: a rotated Secret reaches the file.
    assert mount == {"name": "redis-credentials", "mountPath": REDIS_MOUNT, "readOnly": True}

    # A whole URL: only its file's path in env.
    r = _cached("redis-external-url")
    names, env = url_env(r)
    assert env is None and "BATCHGATE_REDIS_PASSWORD_FILE" not in names
    assert r.env()["BATCHGATE_REDIS_URL_FILE"]["value"] == f"{REDIS_MOUNT}/url"
    assert _redis_credentials(r)[0]["items"] == [{"key": "redis-url", "path": "url"}]
    assert _redis_credentials(r)[0]["secretName"] == FULLNAME

    r = _cached("existing-secrets")
    names, env = url_env(r)
    assert env["value"] == "redis://redis.cache.svc:6379/0"
    assert r.env()["BATCHGATE_REDIS_PASSWORD_FILE"]["value"] == f"{REDIS_MOUNT}/password"
    src, _ = _redis_credentials(r)
    assert src["secretName"] == "redis-creds" and src["items"] == [
        {"key": "redis-password", "path": "password"}
    ]

    r = _cached("existing-url-secret")
    names, env = url_env(r)
    assert env is None and r.env()["BATCHGATE_REDIS_URL_FILE"]["value"] == f"{REDIS_MOUNT}/url"
    src, _ = _redis_credentials(r)
    assert src["secretName"] == "redis-creds" and src["items"] == [{"key": "url", "path": "url"}]

    # In-chart Redis: the gateway and the Redis pod read the same password from the same Secret key.
    for set_name in ("redis-internal", "redis-internal-password"):
        r = _cached(set_name)
        names, env = url_env(r)
        host = f"{FULLNAME}-redis"
        assert env["value"] == f"redis://{host}:6379/0"
        assert r.env()["BATCHGATE_REDIS_PASSWORD_FILE"]["value"] == f"{REDIS_MOUNT}/password"
        redis_pod = r.one("Deployment", host)["spec"]["template"]["spec"]
        (redis,) = redis_pod["containers"]
        # The Redis pod reads it as a file (never env or argv; tests/test_helm_platform.py runs the command).
        assert "env" not in redis
        (auth,) = [v for v in redis_pod["volumes"] if v["name"] == "auth"]
        src, _ = _redis_credentials(r)
        assert auth["secret"]["secretName"] == src["secretName"] == FULLNAME
        assert (
            [i["key"] for i in auth["secret"]["items"]]
            == [i["key"] for i in src["items"]]
            == ["redis-password"]
        )
        assert "/etc/redis-auth/password" in redis["command"][2] and "--requirepass" not in redis["args"]
        assert redis["args"][redis["args"].index("--save") + 1] == ""  # no persistence
        svc = r.one("Service", host)
        redis_labels = r.one("Deployment", host)["spec"]["template"]["metadata"]["labels"]
        assert svc["spec"]["selector"].items() <= redis_labels.items()
        stored = base64.b64decode(r.one("Secret", FULLNAME)["data"]["redis-password"]).decode()
        if set_name == "redis-internal":  # none given: a generated one, not a fixed default
            with helm.Chart.load(CHART) as c:
                again = render(c, VALUE_SETS[set_name]).one("Secret", FULLNAME)["data"]["redis-password"]
            assert len(stored) >= 32 and stored.isalnum() and base64.b64decode(again).decode() != stored
        else:
            assert stored == PASSWORD


REDIS_CA_URL_QUERY = "ssl_ca_certs=/etc/batchgate/redis-ca"
# Each Redis mode: values, the user's Secrets (stand-ins), the Secret key the gateway must mount as
# (secret, key, file) or None, and the URL Settings must end up with (a callable of the chart's
# decoded Secret where the chart generates the password).
REDIS_MODES = {
    "external-url": (
        {"mode": "external", "url": f"rediss://:{PASSWORD}@redis.example:6379/0"},
        {},
        (FULLNAME, "redis-url", "url"),
        f"rediss://:{PASSWORD}@redis.example:6379/0",
    ),
    "external-url-ca": (
        {
            "mode": "external",
            "url": f"rediss://:{PASSWORD}@redis.example:6380/1?socket_keepalive=true",
            "tlsCA": {"existingConfigMap": "corp-ca", "key": "corp.pem"},
        },
        {},
        (FULLNAME, "redis-url", "url"),
        f"rediss://:{PASSWORD}@redis.example:6380/1?socket_keepalive=true&{REDIS_CA_URL_QUERY}/corp.pem",
    ),
    "external-existing-url": (
        {"mode": "external", "existingSecret": "creds", "existingSecretUrlKey": "the-url"},
        {"creds": {"the-url": "rediss://bob:s3cret@redis.example:6390/4", "redis-password": "unused"}},
        ("creds", "the-url", "url"),
        "rediss://bob:s3cret@redis.example:6390/4",
    ),
    "external-parts": (
        {
            "mode": "external",
            "host": "redis.cache.svc",
            "port": 6380,
            "db": 2,
            "tls": True,
            "username": "gateway",
            "password": PASSWORD,
            "tlsCA": {"existingSecret": "redis-ca"},
        },
        {},
        (FULLNAME, "redis-password", "password"),
        f"rediss://gateway:{PASSWORD}@redis.cache.svc:6380/2?{REDIS_CA_URL_QUERY}/ca.crt",
    ),
    # A password of the user's need not be URL-safe: the server percent-encodes it.
    "external-parts-existing-password": (
        {
            "mode": "external",
            "host": "redis.cache.svc",
            "username": "svc",
            "existingSecret": "creds",
            "existingSecretPasswordKey": "pw",
        },
        {"creds": {"pw": "p@ss/w:rd %"}},
        ("creds", "pw", "password"),
        "redis://svc:p%40ss%2Fw%3Ard%20%25@redis.cache.svc:6379/0",
    ),
    "external-parts-no-password": (
        {"mode": "external", "host": "redis.cache.svc"},
        {},
        None,
        "redis://redis.cache.svc:6379/0",
    ),
    "internal": (
        {"mode": "internal"},
        {},
        (FULLNAME, "redis-password", "password"),
        lambda own: f"redis://:{own['redis-password']}@{FULLNAME}-redis:6379/0",
    ),
    "internal-existing-secret": (
        {"mode": "internal", "existingSecret": "creds"},
        {"creds": {"redis-password": "from-creds"}},
        ("creds", "redis-password", "password"),
        f"redis://:from-creds@{FULLNAME}-redis:6379/0",
    ),
    "none-with-existing-secret": ({"mode": "none", "existingSecret": "creds"}, {}, None, None),
}


@pytest.mark.parametrize("mode", sorted(REDIS_MODES))
def test_redis_credentials_reach_settings_as_files(chart, mode, monkeypatch, tmp_path):
    """No Secret reaches the gateway through env; the one Secret key it needs is a file of a mounted
    Secret volume; and Settings, given the rendered env with that volume written the way the kubelet
    would (the chart's Secret as rendered, the user's as stand-ins), builds the full Redis URL."""
    values, existing, credential, want = REDIS_MODES[mode]
    r = render(chart, {"redis": values})
    gateway = r.gateway
    assert not [e for e in gateway.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})], mode
    assert not [e for e in gateway.get("envFrom", []) if "secretRef" in e], mode
    env = {e["name"]: e.get("value") for e in gateway.get("env", [])}
    files = {n: env[n] for n in ("BATCHGATE_REDIS_URL_FILE", "BATCHGATE_REDIS_PASSWORD_FILE") if n in env}
    if credential is None:
        assert not files and _redis_credentials(r) is None, mode
    else:
        secret, key, name = credential
        (setting,) = files
        assert setting == ("BATCHGATE_REDIS_URL_FILE" if name == "url" else "BATCHGATE_REDIS_PASSWORD_FILE")
        # The file lies in a mounted Secret volume whose one item is the right key.
        directory, file = files[setting].rsplit("/", 1)
        (mount,) = [m for m in gateway["volumeMounts"] if m["mountPath"] == directory]
        assert mount.get("readOnly") is True and "subPath" not in mount, mount
        (vol,) = [v for v in r.pod["volumes"] if v["name"] == mount["name"]]
        assert vol["secret"]["secretName"] == secret
        assert vol["secret"]["items"] == [{"key": key, "path": file}]
        if name == "password":  # the URL beside it carries none
            assert urlsplit(env["BATCHGATE_REDIS_URL"]).password is None, env["BATCHGATE_REDIS_URL"]
        else:
            assert "BATCHGATE_REDIS_URL" not in env

    _clean_settings_env(monkeypatch)
    for k, v in _effective_env(r, tmp_path, existing).items():
        monkeypatch.setenv(k, v)
    if callable(want):
        want = want(secret_data(r, FULLNAME, {}))
    assert Settings().redis_url == want


def test_api_keys_file_is_mounted_from_a_secret():
    for set_name, secret_name, key in (
        ("auth-inline", FULLNAME, "api-keys.yaml"),
        ("existing-secrets", "tenants", "tenants.yaml"),
    ):
        r = _cached(set_name)
        assert r.config["BATCHGATE_API_KEYS_FILE"] == f"/etc/batchgate/auth/{key}"
        (vol,) = [v for v in r.pod["volumes"] if v["name"] == "api-keys"]
        assert vol["secret"]["secretName"] == secret_name
        assert vol["secret"]["items"] == [{"key": key, "path": key}]
        (mount,) = [m for m in r.gateway["volumeMounts"] if m["name"] == vol["name"]]
        assert mount["mountPath"] == "/etc/batchgate/auth" and mount["readOnly"] is True
    assert "BATCHGATE_API_KEYS_FILE" not in _cached("defaults").config


def test_model_repository_sources():
    baked = _dockerfile_model_path(ROOT / "Dockerfile")
    r = _cached("defaults")
    assert r.config["BATCHGATE_MODEL_REPOSITORY"] == baked  # the image's baked-in copy
    assert "initContainers" not in r.pod
    assert not any(v["name"] == "model-repository" for v in r.pod["volumes"])

    r = _cached("pvc")
    (vol,) = [v for v in r.pod["volumes"] if v["name"] == "model-repository"]
    assert vol["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    (mount,) = [m for m in r.gateway["volumeMounts"] if m["name"] == "model-repository"]
    assert mount == {"name": "model-repository", "mountPath": baked, "readOnly": True, "subPath": "v3"}

    r = _cached("init-container")
    (vol,) = [v for v in r.pod["volumes"] if v["name"] == "model-repository"]
    assert "emptyDir" in vol
    (init,) = r.pod["initContainers"]
    assert init["image"] == "registry.example/models:2025-01"
    assert init["command"] == ["cp", "-R", "/models/.", baked]
    assert init["volumeMounts"] == [{"name": "model-repository", "mountPath": baked}]
    (mount,) = [m for m in r.gateway["volumeMounts"] if m["name"] == "model-repository"]
    assert mount["readOnly"] is True


def test_autoscaling_disruption_budget_and_service_monitor():
    r = _cached("defaults")
    assert r.deployment["spec"]["replicas"] == 2
    assert not r.of("HorizontalPodAutoscaler") and not r.of("ServiceMonitor")
    assert r.one("PodDisruptionBudget")["spec"]["maxUnavailable"] == 1

    r = _cached("scaling")
    assert "replicas" not in r.deployment["spec"]  # the HPA owns it
    hpa = r.one("HorizontalPodAutoscaler")["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": FULLNAME}
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (3, 12)
    kinds = {m["type"]: m for m in hpa["metrics"]}
    assert kinds["Resource"]["resource"]["target"] == {"type": "Utilization", "averageUtilization": 70}
    assert kinds["Pods"]["pods"]["metric"]["name"] == "batchgate_queue_duration_seconds"
    pdb = r.one("PodDisruptionBudget")["spec"]
    assert pdb == {"minAvailable": "50%", "selector": r.deployment["spec"]["selector"]}
    sm = r.one("ServiceMonitor")
    assert sm["metadata"]["labels"]["release"] == "prometheus"
    assert sm["spec"]["endpoints"] == [
        {"port": "metrics", "path": "/metrics", "interval": "15s", "scrapeTimeout": "10s"}
    ]
    # It must pick the metrics Service only, not the main or headless one too (each pod scraped once).
    selected = [s for s in r.of("Service") if _selects(sm["spec"]["selector"], s["metadata"]["labels"])]
    assert [s["metadata"]["name"] for s in selected] == [f"{FULLNAME}-metrics"]


def test_tls_wiring():
    """TLS on: the server gets the mounted files and the plaintext ports; the probes, the Service's
    metrics port and the ServiceMonitor use those; cert-manager's Secret is the one mounted."""
    plain = _cached("defaults")
    assert not any(k.startswith("BATCHGATE_TLS_") for k in plain.config)
    assert not plain.of("Certificate") and not any(v["name"] == "tls" for v in plain.pod["volumes"])
    for set_name, secret, mutual in (
        ("tls-existing-secret", "gateway-tls", True),
        ("tls-cert-manager", f"{FULLNAME}-tls", False),
    ):
        r = _cached(set_name)
        cfg = r.config
        assert cfg["BATCHGATE_TLS_CERT_FILE"] == "/etc/batchgate/tls/tls.crt"
        assert cfg["BATCHGATE_TLS_KEY_FILE"] == "/etc/batchgate/tls/tls.key"
        assert ("BATCHGATE_TLS_CLIENT_CA_FILE" in cfg) == mutual
        assert (cfg["BATCHGATE_METRICS_PORT"], cfg["BATCHGATE_HEALTH_PORT"]) == ("8002", "8003")
        (vol,) = [v for v in r.pod["volumes"] if v["name"] == "tls"]
        assert vol["secret"]["secretName"] == secret
        keys = [i["key"] for i in vol["secret"]["items"]]
        assert keys == ["tls.crt", "tls.key", "ca.crt"] if mutual else keys == ["tls.crt", "tls.key"]
        (mount,) = [m for m in r.gateway["volumeMounts"] if m["name"] == "tls"]
        # A directory mount (no subPath): Kubernetes updates it in place when the Secret is renewed.
        assert mount == {"name": "tls", "mountPath": "/etc/batchgate/tls", "readOnly": True}
        sm = r.one("ServiceMonitor")
        assert [ep["port"] for ep in sm["spec"]["endpoints"]] == ["metrics"]
        selected = [s for s in r.of("Service") if _selects(sm["spec"]["selector"], s["metadata"]["labels"])]
        (svc,) = selected
        assert {p["name"]: p["targetPort"] for p in svc["spec"]["ports"]}["metrics"] == "metrics"
        certs = r.of("Certificate")
        if set_name == "tls-cert-manager":
            (cert,) = certs
            spec = cert["spec"]
            assert spec["secretName"] == secret
            want = {"name": "internal-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}
            assert spec["issuerRef"] == want
            for dns in (
                FULLNAME,
                f"{FULLNAME}.{NAMESPACE}.svc",
                f"{FULLNAME}-headless.{NAMESPACE}.svc",
                "batchgate.example.com",
            ):
                assert dns in spec["dnsNames"], dns
        else:
            assert not certs


def _selects(selector: dict, labels: dict) -> bool:
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for ex in selector.get("matchExpressions", []):
        present = ex["key"] in labels
        if ex["operator"] == "DoesNotExist" and present or ex["operator"] == "Exists" and not present:
            return False
    return True


def test_notes_render_and_mention_the_headless_dns_target():
    notes = _cached("headless").files["batchgate/templates/NOTES.txt"]
    assert "dns:///rel-batchgate-headless.serving.svc:8001" in notes
    notes = _cached("defaults").files["batchgate/templates/NOTES.txt"]
    assert "round_robin" in notes and "No Redis" in notes


def test_readme_documents_every_value():
    readme = (CHART / "README.md").read_text()
    documented = set(re.findall(r"^\| `([^`]+)` \|", readme, re.M))
    # Free-form maps and lists are documented as a whole.
    leaves = set(_leaf_keys(yaml.safe_load((CHART / "values.yaml").read_text())))
    missing = sorted(k for k in leaves if not any(k == d or k.startswith(d + ".") for d in documented))
    assert not missing, f"helm/batchgate/README.md lacks rows for: {missing}"
    stale = sorted(d for d in documented if not any(k == d or k.startswith(d + ".") for k in leaves))
    assert not stale, f"helm/batchgate/README.md documents values that do not exist: {stale}"


def _leaf_keys(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict) and node:
        return [k for key, v in node.items() for k in _leaf_keys(v, f"{prefix}{key}.")]
    return [prefix.rstrip(".")]


# -- container images -----------------------------------------------------------------------------


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, op: str) -> list[str]:
        return [arg for o, arg in self.instructions if o == op]


def parse_dockerfile(path: Path) -> tuple[dict[str, str], list[Stage]]:
    """(global ARG defaults, stages): enough of the Dockerfile grammar for these checks."""
    text = re.sub(r"\\\n", " ", path.read_text())
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        op, _, rest = line.partition(" ")
        op, rest = op.upper(), rest.strip()
        if op == "FROM":
            parts = rest.split()
            parts = [p for p in parts if not p.startswith("--")]
            base = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), parts[0])
            stages.append(Stage(base, parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else None))
        elif op == "ARG" and not stages:
            k, _, v = rest.partition("=")
            args[k] = v
        else:
            assert stages, f"{path.name}: {op} before FROM"
            stages[-1].instructions.append((op, rest))
    return args, stages


def _copy_sources(arg: str) -> tuple[list[str], str, dict[str, str]]:
    words = shlex.split(arg)
    flags = dict(w[2:].split("=", 1) for w in words if w.startswith("--"))
    paths = [w for w in words if not w.startswith("--")]
    return paths[:-1], paths[-1], flags


def _dockerignore_excludes(rel: str) -> bool:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [p.strip() for p in lines if p.strip() and not p.startswith("#")]
    excluded = False
    parts = rel.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pat in patterns:
        negate = pat.startswith("!")
        pat = pat.lstrip("!").strip("/")
        if any(fnmatch.fnmatch(c, pat) or fnmatch.fnmatch(c, pat.replace("**/", "")) for c in candidates):
            excluded = not negate
    return excluded


def _dockerfile_model_path(path: Path) -> str:
    """Where the final stage has the repository's model_repository, directly or through a stage."""
    _, stages = parse_dockerfile(path)
    baked: dict[str | None, str] = {}  # stage name -> where model_repository was copied in it
    for stage in stages:
        for arg in stage.all("COPY"):
            srcs, dest, flags = _copy_sources(arg)
            if "from" in flags and baked.get(flags["from"]) in [s.rstrip("/") for s in srcs]:
                baked[stage.name] = dest.rstrip("/")
            elif srcs == ["model_repository"]:
                baked[stage.name] = dest.rstrip("/")
    assert stages[-1].name in baked, f"{path.name}: the final stage does not bake model_repository in"
    return baked[stages[-1].name]


BUILD_TOOLS = re.compile(
    r"\b(gcc|g\+\+|clang|build-essential|make|cmake|python3?-dev|libpython3[\d.]*-dev"
    r"|cuda-toolkit|cuda-nvcc)\b"
)


@pytest.mark.parametrize(
    "dockerfile, extra, other", [("Dockerfile", "cpu", "gpu"), ("Dockerfile.cuda", "gpu", "cpu")]
)
def test_dockerfile(dockerfile, extra, other):
    path = ROOT / dockerfile
    _, stages = parse_dockerfile(path)
    assert len(stages) >= 2, f"{dockerfile}: multi-stage (build, then a slim runtime)"
    names = [s.name for s in stages]
    final = stages[-1]
    # Non-root, by number, so runAsNonRoot can verify it without a passwd lookup.
    users = final.all("USER")
    assert users, f"{dockerfile}: the final stage sets no USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"{dockerfile}: USER {users[-1]} must be a non-zero uid"
    # No build tools in the final stage: nothing installs them and no build stage is its base.
    for run in final.all("RUN"):
        assert not BUILD_TOOLS.search(run), f"{dockerfile}: final stage installs build tools: {run}"
    assert final.base not in names, f"{dockerfile}: the final stage must not build FROM a build stage"
    assert "devel" not in final.base, f"{dockerfile}: runtime base must not be a devel image: {final.base}"
    # The package is installed in a build stage with exactly one onnxruntime flavour.
    installs = [run for s in stages[:-1] for run in s.all("RUN") if "pip install" in run]
    assert any(f".[{extra}]" in run for run in installs), f"{dockerfile}: installs .[{extra}]"
    runs = [run for s in stages for run in s.all("RUN")]
    assert not any(f"[{other}" in run or f",{other}]" in run for run in runs), dockerfile
    # Every COPY source exists and is not hidden by .dockerignore; --from names a stage.
    for i, stage in enumerate(stages):
        for arg in stage.all("COPY"):
            srcs, _, flags = _copy_sources(arg)
            if "from" in flags:
                assert flags["from"] in names[:i], f"{dockerfile}: COPY --from={flags['from']}: no such stage"
                continue
            for src in srcs:
                assert (ROOT / src).exists(), f"{dockerfile}: COPY source {src} is not in the repository"
                assert not _dockerignore_excludes(src), f"{dockerfile}: .dockerignore hides COPY source {src}"
    # The runtime runs the CLI, exposes the chart's ports, and bakes the models where the chart looks.
    assert final.all("ENTRYPOINT") and "batchgate" in final.all("ENTRYPOINT")[-1]
    exposed = {int(p.split("/")[0]) for e in final.all("EXPOSE") for p in e.split()}
    chart_values = yaml.safe_load((CHART / "values.yaml").read_text())
    # The service ports; the plaintext metrics/health ports open only when configured (TLS).
    ports = chart_values["containerPorts"]
    assert exposed == {ports["grpc"], ports["http"]}
    assert _dockerfile_model_path(path) == chart_values["modelRepository"]["path"]
    assert not _dockerignore_excludes("model_repository/ranker/1/model.onnx")


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.cuda"])
def test_dockerfile_copies_every_package(dockerfile):
    # pyproject's package list is the truth; a new top-level package must reach the image too.
    import tomllib

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = set(pyproject["tool"]["setuptools"]["package-dir"].values())
    _, stages = parse_dockerfile(ROOT / dockerfile)
    copied = {src.rstrip("/") for s in stages[:-1] for arg in s.all("COPY") for src in _copy_sources(arg)[0]}
    assert "pyproject.toml" in copied
    # PEP 639 license-files: the build fails when a listed file is missing from the context.
    for lf in pyproject["project"].get("license-files", []):
        assert lf in copied, f"{dockerfile} does not COPY {lf} (pyproject license-files)"
    assert packages <= copied, f"{dockerfile} does not COPY {sorted(packages - copied)}"


def test_dockerignore_keeps_the_context_small():
    for heavy in (
        ".git",
        ".venv",
        "tests/test_helm.py",
        "gateway/__pycache__/x.pyc",
        "model_repository/minilm/1/model.onnx",
    ):
        assert _dockerignore_excludes(heavy), heavy
    for needed in ("pyproject.toml", "gateway/server.py", "proto/inference/v2/grpc_service_pb2.py"):
        assert not _dockerignore_excludes(needed), needed


if __name__ == "__main__":
    if sys.argv[1:] == ["--sync-schema"]:
        sync_schema()
        print(f"wrote the config section of {SCHEMA_PATH.relative_to(ROOT)} from gateway.config.Settings")
    else:
        sys.exit("usage: python tests/test_helm.py --sync-schema")


def test_the_variant_selection_runs_before_serving_with_the_repository_writable():
    """variantSelection.initContainer: `batchgate select` over the claim mounted writable, before the
    gateway (which mounts it read-only and serves the recorded choice); never with source image."""
    pod = _cached("pvc-selection").pod
    (init,) = pod["initContainers"]
    assert init["name"] == "variant-selection" and init["args"] == ["select"]
    mount = next(m for m in init["volumeMounts"] if m["name"] == "model-repository")
    assert not mount.get("readOnly") and mount["subPath"] == "v3"
    gateway = next(c for c in pod["containers"] if c["name"] == "gateway")
    assert next(m for m in gateway["volumeMounts"] if m["name"] == "model-repository")["readOnly"] is True
    assert "initContainers" not in _cached("pvc").pod
    with helm.Chart.load(CHART) as c:
        baked = render(c, {"variantSelection": {"initContainer": {"enabled": True}}})
    assert "initContainers" not in baked.pod  # the image's repository cannot be written
