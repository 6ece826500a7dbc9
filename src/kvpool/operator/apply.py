"""The operator's reads and writes through the Kubernetes API (the kubernetes client).

Children are written with server-side apply under the field manager ``kvpool-operator``,
forced: the operator owns exactly the fields it renders, a field it stops rendering is
removed, fields other managers set (the agents' quota data, a person's extra label) stay,
and applying an unchanged child changes nothing on the server. Status goes through the
``status`` subresource as a merge patch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

import urllib3
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

from kvpool.common.kube.watch import api_configuration
from kvpool.common.names import OPERATOR
from kvpool.operator.render import Manifest
from kvpool.operator.spec import API_VERSION, KIND, PLURAL, TENANT_KIND, TENANT_PLURAL

REQUEST_TIMEOUT_SECONDS = 30.0


class ApiError(RuntimeError):
    """The API server refused a request or could not be reached (``status`` None)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Kind:
    api_version: str
    kind: str
    plural: str
    provided_by: str | None = None
    """What installs this kind where a cluster may lack it; None: built into Kubernetes."""

    def path(self, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
        base = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        parts = [base, "namespaces", namespace, self.plural, name, subresource]
        return "/".join(part for part in parts if part)


KINDS = {
    (kind.api_version, kind.kind): kind
    for kind in (
        Kind("v1", "ConfigMap", "configmaps"),
        Kind("v1", "Service", "services"),
        Kind("v1", "ServiceAccount", "serviceaccounts"),
        Kind("apps/v1", "DaemonSet", "daemonsets"),
        Kind("apps/v1", "Deployment", "deployments"),
        Kind("rbac.authorization.k8s.io/v1", "Role", "roles"),
        Kind("rbac.authorization.k8s.io/v1", "RoleBinding", "rolebindings"),
        Kind("networking.k8s.io/v1", "NetworkPolicy", "networkpolicies"),
        Kind(
            "monitoring.coreos.com/v1",
            "ServiceMonitor",
            "servicemonitors",
            provided_by="the prometheus-operator CRDs",
        ),
        Kind(API_VERSION, KIND, PLURAL),
    )
}


TENANTS = Kind(API_VERSION, TENANT_KIND, TENANT_PLURAL)
SECRETS = Kind("v1", "Secret", "secrets")
PODS = Kind("v1", "Pod", "pods")
"""Kinds the operator reads or writes beside the pools' children (``tenants.py``)."""


def kind_of(manifest: Manifest) -> Kind:
    return KINDS[manifest["apiVersion"], manifest["kind"]]


class Cluster:
    """The operator's view of the API server: namespaced objects of the kinds in KINDS."""

    def __init__(self, api: ApiClient, timeout: float = REQUEST_TIMEOUT_SECONDS) -> None:
        self._api = api
        self._timeout = timeout

    @classmethod
    def connect(cls) -> Cluster:
        """In a pod: its service account; elsewhere: the kubeconfig (``$KUBECONFIG``)."""
        return cls(ApiClient(api_configuration()))

    def get(self, kind: Kind, namespace: str, name: str) -> Manifest | None:
        """The object, or None if it does not exist."""
        try:
            return self._request("GET", kind.path(namespace, name))
        except ApiError as error:
            if error.status == 404:
                return None
            raise

    def apply(self, manifest: Manifest) -> Manifest:
        """Server-side apply ``manifest``; returns the object as stored."""
        metadata = manifest["metadata"]
        return self._request(
            "PATCH",
            kind_of(manifest).path(metadata["namespace"], metadata["name"]),
            body=manifest,
            content_type="application/apply-patch+yaml",
            query=[("fieldManager", OPERATOR), ("force", "true")],
        )

    def create(self, kind: Kind, manifest: Manifest) -> Manifest:
        """Create ``manifest`` (409 if it exists); returns the object as stored."""
        return self._request("POST", kind.path(manifest["metadata"]["namespace"]), body=manifest)

    def patch(self, kind: Kind, namespace: str, name: str, patch: Manifest) -> Manifest:
        """A JSON merge patch (RFC 7386: ``None`` removes a key); returns the object."""
        return self._request(
            "PATCH",
            kind.path(namespace, name),
            body=patch,
            content_type="application/merge-patch+json",
        )

    def select(self, kind: Kind, namespace: str, labels: Mapping[str, str]) -> list[Manifest]:
        """The objects of ``kind`` in ``namespace`` that carry every one of ``labels``."""
        selector = ",".join(f"{key}={value}" for key, value in labels.items())
        found = self._request("GET", kind.path(namespace), query=[("labelSelector", selector)])
        items: list[Manifest] = found.get("items") or []
        return items

    def namespace_labels(self, name: str) -> dict[str, str] | None:
        """The labels of the namespace ``name``; None if there is no such namespace."""
        try:
            namespace = self._request("GET", f"/api/v1/namespaces/{name}")
        except ApiError as error:
            if error.status == 404:
                return None
            raise
        labels: dict[str, str] = namespace.get("metadata", {}).get("labels") or {}
        return labels

    def delete(self, kind: Kind, namespace: str, name: str) -> bool:
        """Delete the object; False if there was none."""
        try:
            self._request("DELETE", kind.path(namespace, name))
        except ApiError as error:
            if error.status == 404:
                return False
            raise
        return True

    def delete_owned(self, kind: Kind, namespace: str, name: str, owner_uid: str) -> bool:
        """Delete the object if the object of ``owner_uid`` owns it (someone else's of that
        name stays); False if none was deleted."""
        existing = self.get(kind, namespace, name)
        owners = (existing or {}).get("metadata", {}).get("ownerReferences", ())
        return any(owner.get("uid") == owner_uid for owner in owners) and self.delete(
            kind, namespace, name
        )

    def patch_status(self, kind: Kind, namespace: str, name: str, status: Manifest) -> None:
        self._request(
            "PATCH",
            kind.path(namespace, name, "status"),
            body={"status": status},
            content_type="application/merge-patch+json",
        )

    def serves(self, kind: Kind) -> bool:
        """Whether the API server serves ``kind`` (e.g. whether a CRD is installed)."""
        try:
            resources = self._request("GET", f"/apis/{kind.api_version}")
        except ApiError as error:
            if error.status == 404:
                return False
            raise
        return any(entry.get("kind") == kind.kind for entry in resources.get("resources", ()))

    def _request(
        self,
        method: str,
        path: str,
        *,
        body: Manifest | None = None,
        content_type: str = "application/json",
        query: list[tuple[str, str]] | None = None,
    ) -> Manifest:
        try:
            response = self._api.call_api(
                path,
                method,
                query_params=query or [],
                header_params={"Accept": "application/json", "Content-Type": content_type},
                body=body,
                auth_settings=["BearerToken"],
                _preload_content=False,
                _request_timeout=self._timeout,
            )
        except ApiException as error:
            raise ApiError(f"{method} {path}: {_failure(error.body)}", error.status) from error
        except urllib3.exceptions.HTTPError as error:
            raise ApiError(f"{method} {path}: the API server is unreachable: {error}") from error
        loaded: Manifest = json.loads(response.data or b"{}")
        return loaded


def _failure(body: str | None) -> str:
    """The message of a Kubernetes Status, or the raw body."""
    try:
        status = json.loads(body or "")
    except ValueError:
        return (body or "no response body")[:500]
    return str(status.get("message") or status) if isinstance(status, dict) else str(status)
