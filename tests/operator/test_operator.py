"""The operator for real: ``kvpool-operator`` (kopf) in a subprocess, against the emulated
API server of ``kube_api.py``, driven with kubectl the way a person would drive it.

The tests share one operator and one API server (``conftest.py``); each works in a namespace
of its own.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpool.common.tenants_configmap import digest_token, parse_tenants
from tests.support.kube_api import ServedApi
from tests.support.operator_process import REPO, Kubectl, OperatorProcess
from tests.support.polling import eventually

pytestmark = pytest.mark.process

NAMESPACE = "inference"
CHILDREN = [
    ("configmaps", "kvpool-{}-config"),
    ("configmaps", "kvpool-{}-quotas"),
    ("configmaps", "kvpool-{}-tenants"),
    ("daemonsets", "kvpool-{}-agent"),
    ("services", "kvpool-{}"),
    ("serviceaccounts", "kvpool-{}-agent"),
    ("roles", "kvpool-{}-agent"),
    ("rolebindings", "kvpool-{}-agent"),
]
INDEX_CHILDREN = [
    ("configmaps", "kvpool-{}-index-config"),
    ("serviceaccounts", "kvpool-{}-index"),
    ("roles", "kvpool-{}-index"),
    ("rolebindings", "kvpool-{}-index"),
    ("services", "kvpool-{}-index"),
    ("deployments", "kvpool-{}-index"),
]
POLICIES = [
    ("networkpolicies", "kvpool-{}-agent"),
    ("networkpolicies", "kvpool-{}-index"),
]
KINDS = {
    "configmaps": "ConfigMap",
    "daemonsets": "DaemonSet",
    "deployments": "Deployment",
    "networkpolicies": "NetworkPolicy",
    "rolebindings": "RoleBinding",
    "roles": "Role",
    "serviceaccounts": "ServiceAccount",
    "services": "Service",
}
CHILD_HANDLED = "Handler 'child_changed' succeeded."
"""What kopf logs once the operator handled an event of a child (its deletion, say)."""
CREATED = "Creation is processed: 1 succeeded; 0 failed."
"""kopf's word that it handled a pool's creation."""
LAST_HANDLED = "kvpool.io/last-handled-configuration"
"""kopf's annotation of what it handled last, the last write of its handling."""
TOKENS = {"tenants": {"tokensSecretRef": {"name": "kvpool-tokens"}}}
SERVICE_MONITOR_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "servicemonitors.monitoring.coreos.com"},
    "spec": {
        "group": "monitoring.coreos.com",
        "scope": "Namespaced",
        "names": {
            "kind": "ServiceMonitor",
            "plural": "servicemonitors",
            "singular": "servicemonitor",
        },
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "x-kubernetes-preserve-unknown-fields": True,
                    }
                },
            }
        ],
    },
}


def test_the_picker_follows_the_pool(
    served_api: ServedApi, kubectl: Kubectl, operator: OperatorProcess
) -> None:
    """spec.index.picker: the operator serves the picker's port on the index Service and
    reports it in status.index.pickerPort; a picker without a selector (which the CRD's
    rule refuses; the emulator has none) is reported invalid and not applied."""
    picker = {"enabled": True, "selector": {"app": "vllm"}}
    fingerprint = {"model": "m", "dtype": "bfloat16", "kvLayout": "nhd"}
    index = {"enabled": True, "fingerprint": fingerprint, "picker": picker}
    _create(kubectl, served_api, "picked", {**TOKENS, "index": index})
    eventually(lambda: _applied(served_api, "picked"))

    def service_ports() -> dict[str, dict[str, Any]]:
        service = _get(served_api, "services", "kvpool-picked-index")
        assert service is not None
        return {port["name"]: port for port in service["spec"]["ports"]}

    assert service_ports()["grpc-picker"]["appProtocol"] == "kubernetes.io/h2c"
    assert _status(served_api, "picked")["index"]["pickerPort"] == 7405
    config = _get(served_api, "configmaps", "kvpool-picked-index-config")
    assert config is not None
    assert yaml.safe_load(config["data"]["index.yaml"])["picker"]["selector"] == {"app": "vllm"}

    _patch_pool(kubectl, "picked", {"spec": {"index": {"picker": {"selector": None}}}})
    eventually(lambda: _applied(served_api, "picked", generation=2))
    degraded = _condition(served_api, "picked", "Degraded")
    assert degraded[:2] == ("True", "InvalidSpec")
    assert "spec.index.picker.enabled needs spec.index.picker.selector" in degraded[2]
    assert "grpc-picker" in service_ports()  # what was applied stays

    _patch_pool(kubectl, "picked", {"spec": {"index": {"picker": {"enabled": False}}}})
    eventually(lambda: _applied(served_api, "picked", generation=3))
    assert list(service_ports()) == ["http"]
    assert "pickerPort" not in _status(served_api, "picked")["index"]


