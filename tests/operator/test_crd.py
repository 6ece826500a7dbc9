"""kvpool's CRDs: generated from the operator's models (the committed YAML is what the
generator writes); valid, documented, structural schemas; examples pass them; invalid pools
and tenants are refused with a message naming the problem, by the CRD and, where the
operator needs it, by its model too."""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Literal

import kubernetes_validate
import pytest
import yaml
from pydantic import BaseModel

from kvpool.common.config import AgentConfig, NvmeTierConfig, PeersConfig, S3TierConfig
from kvpool.common.index_config import Fingerprint, IndexConfig, PrefillDecode
from kvpool.common.names import POLICY_NAMES
from kvpool.operator import crds
from kvpool.operator.spec import (
    API_VERSION,
    DISAGGREGATION_NEEDS_PICKER,
    INDEX_NEEDS_TOKENS,
    KIND,
    NETWORK_POLICY_NEEDS_CLIENTS,
    NETWORK_POLICY_NEEDS_GATEWAYS,
    NIXL_PORTS_BACKWARDS,
    NVME_ENCRYPTION_NEEDS_KEY,
    PEER_PORT_TAKEN,
    PEER_SELECTS_NOTHING,
    PLURAL,
    ROTATION_TOO_SHORT,
    S3_NEEDS_KEY,
    SELECTOR_VALUES,
    SSE_KMS_KEY_NEEDS_KMS,
    TENANT_KIND,
    TENANT_PLURAL,
    UCX_NAMES,
    VLLM_PORT_TAKEN,
    InvalidSpec,
    LabelSelector,
    PoolSpec,
    TenantSpec,
    parse_bytes,
)
from kvpool.operator.status import IndexReplicas, Rollout, pool_status
from kvpool.sidecar import main as sidecar_main
from tests.support.crd_schema import (
    CRD_PATH,
    EXAMPLES,
    OLDEST_KUBERNETES,
    TENANT_CRD_PATH,
    admission_errors,
    crd,
    schema,
    schema_errors,
    with_defaults,
)


def _nodes(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for name, child in node.get("properties", {}).items():
        yield from _nodes(child, f"{path}.{name}".lstrip("."))
    if "items" in node:
        yield from _nodes(node["items"], f"{path}[]")


def _pool(spec: dict[str, Any], name: str = "main") -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name}, "spec": spec}


ROOT = CRD_PATH.parents[1]


def test_the_committed_crds_are_generated_from_the_models() -> None:
    """kubectl's and the chart's copies: python -m kvpool.operator.crds writes them."""
    generated = crds.files(ROOT)
    assert sorted(generated) == sorted(
        [
            *(ROOT / t / path.name for t in crds.TARGETS for path in (CRD_PATH, TENANT_CRD_PATH)),
            ROOT / crds.VALUES_SCHEMA,
        ]
    )
    stale = [str(path) for path, text in generated.items() if path.read_text() != text]
    assert stale == [], "run python -m kvpool.operator.crds"


def test_check_names_each_stale_file_and_writing_fixes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for target in crds.TARGETS:
        (tmp_path / target).mkdir(parents=True)
    shutil.copy(ROOT / crds.VALUES_SCHEMA, tmp_path / crds.VALUES_SCHEMA)  # up to date
    assert crds.main(["--check", "--root", str(tmp_path)]) == 1
    assert len(capsys.readouterr().out.splitlines()) == 4  # two CRDs, two places, all missing
    assert crds.main(["--root", str(tmp_path)]) == 0
    assert crds.main(["--check", "--root", str(tmp_path)]) == 0
    edited = tmp_path / "charts/kvpool/crds" / TENANT_CRD_PATH.name
    edited.write_text(edited.read_text().replace("shortNames: [kvt]", "shortNames: [kt]"))
    assert crds.main(["--check", "--root", str(tmp_path)]) == 1
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith(f"{edited}: differs from the models")


def test_the_generator_refuses_what_a_structural_schema_cannot_say() -> None:
    class Constant(BaseModel):
        mode: Literal["fixed"]  # JSON schema's const: no OpenAPI 3.0 equivalent

    class Either(BaseModel):
        value: int | bool

    for model in (Constant, Either):
        with pytest.raises(ValueError, match="no structural schema"):
            crds.openapi_schema(model)


@pytest.mark.parametrize("version", [OLDEST_KUBERNETES, kubernetes_validate.latest_version()])
def test_the_crd_is_a_valid_customresourcedefinition(version: str) -> None:
    kubernetes_validate.validate(crd(), version, strict=True)


