"""The agent's HTTP API bodies: what its routes take and answer.

The operator (tenant usage, clearing) and ``kvpool doctor`` parse the agent's answers with
these models, so they live apart from the app (:mod:`kvpool_agent.edge.http_api`): this
module imports no web framework.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictInt

from kvpool_agent.quotas import TierLimits

MAX_LIMIT_BYTES = 2**53
"""Largest quota accepted (8 PiB): every integer up to it is exact as a JSON double, so a
client that holds numbers as doubles (JavaScript, many JSON Schema validators) never sends
a schema-valid value that rounds past the bound."""


class CacheStatus(BaseModel):
    """State of the node's L1 cache (all tenants)."""

    capacity_bytes: int = Field(description="Bytes of chunk data the L1 segment holds.")
    allocated_bytes: int = Field(description="Bytes in allocated pages (whole pages per chunk).")
    stored_bytes: int = Field(description="Bytes of chunk data stored (being written or ready).")
    chunks: int = Field(description="Chunks in the index.")
    hits: int = Field(description="Chunks found by lookups since start.")
    misses: int = Field(description="Chunks looked up and not found since start.")
    written_bytes: int = Field(description="Bytes of chunks committed since start.")
    read_bytes: int = Field(description="Bytes of chunks handed to readers since start.")
    evictions: dict[str, int] = Field(
        description="Chunks evicted since start, by cause: watermark, pressure, quota."
    )
    lock_expiries: int = Field(description="Leases that expired instead of being released.")
    open_leases: int = Field(description="Read and write leases open now.")
    quarantined_leases: int = Field(
        description="Write leases that expired before their commit since start (their pages "
        "were held back from reuse: a stalled writer may still copy into them)."
    )
    quarantined_bytes: int = Field(description="Bytes in pages held back that way now.")
    free_extents: int = Field(description="Runs of free pages.")
    fragmentation: float = Field(
        description="External fragmentation: 1 - largest free extent / free bytes."
    )
    page_waste: float = Field(
        description="Share of allocated bytes lost to rounding chunks up to whole pages."
    )
    tenant_count: int = Field(
        description="Tenant records: tenants holding chunks or a quota, and the most recently "
        "active of those holding nothing (up to a bound)."
    )


class Quota(BaseModel):
    tenant: str = Field(description="Tenant id (32 lowercase hex characters).")
    limit_bytes: int | None = Field(
        description="Bytes the tenant may keep in L1; 0 = no caching, null = unlimited."
    )
    nvme_limit_bytes: int | None = Field(
        description="Bytes the tenant may keep in this node's NVMe tier; null = unlimited."
    )
    explicit: bool = Field(
        description="True if the tenant has its own quota; false if the default applies "
        "(lowered to the tenant's ceiling, if its KVCacheTenant sets one)."
    )


def _integral_float_as_int(value: object) -> object:
    """JSON Schema's integer includes 4096.0: take it as 4096 (1.5, "1" and true still fail)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


_LimitBytes = (
    Annotated[StrictInt, Field(ge=0, le=MAX_LIMIT_BYTES), BeforeValidator(_integral_float_as_int)]
    | None
)


class QuotaUpdate(BaseModel):
    """A tenant's new quota, stored durably and applied at once (shrinking evicts).

    A tenant's own token may set at most its ceiling in each tier, or without a ceiling the
    pool's default tenant quota (403 above it; null, unlimited, is above any bound).
    """

    model_config = ConfigDict(extra="forbid")

    limit_bytes: _LimitBytes = Field(
        description="Bytes the tenant may keep in L1: an integer >= 0 (0 = no caching), "
        "or null for unlimited.",
        examples=[8 << 30, 0, None],
    )
    nvme_limit_bytes: _LimitBytes = Field(
        None,
        description="Bytes the tenant may keep in the NVMe tier, or null for unlimited; "
        "absent: the same as limit_bytes.",
        examples=[64 << 30],
    )

    def limits(self) -> TierLimits:
        if "nvme_limit_bytes" not in self.model_fields_set:
            return TierLimits.both(self.limit_bytes)
        return TierLimits(self.limit_bytes, self.nvme_limit_bytes)


class Usage(BaseModel):
    tenant: str = Field(description="Tenant id.")
    used_bytes: int = Field(description="Bytes of the tenant's chunks in L1.")
    nvme_used_bytes: int = Field(
        description="Bytes of the tenant's files in this node's NVMe tier; 0 without one."
    )
    chunks: int = Field(description="The tenant's chunks in L1.")
    quota_bytes: int | None = Field(description="The tenant's quota; null = unlimited.")
    hits: int = Field(description="Chunks the tenant found since start.")
    misses: int = Field(description="Chunks the tenant looked up and did not find.")
    stored_chunks: int = Field(description="Chunks the tenant stored since start.")
    evicted_chunks: int = Field(description="The tenant's chunks evicted since start.")


class TenantUsages(BaseModel):
    """Every tenant the cache has an account for; counters run since the agent started."""

    tenants: list[Usage] = Field(description="One entry per tenant, in no particular order.")


class Cleared(BaseModel):
    dropped_chunks: int = Field(
        description="Chunks dropped; locked ones are freed when their readers finish."
    )
    l2_dropped_objects: int | None = Field(
        None,
        description="With tiers=all: objects deleted from the L2 tiers (this node's NVMe "
        "files and the pool's S3 objects of the tenant); null otherwise.",
    )
