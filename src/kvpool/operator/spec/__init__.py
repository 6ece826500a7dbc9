"""kvpool's resources, KVCachePool and KVCacheTenant: the operator's typed view of their
specs, and the source of their CustomResourceDefinitions.

The models are the source of truth: ``python -m kvpool.operator.crds`` generates
``crds/*.yaml`` (and the chart's copies) from them, so the operator reads a pool the same
way whether or not an API server filled in the defaults. How a field says what:

- ``Field(default, ge=..., description=...)``: the CRD's default, bounds and description;
  the model checks those bounds too;
- ``Field(default_factory=...)``: a default of the model only (the CRD leaves the field
  absent, the API server stores nothing);
- ``json_schema_extra={"maxLength": 253}`` and other OpenAPI keywords there: bounds that
  only the API server checks (they bound CEL costs and names; the operator renders
  whatever the API server admitted);
- CEL rules, list markers, printer columns: :mod:`kvpool.operator.spec.markers`.

The CEL rules refuse invalid resources at admission; the models' own validators repeat
those the operator needs to stay total.

- :mod:`~kvpool.operator.spec.base`: names, the model base, byte quantities;
- :mod:`~kvpool.operator.spec.pool`: :class:`PoolSpec` and :class:`KVCachePool`, with
  :mod:`~kvpool.operator.spec.l2`, :mod:`~kvpool.operator.spec.index` (its picker's
  :mod:`~kvpool.operator.spec.disaggregation`), :mod:`~kvpool.operator.spec.network`,
  :mod:`~kvpool.operator.spec.workloads`,
  :mod:`~kvpool.operator.spec.peers`, :mod:`~kvpool.operator.spec.spaces` and
  :mod:`~kvpool.operator.spec.selectors` for its parts;
- :mod:`~kvpool.operator.spec.tenant`: :class:`TenantSpec` and :class:`KVCacheTenant`;
- :mod:`~kvpool.operator.spec.status`: both statuses, as the CRDs declare them.
"""

from kvpool.operator.spec.base import (
    API_VERSION,
    GROUP,
    KIND,
    PLURAL,
    TENANT_KIND,
    TENANT_PLURAL,
    VERSION,
    Bytes,
    InvalidSpec,
    SecretRef,
    describe,
    parse_bytes,
)
from kvpool.operator.spec.disaggregation import (
    DISAGGREGATION_NEEDS_PICKER,
    VLLM_PORT_TAKEN,
    DisaggregationSpec,
)
from kvpool.operator.spec.index import (
    PICKER_NEEDS_FINGERPRINT,
    PICKER_NEEDS_SELECTOR,
    PICKER_PORT_TAKEN,
    TOKENIZER_SUB_PATH,
    FingerprintSpec,
    IndexSpec,
    PickerSpec,
    RoutingSpec,
    TokenizerSpec,
)
from kvpool.operator.spec.l2 import (
    NVME_ENCRYPTION_NEEDS_KEY,
    S3_NEEDS_KEY,
    SSE_KMS_KEY_NEEDS_KMS,
    L2EncryptionSpec,
    L2Spec,
    L2Tier,
    NvmeTier,
    S3Tier,
)
from kvpool.operator.spec.network import (
    NETWORK_POLICY_NEEDS_CLIENTS,
    NETWORK_POLICY_NEEDS_GATEWAYS,
    NETWORK_POLICY_NEEDS_PICKER_CLIENTS,
    PEER_SELECTS_NOTHING,
    NetworkPeer,
    NetworkPolicySpec,
)
from kvpool.operator.spec.peers import (
    NIXL_PORTS_BACKWARDS,
    PEER_PORT_TAKEN,
    ROTATION_TOO_SHORT,
    UCX_NAMES,
    PeersSpec,
)
from kvpool.operator.spec.pool import (
    INDEX_NEEDS_TOKENS,
    EvictionSpec,
    KVCachePool,
    L1Spec,
    MetricsSpec,
    PoolSpec,
    PortsSpec,
    SecretKeyRef,
    ServiceMonitorSpec,
    TenantsSpec,
    TierQuota,
)
from kvpool.operator.spec.selectors import (
    SELECTOR_VALUES,
    LabelSelector,
    LabelSelectorRequirement,
)
from kvpool.operator.spec.spaces import PinnedPrefix, SharedSpaceSpec
from kvpool.operator.spec.tenant import (
    KVCacheTenant,
    PoolRef,
    SaltSecretRef,
    TenantQuota,
    TenantSpec,
)
from kvpool.operator.spec.workloads import AgentSpec, ResourcesSpec, UpdateStrategySpec

__all__ = [
    "API_VERSION",
    "DISAGGREGATION_NEEDS_PICKER",
    "GROUP",
    "INDEX_NEEDS_TOKENS",
    "KIND",
    "NETWORK_POLICY_NEEDS_CLIENTS",
    "NETWORK_POLICY_NEEDS_GATEWAYS",
    "NETWORK_POLICY_NEEDS_PICKER_CLIENTS",
    "NIXL_PORTS_BACKWARDS",
    "NVME_ENCRYPTION_NEEDS_KEY",
    "PEER_PORT_TAKEN",
    "PEER_SELECTS_NOTHING",
    "PICKER_NEEDS_FINGERPRINT",
    "PICKER_NEEDS_SELECTOR",
    "PICKER_PORT_TAKEN",
    "PLURAL",
    "ROTATION_TOO_SHORT",
    "S3_NEEDS_KEY",
    "SELECTOR_VALUES",
    "SSE_KMS_KEY_NEEDS_KMS",
    "TENANT_KIND",
    "TENANT_PLURAL",
    "TOKENIZER_SUB_PATH",
    "UCX_NAMES",
    "VERSION",
    "VLLM_PORT_TAKEN",
    "AgentSpec",
    "Bytes",
    "DisaggregationSpec",
    "EvictionSpec",
    "FingerprintSpec",
    "IndexSpec",
    "InvalidSpec",
    "KVCachePool",
    "KVCacheTenant",
    "L1Spec",
    "L2EncryptionSpec",
    "L2Spec",
    "L2Tier",
    "LabelSelector",
    "LabelSelectorRequirement",
    "MetricsSpec",
    "NetworkPeer",
    "NetworkPolicySpec",
    "NvmeTier",
    "PeersSpec",
    "PickerSpec",
    "PinnedPrefix",
    "PoolRef",
    "PoolSpec",
    "PortsSpec",
    "ResourcesSpec",
    "RoutingSpec",
    "S3Tier",
    "SaltSecretRef",
    "SecretKeyRef",
    "SecretRef",
    "ServiceMonitorSpec",
    "SharedSpaceSpec",
    "TenantQuota",
    "TenantSpec",
    "TenantsSpec",
    "TierQuota",
    "TokenizerSpec",
    "UpdateStrategySpec",
    "describe",
    "parse_bytes",
]
