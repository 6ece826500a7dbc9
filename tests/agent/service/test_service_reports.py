"""Status, tenant lists, metrics and maintenance hold the service lock briefly, any tenant count."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from kvpool.agent.core.factory import SegmentOrigin
from kvpool.agent.edge.metrics import AgentMetrics
from tests.support.chunks import key
from tests.support.l1 import PAGE, make_cache, make_service

TENANTS = 100_000


class TimedLock:
    """A lock that records how long each holder kept it (for this test only)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._since = 0.0
        self.holds: list[float] = []

    def __enter__(self) -> None:
        self._lock.acquire()
        self._since = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        self.holds.append(time.perf_counter() - self._since)
        self._lock.release()


def longest_hold(lock: TimedLock, report: Any) -> tuple[float, float]:
    """The longest lock hold while ``report()`` ran, and how long it ran (best of 5)."""
    holds, took = [], []
    for _ in range(5):
        lock.holds.clear()
        started = time.perf_counter()
        report()
        took.append(time.perf_counter() - started)
        holds.append(max(lock.holds))
    return min(holds), min(took)


def test_reports_on_many_tenants_hold_the_lock_for_a_small_part_of_their_work(
    tmp_path: Path,
) -> None:
    cache = make_cache(pages=TENANTS, high=1.0)
    for number in range(TENANTS):
        reservation = cache.reserve(f"t{number}", [key(number)], [PAGE // 2 + number % 100])
        assert reservation.lease is not None
        cache.commit(reservation.lease)
    service = make_service(cache, tmp_path / "quotas.json")
    lock = TimedLock()
    service._lock = lock  # type: ignore[assignment]  # measures the service's own holds
    origin = SegmentOrigin(False, "created", 0, 0, 0.0)

    def scrape() -> bytes:  # a first scrape: it ranks the tenants
        return AgentMetrics(CollectorRegistry(), service, 20, origin).exposition()[0]

    hold, render = longest_hold(lock, scrape)
    assert hold * 4 < render, f"/metrics held the lock {hold:.4f} s of {render:.4f} s"
    hold, listing = longest_hold(lock, service.tenants)
    assert hold * 4 < listing, f"/v1/tenants held the lock {hold:.4f} s of {listing:.4f} s"
    hold, _ = longest_hold(lock, service.stats)
    assert hold * 10 < render, f"/v1/status held the lock {hold:.4f} s"
    hold, _ = longest_hold(lock, service.maintain)  # every second: only over-quota tenants
    assert hold * 10 < listing, f"maintenance held the lock {hold:.4f} s"
    assert service.stats().tenant_count == TENANTS
    assert b'kvpool_tenant_chunks{tenant="other"} 99980.0' in scrape()
