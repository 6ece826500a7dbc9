"""Where the agent is: an explicit endpoint, or the annotations of a pool's Service.

The operator annotates the Service ``kvpool-<pool>`` with everything a connector
needs; the connector reaches the node-local agent through that Service
(``internalTrafficPolicy: Local``)::

    kvpool.io/zmq-port          7400
    kvpool.io/segment-path      /dev/shm/kvpool-<pool>/segment
    kvpool.io/chunk-tokens      256
    kvpool.io/protocol-version  1
    kvpool.io/http-port         7401   (the agent's HTTP API, for tools such as kvpool doctor)

The Kubernetes client is imported only for a pool name, and reads with the pod's
service account (it needs ``get`` on that Service).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpool.client import AgentInfo
from kvpool.common.names import (
    CACHE_POOL_LABEL,
    CHUNK_TOKENS_ANNOTATION,
    PROTOCOL_VERSION_ANNOTATION,
    SEGMENT_PATH_ANNOTATION,
    ZMQ_PORT_ANNOTATION,
    service_name,
)
from kvpool.common.protocol import PROTOCOL_VERSION
from kvpool.common.segment import door_path
from kvpool.connector.settings import ConnectorSettings, Transport

NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
K8S_TIMEOUT_S = 5.0

ServiceReader = Callable[[str, str], Mapping[str, str]]
"""(service name, namespace) -> the Service's annotations."""


class DiscoveryError(RuntimeError):
    """The pool's Service cannot be read or does not describe a usable agent."""


class ProtocolMismatch(DiscoveryError):
    """The pool's Service advertises a protocol version this client does not speak."""


@dataclass(frozen=True)
class AgentAddress:
    endpoint: str
    segment_path: Path | None
    """None: take the path from the agent's hello."""
    chunk_tokens: int | None
    """None: not advertised."""
    transport: Transport = "auto"
    door_path: Path | None = None
    """None: beside the segment path, else the path the agent's hello names."""

    def segment_for(self, info: AgentInfo) -> Path | None:
        """Where this process sees the agent's segment (beside which its table of ready
        chunks is): this address's path (settings or Service), else the agent's; None with
        the transport ``messages``."""
        if self.transport == "messages":
            return None
        return self.segment_path or info.segment_path

    def door_for(self, info: AgentInfo) -> Path | None:
        """Where this process reaches the agent's door: the settings' path, else the one
        beside the segment path, else the agent's; None with the transport ``messages``
        (map nothing)."""
        if self.transport == "messages":
            return None
        if self.door_path is not None:
            return self.door_path
        if self.segment_path is not None:
            return door_path(self.segment_path)
        return info.door_path


def resolve(
    settings: ConnectorSettings,
    read_service: ServiceReader | None = None,
    namespace_file: Path = NAMESPACE_FILE,
) -> AgentAddress:
    """The agent's address; settings (and so the env overrides) win over annotations."""
    if settings.endpoint is not None:
        return AgentAddress(
            settings.endpoint,
            settings.segment_path,
            settings.chunk_tokens,
            settings.transport,
            settings.door_path,
        )
    assert settings.pool is not None
    namespace = settings.namespace or _own_namespace(namespace_file)
    name = service_name(settings.pool)
    reader = read_service or read_service_annotations
    try:
        annotations = reader(name, namespace)
    except DiscoveryError:
        raise
    except Exception as error:  # the Kubernetes client raises many kinds
        raise DiscoveryError(
            f"cannot read Service {namespace}/{name}: {error} (a pod labelled "
            f"{CACHE_POOL_LABEL}={settings.pool} is given the agent's address by kvpool's "
            f"admission webhook and reads nothing; otherwise its service account needs get "
            f"on that Service)"
        ) from error
    version = annotations.get(PROTOCOL_VERSION_ANNOTATION)
    if version is not None and version != str(PROTOCOL_VERSION):
        raise ProtocolMismatch(
            f"Service {namespace}/{name} speaks protocol {version}; "
            f"this connector speaks {PROTOCOL_VERSION}"
        )
    port = int_annotation(annotations, ZMQ_PORT_ANNOTATION, name)
    if port is None:
        raise DiscoveryError(f"Service {namespace}/{name} has no {ZMQ_PORT_ANNOTATION} annotation")
    advertised_path = annotations.get(SEGMENT_PATH_ANNOTATION)
    segment = settings.segment_path or (Path(advertised_path) if advertised_path else None)
    chunk_tokens = settings.chunk_tokens or int_annotation(
        annotations, CHUNK_TOKENS_ANNOTATION, name
    )
    endpoint = f"tcp://{name}.{namespace}.svc:{port}"
    return AgentAddress(endpoint, segment, chunk_tokens, settings.transport, settings.door_path)


def read_service_annotations(name: str, namespace: str) -> Mapping[str, str]:
    """Read a Service's annotations with the in-cluster service account."""
    # imported here, and untyped on purpose: only pool discovery needs the client,
    # and its typing differs between releases
    k8s_config: Any = importlib.import_module("kubernetes.config")
    k8s_client: Any = importlib.import_module("kubernetes.client")
    k8s_config.load_incluster_config()
    service = k8s_client.CoreV1Api().read_namespaced_service(
        name, namespace, _request_timeout=K8S_TIMEOUT_S
    )
    return service_annotations(service)


def service_annotations(service: Any) -> dict[str, str]:
    """The annotations of a Service read with the Kubernetes client (a ``V1Service``)."""
    annotations = service.metadata.annotations if service.metadata is not None else None
    return {str(key): str(value) for key, value in (annotations or {}).items()}


def _own_namespace(namespace_file: Path) -> str:
    try:
        return namespace_file.read_text().strip()
    except OSError as error:
        raise DiscoveryError(
            f"no 'namespace' in kv_connector_extra_config and {namespace_file} is unreadable "
            f"({error.strerror}): is this pod in Kubernetes?"
        ) from error


def int_annotation(annotations: Mapping[str, str], key: str, service: str) -> int | None:
    """A positive integer annotation; None if absent, DiscoveryError if malformed."""
    raw = annotations.get(key)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise DiscoveryError(f"Service {service}: {key}={raw!r} is not an integer") from None
    if value <= 0:
        raise DiscoveryError(f"Service {service}: {key}={raw!r} must be positive")
    return value
