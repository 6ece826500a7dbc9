"""What the two halves tell each other, as plain data (no vLLM: the worker half runs, and is
tested, below the engine; :mod:`kvpool.connector.metadata` gives these vLLM's types).

* scheduler -> worker, every step: :class:`StepJobs` (loads to do before the forward, stores
  to do after it, requests whose blocks the scheduler now holds, requests preempted this step);
* worker -> scheduler, every step: :class:`StoresDone` (store jobs finished, summed over the
  tensor-parallel workers);
* worker -> scheduler, once at start: :class:`FormatHandshake` (the chunk format's descriptor
  for the key fingerprint, the chunk size, whether stores finish within their step).

Keys travel per tensor-parallel rank (``keys[rank][i]``): each rank has its own
fingerprint, so its own chain. Never the salt: only keys and the tenant id. A job moves
either chunks (every group but the state groups; ``block_ids`` per such group) or state
records (``state``: the state groups only, one block each per record).
"""

from __future__ import annotations

from dataclasses import dataclass, field

RankKeys = tuple[tuple[bytes, ...], ...]
"""``keys[rank][i]``: the key of the job's i-th chunk for that rank."""
GroupBlocks = tuple[tuple[int, ...], ...]
"""``block_ids[g]``: KV cache group ``g``'s block ids, in token order (vLLM's null block
where the group keeps no KV)."""


@dataclass(frozen=True)
class LoadJob:
    """Copy chunks ``keys[rank]`` into ``block_ids`` (their tokens from ``first_tokens`` on)."""

    req_id: str
    tenant: str
    keys: RankKeys
    block_ids: GroupBlocks
    """Per group, the destination blocks from the one holding token ``first_tokens`` of the
    first chunk to the end of the last chunk."""
    first_tokens: int
    """Tokens of the first chunk that vLLM already has (skipped)."""
    per_request: bool = False
    """Report the load's outcome for the request (vLLM's asynchronous load: finished or
    failed receiving), not failed blocks: an engine of several KV cache groups takes no
    block-level failures."""
    state: bool = False
    """A state record (one, :func:`~kvpool.common.keys.state_key`) into the state groups'
    blocks, not chunks into the other groups'."""


@dataclass(frozen=True)
class StoreJob:
    """Store chunks ``keys[rank]``, whose blocks are ``block_ids`` (per group, every block of
    the chunks)."""

    job_id: int
    req_id: str
    tenant: str
    keys: RankKeys
    parents: tuple[bytes | None, ...]
    """Per rank: the key of the chunk before the first, so the agent knows the chain."""
    block_ids: GroupBlocks
    state: bool = False
    """State records (per key, one block of each state group), not chunks."""


@dataclass
class StepJobs:
    loads: list[LoadJob] = field(default_factory=list)
    stores: list[StoreJob] = field(default_factory=list)
    held: list[str] = field(default_factory=list)
    """Finished requests whose blocks the scheduler holds until their stores are done."""
    preempted: list[str] = field(default_factory=list)


@dataclass
class StoresDone:
    completed_stores: dict[int, int] = field(default_factory=dict)
    """Store job id -> number of workers that have finished it (copied or given up)."""

    def merged(self, other: StoresDone) -> dict[int, int]:
        merged = dict(self.completed_stores)
        for job_id, count in other.completed_stores.items():
            merged[job_id] = merged.get(job_id, 0) + count
        return merged


@dataclass
class FormatHandshake:
    kv_layout: str
    """The chunk format's descriptor: the ``kv_layout`` of this rank's key fingerprint."""
    chunk_tokens: int
    stores_complete_in_step: bool
    """Stores finish inside ``wait_for_save`` (CPU), so blocks need never be held."""
