"""The connector's settings: ``kv_connector_extra_config`` and env overrides, validated once.

Two ways to name the agent (exactly one)::

    {"endpoint": "tcp://127.0.0.1:7400", "segment_path": "/dev/shm/kvpool-default/segment"}
    {"pool": "main", "namespace": "inference"}

``segment_path`` and ``door_path`` are optional with an endpoint (the agent's hello names
its segment and its door; set them where the pod sees them at other paths). With a pool the
connector reads the pool Service's annotations through the Kubernetes API (see
:mod:`kvpool.connector.discovery`). ``KVPOOL_CONNECTOR_ENDPOINT``,
``KVPOOL_CONNECTOR_SEGMENT_PATH``, ``KVPOOL_CONNECTOR_DOOR_PATH``,
``KVPOOL_CONNECTOR_CHUNK_TOKENS`` and ``KVPOOL_CONNECTOR_TRANSPORT`` override both (the
admission webhook sets them in a wired pod).
The token the connector says hello with comes from ``KVPOOL_CONNECTOR_TOKEN``, a file, or
the embedded default's engine token (:mod:`kvpool.connector.identity`).

Each variable's old name (``KVPOOL_ENDPOINT`` ...,
:data:`~kvpool.common.names.CONNECTOR_OLD_NAMES`) is read still, with one warning line per
process (:func:`variables`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from kvpool.common.names import (
    CONNECTOR_CHUNK_TOKENS_ENV,
    CONNECTOR_DOOR_PATH_ENV,
    CONNECTOR_ENDPOINT_ENV,
    CONNECTOR_OLD_NAMES,
    CONNECTOR_SEGMENT_PATH_ENV,
    CONNECTOR_TOKEN_ENV,
    CONNECTOR_TRANSPORT_ENV,
    DEFAULT_PD_DECODE_WAIT_MS,
)
from kvpool.common.problems import (
    ConfigError,
    FlagOrigin,
    Loc,
    MappingOrigin,
    Origin,
    SettingError,
    describe,
)

EXTRA_CONFIG = "kv_connector_extra_config"
Transport = Literal["auto", "messages"]
OVERRIDES = {
    "endpoint": CONNECTOR_ENDPOINT_ENV,
    "segment_path": CONNECTOR_SEGMENT_PATH_ENV,
    "door_path": CONNECTOR_DOOR_PATH_ENV,
    "chunk_tokens": CONNECTOR_CHUNK_TOKENS_ENV,
    "transport": CONNECTOR_TRANSPORT_ENV,
}
"""The settings an environment variable overrides, and its name."""
_warned: set[str] = set()
"""The old names of variables this process has read (and warned about, once)."""
log = logging.getLogger(__name__)
_NO_AGENT: dict[str, bool] = {"no agent": True}
"""The validation context of :meth:`ConnectorSettings.for_engine`'s settings without an
endpoint: the one object, told apart by identity."""


def variables(environ: Mapping[str, str] | None = None) -> dict[str, tuple[str, str]]:
    """The connector's variables that are set (not empty) in ``environ`` (default: the
    process's), by their names: the name it was set by and its value.

    An old name (:data:`~kvpool.common.names.CONNECTOR_OLD_NAMES`) is read as the new one,
    with one warning line per process naming each old name and its new one. Both names set
    to the same value (the webhook writes both) is the new one, without a word; to different
    values, a :class:`~kvpool.common.problems.ConfigError`, one line per variable (a
    token's values unshown)."""
    env = os.environ if environ is None else environ
    found: dict[str, tuple[str, str]] = {}
    conflicts: list[str] = []
    for new, old in CONNECTOR_OLD_NAMES.items():
        value, old_value = env.get(new), env.get(old)
        if value and old_value and old_value != value:
            secret = new == CONNECTOR_TOKEN_ENV
            both = f"{new} and {old}" if secret else f"{new}={value} and {old}={old_value}"
            conflicts.append(f"{both} (its old name) differ: set {new} only")
        elif value:
            found[new] = (new, value)
        elif old_value:
            found[new] = (old, old_value)
    if conflicts:
        raise ConfigError(conflicts)
    unwarned = [(name, new) for new, (name, _) in found.items() if name not in (new, *_warned)]
    if unwarned:
        _warned.update(old for old, _ in unwarned)
        pairs = ", ".join(f"{old} -> {new}" for old, new in unwarned)
        log.warning("kvpool: deprecated variable names, read for now: %s; set the new ones", pairs)
    return found


class NotAZmqAddress(ValueError):
    """An endpoint that is not ``tcp://host:port`` or ``ipc://path``."""


class ConnectorSettings(BaseModel):
    """Everything the connector reads from ``kv_connector_extra_config``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    endpoint: str | None = Field(None, description="ZMQ address of the agent, tcp://host:port.")
    segment_path: Path | None = Field(
        None,
        description=(
            "Where this pod sees the agent's segment (beside it, the table of ready chunks "
            "an engine's scheduler reads); default: what hello says."
        ),
    )
    door_path: Path | None = Field(
        None,
        description=(
            "Where this pod reaches the agent's door, which hands out the chunk files its "
            "token may map; default: <segment_path>.door/agent.sock, else what hello says."
        ),
    )
    transport: Transport = Field(
        "auto",
        description=(
            "How the worker moves KV: 'auto' through the chunk files the agent's door gives "
            "this pod's token, else through the agent's messages; 'messages' maps nothing."
        ),
    )
    pool: str | None = Field(None, description="KVCachePool name: discover the agent by Service.")
    namespace: str | None = Field(
        None, description="Namespace of the pool's Service; default: this pod's namespace."
    )
    token_file: Path | None = Field(
        None,
        description=(
            "File of the token for the agent (a mounted Secret's 'token'); "
            "KVPOOL_CONNECTOR_TOKEN and KVPOOL_CONNECTOR_TOKEN_FILE take precedence."
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
    decode_wait_s: float = Field(
        DEFAULT_PD_DECODE_WAIT_MS / 1000,
        ge=0,
        description=(
            "Most time the decode of a disaggregated request waits for the chunks its prefill "
            "stored (its kv_transfer_params may ask for less); then it loads what is there "
            "and computes the rest."
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

    @field_validator("endpoint")
    @classmethod
    def _zmq_address(cls, endpoint: str | None) -> str | None:
        if endpoint is not None and not endpoint.startswith(("tcp://", "ipc://")):
            guess = "" if "://" in endpoint else f"; did you mean tcp://{endpoint}?"
            raise NotAZmqAddress(f"must be tcp://host:port or ipc://path{guess}")
        return endpoint

    @model_validator(mode="after")
    def _one_target(self, info: ValidationInfo) -> Self:
        if info.context is _NO_AGENT:
            return self  # for_engine: the endpoint was malformed; nothing is asked of it
        if (self.endpoint is None) == (self.pool is None):
            raise SettingError(
                f"{EXTRA_CONFIG} needs exactly one of 'endpoint' (with an optional "
                f"'segment_path') or 'pool' (with an optional 'namespace'), or "
                f"{CONNECTOR_ENDPOINT_ENV}",
                endpoint=self.endpoint,
                pool=self.pool,
            )
        if self.retry_max_s < self.retry_min_s:
            raise SettingError(
                "retry_max_s must be at least retry_min_s",
                retry_max_s=self.retry_max_s,
                retry_min_s=self.retry_min_s,
            )
        return self

    @classmethod
    def load(
        cls,
        extra_config: Mapping[str, Any],
        environ: Mapping[str, str] | None = None,
        *,
        flags: Mapping[str, str] | None = None,
    ) -> ConnectorSettings:
        """Validate ``extra_config`` with the ``KVPOOL_*`` overrides applied.

        Raises :class:`~kvpool.common.problems.ConfigError` (a ``ValueError``), one line per
        problem naming the key of ``kv_connector_extra_config`` or the variable and its
        value; vLLM shows it at start. ``flags``: ``extra_config`` came from a command line
        (``kvpool doctor``), and these are the flags of its keys.
        """
        values, origins = cls._values(extra_config, environ, flags)
        try:
            return cls.model_validate(values)
        except ValidationError as error:
            raise ConfigError(describe(error, origins, cls)) from None

    @classmethod
    def for_engine(
        cls, extra_config: Mapping[str, Any], environ: Mapping[str, str] | None = None
    ) -> tuple[ConnectorSettings, str | None]:
        """:meth:`load`'s settings for the connector inside vLLM, and why it goes on without
        the cache (None: it does not).

        An endpoint that is no ZMQ address (``127.0.0.1:7400``, without ``tcp://``) does
        not stop vLLM: as with an agent it cannot reach, vLLM serves without the cache, and
        the line names the setting and its value. The settings are then the others, without
        an agent's address (nothing may ask for one). Any other mistake raises as in
        :meth:`load`.
        """
        values, origins = cls._values(extra_config, environ, None)
        try:
            return cls.model_validate(values), None
        except ValidationError as error:
            lines = describe(error, origins, cls)
            causes = [problem.get("ctx", {}).get("error") for problem in error.errors()]
            if not all(isinstance(cause, NotAZmqAddress) for cause in causes):
                raise ConfigError(lines) from None
        others = {key: value for key, value in values.items() if key != "endpoint"}
        return cls.model_validate(
            others, context=_NO_AGENT
        ), f"{lines[0]} (vLLM goes on without the cache)"

    @classmethod
    def _values(
        cls,
        extra_config: Mapping[str, Any],
        environ: Mapping[str, str] | None,
        flags: Mapping[str, str] | None,
    ) -> tuple[dict[str, Any], list[Origin]]:
        """The values to validate (``extra_config`` with the ``KVPOOL_*`` overrides), and
        where each came from, highest precedence first."""
        env = variables(environ)
        values = dict(extra_config)
        overridden: dict[Loc, tuple[str, object]] = {}
        for field, variable in OVERRIDES.items():
            if variable in env:
                name, value = env[variable]
                values[field] = value
                overridden[(field,)] = (name, value)
        if CONNECTOR_ENDPOINT_ENV in env:
            values.pop("pool", None)
            values.pop("namespace", None)
        given = (
            FlagOrigin(
                {(key,): (flags.get(key, key), value) for key, value in extra_config.items()}
            )
            if flags is not None
            else MappingOrigin(EXTRA_CONFIG, extra_config)
        )
        return values, [FlagOrigin(overridden, joiner="="), given]
