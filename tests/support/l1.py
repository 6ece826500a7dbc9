"""In-process L1 caches and services for unit tests, and a clock the tests move."""

from __future__ import annotations

from pathlib import Path

from kvpool.agent.core.l1 import IDLE_TENANTS, L1Cache
from kvpool.agent.core.policies import policy_factory
from kvpool.agent.core.quota_book import QuotaBook
from kvpool.agent.service.cache_service import CacheService
from kvpool.agent.tenancy.quota_store import FileQuotaStore
from kvpool.common.chunk_files import ChunkFiles
from kvpool.common.segment import SegmentLayout
from tests.support.chunks import key

PAGE = 4096


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make_cache(
    *,
    pages: int = 100,
    policy: str = "lru",
    quotas: QuotaBook | None = None,
    clock: FakeClock | None = None,
    high: float = 0.9,
    low: float = 0.8,
    idle_tenants: int = IDLE_TENANTS,
    pin_budget: int = 0,
    lease_seconds: float = 30.0,
) -> L1Cache:
    return L1Cache(
        SegmentLayout(page_size=PAGE, data_offset=PAGE, data_size=PAGE * pages),
        policy_factory(policy),
        quotas or QuotaBook(),
        high_watermark=high,
        low_watermark=low,
        lease_seconds=lease_seconds,
        clock=clock or FakeClock(),
        idle_tenants=idle_tenants,
        pin_budget=pin_budget,
    )


def make_service(cache: L1Cache, quota_file: Path, files: Path | None = None) -> CacheService:
    """A service over ``cache``, its chunk files in ``files`` (default: beside
    ``quota_file``; the cache gives them no memory: pages come as the service writes them)."""
    layout = cache.layout
    chunk_files = ChunkFiles.open(
        files or quota_file.parent / "chunk-files",
        layout.total_size,
        layout.page_size,
        layout.data_offset,
        adopt=False,
    )
    return CacheService(cache, chunk_files, FileQuotaStore(quota_file))


def store(
    cache: L1Cache, tenant: str, names: list[int], size: int = PAGE, parent: int | None = None
) -> None:
    reservation = cache.reserve(
        tenant,
        [key(n) for n in names],
        [size] * len(names),
        None if parent is None else key(parent),
    )
    assert reservation.refused_reason is None, reservation.refused_reason
    if reservation.lease is not None:
        cache.commit(reservation.lease)


def hits(cache: L1Cache, tenant: str, names: list[int]) -> int:
    return cache.lookup(tenant, [key(n) for n in names], lock=False).count
