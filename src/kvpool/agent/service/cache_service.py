"""The cache service: the one seam through which every edge reaches the L1 cache.

The ZMQ server, the HTTP API, the maintenance task and the L2 controllers
(write-back, prefetch) call these operations; none of them takes the lock or
touches the cache itself. An operation raises the cache's domain errors
(:class:`~kvpool.agent.core.l1.CacheError` and its kinds); each edge maps them to
its own replies.

Data path: :meth:`CacheService.lookup` (a hit tells the write-back, a miss may
start a prefetch), :meth:`~CacheService.reserve`, :meth:`~CacheService.commit`
(tells the write-back), :meth:`~CacheService.release`, and
:meth:`~CacheService.store` / :meth:`~CacheService.retrieve`, which copy bytes
for callers that cannot map the segment (and for the prefetch). The L2
controllers attach through the small protocols below, given at composition
(:meth:`~CacheService.attach_lower_tiers`): the service imports no L2 code.

Pins and shared spaces: :meth:`~CacheService.put_pin` and the rest keep a tenant's pins
(:mod:`kvpool.agent.core.l1.pin_sets`); :meth:`~CacheService.replace_spaces` takes the
tenants ConfigMap's spaces (their pin budgets, and what :meth:`~CacheService.spaces`
reports); :meth:`~CacheService.warm` loads a prefix from L2 through the prefetch hook and
waits for it.

:class:`CacheService` is one composition of the facades its edges use, each in a module of
its own over the state they share (:class:`~kvpool.agent.service.state.ServiceState`):
:class:`~kvpool.agent.service.data_service.DataService` (the data path),
:class:`~kvpool.agent.service.pin_service.PinService` (pins, shared spaces),
:class:`~kvpool.agent.service.quota_service.QuotaService` (quotas, ceilings) and
:class:`~kvpool.agent.service.report_service.ReportService` (usage, counters). An edge that
needs one of them may be given the one.

One lock: cache operations take microseconds, so it serves them all; bulk
copies happen outside it while the chunks are write-locked (store) or
read-locked (retrieve). Quota writes do their I/O outside it (under a lock of
their own, so that two writers apply in the order they stored). Reports
(status, metrics, tenant lists) take the lock for O(1) figures and a copy of
the tenant record list only; reading, ranking and formatting thousands of
tenants happens outside it, so an unauthenticated ``/metrics`` poller cannot
stall the data path.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvpool.agent.service.data_service import DataService
from kvpool.agent.service.hooks import (
    PrefetchHook,
    SequencedListener,
    TenantBytes,
    TenantDrop,
    TierKeys,
    WriteBackHook,
)
from kvpool.agent.service.pin_service import PinService
from kvpool.agent.service.quota_service import QuotaService
from kvpool.agent.service.report_service import ReportService


class CacheService(DataService, PinService, QuotaService, ReportService):
    """The service: every facade over one cache, one lock and the hooks attached here."""

    # ------------------------------------------------------------ composition

    def publish_events(
        self, events: SequencedListener, listed_tiers: Mapping[str, TierKeys] | None = None
    ) -> None:
        """Tell ``events`` of every chunk stored or removed from now on (under the lock).

        ``listed_tiers``: the lower tiers that publish into the same sequence and whose keys
        a :meth:`snapshot` can list, by tier name.
        """
        with self._lock:
            self._events = events
            self._listed_tiers = dict(listed_tiers or {})
            self._cache.listener = events

    def attach_lower_tiers(
        self,
        write_back: WriteBackHook,
        prefetch: PrefetchHook,
        drop: TenantDrop,
        nvme_used: TenantBytes | None = None,
    ) -> None:
        """L2 tiers exist: commits and hits go to ``write_back``, misses to ``prefetch``,
        :meth:`drop_tenant` to ``drop``, :meth:`nvme_used` to ``nvme_used`` (None: no
        NVMe tier).

        The cache then also accepts a run whose predecessor it lacks (a prefetch can
        bring the prefix back).
        """
        with self._lock:
            self._write_back = write_back
            self._prefetch = prefetch
            self._drop_lower = drop
            self._nvme_used = nvme_used
            self._cache.lower_tier = True
