"""The scheduler half: which tokens to load from the agent, which chunks to store, when.

It runs in vLLM's scheduler process and never touches KV bytes. Per request it
keeps the key chain of each tensor-parallel rank (:mod:`kvpool_agent.keys`,
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
* Requests vLLM cannot schedule yet are asked again at every step. A probe's
  answer stands for :data:`PROBE_REUSE_S` (it is a hint: the worker locks what it
  loads), and all questions to the agent in one step (new requests' probes,
  prefetch status) stop at ``step_budget_s``: a request that would need one more
  answers "not yet" and is asked in the next step. Prefetch questions get half of
  it, so the probes of new requests (which start their prefetches) always get
  the other half. vLLM walks its waiting queue
  in admission order and keeps skipped requests at its head, so the budget goes
  to the oldest requests, and a burst or a queue of any length delays a step by
  at most the budget (plus the one question in flight).
* ``update_state_after_alloc``: turn the hit into a :class:`LoadJob` on the
  blocks vLLM allocated (every KV cache group's). The worker locks the chunks when it
  copies them; if they are gone by then it reports the blocks and vLLM recomputes them.
  vLLM takes no failed blocks from an engine of several groups (block ids are not
  unique across groups), and a window group cannot resume at a failed block (the window
  before it was never allocated), so there the load is asynchronous to vLLM
  (:func:`~kvpool_agent.connector.groups.loads_per_request`): the request waits one step
  for its KV, and a failed load is reported for the request, which vLLM then computes
  anew; it gets no more hits, so a chunk that vanished is not offered again.
* ``build_connector_meta``: every chunk that becomes full by the end of this
  step (prompt or generated tokens) and was not loaded from the agent becomes
  part of a :class:`StoreJob`, with the key of the chunk before it as parent.
* State-space and linear-attention groups (a model such as Jamba or Qwen3-Next): vLLM hands
  over each state it keeps (at a block boundary where a step ended) with its block; a state
  that ends a chunk is stored as a record of its own, keyed by that chunk
  (:func:`~kvpool_agent.keys.state_key`). A hit is the longest run of chunks whose last
  chunk has its state (brought back from L2 if L1 has lost it), and the state is loaded
  with the chunks, per request.
* ``request_finished``: a request whose stores have not finished yet keeps its
  blocks until the worker reports them finished (only when the workers' stores
  are asynchronous, as on CUDA; on CPU they finish within their step).

Until the workers' handshake arrives (the chunk format fixes the fingerprint)
the half answers "no hits" and plans nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from kvpool_agent import keys
from kvpool_agent import protocol as p
from kvpool_agent.client import AgentError, AgentInfo
from kvpool_agent.connector.counters import Counters
from kvpool_agent.connector.jobs import GroupBlocks, LoadJob, RankKeys, StoreJob
from kvpool_agent.connector.layout import NULL_BLOCK, GroupRule, LayoutError
from kvpool_agent.connector.link import AgentLink, LinkDown
from kvpool_agent.connector.metadata import (
    KVPoolConnectorHandshakeMetadata,
    KVPoolConnectorMetadata,
    KVPoolConnectorWorkerMetadata,
)
from kvpool_agent.probe_table import ProbeTableReader, table_path

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput

log = logging.getLogger(__name__)

PREFETCH_PROBE_MS = 2
"""How long the scheduler waits, once, for a fresh prefetch: enough for the agent to
find that a local tier holds nothing (the usual miss), so a miss costs no step."""

ACCESS_REUSE_S = 30.0
"""How long the agent's answer stands on whether this engine's token may act for a tenant
other than its own (a shared space): until then a refused tenant's chunks are neither
looked up nor stored, and an allowed one's are probed in the table of ready chunks (which
answers for any tenant, so it is read only for tenants the agent allowed)."""

STATE_LOOKUPS = 4
"""States the scheduler asks the agent about per probe (from the longest run down) where it
has no table of ready chunks: vLLM keeps a state only where a step ended, a few per prompt."""

PROBE_REUSE_S = 1.0
"""How long a probe's answer stands for a request that vLLM asks again (it could not be
scheduled yet). The answer is a hint: the worker locks what it loads and reports a chunk
that is gone by then for recompute, so a stale answer costs at most a few chunks computed
instead of loaded; asking again would cost a round trip per waiting request per step."""


@dataclass(frozen=True)
class _Probe:
    span: tuple[int, int]
    """(first chunk, chunk limit) looked up."""
    hits: int
    at: float


class RequestView(Protocol):
    """What the scheduler half reads of a vLLM ``Request``."""

    @property
    def request_id(self) -> str: ...
    @property
    def cache_salt(self) -> str | None: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def all_token_ids(self) -> Sequence[int]: ...


@dataclass(frozen=True)
class _Span:
    """Chunks ``[start, stop)`` of a request, keyed under ``tenant``."""

    tenant: str
    start: int
    stop: int


@dataclass
class _Request:
    request: RequestView
    tenant: str
    """The tenant of the request's own chunks."""
    chains: list[keys.KeyChain]
    space: str = ""
    """The shared space of chunks ``[0, shared)`` (a structured ``cache_salt``)."""
    shared: int = 0
    cacheable: bool = True
    """False: a structured salt that names no tenant; the request gets no cache."""
    block_ids: list[list[int]] = field(default_factory=list)
    """Per KV cache group, the request's blocks in token order."""
    stored_chunks: int = 0
    """Chunks ``[0, stored_chunks)`` are stored, being stored or were loaded."""
    planned: tuple[int, int] | None = None
    """(vLLM's computed tokens, our hit tokens) of the last lookup."""
    probe: _Probe | None = None
    """The last probe's answer, reused while it is fresh."""
    open_stores: set[int] = field(default_factory=set)
    prefetches: list[int] = field(default_factory=list)
    """Prefetch ids (from L2) the request waits for; one per rank that started one."""
    prefetch_deadline: float = 0.0
    prefetch_tried: bool = False
    counted: bool = False
    """The agent counted this request's hits and misses (at its first lookup)."""
    load_failed: bool = False
    """A per-request load failed: vLLM computes the request anew, without the cache."""
    loaded_from: int = 0
    """The first chunk of the request's load (stored again if that load fails)."""
    states_prefetched: bool = False
    """The agent was asked to bring the request's states back from L2 (once)."""
    loaded_until: int = 0
    """The chunk after the request's load: vLLM hands over the loaded state as if computed,
    and the states before it are the agent's already."""

    def spans(self, first: int, stop: int) -> list[_Span]:
        """Chunks ``[first, stop)`` split at the shared boundary, each with its tenant."""
        spans = []
        if first < self.shared:
            spans.append(_Span(self.space, first, min(stop, self.shared)))
        if stop > max(first, self.shared):
            spans.append(_Span(self.tenant, max(first, self.shared), stop))
        return spans


