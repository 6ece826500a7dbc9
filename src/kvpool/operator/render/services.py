"""The agents' Service ``kvpool-<pool>`` (``internalTrafficPolicy: Local``), whose
annotations tell the vLLM connector how to reach and use its node's agent, and the pool's
ServiceMonitor ``kvpool-<pool>`` (when ``spec.metrics.serviceMonitor.enabled``)."""

from __future__ import annotations

from typing import Any

from kvpool.common.config import AgentConfig
from kvpool.common.names import (
    APP,
    CHUNK_TOKENS_ANNOTATION,
    HTTP_PORT_ANNOTATION,
    INSTANCE_LABEL,
    NAME_LABEL,
    PROTOCOL_VERSION_ANNOTATION,
    SEGMENT_PATH_ANNOTATION,
    ZMQ_PORT_ANNOTATION,
)
from kvpool.common.protocol import PROTOCOL_VERSION
from kvpool.operator.render.objects import ChildRef, Manifest, Pool, manifest
from kvpool.operator.spec import PoolSpec


def agent_ports(spec: PoolSpec) -> list[tuple[str, int]]:
    """The ports of the pool Service (the agent pods also serve ``events``)."""
    return [("zmq", spec.ports.zmq), ("http", spec.ports.http)]


H2C = "kubernetes.io/h2c"
"""The appProtocol of a port that speaks HTTP/2 over cleartext (gRPC without TLS)."""


def service_ports(
    ports: list[tuple[str, int]], app_protocols: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """Service ports that target the container ports of the same names, each with its
    ``appProtocol`` from ``app_protocols`` (by name) where it has one."""
    protocols = app_protocols or {}
    return [
        {"name": name, "port": port, "targetPort": name, "protocol": "TCP"}
        | ({"appProtocol": protocols[name]} if name in protocols else {})
        for name, port in ports
    ]


def agent_service(pool: Pool, spec: PoolSpec, config: AgentConfig) -> Manifest:
    discovery = {
        ZMQ_PORT_ANNOTATION: str(spec.ports.zmq),
        HTTP_PORT_ANNOTATION: str(spec.ports.http),
        SEGMENT_PATH_ANNOTATION: str(config.resolved_segment_path),
        CHUNK_TOKENS_ANNOTATION: str(spec.chunk_tokens),
        PROTOCOL_VERSION_ANNOTATION: str(PROTOCOL_VERSION),
    }
    return manifest(
        "v1",
        "Service",
        pool,
        pool.service_name,
        annotations=discovery,
        spec={
            "type": "ClusterIP",
            "internalTrafficPolicy": "Local",
            "selector": pool.selector(),
            "ports": service_ports(agent_ports(spec)),
        },
    )


def service_monitor_refs(pool: Pool) -> tuple[ChildRef, ...]:
    return (ChildRef("monitoring.coreos.com/v1", "ServiceMonitor", pool.service_name),)


def service_monitor(pool: Pool, spec: PoolSpec) -> Manifest:
    monitor = spec.metrics.service_monitor
    return manifest(
        "monitoring.coreos.com/v1",
        "ServiceMonitor",
        pool,
        pool.service_name,
        labels=monitor.labels,
        spec={
            # Every Service of the pool: the agents' and the index's both name their port http.
            "selector": {"matchLabels": {NAME_LABEL: APP, INSTANCE_LABEL: pool.name}},
            "endpoints": [{"port": "http", "path": "/metrics", "interval": monitor.interval}],
        },
    )
