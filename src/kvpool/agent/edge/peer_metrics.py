"""The peer tier's metrics: what this agent serves its peers, what it pulls from each, and
the offers it sends and receives."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvpool.agent.peer.links import PeerLink
from kvpool.agent.peer.node import PeerTier
from kvpool.agent.peer.serving import ServingStats

SERVING_REFUSALS = ("busy", "unproven", "malformed", "timeout", "handshakes", "connections")
FETCH_FAILURES = ("unreachable", "unproven", "timeout", "broken", "integrity")
OFFERS_SENT = ("accepted", "busy", "failed", "dropped", "unknown")
OFFERS_RECEIVED = ("accepted", "present", "busy")


class PeerCollector(Collector):
    def __init__(self, peers: PeerTier) -> None:
        self._peers = peers

    def collect(self) -> Iterator[Metric]:
        server = self._peers.server
        yield from _serving(server.stats if server is not None else ServingStats())
        yield from _fetching(self._peers.directory.links())
        sent = CounterMetricFamily(
            "kvpool_peer_offers_sent",
            "Offers of a disaggregated prefill's chunks to its decode's node, by outcome: "
            "accepted (the peer pulls them), busy, failed, dropped (too many in flight "
            "here), unknown (no peer on that node).",
            labels=["outcome"],
        )
        for outcome in OFFERS_SENT:
            sent.add_metric([outcome], self._peers.offers.stats.sent[outcome])
        yield sent
        received = CounterMetricFamily(
            "kvpool_peer_offers_received",
            "Offers from peers, by outcome: accepted (a pull started), present (L1 held "
            "them all), busy (no prefetch slot).",
            labels=["outcome"],
        )
        stats = server.stats if server is not None else ServingStats()
        for outcome in OFFERS_RECEIVED:
            received.add_metric([outcome], stats.offers[outcome])
        yield received
        located = CounterMetricFamily(
            "kvpool_peer_index_lookups",
            "Prefixes the pool's index was asked to locate among the peers: answered, or "
            "failed (every peer was asked instead).",
            labels=["result"],
        )
        for result in ("answered", "failed"):
            located.add_metric([result], self._peers.adapter.index_lookups[result])
        yield located


def _serving(stats: ServingStats) -> Iterator[Metric]:
    yield CounterMetricFamily(
        "kvpool_peer_served_chunks", "Chunks sent to peers.", value=stats.served_chunks
    )
    yield CounterMetricFamily(
        "kvpool_peer_served_bytes", "Bytes of chunks sent to peers.", value=stats.served_bytes
    )
    refused = CounterMetricFamily(
        "kvpool_peer_refused",
        "Peer requests or connections refused: busy (at max_transfers or max_bytes_in_flight), "
        "unproven (no pool credential), malformed, timeout (not proven within the handshake's "
        "deadline), handshakes (dropped for a newer one: too many in their handshake), "
        "connections (too many proven).",
        labels=["reason"],
    )
    for reason in SERVING_REFUSALS:
        refused.add_metric([reason], stats.refused[reason])
    yield refused
    yield GaugeMetricFamily(
        "kvpool_peer_transfers_in_flight",
        "Transfers being served to peers.",
        value=stats.transfers_in_flight,
    )
    yield GaugeMetricFamily(
        "kvpool_peer_bytes_in_flight", "Bytes being served to peers.", value=stats.bytes_in_flight
    )


def _fetching(links: list[PeerLink]) -> Iterator[Metric]:
    chunks = CounterMetricFamily(
        "kvpool_peer_fetched_chunks", "Chunks pulled from each peer into L1.", labels=["peer"]
    )
    nbytes = CounterMetricFamily(
        "kvpool_peer_fetched_bytes", "Bytes pulled from each peer.", labels=["peer"]
    )
    failures = CounterMetricFamily(
        "kvpool_peer_fetch_failures",
        "Requests to peers that failed (each a miss there), by reason.",
        labels=["reason"],
    )
    reachable = GaugeMetricFamily(
        "kvpool_peer_reachable",
        "1 if the last request to the peer got through, 0 if it failed (absent: never tried).",
        labels=["peer"],
    )
    totals = dict.fromkeys(FETCH_FAILURES, 0)
    for link in links:
        chunks.add_metric([link.node], link.stats.fetched_chunks)
        nbytes.add_metric([link.node], link.stats.fetched_bytes)
        if link.stats.reachable is not None:
            reachable.add_metric([link.node], float(link.stats.reachable))
        for reason, count in link.stats.failures.items():
            totals[reason] = totals.get(reason, 0) + count
    for reason, count in totals.items():
        failures.add_metric([reason], count)
    yield from (chunks, nbytes, failures, reachable)
