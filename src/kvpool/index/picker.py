"""The endpoint picker's core: which model server a request goes to, and why.

For each candidate (the known, ready model servers, within the proxy's subset; all the
known ones there when none is ready, by prompt alone) the picker estimates the request's
time to first token, and picks the lowest:

* **prompt time**: each chunk of the prompt from the cheapest place that holds it for that
  server (:class:`~kvpool.common.index_config.TierCosts`, seconds per 1000 tokens): its own
  GPU prefix cache, its node's L1, its node's NVMe, another node's agent (``peer``: that
  node's L1 or NVMe), the pool's S3 bucket; the rest, and the tokens after the last full
  chunk, computed. Each tier gives the *leading run* of the prompt's chunks it holds
  (:meth:`~kvpool.index.tracker.PrefixTracker.longest_prefixes`), so chunk ``i`` is in a
  tier iff ``i`` is below its run.
* **queue time**: ``(waiting + RUNNING_SHARE x running + kv penalty) x`` the mean prompt
  time of recent requests (an EWMA of the winners' estimates): a waiting request is
  prefilled before this one (vLLM schedules first come, first served); running ones mostly
  decode, and share each step with this prefill, so they count for a fraction. A server
  whose KV cache is nearly full (above :data:`KV_FULL`) would evict or preempt: each point
  above counts as :data:`KV_FULL_REQUESTS` / 100 more waiting requests.

Ties go to fewer waiting requests, then the address. The answer's reason is ``prefix``
when the winner loads some of the prompt rather than computing it, else ``load``.

**Roles.** A whole request goes to a decode-capable server (role ``decode`` or ``both``);
a ``prefill`` server only while none of those is ready (a misdeployed pool still serves).

**Prefill/decode disaggregation** (``picker.pd``). Let ``d`` be the winner above. The
request is disaggregated when the part of its prompt ``d`` cannot load from any tier is at
least ``threshold_tokens`` (below that, the handover costs more than ``d`` computing it),
and some ready prefill-capable server (``prefill`` or ``both``) other than ``d`` has at
most ``max_prefill_waiting`` requests waiting (Dynamo's rule: a queued prefill starts no
sooner than ``d`` would). The prefill pod ``p`` is the one of those with the lowest
estimate (it may hold some of the prompt). The decode pod is then chosen by load alone,
its prompt's KV being on its way: the decode-capable server other than ``p`` with the
shortest queue, among equal queues one on ``p``'s node (no transfer between nodes). Each
pick's outcome (:class:`~kvpool.index.picking.Disaggregation`) goes to the observer.

**Keys, and the tenant guarantee.** The prompt's chunk keys are the connector's
(:class:`~kvpool.index.query.PromptKeys`: the request's ``cache_salt`` seeds the chain, a
shared space's structured salt keys its shared part with the space's salt), so a decision
only ever sees the chunks of that salt: another tenant's identical prompt has other keys and
matches nothing. Nothing here looks chunks up by token ids alone.

**Deadline.** A pick returns within ``deadline``, in the caller's thread (a gRPC stream's:
their number is the edge's bound): the estimate looks at the time left between steps,
hashes the keys outside the trackers' locks (which the event subscribers take) with a look
every :data:`HASH_STEP` keys, and waits for a tracker's lock no longer than the time left.
When the time runs out (a tracker's lock held by its writer, a huge prompt), or the
estimate fails, the server with the shortest queue is answered with reason ``fail_open``.
An index that knows nothing (agents down, not yet synchronised) just matches nothing:
``load``.

**Benches.** :meth:`EndpointPicker.estimates` is the decision without the deadline, on
given candidates; ``servers`` is any callable returning server states (ranked once per
object it returns), so a bench can time
:meth:`EndpointPicker.pick` over fixed loads and filled trackers against hashing the same
prompt alone (``PromptKeys(...)[n - 1]``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from kvpool.common.index_config import PrefillDecode, TierCosts
from kvpool.common.keys import ModelFingerprint
from kvpool.common.web.rate_limited_log import RateLimitedLog
from kvpool.index.model_servers import Load, ServerState
from kvpool.index.picking import (
    Disaggregation,
    NoEndpoint,
    Pick,
    PickReason,
    PickRequest,
    PrefillPod,
)
from kvpool.index.query import PromptKeys
from kvpool.index.tracker import KeySequence, PrefixTracker

log = logging.getLogger(__name__)
_failures = RateLimitedLog(log)

RUNNING_SHARE = 0.25
"""How much of a waiting request one running request costs this request's start."""
KV_FULL = 0.9
"""KV-cache usage above which a server is penalised."""
KV_FULL_REQUESTS = 50.0
"""Waiting requests a server's KV usage counts for per unit above :data:`KV_FULL` (5 when
full)."""
MEAN_WEIGHT = 0.1
"""Weight of the newest request in the mean prompt time (about the last ten count)."""
HASH_STEP = 1024
"""Keys hashed between two looks at the deadline."""
WHOLE_PROMPT_CHUNKS = 64
"""A prompt of at most this many chunks is hashed whole and looked up in one round: one
round of lookups costs about as much as hashing a dozen keys, so for a prompt this short a
miss found after the first keys saves less than a second round costs."""
FIRST_WINDOW = 4
"""Keys hashed for the first round of a longer prompt: a miss costs this many hashes."""
WINDOW_GROWTH = 8
"""How much longer each round's window of hashed keys is: fewer rounds of lookups (each
asks every tier), against keys hashed past the longest held run."""


