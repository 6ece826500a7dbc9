"""Where the pool's agents are: a static list, or the pool's agent pods in Kubernetes (for
the prefix index, and for each agent's peers).

A discovery calls ``on_change`` with the complete list of agents whenever it
changes (:meth:`~kvpool.index.subscriber.EventSubscriber.follow` takes
it as is). One agent per node: the node name identifies it, in the tracker
and in routing answers.

:class:`KubernetesDiscovery` lists and then watches the pods labelled
``app.kubernetes.io/component=agent,kvpool.io/pool=<pool>`` in one namespace
(it needs ``get``, ``list`` and ``watch`` on pods there). A pod counts while
it is running, has an IP and is not being deleted; its endpoints are
``tcp://<pod IP>:<port>`` for the container ports named ``zmq`` and
``events`` (7400 and 7402 when not named), and ``<pod IP>:<port>`` for ``peer``
(7404). Where two pods sit on one node (a
surge during a rollout), the newer one wins. The list and watch are
:class:`~kvpool.common.kube.watch.ListWatch`'s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from kvpool.common.kube.pods import created, namespace_or_own, placement, pod_lister
from kvpool.common.kube.watch import ListWatch
from kvpool.common.names import (
    DEFAULT_EVENTS_PORT,
    DEFAULT_PEER_PORT,
    DEFAULT_ZMQ_PORT,
    agent_pods_selector,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, order=True)
class AgentEndpoint:
    node: str
    zmq: str
    """The agent's ZMQ protocol endpoint (snapshots), e.g. ``tcp://10.0.0.5:7400``."""
    events: str
    """Its chunk-event PUB endpoint, e.g. ``tcp://10.0.0.5:7402``."""
    peer: str | None = None
    """Where it serves its peers, ``HOST:PORT`` (pods only: the index does not need it)."""

    @classmethod
    def parse(cls, text: str) -> AgentEndpoint:
        """``NODE=ZMQ_ENDPOINT,EVENTS_ENDPOINT``, as ``kvpool-index --agent`` takes it."""
        node, _, endpoints = text.partition("=")
        zmq_endpoint, _, events = endpoints.partition(",")
        if not node or not zmq_endpoint or not events or "," in events:
            raise ValueError(
                f"expected NODE=ZMQ_ENDPOINT,EVENTS_ENDPOINT "
                f"(e.g. gpu-1=tcp://10.0.0.5:7400,tcp://10.0.0.5:7402), got {text!r}"
            )
        return cls(node, zmq_endpoint, events)


EndpointsListener = Callable[[list[AgentEndpoint]], None]
"""Receives every agent of the pool, each time the set changes."""


class Discovery(Protocol):
    def start(self, on_change: EndpointsListener) -> None: ...

    def stop(self) -> None: ...


class StaticDiscovery:
    """A fixed list of agents (local use, tests)."""

    def __init__(self, endpoints: Iterable[AgentEndpoint]) -> None:
        self.endpoints = sorted(endpoints)

    def start(self, on_change: EndpointsListener) -> None:
        on_change(list(self.endpoints))

    def stop(self) -> None:
        """Nothing runs in the background."""


def pod_endpoint(pod: Mapping[str, Any]) -> AgentEndpoint | None:
    """The endpoints of one agent pod (the API's JSON form), or None while it does not count."""
    where = placement(pod)
    if where is None:
        return None
    ports = {
        port.get("name"): port.get("containerPort")
        for container in (pod.get("spec") or {}).get("containers") or []
        for port in container.get("ports") or []
    }
    host = where.host
    return AgentEndpoint(
        where.node,
        f"tcp://{host}:{ports.get('zmq') or DEFAULT_ZMQ_PORT}",
        f"tcp://{host}:{ports.get('events') or DEFAULT_EVENTS_PORT}",
        f"{host}:{ports.get('peer') or DEFAULT_PEER_PORT}",
    )


def endpoints_of(pods: Iterable[Mapping[str, Any]]) -> list[AgentEndpoint]:
    """One endpoint per node, from the newest pod that counts there."""
    newest = sorted(pods, key=created)
    by_node = {
        endpoint.node: endpoint
        for endpoint in (pod_endpoint(pod) for pod in newest)
        if endpoint is not None
    }
    return sorted(by_node.values())


class KubernetesDiscovery:
    def __init__(
        self,
        list_pods: Callable[..., Any],
        namespace: str,
        pool: str,
        *,
        timeout: float = 10.0,
        retry_seconds: float = 2.0,
        watch_seconds: int = 300,
    ) -> None:
        """``list_pods`` is ``CoreV1Api.list_namespaced_pod`` (or a stand-in with its
        signature, called with ``_preload_content=False``)."""
        self.namespace = namespace
        self.pool = pool
        self._published: list[AgentEndpoint] | None = None
        selector = agent_pods_selector(pool)
        self._pods = ListWatch(
            list_pods,
            namespace,
            selectors={"label_selector": selector},
            what=f"pods {selector} in namespace {namespace}",
            timeout=timeout,
            retry_seconds=retry_seconds,
            watch_seconds=watch_seconds,
        )

    @classmethod
    def connect(cls, pool: str, namespace: str | None = None) -> KubernetesDiscovery:
        """Through this pod's service account (in a pod) or the kubeconfig (elsewhere);
        ``namespace`` defaults to this pod's own."""
        list_pods = pod_lister("discover agents with")
        return cls(list_pods, namespace_or_own(namespace, "the index's"), pool)

    @property
    def where(self) -> str:
        return self._pods.what

    def start(self, on_change: EndpointsListener) -> None:
        """List and watch the agent pods; ``on_change`` runs in the watch thread."""
        self._pods.start(
            lambda pods: self._publish(pods.values(), on_change),
            thread_name="kvpool-agents-discovery",
        )

    def stop(self) -> None:
        self._pods.stop()

    def _publish(self, pods: Iterable[Mapping[str, Any]], on_change: EndpointsListener) -> None:
        endpoints = endpoints_of(pods)
        if endpoints != self._published:
            self._published = endpoints
            log.info("agents of pool %s: %s", self.pool, ", ".join(e.node for e in endpoints))
            on_change(endpoints)
