"""The servers' and agents' own counters around a segment, and where its prompt tokens came
from by them.

vLLM counts each prompt's tokens by source (``vllm:prompt_tokens_by_source_total``): its
own prefix cache (``local_cache_hit``), a connector (``external_kv_transfer``: kvpool's
agent or LMCache) and computed (``local_compute``, which includes the last token vLLM always
computes). kvpool's agents count the chunks they fetched from a peer
(``kvpool_peer_fetched_chunks_total``): a fetched chunk lands in the agent's L1 and the
request that asked is served from there, so the tokens loaded from a peer are taken as
those chunks' tokens, at most what the connectors loaded, and the rest of what they loaded
as L1. Where a fetched chunk was not loaded after all (a block vLLM had meanwhile, a
prefetch that came too late), that is an overestimate.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

BY_SOURCE = "vllm:prompt_tokens_by_source_total"
PEER_FETCHED = "kvpool_peer_fetched_chunks_total"
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
"""One endpoint's ``/metrics``: (sample name, labels) -> value."""


def parse(text: str) -> Samples:
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = float(sample.value)
    return samples


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    wanted = set(labels.items())
    return sum(
        value for (sample, have), value in samples.items() if sample == name and wanted <= have
    )


@dataclass(frozen=True)
class Snapshot:
    """Every scraped endpoint's samples, by its name (``vllm-10.200.3.1:8000``,
    ``agent-host-0``; a disaggregated set's prefill servers ``prefill-10.200.3.1:8000``,
    outside the client's view)."""

    endpoints: dict[str, Samples]

    def total(self, prefix: str, name: str, **labels: str) -> float:
        """:func:`total` over the endpoints whose name starts with ``prefix``."""
        return sum(
            total(samples, name, **labels)
            for endpoint, samples in self.endpoints.items()
            if endpoint.startswith(prefix)
        )


def scrape(urls: Mapping[str, str], keep: Path | None = None) -> Snapshot:
    """Read each endpoint's ``/metrics`` (``urls``: name -> base URL); the raw texts go to
    ``keep/<name>.txt`` if given."""
    endpoints = {}
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
    for name, url in urls.items():
        text = httpx.get(f"{url}/metrics", timeout=30).text
        if keep is not None:
            (keep / f"{name}.txt").write_text(text)
        endpoints[name] = parse(text)
    return Snapshot(endpoints)


@dataclass(frozen=True)
class Split:
    """A segment's prompt tokens, by where they came from."""

    prompt: int
    vllm_cache: int
    l1: int
    peer: int
    recomputed: int
    requests: int
    """Requests vLLM counted as finished."""
    prefilled: int = 0
    """Prompt tokens the prefill servers of the disaggregated set took (``prefill-``
    endpoints), not in ``prompt``: the decode servers then took the same prompts, loading
    them."""

    def share(self, part: int) -> float:
        return part / self.prompt if self.prompt else 0.0


def split(before: Snapshot, after: Snapshot, chunk_tokens: int) -> Split:
    """Where the prompt tokens of the segment between the two snapshots came from."""

    def delta(prefix: str, name: str, **labels: str) -> int:
        return round(after.total(prefix, name, **labels) - before.total(prefix, name, **labels))

    cache = delta("vllm-", BY_SOURCE, source="local_cache_hit")
    external = delta("vllm-", BY_SOURCE, source="external_kv_transfer")
    computed = delta("vllm-", BY_SOURCE, source="local_compute")
    peer = min(external, delta("agent-", PEER_FETCHED) * chunk_tokens)
    return Split(
        prompt=cache + external + computed,
        vllm_cache=cache,
        l1=external - peer,
        peer=peer,
        recomputed=computed,
        requests=delta("vllm-", "vllm:request_success_total"),
        prefilled=delta("prefill-", BY_SOURCE),
    )
