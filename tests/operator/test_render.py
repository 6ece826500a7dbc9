"""Rendering a pool's children: valid Kubernetes objects that carry the contracts."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvpool_agent.config import CONFIG_FILE_ENV, AgentConfig
from kvpool_agent.protocol import PROTOCOL_VERSION
from kvpool_operator.render import (
    CHECKSUM_ANNOTATION,
    Children,
    Pool,
    agent_memory,
    format_bytes,
    render,
)
from kvpool_operator.spec import InvalidSpec, PoolSpec

from .crd_schema import EXAMPLES, GPU_EXAMPLE
from .test_crd import OLDEST_KUBERNETES

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


def _all(children: Children) -> list[dict[str, Any]]:
    return children.required() + [m for m in [children.service_monitor] if m is not None]


def _pod(children: Children) -> dict[str, Any]:
    pod: dict[str, Any] = children.daemonset["spec"]["template"]["spec"]
    return pod


@pytest.mark.parametrize("version", [OLDEST_KUBERNETES, kubernetes_validate.latest_version()])
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda path: path.name)
def test_children_are_valid_kubernetes_objects(example: Path, version: str) -> None:
    for child in _children(_spec(example)).required():
        kubernetes_validate.validate(child, version, strict=True)


def test_names_labels_and_owner() -> None:
    children = _children(_spec(GPU_EXAMPLE))
    names = {(c["kind"], c["metadata"]["name"]) for c in _all(children)}
    assert names == {
        ("ConfigMap", "kvpool-gpu-config"),
        ("ConfigMap", "kvpool-gpu-quotas"),
        ("DaemonSet", "kvpool-gpu-agent"),
        ("Service", "kvpool-gpu"),
        ("ServiceMonitor", "kvpool-gpu"),
        ("ServiceAccount", "kvpool-gpu-agent"),
        ("Role", "kvpool-gpu-agent"),
        ("RoleBinding", "kvpool-gpu-agent"),
    }
    for child in _all(children):
        metadata = child["metadata"]
        assert metadata["namespace"] == POOL.namespace
        assert LABELS.items() <= metadata["labels"].items()
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
    monkeypatch.setenv(CONFIG_FILE_ENV, str(tmp_path / "agent.yaml"))
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
    assert (config.store_policy, config.store_min_hits) == ("reused", 2)
    assert config.events_port == 7402
    assert config.quota_configmap == "inference/kvpool-gpu-quotas"


def test_a_pool_without_l2_has_an_agent_without_l2() -> None:
    rendered = yaml.safe_load(_children().config["data"]["agent.yaml"])
    assert (rendered["nvme"], rendered["s3"]) == (None, None)


def test_service_tells_the_connector_where_the_agent_is() -> None:
    service = _children(PoolSpec.parse({"chunkTokens": 512, "ports": {"zmq": 9000}})).service
    assert service["metadata"]["annotations"] == {
        "kvpool.io/zmq-port": "9000",
        "kvpool.io/http-port": "7401",
        "kvpool.io/segment-path": "/dev/shm/kvpool-gpu",
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
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env == {"KVPOOL_HOST": "0.0.0.0", "KVPOOL_CONFIG_FILE": "/etc/kvpool/config/agent.yaml"}
    assert container["envFrom"] == [{"secretRef": {"name": "kvpool-s3"}}]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"zmq": 7400, "http": 7401, "events": 7402}
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
    assert {v["name"] for v in pod["volumes"]} == {"config", "shm", "state"}
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
        value: str = template["metadata"]["annotations"][CHECKSUM_ANNOTATION]
        return value

    base = checksum({})
    assert checksum({}) == base
    assert checksum({"eviction": {"policy": "arc"}}) != base
    assert checksum({"l1": {"size": "2Gi"}}) != base
    assert checksum({"agent": {"nodeSelector": {"gpu": "yes"}}}) == base  # in the pod spec


def test_the_agents_may_use_their_quota_configmap_only() -> None:
    children = _children()
    assert children.role["rules"] == [
        {
            "apiGroups": [""],
            "resources": ["configmaps"],
            "resourceNames": ["kvpool-gpu-quotas"],
            "verbs": ["get", "list", "watch", "patch"],
        }
    ]
    assert children.role_binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "kvpool-gpu-agent", "namespace": "inference"}
    ]
    assert children.role_binding["roleRef"]["name"] == "kvpool-gpu-agent"
    assert "data" not in children.quotas  # the agents own the quotas


def test_service_monitor() -> None:
    assert _children().service_monitor is None
    spec = PoolSpec.parse(
        {"metrics": {"serviceMonitor": {"enabled": True, "interval": "5s", "labels": {"a": "b"}}}}
    )
    monitor = _children(spec).service_monitor
    assert monitor is not None
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["a"] == "b"
    assert monitor["spec"] == {
        "selector": {"matchLabels": _children().service["spec"]["selector"]},
        "endpoints": [{"port": "http", "path": "/metrics", "interval": "5s"}],
    }


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"l1": {"size": "512Ki"}}, "l1_size must hold at least 16 pages"),
        ({"eviction": {"lowWatermark": 0.95}}, "low_watermark (0.95) must be below"),
        ({"l1": {"size": "1.5Gi"}}, "spec.l1.size"),
        ({"l2": {"tiers": [{"type": "s3"}]}}, "spec.l2.tiers.0"),
    ],
)
def test_specs_the_agent_would_refuse_are_invalid(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidSpec, match=re.escape(message)):
        render(POOL, PoolSpec.parse(spec), default_image=IMAGE)


def test_a_pool_name_the_agent_refuses_is_invalid() -> None:
    with pytest.raises(InvalidSpec, match=r"agent\.pool"):
        render(Pool("Gpu.Pool", "ns", "uid"), PoolSpec(), default_image=IMAGE)
