"""Which node holds which chunk: ``key → {node: last seen}`` in bounded memory.

The tracker is fed by the event subscriber (one call per chunk event, and a
whole node at a time after a snapshot) and read by queries. Per node it keeps

* ``where``: key → the :class:`_Batch` the key arrived in, and
* ``batches``: those batches, oldest first. A batch is one ``stored`` event's
  keys (at most :data:`BATCH_KEYS` per record), stamped with its arrival time:
  the *last seen* of its keys.

**Single keys.** The lower tiers publish a chunk at a time (the write-back puts chunk by
chunk, tail first). Stored one by one, each would be a batch of its own, three times the
memory of a key in a full batch; instead consecutive single keys of a node share a *loose*
batch (up to :data:`BATCH_KEYS`, unordered like a snapshot's, so it vouches for nothing),
whose last seen is its newest key's.

**Bounds.** A node holds at most ``max_chunks_per_node`` keys; past that its
oldest batches go, whole (so a node may fall up to one batch below the cap).
Removing a node (its agent went away) drops all of its keys at once.

**Longest prefix by binary search.** Keys are a chain, and an agent holds a
chain as a leading run (it evicts tails first and a chunk whose predecessor is
gone with it), so "node holds ``k_i``" is true up to some ``i`` and false
after it. :meth:`PrefixTracker.longest_prefixes` finds that boundary per node
by galloping then bisecting over the chain (O(log n) probes; keys are hashed
lazily, so a prefix that misses at once costs one hash).

**Where that assumption fails.** A node can hold a chain with a hole: a locked
chunk outlives its evicted predecessor on the agent, the tracker's cap drops a
chain's older head before its newer tail, events were lost before a resync.
Bisection could then overshoot the hole. So every result is verified before it
is returned, walking back from the boundary to ``k_0`` one *batch* per probe:
a batch whose keys are all still here and in chain order vouches for every
position from its first key to the probed one (chain keys commit to their
whole prefix, so matching the batch's first key pins those positions). Batches
that cannot vouch (a member removed or moved, or unordered ones from a
snapshot) are walked one key per probe. A hole restarts the search below it.
The result is always the length of the leading run, exactly what a linear walk
gives; the walk costs one probe per batch of the matched prefix.

Thread safety: every method takes the tracker's lock. Nothing here knows about
sockets, tenants or salts: only opaque keys and node names.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from kvpool.common.names import DEFAULT_MAX_CHUNKS_PER_NODE

BATCH_KEYS = 64
"""Keys per batch record: bounds one verification step and the cap's overshoot."""


class KeySequence(Protocol):
    """The chunk keys of one prompt, in chain order (a list, or keys hashed on demand)."""

    def __len__(self) -> int: ...

    def __getitem__(self, position: int) -> bytes: ...


class PrefixMatch(NamedTuple):  # a tuple: made per node per lookup, on the picker's path
    chunks: int
    """Length of the leading run of the chain that the node holds."""
    last_seen: float
    """When the last chunk of that run was seen stored or in a snapshot (``clock`` time)."""


@dataclass(frozen=True, slots=True)
class NodeCounts:
    chunks: int
    """Keys tracked for the node now."""
    cap_evicted: int
    """Keys dropped because the node was over its cap, since the node was first tracked."""


class _Batch:
    __slots__ = ("keys", "live", "ordered", "seen")
    keys: tuple[bytes, ...]

    def __init__(self, keys: tuple[bytes, ...], ordered: bool, seen: float) -> None:
        self.keys = keys
        self.ordered = ordered
        """True for a stored event's keys: a run of one chain, in chain order."""
        self.seen = seen
        self.live = len(keys)
        """Members whose key still maps to this batch; all of them: the batch is intact."""

    def vouches(self) -> bool:
        return self.ordered and self.live == len(self.keys)


