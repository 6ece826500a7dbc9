"""The cache service's data path and its hooks, which the ZMQ tests reach only with L2 tiers.

Fakes stand in for the write-back and the prefetch (the real ones run in the agent
tests of tests/l2): they record what the service tells them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvpool.agent.service.cache_service import CacheService
from kvpool.agent.service.hooks import Pins
from tests.support.chunks import key
from tests.support.l1 import PAGE, make_cache, make_service

ALICE = "a" * 32


@dataclass
class RecordingWriteBack:
    committed_keys: list[tuple[str, list[bytes]]] = field(default_factory=list)
    hit_keys: list[tuple[str, list[bytes]]] = field(default_factory=list)
    pinned: list[int] = field(default_factory=list)

    def committed(self, tenant: str, keys: Sequence[bytes], pins: Pins) -> None:
        self.committed_keys.append((tenant, list(keys)))
        for name in keys:  # the pins work during the call: the service holds its lock
            lease = pins.pin(tenant, name).lease
            assert lease is not None
            self.pinned.append(lease)

    def hit(self, tenant: str, keys: Sequence[bytes], pins: Pins) -> None:
        self.hit_keys.append((tenant, list(keys)))


@dataclass
class Progress:
    done: bool = False
    expected: int = -1
    loaded: int = 0


@dataclass
class RecordingPrefetch:
    begun: list[tuple[str, list[bytes], bytes | None]] = field(default_factory=list)

    def begin(
        self, tenant: str, keys: Sequence[bytes], parent: bytes | None, *, warm: bool = False
    ) -> int:
        self.begun.append((tenant, list(keys), parent))
        return len(self.begun)

    def status(self, prefetch_id: int) -> Progress | None:
        return Progress() if prefetch_id <= len(self.begun) else None


def attached(tmp_path: Path) -> tuple[CacheService, RecordingWriteBack, RecordingPrefetch]:
    service = make_service(make_cache(pages=20), tmp_path / "q.json")
    write_back, prefetch = RecordingWriteBack(), RecordingPrefetch()
    service.attach_lower_tiers(write_back, prefetch, drop=lambda tenant: 0)
    return service, write_back, prefetch


def test_a_commit_tells_the_write_back_of_the_chunks_it_made_ready(tmp_path: Path) -> None:
    service, write_back, _ = attached(tmp_path)
    keys = [key(n) for n in range(3)]
    reservation = service.reserve(ALICE, keys, [PAGE] * 3)
    assert reservation.lease is not None
    assert service.commit(reservation.lease, 2) == 2
    assert write_back.committed_keys == [(ALICE, keys[:2])]
    service.release_all(write_back.pinned)  # the write-back unpins once copied
    assert service.stats().open_leases == 0


def test_store_copies_the_bytes_in_and_a_chunk_landed_from_l2_is_not_written_back(
    tmp_path: Path,
) -> None:
    service, write_back, _ = attached(tmp_path)
    head, tail = key("head"), key("tail")
    stored = service.store(ALICE, [head], [b"h" * 100])
    assert (stored.stored, stored.present, stored.refused) == (1, 0, None)
    present = service.landing(ALICE, head, None, [])
    assert present.reserve(100) is None and present.present and present.finish(True)
    landed = service.landing(ALICE, tail, head, [], after=present)
    pages = landed.reserve(50)
    assert pages is not None
    pages[:] = b"t" * 50
    assert landed.finish(True)
    assert write_back.committed_keys == [(ALICE, [head])]
    found = service.retrieve(ALICE, [head, tail, key("absent")], max_bytes=150)
    assert found == [b"h" * 100, b"t" * 50]
    # a reply holds the leading chunks that fit in its bound; the client asks for the rest
    assert service.retrieve(ALICE, [head, tail], max_bytes=149) == [b"h" * 100]
    assert service.retrieve(ALICE, [head, tail], max_bytes=99) == []


def test_a_lookup_tells_the_hits_and_prefetches_what_follows_them(tmp_path: Path) -> None:
    service, write_back, prefetch = attached(tmp_path)
    keys = [key(n) for n in range(4)]
    service.store(ALICE, keys[:2], [b"x"] * 2)
    found = service.lookup(ALICE, keys, lock=False, prefetch=True, parent=key("before"))
    assert (found.count, found.prefetch) == (2, 1)
    assert write_back.hit_keys == [(ALICE, keys[:2])]
    assert prefetch.begun == [(ALICE, keys[2:], keys[1])]  # after the last hit
    assert service.prefetch_status(found.prefetch) == Progress()

    missed = service.lookup(ALICE, [key("x")], count=False, prefetch=True, parent=key("p"))
    assert missed.lease is None
    assert prefetch.begun[-1] == (ALICE, [key("x")], key("p"))  # no hit: after the parent
    assert len(write_back.hit_keys) == 1  # an uncounted look tells no hits
    assert service.lookup(ALICE, keys[:2], lock=False).prefetch == 0  # all hit: nothing to load


def test_a_snapshot_carries_the_sequence_of_the_events_it_is_consistent_with(
    tmp_path: Path,
) -> None:
    @dataclass
    class CountingEvents:
        seq: int = 0

        def stored(self, tenant: str, keys: list[bytes]) -> None:
            self.seq += 1

        def removed(self, tenant: str, keys: list[bytes], cause: str) -> None:
            self.seq += 1

    service = make_service(make_cache(), tmp_path / "q.json")
    assert service.snapshot().seq == 0  # no events published
    events = CountingEvents()
    service.publish_events(events)
    service.store(ALICE, [key(1)], [b"x"])
    snapshot = service.snapshot()
    assert (snapshot.seq, snapshot.keys_by_tenant) == (1, {ALICE: [key(1)]})
