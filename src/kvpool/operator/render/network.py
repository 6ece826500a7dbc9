"""The NetworkPolicies ``kvpool-<pool>-agent`` and, with the index, ``kvpool-<pool>-index``
(when ``spec.networkPolicy.enabled``): they isolate the agent pods and the index pods for
ingress and admit each peer the spec names to the ports it needs, and the pool's own pods
to the ports they use (the index to the agents', the agents to each other's peer port and,
with NIXL, UCX's TCP ports)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvpool.common.names import AGENT_COMPONENT, INDEX_COMPONENT
from kvpool.operator.render.objects import ChildRef, Manifest, Pool, manifest
from kvpool.operator.spec import NetworkPeer, PoolSpec

NETWORK_POLICY_API_VERSION = "networking.k8s.io/v1"


def network_policy_refs(pool: Pool) -> tuple[ChildRef, ...]:
    """The agents' NetworkPolicy and the index's."""
    return tuple(
        ChildRef(NETWORK_POLICY_API_VERSION, "NetworkPolicy", name)
        for name in (pool.agent_name, pool.index_name)
    )


def _peers(peers: tuple[NetworkPeer, ...]) -> list[dict[str, Any]]:
    """The spec's peers as NetworkPolicy peers: each selector as written, ``{}`` included."""
    return [peer.model_dump(mode="json", by_alias=True, exclude_defaults=True) for peer in peers]


def _ingress(
    peers: list[dict[str, Any]], ports: Sequence[int | tuple[int, int]]
) -> list[dict[str, Any]]:
    """One ingress rule admitting ``peers`` to ``ports`` (each a port, or a range: first,
    last); none without peers (a rule without ``from`` would admit every source)."""
    if not peers:
        return []
    return [{"from": peers, "ports": [_port(port) for port in ports]}]


def _port(port: int | tuple[int, int]) -> dict[str, Any]:
    if isinstance(port, int):
        return {"protocol": "TCP", "port": port}
    return {"protocol": "TCP", "port": port[0], "endPort": port[1]}


def _network_policy(
    pool: Pool, component: str, name: str, ingress: list[dict[str, Any]]
) -> Manifest:
    """Isolate a component's pods for ingress (egress stays open) and admit ``ingress``."""
    return manifest(
        NETWORK_POLICY_API_VERSION,
        "NetworkPolicy",
        pool,
        name,
        component=component,
        spec={
            "podSelector": {"matchLabels": pool.selector(component)},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    )


def _pool_pods(pool: Pool, component: str, present: bool) -> list[dict[str, Any]]:
    """The pool's own pods of ``component`` as a peer, where the pool has them."""
    return [{"podSelector": {"matchLabels": pool.selector(component)}}] if present else []


def _peer_ports(spec: PoolSpec) -> list[int | tuple[int, int]]:
    """The peer port, and with NIXL the range UCX listens in over TCP."""
    peers = spec.peers
    if peers.transport != "nixl":
        return [peers.port]
    return [peers.port, (peers.nixl.tcp_ports.first, peers.nixl.tcp_ports.last)]


def network_policies(pool: Pool, spec: PoolSpec) -> tuple[Manifest, ...]:
    """Clients reach the agents' ZMQ and HTTP ports, Prometheus their HTTP port (/metrics),
    the pool's index their ZMQ (snapshots) and events ports, the pool's other agents their
    peer port (with spec.peers; egress stays open, so they reach it); gateways, the
    agents (with spec.peers: their lookups) and Prometheus reach the index's port, and the
    picker's clients (a gateway's proxies) the picker's port (spec.index.picker), which
    nobody else reaches, and the routers its placement events' ports."""
    policy, ports = spec.network_policy, spec.ports
    prometheus = _peers(policy.prometheus)
    index = _pool_pods(pool, INDEX_COMPONENT, spec.index.enabled)
    agents = _pool_pods(pool, AGENT_COMPONENT, spec.peers.enabled)
    agents_policy = _network_policy(
        pool,
        AGENT_COMPONENT,
        pool.agent_name,
        _ingress(_peers(policy.clients), [ports.zmq, ports.http])
        + _ingress(index, [ports.zmq, ports.events])
        + _ingress(agents, _peer_ports(spec))
        + _ingress(prometheus, [ports.http]),
    )
    if not spec.index.enabled:
        return (agents_policy,)
    port = spec.index.port
    ingress = (
        _ingress(_peers(policy.gateways), [port])
        + _ingress(agents, [port])  # which peers hold a prefix
        + _ingress(prometheus, [port])
    )
    picker = spec.index.picker
    if picker.enabled:
        ingress += _ingress(_peers(policy.picker_clients), [picker.port])
        placements = [picker.placement_events_port, picker.placement_events_replay_port]
        if routed := [port for port in placements if port is not None]:  # no ports: all
            ingress += _ingress(_peers(policy.routers), routed)
    return agents_policy, _network_policy(pool, INDEX_COMPONENT, pool.index_name, ingress)
