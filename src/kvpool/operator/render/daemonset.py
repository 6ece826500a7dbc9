"""The agents' DaemonSet ``kvpool-<pool>-agent``: one agent per selected node, its memory
sized from L1, its volumes (the node's /dev/shm, the NVMe tier, the tokens, L2 keys and
peer Secrets), with peers its port ``peer`` and its node's name, rolled by a checksum of
``agent.yaml``."""

from __future__ import annotations

from typing import Any

from kvpool.common.config import AgentConfig
from kvpool.common.names import (
    AGENT_COMPONENT,
    AGENT_CONFIG_FILE_ENV,
    AGENT_CONFIG_KEY,
    AGENT_HOST_ENV,
    NODE_NAME_ENV,
    SHM_DIR,
)
from kvpool.operator.render.config import L2_KEYS_DIR
from kvpool.operator.render.objects import Manifest, Pool, manifest
from kvpool.operator.render.pods import (
    AGENT_UID,
    CONFIG_DIR,
    Volume,
    config_volume,
    container_ports,
    container_security,
    peer_keys_volume,
    pod_security,
    pod_template,
    probes,
    resources,
    state_volume,
    tokens_volume,
)
from kvpool.operator.render.services import agent_ports
from kvpool.operator.spec import PoolSpec

AGENT_BASE_MEMORY = 256 << 20
"""Memory of the agent process itself, beyond its L1 segment and index."""
INDEX_BYTES_PER_PAGE = 256
"""Upper bound of the L1 index and allocator metadata per page of the segment."""
AGENT_CPU_REQUEST = "250m"
_BINARY_SUFFIXES = (("Ti", 1 << 40), ("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10))


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
    # The node's /dev/shm, where the agent creates its pool's directory (mode 0710, its group
    # may reach the segment): the CSI plugin publishes that directory into tenants' pods.
    shm = str(SHM_DIR)
    pairs: list[Volume] = [
        config_volume(pool.config_name),
        (
            {"name": "shm", "hostPath": {"path": shm, "type": "Directory"}},
            {"name": "shm", "mountPath": shm},
        ),
        state_volume(),
        *tokens_volume(spec),
        *_l2_keys_volume(spec),
        *peer_keys_volume(pool, spec),
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
    ports = [*agent_ports(spec), ("events", spec.ports.events)]
    env: list[dict[str, Any]] = [
        {"name": AGENT_HOST_ENV, "value": "0.0.0.0"},
        {"name": AGENT_CONFIG_FILE_ENV, "value": f"{CONFIG_DIR}/{AGENT_CONFIG_KEY}"},
    ]
    security = container_security()
    if spec.peers.enabled:  # the port its peers find it at, its name among them
        ports.append(("peer", spec.peers.port))
        env.append(
            {"name": NODE_NAME_ENV, "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}
        )
    if spec.peers.enabled and spec.peers.transport == "nixl":
        env += [{"name": name, "value": value} for name, value in _ucx_environment(spec)]
        if spec.peers.nixl.lock_memory:
            security["capabilities"]["add"] = ["IPC_LOCK"]
    container: dict[str, Any] = {
        "name": "agent",
        "image": image,
        "imagePullPolicy": spec.agent.image_pull_policy,
        "command": ["kvpool-agent"],
        "env": env,
        "ports": container_ports(ports),
        "resources": resources(
            {"cpu": AGENT_CPU_REQUEST, "memory": memory},
            {"memory": memory},
            spec.agent.resources,
        ),
        # The segment is reserved up front: a large L1 may take a while to map at start.
        **probes(startup_failures=150),
        "securityContext": security,
        "volumeMounts": [mount for _, mount in _volumes(pool, spec, config)],
    }
    s3 = spec.l2.tier("s3")
    if s3 is not None and s3.s3 is not None and s3.s3.credentials_secret_ref is not None:
        container["envFrom"] = [{"secretRef": {"name": s3.s3.credentials_secret_ref.name}}]
    return container


def _ucx_environment(spec: PoolSpec) -> list[tuple[str, str]]:
    """UCX's TCP ports (those the NetworkPolicy opens), then the spec's UCX variables."""
    nixl = spec.peers.nixl
    ports = {"UCX_TCP_PORT_RANGE": f"{nixl.tcp_ports.first}-{nixl.tcp_ports.last}"}
    return sorted({**ports, **nixl.ucx}.items())


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


def daemonset(
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
        "securityContext": pod_security(),
        **{key: value for key, value in scheduling.items() if value},
        "containers": [_container(pool, spec, config, image)],
        "volumes": [volume for volume, _ in _volumes(pool, spec, config)],
    }
    return manifest(
        "apps/v1",
        "DaemonSet",
        pool,
        pool.agent_name,
        spec={
            "selector": {"matchLabels": pool.selector()},
            "updateStrategy": strategy,
            "template": pod_template(pool, AGENT_COMPONENT, config_text, pod_spec),
        },
    )
