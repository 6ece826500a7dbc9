"""The tracker: bookkeeping per node, caps, and the verified binary search."""

from __future__ import annotations

import math
import tracemalloc

import pytest

from kvpool.common.keys import ModelFingerprint, chunk_keys, shared_salt
from kvpool.index.query import Query
from kvpool.index.tracker import BATCH_KEYS, NodeCounts, PrefixMatch, PrefixTracker
from tests.support.chunks import chain


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


class CountingChain:
    """A key chain that counts how often the tracker reads a key."""

    def __init__(self, keys: list[bytes]) -> None:
        self.keys = keys
        self.reads = 0

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, position: int) -> bytes:
        self.reads += 1
        return self.keys[position]


def runs(tracker: PrefixTracker, keys: list[bytes]) -> dict[str, int]:
    return {node: match.chunks for node, match in tracker.longest_prefixes(keys).items()}


def test_longest_prefix_per_node_and_only_nodes_with_a_match() -> None:
    clock = Clock()
    tracker = PrefixTracker(clock=clock)
    prompt = chain("prompt", 12)
    tracker.stored("a", prompt)
    tracker.stored("b", prompt[:5])
    tracker.stored("c", chain("other", 12))
    found = tracker.longest_prefixes(prompt)
    assert found == {"a": PrefixMatch(12, 1001.0), "b": PrefixMatch(5, 1002.0)}
    assert tracker.longest_prefixes(prompt, nodes=["b", "c", "unknown"]) == {
        "b": PrefixMatch(5, 1002.0)
    }
    assert tracker.longest_prefixes([]) == {}


def test_tail_removals_shorten_the_match() -> None:
    tracker = PrefixTracker()
    prompt = chain("prompt", 10)
    tracker.stored("a", prompt)
    tracker.removed("a", prompt[6:])
    assert runs(tracker, prompt) == {"a": 6}
    tracker.removed("a", prompt)
    assert runs(tracker, prompt) == {}
    assert tracker.counts()["a"].chunks == 0


def test_an_evicted_middle_chunk_ends_the_match_where_bisection_would_overshoot() -> None:
    tracker = PrefixTracker()
    prompt = chain("prompt", 32)
    for start in range(0, 32, 8):  # four stored events: four batches
        tracker.stored("a", prompt[start : start + 8])
    # Galloping probes 1, 3, 7, 15, 31: all held, so bisection alone would say 32.
    tracker.removed("a", [prompt[9]])
    assert runs(tracker, prompt) == {"a": 9}
    tracker.removed("a", [prompt[2]])
    assert runs(tracker, prompt) == {"a": 2}


def test_a_stored_run_with_a_gap_vouches_for_nothing_it_skipped() -> None:
    """An agent publishes only the chunks it newly stored: a batch may skip chain positions."""
    tracker = PrefixTracker()
    prompt = chain("prompt", 5)
    tracker.stored("a", prompt[:2])
    tracker.stored("a", prompt[3:])
    assert runs(tracker, prompt) == {"a": 2}
    # An intact batch of positions 1, 3, 4: it must not vouch for position 2.
    tracker.stored("a", [prompt[1], prompt[3], prompt[4]])
    assert runs(tracker, prompt) == {"a": 2}
    tracker.stored("a", [prompt[2]])
    assert runs(tracker, prompt) == {"a": 5}


def test_the_cap_drops_the_oldest_batches_and_a_headless_chain_matches_nothing() -> None:
    tracker = PrefixTracker(max_chunks_per_node=6)
    prompt = chain("prompt", 8)
    tracker.stored("a", prompt[:4])
    tracker.stored("a", prompt[4:])  # over the cap: the older batch (the head) goes
    counts = tracker.counts()["a"]
    assert (counts.chunks, counts.cap_evicted) == (4, 4)
    assert tracker.holders(prompt[0]) == {} and "a" in tracker.holders(prompt[7])
    assert runs(tracker, prompt) == {}  # bisection alone would find prompt[7] and say 8
    tracker.stored("b", chain("b", 3))
    assert tracker.counts()["b"].chunks == 3  # caps are per node


def test_a_key_stored_again_moves_to_its_newer_batch() -> None:
    clock = Clock()
    tracker = PrefixTracker(max_chunks_per_node=4, clock=clock)
    old, new = chain("old", 2), chain("new", 2)
    tracker.stored("a", old)
    tracker.stored("a", new)
    tracker.stored("a", old[:1])  # seen again: now the newest
    assert tracker.holders(old[0]) == {"a": 1003.0}
    tracker.stored("a", chain("newest", 2))  # the cap drops the oldest batch first
    assert tracker.holders(old[0]) == {"a": 1003.0}
    assert tracker.holders(old[1]) == {}
    assert runs(tracker, old) == {"a": 1}


