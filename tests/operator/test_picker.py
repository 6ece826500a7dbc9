"""The endpoint picker (``spec.index.picker``): what the CRD admits and refuses, and what the
operator renders for it: the index's ``picker:`` settings, the gRPC port on the index's
container and Service, the tokenizer's read-only claim, and who the NetworkPolicy lets
reach the port."""

from __future__ import annotations

import re
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvpool.common.index_config import IndexConfig, PickerConfig
from kvpool.operator.render import PICKER_PORT_NAME, Children, IndexChildren, Pool, render
from kvpool.operator.render.config import TOKENIZER_DIR
from kvpool.operator.spec import (
    API_VERSION,
    KIND,
    NETWORK_POLICY_NEEDS_PICKER_CLIENTS,
    PICKER_NEEDS_FINGERPRINT,
    PICKER_NEEDS_SELECTOR,
    PICKER_PORT_TAKEN,
    TOKENIZER_SUB_PATH,
    InvalidSpec,
    PoolSpec,
)
from tests.support import pod_security
from tests.support.crd_schema import OLDEST_KUBERNETES, admission_errors, schema, with_defaults

from .network_policy import Pod, admits

POOL = Pool("gpu", "inference", "0d3c5e9a-1f2b-4c6d-8e9f-0a1b2c3d4e5f")
TOKENS = {"tenants": {"tokensSecretRef": {"name": "kvpool-gpu-tokens"}}}
SELECTOR = {"app": "vllm-qwen3"}
PICKER = {"enabled": True, "selector": SELECTOR}
TOKENIZER = {"claimName": "model-cache", "subPath": "Qwen/Qwen3-0.6B"}
GATEWAY_NAMESPACE = {"kubernetes.io/metadata.name": "gateways"}
ENVOY = {"namespaceSelector": {"matchLabels": GATEWAY_NAMESPACE}, "podSelector": {}}
ROUTE_GATEWAY = {"podSelector": {"matchLabels": {"app": "router"}}}
POLICY = {
    "enabled": True,
    "clients": [{"podSelector": {"matchLabels": SELECTOR}}],
    "gateways": [ROUTE_GATEWAY],
    "pickerClients": [ENVOY],
}


