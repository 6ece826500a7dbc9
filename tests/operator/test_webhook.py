"""The admission webhook: one label wires a tenant's vLLM pod to its pool.

First the pure mutation (:mod:`kvpool.operator.admission.wiring`) and the emulator's own
matching; then the real ``kvpool-operator`` (webhook on, reached by URL on 127.0.0.1)
against the emulated API server, which calls it on every pod creation as kube-apiserver
does (the operator and the API server every module shares: ``conftest.py``). The pool
``inference/main`` and the tenant ``team-a/vllm`` are made once; each test creates pods over
HTTP and reads what the API server stored.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import ssl
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import jsonpatch
import kmock
import pytest

from kvpool.common.names import CONNECTOR_OLD_NAMES
from kvpool.connector import settings as connector_settings
from kvpool.connector.identity import credential
from kvpool.connector.settings import ConnectorSettings
from kvpool.operator.admission import server as admission_server
from kvpool.operator.admission.certificates import make, write
from kvpool.operator.admission.server import ServiceRef, Webhook, WebhookOptions
from kvpool.operator.admission.sidecar import DecodeSidecar
from kvpool.operator.admission.wiring import (
    Binding,
    PoolFacts,
    Wiring,
    apply,
    wire,
)
from tests.operator.cluster_view import create_pod
from tests.operator.shared_operator import running
from tests.support.kube_api import ServedApi, matches_rules, matches_selector
from tests.support.metrics import memory_bytes
from tests.support.operator_process import Kubectl, OperatorProcess
from tests.support.polling import eventually
from tests.support.ports import free_port
from tests.support.raw_http import head

pytestmark = pytest.mark.process

POOL_NAMESPACE = "inference"
TEAM = "team-a"
OTHER_TEAM = "team-b"
CLOSED_TEAM = "team-c"
"""A namespace the pool does not admit, with a KVCacheTenant of the pool."""
ENGINES = "serving"
"""The pool's engine namespace (``spec.engineNamespaces``), with a KVCacheTenant of it."""
TENANT = "vllm"
ZMQ_PORT = 7500
CHUNK_TOKENS = 512
CONFIGURATION = "kvpool-operator.kvpool.io"
WEBHOOK = f"cache-pool.{CONFIGURATION}"
POOL = PoolFacts("main", POOL_NAMESPACE, ZMQ_PORT, CHUNK_TOKENS, frozenset({ENGINES}))
UNWIRED = "the pod runs without the cache"
OLD_NAMES = frozenset(CONNECTOR_OLD_NAMES.values())
ENDPOINT_NAMES = ("KVPOOL_CONNECTOR_ENDPOINT", "KVPOOL_ENDPOINT")


def _secret_env(name: str, key: str) -> dict[str, Any]:
    ref = {"name": f"{TENANT}-kvpool", "key": key, "optional": True}
    return {"name": name, "valueFrom": {"secretKeyRef": ref}}


ENV = [
    {"name": "KVPOOL_CONNECTOR_ENDPOINT", "value": f"tcp://kvpool-main.inference.svc:{ZMQ_PORT}"},
    {"name": "KVPOOL_CONNECTOR_DOOR_PATH", "value": "/var/run/kvpool/agent.sock"},
    {"name": "KVPOOL_CONNECTOR_CHUNK_TOKENS", "value": str(CHUNK_TOKENS)},
    _secret_env("KVPOOL_CONNECTOR_TOKEN", "token"),
    _secret_env("KVPOOL_CACHE_SALT", "salt"),
    {"name": "KVPOOL_ENDPOINT", "value": f"tcp://kvpool-main.inference.svc:{ZMQ_PORT}"},
    {"name": "KVPOOL_DOOR_PATH", "value": "/var/run/kvpool/agent.sock"},
    {"name": "KVPOOL_CHUNK_TOKENS", "value": str(CHUNK_TOKENS)},
    _secret_env("KVPOOL_TOKEN", "token"),
]
"""A tenant's pod: the agent's door (the volume is the door directory), no segment; then
the connector's variables again by their old names, for a connector from before the
rename."""
ENGINE_ENV = [
    ENV[0],
    {"name": "KVPOOL_CONNECTOR_SEGMENT_PATH", "value": "/var/run/kvpool/segment"},
    {"name": "KVPOOL_CONNECTOR_DOOR_PATH", "value": "/var/run/kvpool/segment.door/agent.sock"},
    *ENV[2:5],
    ENV[5],
    {"name": "KVPOOL_SEGMENT_PATH", "value": "/var/run/kvpool/segment"},
    {"name": "KVPOOL_DOOR_PATH", "value": "/var/run/kvpool/segment.door/agent.sock"},
    *ENV[7:],
]
"""A pod of the pool's engineNamespaces: the segment too (the volume is the pool's
directory)."""
ENGINE_VOLUME = {
    "name": "kvpool-segment",
    "csi": {
        "driver": "csi.kvpool.io",
        "volumeAttributes": {"pool": "main", "namespace": POOL_NAMESPACE},
    },
}
ENGINE_MOUNT = {"name": "kvpool-segment", "mountPath": "/var/run/kvpool"}
VOLUME = {"name": "kvpool-segment", "csi": {**ENGINE_VOLUME["csi"], "readOnly": True}}
MOUNT = {**ENGINE_MOUNT, "readOnly": True}
"""A tenant's pod: the same volume and mount, read-only (the plugin publishes the door)."""


def _pod(name: str, labels: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {"containers": [{"name": "vllm", "image": "vllm:test"}], **spec},
    }


LABEL = {"kvpool.io/cache-pool": "main"}


# The pure mutation.


