"""Rendering a pool's children: valid Kubernetes objects that carry the contracts."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvpool.common.config import AgentConfig
from kvpool.common.index_config import IndexConfig
from kvpool.common.names import (
    AGENT_CONFIG_FILE_ENV,
    COMPONENT_LABEL,
    CONFIG_CHECKSUM_ANNOTATION,
    DEFAULT_PEER_PORT,
    INDEX_CONFIG_FILE_ENV,
    NODE_NAME_ENV,
    POOL_LABEL,
)
from kvpool.common.protocol import PROTOCOL_VERSION
from kvpool.operator.render import (
    ChildRef,
    Children,
    IndexChildren,
    Pool,
    agent_memory,
    format_bytes,
    index_refs,
    network_policy_refs,
    render,
    service_monitor_refs,
)
from kvpool.operator.spec import InvalidSpec, PoolSpec
from tests.support.crd_schema import EXAMPLES, GPU_EXAMPLE, OLDEST_KUBERNETES

from .network_policy import Pod, admits

POOL = Pool("gpu", "inference", "0d3c5e9a-1f2b-4c6d-8e9f-0a1b2c3d4e5f")
IMAGE = "registry.example/kvpool:1.0"
LABELS = {
    "app.kubernetes.io/name": "kvpool",
    "app.kubernetes.io/instance": "gpu",
    "app.kubernetes.io/component": "agent",
    "kvpool.io/pool": "gpu",
}


def _spec(path: Path) -> PoolSpec:
    return PoolSpec.parse(yaml.safe_load(path.read_text())["spec"])


def _children(spec: PoolSpec | None = None) -> Children:
    return render(POOL, spec or PoolSpec(), default_image=IMAGE)


TOKENS = {"tenants": {"tokensSecretRef": {"name": "kvpool-gpu-tokens"}}}
NO_OFFICIAL_SCHEMA = {"ServiceMonitor"}
"""prometheus-operator's kind; test_service_monitor checks it."""


def _pod(children: Children) -> dict[str, Any]:
    pod: dict[str, Any] = children.daemonset["spec"]["template"]["spec"]
    return pod


def _index(
    spec: dict[str, Any] | None = None, index: dict[str, Any] | None = None
) -> IndexChildren:
    """The index children of a pool with tokens and ``spec.index`` = enabled + ``index``."""
    pool = {**TOKENS, **(spec or {}), "index": {"enabled": True, **(index or {})}}
    children = _children(PoolSpec.parse(pool)).index
    assert children is not None
    return children


def _index_pod(index: IndexChildren) -> dict[str, Any]:
    pod: dict[str, Any] = index.deployment["spec"]["template"]["spec"]
    return pod


@pytest.mark.parametrize("version", [OLDEST_KUBERNETES, kubernetes_validate.latest_version()])
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda path: path.name)
def test_children_are_valid_kubernetes_objects(example: Path, version: str) -> None:
    for child in _children(_spec(example)).present():
        if child["kind"] not in NO_OFFICIAL_SCHEMA:
            kubernetes_validate.validate(child, version, strict=True)


@pytest.mark.parametrize("version", [OLDEST_KUBERNETES, kubernetes_validate.latest_version()])
def test_index_children_of_every_option_are_valid_kubernetes_objects(version: str) -> None:
    index = _index(
        index={
            "image": "registry.example/kvpool-index:1.0",
            "replicas": 3,
            "port": 8080,
            "fingerprint": {"model": "m", "dtype": "bfloat16", "kvLayout": "nhd", "tpSize": 2},
            "resources": {"requests": {"cpu": 1}, "limits": {"cpu": "2", "memory": "8Gi"}},
            "nodeSelector": {"pool": "cpu"},
            "tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
        }
    )
    for child in index.manifests():
        kubernetes_validate.validate(child, version, strict=True)