def _pool(spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": "gpu"}, "spec": spec}


FINGERPRINT = {"model": "Qwen/Qwen3-0.6B", "dtype": "bfloat16", "kvLayout": "nhd"}


def _spec(picker: dict[str, Any], **pool: Any) -> dict[str, Any]:
    index = {"enabled": True, "fingerprint": FINGERPRINT, "picker": picker}
    return {**TOKENS, "index": index, **pool}


def _children(spec: dict[str, Any]) -> Children:
    return render(POOL, PoolSpec.parse(spec), default_image="registry.example/kvpool:1.0")


def _index(picker: dict[str, Any], **pool: Any) -> IndexChildren:
    index = _children(_spec(picker, **pool)).index
    assert index is not None
    return index


def _container(index: IndexChildren) -> dict[str, Any]:
    (container,) = index.deployment["spec"]["template"]["spec"]["containers"]
    assert isinstance(container, dict)
    return container


def _index_config(index: IndexChildren) -> IndexConfig:
    """The index's configuration file, read by the index's own model."""
    return IndexConfig.model_validate(yaml.safe_load(index.config["data"]["index.yaml"]))


@pytest.mark.parametrize("version", [OLDEST_KUBERNETES, kubernetes_validate.latest_version()])
def test_picker_children_are_valid_kubernetes_objects(version: str) -> None:
    picker = {**PICKER, "tokenizer": TOKENIZER, "placementEventsPort": 7406}
    policy = {**POLICY, "routers": [{"podSelector": {"matchLabels": {"app": "llm-d"}}}]}
    children = _children(_spec(picker, networkPolicy=policy))
    assert children.index is not None
    for child in [*children.index.manifests(), *children.network_policies]:
        kubernetes_validate.validate(child, version, strict=True)


def test_the_index_runs_the_picker_it_is_configured_with() -> None:
    picker = {
        **PICKER,
        "port": 9002,
        "targetPort": 8080,
        "kvEventsPort": 5557,
        "kvEventsReplayPort": 5558,
        "tokenizer": TOKENIZER,
        "deadlineMs": 20,
        "maxPromptTokens": 32768,
    }
    index = _index(picker)
    config = _index_config(index).picker
    assert config == PickerConfig(
        enabled=True,
        port=9002,
        discovery="kubernetes",
        selector=SELECTOR,
        target_port=8080,
        kv_events_port=5557,
        kv_events_replay_port=5558,
        tokenizer=TOKENIZER_DIR,
        deadline_ms=20,
        max_prompt_tokens=32768,
    )
    assert _index_config(index).namespace == POOL.namespace  # its model servers' namespace too
    ports = {port["name"]: port for port in _container(index)["ports"]}
    assert ports[PICKER_PORT_NAME]["containerPort"] == 9002
    service = {port["name"]: port for port in index.service["spec"]["ports"]}
    assert service[PICKER_PORT_NAME] == {
        "name": PICKER_PORT_NAME,
        "port": 9002,
        "targetPort": PICKER_PORT_NAME,
        "protocol": "TCP",
        "appProtocol": "kubernetes.io/h2c",
    }
    assert "appProtocol" not in service["http"]
    # readiness stays the index's HTTP /readyz
    assert _container(index)["readinessProbe"]["httpGet"]["port"] == "http"


def test_defaults_are_the_pickers() -> None:
    """A pool's picker runs with the picker's own defaults (PickerConfig)."""
    defaulted = with_defaults(schema(), _pool(_spec(PICKER)))["spec"]["index"]["picker"]
    fields = PickerConfig.model_fields
    assert defaulted["port"] == fields["port"].default
    assert defaulted["targetPort"] == fields["target_port"].default
    assert defaulted["deadlineMs"] == fields["deadline_ms"].default
    assert defaulted["maxPromptTokens"] == fields["max_prompt_tokens"].default
    assert not {"kvEventsPort", "kvEventsReplayPort", "tokenizer"} & defaulted.keys()
    config = _index_config(_index(PICKER)).picker
    assert (config.kv_events_port, config.kv_events_replay_port, config.tokenizer) == (None,) * 3


def test_without_the_picker_nothing_of_it_is_rendered() -> None:
    """A disabled picker (its settings kept) serves no port, mounts no claim."""
    index = _index({**PICKER, "enabled": False, "tokenizer": TOKENIZER})
    assert not _index_config(index).picker.enabled
    assert [port["name"] for port in index.service["spec"]["ports"]] == ["http"]
    assert [port["name"] for port in _container(index)["ports"]] == ["http"]
    volumes = index.deployment["spec"]["template"]["spec"]["volumes"]
    assert not any("persistentVolumeClaim" in volume for volume in volumes)


def test_the_tokenizer_is_a_read_only_claim_that_pod_security_restricted_admits() -> None:
    index = _index({**PICKER, "tokenizer": TOKENIZER})
    pod = index.deployment["spec"]["template"]["spec"]
    (volume,) = [volume for volume in pod["volumes"] if volume["name"] == "tokenizer"]
    assert volume["persistentVolumeClaim"] == {"claimName": "model-cache", "readOnly": True}
    (mount,) = [
        mount for mount in _container(index)["volumeMounts"] if mount["name"] == "tokenizer"
    ]
    assert mount == {
        "name": "tokenizer",
        "mountPath": TOKENIZER_DIR,
        "readOnly": True,
        "subPath": "Qwen/Qwen3-0.6B",
    }
    assert pod_security.restricted(pod) == []
    root = _index({**PICKER, "tokenizer": {"claimName": "tokenizer"}})
    (mount,) = [mount for mount in _container(root)["volumeMounts"] if mount["name"] == "tokenizer"]
    assert "subPath" not in mount


def test_the_index_reads_no_more_than_the_pods_of_its_namespace() -> None:
    """The picker needs the model servers' IP, node and readiness: the index's Role, which
    it already had for the agents, and nothing more (no Secrets, no other namespace)."""
    with_picker, without = _index(PICKER), _index({"enabled": False})
    assert with_picker.role["rules"] == without.role["rules"]
    assert with_picker.role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]
    assert with_picker.role["metadata"]["namespace"] == POOL.namespace


SOURCES = {
    "envoy": Pod({"app": "envoy"}, "gateways", GATEWAY_NAMESPACE),
    "router": Pod({"app": "router"}, POOL.namespace),
    "vllm": Pod(SELECTOR, POOL.namespace),
    "stranger": Pod({"app": "other"}, "tenant-a", {"kubernetes.io/metadata.name": "tenant-a"}),
    "stranger-in-pool-namespace": Pod({"app": "other"}, POOL.namespace),
}


@pytest.mark.parametrize(
    ("source", "ports"),
    [
        ("envoy", {7405}),  # the gateway's proxies: the picker only (no token for the index)
        ("router", {7403}),  # a /v1/route gateway: the index's HTTP port only
        ("vllm", set()),
        ("stranger", set()),
        ("stranger-in-pool-namespace", set()),
    ],
)
def test_only_the_picker_clients_reach_the_picker_port(source: str, ports: set[int]) -> None:
    children = _children(_spec(PICKER, networkPolicy=POLICY))
    assert children.index is not None
    target = Pod(children.index.deployment["spec"]["template"]["metadata"]["labels"], "inference")
    admitted = {
        port
        for port in (7403, 7405)
        if admits(children.network_policies, target, SOURCES[source], port)
    }
    assert admitted == ports


LLM_D = {"podSelector": {"matchLabels": {"app": "llm-d-router"}}}
PLACEMENTS = {**PICKER, "placementEventsPort": 7406, "placementEventsReplayPort": 7407}


def test_placement_events_are_published_on_their_ports() -> None:
    index = _index(PLACEMENTS)
    config = _index_config(index).picker
    assert config.placement_events == "tcp://*:7406"
    assert config.placement_events_replay == "tcp://*:7407"
    assert config.served_model_name is None  # the topics name the fingerprint's model
    service = {port["name"]: port["port"] for port in index.service["spec"]["ports"]}
    assert service["kv-events"] == 7406 and service["kv-replay"] == 7407
    assert {port["containerPort"] for port in _container(index)["ports"]} >= {7406, 7407}
    none = _index_config(_index(PICKER)).picker
    assert none.placement_events is None and none.placement_events_replay is None


