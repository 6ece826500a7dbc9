"""What the service calls on the parts attached below and beside it (given at composition).

The L2 controllers implement these protocols (:mod:`kvpool.agent.tiering`), the events
publisher :class:`SequencedListener`; the service imports none of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvpool.agent.core.cache_types import ChunkListener
from kvpool.common.transfer_results import LookupResult


class Pins(Protocol):
    """Read locks without expiry on single chunks, for the write-back.

    Handed to a :class:`WriteBackHook` call, which runs under the service lock:
    valid only during that call.
    """

    def pin(self, tenant: str, key: bytes) -> LookupResult: ...

    def release(self, lease: int) -> None: ...


class WriteBackHook(Protocol):
    """Hears of commits and hits, under the service lock, and pins what it will copy to L2.

    Must be quick and must not call the service (its lock is held).
    """

    def committed(self, tenant: str, keys: Sequence[bytes], pins: Pins) -> None: ...

    def hit(self, tenant: str, keys: Sequence[bytes], pins: Pins) -> None: ...


class TierKeys(Protocol):
    """Every key a lower tier holds now, by tenant (the NVMe tier's index); any thread."""

    def __call__(self) -> dict[str, list[bytes]]: ...


class TenantDrop(Protocol):
    def __call__(self, tenant: str) -> int:
        """Delete the tenant's objects from every L2 tier (blocking); how many went.

        Raises :class:`~kvpool.agent.l2.base.TierUnavailable` if a tier could not finish.
        """
        ...


class TenantBytes(Protocol):
    def __call__(self, tenant: str) -> int:
        """Bytes of the tenant's objects in a tier."""
        ...


class PrefetchProgress(Protocol):
    @property
    def done(self) -> bool: ...

    @property
    def expected(self) -> int:
        """Chunks the tiers hold (-1 until known)."""
        ...

    @property
    def loaded(self) -> int: ...


class PrefetchHook(Protocol):
    """Loads the rest of a prefix from L2 after an L1 miss (called outside the service lock)."""

    def begin(
        self, tenant: str, keys: Sequence[bytes], parent: bytes | None, *, warm: bool = False
    ) -> int:
        """Start loading ``keys`` (``parent`` precedes the first; ``warm``: for a warm, not a
        lookup); its id, or 0 if none."""
        ...

    def status(self, prefetch_id: int) -> PrefetchProgress | None: ...

    def wait(self, prefetch_id: int, timeout: float) -> PrefetchProgress | None:
        """The prefetch's progress once it is done or ``timeout`` seconds passed (blocks: never
        on the event loop); None for an unknown id."""
        ...


class SequencedListener(ChunkListener, Protocol):
    @property
    def seq(self) -> int:
        """The sequence number of the last change published."""
        ...
