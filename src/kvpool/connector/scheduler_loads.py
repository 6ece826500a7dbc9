"""The scheduler's load planner: the hit vLLM took, as loads into the blocks it allocated.

The worker locks the chunks when it copies them; if they are gone by then it reports the
blocks and vLLM recomputes them. vLLM takes no failed blocks from an engine of several
groups (block ids are not unique across groups), and a window group cannot resume at a
failed block, so there the load is per request (``loads_per_request``): the request waits
one step for its KV, and a failed load is reported for the request.

A decode's hit may end inside the prompt's last chunk (its tail record, loaded into the
blocks that hold the tail's tokens: the last block only partly, vLLM computes the rest).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.connector.counters import Counters
from kvpool.connector.jobs import LoadJob
from kvpool.connector.layout import NULL_BLOCK
from kvpool.connector.scheduler_requests import ChunkGeometry, TrackedRequest


class LoadPlanner:
    def __init__(
        self, *, geometry: ChunkGeometry, counters: Counters, loads_per_request: bool
    ) -> None:
        self._geometry = geometry
        self.counters = counters
        self._loads_per_request = loads_per_request

    def plan(
        self, state: TrackedRequest, block_ids: Sequence[Sequence[int]], num_external_tokens: int
    ) -> list[LoadJob]:
        """The hit vLLM took (``num_external_tokens`` of those the lookup planner offered) as
        loads into the blocks vLLM allocated (every KV cache group's): a job per tenant, and
        the state at the hit's end for a model with state groups."""
        assert state.planned is not None, "vLLM allocated for a hit this connector did not report"
        geometry = self._geometry
        start = state.planned[0]
        end = start + min(num_external_tokens, state.planned[1])
        size = geometry.chunk_tokens
        first_chunk, end_chunk = start // size, -(-end // size)
        loads = []
        for span in state.spans(first_chunk, end_chunk):  # a job per tenant
            begin, stop = max(start, span.start * size), min(end, span.stop * size)
            loads.append(
                LoadJob(
                    req_id=state.request.request_id,
                    tenant=span.tenant,
                    keys=state.record_keys(span.start, span.stop),
                    block_ids=tuple(
                        tuple(ids[begin // rule.block_size : -(-stop // rule.block_size)])
                        for rule, ids in geometry.of_groups(geometry.chunk_groups, block_ids)
                    ),
                    first_tokens=begin % size,
                    per_request=self._loads_per_request,
                )
            )
        if geometry.state_groups:
            loads.append(self._state_load(state, end, block_ids))
        state.loaded_from, state.loaded_until = first_chunk, end_chunk
        state.stored_chunks = max(state.stored_chunks, end // size)  # a partial one: stored full
        state.planned = None
        self.counters.add("hit_tokens", end - start)
        return loads

    def _state_load(
        self, state: TrackedRequest, end: int, block_ids: Sequence[Sequence[int]]
    ) -> LoadJob:
        """The load of the state at the hit's end, into the one block vLLM gives each state
        group there (the block of the hit's last token). It shares the request's fate with
        the chunks' load (per request): one failing fails the request, which vLLM computes
        anew. A hit that does not end on a chunk boundary (vLLM took fewer tokens than
        offered) has no state: the null block makes the load fail."""
        geometry = self._geometry
        size = geometry.chunk_tokens
        tenant, wanted = state.state_keys(end // size - 1)
        return LoadJob(
            req_id=state.request.request_id,
            tenant=tenant,
            keys=tuple((key,) for key in wanted),
            block_ids=tuple(
                (ids[end // rule.block_size - 1] if end % size == 0 else NULL_BLOCK,)
                for rule, ids in geometry.of_groups(geometry.state_groups, block_ids)
            ),
            first_tokens=0,
            per_request=True,
            state=True,
        )