def _two_containers() -> dict[str, Any]:
    return _pod(
        "p",
        LABEL,
        initContainers=[{"name": "init", "image": "busybox"}],
        containers=[
            {"name": "vllm", "image": "vllm:test", "env": [{"name": "HF_HOME", "value": "/h"}]},
            {
                "name": "sidecar",
                "image": "proxy",
                "volumeMounts": [{"name": "x", "mountPath": "/x"}],
            },
        ],
        volumes=[{"name": "x", "emptyDir": {}}],
    )


def test_wires_a_tenants_pod_to_the_agents_door_only() -> None:
    """The segment holds every tenant's KV: a tenant's pod gets the pool's volume read-only
    (the plugin publishes only the door in it), mounted read-only, and its connector's
    variables with the door's path, but no segment path, no transport (``auto`` uses the
    door) and not the agents' group."""
    pod = _two_containers()
    wiring = wire(pod, TEAM, [Binding(TENANT, POOL_NAMESPACE, POOL)])
    assert wiring.warnings == []
    assert wiring.patch == [
        {"op": "add", "path": "/spec/volumes/-", "value": VOLUME},
        {"op": "add", "path": "/spec/containers/0/volumeMounts", "value": [MOUNT]},
        *({"op": "add", "path": "/spec/containers/0/env/-", "value": env} for env in ENV),
        {"op": "add", "path": "/spec/containers/1/volumeMounts/-", "value": MOUNT},
        {"op": "add", "path": "/spec/containers/1/env", "value": ENV},
    ]
    apply(wiring.patch, pod)
    spec = pod["spec"]
    assert spec["volumes"] == [{"name": "x", "emptyDir": {}}, VOLUME]
    assert spec["containers"][0]["env"] == [{"name": "HF_HOME", "value": "/h"}, *ENV]
    assert spec["containers"][1]["volumeMounts"] == [{"name": "x", "mountPath": "/x"}, MOUNT]
    assert "securityContext" not in spec
    names = {env["name"] for env in ENV}
    assert names.isdisjoint({"KVPOOL_CONNECTOR_SEGMENT_PATH", "KVPOOL_CONNECTOR_TRANSPORT"})
    assert names.isdisjoint({"KVPOOL_SEGMENT_PATH", "KVPOOL_TRANSPORT"})


def test_wires_an_engine_namespaces_pod_with_exactly_this_patch() -> None:
    pod = _two_containers()
    wiring = wire(pod, ENGINES, [Binding(TENANT, POOL_NAMESPACE, POOL)])
    assert wiring.warnings == []
    assert wiring.patch == [
        {"op": "add", "path": "/spec/volumes/-", "value": ENGINE_VOLUME},
        {"op": "add", "path": "/spec/containers/0/volumeMounts", "value": [ENGINE_MOUNT]},
        *({"op": "add", "path": "/spec/containers/0/env/-", "value": env} for env in ENGINE_ENV),
        {"op": "add", "path": "/spec/containers/1/volumeMounts/-", "value": ENGINE_MOUNT},
        {"op": "add", "path": "/spec/containers/1/env", "value": ENGINE_ENV},
        {"op": "add", "path": "/spec/securityContext", "value": {"supplementalGroups": [10001]}},
    ]
    apply(wiring.patch, pod)
    spec = pod["spec"]
    assert spec["initContainers"] == [{"name": "init", "image": "busybox"}]
    assert spec["volumes"] == [{"name": "x", "emptyDir": {}}, ENGINE_VOLUME]
    assert spec["containers"][0]["env"] == [{"name": "HF_HOME", "value": "/h"}, *ENGINE_ENV]
    assert spec["containers"][1]["volumeMounts"] == [
        {"name": "x", "mountPath": "/x"},
        ENGINE_MOUNT,
    ]
    # what the patch adds is privileged in no way
    text = str(wiring.patch)
    for word in ("hostPath", "privileged", "capabilities", "runAsUser", "hostNetwork"):
        assert word not in text


def test_keeps_the_variables_a_container_sets_and_its_groups() -> None:
    own = [{"name": "KVPOOL_CHUNK_TOKENS", "value": "256"}, {"name": "KVPOOL_TOKEN", "value": "t"}]
    pod = _pod(
        "p",
        LABEL,
        containers=[{"name": "vllm", "image": "v", "env": [dict(env) for env in own]}],
        securityContext={"runAsUser": 1000, "supplementalGroups": [5]},
    )
    wiring = wire(pod, ENGINES, [Binding(TENANT, POOL_NAMESPACE, POOL)])
    apply(wiring.patch, pod)
    names = [env["name"] for env in pod["spec"]["containers"][0]["env"]]
    assert names == [  # set by their old names: neither name added
        "KVPOOL_CHUNK_TOKENS",
        "KVPOOL_TOKEN",
        "KVPOOL_CONNECTOR_ENDPOINT",
        "KVPOOL_CONNECTOR_SEGMENT_PATH",
        "KVPOOL_CONNECTOR_DOOR_PATH",
        "KVPOOL_CACHE_SALT",
        "KVPOOL_ENDPOINT",
        "KVPOOL_SEGMENT_PATH",
        "KVPOOL_DOOR_PATH",
    ]
    assert pod["spec"]["containers"][0]["env"][:2] == own
    assert pod["spec"]["securityContext"] == {"runAsUser": 1000, "supplementalGroups": [5, 10001]}