@pytest.mark.parametrize(
    ("source", "ports"),
    [("llm-d", {7406, 7407}), ("envoy", {7405}), ("stranger-in-pool-namespace", set())],
)
def test_only_the_routers_reach_the_placement_events(source: str, ports: set[int]) -> None:
    policy = {**POLICY, "routers": [LLM_D]}
    children = _children(_spec(PLACEMENTS, networkPolicy=policy))
    assert children.index is not None
    target = Pod(children.index.deployment["spec"]["template"]["metadata"]["labels"], "inference")
    sources = {**SOURCES, "llm-d": Pod({"app": "llm-d-router"}, POOL.namespace)}
    admitted = {
        port
        for port in (7403, 7405, 7406, 7407)
        if admits(children.network_policies, target, sources[source], port)
    }
    assert admitted == ports
    # without routers, nobody: never a rule without ports (which would admit every port)
    (_, index_policy) = _children(_spec(PLACEMENTS, networkPolicy=POLICY)).network_policies
    assert all(rule["ports"] for rule in index_policy["spec"]["ingress"])


def test_a_disabled_picker_admits_nobody_to_its_port() -> None:
    children = _children(_spec({**PICKER, "enabled": False}, networkPolicy=POLICY))
    (_, index_policy) = children.network_policies
    assert all(
        7405 not in [port["port"] for port in rule["ports"]]
        for rule in index_policy["spec"]["ingress"]
    )


PICKER_RULES = [
    pytest.param(_spec({"enabled": True}), PICKER_NEEDS_SELECTOR, id="no-selector"),
    pytest.param(
        {**TOKENS, "index": {"enabled": True, "picker": PICKER}},
        PICKER_NEEDS_FINGERPRINT,
        id="no-fingerprint",
    ),
    pytest.param(_spec({**PICKER, "port": 7403}), PICKER_PORT_TAKEN, id="port-of-the-index"),
    pytest.param(
        _spec({**PICKER, "tokenizer": {"claimName": "m", "subPath": "../etc"}}),
        TOKENIZER_SUB_PATH,
        id="sub-path-up",
    ),
    pytest.param(
        _spec({**PICKER, "tokenizer": {"claimName": "m", "subPath": "a/../../b"}}),
        TOKENIZER_SUB_PATH,
        id="sub-path-up-inside",
    ),
    pytest.param(
        _spec({**PICKER, "tokenizer": {"claimName": "m", "subPath": "/models"}}),
        TOKENIZER_SUB_PATH,
        id="sub-path-absolute",
    ),
    pytest.param(
        _spec(PICKER, networkPolicy={**POLICY, "pickerClients": []}),
        NETWORK_POLICY_NEEDS_PICKER_CLIENTS,
        id="network-policy-without-picker-clients",
    ),
]
"""Pickers the CRD and the operator's model both refuse, with the same message."""


@pytest.mark.parametrize(("spec", "message"), PICKER_RULES)
def test_picker_rules_hold_in_the_crd_and_the_model(spec: dict[str, Any], message: str) -> None:
    assert any(message in error for error in admission_errors(_pool(spec))), message
    with pytest.raises(InvalidSpec, match=re.escape(message)) as refused:
        PoolSpec.parse(spec)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    ("picker", "message"),
    [
        ({**PICKER, "port": 0}, "0 is less than the minimum of 1"),
        ({**PICKER, "targetPort": 70000}, "70000 is greater than the maximum of 65535"),
        ({**PICKER, "deadlineMs": 0}, "0 is less than the minimum of 1"),
        ({**PICKER, "selector": {"app": "not a label"}}, "does not match"),
        ({**PICKER, "tokenizer": {"claimName": "Models"}}, "does not match"),
        ({**PICKER, "tokenizer": {}}, "'claimName' is a required property"),
        ({**PICKER, "servers": []}, "Additional properties are not allowed"),
    ],
)
def test_invalid_picker_values_are_refused_by_the_crd(picker: dict[str, Any], message: str) -> None:
    (error,) = admission_errors(_pool(_spec(picker)))
    assert message in error and error.startswith("spec.index.picker"), error


def test_pickers_the_crd_admits() -> None:
    for spec in (
        _spec(PICKER),
        _spec({**PICKER, "tokenizer": TOKENIZER, "kvEventsPort": 5557}),
        _spec({**PICKER, "tokenizer": {"claimName": "m", "subPath": "a/..b/c"}}),
        _spec(PICKER, networkPolicy=POLICY),
        _spec({"enabled": False}, networkPolicy={**POLICY, "pickerClients": []}),
        _spec({}),
        {**TOKENS, "index": {"enabled": True, "picker": {"enabled": False}}},
    ):
        assert admission_errors(_pool(spec)) == [], spec
        PoolSpec.parse(spec)
