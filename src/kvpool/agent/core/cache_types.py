"""The L1 cache's contract: what its callers pass, get back, catch and implement.

Kept apart from the cache itself (:mod:`kvpool.agent.core.l1`) so that the service, the
transports, the HTTP API and L2 read these types without loading the mechanism
(allocator, journal, policies).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

from kvpool.common.quotas import Limit


class EvictionCause(enum.StrEnum):
    """Why chunks left L1: the keys of :attr:`L1Stats.evictions`, the ``cause`` of
    :meth:`ChunkListener.removed`."""

    WATERMARK = "watermark"
    PRESSURE = "pressure"
    QUOTA = "quota"


class CacheError(Exception):
    """A request the cache refuses; ``code`` is stable and machine-readable."""

    code = "error"


class InvalidRequest(CacheError):
    code = "invalid_request"


class UnknownLease(CacheError):
    code = "unknown_lease"


class LeaseExpired(CacheError):
    """A write lease expired before its commit; its pages are quarantined.

    See :mod:`kvpool.agent.core.l1` for why.
    """

    code = "lease_expired"


class PinRefused(CacheError):
    """A pin the tenant's pin budget (0: pinning is off) or the bound on pinned keys refuses."""

    code = "pin_refused"


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a chunk's bytes live: an absolute offset into the segment file."""

    key: bytes
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Reservation:
    """Result of :meth:`~kvpool.agent.core.l1.L1Cache.reserve`.

    ``placements[i]`` is where to write ``keys[i]``, or None if that key is
    already cached (nothing to copy). Keys past ``len(placements)`` were
    refused for ``refused_reason``; a gap would make the rest unreachable, so
    refusal always covers the tail of the request.
    """

    lease: int | None
    placements: tuple[Placement | None, ...]
    refused_reason: str | None = None


@dataclass(frozen=True)
class TenantStats:
    tenant: str
    used_bytes: int
    chunks: int
    quota_bytes: Limit
    hits: int
    misses: int
    stored_chunks: int
    evicted_chunks: int


@dataclass(frozen=True, slots=True)
class PinState:
    """One named pin of a tenant: how many of its keys L1 holds, and holds pinned."""

    name: str
    keys: int
    resident: int
    """Keys whose chunk is ready in L1."""
    pinned: int
    """Of those, the chunks the pin budget holds pinned (the rest stay evictable)."""
    pinned_bytes: int


@dataclass(frozen=True)
class TenantPins:
    """A tenant's pins, its pin budget and the bytes of L1 its pinned chunks hold."""

    tenant: str
    budget_bytes: int
    pinned_bytes: int
    pins: list[PinState]


@dataclass(frozen=True)
class L1Stats:
    capacity_bytes: int
    allocated_bytes: int
    stored_bytes: int
    chunks: int
    held_chunks: int
    """Chunks charged to tenants (being written, ready, or cleared but still locked)."""
    hits: int
    misses: int
    written_bytes: int
    """Total bytes of chunks committed."""
    read_bytes: int
    """Total bytes of chunks returned read-locked (retrieves)."""
    evictions: dict[str, int]
    lock_expiries: int
    open_leases: int
    quarantined_leases: int
    """Write leases that expired before their commit (their pages were quarantined)."""
    quarantined_bytes: int
    """Bytes of pages held back now from expired write leases."""
    free_extents: int
    fragmentation: float
    """External: 1 - largest free extent / free bytes."""
    page_waste: float
    """Internal: share of allocated bytes that round chunks up to whole pages."""
    tenant_count: int
    """Tenant records: those holding chunks or a quota, and up to ``idle_tenants`` more."""


class ChunkListener(Protocol):
    """Told when ready chunks appear in or leave L1 (for the pool-wide prefix index).

    Called with the cache's lock held: implementations must be quick and never
    call back into the cache.
    """

    def stored(self, tenant: str, keys: list[bytes]) -> None: ...

    def removed(self, tenant: str, keys: list[bytes], cause: str) -> None: ...


class ChunkBacking(Protocol):
    """Where chunks' bytes live: each account's own memory, given to the pages of a chunk
    as it is placed (the agent's :class:`~kvpool.common.chunk_files.ChunkFiles`).

    Called with the cache's lock held.
    """

    def take(self, owner: str, offset: int, length: int) -> None:
        """Give ``owner`` the memory of ``length`` bytes at ``offset``; ``OSError`` if there
        is none."""

    def claim(self, owner: str, offset: int, length: int) -> None:
        """Note that ``owner`` holds those bytes already (a restored chunk)."""

    def trim_all(self) -> None:
        """Free every account's memory outside what it holds (after the restored claims)."""

    def strays(self) -> list[str]:
        """The accounts that hold more memory than was given them (a client wrote into
        holes): :meth:`trim` them."""

    def trim(self, owner: str) -> None: ...


@dataclass(frozen=True)
class RestoreReport:
    restored: int
    discarded: int
    """Records that failed their checksum, pointed outside the segment or overlapped."""
    quarantined: int = 0
    """Chunks that were reserved, not committed: their pages are held back for a fence."""


class TenantRecord(Protocol):
    """A tenant's record as readers outside the cache see it (read-only)."""

    @property
    def name(self) -> str: ...

    @property
    def used_bytes(self) -> int: ...

    @property
    def chunks(self) -> int: ...

    @property
    def hits(self) -> int: ...

    @property
    def misses(self) -> int: ...

    @property
    def stored_chunks(self) -> int: ...

    @property
    def evicted_chunks(self) -> int: ...
