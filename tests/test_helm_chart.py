"""The Helm chart at helm/sglang-evict, checked offline, per template (helm-unittest style).

The chart is rendered by Helm's own engine: ``helm-python-sdk`` binds Helm 4's Go SDK
(no helm binary, no cluster). Every rendered manifest is validated against the
Kubernetes OpenAPI schemas bundled with ``kubernetes-validate`` (strict: unknown fields
fail), for several value sets. Each value set is rendered once per module and cached.
The supervisor and liveness scripts the chart ships are run for real with bash, with
stand-in processes for the compactor and the server.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from functools import cached_property
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

helm = pytest.importorskip("helm_python", reason="needs helm-python-sdk (the [dev] extra)")
kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="needs kubernetes-validate (the [dev] extra)"
)

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "sglang-evict"
RELEASE = "demo"
NAMESPACE = "llm"
FULLNAME = "demo-sglang-evict"
ROUTER = f"{FULLNAME}-router"
ROUTER_POLICIES = ["cache_aware", "round_robin", "random", "power_of_two", "manual"]
SOCKET = "/run/sglang-evict/compactor/compactor.sock"
# The Kubernetes version Helm's client-only render reports (Capabilities.KubeVersion of
# helm-python-sdk 0.2.2), and the oldest ones the chart supports: any placement but
# sidecar from Chart.yaml's kubeVersion, sidecar (DRA resource.k8s.io/v1) from 1.34.
RENDER_KUBE_VERSION = "1.36"
MIN_KUBE_VERSION = "1.29"
MIN_KUBE_VERSION_DRA = "1.34"
# Kinds from CRDs, which kubernetes-validate has no schema for; checked by their own tests.
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}
OTLP = "otel-collector.observability:4317"
EXTERNAL_REDIS = "redis://redis.infra:6379/0"
# What a release with the tier adds to sglang.extraArgs (eviction.tier in values.yaml).
TIER_BACKEND = ["--attention-backend", "torch_native"]

# Metric names SGLang's /metrics carries for the plugin (sglang_evict/metrics.py), plus the
# compactor-health series the scheduler exports.
EVICTION_METRICS = {
    "sglang_evict:passes_total",
    "sglang_evict:tokens_evicted_total",
    "sglang_evict:pages_freed_total",
    "sglang_evict:slot_copies_total",
    "sglang_evict:bytes_moved_total",
    "sglang_evict:pass_failures_total",
    "sglang_evict:pass_failure_streak",
    "sglang_evict:pressure_passes_total",
    "sglang_evict:lease_release_failures_total",
    "sglang_evict:pass_forced_completions_total",
    "sglang_evict:pass_duration_seconds",
    "sglang_evict:budget_occupancy_ratio",
    "sglang_evict:compactor_up",
    "sglang_evict:compactor_fallbacks_total",
    "sglang_evict:pass_graph_replays_total",
    "sglang_evict:pass_graph_misses_total",
    "sglang_evict:pass_group_steps",
    "sglang_evict:tier_tokens",
    "sglang_evict:tier_bytes",
    "sglang_evict:tier_tokens_quantized_total",
    "sglang_evict:tier_tokens_dropped_total",
}

VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "redis-external": {"redis": {"externalUrl": EXTERNAL_REDIS}},
    "redis-secret": {"redis": {"externalUrlSecret": {"name": "redis-url", "key": "url"}}},
    "redis-off": {"redis": {"enabled": False}},
    "redis-persistent": {"redis": {"persistence": {"enabled": True, "storageClassName": "ssd"}}},
    "tracing": {"tracing": {"otlpEndpoint": OTLP}},
    "sidecar-dra": {"compactor": {"placement": "sidecar"}, "tracing": {"otlpEndpoint": OTLP}},
    "sidecar-dra-tp2": {
        "compactor": {"placement": "sidecar"},
        "dra": {"createClaimTemplate": False, "existingClaimTemplate": "h100-pair"},
        "sglang": {"tpSize": 2},
    },
    "tp2": {"sglang": {"tpSize": 2, "shmSize": "32Gi"}},
    "compactor-off": {"compactor": {"enabled": False}},
    # Replicas behind SGLang's router, without the SGLang Service (discovery needs none).
    "router": {
        "replicaCount": 3,
        "router": {
            "enabled": True,
            "extraArgs": ["--cache-threshold", "0.5"],
            "nodeSelector": {"pool": "cpu"},
        },
        "service": {"enabled": False},
    },
    "everything-on": {
        "model": {
            "path": "/models/Qwen2.5-7B-Instruct",
            "pvc": {"claimName": "models"},
            "hfTokenSecret": {"name": "hf"},
        },
        "eviction": {
            "kvScorer": "triattention",
            "scorerStats": {"configMap": "qwen-stats", "fileName": "qwen.safetensors"},
        },
        "sglang": {
            "extraArgs": ["--mem-fraction-static", "0.85"],
            "extraEnv": [{"name": "A", "value": "1"}],
        },
        "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
        "grafanaDashboard": {"enabled": True},
        "autoscaling": {
            "enabled": True,
            "maxReplicas": 3,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": "sglang_num_queue_reqs"},
                        "target": {"type": "AverageValue", "averageValue": "4"},
                    },
                }
            ],
        },
        "redis": {"enabled": False},  # several pods: in-process leases (see the refusals)
        "router": {"enabled": True, "policy": "power_of_two"},
        "podAnnotations": {"team": "inference"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    },
}


# --- rendering -------------------------------------------------------------------------


@dataclass
class Release:
    """One rendered value set: manifests by template, parsed objects, NOTES.txt."""

    manifests: dict[str, str]

    @property
    def notes(self) -> str:
        return self.manifests[f"{CHART.name}/templates/NOTES.txt"]

    @cached_property
    def objects_by_template(self) -> dict[str, list[dict[str, Any]]]:
        return {
            path: [doc for doc in yaml.safe_load_all(text) if doc]
            for path, text in self.manifests.items()
            if path.endswith(".yaml")
        }

    @property
    def objects(self) -> list[dict[str, Any]]:
        return [obj for objs in self.objects_by_template.values() for obj in objs]

    def all(self, kind: str) -> list[dict[str, Any]]:
        return [obj for obj in self.objects if obj["kind"] == kind]

    def get(self, kind: str, name: str) -> dict[str, Any]:
        found = [obj for obj in self.all(kind) if obj["metadata"]["name"] == name]
        assert len(found) == 1, f"expected one {kind} {name}, rendered: {self.kinds()}"
        return found[0]

    def kinds(self) -> list[tuple[str, str]]:
        return sorted((obj["kind"], obj["metadata"]["name"]) for obj in self.objects)

    @property
    def deployment(self) -> dict[str, Any]:
        return self.get("Deployment", FULLNAME)

    @property
    def pod(self) -> dict[str, Any]:
        return self.deployment["spec"]["template"]["spec"]

    @property
    def router(self) -> dict[str, Any]:
        """The router's only container."""
        (container,) = self.get("Deployment", ROUTER)["spec"]["template"]["spec"]["containers"]
        return container

    def container(self, name: str) -> dict[str, Any]:
        pod = self.pod
        found = [c for c in pod["containers"] + pod.get("initContainers", []) if c["name"] == name]
        assert len(found) == 1, f"expected one container {name!r} in the SGLang pod"
        return found[0]


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(CHART) as loaded:
        yield loaded


@pytest.fixture(scope="module")
def render(chart):
    """render(name_or_values) -> Release; named value sets are rendered once."""
    cache: dict[str, Release] = {}

    def render_values(values: str | dict[str, Any]) -> Release:
        if isinstance(values, dict):
            return Release(chart.render(values, name=RELEASE, namespace=NAMESPACE))
        if values not in cache:
            cache[values] = Release(
                chart.render(VALUE_SETS[values], name=RELEASE, namespace=NAMESPACE)
            )
        return cache[values]

    return render_values


