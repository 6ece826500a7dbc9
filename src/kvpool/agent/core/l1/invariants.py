"""The rules the cache's bookkeeping keeps, checked: :meth:`L1Cache.check_invariants`.

Each check takes time linear in the slots, leases and records: for tests and
debugging, never the data path.
"""

from __future__ import annotations

import math
from collections import Counter

from kvpool.agent.core.l1.chunks import Chunks
from kvpool.agent.core.l1.debug import STATES
from kvpool.agent.core.l1.leases import LeaseTable
from kvpool.agent.core.l1.slots import DOOMED, NIL, READY, State

_STATE_VALUES = frozenset(int(state) for state in State)
_FINDABLE = (int(State.WRITING), READY)
"""The states of chunks the index finds."""
_LINKABLE = frozenset((int(State.WRITING), READY, DOOMED))
"""The states of chunks that can have children."""


class InvariantError(AssertionError):
    """A rule of the cache's bookkeeping is broken: a bug in the cache, never in a caller."""


def check_invariants(chunks: Chunks, leases: LeaseTable) -> None:
    _check_slots(chunks)
    _check_pages(chunks)
    _check_index(chunks)
    _check_chains(chunks)
    _check_leases(chunks, leases)
    _check_quarantine(chunks, leases)
    _check_records(chunks)
    _check_usage(chunks)
    _check_policies(chunks)
    _check_pins(chunks)


def _check_slots(chunks: Chunks) -> None:
    """A slot is free exactly when listed free; a live one is charged, sized and placed."""
    slots = chunks.slots
    free = set(slots.free)
    if len(free) != len(slots.free):
        raise _broken("free slots", "a slot is listed free twice")
    for slot in range(len(slots.keys)):
        state = slots.state[slot]
        if state not in _STATE_VALUES:
            raise _broken("slots", f"slot {slot} is in no state ({state})")
        if state == State.FREE:
            if slot not in free:
                raise _broken("free slots", f"free slot {slot} is not listed free")
            if slots.keys[slot] is not None or slots.tenant[slot] != NIL:
                raise _broken("free slots", f"free slot {slot} keeps a key or a tenant")
            if slots.readers[slot] or slots.sequence[slot]:
                raise _broken("free slots", f"free slot {slot} keeps readers or a number")
            continue
        if slot in free:
            raise _broken("free slots", f"slot {slot} holds a chunk but is listed free")
        _check_live_slot(chunks, slot)


def _check_live_slot(chunks: Chunks, slot: int) -> None:
    slots, places = chunks.slots, chunks.tenants.places
    tenant = slots.tenant[slot]
    if slots.keys[slot] is None:
        raise _broken("slots", f"slot {slot} holds no key")
    if not (
        0 <= tenant < len(places)
        and chunks.tenants.by_name.get(places[tenant].name) is places[tenant]
    ):
        raise _broken("slots", f"slot {slot} is charged to place {tenant}, which holds no record")
    nbytes, pages = slots.nbytes[slot], slots.pages[slot]
    if nbytes <= 0 or pages != chunks.pages_for(nbytes):
        raise _broken("slots", f"slot {slot} holds {nbytes} bytes on {pages} pages")
    if slots.offsets[slot] != chunks.offset_of(slots.first_page[slot]):
        raise _broken("slots", f"slot {slot}'s offset is not its first page's")
    if slots.readers[slot] < 0:
        raise _broken("slots", f"slot {slot} has {slots.readers[slot]} readers")
    if slots.last_use[slot] > slots.tick:
        raise _broken("slots", f"slot {slot} was used at a tick still to come")
    # A quarantined slot may keep the number of a record from before a restart.
    if slots.state[slot] != State.QUARANTINED and slots.sequence[slot] > chunks.commit_sequence:
        raise _broken("slots", f"slot {slot}'s commit number was never handed out")


def _check_pages(chunks: Chunks) -> None:
    """Live chunks and free extents cover the data region exactly, without overlap."""
    slots, allocator = chunks.slots, chunks.allocator
    free = allocator.free_extents()
    if allocator.free_pages != sum(pages for _, pages in free):
        raise _broken("pages", f"{allocator.free_pages} pages counted free, not the extents'")
    runs = free + [
        (slots.first_page[slot], slots.pages[slot])
        for slot in range(len(slots.keys))
        if slots.state[slot] != State.FREE
    ]
    position = 0
    for start, pages in sorted(runs):
        if start != position:
            raise _broken("pages", f"overlap or hole at page {position}")
        position += pages
    if position != allocator.total_pages:
        raise _broken("pages", f"chunks and free extents end at page {position}")


