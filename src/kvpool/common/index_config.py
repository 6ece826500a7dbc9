"""The ``kvpool-index`` configuration: one typed model, validated once.

Sources, highest precedence first: keyword arguments (``kvpool-index --agent``),
``KVPOOL_INDEX_*`` environment variables (nested fields with ``__``, lists as
JSON), then the YAML or JSON file named by ``--config`` or
``KVPOOL_INDEX_CONFIG_FILE``, then the defaults.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_settings import SettingsConfigDict

from kvpool.common.config import POOL_NAME_PATTERN, FileSettings, HttpLimits
from kvpool.common.keys import ModelFingerprint
from kvpool.common.kube.discovery import AgentEndpoint
from kvpool.common.names import (
    DEFAULT_INDEX_PORT,
    DEFAULT_LOAD_FACTOR,
    DEFAULT_LOAD_SLACK,
    DEFAULT_MAX_CHUNKS_PER_NODE,
    DEFAULT_MIN_MATCH_RATIO,
    DEFAULT_PD_HEADER_TTL_SECONDS,
    DEFAULT_PD_MAX_PREFILL_WAITING,
    DEFAULT_PD_THRESHOLD_TOKENS,
    DEFAULT_PICKER_PORT,
    DEFAULT_STATE_DIR,
    INDEX_CONFIG_FILE_ENV,
    INDEX_ENV_PREFIX,
    generated_token_path,
)
from kvpool.common.problems import SettingError
from kvpool.common.routing import RoutingPolicy
from kvpool.common.sizes import Size

DEFAULT_MAX_BODY_BYTES = 16 << 20
"""A route or lookup body: token ids of a prompt of ~2M tokens as JSON."""

ServerRole = Literal["both", "prefill", "decode"]
"""What a model server may be given under prefill/decode disaggregation: whole requests
and prefills (``both``), only prefills (``prefill``), or whole requests and decodes
(``decode``)."""


class Fingerprint(BaseModel):
    """The model configuration the keys were made for (see ``kvpool.common.keys``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field(description="Model name, as vLLM serves it.")
    dtype: str = Field(description="KV cache dtype, e.g. bfloat16.")
    kv_layout: str = Field(description="KV layout the connector reports for the engine.")
    tp_rank: int = Field(0, ge=0, description="Tensor-parallel rank whose keys to match.")
    tp_size: int = Field(1, ge=1, description="Tensor-parallel size.")
    chunk_tokens: int = Field(256, ge=1, description="Tokens per chunk.")

    def fingerprint(self) -> ModelFingerprint:
        return ModelFingerprint(
            self.model, self.dtype, self.kv_layout, self.tp_rank, self.tp_size, self.chunk_tokens
        )


class StaticAgent(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    node: str = Field(description="Node name: how routing answers name this agent.")
    zmq: str = Field(description="The agent's ZMQ endpoint, e.g. tcp://10.0.0.5:7400.")
    events: str = Field(description="Its chunk-event endpoint, e.g. tcp://10.0.0.5:7402.")

    def endpoint(self) -> AgentEndpoint:
        return AgentEndpoint(self.node, self.zmq, self.events)


class ModelServer(BaseModel):
    """One vLLM server the picker may send requests to (static discovery)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    address: str = Field(
        pattern=r"^[^\s:,]+:[0-9]{1,5}$",
        description="ip:port of its OpenAI server, as the gateway reaches it.",
    )
    node: str = Field(description="The node it runs on: the node name of that node's agent.")
    kv_events: str | None = Field(
        None,
        description="Its vLLM KV-events endpoint (tcp://ip:port); none: no GPU tier.",
    )
    kv_events_replay: str | None = Field(
        None,
        description=(
            "Its vLLM KV-events replay endpoint (tcp://ip:port, vLLM's replay_endpoint): "
            "lost events are asked for again; none: a loss drops its GPU tier until refilled."
        ),
    )
    role: ServerRole = Field(
        "both",
        description=(
            "both: whole requests and prefills; prefill: only the prefills of disaggregated "
            "requests (while a decode-capable server is ready); decode: whole requests and "
            "the decodes of disaggregated ones, never a prefill for another (picker.pd)."
        ),
    )


class TierCosts(BaseModel):
    """Seconds per thousand prompt tokens to have them from each place, for the picker's
    estimate of a request's time to first token on each endpoint."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    gpu: float = Field(0.0, ge=0, description="Already in the endpoint's GPU prefix cache.")
    l1: float = Field(0.002, ge=0, description="Loaded from its node's L1 (shared memory).")
    nvme: float = Field(0.01, ge=0, description="Loaded from its node's NVMe.")
    peer: float = Field(0.02, ge=0, description="Fetched from another node's agent.")
    s3: float = Field(0.05, ge=0, description="Fetched from the pool's S3 bucket.")
    compute: float = Field(0.2, gt=0, description="Computed (prefill): no tier holds it.")


class PrefillDecode(BaseModel):
    """Prefill/decode disaggregation: the picker decides per request whether another pod
    prefills the prompt for the decode pod it routes to (the decode pod's kvpool sidecar
    follows its signed choice)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = Field(
        False,
        description=(
            "Disaggregate requests whose uncached part is long (see threshold_tokens); off: "
            "every request is served whole by one decode-capable server."
        ),
    )
    threshold_tokens: int = Field(
        DEFAULT_PD_THRESHOLD_TOKENS,
        ge=1,
        description=(
            "Disaggregate when the prompt tokens that the best decode-capable server cannot "
            "load from any tier are at least this many (tokens, not characters): a shorter "
            "prefill costs the decode pod less than the handover does."
        ),
    )
    max_prefill_waiting: int = Field(
        DEFAULT_PD_MAX_PREFILL_WAITING,
        ge=0,
        description=(
            "A prefill-capable server with more requests waiting than this is not given "
            "prefills: a prefill that queues serves the request later than the decode pod "
            "computing it would."
        ),
    )
    key_file: Path | None = Field(
        None,
        description=(
            "The pool's disaggregation key (at least 32 bytes, e.g. openssl rand -hex 32), "
            "which the decode pods' sidecars mount too: the picker signs its choice of a "
            "prefill pod with it. Required when enabled."
        ),
    )
    header_ttl_seconds: int = Field(
        DEFAULT_PD_HEADER_TTL_SECONDS,
        ge=1,
        description="How long a sidecar follows the signed prefill header after the pick.",
    )
    llmd_header: bool = Field(
        False,
        description=(
            "Also name the prefill pod in llm-d's unsigned x-prefiller-host-port header, for "
            "decode pods that run llm-d's routing sidecar instead of kvpool's."
        ),
    )

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.enabled and self.key_file is None:
            raise SettingError(
                "disaggregation signs its prefill header: set key_file to the pool's "
                "disaggregation key",
                key_file=self.key_file,
            )
        return self


class PickerConfig(BaseModel):
    """The endpoint picker: a Gateway API Inference Extension EPP (Envoy ext_proc over gRPC)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = Field(False, description="Serve the endpoint picker on `port`.")
    port: int = Field(
        DEFAULT_PICKER_PORT, ge=0, le=65535, description="gRPC port (0 picks a free one)."
    )
    discovery: Literal["static", "kubernetes"] = Field(
        "static",
        description=(
            "static: the servers in `servers`; kubernetes: the pods `selector` names, in the "
            "index's namespace (an InferencePool's selector and target port)."
        ),
    )
    servers: list[ModelServer] = Field(
        default_factory=list, description="The model servers to pick from (static discovery)."
    )
    selector: dict[str, str] = Field(
        default_factory=dict, description="Labels of the model server pods (kubernetes)."
    )
    target_port: int = Field(8000, ge=1, le=65535, description="Their OpenAI port (kubernetes).")
    kv_events_port: int | None = Field(
        None, ge=1, le=65535, description="Their vLLM KV-events port (kubernetes); none: none."
    )
    kv_events_replay_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="Their vLLM KV-events replay port (kubernetes); none: no replay.",
    )
    tokenizer: Path | None = Field(
        None,
        description=(
            "Directory of the served model's tokenizer.json and chat template "
            "(tokenizer_config.json or chat_template.jinja), for prompts sent as text; "
            "without one, only token-id prompts are scored (text is routed by load)."
        ),
    )
    require_token: bool = Field(
        True,
        description=(
            "Streams must carry a gateway or admin token of the pool (Envoy: the ext_proc "
            "grpc_service's initial_metadata authorization: Bearer ...). Turn off only for a "
            "gateway that cannot send one, with a NetworkPolicy that admits only it."
        ),
    )
    deadline_ms: float = Field(
        50.0,
        gt=0,
        description="A decision not made within this is made by load alone (fail open).",
    )
    max_body_bytes: Size = Field(
        4 << 20, description="Largest request body the picker reads; a larger one gets 413."
    )
    max_prompt_tokens: int = Field(
        1 << 20, ge=1, description="Longest prompt the picker scores; a longer one gets 413."
    )
    load_interval_seconds: float = Field(
        0.5, gt=0, description="How often each server's /metrics is read for its load."
    )
    load_timeout_seconds: float = Field(
        1.0,
        gt=0,
        description=(
            "Longest read of one server's /metrics. A read that takes longer keeps the "
            "server's last load, twice in a row; the third makes it not ready."
        ),
    )
    tier_costs: TierCosts = Field(default_factory=TierCosts, description="The picker's estimate.")
    placement_events: str | None = Field(
        None,
        description=(
            "Publish what each model server can load from kvpool as vLLM KV events (ZMQ "
            "PUB, e.g. tcp://*:7406), for routers that read vLLM's; none: not published."
        ),
    )
    placement_events_connect: bool = Field(
        False,
        description="Connect to placement_events (a router's bound SUB) instead of binding it.",
    )
    placement_events_replay: str | None = Field(
        None,
        description="ROUTER endpoint for replays from a seq and snapshots (e.g. tcp://*:7407).",
    )
    served_model_name: str | None = Field(
        None,
        description="The model name of the placement events' topics (kv@<pod ip>@<model>); "
        "default: the fingerprint's model.",
    )
    pd: PrefillDecode = Field(
        default_factory=PrefillDecode,
        description="Prefill/decode disaggregation: a prefill pod chosen per request.",
    )


class IndexConfig(FileSettings):
    """Configuration of one prefix index process (one pool)."""

    model_config = SettingsConfigDict(
        env_prefix=INDEX_ENV_PREFIX, env_nested_delimiter="__", frozen=True, extra="forbid"
    )
    config_file_env: ClassVar[str] = INDEX_CONFIG_FILE_ENV

    pool: str = Field(
        "default",
        pattern=POOL_NAME_PATTERN,
        description="Pool whose agents to follow (the kvpool.io/pool label of their pods).",
    )
    discovery: Literal["static", "kubernetes"] = Field(
        "static",
        description="static: the agents listed in `agents`; kubernetes: the pool's agent pods.",
    )
    agents: list[StaticAgent] = Field(
        default_factory=list, description="The agents to follow (static discovery)."
    )
    namespace: str | None = Field(
        None, description="Namespace of the agent pods (kubernetes); default: the index's own."
    )
    host: str = Field("127.0.0.1", description="Address of the HTTP API (0.0.0.0 in a pod).")
    http_port: int = Field(
        DEFAULT_INDEX_PORT,
        ge=0,
        le=65535,
        description="Port of the HTTP API and /metrics (0 picks a free one).",
    )
    http_limits: HttpLimits = Field(
        default_factory=lambda: HttpLimits(max_body_bytes=DEFAULT_MAX_BODY_BYTES),
        description="What one HTTP client may cost: body size, read timeouts, connections.",
    )
    max_chunks_per_node: int = Field(
        DEFAULT_MAX_CHUNKS_PER_NODE,
        ge=1,
        description="Chunks tracked per node at most; the oldest go first.",
    )
    load_factor: float = Field(
        DEFAULT_LOAD_FACTOR,
        ge=1,
        description="Routing: a node is overloaded above load_factor x average load + load_slack.",
    )
    load_slack: float = Field(
        DEFAULT_LOAD_SLACK, ge=0, description="Routing: absolute margin of the load bound."
    )
    min_match_ratio: float = Field(
        DEFAULT_MIN_MATCH_RATIO,
        ge=0,
        le=1,
        description="Routing: matched share of the prompt below which affinity is ignored.",
    )
    fingerprint: Fingerprint | None = Field(
        None, description="Model of queries that send token ids without a fingerprint."
    )
    tokens_file: Path | None = Field(
        None,
        description=(
            "The pool's tokens file (kvpool.common.auth): its admins and gateways "
            "tokens may ask; without one, an admin token is generated into state_dir once "
            "the index listens (a failed start writes none)."
        ),
    )
    agent_token_file: Path | None = Field(
        None,
        description=(
            "File of the token the index follows the agents with (an index token of the "
            "pool: snapshots and chunk events); default: the index token that an agent of "
            "the embedded default generates, <state_dir>/index-token-<pool>."
        ),
    )
    peer_key_dir: Path | None = Field(
        None,
        description=(
            "The pool's peer credential (the agents' peers.key_dir): the index then also "
            "accepts, for its lookups, the token each agent derives from it to ask which "
            "peers hold a prefix (set by the operator)."
        ),
    )
    state_dir: Path = Field(
        DEFAULT_STATE_DIR,
        description="Directory of the generated token (index-admin-token-<pool>).",
    )
    warmup_seconds: float = Field(
        30.0,
        ge=0,
        description=(
            "Readiness waits until every discovered agent is synchronised, at most this long "
            "(so that a new replica does not answer routes from an empty index)."
        ),
    )
    snapshot_timeout_seconds: float = Field(
        10.0, gt=0, description="How long a resync waits for an agent's snapshot."
    )
    receive_hwm: int = Field(
        100_000,
        ge=1,
        description="Events queued per agent before ZMQ drops them (a drop causes a resync).",
    )
    picker: PickerConfig = Field(
        default_factory=PickerConfig,
        description="The endpoint picker for Gateway API Inference Extension gateways.",
    )

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.discovery == "static" and not self.agents:
            raise SettingError(
                "static discovery needs agents: --agent NODE=ZMQ,EVENTS, agents in the "
                "configuration file, or discovery kubernetes",
                agents=self.agents,
            )
        if self.picker.enabled and self.fingerprint is None:
            raise SettingError(
                "the endpoint picker keys prompts with the model's fingerprint: set "
                "fingerprint too",
                fingerprint=self.fingerprint,
            )
        nodes = [agent.node for agent in self.agents]
        again = {n: node for n, node in enumerate(nodes) if node in nodes[:n]}
        if again:
            raise SettingError(
                f"each node may be listed once: {', '.join(sorted(set(again.values())))} "
                "more than once",
                at={("agents", n, "node"): node for n, node in again.items()},
            )
        return self

    def routing_policy(self) -> RoutingPolicy:
        return RoutingPolicy(self.load_factor, self.min_match_ratio, self.load_slack)

    @property
    def resolved_agent_token_file(self) -> Path:
        return self.agent_token_file or generated_token_path(self.state_dir, "index", self.pool)

    @property
    def generated_token_file(self) -> Path:
        return self.state_dir / f"index-admin-token-{self.pool}"
