"""The endpoint picker's decision: tiers against queues, tenants, the deadline, bounds.

Trackers are real :class:`PrefixTracker` s filled with the connector's keys
(:class:`PromptKeys`); loads are given as the model servers' snapshot would give them.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Sequence

import pytest

from kvpool.common.index_config import TierCosts
from kvpool.common.keys import ModelFingerprint, shared_salt
from kvpool.index.model_servers import (
    Load,
    ModelServers,
    ServerEndpoint,
    ServerState,
    StaticServers,
)
from kvpool.index.picker import FIRST_WINDOW, WINDOW_GROWTH, EndpointPicker, Tiers
from kvpool.index.picking import Disaggregation, NoEndpoint, Pick, PickReason, PickRequest
from kvpool.index.query import PromptKeys
from kvpool.index.tracker import KeySequence, PrefixMatch, PrefixTracker
from tests.support.polling import wait_until
from tests.support.vllm_metrics import MetricsServer, vllm_metrics

CHUNK = 16
FINGERPRINT = ModelFingerprint("m", "bfloat16", "layout", chunk_tokens=CHUNK)
COSTS = TierCosts()  # gpu 0, l1 0.002, nvme 0.01, peer 0.02, s3 0.05, compute 0.2 s/1k tokens


def prompt(tokens: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i) % 50_000 for i in range(tokens)]


def store(tracker: PrefixTracker, name: str, tokens: Sequence[int], salt: str | None, chunks: int):
    keys = PromptKeys(tokens, salt, FINGERPRINT)
    tracker.stored(name, [keys[i] for i in range(chunks)])


def server(address: str, node: str, waiting: float = 0, running: float = 0, kv: float = 0):
    return ServerState(address, node, Load(waiting, running, kv))


class Decisions:
    def __init__(self) -> None:
        self.seen: list[tuple[PickReason | None, float]] = []
        self.disaggregations: list[Disaggregation | None] = []

    def observe_pick(
        self, reason: PickReason | None, seconds: float, disaggregation: Disaggregation | None
    ) -> None:
        self.seen.append((reason, seconds))
        self.disaggregations.append(disaggregation)


MakePicker = Callable[..., EndpointPicker]


@pytest.fixture
def make_picker() -> MakePicker:
    """``make_picker(servers, tiers, **options)``: a picker over fixed loads."""

    def make(servers: Sequence[ServerState], tiers: Tiers, **options: float) -> EndpointPicker:
        options.setdefault("deadline_ms", 2000.0)
        return EndpointPicker(lambda: servers, tiers, FINGERPRINT, COSTS, **options)  # type: ignore[arg-type]

    return make


def warm(picker: EndpointPicker, tokens: int = 1024) -> None:
    """One uncached pick of ``tokens``: the mean prompt time becomes its compute time."""
    picker.pick(PickRequest(prompt(tokens, seed=99), "warm-up"))


# ------------------------------------------------------------------ queue against prefix


def test_a_small_prefix_gain_does_not_beat_a_long_queue(make_picker: MakePicker) -> None:
    l1 = PrefixTracker()
    long = prompt(32 * 1024)
    store(l1, "n1", long, "tenant-a", 1024 // CHUNK)  # 1k of 32k tokens cached: saves 0.2 s
    servers = [server("10.0.0.1:8000", "n1", waiting=2), server("10.0.0.2:8000", "n2")]
    picker = make_picker(servers, Tiers(l1=l1))
    warm(picker)  # the mean prompt time is 0.2 s: two waiting cost 0.4 s
    # n2 starts at once, and even fetches those 1k tokens from n1 as a peer
    assert picker.pick(PickRequest(long, "tenant-a")) == Pick(
        "10.0.0.2:8000", PickReason.PREFIX, 1024
    )
    unrelated = PickRequest(prompt(32 * 1024, seed=5), "tenant-a")
    assert picker.pick(unrelated) == Pick("10.0.0.2:8000", PickReason.LOAD)


def test_a_large_prefix_gain_stays_with_the_prefix(make_picker: MakePicker) -> None:
    l1 = PrefixTracker()
    long = prompt(32 * 1024)
    store(l1, "n1", long, "tenant-a", 32 * 1024 // CHUNK)  # all of it: 0.07 s from L1
    servers = [server("10.0.0.1:8000", "n1", waiting=2), server("10.0.0.2:8000", "n2")]
    picker = make_picker(servers, Tiers(l1=l1))
    warm(picker)
    # n1: 0.07 s + 0.4 s of queue; n2: 0.66 s to fetch it all from n1 (6.6 s to compute it)
    assert picker.pick(PickRequest(long, "tenant-a")) == Pick(
        "10.0.0.1:8000", PickReason.PREFIX, 32 * 1024
    )


def test_each_chunk_comes_from_the_cheapest_tier_that_holds_it(make_picker: MakePicker) -> None:
    tokens = prompt(10 * CHUNK + 5)  # ten full chunks and five tokens
    gpu, l1, nvme, s3 = PrefixTracker(), PrefixTracker(), PrefixTracker(), PrefixTracker()
    store(gpu, "10.0.0.1:8000", tokens, "t", 2)
    store(l1, "n1", tokens, "t", 4)
    store(nvme, "n1", tokens, "t", 3)  # shorter than L1: adds nothing
    store(l1, "n2", tokens, "t", 5)  # a peer's L1
    store(nvme, "n3", tokens, "t", 6)  # a peer's NVMe
    store(s3, "n4", tokens, "t", 8)  # written by n4's agent: counts for everyone
    servers = [server("10.0.0.1:8000", "n1"), server("10.0.0.2:8000", "n2")]
    picker = make_picker(servers, Tiers(l1=l1, gpu=gpu, nvme=nvme, s3=s3))
    first, second = picker.estimates(PickRequest(tokens, "t"), servers)
    per_chunk = CHUNK / 1000
    assert first.prompt_seconds == pytest.approx(
        per_chunk
        * (2 * COSTS.gpu + 2 * COSTS.l1 + 2 * COSTS.peer + 2 * COSTS.s3 + 2 * COSTS.compute)
        + 5 / 1000 * COSTS.compute
    )
    assert first.cached_tokens == 8 * CHUNK
    # n2: its own L1 (5), then the best peer, n3's NVMe (6; n1's L1 holds 4), then S3 (8)
    assert second.prompt_seconds == pytest.approx(
        per_chunk * (5 * COSTS.l1 + 1 * COSTS.peer + 2 * COSTS.s3 + 2 * COSTS.compute)
        + 5 / 1000 * COSTS.compute
    )
    assert first.queue_seconds == second.queue_seconds == 0


def test_a_prefix_on_another_node_is_fetched_from_that_peer(make_picker: MakePicker) -> None:
    l1 = PrefixTracker()
    tokens = prompt(64 * CHUNK)
    store(l1, "no-server-here", tokens, "t", 64)
    picker = make_picker([server("10.0.0.1:8000", "n1")], Tiers(l1=l1))
    assert picker.pick(PickRequest(tokens, "t")) == Pick(
        "10.0.0.1:8000", PickReason.PREFIX, 64 * CHUNK
    )


def test_a_nearly_full_kv_cache_counts_as_a_longer_queue(make_picker: MakePicker) -> None:
    servers = [server("10.0.0.1:8000", "n1", kv=0.99), server("10.0.0.2:8000", "n2", waiting=2)]
    picker = make_picker(servers, Tiers(l1=PrefixTracker()))
    # 0.99 is 9 points above 0.9: 4.5 waiting requests' worth, more than 2
    assert picker.pick(PickRequest(prompt(256), "t")).endpoint == "10.0.0.2:8000"
    calm = [server("10.0.0.1:8000", "n1", kv=0.9), server("10.0.0.2:8000", "n2", waiting=2)]
    assert make_picker(calm, Tiers()).pick(PickRequest(prompt(256), "t")).endpoint == (
        "10.0.0.1:8000"
    )


def test_ties_go_to_fewer_waiting_then_the_address(make_picker: MakePicker) -> None:
    # b: one waiting; a: four running (the same queue time, 1 = 4 x 0.25): a has fewer waiting
    servers = [server("10.0.0.2:8000", "n2", waiting=1), server("10.0.0.1:8000", "n1", running=4)]
    assert make_picker(servers, Tiers()).pick(PickRequest(prompt(64), "t")) == Pick(
        "10.0.0.1:8000", PickReason.LOAD
    )
    equal = [server("10.0.0.9:8000", "n9"), server("10.0.0.3:8000", "n3")]
    assert make_picker(equal, Tiers()).pick(PickRequest(prompt(64), "t")).endpoint == (
        "10.0.0.3:8000"
    )


# ---------------------------------------------------------------------------- candidates


def test_only_ready_servers_in_the_subset_are_candidates(make_picker: MakePicker) -> None:
    l1 = PrefixTracker()
    tokens = prompt(8 * CHUNK)
    store(l1, "n1", tokens, "t", 8)
    servers = [
        ServerState("10.0.0.1:8000", "n1"),  # holds the prefix, but its load is unknown
        server("10.0.0.2:8000", "n2", waiting=5),
        server("10.0.0.3:8000", "n3"),
    ]
    picker = make_picker(servers, Tiers(l1=l1))
    request = PickRequest(tokens, "t")
    # n1's prefix is fetched from it as a peer: a ready server gets it
    assert picker.pick(request) == Pick("10.0.0.3:8000", PickReason.PREFIX, 8 * CHUNK)
    subset = frozenset({"10.0.0.1:8000", "10.0.0.2:8000"})
    assert picker.pick(PickRequest(tokens, "t", subset=subset)).endpoint == "10.0.0.2:8000"
    # none ready in the subset: the known ones, by prompt alone
    only_unready = frozenset({"10.0.0.1:8000"})
    assert picker.pick(PickRequest(tokens, "t", subset=only_unready)) == Pick(
        "10.0.0.1:8000", PickReason.PREFIX, 8 * CHUNK
    )


def test_no_candidate_is_no_endpoint_and_is_counted(make_picker: MakePicker) -> None:
    decisions = Decisions()
    picker = make_picker([server("10.0.0.1:8000", "n1")], Tiers(), observer=decisions)
    with pytest.raises(NoEndpoint, match="in the subset"):
        picker.pick(PickRequest(prompt(32), "t", subset=frozenset({"10.9.9.9:8000"})))
    with pytest.raises(NoEndpoint, match="known"):
        make_picker([], Tiers(), observer=decisions).pick(PickRequest(prompt(32), "t"))
    assert [reason for reason, _ in decisions.seen] == [None, None]


def test_decisions_are_counted_by_reason_with_their_time(make_picker: MakePicker) -> None:
    decisions = Decisions()
    l1 = PrefixTracker()
    tokens = prompt(4 * CHUNK)
    store(l1, "n1", tokens, "t", 4)
    picker = make_picker([server("10.0.0.1:8000", "n1")], Tiers(l1=l1), observer=decisions)
    picker.pick(PickRequest(tokens, "t"))
    picker.pick(PickRequest(tokens, "other"))
    assert [reason for reason, _ in decisions.seen] == [PickReason.PREFIX, PickReason.LOAD]
    assert decisions.disaggregations == [Disaggregation.DISABLED] * 2
    assert all(0 < seconds < 2 for _, seconds in decisions.seen)


# ------------------------------------------------------------------------------- tenants


def test_another_tenants_identical_prompt_is_picked_as_with_an_empty_index(
    make_picker: MakePicker,
) -> None:
    tokens = prompt(32 * 1024)
    chunks = len(tokens) // CHUNK
    # n1 holds tenant-a's prompt in every tier, and has one request running; n2 is idle
    servers = [server("10.0.0.1:8000", "n1", running=1), server("10.0.0.2:8000", "n2")]
    full = Tiers(*(PrefixTracker() for _ in range(4)))
    for tracker, name in ((full.l1, "n1"), (full.gpu, "10.0.0.1:8000"), (full.nvme, "n1")):
        assert tracker is not None
        store(tracker, name, tokens, "tenant-a", chunks)
    assert full.s3 is not None
    store(full.s3, "n1", tokens, "tenant-a", chunks)

    def picked(tiers: Tiers, salt: str | None) -> Pick:
        picker = make_picker(servers, tiers)
        warm(picker)
        return picker.pick(PickRequest(tokens, salt))

    assert picked(full, "tenant-a") == Pick("10.0.0.1:8000", PickReason.PREFIX, 32 * 1024)
    empty = Tiers(*(PrefixTracker() for _ in range(4)))
    for salt in ("tenant-b", None, "", "kvpool-share-v1;garbage"):
        as_empty = picked(empty, salt)
        assert picked(full, salt) == as_empty == Pick("10.0.0.2:8000", PickReason.LOAD)


def test_a_shared_space_matches_only_its_shared_part(make_picker: MakePicker) -> None:
    tokens = prompt(20 * CHUNK)
    l1 = PrefixTracker()
    store(l1, "n1", tokens, shared_salt("space", 8 * CHUNK, "tenant-a"), 20)
    picker = make_picker([server("10.0.0.1:8000", "n1")], Tiers(l1=l1))
    # another tenant of the space: the shared 8 chunks, none of tenant-a's own
    b = picker.pick(PickRequest(tokens, shared_salt("space", 8 * CHUNK, "tenant-b")))
    assert b == Pick("10.0.0.1:8000", PickReason.PREFIX, 8 * CHUNK)
    # the same tenant salt outside the space: none
    assert picker.pick(PickRequest(tokens, "tenant-a")).cached_tokens == 0


# ------------------------------------------------------------------- deadline, failures


def test_a_blocked_tier_fails_open_within_the_deadline(make_picker: MakePicker) -> None:
    gpu = PrefixTracker()
    tokens = prompt(8 * CHUNK)
    store(gpu, "10.0.0.1:8000", tokens, "t", 8)
    # n1: the prefix, and one running request; n2: idle, so the choice by load alone
    servers = [server("10.0.0.1:8000", "n1", running=1), server("10.0.0.2:8000", "n2")]
    decisions = Decisions()
    picker = make_picker(servers, Tiers(gpu=gpu), deadline_ms=50.0, observer=decisions)
    with gpu._lock:  # another thread (the engine events' subscriber, say) holds the tracker
        started = time.perf_counter()
        pick = picker.pick(PickRequest(tokens, "t"))
        took = time.perf_counter() - started
    assert pick == Pick("10.0.0.2:8000", PickReason.FAIL_OPEN)
    assert 0.04 < took < 0.5
    assert decisions.seen[-1][0] == PickReason.FAIL_OPEN
    # released: the index answers again
    assert picker.pick(PickRequest(tokens, "t")) == Pick("10.0.0.1:8000", PickReason.PREFIX, 128)


def test_picks_behind_a_blocked_tracker_each_fail_open_at_their_own_deadline(
    make_picker: MakePicker,
) -> None:
    l1 = PrefixTracker()
    store(l1, "n1", prompt(CHUNK), "t", 1)
    picker = make_picker([server("10.0.0.1:8000", "n1")], Tiers(l1=l1), deadline_ms=200)
    request = PickRequest(prompt(CHUNK), "t")
    answers: list[tuple[Pick, float]] = []

    def timed() -> None:
        started = time.perf_counter()
        answers.append((picker.pick(request), time.perf_counter() - started))

    with l1._lock:  # its writer holds it: five streams pick at once, none waits for another
        threads = [threading.Thread(target=timed) for _ in range(5)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert [pick.reason for pick, _ in answers] == [PickReason.FAIL_OPEN] * 5
    assert all(0.15 < took < 0.5 for _, took in answers), answers
    assert picker.pick(request).reason == PickReason.PREFIX


class Broken(PrefixTracker):
    def longest_prefixes(
        self, keys: KeySequence, nodes: object = None, *, wait: float = -1
    ) -> dict[str, PrefixMatch]:
        raise RuntimeError("the index is broken")


def test_a_failing_tier_fails_open_and_never_raises(make_picker: MakePicker) -> None:
    servers = [server("10.0.0.1:8000", "n1", waiting=1), server("10.0.0.2:8000", "n2")]
    picker = make_picker(servers, Tiers(l1=PrefixTracker(), s3=Broken()))
    assert picker.pick(PickRequest(prompt(64), "t")) == Pick("10.0.0.2:8000", PickReason.FAIL_OPEN)


def test_an_empty_index_routes_by_load(make_picker: MakePicker) -> None:
    servers = [server("10.0.0.1:8000", "n1", running=3), server("10.0.0.2:8000", "n2", running=1)]
    for tiers in (Tiers(), Tiers(l1=PrefixTracker(), nvme=PrefixTracker())):
        assert make_picker(servers, tiers).pick(PickRequest(prompt(512), "t")) == Pick(
            "10.0.0.2:8000", PickReason.LOAD
        )


def test_each_new_snapshot_of_the_loads_is_ranked_anew() -> None:
    """The candidates are ranked once per snapshot the servers callable returns: a new one
    (``ModelServers`` publishes one on every change) is seen by the next pick."""
    first = [server("10.0.0.1:8000", "n1"), server("10.0.0.2:8000", "n2", waiting=3)]
    snapshots = [first]
    picker = EndpointPicker(lambda: snapshots[-1], Tiers(), FINGERPRINT, COSTS, deadline_ms=2000)
    request = PickRequest(prompt(64), "t")
    assert picker.pick(request) == Pick("10.0.0.1:8000", PickReason.LOAD)
    snapshots.append([server("10.0.0.1:8000", "n1", waiting=3), server("10.0.0.2:8000", "n2")])
    assert picker.pick(request) == Pick("10.0.0.2:8000", PickReason.LOAD)
    assert picker.candidates(frozenset({"10.0.0.1:8000"})).servers == [snapshots[-1][0]]


def test_picks_from_many_threads_at_once(make_picker: MakePicker) -> None:
    l1 = PrefixTracker()
    tokens = prompt(16 * CHUNK)
    store(l1, "n2", tokens, "t", 16)
    picker = make_picker([server("10.0.0.1:8000", "n1"), server("10.0.0.2:8000", "n2")], Tiers(l1))
    answers: list[Pick] = []

    def work() -> None:
        for _ in range(50):
            answers.append(picker.pick(PickRequest(tokens, "t")))

    threads = [threading.Thread(target=work) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert answers == [Pick("10.0.0.2:8000", PickReason.PREFIX, 16 * CHUNK)] * 400


# ------------------------------------------------------------------------------ attacker


class HashesOutside(PrefixTracker):
    """Checks that nothing is hashed while the tracker's lock would be held."""

    keys: PromptKeys

    def longest_prefixes(
        self, keys: KeySequence, nodes: object = None, *, wait: float = -1
    ) -> dict[str, PrefixMatch]:
        before = self.keys.hashed
        found = super().longest_prefixes(keys, nodes, wait=wait)  # type: ignore[arg-type]
        assert self.keys.hashed == before
        return found


