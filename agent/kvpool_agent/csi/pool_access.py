"""Who may publish a pool: the KVCachePool must exist (a Service and a ConfigMap alone, which
any namespace's editor can make, name no pool), its Service on the API server names its
segment, and its tenants ConfigMap the namespaces of its KVCacheTenants (those admitted).

Each is read with one GET, with a short timeout, at every publish (publishes are
rare: one a pod start). A refusal is a :class:`~kvpool_agent.csi.rpc.Refusal`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import urllib3
from kubernetes.client import CoreV1Api, CustomObjectsApi
from kubernetes.client.exceptions import ApiException

from kvpool_agent.csi.rpc import Refusal
from kvpool_agent.names import (
    API_GROUP,
    API_VERSION,
    POOL_PLURAL,
    SEGMENT_PATH_ANNOTATION,
    service_name,
    tenants_name,
)
from kvpool_agent.tenants_configmap import parse_tenants

NOT_FOUND = 404


def check_pool(api: CoreV1Api, pool: str, namespace: str, timeout: float) -> None:
    """Refuse unless the KVCachePool ``namespace/pool`` exists."""
    custom = CustomObjectsApi(api.api_client)

    def read(name: str, space: str, **options: Any) -> Any:
        return custom.get_namespaced_custom_object(
            API_GROUP, API_VERSION, space, POOL_PLURAL, name, **options
        )

    if _get(read, pool, namespace, timeout, f"KVCachePool {namespace}") is None:
        raise Refusal(grpc.StatusCode.NOT_FOUND, f"no KVCachePool {pool} in namespace {namespace}")


def segment_path(api: CoreV1Api, pool: str, namespace: str, timeout: float) -> str:
    """The pool's segment path on the node (its Service's annotation)."""
    name = service_name(pool)
    found = _get(api.read_namespaced_service, name, namespace, timeout, f"Service {namespace}")
    if found is None:
        raise Refusal(grpc.StatusCode.NOT_FOUND, f"no pool {pool} in namespace {namespace}")
    annotations = found.metadata.annotations or {}
    path = annotations.get(SEGMENT_PATH_ANNOTATION, "")
    if not isinstance(path, str) or not path:
        raise Refusal(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"Service {namespace}/{name} has no annotation {SEGMENT_PATH_ANNOTATION}",
        )
    return path


def check_admitted(
    api: CoreV1Api, pool: str, namespace: str, pod_namespace: str, timeout: float
) -> None:
    """Refuse unless some KVCacheTenant of ``pod_namespace`` is in the pool's tenants."""
    name = tenants_name(pool)
    found = _get(api.read_namespaced_config_map, name, namespace, timeout, f"ConfigMap {namespace}")
    where = f"ConfigMap {namespace}/{name}"
    tenants = parse_tenants(found.data or {}, where) if found is not None else None
    sources = [] if tenants is None else [entry.source for entry in tenants.tenants.values()]
    if not any(source.partition("/")[0] == pod_namespace for source in sources):
        raise Refusal(
            grpc.StatusCode.PERMISSION_DENIED,
            f"namespace {pod_namespace} is not admitted to pool {pool} in namespace "
            f"{namespace}: no KVCacheTenant of it in {where}",
        )


def _get(
    read: Callable[..., Any], name: str, namespace: str, timeout: float, what: str
) -> Any | None:
    """The object, or None if the API server has none of that name."""
    try:
        return read(name, namespace, _request_timeout=timeout)
    except ApiException as error:
        if error.status == NOT_FOUND:
            return None
        raise Refusal(
            grpc.StatusCode.UNAVAILABLE,
            f"cannot read {what}/{name}: {error.status} {error.reason}",
        ) from error
    except (urllib3.exceptions.HTTPError, OSError) as error:
        raise Refusal(
            grpc.StatusCode.UNAVAILABLE,
            f"cannot reach the Kubernetes API server for {what}/{name}: {error}",
        ) from error
