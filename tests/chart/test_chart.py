"""The Helm chart: it lints, renders valid objects for several values files, refuses bad
values at template time, keeps crds/ as the single source of the CRD, runs the operator
with arguments it accepts, and its ServiceMonitor and dashboard fit what the operator and
the agents produce."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import kopf
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

import kvpool_agent.connector
from kvpool_agent.connector.settings import ConnectorSettings
from kvpool_operator import main as operator_main
from kvpool_operator.reconcile import Options
from kvpool_operator.render import Pool, render
from kvpool_operator.spec import PoolSpec
from tests.support.crd_schema import (
    CRD_PATH,
    TENANT_CRD_PATH,
    admission_errors,
    schema,
    with_defaults,
)
from tests.support.tools import KUBERNETES_VERSION

from .conftest import CHART, NAMESPACE, VALUES, Helm, Manifest, by_kind, one

OLDEST_KUBERNETES = "1.29.0"
"""Chart.yaml's kubeVersion floor (the CRD's CEL rules)."""
VALUE_SETS: dict[str, tuple[str, ...]] = {
    "defaults": (),
    "s3-nvme": ("s3-nvme.yaml",),
    "monitoring": ("monitoring.yaml",),
    "csi": ("csi.yaml",),
}
NO_OFFICIAL_SCHEMA = {("monitoring.coreos.com/v1", "ServiceMonitor")}
"""Kinds outside Kubernetes (prometheus-operator's); test_service_monitor checks it."""
BAD_VALUES = {
    "bad-pull-policy.yaml": "/image/pullPolicy",
    "bad-watch-namespaces.yaml": "/operator/watchNamespaces",
    "bad-unknown-key.yaml": "'enable' not allowed",
    "bad-pool-name.yaml": "/examplePool/name",
    "bad-digest.yaml": "/image/digest",
    "bad-resources.yaml": "/operator/resources/limits/memory",
    "bad-example-namespace.yaml": "is not one of operator.watchNamespaces",
}


@pytest.fixture(scope="module", params=sorted(VALUE_SETS))
def rendered(request: pytest.FixtureRequest, helm: Helm) -> tuple[str, list[Manifest]]:
    name: str = request.param
    return name, helm.template(*VALUE_SETS[name])


def _operator_container(manifests: list[Manifest]) -> dict[str, Any]:
    (container,) = one(manifests, "Deployment")["spec"]["template"]["spec"]["containers"]
    return dict(container)


def _values(name: str) -> dict[str, Any]:
    merged: dict[str, Any] = yaml.safe_load((CHART / "values.yaml").read_text())
    for file in VALUE_SETS[name]:
        for key, value in yaml.safe_load((VALUES / file).read_text()).items():
            merged[key] = {**merged[key], **value} if isinstance(value, dict) else value
    return merged


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_lint(helm: Helm, name: str) -> None:
    args = [arg for file in VALUE_SETS[name] for arg in ("--values", str(VALUES / file))]
    result = helm.run("lint", str(CHART), "--strict", *args)
    assert "0 chart(s) failed" in result.stdout


@pytest.mark.parametrize("version", [OLDEST_KUBERNETES, KUBERNETES_VERSION])
def test_every_object_is_valid(rendered: tuple[str, list[Manifest]], version: str) -> None:
    _, manifests = rendered
    for manifest in manifests:
        kind = (manifest["apiVersion"], manifest["kind"])
        if kind in NO_OFFICIAL_SCHEMA:
            continue
        if manifest["kind"] == "KVCachePool":
            # a custom resource: the CRD's schema and CEL rules, as the API server applies them
            assert admission_errors(manifest) == []
            continue
        try:
            kubernetes_validate.validate(manifest, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            first = str(error).splitlines()[0]
            pytest.fail(f"{manifest['kind']} {manifest['metadata']['name']}: {first}")


def test_the_chart_installs_the_crds_of_crds(helm: Helm) -> None:
    sources = (CRD_PATH, TENANT_CRD_PATH)
    copies = sorted(path.name for path in (CHART / "crds").iterdir())
    assert copies == sorted(source.name for source in sources)
    for source in sources:
        assert (CHART / "crds" / source.name).read_bytes() == source.read_bytes(), (
            f"the chart's CRD differs from {source}: run python -m kvpool_operator.crds"
        )
    crds = by_kind(helm.template(), "CustomResourceDefinition")
    assert sorted(crds, key=lambda crd: crd["metadata"]["name"]) == [
        yaml.safe_load(source.read_text()) for source in sources
    ]
    assert {crd["apiVersion"] for crd in crds} == {"apiextensions.k8s.io/v1"}


def test_the_operator_deployment(rendered: tuple[str, list[Manifest]]) -> None:
    _, manifests = rendered
    deployment = one(manifests, "Deployment")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] > 0
    container = _operator_container(manifests)
    assert container["command"] == ["kvpool-operator"]
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert container["resources"]["requests"]["cpu"]
    assert container["resources"]["requests"]["memory"]
    assert container["resources"]["limits"]["memory"]
    (account,) = [
        account
        for account in by_kind(manifests, "ServiceAccount")
        if account["metadata"]["labels"]["app.kubernetes.io/component"] == "operator"
    ]
    assert pod["serviceAccountName"] == account["metadata"]["name"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= (
        deployment["spec"]["template"]["metadata"]["labels"].items()
    )


_KUBECONFIG = {
    "apiVersion": "v1",
    "kind": "Config",
    "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
    "users": [{"name": "u", "user": {"token": "t"}}],
    "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
    "current-context": "c",
}


def test_the_operator_accepts_its_arguments(
    rendered: tuple[str, list[Manifest]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """kvpool-operator's own parser reads the rendered arguments; the probe hits --liveness.

    Its credentials are a kubeconfig (in the pod, the service account); the liveness port
    the pod binds need not be free on the test's machine, so that check only records it.
    """
    name, manifests = rendered
    calls: list[dict[str, Any]] = []
    checked: list[str] = []
    monkeypatch.setattr(kopf, "configure", lambda **_: None)
    monkeypatch.setattr(kopf, "run", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(operator_main, "check_liveness", checked.append)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps(_KUBECONFIG))
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    container = _operator_container(manifests)
    assert operator_main.main(container["args"]) == 0
    (run,) = calls
    assert checked == [run["liveness_endpoint"]]
    values = _values(name)
    watched = values["operator"]["watchNamespaces"]
    assert run["clusterwide"] is (not watched)
    assert list(run["namespaces"]) == watched
    options = run["memo"]["options"]
    assert isinstance(options, Options)
    assert options.agent_image == (values["operator"]["agentImage"] or container["image"])
    liveness = re.fullmatch(r"http://0\.0\.0\.0:(\d+)(/\S+)", run["liveness_endpoint"])
    assert liveness is not None, run["liveness_endpoint"]
    probe = container["livenessProbe"]["httpGet"]
    (port,) = [p for p in container["ports"] if p["name"] == probe["port"]]
    assert (port["containerPort"], probe["path"]) == (int(liveness[1]), liveness[2])


def test_the_image_is_pinned_by_digest_when_asked(helm: Helm) -> None:
    container = _operator_container(helm.template("s3-nvme.yaml"))
    assert container["image"] == (
        "registry.example.com/ml/kvpool:0.1.0@sha256:"
        "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
    )
    defaults = _operator_container(helm.template())
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert defaults["image"] == f"kvpool:{chart['appVersion']}"


def test_the_example_pool_is_one_the_operator_renders(helm: Helm) -> None:
    manifests = helm.template("s3-nvme.yaml")
    pool = one(manifests, "KVCachePool")
    assert pool["metadata"]["namespace"] == "inference"
    defaulted = with_defaults(schema(), pool)
    children = render(
        Pool(pool["metadata"]["name"], "inference", "uid"),
        PoolSpec.parse(defaulted["spec"]),
        default_image="kvpool:test",
    )
    config = yaml.safe_load(children.config["data"]["agent.yaml"])
    assert {"nvme", "s3"} <= config.keys()
    assert children.index is not None
    assert children.index.deployment["spec"]["replicas"] == 2
    assert not by_kind(helm.template(), "KVCachePool"), "no example pool unless asked"


def test_the_service_monitor_scrapes_the_agents_and_index_services(helm: Helm) -> None:
    monitor = one(helm.template("monitoring.yaml"), "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    spec = monitor["spec"]
    assert spec["namespaceSelector"] == {"any": True}
    children = render(
        Pool("main", "inference", "uid"),
        PoolSpec.parse(
            {"tenants": {"tokensSecretRef": {"name": "tokens"}}, "index": {"enabled": True}}
        ),
        default_image="kvpool:test",
    )
    assert children.index is not None
    for service in (children.service, children.index.service):
        labels = service["metadata"]["labels"]
        assert spec["selector"]["matchLabels"].items() <= labels.items()
        assert set(spec["targetLabels"]) <= labels.keys()
        ports = {port["name"] for port in service["spec"]["ports"]}
        for endpoint in spec["endpoints"]:
            assert endpoint["port"] in ports
            assert endpoint["path"] == "/metrics"
    assert not by_kind(helm.template(), "ServiceMonitor"), "no ServiceMonitor unless asked"
    namespaced = one(
        helm.template("s3-nvme.yaml", sets=("serviceMonitor.enabled=true",)), "ServiceMonitor"
    )
    assert namespaced["spec"]["namespaceSelector"] == {"matchNames": ["inference"]}


def test_the_dashboard_config_map_holds_the_dashboard(helm: Helm) -> None:
    (config_map,) = [
        manifest
        for manifest in helm.template("monitoring.yaml")
        if manifest["kind"] == "ConfigMap" and manifest["metadata"]["name"].endswith("-dashboard")
    ]
    assert config_map["metadata"]["namespace"] == "monitoring"
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["annotations"] == {"grafana_folder": "kvpool"}
    (data,) = config_map["data"].values()
    dashboard = CHART / "dashboards" / "kvpool-agents.json"
    assert json.loads(data) == json.loads(dashboard.read_text())
    assert not by_kind(helm.template(), "ConfigMap"), "no dashboard unless asked"


@pytest.mark.parametrize("file", sorted(BAD_VALUES))
def test_bad_values_fail_at_template_time(helm: Helm, file: str) -> None:
    result = helm.run("template", "kvpool", str(CHART), "--values", str(VALUES / file), check=False)
    assert result.returncode != 0, f"{file} was accepted"
    assert BAD_VALUES[file] in result.stderr


def test_every_bad_values_file_is_tested() -> None:
    assert {path.name for path in VALUES.glob("bad-*.yaml")} == BAD_VALUES.keys()


def test_the_notes_configure_vllm_with_the_connectors_own_settings(helm: Helm) -> None:
    notes = helm.notes("s3-nvme.yaml")
    quoted = re.search(r"--kv-transfer-config '([^']*)'", notes)
    assert quoted is not None, notes
    transfer = json.loads(" ".join(quoted[1].split()))
    assert transfer["kv_connector"] in kvpool_agent.connector.__all__
    assert transfer["kv_connector_module_path"] == kvpool_agent.connector.__name__
    settings = ConnectorSettings.load(transfer["kv_connector_extra_config"], environ={})
    assert (settings.pool, settings.namespace) == ("gpu", "inference")
    assert "kvpool tenant-id" in notes
    assert "/v1/tenants/$TENANT_ID/quota" in notes
    assert "kvpool-gpu-quotas" in notes
    assert "create secret generic kvpool-gpu-tokens" in notes  # the pool's tokensSecretRef
    assert f"-n {NAMESPACE} rollout status deployment/kvpool-operator" in notes


def test_the_values_are_documented_field_by_field() -> None:
    """Every field of values.yaml has a comment above it and a typed schema entry."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    lines = (CHART / "values.yaml").read_text().splitlines()
    fields: set[str] = set()

    def walk(node: Any, node_schema: dict[str, Any], path: str) -> None:
        assert "type" in node_schema or "anyOf" in node_schema, path
        if path:
            fields.add(path)
        free_form = node_schema.get("additionalProperties", False) is not False
        if isinstance(node, dict) and not free_form and "properties" in node_schema:
            for key, child in node.items():
                assert key in node_schema["properties"], f"{path}.{key} is not in the schema"
                walk(child, node_schema["properties"][key], f"{path}.{key}".lstrip("."))

    walk(yaml.safe_load("\n".join(lines)), schema, "")
    stack: list[tuple[int, str]] = []
    for index, line in enumerate(lines):
        match = re.match(r"^(\s*)([A-Za-z]\w*):", line)
        if not match:
            continue
        indent = len(match[1])
        stack = [(depth, key) for depth, key in stack if depth < indent] + [(indent, match[2])]
        path = ".".join(key for _, key in stack)
        if path in fields:
            above = lines[index - 1].strip() if index else ""
            assert above.startswith("#"), f"values.yaml line {index + 1}: {path} has no comment"


def test_templates_use_only_defined_values() -> None:
    """A template that reads a value values.yaml lacks renders it empty: catch misspellings."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for template in sorted((CHART / "templates").iterdir()):
        for reference in re.findall(r"\.Values((?:\.\w+)+)", template.read_text()):
            node: Any = values
            for part in reference.strip(".").split("."):
                assert isinstance(node, dict) and part in node, (
                    f"{template.name}: .Values{reference}"
                )
                node = node[part]


def test_chart_metadata() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2"
    assert chart["kubeVersion"].startswith(">=" + OLDEST_KUBERNETES.rsplit(".", 1)[0])
    pyproject = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    version = re.search(r'^version = "([^"]+)"', pyproject, re.MULTILINE)
    assert version is not None
    assert chart["appVersion"] == version[1], "the chart installs the package's version"