def test_names() -> None:
    spec = crd()["spec"]
    assert (spec["group"], spec["scope"]) == ("kvpool.io", "Namespaced")
    assert spec["names"]["kind"] == KIND
    assert spec["names"]["plural"] == PLURAL
    assert spec["names"]["shortNames"] == ["kvp"]
    (version,) = spec["versions"]
    assert f"{spec['group']}/{version['name']}" == API_VERSION
    assert version["subresources"] == {"status": {}}
    columns = {column["name"]: column["jsonPath"] for column in version["additionalPrinterColumns"]}
    assert columns == {
        "L1": ".spec.l1.size",
        "Ready": '.status.conditions[?(@.type=="Ready")].status',
        "Nodes-Ready": ".status.readyNodes",
        "Nodes-Desired": ".status.desiredNodes",
        "Index-Ready": ".status.index.readyReplicas",
        "Age": ".metadata.creationTimestamp",
    }


def test_every_field_is_documented_and_typed() -> None:
    undocumented = [
        path
        for path, node in _nodes(schema())
        if path != "metadata" and not path.endswith("[]") and not node.get("description")
    ]
    untyped = [
        path
        for path, node in _nodes(schema())
        if "type" not in node and not node.get("x-kubernetes-int-or-string")
    ]
    assert (undocumented, untyped) == ([], [])


def test_spec_objects_default_so_that_their_fields_default() -> None:
    spec = schema()["properties"]["spec"]
    missing = [
        path
        for path, node in _nodes(spec, "spec")
        if node.get("type") == "object"
        and any("default" in child for child in node.get("properties", {}).values())
        and "default" not in node
        and path != "spec"
        and not node.get("required")
    ]
    assert missing == [], "these objects have defaulted fields but no default of their own"


def test_the_status_the_operator_writes_fits_the_crd() -> None:
    status = pool_status(
        generation=3,
        observed_generation=3,
        problem=None,
        rollout=Rollout(desired=2, updated=2, ready=1, observed=True),
        previous={},
        now=datetime(2026, 1, 1, tzinfo=UTC),
        index=IndexReplicas(replicas=2, ready=1, picker_port=7405),
    )
    assert status["index"]["pickerPort"] == 7405
    assert schema_errors(with_defaults(schema(), {**_pool(VALID), "status": status})) == []


def test_eviction_policies_are_the_agents() -> None:
    eviction = schema()["properties"]["spec"]["properties"]["eviction"]
    assert tuple(eviction["properties"]["policy"]["enum"]) == POLICY_NAMES


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda path: path.name)
def test_examples_are_admitted(path: Any) -> None:
    assert admission_errors(yaml.safe_load(path.read_text())) == []


def test_the_models_defaults_are_the_crds() -> None:
    defaulted = with_defaults(schema(), _pool({}))
    assert PoolSpec.parse(defaulted["spec"]) == PoolSpec.parse({})


VALID = {"chunkTokens": 256, "blockSize": 16}
TOKENS = {"tenants": {"tokensSecretRef": {"name": "kvpool-main-tokens"}}}
FINGERPRINT = {"model": "m", "dtype": "bfloat16", "kvLayout": "nhd"}
ANY_POD = {"podSelector": {}}


def _clients(*peers: dict[str, Any]) -> dict[str, Any]:
    """A pool whose network policy admits ``peers`` as clients."""
    return {"networkPolicy": {"enabled": True, "clients": list(peers)}}


def _expression(operator: str, *values: str) -> dict[str, Any]:
    """A client peer whose podSelector has one expression on the label ``app``."""
    expression: dict[str, Any] = {"key": "app", "operator": operator}
    expression |= {"values": list(values)} if values else {}
    return {"podSelector": {"matchExpressions": [expression]}}


NETWORK_POLICY_RULES = [
    pytest.param(
        {"networkPolicy": {"enabled": True}}, NETWORK_POLICY_NEEDS_CLIENTS, id="no-clients"
    ),
    pytest.param(
        {**TOKENS, "index": {"enabled": True}, **_clients(ANY_POD)},
        NETWORK_POLICY_NEEDS_GATEWAYS,
        id="index-without-gateways",
    ),
    pytest.param(_clients({}), PEER_SELECTS_NOTHING, id="peer-selects-nothing"),
    pytest.param(_clients(_expression("In")), SELECTOR_VALUES, id="in-without-values"),
    pytest.param(_clients(_expression("Exists", "a")), SELECTOR_VALUES, id="exists-with-values"),
]
"""Network policies the CRD and the operator's model both refuse, with the same message."""
L2_KEY = {"encryption": {"keySecretRef": {"name": "kvpool-main-l2-key"}}}
NVME = {"hostPath": "/mnt/nvme", "capacity": "1Ti"}


