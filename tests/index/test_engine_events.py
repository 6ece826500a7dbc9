"""The GPU tier's follower against stand-in vLLM publishers over real ZMQ sockets: block
chains to kvpool keys, removals, clears, restarts, gaps and replays, and what a pod
cannot do with what it sends."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import msgspec
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher

from kvpool.common.index_config import ModelServer, PickerConfig
from kvpool.common.keys import ModelFingerprint, chunk_keys, shared_salt
from kvpool.index.engine_events import (
    EngineEvents,
    EngineEventsCollector,
    EngineStatus,
    EventEndpoint,
    event_endpoints,
)
from kvpool.index.query import PromptKeys
from kvpool.index.tracker import PrefixTracker
from tests.support.polling import wait_until

from .vllm_publisher import TOPIC, AllBlocksCleared, BlockRemoved, Publisher, stored

BLOCK = 4
CHUNK = 2 * BLOCK
FINGERPRINT = ModelFingerprint("tiny", "float32", "test", chunk_tokens=CHUNK)
TOKENS = list(range(100, 100 + 6 * CHUNK))  # six chunks, twelve blocks
HASHES = list(range(1, 13))


def blocks(first: int, last: int) -> tuple[list[int], list[int]]:
    """Hashes and tokens of blocks ``first`` to ``last`` (inclusive) of the test prompt."""
    return HASHES[first : last + 1], TOKENS[first * BLOCK : (last + 1) * BLOCK]


class Follower:
    """One EngineEvents following one publisher, and ways to look at what it holds."""

    def __init__(
        self, publisher: Publisher, *, replay_endpoint: str | None = None, **options: object
    ) -> None:
        self.publisher = publisher
        self.address = "10.0.0.1:8000"
        self.events = EngineEvents(FINGERPRINT, PrefixTracker(), **options)  # type: ignore[arg-type]
        self.server = EventEndpoint(
            self.address, publisher.endpoint, replay_endpoint or publisher.replay_endpoint
        )
        self.events.follow([self.server])
        self.events.start()
        publisher.wait_subscribed()
        # The socket subscribes a moment before the loop lists the server in its status.
        wait_until(lambda: len(self.events.status()) == 1, timeout=10, what="followed")

    def status(self) -> EngineStatus:
        return self.events.status()[0]

    def held(self, salt: str | None = None, tokens: Sequence[int] = TOKENS) -> int:
        keys = PromptKeys(tokens, salt, FINGERPRINT)
        match = self.events.tracker.longest_prefixes(keys, [self.address])
        return match[self.address].chunks if self.address in match else 0

    def settle(self, condition: Callable[[], bool], what: str) -> None:
        wait_until(condition, timeout=10, what=what)

    def after(self, seq: int) -> None:
        """Wait until the follower applied (or dropped after) message ``seq``."""

        def applied() -> bool:
            last = self.status().last_seq
            return last is not None and last >= seq

        self.settle(applied, f"message {seq}")


@pytest.fixture
def publisher() -> Iterator[Publisher]:
    made = Publisher()
    yield made
    made.close()


@pytest.fixture
def follower(publisher: Publisher) -> Iterator[Follower]:
    made = Follower(publisher)
    yield made
    made.events.stop()


@pytest.mark.parametrize("as_bytes", [False, True], ids=["int-hashes", "bytes-hashes"])
def test_a_chain_stored_in_several_events_holds_exactly_its_full_chunks_under_its_salt(
    publisher: Publisher, follower: Follower, as_bytes: bool
) -> None:
    def h(value: int) -> int | bytes:
        return value.to_bytes(32, "big") if as_bytes else value

    first, tokens = blocks(0, 2)  # chunk 0 and half of chunk 1
    publisher.publish(stored([h(x) for x in first], None, tokens, block_size=BLOCK, salt="a"))
    follower.settle(lambda: follower.held("a") == 1, "chunk 0 held")
    rest, tokens = blocks(3, 10)  # through chunk 5's first block: chunks 1-4 complete
    publisher.publish(stored([h(x) for x in rest], h(3), tokens, block_size=BLOCK))
    follower.settle(lambda: follower.held("a") == 5, "chunks 0-4 held")

    expected = chunk_keys(TOKENS, "a", FINGERPRINT)[:5]
    tracker = follower.events.tracker
    assert tracker.counts()[follower.address].chunks == 5
    assert all(follower.address in tracker.holders(key) for key in expected)
    assert follower.held("b") == 0 and follower.held(None) == 0  # other salts: nothing
    status = follower.status()
    assert (status.blocks, status.chunks, status.events, status.unplaced) == (11, 5, 2, 0)


def test_a_removed_block_releases_the_chunk_it_is_in_and_a_restore_brings_it_back(
    publisher: Publisher, follower: Follower
) -> None:
    hashes, tokens = blocks(0, 5)
    publisher.publish(stored(hashes, None, tokens, block_size=BLOCK, salt="a"))
    follower.settle(lambda: follower.held("a") == 3, "three chunks")
    publisher.publish(BlockRemoved(block_hashes=[3], medium="GPU"))  # chunk 1's first block
    follower.settle(lambda: follower.held("a") == 1, "chunk 1 released")
    assert follower.events.tracker.counts()[follower.address].chunks == 2  # chunk 2 stays
    publisher.publish(stored([3], 2, TOKENS[2 * BLOCK : 3 * BLOCK], block_size=BLOCK))
    follower.settle(lambda: follower.held("a") == 3, "chunk 1 back")
    # A later block stored under the removed-and-restored chain still places.
    more, tokens = blocks(6, 7)
    publisher.publish(stored(more, 6, tokens, block_size=BLOCK))
    follower.settle(lambda: follower.held("a") == 4, "chunk 3")


def test_removal_of_another_medium_or_group_touches_nothing(
    publisher: Publisher, follower: Follower
) -> None:
    hashes, tokens = blocks(0, 3)
    publisher.publish(stored(hashes, None, tokens, block_size=BLOCK, salt="a"))
    publisher.publish(BlockRemoved(block_hashes=[1, 2, 3, 4], medium="CPU"))
    publisher.publish(BlockRemoved(block_hashes=[1, 2, 3, 4], medium="GPU", group_idx=1))
    follower.after(2)
    assert follower.held("a") == 2


def test_all_blocks_cleared_empties_the_server(publisher: Publisher, follower: Follower) -> None:
    hashes, tokens = blocks(0, 3)
    publisher.publish(stored(hashes, None, tokens, block_size=BLOCK, salt="a"))
    follower.settle(lambda: follower.held("a") == 2, "held")
    publisher.publish(AllBlocksCleared())
    follower.settle(lambda: follower.held("a") == 0, "cleared")
    assert follower.status().clears == 1
    assert follower.events.tracker.counts().get(follower.address) is None
    assert follower.status().blocks == 0


def test_a_restart_of_the_engine_drops_what_it_held(
    publisher: Publisher, follower: Follower
) -> None:
    hashes, tokens = blocks(0, 3)
    publisher.publish(stored(hashes, None, tokens, block_size=BLOCK, salt="a"))
    publisher.publish(stored([99], None, TOKENS[:BLOCK], block_size=BLOCK, salt="z"))
    follower.settle(lambda: follower.held("a") == 2, "held")
    # vLLM restarted: its counter starts over, and it sends no AllBlocksCleared.
    publisher.publish(stored([50, 51], None, TOKENS[:CHUNK], block_size=BLOCK, salt="b"), seq=0)
    follower.settle(lambda: follower.held("b") == 1, "the new process's chunk")
    assert follower.held("a") == 0
    assert follower.status().resets == 1


def test_a_gap_without_replay_drops_the_server_and_later_blocks_under_lost_parents_are_not_placed(
    publisher: Publisher, follower: Follower
) -> None:
    hashes, tokens = blocks(0, 3)
    publisher.publish(stored(hashes, None, tokens, block_size=BLOCK, salt="a"))
    follower.settle(lambda: follower.held("a") == 2, "held")
    more, tokens = blocks(4, 5)
    publisher.publish(stored(more, 4, tokens, block_size=BLOCK), send=False)  # lost
    more, tokens = blocks(6, 7)
    publisher.publish(stored(more, 6, tokens, block_size=BLOCK))
    follower.settle(lambda: follower.status().gaps == 1, "the gap seen")
    follower.after(2)
    status = follower.status()
    assert follower.held("a") == 0 and status.chunks == 0
    assert status.unplaced == 2 and status.drops == 1


def test_a_gap_is_filled_by_vllm_s_replay() -> None:
    publisher = Publisher(replay=True)
    follower = Follower(publisher)
    try:
        hashes, tokens = blocks(0, 3)
        publisher.publish(stored(hashes, None, tokens, block_size=BLOCK, salt="a"))
        follower.settle(lambda: follower.held("a") == 2, "held")
        more, tokens = blocks(4, 5)
        publisher.publish(stored(more, 4, tokens, block_size=BLOCK), send=False)
        publisher.publish(BlockRemoved(block_hashes=[99], medium="GPU"), send=False)
        more, tokens = blocks(6, 7)
        publisher.publish(stored(more, 6, tokens, block_size=BLOCK))
        follower.settle(lambda: follower.held("a") == 4, "the lost chunk replayed")
        status = follower.status()
        assert (status.gaps, status.replays, status.drops, status.last_seq) == (1, 1, 0, 3)
        assert publisher.replay_requests == [1]
    finally:
        follower.events.stop()
        publisher.close()


def test_a_replay_that_does_not_reach_back_drops_the_server() -> None:
    publisher = Publisher(replay=True)
    follower = Follower(publisher)
    try:
        hashes, tokens = blocks(0, 3)
        publisher.publish(stored(hashes, None, tokens, block_size=BLOCK, salt="a"))
        follower.settle(lambda: follower.held("a") == 2, "held")
        publisher.publish(BlockRemoved(block_hashes=[1], medium="GPU"), send=False)
        del publisher.history[-1]  # out of vLLM's replay buffer too
        publisher.publish(stored([60, 61], None, TOKENS[:CHUNK], block_size=BLOCK, salt="b"))
        follower.settle(lambda: follower.status().drops == 1, "dropped")
        follower.settle(lambda: follower.held("b") == 1, "the live message after the gap")
        assert follower.held("a") == 0
    finally:
        follower.events.stop()
        publisher.close()


def test_a_replay_that_brings_nothing_drops_the_server_once() -> None:
    publisher = Publisher(replay=True)
    follower = Follower(publisher)
    try:
        hashes, tokens = blocks(0, 3)
        publisher.publish(stored(hashes, None, tokens, block_size=BLOCK, salt="a"))
        follower.settle(lambda: follower.held("a") == 2, "held")
        publisher.publish(BlockRemoved(block_hashes=[1], medium="GPU"), send=False)
        seq = publisher.publish(
            stored([60, 61], None, TOKENS[:CHUNK], block_size=BLOCK, salt="b"), send=False
        )
        payload = publisher.history[-1][1]
        publisher.history.clear()  # vLLM's buffer holds nothing from the gap on
        publisher.raw([TOPIC, seq.to_bytes(8, "big"), payload])
        follower.settle(lambda: follower.held("b") == 1, "the live message after the gap")
        time.sleep(0.3)
        assert publisher.replay_requests == [1]  # asked once, not again and again
        status = follower.status()
        assert (status.gaps, status.replays, status.drops) == (1, 0, 1)
        assert follower.held("a") == 0
    finally:
        follower.events.stop()
        publisher.close()


def test_blocks_under_an_unknown_parent_are_counted_and_not_placed(
    publisher: Publisher, follower: Follower
) -> None:
    more, tokens = blocks(2, 5)
    publisher.publish(stored(more, 2, tokens, block_size=BLOCK))
    follower.after(0)
    assert follower.status().unplaced == 4
    assert follower.events.tracker.counts().get(follower.address) is None


def test_lora_multimodal_other_groups_and_media_are_not_followed(
    publisher: Publisher, follower: Follower
) -> None:
    hashes, tokens = blocks(0, 1)
    publisher.publish(
        stored(hashes, None, tokens, block_size=BLOCK, lora_name="adapter", lora_id=1),
        stored(hashes, None, tokens, block_size=BLOCK, extra_keys=[("mm-1", 0), None]),
        stored(hashes, None, tokens, block_size=BLOCK, group_idx=1),
        stored(hashes, None, tokens, block_size=BLOCK, medium="CPU"),
        stored(hashes, None, TOKENS[:6], block_size=3),  # blocks that do not divide a chunk
    )
    follower.after(0)
    assert follower.status().skipped == 5 * 2
    assert follower.held(None) == 0


def test_two_tenants_of_a_shared_space_hold_its_chunks_until_both_lose_them(
    publisher: Publisher, follower: Follower
) -> None:
    """vLLM keys the whole structured salt (its blocks differ per tenant), kvpool keys the
    space's chunks under the space: either tenant's blocks hold them for both."""
    salt_a, salt_b = shared_salt("space", CHUNK, "a"), shared_salt("space", CHUNK, "b")
    hashes, tokens = blocks(0, 3)
    publisher.publish(stored(hashes, None, tokens, block_size=BLOCK, salt=salt_a))
    publisher.publish(stored([21, 22, 23, 24], None, tokens, block_size=BLOCK, salt=salt_b))
    follower.settle(lambda: follower.held(salt_a) == 2 and follower.held(salt_b) == 2, "both")
    assert follower.status().chunks == 3  # the space's chunk once, each tenant's own
    assert chunk_keys(TOKENS[:CHUNK], salt_a, FINGERPRINT) == chunk_keys(
        TOKENS[:CHUNK], salt_b, FINGERPRINT
    )
    assert follower.held(shared_salt("space", CHUNK, "c")) == 1  # c of the space gets it
    assert follower.held("space") == 1  # the space's own keys, as kvpool keys them
    publisher.publish(BlockRemoved(block_hashes=[1], medium="GPU"))  # a's space block
    follower.after(2)
    # b's blocks still hold the space's chunk, so a still counts it (vLLM would recompute
    # it for a: its hash differs; kvpool's L1 serves it)
    assert (follower.held(salt_a), follower.held(salt_b), follower.status().chunks) == (2, 2, 3)
    publisher.publish(BlockRemoved(block_hashes=[21], medium="GPU"))  # and b's
    follower.settle(lambda: follower.held(salt_b) == 0, "the space's chunk gone")
    assert follower.held(salt_a) == 0 and follower.held("space") == 0
    assert follower.status().chunks == 2  # each tenant's private chunk


def test_legacy_array_events_are_read(publisher: Publisher, follower: Follower) -> None:
    hashes, tokens = blocks(0, 3)
    legacy = [
        ["BlockStored", hashes, None, tokens, BLOCK, None, "GPU", None, [["a"], None, None, None]],
        ["BlockRemoved", [4], "GPU"],
    ]
    publisher.raw([TOPIC, (0).to_bytes(8, "big"), msgspec.msgpack.encode([1.0, legacy, None])])
    follower.settle(lambda: follower.held("a") == 1, "legacy events applied")
    assert follower.status().events == 2


def test_malformed_messages_are_counted_and_following_goes_on(
    publisher: Publisher, follower: Follower, caplog: pytest.LogCaptureFixture
) -> None:
    hashes, tokens = blocks(0, 1)
    good = msgspec.msgpack.encode(
        [1.0, [{"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
                "token_ids": tokens, "block_size": BLOCK, "extra_keys": [["a"], None]}], None]
    )  # fmt: skip
    publisher.raw([TOPIC, b"\x00" * 8])  # two frames
    for frames in range(4, 40):  # a flood, each different: logged once, with a fixed text
        publisher.raw([TOPIC] * frames)
    publisher.raw([TOPIC, b"\x01", good])  # a short sequence number
    publisher.raw([TOPIC, (0).to_bytes(8, "big"), b"\xc1garbage"])  # not msgpack
    publisher.raw([TOPIC, (1).to_bytes(8, "big"), msgspec.msgpack.encode({"a": 1})])
    unknown = {"type": "BlockMoved", "block_hashes": [1]}
    bad_tokens = {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None,
                  "token_ids": [-1, 2**40, 0, 0], "block_size": BLOCK}  # fmt: skip
    batch = [1.0, [unknown, bad_tokens, msgspec.msgpack.decode(good)[1][0]], None]
    publisher.raw([TOPIC, (2).to_bytes(8, "big"), msgspec.msgpack.encode(batch)])
    follower.settle(lambda: follower.held("a") == 1, "the good event applied")
    status = follower.status()
    assert status.undecodable == 6 + 36
    assert status.events == 1
    floods = [r for r in caplog.records if "a message not of 3 frames" in r.getMessage()]
    assert len(floods) == 1


def test_an_oversized_message_is_refused_and_the_follower_goes_on() -> None:
    publisher = Publisher()
    follower = Follower(publisher, max_message_bytes=4096)
    try:
        publisher.raw([TOPIC, (0).to_bytes(8, "big"), b"\x90" + b"x" * 10_000])
        follower.settle(lambda: follower.status().drops >= 1, "disconnected")
        publisher.wait_subscribed()  # ZMQ reconnects
        hashes, tokens = blocks(0, 1)
        publisher.publish(stored(hashes, None, tokens, block_size=BLOCK, salt="a"), seq=1)
        follower.settle(lambda: follower.held("a") == 1, "following again")
    finally:
        follower.events.stop()
        publisher.close()


def test_the_cap_forgets_the_oldest_blocks_and_releases_their_chunks() -> None:
    publisher = Publisher()
    follower = Follower(publisher, max_blocks_per_server=4)
    try:
        hashes, tokens = blocks(0, 3)
        publisher.publish(stored(hashes, None, tokens, block_size=BLOCK, salt="a"))
        follower.settle(lambda: follower.held("a") == 2, "held")
        publisher.publish(stored([30, 31], None, TOKENS[:CHUNK], block_size=BLOCK, salt="b"))
        follower.settle(lambda: follower.held("b") == 1, "b held")
        assert follower.held("a") == 0  # blocks 0 and 1 forgotten: chunk 0 released
        status = follower.status()
        assert (status.capped, status.blocks, status.chunks) == (2, 4, 2)
    finally:
        follower.events.stop()
        publisher.close()


def test_a_server_no_longer_followed_has_its_chunks_dropped(
    publisher: Publisher, follower: Follower
) -> None:
    hashes, tokens = blocks(0, 1)
    publisher.publish(stored(hashes, None, tokens, block_size=BLOCK, salt="a"))
    follower.settle(lambda: follower.held("a") == 1, "held")
    follower.events.follow([])
    follower.settle(lambda: not follower.events.status(), "unfollowed")
    assert follower.events.tracker.counts() == {}


def test_a_server_that_publishes_only_its_own_gpu_cannot_touch_another_server() -> None:
    """Two pods; one sends a removal and a clear: only its own node changes."""
    honest, liar = Publisher(), Publisher()
    events = EngineEvents(FINGERPRINT, PrefixTracker())
    events.follow(
        [
            EventEndpoint("10.0.0.1:8000", honest.endpoint),
            EventEndpoint("10.0.0.2:8000", liar.endpoint),
        ]
    )
    events.start()
    try:
        honest.wait_subscribed()
        liar.wait_subscribed()
        hashes, tokens = blocks(0, 3)
        honest.publish(stored(hashes, None, tokens, block_size=BLOCK, salt="a"))
        liar.publish(stored(hashes, None, tokens, block_size=BLOCK, salt="a"))
        liar.publish(BlockRemoved(block_hashes=list(hashes), medium="GPU"), AllBlocksCleared())
        time.sleep(0.2)
        wait_until(lambda: all(s.last_seq == (0 if s.address.endswith("1:8000") else 1)
                               for s in events.status()), what="both applied")  # fmt: skip
        keys = PromptKeys(TOKENS, "a", FINGERPRINT)
        assert set(events.tracker.longest_prefixes(keys)) == {"10.0.0.1:8000"}
    finally:
        events.stop()
        honest.close()
        liar.close()


def test_a_bad_endpoint_is_logged_and_not_followed(caplog: pytest.LogCaptureFixture) -> None:
    events = EngineEvents(FINGERPRINT, PrefixTracker())
    events.follow([EventEndpoint("10.0.0.1:8000", "nonsense")])
    events.start()
    try:
        wait_until(lambda: "kv_events 'nonsense' is not a ZMQ endpoint" in caplog.text)
        assert events.status() == []
    finally:
        events.stop()


def test_the_metrics_say_what_the_status_says(publisher: Publisher, follower: Follower) -> None:
    hashes, tokens = blocks(0, 3)
    publisher.publish(stored(hashes, None, tokens, block_size=BLOCK, salt="a"))
    publisher.publish(stored([7], 70, TOKENS[:BLOCK], block_size=BLOCK))  # unknown parent
    follower.after(1)
    registry = CollectorRegistry()
    registry.register(EngineEventsCollector(follower.events.status))
    text = generate_latest(registry).decode()
    server = f'server="{follower.address}"'
    for line in (
        f"kvpool_index_gpu_connected{{{server}}} 1.0",
        f"kvpool_index_gpu_blocks{{{server}}} 4.0",
        f"kvpool_index_gpu_chunks{{{server}}} 2.0",
        f"kvpool_index_gpu_last_seq{{{server}}} 1.0",
        f"kvpool_index_gpu_events_total{{{server}}} 2.0",
        f'kvpool_index_gpu_blocks_not_followed_total{{reason="unplaced",{server}}} 1.0',
    ):
        assert line in text, line


def test_a_chain_whose_blocks_do_not_line_up_with_chunks_holds_nothing(
    publisher: Publisher, follower: Follower
) -> None:
    """Block sizes that change mid-chain make blocks straddle a chunk's start: no key is
    made from tokens that are not exactly the chunk's."""
    publisher.publish(stored([1], None, TOKENS[:4], block_size=4, salt="a"))
    publisher.publish(stored([2], 1, TOKENS[4:12], block_size=8))
    publisher.publish(stored([3], 2, TOKENS[12:16], block_size=4))
    follower.after(2)
    status = follower.status()
    assert (status.blocks, status.chunks) == (3, 0)


