"""What a chunk costs to get from each L2 tier, measured: latency and bandwidth per tier.

Every get the prefetch makes is one sample (seconds, bytes). Each tier keeps a
moving average of its per-get latency (from small gets) and of its bandwidth
(from large ones); a chunk of ``n`` bytes is then expected to take
``latency + n / bandwidth``. Where several tiers hold a chunk, the prefetch
takes it from the one expected to be cheapest, so a tier that is slower than
the next one (a congested peer next to a fast S3 endpoint, say) is skipped.
Until a tier has samples of both kinds it keeps its place in the fixed order
(NVMe, peers, S3).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

SMOOTHING = 0.2
"""Weight of a new sample in the moving averages."""
SMALL_BYTES = 64 << 10
"""A get of at most this many bytes measures latency, a larger one bandwidth."""


@dataclass
class TierCost:
    latency: float | None = None
    """Seconds of a small get."""
    bandwidth: float | None = None
    """Bytes per second of a large get, beyond the latency."""

    def expected(self, nbytes: int) -> float | None:
        if self.bandwidth is None:
            return None
        return (self.latency or 0.0) + nbytes / self.bandwidth


class TierCosts:
    def __init__(self) -> None:
        self._costs: dict[str, TierCost] = {}
        self._lock = threading.Lock()

    def observe(self, tier: str, seconds: float, nbytes: int) -> None:
        with self._lock:
            cost = self._costs.setdefault(tier, TierCost())
            if nbytes <= SMALL_BYTES:
                cost.latency = _average(cost.latency, seconds)
                return
            beyond = max(seconds - (cost.latency or 0.0), 1e-9)
            cost.bandwidth = _average(cost.bandwidth, nbytes / beyond)

    def cost(self, tier: str) -> TierCost:
        with self._lock:
            found = self._costs.get(tier, TierCost())
            return TierCost(found.latency, found.bandwidth)

    def cheapest(self, tiers: list[str], nbytes: int) -> int:
        """The index in ``tiers`` (fastest first by their fixed order) to get a chunk of
        ``nbytes`` from: the first, unless a later one is expected to cost less."""
        best, best_cost = 0, self.cost(tiers[0]).expected(nbytes)
        for index, tier in enumerate(tiers[1:], start=1):
            cost = self.cost(tier).expected(nbytes)
            if cost is not None and best_cost is not None and cost < best_cost:
                best, best_cost = index, cost
        return best


def _average(old: float | None, sample: float) -> float:
    return sample if old is None else (1 - SMOOTHING) * old + SMOOTHING * sample