def test_names_labels_and_owner() -> None:
    children = _children(_spec(GPU_EXAMPLE))
    names = {(c["kind"], c["metadata"]["name"]) for c in children.present()}
    assert names == {
        ("ConfigMap", "kvpool-gpu-config"),
        ("ConfigMap", "kvpool-gpu-quotas"),
        ("ConfigMap", "kvpool-gpu-tenants"),
        ("DaemonSet", "kvpool-gpu-agent"),
        ("Service", "kvpool-gpu"),
        ("ServiceMonitor", "kvpool-gpu"),
        ("ServiceAccount", "kvpool-gpu-agent"),
        ("Role", "kvpool-gpu-agent"),
        ("RoleBinding", "kvpool-gpu-agent"),
        ("ConfigMap", "kvpool-gpu-index-config"),
        ("ServiceAccount", "kvpool-gpu-index"),
        ("Role", "kvpool-gpu-index"),
        ("RoleBinding", "kvpool-gpu-index"),
        ("Deployment", "kvpool-gpu-index"),
        ("Service", "kvpool-gpu-index"),
        ("NetworkPolicy", "kvpool-gpu-agent"),
        ("NetworkPolicy", "kvpool-gpu-index"),
    }
    assert children.absent == ()
    assert children.index is not None
    index = [child["metadata"]["name"] for child in children.index.manifests()]
    for child in children.present():
        metadata = child["metadata"]
        assert metadata["namespace"] == POOL.namespace
        component = "index" if metadata["name"] in index else "agent"
        assert {**LABELS, COMPONENT_LABEL: component}.items() <= metadata["labels"].items()
        assert metadata["ownerReferences"] == [
            {
                "apiVersion": "kvpool.io/v1alpha1",
                "kind": "KVCachePool",
                "name": "gpu",
                "uid": POOL.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]


def test_agent_config_is_the_agents_own_model(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with monkeypatch.context() as operator_env:  # the operator's environment must not leak
        operator_env.setenv("KVPOOL_HOST", "10.0.0.1")
        operator_env.setenv("KVPOOL_LEASE_SECONDS", "1")
        text = _children(_spec(GPU_EXAMPLE)).config["data"]["agent.yaml"]
    rendered = yaml.safe_load(text)
    assert "host" not in rendered
    assert rendered["lease_seconds"] == 30
    (tmp_path / "agent.yaml").write_text(text)
    monkeypatch.setenv(AGENT_CONFIG_FILE_ENV, str(tmp_path / "agent.yaml"))
    config = AgentConfig()  # what the agent reads from the mounted ConfigMap
    assert config.pool == "gpu"
    assert int(config.l1_size) == 64 << 30
    assert int(config.page_size) == 64 << 10
    assert config.eviction_policy == "arc"
    assert (config.high_watermark, config.low_watermark) == (0.92, 0.85)
    assert config.default_tenant_quota == 8 << 30
    assert (config.zmq_port, config.http_port) == (7400, 7401)
    assert config.metrics_top_tenants == 50
    assert str(config.tokens_file) == "/etc/kvpool/tokens/tokens.yaml"
    assert str(config.state_dir) == "/var/lib/kvpool"
    assert config.nvme is not None and config.s3 is not None
    assert (str(config.nvme.path), int(config.nvme.capacity)) == ("/mnt/nvme0/kvpool", 1 << 40)
    assert (config.s3.bucket, config.s3.prefix, config.s3.region) == (
        "kv-cache",
        "prod/gpu",
        "eu-west-1",
    )
    assert config.s3.endpoint_url is None
    assert (config.nvme.encryption, config.s3.encryption) == (True, True)
    assert (config.s3.server_side_encryption, config.s3.sse_kms_key_id) == (
        "aws:kms",
        "alias/kvpool",
    )
    assert str(config.l2_key_dir) == "/etc/kvpool/l2-keys"
    assert (config.store_policy, config.store_min_hits) == ("reused", 2)
    assert config.peers is not None
    assert (config.peers.port, str(config.peers.key_dir)) == (7404, "/etc/kvpool/peer-keys")
    assert (config.peers.discovery, config.peers.namespace) == ("kubernetes", "inference")
    assert (config.peers.max_transfers, int(config.peers.bandwidth)) == (8, 2 << 30)
    assert config.events_port == 7402
    assert config.quota_configmap == "inference/kvpool-gpu-quotas"
    assert config.tenants_configmap == "inference/kvpool-gpu-tenants"


def test_a_pool_without_l2_has_an_agent_without_l2() -> None:
    rendered = yaml.safe_load(_children().config["data"]["agent.yaml"])
    assert (rendered["nvme"], rendered["s3"]) == (None, None)
    assert rendered["l2_key_dir"] is None


L2_KEY = {"encryption": {"keySecretRef": {"name": "kvpool-gpu-l2-key"}}}
NVME_TIER = {"type": "nvme", "nvme": {"hostPath": "/mnt/nvme0/kvpool", "capacity": "1Ti"}}
S3_TIER = {"type": "s3", "s3": {"bucket": "kv-cache"}}


def _l2_children(*tiers: dict[str, Any], **l2: Any) -> Children:
    return _children(PoolSpec.parse({"l2": {"tiers": list(tiers), **l2}}))


def _agent_yaml(children: Children) -> dict[str, Any]:
    rendered: dict[str, Any] = yaml.safe_load(children.config["data"]["agent.yaml"])
    return rendered


def _volume_and_mount(children: Children, name: str) -> tuple[Any, Any]:
    """The pod's volume ``name`` and the agent's mount of it (None where absent)."""
    pod = _pod(children)
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    mounts = {mount["name"]: mount for mount in pod["containers"][0]["volumeMounts"]}
    return volumes.get(name), mounts.get(name)


@pytest.mark.parametrize("version", [OLDEST_KUBERNETES, kubernetes_validate.latest_version()])
def test_the_pools_l2_key_secret_is_mounted_for_the_agents(version: str) -> None:
    """Read-only, every entry a key file the agent's group (fsGroup) can read; the agent is
    told where. The operator itself never reads the Secret."""
    children = _l2_children(NVME_TIER, S3_TIER, **L2_KEY)
    kubernetes_validate.validate(children.daemonset, version, strict=True)
    volume, mount = _volume_and_mount(children, "l2-keys")
    assert volume == {
        "name": "l2-keys",
        "secret": {"secretName": "kvpool-gpu-l2-key", "defaultMode": 0o440},
    }
    assert mount == {"name": "l2-keys", "mountPath": "/etc/kvpool/l2-keys", "readOnly": True}
    assert _agent_yaml(children)["l2_key_dir"] == mount["mountPath"]
    assert _agent_yaml(_l2_children(**L2_KEY))["l2_key_dir"] == mount["mountPath"]


def test_without_a_key_secret_an_nvme_tier_keeps_a_node_key_beside_its_files() -> None:
    """The state directory goes with the pod: a key there would turn the NVMe files, which
    outlive it, into misses. The key directory lies in the tier's hostPath mount."""
    children = _l2_children(NVME_TIER)
    assert _volume_and_mount(children, "l2-keys") == (None, None)
    _, nvme = _volume_and_mount(children, "nvme")
    key_dir = Path(_agent_yaml(children)["l2_key_dir"])
    assert key_dir == Path("/mnt/nvme0/kvpool/.kvpool-keys/gpu")
    assert key_dir.is_relative_to(nvme["mountPath"])
    trailing_slash = {"type": "nvme", "nvme": {"hostPath": "/mnt/nvme0/", "capacity": "1Ti"}}
    assert _agent_yaml(_l2_children(trailing_slash))["l2_key_dir"] == "/mnt/nvme0/.kvpool-keys/gpu"


def test_the_tiers_encryption_settings_reach_the_agent() -> None:
    defaulted = _agent_yaml(_l2_children(NVME_TIER, S3_TIER, **L2_KEY))
    assert (defaulted["nvme"]["encryption"], defaulted["s3"]["encryption"]) == (False, True)
    assert not {"server_side_encryption", "sse_kms_key_id"} & defaulted["s3"].keys()
    sealed_nvme = {"type": "nvme", "nvme": {**NVME_TIER["nvme"], "encryption": True}}
    s3 = {
        "type": "s3",
        "s3": {
            "bucket": "kv-cache",
            "encryption": False,
            "serverSideEncryption": "aws:kms:dsse",
            "sseKmsKeyId": "arn:aws:kms:eu-west-1:111122223333:key/kv",
        },
    }
    chosen = _agent_yaml(_l2_children(sealed_nvme, s3, **L2_KEY))
    assert (chosen["nvme"]["encryption"], chosen["s3"]["encryption"]) == (True, False)
    assert chosen["s3"]["server_side_encryption"] == "aws:kms:dsse"
    assert chosen["s3"]["sse_kms_key_id"] == "arn:aws:kms:eu-west-1:111122223333:key/kv"


def test_service_tells_the_connector_where_the_agent_is() -> None:
    service = _children(PoolSpec.parse({"chunkTokens": 512, "ports": {"zmq": 9000}})).service
    assert service["metadata"]["annotations"] == {
        "kvpool.io/zmq-port": "9000",
        "kvpool.io/http-port": "7401",
        "kvpool.io/segment-path": "/dev/shm/kvpool-gpu/segment",
        "kvpool.io/chunk-tokens": "512",
        "kvpool.io/protocol-version": str(PROTOCOL_VERSION),
    }
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["internalTrafficPolicy"] == "Local"
    assert service["spec"]["selector"] == {
        k: v for k, v in LABELS.items() if k.startswith("app.kubernetes.io/")
    }
    assert [(p["name"], p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [
        ("zmq", 9000, "zmq"),
        ("http", 7401, "http"),
    ]


def test_agent_pod() -> None:
    children = _children(_spec(GPU_EXAMPLE))
    pod = _pod(children)
    (container,) = pod["containers"]
    assert container["command"] == ["kvpool-agent"]
    assert container["image"] == IMAGE
    env = {e["name"]: e.get("value") or e["valueFrom"] for e in container["env"]}
    assert env == {
        "KVPOOL_HOST": "0.0.0.0",
        "KVPOOL_CONFIG_FILE": "/etc/kvpool/config/agent.yaml",
        NODE_NAME_ENV: {"fieldRef": {"fieldPath": "spec.nodeName"}},  # its name among peers
    }
    assert container["envFrom"] == [{"secretRef": {"name": "kvpool-s3"}}]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"zmq": 7400, "http": 7401, "events": 7402, "peer": 7404}
    # unprivileged, and no host IPC: the segment is shared through a hostPath
    assert "hostIPC" not in pod and "hostNetwork" not in pod and "hostPID" not in pod
    assert container["securityContext"]["privileged"] is False
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert volumes["shm"]["hostPath"] == {"path": "/dev/shm", "type": "Directory"}
    assert mounts["shm"] == "/dev/shm"
    assert volumes["config"]["configMap"]["name"] == "kvpool-gpu-config"
    assert mounts["config"] == "/etc/kvpool/config"
    assert volumes["tokens"]["secret"]["secretName"] == "kvpool-gpu-tokens"
    assert volumes["tokens"]["secret"]["items"] == [{"key": "tokens.yaml", "path": "tokens.yaml"}]
    assert mounts["tokens"] == "/etc/kvpool/tokens"
    assert volumes["nvme"]["hostPath"] == {"path": "/mnt/nvme0/kvpool", "type": "DirectoryOrCreate"}
    assert mounts["nvme"] == "/mnt/nvme0/kvpool"
    (owner,) = pod["initContainers"]  # kubelet makes the directory for root
    assert owner["command"] == ["chown", "10001:10001", "/mnt/nvme0/kvpool"]
    assert owner["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    assert pod["serviceAccountName"] == "kvpool-gpu-agent"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert pod["priorityClassName"] == "system-node-critical"
    strategy = children.daemonset["spec"]["updateStrategy"]
    assert strategy == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "10%"}}


def test_a_minimal_pool_sets_no_optional_scheduling() -> None:
    pod = _pod(_children())
    optional = {"initContainers", "nodeSelector", "tolerations", "affinity", "priorityClassName"}
    assert not optional & pod.keys()
    assert {v["name"] for v in pod["volumes"]} == {"config", "shm", "state", "peer-keys"}
    assert "envFrom" not in pod["containers"][0]


def test_memory_is_sized_from_l1() -> None:
    small, large = PoolSpec.parse({}), PoolSpec.parse({"l1": {"size": "64Gi"}})
    for spec in (small, large):
        assert spec.l1.size < agent_memory(spec) <= spec.l1.size + (512 << 20)
        resources = _pod(_children(spec))["containers"][0]["resources"]
        assert resources["requests"]["memory"] == format_bytes(agent_memory(spec))
        assert resources["limits"]["memory"] == format_bytes(agent_memory(spec))
    overridden = PoolSpec.parse({"agent": {"resources": {"limits": {"memory": "100Gi"}}}})
    resources = _pod(_children(overridden))["containers"][0]["resources"]
    assert resources["limits"]["memory"] == "100Gi"
    assert resources["requests"]["memory"] == format_bytes(agent_memory(overridden))


@pytest.mark.parametrize(
    ("count", "quantity"),
    [(1 << 30, "1Gi"), (1536 << 20, "1536Mi"), (3 << 40, "3Ti"), (1000, "1000"), (2048, "2Ki")],
)
def test_quantities_are_canonical(count: int, quantity: str) -> None:
    assert format_bytes(count) == quantity


def test_a_config_change_rolls_the_agents_and_nothing_else_does() -> None:
    def checksum(spec: dict[str, Any]) -> str:
        template = _children(PoolSpec.parse(spec)).daemonset["spec"]["template"]
        value: str = template["metadata"]["annotations"][CONFIG_CHECKSUM_ANNOTATION]
        return value

    base = checksum({})
    assert checksum({}) == base
    assert checksum({"eviction": {"policy": "arc"}}) != base
    assert checksum({"l1": {"size": "2Gi"}}) != base
    assert checksum({"agent": {"nodeSelector": {"gpu": "yes"}}}) == base  # in the pod spec


def test_the_agents_may_use_their_quota_configmap_and_read_their_tenants_only() -> None:
    children = _children(PoolSpec.parse({"peers": {"enabled": False}}))
    assert children.role["rules"] == [
        {
            "apiGroups": [""],
            "resources": ["configmaps"],
            "resourceNames": ["kvpool-gpu-quotas"],
            "verbs": ["get", "list", "watch", "patch"],
        },
        {
            "apiGroups": [""],
            "resources": ["configmaps"],
            "resourceNames": ["kvpool-gpu-tenants"],
            "verbs": ["get", "list", "watch"],
        },
    ]
    assert children.role_binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "kvpool-gpu-agent", "namespace": "inference"}
    ]
    assert children.role_binding["roleRef"]["name"] == "kvpool-gpu-agent"
    assert "data" not in children.quotas  # the agents own the quotas
    assert "data" not in children.tenants  # written key by key from the KVCacheTenants