def test_a_huge_prompt_hashes_a_few_keys_per_miss_and_a_few_times_the_run_at_most(
    make_picker: MakePicker,
) -> None:
    tokens = prompt(1_000_000)  # 62500 chunks
    l1, nvme = HashesOutside(), HashesOutside()
    candidates = [server("10.0.0.1:8000", "n1")]
    picker = make_picker(candidates, Tiers(l1=l1, nvme=nvme))
    request = PickRequest(tokens, "t")
    l1.keys = nvme.keys = keys = PromptKeys(tokens, "t", FINGERPRINT)
    assert picker.estimates(request, candidates, keys)[0].cached_tokens == 0
    assert keys.hashed == FIRST_WINDOW
    store(l1, "n1", tokens, "t", 100)
    store(nvme, "n2", tokens, "t", 1000)
    l1.keys = nvme.keys = keys = PromptKeys(tokens, "t", FINGERPRINT)
    (estimate,) = picker.estimates(request, candidates, keys)
    assert estimate.cached_tokens == 1000 * CHUNK  # 100 from L1, 900 more from n2 as a peer
    assert keys.hashed < WINDOW_GROWTH * 1000


def test_hashing_a_long_held_prompt_stops_at_the_deadline(make_picker: MakePicker) -> None:
    chunks = 200_000
    tokens = prompt(chunks * CHUNK)
    l1 = PrefixTracker(max_chunks_per_node=chunks)
    store(l1, "n1", tokens, "t", chunks)
    started = time.perf_counter()
    PromptKeys(tokens, "t", FINGERPRINT)[chunks - 1]
    hashing = time.perf_counter() - started  # what hashing it all takes on this machine now
    picker = make_picker(
        [server("10.0.0.1:8000", "n1")], Tiers(l1=l1), deadline_ms=hashing / 10 * 1000
    )
    started = time.perf_counter()
    assert picker.pick(PickRequest(tokens, "t")).reason == PickReason.FAIL_OPEN
    assert time.perf_counter() - started < hashing / 2  # it gave up at the deadline


