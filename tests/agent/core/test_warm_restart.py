"""Warm restart: a new agent adopts the segment an earlier one left, with every committed chunk."""

from __future__ import annotations

import multiprocessing
import multiprocessing.queues
import os
import random
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvpool.agent.core.cache_types import RestoreReport
from kvpool.agent.core.journal import SegmentJournal
from kvpool.agent.core.l1 import L1Cache
from kvpool.agent.core.policies import policy_factory
from kvpool.agent.core.quota_book import QuotaBook
from kvpool.client import AgentClient, AgentError, AgentUnavailable
from kvpool.common.chunk_files import ChunkFiles, files_directory, generation_directory
from kvpool.common.keys import tenant_id
from kvpool.common.probe_table import ProbeTableReader, ProbeTableWriter, table_path
from kvpool.common.segment import TABLE_RECORD_BYTES, SharedSegment
from tests.support.agent_process import ADMIN_TOKEN, AgentProcess
from tests.support.chunks import key
from tests.support.l1 import FakeClock

pytestmark = pytest.mark.process

PAGE = 4096
TENANT, OTHER = tenant_id("warm-a"), tenant_id("warm-b")
AGENT_ID = "b" * 32


def payload(name: int, size: int) -> bytes:
    return random.Random(name).randbytes(size)


@pytest.fixture
def segment_path(tmp_path: Path) -> Iterator[Path]:
    path = Path("/dev/shm") / f"kvpool-warm-{os.getpid()}-{tmp_path.name}"
    yield path
    path.unlink(missing_ok=True)
    table_path(path).unlink(missing_ok=True)  # a node's table that a test did not close
    shutil.rmtree(files_directory(path), ignore_errors=True)


class Node:
    """An agent's L1 in-process: segment + chunk files + journal + cache, reopened like a
    restart."""

    def __init__(self, path: Path, policy: str = "lru", clock: FakeClock | None = None) -> None:
        self.segment, self.recreated = SharedSegment.open(path, 64 * PAGE, PAGE)
        layout = self.segment.layout
        self.files = ChunkFiles.open(
            generation_directory(path, self.segment.identity[1]),
            layout.total_size,
            layout.page_size,
            layout.data_offset,
            adopt=self.recreated is None,
        )
        self.journal = SegmentJournal(self.segment)
        self.probe_table = ProbeTableWriter(table_path(path), self.segment.layout.pages, AGENT_ID)
        self.cache = L1Cache(
            self.segment.layout,
            policy_factory(policy),
            QuotaBook(),
            journal=self.journal,
            clock=clock or FakeClock(),
            probe_table=self.probe_table,
            backing=self.files,
        )
        self.report = (
            None
            if self.recreated
            else self.cache.restore(self.journal.committed(), self.journal.reserved())
        )
        self.cache.check_invariants()

    def store(self, tenant: str, names: list[int], size: int, parent: int | None = None) -> None:
        reservation = self.cache.reserve(
            tenant,
            [key(n) for n in names],
            [size] * len(names),
            None if parent is None else key(parent),
        )
        for name, place in zip(names, reservation.placements, strict=False):
            if place is not None:
                view = self.files.view(tenant)
                view[place.offset : place.offset + size] = payload(name, size)
        assert reservation.lease is not None
        self.cache.commit(reservation.lease)
        self.cache.check_invariants()

    def read(self, tenant: str, names: list[int]) -> list[bytes]:
        hit = self.cache.lookup(tenant, [key(n) for n in names], lock=False)
        view = self.files.view(tenant)
        return [bytes(view[o : o + s]) for o, s in zip(hit.offsets, hit.sizes, strict=True)]

    def probed(self, tenant: str, names: list[int]) -> list[int]:
        """Which of ``names`` the schedulers' probe table offers ``tenant``."""
        reader = ProbeTableReader(self.probe_table.path, AGENT_ID)
        try:
            return [name for name in names if reader.run(tenant, [key(name)])]
        finally:
            reader.close()

    def close(self) -> None:
        self.probe_table.close()
        self.journal.close()
        self.files.close()
        self.segment.close()


