"""Peers through the real operator (``kvpool-operator`` in a subprocess, checking every
``--usage-seconds 1``, shared with the other modules: ``conftest.py``) against the emulated
API server, each test in a namespace of its own: the pool's peer Secret minted before
the agents that mount it and rotated, the agents' peer port, node name, credential, Role and
NetworkPolicy rule, all gone with ``spec.peers.enabled: false``; invalid fields reported.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Callable
from typing import Any

import pytest
import yaml

from kvpool.operator.spec import PEER_PORT_TAKEN
from tests.operator.cluster_view import apply, condition, event, namespace, secret_values
from tests.support.kube_api import ServedApi
from tests.support.operator_process import Kubectl, OperatorProcess
from tests.support.polling import eventually

pytestmark = pytest.mark.process

NAMESPACE = "mesh"
CREATED = "kvpool.io/peer-keys-created"
CLIENTS = [{"podSelector": {"matchLabels": {"kvpool.io/client": "vllm"}}}]
PODS_RULE = {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
ROTATION_STOPPED = "Daemon 'pool_peer_keys' has exited on request"
"""kopf's word (with --verbose) that a pool's key rotation stopped: it no longer has peers."""


@pytest.fixture(autouse=True)
def _own_namespace(
    namespaces: Callable[[str], str], kubectl: Kubectl, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each test works in a namespace of its own: NAMESPACE (read by the helpers below) names
    it while the test runs."""
    name = namespaces("mesh")
    apply(kubectl, namespace(name, {}))
    monkeypatch.setitem(globals(), "NAMESPACE", name)


def _create(kubectl: Kubectl, name: str, spec: dict[str, Any]) -> None:
    pool = {
        "apiVersion": "kvpool.io/v1alpha1",
        "kind": "KVCachePool",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": spec,
    }
    apply(kubectl, pool)


def _patch(kubectl: Kubectl, name: str, spec: dict[str, Any]) -> None:
    patch = json.dumps({"spec": spec})
    kubectl("patch", "kvp", name, "-n", NAMESPACE, "--type=merge", "-p", patch)


def _get(api: ServedApi, plural: str, name: str) -> dict[str, Any]:
    found = api.objects(plural, NAMESPACE).get(name)
    assert found is not None, f"no {plural} {name}"
    return found


def _applied(api: ServedApi, pool: str, generation: int) -> None:
    status = _get(api, "kvcachepools", pool).get("status") or {}
    assert status.get("observedGeneration") == generation


def _keys(api: ServedApi, pool: str) -> dict[str, str]:
    """The peer Secret's keys, each checked to be a key as the agents' Keyring reads it."""
    keys = secret_values(api, NAMESPACE, f"kvpool-{pool}-peer")
    assert keys, "the peer Secret holds no key"
    for name, value in keys.items():
        assert name.isdecimal() and re.fullmatch("[0-9a-f]{64}", value), name
    return keys


def _pod(api: ServedApi, pool: str) -> dict[str, Any]:
    pod: dict[str, Any] = _get(api, "daemonsets", f"kvpool-{pool}-agent")["spec"]["template"]
    return pod["spec"]


def _peers_config(api: ServedApi, pool: str) -> Any:
    config = _get(api, "configmaps", f"kvpool-{pool}-config")["data"]["agent.yaml"]
    return yaml.safe_load(config)["peers"]


def _peer_rules(api: ServedApi, pool: str) -> list[dict[str, Any]]:
    """The rules of the agents' NetworkPolicy that admit the pool's agents themselves."""
    policy = _get(api, "networkpolicies", f"kvpool-{pool}-agent")["spec"]
    return [
        rule
        for rule in policy["ingress"]
        if rule["from"] == [{"podSelector": {"matchLabels": policy["podSelector"]["matchLabels"]}}]
    ]


def _said(api: ServedApi, pool: str, text: str) -> None:
    """Some event on the pool says ``text``."""
    messages = [e["message"] for e in api.events(NAMESPACE, pool)]
    assert any(text in message for message in messages), messages