@dataclass(frozen=True)
class Tiers:
    """Where chunks may be, each a tracker that exists or not (None: that tier is off)."""

    l1: PrefixTracker | None = None
    """Per node (agent's node name): its L1, the index's tracker of the agents' events."""
    gpu: PrefixTracker | None = None
    """Per model server (its address): vLLM's own prefix cache, from its KV events, in
    kvpool's chunk keys."""
    nvme: PrefixTracker | None = None
    """Per node: the agent's NVMe tier."""
    s3: PrefixTracker | None = None
    """Per agent that wrote it (node name): the pool's bucket; any writer's run counts for
    every server."""


class PickObserver(Protocol):
    def observe_pick(
        self, reason: PickReason | None, seconds: float, disaggregation: Disaggregation | None
    ) -> None:
        """One decision and how long it took; ``reason`` None: :class:`NoEndpoint`;
        ``disaggregation`` None: no decision was made (no endpoint, or failed open)."""
        ...


class Runs:
    """The leading run of a prompt's chunks in each tier (made once per pick: a plain
    class, its node runs ranked once for :meth:`peer`)."""

    __slots__ = ("_best", "gpu", "l1", "nvme", "s3")

    def __init__(
        self, gpu: Mapping[str, int], l1: Mapping[str, int], nvme: Mapping[str, int], s3: int
    ) -> None:
        self.gpu = gpu
        """By server address."""
        self.l1 = l1
        """By node."""
        self.nvme = nvme
        """By node."""
        self.s3 = s3
        """The longest of any writer's."""
        nodes = l1
        if nvme:
            nodes = dict(l1)
            for node, run in nvme.items():
                if run > nodes.get(node, 0):
                    nodes[node] = run
        self._best = sorted(zip(nodes.values(), nodes, strict=True), reverse=True)[:2]
        """The two longest node runs (L1 or NVMe) and their nodes, longest first."""

    def any(self, tier: str) -> bool:
        """Whether ``tier`` (gpu, l1, nvme, peer, s3) holds some of the prompt anywhere."""
        if tier == "s3":
            return self.s3 > 0
        if tier == "peer":
            return bool(self._best) and self._best[0][0] > 0
        return any(getattr(self, tier).values())

    def peer(self, node: str) -> int:
        """The longest run another node's L1 or NVMe holds."""
        for run, holder in self._best:
            if holder != node:
                return run
        return 0


