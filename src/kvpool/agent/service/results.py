"""What the service's operations answer: plain values that the edges encode."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpool.agent.core.cache_types import TenantStats
from kvpool.common.quotas import Limit, TierLimits


@dataclass(frozen=True, slots=True)
class SnapshotResult:
    """Every ready key by tenant (the answer to the wire's :class:`~kvpool.common.protocol.Snapshot`
    request)."""

    seq: int
    """The last chunk event published when the keys were read (0 without events)."""
    keys_by_tenant: dict[str, list[bytes]]
    """L1's keys."""
    tiers: dict[str, dict[str, list[bytes]]] = field(default_factory=dict)
    """The keys of the lower tiers asked for and listed, by tier name, then by tenant."""


@dataclass(frozen=True)
class QuotaView:
    tenant: str
    limits: TierLimits
    explicit: bool
    """False when the tenant has no quota of its own and the default applies."""

    @property
    def limit(self) -> Limit:
        """The L1 limit."""
        return self.limits.l1


class AboveCeiling(ValueError):
    """A tenant asked for more than it may set itself: its ceiling (set by its KVCacheTenant),
    or without one the default quota; nothing changed."""


@dataclass(frozen=True, slots=True)
class Dropped:
    l1_chunks: int
    l2_objects: int


@dataclass(frozen=True)
class TenantRanking:
    """The tenants that use the most L1, and the rest summed (for bounded metric labels)."""

    largest: list[TenantStats]
    """Largest first."""
    rest_used_bytes: int
    rest_chunks: int
    rest_count: int


class WarmRefused(RuntimeError):
    """A warm could not start loading: the prefetch slots warms may take are all busy."""


@dataclass(frozen=True, slots=True)
class Warmed:
    """What a warm did: the keys' leading run in L1 now, and what it loaded from L2."""

    keys: int
    resident: int
    """Leading keys whose chunks are in L1 now (what a lookup would hit)."""
    loaded: int
    """Chunks this warm loaded from L2 into L1 before it answered."""
    missing: int | None
    """Keys from the first one that neither L1 nor any L2 tier holds, to the end; None if
    the tiers were not searched before the timeout."""
    done: bool
    """False: the timeout passed first, and the load goes on."""


@dataclass
class WarmCounts:
    requests: int = 0
    loaded_chunks: int = 0


@dataclass(frozen=True)
class SpaceUsage:
    """A shared space this agent knows: its usage as a tenant's, and its pins' bytes."""

    space: str
    """Its tenant id."""
    source: str
    """Where it is declared: ``namespace/pool/name`` (a pool's ``spec.sharedSpaces``), or
    ``tokens file``."""
    members: int
    owners: int
    usage: TenantStats
    nvme_used_bytes: int
    pinned_bytes: int
    pin_budget_bytes: int