def _l2(nvme: dict[str, Any] | None = None, s3: dict[str, Any] | None = None, **l2: Any) -> Any:
    """A pool whose L2 has an nvme tier with ``nvme`` (if given), an s3 tier of the bucket kv-cache
    with ``s3`` (if given), and the other fields ``l2``."""
    tiers = [{"type": "nvme", "nvme": NVME | nvme}] if nvme is not None else []
    tiers += [{"type": "s3", "s3": {"bucket": "kv-cache"} | s3}] if s3 is not None else []
    return {"l2": {"tiers": tiers, **l2}}


L2_KEY_RULES = [
    pytest.param(_l2(s3={}), S3_NEEDS_KEY, id="s3-without-key"),
    pytest.param(_l2(s3={"encryption": False}), S3_NEEDS_KEY, id="plaintext-s3-without-key"),
    pytest.param(
        _l2(nvme={"encryption": True}), NVME_ENCRYPTION_NEEDS_KEY, id="sealed-nvme-without-key"
    ),
]
"""L2 encryption settings the CRD and the operator's model both refuse, with the same
message."""
PEER_RULES = [
    pytest.param({"peers": {"port": 7401}}, PEER_PORT_TAKEN, id="peer-port-is-http"),
    pytest.param(
        {"ports": {"events": 7500}, "peers": {"port": 7500}}, PEER_PORT_TAKEN, id="peer-port-taken"
    ),
    pytest.param({"peers": {"port": 0}}, "less than", id="peer-port-zero"),
    pytest.param({"peers": {"credentialRotation": "1d"}}, "does not match", id="rotation-in-days"),
    pytest.param({"peers": {"credentialRotation": "0h"}}, "does not match", id="rotation-zero"),
    pytest.param({"peers": {"enable": False}}, "'enable' was unexpected", id="peer-typo"),
    pytest.param({"peers": {"transport": "rdma"}}, "'rdma' is not one of", id="transport"),
    pytest.param(
        {"peers": {"nixl": {"tcpPorts": {"first": 9000, "last": 8999}}}},
        NIXL_PORTS_BACKWARDS,
        id="nixl-ports-backwards",
    ),
    pytest.param(
        {"peers": {"nixl": {"ucx": {"LD_PRELOAD": "/x.so"}}}}, UCX_NAMES, id="ucx-not-ucx"
    ),
]
"""Peer settings the CRD and the operator's model both refuse."""


def _picker(picker: dict[str, Any], **disaggregation: Any) -> dict[str, Any]:
    index = {"enabled": True, "fingerprint": FINGERPRINT}
    picker = {**picker, "disaggregation": {"enabled": True, **disaggregation}}
    return {**TOKENS, "index": {**index, "picker": picker}}


