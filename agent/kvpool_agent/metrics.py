"""Prometheus metrics: the only module that touches prometheus_client.

Cache figures are read from the service's stats at scrape time (a custom
collector, so the hot path only bumps plain integers); request latencies are
observed by the ZMQ server through :meth:`AgentMetrics.observe_request`.
Everything lives on an injected :class:`CollectorRegistry`. Tenant labels are
bounded: the ``top_tenants`` largest tenants by usage get their own label,
the rest are summed under ``other``.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from kvpool_agent.cache_factory import SegmentOrigin
from kvpool_agent.service import CacheService

OTHER_TENANTS = "other"
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
        ranked = sorted(stats.tenants, key=lambda tenant: tenant.used_bytes, reverse=True)
        for tenant in ranked[: self._top]:
            used.add_metric([tenant.tenant], tenant.used_bytes)
            chunks.add_metric([tenant.tenant], tenant.chunks)
            if tenant.quota_bytes is not None:
                quota.add_metric([tenant.tenant], tenant.quota_bytes)
        rest = ranked[self._top :]
        if rest:
            used.add_metric([OTHER_TENANTS], sum(tenant.used_bytes for tenant in rest))
            chunks.add_metric([OTHER_TENANTS], sum(tenant.chunks for tenant in rest))
        yield used
        yield chunks
        yield quota


class AgentMetrics:
    def __init__(
        self,
        registry: CollectorRegistry,
        service: CacheService,
        top_tenants: int,
        origin: SegmentOrigin,
    ) -> None:
        self.registry = registry
        registry.register(_CacheCollector(service, top_tenants))
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
        self._errors = Counter(
            "kvpool_request_errors",
            "ZMQ requests answered with an error, by operation and code.",
            ["op", "code"],
            registry=registry,
        )

    def observe_request(self, op: str, seconds: float, error: str | None) -> None:
        self._latency.labels(op).observe(seconds)
        if error is not None:
            self._errors.labels(op, error).inc()

    def exposition(self) -> tuple[bytes, str]:
        """The text format body and its content type, for GET /metrics."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
