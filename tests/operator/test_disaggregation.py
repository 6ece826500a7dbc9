"""Prefill/decode disaggregation through the real operator (shared with the other modules:
``conftest.py``) against the emulated API server, each test in a namespace of its own:
the key Secret made once before the index that mounts it and kept across reconciles,
replaced for a new ``keyGeneration``, deleted with ``disaggregation.enabled: false``; the
index's ``picker.pd`` and mount; the webhook's decode sidecar for decode and both pods of
the pool's namespace only; an invalid spec reported on one line.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import pytest
import yaml

from kvpool.operator.spec import DISAGGREGATION_NEEDS_PICKER
from tests.operator.cluster_view import (
    apply,
    condition,
    create_pod,
    event,
    namespace,
    secret_values,
)
from tests.support.kube_api import ServedApi
from tests.support.operator_process import Kubectl, OperatorProcess
from tests.support.pod_security import restricted
from tests.support.polling import eventually

pytestmark = pytest.mark.process

NAMESPACE = "pd"
GENERATION = "kvpool.io/pd-key-generation"
KEY_DIR = "/etc/kvpool/pd-key"
FINGERPRINT = {"model": "m", "dtype": "bfloat16", "kvLayout": "nhd"}
PICKER = {"enabled": True, "selector": {"app": "vllm"}, "targetPort": 8000}


def _spec(**disaggregation: Any) -> dict[str, Any]:
    return {
        "tenants": {
            "tokensSecretRef": {"name": "kvpool-pd-tokens"},
            "allowedNamespaces": {"matchLabels": {"pd": "yes"}},
        },
        "index": {
            "enabled": True,
            "fingerprint": FINGERPRINT,
            "picker": {**PICKER, "disaggregation": {"enabled": True, **disaggregation}},
        },
    }


@pytest.fixture(autouse=True)
def _own_namespace(
    namespaces: Callable[[str], str], kubectl: Kubectl, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = namespaces("pd")
    apply(kubectl, namespace(name, {"pd": "yes"}))
    monkeypatch.setitem(globals(), "NAMESPACE", name)


def _pool(kubectl: Kubectl, name: str, spec: dict[str, Any]) -> None:
    manifest = {
        "apiVersion": "kvpool.io/v1alpha1",
        "kind": "KVCachePool",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": spec,
    }
    apply(kubectl, manifest)


def _patch(kubectl: Kubectl, name: str, disaggregation: dict[str, Any]) -> None:
    patch = {"spec": {"index": {"picker": {"disaggregation": disaggregation}}}}
    kubectl("patch", "kvp", name, "-n", NAMESPACE, "--type=merge", "-p", json.dumps(patch))


def _get(api: ServedApi, plural: str, name: str) -> dict[str, Any]:
    found = api.objects(plural, NAMESPACE).get(name)
    assert found is not None, f"no {plural} {name}"
    return found


def _applied(api: ServedApi, pool: str, generation: int) -> None:
    status = _get(api, "kvcachepools", pool).get("status") or {}
    assert status.get("observedGeneration") == generation, status


def _key(api: ServedApi, pool: str) -> str:
    (key,) = secret_values(api, NAMESPACE, f"kvpool-{pool}-pd-key").values()
    assert re.fullmatch("[0-9a-f]{64}", key)
    return key


def _index_pod(api: ServedApi, pool: str) -> dict[str, Any]:
    template: dict[str, Any] = _get(api, "deployments", f"kvpool-{pool}-index")["spec"]["template"]
    return template


def test_the_key_is_made_before_the_index_and_kept(
    served_api: ServedApi, kubectl: Kubectl, operator: OperatorProcess
) -> None:
    _pool(kubectl, "pd", _spec(thresholdTokens=1024, llmdHeader=True))
    eventually(lambda: _applied(served_api, "pd", 1))
    pool, secret = (
        _get(served_api, "kvcachepools", "pd"),
        _get(served_api, "secrets", "kvpool-pd-pd-key"),
    )
    (owner,) = secret["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["uid"]) == ("KVCachePool", pool["metadata"]["uid"])
    assert secret["metadata"]["annotations"][GENERATION] == "0"
    key = _key(served_api, "pd")
    deployment = _get(served_api, "deployments", "kvpool-pd-index")
    made = int(secret["metadata"]["resourceVersion"])
    assert made < int(deployment["metadata"]["resourceVersion"])  # before its mounts

    template = _index_pod(served_api, "pd")
    assert template["metadata"]["annotations"][GENERATION] == "0"
    (container,) = template["spec"]["containers"]
    (volume,) = [
        v
        for v in template["spec"]["volumes"]
        if "secret" in v and v["secret"]["secretName"] == "kvpool-pd-pd-key"
    ]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
    assert (mount["mountPath"], mount["readOnly"]) == (KEY_DIR, True)
    config = yaml.safe_load(
        _get(served_api, "configmaps", "kvpool-pd-index-config")["data"]["index.yaml"]
    )
    assert config["picker"]["pd"] == {
        "enabled": True,
        "threshold_tokens": 1024,
        "max_prefill_waiting": 4,
        "key_file": f"{KEY_DIR}/key",
        "header_ttl_seconds": 30,
        "llmd_header": True,
    }
    created = event(served_api, NAMESPACE, "pd", "Normal", "Applied")
    assert "created Secret kvpool-pd-pd-key with disaggregation key 0" in created
    assert key not in json.dumps(served_api.events(NAMESPACE, "pd"))

    # another reconcile (a changed field) keeps the key; a new generation replaces it
    _patch(kubectl, "pd", {"thresholdTokens": 2048})
    eventually(lambda: _applied(served_api, "pd", 2))
    assert _key(served_api, "pd") == key
    _patch(kubectl, "pd", {"keyGeneration": 1})
    eventually(lambda: _applied(served_api, "pd", 3))
    assert _key(served_api, "pd") != key
    secret = _get(served_api, "secrets", "kvpool-pd-pd-key")
    assert secret["metadata"]["annotations"][GENERATION] == "1"
    assert _index_pod(served_api, "pd")["metadata"]["annotations"][GENERATION] == "1"

    # off: the Secret, the mount and picker.pd go
    _patch(kubectl, "pd", {"enabled": False})
    eventually(lambda: _applied(served_api, "pd", 4))
    assert "kvpool-pd-pd-key" not in served_api.objects("secrets", NAMESPACE)
    config = yaml.safe_load(
        _get(served_api, "configmaps", "kvpool-pd-index-config")["data"]["index.yaml"]
    )
    assert "pd" not in config["picker"]
    assert GENERATION not in _index_pod(served_api, "pd")["metadata"]["annotations"]


def test_an_invalid_spec_is_reported_on_one_line(
    served_api: ServedApi, kubectl: Kubectl, operator: OperatorProcess
) -> None:
    """The CRD refuses it (test_crd); an API server without its rules still gets one line
    naming the field, and no key."""
    spec = _spec()
    spec["index"]["picker"]["enabled"] = False
    kubectl(
        "apply",
        "--validate=false",
        "-f",
        "-",
        manifest={
            "apiVersion": "kvpool.io/v1alpha1",
            "kind": "KVCachePool",
            "metadata": {"name": "bad", "namespace": NAMESPACE},
            "spec": spec,
        },
    )
    status, reason, message = eventually(
        lambda: condition(served_api, "kvcachepools", NAMESPACE, "bad", "Ready")
    )
    assert (status, reason) == ("False", "InvalidSpec")
    assert DISAGGREGATION_NEEDS_PICKER in message and "\n" not in message
    assert "kvpool-bad-pd-key" not in served_api.objects("secrets", NAMESPACE)


def _vllm(name: str, role: str | None) -> dict[str, Any]:
    labels = {"kvpool.io/cache-pool": "pd", "app": "vllm"}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels | ({"kvpool.io/role": role} if role else {})},
        "spec": {
            "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [
                {
                    "name": "vllm",
                    "image": "vllm:test",
                    "securityContext": {
                        "allowPrivilegeEscalation": False,
                        "capabilities": {"drop": ["ALL"]},
                    },
                }
            ],
        },
    }


def test_the_webhook_gives_decode_pods_the_sidecar(
    served_api: ServedApi,
    kubectl: Kubectl,
    operator: OperatorProcess,
    namespaces: Callable[[str], str],
) -> None:
    """Decode and both pods of the pool's namespace get the sidecar and the key, and stay
    "restricted"; a prefill pod and an unlabelled one do not; a decode pod of a tenant's
    namespace gets a warning instead (the picker does not route it)."""
    _pool(kubectl, "pd", _spec(vllmPort=8300, decodeWaitMs=500))
    team = namespaces("pd-team")
    apply(kubectl, namespace(team, {"pd": "yes"}))
    for where in (NAMESPACE, team):
        tenant = {
            "apiVersion": "kvpool.io/v1alpha1",
            "kind": "KVCacheTenant",
            "metadata": {"name": "vllm", "namespace": where},
            "spec": {"poolRef": {"name": "pd", "namespace": NAMESPACE}, "quota": {"l1": "1Gi"}},
        }
        apply(kubectl, tenant)
        eventually(
            lambda where=where: condition(served_api, "kvcachetenants", where, "vllm", "Accepted")
        )
    eventually(lambda: _applied(served_api, "pd", 1))

    for role in ("decode", "both"):
        pod, warnings = create_pod(served_api, NAMESPACE, _vllm(role, role))
        assert warnings == []
        (sidecar,) = pod["spec"]["initContainers"]
        assert sidecar["name"] == "kvpool-pd-sidecar"
        assert sidecar["restartPolicy"] == "Always"
        assert sidecar["image"] == "kvpool:test"
        assert sidecar["command"] == ["kvpool-pd-sidecar"]
        assert sidecar["args"] == [
            "--port=8000",
            "--vllm=http://127.0.0.1:8300",
            f"--key-file={KEY_DIR}/key",
            "--decode-wait-ms=500",
            "--prefill-timeout-s=30",
        ]
        node = {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}
        assert sidecar["env"] == [node]
        (mount,) = sidecar["volumeMounts"]
        (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == mount["name"]]
        assert volume["secret"]["secretName"] == "kvpool-pd-pd-key"
        assert (mount["mountPath"], mount["readOnly"]) == (KEY_DIR, True)
        (vllm,) = pod["spec"]["containers"]
        assert all(m["name"] != mount["name"] for m in vllm["volumeMounts"])  # its alone
        assert restricted(pod["spec"]) == []

    for name, role in (("prefill", "prefill"), ("unlabelled", None)):
        pod, warnings = create_pod(served_api, NAMESPACE, _vllm(name, role))
        assert warnings == [] and "initContainers" not in pod["spec"], name
        assert pod["spec"]["volumes"][0]["name"] == "kvpool-segment"  # wired all the same

    pod, warnings = create_pod(served_api, team, _vllm("elsewhere", "decode"))
    assert "initContainers" not in pod["spec"]
    assert len(warnings) == 1 and "routes only pods of" in warnings[0], warnings
