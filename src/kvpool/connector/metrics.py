"""Counters at vLLM's edge: ``KVConnectorStats`` for its logs, Prometheus for ``/metrics``.

vLLM sums the stats of the scheduler and of every worker each step
(:meth:`KVPoolConnectorStats.aggregate`), logs them, and hands them to
:class:`KVPoolConnectorPromMetrics`, which owns the ``vllm:kvpool_<name>_total`` counters
(one per :data:`~kvpool.connector.counters.COUNTERS` entry, labelled like
vLLM's other metrics).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

from prometheus_client import Counter
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from kvpool.connector.counters import COUNTERS

METRIC_PREFIX = "vllm:kvpool_"


@dataclass
class KVPoolConnectorStats(KVConnectorStats):
    """``data`` maps counter names to counts since the last report."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, count in other.data.items():
            self.data[name] = self.data.get(name, 0) + count
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KVPoolConnectorPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, PromMetric]] = {
            name: create_metric_per_engine(
                self._counter_cls(
                    name=f"{METRIC_PREFIX}{name}", documentation=help_text, labelnames=labelnames
                ),
                per_engine_labelvalues,
            )
            for name, help_text in COUNTERS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, count in transfer_stats_data.items():
            per_engine = self._counters.get(name)
            if per_engine is not None and count:
                cast(Counter, per_engine[engine_idx]).inc(count)
