"""The Helm chart's optional objects (ServiceMonitor, HPA, PDB, the Grafana dashboard,
the notes) and SGLang's router, rendered offline (``tests/helm_render.py``)."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from tests.helm_render import (
    CHART,
    EVICTION_METRICS,
    FULLNAME,
    NAMESPACE,
    ROOT,
    ROUTER,
    ROUTER_POLICIES,
    SOCKET,
    flag_value,
    server_argv,
)

pytest.importorskip("helm_python", reason="needs helm-python-sdk (the [dev] extra)")


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
