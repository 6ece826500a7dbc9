"""The agent's Prometheus metrics: its one module that defines prometheus_client objects.

The composition root (:mod:`kvpool.agent.server`) only creates the
:class:`CollectorRegistry` it injects here; the connector and the prefix index
have metrics modules of their own.

Cache figures are read from the service's stats (and the probe table's count of keys
it could not publish) at scrape time (a custom collector, so the hot path only bumps
plain integers); request latencies are
observed by the ZMQ server through :meth:`AgentMetrics.observe_request`.
Everything lives on an injected :class:`CollectorRegistry`. Tenant labels are
bounded: the ``top_tenants`` largest tenants by usage get their own label,
the rest are summed under ``other``; so do the tenants with pins (by pinned bytes) and the
shared spaces (by usage, labelled with where they are declared, ``namespace/pool/name``).
Ranking costs O(tenants) (outside the
service lock, but in the interpreter the ZMQ thread shares), so it is redone at
most every ``RANKING_SECONDS``: anyone may poll ``/metrics`` in a loop.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from kvpool.agent.core.factory import SegmentOrigin
from kvpool.agent.edge.door import DoorStats, Refusal
from kvpool.agent.edge.peer_metrics import PeerCollector
from kvpool.agent.edge.zmtp import DropReason
from kvpool.agent.l2.base import L2Adapter
from kvpool.agent.peer.node import PeerTier
from kvpool.agent.service.cache_service import CacheService
from kvpool.agent.service.results import SpaceUsage, TenantRanking
from kvpool.agent.tiering.prefetch import Prefetcher
from kvpool.agent.tiering.writeback import WriteBack
from kvpool.common.probe_table import ProbeTableWriter
from kvpool.common.web.connections import HttpRefusals
from kvpool.common.web.refusal_metrics import HttpRefusalsCollector

OTHER_TENANTS = "other"
RANKING_SECONDS = 1.0
"""How old the per-tenant figures of a scrape may be (scrapes come every 15 s or so)."""
_LATENCY_BUCKETS = (
    0.00002,
    0.00005,
    0.0001,
    0.0002,
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.05,
    0.25,
    1.0,
)


class _CacheCollector(Collector):
    def __init__(self, service: CacheService, top_tenants: int) -> None:
        self._service = service
        self._top = top_tenants
        self._ranking: TenantRanking | None = None
        self._ranked_at = 0.0

    def _tenant_ranking(self) -> TenantRanking:
        now = time.monotonic()
        if self._ranking is None or now - self._ranked_at >= RANKING_SECONDS:
            self._ranking, self._ranked_at = self._service.ranked_tenants(self._top), now
        return self._ranking

    def collect(self) -> Iterator[Metric]:
        stats = self._service.stats()
        gauges = {
            "kvpool_l1_capacity_bytes": (
                "Bytes of chunk data the L1 segment holds.",
                stats.capacity_bytes,
            ),
            "kvpool_l1_allocated_bytes": ("Bytes of L1 pages in use.", stats.allocated_bytes),
            "kvpool_l1_stored_bytes": ("Bytes of chunks in L1.", stats.stored_bytes),
            "kvpool_l1_chunks": ("Chunks in L1.", stats.chunks),
            "kvpool_l1_open_leases": ("Read and write leases held by clients.", stats.open_leases),
            "kvpool_l1_quarantined_bytes": (
                "Bytes of L1 pages held back from write leases that expired uncommitted.",
                stats.quarantined_bytes,
            ),
            "kvpool_l1_fragmentation_ratio": (
                "1 - largest free extent / free bytes.",
                stats.fragmentation,
            ),
        }
        for name, (documentation, value) in gauges.items():
            yield GaugeMetricFamily(name, documentation, value=value)
        counters = {
            "kvpool_l1_hits": ("Chunks found by lookups.", stats.hits),
            "kvpool_l1_misses": ("Chunks looked up and not found.", stats.misses),
            "kvpool_l1_written_bytes": ("Bytes of chunks committed.", stats.written_bytes),
            "kvpool_l1_read_bytes": ("Bytes of chunks handed out for reading.", stats.read_bytes),
            "kvpool_l1_lock_expiries": ("Leases that expired un-released.", stats.lock_expiries),
            "kvpool_l1_quarantined_leases": (
                "Write leases that expired uncommitted; their pages were quarantined.",
                stats.quarantined_leases,
            ),
        }
        for name, (documentation, value) in counters.items():
            yield CounterMetricFamily(name, documentation, value=value)
        evictions = CounterMetricFamily(
            "kvpool_l1_evictions", "Chunks evicted from L1, by cause.", labels=["cause"]
        )
        for cause, count in stats.evictions.items():
            evictions.add_metric([cause], count)
        yield evictions

        used = GaugeMetricFamily(
            "kvpool_tenant_used_bytes", "Bytes of L1 used per tenant.", labels=["tenant"]
        )
        chunks = GaugeMetricFamily(
            "kvpool_tenant_chunks", "L1 chunks per tenant.", labels=["tenant"]
        )
        quota = GaugeMetricFamily(
            "kvpool_tenant_quota_bytes",
            "Quota per labelled tenant (absent when unlimited).",
            labels=["tenant"],
        )
        ranking = self._tenant_ranking()
        for tenant in ranking.largest:
            used.add_metric([tenant.tenant], tenant.used_bytes)
            chunks.add_metric([tenant.tenant], tenant.chunks)
            if tenant.quota_bytes is not None:
                quota.add_metric([tenant.tenant], tenant.quota_bytes)
        if ranking.rest_count:
            used.add_metric([OTHER_TENANTS], ranking.rest_used_bytes)
            chunks.add_metric([OTHER_TENANTS], ranking.rest_chunks)
        yield used
        yield chunks
        yield quota
        yield from self._pins()
        yield from self._spaces()
        warm = self._service.warm_counts
        yield CounterMetricFamily(
            "kvpool_warm_requests", "Warm requests answered.", value=warm.requests
        )
        yield CounterMetricFamily(
            "kvpool_warm_loaded_chunks",
            "Chunks warm requests loaded from L2 into L1 before they answered.",
            value=warm.loaded_chunks,
        )

    def _pins(self) -> Iterator[Metric]:
        pinned = GaugeMetricFamily(
            "kvpool_tenant_pinned_bytes",
            "Bytes of L1 held by pinned chunks, per tenant with pins.",
            labels=["tenant"],
        )
        budget = GaugeMetricFamily(
            "kvpool_tenant_pin_budget_bytes",
            "Bytes of L1 pinned chunks may hold, per labelled tenant with pins.",
            labels=["tenant"],
        )
        totals = self._service.pinned_bytes()
        ranked = heapq.nlargest(self._top, totals.items(), key=lambda item: item[1][0])
        for tenant, (pinned_bytes, budget_bytes) in ranked:
            pinned.add_metric([tenant], pinned_bytes)
            budget.add_metric([tenant], budget_bytes)
        if len(ranked) < len(totals):
            rest = sum(n for n, _ in totals.values()) - sum(n for _, (n, _) in ranked)
            pinned.add_metric([OTHER_TENANTS], rest)
        yield pinned
        yield budget

    def _spaces(self) -> Iterator[Metric]:
        spaces = heapq.nlargest(self._top, self._service.spaces(), key=_space_used_bytes)
        figures: list[tuple[type[GaugeMetricFamily | CounterMetricFamily], str, str, list[int]]]
        figures = [
            (
                GaugeMetricFamily,
                "used_bytes",
                "Bytes of L1 used per shared space.",
                [space.usage.used_bytes for space in spaces],
            ),
            (
                GaugeMetricFamily,
                "nvme_used_bytes",
                "Bytes of this node's NVMe tier used per shared space.",
                [space.nvme_used_bytes for space in spaces],
            ),
            (
                GaugeMetricFamily,
                "chunks",
                "L1 chunks per shared space.",
                [space.usage.chunks for space in spaces],
            ),
            (
                GaugeMetricFamily,
                "pinned_bytes",
                "Bytes of L1 held by pinned chunks per shared space.",
                [space.pinned_bytes for space in spaces],
            ),
            (
                GaugeMetricFamily,
                "pin_budget_bytes",
                "Bytes of L1 pinned chunks may hold per shared space.",
                [space.pin_budget_bytes for space in spaces],
            ),
            (
                CounterMetricFamily,
                "hits",
                "Chunks found per shared space.",
                [space.usage.hits for space in spaces],
            ),
            (
                CounterMetricFamily,
                "misses",
                "Chunks looked up and not found per shared space.",
                [space.usage.misses for space in spaces],
            ),
        ]
        labels = [[space.source or space.space] for space in spaces]
        for family, name, documentation, values in figures:
            metric = family(f"kvpool_space_{name}", documentation, labels=["space"])
            for label, value in zip(labels, values, strict=True):
                metric.add_metric(label, value)
            yield metric


def _space_used_bytes(space: SpaceUsage) -> int:
    return space.usage.used_bytes


class _ProbeTableCollector(Collector):
    def __init__(self, table: ProbeTableWriter) -> None:
        self._table = table

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "kvpool_probe_table_full",
            "Ready chunks not published in the probe table (no free bucket near their key's "
            "home); schedulers find them through a lookup instead.",
            value=self._table.full,
        )


class _DoorCollector(Collector):
    """The door's grants and refusals (:class:`~kvpool.agent.edge.door.DoorStats`)."""

    def __init__(self, stats: DoorStats) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "kvpool_door_granted",
            "Chunk files the agent's door handed to a token that may map them.",
            value=self._stats.granted,
        )
        refused = CounterMetricFamily(
            "kvpool_door_refused",
            "Connections the agent's door closed without a chunk file, by reason.",
            labels=["reason"],
        )
        counts = dict(self._stats.refused)  # a copy: the door's thread adds to it
        for reason in Refusal:
            refused.add_metric([reason.value], counts.get(reason, 0))
        yield refused