def test_a_store_in_flight_at_a_restart_keeps_its_pages_out_of_reach_for_a_fence(
    segment_path: Path,
) -> None:
    """Its writer may outlive the agent and copy late: the next agent must not reuse the pages."""
    before = FakeClock()
    node = Node(segment_path, clock=before)
    node.store(TENANT, [1], PAGE)
    in_flight = node.cache.reserve(TENANT, [key(2), key(3)], [PAGE, 2 * PAGE])
    expired = node.cache.reserve(OTHER, [key(4)], [PAGE])
    assert in_flight.lease is not None and expired.lease is not None
    before.advance(31)
    node.cache.expire_leases()  # quarantined before the restart: held after it too
    node.close()

    clock = FakeClock()
    again = Node(segment_path, clock=clock)
    assert again.report is not None and again.report.quarantined == 3
    held = {
        place.offset
        for reservation in (in_flight, expired)
        for place in reservation.placements
        if place is not None
    }
    assert again.read(TENANT, [1]) == [payload(1, PAGE)] and again.read(TENANT, [2]) == []
    # Once a bug: the restore offered the quarantined chunks to the schedulers' probes.
    assert again.probed(TENANT, [1, 2, 3]) == [1] and again.probed(OTHER, [4]) == []
    # Ask for the whole segment: every page but the 4 held back (chunk 1 is evicted).
    fresh = again.cache.reserve(OTHER, [key(n) for n in range(10, 74)], [PAGE] * 64)
    offsets = {place.offset for place in fresh.placements if place is not None}
    assert len(offsets) == 64 - 4 and not offsets & held
    assert again.cache.stats().quarantined_bytes == 4 * PAGE
    assert fresh.lease is not None
    again.cache.release(fresh.lease)
    clock.advance(10 * 30)  # the fence
    again.cache.expire_leases()
    stats = again.cache.stats()
    assert stats.quarantined_bytes == 0 and stats.allocated_bytes == 0
    again.close()
    assert Node(segment_path).report == RestoreReport(0, 0, 0)  # their records are erased


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_committed_chunks_survive_and_reservations_do_not(segment_path: Path, policy: str) -> None:
    node = Node(segment_path, policy)
    node.store(TENANT, [1, 2, 3], 5000)  # a chain of three 2-page chunks
    node.store(OTHER, [10], 100)
    node.store(TENANT, [4], PAGE, parent=3)
    node.cache.reserve(TENANT, [key(5)], [PAGE])  # mid-write when the agent dies
    node.cache.lookup(TENANT, [key(1)])  # a read lock: must not survive
    node.store(TENANT, [6], PAGE)
    node.cache.clear(OTHER)
    node.close()

    again = Node(segment_path, policy)
    assert again.recreated is None and again.report is not None
    assert (again.report.restored, again.report.discarded, again.report.quarantined) == (5, 0, 1)
    assert again.read(TENANT, [1, 2, 3, 4]) == [
        payload(n, s) for n, s in [(1, 5000), (2, 5000), (3, 5000), (4, PAGE)]
    ]
    assert again.read(TENANT, [6]) == [payload(6, PAGE)]
    assert again.read(TENANT, [5]) == [] and again.read(OTHER, [10]) == []
    restored = again.cache.tenant_usage(TENANT)  # with the quarantined reservation
    assert (restored.used_bytes, restored.chunks) == (3 * 5000 + 3 * PAGE, 6)
    stats = again.cache.stats()
    assert stats.open_leases == 0 and stats.allocated_bytes == 9 * PAGE  # 3 x 2 pages + 3 x 1
    assert stats.quarantined_bytes == PAGE
    assert again.cache.evict(1)  # nothing is locked any more
    # The chain is linked again: its tail goes before its older head.
    again.cache.clear()
    again.store(TENANT, [20], PAGE)
    again.store(TENANT, [21], PAGE, parent=20)
    again.close()
    third = Node(segment_path, policy)
    third.cache.lookup(TENANT, [key(21)], lock=False)  # not reachable, but newer than its head
    assert third.cache.evict(1)
    assert third.read(TENANT, [20, 21]) == [payload(20, PAGE)]  # linked: the tail goes first
    third.close()


