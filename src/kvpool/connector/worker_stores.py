"""A worker's stores: chunks (or state records) from vLLM's blocks into the agent.

For each :class:`~kvpool.connector.jobs.StoreJob` (after the forward): reserve
(``prepare_store`` with the parent key), copy the chunks the agent does not have yet,
commit once the copies are done. Refusals (quota, memory) and errors drop the store; the
next request recomputes and tries again. A job is complete once this worker has committed
or given it up; a request the scheduler holds is finished once its jobs are complete.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvpool.client import AgentError
from kvpool.client.mapped_files import ChunkFileError
from kvpool.common.keys import tenant_id
from kvpool.connector import inline
from kvpool.connector.copier import Copy
from kvpool.connector.counters import Counters
from kvpool.connector.jobs import StoreJob
from kvpool.connector.link import AgentLink, LinkDown
from kvpool.connector.worker_transport import ChunkTransport, Parts

log = logging.getLogger(__name__)


@dataclass
class _PendingStore:
    job: StoreJob
    lease: int | None
    copies: list[Copy]


class StoreRunner:
    def __init__(
        self,
        *,
        rank: int,
        link: AgentLink,
        counters: Counters,
        parts: Parts,
        transport: ChunkTransport,
    ) -> None:
        self._rank = rank
        self._link = link
        self.counters = counters
        self._parts = parts
        self._transport = transport
        self._stores: list[_PendingStore] = []
        self._completed: dict[int, int] = {}
        self._open_jobs: dict[str, set[int]] = {}
        self._held: set[str] = set()

    @property
    def pending(self) -> bool:
        """Stores wait for their copies before their commits."""
        return bool(self._stores)

    def hold(self, req_ids: list[str]) -> None:
        """Requests whose blocks the scheduler holds until their stores are done."""
        self._held.update(req_ids)

    def open(self, job: StoreJob) -> None:
        """Follow ``job`` until it is complete."""
        self._open_jobs.setdefault(job.req_id, set()).add(job.job_id)

    def finished(self) -> set[str]:
        """Held requests whose stores are done (their blocks may be freed), once."""
        done = {req_id for req_id in self._held if req_id not in self._open_jobs}
        self._held -= done
        return done

    def take_completed(self) -> dict[int, int]:
        """Store job id -> 1 for each job complete since the last call (this worker's part)."""
        completed, self._completed = self._completed, {}
        return completed

    def store(self, job: StoreJob, present: int) -> None:
        """Store ``job``, of which this step's load found the first ``present`` chunks."""
        part = self._parts[job.state]
        copier, size = part.copier, part.format.chunk_bytes
        keys = list(job.keys[self._rank])
        self.counters.add("present_chunks", present)
        if present == len(keys):
            self._complete(job)
            return
        parent = keys[present - 1] if present else job.parents[self._rank]
        try:
            files = self._transport.mapped()
            inline_limit = (
                self._inline_for(job.tenant) if files is not None else self._transport.inline
            )
            if files is None or inline_limit is not None:
                self._store_inline(job, keys, present, parent, inline_limit)
                return
            sizes = [size] * (len(keys) - present)
            plan = self._link.prepare_store(job.tenant, keys[present:], sizes, parent)
        except (LinkDown, AgentError, ChunkFileError) as error:
            log.debug("kvpool worker %d: store of %s skipped: %s", self._rank, job.req_id, error)
            self.counters.add("failed_stores")
            self._complete(job)
            return
        offsets = plan.offsets
        self.counters.add("present_chunks", sum(1 for offset in offsets if offset < 0))
        self.counters.add("refused_chunks", len(keys) - present - len(offsets))
        copies: list[Copy] = []
        if plan.lease is not None:
            try:
                for index, offset in enumerate(offsets, start=present):
                    if offset >= 0:
                        chunk = files.chunk(plan.file, offset, size, write=True)
                        copies.append(copier.store(chunk, self._kept_blocks(job, index)))
            except ChunkFileError as error:
                log.warning("kvpool worker %d: store not copied: %s", self._rank, error)
                self.counters.add("failed_stores")
                self._abandon(plan.lease)
                self._complete(job)
                return
        self._stores.append(_PendingStore(job, plan.lease, copies))
        if plan.refused:
            log.debug("kvpool worker %d: agent stored only part: %s", self._rank, plan.refused)

    def _inline_for(self, tenant: str) -> int | None:
        """Where a tenant's token stores into a shared space (whose file it maps read-only),
        the agent's ``max_inline_bytes``: those chunks travel through its messages."""
        bound = self._link.bound_tenant
        if not bound or tenant in (bound, tenant_id(None)):  # its own (or the default)
            return None
        return self._link.info().max_inline_bytes

    def _store_inline(
        self,
        job: StoreJob,
        keys: list[bytes],
        present: int,
        parent: bytes | None,
        max_inline_bytes: int | None,
    ) -> None:
        """Copy the chunks out into host memory and send them to the agent in its messages."""
        part = self._parts[job.state]
        copier, size = part.copier, part.format.chunk_bytes
        assert max_inline_bytes is not None
        buffers = [torch.empty(size, dtype=torch.uint8) for _ in keys[present:]]
        copies = [
            copier.store(buffer, self._kept_blocks(job, index))
            for index, buffer in enumerate(buffers, start=present)
        ]
        for copy in copies:
            copy.wait()
        result = inline.store(
            self._link,
            job.tenant,
            keys[present:],
            [buffer.numpy().data for buffer in buffers],
            parent=parent,
            max_inline_bytes=max_inline_bytes,
        )
        self.counters.add("stored_chunks", result.stored)
        self.counters.add("present_chunks", result.present)
        self.counters.add("refused_chunks", len(buffers) - result.stored - result.present)
        if result.refused:
            log.debug("kvpool worker %d: agent stored only part: %s", self._rank, result.refused)
        self._complete(job)

    def _kept_blocks(self, job: StoreJob, index: int) -> list[list[int]]:
        """Per group, the blocks it keeps of the job's ``index``-th chunk."""
        blocks = []
        for group, ids in zip(self._parts[job.state].format.groups, job.block_ids, strict=True):
            start = index * group.blocks_per_chunk
            blocks.append(list(ids[start + group.first_kept : start + group.blocks_per_chunk]))
        return blocks

    def settle(self, *, wait: bool) -> None:
        still: list[_PendingStore] = []
        for store in self._stores:
            if wait:
                for copy in store.copies:
                    copy.wait()
            elif not all(copy.done() for copy in store.copies):
                still.append(store)
                continue
            self._commit(store)
        self._stores = still

    def _commit(self, store: _PendingStore) -> None:
        if store.lease is not None:
            try:
                committed = self._link.commit_store(store.lease)
                self.counters.add("stored_chunks", committed)
            except (LinkDown, AgentError) as error:
                log.debug("kvpool worker %d: commit failed: %s", self._rank, error)
                self.counters.add("failed_stores")
        self._complete(store.job)

    def _abandon(self, lease: int) -> None:
        """Release a lease; if the agent is gone, so is the lease (it also expires)."""
        try:
            self._link.release(lease)
        except (LinkDown, AgentError) as error:
            log.debug("kvpool worker %d: release failed: %s", self._rank, error)

    def _complete(self, job: StoreJob) -> None:
        self._completed[job.job_id] = self._completed.get(job.job_id, 0) + 1
        jobs = self._open_jobs.get(job.req_id)
        if jobs is not None:
            jobs.discard(job.job_id)
            if not jobs:
                del self._open_jobs[job.req_id]
