"""A worker's loads: chunks (or state records) from the agent into vLLM's blocks.

For each :class:`~kvpool.connector.jobs.LoadJob` (before the forward): lock the
chunks (``lookup``), copy them into the blocks, send the release (its answer is read after
the forward, so the round trip overlaps it). The same lookup covers the chunks the request
stores in this step right after the loaded ones: those found need no reservation after the
forward (:meth:`LoadRunner.take_present`). Chunks that are gone, and every chunk after the
first gap, are reported for recompute: their blocks (:meth:`LoadRunner.take_load_errors`),
or for a per-request load its request (:meth:`LoadRunner.take_received`); so are the blocks
of a load whose lease did not hold until its release.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvpool.client import AgentError
from kvpool.client.mapped_files import ChunkFileError
from kvpool.connector import inline
from kvpool.connector.copier import Copy, MappedChunks
from kvpool.connector.counters import Counters
from kvpool.connector.jobs import LoadJob, StoreJob
from kvpool.connector.layout import NULL_BLOCK, ChunkFormat, GroupFormat
from kvpool.connector.link import AgentLink, LinkDown
from kvpool.connector.worker_transport import ChunkTransport, Parts

log = logging.getLogger(__name__)


@dataclass
class _PendingRelease:
    lease: int
    copies: list[Copy]
    block_ids: list[int]
    """The blocks the copies write: wrong if the lease ends before it is released."""
    req_id: str | None = None
    """The request whose load fails as a whole (a per-request load), or None."""
    answer: Callable[[], None] | None = None
    """Waits for the agent's answer to the release, once it is sent."""


