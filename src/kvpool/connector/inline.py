"""Chunks through the agent's protocol, for a worker that cannot map the agent's segment.

A vLLM pod under Pod Security "restricted" (no ``hostPath``), or one whose ``/dev/shm`` is not
the node's, has no segment to copy through. Its worker then moves the same chunk bytes inside
ZMQ messages: ``retrieve_inline`` (the agent read-locks the leading run, copies it into the
reply and releases it) and ``store_inline`` (the agent reserves, copies and commits). Nothing
else changes: the keys, the chunk format and the agent's chains are the same, so a pod on the
inline path and a pod on the segment share every chunk.

A message holds at most the agent's ``max_inline_bytes`` of chunks, so a job is sent in batches
of whole chunks; a chunk larger than that cannot travel this way at all (:func:`fits`).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.client import Payload
from kvpool.common.transfer_results import StoreResult
from kvpool.connector.link import AgentLink


def fits(chunk_bytes: int, max_inline_bytes: int) -> bool:
    """A chunk of ``chunk_bytes`` fits in one inline message."""
    return 0 < chunk_bytes <= max_inline_bytes


def _batches(count: int, chunk_bytes: int, max_inline_bytes: int) -> list[range]:
    per_batch = max(1, max_inline_bytes // chunk_bytes)
    return [range(first, min(first + per_batch, count)) for first in range(0, count, per_batch)]


def retrieve(
    link: AgentLink, tenant: str, keys: Sequence[bytes], chunk_bytes: int, max_inline_bytes: int
) -> list[bytes]:
    """The bytes of the leading run of ``keys`` that the agent holds."""
    found: list[bytes] = []
    for batch in _batches(len(keys), chunk_bytes, max_inline_bytes):
        data = link.retrieve_inline(tenant, [keys[index] for index in batch])
        found.extend(data)
        if len(data) < len(batch):
            break
    return found


def store(
    link: AgentLink,
    tenant: str,
    keys: Sequence[bytes],
    chunks: Sequence[Payload],
    *,
    parent: bytes | None,
    max_inline_bytes: int,
) -> StoreResult:
    """Store ``chunks`` under ``keys`` (the chain continues ``parent``), batch by batch."""
    stored = present = 0
    chunk_bytes = len(chunks[0]) if chunks else 0
    for batch in _batches(len(keys), chunk_bytes, max_inline_bytes):
        result = link.store_inline(
            tenant, [keys[index] for index in batch], [chunks[index] for index in batch], parent
        )
        stored += result.stored
        present += result.present
        if result.refused:
            return StoreResult(stored, present, result.refused)
        parent = keys[batch[-1]]
    return StoreResult(stored, present, None)