# ----------------------------------------------------------------- with real model servers


def test_loads_read_from_real_servers_steer_picks_that_never_wait_for_them() -> None:
    busy, idle, slow = MetricsServer(), MetricsServer(), MetricsServer()
    busy.body = vllm_metrics([(4, 8, 0.5)])
    idle.body = vllm_metrics([(0, 1, 0.1)])
    slow.drip = 0.01  # the reader spends its whole timeout on this one, every round
    endpoints = [ServerEndpoint(s.address, f"n{i}") for i, s in enumerate((busy, idle, slow))]
    servers = ModelServers(StaticServers(endpoints), interval=0.05, timeout=1.0)
    picker = EndpointPicker(servers.snapshot, Tiers(), FINGERPRINT, COSTS, deadline_ms=50)
    servers.start()
    try:
        wait_until(lambda: sum(s.ready for s in servers.snapshot()) == 2)
        for _ in range(20):
            started = time.perf_counter()
            pick = picker.pick(PickRequest(prompt(64), "t"))
            assert pick == Pick(idle.address, PickReason.LOAD)
            assert time.perf_counter() - started < 0.05
    finally:
        servers.stop()
        for served in (busy, idle, slow):
            served.close()


def test_picking_among_contenders_only_picks_as_over_every_candidate(
    make_picker: MakePicker,
) -> None:
    """Servers whose node and GPU hold nothing of the prompt all take the same prompt time:
    the pick estimates only the one of them with the shortest queue, and must choose what
    estimating every candidate chooses."""
    rng = random.Random(5)
    tokens = prompt(12 * CHUNK)
    for _ in range(50):
        l1, nvme, gpu = PrefixTracker(), PrefixTracker(), PrefixTracker()
        servers = [
            server(f"10.0.0.{n}:8000", f"n{n % 6}", rng.choice([0, 0, 1, 3]), rng.randrange(4))
            for n in range(12)
        ]
        for tracker, names in ((l1, "n1 n2"), (nvme, "n3"), (gpu, "10.0.0.5:8000")):
            for name in names.split():
                if rng.random() < 0.7:
                    store(tracker, name, tokens, "t", rng.randrange(1, 13))
        picker = make_picker(servers, Tiers(l1=l1, gpu=gpu, nvme=nvme))
        request = PickRequest(tokens, "t")
        every = min(picker.estimates(request, servers))
        assert min(picker.estimates(request, servers, contenders=True)) == every
