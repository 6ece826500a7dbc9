"""What an HTTP server refused by itself, as a Prometheus counter (the agent's and the
index's, each under its own name)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from kvpool.common.web.connections import HttpRefusals


class HttpRefusalsCollector(Collector):
    """``<name>_total{reason}``: one sample per :class:`~kvpool.common.web.connections.Refusal`."""

    def __init__(self, refusals: HttpRefusals, name: str) -> None:
        self._refusals = refusals
        self._name = name

    def collect(self) -> Iterator[Metric]:
        refused = CounterMetricFamily(
            self._name,
            "Requests and connections the HTTP server answered itself, by reason: "
            "head_too_large and too_many_headers (431), malformed_head (400), head_timeout "
            "(408), connections_full (503), send_timeout (aborted: responses left unread).",
            labels=["reason"],
        )
        for reason, count in sorted(self._refusals.counts.items()):
            refused.add_metric([reason], count)
        yield refused