def test_a_pool_with_peers_gets_its_credential_before_its_agents(
    served_api: ServedApi, kubectl: Kubectl, operator: OperatorProcess
) -> None:
    _create(kubectl, "mesh", {"peers": {"port": 7500, "maxBandwidth": "1Gi"}})
    eventually(lambda: _applied(served_api, "mesh", 1))
    pool = _get(served_api, "kvcachepools", "mesh")
    secret = _get(served_api, "secrets", "kvpool-mesh-peer")
    (owner,) = secret["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["uid"], owner["controller"]) == (
        "KVCachePool",
        pool["metadata"]["uid"],
        True,
    )
    assert list(_keys(served_api, "mesh")) == ["1"]
    assert list(json.loads(secret["metadata"]["annotations"][CREATED])) == ["1"]
    daemonset = _get(served_api, "daemonsets", "kvpool-mesh-agent")
    made_first = int(secret["metadata"]["resourceVersion"])
    assert made_first < int(daemonset["metadata"]["resourceVersion"])  # before its mounts

    pod = _pod(served_api, "mesh")
    (container,) = pod["containers"]
    assert {"name": "peer", "containerPort": 7500, "protocol": "TCP"} in container["ports"]
    node = {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}
    assert node in container["env"]
    name = secret["metadata"]["name"]
    (volume,) = [v for v in pod["volumes"] if v.get("secret", {}).get("secretName") == name]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
    assert mount["readOnly"] is True
    assert _peers_config(served_api, "mesh") == {
        "port": 7500,
        "key_dir": mount["mountPath"],
        "discovery": "kubernetes",
        "namespace": NAMESPACE,
        "max_transfers": 4,
        "wire_protection": "sealed",
        "transport": "tcp",
        "bandwidth": 1 << 30,
    }
    assert PODS_RULE in _get(served_api, "roles", "kvpool-mesh-agent")["rules"]
    eventually(lambda: _said(served_api, "mesh", "created Secret kvpool-mesh-peer with peer key 1"))


def test_the_keys_rotate_and_the_oldest_goes(
    served_api: ServedApi, kubectl: Kubectl, operator: OperatorProcess
) -> None:
    """A key every credentialRotation, the previous one kept; a key never changes once
    made; each rotation is an event naming key ids, never a key."""
    _create(kubectl, "spinning", {"peers": {"credentialRotation": "2s"}})
    seen: dict[str, str] = {}
    changed: list[str] = []
    states: list[list[int]] = []

    def rotated_twice() -> None:
        """Every state the Secret is seen in, until its newest key is 3 or later."""
        current = _keys(served_api, "spinning")
        changed.extend(
            name for name, value in current.items() if seen.setdefault(name, value) != value
        )
        states.append(sorted(map(int, current)))
        assert states[-1][-1] >= 3, states[-1]

    eventually(rotated_twice)
    assert changed == []  # a key never changes once made
    for ids in states:  # the newest key and at most the one before it
        assert ids == list(range(ids[0], ids[0] + len(ids))) and len(ids) <= 2, states
    assert len(states[-1]) == 2, states  # the previous key stays
    secret = _get(served_api, "secrets", "kvpool-spinning-peer")
    created = json.loads(secret["metadata"]["annotations"][CREATED])
    assert created.keys() == secret["data"].keys()
    rotated = event(served_api, NAMESPACE, "spinning", "Normal", "PeerKeysRotated")
    assert "added peer key" in rotated
    dropped = "dropped peer key 1 from Secret kvpool-spinning-peer"
    eventually(lambda: _said(served_api, "spinning", dropped))
    messages = " ".join(e["message"] for e in served_api.events(NAMESPACE, "spinning"))
    assert not any(value in messages for value in seen.values())

    # drift: a deleted Secret is made again on the next pass, a key that is not one goes
    uid = secret["metadata"]["uid"]
    kubectl("delete", "secret", "kvpool-spinning-peer", "-n", NAMESPACE)
    remade = eventually(lambda: _get(served_api, "secrets", "kvpool-spinning-peer"))
    assert remade["metadata"]["uid"] != uid
    tampered = {"data": {"99": base64.b64encode(b"not a key").decode()}}
    patch = json.dumps(tampered)
    written = kubectl(
        "patch", "secret", "kvpool-spinning-peer", "-n", NAMESPACE, "-p", patch, "-o", "json"
    )
    assert "99" in json.loads(written)["data"]
    eventually(lambda: _keys(served_api, "spinning"))  # "99" is gone, every entry a key