PICKER = {"enabled": True, "selector": {"app": "vllm"}}
DISAGGREGATION_RULES = [
    pytest.param(_picker({"enabled": False}), DISAGGREGATION_NEEDS_PICKER, id="pd-without-picker"),
    pytest.param(_picker({}), DISAGGREGATION_NEEDS_PICKER, id="pd-picker-defaulted-off"),
    pytest.param(_picker(PICKER, vllmPort=8000), VLLM_PORT_TAKEN, id="vllm-port-is-target"),
    pytest.param(
        _picker({**PICKER, "targetPort": 8200}), VLLM_PORT_TAKEN, id="target-is-vllm-port"
    ),
]
"""Disaggregation settings the CRD and the operator's model both refuse, with one line."""
INVALID_POOLS = [
    *NETWORK_POLICY_RULES,
    *L2_KEY_RULES,
    pytest.param(
        _l2(s3={"sseKmsKeyId": "alias/kv"}, **L2_KEY), SSE_KMS_KEY_NEEDS_KMS, id="kms-key-alone"
    ),
    pytest.param(
        _l2(s3={"serverSideEncryption": "AES256", "sseKmsKeyId": "alias/kv"}, **L2_KEY),
        SSE_KMS_KEY_NEEDS_KMS,
        id="kms-key-with-aes256",
    ),
    pytest.param(
        _l2(s3={"serverSideEncryption": "aws:kms2"}, **L2_KEY),
        "'aws:kms2' is not one of",
        id="server-side-encryption",
    ),
    pytest.param(
        _l2(s3={}, encryption={"keySecretRef": {}}), "'name' is a required", id="l2-key-name"
    ),
    pytest.param(
        _clients(_expression("Equals", "a")), "'Equals' is not one of", id="selector-operator"
    ),
    pytest.param(
        _clients({"podSelector": {"matchLabels": {"app": "not a label value"}}}),
        "does not match",
        id="label-value",
    ),
    pytest.param(
        _clients({"ipBlock": {"cidr": "10.0.0.0/8"}}),
        "Additional properties are not allowed ('ipBlock'",
        id="ip-block",
    ),
    pytest.param(
        {"networkPolicy": {"enabled": True, "clients": ANY_POD}},
        "is not of type 'array'",
        id="clients-not-a-list",
    ),
    pytest.param(
        {"eviction": {"highWatermark": 0.8, "lowWatermark": 0.9}},
        "eviction.lowWatermark (0.9) must be below eviction.highWatermark (0.8)",
        id="watermarks",
    ),
    pytest.param(
        {"chunkTokens": 100, "blockSize": 16},
        "chunkTokens (100) must be a multiple of blockSize (16)",
        id="chunk-not-a-multiple-of-block",
    ),
    pytest.param(
        {"l1": {"size": "512Ki", "pageSize": "64Ki"}},
        "l1.size must hold at least 16 pages of l1.pageSize",
        id="l1-smaller-than-16-pages",
    ),
    pytest.param({"l1": {"pageSize": "48Ki"}}, "'48Ki' is not one of", id="page-size"),
    pytest.param({"l1": {"size": "1.5Gi"}}, "does not match", id="fractional-size"),
    pytest.param({"eviction": {"policy": "fifo"}}, "'fifo' is not one of", id="policy"),
    pytest.param({"eviction": {"highWatermark": 1.5}}, "1.5 is greater than", id="watermark>1"),
    pytest.param(
        {
            "l2": {
                "tiers": [
                    {"type": "nvme", "nvme": {"hostPath": "/a", "capacity": "1Ti"}},
                    {"type": "nvme", "nvme": {"hostPath": "/b", "capacity": "1Ti"}},
                ]
            }
        },
        "l2.tiers may hold at most one tier of each type (nvme, s3)",
        id="two-nvme-tiers",
    ),
    pytest.param(
        {"l2": {"tiers": [{"type": "s3", "nvme": {"hostPath": "/a", "capacity": "1Ti"}}]}},
        "an L2 tier of type s3 sets the field s3 and no other",
        id="tier-type-mismatch",
    ),
    pytest.param({"ports": {"zmq": 7400, "http": 7400}}, "must differ", id="same-ports"),
    pytest.param({"ports": {"events": 7401}}, "must differ", id="events-port-taken"),
    *PEER_RULES,
    pytest.param(
        {"peers": {"credentialRotation": "5m"}}, ROTATION_TOO_SHORT, id="rotation-too-short"
    ),
    pytest.param({"peers": {"maxBandwidth": "0"}}, "does not match", id="peer-bandwidth-zero"),
    pytest.param(
        {"peers": {"maxTransfers": 0}}, "0 is less than the minimum of 1", id="peer-transfers"
    ),
    pytest.param(
        {"peers": {"wireProtection": "none"}}, "'none' is not one of", id="wire-protection"
    ),
    pytest.param({"l3": {}}, "Additional properties are not allowed ('l3'", id="unknown-field"),
    pytest.param(
        {"tenants": {"tokensSecretRef": {"key": "t"}}}, "'name' is a required", id="secret-name"
    ),
    pytest.param({"index": {"enabled": True}}, INDEX_NEEDS_TOKENS, id="index-without-tokens"),
    pytest.param(
        {**TOKENS, "index": {"enabled": True, "replicas": 0}},
        "0 is less than the minimum of 1",
        id="index-replicas",
    ),
    pytest.param(
        {**TOKENS, "index": {"routing": {"minMatchRatio": 1.5}}},
        "1.5 is greater than the maximum of 1",
        id="index-match-ratio",
    ),
    pytest.param(
        {**TOKENS, "index": {"routing": {"loadFactor": 0.5}}},
        "0.5 is less than the minimum of 1",
        id="index-load-factor",
    ),
    pytest.param(
        {**TOKENS, "index": {"fingerprint": {"model": "m", "dtype": "bfloat16"}}},
        "'kvLayout' is a required property",
        id="index-fingerprint-incomplete",
    ),
    pytest.param(
        {**TOKENS, "index": {"fingerprint": {**FINGERPRINT, "tpRank": 2, "tpSize": 2}}},
        "index.fingerprint.tpRank must be below index.fingerprint.tpSize",
        id="index-tp-rank",
    ),
]


