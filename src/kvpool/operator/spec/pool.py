"""The KVCachePool resource: its spec, as the operator reads it, and the CRD it generates."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal, Self

from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from kvpool.common.names import DEFAULT_EVENTS_PORT, DEFAULT_HTTP_PORT, DEFAULT_ZMQ_PORT
from kvpool.operator.reasons import READY
from kvpool.operator.spec.base import (
    KIND,
    PLURAL,
    Bytes,
    InvalidSpec,
    PageSize,
    PositiveBytes,
    Resource,
    SpecModel,
    describe,
)
from kvpool.operator.spec.index import IndexSpec
from kvpool.operator.spec.l2 import L2Spec
from kvpool.operator.spec.markers import (
    AGE,
    SET,
    CustomResource,
    PrinterColumn,
    Rule,
    cel,
    list_map,
)
from kvpool.operator.spec.network import (
    NETWORK_POLICY_NEEDS_GATEWAYS,
    NETWORK_POLICY_NEEDS_PICKER_CLIENTS,
    NetworkPolicySpec,
)
from kvpool.operator.spec.peers import PEER_PORT_TAKEN, PeersSpec
from kvpool.operator.spec.selectors import LabelSelector
from kvpool.operator.spec.spaces import NamespaceName, SharedSpaceSpec, unique_names
from kvpool.operator.spec.status import PoolStatus
from kvpool.operator.spec.workloads import AgentSpec

INDEX_NEEDS_TOKENS = (
    "spec.index.enabled needs spec.tenants.tokensSecretRef: "
    "gateways authenticate with its gateways: tokens"
)
POOL_NAME = (
    "the pool name must be a DNS label (lowercase letters, digits, '-') of at most 40 "
    "characters: it names the pool's Service, DaemonSet and segment"
)


class L1Spec(SpecModel):
    model_config = ConfigDict(
        json_schema_extra=cel(
            Rule(
                "quantity(self.size).asInteger() >= 16 * quantity(self.pageSize).asInteger()",
                "l1.size must hold at least 16 pages of l1.pageSize",
            )
        )
    )

    size: PositiveBytes = Field(
        "1Gi",
        validate_default=True,
        description="Bytes of chunk data per node (a whole quantity such as 64Gi). The agent "
        "reserves it up front in /dev/shm; its memory request is sized from it.",
    )
    page_size: PageSize = Field(
        "64Ki",
        validate_default=True,
        description="Allocation granularity; a chunk occupies whole pages.",
    )
    lease_seconds: float = Field(
        30.0,
        gt=0,
        description="Lifetime of the read and write locks clients take on chunks; a crashed "
        "client's locks expire after it.",
    )


class EvictionSpec(SpecModel):
    model_config = ConfigDict(
        json_schema_extra=cel(
            Rule(
                "self.lowWatermark < self.highWatermark",
                message_expression="'eviction.lowWatermark (' + string(self.lowWatermark) + ') "
                "must be below eviction.highWatermark (' + string(self.highWatermark) + ')'",
            )
        )
    )

    policy: Literal["lru", "arc"] = Field("lru", description="Order of victims within a tenant.")
    high_watermark: float = Field(
        0.9, gt=0, le=1, description="Eviction starts above this fraction of L1."
    )
    low_watermark: float = Field(
        0.8, gt=0, lt=1, description="Eviction stops at this fraction of L1."
    )


class SecretKeyRef(SpecModel):
    name: str = Field(
        description="Name of the Secret, in the pool's namespace.",
        json_schema_extra={"maxLength": 253},
    )
    key: str = Field(
        "tokens.yaml",
        description="Key of the Secret that holds the tokens document.",
        json_schema_extra={"maxLength": 253},
    )


class TierQuota(SpecModel):
    """Bytes per tier; an absent tier has no limit of its own here."""

    l1: Bytes | None = Field(None, description="Largest L1 quota (bytes on each node) of a tenant.")
    nvme: Bytes | None = Field(
        None, description="Largest NVMe quota (bytes on each node) of a tenant."
    )


class TenantsSpec(SpecModel):
    default_quota: Bytes | None = Field(
        None,
        description="L1 bytes of a tenant without a quota of its own (0 disables caching for "
        "them). Absent: no limit. Quotas set over the HTTP API are kept in the pool's quota "
        "ConfigMap.",
    )
    tokens_secret_ref: SecretKeyRef | None = Field(
        None,
        description="Secret with the bearer tokens of the agents' HTTP API and of the prefix "
        "index, a YAML document {admins: [tokens], gateways: [tokens], tenants: {tenant-id: "
        "[tokens]}} (gateways: tokens call the index only). Without it each agent generates an "
        "admin token of its own, and spec.index cannot be enabled.",
    )
    allowed_namespaces: LabelSelector | None = Field(
        None,
        description="The namespaces whose KVCacheTenants may bind to this pool, by their "
        "labels: matchLabels and matchExpressions must all hold. Absent or empty ({}) selects "
        "NO namespace (binding a team to a shared cache is the platform team's decision); "
        "{matchExpressions: [{key: kubernetes.io/metadata.name, operator: Exists}]} selects "
        "every namespace.",
    )
    max_quota: TierQuota = Field(
        TierQuota(),
        description="The largest quota a KVCacheTenant may ask for, per tier; a tenant above "
        "it is not accepted (QuotaAboveMaximum). An absent tier: no maximum.",
    )


class PortsSpec(SpecModel):
    model_config = ConfigDict(
        json_schema_extra=cel(
            Rule(
                "self.zmq != self.http && self.zmq != self.events && self.http != self.events",
                "ports.zmq, ports.http and ports.events must differ",
            )
        )
    )

    zmq: int = Field(
        DEFAULT_ZMQ_PORT,
        ge=1,
        le=65535,
        description="ZMQ protocol port that vLLM's connector talks to.",
    )
    http: int = Field(
        DEFAULT_HTTP_PORT,
        ge=1,
        le=65535,
        description="HTTP API port (tenant quotas, health, /metrics).",
    )
    events: int = Field(
        DEFAULT_EVENTS_PORT,
        ge=1,
        le=65535,
        description="Port of each agent's chunk-event stream (for a prefix-aware router; "
        "served by the agent pods, not by the pool Service).",
    )


class ServiceMonitorSpec(SpecModel):
    enabled: bool = Field(False, description="Create the ServiceMonitor.")
    interval: str = Field(
        "30s", description="Scrape interval.", json_schema_extra={"pattern": "^[0-9]+(ms|s|m|h)$"}
    )
    labels: dict[str, str] = Field(
        {},
        description="Labels of the ServiceMonitor (e.g. what your Prometheus selects on).",
    )


class MetricsSpec(SpecModel):
    top_tenants: int = Field(
        20,
        ge=0,
        description='Tenants labelled in metrics by usage, largest first; the rest are "other".',
        json_schema_extra={"maximum": 1000},
    )
    service_monitor: ServiceMonitorSpec = Field(
        ServiceMonitorSpec(),
        description="A prometheus-operator ServiceMonitor for the pool (made only where its "
        "CRD exists).",
    )


class PoolSpec(SpecModel):
    """Desired state of the pool."""

    model_config = ConfigDict(
        json_schema_extra=cel(
            Rule(
                "self.chunkTokens % self.blockSize == 0",
                message_expression="'chunkTokens (' + string(self.chunkTokens) + ') must be a "
                "multiple of blockSize (' + string(self.blockSize) + '), the KV block size of "
                "vLLM'",
            ),
            Rule(
                "!has(self.index) || !has(self.index.enabled) || !self.index.enabled || "
                "(has(self.tenants) && has(self.tenants.tokensSecretRef))",
                INDEX_NEEDS_TOKENS,
            ),
            Rule(
                "!has(self.networkPolicy) || !has(self.networkPolicy.enabled) || "
                "!self.networkPolicy.enabled || !has(self.index) || !has(self.index.enabled) || "
                "!self.index.enabled || (has(self.networkPolicy.gateways) && "
                "self.networkPolicy.gateways.size() > 0)",
                NETWORK_POLICY_NEEDS_GATEWAYS,
            ),
            Rule(
                "!has(self.networkPolicy) || !has(self.networkPolicy.enabled) || "
                "!self.networkPolicy.enabled || !has(self.index) || !has(self.index.enabled) || "
                "!self.index.enabled || !has(self.index.picker) || "
                "!has(self.index.picker.enabled) || !self.index.picker.enabled || "
                "(has(self.networkPolicy.pickerClients) && "
                "self.networkPolicy.pickerClients.size() > 0)",
                NETWORK_POLICY_NEEDS_PICKER_CLIENTS,
            ),
            Rule(
                "!self.peers.enabled || !(self.peers.port in "
                "[self.ports.zmq, self.ports.http, self.ports.events])",
                PEER_PORT_TAKEN,
            ),
        )
    )

    chunk_tokens: int = Field(
        256,
        ge=1,
        description="Tokens per cached chunk: the connector keys and stores KV in chunks of "
        "this many tokens. A multiple of blockSize.",
        json_schema_extra={"maximum": 65536},
    )
    block_size: int = Field(
        16,
        ge=1,
        description="KV block size (tokens) of the vLLM deployments using this pool (vLLM's "
        "--block-size); chunkTokens must be a multiple of it.",
        json_schema_extra={"maximum": 4096},
    )
    l1: L1Spec = Field(L1Spec(), description="The shared-memory cache (L1) of each node.")
    eviction: EvictionSpec = Field(
        EvictionSpec(), description="When and what the agent evicts from L1."
    )
    tenants: TenantsSpec = Field(
        TenantsSpec(),
        description="Tenant quotas, the tokens of the agents' HTTP API, and who may bind "
        "KVCacheTenants.",
    )
    l2: L2Spec = Field(L2Spec(), description="Tiers behind L1, checked in order on an L1 miss.")
    ports: PortsSpec = Field(PortsSpec(), description="Ports of the agents and the pool Service.")
    metrics: MetricsSpec = Field(
        MetricsSpec(), description="Prometheus metrics, served at /metrics on the HTTP port."
    )
    agent: AgentSpec = Field(AgentSpec(), description="The agent DaemonSet.")
    index: IndexSpec = Field(
        IndexSpec(),
        description="The pool-wide prefix index (kvpool-index): it follows every agent's chunk "
        "events and answers gateways which node holds the longest cached prefix of a prompt "
        "(POST /v1/route, /v1/lookup). When enabled the operator runs it as the Deployment "
        "kvpool-<pool>-index behind the ClusterIP Service of the same name; gateways call it "
        "with a token from the gateways: key of the pool's tokens Secret "
        "(spec.tenants.tokensSecretRef, required).",
    )
    network_policy: NetworkPolicySpec = Field(
        NetworkPolicySpec(),
        description="NetworkPolicies that admit only the listed peers to the pool's pods (off "
        "by default; they take effect only where the cluster's network plugin enforces "
        "NetworkPolicy). When enabled the operator makes kvpool-<pool>-agent: the agents' ZMQ "
        "and HTTP ports admit clients, their HTTP port prometheus, their ZMQ and events ports "
        "the pool's index, their peer port the pool's other agents (spec.peers); and with "
        "spec.index kvpool-<pool>-index: the index's port admits "
        "gateways and prometheus, and the picker's port (spec.index.picker) pickerClients. "
        "Anything else is refused, except what the network plugin "
        "lets through from the pod's own node (kubelet probes). A peer selects pods "
        "(podSelector, in the pool's namespace unless namespaceSelector is set too), "
        "namespaces (namespaceSelector: every pod there), or both, as in a NetworkPolicy.",
    )
    peers: PeersSpec = Field(
        PeersSpec(),
        description="The peer tier: each agent serves the chunks of its L1 and NVMe to the "
        "pool's other agents on the peer port, and pulls from them what it misses there before "
        "it asks S3. Peers prove the pool's credential (the Secret kvpool-<pool>-peer, minted "
        "and rotated by the operator) and every chunk travels sealed with it. With "
        "spec.networkPolicy the agents admit each other on the peer port.",
    )
    engine_namespaces: tuple[NamespaceName, ...] = Field(
        (),
        description="Namespaces (by name) whose pods get the pool's whole directory on the "
        "node through the CSI driver csi.kvpool.io (the agent's door, and the table of ready "
        "chunks that lists every tenant's keys), and the agents' group. Only for engines "
        "the platform team runs and trusts as it trusts the agents (an engine that serves "
        "many tenants, whose engine token maps every tenant's chunk file). Pods of every other "
        "namespace, tenants' pods included, get only the agent's door through that driver "
        "(read-only): a socket that hands a connector the chunk files its token may map, its "
        "own tenant's and its spaces'.",
        json_schema_extra={"maxItems": 64} | SET,
    )
    shared_spaces: tuple[SharedSpaceSpec, ...] = Field(
        (),
        description="Caches the pool's tenants share, each with a salt the operator mints (kept "
        "in the Secret kvpool-<pool>-spaces), a tenant id and a quota of its own. Each accepted "
        "KVCacheTenant in a space's allowedNamespaces gets the space's salt in its Secret "
        "(key space-<name>) and may then read and store the space's chunks with its own token, "
        "through a structured cache_salt. Removing a space, or a namespace from it, revokes.",
        json_schema_extra={"maxItems": 32} | list_map("name"),
    )

    @field_validator("shared_spaces")
    @classmethod
    def _space_names_are_unique(
        cls, spaces: tuple[SharedSpaceSpec, ...]
    ) -> tuple[SharedSpaceSpec, ...]:
        unique_names([space.name for space in spaces])
        return spaces

    @model_validator(mode="after")
    def _index_has_tokens(self) -> Self:
        if self.index.enabled and self.tenants.tokens_secret_ref is None:
            raise ValueError(INDEX_NEEDS_TOKENS)
        return self

    @model_validator(mode="after")
    def _peer_port_is_free(self) -> Self:
        ports = self.ports
        if self.peers.enabled and self.peers.port in (ports.zmq, ports.http, ports.events):
            raise ValueError(PEER_PORT_TAKEN)
        return self

    @model_validator(mode="after")
    def _index_has_gateways(self) -> Self:
        policy = self.network_policy
        if policy.enabled and self.index.enabled and not policy.gateways:
            raise ValueError(NETWORK_POLICY_NEEDS_GATEWAYS)
        picker = self.index.enabled and self.index.picker.enabled
        if policy.enabled and picker and not policy.picker_clients:
            raise ValueError(NETWORK_POLICY_NEEDS_PICKER_CLIENTS)
        return self

    @classmethod
    def parse(cls, spec: Mapping[str, Any]) -> PoolSpec:
        """Read a pool's ``spec``; :class:`InvalidSpec` says which fields are wrong."""
        try:
            return cls.model_validate(spec)
        except ValidationError as error:
            raise InvalidSpec(describe(error, "spec")) from error


