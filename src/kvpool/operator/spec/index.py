"""A pool's prefix index (``spec.index``): the Deployment that tells gateways where a
prompt's longest cached prefix is."""

from __future__ import annotations

from typing import Self

from pydantic import ConfigDict, Field, model_validator

from kvpool.common.names import (
    DEFAULT_INDEX_PORT,
    DEFAULT_LOAD_FACTOR,
    DEFAULT_LOAD_SLACK,
    DEFAULT_MAX_CHUNKS_PER_NODE,
    DEFAULT_MIN_MATCH_RATIO,
    DEFAULT_PICKER_PORT,
)
from kvpool.operator.spec.base import SpecModel
from kvpool.operator.spec.disaggregation import (
    DISAGGREGATION_NEEDS_PICKER,
    VLLM_PORT_TAKEN,
    DisaggregationSpec,
)
from kvpool.operator.spec.markers import Rule, cel
from kvpool.operator.spec.selectors import LabelValue
from kvpool.operator.spec.workloads import ResourcesSpec, Tolerations

PICKER_NEEDS_SELECTOR = (
    "spec.index.picker.enabled needs spec.index.picker.selector: the labels of the model "
    "server pods"
)
PICKER_PORT_TAKEN = "spec.index.picker.port must differ from spec.index.port"
PICKER_NEEDS_FINGERPRINT = (
    "spec.index.picker.enabled needs spec.index.fingerprint: the picker keys prompts with "
    "the model's fingerprint"
)
TOKENIZER_SUB_PATH = (
    "spec.index.picker.tokenizer.subPath must be a relative path without '..' segments"
)


class RoutingSpec(SpecModel):
    load_factor: float = Field(
        DEFAULT_LOAD_FACTOR,
        ge=1,
        description="A node is overloaded above loadFactor x the candidates' average load + "
        "loadSlack.",
    )
    load_slack: float = Field(
        DEFAULT_LOAD_SLACK,
        ge=0,
        description="Absolute margin of the load bound (a few requests where loads are request "
        "counts).",
    )
    min_match_ratio: float = Field(
        DEFAULT_MIN_MATCH_RATIO,
        ge=0,
        le=1,
        description="Matched share of the prompt below which cache affinity is ignored.",
    )


class FingerprintSpec(SpecModel):
    model_config = ConfigDict(
        json_schema_extra=cel(
            Rule(
                "self.tpRank < self.tpSize",
                "index.fingerprint.tpRank must be below index.fingerprint.tpSize",
            )
        )
    )

    model: str = Field(
        description="Model name, as vLLM serves it.",
        json_schema_extra={"minLength": 1, "maxLength": 1024},
    )
    dtype: str = Field(
        description="KV cache dtype, e.g. bfloat16.",
        json_schema_extra={"minLength": 1, "maxLength": 64},
    )
    kv_layout: str = Field(
        description="KV layout the connector reports for the engine.",
        json_schema_extra={"minLength": 1, "maxLength": 256},
    )
    tp_rank: int = Field(0, ge=0, description="Tensor-parallel rank whose keys to match.")
    tp_size: int = Field(1, ge=1, description="Tensor-parallel size.")
    chunk_tokens: int | None = Field(
        None,
        ge=1,
        description="Tokens per chunk; absent means the pool's chunkTokens.",
        json_schema_extra={"maximum": 65536},
    )