@pytest.fixture(autouse=True)
def _own_namespace(
    namespaces: Callable[[str], str], kubectl: Kubectl, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each test works in a namespace of its own: NAMESPACE (read by the helpers below) names
    it while the test runs."""
    name = namespaces("inference")
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
    kubectl("apply", "--validate=false", "-f", "-", manifest=namespace)
    monkeypatch.setitem(globals(), "NAMESPACE", name)


def _get(api: ServedApi, plural: str, name: str) -> dict[str, Any] | None:
    return api.objects(plural, NAMESPACE).get(name)


def _create(kubectl: Kubectl, api: ServedApi, name: str, spec: dict[str, Any]) -> str:
    pool = {
        "apiVersion": "kvpool.io/v1alpha1",
        "kind": "KVCachePool",
        "metadata": {"name": name},
        "spec": spec,
    }
    kubectl("apply", "--validate=false", "-n", NAMESPACE, "-f", "-", manifest=pool)
    created = _get(api, "kvcachepools", name)
    assert created is not None
    uid: str = created["metadata"]["uid"]
    return uid


def _patch_pool(kubectl: Kubectl, name: str, patch: dict[str, Any]) -> None:
    kubectl("patch", "kvp", name, "-n", NAMESPACE, "--type=merge", "-p", json.dumps(patch))


def _status(api: ServedApi, name: str) -> dict[str, Any]:
    pool = _get(api, "kvcachepools", name)
    assert pool is not None
    status: dict[str, Any] = pool.get("status") or {}
    return status


def _condition(api: ServedApi, name: str, kind: str) -> tuple[str, str, str]:
    for condition in _status(api, name).get("conditions", ()):
        if condition["type"] == kind:
            return condition["status"], condition["reason"], condition["message"]
    raise AssertionError(f"{name} has no {kind} condition yet")


def _applied(api: ServedApi, name: str, generation: int = 1) -> None:
    """The operator has applied this generation of the pool."""
    assert _status(api, name).get("observedGeneration") == generation


def _events(api: ServedApi, name: str) -> list[tuple[str, str, str]]:
    return [(e["type"], e["reason"], e["message"]) for e in api.events(NAMESPACE, name)]


def _event(api: ServedApi, name: str, kind: str, reason: str, text: str = "") -> str:
    """The message of an event on pool ``name``, once kopf has posted it (in the background)."""

    def posted() -> str:
        for event in _events(api, name):
            if event[:2] == (kind, reason) and text in event[2]:
                return event[2]
        raise AssertionError(f"no {kind} {reason} event with {text!r}: {_events(api, name)}")

    return eventually(posted)


def _deletions_handled(
    operator: OperatorProcess, pool: str, children: list[tuple[str, str]], since: int
) -> None:
    """The operator handled an event of each of the pool's ``children`` that came after the
    first ``since`` records of its log: their deletion, the last event a deleted child has.
    Whatever the operator does about a deletion is done then: what is still gone stays so."""
    waiting = [
        f"{plural}/{name.format(pool)}"
        for plural, name in children
        if not operator.handled(CHILD_HANDLED, KINDS[plural], name.format(pool), since, NAMESPACE)
    ]
    assert not waiting, f"no deletion handled yet of {waiting}"


def _children_of(
    api: ServedApi, pool: str, children: list[tuple[str, str]] = CHILDREN
) -> dict[str, dict[str, Any] | None]:
    return {
        f"{plural}/{name.format(pool)}": _get(api, plural, name.format(pool))
        for plural, name in children
    }


def _owned(api: ServedApi, pool: str, uid: str, children: list[tuple[str, str]]) -> None:
    """Every one of ``children`` exists and is owned by the pool."""
    for where, child in _children_of(api, pool, children).items():
        assert child is not None, f"no {where}"
        (owner,) = child["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["uid"]) == ("KVCachePool", pool, uid)
        assert owner["controller"] is True


def test_a_pool_gets_its_children_and_a_status(
    served_api: ServedApi, kubectl: Kubectl, operator: OperatorProcess
) -> None:
    kubectl("apply", "--validate=false", "-n", NAMESPACE, "-f", str(REPO / "crds/examples"))
    uid = served_api.objects("kvcachepools", NAMESPACE)["main"]["metadata"]["uid"]

    eventually(lambda: _owned(served_api, "main", uid, CHILDREN))
    children = _children_of(served_api, "main")
    eventually(lambda: _applied(served_api, "main"))
    assert _condition(served_api, "main", "Ready")[:2] == ("False", "Pending")
    assert _condition(served_api, "main", "Progressing")[:2] == ("True", "RollingOut")
    assert _condition(served_api, "main", "Degraded")[:2] == ("False", "AsExpected")
    config = children["configmaps/kvpool-main-config"]
    daemonset = children["daemonsets/kvpool-main-agent"]
    assert config is not None and daemonset is not None
    checksum = hashlib.sha256(config["data"]["agent.yaml"].encode()).hexdigest()
    template = daemonset["spec"]["template"]
    assert template["metadata"]["annotations"]["kvpool.io/config-checksum"] == checksum
    assert template["spec"]["containers"][0]["image"] == "kvpool:test"
    applied = _event(served_api, "main", "Normal", "Applied")
    assert "created DaemonSet kvpool-main-agent" in applied
    assert "created Service kvpool-main" in applied
    # The other example (gpu-nodes) asks for a ServiceMonitor, which this cluster lacks.
    eventually(lambda: _applied(served_api, "gpu"))
    _event(served_api, "gpu", "Warning", "ServiceMonitorUnavailable")


def test_the_status_follows_the_daemonset(
    served_api: ServedApi, kubectl: Kubectl, operator: OperatorProcess
) -> None:
    _create(kubectl, served_api, "rollout", {})
    eventually(lambda: _applied(served_api, "rollout"))
    daemonset = _get(served_api, "daemonsets", "kvpool-rollout-agent")
    assert daemonset is not None

    def report(ready: int) -> None:  # what the DaemonSet controller would write
        status = {
            "observedGeneration": daemonset["metadata"]["generation"],
            "desiredNumberScheduled": 3,
            "currentNumberScheduled": 3,
            "updatedNumberScheduled": 3,
            "numberReady": ready,
            "numberMisscheduled": 0,
        }
        kubectl(
            "patch",
            "daemonset",
            "kvpool-rollout-agent",
            "-n",
            NAMESPACE,
            "--subresource=status",
            "--type=merge",
            "-p",
            json.dumps({"status": status}),
        )

    report(ready=2)

    def two_of_three() -> None:
        status = _status(served_api, "rollout")
        assert (status.get("readyNodes"), status.get("desiredNodes")) == (2, 3)
        assert _condition(served_api, "rollout", "Ready") == (
            "False",
            "AgentsNotReady",
            "2 of 3 agents ready",
        )

    eventually(two_of_three)
    report(ready=3)

    def all_ready() -> None:
        ready = _condition(served_api, "rollout", "Ready")
        assert ready == ("True", "AgentsReady", "3 of 3 agents ready")

    eventually(all_ready)
    assert _condition(served_api, "rollout", "Progressing")[:2] == ("False", "RolloutComplete")


def test_drift_is_corrected(
    served_api: ServedApi, kubectl: Kubectl, operator: OperatorProcess
) -> None:
    _create(kubectl, served_api, "drift", {})
    eventually(lambda: _applied(served_api, "drift"))
    service = _get(served_api, "services", "kvpool-drift")
    config = _get(served_api, "configmaps", "kvpool-drift-config")
    assert service is not None and config is not None

    kubectl("delete", "service", "kvpool-drift", "-n", NAMESPACE)

    def service_back() -> None:
        again = _get(served_api, "services", "kvpool-drift")
        assert again is not None and again["metadata"]["uid"] != service["metadata"]["uid"]
        assert again["metadata"]["annotations"] == service["metadata"]["annotations"]

    eventually(service_back)

    kubectl("label", "configmap", "kvpool-drift-config", "-n", NAMESPACE, "team=cache")
    hacked = {"data": {"agent.yaml": "pool: drift\nl1_size: 1\n"}}
    kubectl("patch", "configmap", "kvpool-drift-config", "-n", NAMESPACE, "-p", json.dumps(hacked))

    def config_back() -> None:
        again = _get(served_api, "configmaps", "kvpool-drift-config")
        assert again is not None and again["data"] == config["data"]
        assert again["metadata"]["labels"]["team"] == "cache"  # someone else's field stays

    eventually(config_back)

    evil = {"spec": {"template": {"spec": {"containers": [{"name": "agent", "image": "evil"}]}}}}
    kubectl(
        "patch",
        "daemonset",
        "kvpool-drift-agent",
        "-n",
        NAMESPACE,
        "--type=merge",
        "-p",
        json.dumps(evil),
    )

    def daemonset_back() -> None:
        again = _get(served_api, "daemonsets", "kvpool-drift-agent")
        assert again is not None
        (container,) = again["spec"]["template"]["spec"]["containers"]
        assert (container["image"], container.get("command")) == ("kvpool:test", ["kvpool-agent"])

    eventually(daemonset_back)

    for message in (
        "restored Service kvpool-drift, deleted outside the operator",
        "restored ConfigMap kvpool-drift-config, changed outside the operator",
        "restored DaemonSet kvpool-drift-agent, changed outside the operator",
    ):
        _event(served_api, "drift", "Normal", "DriftCorrected", message)


def test_a_spec_change_rolls_the_agents(
    served_api: ServedApi, kubectl: Kubectl, operator: OperatorProcess
) -> None:
    _create(kubectl, served_api, "update", {"agent": {"nodeSelector": {"gpu": "yes", "zone": "a"}}})
    eventually(lambda: _applied(served_api, "update"))
    before = _get(served_api, "daemonsets", "kvpool-update-agent")
    assert before is not None

    _patch_pool(
        kubectl,
        "update",
        {"spec": {"l1": {"size": "2Gi"}, "agent": {"nodeSelector": {"zone": None}}}},
    )
    eventually(lambda: _applied(served_api, "update", generation=2))
    after = _get(served_api, "daemonsets", "kvpool-update-agent")
    config = _get(served_api, "configmaps", "kvpool-update-config")
    assert after is not None and config is not None
    assert yaml.safe_load(config["data"]["agent.yaml"])["l1_size"] == 2 << 30
    old_pod, new_pod = before["spec"]["template"], after["spec"]["template"]
    key = "kvpool.io/config-checksum"
    assert new_pod["metadata"]["annotations"][key] != old_pod["metadata"]["annotations"][key]
    assert after["metadata"]["generation"] > before["metadata"]["generation"]
    assert new_pod["spec"]["nodeSelector"] == {"gpu": "yes"}  # the removed key is gone
    memory = new_pod["spec"]["containers"][0]["resources"]["requests"]["memory"]
    assert memory != old_pod["spec"]["containers"][0]["resources"]["requests"]["memory"]
    updates = "updated ConfigMap kvpool-update-config; updated DaemonSet kvpool-update-agent"
    _event(served_api, "update", "Normal", "Applied", updates)


def test_an_invalid_spec_is_reported_and_not_applied(
    served_api: ServedApi, kubectl: Kubectl, operator: OperatorProcess
) -> None:
    # The emulator has no CEL rules; a real API server would refuse this pool already.
    _create(kubectl, served_api, "tiny", {"l1": {"size": "512Ki"}})
    eventually(lambda: _applied(served_api, "tiny"))
    degraded = _condition(served_api, "tiny", "Degraded")
    assert degraded[:2] == ("True", "InvalidSpec")
    assert "l1_size must hold at least 16 pages" in degraded[2]
    assert _condition(served_api, "tiny", "Ready")[:2] == ("False", "InvalidSpec")
    assert _event(served_api, "tiny", "Warning", "InvalidSpec") == degraded[2]
    assert _get(served_api, "daemonsets", "kvpool-tiny-agent") is None

    _patch_pool(kubectl, "tiny", {"spec": {"l1": {"size": "1Gi"}}})
    eventually(lambda: _applied(served_api, "tiny", generation=2))
    assert _condition(served_api, "tiny", "Degraded")[:2] == ("False", "AsExpected")
    assert _get(served_api, "daemonsets", "kvpool-tiny-agent") is not None


def test_an_s3_tier_needs_the_pools_l2_key_secret(
    served_api: ServedApi, kubectl: Kubectl, operator: OperatorProcess
) -> None:
    """Refused without the key Secret (as the CRD's rule would); with it, the agents mount
    it and are told where."""
    s3 = {"tiers": [{"type": "s3", "s3": {"bucket": "kv-cache"}}]}
    _create(kubectl, served_api, "sealed", {"l2": s3})
    eventually(lambda: _applied(served_api, "sealed"))
    degraded = _condition(served_api, "sealed", "Degraded")
    assert degraded[:2] == ("True", "InvalidSpec")
    assert "an s3 tier needs spec.l2.encryption.keySecretRef" in degraded[2]
    assert _get(served_api, "daemonsets", "kvpool-sealed-agent") is None

    key = {"encryption": {"keySecretRef": {"name": "kvpool-sealed-l2-key"}}}
    _patch_pool(kubectl, "sealed", {"spec": {"l2": key}})
    eventually(lambda: _applied(served_api, "sealed", generation=2))
    assert _condition(served_api, "sealed", "Degraded")[:2] == ("False", "AsExpected")
    daemonset = _get(served_api, "daemonsets", "kvpool-sealed-agent")
    config = _get(served_api, "configmaps", "kvpool-sealed-config")
    assert daemonset is not None and config is not None
    pod = daemonset["spec"]["template"]["spec"]
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    assert volumes["l2-keys"]["secret"]["secretName"] == "kvpool-sealed-l2-key"
    mounts = {mount["name"]: mount for mount in pod["containers"][0]["volumeMounts"]}
    key_dir = yaml.safe_load(config["data"]["agent.yaml"])["l2_key_dir"]
    assert mounts["l2-keys"]["mountPath"] == key_dir


def test_a_refused_child_is_reported_and_retried(
    served_api: ServedApi, kubectl: Kubectl, operator: OperatorProcess
) -> None:
    refusal = "admission webhook denied the DaemonSet"
    with served_api.refuse("PATCH", "daemonsets", 422, refusal):
        _create(kubectl, served_api, "refused", {})
        degraded = eventually(lambda: _condition(served_api, "refused", "Degraded"))
        assert degraded[:2] == ("True", "ApplyFailed")
        assert refusal in degraded[2]
        assert "observedGeneration" not in _status(served_api, "refused")
        _event(served_api, "refused", "Warning", "ApplyFailed", refusal)
    eventually(lambda: _applied(served_api, "refused"))  # retried after the refusal ends
    assert _condition(served_api, "refused", "Degraded")[:2] == ("False", "AsExpected")
    assert _get(served_api, "daemonsets", "kvpool-refused-agent") is not None


def test_a_service_monitor_where_the_cluster_has_them(
    served_api: ServedApi, kubectl: Kubectl, operator: OperatorProcess
) -> None:
    _create(kubectl, served_api, "monitored", {"metrics": {"serviceMonitor": {"enabled": True}}})
    eventually(lambda: _applied(served_api, "monitored"))
    _event(served_api, "monitored", "Warning", "ServiceMonitorUnavailable")
    assert served_api.objects("servicemonitors", NAMESPACE) == {}

    kubectl("apply", "--validate=false", "-f", "-", manifest=SERVICE_MONITOR_CRD)
    try:
        _patch_pool(
            kubectl, "monitored", {"spec": {"metrics": {"serviceMonitor": {"interval": "10s"}}}}
        )

        def monitor_made() -> dict[str, Any]:
            monitor = _get(served_api, "servicemonitors", "kvpool-monitored")
            assert monitor is not None
            return monitor

        monitor = eventually(monitor_made)
        endpoints = [{"port": "http", "path": "/metrics", "interval": "10s"}]
        assert monitor["spec"]["endpoints"] == endpoints
        assert monitor["metadata"]["ownerReferences"][0]["name"] == "monitored"

        off = {"spec": {"metrics": {"serviceMonitor": {"enabled": False}}}}
        _patch_pool(kubectl, "monitored", off)
        deleted = "deleted ServiceMonitor kvpool-monitored"
        _event(served_api, "monitored", "Normal", "Applied", deleted)
        assert _get(served_api, "servicemonitors", "kvpool-monitored") is None
    finally:  # the cluster (every test's) has no ServiceMonitors again
        kubectl("delete", "crd", SERVICE_MONITOR_CRD["metadata"]["name"])


def test_the_index_follows_the_pool(
    served_api: ServedApi, kubectl: Kubectl, operator: OperatorProcess
) -> None:
    uid = _create(kubectl, served_api, "routed", {**TOKENS, "index": {"enabled": True}})
    eventually(lambda: _owned(served_api, "routed", uid, INDEX_CHILDREN))
    eventually(lambda: _applied(served_api, "routed"))
    config = _get(served_api, "configmaps", "kvpool-routed-index-config")
    deployment = _get(served_api, "deployments", "kvpool-routed-index")
    assert config is not None and deployment is not None
    assert yaml.safe_load(config["data"]["index.yaml"])["discovery"] == "kubernetes"
    template = deployment["spec"]["template"]
    checksum = hashlib.sha256(config["data"]["index.yaml"].encode()).hexdigest()
    assert template["metadata"]["annotations"]["kvpool.io/config-checksum"] == checksum
    assert template["metadata"]["labels"]["app.kubernetes.io/component"] == "index"
    assert template["spec"]["containers"][0]["command"] == ["kvpool-index"]
    assert _status(served_api, "routed")["index"] == {"replicas": 1, "readyReplicas": 0}
    _event(served_api, "routed", "Normal", "Applied", "created Deployment kvpool-routed-index")
    # the index's token for the agents: minted into the Secret its pods mount, owned by the
    # pool; the agents learn its digest, as an index's, from the tenants ConfigMap
    token = eventually(lambda: _index_access(served_api, "routed", uid))
    assert eventually(lambda: _granted_index(served_api, "routed")) == (digest_token(token),)

    # drift: a deleted index Deployment comes back
    kubectl("delete", "deployment", "kvpool-routed-index", "-n", NAMESPACE)

    def deployment_back() -> dict[str, Any]:
        again = _get(served_api, "deployments", "kvpool-routed-index")
        assert again is not None and again["metadata"]["uid"] != deployment["metadata"]["uid"]
        assert again["spec"]["template"] == template
        return again

    restored = eventually(deployment_back)
    message = "restored Deployment kvpool-routed-index, deleted outside the operator"
    _event(served_api, "routed", "Normal", "DriftCorrected", message)

    # status.index follows what the Deployment controller reports
    report = {
        "observedGeneration": restored["metadata"]["generation"],
        "replicas": 1,
        "updatedReplicas": 1,
        "readyReplicas": 1,
        "availableReplicas": 1,
    }
    kubectl(
        "patch",
        "deployment",
        "kvpool-routed-index",
        "-n",
        NAMESPACE,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": report}),
    )

    def index_ready() -> None:
        assert _status(served_api, "routed")["index"] == {"replicas": 1, "readyReplicas": 1}

    eventually(index_ready)
    _patch_pool(kubectl, "routed", {"spec": {"index": {"replicas": 2}}})
    eventually(lambda: _applied(served_api, "routed", generation=2))
    scaled = _get(served_api, "deployments", "kvpool-routed-index")
    assert scaled is not None and scaled["spec"]["replicas"] == 2
    assert _status(served_api, "routed")["index"] == {"replicas": 2, "readyReplicas": 1}

    # turned off: every index child goes, the agents' stay, status.index goes
    since = len(operator.records())
    _patch_pool(kubectl, "routed", {"spec": {"index": {"enabled": False}}})
    eventually(lambda: _applied(served_api, "routed", generation=3))

    def index_gone() -> None:
        children = _children_of(served_api, "routed", INDEX_CHILDREN)
        assert [where for where, child in children.items() if child] == []

    eventually(index_gone)
    assert eventually(lambda: _granted_index(served_api, "routed", present=False)) == ()
    assert "index" not in _status(served_api, "routed")
    assert all(_children_of(served_api, "routed").values())
    deleted = _event(served_api, "routed", "Normal", "Applied", "deleted Deployment")
    assert "deleted ConfigMap kvpool-routed-index-config" in deleted
    eventually(lambda: _deletions_handled(operator, "routed", INDEX_CHILDREN, since))
    index_gone()  # and the operator did not bring them back


def _index_access(api: ServedApi, pool: str, uid: str) -> str:
    secret = _get(api, "secrets", f"kvpool-{pool}-index-access")
    assert secret is not None
    assert secret["metadata"]["ownerReferences"][0]["uid"] == uid
    return base64.b64decode(secret["data"]["token"]).decode()


def _granted_index(api: ServedApi, pool: str, *, present: bool = True) -> tuple[bytes, ...]:
    """The index tokens the pool's tenants ConfigMap grants (the agents' reading of it)."""
    config_map = _get(api, "configmaps", f"kvpool-{pool}-tenants")
    assert config_map is not None
    data = config_map.get("data") or {}
    assert ("index" in data) == present, data
    return parse_tenants(data, "test").index_tokens


def _policies(api: ServedApi, pool: str, *names: str) -> None:
    """The NetworkPolicies of ``pool`` are exactly those named ``names``."""
    found = {
        name
        for name, policy in api.objects("networkpolicies", NAMESPACE).items()
        if policy["metadata"]["labels"].get("kvpool.io/pool") == pool
    }
    assert found == set(names)


def _client_peers(api: ServedApi) -> list[dict[str, Any]]:
    """The peers of the first ingress rule of the agents' NetworkPolicy (the clients')."""
    policy = _get(api, "networkpolicies", "kvpool-guarded-agent")
    assert policy is not None
    peers: list[dict[str, Any]] = policy["spec"]["ingress"][0]["from"]
    return peers


def test_network_policies_follow_the_pool(
    served_api: ServedApi, kubectl: Kubectl, operator: OperatorProcess
) -> None:
    uid = _create(kubectl, served_api, "guarded", {**TOKENS, "index": {"enabled": True}})
    eventually(lambda: _applied(served_api, "guarded"))
    _policies(served_api, "guarded")  # none: off by default

    clients = [{"podSelector": {"matchLabels": {"kvpool.io/client": "guarded"}}}]
    gateways = [{"podSelector": {"matchLabels": {"kvpool.io/gateway": "guarded"}}}]
    policy = {"enabled": True, "clients": clients, "gateways": gateways}
    _patch_pool(kubectl, "guarded", {"spec": {"networkPolicy": policy}})
    eventually(lambda: _applied(served_api, "guarded", generation=2))
    eventually(lambda: _owned(served_api, "guarded", uid, POLICIES))
    assert _client_peers(served_api) == clients
    applied = _event(served_api, "guarded", "Normal", "Applied", "NetworkPolicy")
    assert "created NetworkPolicy kvpool-guarded-agent" in applied
    assert "created NetworkPolicy kvpool-guarded-index" in applied

    # update: other clients
    team = [{"namespaceSelector": {"matchLabels": {"team": "a"}}, "podSelector": {}}]
    _patch_pool(kubectl, "guarded", {"spec": {"networkPolicy": {"clients": team}}})
    eventually(lambda: _applied(served_api, "guarded", generation=3))
    assert _client_peers(served_api) == team
    updated = "updated NetworkPolicy kvpool-guarded-agent"
    _event(served_api, "guarded", "Normal", "Applied", updated)

    # drift: a deleted policy comes back
    before = _get(served_api, "networkpolicies", "kvpool-guarded-agent")
    assert before is not None
    kubectl("delete", "networkpolicy", "kvpool-guarded-agent", "-n", NAMESPACE)

    def policy_back() -> None:
        again = _get(served_api, "networkpolicies", "kvpool-guarded-agent")
        assert again is not None and again["metadata"]["uid"] != before["metadata"]["uid"]
        assert again["spec"] == before["spec"]

    eventually(policy_back)
    restored = "restored NetworkPolicy kvpool-guarded-agent, deleted outside the operator"
    _event(served_api, "guarded", "Normal", "DriftCorrected", restored)

    # the index turned off: its policy goes, and the agents no longer admit index pods (only
    # their clients, and each other on the peer port)
    _patch_pool(kubectl, "guarded", {"spec": {"index": {"enabled": False}}})
    eventually(lambda: _applied(served_api, "guarded", generation=4))
    eventually(lambda: _policies(served_api, "guarded", "kvpool-guarded-agent"))
    agents = _get(served_api, "networkpolicies", "kvpool-guarded-agent")
    assert agents is not None
    peers = [{"podSelector": agents["spec"]["podSelector"]}]
    assert [rule["from"] for rule in agents["spec"]["ingress"]] == [team, peers]

    # turned off: the agents' policy goes too, for good
    since = len(operator.records())
    _patch_pool(kubectl, "guarded", {"spec": {"networkPolicy": {"enabled": False}}})
    eventually(lambda: _applied(served_api, "guarded", generation=5))
    deleted = "deleted NetworkPolicy kvpool-guarded-agent"
    _event(served_api, "guarded", "Normal", "Applied", deleted)
    _policies(served_api, "guarded")
    eventually(lambda: _deletions_handled(operator, "guarded", POLICIES[:1], since))
    _policies(served_api, "guarded")  # and the operator did not bring it back

    # on again, then the pool deleted: the garbage collector takes the policy with it
    _patch_pool(kubectl, "guarded", {"spec": {"networkPolicy": {"enabled": True}}})
    eventually(lambda: _applied(served_api, "guarded", generation=6))
    _policies(served_api, "guarded", "kvpool-guarded-agent")
    kubectl("delete", "kvp", "guarded", "-n", NAMESPACE)
    eventually(lambda: _policies(served_api, "guarded"))


def test_an_index_child_the_pool_does_not_own_stays(
    served_api: ServedApi, kubectl: Kubectl, operator: OperatorProcess
) -> None:
    theirs = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "kvpool-plain-index-config", "namespace": NAMESPACE},
        "data": {"index.yaml": "someone else's"},
    }
    kubectl("apply", "--validate=false", "-f", "-", manifest=theirs)
    _create(kubectl, served_api, "plain", {})
    eventually(lambda: _applied(served_api, "plain"))
    kept = _get(served_api, "configmaps", "kvpool-plain-index-config")
    assert kept is not None and kept["data"] == theirs["data"]


def test_deleting_a_pool_deletes_its_children(
    served_api: ServedApi, kubectl: Kubectl, operator: OperatorProcess
) -> None:
    _create(kubectl, served_api, "doomed", {})
    eventually(lambda: _applied(served_api, "doomed"))
    assert all(_children_of(served_api, "doomed").values())

    since = len(operator.records())
    kubectl("delete", "kvp", "doomed", "-n", NAMESPACE)

    def all_gone() -> None:
        assert [where for where, c in _children_of(served_api, "doomed").items() if c] == []

    eventually(all_gone)
    eventually(lambda: _deletions_handled(operator, "doomed", CHILDREN, since))
    all_gone()  # and the operator did not bring them back


def test_logs_are_structured(
    served_api: ServedApi, kubectl: Kubectl, operator: OperatorProcess
) -> None:
    """Every line of the operator's start, and every one it wrote while this test ran."""
    start = operator.log_size()
    _create(kubectl, served_api, "logged", {})
    eventually(lambda: _applied(served_api, "logged"))
    own = operator.log(start)
    lines = operator.log(*operator.startup) + own[: own.rfind("\n") + 1]
    records = [json.loads(line) for line in lines.splitlines() if line.strip()]
    assert all({"message", "severity", "timestamp"} <= record.keys() for record in records)
    about = [
        r["object"]
        for r in records
        if r.get("object", {}).get("name") == "logged" and r["object"].get("namespace") == NAMESPACE
    ]
    assert about and about[0]["kind"] == "KVCachePool"


