"""The worker half: copies between vLLM's KV cache and the agent's chunk files.

It runs in each vLLM worker process (one per tensor-parallel rank) and knows
nothing about scheduling: it executes the jobs in the step's metadata.

* ``register_kv_caches``: find each layer's blocks by shape and stride
  (:mod:`kvpool_agent.connector.layout`), fix the chunk format (every KV cache group,
  each keeping what a request needs to resume at a chunk's end) and, for state-space
  and linear-attention layers, the format of a state record (the state at a chunk's
  end, one block of each such layer), map the chunk files, and describe the formats to the
  scheduler (the handshake). A job moves chunks or state records, each with its format.
* ``start_load_kv`` (before the forward): for each :class:`LoadJob`, lock the
  chunks (``lookup``), copy them into the blocks, send the release (its answer is
  read after the forward, so the round trip overlaps it). The same lookup covers
  the chunks the request stores in this step right after the loaded ones (a prompt
  that ends on a chunk boundary computes its last chunk, which the agent usually
  has): those found need no reservation after the forward. Chunks that are gone,
  and every chunk after the first gap, are reported through
  ``get_block_ids_with_load_errors`` in the same step, so vLLM recomputes them; so are
  the blocks of a load whose lease did not hold until its release (the pages may hold
  another chunk by then). Per group, a chunk is copied into the blocks vLLM allocated
  for it, skipping its null block (a window's positions outside the window); a chunk
  for which vLLM wants a block its group did not keep is reported the same way. On a GPU
  the forward waits for a load only if it reads the blocks in this step: a per-request
  load (vLLM holds the request until it is reported received) runs beside it.
* ``wait_for_save`` (after the forward): for each :class:`StoreJob`, reserve
  (``prepare_store`` with the parent key), copy the chunks the agent does not
  have yet, commit. Refusals (quota, memory) and errors drop the store; the
  next request recomputes and tries again. Where a group lets vLLM free blocks while
  the request runs (a window), the copies finish before ``wait_for_save`` returns.
* ``get_finished``: requests the scheduler holds are reported once their stores
  have finished.

Any agent failure is counted and logged by the link and costs only the cache.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kvpool_agent.client import AgentError, AgentInfo
from kvpool_agent.connector import inline
from kvpool_agent.connector.copier import BlockCopier, Copy, MappedChunks
from kvpool_agent.connector.counters import Counters
from kvpool_agent.connector.jobs import FormatHandshake, LoadJob, StepJobs, StoreJob, StoresDone
from kvpool_agent.connector.layout import (
    NULL_BLOCK,
    ChunkFormat,
    GroupFormat,
    GroupRule,
    detect_layout,
)
from kvpool_agent.connector.link import AgentLink, LinkDown
from kvpool_agent.keys import tenant_id
from kvpool_agent.mapped_files import ChunkFileError

log = logging.getLogger(__name__)


MESSAGES_ONLY = "transport=messages: KV moves through the agent's messages, no file is mapped"


@dataclass(frozen=True)
class _Part:
    """What a job moves (chunks, or state records): their format and the copier of their
    groups' layers."""

    format: ChunkFormat
    copier: BlockCopier


@dataclass
class _PendingStore:
    job: StoreJob
    lease: int | None
    copies: list[Copy]


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


