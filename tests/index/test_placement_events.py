"""The placement publisher on vLLM's wire, read with vLLM's own classes.

Every message is decoded as vLLM's example subscriber decodes the engines' events:
``msgspec.msgpack.Decoder(type=vllm.distributed.kv_events.KVEventBatch)``. A SUB socket
follows the live stream; a DEALER asks for a replay from a sequence number and for a
snapshot, over real sockets on loopback.
"""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import pytest
import zmq
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from kvpool.index.metrics import IndexMetrics
from kvpool.index.placement_events import (
    SNAPSHOT_BATCH_EVENTS,
    SNAPSHOT_REQUEST,
    Block,
    Medium,
    PlacementPublisher,
    topic_of,
)
from kvpool.index.tracker import PrefixTracker
from kvpool.index.vllm_events import END_SEQ
from tests.support.polling import wait_until

kv_events = pytest.importorskip("vllm.distributed.kv_events")
decoder = msgspec.msgpack.Decoder(type=kv_events.KVEventBatch)

TOPIC = topic_of("10.0.0.7", "tiny-llama")
OTHER = topic_of("10.0.0.8", "tiny-llama")
TIMEOUT_MS = 5000


def chain(first: int, count: int, parent: int | None = None, size: int = 16) -> list[Block]:
    blocks = []
    for block_hash in range(first, first + count):
        blocks.append(Block(block_hash, parent, size))
        parent = block_hash
    return blocks


@pytest.fixture
def publisher() -> Iterator[PlacementPublisher]:
    made = PlacementPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", buffer_steps=4)
    made.start()
    yield made
    made.stop()


@pytest.fixture
def sub(publisher: PlacementPublisher) -> Iterator[zmq.Socket[bytes]]:
    socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, b"kv@")
    socket.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    socket.connect(publisher.bound_endpoint)
    yield socket
    socket.close(linger=0)


PROBE = b"kv@probe@none"


def subscribed(publisher: PlacementPublisher, sub: zmq.Socket[bytes]) -> None:
    """Publish probes until the SUB receives one (a PUB drops what precedes a subscription),
    then drain them."""
    sub.setsockopt(zmq.RCVTIMEO, 100)
    try:
        for _ in range(100):
            publisher.stored(PROBE, Medium.L1, [Block(1, None, 16)])
            publisher.cleared(PROBE)
            try:
                sub.recv_multipart()
                break
            except zmq.Again:
                continue
        else:
            pytest.fail("the SUB socket never received the publisher's messages")
        while True:
            sub.recv_multipart()
    except zmq.Again:
        pass
    finally:
        sub.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)


def receive(sub: zmq.Socket[bytes]) -> tuple[bytes, int, object]:
    topic, seq, payload = sub.recv_multipart()
    return topic, int.from_bytes(seq, "big"), decoder.decode(payload)


def ask(publisher: PlacementPublisher, request: bytes) -> list[tuple[bytes, int, object]]:
    dealer: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    dealer.connect(publisher.bound_replay_endpoint)
    try:
        dealer.send_multipart([b"", request])
        answers = []
        while True:
            empty, topic, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                assert topic == payload == b""
                return answers
            answers.append((topic, int.from_bytes(seq, "big"), decoder.decode(payload)))
    finally:
        dealer.close(linger=0)


def test_stores_and_removals_decode_as_vllm_events_with_the_kvpool_medium(
    publisher: PlacementPublisher, sub: zmq.Socket[bytes]
) -> None:
    subscribed(publisher, sub)
    publisher.stored(TOPIC, Medium.L1, chain(100, 3))
    topic, seq, batch = receive(sub)
    assert topic == TOPIC
    (stored,) = batch.events
    assert isinstance(stored, kv_events.BlockStored)
    assert stored.block_hashes == [100, 101, 102] and stored.parent_block_hash is None
    assert stored.medium == "KVPOOL_L1" and stored.block_size == 16 and stored.token_ids == []

    publisher.stored(TOPIC, Medium.L1, chain(100, 3))  # known: nothing new to say
    publisher.removed(TOPIC, Medium.L1, [102, 999])  # 999 was never there
    _, next_seq, batch = receive(sub)
    assert next_seq == seq + 1
    (removed,) = batch.events
    assert isinstance(removed, kv_events.BlockRemoved)
    assert removed.block_hashes == [102] and removed.medium == "KVPOOL_L1"

    publisher.cleared(TOPIC)
    _, _, batch = receive(sub)
    assert [type(event) for event in batch.events] == [kv_events.AllBlocksCleared]


def test_a_chain_with_a_gap_is_stored_as_one_event_per_run(
    publisher: PlacementPublisher, sub: zmq.Socket[bytes]
) -> None:
    subscribed(publisher, sub)
    blocks = [*chain(1, 2), *chain(10, 2, parent=5)]
    publisher.stored(TOPIC, Medium.NVME, blocks)
    _, _, batch = receive(sub)
    assert [(event.block_hashes, event.parent_block_hash) for event in batch.events] == [
        ([1, 2], None),
        ([10, 11], 5),
    ]


def test_a_replay_returns_the_buffered_batches_from_a_seq(
    publisher: PlacementPublisher,
) -> None:
    for n in range(6):  # the buffer keeps the last four
        publisher.stored(TOPIC, Medium.L1, [Block(n, None, 16)])
    answers = ask(publisher, (3).to_bytes(8, "big"))
    assert [seq for _, seq, _ in answers] == [3, 4, 5]
    assert [batch.events[0].block_hashes for _, _, batch in answers] == [[3], [4], [5]]
    assert [seq for _, seq, _ in ask(publisher, (0).to_bytes(8, "big"))] == [2, 3, 4, 5]


