"""The KVCachePool resource: its names and the operator's typed view of its spec.

``crds/kvcachepools.kvpool.io.yaml`` is the source of truth. :class:`PoolSpec` mirrors it
field by field with the same defaults (``tests/operator/test_crd.py`` holds the two in
step), so the operator reads a pool the same way whether or not an API server filled in
the defaults. The CRD's CEL rules refuse invalid pools at admission; this model only adds
the checks the rendering needs to stay total.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from kvpool_agent.names import (
    DEFAULT_EVENTS_PORT,
    DEFAULT_HTTP_PORT,
    DEFAULT_INDEX_PORT,
    DEFAULT_LOAD_FACTOR,
    DEFAULT_LOAD_SLACK,
    DEFAULT_MAX_CHUNKS_PER_NODE,
    DEFAULT_MIN_MATCH_RATIO,
    DEFAULT_ZMQ_PORT,
)

GROUP = "kvpool.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "KVCachePool"
PLURAL = "kvcachepools"
TENANT_KIND = "KVCacheTenant"
TENANT_PLURAL = "kvcachetenants"

_UNITS = {
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "Ki": 1 << 10,
    "Mi": 1 << 20,
    "Gi": 1 << 30,
    "Ti": 1 << 40,
}
_QUANTITY = re.compile(r"([0-9]+)(Ki|Mi|Gi|Ti|k|M|G|T)?")


class InvalidSpec(ValueError):
    """The pool's spec cannot be turned into children; the message names the fields."""


def parse_bytes(value: object) -> int:
    """A whole quantity of bytes as the CRD spells it (``64Gi``, ``512M``, ``4096``)."""
    match = _QUANTITY.fullmatch(value) if isinstance(value, str) else None
    if match is None:
        raise ValueError(f"{value!r} is not a whole quantity of bytes such as 64Gi")
    return int(match[1]) * _UNITS[match[2] or ""]


Bytes = Annotated[int, BeforeValidator(parse_bytes)]


class _Spec(BaseModel):
    model_config = ConfigDict(
        frozen=True, extra="forbid", alias_generator=to_camel, populate_by_name=True
    )


class L1Spec(_Spec):
    size: Bytes = Field(1 << 30, description="Bytes of chunk data per node.")
    page_size: Bytes = Field(64 << 10, description="Allocation granularity.")
    lease_seconds: float = Field(30.0, gt=0, description="Lifetime of chunk locks.")


class EvictionSpec(_Spec):
    policy: Literal["lru", "arc"] = Field("lru", description="Victim order within a tenant.")
    high_watermark: float = Field(0.9, gt=0, le=1, description="Eviction starts above it.")
    low_watermark: float = Field(0.8, gt=0, lt=1, description="Eviction stops at it.")


class SecretKeyRef(_Spec):
    name: str = Field(description="Secret in the pool's namespace.")
    key: str = Field("tokens.yaml", description="Key of the Secret to mount.")


class SecretRef(_Spec):
    name: str = Field(description="Secret in the pool's namespace.")


class NvmeTier(_Spec):
    host_path: str = Field(description="Directory on the node.")
    capacity: Bytes = Field(description="Bytes the agent may use there.")
    encryption: bool = Field(False, description="Seal files with the pool's key.")


S3_NEEDS_KEY = (
    "an s3 tier needs spec.l2.encryption.keySecretRef: every agent of the pool seals or "
    "authenticates its objects with that key (a key per node would make other nodes' objects "
    "misses)"
)
NVME_ENCRYPTION_NEEDS_KEY = (
    "an nvme tier with encryption needs spec.l2.encryption.keySecretRef: a key kept on the "
    "disk beside the data protects nothing at rest"
)


class S3Tier(_Spec):
    bucket: str = Field(description="Bucket name.")
    prefix: str = Field("kvpool", description="Key prefix of the pool's objects.")
    endpoint: str | None = Field(None, description="Endpoint of an S3-compatible store.")
    region: str | None = Field(None, description="Region of the bucket.")
    credentials_secret_ref: SecretRef | None = Field(None, description="Credentials as env.")
    encryption: bool = Field(True, description="Seal objects with the pool's key.")
    server_side_encryption: Literal["AES256", "aws:kms", "aws:kms:dsse"] | None = Field(
        None, description="S3 server-side encryption asked for on every put."
    )
    sse_kms_key_id: str | None = Field(None, description="KMS key of aws:kms and aws:kms:dsse.")