def _check_index(chunks: Chunks) -> None:
    """The index holds exactly the chunks being written or ready, each under its key."""
    slots = chunks.slots
    for key, slot in chunks.index.items():
        if slots.keys[slot] != key or slots.state[slot] not in _FINDABLE:
            raise _broken(
                "index",
                f"key {key.hex()[:12]} names slot {slot}, which holds another key "
                f"or is {STATES[slots.state[slot]].name}",
            )
    findable = sum(1 for state in slots.state if state in _FINDABLE)
    if findable != len(chunks.index):
        raise _broken(
            "index", f"{findable} chunks are written or ready, {len(chunks.index)} indexed"
        )


def _check_chains(chunks: Chunks) -> None:
    """Links are mutual, stay within a tenant and never loop; unlinked slots have none."""
    slots = chunks.slots
    total = len(slots.keys)
    for slot in range(total):
        parent = slots.parent[slot]
        if slots.state[slot] in (State.FREE, State.QUARANTINED):
            if (parent, slots.first_child[slot]) != (NIL, NIL) or (
                slots.next_sibling[slot],
                slots.prev_sibling[slot],
            ) != (NIL, NIL):
                raise _broken("chains", f"{STATES[slots.state[slot]].name} slot {slot} is linked")
            continue
        if parent != NIL:
            if slots.state[parent] not in _LINKABLE:
                raise _broken("chains", f"slot {slot}'s predecessor {parent} holds no chunk")
            if slots.tenant[parent] != slots.tenant[slot]:
                raise _broken("chains", f"slot {slot}'s chain crosses tenants at {parent}")
            if slot not in slots.children(parent):
                raise _broken("chains", f"slot {slot} is not a child of its predecessor")
        before, child = NIL, slots.first_child[slot]
        for _ in range(total):
            if child == NIL:
                break
            if slots.parent[child] != slot or slots.prev_sibling[child] != before:
                raise _broken("chains", f"slot {child} is listed a child of {slot}, not linked")
            before, child = child, slots.next_sibling[child]
        if child != NIL:
            raise _broken("chains", f"slot {slot}'s children loop")
    settled: set[int] = set()
    for start in range(total):
        path: set[int] = set()
        slot = start
        while slot != NIL and slot not in settled:
            if slot in path:
                raise _broken("chains", f"the chain through slot {start} loops")
            path.add(slot)
            slot = slots.parent[slot]
        settled |= path


def _check_leases(chunks: Chunks, leases: LeaseTable) -> None:
    """Every lock belongs to an open lease, every chunk being written to one write lease."""
    slots = chunks.slots
    readers: Counter[int] = Counter()
    writers: Counter[int] = Counter()
    scheduled = set(leases.expiry_heap)
    for lease, record in leases.active.items():
        if lease in leases.quarantine.leases:
            raise _broken("leases", f"lease {lease} is both open and quarantined")
        if record.expires != math.inf and (record.expires, lease) not in scheduled:
            raise _broken("leases", f"lease {lease} is not in the expiry heap: it never expires")
        (writers if record.writing else readers).update(record.slots)
        allowed = (State.WRITING if record.writing else State.READY, State.DOOMED)
        for slot in record.slots:
            if slots.state[slot] not in allowed:
                name = STATES[slots.state[slot]].name
                raise _broken("leases", f"lease {lease} holds slot {slot}, which is {name}")
    if leases.write_leases != sum(record.writing for record in leases.active.values()):
        raise _broken("leases", f"{leases.write_leases} write leases counted open")
    for slot in range(len(slots.keys)):
        state = slots.state[slot]
        if slots.readers[slot] != readers[slot]:
            raise _broken(
                "leases",
                f"slot {slot} has {slots.readers[slot]} readers, {readers[slot]} read leases",
            )
        if state == State.DOOMED:
            if not readers[slot] + writers[slot]:
                raise _broken("leases", f"cleared slot {slot} is held by no lease: never freed")
            if writers[slot] > 1:
                raise _broken("leases", f"slot {slot} is held by {writers[slot]} write leases")
        elif writers[slot] != (state == State.WRITING):
            raise _broken("leases", f"slot {slot} is held by {writers[slot]} write leases")


def _check_quarantine(chunks: Chunks, leases: LeaseTable) -> None:
    """Expired write leases hold their slots, fences ending oldest first."""
    state = chunks.slots.state
    held: Counter[int] = Counter()
    fence = -math.inf
    for lease, record in leases.quarantine.leases.items():
        if not record.writing:
            raise _broken("quarantine", f"read lease {lease} is quarantined")
        if record.expires < fence:
            raise _broken("quarantine", f"lease {lease}'s fence ends before an older one's")
        fence = record.expires
        held.update(record.slots)
    for slot in range(len(state)):
        if held[slot] != (state[slot] == State.QUARANTINED):
            raise _broken(
                "quarantine",
                f"{STATES[state[slot]].name} slot {slot} is held by {held[slot]} "
                "quarantined leases",
            )


