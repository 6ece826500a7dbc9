"""Which vLLM blocks each model server can load from kvpool: the placement events' source.

Three things the index already follows meet here:

* the tiers (the agents' chunk events, per node for L1 and NVMe, pool-wide for S3), seen
  through :class:`TierFeed` sinks that forward every change to the trackers and here;
* the engines' KV events (:mod:`~kvpool.index.engine_events`), which tell, for each chunk
  key a server's blocks complete, the vLLM block hashes that chunk is made of
  (:meth:`PlacementFeed.chunk_blocks`, kept for ``max_chunks`` keys, the oldest going
  first);
* the model servers and their nodes (:meth:`PlacementFeed.servers`).

A server can load a chunk from its own node's L1 or NVMe, and from S3 wherever it runs;
for each such chunk whose blocks are known the :class:`~kvpool.index.placement_events.
PlacementPublisher` says so on the server's topic. A chunk the agents store before any
engine's events named its blocks is published when they do; a chunk whose blocks were
never seen by an engine that publishes KV events (or were forgotten) is not published:
routers could not match it to anything anyway. Chunks another node holds (the peer tier)
are not published per server: every server could load them, and a router would learn
nothing from it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence

from kvpool.index.model_servers import ServerEndpoint
from kvpool.index.placement_events import Block, Medium, PlacementPublisher, topic_of
from kvpool.index.tracker import PrefixTracker
from kvpool.index.vllm_events import BlockHash

MEDIA = {"l1": Medium.L1, "nvme": Medium.NVME, "s3": Medium.S3}
POOL_WIDE = frozenset({"s3"})
DEFAULT_MAX_CHUNKS = 200_000
"""Chunk keys whose vLLM blocks are kept (about 250 bytes each at 16 blocks a chunk)."""


class PlacementFeed:
    """Turn tier changes and engines' chunk blocks into placement events.

    Thread safety: every method may be called from any thread (the agents' subscriber,
    the engines' follower, discovery); one lock guards the mapping and the servers.
    """

    def __init__(
        self,
        publisher: PlacementPublisher,
        trackers: Mapping[str, PrefixTracker],
        model: str,
        *,
        max_chunks: int = DEFAULT_MAX_CHUNKS,
    ) -> None:
        """``trackers``: the tiers by name (``l1``, ``nvme``, ``s3``); ``model``: the name
        the topics carry (the served model's)."""
        self.publisher = publisher
        self._trackers = {tier: trackers[tier] for tier in MEDIA if tier in trackers}
        self._model = model
        self._max_chunks = max_chunks
        self._lock = threading.Lock()
        self._blocks: OrderedDict[bytes, tuple[Block, ...]] = OrderedDict()
        self._nodes: dict[str, list[bytes]] = {}
        """Node -> the topics of the servers on it."""

    # ------------------------------------------------------------- the engines

    def chunk_blocks(
        self, key: bytes, hashes: Sequence[BlockHash], parent: BlockHash | None, size: int
    ) -> None:
        """An engine's events named the blocks of chunk ``key`` (an
        :data:`~kvpool.index.engine_events.chains.ChunkBlocks`)."""
        blocks = []
        for block_hash in hashes:
            blocks.append(Block(block_hash, parent, size))
            parent = block_hash
        with self._lock:
            known = key in self._blocks
            self._blocks[key] = tuple(blocks)
            self._blocks.move_to_end(key)
            while len(self._blocks) > self._max_chunks:
                self._blocks.popitem(last=False)
        if known:
            return
        for tier, tracker in self._trackers.items():
            nodes = tracker.holders(key)
            for topic in self._topics(tier, nodes) if nodes else ():
                self.publisher.stored(topic, MEDIA[tier], blocks)

    # --------------------------------------------------------------- servers

    def servers(self, servers: Sequence[ServerEndpoint]) -> None:
        """The model servers now (discovery's whole list): a server gone is cleared, a
        new one gets what its node and S3 hold."""
        nodes: dict[str, list[bytes]] = {}
        for server in servers:
            host = server.address.rpartition(":")[0].strip("[]")
            nodes.setdefault(server.node, []).append(topic_of(host, self._model))
        with self._lock:
            before = {topic for topics in self._nodes.values() for topic in topics}
            self._nodes = nodes
        now = {topic for topics in nodes.values() for topic in topics}
        for topic in before - now:
            self.publisher.cleared(topic)
        for node, topics in nodes.items():
            for topic in topics:
                if topic in before:
                    continue
                for tier, tracker in self._trackers.items():
                    keys = tracker.keys_of(node) if tier not in POOL_WIDE else _all(tracker)
                    self.publisher.stored(topic, MEDIA[tier], self._blocks_of(keys))

    # ----------------------------------------------------------------- tiers

    def stored(self, tier: str, node: str, keys: Iterable[bytes]) -> None:
        blocks = self._blocks_of(keys)
        if blocks:
            for topic in self._topics(tier, [node]):
                self.publisher.stored(topic, MEDIA[tier], blocks)

    def removed(self, tier: str, node: str, keys: Iterable[bytes]) -> None:
        """Gone from the tier on ``node`` (from S3: gone for every server)."""
        hashes = [block.block_hash for block in self._blocks_of(keys)]
        if hashes:
            for topic in self._topics(tier, [node]):
                self.publisher.removed(topic, MEDIA[tier], hashes)

    def replaced(self, tier: str, node: str) -> None:
        """The tier's keys of ``node`` were replaced (a resync, or the node left)."""
        tracker = self._trackers[tier]
        for topic in self._topics(tier, [node]):
            keys = _all(tracker) if tier in POOL_WIDE else tracker.keys_of(node)
            self.publisher.replace(topic, MEDIA[tier], self._blocks_of(keys))

    def _topics(self, tier: str, nodes: Iterable[str]) -> list[bytes]:
        with self._lock:
            if tier in POOL_WIDE:
                return [topic for topics in self._nodes.values() for topic in topics]
            return [topic for node in nodes for topic in self._nodes.get(node, ())]

    def _blocks_of(self, keys: Iterable[bytes]) -> list[Block]:
        with self._lock:
            return [block for key in keys for block in self._blocks.get(key, ())]


def _all(tracker: PrefixTracker) -> list[bytes]:
    return [key for node in tracker.counts() for key in tracker.keys_of(node)]


class TierFeed:
    """An :class:`~kvpool.index.subscriber.IndexSink` that writes one tier's tracker and
    tells the :class:`PlacementFeed` what changed."""

    def __init__(self, tier: str, tracker: PrefixTracker, feed: PlacementFeed) -> None:
        self._tier = tier
        self._tracker = tracker
        self._feed = feed

    def stored(self, node: str, keys: Sequence[bytes]) -> None:
        self._tracker.stored(node, keys)
        self._feed.stored(self._tier, node, keys)

    def removed(self, node: str, keys: Iterable[bytes]) -> None:
        keys = list(keys)
        self._tracker.removed(node, keys)
        self._feed.removed(self._tier, node, keys)

    def replace(self, node: str, keys: Iterable[bytes]) -> None:
        self._tracker.replace(node, keys)
        self._feed.replaced(self._tier, node)

    def drop_node(self, node: str) -> None:
        self._tracker.drop_node(node)
        self._feed.replaced(self._tier, node)
