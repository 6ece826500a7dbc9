"""The scheduler's store planner: which chunks (and states) the workers store, and when a
finished request's blocks may go.

Every chunk that becomes full by the end of a step (prompt or generated tokens) and was
not loaded from the agent becomes part of a :class:`~kvpool.connector.jobs.StoreJob`,
with the key of the chunk before it as parent; a state vLLM hands over at a chunk's end
becomes one of its own. A prefill of a disaggregated request also stores the tokens after
its prompt's last full chunk, once the prompt is computed: a *tail* record, a chunk-sized
record keyed by :func:`~kvpool.common.keys.tail_key` that holds the blocks of those tokens
(the rest of the record repeats the last of them, the request's own KV: never stale bytes),
so that the decode computes one token instead of up to a chunk. A store job is followed
until every tensor-parallel worker has done it; a finished request whose stores have not
finished yet keeps its blocks (only where the workers' stores are asynchronous, as on
CUDA).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvpool.connector.counters import Counters
from kvpool.connector.jobs import GroupBlocks, RankKeys, StoreJob
from kvpool.connector.scheduler_requests import ChunkGeometry, TrackedRequest


@dataclass
class _OpenStore:
    req_id: str
    workers_left: int


class StorePlanner:
    def __init__(
        self,
        *,
        geometry: ChunkGeometry,
        tp_size: int,
        allowed: Callable[[str], bool | None],
        counters: Counters,
        stores_complete_in_step: bool,
    ) -> None:
        """``allowed``: whether this engine's token may store for a tenant (None: not known
        now); ``stores_complete_in_step``: the workers' stores finish within their step, so
        no request's blocks are ever held."""
        self._geometry = geometry
        self._tp_size = tp_size
        self._allowed = allowed
        self.counters = counters
        self._stores_complete_in_step = stores_complete_in_step
        self._stores: dict[int, _OpenStore] = {}
        self._job_ids = itertools.count(1)
        self._newly_held: list[str] = []
        self._held: set[str] = set()

    # ------------------------------------------------------------ planning

    def plan(self, state: TrackedRequest, computed_tokens: int, stores: list[StoreJob]) -> None:
        """Add to ``stores`` the request's chunks that are full once ``computed_tokens`` are."""
        geometry = self._geometry
        size = geometry.chunk_tokens
        full = min(computed_tokens, state.request.num_tokens, len(state.request.all_token_ids))
        if not state.block_ids or not state.cacheable:
            return
        chunk_ids = [state.block_ids[index] for index in geometry.chunk_groups]
        full = min(
            full // size,
            *(
                len(ids) // per_chunk
                for ids, per_chunk in zip(chunk_ids, geometry.blocks_per_chunk, strict=True)
            ),
        )
        first = state.stored_chunks
        while first < full and not geometry.storable(state.block_ids, first):
            first += 1  # a window's blocks vLLM did not keep (before its own prefix hit)
        state.stored_chunks = max(state.stored_chunks, first)
        if full <= first:
            self._plan_tail(state, computed_tokens, stores)
            return
        tokens = state.request.all_token_ids
        with self.counters.timed("hash_us"):
            hashed = [len(chain.upto(tokens, full)) for chain in state.chains]
        if any(count != full for count in hashed):
            return  # token ids not known yet (cannot happen with vLLM's accounting)
        for span in state.spans(first, full):  # a job per tenant
            if self._allowed(span.tenant) is False:
                continue  # a shared space the agent refuses this token: it would refuse these
            self._open(
                state,
                stores,
                tenant=span.tenant,
                keys=tuple(tuple(chain.keys[span.start : span.stop]) for chain in state.chains),
                parents=tuple(chain.parent(span.start) for chain in state.chains),
                block_ids=tuple(
                    tuple(ids[span.start * per_chunk : span.stop * per_chunk])
                    for ids, per_chunk in zip(chunk_ids, geometry.blocks_per_chunk, strict=True)
                ),
            )
        state.stored_chunks = full
        self._plan_tail(state, computed_tokens, stores)

    def _plan_tail(
        self, state: TrackedRequest, computed_tokens: int, stores: list[StoreJob]
    ) -> None:
        """Store the prompt's tail (after its full chunks' job, its parent) once the prompt is
        computed, if the request stores one and the chunk format can hold it."""
        geometry = self._geometry
        if (
            not state.stores_tail
            or state.tail_stored is not None
            or not geometry.tails
            or computed_tokens < state.request.num_prompt_tokens
            or state.stored_chunks < state.full_chunks
        ):
            return
        state.tail_stored = False
        tail = state.tail()
        if tail is None or self._allowed(tail[0]) is False:
            return
        tenant, tail_keys = tail
        full, rest = state.full_chunks, state.request.num_prompt_tokens % geometry.chunk_tokens
        block_ids = []
        for index, per_chunk in zip(geometry.chunk_groups, geometry.blocks_per_chunk, strict=True):
            ids = state.block_ids[index][full * per_chunk :]
            used = -(-rest // geometry.groups[index].block_size)
            if len(ids) < used:
                return  # vLLM has not allocated them (cannot happen once the prompt is computed)
            block_ids.append(tuple(ids[:used]) + (ids[used - 1],) * (per_chunk - used))
        state.tail_stored = True
        self._open(
            state,
            stores,
            tenant=tenant,
            keys=tuple((key,) for key in tail_keys),
            parents=tuple(chain.keys[full - 1] for chain in state.chains),
            block_ids=tuple(block_ids),
        )
        self.counters.add("pd_tails")

    def plan_states(
        self,
        state: TrackedRequest,
        handed_over: Sequence[tuple[int, int, int]],
        stores: list[StoreJob],
    ) -> None:
        """Store the states vLLM hands over (``(group, block, tokens)``: the block holds the
        group's state after ``tokens`` tokens, written by this step's forward) that end a
        chunk, every state group's, each under its chunk's key (after the chunks' stores, so
        the agent has the parent)."""
        size = self._geometry.chunk_tokens
        state_groups = self._geometry.state_groups
        by_boundary: dict[int, dict[int, int]] = {}
        for group, block, tokens in handed_over:
            if tokens > 0 and tokens % size == 0:
                by_boundary.setdefault(tokens, {})[group] = block
        for tokens, blocks in sorted(by_boundary.items()):
            chunk = tokens // size - 1
            if (
                not state.cacheable
                or chunk < state.loaded_until
                or any(group not in blocks for group in state_groups)
            ):
                continue
            with self.counters.timed("hash_us"):
                hashed = [
                    len(chain.upto(state.request.all_token_ids, chunk + 1))
                    for chain in state.chains
                ]
            if min(hashed) <= chunk:
                continue
            tenant, wanted = state.state_keys(chunk)
            if self._allowed(tenant) is False:
                continue
            self._open(
                state,
                stores,
                tenant=tenant,
                keys=tuple((key,) for key in wanted),
                parents=tuple(chain.keys[chunk] for chain in state.chains),
                block_ids=tuple((blocks[group],) for group in state_groups),
                is_state=True,
            )

    def _open(
        self,
        state: TrackedRequest,
        stores: list[StoreJob],
        *,
        tenant: str,
        keys: RankKeys,
        parents: tuple[bytes | None, ...],
        block_ids: GroupBlocks,
        is_state: bool = False,
    ) -> None:
        """A store job of the request's, added to this step's ``stores`` and followed until
        every worker has done it."""
        job_id = next(self._job_ids)
        req_id = state.request.request_id
        stores.append(StoreJob(job_id, req_id, tenant, keys, parents, block_ids, state=is_state))
        self._stores[job_id] = _OpenStore(req_id, self._tp_size)
        state.open_stores.add(job_id)

    # ------------------------------------------------------------ completion

    def completed(
        self, completed_stores: Mapping[int, int], requests: Callable[[str], TrackedRequest | None]
    ) -> None:
        """Count the workers that finished each store job (``job id -> workers``); a job all
        have finished is closed in its request (``requests`` finds it by id)."""
        for job_id, workers in completed_stores.items():
            store = self._stores.get(job_id)
            if store is None:
                continue
            store.workers_left -= workers
            if store.workers_left > 0:
                continue
            del self._stores[job_id]
            state = requests(store.req_id)
            if state is not None:
                state.open_stores.discard(job_id)

    def released(self, finished_sending: set[str]) -> list[str]:
        """Of the requests the workers finished sending, those whose blocks were held."""
        released = [req_id for req_id in finished_sending if req_id in self._held]
        self._held.difference_update(released)
        return released

    def hold(self, state: TrackedRequest) -> bool:
        """The request finished: True to hold its blocks until the workers report its stores
        finished; False when nothing is open (stores finished within their step are
        forgotten)."""
        if state.open_stores and not self._stores_complete_in_step:
            self._held.add(state.request.request_id)
            self._newly_held.append(state.request.request_id)
            self.counters.add("held_requests")
            return True
        for job_id in state.open_stores:  # finished within their step; forget them
            self._stores.pop(job_id, None)
        return False

    def take_newly_held(self) -> list[str]:
        held, self._newly_held = self._newly_held, []
        return held

    @property
    def holding(self) -> bool:
        return bool(self._held)