def test_a_restarted_operator_catches_up(
    served_api: ServedApi, kubectl: Kubectl, operator: OperatorProcess
) -> None:
    since = len(operator.records())
    _create(kubectl, served_api, "resumed", {})
    eventually(lambda: _applied(served_api, "resumed"))

    def idle() -> None:
        """kopf is done with the creation: stopped in the middle of it, kopf may spawn the
        pool's daemon after its shutdown began, and exit 1 (seen with a shared operator)."""
        assert operator.handled(CREATED, "KVCachePool", "resumed", since, NAMESPACE) == 1
        pool = _get(served_api, "kvcachepools", "resumed")
        assert pool is not None and LAST_HANDLED in pool["metadata"]["annotations"]

    eventually(idle)
    log_from = operator.log_size()
    assert operator.stop() == 0, operator.log(log_from)[-4000:]  # why it did not exit clean

    kubectl("delete", "service", "kvpool-resumed", "-n", NAMESPACE)
    _patch_pool(kubectl, "resumed", {"spec": {"chunkTokens": 512}})
    operator.start()

    def caught_up() -> None:
        _applied(served_api, "resumed", generation=2)
        service = _get(served_api, "services", "kvpool-resumed")
        assert service is not None
        assert service["metadata"]["annotations"]["kvpool.io/chunk-tokens"] == "512"

    eventually(caught_up)