PEERS_OFF = {"peers": {"enabled": False}}


def test_peer_agents_find_each_other_among_their_namespaces_pods() -> None:
    """With peers the agents' Role also reads and watches pods (their discovery), in the
    pool's namespace only: a Role, never a ClusterRole."""
    peers, alone = _children(), _children(PoolSpec.parse(PEERS_OFF))
    assert peers.role["kind"] == "Role"
    assert peers.role["metadata"]["namespace"] == "inference"
    assert peers.role["rules"] == [
        *alone.role["rules"],
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
    ]
    assert not [rule for rule in alone.role["rules"] if rule["resources"] == ["pods"]]


@pytest.mark.parametrize("version", [OLDEST_KUBERNETES, kubernetes_validate.latest_version()])
def test_peer_agents_serve_the_peer_port_with_the_pools_credential(version: str) -> None:
    """The port named peer (where the agents' discovery finds it), NODE_NAME from the
    downward API, the peer Secret read-only for the agent's group, and the peers section
    naming them, found as the index finds the agents."""
    spec = PoolSpec.parse(
        {
            "peers": {
                "port": 9404,
                "maxBandwidth": "500M",
                "maxTransfers": 2,
                "wireProtection": "integrity",
            },
            "ports": PORTS,
        }
    )
    children = _children(spec)
    kubernetes_validate.validate(children.daemonset, version, strict=True)
    (container,) = _pod(children)["containers"]
    assert {"name": "peer", "containerPort": 9404, "protocol": "TCP"} in container["ports"]
    node = {"name": NODE_NAME_ENV, "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}
    assert node in container["env"]
    volume, mount = _volume_and_mount(children, "peer-keys")
    assert volume == {
        "name": "peer-keys",
        "secret": {"secretName": "kvpool-gpu-peer", "defaultMode": 0o440},
    }
    assert mount == {"name": "peer-keys", "mountPath": "/etc/kvpool/peer-keys", "readOnly": True}
    assert _agent_yaml(children)["peers"] == {
        "port": 9404,
        "key_dir": mount["mountPath"],
        "discovery": "kubernetes",
        "namespace": "inference",
        "max_transfers": 2,
        "wire_protection": "integrity",
        "transport": "tcp",
        "bandwidth": 500_000_000,
    }
    uncapped = _agent_yaml(_children())["peers"]
    assert "bandwidth" not in uncapped  # the agent's default: no cap
    assert (uncapped["port"], uncapped["max_transfers"]) == (DEFAULT_PEER_PORT, 4)
    assert uncapped["wire_protection"] == "sealed"


def test_a_pool_without_peers_has_no_peer_port_credential_or_section() -> None:
    children = _children(PoolSpec.parse(PEERS_OFF))
    (container,) = _pod(children)["containers"]
    assert "peer" not in {port["name"] for port in container["ports"]}
    assert NODE_NAME_ENV not in {env["name"] for env in container["env"]}
    assert _volume_and_mount(children, "peer-keys") == (None, None)
    assert _agent_yaml(children)["peers"] is None
    assert "peer-keys" not in yaml.safe_dump(children.daemonset)


def test_service_monitor() -> None:
    assert _children().service_monitor is None
    spec = PoolSpec.parse(
        {"metrics": {"serviceMonitor": {"enabled": True, "interval": "5s", "labels": {"a": "b"}}}}
    )
    monitor = _children(spec).service_monitor
    assert monitor is not None
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["a"] == "b"
    assert monitor["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "5s"}]
    # it scrapes the agents' Service and the index's (each has a port named http)
    selector = monitor["spec"]["selector"]["matchLabels"].items()
    for service in (_children().service, _index().service):
        assert selector <= service["metadata"]["labels"].items()
        assert "http" in {port["name"] for port in service["spec"]["ports"]}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"l1": {"size": "512Ki"}}, "l1_size must hold at least 16 pages"),
        ({"eviction": {"lowWatermark": 0.95}}, "low_watermark (0.95) must be below"),
        ({"l1": {"size": "1.5Gi"}}, "spec.l1.size"),
        ({"l2": {"tiers": [{"type": "s3"}]}}, "spec.l2.tiers.0"),
        (
            {
                "l2": {
                    "tiers": [{"type": "s3", "s3": {"bucket": "b", "sseKmsKeyId": "alias/kv"}}],
                    **L2_KEY,
                }
            },
            "agent.s3: Value error, sse_kms_key_id needs server_side_encryption aws:kms",
        ),
    ],
)
def test_specs_the_agent_would_refuse_are_invalid(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidSpec, match=re.escape(message)):
        render(POOL, PoolSpec.parse(spec), default_image=IMAGE)


