"""Render a pool's children: pure functions from a pool and its spec to manifests.

The children (shared/ARCHITECTURE.md), all in the pool's namespace, all labelled with
the pool and owned by it (a controller ownerReference, so deleting the pool deletes them):

- ``kvpool-<pool>-config``: ConfigMap, key ``agent.yaml``: the agent's own
  :class:`~kvpool_agent.config.AgentConfig`, validated by that model and dumped from it;
- ``kvpool-<pool>-quotas``: ConfigMap of tenant quotas; the operator renders only its
  metadata, the agents own its data;
- ``kvpool-<pool>-agent``: ServiceAccount, Role and RoleBinding that let the agents read,
  watch and patch that one quota ConfigMap;
- ``kvpool-<pool>-agent``: DaemonSet of agents, rolled by a checksum of ``agent.yaml``;
- ``kvpool-<pool>``: Service (``internalTrafficPolicy: Local``) whose annotations tell
  the vLLM connector how to reach and use its node's agent;
- ``kvpool-<pool>``: ServiceMonitor, when the spec asks for one.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import yaml
from pydantic import ValidationError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

from kvpool_agent.config import AgentConfig
from kvpool_agent.protocol import PROTOCOL_VERSION
from kvpool_operator.spec import (
    API_VERSION,
    KIND,
    InvalidSpec,
    NvmeTier,
    PoolSpec,
    S3Tier,
    describe,
)

Manifest = dict[str, Any]

NAME_LABEL = "app.kubernetes.io/name"
INSTANCE_LABEL = "app.kubernetes.io/instance"
COMPONENT_LABEL = "app.kubernetes.io/component"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
POOL_LABEL = "kvpool.io/pool"
CHECKSUM_ANNOTATION = "kvpool.io/config-checksum"
DISCOVERY_ANNOTATIONS = (
    "kvpool.io/zmq-port",
    "kvpool.io/http-port",
    "kvpool.io/segment-path",
    "kvpool.io/chunk-tokens",
    "kvpool.io/protocol-version",
)

CONFIG_KEY = "agent.yaml"
CONFIG_DIR = "/etc/kvpool/config"
TOKENS_DIR = "/etc/kvpool/tokens"
TOKENS_FILE = "tokens.yaml"
STATE_DIR = "/var/lib/kvpool"
AGENT_UID = 10001
"""The agent image's user (Dockerfile)."""

