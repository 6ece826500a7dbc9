"""Pins: per tenant, named lists of chunk keys whose ready chunks L1 keeps, within a budget.

A pin names keys, whose chunks may arrive later: a chunk becomes pinned when it becomes
ready (or when a pin names it while it is ready), unless that would take its tenant's
pinned bytes past the tenant's pin budget; then it stays an ordinary chunk (a pin's
state says how many of its keys are resident, and how many of those pinned). Which
chunks the budget holds is settled again, in the order their keys were first pinned,
whenever the tenant's pins or its budget change. A pinned chunk that leaves L1 (cleared,
or evicted when its tenant's quota shrinks) frees its share of the budget at once.

Eviction never takes a pinned chunk (:mod:`~kvpool.agent.core.l1.planner`), except for a
quota that shrank below what its tenant holds: a pin never lets a tenant exceed its
quota, and pinned chunks count against it as any other.

Pins live in memory only: a restarted agent has none until they are set again.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvpool.agent.core.cache_types import PinRefused, PinState, TenantPins
from kvpool.agent.core.l1.slots import NIL, READY, SlotTable
from kvpool.agent.core.l1.tenants import TenantTable

MAX_PINNED_KEYS = 1 << 16
"""Keys one tenant's pins may name together (2 MiB of keys)."""


@dataclass
class Pins:
    """One tenant's pins."""

    names: dict[str, tuple[bytes, ...]] = field(default_factory=dict)
    wanted: Counter[bytes] = field(default_factory=Counter)
    """Every key the pins name, with how many pins name it, in the order first pinned."""
    pinned: set[bytes] = field(default_factory=set)
    """Keys whose ready chunk is pinned."""
    pinned_bytes: int = 0