def test_chains_come_back_whole_whatever_the_order_of_their_pages(segment_path: Path) -> None:
    """Once a bug: the restore linked chunks in page order, and linking a chunk forgets its
    children, so a chain whose tail lay before its middle came back broken."""
    node = Node(segment_path)
    node.store(OTHER, [10], PAGE)
    node.store(TENANT, [1, 2], PAGE)
    node.cache.clear(OTHER)
    node.store(TENANT, [3], PAGE, parent=2)  # on the page chunk 10 left
    view = node.cache.debug_view()
    assert [view.slot_of(key(n)).first_page for n in (3, 1, 2)] == [0, 1, 2]
    node.close()

    again = Node(segment_path)  # checks the invariants
    view = again.cache.debug_view()
    assert view.slot_of(key(3)).parent == view.index[key(2)]
    assert view.slot_of(key(2)).parent == view.index[key(1)]
    again.cache.lookup(TENANT, [key(1)], lock=False)  # the head is the oldest no longer
    assert again.cache.evict(1)
    assert again.read(TENANT, [1, 2, 3]) == [payload(1, PAGE), payload(2, PAGE)]  # tail first
    again.close()


def test_a_chunk_cleared_while_read_locked_stays_cleared_after_a_restart(
    segment_path: Path,
) -> None:
    """Once a bug: its record stayed in the chunk table until its last reader let go, so a
    restart before that brought it back, charged to its tenant."""
    node = Node(segment_path)
    node.store(TENANT, [1, 2], PAGE)
    assert node.cache.lookup(TENANT, [key(1)]).lease is not None  # a reader is copying it
    assert node.cache.clear(TENANT) == 2
    node.close()  # the agent stops before the reader lets go
    again = Node(segment_path)
    assert again.report == RestoreReport(0, 0, 0)
    assert again.read(TENANT, [1]) == [] and again.probed(TENANT, [1]) == []
    assert again.cache.tenant_usage(TENANT).used_bytes == 0
    again.close()


def test_new_chunks_after_a_restart_never_overlap_old_ones(segment_path: Path) -> None:
    node = Node(segment_path)
    for n in range(0, 40, 2):
        node.store(TENANT, [n], PAGE * (1 + n % 3))
    node.close()
    again = Node(segment_path)
    for n in range(100, 104):  # 40 pages + 8, below the high watermark: nothing is evicted
        again.store(TENANT, [n], PAGE * 2)
    for n in range(0, 40, 2):
        assert again.read(TENANT, [n]) == [payload(n, PAGE * (1 + n % 3))]
    for n in range(100, 104):
        assert again.read(TENANT, [n]) == [payload(n, PAGE * 2)]
    again.close()


def test_damaged_records_are_discarded_never_served(segment_path: Path) -> None:
    node = Node(segment_path)
    for n in range(6):
        node.store(TENANT, [n], PAGE)
    node.close()
    layout = node.segment.layout
    with segment_path.open("r+b") as handle:  # flip a byte inside slot 0's record (its key)
        handle.seek(layout.table_offset + 0 * TABLE_RECORD_BYTES + 10)
        handle.write(b"\xff")
    again = Node(segment_path)
    assert again.report is not None and (again.report.restored, again.report.discarded) == (5, 1)
    served = sum(len(again.read(TENANT, [n])) for n in range(6))
    assert served == 5
    for n in range(6):
        assert again.read(TENANT, [n]) in ([], [payload(n, PAGE)])
    again.close()
    assert Node(segment_path).report.discarded == 0  # type: ignore[union-attr]  # erased


def _fill(endpoint: str, tenant: str, count: int, size: int) -> None:
    with AgentClient(endpoint, token=ADMIN_TOKEN) as client:
        for first in range(0, count, 8):
            names = list(range(first, min(first + 8, count)))
            stored = client.store(
                tenant, [key(n) for n in names], [payload(n, size) for n in names]
            )
            assert stored == len(names)