def _check_records(chunks: Chunks) -> None:
    """Each record sits at its place in the list; dropped records' places are vacant."""
    tenants = chunks.tenants
    records, places, idle = tenants.by_name, tenants.places, tenants.idle
    for name, account in records.items():
        if account.name != name:
            raise _broken("records", f"record {account.name!r} is filed as {name!r}")
        if not (0 <= account.index < len(places) and places[account.index] is account):
            raise _broken("records", f"record {name!r} is not at its place")
    if len(set(idle.vacancies)) != len(idle.vacancies) or any(
        places[place] is not idle.vacant for place in idle.vacancies
    ):
        raise _broken("records", "a vacancy is listed twice or holds a record")
    if len(records) + len(idle.vacancies) != len(places):
        raise _broken(
            "records",
            f"{len(records)} records, {len(idle.vacancies)} vacancies, {len(places)} places",
        )
    for name, account in idle.records.items():
        if records.get(name) is not account:
            raise _broken("records", f"idle record {name!r} is not a record")
    vacant = idle.vacant
    if vacant.used_bytes or vacant.chunks or next(vacant.policy.victims(), None) is not None:
        raise _broken("records", "the vacant record was charged")


def _check_usage(chunks: Chunks) -> None:
    """Each record's bytes and chunks, and the cache's, are what its slots hold."""
    slots = chunks.slots
    used: Counter[int] = Counter()
    held: Counter[int] = Counter()
    for slot in range(len(slots.keys)):
        if slots.state[slot] != State.FREE:
            used[slots.tenant[slot]] += slots.nbytes[slot]
            held[slots.tenant[slot]] += 1
    for account in chunks.tenants.by_name.values():
        if (account.used_bytes, account.chunks) != (used[account.index], held[account.index]):
            raise _broken(
                "usage",
                f"record {account.name!r} counts {account.used_bytes} bytes in "
                f"{account.chunks} chunks; its slots hold {used[account.index]} in "
                f"{held[account.index]}",
            )
    if chunks.stored_bytes != sum(used.values()):
        raise _broken("usage", f"{chunks.stored_bytes} bytes counted, {sum(used.values())} held")


def _check_policies(chunks: Chunks) -> None:
    """Each record's policy orders exactly the record's ready chunks, each once."""
    slots = chunks.slots
    ready: dict[int, set[int]] = {}
    for slot in range(len(slots.keys)):
        if slots.state[slot] == State.READY:
            ready.setdefault(slots.tenant[slot], set()).add(slot)
    for account in chunks.tenants.by_name.values():
        victims = list(account.policy.victims())
        if len(victims) != len(set(victims)) or set(victims) != ready.get(account.index, set()):
            raise _broken(
                "policies",
                f"record {account.name!r}'s policy orders {victims}, its ready chunks are "
                f"{sorted(ready.get(account.index, set()))}",
            )


def _check_pins(chunks: Chunks) -> None:
    """Only ready chunks are pinned, each by a pin of its tenant, within the tenant's budget."""
    slots, pins = chunks.slots, chunks.pins
    flagged = 0
    for slot in range(len(slots.keys)):
        if slots.pinned[slot]:
            flagged += 1
            if slots.state[slot] != READY:
                raise _broken("pins", f"{STATES[slots.state[slot]].name} slot {slot} is pinned")
    held = 0
    for tenant, entry in pins.by_tenant.items():
        named: Counter[bytes] = Counter()
        for keys in entry.names.values():
            named.update(keys)
        if not entry.names or named != entry.wanted:
            raise _broken("pins", f"tenant {tenant!r}'s wanted keys are not its pins' keys")
        pinned_bytes = 0
        for key in entry.pinned:
            slot = chunks.index.get(key, NIL)
            owner = chunks.tenants.places[slots.tenant[slot]].name if slot != NIL else None
            if slot == NIL or not slots.pinned[slot] or owner != tenant or key not in named:
                raise _broken("pins", f"tenant {tenant!r} counts {key.hex()[:12]} pinned")
            pinned_bytes += slots.nbytes[slot]
        if pinned_bytes != entry.pinned_bytes or pinned_bytes > pins.budget(tenant):
            raise _broken(
                "pins",
                f"tenant {tenant!r} counts {entry.pinned_bytes} bytes pinned, holds "
                f"{pinned_bytes}, budget {pins.budget(tenant)}",
            )
        held += len(entry.pinned)
    if held != flagged:
        raise _broken("pins", f"{flagged} slots are pinned, the pins count {held}")


def _broken(invariant: str, detail: str) -> InvariantError:
    return InvariantError(f"L1 invariant broken ({invariant}): {detail}")