def test_a_container_with_its_own_token_file_keeps_it() -> None:
    own = [{"name": "KVPOOL_TOKEN_FILE", "value": "/var/run/token"}]
    pod = _pod("p", LABEL, containers=[{"name": "vllm", "image": "v", "env": own}])
    apply(wire(pod, TEAM, [Binding(TENANT, POOL_NAMESPACE, POOL)]).patch, pod)
    names = [env["name"] for env in pod["spec"]["containers"][0]["env"]]
    assert "KVPOOL_TOKEN" not in names
    assert "KVPOOL_CONNECTOR_TOKEN" not in names
    assert "KVPOOL_CACHE_SALT" in names


def test_a_variable_a_container_sets_by_its_new_name_gets_neither_name() -> None:
    own = [
        {"name": "KVPOOL_CONNECTOR_CHUNK_TOKENS", "value": "256"},
        {"name": "KVPOOL_CONNECTOR_TOKEN_FILE", "value": "/var/run/token"},
    ]
    pod = _pod("p", LABEL, containers=[{"name": "vllm", "image": "v", "env": own}])
    apply(wire(pod, TEAM, [Binding(TENANT, POOL_NAMESPACE, POOL)]).patch, pod)
    names = [env["name"] for env in pod["spec"]["containers"][0]["env"]]
    assert names == [
        "KVPOOL_CONNECTOR_CHUNK_TOKENS",
        "KVPOOL_CONNECTOR_TOKEN_FILE",
        "KVPOOL_CONNECTOR_ENDPOINT",
        "KVPOOL_CONNECTOR_DOOR_PATH",
        "KVPOOL_CACHE_SALT",
        "KVPOOL_ENDPOINT",
        "KVPOOL_DOOR_PATH",
    ]


SIDECAR = DecodeSidecar(
    image="kvpool:1",
    image_pull_policy="IfNotPresent",
    port=8000,
    vllm_port=8200,
    key_secret="kvpool-main-pd-key",
    decode_wait_ms=2000,
    prefill_timeout_seconds=30,
    resources={"requests": {"cpu": "100m"}},
)
PD_POOL = PoolFacts("main", POOL_NAMESPACE, ZMQ_PORT, CHUNK_TOKENS, decode_sidecar=SIDECAR)
"""A pool whose picker disaggregates."""
KEY_VOLUME = {
    "name": "kvpool-pd-key",
    "secret": {"secretName": "kvpool-main-pd-key", "defaultMode": 0o444},
}


def _decode_pod(role: str | None, **spec: Any) -> dict[str, Any]:
    return _pod("p", LABEL | ({"kvpool.io/role": role} if role else {}), **spec)