def test_sigkill_then_restart_serves_every_chunk_byte_exact(agent_process: AgentProcess) -> None:
    agent = agent_process.start()
    agent.fix_ports()
    _fill(agent.zmq, TENANT, 200, 100_000)
    client = AgentClient(
        agent.zmq, token=ADMIN_TOKEN, timeout=2
    )  # stays connected across the restart
    client.connect()
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    usage = httpx.get(f"{agent.http}/v1/tenants/{TENANT}/usage", headers=admin).json()
    agent.kill()  # SIGKILL: no shutdown path at all
    agent.start()
    assert client.retrieve(TENANT, [key(n) for n in range(200)]) == [
        payload(n, 100_000) for n in range(200)
    ]
    after = httpx.get(f"{agent.http}/v1/tenants/{TENANT}/usage", headers=admin).json()
    for field in ("used_bytes", "chunks", "limit_bytes"):  # usage, not per-process counters
        assert after.get(field) == usage.get(field), field
    assert after["used_bytes"] == 200 * 100_000
    metrics = httpx.get(f"{agent.http}/metrics").text
    assert "kvpool_l1_restored_chunks 200.0" in metrics
    assert 'kvpool_l1_segment_origin{reason="adopted"} 1.0' in metrics
    client.close()


def _store_until_refused(
    endpoint: str, worker: int, done: multiprocessing.queues.Queue[int]
) -> None:
    """Store chunk after chunk; report each one whose commit the agent confirmed."""
    client = AgentClient(endpoint, token=ADMIN_TOKEN, timeout=2)
    name = worker * 100_000
    try:
        client.connect()
        while True:
            plan = client.prepare_store(TENANT, [key(name)], [50_000])
            if plan.lease is None:
                break  # refused: the agent is draining
            client.files().chunk(plan.file, plan.offsets[0], 50_000, write=True)[:] = payload(
                name, 50_000
            )
            if client.commit_store(plan.lease) == 1:
                done.put(name)
            name += 1
    except (AgentUnavailable, AgentError):
        pass
    done.put(-1)


def test_sigterm_during_concurrent_stores_loses_no_committed_chunk(
    agent_process: AgentProcess,
) -> None:
    agent_process.settings["L1_SIZE"] = "256MiB"
    agent = agent_process.start()
    agent.fix_ports()
    context = multiprocessing.get_context("spawn")
    done: multiprocessing.queues.Queue[int] = context.Queue()
    workers = [
        context.Process(target=_store_until_refused, args=(agent.zmq, w, done)) for w in range(2)
    ]
    for worker in workers:
        worker.start()
    committed: list[int] = []
    while len(committed) < 50:
        committed.append(done.get(timeout=30))
    assert agent.stop() == 0  # SIGTERM while both workers keep storing
    finished = 0
    while finished < len(workers):
        name = done.get(timeout=30)
        finished += name == -1
        if name >= 0:
            committed.append(name)
    for worker in workers:
        worker.join(10)
    assert "stores in flight dropped" not in "".join(agent.log)
    agent.start()
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
        names = [n for n in committed if n >= 0]
        for name in names:
            assert client.retrieve(TENANT, [key(name)]) == [payload(name, 50_000)], name


def test_an_incompatible_segment_is_recreated_with_a_reason(agent_process: AgentProcess) -> None:
    agent = agent_process.start()
    _fill(agent.zmq, TENANT, 8, 1000)
    assert agent.stop() == 0
    with agent.segment_path.open("r+b") as handle:  # an older layout version
        handle.seek(8)
        handle.write((1).to_bytes(4, "little"))
    agent.start()
    assert any("from empty: segment layout 1; this build reads 3" in line for line in agent.log)
    metrics = httpx.get(f"{agent.http}/metrics").text
    assert 'kvpool_l1_segment_origin{reason="segment layout 1; this build reads 3"} 1.0' in metrics
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
        assert client.lookup(TENANT, [key(0)], lock=False).count == 0
        _fill(agent.zmq, TENANT, 8, 1000)  # and it serves
        assert client.lookup(TENANT, [key(n) for n in range(8)], lock=False).count == 8
