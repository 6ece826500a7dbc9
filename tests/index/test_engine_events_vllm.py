"""The GPU tier against a real vLLM engine: its KV events, followed, give kvpool's keys."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator

import pytest

from kvpool.common.keys import ModelFingerprint, chunk_keys
from kvpool.index.engine_events import EngineEvents, EventEndpoint
from kvpool.index.query import PromptKeys
from kvpool.index.tracker import PrefixTracker
from tests.support.engines import Engine, write_model
from tests.support.polling import wait_until

pytestmark = [pytest.mark.process, pytest.mark.engine]

BLOCK = 32  # the CPU attention backend takes multiples of 32
FINGERPRINT = ModelFingerprint("tiny", "float32", "test", chunk_tokens=2 * BLOCK)
ADDRESS = "127.0.0.1:8000"
NUM_BLOCKS = 32
CHUNK = FINGERPRINT.chunk_tokens


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, str]]:
    """A vLLM engine publishing its KV events on a socket of its own (an ipc:// one: vLLM
    binds it, as it binds tcp://*:port in a pod, without listening on the network)."""
    work = tmp_path_factory.mktemp("engine-events")
    with tempfile.TemporaryDirectory(prefix="kv") as short:  # ipc paths: 107 bytes at most
        endpoint = f"ipc://{short}/events"
        settings = {
            "model": str(write_model(work / "model")),
            "block_size": BLOCK,
            "num_blocks": NUM_BLOCKS,  # small, so that a few prompts evict older ones
            "max_model_len": 512,
            "max_num_batched_tokens": 512,
            "kv_events": {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": endpoint,
                "topic": f"kv@{ADDRESS}@tiny",
            },
        }
        started = Engine("events", settings, work / "engine.log").start()
        try:
            started.wait_ready()
            yield started, endpoint
        finally:
            started.stop()


def held(events: EngineEvents[PrefixTracker], tokens: list[int], salt: str | None) -> int:
    match = events.tracker.longest_prefixes(PromptKeys(tokens, salt, FINGERPRINT), [ADDRESS])
    return match[ADDRESS].chunks if ADDRESS in match else 0


def test_the_tracker_holds_the_full_chunks_a_salted_prompt_left_in_the_gpu_cache(
    engine: tuple[Engine, str],
) -> None:
    llm, endpoint = engine
    events = EngineEvents(FINGERPRINT, PrefixTracker())
    events.follow([EventEndpoint(ADDRESS, endpoint)])
    events.start()
    try:
        wait_until(lambda: events.status() and events.status()[0].connected, what="connected")
        time.sleep(0.3)  # the subscription travels after the connection
        prompt = [(7 * i + 3) % 500 + 1 for i in range(5 * FINGERPRINT.chunk_tokens + 7)]
        llm.generate([prompt], salts=["tenant-a"], max_tokens=1)
        wait_until(lambda: held(events, prompt, "tenant-a") == 5, what="5 chunks held")

        expected = chunk_keys(prompt, "tenant-a", FINGERPRINT)
        assert len(expected) == 5
        assert events.tracker.counts()[ADDRESS].chunks == 5
        assert all(ADDRESS in events.tracker.holders(key) for key in expected)
        assert held(events, prompt, "tenant-b") == 0  # another tenant's keys: none
        assert held(events, prompt, None) == 0
        status = events.status()[0]
        assert (status.blocks, status.chunks, status.undecodable, status.unplaced) == (10, 5, 0, 0)

        # A second prompt shares the first two chunks: vLLM stores only its new blocks, under
        # the shared blocks as parents, and the tracker follows the chain across them.
        other = prompt[: 2 * FINGERPRINT.chunk_tokens] + [9] * (2 * FINGERPRINT.chunk_tokens)
        llm.generate([other], salts=["tenant-a"], max_tokens=1)
        wait_until(lambda: held(events, other, "tenant-a") == 4, what="the branch held")
        assert held(events, prompt, "tenant-a") == 5
        assert events.status()[0].chunks == 7
    finally:
        events.stop()


def test_what_the_tracker_says_a_server_holds_is_what_vllm_then_reuses(
    engine: tuple[Engine, str],
) -> None:
    """Prompts that evict each other's blocks from a small GPU cache: the tracker follows
    the removals, and its count for a prompt is the prefix vLLM then serves from cache."""
    llm, endpoint = engine
    events = EngineEvents(FINGERPRINT, PrefixTracker())
    events.follow([EventEndpoint(ADDRESS, endpoint)])
    events.start()
    try:
        wait_until(lambda: events.status() and events.status()[0].connected, what="connected")
        time.sleep(0.3)

        def run(n: int, chunks: int) -> None:
            prompt = [(11 * i + 5 * n) % 900 + 1 for i in range(chunks * CHUNK + 7)]
            llm.generate([prompt], salts=["t"], max_tokens=1)
            wait_until(lambda: held(events, prompt, "t") == chunks, what=f"prompt {n} held")

        first = [(11 * i + 5) % 900 + 1 for i in range(5 * CHUNK + 7)]
        run(1, 5)
        for n in range(2, 20):  # newer prompts until they evict some of the first one's tail
            run(n, 5 if n < 4 else 1)
            if held(events, first, "t") < 5:
                break
        predicted = held(events, first, "t")
        assert 0 < predicted < 5, f"the first prompt should be partly evicted: {predicted}"
        assert events.status()[0].unplaced == 0
        reused = llm.generate([first], salts=["t"], max_tokens=1).cached[0]
        assert reused // CHUNK == predicted, (reused, predicted)
    finally:
        events.stop()
