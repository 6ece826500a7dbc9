"""Who this agent's peers are: the static list of its configuration, or the pool's agent
pods (:class:`~kvpool.common.kube.discovery.KubernetesDiscovery`, as the index finds them).

This agent's own entry is skipped by node name. A peer whose address changes (its
pod was replaced) gets a new :class:`~kvpool.agent.peer.links.PeerLink`; one that
leaves has its connections closed.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Iterable

from kvpool.agent.peer.links import LinkSettings, PeerLink
from kvpool.common.config import PEER_AGENT, PeersConfig
from kvpool.common.kube.discovery import KubernetesDiscovery
from kvpool.common.names import NODE_NAME_ENV

log = logging.getLogger(__name__)


def node_name(config: PeersConfig) -> str:
    """This agent's name among its peers: configured, else $NODE_NAME, else the host name."""
    return config.node or os.environ.get(NODE_NAME_ENV) or socket.gethostname()


class PeerDirectory:
    def __init__(self, config: PeersConfig, settings: LinkSettings) -> None:
        self.config = config
        self.settings = settings
        self._links: dict[str, PeerLink] = {}
        self._lock = threading.Lock()
        self._discovery: KubernetesDiscovery | None = None

    def links(self) -> list[PeerLink]:
        with self._lock:
            return list(self._links.values())

    def start(self) -> None:
        """Static peers at once; pods as the discovery lists them (:class:`ValueError` where
        there is no Kubernetes API to ask)."""
        if self.config.discovery == "static":
            self.replace(_static(self.config.agents))
            return
        self._discovery = KubernetesDiscovery.connect(self.settings.pool, self.config.namespace)
        self._discovery.start(
            lambda endpoints: self.replace(
                (e.node, e.peer) for e in endpoints if e.peer is not None
            )
        )

    def stop(self) -> None:
        if self._discovery is not None:
            self._discovery.stop()
        self.replace(())

    def replace(self, peers: Iterable[tuple[str, str]]) -> None:
        """The peers are now ``(node, HOST:PORT)`` each (this agent's own skipped)."""
        wanted = {node: address for node, address in peers if node != self.settings.node}
        with self._lock:
            gone = [link for node, link in self._links.items() if wanted.get(node) != link.address]
            for link in gone:
                del self._links[link.node]
            for node, address in wanted.items():
                if node not in self._links:
                    self._links[node] = PeerLink(node, address, self.settings)
            names = sorted(self._links)
        for link in gone:
            link.close()
        log.info("peers: %s", ", ".join(names) or "none")


def _static(agents: Iterable[str]) -> list[tuple[str, str]]:
    found = []
    for agent in agents:
        match = PEER_AGENT.fullmatch(agent)
        assert match is not None  # the configuration checked it
        found.append((match[1], f"{match[2]}:{match[3]}"))
    return found