class TokenizerSpec(SpecModel):
    """The served model's tokenizer: a directory on a PersistentVolumeClaim, mounted
    read-only (a ConfigMap holds at most 1 MiB; a tokenizer.json is often several)."""

    model_config = ConfigDict(
        json_schema_extra=cel(
            Rule(
                "!self.subPath.matches('^/|(^|/)[.][.](/|$)')",
                TOKENIZER_SUB_PATH,
            )
        )
    )

    claim_name: str = Field(
        description="PersistentVolumeClaim in the pool's namespace that holds the tokenizer "
        "(e.g. the model cache the vLLM pods mount; ReadOnlyMany or ReadWriteMany when the "
        "index has replicas on several nodes). Its files must be readable by the index's "
        "user 10001 or group 10001.",
        json_schema_extra={
            "minLength": 1,
            "maxLength": 253,
            "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        },
    )
    sub_path: str = Field(
        "",
        description="Directory in the claim of tokenizer.json and the chat template "
        "(tokenizer_config.json or chat_template.jinja); empty: its root.",
        json_schema_extra={"maxLength": 1024},
    )

    @model_validator(mode="after")
    def _relative(self) -> Self:
        if self.sub_path.startswith("/") or ".." in self.sub_path.split("/"):
            raise ValueError(TOKENIZER_SUB_PATH)
        return self


class PickerSpec(SpecModel):
    """The endpoint picker of Gateway API Inference Extension gateways (an InferencePool's
    endpointPickerRef): an Envoy ext_proc gRPC server in each index replica that picks the
    model server whose caches hold most of a request's prompt."""

    model_config = ConfigDict(
        json_schema_extra=cel(
            Rule("!self.enabled || self.selector.size() > 0", PICKER_NEEDS_SELECTOR),
            Rule(
                "!has(self.disaggregation) || !self.disaggregation.enabled || self.enabled",
                DISAGGREGATION_NEEDS_PICKER,
            ),
            Rule(
                "!has(self.disaggregation) || !self.disaggregation.enabled || "
                "self.disaggregation.vllmPort != self.targetPort",
                VLLM_PORT_TAKEN,
            ),
        )
    )

    enabled: bool = Field(
        False,
        description="Serve the picker on port, and the port on the index Service (named "
        "grpc-picker, appProtocol kubernetes.io/h2c).",
    )
    port: int = Field(
        DEFAULT_PICKER_PORT,
        ge=1,
        le=65535,
        description="gRPC port of the picker (ext_proc and grpc.health.v1) and of the index "
        "Service: an InferencePool's endpointPickerRef.port.number.",
    )
    selector: dict[str, LabelValue] = Field(
        {},
        description="Labels of the model server (vLLM) pods, as the InferencePool's "
        "selector.matchLabels: pods of the pool's namespace (an InferencePool, its pods and "
        "its endpointPickerRef Service share one namespace). The index reads their IP, node "
        "and readiness. Required when enabled.",
        json_schema_extra={"maxProperties": 64},
    )
    target_port: int = Field(
        8000,
        ge=1,
        le=65535,
        description="Their OpenAI port, as the InferencePool's targetPorts[0].number.",
    )
    placement_events_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="Publish what each model server can load from kvpool as vLLM KV events "
        "(ZMQ PUB on this port, topic kv@<pod ip>@<fingerprint.model>), for routers that read "
        "vLLM's events (llm-d, Dynamo); absent: not published. The Service port kv-events.",
    )
    placement_events_replay_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="Their replay and snapshot port (ZMQ ROUTER; Service port kv-replay), "
        "for a restarted router.",
    )
    require_token: bool = Field(
        True,
        description="Streams must carry a gateways: token of the pool's Secret (Envoy: the "
        "ext_proc grpc_service's initial_metadata, authorization: Bearer <token>). False only "
        "for a gateway that cannot send one, with networkPolicy.pickerClients admitting only "
        "it.",
    )
    kv_events_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="Their vLLM KV-events port (--kv-events-config endpoint tcp://*:<port>), "
        "for their GPU prefix caches; absent: the picker knows the pool's tiers only.",
    )
    kv_events_replay_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="Their vLLM KV-events replay port (--kv-events-config replay_endpoint "
        "tcp://*:<port>): events lost on the way are asked for again; absent: a loss drops "
        "a server's GPU tier until it is refilled.",
    )
    tokenizer: TokenizerSpec | None = Field(
        None,
        description="The served model's tokenizer, for prompts sent as text; absent: only "
        "token-id prompts are scored by cache, text is routed by load.",
    )
    deadline_ms: int = Field(
        50,
        ge=1,
        description="A pick not made within this many milliseconds is made by load alone.",
        json_schema_extra={"maximum": 10000},
    )
    max_prompt_tokens: int = Field(
        1 << 20,
        ge=1,
        description="Longest prompt the picker scores; a longer one is answered 413.",
        json_schema_extra={"maximum": 1 << 24},
    )
    disaggregation: DisaggregationSpec = Field(
        DisaggregationSpec(),
        description="Prefill/decode disaggregation: the picker hands a long prompt's "
        "prefill to a pod labelled kvpool.io/role: prefill (or both), and the decode pod's "
        "sidecar (injected by the admission webhook) runs it there and decodes with the "
        "prompt's KV from kvpool.",
    )

    @model_validator(mode="after")
    def _selects(self) -> Self:
        if self.enabled and not self.selector:
            raise ValueError(PICKER_NEEDS_SELECTOR)
        pd = self.disaggregation
        if pd.enabled and not self.enabled:
            raise ValueError(DISAGGREGATION_NEEDS_PICKER)
        if pd.enabled and pd.vllm_port == self.target_port:
            raise ValueError(VLLM_PORT_TAKEN)
        return self


