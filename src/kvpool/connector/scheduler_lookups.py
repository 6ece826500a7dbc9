"""The scheduler's lookup-and-prefetch planner: how many of a request's tokens to load.

It probes (without locking) the chunks beyond vLLM's own prefix-cache hit, on every rank:
in the agent's table of ready chunks where this process maps it (no round trip), else by
asking the agent, which also starts loading the chunks after the run from L2 (once per
request). A probe's answer stands for :data:`PROBE_REUSE_S`; the questions of one step
stop at its budget (prefetch questions get half of it). The hit is then planned as loads
(:mod:`~kvpool.connector.scheduler_loads`).

A decode of a disaggregated request (its params name the prompt another pod prefilled)
waits, bounded, for the whole prompt: while chunks or the tail record are missing it
answers "not yet", re-probing every :data:`DECODE_PROBE_REUSE_S`, until its deadline (the
engine's ``decode_wait_s``, or less if the params ask); then it loads what is there and
vLLM computes the rest. With the tail its hit is the prompt but its last token.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from pathlib import Path

from kvpool.client import AgentError, AgentInfo
from kvpool.common import protocol as p
from kvpool.common.probe_table import ProbeTableReader, table_path
from kvpool.connector.counters import Counters
from kvpool.connector.link import AgentLink, LinkDown
from kvpool.connector.scheduler_access import TenantAccess
from kvpool.connector.scheduler_requests import ChunkGeometry, Probe, Span, TrackedRequest

log = logging.getLogger(__name__)

PREFETCH_PROBE_MS = 2
"""How long the scheduler waits, once, for a fresh prefetch: enough for the agent to
find that a local tier holds nothing (the usual miss), so a miss costs no step."""

STATE_LOOKUPS = 4
"""States the scheduler asks the agent about per probe (from the longest run down) where it
has no table of ready chunks: vLLM keeps a state only where a step ended, a few per prompt."""

PROBE_REUSE_S = 1.0
"""How long a probe's answer stands for a request that vLLM asks again (it could not be
scheduled yet). The answer is a hint: the worker locks what it loads and reports a chunk
that is gone by then for recompute, so a stale answer costs at most a few chunks computed
instead of loaded; asking again would cost a round trip per waiting request per step."""


DECODE_PROBE_REUSE_S = 0.02
"""How long a probe's answer stands for a decode waiting for its prompt's chunks: vLLM asks
at every step (about every millisecond while nothing else runs), and the chunks land as
the prefill's agent sends them."""


class ProbeTables:
    """The agent's table of ready chunks, mapped once per agent beside its segment."""

    def __init__(self, segment_path: Callable[[AgentInfo], Path | None] | None) -> None:
        """``segment_path``: where this process sees the agent's segment; without it, or
        where it says None (the transport ``messages``), there is no table."""
        self._segment_path = segment_path
        self._table: ProbeTableReader | None = None
        self._no_table_for: str | None = None

    def of(self, info: AgentInfo) -> ProbeTableReader | None:
        """The table of the agent ``info`` names (None without one)."""
        table = self._table
        if table is not None and not table.is_kept():  # the agent died: ask (and reconnect)
            table.close()
            self._table = self._no_table_for = None
            return None
        if table is not None and table.agent_id == info.agent_id:
            return table
        if table is not None:
            table.close()
            self._table = None
        segment = None if self._segment_path is None else self._segment_path(info)
        if segment is None or self._no_table_for == info.agent_id:
            return None  # nothing to read the table beside (the transport "messages")
        try:
            self._table = ProbeTableReader(table_path(segment), info.agent_id)
        except (OSError, ValueError) as error:
            self._no_table_for = info.agent_id
            log.info("kvpool: no table of ready chunks (%s); every probe asks the agent", error)
        return self._table

    def close(self) -> None:
        if self._table is not None:
            self._table.close()