@pytest.mark.parametrize(("change", "message"), INVALID_POOLS)
def test_invalid_pools_are_refused_with_a_message(change: dict[str, Any], message: str) -> None:
    assert admission_errors(_pool(VALID)) == []
    errors = admission_errors(_pool({**VALID, **change}))
    assert any(message in error for error in errors), errors


@pytest.mark.parametrize("name", ["gpu.pool", "x" * 41, "Main"])
def test_pool_names_must_be_short_dns_labels(name: str) -> None:
    assert admission_errors(_pool({}, name="main")) == []
    (error,) = admission_errors(_pool({}, name=name))
    assert "the pool name must be a DNS label" in error


def test_defaults_are_the_agents() -> None:
    """An empty pool runs agents with the agent's own defaults (README, AgentConfig)."""
    spec = with_defaults(schema(), _pool({}))["spec"]
    agent = AgentConfig.model_fields
    assert parse_bytes(spec["l1"]["size"]) == agent["l1_size"].default
    assert parse_bytes(spec["l1"]["pageSize"]) == agent["page_size"].default
    assert spec["l1"]["leaseSeconds"] == agent["lease_seconds"].default
    assert spec["eviction"] == {
        "policy": agent["eviction_policy"].default,
        "highWatermark": agent["high_watermark"].default,
        "lowWatermark": agent["low_watermark"].default,
    }
    assert spec["ports"] == {
        "zmq": agent["zmq_port"].default,
        "http": agent["http_port"].default,
        "events": agent["events_port"].default,
    }
    assert spec["metrics"]["topTenants"] == agent["metrics_top_tenants"].default
    assert spec["l2"] == {
        "storePolicy": agent["store_policy"].default,
        "storeMinHits": agent["store_min_hits"].default,
        "tiers": [],
    }
    nvme, s3 = (
        tier[tier["type"]]
        for tier in with_defaults(schema(), _pool(_l2(nvme={}, s3={}, **L2_KEY)))["spec"]["l2"][
            "tiers"
        ]
    )
    assert s3["prefix"] == S3TierConfig.model_fields["prefix"].default
    assert s3["encryption"] == S3TierConfig.model_fields["encryption"].default is True
    assert nvme["encryption"] == NvmeTierConfig.model_fields["encryption"].default is False
    assert "serverSideEncryption" not in s3
    peers = PeersConfig.model_fields
    assert spec["peers"] == {
        "enabled": True,
        "port": peers["port"].default,
        "maxTransfers": peers["max_transfers"].default,
        "wireProtection": peers["wire_protection"].default,
        "transport": peers["transport"].default,
        "nixl": {"tcpPorts": {"first": 7410, "last": 7441}, "lockMemory": False},
        "credentialRotation": "24h",
    }


def test_an_index_needs_the_pools_tokens_in_the_crd_and_the_model() -> None:
    """Gateways authenticate with the tokens Secret: no index nobody could call."""
    enabled = {"index": {"enabled": True}}
    assert admission_errors(_pool({**enabled, **TOKENS})) == []
    assert admission_errors(_pool({"index": {"enabled": False}})) == []
    (error,) = admission_errors(_pool(enabled))
    assert error == f"spec: {INDEX_NEEDS_TOKENS}"
    with pytest.raises(InvalidSpec, match=re.escape(INDEX_NEEDS_TOKENS)):
        PoolSpec.parse(enabled)
    assert PoolSpec.parse({**enabled, **TOKENS}).index.enabled


@pytest.mark.parametrize(("spec", "message"), NETWORK_POLICY_RULES)
def test_network_policy_rules_hold_in_the_crd_and_the_model(
    spec: dict[str, Any], message: str
) -> None:
    """The emulated API server has no CEL rules: the operator refuses what the CRD refuses."""
    assert any(message in error for error in admission_errors(_pool(spec))), message
    with pytest.raises(InvalidSpec, match=re.escape(message)):
        PoolSpec.parse(spec)


