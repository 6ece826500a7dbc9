"""Build the L1 pieces (segment, pinning, index) from the agent's configuration."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvpool_agent.config import AgentConfig
from kvpool_agent.l1 import L1Cache
from kvpool_agent.pinned import PinnedRegion, pin
from kvpool_agent.policies import policy_factory
from kvpool_agent.quotas import QuotaBook
from kvpool_agent.segment import SharedSegment

log = logging.getLogger(__name__)


@dataclass
class L1Tier:
    """The mapped segment and the cache that manages it; ``close`` undoes ``open_l1``."""

    segment: SharedSegment
    cache: L1Cache
    pinned: PinnedRegion | None

    def close(self) -> None:
        if self.pinned is not None:
            self.pinned.release()
        self.segment.close()


def open_l1(config: AgentConfig) -> L1Tier:
    path = config.resolved_segment_path
    segment = SharedSegment.create(path, int(config.l1_size), int(config.page_size))
    pinned = pin(segment.mapping, config.pin_memory)
    cache = L1Cache(
        segment.layout,
        policy_factory(config.eviction_policy),
        QuotaBook(default=_limit(config.default_tenant_quota)),
        high_watermark=config.high_watermark,
        low_watermark=config.low_watermark,
        lease_seconds=config.lease_seconds,
    )
    log.info(
        "L1 segment %s: %d pages of %d bytes, policy %s, pinned %s",
        path,
        segment.layout.pages,
        segment.layout.page_size,
        config.eviction_policy,
        pinned is not None,
    )
    return L1Tier(segment, cache, pinned)


def _limit(value: int | None) -> int | None:
    return None if value is None else int(value)
