"""The placement feed: tier changes and engines' chunk blocks in, vLLM KV events out.

Real trackers written through :class:`TierFeed` (as the agents' subscriber writes them), a
real :class:`PlacementPublisher` on loopback, and every event read back through its replay
and decoded with vLLM's own class.
"""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import pytest
import zmq

from kvpool.index.model_servers import ServerEndpoint
from kvpool.index.placement_events import PlacementPublisher, topic_of
from kvpool.index.placements import PlacementFeed, TierFeed
from kvpool.index.tracker import PrefixTracker
from kvpool.index.vllm_events import END_SEQ

kv_events = pytest.importorskip("vllm.distributed.kv_events")
decoder = msgspec.msgpack.Decoder(type=kv_events.KVEventBatch)

MODEL = "m"
A = topic_of("10.0.0.1", MODEL)
B = topic_of("10.0.0.2", MODEL)
KEYS = [bytes([n]) * 32 for n in range(4)]


def blocks_of(chunk: int) -> list[int]:
    """Two vLLM blocks per chunk: 100 + 2n and 101 + 2n."""
    return [100 + 2 * chunk, 101 + 2 * chunk]


Setup = tuple[PlacementFeed, dict[str, TierFeed], PlacementPublisher]


@pytest.fixture
def setup() -> Iterator[Setup]:
    publisher = PlacementPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    publisher.start()
    trackers = {tier: PrefixTracker() for tier in ("l1", "nvme", "s3")}
    feed = PlacementFeed(publisher, trackers, MODEL)
    sinks = {tier: TierFeed(tier, tracker, feed) for tier, tracker in trackers.items()}
    feed.servers(
        [ServerEndpoint("10.0.0.1:8000", "node-a"), ServerEndpoint("10.0.0.2:8000", "node-b")]
    )
    yield feed, sinks, publisher
    publisher.stop()


def learn(feed: PlacementFeed, chunk: int) -> None:
    parent = None if chunk == 0 else blocks_of(chunk - 1)[-1]
    feed.chunk_blocks(KEYS[chunk], blocks_of(chunk), parent, 16)


def state(publisher: PlacementPublisher) -> dict[tuple[bytes, str], set[int]]:
    """What each topic holds per medium, replaying every batch from seq 0."""
    dealer: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 5000)
    dealer.connect(publisher.bound_replay_endpoint)
    held: dict[tuple[bytes, str], set[int]] = {}
    try:
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        while True:
            _, topic, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                return {where: hashes for where, hashes in held.items() if hashes}
            for event in decoder.decode(payload).events:
                if isinstance(event, kv_events.AllBlocksCleared):
                    held = {where: h for where, h in held.items() if where[0] != topic}
                elif isinstance(event, kv_events.BlockStored):
                    held.setdefault((topic, event.medium), set()).update(event.block_hashes)
                else:
                    held.get((topic, event.medium), set()).difference_update(event.block_hashes)
    finally:
        dealer.close(linger=0)


def test_a_chunk_in_a_nodes_l1_is_published_for_that_nodes_servers_only(setup: Setup) -> None:
    feed, sinks, publisher = setup
    learn(feed, 0)
    learn(feed, 1)
    sinks["l1"].stored("node-a", KEYS[:2])
    assert state(publisher) == {(A, "KVPOOL_L1"): {100, 101, 102, 103}}
    sinks["l1"].removed("node-a", [KEYS[1]])
    assert state(publisher) == {(A, "KVPOOL_L1"): {100, 101}}


def test_a_chunk_stored_before_its_blocks_are_known_is_published_when_they_are(
    setup: Setup,
) -> None:
    feed, sinks, publisher = setup
    sinks["nvme"].stored("node-b", [KEYS[2]])
    assert state(publisher) == {}  # no engine named its blocks yet: nothing to say
    learn(feed, 2)
    assert state(publisher) == {(B, "KVPOOL_NVME"): {104, 105}}


def test_a_chunk_in_s3_is_published_for_every_server(setup: Setup) -> None:
    feed, sinks, publisher = setup
    learn(feed, 3)
    sinks["s3"].stored("node-a", [KEYS[3]])
    assert state(publisher) == {(A, "KVPOOL_S3"): {106, 107}, (B, "KVPOOL_S3"): {106, 107}}


def test_a_resync_publishes_the_difference_and_a_server_that_goes_is_cleared(setup: Setup) -> None:
    feed, sinks, publisher = setup
    for chunk in range(3):
        learn(feed, chunk)
    sinks["l1"].stored("node-a", KEYS[:2])
    sinks["l1"].replace("node-a", [KEYS[0], KEYS[2]])  # a snapshot after a gap
    assert state(publisher) == {(A, "KVPOOL_L1"): {100, 101, 104, 105}}
    feed.servers([ServerEndpoint("10.0.0.2:8000", "node-b")])
    assert state(publisher) == {}


def test_a_new_server_gets_what_its_node_already_holds(setup: Setup) -> None:
    feed, sinks, publisher = setup
    learn(feed, 0)
    sinks["l1"].stored("node-c", [KEYS[0]])  # no server on node-c yet
    assert state(publisher) == {}
    c = ServerEndpoint("10.0.0.3:8000", "node-c")
    feed.servers([ServerEndpoint("10.0.0.1:8000", "node-a"), c])
    assert state(publisher) == {(topic_of("10.0.0.3", MODEL), "KVPOOL_L1"): {100, 101}}