class LoadRunner:
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
        self._failed_blocks: set[int] = set()
        self._received: set[str] = set()
        """Requests whose per-request loads are done (loaded or failed): finished receiving."""
        self._failed_requests: set[str] = set()
        """Of those, the requests whose loads failed (vLLM recomputes them)."""
        self._releases: list[_PendingRelease] = []
        self._releasing: list[_PendingRelease] = []
        """Releases sent whose answers are read after the forward."""
        self._present: dict[int, int] = {}
        """Store job id -> its leading chunks that this step's load lookup found cached."""
        self._said_unkept = False
        """A load found vLLM wanting a block a group did not keep (warned once)."""

    @property
    def pending(self) -> bool:
        """Releases wait for their copies."""
        return bool(self._releases)

    def take_present(self, job_id: int) -> int:
        """The leading chunks of store job ``job_id`` that a load's lookup found cached."""
        return self._present.pop(job_id, 0)

    def following_store(self, load: LoadJob, stores: Sequence[StoreJob]) -> StoreJob | None:
        """The store job of the same request whose chunks follow the loaded ones."""
        last = load.keys[self._rank][-1]
        for store in stores:
            if (
                store.req_id == load.req_id
                and store.state == load.state
                and store.parents[self._rank] == last
            ):
                return store
        return None

    def load(self, job: LoadJob, following: StoreJob | None) -> None:
        keys = list(job.keys[self._rank])
        loaded = 0
        try:
            files = self._transport.mapped()
            if files is None:
                loaded = self._load_inline(job, keys)
            else:
                loaded = self._load_mapped(job, keys, following, files)
        except (LinkDown, ChunkFileError) as error:
            log.debug("kvpool worker %d: load of %s failed: %s", self._rank, job.req_id, error)
        except AgentError as error:
            log.warning("kvpool worker %d: load refused: %s", self._rank, error)
        self.counters.add("loaded_chunks", loaded)
        if job.per_request:
            self._received.add(job.req_id)
        if loaded < len(keys):
            self.counters.add("load_failed_chunks", len(keys) - loaded)
            if job.per_request:
                self._failed_requests.add(job.req_id)
            else:
                for index in range(loaded, len(keys)):
                    self._failed_blocks.update(self._chunk_blocks(job, index))

    def _load_mapped(
        self,
        job: LoadJob,
        keys: list[bytes],
        following: StoreJob | None,
        files: MappedChunks,
    ) -> int:
        """Lock the chunks, copy them out of their chunk file; the release waits for the copies.
        The same lookup covers the chunks the request stores next."""
        part = self._parts[job.state]
        copier, chunk_format = part.copier, part.format
        store_keys = list(following.keys[self._rank]) if following is not None else []
        # the scheduler's probe counted these chunks already
        hit = self._link.lookup(job.tenant, keys + store_keys, lock=True, count=False)
        if following is not None and hit.count > len(keys):
            self._present[following.job_id] = hit.count - len(keys)
        copies: list[Copy] = []
        written: list[int] = []
        try:
            for index in range(min(hit.count, len(keys))):
                if not self._expected_size(hit.sizes[index], chunk_format):
                    break
                targets = self._load_targets(job, index)
                if targets is None:
                    break
                chunk = files.chunk(hit.file, hit.offsets[index], chunk_format.chunk_bytes)
                copies.append(copier.load(chunk, targets, forward_reads=not job.per_request))
                written.extend(block for _, ids in targets for block in ids)
        finally:
            if hit.lease is not None:
                owner = job.req_id if job.per_request else None
                self._releases.append(_PendingRelease(hit.lease, copies, written, owner))
        return len(copies)

    def _load_inline(self, job: LoadJob, keys: list[bytes]) -> int:
        """Ask the agent for the chunks' bytes and copy them in (no lease: they are copies)."""
        part = self._parts[job.state]
        copier, chunk_format = part.copier, part.format
        assert self._transport.inline is not None
        found = inline.retrieve(
            self._link, job.tenant, keys, chunk_format.chunk_bytes, self._transport.inline
        )
        copies: list[Copy] = []
        for index, data in enumerate(found):
            if not self._expected_size(len(data), chunk_format):
                break
            targets = self._load_targets(job, index)
            if targets is None:
                break
            chunk = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            copies.append(copier.load(chunk, targets, forward_reads=not job.per_request))
        for copy in copies:  # the host bytes go when this returns
            copy.wait()
        return len(copies)

    def _expected_size(self, size: int, chunk_format: ChunkFormat) -> bool:
        if size == chunk_format.chunk_bytes:
            return True
        log.warning(
            "kvpool worker %d: chunk of %d bytes, expected %d; not loaded",
            self._rank,
            size,
            chunk_format.chunk_bytes,
        )
        return False

    def _chunk_ids(
        self, job: LoadJob, index: int
    ) -> list[tuple[GroupFormat, int, tuple[int, ...]]]:
        """Per group, the destination ids of the job's ``index``-th chunk: ``(group, first,
        ids)``, the ids of the chunk's blocks ``first`` (past those vLLM already has) to the
        last, vLLM's null block where the group keeps no KV."""
        chunks = []
        for group, ids in zip(self._parts[job.state].format.groups, job.block_ids, strict=True):
            per_chunk, skipped = group.blocks_per_chunk, job.first_tokens // group.rule.block_size
            first = skipped if index == 0 else 0
            start = index * per_chunk - skipped + first
            chunks.append((group, first, ids[start : start + per_chunk - first]))
        return chunks

    def _chunk_blocks(self, job: LoadJob, index: int) -> list[int]:
        """The real (not null) destination blocks of the job's ``index``-th chunk."""
        return [
            block
            for _, _, ids in self._chunk_ids(job, index)
            for block in ids
            if block != NULL_BLOCK
        ]

    def _load_targets(self, job: LoadJob, index: int) -> list[tuple[int, list[int]]] | None:
        """Per group, ``(first kept block, destination ids)`` for the ``index``-th chunk of the
        job: the blocks vLLM allocated, which must be a run at the end of what the group
        keeps (vLLM gives the null block to positions outside a window). None when vLLM
        wants a block the chunk does not hold: that chunk and the rest are recomputed."""
        targets: list[tuple[int, list[int]]] = []
        for group, first, ids in self._chunk_ids(job, index):
            real = [position for position, block in enumerate(ids) if block != NULL_BLOCK]
            if not real and group.rule.is_state:
                return None  # vLLM gave the state no block (it cannot happen): recompute
            if not real:
                targets.append((0, []))
                continue
            begin = first + real[0]
            if begin < group.first_kept or len(real) != len(ids) - real[0]:
                if not self._said_unkept:
                    self._said_unkept = True
                    log.warning(
                        "kvpool worker %d: vLLM wants block %d of a chunk whose %s group "
                        "keeps blocks %d to %d; such chunks are recomputed (said once)",
                        self._rank,
                        begin,
                        group.rule.name,
                        group.first_kept,
                        group.blocks_per_chunk - 1,
                    )
                return None
            targets.append((begin - group.first_kept, list(ids[real[0] :])))
        return targets

    def take_received(self) -> tuple[set[str], set[str]]:
        """(finished receiving, failed receiving) of the per-request loads since the last
        call; the failed are among the finished, as vLLM wants them."""
        if self._received:  # their copies are done and their leases held until now
            self.settle(wait=True)
        received, self._received = self._received, set()
        failed = self._failed_requests & received
        self._failed_requests -= received
        return received, failed

    def take_load_errors(self) -> set[int]:
        # vLLM asks after the forward, whose input the copies were: they are done, and the
        # blocks count only if their chunks' leases held until now
        self.settle(wait=True)
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def settle(self, *, wait: bool) -> None:
        """Send the releases of loads whose copies have finished; with ``wait``, finish every
        copy and read every release's answer."""
        waiting: list[_PendingRelease] = []
        for release in self._releases:
            if wait:
                for copy in release.copies:
                    copy.wait()
            elif not all(copy.done() for copy in release.copies):
                waiting.append(release)
                continue
            try:
                release.answer = self._link.release_later(release.lease)
            except (LinkDown, AgentError) as error:
                self._lease_lost(release, error)
                continue
            self._releasing.append(release)
        self._releases = waiting
        if wait:
            for release in self._releasing:
                self._confirm_release(release)
            self._releasing = []

    def _confirm_release(self, release: _PendingRelease) -> None:
        assert release.answer is not None
        try:
            release.answer()
        except (LinkDown, AgentError) as error:
            self._lease_lost(release, error)

    def _lease_lost(self, release: _PendingRelease, error: Exception) -> None:
        """A release that failed: the lease may have ended before the copies did (a stalled
        worker, an agent restarted), and the pages may hold another chunk by now, another
        tenant's included: the blocks are reported for recompute, never used."""
        log.warning(
            "kvpool worker %d: a load's lease did not hold until its release (%s); "
            "%d blocks recomputed",
            self._rank,
            error,
            len(release.block_ids),
        )
        self.counters.add("load_failed_chunks", len(release.copies))
        if release.req_id is not None:
            self._failed_requests.add(release.req_id)
        else:
            self._failed_blocks.update(release.block_ids)
