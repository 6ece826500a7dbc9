"""The contract every L2 tier implements.

Operations are batched and answer per key, in order: one failing key never
fails the batch. ``get`` returns only verified bytes: an object whose header
or checksum does not match is a miss (counted by the adapter and deleted),
never served. Adapters bound their own concurrency and never raise for an
unreachable backend; they report per-key failures instead (``False`` or
``None``), so a dead tier costs the cache nothing but misses. The one exception
is :meth:`L2Adapter.drop_tenant`, whose caller must learn that a drop is
incomplete (:class:`TierUnavailable`) to try again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


class TierUnavailable(RuntimeError):
    """The tier could not finish a tenant's drop; some of its objects may remain."""


@dataclass(frozen=True, slots=True)
class ObjectKey:
    """A chunk in L2: its tenant (the tenant id, never the salt) and its chunk key."""

    tenant: str
    key: bytes


@dataclass(frozen=True, slots=True)
class L2Object:
    name: ObjectKey
    payload: bytes | memoryview


@dataclass
class AdapterStats:
    """Plain counters an adapter keeps; the metrics module exports them."""

    puts: int = 0
    put_failures: int = 0
    put_bytes: int = 0
    gets: int = 0
    hits: int = 0
    get_bytes: int = 0
    integrity_failures: int = 0
    evictions: int = 0
    used_bytes: int = 0
    """Bytes held in the tier (where the adapter knows; S3 does not)."""


class L2Adapter(Protocol):
    name: str
    stats: AdapterStats

    async def put(self, objects: Sequence[L2Object]) -> list[bool]:
        """Store each object; True where it is durably stored (or already was)."""
        ...

    async def get(self, keys: Sequence[ObjectKey]) -> list[bytes | memoryview | None]:
        """The verified payload of each key, or None (missing, corrupt or unreachable)."""
        ...

    async def exists(self, keys: Sequence[ObjectKey]) -> list[bool]: ...

    async def delete(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """True where the object is gone afterwards."""
        ...

    async def enforce_quota(self, tenant: str) -> int:
        """Evict the tenant's objects down to its quota now (a quota shrank); how many went."""
        ...

    async def drop_tenant(self, tenant: str) -> int:
        """Delete every object of ``tenant`` in this tier (its KVCacheTenant is gone); how many.

        Idempotent: dropping an absent tenant is 0. Raises :class:`TierUnavailable` if the
        backend failed before every object was gone. The adapters document its cost.
        """
        ...

    async def close(self) -> None: ...


class Destination(Protocol):
    """Where a tier that receives in place puts a chunk (the prefetch's landing)."""

    def turn(self) -> bool | None:
        """Whether the chunk may be placed now (the chunk before it holds its place): None
        while that is not decided yet, False if it never will be."""
        ...

    def wait_turn(self) -> bool:
        """:meth:`turn`, once decided (blocks)."""
        ...

    def reserve(self, size: int) -> memoryview | None:
        """The memory for the chunk's ``size`` bytes; None: read nothing into it."""
        ...


@runtime_checkable
class ReceivesInPlace(Protocol):
    """A tier that receives a chunk straight into memory it is given (the peer tier)."""

    async def get_into(self, name: ObjectKey, into: Destination) -> bool:
        """Receive ``name`` into ``into.reserve(size)`` and verify it there, in ``into``'s
        turn; True if it is there and intact. False: no holder gave it, or ``into`` gave no
        memory or no turn."""
        ...

    async def get_run_into(self, names: Sequence[ObjectKey], into: Sequence[Destination]) -> int:
        """Consecutive chunks of one prefix, each as :meth:`get_into` receives it, in one go
        where the tier can: how many of them, from the first, are there. It stops at the
        first it could not give; those after it are left to :meth:`get_into`."""
        ...
