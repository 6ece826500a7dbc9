"""Render a pool's children: pure functions from a pool and its spec to manifests.

The children (shared/ARCHITECTURE.md), all in the pool's namespace, all labelled with
the pool and owned by it (a controller ownerReference, so deleting the pool deletes them):

- ``kvpool-<pool>-config``: ConfigMap, key ``agent.yaml``: the agent's own
  :class:`~kvpool_agent.config.AgentConfig`, validated by that model and dumped from it;
- ``kvpool-<pool>-quotas``: ConfigMap of tenant quotas; the operator renders only its
  metadata, the agents own its data;
- ``kvpool-<pool>-tenants``: ConfigMap of the KVCacheTenants' token digests and quota
  ceilings; the operator renders only its metadata and writes its data key by key
  (``tenants.py``), the agents watch it;
- ``kvpool-<pool>-agent``: ServiceAccount, Role and RoleBinding that let the agents read,
  watch and patch that one quota ConfigMap, and read and watch the tenants ConfigMap;
- ``kvpool-<pool>-agent``: DaemonSet of agents, rolled by a checksum of ``agent.yaml``;
- ``kvpool-<pool>``: Service (``internalTrafficPolicy: Local``) whose annotations tell
  the vLLM connector how to reach and use its node's agent;
- ``kvpool-<pool>``: ServiceMonitor, when the spec asks for one;
- ``kvpool-<pool>-agent`` and, with the index, ``kvpool-<pool>-index``: NetworkPolicies,
  when the spec asks for them (``spec.networkPolicy.enabled``), that isolate the agent pods
  and the index pods for ingress and admit each peer the spec names to the ports it needs;
  applied before the other children, so that no pod of the pool runs unprotected;
- the prefix index, when the spec asks for it (``spec.index.enabled``), labelled
  ``app.kubernetes.io/component: index`` (so the agents' Service and DaemonSet never select
  its pods, nor the index's discovery, which follows ``component: agent`` pods):
  ``kvpool-<pool>-index-config``: ConfigMap, key ``index.yaml``: the index's own
  :class:`~kvpool_agent.index.config.IndexConfig`; ``kvpool-<pool>-index``: ServiceAccount,
  Role and RoleBinding that let it read and watch the pool's pods, a Deployment of
  ``spec.index.replicas`` independent indexes, and a ClusterIP Service for gateways.

The NetworkPolicies, the ServiceMonitor and the index are optional children:
:class:`Children` lists those the spec asks for next to the required ones, and names
(:attr:`Children.absent`) those it does not, which the operator deletes where the pool owns
them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any, TypeVar

import yaml
from pydantic import ValidationError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

from kvpool_agent import names
from kvpool_agent.config import AgentConfig
from kvpool_agent.index.config import IndexConfig
from kvpool_agent.names import (
    AGENT_COMPONENT,
    AGENT_CONFIG_FILE_ENV,
    AGENT_CONFIG_KEY,
    AGENT_HOST_ENV,
    APP,
    CHUNK_TOKENS_ANNOTATION,
    COMPONENT_LABEL,
    CONFIG_CHECKSUM_ANNOTATION,
    HTTP_PORT_ANNOTATION,
    INDEX_COMPONENT,
    INDEX_CONFIG_FILE_ENV,
    INDEX_CONFIG_KEY,
    INSTANCE_LABEL,
    MANAGED_BY_LABEL,
    NAME_LABEL,
    OPERATOR,
    POOL_LABEL,
    PROTOCOL_VERSION_ANNOTATION,
    SEGMENT_PATH_ANNOTATION,
    ZMQ_PORT_ANNOTATION,
)
from kvpool_agent.protocol import PROTOCOL_VERSION
from kvpool_operator.spec import (
    API_VERSION,
    KIND,
    InvalidSpec,
    NetworkPeer,
    NvmeTier,
    PoolSpec,
    ResourcesSpec,
    S3Tier,
    describe,
)

Manifest = dict[str, Any]

CONFIG_DIR = "/etc/kvpool/config"
TOKENS_DIR = "/etc/kvpool/tokens"
TOKENS_FILE = "tokens.yaml"
TOKENS_PATH = f"{TOKENS_DIR}/{TOKENS_FILE}"
STATE_DIR = "/var/lib/kvpool"
L2_KEYS_DIR = "/etc/kvpool/l2-keys"
"""Where the pool's L2 key Secret is mounted (spec.l2.encryption.keySecretRef)."""
NODE_KEYS_DIR = ".kvpool-keys"
"""Without a key Secret, each agent keeps its own key under the NVMe tier's hostPath, in
this directory (a name no pool can have), so that it outlives the pod as the files do."""
AGENT_UID = 10001
"""The agent image's user (Dockerfile)."""

