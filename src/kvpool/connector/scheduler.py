"""``KVPoolConnectorScheduler``: which tokens to load from the agent, which chunks to store,
when.

It runs in vLLM's scheduler process and never touches KV bytes. Per request it
keeps the key chain of each tensor-parallel rank (:mod:`kvpool.common.keys`,
computed from the token ids, the request's ``cache_salt`` and the rank's
fingerprint), the request's block ids and a store cursor.

* ``get_num_new_matched_tokens``: probe (without locking) the chunks beyond
  vLLM's own prefix-cache hit, on every rank; the hit is the shortest run, in
  whole chunks, and never the whole prompt (vLLM must compute one token). An
  unavailable agent is a miss. The probe is one round trip per rank, and it also
  asks the agent to load the chunks after the run from L2 (once per request); an
  agent without L2, or one whose L2 holds nothing more, answers that at once. A
  prefetch is given a couple of milliseconds; if it is still loading, the answer
  is "not yet" (``None``) and vLLM asks again at its next step, until the
  prefetch is done or ``prefetch_wait_s`` has passed.
* Requests vLLM cannot schedule yet are asked again at every step. A probe's answer stands
  for :data:`~kvpool.connector.scheduler_lookups.PROBE_REUSE_S` (it is a hint: the
  worker locks what it loads), and all questions to the agent in one step (new requests'
  probes, prefetch status) stop at ``step_budget_s``: a request that would need one more
  answers "not yet" and is asked in the next step. Prefetch questions get half of it, so the
  probes of new requests (which start their prefetches) always get the other half. vLLM
  walks its waiting queue in admission order and keeps skipped requests at its head, so the
  budget goes to the oldest requests, and a burst or a queue of any length delays a step by
  at most the budget (plus the one question in flight).
* ``update_state_after_alloc``: turn the hit into a :class:`LoadJob` on the
  blocks vLLM allocated (every KV cache group's). The worker locks the chunks when it
  copies them; if they are gone by then it reports the blocks and vLLM recomputes them.
  vLLM takes no failed blocks from an engine of several groups (block ids are not
  unique across groups), and a window group cannot resume at a failed block (the window
  before it was never allocated), so there the load is asynchronous to vLLM
  (:func:`~kvpool.connector.groups.loads_per_request`): the request waits one step
  for its KV, and a failed load is reported for the request, which vLLM then computes
  anew; it gets no more hits, so a chunk that vanished is not offered again.
* ``build_connector_meta``: every chunk that becomes full by the end of this
  step (prompt or generated tokens) and was not loaded from the agent becomes
  part of a :class:`StoreJob`, with the key of the chunk before it as parent.
* State-space and linear-attention groups (a model such as Jamba or Qwen3-Next): vLLM hands
  over each state it keeps (at a block boundary where a step ended) with its block; a state
  that ends a chunk is stored as a record of its own, keyed by that chunk
  (:func:`~kvpool.common.keys.state_key`). A hit is the longest run of chunks whose last
  chunk has its state (brought back from L2 if L1 has lost it), and the state is loaded
  with the chunks, per request.
* ``request_finished``: a request whose stores have not finished yet keeps its
  blocks until the worker reports them finished (only when the workers' stores
  are asynchronous, as on CUDA; on CPU they finish within their step). A prefill of a
  disaggregated request returns what its decode needs (:mod:`kvpool.common.disagg`), and
  once its stores are done asks the agent to offer the prompt's records to the agent of
  its decode's node (``push_to``), which pulls them; the decode's own lookup pulls
  whatever does not arrive.
* vLLM's ``kv_role``: ``kv_both`` loads and stores; ``kv_producer`` also stores every
  prompt's tail (each of its requests is a prefill); ``kv_consumer`` loads and never
  stores.

Until the workers' handshake arrives (the chunk format fixes the fingerprint)
the scheduler answers "no hits" and plans nothing.

It composes, as vLLM's connectors do, collaborators of one job each:

* :class:`~kvpool.connector.scheduler_requests.RequestTracker` -- the requests, their
  tenants (from the salt) and key chains;
* :class:`~kvpool.connector.scheduler_lookups.LookupPlanner` -- probes and
  prefetches: how many tokens to load;
* :class:`~kvpool.connector.scheduler_loads.LoadPlanner` -- the load of a hit;
* :class:`~kvpool.connector.scheduler_stores.StorePlanner` -- store jobs and held
  requests;
* :class:`~kvpool.connector.scheduler_access.TenantAccess` -- for which tenants this
  engine's token may look up and store.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvpool.client import AgentError, AgentInfo
from kvpool.common import keys
from kvpool.common.disagg import DecodeParams
from kvpool.common.web.rate_limited_log import RateLimitedLog
from kvpool.connector.counters import Counters
from kvpool.connector.jobs import LoadJob, StoreJob
from kvpool.connector.layout import GroupRule, LayoutError
from kvpool.connector.link import AgentLink, LinkDown
from kvpool.connector.metadata import (
    KVPoolConnectorHandshakeMetadata,
    KVPoolConnectorMetadata,
    KVPoolConnectorWorkerMetadata,
)
from kvpool.connector.scheduler_access import TenantAccess
from kvpool.connector.scheduler_loads import LoadPlanner
from kvpool.connector.scheduler_lookups import LookupPlanner, ProbeTables
from kvpool.connector.scheduler_requests import (
    ChunkGeometry,
    RequestTracker,
    RequestView,
    TrackedRequest,
)
from kvpool.connector.scheduler_stores import StorePlanner

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput

log = logging.getLogger(__name__)
_unsent = RateLimitedLog(log)

__all__ = ["KVPoolConnectorScheduler", "RequestView"]


@dataclass
class _Planners:
    """What the scheduler plans with, once the workers' handshake fixed the chunk format."""

    requests: RequestTracker
    lookups: LookupPlanner
    loads: LoadPlanner
    stores: StorePlanner