def render_at_kube_version(chart, values: dict[str, Any], kube_version: str) -> dict[str, str]:
    """Render as for a cluster of ``kube_version``. libhelm_c's render takes a
    ``kube_version`` option that helm-python-sdk 0.2.2's ``Chart.render`` does not pass
    on, hence the call one level down."""
    from helm_python import _native

    opts = {"name": RELEASE, "namespace": NAMESPACE, "kube_version": kube_version}
    rendered = _native.call_string(
        "helm_render", chart._raw(), json.dumps(values), json.dumps(opts)
    )
    return json.loads(rendered)


def argv(container: dict[str, Any]) -> list[str]:
    return list(container.get("command", [])) + list(container.get("args", []))


def split_supervised(container: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(compactor argv, server argv) of a container run by supervisor.sh."""
    args = container["args"]
    assert args.count("--") == 1, "supervisor args need exactly one '--' separator"
    cut = args.index("--")
    return args[:cut], args[cut + 1 :]


def flag_value(arguments: list[str], flag: str) -> str:
    assert arguments.count(flag) == 1, f"{flag} appears {arguments.count(flag)} times"
    return arguments[arguments.index(flag) + 1]


def server_argv(release: Release) -> list[str]:
    sglang = release.container("sglang")
    if sglang["command"][-1].endswith("supervisor.sh"):
        return split_supervised(sglang)[1]
    return argv(sglang)


def env_names(container: dict[str, Any]) -> set[str]:
    return {entry["name"] for entry in container.get("env", [])}


# --- chart metadata, values and schema -------------------------------------------------


def test_app_version_is_the_package_version():
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli", reason="Python 3.10 reads TOML with tomli")
    package_version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    chart_meta = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart_meta["appVersion"] == package_version


def test_image_tag_defaults_to_app_version_and_can_be_set(render, chart):
    assert render("defaults").container("sglang")["image"] == (
        f"sglang-evict:{chart.metadata['appVersion']}"
    )
    custom = render({"image": {"repository": "registry.example/llm/sglang-evict", "tag": "dev"}})
    assert custom.container("sglang")["image"] == "registry.example/llm/sglang-evict:dev"


@pytest.mark.parametrize("values", sorted(VALUE_SETS))
def test_chart_lints_without_warnings(values):
    report = helm.lint(CHART, VALUE_SETS[values], strict=True)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not problems and not report["errors"], problems or report["errors"]


def _undocumented_values(text: str) -> list[str]:
    """Leaf keys of a values file documented neither by a `# --` comment block right above
    them nor by one above an enclosing key (helm-docs conventions)."""
    lines = text.splitlines()
    key_re = re.compile(r"^(\s*)([A-Za-z0-9_.\-/]+):(.*)$")
    stack: list[tuple[int, str, bool]] = []  # (indent, key, documented)
    comment_block: list[str] = []
    missing = []
    for index, line in enumerate(lines):
        stripped = line.strip()
        if stripped.startswith("#"):
            comment_block.append(stripped)
            continue
        match = key_re.match(line)
        if not match or stripped.startswith("-"):
            comment_block = []
            continue
        indent, key, rest = len(match[1]), match[2], match[3].split("#")[0].strip()
        while stack and stack[-1][0] >= indent:
            stack.pop()
        documented = any(c.startswith("# --") for c in comment_block)
        comment_block = []
        following = [
            ln for ln in lines[index + 1 :] if ln.strip() and not ln.strip().startswith("#")
        ]
        nxt = following[0] if following else ""
        is_parent = (
            not rest and len(nxt) - len(nxt.lstrip()) > indent and not nxt.strip().startswith("-")
        )
        path = ".".join([k for _, k, _ in stack] + [key])
        if not is_parent and not (documented or any(d for _, _, d in stack)):
            missing.append(path)
        stack.append((indent, key, documented))
    return missing


def test_every_value_is_documented_helm_docs_style():
    assert _undocumented_values("a:\n  b: 1\n# -- c\nc: 2\n") == ["a.b"]  # the check can fail
    assert _undocumented_values((CHART / "values.yaml").read_text()) == []


def _schema_problems(node: dict[str, Any], path: str = "$") -> list[str]:
    problems = []
    if "properties" in node:
        if node.get("additionalProperties") is not False:
            problems.append(f"{path}: additionalProperties is not false")
        for key, child in node["properties"].items():
            problems += _schema_problems(child, f"{path}.{key}")
    elif node.get("type") == "object":
        passed_through = "passed through" in node.get("description", "")
        if not passed_through and not isinstance(node.get("additionalProperties"), dict):
            problems.append(f"{path}: object without properties or a typed map")
    return problems


def _value_paths(values: dict[str, Any], schema: dict[str, Any], prefix: str = "") -> set[str]:
    """Dotted keys of values.yaml, descending where the schema lists properties."""
    paths = set()
    for key, value in values.items():
        paths.add(prefix + key)
        child = schema.get("properties", {}).get(key, {})
        if isinstance(value, dict) and "properties" in child:
            paths |= _value_paths(value, child, f"{prefix}{key}.")
    return paths


def _schema_paths(schema: dict[str, Any], prefix: str = "") -> set[str]:
    paths = set()
    for key, child in schema.get("properties", {}).items():
        paths.add(prefix + key)
        paths |= _schema_paths(child, f"{prefix}{key}.")
    return paths


def test_schema_is_closed_and_matches_values_yaml(chart):
    schema = chart.schema
    assert _schema_problems(schema) == []
    for name, definition in schema["definitions"].items():
        assert _schema_problems(definition, name) == []
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert _value_paths(values, schema) == _schema_paths(schema)


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        ({"eviction": {"kvBudget": "lots"}}, "/eviction/kvBudget"),
        ({"eviction": {"kvBudget": 0}}, "/eviction/kvBudget"),
        ({"eviction": {"kvBudgett": 4096}}, "kvBudgett"),
        ({"eviction": {"kvScorer": "knrom"}}, "/eviction/kvScorer"),
        ({"sglang": {"tpSize": "2"}}, "/sglang/tpSize"),
        ({"compactor": {"placement": "sidcar"}}, "/compactor/placement"),
        ({"redis": {"enable": False}}, "enable"),
        ({"tracing": {"otlpEndpoint": "http://collector:4317"}}, "/tracing/otlpEndpoint"),
        ({"replicas": 2}, "replicas"),
        ({"router": {"enabled": True, "policy": "least_loaded"}}, "/router/policy"),
    ],
    ids=[
        "budget-string",
        "budget-zero",
        "typo-nested",
        "unknown-scorer",
        "tp-string",
        "bad-placement",
        "typo-redis",
        "endpoint-with-scheme",
        "typo-top-level",
        "unknown-router-policy",
    ],
)
def test_schema_rejects_bad_values(chart, values, complaint):
    with pytest.raises(helm.HelmValuesError, match=re.escape(complaint)):
        chart.render(values, name=RELEASE)


@pytest.mark.parametrize("placement", ["inContainer", "sidecar"])
def test_replicas_sharing_redis_use_one_lease_namespace_per_pod(render, placement):
    release = render({"replicaCount": 3, "compactor": {"placement": placement}})
    server = release.container("sglang")
    assert flag_value(server_argv(release), "--kv-lease-namespace") == "$(POD_NAME)"
    if placement == "sidecar":
        compactor = release.container("compactor")
        compactor_args = argv(compactor)
        assert "POD_NAME" in env_names(compactor)
    else:
        compactor_args = split_supervised(server)[0]
    assert flag_value(compactor_args, "--lease-namespace") == "$(POD_NAME)"
    assert "POD_NAME" in env_names(server)


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        (
            {
                "eviction": {"kvScorer": "triattention", "scorerStats": {"configMap": "s"}},
                "sglang": {"tpSize": 2},
            },
            "triattention with sglang.tpSize=2",
        ),
        ({"eviction": {"kvScorer": "triattention"}}, "needs its stats file"),
        (
            {"eviction": {"scorerStats": {"configMap": "a", "existingClaim": "b"}}},
            "not both",
        ),
        ({"eviction": {"kvBudget": 260, "kvWindow": 256}}, "leaves no room to choose"),
        ({"eviction": {"kvRequestMaxBudget": 1024}}, "kvRequestMaxBudget=1024 is below"),
        ({"eviction": {"kvRequestMaxCadence": 64}}, "kvRequestMaxCadence=64 is below"),
        ({"sglang": {"extraArgs": ["--kv-budget", "10"]}}, "--kv-budget is set by the chart"),
        ({"sglang": {"extraArgs": ["--tp-size=2"]}}, "--tp-size is set by the chart"),
        (
            {"sglang": {"extraArgs": ["--kv-lease-store", "redis"]}},
            "--kv-lease-store is set by the chart",
        ),
        (
            {"sglang": {"extraArgs": ["--kv-compactor-address=127.0.0.1:1"]}},
            "--kv-compactor-address: the chart runs and connects the compactor",
        ),
        (
            {"sglang": {"extraArgs": ["--kv-redis-url", "redis://r:6379/0"]}},
            "--kv-redis-url: the Redis URL is a secret and never goes on a command line",
        ),
        ({"sglang": {"extraArgs": ["--kv-evict-prompt"]}}, "--kv-evict-prompt is set by"),
        (
            {"sglang": {"extraArgs": ["--kv-tier-outliers", "2"]}},
            "--kv-tier-outliers without eviction.tier.bits: no tier runs without its bits",
        ),
        (
            {"eviction": {"tier": {"bits": 3}}, "sglang": {"extraArgs": TIER_BACKEND}},
            "eviction.tier.bits with compactor.enabled: the compactor sidecar does not "
            "quantize yet",
        ),
        (
            {"eviction": {"tier": {"bits": 3}}, "compactor": {"enabled": False}},
            "eviction.tier.bits with SGLang's default attention backend: on a GPU the tier's "
            "attention merges with SGLang's torch_native backend only (its merge with triton "
            'has not run on a GPU yet); add "--attention-backend", "torch_native"',
        ),
        (
            {
                "eviction": {"tier": {"bits": 3}},
                "compactor": {"enabled": False},
                "sglang": {"extraArgs": ["--attention-backend=triton"]},
            },
            "eviction.tier.bits with --attention-backend triton:",
        ),
        (
            {
                "eviction": {"tier": {"bits": 3, "groupTokens": 64, "maxTokens": 96}},
                "compactor": {"enabled": False},
                "sglang": {"extraArgs": TIER_BACKEND},
            },
            "eviction.tier.maxTokens=96: the tier holds whole groups of "
            "eviction.tier.groupTokens=64 tokens",
        ),
        (
            {"redis": {"externalUrl": EXTERNAL_REDIS, "externalUrlSecret": {"name": "r"}}},
            "not both",
        ),
        (
            {"compactor": {"placement": "sidecar"}, "dra": {"createClaimTemplate": False}},
            "exactly one GPU claim source",
        ),
        (
            {"serviceMonitor": {"enabled": True}, "sglang": {"enableMetrics": False}},
            "needs sglang.enableMetrics",
        ),
        (
            {"autoscaling": {"enabled": True}, "redis": {"enabled": False}},
            "needs autoscaling.metrics",
        ),
        (
            {"router": {"enabled": True, "extraArgs": ["--policy", "random"]}},
            "router.extraArgs: --policy is set by the chart; set router.policy instead",
        ),
        (
            {"router": {"enabled": True, "extraArgs": ["--port=8080"]}},
            "--port is set by the chart; set router.port instead",
        ),
        (
            {"router": {"enabled": True, "extraArgs": ["--service-discovery-port", "8000"]}},
            "--service-discovery-port is set by the chart; set sglang.port instead",
        ),
        (
            {"router": {"enabled": True, "extraArgs": ["--selector", "app=other"]}},
            "--selector is set by the chart; the chart discovers this release's SGLang pods",
        ),
        (
            {"router": {"enabled": True, "port": 29000}},
            "router.port and router.prometheusPort are both 29000",
        ),
    ],
    ids=[
        "triattention-tp2",
        "triattention-no-stats",
        "two-stats-sources",
        "budget-within-kept",
        "request-max-budget-below-budget",
        "request-max-cadence-below-cadence",
        "extra-kv-flag",
        "extra-tp-flag",
        "extra-lease-store-flag",
        "extra-compactor-address",
        "extra-redis-url",
        "extra-evict-prompt",
        "tier-flag-without-bits",
        "tier-with-sidecar",
        "tier-default-backend",
        "tier-triton-backend",
        "tier-partial-group",
        "two-redis-urls",
        "sidecar-without-claim",
        "servicemonitor-without-metrics",
        "hpa-without-metrics",
        "router-policy-flag",
        "router-port-flag",
        "router-discovery-port-flag",
        "router-selector-flag",
        "router-ports-clash",
    ],
)
def test_refused_combinations_fail_with_the_fix(chart, values, complaint):
    with pytest.raises(helm.HelmRenderError, match=re.escape(complaint)):
        chart.render(values, name=RELEASE)


def test_sidecar_placement_needs_kubernetes_1_34(chart):
    values = {"compactor": {"placement": "sidecar"}}
    with pytest.raises(helm.HelmRenderError, match=r"needs Kubernetes >= 1\.34"):
        render_at_kube_version(chart, values, "v1.33.0")
    assert "ResourceClaimTemplate" in "".join(
        render_at_kube_version(chart, values, "v1.34.0").values()
    )
    assert render_at_kube_version(chart, {}, "v1.29.0")  # the default placement renders there


# --- every manifest is valid Kubernetes ------------------------------------------------


@pytest.mark.parametrize("values", sorted(VALUE_SETS))
def test_manifests_validate_against_kubernetes_schemas(render, values):
    release = render(values)
    dra = release.pod.get("resourceClaims")
    versions = [RENDER_KUBE_VERSION, MIN_KUBE_VERSION_DRA if dra else MIN_KUBE_VERSION]
    assert release.objects
    for obj in release.objects:
        if (obj["apiVersion"], obj["kind"]) in CRD_KINDS:
            continue
        for version in versions:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as error:
                where = "/".join(str(p) for p in error.path)
                pytest.fail(
                    f"{obj['kind']} {obj['metadata']['name']} @ {version}: {where}: {error.message}"
                )


def test_schema_validation_catches_a_broken_manifest(render):
    """The validation above can fail: a misspelt pod field is rejected."""
    broken = json.loads(json.dumps(render("defaults").deployment))
    broken["spec"]["template"]["spec"]["hostNetwrk"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, RENDER_KUBE_VERSION, strict=True)


@pytest.mark.parametrize("values", sorted(VALUE_SETS))
def test_each_template_renders_at_most_one_object(render, values):
    counts = {path: len(objs) for path, objs in render(values).objects_by_template.items()}
    assert all(count <= 1 for count in counts.values()), counts


# --- the SGLang Deployment -------------------------------------------------------------


@pytest.mark.parametrize("scorer", ["window", "rkv"])
def test_scorers_reading_captured_queries_render(render, scorer):
    """The server captures queries inside the attention, so the chart passes these on."""
    args = server_argv(render({"eviction": {"kvScorer": scorer}}))
    assert flag_value(args, "--kv-scorer") == scorer


def test_the_default_scorer_is_the_plugins(render):
    from sglang_evict.config import DEFAULT_SCORER

    assert flag_value(server_argv(render("defaults")), "--kv-scorer") == DEFAULT_SCORER


def test_eviction_flags_reach_the_server_command(render):
    release = render(
        {
            "eviction": {
                "kvBudget": 4096,
                "kvCadence": 64,
                "kvSinkTokens": 8,
                "kvProtectedTokens": 32,
                "kvWindow": 256,
                "kvScorer": "streaming",
                "kvCompaction": "repack",
            },
            "sglang": {"pageSize": 32, "extraArgs": ["--mem-fraction-static", "0.85"]},
            "model": {"path": "meta-llama/Llama-3.1-8B-Instruct"},
        }
    )
    args = server_argv(release)
    assert args[:2] == ["sglang-evict", "serve"]
    expected = {
        "--kv-budget": "4096",
        "--kv-cadence": "64",
        "--kv-sink-tokens": "8",
        "--kv-protected-tokens": "32",
        "--kv-window": "256",
        "--kv-scorer": "streaming",
        "--kv-compaction": "repack",
        "--page-size": "32",
        "--model-path": "meta-llama/Llama-3.1-8B-Instruct",
        "--host": "0.0.0.0",
        "--port": "30000",
    }
    assert {flag: flag_value(args, flag) for flag in expected} == expected
    assert "--kv-scorer-stats" not in args
    assert args[-2:] == ["--mem-fraction-static", "0.85"]


def test_tier_and_prompt_eviction_reach_the_server_command_only_when_set(render):
    args = server_argv(render("defaults"))
    assert not [arg for arg in args if arg.startswith(("--kv-tier-", "--kv-evict-prompt"))]
    release = render(
        {
            "eviction": {
                "kvEvictPrompt": True,
                "tier": {"bits": 3, "groupTokens": 64, "maxTokens": 2048, "poolShare": 0.3},
            },
            "compactor": {"enabled": False},
            "sglang": {"extraArgs": [*TIER_BACKEND, "--kv-tier-outliers", "2"]},
        }
    )
    args = server_argv(release)
    expected = {
        "--kv-tier-bits": "3",
        "--kv-tier-group": "64",
        "--kv-tier-tokens": "2048",
        "--kv-tier-pool-share": "0.3",
        "--kv-compactor": "inprocess",
        "--attention-backend": "torch_native",
        "--kv-tier-outliers": "2",  # a --kv-* flag the chart does not set passes through
    }
    assert {flag: flag_value(args, flag) for flag in expected} == expected
    assert "--kv-evict-prompt" in args


def test_the_tier_release_passes_serves_own_checks(render, tmp_path, capsys, monkeypatch):
    """The server command the chart renders for the tier is one ``sglang-evict serve``
    accepts: its dry run, on this machine, validates the flags, the policy and SGLang's
    server arguments against a local model (the model path swapped in)."""
    pytest.importorskip("sglang")
    from sglang_evict.cli import main
    from sglang_evict.engine_model import build_engine_model

    model = build_engine_model(tmp_path / "model", "head_dim64")  # a head dim the tier has
    release = render(
        {
            "eviction": {"kvEvictPrompt": True, "kvScorer": "rkv", "tier": {"bits": 3}},
            "compactor": {"enabled": False},
            "sglang": {"extraArgs": TIER_BACKEND},
            "model": {"path": str(model)},
        }
    )
    argv = server_argv(release)[1:]
    # What the pod's environment gives the server: the in-chart Redis's URL.
    env = {item["name"]: item.get("value") for item in release.container("sglang")["env"]}
    monkeypatch.setenv("SGLANG_EVICT_REDIS_URL", env["SGLANG_EVICT_REDIS_URL"])
    code = main([*argv, "--dry-run", "--device", "cuda"])
    out, err = capsys.readouterr()
    assert code == 0, err[-2000:]
    assert "--kv-tier-bits" not in out.splitlines()[-1]  # ours go in the environment
    assert '"tier_bits": 3' in out and "# per request at most:" in out


def test_request_limits_reach_the_server_command_only_when_set(render):
    args = server_argv(render("defaults"))
    assert not [arg for arg in args if arg.startswith("--kv-request-")]
    limits = {"kvRequestMaxBudget": 8192, "kvRequestMaxCadence": 256, "kvRequestAllowDisable": True}
    args = server_argv(render({"eviction": limits}))
    assert flag_value(args, "--kv-request-max-budget") == "8192"
    assert flag_value(args, "--kv-request-max-cadence") == "256"
    assert "--kv-request-allow-disable" in args


def test_admission_values_reach_the_server_command(render):
    args = server_argv(render("defaults"))
    assert flag_value(args, "--kv-admission") == "bounded"
    assert "--kv-no-pressure-passes" not in args
    args = server_argv(render({"eviction": {"kvAdmission": "sglang", "kvPressurePasses": False}}))
    assert flag_value(args, "--kv-admission") == "sglang"
    assert "--kv-no-pressure-passes" in args


def test_pass_group_steps_reach_the_server_command_only_when_above_one(render):
    assert "--kv-pass-group-steps" not in server_argv(render("defaults"))
    args = server_argv(render({"eviction": {"kvPassGroupSteps": 16}}))
    assert flag_value(args, "--kv-pass-group-steps") == "16"


def test_large_integers_are_not_rendered_in_float_notation(render):
    args = server_argv(render({"eviction": {"kvBudget": 1_000_000}}))
    assert flag_value(args, "--kv-budget") == "1000000"


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_gpu_limit_equals_tp_size(render, tp_size):
    release = render({"sglang": {"tpSize": tp_size}})
    assert release.container("sglang")["resources"]["limits"]["nvidia.com/gpu"] == str(tp_size)
    assert flag_value(server_argv(release), "--tp-size") == str(tp_size)


def test_tp2_value_set_requests_two_gpus(render):
    release = render("tp2")
    assert release.container("sglang")["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert flag_value(server_argv(release), "--tp-size") == "2"


def test_dev_shm_is_a_memory_backed_emptydir(render):
    release = render("tp2")
    mounts = {m["mountPath"]: m["name"] for m in release.container("sglang")["volumeMounts"]}
    volume = next(v for v in release.pod["volumes"] if v["name"] == mounts["/dev/shm"])
    assert volume["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Gi"}


@pytest.mark.parametrize("values", ["defaults", "compactor-off", "sidecar-dra"])
def test_probes_use_sglang_health_endpoint(render, values):
    sglang = render(values).container("sglang")
    for probe in ("startupProbe", "readinessProbe"):
        assert sglang[probe]["httpGet"] == {"path": "/health", "port": "http"}
    liveness = sglang["livenessProbe"]
    if values == "defaults":  # the compactor shares the container: one probe checks both
        assert liveness["exec"]["command"] == ["/bin/bash", "/etc/sglang-evict/scripts/liveness.sh"]
        env = {e["name"]: e.get("value") for e in sglang["env"]}
        assert env["SGLANG_EVICT_HEALTH_PATH"] == "/health"
        assert env["SGLANG_EVICT_HTTP_PORT"] == "30000"
    else:
        assert liveness["httpGet"] == {"path": "/health", "port": "http"}


def test_probe_path_can_be_health_generate(render):
    sglang = render({"sglang": {"probes": {"path": "/health_generate"}}}).container("sglang")
    assert sglang["readinessProbe"]["httpGet"]["path"] == "/health_generate"


def test_model_pvc_and_scorer_stats_are_mounted_read_only(render):
    release = render("everything-on")
    sglang = release.container("sglang")
    args = server_argv(release)
    assert flag_value(args, "--kv-scorer") == "triattention"
    assert (
        flag_value(args, "--kv-scorer-stats") == "/etc/sglang-evict/scorer-stats/qwen.safetensors"
    )
    mounts = {m["name"]: m for m in sglang["volumeMounts"]}
    volumes = {v["name"]: v for v in release.pod["volumes"]}
    assert mounts["scorer-stats"]["readOnly"] and mounts["model"]["readOnly"]
    assert volumes["scorer-stats"]["configMap"] == {
        "name": "qwen-stats",
        "items": [{"key": "qwen.safetensors", "path": "qwen.safetensors"}],
    }
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}} in (
        sglang["env"]
    )


@pytest.mark.parametrize("values", ["defaults", "sidecar-dra", "everything-on", "router"])
def test_security_defaults(render, values):
    release = render(values)
    for obj in release.all("Deployment"):
        pod = obj["spec"]["template"]["spec"]
        name = obj["metadata"]["name"]
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert isinstance(pod["securityContext"]["runAsUser"], int), name
        # Only the router talks to the API server (service discovery, its own Role).
        assert pod["automountServiceAccountToken"] is (name == ROUTER), name
        assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
        for container in pod["containers"] + pod.get("initContainers", []):
            where = f"{name}/{container['name']}"
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False, where
            assert context.get("privileged") is not True, where
            assert context["capabilities"]["drop"] == ["ALL"], where
            resources = container["resources"]
            assert resources["requests"] and resources["limits"], where
            assert not container.get("ports") or all(
                "hostPort" not in p for p in container["ports"]
            )


# --- the compactor ---------------------------------------------------------------------


def test_in_container_compactor_runs_under_the_supervisor(render):
    release = render("defaults")
    sglang = release.container("sglang")
    assert sglang["command"] == ["/bin/bash", "/etc/sglang-evict/scripts/supervisor.sh"]
    compactor, server = split_supervised(sglang)
    assert compactor[:2] == ["sglang-evict", "compactor"]
    assert flag_value(compactor, "--socket") == SOCKET
    assert "--tcp" not in compactor
    assert server[:2] == ["sglang-evict", "serve"]
    assert flag_value(server, "--kv-compactor") == "grpc"
    assert flag_value(server, "--kv-compactor-socket") == SOCKET
    assert flag_value(server, "--kv-compactor-fallback") == "inprocess"
    assert flag_value(server, "--kv-compactor-timeout-ms") == "2000"
    env = {e["name"]: e.get("value") for e in sglang["env"]}
    assert env["SGLANG_EVICT_COMPACTOR_SOCKET"] == SOCKET
    assert "nvidia.com/gpu" in sglang["resources"]["limits"]
    assert "initContainers" not in release.pod and len(release.pod["containers"]) == 1
    assert "shareProcessNamespace" not in release.pod


def test_scripts_configmap_ships_the_chart_files(render):
    release = render("defaults")
    scripts = release.get("ConfigMap", f"{FULLNAME}-scripts")
    for name in ("supervisor.sh", "liveness.sh"):
        assert scripts["data"][name] == (CHART / "files" / name).read_text()
    volume = next(v for v in release.pod["volumes"] if v["name"] == "scripts")
    assert volume["configMap"]["name"] == f"{FULLNAME}-scripts"
    checksum = release.deployment["spec"]["template"]["metadata"]["annotations"]
    assert re.fullmatch(r"[0-9a-f]{64}", checksum["checksum/scripts"])


def test_compactor_absent_when_disabled(render):
    release = render("compactor-off")
    sglang = release.container("sglang")
    assert sglang["command"] == ["sglang-evict"]
    assert sglang["args"][0] == "serve"
    assert flag_value(sglang["args"], "--kv-compactor") == "inprocess"
    for flag in ("--kv-compactor-socket", "--kv-compactor-fallback", "--kv-compactor-timeout-ms"):
        assert flag not in sglang["args"]
    assert "compactor" not in sglang["args"]
    assert not any(o["kind"] == "ConfigMap" for o in release.objects)
    assert {v["name"] for v in release.pod["volumes"]} == {"dshm", "cache"}
    assert "initContainers" not in release.pod


def test_sidecar_mode_shares_one_dra_claim_the_socket_and_the_pid_namespace(render):
    release = render("sidecar-dra")
    pod = release.pod
    assert pod["shareProcessNamespace"] is True
    assert pod["resourceClaims"] == [
        {"name": "gpu", "resourceClaimTemplateName": f"{FULLNAME}-gpu"}
    ]
    sglang, compactor = release.container("sglang"), release.container("compactor")
    assert compactor["restartPolicy"] == "Always"  # a native sidecar, started first
    for container in (sglang, compactor):
        assert container["resources"]["claims"] == [{"name": "gpu"}], container["name"]
        assert "nvidia.com/gpu" not in container["resources"].get("limits", {})
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert mounts["compactor-socket"] == "/run/sglang-evict"
    socket_volume = next(v for v in pod["volumes"] if v["name"] == "compactor-socket")
    assert "emptyDir" in socket_volume
    health = ["sglang-evict", "compactor-health", "--socket", SOCKET]
    for probe in ("startupProbe", "livenessProbe"):
        assert compactor[probe]["exec"]["command"] == health
    assert argv(compactor)[:2] == ["sglang-evict", "compactor"]
    assert argv(sglang)[:2] == ["sglang-evict", "serve"]
    assert flag_value(argv(sglang), "--kv-compactor-socket") == SOCKET
    claim = release.get("ResourceClaimTemplate", f"{FULLNAME}-gpu")
    request = claim["spec"]["spec"]["devices"]["requests"][0]["exactly"]
    assert request == {
        "deviceClassName": "gpu.nvidia.com",
        "allocationMode": "ExactCount",
        "count": 1,
    }
    assert not any(o["kind"] == "ConfigMap" for o in release.objects)  # no supervisor needed


def test_sidecar_mode_with_an_existing_claim_template_and_tp2(render):
    release = render("sidecar-dra-tp2")
    assert release.pod["resourceClaims"] == [
        {"name": "gpu", "resourceClaimTemplateName": "h100-pair"}
    ]
    assert not release.all("ResourceClaimTemplate")
    assert flag_value(server_argv(release), "--tp-size") == "2"


@pytest.mark.parametrize("values", sorted(VALUE_SETS))
def test_compactor_socket_is_never_a_port(render, values):
    release = render(values)
    for service in release.all("Service"):
        names = {port["name"] for port in service["spec"]["ports"]}
        allowed = [{"http", "metrics"}] if service["metadata"]["name"] == ROUTER else []
        assert names in [{"http"}, {"redis"}, *allowed], service["metadata"]["name"]
    for container in release.pod["containers"] + release.pod.get("initContainers", []):
        assert [p["name"] for p in container.get("ports", [])] in ([], ["http"])
        assert "--tcp" not in argv(container)
    if release.pod.get("volumes"):
        socket_volumes = [v for v in release.pod["volumes"] if v["name"] == "compactor-socket"]
        assert all(set(v) == {"name", "emptyDir"} for v in socket_volumes)


# --- tracing ---------------------------------------------------------------------------


@pytest.mark.parametrize("values", ["defaults", "sidecar-dra-tp2", "compactor-off"])
def test_no_tracing_without_an_endpoint(render, values):
    release = render(values)
    assert "OTEL_" not in json.dumps(release.deployment)
    assert "--enable-trace" not in server_argv(release)
    assert "--otlp-traces-endpoint" not in server_argv(release)
    assert "tracing.otlpEndpoint" in release.notes  # tells how to turn it on


def test_tracing_in_container_scopes_otel_env_to_the_compactor(render):
    release = render("tracing")
    sglang = release.container("sglang")
    compactor, server = split_supervised(sglang)
    assert compactor[:4] == [
        "env",
        f"OTEL_EXPORTER_OTLP_ENDPOINT=http://{OTLP}",
        f"OTEL_SERVICE_NAME={FULLNAME}-compactor",
        "OTEL_TRACES_EXPORTER=otlp",
    ]
    assert compactor[4:6] == ["sglang-evict", "compactor"]
    assert "--enable-trace" in server
    assert flag_value(server, "--otlp-traces-endpoint") == OTLP
    assert not any(name.startswith("OTEL_") for name in env_names(sglang))  # not SGLang's
    assert OTLP in release.notes


def test_tracing_in_sidecar_sets_the_compactor_containers_otel_env(render):
    release = render("sidecar-dra")
    env = {e["name"]: e.get("value") for e in release.container("compactor")["env"]}
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == f"http://{OTLP}"
    assert env["OTEL_SERVICE_NAME"] == f"{FULLNAME}-compactor"
    assert env["OTEL_TRACES_EXPORTER"] == "otlp"
    assert not any(name.startswith("OTEL_") for name in env_names(release.container("sglang")))
    assert flag_value(server_argv(release), "--otlp-traces-endpoint") == OTLP


# --- Redis -----------------------------------------------------------------------------


def redis_url_env(container: dict[str, Any]) -> dict[str, Any]:
    return next(e for e in container["env"] if e["name"] == "SGLANG_EVICT_REDIS_URL")


def test_in_chart_redis_by_default(render):
    release = render("defaults")
    url = f"redis://{FULLNAME}-redis:6379/0"
    _, server = split_supervised(release.container("sglang"))
    assert flag_value(server, "--kv-lease-store") == "redis"
    assert redis_url_env(release.container("sglang")) == {
        "name": "SGLANG_EVICT_REDIS_URL",
        "value": url,
    }
    redis = release.get("Deployment", f"{FULLNAME}-redis")
    container = redis["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"] == {"cpu": "500m", "memory": "256Mi"}
    assert redis["spec"]["template"]["spec"]["volumes"][0]["emptyDir"]  # no persistence
    assert release.get("Service", f"{FULLNAME}-redis")["spec"]["ports"][0]["port"] == 6379
    policy = release.get("NetworkPolicy", f"{FULLNAME}-redis")
    allowed = policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
    assert allowed == release.deployment["spec"]["selector"]["matchLabels"]
    assert not release.all("PersistentVolumeClaim")


def test_redis_persistence_uses_a_claim(render):
    release = render("redis-persistent")
    claim = release.get("PersistentVolumeClaim", f"{FULLNAME}-redis")
    assert claim["spec"]["storageClassName"] == "ssd"
    pod = release.get("Deployment", f"{FULLNAME}-redis")["spec"]["template"]["spec"]
    assert pod["volumes"][0]["persistentVolumeClaim"] == {"claimName": f"{FULLNAME}-redis"}
    assert "--appendonly" in (command := pod["containers"][0]["command"])
    assert command[command.index("--appendonly") + 1] == "yes"


@pytest.mark.parametrize("values", ["redis-external", "redis-secret", "redis-off"])
def test_no_redis_objects_without_the_in_chart_redis(render, values):
    release = render(values)
    redis_objects = [
        o
        for o in release.objects
        if o["metadata"]["labels"].get("app.kubernetes.io/component") == "redis"
    ]
    assert redis_objects == []


@pytest.mark.parametrize("placement", ["inContainer", "sidecar"])
def test_external_redis_url_reaches_both_processes_through_the_environment(render, placement):
    release = render(
        {"redis": {"externalUrl": EXTERNAL_REDIS}, "compactor": {"placement": placement}}
    )
    containers = [release.container("sglang")]
    if placement == "sidecar":
        containers.append(release.container("compactor"))
    for container in containers:  # inContainer: the compactor inherits the container's env
        assert redis_url_env(container) == {
            "name": "SGLANG_EVICT_REDIS_URL",
            "value": EXTERNAL_REDIS,
        }


@pytest.mark.parametrize("placement", ["inContainer", "sidecar"])
def test_external_redis_url_from_a_secret_stays_out_of_the_pod_spec(render, placement):
    values = {
        "redis": {"externalUrlSecret": {"name": "redis-url", "key": "url"}},
        "compactor": {"placement": placement},
    }
    release = render(values)
    containers = [release.container("sglang")]
    if placement == "sidecar":
        containers.append(release.container("compactor"))
    for container in containers:
        assert redis_url_env(container) == {
            "name": "SGLANG_EVICT_REDIS_URL",
            "valueFrom": {"secretKeyRef": {"name": "redis-url", "key": "url"}},
        }


@pytest.mark.parametrize("values", sorted(VALUE_SETS))
def test_no_container_carries_the_redis_url_in_its_arguments(render, values):
    """The kubelet expands $(VAR) references into the command line, which every user of
    the node reads in /proc/PID/cmdline: the URL (and its password) goes in env only."""
    release = render(values)
    for container in release.pod["containers"] + release.pod.get("initContainers", []):
        arguments = " ".join(argv(container))
        assert "redis://" not in arguments and "SGLANG_EVICT_REDIS_URL" not in arguments
        assert "--redis-url" not in arguments and "--kv-redis-url" not in arguments


def test_without_redis_the_in_process_lease_store_is_used(render):
    sglang = render("redis-off").container("sglang")
    _, server = split_supervised(sglang)
    assert flag_value(server, "--kv-lease-store") == "inprocess"
    assert "SGLANG_EVICT_REDIS_URL" not in env_names(sglang)


# --- optional objects ------------------------------------------------------------------


def test_optional_objects_absent_by_default(render):
    kinds = {kind for kind, _ in render("defaults").kinds()}
    assert kinds == {
        "ConfigMap",
        "Deployment",
        "NetworkPolicy",
        "PodDisruptionBudget",
        "Service",
        "ServiceAccount",
    }
    assert not any(
        "grafana_dashboard" in o["metadata"]["labels"] for o in render("defaults").objects
    )


def test_servicemonitor_scrapes_the_http_port(render):
    release = render("everything-on")
    monitor = release.get("ServiceMonitor", FULLNAME)
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "30s"}]
    service = release.get("Service", FULLNAME)
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    assert "--enable-metrics" in server_argv(release)


def test_hpa_targets_the_deployment_which_leaves_replicas_to_it(render):
    release = render("everything-on")
    hpa = release.get("HorizontalPodAutoscaler", FULLNAME)
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": FULLNAME,
    }
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 3)
    assert "replicas" not in release.deployment["spec"]
    assert render("defaults").deployment["spec"]["replicas"] == 1


def test_pdb_selects_the_server_pods(render):
    release = render("defaults")
    pdb = release.get("PodDisruptionBudget", FULLNAME)
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"] == release.deployment["spec"]["selector"]
    assert not render({"podDisruptionBudget": {"enabled": False}}).all("PodDisruptionBudget")


def test_grafana_dashboard_covers_the_eviction_metrics(render):
    release = render("everything-on")
    config_map = release.get("ConfigMap", f"{FULLNAME}-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(config_map["data"]["sglang-evict.json"])
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = set()
    for expr in exprs:
        for name in re.findall(r"sglang_evict:[a-z_]+", expr):
            used.add(re.sub(r"_(bucket|sum|count)$", "", name))
    assert used <= EVICTION_METRICS, used - EVICTION_METRICS
    for needed in (
        "sglang_evict:pages_freed_total",
        "sglang_evict:tokens_evicted_total",
        "sglang_evict:budget_occupancy_ratio",
        "sglang_evict:pass_duration_seconds",
        "sglang_evict:compactor_up",
        "sglang_evict:compactor_fallbacks_total",
        "sglang_evict:tier_tokens",
        "sglang_evict:tier_bytes",
        "sglang_evict:tier_tokens_quantized_total",
        "sglang_evict:tier_tokens_dropped_total",
    ):
        assert needed in used, needed
    assert any("histogram_quantile" in e and "pass_duration_seconds_bucket" in e for e in exprs)


def test_dashboard_metric_names_match_the_plugin():
    from sglang_evict import metrics

    exported = {
        v for k, v in vars(metrics).items() if k.isupper() and str(v).startswith("sglang_evict:")
    }
    assert exported and exported <= EVICTION_METRICS, exported - EVICTION_METRICS


def test_overrides_shown_in_the_docs_render(render):
    page = (ROOT / "docs" / "kubernetes.md").read_text()
    text = page.split("\n## Kubernetes\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```yaml\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 2
    release = render(yaml.safe_load(blocks[0]))
    args = server_argv(release)
    assert flag_value(args, "--model-path") == "meta-llama/Llama-3.1-8B-Instruct"
    assert flag_value(args, "--kv-budget") == "4096"
    assert release.container("sglang")["resources"]["limits"]["nvidia.com/gpu"] == "2"
    tier = server_argv(render(yaml.safe_load(blocks[1])))  # the tier's block
    assert flag_value(tier, "--kv-tier-bits") == "3"
    assert flag_value(tier, "--kv-compactor") == "inprocess"
    assert "helm install llm ./helm/sglang-evict" in text


def test_notes_explain_how_to_reach_the_server_metrics_and_traces(render):
    notes = render("defaults").notes
    assert f"kubectl -n {NAMESPACE} port-forward svc/{FULLNAME} 30000:30000" in notes
    assert "/v1/models" in notes and "/metrics" in notes and "sglang_evict:" in notes
    assert "compactor-health --socket " + SOCKET in notes
    assert "Traces:" in notes
    assert "sglang.enableMetrics=true" in render({"sglang": {"enableMetrics": False}}).notes


def test_dashboard_sums_over_replicas_and_shows_each_replica():
    """The fleet view: each of the plugin's main counters summed over every selected
    replica, and again per replica, by the pod label the other panels use."""
    dashboard = json.loads((CHART / "dashboards" / "sglang-evict.json").read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert "label_values(sglang_evict:passes_total" in variables["pod"]["definition"]
    assert variables["pod"]["includeAll"] and variables["pod"]["multi"]
    exprs = [
        (p["title"], t["expr"])
        for p in dashboard["panels"]
        if p["type"] != "row"
        for t in p["targets"]
    ]
    every = [expr for _, expr in exprs]
    for expr in every:  # every panel follows the namespace and pod choice
        for selector in re.findall(r"sglang_evict:[a-z_]+(\{[^}]*\})", expr):
            assert 'pod=~"$pod"' in selector, expr
    per_replica = [expr for title, expr in exprs if title.endswith("per replica")]
    for counter in ("tokens_evicted_total", "passes_total", "pages_freed_total"):
        rate = f"rate(sglang_evict:{counter}{{"
        assert any(e.startswith(f"sum({rate}") for e in every), f"no fleet sum of {counter}"
        assert any(e.startswith(f"sum by (pod) ({rate}") for e in per_replica), counter
    assert any(e.startswith("sum(rate(sglang_evict:pass_failures_total{") for e in every)
    assert any("sum by (pod, le)" in e and "pass_duration_seconds_bucket" in e for e in every)
    rows = [p["title"] for p in dashboard["panels"] if p["type"] == "row"]
    assert "Per replica" in rows


# --- SGLang's router -------------------------------------------------------------------


def selector_argument(arguments: list[str]) -> dict[str, str]:
    """The labels of the router's `--selector key=value ...` (argparse nargs="+")."""
    start = arguments.index("--selector") + 1
    end = next(i for i in range(start, len(arguments)) if arguments[i].startswith("--"))
    return dict(label.split("=", 1) for label in arguments[start:end])


def test_router_is_off_by_default(render):
    release = render("defaults")
    assert not [o for o in release.objects if ROUTER == o["metadata"]["name"]]
    assert not release.all("Role") and not release.all("RoleBinding")
    assert "router" not in release.notes


@pytest.mark.parametrize("values", ["router", "everything-on"])
def test_router_discovers_the_server_pods_by_their_selector_labels(render, values):
    release = render(values)
    router, router_deployment = release.router, release.get("Deployment", ROUTER)
    assert router["command"] == ["python3", "-m", "sglang_router.launch_router"]
    args = router["args"]
    server_selector = release.deployment["spec"]["selector"]["matchLabels"]
    assert selector_argument(args) == server_selector
    pod_labels = release.deployment["spec"]["template"]["metadata"]["labels"]
    assert server_selector.items() <= pod_labels.items()
    router_labels = router_deployment["spec"]["template"]["metadata"]["labels"]
    assert not server_selector.items() <= router_labels.items()  # it never routes to itself
    assert "--service-discovery" in args
    assert flag_value(args, "--service-discovery-port") == "30000"  # sglang.port
    assert flag_value(args, "--service-discovery-namespace") == NAMESPACE
    assert flag_value(args, "--host") == "0.0.0.0"
    assert flag_value(args, "--port") == "30080"
    assert flag_value(args, "--prometheus-port") == "29000"
    assert "--worker-urls" not in args
    service = release.get("Service", ROUTER)
    assert service["spec"]["selector"] == router_deployment["spec"]["selector"]["matchLabels"]
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {
        "http": 30080,
        "metrics": 29000,
    }


def test_router_works_without_the_sglang_service_and_the_service_stays_otherwise(render):
    without = render("router")  # service.enabled: false, replicaCount: 3
    assert not [s for s in without.all("Service") if s["metadata"]["name"] == FULLNAME]
    assert without.deployment["spec"]["replicas"] == 3
    assert without.router["args"][-2:] == ["--cache-threshold", "0.5"]  # extraArgs appended
    pod = without.get("Deployment", ROUTER)["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "cpu"}
    assert "nodeSelector" not in without.pod  # the server's placement is its own
    with_hpa = render("everything-on")
    assert with_hpa.get("Service", FULLNAME)  # direct per-replica access stays
    assert "replicas" not in with_hpa.deployment["spec"]  # the HPA's
    assert with_hpa.get("ServiceMonitor", ROUTER)["spec"]["endpoints"][0]["port"] == "metrics"


@pytest.mark.parametrize("policy", [None, *ROUTER_POLICIES])
def test_router_policy_reaches_the_command(render, policy):
    router = {"enabled": True} | ({"policy": policy} if policy else {})
    args = render({"router": router}).router["args"]
    assert flag_value(args, "--policy") == (policy or "cache_aware")


def test_router_image_defaults_to_the_charts_image(render, chart):
    app_version = chart.metadata["appVersion"]
    assert render("router").router["image"] == f"sglang-evict:{app_version}"
    own = render({"router": {"enabled": True}, "image": {"repository": "reg/se", "tag": "dev"}})
    assert own.router["image"] == "reg/se:dev"
    other = render({"router": {"enabled": True, "image": {"repository": "reg/r", "tag": "1"}}})
    assert other.router["image"] == "reg/r:1"


def test_router_rbac_is_a_namespaced_role_to_read_pods(render):
    release = render("router")
    kinds = {kind for kind, _ in release.kinds()}
    assert not kinds & {"ClusterRole", "ClusterRoleBinding"}
    role = release.get("Role", ROUTER)
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]
    binding = release.get("RoleBinding", ROUTER)
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": ROUTER,
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": ROUTER, "namespace": NAMESPACE}
    ]
    account = release.get("ServiceAccount", ROUTER)
    assert account.get("automountServiceAccountToken") is not False
    pod = release.get("Deployment", ROUTER)["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == ROUTER
    assert pod["automountServiceAccountToken"] is True
    assert release.pod["serviceAccountName"] != ROUTER  # the server has no API access


def test_router_probes_its_health_and_readiness(render):
    router = render("router").router
    assert router["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert router["readinessProbe"]["httpGet"] == {"path": "/readiness", "port": "http"}
    ports = {p["name"]: p["containerPort"] for p in router["ports"]}
    assert ports == {"http": 30080, "metrics": 29000}


def test_notes_send_traffic_to_the_router_when_it_is_on(render):
    notes = render("everything-on").notes
    assert f"kubectl -n {NAMESPACE} port-forward svc/{ROUTER} 30080:30080" in notes
    assert f"http://{ROUTER}.{NAMESPACE}.svc:30080" in notes
    assert "direct per-replica access" in notes
    # The SGLang Service is still named, for direct access only.
    assert f"http://{FULLNAME}.{NAMESPACE}.svc:30000 (one replica per connection" in notes
    assert f"svc/{ROUTER}" in render("router").notes  # without the SGLang Service too
    # Not Ready: the pods its selector should match, listed with the same labels.
    selector = render("everything-on").get("Deployment", FULLNAME)["spec"]["selector"]
    labels = ",".join(f"{k}={v}" for k, v in selector["matchLabels"].items())
    assert f"get pods -l {labels})" in notes
    assert "custom_params) reaches the replicas on /v1/completions" in notes


# --- the scripts, run for real ---------------------------------------------------------

needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")

FAKE_COMPACTOR = """
import os, socket, sys, time
path, pid_file, lifetime_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
with open(pid_file, "w") as f:
    f.write(str(os.getpid()))
if lifetime_s < 0:  # die before opening the socket
    sys.exit(3)
server = socket.socket(socket.AF_UNIX)
server.bind(path)
server.listen()
time.sleep(lifetime_s)
"""


def _run_supervisor(tmp_path, compactor_lifetime_s, server_cmd, *, wait_s=10, signal_after_s=None):
    sock = tmp_path / "compactor.sock"
    pid_file = tmp_path / "compactor.pid"
    env = {
        **os.environ,
        "SGLANG_EVICT_COMPACTOR_SOCKET": str(sock),
        "SGLANG_EVICT_SOCKET_WAIT_S": str(wait_s),
        "SGLANG_EVICT_STOP_TIMEOUT_S": "5",
    }
    command = [
        "bash",
        str(CHART / "files" / "supervisor.sh"),
        sys.executable,
        "-c",
        FAKE_COMPACTOR,
        str(sock),
        str(pid_file),
        str(compactor_lifetime_s),
        "--",
        *server_cmd,
    ]
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    if signal_after_s is not None:
        deadline = time.monotonic() + 10
        while not (tmp_path / "server.started").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(signal_after_s)
        process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=30)
    compactor_pid = int(pid_file.read_text()) if pid_file.exists() else None
    return process.returncode, stderr, compactor_pid


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _server(tmp_path, script: str) -> list[str]:
    return ["bash", "-c", f"touch {tmp_path}/server.started; {script}"]


@needs_bash
def test_supervisor_exits_nonzero_and_stops_the_compactor_when_the_server_exits(tmp_path):
    code, stderr, compactor_pid = _run_supervisor(
        tmp_path, 60, _server(tmp_path, "sleep 0.3; exit 0")
    )
    assert code != 0, stderr
    assert "server exited" in stderr
    assert (tmp_path / "server.started").exists()
    assert _gone(compactor_pid)


@needs_bash
def test_supervisor_exits_nonzero_and_stops_the_server_when_the_compactor_dies(tmp_path):
    code, stderr, _ = _run_supervisor(
        tmp_path, 0.5, _server(tmp_path, f"echo $$ > {tmp_path}/server.pid; exec sleep 60")
    )
    assert code != 0, stderr
    assert "compactor exited" in stderr
    assert _gone(int((tmp_path / "server.pid").read_text()))


@needs_bash
def test_supervisor_never_starts_the_server_when_the_compactor_dies_before_its_socket(tmp_path):
    code, stderr, _ = _run_supervisor(tmp_path, -1, _server(tmp_path, "sleep 60"))
    assert code != 0
    assert "before opening" in stderr
    assert not (tmp_path / "server.started").exists()


@needs_bash
def test_supervisor_gives_up_when_the_socket_never_appears(tmp_path):
    silent_compactor = ["bash", "-c", f"echo $$ > {tmp_path}/compactor.pid; exec sleep 60"]
    result = subprocess.run(
        [
            "bash",
            str(CHART / "files" / "supervisor.sh"),
            *silent_compactor,
            "--",
            *_server(tmp_path, "sleep 60"),
        ],
        env={
            **os.environ,
            "SGLANG_EVICT_COMPACTOR_SOCKET": str(tmp_path / "never.sock"),
            "SGLANG_EVICT_SOCKET_WAIT_S": "1",
        },
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode != 0
    assert "did not open" in result.stderr
    assert not (tmp_path / "server.started").exists()
    assert _gone(int((tmp_path / "compactor.pid").read_text()))


@needs_bash
def test_supervisor_stops_both_and_exits_zero_on_sigterm(tmp_path):
    code, stderr, compactor_pid = _run_supervisor(
        tmp_path, 60, _server(tmp_path, "exec sleep 60"), signal_after_s=0.2
    )
    assert code == 0, stderr
    assert "termination requested" in stderr
    assert _gone(compactor_pid)


class _Health(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):  # http.server calls it by this name
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def health_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield server
    server.shutdown()
    _Health.status = 200


def _run_liveness(tmp_path, port: int, compactor_healthy: bool):
    """liveness.sh with a stand-in `sglang-evict` whose compactor-health answers as told."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "sglang-evict"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        f'[ "$1 $2 $3" = "compactor-health --socket {SOCKET}" ] || exit 64\n'
        f"exit {0 if compactor_healthy else 1}\n"
    )
    fake.chmod(0o755)
    (bin_dir / "python3").symlink_to(sys.executable)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "SGLANG_EVICT_HTTP_PORT": str(port),
        "SGLANG_EVICT_HEALTH_PATH": "/health",
        "SGLANG_EVICT_COMPACTOR_SOCKET": SOCKET,
    }
    return subprocess.run(
        ["bash", str(CHART / "files" / "liveness.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )


@needs_bash
@pytest.mark.parametrize(
    ("http_status", "compactor_healthy", "blamed"),
    [(200, True, None), (503, True, "SGLang"), (200, False, "compactor")],
    ids=["both-healthy", "sglang-unhealthy", "compactor-unhealthy"],
)
def test_liveness_script_checks_both_processes(
    tmp_path, health_server, http_status, compactor_healthy, blamed
):
    _Health.status = http_status
    result = _run_liveness(tmp_path, health_server.server_address[1], compactor_healthy)
    if blamed is None:
        assert result.returncode == 0, result.stderr
    else:
        assert result.returncode != 0
        assert f"liveness: {blamed}" in result.stderr


@needs_bash
def test_liveness_script_fails_when_sglang_is_not_listening(tmp_path):
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = _run_liveness(tmp_path, port, compactor_healthy=True)
    assert result.returncode != 0 and "liveness: SGLang" in result.stderr