class LookupPlanner:
    def __init__(
        self,
        *,
        geometry: ChunkGeometry,
        link: AgentLink,
        access: TenantAccess,
        tables: ProbeTables,
        counters: Counters,
        clock: Callable[[], float],
        prefetch_wait_s: float,
        step_budget_s: float,
        loads_per_request: bool,
        decode_wait_s: float,
    ) -> None:
        self._geometry = geometry
        self._link = link
        self._access = access
        self._tables = tables
        self.counters = counters
        self._clock = clock
        self._prefetch_wait_s = prefetch_wait_s
        self._step_budget_s = step_budget_s
        self._loads_per_request = loads_per_request
        self._decode_wait_s = decode_wait_s
        self._step_asked_s = 0.0
        """Time spent asking the agent in this step."""

    def new_step(self) -> None:
        self._step_asked_s = 0.0

    def matched(self, state: TrackedRequest, num_computed_tokens: int) -> tuple[int | None, bool]:
        """vLLM's ``get_num_new_matched_tokens`` for the request ``state``."""
        state.planned = None
        if state.load_failed or not state.cacheable:
            return 0, False
        if state.decode is not None and self._geometry.tails:
            return self._decode_matched(state, num_computed_tokens)
        size = self._geometry.chunk_tokens
        limit = (state.request.num_tokens - 1) // size  # vLLM must compute at least one token
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

    def _decode_matched(
        self, state: TrackedRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """:meth:`matched` for a decode of a prompt another pod prefilled: the prompt but its
        last token once its full chunks and tail are here; "not yet" while they are not and
        its wait lasts; then the leading run of chunks there is."""
        assert state.decode is not None
        now = self._clock()
        if state.wait_until is None:
            asked = state.decode.wait_ms
            wait_s = (
                self._decode_wait_s if asked is None else min(self._decode_wait_s, asked / 1000)
            )
            state.decode_since, state.wait_until = now, now + wait_s
        waiting = now < state.wait_until
        size, prompt = self._geometry.chunk_tokens, state.request.num_prompt_tokens
        full, first = state.full_chunks, num_computed_tokens // size
        if state.prefetches and not self._prefetched(state) and waiting:
            return None, False
        hits = self._probe(state, first, full, reuse_s=DECODE_PROBE_REUSE_S) if first < full else 0
        if hits is None:
            return None, False
        whole = first + hits == full and self._tail_here(state)
        if not whole and waiting:
            return None, False
        if not state.decided:  # vLLM may ask again (no free blocks): count the request once
            state.decided = True
            self.counters.add("pd_full_hits" if whole else "pd_partial_hits")
            self.counters.add("pd_wait_ms", round(1000 * max(0.0, now - state.decode_since)))
        end = prompt - 1 if whole else min((first + hits) * size, prompt - 1)
        external = end - num_computed_tokens
        if external <= 0:
            return 0, False
        state.planned = (num_computed_tokens, external)
        return external, self._loads_per_request

    def _tail_here(self, state: TrackedRequest) -> bool:
        """The prompt needs no tail (it ends on a chunk boundary), or every rank finds it."""
        assert state.decode is not None
        tail = state.tail()
        if tail is None:
            return True
        if not state.decode.tail:
            return False  # the prefill stored none: the full chunks are all there is
        tenant, wanted = tail
        asked = self._clock()
        try:
            if not self._link.usable():
                return False
            table = self._tables.of(self._link.info())
            if table is not None and self._access.allowed(tenant):
                return all(table.run(tenant, [key]) for key in wanted)
            if self._step_asked_s >= self._step_budget_s:
                return False  # this step's time for questions is spent: ask next step
            return all(
                self._link.lookup(tenant, [key], lock=False, count=False).count for key in wanted
            )
        except (LinkDown, AgentError) as error:
            log.debug("kvpool: tail lookup failed: %s", error)
            return False
        finally:
            self._step_asked_s += self._clock() - asked

    def _probe(
        self, state: TrackedRequest, first: int, limit: int, reuse_s: float = PROBE_REUSE_S
    ) -> int | None:
        """Chunks ``first, first+1, ...`` (up to ``limit``) that every rank finds, in a row;
        None when that takes a question and this step has no time left for one. An answer
        stands for ``reuse_s``."""
        now = self._clock()
        probe = state.probe
        if probe is not None and probe.span == (first, limit) and now - probe.at < reuse_s:
            return probe.hits
        hits = self._local_run(state, first, limit)
        if hits is None:
            if self._step_asked_s >= self._step_budget_s:
                return None
            hits = self._lookup(state, first, limit)
            self._step_asked_s += self._clock() - now
        if hits and self._geometry.state_groups:
            hits = self._state_run(state, first, hits)
        state.probe = Probe((first, limit), hits, now)
        return hits

    def _state_run(self, state: TrackedRequest, first: int, hits: int) -> int:
        """Of the ``hits`` chunks after ``first``, the longest run whose last chunk has its
        state record on every rank (a model with state-space layers resumes only where it
        has their state); 0 when none has. The table of ready chunks answers without a round
        trip; without one, the agent is asked about :data:`STATE_LOOKUPS` states at most.
        When none is ready, the agent is asked once per request to bring the states of the
        longest runs back from L2 (they are leaves of their chains: evicted first)."""
        try:
            table = self._tables.of(self._link.info()) if self._link.usable() else None
        except LinkDown:
            return 0
        runs = range(hits, 0, -1)
        asked = 0
        try:
            for run in runs:
                tenant, wanted = state.state_keys(first + run - 1)
                if table is not None and self._access.allowed(tenant):
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

    def _prefetch_state(self, state: TrackedRequest, chunk: int) -> None:
        """Ask the agent to load the state at the end of ``chunk`` from L2 (if it has it)."""
        tenant, wanted = state.state_keys(chunk)
        for chain, key in zip(state.chains, wanted, strict=True):
            _, started = self._link.lookup_prefetch(tenant, [key], chain.keys[chunk], count=False)
            if started:
                state.prefetches.append(started)
                state.prefetch_deadline = self._clock() + self._prefetch_wait_s
                self.counters.add("prefetches")

    def _local_run(self, state: TrackedRequest, first: int, limit: int) -> int | None:
        """The run of chunks the agent's table of ready chunks shows (no round trip), or None
        when the agent must be asked: no table (an older agent), or chunks missing that the
        probe's prefetch from L2 may bring."""
        if not self._link.usable():
            return None
        try:
            info = self._link.info()
        except LinkDown:
            return 0  # a miss, as the lookup would answer
        table = self._tables.of(info)
        if table is None:
            return None
        tokens, end = state.request.all_token_ids, min(limit, first + info.max_keys)
        spans = state.spans(first, end)
        if not all(self._access.allowed(span.tenant) for span in spans):
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

    def _lookup(self, state: TrackedRequest, first: int, limit: int) -> int:
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

    def _lookup_allowed(
        self, state: TrackedRequest, span: Span, max_keys: int, *, prefetch: bool, count: bool
    ) -> int:
        """:meth:`_lookup_span` for a tenant the agent has not refused this token lately;
        its answer on a tenant not the token's own (a shared space, or another tenant's
        salt) is remembered for a while (:class:`TenantAccess`)."""
        if self._access.allowed(span.tenant) is False:
            return 0
        until = self._access.until()
        try:
            run = self._lookup_span(state, span, max_keys, prefetch=prefetch, count=count)
        except AgentError as error:
            if error.code != p.ErrorCode.FORBIDDEN:
                raise
            self._access.refused(span.tenant, until, error)
            return 0
        self._access.answered(span.tenant, until)
        return run

    def _lookup_span(
        self, state: TrackedRequest, span: Span, max_keys: int, *, prefetch: bool, count: bool
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

    def _prefetched(self, state: TrackedRequest, wait_ms: int = 0) -> bool:
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