AGENT_BASE_MEMORY = 256 << 20
"""Memory of the agent process itself, beyond its L1 segment and index."""
INDEX_BYTES_PER_PAGE = 256
"""Upper bound of the L1 index and allocator metadata per page of the segment."""
AGENT_CPU_REQUEST = "250m"
_BINARY_SUFFIXES = (("Ti", 1 << 40), ("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10))


@dataclass(frozen=True)
class Pool:
    """The identity of a KVCachePool: what its children are named after and owned by."""

    name: str
    namespace: str
    uid: str

    @property
    def config_name(self) -> str:
        return f"kvpool-{self.name}-config"

    @property
    def quotas_name(self) -> str:
        return f"kvpool-{self.name}-quotas"

    @property
    def agent_name(self) -> str:
        return f"kvpool-{self.name}-agent"

    @property
    def service_name(self) -> str:
        return f"kvpool-{self.name}"

    def labels(self) -> dict[str, str]:
        return {
            NAME_LABEL: "kvpool",
            INSTANCE_LABEL: self.name,
            COMPONENT_LABEL: "agent",
            POOL_LABEL: self.name,
        }

    def selector(self) -> dict[str, str]:
        """The agent pods' labels that the DaemonSet and the Service select on."""
        return {key: self.labels()[key] for key in (NAME_LABEL, INSTANCE_LABEL, COMPONENT_LABEL)}


@dataclass(frozen=True)
class Children:
    """Every child of one pool, in the order they are applied (the DaemonSet last)."""

    service_account: Manifest
    role: Manifest
    role_binding: Manifest
    config: Manifest
    quotas: Manifest
    service: Manifest
    daemonset: Manifest
    service_monitor: Manifest | None

    def required(self) -> list[Manifest]:
        """The children every pool has (the ServiceMonitor is optional)."""
        return [
            self.service_account,
            self.role,
            self.role_binding,
            self.config,
            self.quotas,
            self.service,
            self.daemonset,
        ]


class _RenderedAgentConfig(AgentConfig):
    """AgentConfig from its arguments only: the operator's environment must not leak in."""

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


def render(pool: Pool, spec: PoolSpec, *, default_image: str) -> Children:
    """Every child of ``pool``; :class:`InvalidSpec` if the agent would refuse its config."""
    config = agent_config(pool, spec)
    config_text = yaml.safe_dump(config.model_dump(mode="json", exclude_unset=True))
    return Children(
        service_account=_service_account(pool),
        role=_role(pool),
        role_binding=_role_binding(pool),
        config=_manifest("v1", "ConfigMap", pool, pool.config_name, data={CONFIG_KEY: config_text}),
        quotas=_manifest("v1", "ConfigMap", pool, pool.quotas_name),
        service=_service(pool, spec, config),
        daemonset=_daemonset(pool, spec, config, config_text, default_image),
        service_monitor=_service_monitor(pool, spec)
        if spec.metrics.service_monitor.enabled
        else None,
    )


def agent_config(pool: Pool, spec: PoolSpec) -> AgentConfig:
    """The configuration every agent of the pool runs with."""
    tokens = spec.tenants.tokens_secret_ref
    nvme, s3 = spec.l2.tier("nvme"), spec.l2.tier("s3")
    try:
        return _RenderedAgentConfig(
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
            tokens_file=f"{TOKENS_DIR}/{TOKENS_FILE}" if tokens else None,
            quota_configmap=f"{pool.namespace}/{pool.quotas_name}",
            nvme=_nvme_config(nvme.nvme) if nvme and nvme.nvme else None,
            s3=_s3_config(s3.s3) if s3 and s3.s3 else None,
            store_policy=spec.l2.store_policy,
            store_min_hits=spec.l2.store_min_hits,
        )
    except ValidationError as error:
        raise InvalidSpec(
            f"the agent configuration is invalid: {describe(error, 'agent')}"
        ) from error


def _nvme_config(tier: NvmeTier) -> dict[str, Any]:
    return {"path": tier.host_path, "capacity": tier.capacity}


def _s3_config(tier: S3Tier) -> dict[str, Any]:
    settings = {"bucket": tier.bucket, "prefix": tier.prefix}
    settings |= {"endpoint_url": tier.endpoint} if tier.endpoint else {}
    return settings | ({"region": tier.region} if tier.region else {})


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
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    **body: Any,
) -> Manifest:
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": pool.namespace,
        "labels": {**pool.labels(), MANAGED_BY_LABEL: "kvpool-operator", **(labels or {})},
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


def _service_account(pool: Pool) -> Manifest:
    return _manifest("v1", "ServiceAccount", pool, pool.agent_name)


def _role(pool: Pool) -> Manifest:
    return _manifest(
        "rbac.authorization.k8s.io/v1",
        "Role",
        pool,
        pool.agent_name,
        rules=[
            {
                "apiGroups": [""],
                "resources": ["configmaps"],
                "resourceNames": [pool.quotas_name],
                "verbs": ["get", "list", "watch", "patch"],
            }
        ],
    )


def _role_binding(pool: Pool) -> Manifest:
    return _manifest(
        "rbac.authorization.k8s.io/v1",
        "RoleBinding",
        pool,
        pool.agent_name,
        roleRef={"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": pool.agent_name},
        subjects=[{"kind": "ServiceAccount", "name": pool.agent_name, "namespace": pool.namespace}],
    )


def _ports(spec: PoolSpec) -> list[tuple[str, int]]:
    """The ports of the pool Service (the agent pods also serve ``events``)."""
    return [("zmq", spec.ports.zmq), ("http", spec.ports.http)]


def _service(pool: Pool, spec: PoolSpec, config: AgentConfig) -> Manifest:
    discovery = dict(
        zip(
            DISCOVERY_ANNOTATIONS,
            (
                str(spec.ports.zmq),
                str(spec.ports.http),
                str(config.resolved_segment_path),
                str(spec.chunk_tokens),
                str(PROTOCOL_VERSION),
            ),
            strict=True,
        )
    )
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
            "ports": [
                {"name": name, "port": port, "targetPort": name, "protocol": "TCP"}
                for name, port in _ports(spec)
            ],
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
            "selector": {"matchLabels": pool.selector()},
            "endpoints": [{"port": "http", "path": "/metrics", "interval": monitor.interval}],
        },
    )