@pytest.mark.parametrize(("spec", "message"), L2_KEY_RULES)
def test_l2_key_rules_hold_in_the_crd_and_the_model(spec: dict[str, Any], message: str) -> None:
    """The emulated API server has no CEL rules: the operator refuses what the CRD refuses."""
    assert any(message in error for error in admission_errors(_pool(spec))), message
    with pytest.raises(InvalidSpec, match=re.escape(message)):
        PoolSpec.parse(spec)


@pytest.mark.parametrize(("spec", "message"), PEER_RULES)
def test_peer_rules_hold_in_the_crd_and_the_model(spec: dict[str, Any], message: str) -> None:
    """Refused by both, the model's error on one line naming the field."""
    assert any(message in error for error in admission_errors(_pool(spec))), message
    with pytest.raises(InvalidSpec) as refused:
        PoolSpec.parse(spec)
    error = str(refused.value)
    assert "\n" not in error
    assert error.startswith(("spec.peers.", f"spec: Value error, {PEER_PORT_TAKEN}")), error


@pytest.mark.parametrize(("spec", "message"), DISAGGREGATION_RULES)
def test_disaggregation_rules_hold_in_the_crd_and_the_model(
    spec: dict[str, Any], message: str
) -> None:
    """Refused by both, the model's error on one line naming the field."""
    assert any(message in error for error in admission_errors(_pool(spec))), message
    with pytest.raises(InvalidSpec) as refused:
        PoolSpec.parse(spec)
    error = str(refused.value)
    assert "\n" not in error and message in error, error


@pytest.mark.parametrize(
    "disaggregation",
    [
        {"enabled": False, "vllmPort": 8000},  # off: its fields are not checked
        {"enabled": True, "keyGeneration": 3, "resources": {"limits": {"memory": "2Gi"}}},
    ],
)
def test_disaggregation_settings_the_rules_admit(disaggregation: dict[str, Any]) -> None:
    spec = _picker(PICKER)
    spec["index"]["picker"]["disaggregation"] = disaggregation
    assert admission_errors(_pool(spec)) == []
    PoolSpec.parse(spec)


def test_disaggregation_defaults_are_the_pickers() -> None:
    """A pool's picker disaggregates with the index's own defaults (picker.pd)."""
    spec = with_defaults(schema(), _pool(_picker(PICKER)))["spec"]
    pd, config = spec["index"]["picker"]["disaggregation"], PrefillDecode.model_fields
    assert (pd["thresholdTokens"], pd["maxPrefillWaiting"], pd["headerTtlSeconds"]) == (
        config["threshold_tokens"].default,
        config["max_prefill_waiting"].default,
        config["header_ttl_seconds"].default,
    )
    assert (pd["llmdHeader"], pd["keyGeneration"], pd["resources"]) == (False, 0, {})
    flags = sidecar_main.parser().parse_args([])  # and the sidecar's
    assert (pd["decodeWaitMs"], pd["prefillTimeoutSeconds"]) == (
        flags.decode_wait_ms,
        flags.prefill_timeout_s,
    )
    assert flags.vllm == f"http://127.0.0.1:{pd['vllmPort']}"


def test_peer_settings_the_crd_admits() -> None:
    """A port taken by the agents is free again with peers off; durations in s, m or h; the
    CRD's floor of credentialRotation is the API server's alone (the operator rotates as
    often as it is told: its tests rotate in seconds)."""
    for spec in (
        {"peers": {"enabled": False, "port": 7401}},
        {"peers": {"credentialRotation": "600s", "maxBandwidth": "1Gi", "maxTransfers": 16}},
        {"peers": {"credentialRotation": "10m"}},
        {"peers": {"credentialRotation": "168h"}},
        {"peers": {"wireProtection": "integrity"}},
        {"peers": {"transport": "nixl", "nixl": {"ucx": {"UCX_TLS": "rc,cuda_copy"}}}},
    ):
        assert admission_errors(_pool(spec)) == [], spec
        PoolSpec.parse(with_defaults(schema(), _pool(spec))["spec"])
    assert PoolSpec.parse({"peers": {"credentialRotation": "90m"}}).peers.credential_rotation == (
        timedelta(minutes=90)
    )
    assert PoolSpec.parse({"peers": {"credentialRotation": "2s"}}).peers.credential_rotation == (
        timedelta(seconds=2)
    )