class _Node:
    __slots__ = ("batches", "cap_evicted", "dead", "loose", "where")

    def __init__(self) -> None:
        self.where: dict[bytes, _Batch] = {}
        self.batches: deque[_Batch] = deque()
        self.dead = 0
        """Batches in ``batches`` with no live member left (dropped when they dominate)."""
        self.cap_evicted = 0
        self.loose: _Batch | None = None
        """The batch single keys join while it is the newest and not full."""

    def add_single(self, key: bytes, seen: float) -> None:
        """Add one key to the loose batch (a new one unless the newest batch is it)."""
        batch = self.loose
        joinable = (
            batch is not None
            and batch.live
            and len(batch.keys) < BATCH_KEYS
            and bool(self.batches)
            and self.batches[-1] is batch
        )
        if batch is None or not joinable:
            self.loose = _Batch((key,), False, seen)
            self.add(self.loose)
            return
        previous = self.where.get(key)
        if previous is batch:
            batch.seen = seen
            return
        if previous is not None:
            self.release(previous)
        batch.keys += (key,)
        batch.live += 1
        batch.seen = seen
        self.where[key] = batch

    def add(self, batch: _Batch) -> None:
        where = self.where
        for key in batch.keys:
            previous = where.get(key)
            if previous is not None:
                self.release(previous)  # seen again: the key moves to the newer batch
            where[key] = batch
        self.batches.append(batch)

    def release(self, batch: _Batch) -> None:
        batch.live -= 1
        if batch.live == 0:
            self.dead += 1

    def remove(self, keys: Iterable[bytes]) -> None:
        where = self.where
        for key in keys:
            batch = where.pop(key, None)
            if batch is not None:
                self.release(batch)
        if self.dead > len(self.batches) // 2:
            self.batches = deque(batch for batch in self.batches if batch.live)
            self.dead = 0

    def trim(self, cap: int) -> None:
        """Drop the oldest batches while more than ``cap`` keys are tracked."""
        where = self.where
        while len(where) > cap:
            batch = self.batches.popleft()
            if not batch.live:
                self.dead -= 1
                continue
            for key in batch.keys:
                if where.get(key) is batch:
                    del where[key]
                    self.cap_evicted += 1
            batch.live = 0


def _leading_run(where: dict[bytes, _Batch], keys: KeySequence, hint: int = 0) -> int:
    """How many keys of ``keys``, from the first, ``where`` holds without a gap.

    ``hint``: a run another node was found to hold (nodes that share a prompt's prefix
    often end at the same chunk); where this node's boundary is there too, two probes and
    the verification find it, with no search."""
    limit = len(keys)
    if (
        0 < hint <= limit
        and keys[hint - 1] in where
        and (hint == limit or keys[hint] not in where)
        and _first_hole(where, keys, hint - 1) < 0
    ):
        return hint
    while limit > 0 and keys[0] in where:
        # Gallop (1, 3, 7, ...) to bracket the boundary, so short matches hash few keys...
        held, step = 0, 1
        absent = limit
        while held + step < limit:
            if keys[held + step] in where:
                held += step
                step *= 2
            else:
                absent = held + step
                break
        # ...then bisect: keys[held] is held, keys[absent] is not (or is past the end).
        while absent - held > 1:
            middle = (held + absent) // 2
            if keys[middle] in where:
                held = middle
            else:
                absent = middle
        hole = _first_hole(where, keys, held)
        if hole < 0:
            return held + 1
        limit = hole  # bisection jumped over a hole: the run ends before it
    return 0


def _first_hole(where: dict[bytes, _Batch], keys: KeySequence, top: int) -> int:
    """A position in ``[0, top]`` whose key ``where`` lacks, or -1 if it holds them all."""
    position = top
    while position >= 0:
        key = keys[position]
        batch = where.get(key)
        if batch is None:
            return position
        if batch.vouches():
            offset = batch.keys.index(key)
            first = position - offset
            if first >= 0 and batch.keys[0] == keys[first]:
                position = first - 1
                continue
        position -= 1
    return -1