def test_peers_off_closes_the_port_and_deletes_the_credential(
    served_api: ServedApi, kubectl: Kubectl, operator: OperatorProcess
) -> None:
    policy = {"enabled": True, "clients": CLIENTS}
    _create(kubectl, "solo", {"networkPolicy": policy, "peers": {"credentialRotation": "1s"}})
    eventually(lambda: _applied(served_api, "solo", 1))
    (rule,) = _peer_rules(served_api, "solo")
    assert rule["ports"] == [{"protocol": "TCP", "port": 7404}]
    first = eventually(lambda: _keys(served_api, "solo"))

    since = len(operator.records())
    _patch(kubectl, "solo", {"peers": {"enabled": False}})
    eventually(lambda: _applied(served_api, "solo", 2))
    eventually(lambda: _said(served_api, "solo", "deleted Secret kvpool-solo-peer"))
    assert "kvpool-solo-peer" not in served_api.objects("secrets", NAMESPACE)
    pod = _pod(served_api, "solo")
    (container,) = pod["containers"]
    assert "peer" not in {port["name"] for port in container["ports"]}
    assert "NODE_NAME" not in {env["name"] for env in container["env"]}
    assert "kvpool-solo-peer" not in json.dumps(pod)
    assert _peers_config(served_api, "solo") is None
    assert PODS_RULE not in _get(served_api, "roles", "kvpool-solo-agent")["rules"]
    assert _peer_rules(served_api, "solo") == []

    def rotation_stopped() -> None:  # it rotated every second: no pass of it is left to run
        stopped = operator.handled(ROTATION_STOPPED, "KVCachePool", "solo", since, NAMESPACE)
        assert stopped == 1

    eventually(rotation_stopped)
    assert "kvpool-solo-peer" not in served_api.objects("secrets", NAMESPACE)

    _patch(kubectl, "solo", {"peers": {"enabled": True}})
    eventually(lambda: _applied(served_api, "solo", 3))
    again = _keys(served_api, "solo")
    assert list(again) == ["1"] and again["1"] != first["1"]  # a new credential
    assert _peer_rules(served_api, "solo") != []


INVALID = {
    "port-taken": ({"peers": {"port": 7401}}, PEER_PORT_TAKEN),
    "rotation": ({"peers": {"credentialRotation": "1d"}}, "spec.peers.credentialRotation: "),
    "transfers": ({"peers": {"maxTransfers": 0}}, "spec.peers.maxTransfers: "),
}


@pytest.mark.parametrize("case", sorted(INVALID))
def test_invalid_peer_fields_are_reported_on_one_line(
    served_api: ServedApi, kubectl: Kubectl, operator: OperatorProcess, case: str
) -> None:
    """The emulator checks no schema and no CEL rule: the operator refuses, as the API
    server would."""
    (spec, message), name = INVALID[case], f"bad-{case}"
    _create(kubectl, name, spec)
    eventually(lambda: _applied(served_api, name, 1))
    status, reason, text = condition(served_api, "kvcachepools", NAMESPACE, name, "Degraded")
    assert (status, reason) == ("True", "InvalidSpec")
    assert message in text and "\n" not in text
    assert f"kvpool-{name}-agent" not in served_api.objects("daemonsets", NAMESPACE)
    assert f"kvpool-{name}-peer" not in served_api.objects("secrets", NAMESPACE)
