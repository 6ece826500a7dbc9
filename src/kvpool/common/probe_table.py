"""Which L1 chunks are ready, readable by the connector's scheduler without a round trip.

The agent keeps it beside its segment (``<segment>.probe``, recreated at every start)
and writes it under its cache lock: a key is published when its chunk becomes ready
and withdrawn when it stops being ready. A vLLM scheduler on the node maps the file
read-only and probes its keys there instead of asking the agent. The answer is a
hint, as the unlocked lookup it replaces was: the worker locks what it loads and
recomputes what is gone by then.

Layout: a header (magic, version, bucket count, the agent's id, so a reader knows the
table belongs to the agent it talks to) and a power of two of buckets, at most half
full (a chunk needs a page, so there are never more chunks than pages). A key's home
bucket is its first 8 bytes (keys are SHA-256 digests); collisions probe linearly, and
a withdrawal shifts the entries after it back, so there are no tombstones. A bucket is
``sequence (u32) | tenant tag (u32) | key (32 bytes)``; the sequence is odd while the
agent writes the bucket, and a reader retries a bucket whose sequence moved. A reader
may miss a key that is being moved (a miss costs a recompute, as any miss does); it
never sees a key the agent has not published.

The agent holds an exclusive lock on the file while it lives; the kernel drops it when the
process ends, however it ends. A reader trusts the table only while somebody holds that
lock: a dead or stopped agent's table is never read as if it were kept.

The writer keeps its own copy of which bucket holds which key and never reads the mapping
back, so nothing written into the file by anyone else steers it. A key is placed at most
:data:`MAX_PROBE` buckets past its home (half-full tables of random keys stay far below:
about 40 buckets at a million keys); a key with no free bucket that close (keys crafted
to share a home) is not published and is counted (:attr:`ProbeTableWriter.full`): the
scheduler misses it here and the agent's lookup finds it, at the cost of a round trip.
Every loop is bounded, so a full table never holds the cache's lock for long.

The agent creates the file exclusively (:mod:`kvpool.common.files`) with mode
:data:`TABLE_MODE`: the agent writes, its group (the node's connectors) reads, others
nothing. Something at the table's name that is not a regular file of the agent's user
is refused at start.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import zlib
from array import array
from collections.abc import Sequence
from pathlib import Path

from kvpool.common.files import check_replaceable, create_temporary, open_verified

MAGIC = b"KVPPROBE"
VERSION = 1
_HEADER = struct.Struct("<8sII32s")  # magic, version, buckets, agent id (hex, 32 chars)
HEADER_BYTES = 64
_BUCKET = struct.Struct("<II32s")
BUCKET_BYTES = _BUCKET.size
_SEQUENCE = struct.Struct("<I")
_EMPTY = bytes(32)
_READ_TRIES = 4
MAX_PROBE = 64
"""How far past its home bucket the writer places a key (or gives up on publishing it)."""
TABLE_MODE = 0o640
"""The agent writes the table; its group (the connectors' schedulers) maps it read-only."""


def table_path(segment_path: Path) -> Path:
    return segment_path.with_name(segment_path.name + ".probe")


def tenant_tag(tenant: str) -> int:
    """32 bits of the tenant id: a key is only ever found by its own tenant (as in L1, where
    a key another tenant stored is a miss)."""
    return zlib.crc32(tenant.encode())


def _home(key: bytes, mask: int) -> int:
    return int.from_bytes(key[:8], "little") & mask


class ProbeTableWriter:
    """The agent's side: one writer, under the cache's lock."""

    def __init__(self, path: Path, max_chunks: int, agent_id: str) -> None:
        """Create the table (replacing the agent's own earlier one); :class:`~kvpool.
        files.FileRefused` if what is at ``path`` is not the agent's."""
        buckets = 1 << max(4, (2 * max_chunks - 1).bit_length())
        self.path = path
        self._mask = buckets - 1
        self._max_probe = min(MAX_PROBE, buckets)
        self._held: list[bytes | None] = [None] * buckets
        """The key in each bucket as the writer put it: no decision depends on the mapping."""
        self._tags = array("I", bytes(4 * buckets))
        self._keys: dict[bytes, int] = {}
        """Key -> its bucket."""
        self.full = 0
        """Keys not published: no free bucket within MAX_PROBE of their home."""
        size = HEADER_BYTES + buckets * BUCKET_BYTES
        check_replaceable(path, "probe table")
        self._fd, temporary = create_temporary(path, TABLE_MODE)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)  # held until the process ends: "the table is kept"
            status = os.fstat(self._fd)
            self._identity = status.st_dev, status.st_ino
            os.ftruncate(self._fd, size)
            self._map = mmap.mmap(self._fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            _HEADER.pack_into(self._map, 0, MAGIC, VERSION, buckets, agent_id.encode()[:32])
            os.replace(temporary, path)
        except BaseException:
            temporary.unlink(missing_ok=True)
            os.close(self._fd)
            raise

    def publish(self, key: bytes, tenant: str) -> bool:
        """Publish ``key`` for ``tenant``; False (counted) if no bucket near its home is free."""
        if key in self._keys:
            return True
        if len(key) != 32 or key == _EMPTY:
            return False
        held, mask = self._held, self._mask
        index = _home(key, mask)
        for _ in range(self._max_probe):
            if held[index] is None:
                self._write(index, tenant_tag(tenant), key)
                return True
            index = (index + 1) & mask
        self.full += 1
        return False

    def withdraw(self, key: bytes) -> None:
        """Remove ``key``; move the entries after it back so that no probe stops short."""
        hole = self._keys.pop(key, None)
        if hole is None:
            return
        held, mask, limit = self._held, self._mask, self._max_probe
        index = hole
        for _ in range(mask):
            index = (index + 1) & mask
            moving = held[index]
            if moving is None or (index - hole) & mask >= limit:
                break  # every entry lies within MAX_PROBE of its home: none further can move
            home = _home(moving, mask)
            # the entry may fill the hole unless its home lies cyclically in (hole, index]
            if (index - home) & mask >= (index - hole) & mask:
                self._write(hole, self._tags[index], moving)
                hole = index
        self._write(hole, 0, _EMPTY)

    def is_at_path(self) -> bool:
        """Whether :attr:`path` still names this table (not removed, not replaced)."""
        try:
            status = os.lstat(self.path)
        except OSError:
            return False
        return (status.st_dev, status.st_ino) == self._identity

    def close(self) -> None:
        if self.is_at_path():  # never another's table that replaced this one
            self.path.unlink(missing_ok=True)
        self._map.close()
        os.close(self._fd)

    def _write(self, index: int, tag: int, key: bytes) -> None:
        offset = HEADER_BYTES + index * BUCKET_BYTES
        (sequence,) = _SEQUENCE.unpack_from(self._map, offset)
        _SEQUENCE.pack_into(self._map, offset, (sequence + 1) & 0xFFFFFFFF)
        self._map[offset + 4 : offset + BUCKET_BYTES] = _BUCKET.pack(0, tag, key)[4:]
        _SEQUENCE.pack_into(self._map, offset, (sequence + 2) & 0xFFFFFFFF)
        self._tags[index] = tag
        if key == _EMPTY:
            self._held[index] = None
        else:
            self._held[index] = key
            self._keys[key] = index


def table_kept(path: Path) -> bool:
    """Whether a live agent writes the table at ``path`` (holds its lock). False where there is
    none, or something that is not the agent's (its writer refuses that at start)."""
    try:
        fd, _ = open_verified(path, what="probe table", mode=TABLE_MODE)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


class ProbeTableReader:
    """A scheduler's side: the table of the agent ``agent_id``, mapped read-only."""

    def __init__(self, path: Path, agent_id: str) -> None:
        """Raises OSError or ValueError when there is no such table (an older agent, or one
        that restarted since): the caller asks the agent instead."""
        self._fd = os.open(path, os.O_RDONLY)
        try:
            self._map = mmap.mmap(self._fd, 0, mmap.MAP_SHARED, mmap.PROT_READ)
        except (OSError, ValueError):
            os.close(self._fd)
            raise
        try:
            magic, version, buckets, owner = _HEADER.unpack_from(self._map, 0)
            if magic != MAGIC or version != VERSION:
                raise ValueError(f"{path} is not a probe table of version {VERSION}")
            if owner.rstrip(b"\0").decode() != agent_id[:32]:
                raise ValueError(f"{path} belongs to another agent (restarted?)")
            if len(self._map) != HEADER_BYTES + buckets * BUCKET_BYTES:
                raise ValueError(f"{path} is truncated")
        except ValueError:
            self.close()
            raise
        self.agent_id = agent_id
        self._mask = buckets - 1

    def run(self, tenant: str, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, the agent holds ready for ``tenant``."""
        tag = tenant_tag(tenant)
        for count, key in enumerate(keys):
            if not self._holds(key, tag):
                return count
        return len(keys)

    def _holds(self, key: bytes, tag: int) -> bool:
        view, mask = self._map, self._mask
        index = _home(key, mask)
        for _ in range(mask + 1):
            offset = HEADER_BYTES + index * BUCKET_BYTES
            for _ in range(_READ_TRIES):
                before, owner, found = _BUCKET.unpack_from(view, offset)
                if not before & 1 and _SEQUENCE.unpack_from(view, offset)[0] == before:
                    break
            else:
                return False  # a bucket being rewritten right now: a miss is always safe
            if found == key:
                return bool(owner == tag)
            if found == _EMPTY:
                return False
            index = (index + 1) & mask
        return False

    def is_kept(self) -> bool:
        """Whether the agent that writes the table is alive (it holds the file's lock)."""
        try:
            fcntl.flock(self._fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        return False

    def close(self) -> None:
        self._map.close()
        os.close(self._fd)
