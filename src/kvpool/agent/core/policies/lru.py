"""Least recently used: one list, hits move a slot to the newest end."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from kvpool.agent.core.policies.slotlists import SlotArena


class LRUPolicy:
    def __init__(self, arena: SlotArena) -> None:
        self._order = arena.new_list()

    def insert(self, slot: int, key: bytes) -> None:
        self._order.append(slot)

    def touch(self, slots: Sequence[int]) -> None:
        self._order.move_to_tail(slots)

    def remove(self, slot: int, key: bytes, *, evicted: bool) -> None:
        self._order.remove(slot)

    def requeue(self, slots: Sequence[int]) -> None:
        self._order.move_to_tail(slots)

    def victims(self) -> Iterator[int]:
        return iter(self._order)
