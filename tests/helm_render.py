"""What the Helm chart's tests share: the chart, its named value sets, one rendered
release per value set and module, and readers for what a release holds.

The chart is rendered by Helm's own engine: ``helm-python-sdk`` binds Helm 4's Go SDK (no
helm binary, no cluster). A test using ``chart`` or ``render`` skips without the ``[dev]``
extra.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import pytest
import yaml

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


@contextmanager
def loaded_chart() -> Iterator[Any]:
    """The chart loaded by Helm's engine (the ``chart`` fixture in ``tests/conftest.py``)."""
    helm = pytest.importorskip("helm_python", reason="needs helm-python-sdk (the [dev] extra)")
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def renderer(chart) -> Callable[[str | dict[str, Any]], Release]:
    """render(name_or_values) -> Release; named value sets are rendered once (the ``render``
    fixture in ``tests/conftest.py``)."""
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