class _L2Collector(Collector):
    def __init__(
        self, tiers: Sequence[L2Adapter], writeback: WriteBack, prefetcher: Prefetcher
    ) -> None:
        self._tiers = tiers
        self._writeback = writeback
        self._prefetcher = prefetcher

    def collect(self) -> Iterator[Metric]:
        per_tier = {
            "kvpool_l2_puts": ("Objects put, by tier.", "puts", CounterMetricFamily),
            "kvpool_l2_put_failures": (
                "Puts that failed, by tier.",
                "put_failures",
                CounterMetricFamily,
            ),
            "kvpool_l2_gets": ("Objects asked for, by tier.", "gets", CounterMetricFamily),
            "kvpool_l2_hits": ("Objects found and verified, by tier.", "hits", CounterMetricFamily),
            "kvpool_l2_integrity_failures": (
                "Objects that failed their header or checksum (deleted, never served).",
                "integrity_failures",
                CounterMetricFamily,
            ),
            "kvpool_l2_evictions": ("Objects evicted, by tier.", "evictions", CounterMetricFamily),
            "kvpool_l2_used_bytes": (
                "Bytes held, by tier (where known).",
                "used_bytes",
                GaugeMetricFamily,
            ),
        }
        for name, (documentation, field, family) in per_tier.items():
            metric = family(name, documentation, labels=["tier"])
            for tier in self._tiers:
                metric.add_metric([tier.name], getattr(tier.stats, field))
            yield metric
        latency = GaugeMetricFamily(
            "kvpool_tier_latency_seconds",
            "Measured seconds of a small get, by tier (the prefetch's cost model).",
            labels=["tier"],
        )
        bandwidth = GaugeMetricFamily(
            "kvpool_tier_bandwidth_bytes_per_second",
            "Measured bytes per second of a large get, by tier (the prefetch's cost model).",
            labels=["tier"],
        )
        for tier in self._tiers:
            cost = self._prefetcher.costs.cost(tier.name)
            if cost.latency is not None:
                latency.add_metric([tier.name], cost.latency)
            if cost.bandwidth is not None:
                bandwidth.add_metric([tier.name], cost.bandwidth)
        yield latency
        yield bandwidth
        writeback = self._writeback.stats
        yield CounterMetricFamily(
            "kvpool_writeback_written", "Chunk copies written to L2.", value=writeback.written
        )
        yield CounterMetricFamily(
            "kvpool_writeback_failed", "Chunk copies L2 refused.", value=writeback.failed
        )
        yield CounterMetricFamily(
            "kvpool_writeback_shed", "Chunks not written back: queue full.", value=writeback.shed
        )
        yield GaugeMetricFamily(
            "kvpool_writeback_pending", "Chunks waiting for L2.", value=writeback.pending
        )
        prefetch = self._prefetcher.stats
        yield CounterMetricFamily(
            "kvpool_prefetch_started", "Prefetches from L2 started.", value=prefetch.started
        )
        yield CounterMetricFamily(
            "kvpool_prefetch_refused", "Prefetches not started (too many).", value=prefetch.refused
        )
        yield CounterMetricFamily(
            "kvpool_prefetch_joined",
            "Prefetches not started: a running one loads the same keys already.",
            value=prefetch.joined,
        )
        yield CounterMetricFamily(
            "kvpool_prefetch_loaded_chunks",
            "Chunks loaded from L2 into L1.",
            value=prefetch.loaded_chunks,
        )
        yield CounterMetricFamily(
            "kvpool_prefetch_loaded_bytes",
            "Bytes loaded from L2 into L1.",
            value=prefetch.loaded_bytes,
        )


