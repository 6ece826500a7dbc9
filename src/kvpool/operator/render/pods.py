"""What the agents' and the index's pods share: the image's user, security contexts,
probes, resources, the configuration, state and tokens volumes, and a template that a
change of the configuration file rolls."""

from __future__ import annotations

import hashlib
from typing import Any

from kvpool.common.names import CONFIG_CHECKSUM_ANNOTATION
from kvpool.operator.render.config import (
    AGENT_ACCESS_DIR,
    PD_KEY_DIR,
    PEER_KEYS_DIR,
    STATE_DIR,
    TOKENIZER_DIR,
    TOKENS_DIR,
    TOKENS_FILE,
)
from kvpool.operator.render.objects import Pool
from kvpool.operator.spec import PoolSpec, ResourcesSpec

CONFIG_DIR = "/etc/kvpool/config"
AGENT_UID = 10001
"""The agent image's user (Dockerfile)."""


def resources(
    requests: dict[str, int | str], limits: dict[str, int | str], overrides: ResourcesSpec
) -> dict[str, dict[str, int | str]]:
    """Default requests and limits, each entry overridable by the spec."""
    return {
        "requests": {**requests, **overrides.requests},
        "limits": {**limits, **overrides.limits},
    }


def probes(startup_failures: int) -> dict[str, Any]:
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


def container_security() -> dict[str, Any]:
    return {
        "privileged": False,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def pod_security() -> dict[str, Any]:
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
PD_KEY_VOLUME = "kvpool-pd-key"
"""Prefixed: the admission webhook adds it to vLLM pods, whose own volumes have any names."""


def config_volume(config_map: str) -> Volume:
    return (
        {"name": "config", "configMap": {"name": config_map}},
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
    )


def state_volume() -> Volume:
    return {"name": "state", "emptyDir": {}}, {"name": "state", "mountPath": STATE_DIR}


def tokens_volume(spec: PoolSpec) -> list[Volume]:
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


def peer_keys_volume(pool: Pool, spec: PoolSpec) -> list[Volume]:
    """With peers, the pool's peer Secret at PEER_KEYS_DIR, as the L2 keys: the operator's
    rotations reach the agents (and the index, which accepts tokens derived from it) with
    no roll."""
    if not spec.peers.enabled:
        return []
    volume = {"name": "peer-keys", "secret": {"secretName": pool.peer_name, "defaultMode": 0o440}}
    return [(volume, {"name": "peer-keys", "mountPath": PEER_KEYS_DIR, "readOnly": True})]


def pd_key_volume(secret: str) -> Volume:
    """The pool's disaggregation key Secret at PD_KEY_DIR, read-only: the index signs its
    prefill headers with it, the decode pods' sidecars verify them (both read it at start;
    ``defaultMode`` 0444 because a vLLM pod's sidecar runs as a user of its own, without
    the pod's fsGroup that the index's 0440 relies on)."""
    volume = {"name": PD_KEY_VOLUME, "secret": {"secretName": secret, "defaultMode": 0o444}}
    return volume, {"name": PD_KEY_VOLUME, "mountPath": PD_KEY_DIR, "readOnly": True}


def agent_access_volume(pool: Pool) -> Volume:
    """The index's token for the agents (the operator's Secret), read-only."""
    volume = {
        "name": "agent-access",
        "secret": {"secretName": pool.index_access_name, "defaultMode": 0o440},
    }
    return volume, {"name": "agent-access", "mountPath": AGENT_ACCESS_DIR, "readOnly": True}


def tokenizer_volume(spec: PoolSpec) -> list[Volume]:
    """With the picker's tokenizer, its claim at TOKENIZER_DIR, read-only both in the volume
    and the mount (a persistentVolumeClaim volume is allowed under Pod Security
    "restricted"; the picker only reads it)."""
    tokenizer = spec.index.picker.tokenizer
    if not spec.index.picker.enabled or tokenizer is None:
        return []
    volume = {
        "name": "tokenizer",
        "persistentVolumeClaim": {"claimName": tokenizer.claim_name, "readOnly": True},
    }
    mount = {"name": "tokenizer", "mountPath": TOKENIZER_DIR, "readOnly": True}
    return [(volume, mount | ({"subPath": tokenizer.sub_path} if tokenizer.sub_path else {}))]


def container_ports(ports: list[tuple[str, int]]) -> list[dict[str, Any]]:
    return [{"name": name, "containerPort": port, "protocol": "TCP"} for name, port in ports]


def checksum(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def pod_template(
    pool: Pool, component: str, config_text: str, pod_spec: dict[str, Any]
) -> dict[str, Any]:
    """A component's pod template, rolled by a checksum of its configuration file."""
    return {
        "metadata": {
            "labels": pool.labels(component),
            "annotations": {CONFIG_CHECKSUM_ANNOTATION: checksum(config_text)},
        },
        "spec": pod_spec,
    }