class KVCachePool(Resource):
    """A managed KV cache for vLLM: one cache agent per selected node, a shared-memory
    segment (L1) per node, optional L2 tiers, per-tenant quotas."""

    model_config = ConfigDict(
        json_schema_extra=cel(
            Rule(
                "self.metadata.name.size() <= 40 && "
                "self.metadata.name.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?$')",
                POOL_NAME,
            )
        )
    )
    crd: ClassVar[CustomResource] = CustomResource(
        kind=KIND,
        plural=PLURAL,
        short_names=("kvp",),
        printer_columns=(
            PrinterColumn("L1", "string", ".spec.l1.size", "Shared-memory cache size per node."),
            PrinterColumn(
                "Ready",
                "string",
                f'.status.conditions[?(@.type=="{READY}")].status',
                "Whether every node's agent is up to date and ready.",
            ),
            PrinterColumn(
                "Nodes-Ready", "integer", ".status.readyNodes", "Nodes whose agent is ready."
            ),
            PrinterColumn(
                "Nodes-Desired",
                "integer",
                ".status.desiredNodes",
                "Nodes that should run an agent.",
            ),
            PrinterColumn(
                "Index-Ready",
                "integer",
                ".status.index.readyReplicas",
                "Ready replicas of the prefix index (spec.index), if the pool has one.",
                priority=1,
            ),
            AGE,
        ),
    )

    spec: PoolSpec = Field(description="Desired state of the pool.")
    status: PoolStatus | None = Field(
        None, description="Observed state of the pool, written by the operator."
    )
