"""Open the configured L2 tiers, fastest first (NVMe, then S3)."""

from __future__ import annotations

from collections.abc import Callable

from kvpool_agent.config import AgentConfig
from kvpool_agent.l2 import L2Adapter, adapter_class


def open_tiers(config: AgentConfig, limit_of: Callable[[str], int | None]) -> list[L2Adapter]:
    tiers: list[L2Adapter] = []
    if config.nvme is not None:
        tiers.append(adapter_class("nvme")(config.nvme, config.pool, limit_of))  # type: ignore[call-arg]
    if config.s3 is not None:
        tiers.append(adapter_class("s3")(config.s3, config.pool))  # type: ignore[call-arg]
    return tiers
