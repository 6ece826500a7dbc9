"""The scheduler's request tracker: per request, its tenant, key chains and blocks.

A request is tracked from its first lookup (or ``on_new_request``) until it finishes. Its
``cache_salt`` is read once (:func:`~kvpool.common.keys.plan_salt`): the tenant of its own
chunks, the shared space of its first chunks, whether it is cached at all. Its key chains
(one per tensor-parallel rank, each from that rank's fingerprint) grow as the scheduler
hashes its tokens. Its ``kv_transfer_params`` say whether it is half of a disaggregated
request (:mod:`kvpool.common.disagg`): a prefill, which stores its prompt's last partial
chunk too (a *tail* record), or a decode of a prompt another pod prefilled. The planners
(:mod:`~kvpool.connector.scheduler_lookups`, :mod:`~kvpool.connector.scheduler_stores`)
read and update the records; only the tracker creates and forgets them.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvpool.common import disagg, keys
from kvpool.common.disagg import DecodeParams, PrefillParams
from kvpool.connector.counters import Counters
from kvpool.connector.layout import NULL_BLOCK, GroupRule

log = logging.getLogger(__name__)


class RequestView(Protocol):
    """What the scheduler reads of a vLLM ``Request``."""

    @property
    def request_id(self) -> str: ...
    @property
    def cache_salt(self) -> str | None: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def all_token_ids(self) -> Sequence[int]: ...
    @property
    def kv_transfer_params(self) -> Mapping[str, Any] | None: ...


@dataclass(frozen=True)
class ChunkGeometry:
    """How the workers' chunk format lays chunks over vLLM's KV cache groups (fixed by the
    handshake)."""

    chunk_tokens: int
    groups: list[GroupRule]
    """What each of vLLM's KV cache groups keeps of a chunk, in vLLM's order."""
    chunk_groups: list[int]
    """The groups a chunk holds (vLLM's indices): all but the state groups."""
    state_groups: list[int]
    """State-space and linear-attention groups: a hit also needs their state at its end,
    a record of its own (:func:`~kvpool.common.keys.state_key`)."""
    blocks_per_chunk: list[int]
    first_kept: list[int]
    """Per chunk group: blocks per chunk, and the first block of a chunk that it keeps."""

    @property
    def tails(self) -> bool:
        """A prompt's last partial chunk can be a record of its own: every group keeps all of
        a chunk's blocks (full attention or MLA; a window's tail would need the blocks
        before it, a state-space layer its state mid-chunk)."""
        return not self.state_groups and not any(self.first_kept)

    def of_groups(
        self, groups: Sequence[int], block_ids: Sequence[Sequence[int]]
    ) -> list[tuple[GroupRule, Sequence[int]]]:
        """``(rule, block ids)`` of each group in ``groups`` (vLLM's indices)."""
        return [(self.groups[index], block_ids[index]) for index in groups]

    def storable(self, block_ids: Sequence[Sequence[int]], chunk: int) -> bool:
        """Every group has the blocks it keeps of ``chunk`` (none is vLLM's null block)."""
        for index, per_chunk, first_kept in zip(
            self.chunk_groups, self.blocks_per_chunk, self.first_kept, strict=True
        ):
            ids = block_ids[index]
            start = chunk * per_chunk
            if NULL_BLOCK in ids[start + first_kept : start + per_chunk]:
                return False
        return True


@dataclass(frozen=True)
class Probe:
    span: tuple[int, int]
    """(first chunk, chunk limit) looked up."""
    hits: int
    at: float


@dataclass(frozen=True)
class Span:
    """Chunks ``[start, stop)`` of a request, keyed under ``tenant``."""

    tenant: str
    start: int
    stop: int


@dataclass
class TrackedRequest:
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
    probe: Probe | None = None
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
    stores_tail: bool = False
    """Store the prompt's last partial chunk (a prefill of a disaggregated request)."""
    push_to: str | None = None
    """The node of the prefill's decode, whose agent is offered the prompt's chunks."""
    tail_stored: bool | None = None
    """Its tail's store is planned (True), or the tail was considered and has none (False:
    the prompt ends on a chunk boundary, or the agent refuses the tenant); None: not yet."""
    decode: DecodeParams | None = None
    """A decode of a prompt another pod prefilled (its params match this prompt)."""
    decode_since: float = 0.0
    wait_until: float | None = None
    """When a decode started and stops waiting for the prompt's chunks (its first lookup)."""
    decided: bool = False
    """The decode's hit is decided (counted once)."""

    @property
    def full_chunks(self) -> int:
        return self.request.num_prompt_tokens // self.chains[0].chunk_tokens

    def tail(self) -> tuple[str, list[bytes]] | None:
        """The tenant and every rank's key of the prompt's last partial chunk (the tokens
        after its full chunks; :func:`~kvpool.common.keys.tail_key`); None when the prompt
        ends on a chunk boundary or is shorter than one chunk."""
        full, prompt = self.full_chunks, self.request.num_prompt_tokens
        size = self.chains[0].chunk_tokens
        if full == 0 or prompt == full * size:
            return None
        tokens = self.request.all_token_ids
        rest = tokens[full * size : prompt]
        tails = [keys.tail_key(chain.upto(tokens, full)[full - 1], rest) for chain in self.chains]
        return self.spans(full, full + 1)[0].tenant, tails

    def prompt_records(self) -> list[tuple[str, list[list[bytes]], list[bytes | None]]]:
        """The prompt's records as its stores keyed them, a run per tenant: ``(tenant, keys
        per rank, parent per rank)``; its tail last, where it stored one."""
        full = self.full_chunks
        stop = full + (1 if self.tail_stored else 0)
        tokens = self.request.all_token_ids
        for chain in self.chains:
            chain.upto(tokens, full)
        return [
            (
                span.tenant,
                [list(keys) for keys in self.record_keys(span.start, span.stop)],
                [chain.parent(span.start) for chain in self.chains],
            )
            for span in self.spans(0, stop)
        ]

    def record_keys(self, start: int, stop: int) -> tuple[tuple[bytes, ...], ...]:
        """Per rank, the keys of chunks ``[start, stop)``: the prompt's partial last chunk is
        its tail record (hashed already)."""
        full = self.full_chunks
        if stop <= full:
            return tuple(tuple(chain.keys[start:stop]) for chain in self.chains)
        tail = self.tail()
        assert tail is not None and stop == full + 1, "chunks past the prompt have no records"
        return tuple(
            (*chain.keys[start:full], key) for chain, key in zip(self.chains, tail[1], strict=True)
        )

    def spans(self, first: int, stop: int) -> list[Span]:
        """Chunks ``[first, stop)`` split at the shared boundary, each with its tenant."""
        spans = []
        if first < self.shared:
            spans.append(Span(self.space, first, min(stop, self.shared)))
        if stop > max(first, self.shared):
            spans.append(Span(self.tenant, max(first, self.shared), stop))
        return spans

    def state_keys(self, chunk: int) -> tuple[str, list[bytes]]:
        """The tenant and every rank's key of the state at the end of ``chunk``."""
        tenant = self.spans(chunk, chunk + 1)[0].tenant
        return tenant, [keys.state_key(chain.keys[chunk]) for chain in self.chains]

    def load_failed_now(self) -> None:
        """Its per-request load failed: no more hits, and the loaded chunks are stored
        again."""
        self.load_failed = True
        self.stored_chunks = min(self.stored_chunks, self.loaded_from)
        self.loaded_until = self.loaded_from


class RequestTracker:
    """The requests the scheduler knows, by id, each with its key chain per rank."""

    def __init__(
        self,
        fingerprints: Sequence[keys.ModelFingerprint],
        chunk_tokens: int,
        counters: Counters,
        *,
        tails: bool = False,
    ) -> None:
        """``fingerprints``: per tensor-parallel rank. ``tails``: store every prompt's tail
        (a ``kv_producer``: each request is the prefill of a disaggregated one); otherwise
        only a request whose params say it is a prefill stores its tail."""
        self._roots: list[tuple[keys.ModelFingerprint, dict[str, bytes]]] = [
            (fingerprint, {}) for fingerprint in fingerprints
        ]
        self._chunk_tokens = chunk_tokens
        self._counters = counters
        self._tails = tails
        self._requests: dict[str, TrackedRequest] = {}
        self._salt_problems_said: set[str] = set()
        self._params_problems_said: set[str] = set()

    def __len__(self) -> int:
        return len(self._requests)

    def get(self, req_id: str) -> TrackedRequest | None:
        return self._requests.get(req_id)

    def forget(self, req_id: str) -> None:
        self._requests.pop(req_id, None)

    def track(self, request: RequestView, bound_tenant: str) -> TrackedRequest:
        """The request's record, made at its first sight. ``bound_tenant``: the tenant the
        engine's token acts for, that of a request without a salt ("": the default)."""
        state = self._requests.get(request.request_id)
        if state is None:
            plan = keys.plan_salt(request.cache_salt)
            if plan.problem is not None:
                self._salt_problem(request.request_id, plan)
            chains = [
                plan.chain(self._chunk_tokens, functools.partial(self._root, rank))
                for rank in range(len(self._roots))
            ]
            # no salt: the default tenant, or the tenant the engine's token acts for
            salt = plan.tenant_salt
            tenant = keys.tenant_id(salt) if salt else bound_tenant or keys.tenant_id(salt)
            state = TrackedRequest(
                request,
                tenant,
                chains,
                space=keys.tenant_id(plan.space_salt) if plan.space_salt is not None else "",
                shared=plan.shared_chunks(self._chunk_tokens),
                cacheable=plan.cacheable,
            )
            self._disaggregated(state)
            self._requests[request.request_id] = state
        return state

    def _disaggregated(self, state: TrackedRequest) -> None:
        """Read the request's part in a disaggregated request from its params."""
        request = state.request
        try:
            params = disagg.read_params(request.kv_transfer_params)
        except disagg.ParamsError as error:
            self._counters.add("pd_bad_params")
            self._say_once(self._params_problems_said, str(error), request.request_id)
            return
        state.stores_tail = self._tails or isinstance(params, PrefillParams)
        if isinstance(params, PrefillParams):
            state.push_to = params.push_to
        if isinstance(params, DecodeParams):
            if params.tokens == request.num_prompt_tokens:
                state.decode = params
            else:  # another tokenization (a template), or params of another request
                self._counters.add("pd_mismatched")
                self._say_once(
                    self._params_problems_said,
                    f"kv_transfer_params.kvpool.tokens is {params.tokens}, the prompt has "
                    f"{request.num_prompt_tokens}; looked up as any request",
                    request.request_id,
                )

    def _root(self, rank: int, salt: str | None) -> bytes:
        fingerprint, roots = self._roots[rank]
        cached = roots.get(salt or "")
        if cached is None:
            if len(roots) > 4096:  # salts are per tenant; keep the memo bounded anyway
                roots.clear()
            cached = roots[salt or ""] = keys.root_key(salt, fingerprint)
        return cached

    @staticmethod
    def _say_once(said: set[str], problem: str, req_id: str) -> None:
        """Log a request's problem once per kind (a bounded memo)."""
        if problem in said:
            return
        if len(said) < 64:
            said.add(problem)
        log.warning("kvpool: request %s: %s", req_id, problem)

    def _salt_problem(self, req_id: str, plan: keys.SaltPlan) -> None:
        """Say once per kind of problem why a salt was not taken as written (the salt itself is
        never logged: it is a tenant's secret)."""
        self._counters.add("salt_problems")
        outcome = (
            "the request is its tenant's alone (nothing shared)"
            if plan.cacheable
            else "the request gets no cache"
        )
        self._say_once(
            self._salt_problems_said,
            f"a cache_salt not taken as written: {plan.problem}; {outcome}",
            req_id,
        )
