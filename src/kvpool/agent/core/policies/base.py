"""The contract between the L1 cache (which acts) and an eviction policy (which orders).

A policy only keeps an order over the slots of one tenant and proposes victims;
it never frees memory, never looks at locks and never decides how much to
evict. The cache calls ``insert`` when a chunk becomes ready, ``touch`` with the
slots of every lookup's hits, ``remove`` when a chunk leaves (``evicted`` tells a policy with ghost
history whether to remember it) and walks ``victims()`` without changing
anything in between, skipping slots it may not evict. It calls ``requeue`` with
the slots it passed over because they are the prefix of chunks still cached.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

from kvpool.agent.core.policies.slotlists import SlotArena


class EvictionPolicy(Protocol):
    def insert(self, slot: int, key: bytes) -> None: ...

    def touch(self, slots: Sequence[int]) -> None:
        """Hits, in the order they happened (the last one is the most recent)."""
        ...

    def remove(self, slot: int, key: bytes, *, evicted: bool) -> None: ...

    def requeue(self, slots: Sequence[int]) -> None:
        """Rank ``slots`` newest within whatever list each is in; not a use (no promotion)."""
        ...

    def victims(self) -> Iterator[int]:
        """Resident slots, best victim first; lazy, and invalid once the policy changes."""
        ...


class PolicyFactory(Protocol):
    def __call__(self, arena: SlotArena) -> EvictionPolicy: ...
