"""Chunks from L2 landing in their reserved pages: alone, and a run's at once.

The prefetch's runs (consecutive chunks one pipelined request brings) reserve their pages in
one call to L1 and commit in one; these tests drive the landings as the peer tier and the
prefetch do, on a real L1 and its chunk files.
"""

from __future__ import annotations

from pathlib import Path

from kvpool.agent.core.quota_book import QuotaBook
from kvpool.agent.service.cache_service import CacheService
from kvpool.agent.service.landing import ChunkLanding, RunReservation, finish_in_order
from tests.support.chunks import key
from tests.support.l1 import PAGE, make_cache, make_service

ALICE = "a" * 32


def run_of(
    service: CacheService,
    names: list[str],
    parent: bytes | None = None,
    after: ChunkLanding | None = None,
) -> list[ChunkLanding]:
    """Landings of ``names``, each after the one before (the first after ``after``), sharing
    one run's reservation."""
    landings: list[ChunkLanding] = []
    keep: list[bytes] = []
    together = RunReservation(service, [key(name) for name in names])
    for position, name in enumerate(names):
        before = landings[-1].key if landings else parent
        landing = service.landing(
            ALICE, key(name), before, keep, after=landings[-1] if landings else after
        )
        landing.run, landing.position = together, position
        landings.append(landing)
    return landings


def land(landing: ChunkLanding, size: int, fill: bytes) -> None:
    pages = landing.reserve(size)
    assert pages is not None
    pages[:] = fill * size


def test_a_run_reserves_its_pages_at_once_and_commits_them_in_one_go(tmp_path: Path) -> None:
    service = make_service(make_cache(pages=20), tmp_path / "q.json")
    landings = run_of(service, ["a", "b", "c"])
    land(landings[0], PAGE, b"a")
    assert service.open_write_leases == 1  # one lease for the whole run
    land(landings[1], PAGE, b"b")
    land(landings[2], PAGE, b"c")
    assert service.open_write_leases == 1
    assert finish_in_order(landings, [True, True, True]) == 3
    assert service.open_write_leases == 0
    names = [key(name) for name in "abc"]
    assert service.retrieve(ALICE, names, max_bytes=3 * PAGE) == [
        b"a" * PAGE,
        b"b" * PAGE,
        b"c" * PAGE,
    ]


def test_a_chunk_of_another_size_gives_the_runs_pages_back_and_reserves_alone(
    tmp_path: Path,
) -> None:
    """A prefix's last chunk may be shorter than the others: it lands all the same."""
    service = make_service(make_cache(pages=20), tmp_path / "q.json")
    landings = run_of(service, ["a", "b", "c"])
    land(landings[0], PAGE, b"a")
    land(landings[1], 50, b"b")  # the run's pages from here on go back
    land(landings[2], PAGE, b"c")  # and this one reserves alone too
    assert service.open_write_leases == 3
    assert finish_in_order(landings, [True, True, True]) == 3
    names = [key(name) for name in "abc"]
    assert service.retrieve(ALICE, names, max_bytes=3 * PAGE) == [
        b"a" * PAGE,
        b"b" * 50,
        b"c" * PAGE,
    ]
    assert service.open_write_leases == 0 and service.stats().chunks == 3


def test_a_gap_in_a_run_commits_the_chunks_before_it_and_frees_the_rest(tmp_path: Path) -> None:
    service = make_service(make_cache(pages=20), tmp_path / "q.json")
    landings = run_of(service, ["a", "b", "c"])
    for landing, fill in zip(landings, [b"a", b"b", b"c"], strict=True):
        land(landing, PAGE, fill)
    assert finish_in_order(landings, [True, False, True]) == 1  # "b" never came whole
    names = [key(name) for name in "abc"]
    assert service.lookup(ALICE, names, lock=False).count == 1
    assert service.open_write_leases == 0 and service.stats().chunks == 1


def test_a_run_past_its_tenants_quota_stops_at_the_quota(tmp_path: Path) -> None:
    cache = make_cache(pages=20, quotas=QuotaBook(limits={ALICE: 2 * PAGE}))
    service = make_service(cache, tmp_path / "q.json")
    landings = run_of(service, ["a", "b", "c"])
    land(landings[0], PAGE, b"a")
    land(landings[1], PAGE, b"b")
    assert landings[2].reserve(PAGE) is None and not landings[2].reserved  # refused
    assert finish_in_order(landings, [True, True, False]) == 2
    assert service.open_write_leases == 0 and service.stats().chunks == 2


def test_a_chunk_present_already_counts_as_placed_within_a_run(tmp_path: Path) -> None:
    service = make_service(make_cache(pages=20), tmp_path / "q.json")
    service.store(ALICE, [key("a"), key("b")], [b"x" * PAGE, b"y" * PAGE])
    landings = run_of(service, ["b", "c"], parent=key("a"))
    assert landings[0].reserve(PAGE) is None and landings[0].present
    land(landings[1], PAGE, b"c")
    assert finish_in_order(landings, [False, True]) == 2
    names = [key(name) for name in "abc"]
    assert service.lookup(ALICE, names, lock=False).count == 3


def test_a_run_given_up_gives_all_its_pages_back(tmp_path: Path) -> None:
    """What the prefetch does with the runs past a gap: finish each landing unfilled."""
    service = make_service(make_cache(pages=20), tmp_path / "q.json")
    landings = run_of(service, ["a", "b", "c"])
    land(landings[0], PAGE, b"a")
    for landing in landings:
        assert not landing.finish(False)
    assert service.open_write_leases == 0 and service.stats().chunks == 0
    assert service.lookup(ALICE, [key("a")], lock=False).count == 0


def test_a_chunk_its_run_holds_pages_for_lets_the_next_run_reserve_before_it_comes(
    tmp_path: Path,
) -> None:
    """What lets the prefetch reserve a prefix's runs before asking for them: a chunk's turn
    comes once the chunk before it holds pages, its own or its run's."""
    service = make_service(make_cache(pages=20), tmp_path / "q.json")
    first = run_of(service, ["a", "b"])
    second = run_of(service, ["c", "d"], parent=key("b"), after=first[-1])
    assert second[0].turn() is None  # "b" has no pages yet
    land(first[0], PAGE, b"a")  # the run reserves "a" and "b"
    assert second[0].turn() is True
    land(second[0], PAGE, b"c")  # "c" and "d" come before "b"
    land(second[1], PAGE, b"d")
    land(first[1], PAGE, b"b")
    assert finish_in_order(first + second, [True] * 4) == 4
    names = [key(name) for name in "abcd"]
    assert service.lookup(ALICE, names, lock=False).count == 4
    assert service.open_write_leases == 0


def test_a_chunk_its_run_was_refused_pages_for_gives_the_next_run_no_turn(
    tmp_path: Path,
) -> None:
    cache = make_cache(pages=20, quotas=QuotaBook(limits={ALICE: PAGE}))
    service = make_service(cache, tmp_path / "q.json")
    first = run_of(service, ["a", "b"])
    second = run_of(service, ["c", "d"], parent=key("b"), after=first[-1])
    land(first[0], PAGE, b"a")  # the quota leaves "b" out of the run's pages
    assert second[0].turn() is None  # until "b" asks and is refused
    assert first[1].reserve(PAGE) is None
    assert second[0].turn() is False and not second[0].wait_turn()
    assert finish_in_order(first + second, [True, False, False, False]) == 1
    assert service.open_write_leases == 0 and service.stats().chunks == 1