class Estimate(NamedTuple):
    """One candidate's estimate. A tuple (one is made per candidate per pick) whose order is
    the ranking: the lowest is picked (ties: fewer waiting, then the address)."""

    seconds: float
    """Queue and prompt time."""
    waiting: float
    address: str
    prompt_seconds: float
    queue_seconds: float
    cached_tokens: int
    """Tokens of the prompt loaded (from a tier cheaper than computing), not computed."""


class Candidates:
    """The servers a pick may choose from, shortest queue first (ties: fewer waiting, then
    the address), each with its queue: made once per snapshot of the servers' loads, not per
    pick."""

    __slots__ = ("addresses", "queues", "ranked", "servers")

    def __init__(self, servers: Iterable[ServerState]) -> None:
        ranked = sorted((_queue_requests(s.load), _waiting(s.load), s.address, s) for s in servers)
        self.servers = [server for *_, server in ranked]
        self.queues = [queue for queue, *_ in ranked]
        """Each one's requests ahead of a new one (:func:`_queue_requests`)."""
        self.addresses = [server.address for server in self.servers]
        """The names the GPU tier knows them by."""
        self.ranked = list(zip(self.servers, self.queues, strict=True))
        """Each server with its queue, in order."""


class _Ranking(NamedTuple):
    """A snapshot's candidates for one subset."""

    destinations: Candidates
    """Where a request may go whole, or be decoded."""
    prefill: Candidates
    """The ready prefill-capable servers (none without ``picker.pd``)."""
    addresses: Collection[str]
    """Both's addresses: the GPU tier's runs to look up."""


class _TooLate(Exception):
    """The estimate's deadline passed while hashing the prompt's keys."""


class _Head:
    """The first ``length`` keys of a prompt, hashed already: a tracker reads them under its
    lock without hashing (the lock is the one the index's event subscriber takes)."""

    __slots__ = ("_keys", "_length")

    def __init__(self, keys: KeySequence, length: int) -> None:
        self._keys = keys
        self._length = length

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, position: int) -> bytes:
        if not 0 <= position < self._length:
            raise IndexError(f"chunk {position} of a window of {self._length}")
        return self._keys[position]


def tier_runs(
    tiers: Tiers,
    keys: KeySequence,
    addresses: Collection[str],
    left: Callable[[], float] = lambda: math.inf,
) -> Runs:
    """Each tier's leading runs of ``keys`` (GPU runs of ``addresses`` only); :class:`_TooLate`
    once ``left()`` (the seconds left) runs out while hashing, or ``TimeoutError`` while a
    tracker's lock is held that long.

    The keys are hashed here, outside the trackers' locks: a prompt of up to
    :data:`WHOLE_PROMPT_CHUNKS` chunks whole, in one round; a longer one in a window of the
    first keys, :data:`WINDOW_GROWTH` times longer while some node holds all of it, each
    round asking only those nodes again: no tier holding it costs :data:`FIRST_WINDOW`
    hashes, a longest held run of ``r`` chunks fewer than ``WINDOW_GROWTH x r``. The
    deadline is looked at every :data:`HASH_STEP` keys."""
    found: list[dict[str, int]] = [{}, {}, {}, {}]
    asked: Sequence[tuple[dict[str, int], PrefixTracker, Collection[str] | None]] = [
        (runs, tracker, addresses if tier == 0 else None)
        for tier, (runs, tracker) in enumerate(
            zip(found, (tiers.gpu, tiers.l1, tiers.nvme, tiers.s3), strict=True)
        )
        if tracker is not None
    ]
    count = len(keys)
    window = count if count <= WHOLE_PROMPT_CHUNKS else FIRST_WINDOW
    length = 0
    while asked:
        hashed, length = length, min(window, count)
        for end in range(hashed + HASH_STEP, length + HASH_STEP, HASH_STEP):
            if left() <= 0:
                raise _TooLate
            keys[min(end, length) - 1]  # hashes up to there (a chain is hashed in order)
        head = keys.head(length) if isinstance(keys, PromptKeys) else _Head(keys, length)
        again = []
        for runs, tracker, names in asked:
            wait = left()  # a tracker's lock held by its writer: no longer than that
            if wait <= 0:
                raise _TooLate
            matches = tracker.longest_prefixes(head, names, wait=-1 if wait == math.inf else wait)
            whole = []  # the nodes that hold all of the window: asked again with a longer one
            for name, (chunks, _) in matches.items():
                runs[name] = chunks
                if chunks == length:
                    whole.append(name)
            if whole and length < count:
                again.append((runs, tracker, whole))
        asked = again
        window *= WINDOW_GROWTH
    gpu, l1, nvme, s3 = found
    return Runs(gpu, l1, nvme, max(s3.values(), default=0))