def test_an_operator_of_one_namespace_serves_that_one(tmp_path: Path) -> None:
    """``--namespace``, which the shared operator (every namespace) does not run with: an
    operator of its own, on an API server of its own, applies the pool of its namespace and
    not the one of another namespace, both there before it started (an operator of every
    namespace lists both at once)."""
    api = ServedApi(tmp_path).start()
    try:
        kubectl = Kubectl(api.kubeconfig())
        kubectl("apply", "--validate=false", "-f", str(REPO / "crds"))
        for namespace, pool in (("served", "here"), ("other", "elsewhere")):
            manifest = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
            kubectl("apply", "--validate=false", "-f", "-", manifest=manifest)
            manifest = {
                "apiVersion": "kvpool.io/v1alpha1",
                "kind": "KVCachePool",
                "metadata": {"name": pool, "namespace": namespace},
                "spec": {},
            }
            kubectl("apply", "--validate=false", "-f", "-", manifest=manifest)
        operator = OperatorProcess(api.kubeconfig(), "served", tmp_path / "operator.log")
        operator.start()
        try:

            def applied() -> None:
                pool = api.objects("kvcachepools", "served")["here"]
                assert (pool.get("status") or {}).get("observedGeneration") == 1

            eventually(applied)
            assert "kvpool-here-agent" in api.objects("daemonsets", "served")
            assert api.objects("daemonsets", "other") == {}
            assert "status" not in api.objects("kvcachepools", "other")["elsewhere"]
            about = {(r.get("object") or {}).get("namespace") for r in operator.records()}
            assert "other" not in about
        finally:
            operator.stop()
    finally:
        api.stop()