class KVPoolConnectorScheduler:
    def __init__(
        self,
        *,
        model: str,
        dtype: str,
        tp_size: int,
        groups: Sequence[GroupRule],
        link: AgentLink,
        counters: Counters,
        prefetch_wait_s: float = 0.0,
        step_budget_s: float = 0.01,
        segment_path: Callable[[AgentInfo], Path | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        disabled: str | None = None,
        loads_per_request: bool = False,
        kv_role: str = "kv_both",
        decode_wait_s: float = 0.0,
    ) -> None:
        """``groups``: what each of vLLM's KV cache groups keeps of a chunk, in vLLM's order.
        ``segment_path``: where this process sees the agent's segment (its table of ready
        chunks lies beside it); without it, or where it says None (the transport
        ``messages``), every probe asks the agent. ``disabled``: why this
        engine gets no hits and stores nothing (said once, by the caller).
        ``loads_per_request``: a failed load must fail its whole request (several KV cache
        groups, or a window), so loads are asynchronous to vLLM and their failures reported
        per request (vLLM then computes the request anew). ``kv_role``: vLLM's
        (``kv_both``, ``kv_producer``, ``kv_consumer``). ``decode_wait_s``: the most a decode
        of a disaggregated request waits for its prompt's chunks."""
        if kv_role not in ("kv_both", "kv_producer", "kv_consumer"):
            raise ValueError(
                f"kv_role: expected kv_both, kv_producer or kv_consumer, got {kv_role!r}"
            )
        self._kv_role = kv_role
        self._decode_wait_s = decode_wait_s
        self._disabled = disabled
        self._loads_per_request = loads_per_request
        self._prefetch_wait_s = prefetch_wait_s
        self._step_budget_s = step_budget_s
        self._clock = clock
        self._model = model
        self._dtype = dtype
        self._tp_size = tp_size
        self._groups = list(groups)
        self._link = link
        self.counters = counters
        self._tables = ProbeTables(segment_path)
        self._access = TenantAccess(link, clock)
        self._planners: _Planners | None = None
        self.chunk_tokens = 0
        self._loads: list[LoadJob] = []

    # ------------------------------------------------------------ set-up

    @property
    def ready(self) -> bool:
        return self._planners is not None

    def configure(self, handshakes: Mapping[int, KVPoolConnectorHandshakeMetadata]) -> None:
        """Take every rank's chunk format; the fingerprints follow from it."""
        if self._disabled is not None:
            return
        missing = sorted(set(range(self._tp_size)) - set(handshakes))
        if missing:
            log.error("kvpool: no handshake from tensor-parallel ranks %s; cache disabled", missing)
            return
        sizes = {handshakes[rank].chunk_tokens for rank in range(self._tp_size)}
        if len(sizes) != 1:
            log.error("kvpool: workers disagree on chunk_tokens %s; cache disabled", sizes)
            return
        chunk_tokens = sizes.pop()
        try:
            geometry = self._geometry(chunk_tokens)
        except LayoutError as error:
            log.error("kvpool: %s; cache disabled", error)
            return
        self.chunk_tokens = chunk_tokens
        fingerprints = [
            keys.ModelFingerprint(
                self._model,
                self._dtype,
                handshakes[rank].kv_layout,
                rank,
                self._tp_size,
                chunk_tokens,
            )
            for rank in range(self._tp_size)
        ]
        self._planners = _Planners(
            requests=RequestTracker(
                fingerprints, chunk_tokens, self.counters, tails=self._kv_role == "kv_producer"
            ),
            lookups=LookupPlanner(
                geometry=geometry,
                link=self._link,
                access=self._access,
                tables=self._tables,
                counters=self.counters,
                clock=self._clock,
                prefetch_wait_s=self._prefetch_wait_s,
                step_budget_s=self._step_budget_s,
                loads_per_request=self._loads_per_request,
                decode_wait_s=self._decode_wait_s,
            ),
            loads=LoadPlanner(
                geometry=geometry,
                counters=self.counters,
                loads_per_request=self._loads_per_request,
            ),
            stores=StorePlanner(
                geometry=geometry,
                tp_size=self._tp_size,
                allowed=self._access.allowed,
                counters=self.counters,
                stores_complete_in_step=all(
                    handshakes[rank].stores_complete_in_step for rank in range(self._tp_size)
                ),
            ),
        )
        log.info("kvpool: caching %d-token chunks as %s", chunk_tokens, self._kv_role)
        # What a prefix index needs to hash a gateway's token ids as this engine does
        # (its `fingerprint` setting, the pool's spec.index.fingerprint).
        log.info(
            "kvpool: key fingerprint for the index: %s",
            json.dumps(dataclasses.asdict(fingerprints[0]), sort_keys=True),
        )

    def _geometry(self, chunk_tokens: int) -> ChunkGeometry:
        """How chunks of ``chunk_tokens`` lie over the groups (LayoutError: they cannot)."""
        for rule in self._groups:  # every group's blocks end on chunk boundaries
            rule.blocks_per_chunk(chunk_tokens)
        chunk_groups = [index for index, rule in enumerate(self._groups) if not rule.is_state]
        rules = [self._groups[index] for index in chunk_groups]
        blocks_per_chunk = [rule.blocks_per_chunk(chunk_tokens) for rule in rules]
        return ChunkGeometry(
            chunk_tokens=chunk_tokens,
            groups=self._groups,
            chunk_groups=chunk_groups,
            state_groups=[index for index, rule in enumerate(self._groups) if rule.is_state],
            blocks_per_chunk=blocks_per_chunk,
            first_kept=[
                per_chunk - rule.kept_blocks(chunk_tokens)
                for rule, per_chunk in zip(rules, blocks_per_chunk, strict=True)
            ],
        )

    # ------------------------------------------------------------ lookups

    def on_new_request(self, request: RequestView) -> None:
        if self._planners is not None:
            self._planners.requests.track(request, self._link.bound_tenant)

    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        planners = self._planners
        if planners is None:
            return 0, False
        with self.counters.timed("scheduler_us"):
            state = planners.requests.track(request, self._link.bound_tenant)
            return planners.lookups.matched(state, num_computed_tokens)

    def update_state_after_alloc(
        self, request: RequestView, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if num_external_tokens == 0:
            return
        assert self._planners is not None, "vLLM allocated for a hit this connector did not report"
        state = self._planners.requests.get(request.request_id)
        assert state is not None, "vLLM allocated for a request this connector does not know"
        self._loads.extend(
            self._planners.loads.plan(state, blocks.get_block_ids(), num_external_tokens)
        )

    # ------------------------------------------------------------ each step

    def build_connector_meta(self, output: SchedulerOutput) -> KVPoolConnectorMetadata:
        with self.counters.timed("scheduler_us"):
            return self._build(output)

    def _build(self, output: SchedulerOutput) -> KVPoolConnectorMetadata:
        stores: list[StoreJob] = []
        held: list[str] = []
        if self._planners is not None:
            self._planners.lookups.new_step()  # once per schedule(): a new step
            if self._kv_role != "kv_consumer":
                self._plan_stores(self._planners, output, stores)
            held = self._planners.stores.take_newly_held()
        preempted = sorted(output.preempted_req_ids or ())
        for req_id in preempted:
            self.counters.add("preemptions_seen")
            state = None if self._planners is None else self._planners.requests.get(req_id)
            if state is not None:
                state.block_ids = []
                state.probe = None  # it stored chunks since: look again when it resumes
        meta = KVPoolConnectorMetadata(self._loads, stores, held, preempted)
        self._loads = []
        return meta

    def _plan_stores(
        self, planners: _Planners, output: SchedulerOutput, stores: list[StoreJob]
    ) -> None:
        """Follow the requests' blocks through the step and plan the stores of its chunks."""
        requests, planner = planners.requests, planners.stores
        for new in output.scheduled_new_reqs:
            new_state = requests.get(new.req_id)
            if new_state is None:
                continue
            new_state.block_ids = [list(ids) for ids in new.block_ids]
            computed = new.num_computed_tokens + output.num_scheduled_tokens.get(new.req_id, 0)
            planner.plan(new_state, computed, stores)
        cached = output.scheduled_cached_reqs
        for index, req_id in enumerate(cached.req_ids):
            state = requests.get(req_id)
            if state is None:
                continue
            new_block_ids = cached.new_block_ids[index]
            if req_id in cached.resumed_req_ids:
                state.block_ids = [list(ids) for ids in new_block_ids or ()]
            elif new_block_ids:
                for ids, new_ids in zip(state.block_ids, new_block_ids, strict=True):
                    ids.extend(new_ids)
            computed = cached.num_computed_tokens[index] + output.num_scheduled_tokens.get(
                req_id, 0
            )
            planner.plan(state, computed, stores)
        handed_over = getattr(output, "kv_connector_block_state", None)
        if any(rule.is_state for rule in self._groups) and handed_over is not None:
            for req_id, states in handed_over.boundary_state_offloads.items():
                state = requests.get(req_id)
                if state is not None:
                    planner.plan_states(state, states, stores)

    def update_connector_output(
        self,
        worker_meta: KVPoolConnectorWorkerMetadata | None,
        finished_sending: set[str],
        failed_receiving: Collection[str] = (),
    ) -> None:
        """Count finished stores; ``failed_receiving``: requests whose per-request loads
        failed, which vLLM computes anew; they get no more hits (a chunk that vanished
        between the probe and the load would otherwise be offered again and again)."""
        planners = self._planners
        if planners is None:
            return
        for req_id in failed_receiving:
            failed = planners.requests.get(req_id)
            if failed is not None:
                failed.load_failed_now()
        if worker_meta is not None:
            planners.stores.completed(worker_meta.completed_stores, planners.requests.get)
        for req_id in planners.stores.released(finished_sending):
            released = planners.requests.get(req_id)
            if released is not None:
                self._push(released)
            planners.requests.forget(req_id)

    def request_finished(self, request: RequestView) -> tuple[bool, dict[str, object] | None]:
        """Whether to hold the request's blocks until the worker reports its stores finished,
        and the ``kv_transfer_params`` of its answer: a prefill's, what its decode needs."""
        planners = self._planners
        state = None if planners is None else planners.requests.get(request.request_id)
        if planners is None or state is None:
            return False, None
        params = None
        if state.stores_tail and self._kv_role != "kv_consumer":
            prefilled = DecodeParams(tokens=request.num_prompt_tokens, tail=bool(state.tail_stored))
            params = prefilled.to_json()
        if planners.stores.hold(state):
            return True, params
        self._push(state)
        planners.requests.forget(request.request_id)
        return False, params

    def _push(self, state: TrackedRequest) -> None:
        """Offer a finished prefill's prompt to its decode's node, a run per tenant and rank
        (best effort: whatever is not sent, the decode's lookup pulls)."""
        node = state.push_to
        if node is None or self._kv_role == "kv_consumer":
            return
        for tenant, per_rank, parents in state.prompt_records():
            for rank_keys, parent in zip(per_rank, parents, strict=True):
                try:
                    unsent = self._link.push(tenant, rank_keys, node, parent)
                except (LinkDown, AgentError) as error:
                    unsent = str(error)
                self.counters.add("pd_pushes" if unsent is None else "pd_pushes_unsent")
                if unsent is not None:
                    _unsent.warning(f"kvpool: a prefill's chunks not offered to {node}: {unsent}")

    def has_pending_work(self) -> bool:
        """Keep vLLM stepping while blocks are held, so the worker can report them."""
        return self._planners is not None and self._planners.stores.holding

    @property
    def tracked_requests(self) -> int:
        return 0 if self._planners is None else len(self._planners.requests)

    def close(self) -> None:
        self._tables.close()
        self._link.close()
