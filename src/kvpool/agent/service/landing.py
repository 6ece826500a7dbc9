"""One chunk coming from a lower tier, received straight into the L1 pages reserved for it.

The prefetch makes a :class:`ChunkLanding` per chunk and hands its :meth:`reserve` to a
tier that can write into memory it is given (the peer tier): once the tier knows the
chunk's size it reserves (write-locks) the pages and receives and opens the bytes there,
with no buffer in between. Nothing is visible until :meth:`finish` commits; a tier that
fails leaves the reservation to be released, and a second holder of the chunk reuses it.

Chunks of one prefetch arrive concurrently but reserve in prompt order: a landing waits
until the one before it has reserved (or given up), and gives up if that one did, so
that a quota or a full L1 stops a prefix at its first refused chunk, as a sequential
load would, instead of placing later chunks no lookup could reach.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvpool.agent.core.cache_types import Reservation

TURN_SECONDS = 60.0
"""The longest a landing waits for the one before it (each tier times its own I/O)."""


class LandingSite(Protocol):
    """What a landing needs of the cache (the service's data operations implement it; kept
    here so that this module imports nothing of the service above it)."""

    def reserve(
        self,
        tenant: str,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        parent: bytes | None = None,
        *,
        keep: Sequence[bytes] = (),
    ) -> Reservation: ...

    def chunk_view(self, tenant: str) -> memoryview: ...

    def commit_loaded(self, lease: int) -> int: ...

    def release_all(self, leases: Iterable[int]) -> None: ...


@dataclass(eq=False)
class ChunkLanding:
    service: LandingSite
    tenant: str
    key: bytes
    parent: bytes | None
    keep: list[bytes]
    """The chunks the same prefetch placed: never evicted to make room for this one."""
    after: ChunkLanding | None = None
    """The landing of the chunk before this one in the same prefetch, if any."""
    on_decided: Callable[[], None] | None = None
    """Called once, on any thread, when the landing has reserved or given up (the prefetch
    wakes the next chunk's turn on its event loop with it)."""
    reservation: Reservation | None = None
    _decided: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def present(self) -> bool:
        """L1 held the chunk already (nothing to receive: it counts as placed)."""
        reservation = self.reservation
        return (
            reservation is not None
            and bool(reservation.placements)
            and reservation.placements[0] is None
        )

    @property
    def size(self) -> int:
        """The bytes reserved (0: none)."""
        reservation = self.reservation
        if reservation is None or not reservation.placements or reservation.placements[0] is None:
            return 0
        return reservation.placements[0].nbytes

    @property
    def reserved(self) -> bool:
        reservation = self.reservation
        return self.present or (reservation is not None and reservation.lease is not None)

    def reserve(self, size: int) -> memoryview | None:
        """The reserved pages for ``size`` bytes (the same ones on a second call of the same
        size); None if L1 holds the chunk already or refuses it (quota, full), or the chunk
        before it could not be reserved."""
        with self._lock:
            if self.reservation is None:
                if not self.wait_turn():
                    self._decide()
                    return None
                self.reservation = self.service.reserve(
                    self.tenant, [self.key], [size], self.parent, keep=self.keep
                )
                self._decide()
            reservation = self.reservation
        if reservation.lease is None or not reservation.placements:
            return None
        place = reservation.placements[0]
        if place is None or place.nbytes != size:
            return None
        return self.service.chunk_view(self.tenant)[place.offset : place.offset + size]

    def turn(self) -> bool | None:
        """Whether this chunk may reserve now: the one before it holds its place (None: it
        has not reserved or given up yet)."""
        before = self.after
        if before is None:
            return True
        return before.reserved if before.decided else None

    def wait_turn(self) -> bool:
        """Block until the chunk before this one holds its place (or gave up): whether it
        does."""
        return self.after is None or self.after.wait_reserved()

    def wait_reserved(self) -> bool:
        """Once this landing has reserved or given up: whether it holds its place."""
        return self._decided.wait(TURN_SECONDS) and self.reserved

    def _decide(self) -> None:
        if not self._decided.is_set():
            self._decided.set()
            if self.on_decided is not None:
                self.on_decided()

    @property
    def decided(self) -> bool:
        return self._decided.is_set()

    def give_up(self) -> None:
        """Done trying (reserved or not): the chunks after it stop waiting for its turn."""
        self._decide()

    def finish(self, filled: bool) -> bool:
        """Commit the chunk if ``filled`` (its bytes were received and verified), else release
        the pages; True if the chunk is now in L1."""
        with self._lock:
            self._decide()
            reservation = self.reservation
        if reservation is None or reservation.lease is None:
            return self.present
        if not filled:
            self.service.release_all([reservation.lease])
            self.reservation = None
            return False
        return self.service.commit_loaded(reservation.lease) == 1
