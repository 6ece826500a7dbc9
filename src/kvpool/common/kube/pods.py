"""What discoveries of pods share: when a pod counts, where it runs, and how to reach the API.

The agents' discovery (:mod:`kvpool.common.kube.discovery`) and the endpoint picker's
model servers (:mod:`kvpool.index.model_servers`) both follow pods through
:class:`~kvpool.common.kube.watch.ListWatch`; they agree here on when a pod counts (running,
with an IP and a node, not being deleted), how its IP becomes a host (IPv6 in brackets),
and which namespace and API client a component in a pod uses.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from kubernetes.client import ApiClient, CoreV1Api
from kubernetes.config import ConfigException

from kvpool.common.kube.watch import api_configuration

NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


@dataclass(frozen=True)
class Placement:
    host: str
    """The pod's IP as a host part: ``10.0.0.5``, or ``[fd00::7]`` for IPv6."""
    node: str
    """``spec.nodeName``."""


def placement(pod: Mapping[str, Any]) -> Placement | None:
    """Where a pod (the API's JSON form) runs, or None while it does not count: not
    ``Running``, without an IP or a node yet, or being deleted."""
    metadata = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    ip, node = status.get("podIP"), spec.get("nodeName")
    if status.get("phase") != "Running" or not ip or not node or metadata.get("deletionTimestamp"):
        return None
    return Placement(f"[{ip}]" if ":" in ip else ip, node)


def is_ready(pod: Mapping[str, Any]) -> bool:
    """Whether the pod's ``Ready`` condition is ``True`` (its readiness probe passes)."""
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def created(pod: Mapping[str, Any]) -> str:
    """The pod's creationTimestamp (RFC 3339, so it sorts as text)."""
    return str((pod.get("metadata") or {}).get("creationTimestamp", ""))


def pod_lister(purpose: str) -> Callable[..., Any]:
    """``CoreV1Api.list_namespaced_pod`` through this pod's service account (in a pod) or
    the kubeconfig (elsewhere); ValueError naming ``purpose`` without an API to reach."""
    try:
        configuration = api_configuration()
    except ConfigException as error:
        raise ValueError(f"no Kubernetes API to {purpose}: {error}") from error
    return cast(Callable[..., Any], CoreV1Api(ApiClient(configuration)).list_namespaced_pod)


def namespace_or_own(namespace: str | None, whose: str) -> str:
    """``namespace``, or this pod's own; ValueError naming ``whose`` namespace to set."""
    if namespace is not None:
        return namespace
    try:
        return NAMESPACE_FILE.read_text().strip()
    except OSError as error:
        raise ValueError(
            f"no namespace configured and {NAMESPACE_FILE} is unreadable "
            f"({error.strerror}): set {whose} namespace"
        ) from error
