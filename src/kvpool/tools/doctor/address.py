"""Where the agent is, found as the connector finds it: the service, protocol and annotations
checks.

With a pool the connector's own :func:`~kvpool.connector.discovery.resolve` reads the
Service, through a reader that keeps what the API server answered, so that a failure is
told apart: the Service cannot be read (no credentials, no such Service, no RBAC grant),
it advertises another protocol, or its annotations do not parse. With an endpoint there
is no Service to check.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvpool.common.names import HTTP_PORT_ANNOTATION, PROTOCOL_VERSION_ANNOTATION, service_name
from kvpool.common.protocol import PROTOCOL_VERSION
from kvpool.connector.discovery import (
    AgentAddress,
    DiscoveryError,
    ProtocolMismatch,
    int_annotation,
    resolve,
    service_annotations,
)
from kvpool.connector.settings import ConnectorSettings
from kvpool.tools.doctor.kube import KubeReader, grant_service_get, refusal
from kvpool.tools.doctor.report import Check, failed, passed, skipped, skipped_all

CHECKS = ("service", "protocol", "annotations")
SERVICE, PROTOCOL, ANNOTATIONS = CHECKS


@dataclass(frozen=True)
class Located:
    """The agent's address, and what else the pool's Service told."""

    address: AgentAddress
    http_url: str | None
    """The agent's HTTP API; None when unknown."""
    pool: str | None
    """None: an endpoint was given."""
    namespace: str | None
    kube: KubeReader | None


class _ServiceRead:
    """A Service reader for ``resolve`` that keeps what the API server answered."""

    def __init__(self, kube: KubeReader) -> None:
        self._kube = kube
        self.namespace: str | None = None
        self.annotations: Mapping[str, str] | None = None
        self.error: Exception | None = None

    def __call__(self, name: str, namespace: str) -> Mapping[str, str]:
        self.namespace = namespace
        try:
            self.annotations = service_annotations(self._kube.service(name, namespace))
        except Exception as error:  # the Kubernetes client raises many kinds
            self.error = error
            raise
        return self.annotations


def locate(settings: ConnectorSettings, http_url: str | None) -> tuple[list[Check], Located | None]:
    """The discovery checks and, if they pass, the agent's address."""
    if settings.endpoint is not None:
        reason = f"endpoint {settings.endpoint} given: no pool Service to read"
        return skipped_all(CHECKS, reason), Located(resolve(settings), http_url, None, None, None)
    assert settings.pool is not None
    name = service_name(settings.pool)
    try:
        kube = KubeReader.connect()
    except Exception as error:  # kubernetes.config.ConfigException and what it wraps
        no_credentials = failed(
            SERVICE,
            f"no Kubernetes credentials: {error}",
            "run it in the vLLM pod (kubectl exec POD -- kvpool doctor ...), or point "
            "KUBECONFIG at a kubeconfig",
        )
        return [no_credentials, *skipped_all(CHECKS[1:], "needs the Service")], None
    read = _ServiceRead(kube)
    try:
        address = resolve(settings, read)
        http_port = int_annotation(read.annotations or {}, HTTP_PORT_ANNOTATION, name)
    except DiscoveryError as error:
        if read.annotations is None:
            unread = _unread(str(error), read, settings.pool, kube)
            return [unread, *skipped_all(CHECKS[1:], "needs the Service")], None
        service = _read(read, name, kube)
        if isinstance(error, ProtocolMismatch):
            mismatch = failed(
                PROTOCOL,
                str(error),
                "run one kvpool release in the vLLM image and in the pool's agents (upgrade "
                "the older side): the protocol version is part of the release",
            )
            return [
                service,
                mismatch,
                skipped(ANNOTATIONS, "needs a protocol this client speaks"),
            ], None
        return [
            service,
            _protocol(read.annotations),
            failed(ANNOTATIONS, str(error), _REWRITE_ANNOTATIONS),
        ], None
    assert read.namespace is not None and read.annotations is not None
    http = None if http_port is None else f"http://{name}.{read.namespace}.svc:{http_port}"
    return [
        _read(read, name, kube),
        _protocol(read.annotations),
        passed(ANNOTATIONS, _described(address, http)),
    ], Located(address, http, settings.pool, read.namespace, kube)


_REWRITE_ANNOTATIONS = (
    "the operator writes these annotations from the KVCachePool: compare the Service with "
    "kubectl -n NAMESPACE get service NAME -o yaml, and remove what edits it by hand "
    "(the operator restores its own on the next reconcile)"
)


def _read(read: _ServiceRead, name: str, kube: KubeReader) -> Check:
    return passed(SERVICE, f"read Service {read.namespace}/{name} with {kube.credentials}")


def _protocol(annotations: Mapping[str, str]) -> Check:
    version = annotations.get(PROTOCOL_VERSION_ANNOTATION)
    if version is None:
        return passed(
            PROTOCOL, f"no {PROTOCOL_VERSION_ANNOTATION} annotation: protocol {PROTOCOL_VERSION}"
        )
    return passed(PROTOCOL, f"the Service and this client speak protocol {version}")


def _described(address: AgentAddress, http: str | None) -> str:
    chunks = "not advertised" if address.chunk_tokens is None else f"{address.chunk_tokens}"
    segment = address.segment_path or "from the agent's hello"
    return (
        f"zmq {address.endpoint}, http {http or 'not advertised'}, segment {segment}, "
        f"chunk tokens {chunks}"
    )


def _unread(message: str, read: _ServiceRead, pool: str, kube: KubeReader) -> Check:
    """The Service could not be read: why, and what to do about it."""
    namespace = read.namespace
    if namespace is None:  # resolve() found no namespace before reading
        return failed(SERVICE, message, "pass --namespace: the pool's namespace")
    name = f"{namespace}/{service_name(pool)}"
    why = refusal(read.error) if read.error is not None else None
    if why is not None and why.status == 403:
        return failed(
            SERVICE,
            f"this pod may not get Service {name} ({kube.credentials}): {why.message}",
            grant_service_get(pool, namespace, why.user),
        )
    if why is not None and why.status == 404:
        return failed(
            SERVICE,
            f"no Service {name}",
            f"check the pool's name and namespace (kubectl get kvp -A): the operator makes "
            f"the Service kvpool-<pool> for every KVCachePool in its namespace; "
            f"is the operator running? (kubectl -n {namespace} describe kvp {pool})",
        )
    if why is not None and why.status == 401:
        return failed(
            SERVICE,
            f"the API server refused the credentials ({kube.credentials}): {why.message}",
            "the pod's service account token is missing or expired "
            "(automountServiceAccountToken: true), or the kubeconfig's user is wrong",
        )
    return failed(
        SERVICE,
        message,
        "the API server must be reachable from this pod (a NetworkPolicy may block its "
        "egress), or KUBECONFIG must name a reachable server",
    )
