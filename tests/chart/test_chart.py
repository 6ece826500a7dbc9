"""The Helm chart: it lints, renders valid objects for several values files, refuses bad
values at template time, keeps crds/ as the single source of the CRD, runs the operator
with arguments it accepts, and its ServiceMonitor and dashboard fit what the operator and
the agents produce."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import kopf
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

import kvpool.connector
from kvpool.common.names import CACHE_POOL_LABEL, CSI_DRIVER, NODE_NAME_ENV
from kvpool.connector.settings import ConnectorSettings
from kvpool.csi import main as csi_main
from kvpool.operator import crds
from kvpool.operator import main as operator_main
from kvpool.operator.admission.server import DEFAULT_CONFIGURATION, ServiceRef, WebhookOptions
from kvpool.operator.admission.sidecar import DecodeSidecar
from kvpool.operator.crds import openapi_schema
from kvpool.operator.reconcile import Options
from kvpool.operator.render import Pool, render
from kvpool.operator.spec import KVCachePool, PoolSpec
from tests.support.crd_schema import (
    CRD_PATH,
    GAIE_CRD_PATH,
    TENANT_CRD_PATH,
    admission_errors,
    object_errors,
    schema,
    with_defaults,
)
from tests.support.tools import KUBERNETES_VERSION

from .conftest import CHART, NAMESPACE, VALUES, Helm, Manifest, by_kind, one

pytestmark = pytest.mark.process

OLDEST_KUBERNETES = "1.29.0"
"""Chart.yaml's kubeVersion floor (the CRD's CEL rules)."""
VALUE_SETS: dict[str, tuple[str, ...]] = {
    "defaults": (),
    "s3-nvme": ("s3-nvme.yaml",),
    "monitoring": ("monitoring.yaml",),
    "csi": ("csi.yaml",),
    "webhook": ("webhook.yaml",),
    "inference-gateway": ("inference-gateway.yaml",),
    "prefill-decode": ("prefill-decode.yaml",),
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
    "bad-webhook-without-csi.yaml": (
        "the webhook mounts the pool's volume through kvpool's CSI driver: set csi.enabled"
    ),
    "bad-webhook-namespaces.yaml": "the webhook needs the operator to watch every namespace",
    "bad-webhook-port.yaml": "webhook.port 9443 is operator.healthPort's",
    "bad-example-spec-field.yaml": "at '/examplePool/spec/l1': additional properties 'sise'",
    "bad-example-spec-size.yaml": "at '/examplePool/spec/l1/size': '1GB' does not match pattern",
    "bad-example-spec-disaggregation.yaml": (
        "at '/examplePool/spec/index/picker/disaggregation': additional properties 'thresholdToken'"
    ),
    "bad-inference-pool-without-picker.yaml": (
        "examplePool.inferencePool needs the example pool's endpoint picker"
    ),
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
        if manifest["kind"] == "InferencePool":  # the Gateway API Inference Extension's CRD
            assert object_errors(schema(GAIE_CRD_PATH), manifest) == []
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
            f"the chart's CRD differs from {source}: run python -m kvpool.operator.crds"
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


@dataclass
class OperatorRun:
    """What ``kvpool-operator`` did with the rendered arguments, up to ``kopf.run``."""

    run: dict[str, Any]
    liveness_checked: list[str]
    webhook: WebhookOptions | None


def _run_operator(args: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> OperatorRun:
    """kvpool-operator's own parser reads ``args``, stopped at ``kopf.run``.

    Its credentials are a kubeconfig (in the pod, the service account); the liveness and
    webhook ports the pod binds need not be free on the test's machine, nor the webhook's
    certificate directory be there, so those checks only record what they were given; the
    webhook's handlers are recorded, not registered (the registry is the process's).
    """
    calls: list[dict[str, Any]] = []
    checked: list[str] = []
    webhooks: list[WebhookOptions] = []
    registered: list[WebhookOptions] = []
    monkeypatch.setattr(kopf, "configure", lambda **_: None)
    monkeypatch.setattr(kopf, "run", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(operator_main, "check_liveness", checked.append)
    monkeypatch.setattr(operator_main, "check_webhook", webhooks.append)
    monkeypatch.setattr(
        operator_main, "register_webhook", lambda _, options: registered.append(options)
    )
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps(_KUBECONFIG))
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    assert operator_main.main(args) == 0
    (run,) = calls
    assert webhooks == registered
    assert len(registered) <= 1
    return OperatorRun(run, checked, next(iter(registered), None))


def test_the_operator_accepts_its_arguments(
    rendered: tuple[str, list[Manifest]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """kvpool-operator's own parser reads the rendered arguments; the probe hits --liveness;
    the webhook listens on the port its Service forwards to, with the certificate mounted."""
    name, manifests = rendered
    container = _operator_container(manifests)
    operator = _run_operator(container["args"], monkeypatch, tmp_path)
    run = operator.run
    assert operator.liveness_checked == [run["liveness_endpoint"]]
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
    webhook = operator.webhook
    if not values["webhook"]["enabled"]:
        assert webhook is None
        assert "webhook" not in {p["name"] for p in container["ports"]}
        assert not _webhook_services(manifests)
        return
    assert webhook is not None
    (service,) = _webhook_services(manifests)
    (service_port,) = service["spec"]["ports"]
    assert webhook.service == ServiceRef(
        service["metadata"]["namespace"], service["metadata"]["name"], service_port["port"]
    )
    (port,) = [p for p in container["ports"] if p["name"] == service_port["targetPort"]]
    assert webhook.port == port["containerPort"] == values["webhook"]["port"]
    assert webhook.bind == "0.0.0.0"
    assert webhook.configuration == DEFAULT_CONFIGURATION
    secret = values["webhook"]["certSecretName"]
    cert_dir = None if webhook.cert_dir is None else str(webhook.cert_dir)
    assert cert_dir == _mount_of_secret(manifests, secret)


def _webhook_services(manifests: list[Manifest]) -> list[Manifest]:
    return [
        service
        for service in by_kind(manifests, "Service")
        if service["metadata"]["name"].endswith("-webhook")
    ]


def _mount_of_secret(manifests: list[Manifest], secret: str) -> str | None:
    """Where the operator's container mounts the Secret ``secret`` (None: nowhere)."""
    pod = one(manifests, "Deployment")["spec"]["template"]["spec"]
    volumes = {v["name"] for v in pod["volumes"] if v.get("secret", {}).get("secretName") == secret}
    (container,) = pod["containers"]
    mounts = [m for m in container["volumeMounts"] if m["name"] in volumes]
    assert all(m.get("readOnly") for m in mounts), mounts
    return mounts[0]["mountPath"] if mounts else None


