"""This agent's part in its pool's peer tier, built from the ``peers`` configuration.

:class:`PeerTier` reads the peer credential and binds the peer port at once (so
that a missing key or a port in use stops the agent at start, naming the
setting); :meth:`PeerTier.serve` starts serving once L1 exists and starts
following the peers. Its :attr:`PeerTier.adapter` is the tier the prefetch
reads between NVMe and S3; its :attr:`PeerTier.offers` offer a disaggregated prefill's
chunks to the decode's node.
"""

from __future__ import annotations

import asyncio
import contextlib

from kvpool.agent.l2.base import L2Adapter
from kvpool.agent.l2.buffers import BufferPool
from kvpool.agent.l2.codec import ObjectCodec
from kvpool.agent.peer.adapter import PeerAdapter
from kvpool.agent.peer.directory import PeerDirectory, node_name
from kvpool.agent.peer.index_lookup import IndexLookup
from kvpool.agent.peer.links import LinkSettings, PeerLink
from kvpool.agent.peer.offers import Offers
from kvpool.agent.peer.serving import PeerServer
from kvpool.agent.peer.transport import PeerTransport, TcpTransport
from kvpool.agent.peer.transport_nixl import NixlTransport
from kvpool.agent.service.data_service import DataService
from kvpool.common.api_models import Peers, PeerServing, PeerState
from kvpool.common.config import AgentConfig, PeersConfig
from kvpool.common.keyring import Keyring
from kvpool.common.problems import listening


class PeerTier:
    def __init__(self, config: AgentConfig, transport: PeerTransport | None = None) -> None:
        """:class:`~kvpool.common.keyring.KeyringError` without a usable peer key;
        :class:`~kvpool.common.problems.ConfigError` if the port cannot be had."""
        assert config.peers is not None
        self.config: PeersConfig = config.peers
        self.pool = config.pool
        self.node = node_name(self.config)
        self.keyring = Keyring(self.config.key_dir, what="peer key")
        sealed = self.config.wire_protection == "sealed"
        self.codec = ObjectCodec(
            self.keyring, config.pool, seal=sealed, buffers=BufferPool(), aegis=True
        )
        self.transport = transport or (
            NixlTransport(self.node) if self.config.transport == "nixl" else TcpTransport()
        )
        with listening("peers.port", config.host, self.config.port):
            self.listener = self.transport.listen(
                config.host, self.config.port, self.config.io_timeout_seconds
            )
        settings = LinkSettings(
            pool=config.pool,
            node=self.node,
            keyring=self.keyring,
            codec=self.codec,
            transport=self.transport,
            connect_timeout=self.config.connect_timeout_seconds,
            io_timeout=self.config.io_timeout_seconds,
            max_object_bytes=int(config.l1_size),
            max_requests=self.config.max_transfers,
        )
        self.directory = PeerDirectory(self.config, settings)
        index = self.config.index_url
        self.adapter = PeerAdapter(
            self.directory,
            None
            if index is None
            else IndexLookup(index, self.keyring, config.pool, self.config.io_timeout_seconds),
        )
        self.offers = Offers(self.directory)
        self.server: PeerServer | None = None

    def serve(
        self,
        service: DataService,
        nvme: L2Adapter | None,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        """Serve the peers from L1 (and ``nvme``) and start following who they are."""
        self.server = PeerServer(
            self.config,
            self.pool,
            self.node,
            self.keyring,
            self.codec,
            service,
            nvme,
            loop,
            self.listener,
        )
        self.server.start()
        self.directory.start()

    def stop(self) -> None:
        """Stop serving and offering (before L1 goes); the adapter closes with the other
        tiers."""
        self.offers.close()
        if self.server is not None:
            self.server.stop()
        else:
            self.listener.close()

    def state(self, probe: bool = False) -> Peers:
        """What ``GET /v1/peers`` answers; ``probe`` connects to every peer first (blocks)."""
        links = sorted(self.directory.links(), key=lambda link: link.node)
        if probe:
            for link in links:
                with contextlib.suppress(Exception):  # the link records the failure
                    link.probe()
        stats = self.server.stats if self.server is not None else None
        return Peers(
            node=self.node,
            port=self.config.port,
            peers=[_peer_state(link) for link in links],
            serving=PeerServing(
                wire_protection=self.config.wire_protection,
                transport=self.transport.name,
                transport_fallback=self.transport.fallback,
                transfers_in_flight=stats.transfers_in_flight if stats else 0,
                bytes_in_flight=stats.bytes_in_flight if stats else 0,
                max_transfers=self.config.max_transfers,
                max_bytes_in_flight=int(self.config.max_bytes_in_flight),
                bandwidth_bytes_per_second=int(self.config.bandwidth),
                served_chunks=stats.served_chunks if stats else 0,
                served_bytes=stats.served_bytes if stats else 0,
                refused=dict(stats.refused) if stats else {},
            ),
        )


def _peer_state(link: PeerLink) -> PeerState:
    stats = link.stats
    return PeerState(
        node=link.node,
        endpoint=link.address,
        reachable=stats.reachable,
        error=stats.error,
        rtt_ms=stats.rtt_ms,
        fetched_chunks=stats.fetched_chunks,
        fetched_bytes=stats.fetched_bytes,
        failures=sum(stats.failures.values()),
        transport=stats.transport,
    )