def test_a_gap_is_filled_by_the_replay_of_vllm_s_own_publisher() -> None:
    """vLLM's ZmqEventPublisher answers the replay (its ROUTER, its framing); the live
    stream is a stand-in that skips the middle batches."""
    with tempfile.TemporaryDirectory(prefix="kv") as short:  # ipc paths: 107 bytes at most
        replay_from_vllm(Path(short))


def replay_from_vllm(directory: Path) -> None:
    hashes, tokens = blocks(0, 7)
    batches = [
        stored(hashes[:2], None, tokens[: 2 * BLOCK], block_size=BLOCK, salt="a"),
        *(
            stored(
                [hashes[i]], hashes[i - 1], tokens[i * BLOCK : (i + 1) * BLOCK], block_size=BLOCK
            )
            for i in range(2, 8)
        ),
    ]
    vllm = ZmqEventPublisher(
        0, endpoint=f"ipc://{directory}/live", replay_endpoint=f"ipc://{directory}/replay"
    )
    live = Publisher()
    try:
        for event in batches:
            vllm.publish(KVEventBatch(ts=time.time(), events=[event]))
        # its publishing thread buffers them for replay (a private deque: no other way to know)
        wait_until(lambda: len(vllm._buffer) == len(batches), what="vLLM buffered them")
        follower = Follower(live, replay_endpoint=f"ipc://{directory}/replay")
        try:
            live.publish(batches[0])
            live.publish(batches[-1], seq=len(batches) - 1)  # 1 to 5 lost on the way
            follower.settle(lambda: follower.held("a") == 4, "replayed from vLLM")
            status = follower.status()
            assert (status.gaps, status.replays, status.drops) == (1, 1, 0)
        finally:
            follower.events.stop()
    finally:
        live.close()
        vllm.shutdown()