def test_a_pool_name_the_agent_refuses_is_invalid() -> None:
    with pytest.raises(InvalidSpec, match=r"agent\.pool"):
        render(Pool("Gpu.Pool", "ns", "uid"), PoolSpec(), default_image=IMAGE)


def test_a_pool_without_the_index_names_the_index_children_absent() -> None:
    """What a pool without the index deletes is exactly what a pool with one has."""
    children = _children()
    assert children.index is None
    assert children.absent == index_refs(POOL) + service_monitor_refs(POOL) + network_policy_refs(
        POOL
    )
    index = _index()
    assert {ChildRef.of(child) for child in index.manifests()} == set(index_refs(POOL))
    assert index_refs(POOL)[0] == ChildRef.of(index.deployment)  # deleted first
    monitored = _children(PoolSpec.parse({"metrics": {"serviceMonitor": {"enabled": True}}}))
    assert monitored.service_monitor is not None
    assert service_monitor_refs(POOL) == (ChildRef.of(monitored.service_monitor),)
    assert monitored.absent == index_refs(POOL) + network_policy_refs(POOL)


def test_index_pods_and_agent_pods_are_told_apart() -> None:
    """The agents' Service and DaemonSet never select an index pod, the index's Service no
    agent pod, and the index's discovery (component=agent pods of the pool) follows agents
    only."""
    children = _children(PoolSpec.parse({**TOKENS, "index": {"enabled": True}}))
    assert children.index is not None
    index_pod = children.index.deployment["spec"]["template"]["metadata"]["labels"]
    agent_pod = children.daemonset["spec"]["template"]["metadata"]["labels"]

    def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
        return selector.items() <= labels.items()

    agent_selectors = [
        children.service["spec"]["selector"],
        children.daemonset["spec"]["selector"]["matchLabels"],
    ]
    index_selectors = [
        children.index.service["spec"]["selector"],
        children.index.deployment["spec"]["selector"]["matchLabels"],
    ]
    discovery = {COMPONENT_LABEL: "agent", POOL_LABEL: "gpu"}
    assert all(selects(s, agent_pod) and not selects(s, index_pod) for s in agent_selectors)
    assert all(selects(s, index_pod) and not selects(s, agent_pod) for s in index_selectors)
    assert selects(discovery, agent_pod) and not selects(discovery, index_pod)
    assert index_pod[COMPONENT_LABEL] == "index"