class PrefixTracker:
    def __init__(
        self,
        max_chunks_per_node: int = DEFAULT_MAX_CHUNKS_PER_NODE,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if max_chunks_per_node < 1:
            raise ValueError(f"max_chunks_per_node must be >= 1, got {max_chunks_per_node}")
        self.max_chunks_per_node = max_chunks_per_node
        self._clock = clock
        self._lock = threading.Lock()
        self._nodes: dict[str, _Node] = {}

    # ---------------------------------------------------------------- updates

    def stored(self, node: str, keys: Sequence[bytes]) -> None:
        """``keys`` (one run of one chain, in chain order) were stored on ``node``."""
        seen = self._clock()
        with self._lock:
            state = self._nodes.get(node)
            if state is None:
                state = self._nodes[node] = _Node()
            if len(keys) == 1:
                state.add_single(keys[0], seen)
            else:
                for start in range(0, len(keys), BATCH_KEYS):
                    state.add(_Batch(tuple(keys[start : start + BATCH_KEYS]), True, seen))
            state.trim(self.max_chunks_per_node)

    def removed(self, node: str, keys: Iterable[bytes]) -> None:
        with self._lock:
            state = self._nodes.get(node)
            if state is not None:
                state.remove(keys)

    def replace(self, node: str, keys: Iterable[bytes]) -> None:
        """``node`` holds exactly ``keys`` (a snapshot, in no particular order)."""
        distinct = list(dict.fromkeys(keys))
        kept = distinct[-self.max_chunks_per_node :]
        state = _Node()
        state.cap_evicted = len(distinct) - len(kept)
        seen = self._clock()
        for start in range(0, len(kept), BATCH_KEYS):
            state.add(_Batch(tuple(kept[start : start + BATCH_KEYS]), False, seen))
        with self._lock:
            previous = self._nodes.get(node)
            if previous is not None:
                state.cap_evicted += previous.cap_evicted
            self._nodes[node] = state

    def drop_node(self, node: str) -> None:
        with self._lock:
            self._nodes.pop(node, None)

    # ---------------------------------------------------------------- queries

    def longest_prefixes(
        self, keys: KeySequence, nodes: Iterable[str] | None = None, *, wait: float = -1
    ) -> dict[str, PrefixMatch]:
        """Per node (all nodes, or those of ``nodes`` that are tracked) with a match: its
        leading run of ``keys``. Nodes that hold not even ``keys[0]`` are left out.
        ``wait``: seconds to wait at most for the lock (-1: as long as it takes), then
        ``TimeoutError``."""
        found: dict[str, PrefixMatch] = {}
        if len(keys) == 0:
            return found
        first = keys[0]
        if not self._lock.acquire(timeout=wait):
            raise TimeoutError("the tracker is busy")
        try:
            names = self._nodes if nodes is None else [n for n in nodes if n in self._nodes]
            run = 0
            for name in names:
                where = self._nodes[name].where
                if first in where:
                    run = _leading_run(where, keys, run)
                    if run:
                        found[name] = PrefixMatch(run, where[keys[run - 1]].seen)
        finally:
            self._lock.release()
        return found

    def keys_of(self, node: str) -> list[bytes]:
        """The keys tracked for ``node`` now."""
        with self._lock:
            state = self._nodes.get(node)
            return list(state.where) if state is not None else []

    def holders(self, key: bytes) -> dict[str, float]:
        """``{node: last seen}`` of one key."""
        with self._lock:
            return {
                name: batch.seen
                for name, state in self._nodes.items()
                if (batch := state.where.get(key)) is not None
            }

    def counts(self) -> dict[str, NodeCounts]:
        with self._lock:
            return {
                name: NodeCounts(len(state.where), state.cap_evicted)
                for name, state in self._nodes.items()
            }


@dataclass(frozen=True)
class TierTrackers:
    """One tracker per tier the index follows (see :mod:`kvpool.index.subscriber`), each
    keyed by node: ``l1`` (the segments: lookups and routes answer from it), ``nvme`` (the
    nodes' NVMe files) and ``s3`` (chunks the node's agent wrote back to the pool's bucket,
    which any node can load). Each is bounded by ``max_chunks_per_node`` per node."""

    l1: PrefixTracker
    nvme: PrefixTracker
    s3: PrefixTracker

    @classmethod
    def create(
        cls,
        max_chunks_per_node: int = DEFAULT_MAX_CHUNKS_PER_NODE,
        *,
        clock: Callable[[], float] = time.time,
    ) -> TierTrackers:
        return cls(*(PrefixTracker(max_chunks_per_node, clock=clock) for _ in range(3)))

    def lower(self) -> dict[str, PrefixTracker]:
        """The lower tiers' trackers by tier name: the subscriber's ``tiers``."""
        return {"nvme": self.nvme, "s3": self.s3}