class PinSets:
    def __init__(
        self,
        slots: SlotTable,
        index: Mapping[bytes, int],
        tenants: TenantTable,
        default_budget: int,
        max_keys: int = MAX_PINNED_KEYS,
    ) -> None:
        self._slots = slots
        self._index = index
        self._tenants = tenants
        self.default_budget = default_budget
        """The pin budget of a tenant that :attr:`budgets` does not name."""
        self.budgets: dict[str, int] = {}
        self.by_tenant: dict[str, Pins] = {}
        self.max_keys = max_keys

    def budget(self, tenant: str) -> int:
        return self.budgets.get(tenant, self.default_budget)

    def put(self, tenant: str, name: str, keys: Sequence[bytes]) -> PinState:
        """Make the pin ``name`` of ``tenant`` exactly ``keys`` (a new one, or replaced)."""
        budget = self.budget(tenant)
        if budget <= 0:
            raise PinRefused(
                f"the pin budget of tenant {tenant} is 0 bytes, so it may pin nothing: a "
                "shared space's pinBudget sets one, else the agent's default_pin_budget"
            )
        entry = self.by_tenant.get(tenant, Pins())
        unique = tuple(dict.fromkeys(keys))
        wanted = Counter(entry.wanted)
        wanted.subtract(entry.names.get(name, ()))
        wanted += Counter(unique)  # keeps positive counts only, in their first order
        if len(wanted) > self.max_keys:
            raise PinRefused(
                f"tenant {tenant}'s pins would name {len(wanted)} keys; at most "
                f"{self.max_keys} together"
            )
        entry.names[name] = unique
        entry.wanted = wanted
        self.by_tenant[tenant] = entry
        self.settle(tenant)
        return self._state(entry, name, self._owner(tenant))

    def delete(self, tenant: str, name: str) -> bool:
        """Drop one pin; whether there was one. Its chunks stay, evictable unless another
        pin of the tenant names them."""
        entry = self.by_tenant.get(tenant)
        if entry is None or name not in entry.names:
            return False
        entry.wanted.subtract(entry.names.pop(name))
        entry.wanted = +entry.wanted
        if entry.names:
            self.settle(tenant)
        else:
            self.drop(tenant)
        return True

    def drop(self, tenant: str | None = None) -> None:
        """Drop every pin (of one tenant, or all)."""
        tenants = list(self.by_tenant) if tenant is None else [tenant]
        for name in tenants:
            entry = self.by_tenant.pop(name, None)
            if entry is not None:
                self._unpin_all(entry)

    def replace_budgets(self, budgets: Mapping[str, int]) -> None:
        """Make the budgets named exactly ``budgets``; settle the tenants whose budget changed."""
        before = {tenant: self.budget(tenant) for tenant in self.by_tenant}
        self.budgets = dict(budgets)
        for tenant, budget in before.items():
            if self.budget(tenant) != budget:
                self.settle(tenant)

    def settle(self, tenant: str) -> None:
        """Pin the tenant's ready chunks its pins name, first pinned first, within its budget."""
        entry = self.by_tenant.get(tenant)
        if entry is None:
            return
        self._unpin_all(entry)
        owner, budget = self._owner(tenant), self.budget(tenant)
        if owner == NIL:
            return
        for key in entry.wanted:
            slot = self._index.get(key, NIL)
            if slot != NIL:
                self._try_pin(entry, slot, owner, budget)

    def arrived(self, slot: int, tenant: str) -> None:
        """A chunk of ``tenant`` became ready: pinned if a pin names it and the budget allows."""
        entry = self.by_tenant.get(tenant)
        if entry is not None and self._slots.key(slot) in entry.wanted:
            self._try_pin(entry, slot, self._slots.tenant[slot], self.budget(tenant))

    def left(self, slot: int) -> None:
        """A ready chunk stops being ready: its share of the budget is free again."""
        slots = self._slots
        if not slots.pinned[slot]:
            return
        entry = self.by_tenant[self._tenants.places[slots.tenant[slot]].name]
        slots.pinned[slot] = 0
        entry.pinned.discard(slots.key(slot))
        entry.pinned_bytes -= slots.nbytes[slot]

    def pinned_bytes(self) -> dict[str, int]:
        """Bytes pinned per tenant that has pins."""
        return {tenant: entry.pinned_bytes for tenant, entry in self.by_tenant.items()}

    def is_pinned(self, tenant: str, key: bytes) -> bool:
        entry = self.by_tenant.get(tenant)
        return entry is not None and key in entry.pinned

    def report(self, tenant: str) -> TenantPins:
        entry = self.by_tenant.get(tenant, Pins())
        owner = self._owner(tenant)
        return TenantPins(
            tenant,
            self.budget(tenant),
            entry.pinned_bytes,
            [self._state(entry, name, owner) for name in entry.names],
        )

    def _state(self, entry: Pins, name: str, owner: int) -> PinState:
        keys = entry.names[name]
        slots, find = self._slots, self._index.get
        resident = [
            slot
            for slot in (find(key, NIL) for key in keys)
            if slot != NIL and slots.state[slot] == READY and slots.tenant[slot] == owner
        ]
        pinned = [slot for slot in resident if slots.pinned[slot]]
        return PinState(
            name, len(keys), len(resident), len(pinned), sum(slots.nbytes[s] for s in pinned)
        )

    def _owner(self, tenant: str) -> int:
        account = self._tenants.by_name.get(tenant)
        return NIL if account is None else account.index

    def _try_pin(self, entry: Pins, slot: int, owner: int, budget: int) -> None:
        slots = self._slots
        nbytes = slots.nbytes[slot]
        if (
            slots.state[slot] == READY
            and slots.tenant[slot] == owner
            and not slots.pinned[slot]
            and entry.pinned_bytes + nbytes <= budget
        ):
            slots.pinned[slot] = 1
            entry.pinned.add(slots.key(slot))
            entry.pinned_bytes += nbytes

    def _unpin_all(self, entry: Pins) -> None:
        flags, index = self._slots.pinned, self._index
        for key in entry.pinned:
            flags[index[key]] = 0
        entry.pinned.clear()
        entry.pinned_bytes = 0
