"""Plain counters, counted where things happen and shipped to vLLM's metrics at the edge.

Each half (scheduler, worker) owns one :class:`Counters`; vLLM collects their
deltas every step through ``get_kv_connector_stats`` and the facade's
Prometheus hook (:mod:`kvpool.connector.metrics`) turns them into
``vllm:kvpool_<name>_total`` counters.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

COUNTERS: dict[str, str] = {
    "lookups": "Scheduler lookups sent to the agent.",
    "local_probes": "Scheduler probes answered by the agent's table of ready chunks (no wait).",
    "hit_tokens": "Tokens vLLM allocated blocks for, to load them from the agent.",
    "prefetches": "Prefetches from L2 that requests waited for.",
    "prefetch_timeouts": "Prefetches not done within prefetch_wait_s (the request went on).",
    "loaded_chunks": "Chunks copied from the segment into vLLM's KV cache.",
    "load_failed_chunks": "Planned chunk loads that failed (vLLM recomputed them).",
    "stored_chunks": "Chunks copied into the segment and committed.",
    "present_chunks": "Chunks a store found already cached (nothing copied).",
    "refused_chunks": "Chunks the agent refused to store (quota or memory).",
    "failed_stores": "Store jobs abandoned because of an error.",
    "agent_failures": "Calls that found the agent unavailable (timeout, refused, unresolvable).",
    "agent_skipped_calls": "Calls skipped while pausing after an agent failure.",
    "agent_restarts_seen": "Times the agent answered with a new identity (it restarted).",
    "salt_problems": "Requests whose structured cache_salt did not parse (see the log).",
    "preemptions_seen": "Preempted requests seen by the scheduler.",
    "pd_tails": "Prompt tails (the tokens after the last full chunk) a prefill stored.",
    "pd_pushes": "Runs of a prefill's chunks the agent offered to its decode's node.",
    "pd_pushes_unsent": "Runs not offered (no peers, an unknown node, an older agent).",
    "pd_full_hits": "Decodes of disaggregated requests that found the whole prompt.",
    "pd_partial_hits": "Decodes that stopped waiting and loaded only part of the prompt.",
    "pd_wait_ms": "Milliseconds decodes waited for their prompts' chunks.",
    "pd_bad_params": "Requests whose kvpool kv_transfer_params were malformed (ignored).",
    "pd_mismatched": "Decodes whose params named another prompt length (looked up as usual).",
    "held_requests": "Finished requests whose blocks were held until their stores completed.",
    "scheduler_us": "Microseconds the scheduler spent in lookups and planning.",
    "hash_us": "Microseconds the scheduler spent hashing token ids into keys (in scheduler_us).",
    "load_us": "Microseconds the workers spent loading (lookups, copies, releases).",
    "store_us": "Microseconds the workers spent storing (reserve, copies, commits).",
}
"""Every counter's name and meaning (the metric's help text)."""


class Counters:
    """Named event counts; :meth:`take` returns what was counted since the last take."""

    def __init__(self) -> None:
        self._pending: Counter[str] = Counter()
        self.totals: Counter[str] = Counter()

    def add(self, name: str, amount: int = 1) -> None:
        if name not in COUNTERS:
            raise KeyError(f"unknown counter {name!r}; known: {', '.join(COUNTERS)}")
        if amount:
            self._pending[name] += amount
            self.totals[name] += amount

    @contextmanager
    def timed(self, name: str) -> Iterator[None]:
        """Add the block's duration to ``name``, in microseconds."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, round((time.perf_counter() - started) * 1e6))

    def take(self) -> dict[str, int]:
        taken = dict(self._pending)
        self._pending.clear()
        return taken