class L2Tier(_Spec):
    type: Literal["nvme", "s3"] = Field(description="Kind of tier.")
    nvme: NvmeTier | None = Field(None, description="Settings of an nvme tier.")
    s3: S3Tier | None = Field(None, description="Settings of an s3 tier.")

    @model_validator(mode="after")
    def _one_member(self) -> Self:
        members = {"nvme": self.nvme, "s3": self.s3}
        if members[self.type] is None or any(
            value is not None for name, value in members.items() if name != self.type
        ):
            raise ValueError(f"an L2 tier of type {self.type} sets the field {self.type} only")
        return self


class L2EncryptionSpec(_Spec):
    key_secret_ref: SecretRef | None = Field(None, description="The pool's L2 master keys.")


class L2Spec(_Spec):
    store_policy: Literal["all", "reused"] = Field("all", description="Chunks written back.")
    store_min_hits: int = Field(1, ge=1, description="Hits before a reused chunk goes to L2.")
    tiers: tuple[L2Tier, ...] = Field((), description="Tiers in lookup order.")
    encryption: L2EncryptionSpec = Field(L2EncryptionSpec(), description="Keys of L2 objects.")

    @model_validator(mode="after")
    def _shared_tiers_have_the_pools_key(self) -> Self:
        if self.encryption.key_secret_ref is None:
            s3, nvme = self.tier("s3"), self.tier("nvme")
            if s3 is not None:
                raise ValueError(S3_NEEDS_KEY)
            if nvme is not None and nvme.nvme is not None and nvme.nvme.encryption:
                raise ValueError(NVME_ENCRYPTION_NEEDS_KEY)
        return self

    def tier(self, kind: Literal["nvme", "s3"]) -> L2Tier | None:
        return next((tier for tier in self.tiers if tier.type == kind), None)


class PortsSpec(_Spec):
    zmq: int = Field(DEFAULT_ZMQ_PORT, ge=1, le=65535, description="ZMQ protocol port.")
    http: int = Field(DEFAULT_HTTP_PORT, ge=1, le=65535, description="HTTP API and metrics port.")
    events: int = Field(DEFAULT_EVENTS_PORT, ge=1, le=65535, description="Chunk-event stream port.")


class ServiceMonitorSpec(_Spec):
    enabled: bool = Field(False, description="Create a ServiceMonitor.")
    interval: str = Field("30s", description="Scrape interval.")
    labels: dict[str, str] = Field({}, description="Labels of the ServiceMonitor.")


class MetricsSpec(_Spec):
    top_tenants: int = Field(20, ge=0, description="Tenants labelled in metrics.")
    service_monitor: ServiceMonitorSpec = Field(ServiceMonitorSpec(), description="Monitor.")


class ResourcesSpec(_Spec):
    requests: dict[str, int | str] = Field({}, description="Overrides of the requests.")
    limits: dict[str, int | str] = Field({}, description="Overrides of the limits.")


class UpdateStrategySpec(_Spec):
    type: Literal["RollingUpdate", "OnDelete"] = Field("RollingUpdate", description="Rollout.")
    max_unavailable: int | str = Field(1, description="Agents down at once in a rollout.")


class AgentSpec(_Spec):
    image: str | None = Field(None, description="Agent image; default: the operator's.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", description="Pull policy."
    )
    resources: ResourcesSpec = Field(ResourcesSpec(), description="Resource overrides.")
    node_selector: dict[str, str] = Field({}, description="Nodes that run an agent.")
    tolerations: tuple[dict[str, Any], ...] = Field((), description="Pod tolerations.")
    affinity: dict[str, Any] | None = Field(None, description="Pod affinity.")
    priority_class_name: str | None = Field(None, description="Pod priority class.")
    update_strategy: UpdateStrategySpec = Field(UpdateStrategySpec(), description="Rollout.")


class RoutingSpec(_Spec):
    load_factor: float = Field(
        DEFAULT_LOAD_FACTOR, ge=1, description="Overload bound: x average load."
    )
    load_slack: float = Field(
        DEFAULT_LOAD_SLACK, ge=0, description="Absolute margin of the load bound."
    )
    min_match_ratio: float = Field(
        DEFAULT_MIN_MATCH_RATIO,
        ge=0,
        le=1,
        description="Matched share of a prompt below which affinity is ignored.",
    )


