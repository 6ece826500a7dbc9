"""The statuses of kvpool's resources, as their CRDs declare them. The operator writes them
as plain objects (``kvpool.operator.status`` for pools, ``kvpool.operator.tenants`` for
tenants); these models are their schema."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import Field

from kvpool.operator.spec.base import Int64, SpecModel
from kvpool.operator.spec.markers import ATOMIC, list_map

ConditionStatus = Literal["True", "False", "Unknown"]


class PoolCondition(SpecModel):
    type: str = Field(description="Ready, Progressing, Degraded or SharedSpaces.")
    status: ConditionStatus = Field(description="Whether the condition holds.")
    reason: str = Field(description="One-word CamelCase reason.")
    message: str = Field(description="What a person should know.")
    last_transition_time: datetime = Field(description="When status last changed.")
    observed_generation: Int64 | None = Field(
        None, description="The generation the condition was computed for."
    )


class IndexStatus(SpecModel):
    replicas: int | None = Field(None, description="Index replicas the pool asks for.")
    ready_replicas: int | None = Field(None, description="Index replicas that are ready.")
    picker_port: int | None = Field(
        None,
        description="The endpoint picker's port on the index Service (spec.index.picker), "
        "for an InferencePool's endpointPickerRef; absent while the index serves none.",
    )


class PoolStatus(SpecModel):
    observed_generation: Int64 | None = Field(
        None, description="The generation of the spec that the children were last made from."
    )
    desired_nodes: int | None = Field(None, description="Nodes that should run an agent.")
    ready_nodes: int | None = Field(None, description="Nodes whose agent is ready.")
    updated_nodes: int | None = Field(
        None, description="Nodes whose agent runs the current configuration."
    )
    index: IndexStatus | None = Field(
        None,
        description="The prefix index's Deployment (kvpool-<pool>-index), while the pool has "
        "one. The pool's Ready condition is about the agents only.",
    )
    shared_spaces: tuple[SharedSpaceStatus, ...] | None = Field(
        None,
        description="The pool's shared spaces (spec.sharedSpaces), while it has some: their "
        "tenant ids, members and usage.",
        json_schema_extra=list_map("name"),
    )
    conditions: tuple[PoolCondition, ...] | None = Field(
        None,
        description="Ready, Progressing and Degraded, each with a reason and a message; "
        "SharedSpaces while the pool has some (whether every space is published and its "
        "pinned prefixes are on every agent).",
        json_schema_extra=list_map("type"),
    )


class TenantCondition(SpecModel):
    type: str = Field(description="Accepted or Ready.")
    status: ConditionStatus = Field(description="Whether the condition holds.")
    reason: str | None = Field(None, description="Why, in one CamelCase word.")
    message: str | None = Field(None, description="Why, for people.")
    observed_generation: Int64 | None = Field(
        None, description="The generation the condition is about."
    )
    last_transition_time: datetime | None = Field(None, description="When the status last changed.")


class TenantQuotaStatus(SpecModel):
    l1: Int64 | None = Field(None, description="Bytes of L1 on each node.")
    nvme: Int64 | None = Field(None, description="Bytes of NVMe on each node.")


class TenantUsage(SpecModel):
    l1_bytes: Int64 | None = Field(
        None, description="Bytes of the tenant's chunks in L1, all nodes together."
    )
    nvme_bytes: Int64 | None = Field(
        None, description="Bytes of the tenant's chunks on NVMe, all nodes together."
    )
    hits: Int64 | None = Field(None, description="Chunks the tenant found.")
    misses: Int64 | None = Field(None, description="Chunks the tenant looked up and did not find.")
    agents: int | None = Field(
        None, description="Agents that answered (of the pool's agents with an address)."
    )
    read_at: datetime | None = Field(None, description="When the usage was read.")


class SharedSpaceStatus(SpecModel):
    name: str = Field(description="The space's name (spec.sharedSpaces[].name).")
    tenant_id: str | None = Field(
        None, description="The tenant id the agents keep the space's chunks under."
    )
    members: tuple[str, ...] | None = Field(
        None,
        description="The KVCacheTenants (namespace/name) admitted to the space.",
        json_schema_extra=ATOMIC,
    )
    pinned: tuple[str, ...] | None = Field(
        None,
        description="The pins the operator holds on the agents for the space: its pinned "
        "prefixes, and removed ones until every agent has dropped them.",
        json_schema_extra=ATOMIC,
    )
    usage: TenantUsage | None = Field(
        None, description="The space's usage summed over the pool's agents, read periodically."
    )


class TenantStatus(SpecModel):
    observed_generation: Int64 | None = Field(
        None, description="The generation of the spec the conditions are about."
    )
    tenant_id: str | None = Field(
        None,
        description="The tenant id (kvpool tenant-id <salt>), 32 lowercase hex characters.",
    )
    secret_name: str | None = Field(
        None, description="The Secret with the token, tenant id, pool and endpoint."
    )
    token_generation: Int64 | None = Field(
        None, description="The spec.tokenGeneration of the token in the Secret."
    )
    quota: TenantQuotaStatus | None = Field(
        None,
        description="The ceilings the operator last wrote as the tenant's quota, in bytes.",
    )
    usage: TenantUsage | None = Field(
        None,
        description="The tenant's usage summed over the pool's agents, read periodically (not "
        "on every change); hits and misses count since each agent started.",
    )
    shared_spaces: tuple[str, ...] | None = Field(
        None,
        description="The pool's shared spaces the tenant is admitted to: its Secret holds each "
        "one's salt at the key space-<name>.",
        json_schema_extra=ATOMIC,
    )
    conditions: tuple[TenantCondition, ...] | None = Field(
        None,
        description="Accepted (the pool admits the tenant) and Ready (its token and quota are "
        "published to the pool's agents).",
        json_schema_extra=list_map("type"),
    )
