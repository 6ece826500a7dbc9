"""What the cache answers about moving chunks, as every part holds it in process.

One name per answer, from the cache to the client: the L1 cache, the service, the agent's
edges and the client all hold a lookup's answer as a :class:`LookupResult` (the wire
carries it as :class:`~kvpool.common.protocol.LookupReply`), and a client holds the agent's
plan for a store as a :class:`StorePlan` (on the wire a
:class:`~kvpool.common.protocol.PrepareStoreReply`; inside the cache, the slots it reserved
are a :class:`~kvpool.agent.core.cache_types.Reservation`), and what a store of bytes did
as a :class:`StoreResult` (on the wire a :class:`~kvpool.common.protocol.StoreInlineReply`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LookupResult:
    """The leading run of the keys that the cache holds: ``offsets[i]`` and ``sizes[i]``
    locate the i-th; ``lease`` holds them read-locked (None: nothing locked);
    ``len(offsets)`` is the hit count."""

    lease: int | None
    offsets: list[int]
    sizes: list[int]
    file: int = 0
    """The chunk file the hits are in (see :mod:`kvpool.client.mapped_files`); 0 where the
    answer names none (inside the cache, or no hit)."""
    prefetch: int = 0
    """The prefetch loading the keys after the hits from L2, or 0 (none started)."""

    @property
    def count(self) -> int:
        return len(self.offsets)


@dataclass(frozen=True, slots=True)
class StorePlan:
    """Where to write each key: ``offsets[i]`` or -1 when the agent already has it; the
    keys after ``len(offsets)`` were refused for ``refused``."""

    lease: int | None
    offsets: list[int]
    refused: str | None
    file: int = 0
    """The chunk file the offsets are in."""


@dataclass(frozen=True, slots=True)
class StoreResult:
    """What a store of bytes did (the chunks sent with the request, not written in place)."""

    stored: int
    """Chunks copied and made ready."""
    present: int
    """Chunks that were cached already (nothing copied)."""
    refused: str | None
    """Why the tail of the keys was refused, if it was."""
