"""Prometheus metrics of the index: the only index module that touches prometheus_client.

Per node (label ``node``; a pool has one agent per node, so the label is
bounded by the cluster): chunks tracked, chunks dropped by the cap, events
applied, resyncs by reason, failed snapshot requests, whether the node is
synchronised and connected, the lag of its last event (receive time minus
the agent's publish time; as exact as the nodes' clocks agree) and the age of
its last event (a quiet agent grows it, a late stream grows the lag). These are
read from the tracker and the subscriber at scrape time. Queries are timed by
:class:`~kvpool.index.service.IndexService` through
:meth:`IndexMetrics.observe_query`; routing decisions are counted by reason.
A gap in sequence numbers (counted as a ``gap`` resync) is the certain sign of
lost events. With the picker: its answers, its picks by reason and whether each
disaggregated prefill from decode (or why not), the model servers' loads, and the placement
events' publisher (batches, drops, recovery requests, placements held by medium).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from kvpool.common.routing import Decision
from kvpool.common.web.connections import HttpRefusals
from kvpool.common.web.refusal_metrics import HttpRefusalsCollector
from kvpool.index.model_servers import ServerState
from kvpool.index.picking import Disaggregation, PickReason
from kvpool.index.placement_events import PublisherStatus
from kvpool.index.subscriber import AgentStatus
from kvpool.index.tracker import PrefixTracker

_QUERY_BUCKETS = (
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
)


class _IndexCollector(Collector):
    def __init__(
        self,
        tracker: PrefixTracker,
        agents: Callable[[], list[AgentStatus]],
        clock: Callable[[], float],
    ) -> None:
        self._tracker = tracker
        self._agents = agents
        self._clock = clock

    def collect(self) -> Iterator[Metric]:
        chunks = GaugeMetricFamily(
            "kvpool_index_chunks", "Chunks tracked, by node.", labels=["node"]
        )
        evicted = CounterMetricFamily(
            "kvpool_index_cap_evicted",
            "Chunks dropped because the node was over max_chunks_per_node, by node.",
            labels=["node"],
        )
        for node, counts in sorted(self._tracker.counts().items()):
            chunks.add_metric([node], counts.chunks)
            evicted.add_metric([node], counts.cap_evicted)
        yield chunks
        yield evicted

        events = CounterMetricFamily(
            "kvpool_index_events", "Chunk events applied, by node.", labels=["node"]
        )
        resyncs = CounterMetricFamily(
            "kvpool_index_resyncs",
            "Resynchronisations from a snapshot, by node and reason (connected, restart, gap).",
            labels=["node", "reason"],
        )
        failures = CounterMetricFamily(
            "kvpool_index_snapshot_failures",
            "Snapshot requests that failed or timed out (retried), by node.",
            labels=["node"],
        )
        synced = GaugeMetricFamily(
            "kvpool_index_agent_synced",
            "1 while the node's keys are a snapshot plus every later event.",
            labels=["node"],
        )
        connected = GaugeMetricFamily(
            "kvpool_index_agent_connected",
            "1 while the index is connected to the node's event socket.",
            labels=["node"],
        )
        age = GaugeMetricFamily(
            "kvpool_index_last_event_age_seconds",
            "Seconds since the node's last chunk event (absent before the first).",
            labels=["node"],
        )
        lag = GaugeMetricFamily(
            "kvpool_index_event_lag_seconds",
            "Receive time minus publish time of the node's last chunk event.",
            labels=["node"],
        )
        now = self._clock()
        for agent in sorted(self._agents(), key=lambda status: status.endpoint.node):
            node = agent.endpoint.node
            events.add_metric([node], agent.events)
            for reason, count in agent.resyncs.items():
                resyncs.add_metric([node, reason], count)
            failures.add_metric([node], agent.snapshot_failures)
            synced.add_metric([node], int(agent.synced))
            connected.add_metric([node], int(agent.connected))
            if agent.last_event is not None:
                age.add_metric([node], max(0.0, now - agent.last_event))
            if agent.event_lag is not None:
                lag.add_metric([node], agent.event_lag)
        yield from (events, resyncs, failures, synced, connected, age, lag)


class _PickerCollector(Collector):
    def __init__(
        self,
        answers: Callable[[], dict[tuple[int, str], int]],
        servers: Callable[[], Sequence[ServerState]],
    ) -> None:
        self._answers = answers
        self._servers = servers

    def collect(self) -> Iterator[Metric]:
        answers = CounterMetricFamily(
            "kvpool_index_picker_answers",
            "What the endpoint picker answered the gateway, by HTTP status and reason.",
            labels=["status", "reason"],
        )
        for (status, reason), count in sorted(self._answers().items()):
            answers.add_metric([str(status), reason], count)
        yield answers
        ready = GaugeMetricFamily(
            "kvpool_index_model_server_ready",
            "1 while the model server's /metrics answers (it is then a candidate).",
            labels=["server", "node"],
        )
        slow = GaugeMetricFamily(
            "kvpool_index_model_server_slow_reads",
            "Reads of the model server's /metrics in a row that outlasted "
            "picker.load_timeout_seconds (its last load is kept through two).",
            labels=["server"],
        )
        waiting = GaugeMetricFamily(
            "kvpool_index_model_server_waiting",
            "Requests waiting in the model server, as it last said.",
            labels=["server"],
        )
        running = GaugeMetricFamily(
            "kvpool_index_model_server_running",
            "Requests running in the model server, as it last said.",
            labels=["server"],
        )
        usage = GaugeMetricFamily(
            "kvpool_index_model_server_kv_cache_usage",
            "Share of the model server's KV cache in use (0 to 1), as it last said.",
            labels=["server"],
        )
        for server in self._servers():
            ready.add_metric([server.address, server.node], int(server.ready))
            slow.add_metric([server.address], server.slow_reads)
            if server.load is not None:
                waiting.add_metric([server.address], server.load.waiting)
                running.add_metric([server.address], server.load.running)
                usage.add_metric([server.address], server.load.kv_cache_usage)
        yield from (ready, slow, waiting, running, usage)


class _PlacementsCollector(Collector):
    def __init__(self, status: Callable[[], PublisherStatus]) -> None:
        self._status = status

    def collect(self) -> Iterator[Metric]:
        status = self._status()
        yield CounterMetricFamily(
            "kvpool_index_placement_event_batches",
            "Batches of placement events published (the next batch's seq).",
            value=status.seq,
        )
        yield CounterMetricFamily(
            "kvpool_index_placement_event_batches_dropped",
            "Batches of placement events not sent: the PUB socket was at its high-water mark.",
            value=status.dropped,
        )
        requests = CounterMetricFamily(
            "kvpool_index_placement_event_requests",
            "Recovery requests on the replay port, by kind (replay, snapshot, malformed).",
            labels=["kind"],
        )
        for kind, count in sorted(status.requests.items()):
            requests.add_metric([kind], count)
        yield requests
        held = GaugeMetricFamily(
            "kvpool_index_placements",
            "Placements published and not removed, by medium (what a snapshot lists).",
            labels=["medium"],
        )
        for medium, count in sorted(status.placements.items()):
            held.add_metric([medium], count)
        yield held
        yield GaugeMetricFamily(
            "kvpool_index_placement_topics",
            "Model servers (topics) with some placement.",
            value=status.topics,
        )


class IndexMetrics:
    """The :class:`~kvpool.index.service.QueryObserver` of the index process."""

    def __init__(
        self,
        registry: CollectorRegistry,
        tracker: PrefixTracker,
        agents: Callable[[], list[AgentStatus]],
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.registry = registry
        registry.register(_IndexCollector(tracker, agents, clock))
        self._latency = Histogram(
            "kvpool_index_query_seconds",
            "Time to answer a lookup or route in the index, key hashing included, by operation.",
            ["op"],
            buckets=_QUERY_BUCKETS,
            registry=registry,
        )
        self._decisions = Counter(
            "kvpool_index_route_decisions",
            "Routing decisions, by reason (longest_match, overloaded, low_match).",
            ["reason"],
            registry=registry,
        )

    def register_placements(self, status: Callable[[], PublisherStatus]) -> None:
        """The placement events' publisher's counters (with ``picker.placement_events``)."""
        self.registry.register(_PlacementsCollector(status))

    def register_picker(
        self,
        answers: Callable[[], dict[tuple[int, str], int]],
        servers: Callable[[], Sequence[ServerState]],
    ) -> None:
        """The endpoint picker's numbers: its answers by status and reason, its picks by
        reason, disaggregation and time (:meth:`observe_pick`), each model server's load."""
        self.registry.register(_PickerCollector(answers, servers))
        self._picks = Counter(
            "kvpool_index_picks",
            "Endpoint picks, by reason (prefix, load, pd, fail_open, no_endpoint).",
            ["reason"],
            registry=self.registry,
        )
        self._disaggregations = Counter(
            "kvpool_index_pick_disaggregation",
            "Endpoint picks by whether they disaggregated prefill from decode (disaggregated) "
            "or why not (disabled, short, no_decode_ready, no_prefill_ready, prefill_busy).",
            ["outcome"],
            registry=self.registry,
        )
        self._pick_latency = Histogram(
            "kvpool_index_pick_seconds",
            "Time to pick an endpoint, prompt key hashing included.",
            buckets=_QUERY_BUCKETS,
            registry=self.registry,
        )

    def observe_pick(
        self, reason: PickReason | None, seconds: float, disaggregation: Disaggregation | None
    ) -> None:
        """A :class:`~kvpool.index.picker.PickObserver`: ``reason`` None is a request no
        endpoint could take."""
        self._picks.labels(reason.value if reason is not None else "no_endpoint").inc()
        self._pick_latency.observe(seconds)
        if disaggregation is not None:
            self._disaggregations.labels(disaggregation.value).inc()

    def register_http(self, refusals: HttpRefusals) -> None:
        """Count what the HTTP server refuses (see
        :func:`~kvpool.common.web.serving.serve_http`)."""
        self.registry.register(HttpRefusalsCollector(refusals, "kvpool_index_http_refused"))

    def observe_query(self, op: str, seconds: float) -> None:
        self._latency.labels(op).observe(seconds)

    def observe_decision(self, decision: Decision) -> None:
        self._decisions.labels(decision.reason.value).inc()

    def exposition(self) -> tuple[bytes, str]:
        """The text format body and its content type, for GET /metrics."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
