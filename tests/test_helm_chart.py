"""The Helm chart at helm/sglang-evict, checked offline, per template (helm-unittest style):
metadata, values and schema, refusals, Kubernetes validity, the SGLang Deployment, the
compactor, tracing and Redis.

Every rendered manifest is validated against the Kubernetes OpenAPI schemas bundled with
``kubernetes-validate`` (strict: unknown fields fail), for several value sets. Each value
set is rendered once per module and cached (``tests/helm_render.py``). The optional
objects and the router: ``test_helm_objects.py``; the chart's scripts run for real:
``test_helm_scripts.py``.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import yaml

from tests.helm_render import (
    CHART,
    CRD_KINDS,
    EXTERNAL_REDIS,
    FULLNAME,
    MIN_KUBE_VERSION,
    MIN_KUBE_VERSION_DRA,
    OTLP,
    RELEASE,
    RENDER_KUBE_VERSION,
    ROOT,
    ROUTER,
    SOCKET,
    TIER_BACKEND,
    VALUE_SETS,
    argv,
    env_names,
    flag_value,
    render_at_kube_version,
    server_argv,
    split_supervised,
)

helm = pytest.importorskip("helm_python", reason="needs helm-python-sdk (the [dev] extra)")
kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="needs kubernetes-validate (the [dev] extra)"
)


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
            "eviction.tier.bits with compactor.enabled: the sidecar demotes into the tier's "
            "arena on CPU only so far",
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
    pytest.importorskip("sglang", reason="serve's dry run checks SGLang's server arguments")
    from sglang_evict.cli.main import main
    from sglang_evict.models.engine_model import build_engine_model

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