class FingerprintSpec(_Spec):
    model: str = Field(description="Model name, as vLLM serves it.")
    dtype: str = Field(description="KV cache dtype.")
    kv_layout: str = Field(description="KV layout the connector reports.")
    tp_rank: int = Field(0, ge=0, description="Tensor-parallel rank whose keys to match.")
    tp_size: int = Field(1, ge=1, description="Tensor-parallel size.")
    chunk_tokens: int | None = Field(None, ge=1, description="Default: the pool's chunkTokens.")


class IndexSpec(_Spec):
    enabled: bool = Field(False, description="Deploy the pool-wide prefix index.")
    replicas: int = Field(1, ge=1, description="Independent index replicas.")
    image: str | None = Field(None, description="Index image; default: the agents'.")
    port: int = Field(DEFAULT_INDEX_PORT, ge=1, le=65535, description="HTTP port of the index.")
    max_chunks_per_node: int = Field(
        DEFAULT_MAX_CHUNKS_PER_NODE, ge=1, description="Chunks tracked per node."
    )
    routing: RoutingSpec = Field(RoutingSpec(), description="Routing policy.")
    fingerprint: FingerprintSpec | None = Field(None, description="Default model of queries.")
    resources: ResourcesSpec = Field(ResourcesSpec(), description="Resource overrides.")
    node_selector: dict[str, str] = Field({}, description="Nodes that may run the index.")
    tolerations: tuple[dict[str, Any], ...] = Field((), description="Pod tolerations.")


SELECTOR_VALUES = "matchExpressions: In and NotIn need values, Exists and DoesNotExist take none"
PEER_SELECTS_NOTHING = "a networkPolicy peer sets podSelector, namespaceSelector or both"
NETWORK_POLICY_NEEDS_CLIENTS = (
    "spec.networkPolicy.enabled needs spec.networkPolicy.clients: "
    "the pods (vLLM's) that use the agents"
)
NETWORK_POLICY_NEEDS_GATEWAYS = (
    "spec.networkPolicy.enabled with spec.index.enabled needs spec.networkPolicy.gateways: "
    "the pods that call the index"
)


class LabelSelectorRequirement(_Spec):
    key: str = Field(description="Label key.")
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"] = Field(
        description="How the label's value is matched."
    )
    values: tuple[str, ...] = Field((), description="Values of In and NotIn.")

    @model_validator(mode="after")
    def _values_fit_the_operator(self) -> Self:
        if (self.operator in ("In", "NotIn")) != bool(self.values):
            raise ValueError(SELECTOR_VALUES)
        return self


class LabelSelector(_Spec):
    match_labels: dict[str, str] = Field({}, description="Labels it has.")
    match_expressions: tuple[LabelSelectorRequirement, ...] = Field(
        (), description="Requirements on its labels."
    )

    def matches(self, labels: Mapping[str, str]) -> bool:
        """Whether an object with ``labels`` is selected, as Kubernetes reads a selector."""
        return all(labels.get(key) == value for key, value in self.match_labels.items()) and all(
            _holds(requirement, labels) for requirement in self.match_expressions
        )


def _holds(requirement: LabelSelectorRequirement, labels: Mapping[str, str]) -> bool:
    present = requirement.key in labels
    match requirement.operator:
        case "In":
            return present and labels[requirement.key] in requirement.values
        case "NotIn":
            return not present or labels[requirement.key] not in requirement.values
        case "Exists":
            return present
        case "DoesNotExist":
            return not present


class TierQuota(_Spec):
    """Bytes per tier; an absent tier has no limit of its own here."""

    l1: Bytes | None = Field(None, description="Bytes of L1 (each node's shared memory).")
    nvme: Bytes | None = Field(None, description="Bytes of each node's NVMe tier.")


class TenantsSpec(_Spec):
    default_quota: Bytes | None = Field(None, description="Quota of tenants without one.")
    tokens_secret_ref: SecretKeyRef | None = Field(None, description="HTTP API tokens.")
    allowed_namespaces: LabelSelector | None = Field(
        None, description="Namespaces whose KVCacheTenants may bind; absent or empty: none."
    )
    max_quota: TierQuota = Field(TierQuota(), description="Largest quota of a KVCacheTenant.")


class NetworkPeer(_Spec):
    pod_selector: LabelSelector | None = Field(None, description="Pods admitted.")
    namespace_selector: LabelSelector | None = Field(None, description="Their namespaces.")

    @model_validator(mode="after")
    def _selects(self) -> Self:
        if self.pod_selector is None and self.namespace_selector is None:
            raise ValueError(PEER_SELECTS_NOTHING)
        return self


