"""The agent's HTTP API bodies: what its routes take and answer.

The operator (tenant usage, clearing) and ``kvpool doctor`` parse the agent's answers with
these models, so they live apart from the app (:mod:`kvpool.agent.edge.http_api`): this
module imports no web framework.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictInt, StringConstraints

from kvpool.common.quotas import TierLimits

MAX_LIMIT_BYTES = 2**53
"""Largest quota accepted (8 PiB): every integer up to it is exact as a JSON double, so a
client that holds numbers as doubles (JavaScript, many JSON Schema validators) never sends
a schema-valid value that rounds past the bound."""


MAX_REQUEST_KEYS = 8192
"""Keys one pin or warm request may name (as many as one ZMQ request)."""
MAX_WARM_SECONDS = 60.0
"""The longest a warm request waits for its chunks."""
PIN_NAME_PATTERN = r"^[a-z0-9]([-._a-z0-9]{0,61}[a-z0-9])?$"
"""A pin's name: 1 to 63 lowercase letters, digits, '-', '.' and '_', alphanumeric at both ends."""

ChunkKey = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
"""A chunk key as the HTTP API spells it: 32 bytes in 64 lowercase hex characters."""


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


class PinUpdate(BaseModel):
    """The keys of a pin, replacing those it had."""

    model_config = ConfigDict(extra="forbid")

    keys: list[ChunkKey] = Field(
        max_length=MAX_REQUEST_KEYS,
        description="Chunk keys (64 lowercase hex characters each), a prompt's head first: "
        "where the pin budget cannot hold every chunk, it holds those pinned first.",
    )


class Pin(BaseModel):
    name: str = Field(description="The pin's name.")
    keys: int = Field(description="Keys the pin names.")
    resident_keys: int = Field(description="Of those, keys whose chunk is in L1 now.")
    pinned_keys: int = Field(
        description="Of those, chunks the pin budget holds pinned (the rest are evictable)."
    )
    pinned_bytes: int = Field(description="Bytes of the chunks pinned.")


class Pins(BaseModel):
    """A tenant's pins in this agent's L1 (pins live in memory: set them again after a
    restart)."""

    tenant: str = Field(description="Tenant id.")
    budget_bytes: int = Field(
        description="Bytes of L1 the tenant's pinned chunks may hold (its space's pinBudget, "
        "else the agent's default_pin_budget)."
    )
    pinned_bytes: int = Field(description="Bytes of L1 its pinned chunks hold now.")
    pins: list[Pin] = Field(description="Its pins, in the order they were first set.")


class WarmRequest(BaseModel):
    """Keys to bring from L2 (NVMe, then S3) into this agent's L1."""

    model_config = ConfigDict(extra="forbid")

    keys: list[ChunkKey] = Field(
        max_length=MAX_REQUEST_KEYS,
        description="Chunk keys of one prompt prefix, in order (64 lowercase hex characters "
        "each): loading stops at the first key that no tier holds.",
    )
    timeout_s: float = Field(
        5.0,
        ge=0,
        le=MAX_WARM_SECONDS,
        description="Seconds to wait for the chunks at most; the load goes on past them.",
    )


class Warmed(BaseModel):
    keys: int = Field(description="Keys asked for.")
    resident: int = Field(
        description="Leading keys whose chunks are in L1 now (what a lookup would hit)."
    )
    loaded: int = Field(description="Chunks this warm loaded from L2 into L1 before it answered.")
    missing: int | None = Field(
        description="Keys from the first that neither L1 nor any L2 tier holds, to the end; "
        "null if the tiers were not searched within timeout_s."
    )
    done: bool = Field(description="False if timeout_s passed first (the load goes on).")


class SpaceUsage(BaseModel):
    space: str = Field(description="The shared space's tenant id.")
    source: str = Field(
        description="Where it is declared: namespace/pool/name (a KVCachePool's "
        "spec.sharedSpaces), or 'tokens file'."
    )
    members: int = Field(description="Tenants that may use its chunks.")
    owners: int = Field(description="Tenants that may also pin and warm them.")
    usage: Usage = Field(description="Its usage, as the tenant usage route gives it.")
    pinned_bytes: int = Field(description="Bytes of L1 its pinned chunks hold.")
    pin_budget_bytes: int = Field(description="Bytes of L1 its pinned chunks may hold.")


class Spaces(BaseModel):
    """The shared spaces this agent knows, from the pool's tenants ConfigMap and its tokens
    file."""

    spaces: list[SpaceUsage] = Field(description="One entry per space, in no particular order.")


class PeerState(BaseModel):
    node: str = Field(description="The peer's node name.")
    endpoint: str = Field(description="Where it serves peers, host:port.")
    reachable: bool | None = Field(
        description="The last connection (or probe) got through and both sides proved the pool's "
        "credential; null if never tried."
    )
    error: str | None = Field(description="Why the last attempt failed, in one line.")
    rtt_ms: float | None = Field(description="Round trip of the last probe, in milliseconds.")
    fetched_chunks: int = Field(description="Chunks pulled from this peer into L1.")
    fetched_bytes: int = Field(description="Their bytes.")
    failures: int = Field(description="Fetches from this peer that ended in a miss by failure.")
    transport: Literal["tcp", "nixl"] | None = Field(
        description="What carried the last request's chunk bodies: tcp, or nixl (the transfer "
        "engine, into a landing of this agent's); null if never connected."
    )


class PeerServing(BaseModel):
    wire_protection: Literal["sealed", "integrity"] = Field(
        description="What the chunks sent to peers carry: sealed (ciphertext) or integrity "
        "(plaintext under its authentication tag)."
    )
    transport: Literal["tcp", "nixl"] = Field(
        description="What carries the chunk bodies this agent sends and receives: tcp, or "
        "nixl (the transfer engine)."
    )
    transport_fallback: str | None = Field(
        description="Why it is tcp though peers.transport says nixl (NIXL did not start)."
    )
    transfers_in_flight: int = Field(description="Transfers being served now.")
    bytes_in_flight: int = Field(description="Their bytes.")
    max_transfers: int = Field(description="Transfers served at once at most.")
    max_bytes_in_flight: int = Field(description="Bytes served at once at most.")
    bandwidth_bytes_per_second: int = Field(description="The serving cap; 0: none.")
    served_chunks: int = Field(description="Chunks sent to peers.")
    served_bytes: int = Field(description="Their bytes.")
    refused: dict[str, int] = Field(description="Requests refused, by reason.")


class Peers(BaseModel):
    """This agent's peers (the pool's other agents) and what it serves them."""

    node: str = Field(description="This agent's name among its peers.")
    port: int = Field(description="The port it serves peers on.")
    peers: list[PeerState] = Field(description="One entry per known peer, by node name.")
    serving: PeerServing