def test_a_decode_pod_gets_the_sidecar_after_its_init_containers() -> None:
    """A native sidecar (an init container that keeps running), after the pod's own init
    containers (a model download, say), the key mounted into it alone."""
    pod = _decode_pod("decode", **_two_containers()["spec"])
    wiring = wire(pod, POOL_NAMESPACE, [Binding(TENANT, POOL_NAMESPACE, PD_POOL)])
    assert wiring.warnings == []
    apply(wiring.patch, pod)
    init, sidecar = pod["spec"]["initContainers"]
    assert init == {"name": "init", "image": "busybox"}
    assert sidecar == {
        "name": "kvpool-pd-sidecar",
        "image": "kvpool:1",
        "imagePullPolicy": "IfNotPresent",
        "restartPolicy": "Always",
        "command": ["kvpool-pd-sidecar"],
        "args": [
            "--port=8000",
            "--vllm=http://127.0.0.1:8200",
            "--key-file=/etc/kvpool/pd-key/key",
            "--decode-wait-ms=2000",
            "--prefill-timeout-s=30",
        ],
        "env": [{"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}],
        "resources": {"requests": {"cpu": "100m"}},
        "securityContext": {
            "privileged": False,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
            "runAsNonRoot": True,
            "runAsUser": 10001,
            "runAsGroup": 10001,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "volumeMounts": [
            {"name": "kvpool-pd-key", "mountPath": "/etc/kvpool/pd-key", "readOnly": True}
        ],
    }
    assert pod["spec"]["volumes"] == [{"name": "x", "emptyDir": {}}, VOLUME, KEY_VOLUME]
    for container in pod["spec"]["containers"]:
        assert KEY_VOLUME["name"] not in {m["name"] for m in container["volumeMounts"]}
    assert wire(pod, POOL_NAMESPACE, [Binding(TENANT, POOL_NAMESPACE, PD_POOL)]) == Wiring()


@pytest.mark.parametrize(
    ("role", "namespace", "pool", "sidecar", "warning"),
    [
        ("decode", POOL_NAMESPACE, PD_POOL, True, ""),
        ("both", POOL_NAMESPACE, PD_POOL, True, ""),
        ("prefill", POOL_NAMESPACE, PD_POOL, False, ""),
        (None, POOL_NAMESPACE, PD_POOL, False, ""),
        ("llm-d", POOL_NAMESPACE, PD_POOL, False, ""),
        ("decode", POOL_NAMESPACE, POOL, False, ""),
        (
            "decode",
            TEAM,
            PD_POOL,
            False,
            "kvpool: label kvpool.io/role=decode in namespace team-a: the picker of pool "
            "inference/main routes only pods of inference; the pod runs without the decode "
            "sidecar",
        ),
    ],
    ids=["decode", "both", "prefill", "unlabelled", "other-value", "no-pd", "tenant-namespace"],
)
def test_which_pods_get_the_sidecar(
    role: str | None, namespace: str, pool: PoolFacts, sidecar: bool, warning: str
) -> None:
    """Only decode-capable pods the picker routes (the pool's namespace's) of a pool that
    disaggregates; every one of them is wired to the cache all the same."""
    wiring = wire(_decode_pod(role), namespace, [Binding(TENANT, POOL_NAMESPACE, pool)])
    paths = {operation["path"] for operation in wiring.patch}
    assert ("/spec/initContainers" in paths) == sidecar
    assert "/spec/volumes" in paths
    assert wiring.warnings == ([warning] if warning else [])


def test_a_container_on_the_sidecars_port_is_warned_about() -> None:
    """The sidecar takes the target port: a vLLM container declaring it would not bind."""
    containers = [{"name": "vllm", "image": "v", "ports": [{"containerPort": 8000}]}]
    wiring = wire(
        _decode_pod("decode", containers=containers),
        POOL_NAMESPACE,
        [Binding(TENANT, POOL_NAMESPACE, PD_POOL)],
    )
    assert any(operation["path"] == "/spec/initContainers" for operation in wiring.patch)
    assert wiring.warnings == [
        "kvpool: container vllm declares port 8000, where the decode sidecar listens: serve "
        "its vLLM on port 8200 (spec.index.picker.disaggregation.vllmPort)"
    ]


def test_a_pod_with_a_sidecar_of_that_name_keeps_its_own() -> None:
    own = [{"name": "kvpool-pd-sidecar", "image": "mine", "restartPolicy": "Always"}]
    pod = _decode_pod("decode", initContainers=own)
    wiring = wire(pod, POOL_NAMESPACE, [Binding(TENANT, POOL_NAMESPACE, PD_POOL)])
    assert all(operation["path"] != "/spec/initContainers/-" for operation in wiring.patch)
    apply(wiring.patch, pod)
    assert pod["spec"]["initContainers"] == own and pod["spec"]["volumes"] == [VOLUME]


def _environ(env: list[dict[str, Any]], secret: dict[str, str]) -> dict[str, str]:
    """The environment the kubelet gives a container of ``env`` (``secret``: the tenant's
    Secret's data)."""
    return {
        variable["name"]: variable.get("value")
        or secret[variable["valueFrom"]["secretKeyRef"]["key"]]
        for variable in env
    }


@pytest.mark.parametrize("env", [ENV, ENGINE_ENV], ids=["tenant", "engine"])
def test_connectors_old_and_new_read_the_wired_pod_alike_and_the_new_without_a_word(
    env: list[dict[str, Any]], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the webhook writes, read by a connector of today (every name) and one from
    before the rename (the old names only): the same settings and token, and no warning and
    no refusal from today's, which would otherwise fill every wired engine's log."""
    environ = _environ(env, {"token": "the-team-s-token", "salt": "the-team-s-salt"})
    caplog.set_level(logging.WARNING, logger="kvpool.connector.settings")
    monkeypatch.setattr(connector_settings, "_warned", set())  # no old name read before
    settings = ConnectorSettings.load({}, environ)
    assert settings.endpoint == f"tcp://kvpool-main.inference.svc:{ZMQ_PORT}"
    assert credential(settings, environ)() == "the-team-s-token"
    assert caplog.records == []
    old = {name: value for name, value in environ.items() if name in OLD_NAMES}
    assert ConnectorSettings.load({}, old) == settings
    assert credential(settings, old)() == "the-team-s-token"


@pytest.mark.parametrize("namespace", [TEAM, ENGINES])
def test_leaves_a_wired_pod_as_it_is(namespace: str) -> None:
    """A pod is wired once: one that already has the volume (a tenant's, read-only, or an
    engine's) gets no second volume, mount or variable, and no warning."""
    pod = _pod("p", LABEL)
    apply(wire(pod, namespace, [Binding(TENANT, POOL_NAMESPACE, POOL)]).patch, pod)
    assert pod["spec"]["volumes"] == [VOLUME if namespace == TEAM else ENGINE_VOLUME]
    assert wire(pod, namespace, [Binding(TENANT, POOL_NAMESPACE, POOL)]) == Wiring()
    assert wire(pod, namespace, []) == Wiring()


@pytest.mark.parametrize(
    ("value", "bindings", "problem"),
    [
        ("main", [], "no KVCacheTenant in namespace team-a binds pool main"),
        (
            "main",
            [Binding("b", "x", POOL), Binding("a", "y", POOL)],
            "2 KVCacheTenants in namespace team-a bind pool main (a, b); "
            "label the pod for one pool of one tenant",
        ),
        (
            "Main_Pool",
            [],
            "label kvpool.io/cache-pool='Main_Pool' in namespace team-a is not a pool name "
            "(a DNS label)",
        ),
        (
            "main",
            [Binding(TENANT, POOL_NAMESPACE, None)],
            "KVCacheTenant team-a/vllm binds pool inference/main, which does not exist or is "
            "not valid",
        ),
        (
            "main",
            [Binding(TENANT, POOL_NAMESPACE, POOL, "NamespaceNotAllowed")],
            "KVCacheTenant team-a/vllm is not accepted by pool inference/main "
            "(NamespaceNotAllowed)",
        ),
    ],
    ids=["no-tenant", "two-tenants", "invalid-value", "no-pool", "refused"],
)
def test_warns_and_changes_nothing(value: str, bindings: list[Binding], problem: str) -> None:
    wiring = wire(_pod("p", {"kvpool.io/cache-pool": value}), TEAM, bindings)
    assert wiring.patch == []
    assert wiring.warnings == [f"kvpool: {problem}; {UNWIRED}"]


def _first_config(options: WebhookOptions, hostname: str) -> dict[str, Any]:
    """Start the webhook server; its first client configuration, once a TLS client that
    trusts its caBundle has verified it as ``hostname``."""

    async def fn(*_: Any, **__: Any) -> Any:
        raise AssertionError("not called")

    async def first() -> dict[str, Any]:
        async with Webhook(options) as server:
            async for config in server(fn):
                ca = base64.b64decode(config["caBundle"] or "").decode()
                context = ssl.create_default_context(cadata=ca)
                _, writer = await asyncio.open_connection(
                    options.bind, options.port, ssl=context, server_hostname=hostname
                )
                writer.close()
                return dict(config)
        raise AssertionError("no client configuration")

    return asyncio.run(first())


def test_through_a_service_the_client_config_names_it() -> None:
    service = ServiceRef("kvpool-system", "kvpool-operator", 443)
    options = WebhookOptions(bind="127.0.0.1", port=free_port(), service=service)
    config = _first_config(options, "kvpool-operator.kvpool-system.svc")
    assert config["service"] == {
        "namespace": "kvpool-system",
        "name": "kvpool-operator",
        "port": 443,
    }
    assert "url" not in config


def test_a_certificate_directory_is_served_and_its_ca_published(tmp_path: Path) -> None:
    made = make(["127.0.0.1"])
    write(made, tmp_path)
    options = WebhookOptions(
        bind="127.0.0.1", port=free_port(), url_host="127.0.0.1", cert_dir=tmp_path
    )
    config = _first_config(options, "127.0.0.1")
    assert base64.b64decode(config["caBundle"]) == made.ca
    assert config["url"] == f"https://127.0.0.1:{options.port}"


def test_renewed_tls_files_are_served_and_their_ca_published(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cert-manager renews the files in place: the next client configuration carries the
    new CA, and a client that trusts only the new CA is served."""
    monkeypatch.setattr(admission_server, "RENEWAL_CHECK_SECONDS", 0.05)
    write(make(["127.0.0.1"]), tmp_path)
    options = WebhookOptions(
        bind="127.0.0.1", port=free_port(), url_host="127.0.0.1", cert_dir=tmp_path
    )

    async def fn(*_: Any, **__: Any) -> Any:
        raise AssertionError("not called")

    async def renew() -> None:
        async with Webhook(options) as server:
            configs = server(fn)
            await anext(configs)
            renewed = make(["127.0.0.1"])
            write(renewed, tmp_path)
            config = await asyncio.wait_for(anext(configs), 10)
            assert base64.b64decode(config["caBundle"]) == renewed.ca
            context = ssl.create_default_context(cadata=renewed.ca.decode())
            _, writer = await asyncio.open_connection(
                options.bind, options.port, ssl=context, server_hostname="127.0.0.1"
            )
            writer.close()
            await configs.aclose()

    asyncio.run(renew())


# The emulator's matching.


@pytest.mark.parametrize(
    ("selector", "labels", "selected"),
    [
        (None, {}, True),
        ({}, {"a": "1"}, True),
        ({"matchLabels": {"a": "1"}}, {"a": "1", "b": "2"}, True),
        ({"matchLabels": {"a": "1"}}, {"a": "2"}, False),
        ({"matchExpressions": [{"key": "a", "operator": "Exists"}]}, {"a": ""}, True),
        ({"matchExpressions": [{"key": "a", "operator": "Exists"}]}, {}, False),
        ({"matchExpressions": [{"key": "a", "operator": "DoesNotExist"}]}, {}, True),
        (
            {"matchExpressions": [{"key": "a", "operator": "In", "values": ["1", "2"]}]},
            {"a": "2"},
            True,
        ),
        ({"matchExpressions": [{"key": "a", "operator": "In", "values": ["1"]}]}, {}, False),
        ({"matchExpressions": [{"key": "a", "operator": "NotIn", "values": ["1"]}]}, {}, True),
        (
            {"matchExpressions": [{"key": "a", "operator": "NotIn", "values": ["1"]}]},
            {"a": "1"},
            False,
        ),
    ],
)
def test_the_emulator_matches_label_selectors(
    selector: dict[str, Any] | None, labels: dict[str, str], selected: bool
) -> None:
    assert matches_selector(selector, labels) is selected


def test_the_emulator_matches_rules() -> None:
    pods = kmock.resource("", "v1", "pods")
    rule = {
        "apiGroups": [""],
        "apiVersions": ["v1"],
        "resources": ["pods"],
        "operations": ["CREATE"],
    }
    assert matches_rules([rule], pods, "CREATE", True)
    assert not matches_rules([rule], pods, "UPDATE", True)
    assert not matches_rules([rule], kmock.resource("apps", "v1", "deployments"), "CREATE", True)
    assert not matches_rules([{**rule, "scope": "Cluster"}], pods, "CREATE", True)
    anything = {"apiGroups": ["*"], "apiVersions": ["*"], "resources": ["*"], "operations": ["*"]}
    assert matches_rules([anything], kmock.resource("apps", "v1", "deployments"), "CREATE", True)


# The real operator.


def _apply(kubectl: Kubectl, manifest: dict[str, Any]) -> None:
    kubectl("apply", "--validate=false", "-f", "-", manifest=manifest)


def _namespace(name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": name, "labels": labels or {}},
    }


def _conditions(api: ServedApi, plural: str, namespace: str, name: str) -> list[Any]:
    found = api.objects(plural, namespace).get(name) or {}
    conditions: list[Any] = (found.get("status") or {}).get("conditions") or []
    assert conditions, f"{plural} {namespace}/{name}: no conditions yet"
    return conditions


@pytest.fixture(scope="module")
def wired_cluster(
    served_api: ServedApi, kubectl: Kubectl, operator_process: OperatorProcess
) -> Iterator[None]:
    """The module's namespaces, pool and tenants, on the operator that every module shares
    (``conftest.py``): these namespaces' names are theirs alone (the other modules' names
    carry a number), and they are removed after the module."""
    operator = running(operator_process, served_api)
    for name in (POOL_NAMESPACE, TEAM, OTHER_TEAM, CLOSED_TEAM, ENGINES):
        admitted = name in (TEAM, OTHER_TEAM, ENGINES)
        _apply(kubectl, _namespace(name, {"team": "yes"} if admitted else {}))
    pool = {
        "apiVersion": "kvpool.io/v1alpha1",
        "kind": "KVCachePool",
        "metadata": {"name": "main", "namespace": POOL_NAMESPACE},
        "spec": {
            "chunkTokens": CHUNK_TOKENS,
            "ports": {"zmq": ZMQ_PORT},
            "tenants": {"allowedNamespaces": {"matchLabels": {"team": "yes"}}},
            "engineNamespaces": [ENGINES],
        },
    }
    _apply(kubectl, pool)
    tenant = {
        "apiVersion": "kvpool.io/v1alpha1",
        "kind": "KVCacheTenant",
        "metadata": {"name": TENANT, "namespace": TEAM},
        "spec": {"poolRef": {"name": "main", "namespace": POOL_NAMESPACE}, "quota": {"l1": "1Gi"}},
    }
    _apply(kubectl, tenant)
    _apply(kubectl, {**tenant, "metadata": {"name": TENANT, "namespace": CLOSED_TEAM}})
    _apply(kubectl, {**tenant, "metadata": {"name": TENANT, "namespace": ENGINES}})
    # the webhook is configured, and the operator has seen the pool and the tenant (so
    # its indices hold them: kopf indexes an object before it handles it)
    eventually(lambda: _webhook(served_api), timeout=30, what=operator.log(operator.startup[0]))
    eventually(lambda: _conditions(served_api, "kvcachepools", POOL_NAMESPACE, "main"))
    eventually(lambda: _conditions(served_api, "kvcachetenants", TEAM, TENANT))
    eventually(lambda: _conditions(served_api, "kvcachetenants", CLOSED_TEAM, TENANT))
    eventually(lambda: _conditions(served_api, "kvcachetenants", ENGINES, TENANT))
    yield
    for name in (POOL_NAMESPACE, TEAM, OTHER_TEAM, CLOSED_TEAM, ENGINES):
        served_api.remove_namespace(name)


@pytest.fixture
def operator(operator: OperatorProcess, wired_cluster: None) -> OperatorProcess:
    """The shared operator (running), once the module's pool and tenants are made."""
    return operator


def _webhook(api: ServedApi) -> dict[str, Any]:
    configuration = api.objects("mutatingwebhookconfigurations").get(CONFIGURATION)
    assert configuration is not None and configuration.get("webhooks"), configuration
    (webhook,) = configuration["webhooks"]
    assert webhook["clientConfig"].get("caBundle")
    result: dict[str, Any] = webhook
    return result


def _calls(api: ServedApi, name: str) -> list[str]:
    return [call.outcome for call in api.api.admissions if call.name == name]


def test_kopf_configures_the_webhook(served_api: ServedApi, operator: OperatorProcess) -> None:
    webhook = _webhook(served_api)
    assert webhook["name"] == WEBHOOK
    assert webhook["failurePolicy"] == "Ignore"
    assert webhook["sideEffects"] == "None"
    assert webhook["objectSelector"] == {
        "matchExpressions": [{"key": "kvpool.io/cache-pool", "operator": "Exists"}]
    }
    (rule,) = webhook["rules"]
    assert (rule["apiGroups"], rule["apiVersions"], rule["resources"], rule["operations"]) == (
        [""],
        ["v1"],
        ["pods"],
        ["CREATE"],
    )
    assert webhook["clientConfig"]["url"].startswith("https://127.0.0.1:")
    assert webhook["clientConfig"]["url"].endswith("/cache-pool")
    # kopf keeps a ValidatingWebhookConfiguration of the same name too (no webhooks in it):
    # the operator's RBAC needs create and patch on both kinds
    validating = served_api.objects("validatingwebhookconfigurations")[CONFIGURATION]
    assert not validating.get("webhooks")


def test_a_labelled_pod_is_wired(served_api: ServedApi, operator: OperatorProcess) -> None:
    pod, warnings = create_pod(served_api, TEAM, _pod("wired", LABEL))
    assert warnings == []
    container = {"name": "vllm", "image": "vllm:test", "volumeMounts": [MOUNT], "env": ENV}
    assert pod["spec"] == {"containers": [container], "volumes": [VOLUME]}
    assert _calls(served_api, "wired") == ["patched"]


def test_a_labelled_pod_of_an_engine_namespace_maps_the_segment(
    served_api: ServedApi, operator: OperatorProcess
) -> None:
    pod, warnings = create_pod(served_api, ENGINES, _pod("engine", LABEL))
    assert warnings == []
    container = {
        "name": "vllm",
        "image": "vllm:test",
        "volumeMounts": [ENGINE_MOUNT],
        "env": ENGINE_ENV,
    }
    assert pod["spec"] == {
        "containers": [container],
        "volumes": [ENGINE_VOLUME],
        "securityContext": {"supplementalGroups": [10001]},
    }


def test_a_containers_own_variable_stays(served_api: ServedApi, operator: OperatorProcess) -> None:
    own = {"name": "KVPOOL_CHUNK_TOKENS", "value": "256"}
    container = {"name": "vllm", "image": "vllm:test", "env": [own]}
    pod, _ = create_pod(served_api, TEAM, _pod("own-env", LABEL, containers=[container]))
    env = pod["spec"]["containers"][0]["env"]
    assert env[0] == own
    assert [variable["name"] for variable in env].count("KVPOOL_CHUNK_TOKENS") == 1


def test_a_containers_own_variable_by_its_old_name_gets_neither_name(
    served_api: ServedApi, operator: OperatorProcess
) -> None:
    """A pod that names its agent itself, by the old name, keeps it: the webhook writes the
    endpoint by neither name, so its connector reads the pod's own, as before the rename
    (and is not refused for two endpoints)."""
    own = {"name": "KVPOOL_ENDPOINT", "value": "tcp://own-agent.team-a.svc:7400"}
    container = {"name": "vllm", "image": "vllm:test", "env": [own]}
    pod, _ = create_pod(served_api, TEAM, _pod("own-old-env", LABEL, containers=[container]))
    env = pod["spec"]["containers"][0]["env"]
    assert env == [own, *(v for v in ENV if v["name"] not in ENDPOINT_NAMES)]
    environ = _environ(env, {"token": "t", "salt": "s"})
    assert ConnectorSettings.load({}, environ).endpoint == "tcp://own-agent.team-a.svc:7400"


def test_an_unlabelled_pod_is_not_even_sent(
    served_api: ServedApi, operator: OperatorProcess
) -> None:
    sent = _pod("plain", {"app": "vllm"})
    pod, warnings = create_pod(served_api, TEAM, sent)
    assert (pod["spec"], warnings) == (sent["spec"], [])
    assert _calls(served_api, "plain") == []


@pytest.mark.parametrize(
    ("namespace", "value", "problem"),
    [
        (TEAM, "other", "no KVCacheTenant in namespace team-a binds pool other"),
        (OTHER_TEAM, "main", "no KVCacheTenant in namespace team-b binds pool main"),
        (
            TEAM,
            "Main.Pool",
            "label kvpool.io/cache-pool='Main.Pool' in namespace team-a is not a pool name "
            "(a DNS label)",
        ),
        (
            CLOSED_TEAM,
            "main",
            "KVCacheTenant team-c/vllm is not accepted by pool inference/main "
            "(NamespaceNotAllowed)",
        ),
    ],
    ids=["other-pool", "other-namespace", "invalid-value", "refused-tenant"],
)
def test_a_pod_that_cannot_be_wired_is_created_with_a_warning(
    served_api: ServedApi, operator: OperatorProcess, namespace: str, value: str, problem: str
) -> None:
    name = f"unwired-{uuid.uuid4().hex[:6]}"
    sent = _pod(name, {"kvpool.io/cache-pool": value})
    pod, warnings = create_pod(served_api, namespace, sent)
    assert pod["spec"] == sent["spec"]
    assert warnings == [f'299 - "kvpool: {problem}; {UNWIRED}"']
    assert _calls(served_api, name) == ["unchanged"]


def test_the_published_ca_verifies_the_webhook_address(
    served_api: ServedApi, operator: OperatorProcess
) -> None:
    config = _webhook(served_api)["clientConfig"]
    context = ssl.create_default_context(cadata=base64.b64decode(config["caBundle"]).decode())
    pod = _pod("direct", LABEL)
    pod["metadata"]["namespace"] = TEAM
    uid = str(uuid.uuid4())
    review = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": TEAM,
            "operation": "CREATE",
            "userInfo": {"username": "someone"},
            "object": pod,
            "dryRun": False,
        },
    }
    response = httpx.post(config["url"], json=review, verify=context, timeout=10)
    assert response.status_code == 200, response.text
    answer = response.json()["response"]
    assert (answer["uid"], answer["allowed"], answer["patchType"]) == (uid, True, "JSONPatch")
    patched = jsonpatch.apply_patch(pod, json.loads(base64.b64decode(answer["patch"])))
    assert patched["spec"]["containers"][0]["env"] == ENV
    with pytest.raises(httpx.ConnectError):  # another CA: refused
        httpx.post(config["url"], json=review, verify=ssl.create_default_context(), timeout=10)


def test_a_failing_webhook_under_fail_policy_fails_thecreate_pod(
    served_api: ServedApi, operator: OperatorProcess
) -> None:
    url = f"https://127.0.0.1:{free_port()}/x"
    configuration = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": "strict.example.com"},
        "webhooks": [
            {
                "name": "strict.example.com",
                "clientConfig": {"url": url},
                "rules": [
                    {
                        "apiGroups": [""],
                        "apiVersions": ["v1"],
                        "resources": ["pods"],
                        "operations": ["CREATE"],
                    }
                ],
                "objectSelector": {"matchLabels": {"strict": "yes"}},
                "namespaceSelector": {"matchLabels": {"team": "yes"}},
                "sideEffects": "None",
                "admissionReviewVersions": ["v1"],
            }
        ],
    }
    headers = {"Authorization": "Bearer test"}
    base = f"{served_api.url}/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"
    assert httpx.post(base, json=configuration, headers=headers).status_code == 201
    try:
        pods = f"{served_api.url}/api/v1/namespaces/{TEAM}/pods"
        refused = httpx.post(pods, json=_pod("strict", {"strict": "yes"}), headers=headers)
        assert refused.status_code == 500
        assert refused.json()["message"].startswith(
            f'Internal error occurred: failed calling webhook "strict.example.com": '
            f'failed to call webhook: Post "{url}": '
        )
        assert "strict" not in served_api.objects("pods", TEAM)
        # the namespace selector: not a team namespace, not called
        pods = f"{served_api.url}/api/v1/namespaces/{POOL_NAMESPACE}/pods"
        created = httpx.post(pods, json=_pod("strict", {"strict": "yes"}), headers=headers)
        assert created.status_code == 201, created.text
    finally:
        httpx.delete(f"{base}/strict.example.com", headers=headers)


# What junk clients may cost the webhook: any pod can reach it, and the API server sends
# no client certificate, so every connection is a stranger's.

DEADLINE_SECONDS = 5.0
"""The webhook's TLS handshake deadline, and its request head deadline."""
SLACK_SECONDS = 3.0
"""Beyond a deadline, for a loaded machine."""
JUNK_CONNECTIONS = 200
JUNK_MEMORY_BOUND = 16 << 20
"""The operator's RSS growth allowed while 200 junk connections come (before: +206 MiB for
200 half heads, as many of them held as came, each for ever)."""
WIRED_WITHIN_SECONDS = 2.0


def _webhook_address(api: ServedApi) -> tuple[str, int, ssl.SSLContext]:
    """The webhook's host and port, and a TLS context that trusts its published CA."""
    config = _webhook(api)["clientConfig"]
    parts = urlsplit(config["url"])
    assert parts.hostname is not None and parts.port is not None
    context = ssl.create_default_context(cadata=base64.b64decode(config["caBundle"]).decode())
    return parts.hostname, parts.port, context


async def _held_seconds(reader: asyncio.StreamReader, opened: float) -> float:
    """Seconds from ``opened`` until the server closed the connection (at most a bound)."""
    try:
        async with asyncio.timeout(DEADLINE_SECONDS + 2 * SLACK_SECONDS):
            while await reader.read(65536):
                pass
    except TimeoutError:
        return float("inf")
    except OSError:  # reset, or TLS cut short: closed too
        pass
    return time.monotonic() - opened


Junk = Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]


def _flood(api: ServedApi, operator: OperatorProcess, junk: Junk, pod: str) -> list[float]:
    """Open :data:`JUNK_CONNECTIONS` junk connections one after the other, then create a
    labelled pod through the API server; checks that the operator's memory stayed bounded
    and the pod was wired in time; how long the server held each junk connection."""
    before = memory_bytes(operator.pid)

    async def flood() -> list[float]:
        waits, writers = [], []
        for _ in range(JUNK_CONNECTIONS):
            reader, writer = await junk()
            waits.append(asyncio.create_task(_held_seconds(reader, time.monotonic())))
            writers.append(writer)
        growth = memory_bytes(operator.pid) - before
        assert growth < JUNK_MEMORY_BOUND, f"RSS grew by {growth >> 20} MiB"
        started = time.monotonic()
        stored, _ = await asyncio.to_thread(create_pod, api, TEAM, _pod(pod, LABEL))
        assert time.monotonic() - started < WIRED_WITHIN_SECONDS
        assert stored["spec"]["containers"][0]["env"] == ENV
        held = await asyncio.gather(*waits)
        for writer in writers:
            writer.close()
        return held

    return asyncio.run(flood())


def test_connections_stalled_in_their_request_head_are_closed_within_seconds(
    served_api: ServedApi, operator: OperatorProcess
) -> None:
    """200 connections finish TLS, send half a request head and stall: each is closed
    within the head deadline (the oldest at once past the connection bound), the
    operator's memory barely grows, and the API server's calls still get through."""
    host, port, context = _webhook_address(served_api)

    async def half_head() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection(
            host, port, ssl=context, server_hostname=host
        )
        writer.write(head("POST", "/cache-pool", end=False))
        await writer.drain()
        return reader, writer

    held = _flood(served_api, operator, half_head, "among-half-heads")
    assert max(held) < DEADLINE_SECONDS + SLACK_SECONDS, sorted(held)[-5:]


def test_connections_that_never_start_tls_are_closed_within_seconds(
    served_api: ServedApi, operator: OperatorProcess
) -> None:
    """200 TCP connections send nothing: each is closed within the handshake deadline (the
    oldest at once past the bound), and the API server's calls still get through."""
    host, port, _ = _webhook_address(served_api)

    async def silent() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection(host, port)

    held = _flood(served_api, operator, silent, "among-silent-connections")
    assert max(held) < DEADLINE_SECONDS + SLACK_SECONDS, sorted(held)[-5:]


def test_a_body_declared_too_large_is_refused_at_once_and_the_connection_closed(
    served_api: ServedApi, operator: OperatorProcess
) -> None:
    host, port, context = _webhook_address(served_api)
    declared = {"Content-Type": "application/json", "Content-Length": str(100 << 20)}

    async def declare() -> bytes:
        reader, writer = await asyncio.open_connection(
            host, port, ssl=context, server_hostname=host
        )
        writer.write(head("POST", "/cache-pool", declared))  # and not one byte of the body
        try:
            async with asyncio.timeout(SLACK_SECONDS):
                return await reader.read()  # up to the end: the server closes
        finally:
            writer.close()

    answer = asyncio.run(declare())
    assert answer.startswith(b"HTTP/1.1 413 "), answer
    assert b"request body larger than 1048576 bytes" in answer


def test_with_the_operator_down_a_labelled_pod_is_created_as_it_is(
    served_api: ServedApi, operator: OperatorProcess
) -> None:
    """Last: it stops the operator. The webhook stays configured (persistent); its calls
    fail, and failurePolicy Ignore creates the pod unchanged."""
    operator.stop()
    assert _webhook(served_api)
    sent = _pod("operator-down", LABEL)
    pod, warnings = create_pod(served_api, TEAM, sent)
    assert (pod["spec"], warnings) == (sent["spec"], [])
    (outcome,) = _calls(served_api, "operator-down")
    assert outcome.startswith("ignored: failed to call webhook: Post ")
