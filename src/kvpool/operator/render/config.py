"""The configuration files of a pool's processes: ``agent.yaml`` (the agent's own
:class:`~kvpool.common.config.AgentConfig`) and ``index.yaml`` (the index's
:class:`~kvpool.common.index_config.IndexConfig`), each validated by its model and dumped
from it, and the paths in the pods that they name."""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any, TypeVar

import yaml
from pydantic import ValidationError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

from kvpool.common.config import AgentConfig
from kvpool.common.index_config import IndexConfig
from kvpool.common.names import AGENT_COMPONENT, INDEX_COMPONENT
from kvpool.operator.render.objects import Pool
from kvpool.operator.spec import InvalidSpec, NvmeTier, PoolSpec, S3Tier, describe

TOKENS_DIR = "/etc/kvpool/tokens"
TOKENS_FILE = "tokens.yaml"
TOKENS_PATH = f"{TOKENS_DIR}/{TOKENS_FILE}"
STATE_DIR = "/var/lib/kvpool"
AGENT_ACCESS_DIR = "/etc/kvpool/agent-access"
"""Where the index mounts the Secret of the token it follows the agents with."""
AGENT_ACCESS_KEY = "token"
"""That Secret's key (the operator mints it; see kvpool.operator.tenants)."""
L2_KEYS_DIR = "/etc/kvpool/l2-keys"
"""Where the pool's L2 key Secret is mounted (spec.l2.encryption.keySecretRef)."""
PEER_KEYS_DIR = "/etc/kvpool/peer-keys"
"""Where the pool's peer Secret (``kvpool-<pool>-peer``) is mounted (spec.peers)."""
TOKENIZER_DIR = "/etc/kvpool/tokenizer"
"""Where the index mounts the picker's tokenizer (spec.index.picker.tokenizer), read-only."""
PD_KEY_DIR = "/etc/kvpool/pd-key"
"""Where the index and the decode pods' sidecars mount the pool's disaggregation key Secret
(``kvpool-<pool>-pd-key``), read-only."""
PD_KEY = "key"
"""That Secret's key: the key itself, 64 hex characters."""
PD_KEY_PATH = f"{PD_KEY_DIR}/{PD_KEY}"
PD_KEY_GENERATION_ANNOTATION = "kvpool.io/pd-key-generation"
"""On the key Secret: the ``keyGeneration`` its key was made for; on the index's pod
template: the one its pods must sign with (a change rolls them onto the new key)."""
NODE_KEYS_DIR = ".kvpool-keys"
"""Without a key Secret, each agent keeps its own key under the NVMe tier's hostPath, in
this directory (a name no pool can have), so that it outlives the pod as the files do."""


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


def configured(model: type[_Settings], component: str, **arguments: Any) -> _Settings:
    """``model`` from ``arguments``; :class:`InvalidSpec` naming the fields it refuses."""
    try:
        return model(**arguments)
    except ValidationError as error:
        raise InvalidSpec(
            f"the {component} configuration is invalid: {describe(error, component)}"
        ) from error


def settings_file(config: BaseSettings) -> str:
    """The settings file a process reads: the fields the operator set, nothing defaulted."""
    return yaml.safe_dump(config.model_dump(mode="json", exclude_unset=True))


def agent_config(pool: Pool, spec: PoolSpec) -> AgentConfig:
    """The configuration every agent of the pool runs with."""
    tokens = spec.tenants.tokens_secret_ref
    nvme, s3 = spec.l2.tier("nvme"), spec.l2.tier("s3")
    return configured(
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
        peers=_peers_config(pool, spec) if spec.peers.enabled else None,
        store_policy=spec.l2.store_policy,
        store_min_hits=spec.l2.store_min_hits,
    )


def index_config(pool: Pool, spec: PoolSpec) -> IndexConfig:
    """The configuration every index replica of the pool runs with."""
    index, fingerprint = spec.index, spec.index.fingerprint
    return configured(
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
        agent_token_file=f"{AGENT_ACCESS_DIR}/{AGENT_ACCESS_KEY}",
        peer_key_dir=PEER_KEYS_DIR if spec.peers.enabled else None,
        state_dir=STATE_DIR,
        **({"picker": _picker_config(spec)} if index.picker.enabled else {}),
    )


def _picker_config(spec: PoolSpec) -> dict[str, Any]:
    """The endpoint picker of every index replica: the model server pods of the pool's
    namespace that the selector names (the index's own, as an InferencePool's are), its
    tokenizer where the Deployment mounts it."""
    picker = spec.index.picker
    optional = {
        "kv_events_port": picker.kv_events_port,
        "kv_events_replay_port": picker.kv_events_replay_port,
        "tokenizer": TOKENIZER_DIR if picker.tokenizer else None,
        "placement_events": _bound(picker.placement_events_port),
        "placement_events_replay": _bound(picker.placement_events_replay_port),
    }
    return {
        "enabled": True,
        "port": picker.port,
        "discovery": "kubernetes",
        "selector": picker.selector,
        "target_port": picker.target_port,
        "require_token": picker.require_token,
        "deadline_ms": picker.deadline_ms,
        "max_prompt_tokens": picker.max_prompt_tokens,
        **{name: value for name, value in optional.items() if value is not None},
        **({"pd": _pd_config(spec)} if spec.index.disaggregates else {}),
    }


def _pd_config(spec: PoolSpec) -> dict[str, Any]:
    """The picker's prefill/decode disaggregation, signing with the key Secret mounted at
    PD_KEY_PATH."""
    pd = spec.index.picker.disaggregation
    return {
        "enabled": True,
        "threshold_tokens": pd.threshold_tokens,
        "max_prefill_waiting": pd.max_prefill_waiting,
        "key_file": PD_KEY_PATH,
        "header_ttl_seconds": pd.header_ttl_seconds,
        "llmd_header": pd.llmd_header,
    }


def _bound(port: int | None) -> str | None:
    """A ZMQ endpoint the index binds on every address of its pod."""
    return None if port is None else f"tcp://*:{port}"


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


def _peers_config(pool: Pool, spec: PoolSpec) -> dict[str, Any]:
    """The pool's other agents, found as the index finds them (their pods' container port
    named ``peer``), proving the credential mounted at PEER_KEYS_DIR; with an index, which
    of them hold a prefix is asked of it (its Service)."""
    peers = spec.peers
    capped = {} if peers.max_bandwidth is None else {"bandwidth": peers.max_bandwidth}
    index = (
        {"index_url": f"http://{pool.index_name}.{pool.namespace}.svc:{spec.index.port}"}
        if spec.index.enabled
        else {}
    )
    return {
        "port": peers.port,
        "key_dir": PEER_KEYS_DIR,
        "discovery": "kubernetes",
        "namespace": pool.namespace,
        "max_transfers": peers.max_transfers,
        "wire_protection": peers.wire_protection,
        "transport": peers.transport,
        **capped,
        **index,
    }


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