@dataclass
class _OpenStore:
    req_id: str
    workers_left: int


class SchedulerHalf:
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
    ) -> None:
        """``groups``: what each of vLLM's KV cache groups keeps of a chunk, in vLLM's order.
        ``segment_path``: where this process sees the agent's segment (its table of ready
        chunks lies beside it); without it, or where it says None (the transport
        ``messages``), every probe asks the agent. ``disabled``: why this
        engine gets no hits and stores nothing (said once, by the caller).
        ``loads_per_request``: a failed load must fail its whole request (several KV cache
        groups, or a window), so loads are asynchronous to vLLM and their failures reported
        per request (vLLM then computes the request anew)."""
        self._disabled = disabled
        self._loads_per_request = loads_per_request
        self._prefetch_wait_s = prefetch_wait_s
        self._step_budget_s = step_budget_s
        self._segment_path = segment_path
        self._probe_table: ProbeTableReader | None = None
        self._no_table_for: str | None = None
        self._clock = clock
        self._model = model
        self._dtype = dtype
        self._tp_size = tp_size
        self._groups = list(groups)
        self._chunk_groups = [index for index, rule in enumerate(groups) if not rule.is_state]
        """The groups a chunk holds (vLLM's indices): all but the state groups."""
        self._state_groups = [index for index, rule in enumerate(groups) if rule.is_state]
        """State-space and linear-attention groups: a hit also needs their state at its end,
        a record of its own (:func:`~kvpool_agent.keys.state_key`)."""
        self._blocks_per_chunk: list[int] = []
        self._first_kept: list[int] = []
        """Per chunk group: blocks per chunk, and the first block of a chunk that it keeps."""
        self._link = link
        self.counters = counters
        self._roots: list[tuple[keys.ModelFingerprint, dict[str, bytes]]] = []
        self.chunk_tokens = 0
        self._stores_complete_in_step = True
        self._requests: dict[str, _Request] = {}
        self._loads: list[LoadJob] = []
        self._newly_held: list[str] = []
        self._held: set[str] = set()
        self._stores: dict[int, _OpenStore] = {}
        self._job_ids = itertools.count(1)
        self._step_asked_s = 0.0
        """Time spent asking the agent in this step."""
        self._salt_problems_said: set[str | None] = set()
        self._access: dict[str, tuple[bool, float]] = {}
        """Tenant -> (whether the agent let this engine act for it, until when that stands)."""

    # ------------------------------------------------------------ set-up

    @property
    def ready(self) -> bool:
        return bool(self._roots)

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
            for rule in self._groups:  # every group's blocks end on chunk boundaries
                rule.blocks_per_chunk(chunk_tokens)
            rules = [self._groups[index] for index in self._chunk_groups]
            self._blocks_per_chunk = [rule.blocks_per_chunk(chunk_tokens) for rule in rules]
            self._first_kept = [
                per_chunk - rule.kept_blocks(chunk_tokens)
                for rule, per_chunk in zip(rules, self._blocks_per_chunk, strict=True)
            ]
        except LayoutError as error:
            log.error("kvpool: %s; cache disabled", error)
            return
        self.chunk_tokens = chunk_tokens
        self._stores_complete_in_step = all(
            handshakes[rank].stores_complete_in_step for rank in range(self._tp_size)
        )
        self._roots = [
            (
                keys.ModelFingerprint(
                    self._model,
                    self._dtype,
                    handshakes[rank].kv_layout,
                    rank,
                    self._tp_size,
                    self.chunk_tokens,
                ),
                {},
            )
            for rank in range(self._tp_size)
        ]
        log.info("kvpool: caching %d-token chunks", self.chunk_tokens)
        # What a prefix index needs to hash a gateway's token ids as this engine does
        # (its `fingerprint` setting, the pool's spec.index.fingerprint).
        log.info(
            "kvpool: key fingerprint for the index: %s",
            json.dumps(dataclasses.asdict(self._roots[0][0]), sort_keys=True),
        )

    def _root(self, rank: int, salt: str | None) -> bytes:
        fingerprint, roots = self._roots[rank]
        cached = roots.get(salt or "")
        if cached is None:
            if len(roots) > 4096:  # salts are per tenant; keep the memo bounded anyway
                roots.clear()
            cached = roots[salt or ""] = keys.root_key(salt, fingerprint)
        return cached

    def _state(self, request: RequestView) -> _Request:
        state = self._requests.get(request.request_id)
        if state is None:
            plan = keys.plan_salt(request.cache_salt)
            if plan.problem is not None:
                self._salt_problem(request.request_id, plan)
            chains = [
                plan.chain(self.chunk_tokens, functools.partial(self._root, rank))
                for rank in range(len(self._roots))
            ]
            # no salt: the default tenant, or the tenant the engine's token acts for
            salt = plan.tenant_salt
            tenant = (
                keys.tenant_id(salt) if salt else self._link.bound_tenant or keys.tenant_id(salt)
            )
            state = _Request(
                request,
                tenant,
                chains,
                space=keys.tenant_id(plan.space_salt) if plan.space_salt is not None else "",
                shared=plan.shared_chunks(self.chunk_tokens),
                cacheable=plan.cacheable,
            )
            self._requests[request.request_id] = state
        return state

    def _salt_problem(self, req_id: str, plan: keys.SaltPlan) -> None:
        """Say once per kind of problem why a salt was not taken as written (the salt itself is
        never logged: it is a tenant's secret)."""
        self.counters.add("salt_problems")
        if plan.problem in self._salt_problems_said:
            return
        if len(self._salt_problems_said) < 64:
            self._salt_problems_said.add(plan.problem)
        outcome = (
            "the request is its tenant's alone (nothing shared)"
            if plan.cacheable
            else "the request gets no cache"
        )
        log.warning(
            "kvpool: request %s: a cache_salt not taken as written: %s; %s",
            req_id,
            plan.problem,
            outcome,
        )

    # ------------------------------------------------------------ lookups

    def on_new_request(self, request: RequestView) -> None:
        if self.ready:
            self._state(request)

    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if not self.ready:
            return 0, False
        with self.counters.timed("scheduler_us"):
            return self._matched(request, num_computed_tokens)

    def _matched(self, request: RequestView, num_computed_tokens: int) -> tuple[int | None, bool]:
        state = self._state(request)
        state.planned = None
        if state.load_failed or not state.cacheable:
            return 0, False
        size = self.chunk_tokens
        limit = (request.num_tokens - 1) // size  # vLLM must compute at least one token
        first = num_computed_tokens // size
        if first >= limit:
            return 0, False
        if state.prefetches and not self._prefetched(state):
            return None, False  # the agent is still loading the rest from L2: ask again
        hits = self._probe(state, first, limit)
        # A probe starts a prefetch once per request (of the chunks, then of their states):
        # probe again only if it loaded something.
        while hits is not None and state.prefetches:
            if not self._prefetched(state, wait_ms=PREFETCH_PROBE_MS):
                return None, False
            hits = self._probe(state, first, limit)
        if hits is None:
            return None, False  # this step's time for questions is spent: ask next step
        external = (first + hits) * size - num_computed_tokens
        if external <= 0:
            return 0, False
        state.planned = (num_computed_tokens, external)
        return external, self._loads_per_request

    def _probe(self, state: _Request, first: int, limit: int) -> int | None:
        """Chunks ``first, first+1, ...`` (up to ``limit``) that every rank finds, in a row;
        None when that takes a question and this step has no time left for one."""
        now = self._clock()
        probe = state.probe
        if probe is not None and probe.span == (first, limit) and now - probe.at < PROBE_REUSE_S:
            return probe.hits
        hits = self._local_run(state, first, limit)
        if hits is None:
            if self._step_asked_s >= self._step_budget_s:
                return None
            hits = self._lookup(state, first, limit)
            self._step_asked_s += self._clock() - now
        if hits and self._state_groups:
            hits = self._state_run(state, first, hits)
        state.probe = _Probe((first, limit), hits, now)
        return hits

    def _state_run(self, state: _Request, first: int, hits: int) -> int:
        """Of the ``hits`` chunks after ``first``, the longest run whose last chunk has its
        state record on every rank (a model with state-space layers resumes only where it
        has their state); 0 when none has. The table of ready chunks answers without a round
        trip; without one, the agent is asked about :data:`STATE_LOOKUPS` states at most.
        When none is ready, the agent is asked once per request to bring the states of the
        longest runs back from L2 (they are leaves of their chains: evicted first)."""
        try:
            table = self._table(self._link.info()) if self._link.usable() else None
        except LinkDown:
            return 0
        runs = range(hits, 0, -1)
        asked = 0
        try:
            for run in runs:
                tenant, wanted = self._state_keys(state, first + run - 1)
                if table is not None and self._allowed(tenant):
                    if all(table.run(tenant, [key]) for key in wanted):
                        return run
                    continue
                if asked == STATE_LOOKUPS:
                    break
                asked += 1
                found = (
                    self._link.lookup(tenant, [key], lock=False, count=False) for key in wanted
                )
                if all(hit.count for hit in found):
                    return run
            if self._prefetch_wait_s > 0 and not state.states_prefetched:
                state.states_prefetched = True
                for run in runs[:STATE_LOOKUPS]:
                    self._prefetch_state(state, first + run - 1)
        except (LinkDown, AgentError) as error:
            log.debug("kvpool: state lookup failed: %s", error)
        return 0

    def _state_keys(self, state: _Request, chunk: int) -> tuple[str, list[bytes]]:
        """The tenant and every rank's key of the state at the end of ``chunk``."""
        tenant = state.spans(chunk, chunk + 1)[0].tenant
        return tenant, [keys.state_key(chain.keys[chunk]) for chain in state.chains]

    def _prefetch_state(self, state: _Request, chunk: int) -> None:
        """Ask the agent to load the state at the end of ``chunk`` from L2 (if it has it)."""
        tenant, wanted = self._state_keys(state, chunk)
        for chain, key in zip(state.chains, wanted, strict=True):
            _, started = self._link.lookup_prefetch(tenant, [key], chain.keys[chunk], count=False)
            if started:
                state.prefetches.append(started)
                state.prefetch_deadline = self._clock() + self._prefetch_wait_s
                self.counters.add("prefetches")

    def _local_run(self, state: _Request, first: int, limit: int) -> int | None:
        """The run of chunks the agent's table of ready chunks shows (no round trip), or None
        when the agent must be asked: no table (an older agent), or chunks missing that the
        probe's prefetch from L2 may bring."""
        if not self._link.usable():
            return None
        try:
            info = self._link.info()
        except LinkDown:
            return 0  # a miss, as the lookup would answer
        table = self._table(info)
        if table is None:
            return None
        tokens, end = state.request.all_token_ids, min(limit, first + info.max_keys)
        spans = state.spans(first, end)
        if not all(self._allowed(span.tenant) for span in spans):
            return None  # the agent says whether this token may act for the tenant
        with self.counters.timed("hash_us"):
            for chain in state.chains:
                chain.upto(tokens, end)
        hits = 0
        for span in spans:
            run = min(
                table.run(span.tenant, chain.keys[span.start : span.stop]) for chain in state.chains
            )
            hits += run
            if run < span.stop - span.start:
                break
        if hits < end - first and self._prefetch_wait_s > 0 and not state.prefetch_tried:
            return None
        self.counters.add("local_probes")
        if not state.counted:  # the agent counts a request's hits and misses once, as before
            state.counted = True
            for span in spans:
                for chain in state.chains:
                    self.counters.add("lookups")
                    with contextlib.suppress(LinkDown, AgentError):
                        self._link.count_lookup(span.tenant, chain.keys[span.start : span.stop])
        return hits

    def _table(self, info: AgentInfo) -> ProbeTableReader | None:
        """The table of the agent ``info`` names, mapped once per agent (None without one)."""
        table = self._probe_table
        if table is not None and not table.is_kept():  # the agent died: ask (and reconnect)
            table.close()
            self._probe_table = self._no_table_for = None
            return None
        if table is not None and table.agent_id == info.agent_id:
            return table
        if table is not None:
            table.close()
            self._probe_table = None
        segment = None if self._segment_path is None else self._segment_path(info)
        if segment is None or self._no_table_for == info.agent_id:
            return None  # nothing to read the table beside (the transport "messages")
        try:
            self._probe_table = ProbeTableReader(table_path(segment), info.agent_id)
        except (OSError, ValueError) as error:
            self._no_table_for = info.agent_id
            log.info("kvpool: no table of ready chunks (%s); every probe asks the agent", error)
        return self._probe_table

    def _lookup(self, state: _Request, first: int, limit: int) -> int:
        if not self._link.usable():
            self.counters.add("agent_skipped_calls")
            return 0
        prefetch = self._prefetch_wait_s > 0 and not state.prefetch_tried
        state.prefetch_tried = True
        hits, short = 0, False
        try:
            max_keys = self._link.info().max_keys
            count, state.counted = not state.counted, True
            for span in state.spans(first, limit):
                run = self._lookup_allowed(state, span, max_keys, prefetch=prefetch, count=count)
                if not short:
                    hits += run
                short = short or run < span.stop - span.start
                if short and not prefetch:
                    break  # with a prefetch, every span starts loading its own chunks
        except LinkDown:
            hits = 0
        except AgentError as error:
            log.warning("kvpool: lookup refused (%s); treating it as a miss", error)
            hits = 0
        if state.prefetches:
            self.counters.add("prefetches", len(state.prefetches))
            state.prefetch_deadline = self._clock() + self._prefetch_wait_s
        return hits

    def _token_acts_for(self, tenant: str) -> bool:
        """An engine's token acts for any tenant, a tenant's for its own (no need to ask)."""
        bound = self._link.bound_tenant
        return not bound or tenant == bound

    def _allowed(self, tenant: str) -> bool | None:
        """Whether this engine's token may act for ``tenant`` (None: not known now)."""
        if self._token_acts_for(tenant):
            return True
        allowed, until = self._access.get(tenant, (None, 0.0))
        return allowed if self._clock() < until else None

    def _lookup_allowed(
        self, state: _Request, span: _Span, max_keys: int, *, prefetch: bool, count: bool
    ) -> int:
        """:meth:`_lookup_span` for a tenant the agent has not refused this token lately;
        its answer on a tenant not the token's own (a shared space, or another tenant's
        salt) is remembered for :data:`ACCESS_REUSE_S`."""
        if self._allowed(span.tenant) is False:
            return 0
        until = self._clock() + ACCESS_REUSE_S
        try:
            run = self._lookup_span(state, span, max_keys, prefetch=prefetch, count=count)
        except AgentError as error:
            if error.code != p.ErrorCode.FORBIDDEN:
                raise
            if len(self._access) > 4096:
                self._access.clear()
            self._access[span.tenant] = (False, until)
            log.warning(
                "kvpool: the agent refused this engine's token tenant %s (%s); "
                "its chunks are neither loaded nor stored for %d s",
                span.tenant,
                error,
                ACCESS_REUSE_S,
            )
            return 0
        if not self._token_acts_for(span.tenant):
            self._access[span.tenant] = (True, until)
        return run

    def _lookup_span(
        self, state: _Request, span: _Span, max_keys: int, *, prefetch: bool, count: bool
    ) -> int:
        """The chunks of ``span``, from its start, that every rank finds in a row."""
        tokens = state.request.all_token_ids
        hits = span.stop - span.start
        for chain in state.chains:
            with self.counters.timed("hash_us"):
                wanted = chain.upto(tokens, span.start + hits)[
                    span.start : span.start + min(hits, max_keys)
                ]
            self.counters.add("lookups")
            if prefetch:  # every rank: each loads its own chunks
                found, started = self._link.lookup_prefetch(
                    span.tenant, wanted, chain.parent(span.start), count=count
                )
                if started:
                    state.prefetches.append(started)
            else:
                found = self._link.lookup(span.tenant, wanted, lock=False, count=count)
            hits = min(hits, found.count)
            if hits == 0 and not prefetch:
                break
        return hits

    def _prefetched(self, state: _Request, wait_ms: int = 0) -> bool:
        """True once the request's prefetches are done, failed or out of time. A prefetch that
        loaded chunks makes the next probe ask the agent again."""
        try:
            for prefetch in list(state.prefetches):
                asked = self._clock()
                if self._step_asked_s >= self._step_budget_s / 2 and (
                    asked < state.prefetch_deadline
                ):
                    return False  # this step's time for these questions is spent
                progress = self._link.prefetch_status(prefetch, wait_ms=wait_ms)
                self._step_asked_s += self._clock() - asked
                if progress.loaded:
                    state.probe = None
                if not progress.done:
                    if self._clock() < state.prefetch_deadline:
                        return False
                    self.counters.add("prefetch_timeouts")
                    break
                state.prefetches.remove(prefetch)
        except (LinkDown, AgentError) as error:
            log.debug("kvpool: prefetch status unknown: %s", error)
        state.prefetches.clear()
        return True

    def update_state_after_alloc(
        self, request: RequestView, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if num_external_tokens == 0:
            return
        state = self._requests[request.request_id]
        assert state.planned is not None, "vLLM allocated for a hit this connector did not report"
        start = state.planned[0]
        end = start + min(num_external_tokens, state.planned[1])
        size = self.chunk_tokens
        first_chunk, end_chunk = start // size, -(-end // size)
        block_ids = blocks.get_block_ids()
        for span in state.spans(first_chunk, end_chunk):  # a job per tenant
            begin, stop = max(start, span.start * size), min(end, span.stop * size)
            self._loads.append(
                LoadJob(
                    req_id=request.request_id,
                    tenant=span.tenant,
                    keys=tuple(tuple(chain.keys[span.start : span.stop]) for chain in state.chains),
                    block_ids=tuple(
                        tuple(ids[begin // rule.block_size : stop // rule.block_size])
                        for rule, ids in self._of_groups(self._chunk_groups, block_ids)
                    ),
                    first_tokens=begin % size,
                    per_request=self._loads_per_request,
                )
            )
        if self._state_groups:
            self._loads.append(self._state_load(state, end, block_ids))
        state.loaded_from, state.loaded_until = first_chunk, end_chunk
        state.stored_chunks = max(state.stored_chunks, end_chunk)
        state.planned = None
        self.counters.add("hit_tokens", end - start)

    def _state_load(self, state: _Request, end: int, block_ids: Sequence[Sequence[int]]) -> LoadJob:
        """The load of the state at the hit's end, into the one block vLLM gives each state
        group there (the block of the hit's last token). It shares the request's fate with
        the chunks' load (per request): one failing fails the request, which vLLM computes
        anew. A hit that does not end on a chunk boundary (vLLM took fewer tokens than
        offered) has no state: the null block makes the load fail."""
        tenant, wanted = self._state_keys(state, end // self.chunk_tokens - 1)
        return LoadJob(
            req_id=state.request.request_id,
            tenant=tenant,
            keys=tuple((key,) for key in wanted),
            block_ids=tuple(
                (ids[end // rule.block_size - 1] if end % self.chunk_tokens == 0 else NULL_BLOCK,)
                for rule, ids in self._of_groups(self._state_groups, block_ids)
            ),
            first_tokens=0,
            per_request=True,
            state=True,
        )

    def _of_groups(
        self, groups: Sequence[int], block_ids: Sequence[Sequence[int]]
    ) -> list[tuple[GroupRule, Sequence[int]]]:
        """``(rule, block ids)`` of each group in ``groups`` (vLLM's indices)."""
        return [(self._groups[index], block_ids[index]) for index in groups]

    # ------------------------------------------------------------ each step

    def build_connector_meta(self, output: SchedulerOutput) -> KVPoolConnectorMetadata:
        with self.counters.timed("scheduler_us"):
            return self._build(output)

    def _build(self, output: SchedulerOutput) -> KVPoolConnectorMetadata:
        self._step_asked_s = 0.0  # once per schedule(): a new step
        stores: list[StoreJob] = []
        for new in output.scheduled_new_reqs:
            new_state = self._requests.get(new.req_id)
            if new_state is None:
                continue
            new_state.block_ids = [list(ids) for ids in new.block_ids]
            computed = new.num_computed_tokens + output.num_scheduled_tokens.get(new.req_id, 0)
            self._plan_store(new_state, computed, stores)
        cached = output.scheduled_cached_reqs
        for index, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
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
            self._plan_store(state, computed, stores)
        handed_over = getattr(output, "kv_connector_block_state", None)
        if self._state_groups and handed_over is not None:
            for req_id, states in handed_over.boundary_state_offloads.items():
                state = self._requests.get(req_id)
                if state is not None:
                    self._plan_state_stores(state, states, stores)
        preempted = sorted(output.preempted_req_ids or ())
        for req_id in preempted:
            self.counters.add("preemptions_seen")
            state = self._requests.get(req_id)
            if state is not None:
                state.block_ids = []
                state.probe = None  # it stored chunks since: look again when it resumes
        meta = KVPoolConnectorMetadata(self._loads, stores, self._newly_held, preempted)
        self._loads, self._newly_held = [], []
        return meta

    def _plan_store(self, state: _Request, computed_tokens: int, stores: list[StoreJob]) -> None:
        size = self.chunk_tokens
        full = min(computed_tokens, state.request.num_tokens, len(state.request.all_token_ids))
        if not state.block_ids or not state.cacheable:
            return
        chunk_ids = [state.block_ids[index] for index in self._chunk_groups]
        full = min(
            full // size,
            *(
                len(ids) // per_chunk
                for ids, per_chunk in zip(chunk_ids, self._blocks_per_chunk, strict=True)
            ),
        )
        first = state.stored_chunks
        while first < full and not self._storable(state, first):
            first += 1  # a window's blocks vLLM did not keep (before its own prefix hit)
        state.stored_chunks = max(state.stored_chunks, first)
        if full <= first:
            return
        tokens = state.request.all_token_ids
        with self.counters.timed("hash_us"):
            hashed = [len(chain.upto(tokens, full)) for chain in state.chains]
        if any(count != full for count in hashed):
            return  # token ids not known yet (cannot happen with vLLM's accounting)
        for span in state.spans(first, full):  # a job per tenant
            if self._allowed(span.tenant) is False:
                continue  # a shared space the agent refuses this token: it would refuse these
            self._open_store(
                state,
                stores,
                tenant=span.tenant,
                keys=tuple(tuple(chain.keys[span.start : span.stop]) for chain in state.chains),
                parents=tuple(chain.parent(span.start) for chain in state.chains),
                block_ids=tuple(
                    tuple(ids[span.start * per_chunk : span.stop * per_chunk])
                    for ids, per_chunk in zip(chunk_ids, self._blocks_per_chunk, strict=True)
                ),
            )
        state.stored_chunks = full

    def _open_store(
        self,
        state: _Request,
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

    def _plan_state_stores(
        self, state: _Request, handed_over: Sequence[tuple[int, int, int]], stores: list[StoreJob]
    ) -> None:
        """Store the states vLLM hands over (``(group, block, tokens)``: the block holds the
        group's state after ``tokens`` tokens, written by this step's forward) that end a
        chunk, every state group's, each under its chunk's key (after the chunks' stores, so
        the agent has the parent)."""
        size = self.chunk_tokens
        by_boundary: dict[int, dict[int, int]] = {}
        for group, block, tokens in handed_over:
            if tokens > 0 and tokens % size == 0:
                by_boundary.setdefault(tokens, {})[group] = block
        for tokens, blocks in sorted(by_boundary.items()):
            chunk = tokens // size - 1
            if (
                not state.cacheable
                or chunk < state.loaded_until
                or any(group not in blocks for group in self._state_groups)
            ):
                continue
            with self.counters.timed("hash_us"):
                hashed = [
                    len(chain.upto(state.request.all_token_ids, chunk + 1))
                    for chain in state.chains
                ]
            if min(hashed) <= chunk:
                continue
            tenant, wanted = self._state_keys(state, chunk)
            if self._allowed(tenant) is False:
                continue
            self._open_store(
                state,
                stores,
                tenant=tenant,
                keys=tuple((key,) for key in wanted),
                parents=tuple(chain.keys[chunk] for chain in state.chains),
                block_ids=tuple((blocks[group],) for group in self._state_groups),
                is_state=True,
            )

    def _storable(self, state: _Request, chunk: int) -> bool:
        """Every group has the blocks it keeps of ``chunk`` (none is vLLM's null block)."""
        for index, per_chunk, first_kept in zip(
            self._chunk_groups, self._blocks_per_chunk, self._first_kept, strict=True
        ):
            ids = state.block_ids[index]
            start = chunk * per_chunk
            if NULL_BLOCK in ids[start + first_kept : start + per_chunk]:
                return False
        return True

    def update_connector_output(
        self,
        worker_meta: KVPoolConnectorWorkerMetadata | None,
        finished_sending: set[str],
        failed_receiving: Collection[str] = (),
    ) -> None:
        """Count finished stores; ``failed_receiving``: requests whose per-request loads
        failed, which vLLM computes anew; they get no more hits (a chunk that vanished
        between the probe and the load would otherwise be offered again and again)."""
        for req_id in failed_receiving:
            failed = self._requests.get(req_id)
            if failed is not None:
                failed.load_failed = True
                failed.stored_chunks = min(failed.stored_chunks, failed.loaded_from)
                failed.loaded_until = failed.loaded_from
        if worker_meta is not None:
            for job_id, workers in worker_meta.completed_stores.items():
                store = self._stores.get(job_id)
                if store is None:
                    continue
                store.workers_left -= workers
                if store.workers_left > 0:
                    continue
                del self._stores[job_id]
                state = self._requests.get(store.req_id)
                if state is not None:
                    state.open_stores.discard(job_id)
        for req_id in finished_sending:
            if req_id in self._held:
                self._held.discard(req_id)
                self._requests.pop(req_id, None)

    def request_finished(self, request: RequestView) -> bool:
        """True: hold the request's blocks until the worker reports its stores finished."""
        state = self._requests.get(request.request_id)
        if state is None:
            return False
        if state.open_stores and not self._stores_complete_in_step:
            self._held.add(request.request_id)
            self._newly_held.append(request.request_id)
            self.counters.add("held_requests")
            return True
        for job_id in state.open_stores:  # finished within their step; forget them
            self._stores.pop(job_id, None)
        del self._requests[request.request_id]
        return False

    def has_pending_work(self) -> bool:
        """Keep vLLM stepping while blocks are held, so the worker can report them."""
        return bool(self._held)

    @property
    def tracked_requests(self) -> int:
        return len(self._requests)

    def close(self) -> None:
        if self._probe_table is not None:
            self._probe_table.close()
        self._link.close()
