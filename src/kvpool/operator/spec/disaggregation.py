"""Prefill/decode disaggregation (``spec.index.picker.disaggregation``): when the picker
hands a request's prefill to another pod, and the decode pods' sidecar that follows it.

One switch for both halves, because either alone does nothing: the picker's signed
``x-kvpool-prefill`` header needs a sidecar that verifies it, and the sidecar needs a
picker that signs. The operator makes the key both share (a Secret of the pool's
namespace, :mod:`kvpool.operator.disagg_key`), and the admission webhook injects the
sidecar into the pool namespace's pods labelled ``kvpool.io/role: decode`` or ``both``."""

from __future__ import annotations

from pydantic import Field

from kvpool.common.names import (
    DEFAULT_PD_DECODE_WAIT_MS,
    DEFAULT_PD_HEADER_TTL_SECONDS,
    DEFAULT_PD_MAX_PREFILL_WAITING,
    DEFAULT_PD_PREFILL_TIMEOUT_SECONDS,
    DEFAULT_PD_THRESHOLD_TOKENS,
    DEFAULT_PD_VLLM_PORT,
    MAX_PD_DECODE_WAIT_MS,
)
from kvpool.operator.spec.base import Int64, SpecModel
from kvpool.operator.spec.workloads import ResourcesSpec

DISAGGREGATION_NEEDS_PICKER = (
    "spec.index.picker.disaggregation.enabled needs spec.index.picker.enabled: the picker "
    "chooses the prefill pods"
)
VLLM_PORT_TAKEN = (
    "spec.index.picker.disaggregation.vllmPort must differ from spec.index.picker.targetPort: "
    "the decode pods' sidecar listens there"
)


class DisaggregationSpec(SpecModel):
    """The picker's ``picker.pd`` and the decode sidecar's flags."""

    enabled: bool = Field(
        False,
        description="Disaggregate requests whose uncached prompt is long: the picker names a "
        "prefill pod in a header signed with the pool's disaggregation key (the Secret "
        "kvpool-<pool>-pd-key, made by the operator), and the admission webhook gives the "
        "pool namespace's pods labelled kvpool.io/role: decode or both the sidecar that "
        "follows it. Needs picker.enabled.",
    )
    threshold_tokens: int = Field(
        DEFAULT_PD_THRESHOLD_TOKENS,
        ge=1,
        description="Disaggregate when the prompt tokens that the best decode-capable server "
        "cannot load from any tier are at least this many.",
        json_schema_extra={"maximum": 1 << 24},
    )
    max_prefill_waiting: int = Field(
        DEFAULT_PD_MAX_PREFILL_WAITING,
        ge=0,
        description="A prefill-capable server with more requests waiting than this is not "
        "given prefills (a queued prefill serves the request later than the decode pod "
        "computing it would).",
        json_schema_extra={"maximum": 10000},
    )
    header_ttl_seconds: int = Field(
        DEFAULT_PD_HEADER_TTL_SECONDS,
        ge=1,
        description="How long a sidecar follows the signed prefill header after the pick.",
        json_schema_extra={"maximum": 3600},
    )
    llmd_header: bool = Field(
        False,
        description="Also name the prefill pod in llm-d's unsigned x-prefiller-host-port "
        "header, for decode pods that run llm-d's routing sidecar instead of kvpool's (the "
        "injected sidecar never follows that header).",
    )
    vllm_port: int = Field(
        DEFAULT_PD_VLLM_PORT,
        ge=1,
        le=65535,
        description="Port of a decode pod's vLLM OpenAI server (vllm serve --port), which "
        "the sidecar forwards to on 127.0.0.1; the sidecar listens on picker.targetPort, the "
        "InferencePool's. Prefill pods keep their vLLM on targetPort (they get no sidecar).",
    )
    decode_wait_ms: int = Field(
        DEFAULT_PD_DECODE_WAIT_MS,
        ge=0,
        description="How long a decode may wait for the prefill's chunks (the sidecar's "
        "--decode-wait-ms; the connector caps it).",
        json_schema_extra={"maximum": MAX_PD_DECODE_WAIT_MS},
    )
    prefill_timeout_seconds: int = Field(
        DEFAULT_PD_PREFILL_TIMEOUT_SECONDS,
        ge=1,
        description="A prefill not answered within this many seconds is computed by the "
        "decode pod instead (the sidecar's --prefill-timeout-s).",
        json_schema_extra={"maximum": 600},
    )
    key_generation: Int64 = Field(
        0,
        ge=0,
        description="Change it to replace the disaggregation key: the operator writes a new "
        "one into the Secret and the index rolls; restart the decode pods too (their "
        "sidecars read the key at start; until then they serve requests whole).",
    )
    resources: ResourcesSpec = Field(
        ResourcesSpec(),
        description="Overrides of the sidecar's resources. By default it requests 100m CPU "
        "and 128Mi of memory and may use up to 1Gi (request bodies are held whole, up to "
        "8 MiB each).",
    )
