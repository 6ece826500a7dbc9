"""The chunks L1 holds: where each one is, whom it is charged to, and who hears of it.

A chunk takes a slot (:mod:`~kvpool.agent.core.l1.slots`), a run of pages and, while it
is being written or ready, the index entry under its key. Placing and freeing one
keeps its tenant's usage exact and tells the journal (for warm restarts), the
probe table (for the connectors' schedulers), the listener (for the pool-wide
prefix index) and, when a ready chunk leaves, the pins (:mod:`~kvpool.agent.core.l1.pin_sets`).
"""

from __future__ import annotations

from collections.abc import Iterable

from kvpool.agent.core.allocator import ExtentAllocator
from kvpool.agent.core.cache_types import ChunkBacking, ChunkListener
from kvpool.agent.core.journal import RESERVED, ChunkRecord, SegmentJournal
from kvpool.agent.core.l1.pin_sets import PinSets
from kvpool.agent.core.l1.slots import NIL, READY, SlotTable, State
from kvpool.agent.core.l1.tenants import Tenant, TenantTable
from kvpool.agent.core.policies import PolicyFactory, SlotArena
from kvpool.agent.core.quota_book import QuotaBook
from kvpool.common.probe_table import ProbeTableWriter
from kvpool.common.segment import SegmentLayout


class Chunks:
    def __init__(
        self,
        layout: SegmentLayout,
        policy: PolicyFactory,
        quotas: QuotaBook,
        *,
        idle_tenants: int,
        pin_budget: int,
        journal: SegmentJournal | None,
        probe_table: ProbeTableWriter | None,
        listener: ChunkListener | None,
        backing: ChunkBacking | None,
    ) -> None:
        self.layout = layout
        self.slots = SlotTable(layout.pages)
        self.index: dict[bytes, int] = {}
        """Key to slot of the chunks being written or ready."""
        self.allocator = ExtentAllocator(layout.pages)
        self.tenants = TenantTable(policy, quotas, SlotArena(layout.pages), idle_tenants)
        self.pins = PinSets(self.slots, self.index, self.tenants, pin_budget)
        self.journal = journal
        self.probe_table = probe_table
        self.listener = listener
        self.backing = backing
        self.lower_tier = False
        """L2 tiers are configured: a prefix that L1 lacks can come back by prefetch."""
        self.stored_bytes = 0
        self.commit_sequence = 0
        """The number of the last chunk committed (journal records are numbered)."""

    def pages_for(self, nbytes: int) -> int:
        return -(-nbytes // self.layout.page_size)

    def offset_of(self, first_page: int) -> int:
        return self.layout.data_offset + first_page * self.layout.page_size

    def back(self, account: Tenant, first_page: int, pages: int) -> str | None:
        """Give the account's memory to pages just allocated for one of its chunks; why not
        (the pages are free again) when there is no memory for them."""
        if self.backing is None:
            return None
        try:
            self.backing.take(
                account.name, self.offset_of(first_page), pages * self.layout.page_size
            )
        except OSError as error:
            self.allocator.free(first_page, pages)
            return error.strerror or str(error)
        return None

    def place(self, account: Tenant, key: bytes, nbytes: int, first_page: int, pages: int) -> int:
        """Put a chunk being written on pages allocated for it; its slot, linked to nothing."""
        slots = self.slots
        slot = slots.free.pop()
        slots.keys[slot] = key
        slots.state[slot] = State.WRITING
        slots.first_page[slot] = first_page
        slots.offsets[slot] = self.offset_of(first_page)
        slots.pages[slot] = pages
        slots.nbytes[slot] = nbytes
        slots.tenant[slot] = account.index
        slots.readers[slot] = 0
        self.index[key] = slot
        account.used_bytes += nbytes
        account.chunks += 1
        self.stored_bytes += nbytes
        if self.journal is not None:  # its writer may outlive this agent: see restore.py
            record = ChunkRecord(slot, NIL, key, account.name, first_page, pages, nbytes, 0, 0)
            self.journal.record(record, RESERVED)
        return slot

    def record_of(self, slot: int) -> ChunkRecord:
        """The journal record of a chunk being committed, numbered after every other."""
        slots = self.slots
        self.commit_sequence += 1
        slots.sequence[slot] = self.commit_sequence
        parent = slots.parent[slot]
        return ChunkRecord(
            slot,
            parent,
            slots.key(slot),
            self.tenants.places[slots.tenant[slot]].name,
            slots.first_page[slot],
            slots.pages[slot],
            slots.nbytes[slot],
            self.commit_sequence,
            0 if parent == NIL else slots.sequence[parent],  # sequences start at 1
        )

    def free(self, slot: int) -> None:
        slots = self.slots
        if slots.state[slot] == READY:
            self.withdraw(slot)
        if self.journal is not None:
            self.journal.erase(slot)  # before the pages can be handed out again
        key = slots.key(slot)
        if self.index.get(key) == slot:
            del self.index[key]
        slots.unlink(slot)
        self.allocator.free(slots.first_page[slot], slots.pages[slot])
        account = self.tenants.places[slots.tenant[slot]]  # its pages stay with its memory
        nbytes = slots.nbytes[slot]
        account.used_bytes -= nbytes
        account.chunks -= 1
        if not account.chunks:
            self.tenants.rest(account)
        self.stored_bytes -= nbytes
        slots.keys[slot] = None
        slots.sequence[slot] = 0
        slots.state[slot] = State.FREE
        slots.tenant[slot] = NIL
        slots.readers[slot] = 0
        slots.free.append(slot)

    def quarantine(self, slots: Iterable[int]) -> None:
        """Make chunks unreachable and unusable; their pages stay allocated."""
        table = self.slots
        for slot in slots:
            key = table.key(slot)
            if self.index.get(key) == slot:
                del self.index[key]  # the key may be stored again, elsewhere
            table.unlink(slot)
            table.state[slot] = State.QUARANTINED

    def clear(self, scope: Tenant | None) -> int:
        """Drop every chunk (of one tenant, or all); locked ones go when unlocked."""
        slots = self.slots
        dropped = 0
        announced: dict[int, list[bytes]] = {}
        for key, slot in list(self.index.items()):
            if scope is not None and slots.tenant[slot] != scope.index:
                continue
            dropped += 1
            if slots.state[slot] == State.READY:
                announced.setdefault(slots.tenant[slot], []).append(key)
            if slots.state[slot] == State.READY and slots.readers[slot] == 0:
                self.remove_from_policy(slot, evicted=False)
                self.free(slot)
            else:
                if slots.state[slot] == State.READY:
                    self.remove_from_policy(slot, evicted=False)
                    self.withdraw(slot)
                    if self.journal is not None:  # a restart must not bring it back
                        self.journal.erase(slot)
                slots.state[slot] = State.DOOMED
                del self.index[key]
        self.announce_removed(announced, "cleared")
        return dropped

    def withdraw(self, slot: int) -> None:
        """The chunk stops being ready: the connectors' schedulers no longer find it, and
        its pin (if any) lets go of it."""
        self.pins.left(slot)
        if self.probe_table is not None:
            self.probe_table.withdraw(self.slots.key(slot))

    def remove_from_policy(self, slot: int, *, evicted: bool) -> None:
        slots = self.slots
        account = self.tenants.places[slots.tenant[slot]]
        account.policy.remove(slot, slots.key(slot), evicted=evicted)

    def announce_removed(self, keys_by_tenant: dict[int, list[bytes]], cause: str) -> None:
        if self.listener is not None:
            for tenant, keys in keys_by_tenant.items():
                self.listener.removed(self.tenants.places[tenant].name, keys, cause)
