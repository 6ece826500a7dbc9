"""What a publish learns of a pool: the KVCachePool must exist (a Service alone, which any
namespace's editor can make, names no pool), its ``spec.engineNamespaces`` say whether the
pod's namespace gets the pool's whole directory or its door only (the segment holds every
tenant's KV on the node: only engines the platform trusts map it), and its Service on the
API server names its segment.

Each is read with one GET, with a short timeout, at every publish (publishes are
rare: one a pod start). A refusal is a :class:`~kvpool.csi.rpc.Refusal`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import urllib3
from kubernetes.client import CoreV1Api, CustomObjectsApi
from kubernetes.client.exceptions import ApiException

from kvpool.common.names import (
    API_GROUP,
    API_VERSION,
    POOL_PLURAL,
    SEGMENT_PATH_ANNOTATION,
    service_name,
)
from kvpool.csi.rpc import Refusal

ENGINE_NAMESPACES_FIELD = "engineNamespaces"

NOT_FOUND = 404


def read_pool(api: CoreV1Api, pool: str, namespace: str, timeout: float) -> Any:
    """The KVCachePool ``namespace/pool``; refused if there is none."""
    custom = CustomObjectsApi(api.api_client)

    def read(name: str, space: str, **options: Any) -> Any:
        return custom.get_namespaced_custom_object(
            API_GROUP, API_VERSION, space, POOL_PLURAL, name, **options
        )

    found = _get(read, pool, namespace, timeout, f"KVCachePool {namespace}")
    if found is None:
        raise Refusal(grpc.StatusCode.NOT_FOUND, f"no KVCachePool {pool} in namespace {namespace}")
    return found


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


def is_engine_namespace(pool: Any, pod_namespace: str) -> bool:
    """Whether ``pod_namespace`` is one of the pool's ``spec.engineNamespaces``, whose pods
    map the node's segment (it holds every tenant's KV, so only the engines the platform
    trusts); any other pod gets the agent's door only, which hands it the chunk files its
    token may map."""
    spec = pool.get("spec") if isinstance(pool, dict) else None
    engines = spec.get(ENGINE_NAMESPACES_FIELD) if isinstance(spec, dict) else None
    return isinstance(engines, list) and pod_namespace in engines


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
