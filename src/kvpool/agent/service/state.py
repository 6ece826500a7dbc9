"""What every part of the service shares: the L1 cache under one lock, the chunk files, the
quota store, and the hooks attached at composition (events, write-back, prefetch, L2
drops, NVMe usage).

One lock: cache operations take microseconds, so it serves them all; bulk copies happen
outside it while the chunks are write-locked (store) or read-locked (retrieve).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvpool.agent.core.l1 import L1Cache
from kvpool.agent.service.hooks import (
    PrefetchHook,
    SequencedListener,
    TenantBytes,
    TenantDrop,
    TierKeys,
    WriteBackHook,
)
from kvpool.agent.service.results import WarmCounts
from kvpool.agent.tenancy.quota_store import QuotaStore
from kvpool.common.chunk_files import ChunkFiles
from kvpool.common.tenants_configmap import SpaceEntry


class ServiceState:
    """The state the service's facades (data, pins, quotas, reports) share."""

    def __init__(self, cache: L1Cache, files: ChunkFiles, quota_store: QuotaStore) -> None:
        self._cache = cache
        self._files = files
        self._lock = threading.Lock()
        self._quota_store = quota_store
        self._quota_writes = threading.Lock()
        self._events: SequencedListener | None = None
        self._listed_tiers: dict[str, TierKeys] = {}
        """The lower tiers a snapshot can list, by tier name."""
        self._write_back: WriteBackHook | None = None
        self._prefetch: PrefetchHook | None = None
        self._drop_lower: TenantDrop | None = None
        self._nvme_used: TenantBytes | None = None
        self._spaces: dict[str, SpaceEntry] = {}
        self.warm_counts = WarmCounts()
        self.quota_listeners: list[Callable[[str], None]] = []
        """Told (outside the locks) which tenant's quota changed, e.g. to shrink L2 tiers."""

    def nvme_used(self, tenant: str) -> int:
        """Bytes of the tenant's files in this node's NVMe tier; 0 without one."""
        return 0 if self._nvme_used is None else self._nvme_used(tenant)
