"""The Kubernetes API as this pod sees it: the pool's Service and the index's ConfigMap.

The credentials are the components' own (:func:`kvpool.common.kube.watch.api_configuration`):
the pod's service account in a pod, else the kubeconfig (``$KUBECONFIG``). Errors keep
the API server's status, so that a check tells a missing object (404) from a missing
RBAC grant (403), and names the grant.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any

import yaml
from kubernetes.client import ApiClient, CoreV1Api
from kubernetes.client.exceptions import ApiException

from kvpool.common.kube.watch import api_configuration
from kvpool.common.names import INDEX_CONFIG_KEY, index_config_map_name, service_name
from kvpool.connector.discovery import K8S_TIMEOUT_S

_USER = re.compile(r'User "([^"]+)"')
_SERVICE_ACCOUNT = "system:serviceaccount:"


class KubeReader:
    """Reads objects with this pod's credentials."""

    def __init__(self, api: Any, credentials: str) -> None:
        self._api = api
        self.credentials = credentials
        """How this reader authenticates, in words."""

    @classmethod
    def connect(cls) -> KubeReader:
        """The in-cluster service account, else the kubeconfig; ConfigException if neither."""
        in_cluster = "KUBERNETES_SERVICE_HOST" in os.environ
        credentials = "this pod's service account" if in_cluster else "the kubeconfig"
        return cls(CoreV1Api(ApiClient(api_configuration())), credentials)

    def service(self, name: str, namespace: str) -> Any:
        """The Service (a ``V1Service``); ApiException if the API server refuses."""
        return self._api.read_namespaced_service(name, namespace, _request_timeout=K8S_TIMEOUT_S)

    def index_config(self, pool: str, namespace: str) -> Any:
        """The pool's index configuration (what ``kvpool-index`` runs with), parsed YAML."""
        config_map = self._api.read_namespaced_config_map(
            index_config_map_name(pool), namespace, _request_timeout=K8S_TIMEOUT_S
        )
        return yaml.safe_load((config_map.data or {}).get(INDEX_CONFIG_KEY) or "{}")


@dataclass(frozen=True)
class Refusal:
    """Why the API server said no."""

    status: int | None
    """The HTTP status; None when no answer came (unreachable, no credentials)."""
    message: str
    user: str | None
    """Who the API server took this pod for (named in a 403)."""


def refusal(error: Exception) -> Refusal:
    if not isinstance(error, ApiException):
        return Refusal(None, str(error), None)
    try:
        message = str(json.loads(error.body)["message"])
    except (TypeError, ValueError, KeyError):
        message = f"{error.status} {error.reason}"
    user = _USER.search(message)
    return Refusal(error.status, message, user.group(1) if user else None)


def grant_service_get(pool: str, namespace: str, user: str | None) -> str:
    """The commands that let ``user`` get the pool's Service (the chart's NOTES give the same)."""
    role = f"kvpool-{pool}-discovery"
    if user is None:
        subject = f"--serviceaccount={namespace}:<vLLM's service account>"
    elif user.startswith(_SERVICE_ACCOUNT):
        subject = f"--serviceaccount={user.removeprefix(_SERVICE_ACCOUNT)}"
    else:
        subject = f"--user={user}"
    return (
        f"kubectl -n {namespace} create role {role} --verb=get --resource=services "
        f"--resource-name={service_name(pool)} && kubectl -n {namespace} create rolebinding "
        f"{role} --role={role} {subject}"
    )