class AgentMetrics:
    def __init__(
        self,
        registry: CollectorRegistry,
        service: CacheService,
        top_tenants: int,
        origin: SegmentOrigin,
        probe_table: ProbeTableWriter | None = None,
    ) -> None:
        self.registry = registry
        registry.register(_CacheCollector(service, top_tenants))
        if probe_table is not None:
            registry.register(_ProbeTableCollector(probe_table))
        Gauge(
            "kvpool_l1_restored_chunks",
            "Chunks this agent adopted from the segment an earlier agent left.",
            registry=registry,
        ).set(origin.restored_chunks)
        Gauge(
            "kvpool_l1_discarded_records",
            "Damaged chunk records discarded when the segment was adopted.",
            registry=registry,
        ).set(origin.discarded_records)
        Gauge(
            "kvpool_l1_segment_start_seconds",
            "Time to open or adopt the segment and rebuild the index at start.",
            registry=registry,
        ).set(origin.seconds)
        Gauge(
            "kvpool_l1_segment_origin",
            'How the segment came to be: reason "adopted", or why it was recreated.',
            ["reason"],
            registry=registry,
        ).labels(origin.reason).set(1)
        self._latency = Histogram(
            "kvpool_request_seconds",
            "Time to serve a ZMQ request, by operation.",
            ["op"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self._l2_latency = Histogram(
            "kvpool_l2_seconds",
            "Time of one L2 operation, by tier and operation.",
            ["tier", "op"],
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10),
            registry=registry,
        )
        self._errors = Counter(
            "kvpool_request_errors",
            "ZMQ requests answered with an error, by operation and code.",
            ["op", "code"],
            registry=registry,
        )
        self._dropped_peers = Counter(
            "kvpool_zmq_dropped_peers",
            "ZMQ connections the agent closed, by reason: a message of too many frames or "
            "bytes, not ZMTP 3 from a DEALER, no handshake and hello in time, a large message "
            "too slow, no hello before newer connections, max_connections reached.",
            ["reason"],
            registry=registry,
        )
        for reason in DropReason:
            self._dropped_peers.labels(reason)

    def register_http(self, refusals: HttpRefusals) -> None:
        """Count what the HTTP server refuses (see
        :func:`~kvpool.common.web.serving.serve_http`)."""
        self.registry.register(HttpRefusalsCollector(refusals, "kvpool_http_refused"))

    def register_door(self, stats: DoorStats) -> None:
        self.registry.register(_DoorCollector(stats))

    def register_l2(
        self, tiers: Sequence[L2Adapter], writeback: WriteBack, prefetcher: Prefetcher
    ) -> None:
        self.registry.register(_L2Collector(tiers, writeback, prefetcher))

    def register_peers(self, peers: PeerTier) -> None:
        self.registry.register(PeerCollector(peers))

    def observe_l2(self, tier: str, op: str, seconds: float) -> None:
        self._l2_latency.labels(tier, op).observe(seconds)

    def observe_request(self, op: str, seconds: float, error: str | None) -> None:
        self._latency.labels(op).observe(seconds)
        if error is not None:
            self._errors.labels(op, error).inc()

    def observe_dropped_peer(self, reason: str) -> None:
        self._dropped_peers.labels(reason).inc()

    def exposition(self) -> tuple[bytes, str]:
        """The text format body and its content type, for GET /metrics."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
