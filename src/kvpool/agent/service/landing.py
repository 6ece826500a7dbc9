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

The landings of a run (consecutive chunks one request brings: the peer tier's pipelined
runs) share a :class:`RunReservation`: the first of them to reserve reserves pages for it
and every chunk after it in the run at once, each of its size (a prefix's chunks are one
size), in one call to L1 (one quota check, one pass of eviction), and the run commits
with one call (one KV event, one lock); a chunk of another size (a prefix's shorter last
one) gives the run's pages back from it on, and it and the chunks after it reserve
alone. A chunk whose run holds pages for it holds its place: the chunk after it may
reserve before it has come (so the prefetch reserves a prefix's runs one after the other
before asking for them, and every chunk lands in its pages as it comes).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvpool.agent.core.cache_types import Reservation

TURN_SECONDS = 60.0
"""The longest a landing waits for the one before it (each tier times its own I/O)."""
_DECIDING = threading.Lock()
"""Guards every landing's decision and its waiters' event (a few instructions each time:
one lock for all, where an event of each landing's own would cost a few microseconds to
make for every chunk of a prefix, and few are ever waited for)."""


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

    def commit_loaded(self, lease: int, count: int | None = None) -> int: ...

    def trim(self, lease: int, count: int) -> None: ...

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
    run: RunReservation | None = None
    """The run it reserves with (set before its chunk is asked for), if any."""
    position: int = 0
    """Its place in that run."""
    reservation: Reservation | None = None
    _decided: bool = False
    _waiting: threading.Event | None = None
    """Made by the first thread that waits for the decision."""
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

    def reserve(self, size: int, *, wait: bool = True) -> memoryview | None:
        """The reserved pages for ``size`` bytes (the same ones on a second call of the same
        size); None if L1 holds the chunk already or refuses it (quota, full), or the chunk
        before it could not be reserved. Without ``wait``, None also (and nothing decided)
        where the chunk before it has not decided yet: its turn has not come."""
        with self._lock:
            if self.reservation is None:
                turn = self.wait_turn() if wait else self.turn()
                if turn is None:
                    return None
                if not turn:
                    self._decide()
                    return None
                run = self.run
                reserved = None if run is None else run.reserve(self, size)
                self.reservation = reserved or self.service.reserve(
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
        """Whether this chunk may reserve now: the one before it holds its place, reserved
        by itself or by its run (None: it has not reserved nor given up yet, nor has its
        run reserved for it)."""
        before = self.after
        if before is None:
            return True
        if before.decided:
            return before.reserved
        return True if before.run is not None and before.run.holds(before) else None

    def wait_turn(self) -> bool:
        """Block until the chunk before this one holds its place (or gave up): whether it
        does."""
        turn = self.turn()
        if turn is None:
            assert self.after is not None  # only a chunk after another waits
            return self.after.wait_reserved()
        return turn

    def wait_reserved(self) -> bool:
        """Once this landing has reserved or given up: whether it holds its place."""
        with _DECIDING:
            if self._decided:
                waiting = None
            else:
                waiting = self._waiting = self._waiting or threading.Event()
        if waiting is not None and not waiting.wait(TURN_SECONDS):
            return False
        return self.reserved

    def _decide(self) -> None:
        with _DECIDING:
            if self._decided:
                return
            self._decided = True
            waiting = self._waiting
        if waiting is not None:
            waiting.set()
        if self.on_decided is not None:
            self.on_decided()

    @property
    def decided(self) -> bool:
        return self._decided

    def give_up(self) -> None:
        """Done trying (reserved or not): the chunks after it stop waiting for its turn."""
        self._decide()

    def finish(self, filled: bool) -> bool:
        """Commit the chunk if ``filled`` (its bytes were received and verified), else release
        the pages; True if the chunk is now in L1. A chunk that holds pages of its run's
        reservation commits with the run (:func:`finish_in_order`): alone, it only gives
        them back (the run's, from the first)."""
        with self._lock:
            self._decide()
            reservation = self.reservation
        if reservation is None or reservation.lease is None:
            return self.present
        run = self.run
        if run is not None and run.holds(self):
            assert not filled, "a run's chunk commits with its run"
            run.give_back()
            return False
        if not filled:
            self.service.release_all([reservation.lease])
            self.reservation = None
            return False
        return self.service.commit_loaded(reservation.lease) == 1


def finish_in_order(landings: Sequence[ChunkLanding], filled: Sequence[bool]) -> int:
    """Commit the leading ``landings`` whose chunks are in place (``filled``, or present
    already), in order (those of a run's reservation in one commit), and give back the pages
    of the rest: how many are in L1 now."""
    placed = index = 0
    while index < len(landings):
        landing, end = landings[index], index + 1
        run = landing.run
        if run is not None and run.holds(landing):
            while end < len(landings) and landings[end].run is run and run.holds(landings[end]):
                end += 1
            count = run.commit(landings[index:end], filled[index:end])
        else:
            count = int(landing.finish(filled[index]))
        placed += count
        if count < end - index:
            for rest in landings[end:]:
                rest.finish(False)
            break
        index = end
    return placed


@dataclass(eq=False)
class RunReservation:
    """The pages of a run's landings, reserved at once (see the module's text)."""

    service: LandingSite
    keys: list[bytes]
    """The run's chunks, in order (a landing's ``position`` is its index here)."""
    _reservation: Reservation | None = None
    _first: int = 0
    """The position of the landing that reserved for the run."""
    _shared: int = 0
    """The landings from :attr:`_first` to this position hold pages of the reservation."""
    _open: bool = False
    """Its lease is neither committed nor given back."""
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def reserve(self, landing: ChunkLanding, size: int) -> Reservation | None:
        """``landing``'s part of the run's reservation, made now if it is the first to ask;
        None where it reserves alone (its size is not the run's, or the run's pages were
        given back before it)."""
        with self._lock:
            reservation = self._reservation
            if reservation is None:
                self._first = landing.position
                reservation = self._reservation = self.service.reserve(
                    landing.tenant,
                    self.keys[self._first :],
                    [size] * (len(self.keys) - self._first),
                    landing.parent,
                    keep=landing.keep,
                )
                self._shared = len(self.keys)
                self._open = reservation.lease is not None
            index = landing.position - self._first
            if not 0 <= index < self._shared - self._first:
                return None
            if index >= len(reservation.placements):  # refused there (quota, full)
                return Reservation(None, (), reservation.refused_reason)
            place = reservation.placements[index]
            if place is not None and place.nbytes != size:
                if self._open:
                    assert reservation.lease is not None
                    self.service.trim(reservation.lease, _new(reservation, index))
                self._shared = landing.position
                return None
            return Reservation(reservation.lease, (place,))

    def holds(self, landing: ChunkLanding) -> bool:
        """Whether ``landing`` holds pages of the run's reservation (or L1 had its chunk), not
        committed yet: False where L1 refused it (quota, full)."""
        with self._lock:
            reservation = self._reservation
            return (
                self._open
                and reservation is not None
                and self._first <= landing.position < self._shared
                and landing.position - self._first < len(reservation.placements)
            )

    def commit(self, landings: Sequence[ChunkLanding], filled: Sequence[bool]) -> int:
        """Commit the leading ``landings`` (those that hold the run's pages, from the first)
        whose chunks are in place, in one commit; give back the rest of the pages. How many
        are in L1 now."""
        with self._lock:
            reservation, self._open = self._reservation, False
        assert reservation is not None and reservation.lease is not None
        assert landings[0].position == self._first, "a run commits from its first chunk"
        placed = 0
        for landing, ok in zip(landings, filled, strict=True):
            if not (ok or landing.present):
                break
            placed += 1
        expected = _new(reservation, placed)
        if self.service.commit_loaded(reservation.lease, expected) != expected:
            return 0  # some were dropped meanwhile (the tenant's chunks cleared)
        return placed

    def give_back(self) -> None:
        """Release the run's pages not committed yet (none once committed)."""
        with self._lock:
            reservation, was_open, self._open = self._reservation, self._open, False
        if was_open and reservation is not None and reservation.lease is not None:
            self.service.release_all([reservation.lease])


def _new(reservation: Reservation, count: int) -> int:
    """How many of the reservation's first ``count`` chunks it placed anew (its lease's
    chunks: those L1 held already are not in it)."""
    return sum(place is not None for place in reservation.placements[:count])