@pytest.mark.parametrize(
    "spec",
    [
        pytest.param(_l2(s3={}, **L2_KEY), id="s3-with-key"),
        pytest.param(_l2(nvme={}), id="plaintext-nvme-without-key"),
        pytest.param(_l2(nvme={"encryption": True}, **L2_KEY), id="sealed-nvme-with-key"),
        pytest.param(_l2(**L2_KEY), id="key-without-tiers"),
        pytest.param(_l2(s3={"serverSideEncryption": "AES256"}, **L2_KEY), id="sse-s3"),
        pytest.param(_l2(s3={"serverSideEncryption": "aws:kms"}, **L2_KEY), id="sse-kms"),
        pytest.param(
            _l2(s3={"serverSideEncryption": "aws:kms:dsse", "sseKmsKeyId": "arn:k"}, **L2_KEY),
            id="sse-kms-dsse-with-key-id",
        ),
    ],
)
def test_l2_encryption_settings_the_rules_admit(spec: dict[str, Any]) -> None:
    assert admission_errors(_pool(spec)) == []
    PoolSpec.parse(with_defaults(schema(), _pool(spec))["spec"])


def test_network_policy_peers_as_a_networkpolicy_takes_them() -> None:
    namespaces = {"namespaceSelector": {}}  # every pod of every namespace
    both = {"namespaceSelector": {"matchLabels": {"team": "a"}}, **_expression("In", "vllm")}
    policy = _clients(ANY_POD, namespaces, both, _expression("DoesNotExist"))
    policy["networkPolicy"] |= {"gateways": [ANY_POD], "prometheus": [namespaces]}
    spec = {**TOKENS, "index": {"enabled": True}, **policy}
    assert admission_errors(_pool(spec)) == []
    assert PoolSpec.parse(spec).network_policy.enabled
    assert admission_errors(_pool({"networkPolicy": {"clients": [ANY_POD]}})) == []
    defaulted = with_defaults(schema(), _pool({}))["spec"]["networkPolicy"]
    assert defaulted == {
        "enabled": False,
        "clients": [],
        "gateways": [],
        "pickerClients": [],
        "routers": [],
        "prometheus": [],
    }


def test_index_defaults_are_the_indexs() -> None:
    """A pool's index runs with the index's own defaults (IndexConfig, Fingerprint)."""
    spec = with_defaults(schema(), _pool({"index": {"fingerprint": FINGERPRINT}}))["spec"]
    index, config = spec["index"], IndexConfig.model_fields
    assert (index["enabled"], index["replicas"], "image" in index) == (False, 1, False)
    assert index["port"] == config["http_port"].default
    assert index["maxChunksPerNode"] == config["max_chunks_per_node"].default
    assert index["routing"] == {
        "loadFactor": config["load_factor"].default,
        "loadSlack": config["load_slack"].default,
        "minMatchRatio": config["min_match_ratio"].default,
    }
    fingerprint = Fingerprint.model_fields
    assert (index["fingerprint"]["tpRank"], index["fingerprint"]["tpSize"]) == (
        fingerprint["tp_rank"].default,
        fingerprint["tp_size"].default,
    )
    assert "chunkTokens" not in index["fingerprint"]  # the operator uses the pool's
    assert (index["resources"], index["nodeSelector"], index["tolerations"]) == ({}, {}, [])


def _tenant(spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": TENANT_KIND,
        "metadata": {"name": "team-a"},
        "spec": spec,
    }


TENANT = {"poolRef": {"name": "main", "namespace": "inference"}, "quota": {"l1": "8Gi"}}


@pytest.mark.parametrize("version", [OLDEST_KUBERNETES, kubernetes_validate.latest_version()])
def test_the_tenant_crd_is_a_valid_customresourcedefinition(version: str) -> None:
    kubernetes_validate.validate(crd(TENANT_CRD_PATH), version, strict=True)


def test_tenant_names_and_columns() -> None:
    spec = crd(TENANT_CRD_PATH)["spec"]
    assert (spec["group"], spec["scope"]) == ("kvpool.io", "Namespaced")
    assert (spec["names"]["kind"], spec["names"]["plural"]) == (TENANT_KIND, TENANT_PLURAL)
    assert spec["names"]["shortNames"] == ["kvt"]
    (version,) = spec["versions"]
    assert version["subresources"] == {"status": {}}
    columns = {column["name"]: column["jsonPath"] for column in version["additionalPrinterColumns"]}
    assert columns == {
        "Pool": ".spec.poolRef.name",
        "Tenant-ID": ".status.tenantId",
        "L1-Quota": ".spec.quota.l1",
        "L1-Used": ".status.usage.l1Bytes",
        "Ready": '.status.conditions[?(@.type=="Ready")].status',
        "Age": ".metadata.creationTimestamp",
    }


