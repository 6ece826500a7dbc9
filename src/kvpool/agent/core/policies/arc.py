"""Adaptive Replacement Cache (Megiddo & Modha, FAST 2003), driven from outside.

Four lists::

    T1  resident, seen once            B1  ghosts of keys evicted from T1
    T2  resident, seen at least twice  B2  ghosts of keys evicted from T2

``target`` is the size T1 should have. A miss that hits ghost list B1 means T1
was too small: ``target`` grows by max(1, |B2|/|B1|). A hit in B2 shrinks it by
max(1, |B1|/|B2|). Victims come from T1 while it is larger than ``target`` and
from T2 otherwise (the paper's REPLACE), then from the other list.

The cache, not the policy, decides when and how much to evict, so the
paper's capacity ``c`` is replaced by the largest resident count seen; ghost
lists are trimmed to it. Ghosts are keys (a chunk's identity outlives its slot).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterator, Sequence

from kvpool.agent.core.policies.slotlists import SlotArena


class ARCPolicy:
    def __init__(self, arena: SlotArena) -> None:
        self._t1 = arena.new_list()
        self._t2 = arena.new_list()
        self._b1: OrderedDict[bytes, None] = OrderedDict()
        self._b2: OrderedDict[bytes, None] = OrderedDict()
        self.target = 0.0
        self._capacity = 1

    def insert(self, slot: int, key: bytes) -> None:
        if key in self._b1:
            self.target = min(
                self.target + max(1.0, len(self._b2) / len(self._b1)), float(self._capacity)
            )
            del self._b1[key]
            self._t2.append(slot)
        elif key in self._b2:
            self.target = max(self.target - max(1.0, len(self._b1) / len(self._b2)), 0.0)
            del self._b2[key]
            self._t2.append(slot)
        else:
            self._t1.append(slot)
        self._capacity = max(self._capacity, len(self._t1) + len(self._t2))

    def touch(self, slots: Sequence[int]) -> None:
        t1 = self._t1
        for slot in slots:
            if slot in t1:
                t1.remove(slot)
                self._t2.append(slot)
        self._t2.move_to_tail(slots)

    def remove(self, slot: int, key: bytes, *, evicted: bool) -> None:
        from_t1 = slot in self._t1
        (self._t1 if from_t1 else self._t2).remove(slot)
        if evicted:
            ghosts = self._b1 if from_t1 else self._b2
            ghosts[key] = None
            self._trim_ghosts()

    def requeue(self, slots: Sequence[int]) -> None:
        for resident in (self._t1, self._t2):
            resident.move_to_tail([slot for slot in slots if slot in resident])

    def victims(self) -> Iterator[int]:
        if len(self._t1) > self.target or not self._t2:
            return itertools.chain(self._t1, self._t2)
        return itertools.chain(self._t2, self._t1)

    def _trim_ghosts(self) -> None:
        while len(self._b1) + len(self._b2) > self._capacity:
            longer = self._b1 if len(self._b1) >= len(self._b2) else self._b2
            longer.popitem(last=False)
