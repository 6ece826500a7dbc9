"""The chunk table in the segment: what a restarted agent rebuilds its index from.

One fixed-size record per slot (slot numbers are stable, so a record's index
is its slot). The L1 cache writes a record when a chunk is committed (after
the client copied its bytes) and erases it before the chunk's pages can be
reused, so a committed record always describes bytes that are in place; a chunk
cleared while read-locked loses its record at once, so a restart never brings it back.
A reserved chunk has a record too, marked reserved: its writer may outlive the
agent, so a restarted agent holds those pages back (quarantined) instead of
handing them out at once; reserved chunks are never restored as chunks.

Record (little-endian, 128 bytes)::

    state u8 | pad[3] | parent slot i32 | key[32] | tenant[32] | first page u64
    | pages u32 | nbytes u64 | sequence u64 | parent's sequence u64 | CRC32 u32

``sequence`` numbers commits; a chunk names its parent by slot and by the
parent's sequence, so a slot reused by another chunk is never taken for the
parent. A record whose CRC does not match is discarded, never trusted.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

from kvpool.common.keys import KEY_BYTES
from kvpool.common.segment import TABLE_RECORD_BYTES, SharedSegment

COMMITTED = 1
RESERVED = 2
_BODY = struct.Struct("<B3xi32s32sQIQQQ")
_CRC = struct.Struct("<I")
MAX_TENANT_BYTES = 32


@dataclass(frozen=True, slots=True)
class ChunkRecord:
    slot: int
    parent: int
    key: bytes
    tenant: str
    first_page: int
    pages: int
    nbytes: int
    sequence: int
    parent_sequence: int


class SegmentJournal:
    """Reads and writes the chunk table of one mapped segment."""

    def __init__(self, segment: SharedSegment) -> None:
        self._table = segment.table
        self.slots = segment.layout.table_slots

    def record(self, chunk: ChunkRecord, state: int = COMMITTED) -> None:
        tenant = chunk.tenant.encode()
        if len(tenant) > MAX_TENANT_BYTES or len(chunk.key) != KEY_BYTES:
            raise ValueError("tenant ids are at most 32 bytes and keys 32 bytes")
        body = _BODY.pack(
            state,
            chunk.parent,
            chunk.key,
            tenant,
            chunk.first_page,
            chunk.pages,
            chunk.nbytes,
            chunk.sequence,
            chunk.parent_sequence,
        )
        start = chunk.slot * TABLE_RECORD_BYTES
        self._table[start : start + _BODY.size] = body
        _CRC.pack_into(self._table, start + _BODY.size, zlib.crc32(body))

    def close(self) -> None:
        """Let go of the table view, so that the segment can be unmapped."""
        self._table.release()

    def erase(self, slot: int) -> None:
        self._table[slot * TABLE_RECORD_BYTES] = 0

    def reset(self) -> None:
        """Forget every record (a new, empty segment)."""
        self._table[:] = bytes(len(self._table))

    def committed(self) -> Iterator[ChunkRecord | int]:
        """Every committed record; the slot number alone for a record that fails its CRC."""
        return self._records(COMMITTED)

    def reserved(self) -> Iterator[ChunkRecord | int]:
        """Every reserved (uncommitted) record, as :meth:`committed`."""
        return self._records(RESERVED)

    def _records(self, state: int) -> Iterator[ChunkRecord | int]:
        table = self._table
        for slot in range(self.slots):
            start = slot * TABLE_RECORD_BYTES
            if table[start] != state:
                continue
            body = table[start : start + _BODY.size]
            (crc,) = _CRC.unpack_from(table, start + _BODY.size)
            if zlib.crc32(body) != crc:
                yield slot
                continue
            _, parent, key, tenant, first_page, pages, nbytes, sequence, parent_sequence = (
                _BODY.unpack(body)
            )
            yield ChunkRecord(
                slot,
                parent,
                key,
                tenant.rstrip(b"\0").decode(errors="replace"),
                first_page,
                pages,
                nbytes,
                sequence,
                parent_sequence,
            )
