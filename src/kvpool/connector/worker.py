"""``KVPoolConnectorWorker``: copies between vLLM's KV cache and the agent's chunk files.

It runs in each vLLM worker process (one per tensor-parallel rank) and knows
nothing about scheduling: it executes the jobs in the step's metadata.

* ``register_kv_caches``: find each layer's blocks by shape and stride
  (:mod:`kvpool.connector.layout`), fix the chunk format (every KV cache group,
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

It composes collaborators of one job each:
:class:`~kvpool.connector.worker_transport.ChunkTransport` (chunk files or the
agent's messages), :class:`~kvpool.connector.worker_loads.LoadRunner` and
:class:`~kvpool.connector.worker_stores.StoreRunner`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from kvpool.client import AgentInfo
from kvpool.connector.copier import BlockCopier
from kvpool.connector.counters import Counters
from kvpool.connector.jobs import FormatHandshake, StepJobs, StoresDone
from kvpool.connector.layout import ChunkFormat, GroupRule, detect_layout
from kvpool.connector.link import AgentLink, LinkDown
from kvpool.connector.worker_loads import LoadRunner
from kvpool.connector.worker_stores import StoreRunner
from kvpool.connector.worker_transport import ChunkTransport, Part

log = logging.getLogger(__name__)

__all__ = ["KVPoolConnectorWorker"]


class KVPoolConnectorWorker:
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
        self._parts: dict[bool, Part] = {}
        """By :attr:`LoadJob.state`: what the job moves."""
        self._transport = ChunkTransport(
            rank=rank,
            link=link,
            parts=self._parts,
            door_path=door_path,
            before_unmap=self._finish_copies,
        )
        self._loads = LoadRunner(
            rank=rank, link=link, counters=counters, parts=self._parts, transport=self._transport
        )
        self._stores = StoreRunner(
            rank=rank, link=link, counters=counters, parts=self._parts, transport=self._transport
        )
        self.handshake: FormatHandshake | None = None

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
    ) -> Part:
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
        fused = copier.fused or [False] * len(layouts)
        log.info(
            "kvpool worker %d: %s, %d bytes per %s",
            self._rank,
            "; ".join(
                f"{group.rule.name}: {group.layers} layers, {group.kept} of "
                f"{group.blocks_per_chunk} blocks {layout[0].page_shape} "
                f"({layout[0].physical_order}{', fused copies' if one_launch else ''})"
                for group, layout, one_launch in zip(
                    part_format.groups, layouts, fused, strict=True
                )
            ),
            part_format.chunk_bytes,
            "state record" if groups[0][0].is_state else f"{chunk_tokens}-token chunk",
        )
        return Part(part_format, copier)

    def _flush(self) -> None:
        for part in self._parts.values():
            part.copier.flush()

    def _finish_copies(self) -> None:
        """Finish every copy, commit every store and release every load."""
        self._flush()
        self._settle(wait=True)

    def on_new_agent(self, info: AgentInfo) -> None:
        """The link met an agent (first or restarted): see
        :meth:`~kvpool.connector.worker_transport.ChunkTransport.on_new_agent`."""
        self._transport.on_new_agent(info)

    # ------------------------------------------------------------ loads

    def start_load(self, meta: StepJobs) -> None:
        self._stores.hold(meta.held)  # before get_finished, whatever the step's order
        if meta.loads:
            with self.counters.timed("load_us"):
                for job in meta.loads:
                    self._loads.load(job, self._loads.following_store(job, meta.stores))
                    self._settle(wait=False)

    def take_received(self) -> tuple[set[str], set[str]]:
        """(finished receiving, failed receiving) of the per-request loads since the last
        call; the failed are among the finished, as vLLM wants them."""
        return self._loads.take_received()

    def take_load_errors(self) -> set[int]:
        return self._loads.take_load_errors()

    # ------------------------------------------------------------ stores

    def save(self, meta: StepJobs) -> None:
        if not (meta.stores or self._stores.pending or self._loads.pending):
            return
        with self.counters.timed("store_us"):
            for job in meta.stores:
                self._stores.open(job)
                self._stores.store(job, self._loads.take_present(job.job_id))
            # vLLM frees a window's (and a state's) blocks while the request runs, without
            # waiting for us
            self._stores.settle(wait=any(part.format.frees_blocks for part in self._parts.values()))
            self._loads.settle(wait=False)

    def _settle(self, *, wait: bool) -> None:
        """Commit stores and release loads whose copies have finished (all, with ``wait``)."""
        self._stores.settle(wait=wait)
        self._loads.settle(wait=wait)

    def handle_preemptions(self, meta: StepJobs) -> None:
        """Preempted requests' blocks are about to be reused: finish every copy first."""
        if meta.preempted and self._stores.pending:
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
        return self._stores.finished()

    def build_worker_meta(self) -> StoresDone | None:
        completed = self._stores.take_completed()
        return StoresDone(completed) if completed else None

    def close(self) -> None:
        self._transport.unmap()
        self._link.close()