def test_the_event_endpoints_of_discovered_servers() -> None:
    static = PickerConfig(
        servers=[
            ModelServer(address="10.0.0.1:8000", node="a", kv_events="tcp://10.0.0.1:5557"),
            ModelServer(
                address="10.0.0.2:8000",
                node="b",
                kv_events="tcp://10.0.0.2:5557",
                kv_events_replay="tcp://10.0.0.2:5558",
            ),
            ModelServer(address="10.0.0.3:8000", node="c"),  # no KV events: no GPU tier
        ]
    )
    found = event_endpoints(["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"], static)
    assert found == [
        EventEndpoint("10.0.0.1:8000", "tcp://10.0.0.1:5557"),
        EventEndpoint("10.0.0.2:8000", "tcp://10.0.0.2:5557", "tcp://10.0.0.2:5558"),
    ]
    assert event_endpoints(["10.0.0.9:8000"], static) == []  # not listed
    pods = PickerConfig(discovery="kubernetes", kv_events_port=5557, kv_events_replay_port=5558)
    assert event_endpoints(["10.1.0.4:8000", "[fd00::4]:8000"], pods) == [
        EventEndpoint("10.1.0.4:8000", "tcp://10.1.0.4:5557", "tcp://10.1.0.4:5558"),
        EventEndpoint("[fd00::4]:8000", "tcp://[fd00::4]:5557", "tcp://[fd00::4]:5558"),
    ]
    assert event_endpoints(["10.1.0.4:8000"], PickerConfig(discovery="kubernetes")) == []