class NetworkPolicySpec(_Spec):
    enabled: bool = Field(False, description="Admit only these peers to the pool's pods.")
    clients: tuple[NetworkPeer, ...] = Field((), description="vLLM pods and tools: the agents.")
    gateways: tuple[NetworkPeer, ...] = Field((), description="Gateways: the index.")
    prometheus: tuple[NetworkPeer, ...] = Field((), description="Scrapers of /metrics.")

    @model_validator(mode="after")
    def _has_clients(self) -> Self:
        if self.enabled and not self.clients:
            raise ValueError(NETWORK_POLICY_NEEDS_CLIENTS)
        return self


INDEX_NEEDS_TOKENS = (
    "spec.index.enabled needs spec.tenants.tokensSecretRef: "
    "gateways authenticate with its gateways: tokens"
)


class PoolSpec(_Spec):
    chunk_tokens: int = Field(256, ge=1, description="Tokens per cached chunk.")
    block_size: int = Field(16, ge=1, description="vLLM's KV block size.")
    l1: L1Spec = Field(L1Spec(), description="The shared-memory cache of each node.")
    eviction: EvictionSpec = Field(EvictionSpec(), description="L1 eviction.")
    tenants: TenantsSpec = Field(TenantsSpec(), description="Quotas and tokens.")
    l2: L2Spec = Field(L2Spec(), description="Tiers behind L1.")
    ports: PortsSpec = Field(PortsSpec(), description="Agent and Service ports.")
    metrics: MetricsSpec = Field(MetricsSpec(), description="Prometheus metrics.")
    agent: AgentSpec = Field(AgentSpec(), description="The agent DaemonSet.")
    index: IndexSpec = Field(IndexSpec(), description="The pool-wide prefix index.")
    network_policy: NetworkPolicySpec = Field(
        NetworkPolicySpec(), description="Who may connect to the pool's pods."
    )

    @model_validator(mode="after")
    def _index_has_tokens(self) -> Self:
        if self.index.enabled and self.tenants.tokens_secret_ref is None:
            raise ValueError(INDEX_NEEDS_TOKENS)
        return self

    @model_validator(mode="after")
    def _index_has_gateways(self) -> Self:
        policy = self.network_policy
        if policy.enabled and self.index.enabled and not policy.gateways:
            raise ValueError(NETWORK_POLICY_NEEDS_GATEWAYS)
        return self

    @classmethod
    def parse(cls, spec: Mapping[str, Any]) -> PoolSpec:
        """Read a pool's ``spec``; :class:`InvalidSpec` says which fields are wrong."""
        try:
            return cls.model_validate(spec)
        except ValidationError as error:
            raise InvalidSpec(describe(error, "spec")) from error


def describe(error: ValidationError, root: str) -> str:
    """One line per problem, each naming its field from ``root``."""
    return "; ".join(
        f"{'.'.join([root, *(str(part) for part in problem['loc'])])}: {problem['msg']}"
        for problem in error.errors()
    )


class PoolRef(_Spec):
    name: str = Field(description="The KVCachePool's name.")
    namespace: str = Field(description="The KVCachePool's namespace.")


class TenantQuota(_Spec):
    l1: Bytes = Field(description="Bytes of L1 on each node: the tenant's ceiling there.")
    nvme: Bytes | None = Field(None, description="Bytes of NVMe on each node; absent: as l1.")

    @property
    def nvme_bytes(self) -> int:
        return self.l1 if self.nvme is None else self.nvme


class SaltSecretRef(_Spec):
    name: str = Field(description="Secret in the tenant's namespace.")
    key: str = Field("salt", description="Key of the Secret that holds the salt.")


class TenantSpec(_Spec):
    """A KVCacheTenant's ``spec`` (``crds/kvcachetenants.kvpool.io.yaml``)."""

    pool_ref: PoolRef = Field(description="The pool the tenant binds to.")
    quota: TenantQuota = Field(description="The tenant's quota ceiling per tier.")
    salt_secret_ref: SaltSecretRef | None = Field(
        None, description="The team's own Secret holding the salt; absent: generated."
    )
    token_generation: int = Field(0, ge=0, description="Bump to rotate the token.")

    @classmethod
    def parse(cls, spec: Mapping[str, Any]) -> TenantSpec:
        """Read a tenant's ``spec``; :class:`InvalidSpec` says which fields are wrong."""
        try:
            return cls.model_validate(spec)
        except ValidationError as error:
            raise InvalidSpec(describe(error, "spec")) from error