class WorkerHalf:
    def __init__(
        self,
        *,
        rank: int,
        link: AgentLink,
        counters: Counters,
        chunk_tokens: Callable[[], int],
        door_path: Callable[[AgentInfo], Path | None],
    ) -> None:
        self._rank = rank
        self._link = link
        self.counters = counters
        self._chunk_tokens = chunk_tokens
        self._door_path = door_path
        self._parts: dict[bool, _Part] = {}
        """By :attr:`LoadJob.state`: what the job moves."""
        self._files: MappedChunks | None = None
        self._inline: int | None = None
        """Without chunk files: the agent's ``max_inline_bytes`` when chunks travel
        through its protocol instead (:mod:`kvpool_agent.connector.inline`), else None."""
        self._said_unmapped: tuple[Path | None, str, bool] | None = None
        """Why chunk files were last not used, said once (see :meth:`on_new_agent`)."""
        self._failed_blocks: set[int] = set()
        self._received: set[str] = set()
        """Requests whose per-request loads are done (loaded or failed): finished receiving."""
        self._failed_requests: set[str] = set()
        """Of those, the requests whose loads failed (vLLM recomputes them)."""
        self._stores: list[_PendingStore] = []
        self._releases: list[_PendingRelease] = []
        self._releasing: list[_PendingRelease] = []
        """Releases sent whose answers are read after the forward."""
        self._completed: dict[int, int] = {}
        self._open_jobs: dict[str, set[int]] = {}
        self._held: set[str] = set()
        self._present: dict[int, int] = {}
        """Store job id -> its leading chunks that this step's load lookup found cached."""
        self.handshake: FormatHandshake | None = None
        self._said_unkept = False
        """A load found vLLM wanting a block a group did not keep (warned once)."""

    # ------------------------------------------------------------ set-up

    def register_kv_caches(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        groups: Sequence[tuple[GroupRule, Sequence[str]]],
        num_blocks: int,
        content: str,
    ) -> None:
        """Understand the caches of each group's layers (in this order) and map the chunk
        files."""
        chunk_tokens = self._chunk_tokens()
        chunks = [group for group in groups if not group[0].is_state]
        states = [group for group in groups if group[0].is_state]
        self._parts[False] = self._make_part(kv_caches, chunks, num_blocks, chunk_tokens, content)
        if states:
            self._parts[True] = self._make_part(
                kv_caches, states, num_blocks, chunk_tokens, content
            )
        self.handshake = FormatHandshake(
            self._parts[False].format.descriptor(self.state_format),
            chunk_tokens,
            all(part.copier.synchronous for part in self._parts.values()),
        )
        with contextlib.suppress(LinkDown):  # map now, not in the first request
            self._link.info()

    @property
    def format(self) -> ChunkFormat | None:
        """The chunks' format (every group but the state groups), once caches are known."""
        part = self._parts.get(False)
        return None if part is None else part.format

    @property
    def state_format(self) -> ChunkFormat | None:
        """The state records' format, for a model with state-space or linear-attention
        layers."""
        part = self._parts.get(True)
        return None if part is None else part.format

    def _make_part(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        groups: Sequence[tuple[GroupRule, Sequence[str]]],
        num_blocks: int,
        chunk_tokens: int,
        content: str,
    ) -> _Part:
        tensors = [[kv_caches[name] for name in names] for _, names in groups]
        layouts = [[detect_layout(tensor, num_blocks) for tensor in group] for group in tensors]
        part_format = ChunkFormat.of(
            [(rule, group) for (rule, _), group in zip(groups, layouts, strict=True)],
            chunk_tokens,
            content,
        )
        copier = BlockCopier(
            [
                [layout.blocks(tensor) for layout, tensor in zip(group, caches, strict=True)]
                for group, caches in zip(layouts, tensors, strict=True)
            ],
            part_format,
        )
        log.info(
            "kvpool worker %d: %s, %d bytes per %s",
            self._rank,
            "; ".join(
                f"{group.rule.name}: {group.layers} layers, {group.kept} of "
                f"{group.blocks_per_chunk} blocks {layout[0].page_shape} "
                f"({layout[0].physical_order})"
                for group, layout in zip(part_format.groups, layouts, strict=True)
            ),
            part_format.chunk_bytes,
            "state record" if groups[0][0].is_state else f"{chunk_tokens}-token chunk",
        )
        return _Part(part_format, copier)

    def _flush(self) -> None:
        for part in self._parts.values():
            part.copier.flush()

    def _moved(self, job: LoadJob | StoreJob) -> _Part:
        """The format and copier of what ``job`` moves (chunks or state records)."""
        return self._parts[job.state]

    def on_new_agent(self, info: AgentInfo) -> None:
        """The link met an agent (first or restarted): map chunk files through its door from
        now on, unless those mapped go with the same segment (an agent that started from
        empty has new files).

        Without the agent's door, chunks travel through the agent's protocol instead; with
        the transport ``messages`` (no door), always.
        """
        door = self._door_path(info)
        if door is None:
            self._without_files(info, None, MESSAGES_ONLY)
            return
        mapped = self._files
        if (
            mapped is not None
            and mapped.files.door == door
            and mapped.identity == info.segment_identity
        ):
            return
        self._drop_files()
        if not door.is_socket():
            self._without_files(info, door, f"no agent's door at {door}")
            return
        self._said_unmapped, self._inline = None, None
        self._files = MappedChunks(self._link.chunk_files(door), info.segment_identity)
        log.info("kvpool worker %d: maps chunk files from the agent's door %s", self._rank, door)

    def _without_files(self, info: AgentInfo, path: Path | None, reason: str) -> None:
        """No chunk files to copy through (``path`` None: none asked for, the transport
        ``messages``): move chunks through the agent's protocol if they fit in its messages;
        say which, once. (Before the caches are registered nothing is decided: the next load
        or store maps again.)"""
        if not self._parts:
            return
        size = max(part.format.chunk_bytes for part in self._parts.values())
        usable = inline.fits(size, info.max_inline_bytes)
        self._inline = info.max_inline_bytes if usable else None
        if self._said_unmapped == (path, reason, usable):
            return
        self._said_unmapped = (path, reason, usable)
        if usable and path is None:
            log.info("kvpool worker %d: %s", self._rank, reason)
        elif usable:
            log.warning(
                "kvpool worker %d: %s; moving KV through the agent over the network instead "
                "(slower than mapping its chunk files: give the pod the agent's door, as "
                "kvpool's admission webhook does)",
                self._rank,
                reason,
            )
        else:
            log.warning(
                "kvpool worker %d: %s, and a chunk (%d bytes) is larger than the agent's "
                "max_inline_bytes (%d), so it cannot travel through the agent either: "
                "nothing is loaded or stored",
                self._rank,
                reason,
                size,
                info.max_inline_bytes,
            )

    def _drop_files(self) -> None:
        if self._files is None:
            return
        self._flush()
        self._settle(wait=True)
        self._files.close()
        self._files = None

    # ------------------------------------------------------------ loads

    def start_load(self, meta: StepJobs) -> None:
        self._held.update(meta.held)  # before get_finished, whatever the step's order
        if meta.loads:
            with self.counters.timed("load_us"):
                for job in meta.loads:
                    self._load(job, self._following_store(job, meta.stores))

    def _following_store(self, load: LoadJob, stores: Sequence[StoreJob]) -> StoreJob | None:
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

    def _load(self, job: LoadJob, following: StoreJob | None) -> None:
        keys = list(job.keys[self._rank])
        loaded = 0
        try:
            files = self._mapped()
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
        self._settle(wait=False)

    def _load_mapped(
        self,
        job: LoadJob,
        keys: list[bytes],
        following: StoreJob | None,
        files: MappedChunks,
    ) -> int:
        """Lock the chunks, copy them out of their chunk file; the release waits for the copies.
        The same lookup covers the chunks the request stores next."""
        part = self._moved(job)
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
        part = self._moved(job)
        copier, chunk_format = part.copier, part.format
        assert self._inline is not None
        found = inline.retrieve(
            self._link, job.tenant, keys, chunk_format.chunk_bytes, self._inline
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
        for group, ids in zip(self._moved(job).format.groups, job.block_ids, strict=True):
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
            self._settle_loads(wait=True)
        received, self._received = self._received, set()
        failed = self._failed_requests & received
        self._failed_requests -= received
        return received, failed

    def take_load_errors(self) -> set[int]:
        # vLLM asks after the forward, whose input the copies were: they are done, and the
        # blocks count only if their chunks' leases held until now
        self._settle_loads(wait=True)
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    # ------------------------------------------------------------ stores

    def save(self, meta: StepJobs) -> None:
        if not (meta.stores or self._stores or self._releases):
            return
        with self.counters.timed("store_us"):
            for job in meta.stores:
                self._open_jobs.setdefault(job.req_id, set()).add(job.job_id)
                self._store(job)
            # vLLM frees a window's (and a state's) blocks while the request runs, without
            # waiting for us
            self._settle_stores(wait=any(part.format.frees_blocks for part in self._parts.values()))
            self._settle_loads(wait=False)

    def _store(self, job: StoreJob) -> None:
        part = self._moved(job)
        copier, size = part.copier, part.format.chunk_bytes
        keys = list(job.keys[self._rank])
        present = self._present.pop(job.job_id, 0)
        self.counters.add("present_chunks", present)
        if present == len(keys):
            self._complete(job)
            return
        parent = keys[present - 1] if present else job.parents[self._rank]
        try:
            files = self._mapped()
            inline_limit = self._inline_for(job.tenant) if files is not None else self._inline
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
        part = self._moved(job)
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
        for group, ids in zip(self._moved(job).format.groups, job.block_ids, strict=True):
            start = index * group.blocks_per_chunk
            blocks.append(list(ids[start + group.first_kept : start + group.blocks_per_chunk]))
        return blocks

    def _settle(self, *, wait: bool) -> None:
        """Commit stores and release loads whose copies have finished (all, with ``wait``)."""
        self._settle_stores(wait=wait)
        self._settle_loads(wait=wait)

    def _settle_stores(self, *, wait: bool) -> None:
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

    def _settle_loads(self, *, wait: bool) -> None:
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

    def _commit(self, store: _PendingStore) -> None:
        if store.lease is not None:
            try:
                committed = self._link.commit_store(store.lease)
                self.counters.add("stored_chunks", committed)
            except (LinkDown, AgentError) as error:
                log.debug("kvpool worker %d: commit failed: %s", self._rank, error)
                self.counters.add("failed_stores")
        self._complete(store.job)

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

    def handle_preemptions(self, meta: StepJobs) -> None:
        """Preempted requests' blocks are about to be reused: finish every copy first."""
        if meta.preempted and self._stores:
            self._flush()
            self._settle(wait=True)

    # ------------------------------------------------------------ reporting

    def get_finished(self, finished_req_ids: set[str]) -> set[str]:
        """Held requests whose stores are done (their blocks may be freed).

        The scheduler names a request as held in the metadata of the step whose
        ``finished_req_ids`` carry it, so every id reported here was given to vLLM's
        ``get_finished`` in this call or an earlier one, as vLLM requires.
        """
        self._settle(wait=False)
        done = {req_id for req_id in self._held if req_id not in self._open_jobs}
        self._held -= done
        return done

    def build_worker_meta(self) -> StoresDone | None:
        if not self._completed:
            return None
        completed, self._completed = self._completed, {}
        return StoresDone(completed)

    def _mapped(self) -> MappedChunks | None:
        """The agent's chunk files; None when chunks travel through the agent's protocol
        (the link maps again when it meets a new agent). ChunkFileError: neither works."""
        if self._files is None and self._inline is None:
            self.on_new_agent(self._link.info())
        if self._files is None and self._inline is None:
            raise ChunkFileError("the agent's chunk files are not mapped")
        return self._files

    def close(self) -> None:
        self._drop_files()
        self._link.close()
