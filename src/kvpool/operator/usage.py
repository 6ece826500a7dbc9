"""A tenant's usage (a KVCacheTenant's or a shared space's) summed over a pool's agents, as
the statuses hold it."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from kvpool.common.api_models import Usage


def usage_summary(answers: Sequence[Usage]) -> dict[str, Any]:
    """The ``usage`` of a status from the agents' answers."""
    return {
        "l1Bytes": sum(answer.used_bytes for answer in answers),
        "nvmeBytes": sum(answer.nvme_used_bytes for answer in answers),
        "hits": sum(answer.hits for answer in answers),
        "misses": sum(answer.misses for answer in answers),
        "agents": len(answers),
        "readAt": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