DOWNWARD = {"spec.nodeName": "gpu-node-1"}
"""What the kubelet fills in from the downward API."""


def test_each_pod_leads_its_process_to_its_own_configuration(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The env a workload's container gets names the file its process reads its settings from
    (the names the operator renders are the names the agent and the index read)."""
    children = _children(_spec(GPU_EXAMPLE))
    assert children.index is not None
    workloads = (
        (children.daemonset, children.config, AgentConfig),
        (children.index.deployment, children.index.config, IndexConfig),
    )
    for workload, config_map, model in workloads:
        pod = workload["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        mount = next(m for m in container["volumeMounts"] if m["name"] == "config")
        volume = next(v for v in pod["volumes"] if v["name"] == "config")
        assert volume["configMap"]["name"] == config_map["metadata"]["name"]
        with monkeypatch.context() as pod_env:
            for variable in container["env"]:
                field = variable.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
                path = Path(DOWNWARD[field] if field else variable["value"])
                if path.parent == Path(mount["mountPath"]):  # where the kubelet mounts it
                    (tmp_path / path.name).write_text(config_map["data"][path.name])
                    path = tmp_path / path.name
                pod_env.setenv(variable["name"], str(path))
            config = model()
        assert (config.pool, config.host) == ("gpu", "0.0.0.0")


def test_index_config_is_the_indexs_own_model(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    bogus = tmp_path / "operator-index.yaml"
    bogus.write_text("http_port: 1\n")
    with monkeypatch.context() as operator_env:  # the operator's environment must not leak
        operator_env.setenv("KVPOOL_INDEX_LOAD_SLACK", "99")
        operator_env.setenv(INDEX_CONFIG_FILE_ENV, str(bogus))
        index = _children(_spec(GPU_EXAMPLE)).index
    assert index is not None
    text = index.config["data"]["index.yaml"]
    assert yaml.safe_load(text)["load_slack"] == 4
    (tmp_path / "index.yaml").write_text(text)
    monkeypatch.setenv(INDEX_CONFIG_FILE_ENV, str(tmp_path / "index.yaml"))
    config = IndexConfig()  # what `kvpool-index` reads from the mounted ConfigMap
    assert (config.pool, config.discovery, config.namespace) == ("gpu", "kubernetes", "inference")
    assert (config.host, config.http_port) == ("0.0.0.0", 7403)
    assert str(config.tokens_file) == "/etc/kvpool/tokens/tokens.yaml"
    assert str(config.state_dir) == "/var/lib/kvpool"
    assert str(config.agent_token_file) == "/etc/kvpool/agent-access/token"  # the Secret's key
    assert config.max_chunks_per_node == 2_000_000
    assert (config.load_factor, config.load_slack, config.min_match_ratio) == (2, 4, 0.25)
    assert config.fingerprint is not None
    assert config.fingerprint.model_dump() == {
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "dtype": "bfloat16",
        "kv_layout": "nhd",
        "tp_rank": 0,
        "tp_size": 1,
        "chunk_tokens": 256,
    }
    assert not config.agents  # discovery finds them


def test_index_config_defaults_and_fingerprint_chunks() -> None:
    def config(spec: dict[str, Any], index: dict[str, Any]) -> dict[str, Any]:
        loaded: dict[str, Any] = yaml.safe_load(_index(spec, index).config["data"]["index.yaml"])
        return loaded

    plain = config({}, {})
    assert plain["fingerprint"] is None
    assert plain["max_chunks_per_node"] == 1_000_000
    routing = (plain["load_factor"], plain["load_slack"], plain["min_match_ratio"])
    assert routing == (1.5, 0.0, 0.3)
    fingerprint = {"model": "m", "dtype": "fp8", "kvLayout": "hnd"}
    pools = config({"chunkTokens": 512}, {"fingerprint": fingerprint})
    assert pools["fingerprint"]["chunk_tokens"] == 512  # the pool's, by default
    own = config({"chunkTokens": 512}, {"fingerprint": {**fingerprint, "chunkTokens": 128}})
    assert own["fingerprint"]["chunk_tokens"] == 128
    assert config({}, {"port": 9000})["http_port"] == 9000


def test_index_deployment_and_pod() -> None:
    index = _index()
    deployment = index.deployment
    assert deployment["apiVersion"] == "apps/v1"
    assert deployment["spec"]["replicas"] == 1
    pod = _index_pod(index)
    (container,) = pod["containers"]
    assert container["command"] == ["kvpool-index"]
    assert container["image"] == IMAGE
    assert container["env"] == [
        {"name": "KVPOOL_INDEX_CONFIG_FILE", "value": "/etc/kvpool/config/index.yaml"}
    ]
    assert container["ports"] == [{"name": "http", "containerPort": 7403, "protocol": "TCP"}]
    assert container["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert (
        volumes.keys()
        == mounts.keys()
        == {
            "config",
            "state",
            "tokens",
            "agent-access",
            "peer-keys",
        }
    )
    # the pool's peer credential, as the agents mount it: it accepts their lookup tokens
    agent_peer_keys = _volume_and_mount(_children(), "peer-keys")
    assert (volumes["peer-keys"], mounts["peer-keys"]) == agent_peer_keys
    # the token it follows the agents with: the operator's Secret, read only
    assert volumes["agent-access"]["secret"] == {
        "secretName": "kvpool-gpu-index-access",
        "defaultMode": 0o440,
    }
    assert mounts["agent-access"] == {
        "name": "agent-access",
        "mountPath": "/etc/kvpool/agent-access",
        "readOnly": True,
    }
    assert volumes["config"]["configMap"] == {"name": "kvpool-gpu-index-config"}
    assert mounts["config"] == {
        "name": "config",
        "mountPath": "/etc/kvpool/config",
        "readOnly": True,
    }
    assert volumes["state"] == {"name": "state", "emptyDir": {}}
    assert mounts["state"]["mountPath"] == "/var/lib/kvpool"
    agent_pod = _pod(_children(PoolSpec.parse(TOKENS)))
    agent_tokens = next(v for v in agent_pod["volumes"] if v["name"] == "tokens")
    assert volumes["tokens"] == agent_tokens  # the same Secret, mounted the same way
    assert mounts["tokens"] == {
        "name": "tokens",
        "mountPath": "/etc/kvpool/tokens",
        "readOnly": True,
    }
    # hardened like the agent: non-root, read-only root, no capabilities, RuntimeDefault
    assert pod["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 10001,
        "runAsGroup": 10001,
        "fsGroup": 10001,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert container["securityContext"] == agent_pod["containers"][0]["securityContext"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert not {"hostIPC", "hostNetwork", "hostPID", "nodeSelector", "tolerations"} & pod.keys()
    assert pod["serviceAccountName"] == "kvpool-gpu-index"
    assert container["resources"] == {
        "requests": {"cpu": "100m", "memory": "512Mi"},
        "limits": {"memory": "2Gi"},
    }


def pod_labels(index: IndexChildren) -> dict[str, str]:
    labels: dict[str, str] = index.deployment["spec"]["template"]["metadata"]["labels"]
    return labels


def test_index_options_reach_the_deployment() -> None:
    toleration = {"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}
    index = _index(
        {"agent": {"image": "registry.example/agent:2", "imagePullPolicy": "Always"}},
        {
            "replicas": 3,
            "port": 8080,
            "resources": {"requests": {"memory": "1Gi"}, "limits": {"memory": "8Gi", "cpu": 2}},
            "nodeSelector": {"pool": "cpu"},
            "tolerations": [toleration],
        },
    )
    pod = _index_pod(index)
    (container,) = pod["containers"]
    assert index.deployment["spec"]["replicas"] == 3
    assert (container["image"], container["imagePullPolicy"]) == (
        "registry.example/agent:2",  # the agents' image, where the index names none
        "Always",
    )
    assert container["ports"][0]["containerPort"] == 8080
    assert container["resources"] == {
        "requests": {"cpu": "100m", "memory": "1Gi"},
        "limits": {"memory": "8Gi", "cpu": 2},
    }
    assert (pod["nodeSelector"], pod["tolerations"]) == ({"pool": "cpu"}, [toleration])
    # replicas spread over nodes where they can (a soft rule: never blocks scheduling)
    anti_affinity = pod["affinity"]["podAntiAffinity"]
    (spread,) = anti_affinity["preferredDuringSchedulingIgnoredDuringExecution"]
    term = spread["podAffinityTerm"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"].items() <= pod_labels(index).items()
    assert "affinity" not in _index_pod(_index())  # one replica: nothing to spread
    assert index.service["spec"]["ports"] == [
        {"name": "http", "port": 8080, "targetPort": "http", "protocol": "TCP"}
    ]
    own = _index(index={"image": "registry.example/index:3"})
    assert _index_pod(own)["containers"][0]["image"] == "registry.example/index:3"


def test_index_service() -> None:
    index = _index()
    service = index.service
    assert service["metadata"]["name"] == "kvpool-gpu-index"
    assert service["spec"]["type"] == "ClusterIP"
    assert "internalTrafficPolicy" not in service["spec"]  # any node's gateway may call it
    assert service["spec"]["ports"] == [
        {"name": "http", "port": 7403, "targetPort": "http", "protocol": "TCP"}
    ]
    assert service["spec"]["selector"] == index.deployment["spec"]["selector"]["matchLabels"]


def test_the_index_may_read_and_watch_pods_only() -> None:
    index = _index()
    assert index.role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]
    assert index.role_binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "kvpool-gpu-index",
    }
    assert index.role_binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "kvpool-gpu-index", "namespace": "inference"}
    ]
    assert index.service_account["metadata"]["name"] == "kvpool-gpu-index"


def test_an_index_config_change_rolls_the_index_and_nothing_else_does() -> None:
    def checksums(index: dict[str, Any]) -> tuple[str, str]:
        children = _children(PoolSpec.parse({**TOKENS, "index": {"enabled": True, **index}}))
        assert children.index is not None
        templates = (children.index.deployment, children.daemonset)
        index_sum, agent_sum = (
            t["spec"]["template"]["metadata"]["annotations"][CONFIG_CHECKSUM_ANNOTATION]
            for t in templates
        )
        return index_sum, agent_sum

    index_base, agent_base = checksums({})
    assert checksums({}) == (index_base, agent_base)
    assert checksums({"routing": {"loadSlack": 2}})[0] != index_base
    assert checksums({"maxChunksPerNode": 10})[0] != index_base
    assert checksums({"replicas": 2}) == (index_base, agent_base)  # in the Deployment spec
    assert checksums({"routing": {"loadSlack": 2}})[1] == agent_base


def test_a_pool_that_asks_for_an_index_without_tokens_is_invalid() -> None:
    with pytest.raises(InvalidSpec, match=r"spec\.index\.enabled needs spec\.tenants"):
        PoolSpec.parse({"index": {"enabled": True}})


NETWORK_POLICY = {
    "enabled": True,
    "clients": [
        {"podSelector": {"matchLabels": {"app": "vllm"}}},
        {
            "namespaceSelector": {"matchLabels": {"team": "a"}},
            "podSelector": {"matchExpressions": [{"key": "client", "operator": "Exists"}]},
        },
    ],
    "gateways": [{"podSelector": {"matchLabels": {"app": "gateway"}}}],
    "prometheus": [
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
            "podSelector": {
                "matchExpressions": [
                    {"key": "app.kubernetes.io/name", "operator": "In", "values": ["prometheus"]}
                ]
            },
        }
    ],
}
PORTS = {"zmq": 9000, "http": 9001, "events": 9002}
INDEX_PORT = 9003
PEER_PORT = 9004
SOURCES = {
    "vllm": Pod({"app": "vllm"}, "inference"),
    "vllm-of-team-a": Pod({"client": "yes"}, "team-a", {"team": "a"}),
    "vllm-elsewhere": Pod({"app": "vllm"}, "elsewhere"),
    "stranger": Pod({"app": "other"}, "inference"),
    "gateway": Pod({"app": "gateway"}, "inference"),
    "prometheus": Pod(
        {"app.kubernetes.io/name": "prometheus"},
        "monitoring",
        {"kubernetes.io/metadata.name": "monitoring"},
    ),
}


def _protected(
    policy: dict[str, Any], index: bool = True, peers: bool = True, **more_peers: Any
) -> Children:
    spec = {**TOKENS, "ports": PORTS, "networkPolicy": policy}
    spec |= {"peers": {"enabled": peers, "port": PEER_PORT, **more_peers}}
    spec |= {"index": {"enabled": True, "port": INDEX_PORT}} if index else {}
    return _children(PoolSpec.parse(spec))


def _pods(children: Children) -> dict[str, Pod]:
    """The pool's agent pod, and its index pod if it has one."""
    workloads = {"agent": children.daemonset}
    workloads |= {"index": children.index.deployment} if children.index is not None else {}
    return {
        name: Pod(workload["spec"]["template"]["metadata"]["labels"], POOL.namespace)
        for name, workload in workloads.items()
    }


def _admitted(children: Children, target: Pod, source: Pod) -> set[int]:
    ports = {*PORTS.values(), INDEX_PORT, PEER_PORT}
    return {port for port in ports if admits(children.network_policies, target, source, port)}


def test_network_policies_are_off_by_default() -> None:
    children = _children(PoolSpec.parse({**TOKENS, "index": {"enabled": True}}))
    assert children.network_policies == ()
    assert set(network_policy_refs(POOL)) <= set(children.absent)


@pytest.mark.parametrize("version", [OLDEST_KUBERNETES, kubernetes_validate.latest_version()])
def test_network_policies_are_valid_kubernetes_objects(version: str) -> None:
    children = _protected(NETWORK_POLICY)
    assert [ChildRef.of(policy) for policy in children.network_policies] == list(
        network_policy_refs(POOL)
    )
    for policy in children.network_policies:
        kubernetes_validate.validate(policy, version, strict=True)
    assert children.present()[:2] == list(children.network_policies)  # applied first
    assert not set(network_policy_refs(POOL)) & set(children.absent)


@pytest.mark.parametrize(
    ("source", "agent_ports", "index_ports"),
    [
        ("vllm", {9000, 9001}, set()),
        ("vllm-of-team-a", {9000, 9001}, set()),
        ("vllm-elsewhere", set(), set()),  # a podSelector alone: the pool's namespace only
        ("stranger", set(), set()),
        ("gateway", set(), {INDEX_PORT}),
        ("prometheus", {9001}, {INDEX_PORT}),
    ],
)
def test_each_peer_reaches_the_ports_it_needs_and_no_other(
    source: str, agent_ports: set[int], index_ports: set[int]
) -> None:
    children = _protected(NETWORK_POLICY)
    pods = _pods(children)
    assert _admitted(children, pods["agent"], SOURCES[source]) == agent_ports
    assert _admitted(children, pods["index"], SOURCES[source]) == index_ports


def test_the_index_reaches_the_agents_snapshots_and_events() -> None:
    children = _protected(NETWORK_POLICY)
    pods = _pods(children)
    assert _admitted(children, pods["agent"], pods["index"]) == {9000, 9002}
    # the agents ask the index which peers hold a prefix: with peers only
    assert _admitted(children, pods["index"], pods["agent"]) == {INDEX_PORT}
    alone = _protected(NETWORK_POLICY, peers=False)
    assert _admitted(alone, _pods(alone)["index"], _pods(alone)["agent"]) == set()


def test_with_an_index_the_agents_ask_it_which_peers_hold_a_prefix() -> None:
    """The agents' peers section names the index's Service; the index gets the peer
    credential's directory (it accepts the lookup tokens the agents derive from it)."""
    with_index = PoolSpec.parse({**TOKENS, "index": {"enabled": True, "port": 9403}})
    peers = _agent_yaml(_children(with_index))["peers"]
    assert peers["index_url"] == "http://kvpool-gpu-index.inference.svc:9403"
    assert _index_yaml(_index())["peer_key_dir"] == peers["key_dir"]
    assert _index_yaml(_index(PEERS_OFF))["peer_key_dir"] is None
    no_index = _agent_yaml(_children(PoolSpec.parse({"index": {"enabled": False}})))["peers"]
    assert "index_url" not in no_index


def _index_yaml(index: IndexChildren) -> dict[str, Any]:
    rendered: dict[str, Any] = yaml.safe_load(index.config["data"]["index.yaml"])
    return rendered


def test_the_agents_reach_each_others_peer_port_only_with_peers() -> None:
    """The pool's agents admit each other on the peer port, and on nothing else; another
    pool's agents (another instance label) and the pool's other pods are refused it."""
    children = _protected(NETWORK_POLICY)
    agent = _pods(children)["agent"]
    assert _admitted(children, agent, agent) == {PEER_PORT}
    other_pool = Pod({**agent.labels, "app.kubernetes.io/instance": "other"}, POOL.namespace)
    assert _admitted(children, agent, other_pool) == set()
    for source in ("vllm", "prometheus", "stranger"):
        assert PEER_PORT not in _admitted(children, agent, SOURCES[source]), source
    alone = _protected(NETWORK_POLICY, peers=False)
    assert _admitted(alone, _pods(alone)["agent"], _pods(alone)["agent"]) == set()


UCX_PORTS = {"first": 9010, "last": 9013}


def test_with_nixl_the_agents_reach_each_others_ucx_ports_too() -> None:
    """UCX listens in the spec's range (UCX_TCP_PORT_RANGE): the pool's agents, and nobody
    else, are admitted to it, as to the peer port; the TCP transport opens no range."""
    children = _protected(NETWORK_POLICY, transport="nixl", nixl={"tcpPorts": UCX_PORTS})
    agent = _pods(children)["agent"]
    ucx = set(range(9008, 9016))
    admitted = {port for port in ucx if admits(children.network_policies, agent, agent, port)}
    assert admitted == {9010, 9011, 9012, 9013}
    for source in ("vllm", "prometheus", "stranger"):
        assert not [
            port for port in ucx if admits(children.network_policies, agent, SOURCES[source], port)
        ], source
    tcp = _protected(NETWORK_POLICY, nixl={"tcpPorts": UCX_PORTS})
    agent = _pods(tcp)["agent"]
    assert not [port for port in ucx if admits(tcp.network_policies, agent, agent, port)]
    for version in (OLDEST_KUBERNETES, kubernetes_validate.latest_version()):
        for policy in children.network_policies:
            kubernetes_validate.validate(policy, version, strict=True)


def test_nixl_agents_get_ucxs_ports_variables_and_memory_locking_as_the_spec_says() -> None:
    """The agents' section says transport nixl; their environment holds the UCX port range
    and the spec's UCX variables; IPC_LOCK is added only when asked (RDMA's pinning)."""
    nixl = {"tcpPorts": UCX_PORTS, "ucx": {"UCX_NET_DEVICES": "mlx5_0:1"}}
    children = _children(PoolSpec.parse({"peers": {"transport": "nixl", "nixl": nixl}}))
    (container,) = _pod(children)["containers"]
    assert {"name": "UCX_TCP_PORT_RANGE", "value": "9010-9013"} in container["env"]
    assert {"name": "UCX_NET_DEVICES", "value": "mlx5_0:1"} in container["env"]
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert _agent_yaml(children)["peers"]["transport"] == "nixl"
    locked = {"transport": "nixl", "nixl": {**nixl, "lockMemory": True}}
    (container,) = _pod(_children(PoolSpec.parse({"peers": locked})))["containers"]
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    tcp = _children(PoolSpec.parse({"peers": {"nixl": {**nixl, "lockMemory": True}}}))
    (container,) = _pod(tcp)["containers"]
    assert not [env for env in container["env"] if env["name"].startswith("UCX_")]
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert _agent_yaml(tcp)["peers"]["transport"] == "tcp"


def test_a_pool_without_the_index_has_the_agents_policy_only() -> None:
    clients_only = {"enabled": True, "clients": NETWORK_POLICY["clients"]}
    children = _protected(clients_only, index=False)
    (policy,) = children.network_policies
    assert ChildRef.of(policy) == network_policy_refs(POOL)[0]
    assert network_policy_refs(POOL)[1] in children.absent
    clients, peers = policy["spec"]["ingress"]  # no rule for an index or Prometheus it lacks
    assert clients["from"] == NETWORK_POLICY["clients"]
    assert peers == {
        "from": [{"podSelector": {"matchLabels": policy["spec"]["podSelector"]["matchLabels"]}}],
        "ports": [{"protocol": "TCP", "port": PEER_PORT}],
    }
    agent = _pods(children)["agent"]
    assert _admitted(children, agent, SOURCES["vllm"]) == {9000, 9001}
    for source in ("prometheus", "gateway", "stranger"):
        assert _admitted(children, agent, SOURCES[source]) == set(), source


def test_no_rule_admits_every_source() -> None:
    """A rule without peers admits everyone: an empty list of peers makes no rule at all."""
    for policy in (NETWORK_POLICY, {"enabled": True, "clients": NETWORK_POLICY["clients"]}):
        for index in (True, False):
            if index and "gateways" not in policy:
                continue
            for rendered in _protected(policy, index).network_policies:
                assert rendered["spec"]["policyTypes"] == ["Ingress"]  # egress stays open
                assert all(rule["from"] and rule["ports"] for rule in rendered["spec"]["ingress"])