AGENT_BASE_MEMORY = 256 << 20
"""Memory of the agent process itself, beyond its L1 segment and index."""
INDEX_BYTES_PER_PAGE = 256
"""Upper bound of the L1 index and allocator metadata per page of the segment."""
AGENT_CPU_REQUEST = "250m"
INDEX_CPU_REQUEST = "100m"
INDEX_MEMORY_REQUEST = "512Mi"
INDEX_MEMORY_LIMIT = "2Gi"
"""The index's memory grows with the chunks it tracks (about 150 B each, keys included,
by ``kvpool bench index``): 2Gi holds about ten nodes' worth of maxChunksPerNode 1M. Its
node count is unknown at render time, so these are defaults that spec.index.resources
overrides."""
_BINARY_SUFFIXES = (("Ti", 1 << 40), ("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10))


@dataclass(frozen=True)
class Pool:
    """The identity of a KVCachePool: what its children are named after and owned by."""

    name: str
    namespace: str
    uid: str

    @property
    def config_name(self) -> str:
        return names.config_map_name(self.name)

    @property
    def quotas_name(self) -> str:
        return names.quotas_name(self.name)

    @property
    def tenants_name(self) -> str:
        return names.tenants_name(self.name)

    @property
    def agent_name(self) -> str:
        return names.agent_name(self.name)

    @property
    def service_name(self) -> str:
        return names.service_name(self.name)

    @property
    def index_name(self) -> str:
        return names.index_name(self.name)

    @property
    def index_config_name(self) -> str:
        return names.index_config_map_name(self.name)

    def labels(self, component: str = AGENT_COMPONENT) -> dict[str, str]:
        return {
            NAME_LABEL: APP,
            INSTANCE_LABEL: self.name,
            COMPONENT_LABEL: component,
            POOL_LABEL: self.name,
        }

    def selector(self, component: str = AGENT_COMPONENT) -> dict[str, str]:
        """The labels that a component's workload and Service select its pods on."""
        labels = self.labels(component)
        return {key: labels[key] for key in (NAME_LABEL, INSTANCE_LABEL, COMPONENT_LABEL)}


@dataclass(frozen=True)
class ChildRef:
    """Which object a child is: enough to get or delete it in the pool's namespace."""

    api_version: str
    kind: str
    name: str

    @classmethod
    def of(cls, manifest: Mapping[str, Any]) -> ChildRef:
        return cls(manifest["apiVersion"], manifest["kind"], manifest["metadata"]["name"])


@dataclass(frozen=True)
class IndexChildren:
    """The prefix index's children, in the order they are applied (the Deployment last)."""

    config: Manifest
    service_account: Manifest
    role: Manifest
    role_binding: Manifest
    service: Manifest
    deployment: Manifest

    def manifests(self) -> list[Manifest]:
        return [
            self.config,
            self.service_account,
            self.role,
            self.role_binding,
            self.service,
            self.deployment,
        ]


@dataclass(frozen=True)
class Children:
    """Every child of one pool: those it has, and the optional ones it must not have."""

    service_account: Manifest
    role: Manifest
    role_binding: Manifest
    config: Manifest
    quotas: Manifest
    tenants: Manifest
    service: Manifest
    daemonset: Manifest
    index: IndexChildren | None
    service_monitor: Manifest | None
    network_policies: tuple[Manifest, ...]
    absent: tuple[ChildRef, ...]
    """Optional children the spec does not ask for, in the order they are deleted."""

    def required(self) -> list[Manifest]:
        """The children every pool has, in the order they are applied (the DaemonSet last)."""
        return [
            self.service_account,
            self.role,
            self.role_binding,
            self.config,
            self.quotas,
            self.tenants,
            self.service,
            self.daemonset,
        ]

    def optional(self) -> list[Manifest]:
        """The index's children and the ServiceMonitor, where the spec asks for them, in the
        order they are applied (after the required children)."""
        index = self.index.manifests() if self.index is not None else []
        return index + ([self.service_monitor] if self.service_monitor is not None else [])

    def present(self) -> list[Manifest]:
        """Every child the pool has, in the order they are applied (NetworkPolicies first)."""
        return [*self.network_policies, *self.required(), *self.optional()]


def index_refs(pool: Pool) -> tuple[ChildRef, ...]:
    """The children the index adds, in the order they are deleted (the Deployment first)."""
    return (
        ChildRef("apps/v1", "Deployment", pool.index_name),
        ChildRef("v1", "Service", pool.index_name),
        ChildRef("rbac.authorization.k8s.io/v1", "RoleBinding", pool.index_name),
        ChildRef("rbac.authorization.k8s.io/v1", "Role", pool.index_name),
        ChildRef("v1", "ServiceAccount", pool.index_name),
        ChildRef("v1", "ConfigMap", pool.index_config_name),
    )


def service_monitor_refs(pool: Pool) -> tuple[ChildRef, ...]:
    return (ChildRef("monitoring.coreos.com/v1", "ServiceMonitor", pool.service_name),)


NETWORK_POLICY_API_VERSION = "networking.k8s.io/v1"


def network_policy_refs(pool: Pool) -> tuple[ChildRef, ...]:
    """The agents' NetworkPolicy and the index's."""
    return tuple(
        ChildRef(NETWORK_POLICY_API_VERSION, "NetworkPolicy", name)
        for name in (pool.agent_name, pool.index_name)
    )


class _ArgumentsOnly(BaseSettings):
    """Settings from their keyword arguments only: the operator's environment (variables,
    a config file named there) must not leak into what the operator renders."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)


class _RenderedAgentConfig(_ArgumentsOnly, AgentConfig):
    """AgentConfig from its arguments only."""


class _RenderedIndexConfig(_ArgumentsOnly, IndexConfig):
    """IndexConfig from its arguments only."""


_Settings = TypeVar("_Settings", bound=BaseSettings)


def _configured(model: type[_Settings], component: str, **arguments: Any) -> _Settings:
    """``model`` from ``arguments``; :class:`InvalidSpec` naming the fields it refuses."""
    try:
        return model(**arguments)
    except ValidationError as error:
        raise InvalidSpec(
            f"the {component} configuration is invalid: {describe(error, component)}"
        ) from error


def _config_text(config: BaseSettings) -> str:
    """The settings file a process reads: the fields the operator set, nothing defaulted."""
    return yaml.safe_dump(config.model_dump(mode="json", exclude_unset=True))


def _checksum(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def render(pool: Pool, spec: PoolSpec, *, default_image: str) -> Children:
    """Every child of ``pool``; :class:`InvalidSpec` if the agent or the index would refuse
    its configuration."""
    config = agent_config(pool, spec)
    config_text = _config_text(config)
    service_account, role, role_binding = _agent_rbac(pool)
    index = _index_children(pool, spec, default_image) if spec.index.enabled else None
    monitor = _service_monitor(pool, spec) if spec.metrics.service_monitor.enabled else None
    policies = _network_policies(pool, spec) if spec.network_policy.enabled else ()
    made = {ChildRef.of(policy) for policy in policies}
    return Children(
        service_account=service_account,
        role=role,
        role_binding=role_binding,
        config=_manifest(
            "v1", "ConfigMap", pool, pool.config_name, data={AGENT_CONFIG_KEY: config_text}
        ),
        quotas=_manifest("v1", "ConfigMap", pool, pool.quotas_name),
        tenants=_manifest("v1", "ConfigMap", pool, pool.tenants_name),
        service=_service(pool, spec, config),
        daemonset=_daemonset(pool, spec, config, config_text, default_image),
        index=index,
        service_monitor=monitor,
        network_policies=policies,
        absent=(() if index else index_refs(pool))
        + (() if monitor else service_monitor_refs(pool))
        + tuple(ref for ref in network_policy_refs(pool) if ref not in made),
    )


def agent_config(pool: Pool, spec: PoolSpec) -> AgentConfig:
    """The configuration every agent of the pool runs with."""
    tokens = spec.tenants.tokens_secret_ref
    nvme, s3 = spec.l2.tier("nvme"), spec.l2.tier("s3")
    return _configured(
        _RenderedAgentConfig,
        AGENT_COMPONENT,
        pool=pool.name,
        l1_size=spec.l1.size,
        page_size=spec.l1.page_size,
        lease_seconds=spec.l1.lease_seconds,
        eviction_policy=spec.eviction.policy,
        high_watermark=spec.eviction.high_watermark,
        low_watermark=spec.eviction.low_watermark,
        default_tenant_quota=spec.tenants.default_quota,
        zmq_port=spec.ports.zmq,
        http_port=spec.ports.http,
        events_port=spec.ports.events,
        metrics_top_tenants=spec.metrics.top_tenants,
        state_dir=STATE_DIR,
        tokens_file=TOKENS_PATH if tokens else None,
        quota_configmap=f"{pool.namespace}/{pool.quotas_name}",
        tenants_configmap=f"{pool.namespace}/{pool.tenants_name}",
        l2_key_dir=_l2_key_dir(pool, spec),
        nvme=_nvme_config(nvme.nvme) if nvme and nvme.nvme else None,
        s3=_s3_config(s3.s3) if s3 and s3.s3 else None,
        store_policy=spec.l2.store_policy,
        store_min_hits=spec.l2.store_min_hits,
    )


def index_config(pool: Pool, spec: PoolSpec) -> IndexConfig:
    """The configuration every index replica of the pool runs with."""
    index, fingerprint = spec.index, spec.index.fingerprint
    return _configured(
        _RenderedIndexConfig,
        INDEX_COMPONENT,
        pool=pool.name,
        discovery="kubernetes",
        namespace=pool.namespace,
        host="0.0.0.0",
        http_port=index.port,
        max_chunks_per_node=index.max_chunks_per_node,
        load_factor=index.routing.load_factor,
        load_slack=index.routing.load_slack,
        min_match_ratio=index.routing.min_match_ratio,
        fingerprint=None
        if fingerprint is None
        else {
            **fingerprint.model_dump(),
            "chunk_tokens": fingerprint.chunk_tokens or spec.chunk_tokens,
        },
        tokens_file=TOKENS_PATH,
        state_dir=STATE_DIR,
    )


def _l2_key_dir(pool: Pool, spec: PoolSpec) -> str | None:
    """The mounted key Secret; without one, a node key beside the NVMe tier's files (the
    state directory is lost with the pod, and the files would become misses); no L2, none."""
    if spec.l2.encryption.key_secret_ref is not None:
        return L2_KEYS_DIR
    nvme = spec.l2.tier("nvme")
    if nvme is not None and nvme.nvme is not None:
        return str(PurePosixPath(nvme.nvme.host_path, NODE_KEYS_DIR, pool.name))
    return None


def _nvme_config(tier: NvmeTier) -> dict[str, Any]:
    return {"path": tier.host_path, "capacity": tier.capacity, "encryption": tier.encryption}


def _s3_config(tier: S3Tier) -> dict[str, Any]:
    optional = {
        "endpoint_url": tier.endpoint,
        "region": tier.region,
        "server_side_encryption": tier.server_side_encryption,
        "sse_kms_key_id": tier.sse_kms_key_id,
    }
    return {
        "bucket": tier.bucket,
        "prefix": tier.prefix,
        "encryption": tier.encryption,
        **{name: value for name, value in optional.items() if value},
    }


def agent_memory(spec: PoolSpec) -> int:
    """Bytes of memory an agent needs: its L1 segment (charged to the pod), index, itself."""
    pages = spec.l1.size // spec.l1.page_size
    needed = spec.l1.size + pages * INDEX_BYTES_PER_PAGE + AGENT_BASE_MEMORY
    return -(-needed // (1 << 20)) << 20


def format_bytes(count: int) -> str:
    """A byte count as the canonical quantity the API server stores (``1536Mi``, ``2Gi``)."""
    for suffix, unit in _BINARY_SUFFIXES:
        if count % unit == 0:
            return f"{count // unit}{suffix}"
    return str(count)


def _manifest(
    api_version: str,
    kind: str,
    pool: Pool,
    name: str,
    *,
    component: str = AGENT_COMPONENT,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    **body: Any,
) -> Manifest:
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": pool.namespace,
        "labels": {
            **pool.labels(component),
            MANAGED_BY_LABEL: OPERATOR,
            **(labels or {}),
        },
        "ownerReferences": [
            {
                "apiVersion": API_VERSION,
                "kind": KIND,
                "name": pool.name,
                "uid": pool.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ],
    }
    if annotations:
        metadata["annotations"] = annotations
    return {"apiVersion": api_version, "kind": kind, "metadata": metadata, **body}


def _rbac(
    pool: Pool, name: str, component: str, rules: list[dict[str, Any]]
) -> tuple[Manifest, Manifest, Manifest]:
    """A ServiceAccount ``name``, a Role ``name`` with ``rules``, and their RoleBinding."""
    rbac = "rbac.authorization.k8s.io"
    return (
        _manifest("v1", "ServiceAccount", pool, name, component=component),
        _manifest(f"{rbac}/v1", "Role", pool, name, component=component, rules=rules),
        _manifest(
            f"{rbac}/v1",
            "RoleBinding",
            pool,
            name,
            component=component,
            roleRef={"apiGroup": rbac, "kind": "Role", "name": name},
            subjects=[{"kind": "ServiceAccount", "name": name, "namespace": pool.namespace}],
        ),
    )


def _agent_rbac(pool: Pool) -> tuple[Manifest, Manifest, Manifest]:
    """The agents may read, watch and patch their pool's quota ConfigMap, and read and
    watch its tenants ConfigMap (only the operator writes that one), nothing else."""
    quotas = {
        "apiGroups": [""],
        "resources": ["configmaps"],
        "resourceNames": [pool.quotas_name],
        "verbs": ["get", "list", "watch", "patch"],
    }
    tenants = {
        "apiGroups": [""],
        "resources": ["configmaps"],
        "resourceNames": [pool.tenants_name],
        "verbs": ["get", "list", "watch"],
    }
    return _rbac(pool, pool.agent_name, AGENT_COMPONENT, [quotas, tenants])


def _index_rbac(pool: Pool) -> tuple[Manifest, Manifest, Manifest]:
    """The index lists and watches the pods of its namespace (the pool's agents)."""
    pods = {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    return _rbac(pool, pool.index_name, INDEX_COMPONENT, [pods])


def _ports(spec: PoolSpec) -> list[tuple[str, int]]:
    """The ports of the pool Service (the agent pods also serve ``events``)."""
    return [("zmq", spec.ports.zmq), ("http", spec.ports.http)]


def _service_ports(ports: list[tuple[str, int]]) -> list[dict[str, Any]]:
    return [
        {"name": name, "port": port, "targetPort": name, "protocol": "TCP"} for name, port in ports
    ]


def _container_ports(ports: list[tuple[str, int]]) -> list[dict[str, Any]]:
    return [{"name": name, "containerPort": port, "protocol": "TCP"} for name, port in ports]


def _service(pool: Pool, spec: PoolSpec, config: AgentConfig) -> Manifest:
    discovery = {
        ZMQ_PORT_ANNOTATION: str(spec.ports.zmq),
        HTTP_PORT_ANNOTATION: str(spec.ports.http),
        SEGMENT_PATH_ANNOTATION: str(config.resolved_segment_path),
        CHUNK_TOKENS_ANNOTATION: str(spec.chunk_tokens),
        PROTOCOL_VERSION_ANNOTATION: str(PROTOCOL_VERSION),
    }
    return _manifest(
        "v1",
        "Service",
        pool,
        pool.service_name,
        annotations=discovery,
        spec={
            "type": "ClusterIP",
            "internalTrafficPolicy": "Local",
            "selector": pool.selector(),
            "ports": _service_ports(_ports(spec)),
        },
    )


def _service_monitor(pool: Pool, spec: PoolSpec) -> Manifest:
    monitor = spec.metrics.service_monitor
    return _manifest(
        "monitoring.coreos.com/v1",
        "ServiceMonitor",
        pool,
        pool.service_name,
        labels=monitor.labels,
        spec={
            # Every Service of the pool: the agents' and the index's both name their port http.
            "selector": {"matchLabels": {NAME_LABEL: APP, INSTANCE_LABEL: pool.name}},
            "endpoints": [{"port": "http", "path": "/metrics", "interval": monitor.interval}],
        },
    )


def _peers(peers: tuple[NetworkPeer, ...]) -> list[dict[str, Any]]:
    """The spec's peers as NetworkPolicy peers: each selector as written, ``{}`` included."""
    return [peer.model_dump(mode="json", by_alias=True, exclude_defaults=True) for peer in peers]


def _ingress(peers: list[dict[str, Any]], ports: list[int]) -> list[dict[str, Any]]:
    """One ingress rule admitting ``peers`` to ``ports``; none without peers (a rule without
    ``from`` would admit every source)."""
    if not peers:
        return []
    return [{"from": peers, "ports": [{"protocol": "TCP", "port": port} for port in ports]}]


def _network_policy(
    pool: Pool, component: str, name: str, ingress: list[dict[str, Any]]
) -> Manifest:
    """Isolate a component's pods for ingress (egress stays open) and admit ``ingress``."""
    return _manifest(
        NETWORK_POLICY_API_VERSION,
        "NetworkPolicy",
        pool,
        name,
        component=component,
        spec={
            "podSelector": {"matchLabels": pool.selector(component)},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    )


def _network_policies(pool: Pool, spec: PoolSpec) -> tuple[Manifest, ...]:
    """Clients reach the agents' ZMQ and HTTP ports, Prometheus their HTTP port (/metrics),
    the pool's index their ZMQ (snapshots) and events ports; gateways and Prometheus reach
    the index's port."""
    policy, ports = spec.network_policy, spec.ports
    prometheus = _peers(policy.prometheus)
    index = (
        [{"podSelector": {"matchLabels": pool.selector(INDEX_COMPONENT)}}]
        if spec.index.enabled
        else []
    )
    agents = _network_policy(
        pool,
        AGENT_COMPONENT,
        pool.agent_name,
        _ingress(_peers(policy.clients), [ports.zmq, ports.http])
        + _ingress(index, [ports.zmq, ports.events])
        + _ingress(prometheus, [ports.http]),
    )
    if not spec.index.enabled:
        return (agents,)
    port = spec.index.port
    ingress = _ingress(_peers(policy.gateways), [port]) + _ingress(prometheus, [port])
    return agents, _network_policy(pool, INDEX_COMPONENT, pool.index_name, ingress)


def _resources(
    requests: dict[str, int | str], limits: dict[str, int | str], overrides: ResourcesSpec
) -> dict[str, dict[str, int | str]]:
    """Default requests and limits, each entry overridable by the spec."""
    return {
        "requests": {**requests, **overrides.requests},
        "limits": {**limits, **overrides.limits},
    }


def _probes(startup_failures: int) -> dict[str, Any]:
    """Startup and liveness on /healthz, readiness on /readyz, all on the port named http."""

    def probe(path: str, period: int, failures: int) -> dict[str, Any]:
        return {
            "httpGet": {"path": path, "port": "http"},
            "periodSeconds": period,
            "failureThreshold": failures,
        }

    return {
        "startupProbe": probe("/healthz", 2, startup_failures),
        "livenessProbe": probe("/healthz", 10, 3),
        "readinessProbe": probe("/readyz", 5, 2),
    }


def _container_security() -> dict[str, Any]:
    return {
        "privileged": False,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _pod_security() -> dict[str, Any]:
    """The image's non-root user, the runtime's default seccomp profile."""
    return {
        "runAsNonRoot": True,
        "runAsUser": AGENT_UID,
        "runAsGroup": AGENT_UID,
        "fsGroup": AGENT_UID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


Volume = tuple[dict[str, Any], dict[str, Any]]
"""A pod's volume and its container's mount of it."""


def _config_volume(config_map: str) -> Volume:
    return (
        {"name": "config", "configMap": {"name": config_map}},
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
    )


def _state_volume() -> Volume:
    return {"name": "state", "emptyDir": {}}, {"name": "state", "mountPath": STATE_DIR}


def _tokens_volume(spec: PoolSpec) -> list[Volume]:
    """The pool's tokens Secret at TOKENS_PATH, if it names one."""
    tokens = spec.tenants.tokens_secret_ref
    if tokens is None:
        return []
    volume = {
        "name": "tokens",
        "secret": {
            "secretName": tokens.name,
            "items": [{"key": tokens.key, "path": TOKENS_FILE}],
            "defaultMode": 0o440,
        },
    }
    return [(volume, {"name": "tokens", "mountPath": TOKENS_DIR, "readOnly": True})]


def _l2_keys_volume(spec: PoolSpec) -> list[Volume]:
    """The pool's L2 key Secret at L2_KEYS_DIR, every entry a file, if it names one. The
    kubelet refreshes the files when the Secret changes and the agent rereads them: no roll."""
    keys = spec.l2.encryption.key_secret_ref
    if keys is None:
        return []
    volume = {"name": "l2-keys", "secret": {"secretName": keys.name, "defaultMode": 0o440}}
    return [(volume, {"name": "l2-keys", "mountPath": L2_KEYS_DIR, "readOnly": True})]


def _volumes(pool: Pool, spec: PoolSpec, config: AgentConfig) -> list[Volume]:
    """(volume, mount) pairs of the agent pod."""
    shm = config.resolved_segment_path.parent
    pairs: list[Volume] = [
        _config_volume(pool.config_name),
        (
            {"name": "shm", "hostPath": {"path": str(shm), "type": "Directory"}},
            {"name": "shm", "mountPath": str(shm)},
        ),
        _state_volume(),
        *_tokens_volume(spec),
        *_l2_keys_volume(spec),
    ]
    nvme = spec.l2.tier("nvme")
    if nvme is not None and nvme.nvme is not None:
        path = nvme.nvme.host_path
        pairs.append(
            (
                {"name": "nvme", "hostPath": {"path": path, "type": "DirectoryOrCreate"}},
                {"name": "nvme", "mountPath": path},
            )
        )
    return pairs


def _container(pool: Pool, spec: PoolSpec, config: AgentConfig, image: str) -> dict[str, Any]:
    memory = format_bytes(agent_memory(spec))
    container: dict[str, Any] = {
        "name": "agent",
        "image": image,
        "imagePullPolicy": spec.agent.image_pull_policy,
        "command": ["kvpool-agent"],
        "env": [
            {"name": AGENT_HOST_ENV, "value": "0.0.0.0"},
            {"name": AGENT_CONFIG_FILE_ENV, "value": f"{CONFIG_DIR}/{AGENT_CONFIG_KEY}"},
        ],
        "ports": _container_ports([*_ports(spec), ("events", spec.ports.events)]),
        "resources": _resources(
            {"cpu": AGENT_CPU_REQUEST, "memory": memory},
            {"memory": memory},
            spec.agent.resources,
        ),
        # The segment is reserved up front: a large L1 may take a while to map at start.
        **_probes(startup_failures=150),
        "securityContext": _container_security(),
        "volumeMounts": [mount for _, mount in _volumes(pool, spec, config)],
    }
    s3 = spec.l2.tier("s3")
    if s3 is not None and s3.s3 is not None and s3.s3.credentials_secret_ref is not None:
        container["envFrom"] = [{"secretRef": {"name": s3.s3.credentials_secret_ref.name}}]
    return container


def _init_containers(spec: PoolSpec, image: str) -> list[dict[str, Any]]:
    """Give the NVMe tier's directory to the agent's user (kubelet creates it for root)."""
    nvme = spec.l2.tier("nvme")
    if nvme is None or nvme.nvme is None:
        return []
    path = nvme.nvme.host_path
    return [
        {
            "name": "nvme-owner",
            "image": image,
            "imagePullPolicy": spec.agent.image_pull_policy,
            "command": ["chown", f"{AGENT_UID}:{AGENT_UID}", path],
            "securityContext": {
                "runAsUser": 0,
                "runAsNonRoot": False,
                "allowPrivilegeEscalation": False,
                "readOnlyRootFilesystem": True,
                "capabilities": {"drop": ["ALL"], "add": ["CHOWN"]},
            },
            "volumeMounts": [{"name": "nvme", "mountPath": path}],
        }
    ]


def _pod_template(
    pool: Pool, component: str, config_text: str, pod_spec: dict[str, Any]
) -> dict[str, Any]:
    """A component's pod template, rolled by a checksum of its configuration file."""
    return {
        "metadata": {
            "labels": pool.labels(component),
            "annotations": {CONFIG_CHECKSUM_ANNOTATION: _checksum(config_text)},
        },
        "spec": pod_spec,
    }


def _daemonset(
    pool: Pool, spec: PoolSpec, config: AgentConfig, config_text: str, default_image: str
) -> Manifest:
    agent = spec.agent
    strategy: dict[str, Any] = {"type": agent.update_strategy.type}
    if agent.update_strategy.type == "RollingUpdate":
        strategy["rollingUpdate"] = {"maxUnavailable": agent.update_strategy.max_unavailable}
    image = agent.image or default_image
    scheduling: dict[str, Any] = {
        "initContainers": _init_containers(spec, image),
        "nodeSelector": agent.node_selector,
        "tolerations": list(agent.tolerations),
        "affinity": agent.affinity,
        "priorityClassName": agent.priority_class_name,
    }
    pod_spec: dict[str, Any] = {
        "serviceAccountName": pool.agent_name,
        "securityContext": _pod_security(),
        **{key: value for key, value in scheduling.items() if value},
        "containers": [_container(pool, spec, config, image)],
        "volumes": [volume for volume, _ in _volumes(pool, spec, config)],
    }
    return _manifest(
        "apps/v1",
        "DaemonSet",
        pool,
        pool.agent_name,
        spec={
            "selector": {"matchLabels": pool.selector()},
            "updateStrategy": strategy,
            "template": _pod_template(pool, AGENT_COMPONENT, config_text, pod_spec),
        },
    )


def _index_children(pool: Pool, spec: PoolSpec, default_image: str) -> IndexChildren:
    config_text = _config_text(index_config(pool, spec))
    service_account, role, role_binding = _index_rbac(pool)
    port = [("http", spec.index.port)]
    return IndexChildren(
        config=_manifest(
            "v1",
            "ConfigMap",
            pool,
            pool.index_config_name,
            component=INDEX_COMPONENT,
            data={INDEX_CONFIG_KEY: config_text},
        ),
        service_account=service_account,
        role=role,
        role_binding=role_binding,
        service=_manifest(
            "v1",
            "Service",
            pool,
            pool.index_name,
            component=INDEX_COMPONENT,
            spec={
                "type": "ClusterIP",
                "selector": pool.selector(INDEX_COMPONENT),
                "ports": _service_ports(port),
            },
        ),
        deployment=_index_deployment(pool, spec, config_text, default_image),
    )


def _index_deployment(pool: Pool, spec: PoolSpec, config_text: str, default_image: str) -> Manifest:
    index = spec.index
    volumes = [_config_volume(pool.index_config_name), _state_volume(), *_tokens_volume(spec)]
    container = {
        "name": "index",
        "image": index.image or spec.agent.image or default_image,
        "imagePullPolicy": spec.agent.image_pull_policy,
        "command": ["kvpool", "index"],
        "env": [{"name": INDEX_CONFIG_FILE_ENV, "value": f"{CONFIG_DIR}/{INDEX_CONFIG_KEY}"}],
        "ports": _container_ports([("http", index.port)]),
        "resources": _resources(
            {"cpu": INDEX_CPU_REQUEST, "memory": INDEX_MEMORY_REQUEST},
            {"memory": INDEX_MEMORY_LIMIT},
            index.resources,
        ),
        **_probes(startup_failures=30),
        "securityContext": _container_security(),
        "volumeMounts": [mount for _, mount in volumes],
    }
    scheduling: dict[str, Any] = {
        "nodeSelector": index.node_selector,
        "tolerations": list(index.tolerations),
        # replicas on different nodes where the cluster allows: one node's loss leaves routes
        "affinity": {
            "podAntiAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "weight": 100,
                        "podAffinityTerm": {
                            "labelSelector": {"matchLabels": pool.selector(INDEX_COMPONENT)},
                            "topologyKey": "kubernetes.io/hostname",
                        },
                    }
                ]
            }
        }
        if index.replicas > 1
        else None,
    }
    pod_spec: dict[str, Any] = {
        "serviceAccountName": pool.index_name,
        "securityContext": _pod_security(),
        **{key: value for key, value in scheduling.items() if value},
        "containers": [container],
        "volumes": [volume for volume, _ in volumes],
    }
    return _manifest(
        "apps/v1",
        "Deployment",
        pool,
        pool.index_name,
        component=INDEX_COMPONENT,
        spec={
            "replicas": index.replicas,
            "selector": {"matchLabels": pool.selector(INDEX_COMPONENT)},
            "template": _pod_template(pool, INDEX_COMPONENT, config_text, pod_spec),
        },
    )