def _resources(spec: PoolSpec) -> dict[str, dict[str, int | str]]:
    memory = format_bytes(agent_memory(spec))
    overrides = spec.agent.resources
    return {
        "requests": {"cpu": AGENT_CPU_REQUEST, "memory": memory, **overrides.requests},
        "limits": {"memory": memory, **overrides.limits},
    }


def _volumes(
    pool: Pool, spec: PoolSpec, config: AgentConfig
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(volume, mount) pairs of the agent pod."""
    shm = config.resolved_segment_path.parent
    pairs: list[tuple[dict[str, Any], dict[str, Any]]] = [
        (
            {"name": "config", "configMap": {"name": pool.config_name}},
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        ),
        (
            {"name": "shm", "hostPath": {"path": str(shm), "type": "Directory"}},
            {"name": "shm", "mountPath": str(shm)},
        ),
        ({"name": "state", "emptyDir": {}}, {"name": "state", "mountPath": STATE_DIR}),
    ]
    tokens = spec.tenants.tokens_secret_ref
    if tokens is not None:
        pairs.append(
            (
                {
                    "name": "tokens",
                    "secret": {
                        "secretName": tokens.name,
                        "items": [{"key": tokens.key, "path": TOKENS_FILE}],
                        "defaultMode": 0o440,
                    },
                },
                {"name": "tokens", "mountPath": TOKENS_DIR, "readOnly": True},
            )
        )
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
    def probe(path: str, period: int, failures: int) -> dict[str, Any]:
        return {
            "httpGet": {"path": path, "port": "http"},
            "periodSeconds": period,
            "failureThreshold": failures,
        }

    container: dict[str, Any] = {
        "name": "agent",
        "image": image,
        "imagePullPolicy": spec.agent.image_pull_policy,
        "command": ["kvpool-agent"],
        "env": [
            {"name": "KVPOOL_HOST", "value": "0.0.0.0"},
            {"name": "KVPOOL_CONFIG_FILE", "value": f"{CONFIG_DIR}/{CONFIG_KEY}"},
        ],
        "ports": [
            {"name": name, "containerPort": port, "protocol": "TCP"}
            for name, port in [*_ports(spec), ("events", spec.ports.events)]
        ],
        "resources": _resources(spec),
        # The segment is reserved up front: a large L1 may take a while to map at start.
        "startupProbe": probe("/healthz", 2, 150),
        "livenessProbe": probe("/healthz", 10, 3),
        "readinessProbe": probe("/readyz", 5, 2),
        "securityContext": {
            "privileged": False,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
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
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": AGENT_UID,
            "runAsGroup": AGENT_UID,
            "fsGroup": AGENT_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        **{key: value for key, value in scheduling.items() if value},
        "containers": [_container(pool, spec, config, image)],
        "volumes": [volume for volume, _ in _volumes(pool, spec, config)],
    }
    checksum = hashlib.sha256(config_text.encode()).hexdigest()
    return _manifest(
        "apps/v1",
        "DaemonSet",
        pool,
        pool.agent_name,
        spec={
            "selector": {"matchLabels": pool.selector()},
            "updateStrategy": strategy,
            "template": {
                "metadata": {
                    "labels": pool.labels(),
                    "annotations": {CHECKSUM_ANNOTATION: checksum},
                },
                "spec": pod_spec,
            },
        },
    )