class IndexSpec(SpecModel):
    model_config = ConfigDict(
        json_schema_extra=cel(
            Rule(
                "!has(self.picker) || !self.picker.enabled || self.picker.port != self.port",
                PICKER_PORT_TAKEN,
            ),
            Rule(
                "!has(self.picker) || !self.picker.enabled || has(self.fingerprint)",
                PICKER_NEEDS_FINGERPRINT,
            ),
        )
    )

    enabled: bool = Field(
        False,
        description="Run the index. Turning it off deletes its Deployment, Service, ConfigMap "
        "and RBAC.",
    )
    replicas: int = Field(
        1,
        ge=1,
        json_schema_extra={"maximum": 16},
        description="Index replicas behind the Service. Each is an independent index that "
        "follows every agent (no shared state): more replicas serve more gateways and survive "
        "a lost pod; each holds the whole index.",
    )
    image: str | None = Field(
        None,
        description="Index image; absent means the agents' image (one image runs both).",
        json_schema_extra={"maxLength": 1024},
    )
    port: int = Field(
        DEFAULT_INDEX_PORT,
        ge=1,
        le=65535,
        description="HTTP port of the index (routing API, /healthz, /readyz, /metrics) and of "
        "its Service.",
    )
    max_chunks_per_node: int = Field(
        DEFAULT_MAX_CHUNKS_PER_NODE,
        ge=1,
        description="Chunks the index tracks per node at most; the oldest go first. An index "
        "needs about 150 bytes per tracked chunk: size resources.limits.memory from "
        "maxChunksPerNode x nodes.",
    )
    routing: RoutingSpec = Field(
        RoutingSpec(),
        description="How the index picks a node: the longest cached prefix, unless that node "
        "is overloaded or the match is too short, then the least loaded node.",
    )
    fingerprint: FingerprintSpec | None = Field(
        None,
        description="The model configuration of queries that send token ids without a "
        "fingerprint of their own (the connector's keys depend on it). Absent: every such "
        "query must carry one.",
    )
    resources: ResourcesSpec = Field(
        ResourcesSpec(),
        description="Overrides of the index's resources. By default it requests 100m CPU and "
        "512Mi of memory and may use up to 2Gi (about ten full nodes at the default "
        "maxChunksPerNode).",
    )
    node_selector: dict[str, str] = Field(
        {},
        description="Nodes that may run the index (it needs no GPU and no /dev/shm).",
    )
    tolerations: Tolerations = Field(
        (), description="Tolerations of the index pods (core/v1 Toleration)."
    )
    picker: PickerSpec = Field(
        PickerSpec(),
        description="The endpoint picker for Gateway API Inference Extension gateways "
        "(an InferencePool's endpointPickerRef: the index Service kvpool-<pool>-index, "
        "port picker.port). It needs fingerprint (the model's keys). Tier costs, body limits "
        "and the load interval keep the index's defaults.",
    )

    @property
    def disaggregates(self) -> bool:
        """Whether the pool runs prefill/decode disaggregation: its index, and the picker's
        ``disaggregation`` (which needs the picker)."""
        return self.enabled and self.picker.disaggregation.enabled

    @model_validator(mode="after")
    def _picker_fits(self) -> Self:
        if self.picker.enabled and self.picker.port == self.port:
            raise ValueError(PICKER_PORT_TAKEN)
        if self.picker.enabled and self.fingerprint is None:
            raise ValueError(PICKER_NEEDS_FINGERPRINT)
        return self
