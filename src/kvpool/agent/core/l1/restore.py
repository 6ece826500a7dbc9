"""Warm restore: rebuild a fresh cache from the chunk table of an adopted segment.

The journal (:mod:`kvpool.agent.core.journal`) records each chunk as it is reserved and
again when it is committed, numbered so that a parent is numbered before its
child; a restart reads the records back here.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable

from kvpool.agent.core.allocator import ExtentAllocator
from kvpool.agent.core.cache_types import RestoreReport
from kvpool.agent.core.journal import ChunkRecord
from kvpool.agent.core.l1.chunks import Chunks
from kvpool.agent.core.l1.leases import LeaseTable
from kvpool.agent.core.l1.slots import NIL, State


def restore(
    chunks: Chunks,
    leases: LeaseTable,
    records: Iterable[ChunkRecord | int],
    reserved: Iterable[ChunkRecord | int],
) -> RestoreReport:
    """See :meth:`kvpool.agent.core.l1.L1Cache.restore`."""
    if chunks.index or chunks.journal is None:
        raise RuntimeError("restore() needs a fresh cache with a journal")
    total = chunks.allocator.total_pages
    valid: list[tuple[ChunkRecord, bool]] = []
    discarded: list[int] = []
    for writing, group in ((False, records), (True, reserved)):
        for record in group:
            if isinstance(record, int) or not _fits(chunks, record):
                discarded.append(record if isinstance(record, int) else record.slot)
            else:
                valid.append((record, writing))
    kept: list[ChunkRecord] = []
    held: list[ChunkRecord] = []
    end = 0
    for record, writing in sorted(valid, key=lambda pair: pair[0].first_page):
        if record.first_page < end or (not writing and record.key in chunks.index):
            discarded.append(record.slot)
            continue
        if writing:
            held.append(record)
        else:
            kept.append(record)
            chunks.index[record.key] = record.slot
        end = record.first_page + record.pages
    for slot in discarded:
        chunks.journal.erase(slot)
    chunks.allocator = ExtentAllocator(total, [(r.first_page, r.pages) for r in kept + held])
    kept.sort(key=lambda r: r.sequence)  # a parent is numbered before its children
    for record in kept + held:
        _adopt(chunks, record)
    if held:
        for record in held:
            chunks.remove_from_policy(record.slot, evicted=False)
        leases.quarantine_restored([r.slot for r in held])
    slots = chunks.slots
    for record in kept:  # parents first: linking a chunk forgets the children it had
        parent = record.parent
        if (
            0 <= parent < total
            and slots.state[parent] == State.READY
            and slots.sequence[parent] == record.parent_sequence
            and slots.tenant[parent] == slots.tenant[record.slot]
        ):
            slots.link(record.slot, parent)
    used = {record.slot for record in kept + held}
    slots.free = array("i", (s for s in range(total - 1, -1, -1) if s not in used))
    chunks.commit_sequence = max((r.sequence for r in kept), default=0)
    if chunks.backing is not None:  # each chunk's bytes are in its account's memory already
        for record in kept + held:
            offset = chunks.offset_of(record.first_page)
            chunks.backing.claim(record.tenant, offset, record.pages * chunks.layout.page_size)
        chunks.backing.trim_all()  # chunks discarded, pages of none, or written by clients
    return RestoreReport(len(kept), len(discarded), len(held))


def _fits(chunks: Chunks, record: ChunkRecord) -> bool:
    """Whether a journal record lies inside the data region and agrees with its size."""
    page, total = chunks.layout.page_size, chunks.allocator.total_pages
    return (
        0 <= record.slot < total
        and record.pages > 0
        and 0 <= record.first_page <= total - record.pages
        and (record.pages - 1) * page < record.nbytes <= record.pages * page
    )


def _adopt(chunks: Chunks, record: ChunkRecord) -> None:
    slots, slot = chunks.slots, record.slot
    account = chunks.tenants.account(record.tenant)
    slots.keys[slot] = record.key
    slots.state[slot] = State.READY
    if chunks.probe_table is not None and chunks.index.get(record.key) == slot:
        chunks.probe_table.publish(record.key, account.name)  # ready, not held back
    slots.first_page[slot] = record.first_page
    slots.offsets[slot] = chunks.offset_of(record.first_page)
    slots.pages[slot] = record.pages
    slots.nbytes[slot] = record.nbytes
    slots.tenant[slot] = account.index
    slots.readers[slot] = 0
    slots.link(slot, NIL)
    slots.last_use[slot] = slots.next_tick()
    slots.sequence[slot] = record.sequence
    account.policy.insert(slot, record.key)
    account.used_bytes += record.nbytes
    account.chunks += 1
    chunks.stored_bytes += record.nbytes
    chunks.tenants.over_quota.add(account.name)  # the quota may have shrunk while it was away
