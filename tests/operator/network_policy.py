"""What NetworkPolicies admit, decided as a network plugin that enforces them decides it
(kubernetes.io/docs/concepts/services-networking/network-policies): a pod that no policy
selects admits everything; a pod that some policies select for ingress admits a connection
to a port if one of their rules lists the port and a peer that matches the source. Only what
the operator renders is evaluated: pod and namespace selectors, numeric TCP ports and port
ranges (``endPort``; a rule without ``from`` or ``ports`` admits every source or port, as
specified).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

Manifest = dict[str, Any]


@dataclass(frozen=True)
class Pod:
    labels: Mapping[str, str]
    namespace: str
    namespace_labels: Mapping[str, str] = field(default_factory=dict)


def selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """Whether a label selector matches ``labels`` (``{}`` matches everything)."""
    if any(labels.get(key) != value for key, value in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", ()):
        key, operator, values = expression["key"], expression["operator"], expression.get("values")
        held = {
            "In": key in labels and labels[key] in (values or ()),
            "NotIn": key not in labels or labels[key] not in (values or ()),
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[operator]
        if not held:
            return False
    return True


def _peer_matches(peer: Mapping[str, Any], policy_namespace: str, source: Pod) -> bool:
    if "namespaceSelector" in peer:
        in_namespace = selects(peer["namespaceSelector"], source.namespace_labels)
    else:
        in_namespace = source.namespace == policy_namespace
    return in_namespace and selects(peer.get("podSelector", {}), source.labels)


def admits(policies: Iterable[Manifest], target: Pod, source: Pod, port: int) -> bool:
    """Whether ``source`` may open a TCP connection to ``port`` of ``target``."""
    isolating = [
        policy
        for policy in policies
        if policy["metadata"]["namespace"] == target.namespace
        and "Ingress" in policy["spec"]["policyTypes"]
        and selects(policy["spec"]["podSelector"], target.labels)
    ]
    if not isolating:
        return True
    return any(
        _rule_admits(rule, policy["metadata"]["namespace"], source, port)
        for policy in isolating
        for rule in policy["spec"].get("ingress", ())
    )


def _port_matches(listed: Mapping[str, Any], port: int) -> bool:
    first = listed["port"]
    return listed["protocol"] == "TCP" and first <= port <= listed.get("endPort", first)


def _rule_admits(rule: Mapping[str, Any], namespace: str, source: Pod, port: int) -> bool:
    """A rule without ports admits every port, one without peers every source."""
    ports, peers = rule.get("ports"), rule.get("from")
    return (not ports or any(_port_matches(listed, port) for listed in ports)) and (
        not peers or any(_peer_matches(peer, namespace, source) for peer in peers)
    )
