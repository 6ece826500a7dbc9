from __future__ import annotations

import hashlib
import mmap
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool_agent.core.l1 import IDLE_TENANTS, L1Cache
from kvpool_agent.core.policies import policy_factory
from kvpool_agent.core.quota_book import QuotaBook
from kvpool_agent.segment import SegmentLayout, SharedSegment
from kvpool_agent.service.cache_service import CacheService
from kvpool_agent.tenancy.quota_store import FileQuotaStore
from kvpool_agent.testing.agent_process import AgentProcess

PAGE = 4096


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def key(name: str | int) -> bytes:
    return hashlib.sha256(str(name).encode()).digest()


def make_cache(
    *,
    pages: int = 100,
    policy: str = "lru",
    quotas: QuotaBook | None = None,
    clock: FakeClock | None = None,
    high: float = 0.9,
    low: float = 0.8,
    idle_tenants: int = IDLE_TENANTS,
) -> L1Cache:
    return L1Cache(
        SegmentLayout(page_size=PAGE, data_offset=PAGE, data_size=PAGE * pages),
        policy_factory(policy),
        quotas or QuotaBook(),
        high_watermark=high,
        low_watermark=low,
        lease_seconds=30.0,
        clock=clock or FakeClock(),
        idle_tenants=idle_tenants,
    )


def make_service(cache: L1Cache, quota_file: Path) -> CacheService:
    """A service over ``cache``, its segment anonymous memory laid out like the cache's."""
    layout = cache.layout
    segment = SharedSegment(Path("anonymous"), layout, mmap.mmap(-1, layout.total_size))
    return CacheService(cache, segment, FileQuotaStore(quota_file))


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def agent_process(tmp_path: Path) -> Iterator[AgentProcess]:
    """A real agent process (not started: set ``settings`` first, then call ``start()``)."""
    process = AgentProcess(tmp_path)
    yield process
    process.cleanup()