def test_a_snapshot_replaces_a_node_and_is_matched_key_by_key() -> None:
    tracker = PrefixTracker(max_chunks_per_node=100)
    prompt = chain("prompt", 40)
    tracker.stored("a", chain("stale", 5))
    tracker.replace("a", reversed([*prompt[:20], *prompt[21:]]))  # no order, a hole at 20
    assert runs(tracker, prompt) == {"a": 20}
    assert tracker.counts()["a"].chunks == 39
    tracker.replace("a", chain("big", 150))
    assert tracker.counts()["a"].chunks == 100
    assert tracker.counts()["a"].cap_evicted == 50


def test_dropping_a_node_forgets_its_keys() -> None:
    tracker = PrefixTracker()
    prompt = chain("prompt", 4)
    tracker.stored("a", prompt)
    tracker.stored("b", prompt)
    tracker.drop_node("a")
    assert runs(tracker, prompt) == {"b": 4}
    assert set(tracker.counts()) == {"b"}


def test_a_whole_match_costs_logarithmic_probes_plus_one_per_batch() -> None:
    tracker = PrefixTracker()
    prompt = chain("prompt", 1024)
    for start in range(0, 1024, 256):  # stored by four requests
        tracker.stored("a", prompt[start : start + 256])
    keys = CountingChain(prompt)
    assert runs(tracker, keys) == {"a": 1024}  # type: ignore[arg-type]
    batches = 1024 // BATCH_KEYS
    assert keys.reads <= 2 * math.log2(1024) + 2 * batches + 2
    keys.reads = 0
    assert runs(tracker, CountingChain(chain("miss", 1024))) == {}  # type: ignore[arg-type]


def test_a_miss_hashes_one_key_of_the_prompt() -> None:
    fingerprint = ModelFingerprint("m", "bfloat16", "NHD", chunk_tokens=16)
    tracker = PrefixTracker()
    tracker.stored("a", chain("unrelated", 4))
    query = Query.of_tokens(list(range(16 * 64)), "salt", fingerprint)
    assert tracker.longest_prefixes(query.keys) == {}
    assert query.keys.hashed == 1  # type: ignore[attr-defined]


def test_a_structured_salt_routes_on_the_connectors_keys() -> None:
    """A node holding one tenant's shared prefix matches another tenant of the space on the
    shared chunks only; a salt that names no tenant matches nothing."""
    fingerprint = ModelFingerprint("m", "bfloat16", "NHD", chunk_tokens=16)
    prompt = list(range(16 * 6))
    tracker = PrefixTracker()
    tracker.stored("a", chunk_keys(prompt, shared_salt("space", 16 * 4, "alice"), fingerprint))
    bob = Query.of_tokens(prompt, shared_salt("space", 16 * 4, "bob"), fingerprint)
    assert {node: match.chunks for node, match in tracker.longest_prefixes(bob.keys).items()} == {
        "a": 4
    }
    nobody = Query.of_tokens(prompt, "kvpool-share-v1;space=space;shared=64", fingerprint)
    assert len(nobody.keys) == 0 and tracker.longest_prefixes(nobody.keys) == {}


def test_the_cap_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_chunks_per_node"):
        PrefixTracker(max_chunks_per_node=0)


def test_single_keys_share_loose_batches_that_vouch_for_nothing() -> None:
    """A lower tier's chunks arrive one by one, tail first (the write-back's order)."""
    clock = Clock()
    tracker = PrefixTracker(max_chunks_per_node=BATCH_KEYS + 10, clock=clock)
    prompt = chain("written-back", BATCH_KEYS + 6)
    for key in reversed(prompt):
        tracker.stored("a", [key])
    assert runs(tracker, prompt) == {"a": BATCH_KEYS + 6}
    # The run ends in the first loose batch (the tail's 64 keys): seen when its newest came.
    assert tracker.longest_prefixes(prompt)["a"].last_seen == 1000.0 + BATCH_KEYS
    tracker.removed("a", [prompt[3]])
    assert runs(tracker, prompt) == {"a": 3}  # a loose batch never vouches across the hole
    tracker.stored("a", [prompt[3]])  # stored again
    assert runs(tracker, prompt) == {"a": BATCH_KEYS + 6}
    # Loose batches are batches to the cap: the oldest (the chain's tail, a full batch) goes.
    tracker.stored("a", chain("other", 10))
    assert tracker.counts()["a"] == NodeCounts(6 + 10, BATCH_KEYS)
    assert runs(tracker, prompt) == {"a": 6}


def test_single_keys_cost_about_what_keys_of_full_batches_do() -> None:
    keys = chain("memory", 20 * BATCH_KEYS)

    def bytes_per_key(batch: int) -> float:
        tracker = PrefixTracker()
        tracemalloc.start()
        try:
            for start in range(0, len(keys), batch):
                tracker.stored("a", keys[start : start + batch])
            return tracemalloc.get_traced_memory()[0] / len(keys)
        finally:
            tracemalloc.stop()

    # A batch of its own for each key would be some three times as much.
    assert bytes_per_key(1) < 1.5 * bytes_per_key(BATCH_KEYS)
