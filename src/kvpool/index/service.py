"""The index's two questions, for the HTTP API and for gateways that embed the index.

:meth:`IndexService.lookup` ranks nodes by the prompt prefix they hold;
:meth:`IndexService.route` also picks one with the :class:`RoutingPolicy`.
Both time themselves (key hashing included) for the ``observer``.

Embedding the index in a Python gateway instead of running ``kvpool-index``::

    tracker = PrefixTracker()
    subscriber = EventSubscriber(tracker, token=index_token)  # an index token of the pool
    discovery = StaticDiscovery(endpoints)  # or KubernetesDiscovery.connect(pool, namespace)
    subscriber.start()
    discovery.start(subscriber.follow)
    service = IndexService(tracker, RoutingPolicy())
    route = service.route(Query.of_tokens(token_ids, salt, fingerprint), loads)

To follow the lower tiers too (NVMe, S3: the endpoint picker's), build ``trackers =
TierTrackers.create()`` and ``EventSubscriber(trackers.l1, tiers=trackers.lower(), ...)``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from kvpool.common.routing import Decision, RoutingPolicy
from kvpool.index.query import NodeMatch, Query
from kvpool.index.tracker import PrefixTracker


class QueryObserver(Protocol):
    def observe_query(self, op: str, seconds: float) -> None: ...

    def observe_decision(self, decision: Decision) -> None: ...


@dataclass(frozen=True)
class Route:
    decision: Decision
    matches: list[NodeMatch]
    """The candidates holding a prefix of the prompt, longest first."""


class IndexService:
    def __init__(
        self,
        tracker: PrefixTracker,
        policy: RoutingPolicy,
        observer: QueryObserver | None = None,
    ) -> None:
        self.tracker = tracker
        self.policy = policy
        self._observer = observer

    def lookup(self, query: Query, nodes: Iterable[str] | None = None) -> list[NodeMatch]:
        """Nodes holding a prefix of the prompt, longest first (ties by name); ``nodes``
        restricts the answer to those nodes."""
        started = time.perf_counter()
        matches = self._rank(query, nodes)
        if self._observer is not None:
            self._observer.observe_query("lookup", time.perf_counter() - started)
        return matches

    def route(self, query: Query, loads: Mapping[str, float]) -> Route:
        """The node among ``loads``' keys to send the prompt to, and the ranking behind it."""
        started = time.perf_counter()
        matches = self._rank(query, loads)
        decision = self.policy.choose(
            {match.node: match.tokens for match in matches}, loads, query.prompt_tokens
        )
        if self._observer is not None:
            self._observer.observe_query("route", time.perf_counter() - started)
            self._observer.observe_decision(decision)
        return Route(decision, matches)

    def _rank(self, query: Query, nodes: Iterable[str] | None) -> list[NodeMatch]:
        found = self.tracker.longest_prefixes(query.keys, nodes)
        matches = [
            NodeMatch(node, match.chunks, match.chunks * query.chunk_tokens, match.last_seen)
            for node, match in found.items()
        ]
        matches.sort(key=lambda match: (-match.chunks, match.node))
        return matches