def test_every_tenant_field_is_documented_and_typed() -> None:
    tenant = schema(TENANT_CRD_PATH)
    undocumented = [
        path
        for path, node in _nodes(tenant)
        if path != "metadata" and not path.endswith("[]") and not node.get("description")
    ]
    untyped = [path for path, node in _nodes(tenant) if "type" not in node]
    assert (undocumented, untyped) == ([], [])


def test_a_tenant_is_admitted_and_its_defaults_are_the_models() -> None:
    assert admission_errors(_tenant(TENANT), TENANT_CRD_PATH) == []
    salted = {**TENANT, "saltSecretRef": {"name": "team-a-salt"}}
    defaulted = with_defaults(schema(TENANT_CRD_PATH), _tenant(salted))["spec"]
    assert TenantSpec.parse(defaulted) == TenantSpec.parse(salted)
    assert (defaulted["tokenGeneration"], defaulted["saltSecretRef"]["key"]) == (0, "salt")
    assert TenantSpec.parse(TENANT).quota.nvme_bytes == 8 << 30  # absent nvme: as l1


@pytest.mark.parametrize(
    ("change", "message"),
    [
        pytest.param({"quota": {"l1": "0"}}, "quota.l1 must be more than 0 bytes", id="l1-zero"),
        pytest.param({"quota": {"l1": "1.5Gi"}}, "does not match", id="l1-fraction"),
        pytest.param({"quota": {"nvme": "1Ti"}}, "'l1' is a required", id="l1-missing"),
        pytest.param(
            {"poolRef": {"name": "Main", "namespace": "inference"}},
            "poolRef.name must be a pool name",
            id="pool-name",
        ),
        pytest.param(
            {"poolRef": {"name": "main", "namespace": "in_ference"}},
            "poolRef.namespace must be a namespace name",
            id="pool-namespace",
        ),
        pytest.param({"poolRef": {"name": "main"}}, "'namespace' is a required", id="no-ns"),
        pytest.param(
            {"saltSecretRef": {"name": "Salt!"}}, "saltSecretRef.name must be", id="salt-name"
        ),
        pytest.param(
            {"saltSecretRef": {"name": "s", "key": "a/b"}}, "saltSecretRef.key must", id="key"
        ),
        pytest.param({"tokenGeneration": -1}, "-1 is less than the minimum of 0", id="gen"),
    ],
)
def test_invalid_tenants_are_refused_with_a_message(change: dict[str, Any], message: str) -> None:
    errors = admission_errors(_tenant({**TENANT, **change}), TENANT_CRD_PATH)
    assert any(message in error for error in errors), errors


def test_the_pools_tenant_fields() -> None:
    """allowedNamespaces is a label selector, maxQuota bytes per tier; both optional."""
    selector = {"matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "Exists"}]}
    tenants = {"allowedNamespaces": selector, "maxQuota": {"l1": "16Gi"}}
    assert admission_errors(_pool({"tenants": tenants})) == []
    spec = PoolSpec.parse({"tenants": tenants}).tenants
    assert spec.max_quota.l1 == 16 << 30 and spec.max_quota.nvme is None
    assert spec.allowed_namespaces is not None
    assert spec.allowed_namespaces.matches({"kubernetes.io/metadata.name": "any"})
    wrong = {"allowedNamespaces": {"matchExpressions": [{"key": "a", "operator": "In"}]}}
    assert any(SELECTOR_VALUES in e for e in admission_errors(_pool({"tenants": wrong})))
    assert PoolSpec.parse({}).tenants.allowed_namespaces is None


@pytest.mark.parametrize(
    ("selector", "labels", "selected"),
    [
        ({"matchLabels": {"team": "a"}}, {"team": "a", "x": "y"}, True),
        ({"matchLabels": {"team": "a"}}, {"team": "b"}, False),
        ({"matchExpressions": [{"key": "team", "operator": "In", "values": ["a"]}]}, {}, False),
        ({"matchExpressions": [{"key": "team", "operator": "NotIn", "values": ["a"]}]}, {}, True),
        ({"matchExpressions": [{"key": "team", "operator": "DoesNotExist"}]}, {"team": ""}, False),
    ],
)
def test_label_selectors_match_as_kubernetes_matches(
    selector: dict[str, Any], labels: dict[str, str], selected: bool
) -> None:
    assert LabelSelector.model_validate(selector).matches(labels) is selected
