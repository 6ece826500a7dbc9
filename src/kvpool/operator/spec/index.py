"""A pool's prefix index (``spec.index``): the Deployment that tells gateways where a
prompt's longest cached prefix is."""

from __future__ import annotations

from pydantic import ConfigDict, Field

from kvpool.common.names import (
    DEFAULT_INDEX_PORT,
    DEFAULT_LOAD_FACTOR,
    DEFAULT_LOAD_SLACK,
    DEFAULT_MAX_CHUNKS_PER_NODE,
    DEFAULT_MIN_MATCH_RATIO,
)
from kvpool.operator.spec.base import SpecModel
from kvpool.operator.spec.markers import Rule, cel
from kvpool.operator.spec.workloads import ResourcesSpec, Tolerations


class RoutingSpec(SpecModel):
    load_factor: float = Field(
        DEFAULT_LOAD_FACTOR,
        ge=1,
        description="A node is overloaded above loadFactor x the candidates' average load + "
        "loadSlack.",
    )
    load_slack: float = Field(
        DEFAULT_LOAD_SLACK,
        ge=0,
        description="Absolute margin of the load bound (a few requests where loads are request "
        "counts).",
    )
    min_match_ratio: float = Field(
        DEFAULT_MIN_MATCH_RATIO,
        ge=0,
        le=1,
        description="Matched share of the prompt below which cache affinity is ignored.",
    )


class FingerprintSpec(SpecModel):
    model_config = ConfigDict(
        json_schema_extra=cel(
            Rule(
                "self.tpRank < self.tpSize",
                "index.fingerprint.tpRank must be below index.fingerprint.tpSize",
            )
        )
    )

    model: str = Field(
        description="Model name, as vLLM serves it.",
        json_schema_extra={"minLength": 1, "maxLength": 1024},
    )
    dtype: str = Field(
        description="KV cache dtype, e.g. bfloat16.",
        json_schema_extra={"minLength": 1, "maxLength": 64},
    )
    kv_layout: str = Field(
        description="KV layout the connector reports for the engine.",
        json_schema_extra={"minLength": 1, "maxLength": 256},
    )
    tp_rank: int = Field(0, ge=0, description="Tensor-parallel rank whose keys to match.")
    tp_size: int = Field(1, ge=1, description="Tensor-parallel size.")
    chunk_tokens: int | None = Field(
        None,
        ge=1,
        description="Tokens per chunk; absent means the pool's chunkTokens.",
        json_schema_extra={"maximum": 65536},
    )


class IndexSpec(SpecModel):
    enabled: bool = Field(
        False,
        description="Run the index. Turning it off deletes its Deployment, Service, ConfigMap "
        "and RBAC.",
    )
    replicas: int = Field(
        1,
        ge=1,
        json_schema_extra={"maximum": 16},
        description="Index replicas behind the Service. Each is an independent index that "
        "follows every agent (no shared state): more replicas serve more gateways and survive "
        "a lost pod; each holds the whole index.",
    )
    image: str | None = Field(
        None,
        description="Index image; absent means the agents' image (one image runs both).",
        json_schema_extra={"maxLength": 1024},
    )
    port: int = Field(
        DEFAULT_INDEX_PORT,
        ge=1,
        le=65535,
        description="HTTP port of the index (routing API, /healthz, /readyz, /metrics) and of "
        "its Service.",
    )
    max_chunks_per_node: int = Field(
        DEFAULT_MAX_CHUNKS_PER_NODE,
        ge=1,
        description="Chunks the index tracks per node at most; the oldest go first. An index "
        "needs about 150 bytes per tracked chunk: size resources.limits.memory from "
        "maxChunksPerNode x nodes.",
    )
    routing: RoutingSpec = Field(
        RoutingSpec(),
        description="How the index picks a node: the longest cached prefix, unless that node "
        "is overloaded or the match is too short, then the least loaded node.",
    )
    fingerprint: FingerprintSpec | None = Field(
        None,
        description="The model configuration of queries that send token ids without a "
        "fingerprint of their own (the connector's keys depend on it). Absent: every such "
        "query must carry one.",
    )
    resources: ResourcesSpec = Field(
        ResourcesSpec(),
        description="Overrides of the index's resources. By default it requests 100m CPU and "
        "512Mi of memory and may use up to 2Gi (about ten full nodes at the default "
        "maxChunksPerNode).",
    )
    node_selector: dict[str, str] = Field(
        {},
        description="Nodes that may run the index (it needs no GPU and no /dev/shm).",
    )
    tolerations: Tolerations = Field(
        (), description="Tolerations of the index pods (core/v1 Toleration)."
    )
