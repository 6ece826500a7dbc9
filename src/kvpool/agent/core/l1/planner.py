"""The eviction plan: which chunks go to free an amount, chosen without changing anything.

Why only chain tails go, and how tenants and policies order the victims, is told in
:mod:`kvpool.agent.core.l1`; why pinned chunks stay, in :mod:`~kvpool.agent.core.l1.pin_sets`.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvpool.agent.core.l1.chunks import Chunks
from kvpool.agent.core.l1.slots import NIL, READY, SlotTable
from kvpool.agent.core.l1.tenants import Tenant


@dataclass
class EvictionPlan:
    victims: dict[int, None] = field(default_factory=dict)
    freed: int = 0
    waiting: dict[int, int] = field(default_factory=dict)
    """Chunks passed over as the prefix of others: how many children are not victims yet."""


def plan_eviction(
    chunks: Chunks,
    need: int,
    measure: array[int],
    scope: Tenant | None,
    protected: set[int],
    *,
    required: int = 0,
    take_pinned: bool = False,
) -> EvictionPlan:
    """Choose victims worth ``need`` (in ``measure`` units: bytes or pages of each slot).

    Only chain tails are victims, so what stays is whole prefixes whatever order the
    policy proposes (a long prompt stored over several steps has its head oldest). A
    chunk proposed while it has children waits, and goes the moment its last child
    does: the policy ranked it before everything still to come. A chunk with a locked
    descendant, or one being written, stays: it is the prefix of a chunk in use.
    Chunks still waiting at the end get a second chance (the eviction ranks them anew,
    newest).

    ``required``: how much of ``need`` a store cannot proceed without (the chunk it
    places, or the part of its run that does not fit). With L2 tiers, and only if tails
    alone free less than that, the chunks passed over go too, oldest first, until it is
    freed: a chain longer than L1 (or its tenant's quota) still reaches L2 whole. The
    rest of ``need`` (a watermark) is only ever met by tails.

    Pinned chunks stay, unless ``take_pinned`` (a quota that shrank below them).
    """
    plan = EvictionPlan()
    slots = chunks.slots
    first_child = slots.first_child
    for slot in _victim_order(chunks, scope):
        if plan.freed >= need:
            break
        if not _evictable(slots, slot, protected, take_pinned):
            continue
        if first_child[slot] != NIL:
            kept = sum(1 for child in slots.children(slot) if child not in plan.victims)
            if kept:
                plan.waiting[slot] = kept
                continue
        _take(slots, plan, slot, need, measure)
    if plan.freed < required and chunks.lower_tier:
        # Tails alone do not make room for the store (a chain being extended, locked or
        # written back is all there is): older chunks go too, since a prefetch brings a
        # prefix back. Without this, the rest of a chain longer than L1 would never be
        # stored, nor reach L2.
        for slot in list(plan.waiting):
            if plan.freed >= required:
                break
            del plan.waiting[slot]
            plan.victims[slot] = None
            plan.freed += measure[slot]
    return plan


def _take(slots: SlotTable, plan: EvictionPlan, slot: int, need: int, measure: array[int]) -> None:
    """Make ``slot`` a victim, then each waiting ancestor that has no child left."""
    victim = slot
    while True:
        plan.victims[victim] = None
        plan.freed += measure[victim]
        parent = slots.parent[victim]
        if parent not in plan.waiting or plan.freed >= need:
            return
        plan.waiting[parent] -= 1
        if plan.waiting[parent]:
            return
        del plan.waiting[parent]
        victim = parent


def _victim_order(chunks: Chunks, scope: Tenant | None) -> Iterator[int]:
    if scope is not None:
        return scope.policy.victims()
    places = chunks.tenants.places
    candidates = [account.policy.victims() for account in places if account.chunks]
    return heapq.merge(*candidates, key=chunks.slots.last_use.__getitem__)


def _evictable(slots: SlotTable, slot: int, protected: set[int], take_pinned: bool) -> bool:
    return (
        slots.state[slot] == READY
        and slots.readers[slot] == 0
        and slot not in protected
        and (take_pinned or not slots.pinned[slot])
    )
