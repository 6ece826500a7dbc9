"""The connector's settings: ``kv_connector_extra_config`` and env overrides, validated once.

Two ways to name the agent (exactly one)::

    {"endpoint": "tcp://127.0.0.1:7400", "segment_path": "/dev/shm/kvpool-default"}
    {"pool": "main", "namespace": "inference"}

``segment_path`` is optional with an endpoint (the agent's hello names its segment;
set it when the pod mounts the segment at another path). With a pool the connector
reads the pool Service's annotations through the Kubernetes API (see
:mod:`kvpool_agent.connector.discovery`). ``KVPOOL_ENDPOINT``,
``KVPOOL_SEGMENT_PATH`` and ``KVPOOL_CHUNK_TOKENS`` override both, for local use.
The token the connector says hello with comes from ``KVPOOL_TOKEN``, a file, or the
embedded default's engine token (:mod:`kvpool_agent.connector.identity`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvpool_agent.names import (
    CONNECTOR_CHUNK_TOKENS_ENV,
    CONNECTOR_ENDPOINT_ENV,
    CONNECTOR_SEGMENT_PATH_ENV,
)


class ConnectorSettings(BaseModel):
    """Everything the connector reads from ``kv_connector_extra_config``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    endpoint: str | None = Field(None, description="ZMQ address of the agent, tcp://host:port.")
    segment_path: Path | None = Field(
        None, description="Where this pod sees the agent's segment; default: what hello says."
    )
    pool: str | None = Field(None, description="KVCachePool name: discover the agent by Service.")
    namespace: str | None = Field(
        None, description="Namespace of the pool's Service; default: this pod's namespace."
    )
    token_file: Path | None = Field(
        None,
        description=(
            "File of the token for the agent (a mounted Secret's 'token'); KVPOOL_TOKEN and "
            "KVPOOL_TOKEN_FILE take precedence."
        ),
    )
    chunk_tokens: int | None = Field(
        None,
        gt=0,
        description=(
            "Tokens per chunk (one agent key); a multiple of vLLM's block size. Default: the "
            "pool Service's annotation, else 256."
        ),
    )
    model_name: str | None = Field(
        None,
        description=(
            "Model name in the key fingerprint; default: vLLM's model. Set it when engines load "
            "the same weights from different paths."
        ),
    )
    lookup_timeout_s: float = Field(
        0.25, gt=0, description="Timeout of the scheduler's lookups (they delay scheduling)."
    )
    transfer_timeout_s: float = Field(
        2.0, gt=0, description="Timeout of the worker's requests around its copies."
    )
    prefetch_wait_s: float = Field(
        2.0,
        ge=0,
        description=(
            "How long a request may wait while the agent loads its missing chunks from L2 "
            "(0: never ask for a prefetch)."
        ),
    )
    step_budget_ms: float = Field(
        10.0,
        gt=0,
        description=(
            "Most time the scheduler spends asking the agent in one engine step (a burst of "
            "new requests, prefetch questions); requests past it are asked in the next step."
        ),
    )
    retry_min_s: float = Field(
        1.0, gt=0, description="First pause after the agent failed; doubles while it stays down."
    )
    retry_max_s: float = Field(30.0, gt=0, description="Longest pause between reconnect tries.")
    pin_memory: Literal["auto", "never", "always"] = Field(
        "auto", description="Register the segment as CUDA pinned memory in the worker."
    )

    @model_validator(mode="after")
    def _one_target(self) -> Self:
        if (self.endpoint is None) == (self.pool is None):
            raise ValueError(
                "kv_connector_extra_config needs exactly one of 'endpoint' (with an optional "
                f"'segment_path') or 'pool' (with an optional 'namespace'), or "
                f"{CONNECTOR_ENDPOINT_ENV}"
            )
        if self.endpoint is not None and not self.endpoint.startswith(("tcp://", "ipc://")):
            raise ValueError(f"endpoint must be tcp://host:port or ipc://path, not {self.endpoint}")
        if self.retry_max_s < self.retry_min_s:
            raise ValueError("retry_max_s must be at least retry_min_s")
        return self

    @classmethod
    def load(
        cls, extra_config: Mapping[str, Any], environ: Mapping[str, str] | None = None
    ) -> ConnectorSettings:
        """Validate ``extra_config`` with the ``KVPOOL_*`` overrides applied.

        Raises ``ValueError`` naming the offending key; vLLM shows it at start.
        """
        env = os.environ if environ is None else environ
        values = dict(extra_config)
        if env.get(CONNECTOR_ENDPOINT_ENV):
            values["endpoint"] = env[CONNECTOR_ENDPOINT_ENV]
            values.pop("pool", None)
            values.pop("namespace", None)
        if env.get(CONNECTOR_SEGMENT_PATH_ENV):
            values["segment_path"] = env[CONNECTOR_SEGMENT_PATH_ENV]
        if env.get(CONNECTOR_CHUNK_TOKENS_ENV):
            values["chunk_tokens"] = env[CONNECTOR_CHUNK_TOKENS_ENV]
        try:
            return cls.model_validate(values)
        except ValidationError as error:
            known = ", ".join(sorted(cls.model_fields))
            raise ValueError(
                f"invalid kvpool kv_connector_extra_config: {error}\nknown keys: {known}"
            ) from None