def test_the_webhook_service_reaches_the_operators_pod_only(helm: Helm) -> None:
    manifests = helm.template("webhook.yaml")
    (service,) = _webhook_services(manifests)
    assert service["metadata"]["namespace"] == NAMESPACE
    assert service["spec"]["ports"] == [
        {"name": "https", "port": 443, "targetPort": "webhook", "protocol": "TCP"}
    ]
    selector = service["spec"]["selector"].items()
    deployment = one(manifests, "Deployment")
    assert selector == deployment["spec"]["selector"]["matchLabels"].items()
    assert selector <= deployment["spec"]["template"]["metadata"]["labels"].items()
    for daemon_set in by_kind(manifests, "DaemonSet"):  # the CSI plugin's pods
        assert not selector <= daemon_set["spec"]["template"]["metadata"]["labels"].items()


def test_the_webhook_makes_its_own_certificate_unless_given_one(
    helm: Helm, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Without certSecretName: no Secret volume, no --webhook-cert-dir; the operator writes
    its CA and certificate under /tmp, the pod's writable emptyDir."""
    manifests = helm.template("webhook.yaml", sets=("webhook.certSecretName=",))
    container = _operator_container(manifests)
    assert "--webhook-cert-dir" not in container["args"]
    pod = one(manifests, "Deployment")["spec"]["template"]["spec"]
    assert not [volume for volume in pod["volumes"] if "secret" in volume]
    webhook = _run_operator(container["args"], monkeypatch, tmp_path).webhook
    assert webhook is not None and webhook.cert_dir is None
    (tmp,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == tmp["name"]]
    assert "emptyDir" in volume and not tmp.get("readOnly")


def _on_host(pod: dict[str, Any], path: Path) -> Path:
    """The host's path behind ``path`` of the pod's container (through a hostPath volume)."""
    (container,) = pod["containers"]
    for mount in container["volumeMounts"]:
        if path.is_relative_to(mount["mountPath"]):
            (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
            return Path(volume["hostPath"]["path"]) / path.relative_to(mount["mountPath"])
    raise AssertionError(f"{path} is on no volume of the pod")


@pytest.mark.parametrize("kubelet", ["/var/lib/kubelet", "/var/lib/k0s/kubelet"])
def test_the_csi_plugin_accepts_its_arguments_and_mounts_what_they_name(
    helm: Helm, kubelet: str
) -> None:
    """kvpool-csi's own parser reads the DaemonSet's arguments; every path they name is the
    host's path the kubelet expects, through the plugin's hostPath volumes."""
    manifests = helm.template("csi.yaml", sets=(f"csi.kubeletDir={kubelet}",))
    (daemon_set,) = by_kind(manifests, "DaemonSet")
    pod = daemon_set["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["kvpool-csi"]
    args = csi_main.parser().parse_args(container["args"])
    plugin_dir = Path(kubelet) / "plugins" / CSI_DRIVER
    assert _on_host(pod, args.endpoint) == args.kubelet_endpoint == plugin_dir / "csi.sock"
    assert args.registration_dir is not None
    assert _on_host(pod, args.registration_dir) == Path(kubelet) / "plugins_registry"
    # the kubelet's directory at the same path, so that the targets it names are there
    assert _on_host(pod, args.kubelet_dir) == args.kubelet_dir == Path(kubelet)
    (kubelet_mount,) = [
        m for m in container["volumeMounts"] if Path(m["mountPath"]) == args.kubelet_dir
    ]
    assert kubelet_mount["mountPropagation"] == "Bidirectional"
    assert _on_host(pod, args.shm_dir) == Path("/dev/shm")
    (node_name,) = [env for env in container["env"] if env["name"] == NODE_NAME_ENV]
    assert node_name["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}


def test_the_csi_driver_serves_inline_volumes_with_the_pods_identity(helm: Helm) -> None:
    manifests = helm.template("csi.yaml")
    driver = one(manifests, "CSIDriver")
    assert driver["metadata"]["name"] == CSI_DRIVER
    assert driver["spec"]["volumeLifecycleModes"] == ["Ephemeral"]
    assert driver["spec"]["podInfoOnMount"] is True  # the plugin admits by the pod's namespace
    assert driver["spec"]["attachRequired"] is False
    for name in ("defaults", "s3-nvme", "monitoring"):
        manifests = helm.template(*VALUE_SETS[name])
        assert not by_kind(manifests, "CSIDriver") and not by_kind(manifests, "DaemonSet")


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


def test_the_inference_pool_names_the_example_pools_picker(helm: Helm) -> None:
    """The InferencePool's endpoint picker is the index Service's picker port (HTTP/2)
    that the operator renders for the example pool, and its pods are the picker's."""
    manifests = helm.template("inference-gateway.yaml")
    pool, inference_pool = one(manifests, "KVCachePool"), one(manifests, "InferencePool")
    spec = PoolSpec.parse(with_defaults(schema(), pool)["spec"])
    children = render(Pool("main", "inference", "uid"), spec, default_image="kvpool:test")
    assert children.index is not None
    service = children.index.service
    assert inference_pool["metadata"] == {
        "name": "qwen3",
        "namespace": service["metadata"]["namespace"],
        "labels": inference_pool["metadata"]["labels"],
    }
    ref = inference_pool["spec"]["endpointPickerRef"]
    assert (ref["kind"], ref["name"], ref["failureMode"]) == (
        "Service",
        service["metadata"]["name"],
        "FailOpen",
    )
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    assert (port["port"], port["appProtocol"]) == (9002, "kubernetes.io/h2c")
    assert inference_pool["spec"]["selector"] == {"matchLabels": {"app": "vllm-qwen3"}}
    assert inference_pool["spec"]["targetPorts"] == [{"number": 8080}]
    assert not by_kind(helm.template("s3-nvme.yaml"), "InferencePool"), "only when asked"


def test_the_example_pool_disaggregates_behind_its_inference_pool(helm: Helm) -> None:
    """The operator renders the example pool's picker.pd with the key it mounts, and the
    webhook's decode sidecar listens on the port the InferencePool targets, forwarding to
    the pod's vLLM on vllmPort, in the image the chart gives the operator."""
    manifests = helm.template("prefill-decode.yaml")
    pool, inference_pool = one(manifests, "KVCachePool"), one(manifests, "InferencePool")
    spec = PoolSpec.parse(with_defaults(schema(), pool)["spec"])
    identity = Pool("main", "inference", "uid")
    image = _operator_container(manifests)["image"]
    children = render(identity, spec, default_image=image)
    assert children.index is not None
    config = yaml.safe_load(children.index.config["data"]["index.yaml"])
    assert config["picker"]["pd"] == {
        "enabled": True,
        "threshold_tokens": 1024,
        "max_prefill_waiting": 4,
        "key_file": "/etc/kvpool/pd-key/key",
        "header_ttl_seconds": 30,
        "llmd_header": False,
    }
    volumes = children.index.deployment["spec"]["template"]["spec"]["volumes"]
    assert {"secretName": identity.pd_key_name, "defaultMode": 0o444} in [
        volume.get("secret") for volume in volumes
    ]
    sidecar = DecodeSidecar.of(identity, spec, image)
    assert sidecar is not None
    container = sidecar.container()
    (target,) = inference_pool["spec"]["targetPorts"]
    assert f"--port={target['number']}" in container["args"]
    assert "--vllm=http://127.0.0.1:8200" in container["args"]
    assert "--decode-wait-ms=3000" in container["args"]
    assert container["image"] == image
    assert DecodeSidecar.of(identity, PoolSpec.parse({}), image) is None  # off by default


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
    assert transfer["kv_connector"] in kvpool.connector.__all__
    assert transfer["kv_connector_module_path"] == kvpool.connector.__name__
    settings = ConnectorSettings.load(transfer["kv_connector_extra_config"], environ={})
    assert (settings.pool, settings.namespace) == ("gpu", "inference")
    assert "kvpool tenant-id" in notes
    assert "/v1/tenants/$TENANT_ID/quota" in notes
    assert "kvpool-gpu-quotas" in notes
    assert "create secret generic kvpool-gpu-tokens" in notes  # the pool's tokensSecretRef
    assert f"-n {NAMESPACE} rollout status deployment/kvpool-operator" in notes
    assert "hostPath" in notes and "create role" in notes
    assert "kvpool.io/cache-pool" not in notes

    # with the webhook: the label and the connector's name, nothing else of kvpool
    notes = helm.notes("webhook.yaml")
    quoted = re.search(r"--kv-transfer-config '([^']*)'", notes)
    assert quoted is not None, notes
    transfer = json.loads(" ".join(quoted[1].split()))
    assert transfer["kv_connector"] in kvpool.connector.__all__
    settings = ConnectorSettings.load(transfer["kv_connector_extra_config"], environ={})
    assert (settings.pool, settings.namespace) == ("main", NAMESPACE)
    assert f"labels: {{{CACHE_POOL_LABEL}: main}}" in notes
    for absent in ("hostPath", "/dev/shm", "create role", "KVPOOL_CONNECTOR_TOKEN"):
        assert absent not in notes, absent
    assert "kvpool tenant-id" in notes


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


def test_the_example_pools_schema_is_the_crds() -> None:
    """``examplePool.spec`` is checked against the KVCachePool spec's schema (generated:
    ``python -m kvpool.operator.crds``), as JSON Schema: what it refuses, helm refuses."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    spec = schema["properties"]["examplePool"]["properties"]["spec"]
    assert (
        spec["properties"].keys()
        == openapi_schema(KVCachePool)["properties"]["spec"]["properties"].keys()
    )
    check = jsonschema.Draft7Validator(spec)
    assert not list(
        check.iter_errors(
            yaml.safe_load((VALUES / "s3-nvme.yaml").read_text())["examplePool"]["spec"]
        )
    )
    refused = {
        "an unknown field": {"l1": {"sise": "64Gi"}},
        "a size that is no quantity": {"l1": {"size": "1GB"}},
        "a bound the CRD makes exclusive": {"l1": {"leaseSeconds": 0}},
        "a list where a number is": {"chunkTokens": [256]},
    }
    for what, value in refused.items():
        assert list(check.iter_errors(value)), what


def test_json_schema_says_what_a_structural_schema_does() -> None:
    structural = {
        "type": "object",
        "x-kubernetes-validations": [{"rule": "self.a > 0"}],
        "properties": {
            "a": {"type": "number", "minimum": 0, "exclusiveMinimum": True},
            "b": {"x-kubernetes-int-or-string": True, "pattern": "^[0-9]+Gi$"},
            "c": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
            "d": {"type": "array", "x-kubernetes-list-type": "set", "items": {"type": "string"}},
        },
    }
    assert crds.json_schema(structural) == {
        "type": "object",
        "properties": {
            "a": {"type": "number", "exclusiveMinimum": 0},
            "b": {"type": ["integer", "string"], "pattern": "^[0-9]+Gi$"},
            "c": {"type": "object", "additionalProperties": True},
            "d": {"type": "array", "items": {"type": "string"}},
        },
        "additionalProperties": False,
    }
