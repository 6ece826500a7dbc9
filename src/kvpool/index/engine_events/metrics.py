"""The GPU tier's per-server numbers for ``/metrics``, read from
:meth:`~kvpool.index.engine_events.EngineEvents.status` at scrape time.

Register it next to the index's collector:
``registry.register(EngineEventsCollector(engine_events.status))``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvpool.index.engine_events.follower import EngineStatus

_LABELS = ["server"]


class EngineEventsCollector(Collector):
    def __init__(self, status: Callable[[], list[EngineStatus]]) -> None:
        self._status = status

    def collect(self) -> Iterator[Metric]:
        def gauge(name: str, text: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"kvpool_index_gpu_{name}", text, labels=_LABELS)

        def counter(name: str, text: str) -> CounterMetricFamily:
            return CounterMetricFamily(f"kvpool_index_gpu_{name}", text, labels=_LABELS)

        connected = gauge(
            "connected", "1 while the index is connected to the server's vLLM KV events."
        )
        blocks = gauge("blocks", "GPU blocks the server holds, as followed from its KV events.")
        chunks = gauge("chunks", "kvpool chunk keys the server's GPU blocks hold whole.")
        last_seq = gauge("last_seq", "Sequence number of the server's last KV-event batch applied.")
        messages = counter("messages", "KV-event batches applied, by server.")
        events = counter("events", "KV events applied, by server.")
        resets = counter("restarts", "vLLM restarts seen (its event numbers started over).")
        gaps = counter("gaps", "Jumps in the server's event numbers (events lost).")
        replays = counter("replays", "Gaps filled from vLLM's replay endpoint.")
        drops = counter("drops", "Times the server's GPU entries were dropped to start over.")
        clears = counter("clears", "Resets of vLLM's prefix cache (AllBlocksCleared).")
        undecodable = counter("undecodable", "KV-event messages or events that did not decode.")
        unfollowed = CounterMetricFamily(
            "kvpool_index_gpu_blocks_not_followed",
            "Blocks not followed, by server and reason (unplaced: unknown parent; skipped: "
            "LoRA, multimodal, another group or medium; capped: over the server's cap).",
            labels=["server", "reason"],
        )
        for status in sorted(self._status(), key=lambda s: s.address):
            server = [status.address]
            connected.add_metric(server, int(status.connected))
            blocks.add_metric(server, status.blocks)
            chunks.add_metric(server, status.chunks)
            if status.last_seq is not None:
                last_seq.add_metric(server, status.last_seq)
            messages.add_metric(server, status.messages)
            events.add_metric(server, status.events)
            resets.add_metric(server, status.resets)
            gaps.add_metric(server, status.gaps)
            replays.add_metric(server, status.replays)
            drops.add_metric(server, status.drops)
            clears.add_metric(server, status.clears)
            undecodable.add_metric(server, status.undecodable)
            for reason in ("unplaced", "skipped", "capped"):
                unfollowed.add_metric([status.address, reason], getattr(status, reason))
        yield from (connected, blocks, chunks, last_seq, messages, events, resets, gaps)
        yield from (replays, drops, clears, undecodable, unfollowed)
