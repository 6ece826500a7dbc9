"""What the operator's tests do to and read from the emulated API server: apply with kubectl,
read objects, conditions, Secrets and events."""

from __future__ import annotations

import base64
import json
from typing import Any

import httpx

from kvpool.operator.render import Pool
from tests.support.kube_api import ServedApi
from tests.support.operator_process import Kubectl
from tests.support.polling import eventually


def apply(kubectl: Kubectl, manifest: dict[str, Any]) -> None:
    kubectl("apply", "--validate=false", "-f", "-", manifest=manifest)


def namespace(name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}}


def agent_pod(kubectl: Kubectl, pool: Pool, name: str, address: str) -> None:
    """An agent pod of ``pool``, with ``address`` as its IP (where the operator calls it)."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": pool.namespace, "labels": pool.labels()},
        "spec": {"containers": [{"name": "agent", "image": "kvpool:test"}]},
    }
    apply(kubectl, pod)
    status = {"status": {"podIP": address, "phase": "Running"}}
    kubectl(
        "patch",
        "pod",
        name,
        "-n",
        pool.namespace,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps(status),
    )


def create_pod(
    api: ServedApi, namespace: str, pod: dict[str, Any]
) -> tuple[dict[str, Any], list[str]]:
    """Create the pod over HTTP, as a client does (the admission webhook is called): the
    stored pod, and the Warning headers."""
    response = httpx.post(
        f"{api.url}/api/v1/namespaces/{namespace}/pods",
        json=pod,
        headers={"Authorization": "Bearer test"},
        timeout=30,
    )
    assert response.status_code == 201, response.text
    stored = api.objects("pods", namespace)[pod["metadata"]["name"]]
    return stored, response.headers.get_list("Warning")


def status(api: ServedApi, plural: str, namespace: str, name: str) -> dict[str, Any]:
    found = api.objects(plural, namespace).get(name)
    assert found is not None, f"no {plural} {namespace}/{name}"
    result: dict[str, Any] = found.get("status") or {}
    return result


def condition(
    api: ServedApi, plural: str, namespace: str, name: str, kind: str
) -> tuple[str, str, str]:
    """(status, reason, message) of a condition of the object."""
    for found in status(api, plural, namespace, name).get("conditions", ()):
        if found["type"] == kind:
            return found["status"], found["reason"], found["message"]
    raise AssertionError(f"{namespace}/{name} has no {kind} condition yet")


def secret_values(api: ServedApi, namespace: str, name: str) -> dict[str, str]:
    """The values of a Secret, decoded."""
    found = api.objects("secrets", namespace).get(name)
    assert found is not None, f"no Secret {name}"
    data = found.get("data") or {}
    return {key: base64.b64decode(value).decode() for key, value in data.items()}


def config_map(api: ServedApi, namespace: str, name: str) -> dict[str, str]:
    found = api.objects("configmaps", namespace).get(name)
    assert found is not None, f"no ConfigMap {name}"
    data: dict[str, str] = found.get("data") or {}
    return data


def event(api: ServedApi, namespace: str, name: str, kind: str, reason: str) -> str:
    """The message of an event of ``kind`` and ``reason`` about the object, once posted."""

    def posted() -> str:
        events = [(e["type"], e["reason"], e["message"]) for e in api.events(namespace, name)]
        for found in events:
            if found[:2] == (kind, reason):
                return found[2]
        raise AssertionError(f"no {kind} {reason} event on {name}: {events}")

    return eventually(posted)