def test_a_snapshot_then_the_stream_from_its_resume_seq_rebuilds_the_state(
    publisher: PlacementPublisher, sub: zmq.Socket[bytes]
) -> None:
    publisher.stored(TOPIC, Medium.L1, chain(1, 3))
    publisher.stored(TOPIC, Medium.S3, chain(1, 2))
    publisher.stored(OTHER, Medium.L1, chain(50, 2))
    publisher.removed(TOPIC, Medium.L1, [3])
    subscribed(publisher, sub)

    answers = ask(publisher, SNAPSHOT_REQUEST)
    resume = publisher.seq
    assert {seq for _, seq, _ in answers} == {resume}
    state: dict[tuple[bytes, str], set[int]] = {}
    for topic, _, batch in answers:
        for event in batch.events:
            if isinstance(event, kv_events.AllBlocksCleared):
                for key in [key for key in state if key[0] == topic]:
                    del state[key]
            else:
                state.setdefault((topic, event.medium), set()).update(event.block_hashes)
    assert state == {
        (TOPIC, "KVPOOL_L1"): {1, 2},
        (TOPIC, "KVPOOL_S3"): {1, 2},
        (OTHER, "KVPOOL_L1"): {50, 51},
    }
    publisher.removed(OTHER, Medium.L1, [51])
    topic, seq, batch = receive(sub)
    assert (topic, seq) == (OTHER, resume)  # the live stream goes on from the resume seq
    assert batch.events[0].block_hashes == [51]


def test_a_large_snapshot_comes_in_bounded_batches(publisher: PlacementPublisher) -> None:
    count = 2 * SNAPSHOT_BATCH_EVENTS + 5
    publisher.stored(TOPIC, Medium.L1, [Block(n, n + 10**9, 16) for n in range(count)])
    answers = ask(publisher, SNAPSHOT_REQUEST)
    assert len(answers) == 3
    assert all(len(batch.events) <= SNAPSHOT_BATCH_EVENTS for _, _, batch in answers)
    stored = [e for _, _, b in answers for e in b.events if isinstance(e, kv_events.BlockStored)]
    assert sum(len(event.block_hashes) for event in stored) == count


def test_malformed_requests_are_ignored_and_the_publisher_keeps_serving(
    publisher: PlacementPublisher,
) -> None:
    context = zmq.Context.instance()
    rogue: zmq.Socket[bytes] = context.socket(zmq.DEALER)
    rogue.connect(publisher.bound_replay_endpoint)
    rogue.send_multipart([b"", b"x" * 5])  # neither a seq nor "snapshot"
    rogue.send_multipart([b"", b"a", b"b"])  # three frames after the envelope
    rogue.send_multipart([b"", b"y" * 10_000])  # past the request size: disconnected
    rogue.close(linger=1000)
    publisher.stored(TOPIC, Medium.L1, [Block(7, None, 16)])
    answers = ask(publisher, (0).to_bytes(8, "big"))
    assert [batch.events[0].block_hashes for _, _, batch in answers] == [[7]]
    # the oversized one never reached the publisher (ZMQ dropped the connection)
    wait_until(lambda: publisher.status().requests["malformed"] == 2)
    assert publisher.status().requests == {"replay": 1, "snapshot": 0, "malformed": 2}


def test_the_index_metrics_count_batches_requests_and_placements(
    publisher: PlacementPublisher,
) -> None:
    metrics = IndexMetrics(CollectorRegistry(), PrefixTracker(), lambda: [])
    metrics.register_placements(publisher.status)
    publisher.stored(TOPIC, Medium.L1, chain(100, 3))
    publisher.stored(OTHER, Medium.NVME, chain(200, 2))
    publisher.removed(TOPIC, Medium.L1, [102])
    assert len(ask(publisher, SNAPSHOT_REQUEST)) == 2  # a batch per topic
    scraped = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(metrics.exposition()[0].decode())
        for sample in family.samples
    }
    assert scraped[("kvpool_index_placement_event_batches_total", ())] == 3
    assert scraped[("kvpool_index_placement_event_batches_dropped_total", ())] == 0
    requests = "kvpool_index_placement_event_requests_total"
    assert scraped[(requests, (("kind", "snapshot"),))] == 1
    assert scraped[(requests, (("kind", "replay"),))] == 0
    assert scraped[("kvpool_index_placements", (("medium", "KVPOOL_L1"),))] == 2
    assert scraped[("kvpool_index_placements", (("medium", "KVPOOL_NVME"),))] == 2
    assert scraped[("kvpool_index_placements", (("medium", "KVPOOL_S3"),))] == 0
    assert scraped[("kvpool_index_placement_topics", ())] == 2


def test_a_publisher_connects_to_a_router_that_binds_its_sub() -> None:
    sub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    publisher = PlacementPublisher(f"tcp://127.0.0.1:{port}", connect=True)
    publisher.start()
    try:
        subscribed(publisher, sub)
        publisher.stored(TOPIC, Medium.L1, [Block(9, None, 16)])
        topic, _, batch = receive(sub)
        assert topic == TOPIC and batch.events[0].block_hashes == [9]
    finally:
        publisher.stop()
        sub.close(linger=0)


def test_an_endpoint_in_use_is_one_line() -> None:
    first = PlacementPublisher("tcp://127.0.0.1:0")
    first.start()
    try:
        second = PlacementPublisher(first.bound_endpoint)
        with pytest.raises(OSError, match="placement events"):
            second.start()
    finally:
        first.stop()