class EndpointPicker:
    """:class:`~kvpool.index.picking.Picker` over model servers and the index's tiers."""

    def __init__(
        self,
        servers: Callable[[], Sequence[ServerState]],
        tiers: Tiers,
        fingerprint: ModelFingerprint,
        costs: TierCosts,
        *,
        deadline_ms: float,
        pd: PrefillDecode | None = None,
        observer: PickObserver | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """``servers``: the known servers and their loads (``ModelServers.snapshot``), the
        same object while nothing changed: they are ranked by queue once per object.
        ``pd``: when to disaggregate (None: never)."""
        self.tiers = tiers
        self.fingerprint = fingerprint
        self.costs = costs
        self.deadline = deadline_ms / 1000
        self.pd = pd if pd is not None and pd.enabled else None
        self._servers = servers
        self._observer = observer
        self._clock = clock
        self._mean_prompt: float | None = None
        self._ranked: tuple[Sequence[ServerState], _Ranking] | None = None
        """The last snapshot of every server and its candidates (whole: read without a lock)."""
        self._cheapest_first = sorted(
            (cost, tier)
            for tier, cost in (
                ("gpu", costs.gpu),
                ("l1", costs.l1),
                ("nvme", costs.nvme),
                ("peer", costs.peer),
                ("s3", costs.s3),
            )
            if cost < costs.compute  # a tier that costs as much as computing is no gain
        )

    # ------------------------------------------------------------------ pick

    def pick(self, request: PickRequest) -> Pick:
        started = self._clock()
        try:
            ranking = self._ranking(request.subset)
        except NoEndpoint:
            self._observe(None, None, started)
            raise
        disaggregation = None
        first = ranking.destinations.servers[0].address
        try:
            pick, disaggregation = self._decide(request, ranking, started + self.deadline)
        except (_TooLate, TimeoutError):
            pick = Pick(first, PickReason.FAIL_OPEN)
        except Exception as error:  # the index's trouble must not fail the request
            _failures.exception(f"picking by prefix failed, picked by load: {error}")
            pick = Pick(first, PickReason.FAIL_OPEN)
        self._observe(pick.reason, disaggregation, started)
        return pick

    def candidates(self, subset: frozenset[str] | None) -> Candidates:
        """The servers a request may go to whole: the ready ones (all, when none is ready),
        within ``subset``, the decode-capable of those (all of them, when none is);
        :class:`NoEndpoint` when there are none."""
        return self._ranking(subset).destinations

    def _ranking(self, subset: frozenset[str] | None) -> _Ranking:
        snapshot = self._servers()
        if subset is None and (ranked := self._ranked) is not None and ranked[0] is snapshot:
            return ranked[1]
        known = [s for s in snapshot if subset is None or s.address in subset]
        if not known:
            where = "in the subset" if subset is not None else "known"
            raise NoEndpoint(f"no model server {where}")
        ready = [s for s in known if s.ready]
        chosen = ready or known
        destinations = Candidates([s for s in chosen if s.decodes] or chosen)
        prefill = Candidates([s for s in ready if s.prefills] if self.pd is not None else [])
        addresses = destinations.addresses
        if prefill.addresses:
            addresses = sorted(set(addresses).union(prefill.addresses))
        ranking = _Ranking(destinations, prefill, addresses)
        if subset is None:
            self._ranked = (snapshot, ranking)
        return ranking

    def _decide(
        self, request: PickRequest, ranking: _Ranking, deadline: float
    ) -> tuple[Pick, Disaggregation]:
        keys = PromptKeys(request.token_ids, request.cache_salt, self.fingerprint)
        left = lambda: deadline - self._clock()  # noqa: E731
        runs = tier_runs(self.tiers, keys, ranking.addresses, left)
        prices = self._prices(request, runs)
        ranked = ranking.destinations.ranked
        best, server = _best(_contenders(ranked, runs), runs, prices)
        # no lock: two picks at once may lose one of their updates, which a mean forgets
        # anyway; each assignment is whole
        mean = self._mean_prompt
        self._mean_prompt = (
            best.prompt_seconds
            if mean is None
            else mean + MEAN_WEIGHT * (best.prompt_seconds - mean)
        )
        reason = PickReason.PREFIX if best.cached_tokens else PickReason.LOAD
        whole = Pick(best.address, reason, best.cached_tokens)
        pd = self.pd
        if pd is None:
            return whole, Disaggregation.DISABLED
        if len(request.token_ids) - best.cached_tokens < pd.threshold_tokens:
            return whole, Disaggregation.SHORT
        if not server.decodes:  # none that decodes is ready: there is no decode pod
            return whole, Disaggregation.NO_DECODE_READY
        others = [(s, q) for s, q in ranking.prefill.ranked if s.address != best.address]
        if not others:
            return whole, Disaggregation.NO_PREFILL_READY
        free = [(s, q) for s, q in others if _waiting(s.load) <= pd.max_prefill_waiting]
        if not free:
            return whole, Disaggregation.PREFILL_BUSY
        prefill, filler = _best(_contenders(free, runs), runs, prices)
        decode = _decode_pod(ranked, filler)
        pod = PrefillPod(filler.address, filler.node)
        pick = Pick(decode.address, PickReason.PD, prefill.cached_tokens, pod)
        return pick, Disaggregation.DISAGGREGATED

    def _observe(
        self, reason: PickReason | None, disaggregation: Disaggregation | None, started: float
    ) -> None:
        if self._observer is not None:
            self._observer.observe_pick(reason, self._clock() - started, disaggregation)

    # ------------------------------------------------------------- estimate

    def estimates(
        self,
        request: PickRequest,
        candidates: Candidates | Sequence[ServerState],
        keys: KeySequence | None = None,
        left: Callable[[], float] = lambda: math.inf,
        *,
        contenders: bool = False,
    ) -> list[Estimate]:
        """Every candidate's estimate for the request (``keys``: its chunk keys, when the
        caller has them already; :class:`_TooLate` or ``TimeoutError`` once ``left()``, the
        seconds left, runs out). ``contenders``: only of the candidates that may win, which
        are those whose own node or GPU holds some of the prompt, and of the rest (whose
        prompt times are all the same: every chunk from a peer, S3 or computed) the one
        with the shortest queue."""
        if not isinstance(candidates, Candidates):
            candidates = Candidates(candidates)
        if keys is None:
            keys = PromptKeys(request.token_ids, request.cache_salt, self.fingerprint)
        runs = tier_runs(self.tiers, keys, candidates.addresses, left)
        prices = self._prices(request, runs)
        ranked = candidates.ranked
        chosen = _contenders(ranked, runs) if contenders else ranked
        return [_estimate(server, queue, runs, prices) for server, queue in chosen]

    def _prices(self, request: PickRequest, runs: Runs) -> _Prices:
        """What the estimates of one pick share."""
        tokens = len(request.token_ids)
        chunk = self.fingerprint.chunk_tokens
        held = [
            (cost * chunk / 1000, tier) for cost, tier in self._cheapest_first if runs.any(tier)
        ]
        compute = self.costs.compute / 1000
        return _Prices(held, tokens, chunk, compute, self._mean_prompt_seconds(tokens))

    def _mean_prompt_seconds(self, tokens: int) -> float:
        """The mean prompt time of recent requests (before the first: this one's, computed)."""
        mean = self._mean_prompt
        return tokens / 1000 * self.costs.compute if mean is None else mean


def _contenders(
    ranked: Sequence[tuple[ServerState, float]], runs: Runs
) -> Sequence[tuple[ServerState, float]]:
    """The candidates (and their queues, shortest first) that hold some of the prompt on
    their node or GPU, and the first of the others: the one with the shortest queue."""
    l1, nvme, gpu = runs.l1, runs.nvme, runs.gpu
    if not (l1 or nvme or gpu):
        return ranked[:1]
    chosen = []
    plain = True  # none of the others chosen yet
    for server, queue in ranked:
        if server.node in l1 or server.node in nvme or server.address in gpu:
            chosen.append((server, queue))
        elif plain:
            chosen.append((server, queue))
            plain = False
    return chosen


def _best(
    chosen: Iterable[tuple[ServerState, float]], runs: Runs, prices: _Prices
) -> tuple[Estimate, ServerState]:
    """The lowest estimate of ``chosen`` (not empty), and its server."""
    return min(
        ((_estimate(server, queue, runs, prices), server) for server, queue in chosen),
        key=lambda estimated: estimated[0],
    )


def _decode_pod(ranked: Sequence[tuple[ServerState, float]], prefill: ServerState) -> ServerState:
    """The decode pod of a request ``prefill`` prefills: of ``ranked`` (shortest queue
    first) other than it, the shortest queue; among equal queues, one on its node."""
    others = [(server, queue) for server, queue in ranked if server.address != prefill.address]
    shortest = others[0][1]
    tied = [server for server, queue in others if queue == shortest]
    return next((server for server in tied if server.node == prefill.node), tied[0])


def _queue_requests(load: Load | None) -> float:
    """The requests a server's queue puts before a new one (its last load; none: none); times
    the mean prompt time, the time it makes the request wait."""
    if load is None:
        return 0.0
    full = max(0.0, load.kv_cache_usage - KV_FULL) * KV_FULL_REQUESTS
    return load.waiting + RUNNING_SHARE * load.running + full


def _waiting(load: Load | None) -> float:
    return load.waiting if load is not None else 0.0


class _Prices(NamedTuple):
    """What one pick's estimates share."""

    held: Sequence[tuple[float, str]]
    """The tiers that hold some of the prompt, cheapest first, each with its seconds per
    chunk."""
    tokens: int
    chunk_tokens: int
    compute: float
    """Seconds per token computed."""
    mean: float
    """The mean prompt time of recent requests (a waiting request's cost)."""


def _estimate(server: ServerState, queue_requests: float, runs: Runs, prices: _Prices) -> Estimate:
    """One candidate's estimate."""
    held, tokens, chunk_tokens, compute, mean = prices
    covered = 0
    seconds = 0.0
    for cost, tier in held:
        if tier == "l1":
            run = runs.l1.get(server.node, 0)
        elif tier == "peer":
            run = runs.peer(server.node)
        elif tier == "gpu":
            run = runs.gpu.get(server.address, 0)
        elif tier == "nvme":
            run = runs.nvme.get(server.node, 0)
        else:
            run = runs.s3
        if run > covered:
            seconds += (run - covered) * cost
            covered = run
    cached = covered * chunk_tokens
    seconds += (tokens - cached) * compute
    queue = queue_requests * mean
    return Estimate(seconds + queue, _waiting(server.load), server.address, seconds, queue, cached)
