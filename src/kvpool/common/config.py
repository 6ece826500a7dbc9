"""The agent's configuration: one typed model, validated once.

Sources, highest precedence first: keyword arguments, ``KVPOOL_*`` environment
variables, then a YAML or JSON file named by ``KVPOOL_CONFIG_FILE`` (the
operator renders this model into a ConfigMap and mounts it there).
"""

from __future__ import annotations

import difflib
import os
import re
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal, Self, TypeVar
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from kvpool.common.files import FileRefused, ensure_directory
from kvpool.common.names import (
    AGENT_CONFIG_FILE_ENV,
    AGENT_ENV_PREFIX,
    DEFAULT_EVENTS_PORT,
    DEFAULT_HTTP_PORT,
    DEFAULT_PEER_PORT,
    DEFAULT_POOL,
    DEFAULT_STATE_DIR,
    DEFAULT_ZMQ_PORT,
    INDEX_ENV_PREFIX,
    POLICY_NAMES,
    SHARED_VARIABLES,
    generated_token_path,
    segment_path,
)
from kvpool.common.problems import (
    ConfigError,
    EnvironmentOrigin,
    FlagOrigin,
    Loc,
    MappingOrigin,
    Origin,
    SettingError,
    describe,
    named,
    show,
    yaml_problem,
)
from kvpool.common.sizes import Size

POOL_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
"""A pool name: a DNS label, as the names of its Kubernetes objects need."""
_REGION = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9]{0,61}[A-Za-z0-9])?")
"""An S3 region: a host label, as botocore checks it."""
MIN_PAGE_SIZE = 4096
MIN_PAGES = 16


def read_config_file(path: str) -> dict[str, Any]:
    """The settings in a YAML or JSON file; :class:`ConfigError` naming the file, and the
    line where YAML stopped, if it cannot be read."""
    try:
        loaded = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as error:
        raise ConfigError(
            [f"{path}: cannot read the configuration file: {error.strerror}"]
        ) from None
    except UnicodeDecodeError as error:
        raise ConfigError([f"{path}: not UTF-8 text (byte {error.start})"]) from None
    except yaml.YAMLError as error:
        raise ConfigError([f"{path}: not YAML or JSON: {yaml_problem(error)}"]) from None
    if not isinstance(loaded, dict):
        raise ConfigError(
            [f"{path}: expected a mapping of settings, got a {type(loaded).__name__}"]
        )
    return loaded


class ConfigFileSource(PydanticBaseSettingsSource):
    """Values from the YAML/JSON file named by the environment variable ``env``, if set."""

    def __init__(self, settings_cls: type[BaseSettings], env: str) -> None:
        super().__init__(settings_cls)
        path = os.environ.get(env)
        self._values = read_config_file(path) if path else {}

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return self._values.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(self._values)


class FileSettings(BaseSettings):
    """Settings of a process from its arguments, then ``KVPOOL_*`` variables, then the
    YAML/JSON file that the variable ``config_file_env`` names (the agent's, the index's)."""

    config_file_env: ClassVar[str]

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, ConfigFileSource(settings_cls, cls.config_file_env))


_Settings = TypeVar("_Settings", bound=BaseSettings)
_UNREADABLE = re.compile(
    r'error parsing value for field "(?P<field>[^"]+)" from source "(?P<source>\w+)"'
)


def load_settings(
    model: type[_Settings], flags: Mapping[Loc, tuple[str, object]] | None = None, **values: Any
) -> _Settings:
    """``model(**values)`` (a settings model with a ``config_file_env``), or a
    :class:`ConfigError` with one line per problem, each naming the setting as the user
    wrote it: a flag (``flags``: where each of ``values`` came from on the command line), an
    environment variable, or a key of the configuration file; and its value.
    """
    unknown = unknown_variables(model, os.environ)
    if unknown:
        raise ConfigError(unknown)
    try:
        return model(**values)
    except ValidationError as error:
        raise ConfigError(describe(error, _origins(model, flags), model)) from None
    except SettingsError as error:  # a variable of a list or a nested model that is not JSON
        match = _UNREADABLE.search(str(error))
        if match is None:
            raise ConfigError([" ".join(str(error).split())]) from None
        found = _environment(model).find((match["field"],))
        where = match["field"] if found is None else f"{found.name}={show(found.value)}"
        raise ConfigError([f"{where}: not valid JSON ({error.__cause__})"]) from None


def variables(model: type[BaseSettings]) -> set[str]:
    """Every environment variable ``model`` reads, in upper case: its prefix and each
    field's name, a nested model's fields after the delimiter too (``KVPOOL_NVME``,
    ``KVPOOL_NVME__PATH``); its configuration file's variable, and the ``other_variables``
    it takes as known."""
    config = model.model_config
    prefix, delimiter = config.get("env_prefix") or "", config.get("env_nested_delimiter")
    names = {getattr(model, "config_file_env", prefix), *getattr(model, "other_variables", ())}

    def add(fields: type[BaseModel], stem: str) -> None:
        for name, field in fields.model_fields.items():
            variable = f"{stem}{name}".upper()
            names.add(variable)
            inner = _inner_model(field.annotation)
            if inner is not None and delimiter:
                add(inner, variable + delimiter)

    add(model, prefix)
    return names


def _inner_model(annotation: object) -> type[BaseModel] | None:
    """The model of a field that is one (``NvmeTierConfig | None``), whose fields a variable
    each may set; not a list's."""
    arguments = typing.get_args(annotation) if typing.get_origin(annotation) in _UNIONS else ()
    for candidate in (annotation, *arguments):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


_UNIONS = (typing.Union, types.UnionType)


def unknown_variables(model: type[BaseSettings], environ: Mapping[str, str]) -> list[str]:
    """One line per variable of ``environ`` under ``model``'s prefix that no part of kvpool
    reads (a misspelled ``KVPOOL_L1SIZE`` would leave ``l1_size`` at its default), with the
    closest known name. Any case, as pydantic-settings reads them; the values are not
    shown (a misspelled token variable holds a secret). Variables under one of the model's
    ``foreign_prefixes`` are another process's to check (``KVPOOL_INDEX_`` the index's)."""
    prefix = (model.model_config.get("env_prefix") or "").upper()
    foreign = tuple(other.upper() for other in getattr(model, "foreign_prefixes", ()))
    known = variables(model)
    services = _service_links(environ)
    suffixes = sorted(name.removeprefix(prefix) for name in known if name.startswith(prefix))
    lines = []
    for name in sorted(environ):
        upper = name.upper()
        if not prefix or not upper.startswith(prefix) or upper in known:
            continue
        if (foreign and upper.startswith(foreign)) or (services and upper.startswith(services)):
            continue
        close = difflib.get_close_matches(upper.removeprefix(prefix), suffixes, n=1)
        hint = f"did you mean {prefix}{close[0]}?" if close else "see the configuration reference"
        lines.append(f"{name}: unknown setting, no part of kvpool reads it; {hint}")
    return lines


def _service_links(environ: Mapping[str, str]) -> tuple[str, ...]:
    """The prefixes of the variables Kubernetes sets in a pod for each Service of its
    namespace (``KVPOOL_MAIN_SERVICE_HOST``, ``KVPOOL_MAIN_PORT_7400_TCP``... for the
    Service ``kvpool-main``): a Service with a cluster IP always has ``<NAME>_SERVICE_HOST``."""
    stems = [name[: -len("_SERVICE_HOST")] for name in environ if name.endswith("_SERVICE_HOST")]
    return tuple(f"{stem}{part}".upper() for stem in stems for part in ("_SERVICE_", "_PORT"))


def setting(model: type[BaseSettings], loc: Loc, value: object) -> str:
    """``model``'s setting at ``loc``, as the user wrote it (the variable, the file and the
    key), with ``value``: for a problem found after validation (a directory that cannot be
    made)."""
    return named(loc, value, _origins(model, None))


def make_setting_directory(loc: Loc, path: Path, *, what: str) -> None:
    """The agent's directory of the setting at ``loc`` (``state_dir``, ``nvme.path``...),
    made if missing; one that cannot be made (a file in its way, a read-only or missing
    mount) is a :class:`ConfigError` naming the setting as the user wrote it."""
    try:
        ensure_directory(path, what=what)
    except FileRefused:
        raise
    except OSError as error:
        where = setting(AgentConfig, loc, path)
        raise ConfigError(
            [f"{where}: cannot make the directory: {error.strerror} ({error.filename})"]
        ) from None


def _environment(model: type[BaseSettings]) -> EnvironmentOrigin:
    config = model.model_config
    prefix, delimiter = config.get("env_prefix") or "", config.get("env_nested_delimiter")
    return EnvironmentOrigin(prefix, delimiter, os.environ)


def _origins(
    model: type[BaseSettings], flags: Mapping[Loc, tuple[str, object]] | None
) -> list[Origin]:
    """Where ``model``'s values come from, highest precedence first."""
    origins: list[Origin] = [FlagOrigin(flags or {}), _environment(model)]
    path = os.environ.get(getattr(model, "config_file_env", ""), "")
    if path:
        origins.append(MappingOrigin(path, read_config_file(path)))
    return origins


DEFAULT_MAX_BODY_BYTES = 1 << 20
"""The agent's default bound on a request body."""


class HttpLimits(BaseModel):
    """What one HTTP client may cost a process: head and body size, read timeouts, connections.

    The agent's and the index's configurations both hold one (``http_limits``);
    :func:`kvpool.common.web.serving.serve_http` and
    :class:`kvpool.common.web.body_gate.BodyGate` enforce it.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_body_bytes: Size = Field(
        DEFAULT_MAX_BODY_BYTES,
        description="Largest request body; a larger one is answered 413 before it is read.",
    )
    max_head_bytes: Size = Field(
        16 << 10,
        ge=1024,
        description=(
            "Largest request head (request line and header fields); past it the request is "
            "answered 431 and the connection closed, and at most this much of an unfinished "
            "head is held. Clients send a few KiB (bearer tokens are 64 characters); 16 KiB "
            "is h11's and Node.js's default."
        ),
    )
    max_header_count: int = Field(
        100,
        ge=1,
        description="Header fields of a request at most (Apache's default); more: 431, closed.",
    )
    header_timeout_seconds: float = Field(
        10.0,
        gt=0,
        description=(
            "A connection that has not sent a whole request head this long after it opened "
            "(or after its last response) is answered 408 and closed."
        ),
    )
    body_timeout_seconds: float = Field(
        30.0,
        gt=0,
        description="A request body not received in full this long after its head: 408, closed.",
    )
    send_timeout_seconds: float = Field(
        10.0,
        gt=0,
        description=(
            "A connection whose client leaves its responses unread this long (the server's "
            "write buffer stays full) is aborted."
        ),
    )
    max_connections: int = Field(
        1024,
        ge=1,
        description=(
            "Open HTTP connections at most; at the bound one is closed to admit a new one: "
            "one not authenticated before one that is, idle (between requests) before busy, "
            "the longest in that state first, never one busy with an authenticated request "
            "(if only those are open, the new one is refused with 503). Lowered (logged) to half "
            "of the file limit less 256 descriptors if that is smaller (an accept burst may "
            "briefly double the count); the soft file limit is raised to the hard one at start."
        ),
    )


class ZmqLimits(BaseModel):
    """What the ZMQ port's clients may cost the agent together: connections, time before
    hello, and the bytes of large messages being received.

    :class:`kvpool.agent.edge.zmtp.ZmtpRouter` enforces it (see its docstring for what a
    connection holds before and after hello).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_connections: int = Field(
        1024,
        ge=1,
        description=(
            "Connections that said hello at most; at the bound a new connection is closed at "
            "once, and a hello that would pass it closes its connection."
        ),
    )
    max_unauthenticated: int = Field(
        256,
        ge=1,
        description=(
            "Connections that have not yet said hello at most (each holds at most 10 KiB); at "
            "the bound the oldest of them is closed to admit a new one. Room for every link "
            "of a node's engines at once: after an agent restart, libzmq reconnects each "
            "link, which says hello only with its next request."
        ),
    )
    hello_seconds: float = Field(
        5.0,
        gt=0,
        description=(
            "A connection that has not finished its ZMTP handshake and a successful hello this "
            "long after it opened is closed (on the events port: its PLAIN handshake)."
        ),
    )
    receive_budget: Size = Field(
        256 << 20,
        description=(
            "Bytes of large messages (over 64 KiB) being received at once, all connections "
            "together; a connection whose message finds none left is not read until some is "
            "free. Always room for one largest message (max_inline_bytes and 1 MiB)."
        ),
    )
    message_seconds: float = Field(
        30.0,
        gt=0,
        description=(
            "A large message not received in full this long after it took its share of "
            "receive_budget closes its connection."
        ),
    )


class NvmeTierConfig(BaseModel):
    """A local-disk L2 tier: one file per chunk under ``path/<pool>``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    path: Path = Field(description="Directory on the node's NVMe (a hostPath in Kubernetes).")
    capacity: Size = Field(description="Bytes of chunk files kept; LRU files go first.")
    fsync: Literal["never", "data", "always"] = Field(
        "data",
        description=(
            "never: rely on the page cache; data: fsync each file before it is renamed into "
            "place; always: also fsync the directory."
        ),
    )
    direct_io: bool = Field(False, description="Write and read with O_DIRECT (where supported).")
    max_concurrency: int = Field(16, ge=1, description="File operations in flight at once.")
    encryption: bool = Field(
        False,
        description=(
            "Seal each file with AES-GCM under the pool's key. Off: files are plaintext but "
            "still authenticated with the key (a forged or renamed file is a miss)."
        ),
    )


class S3TierConfig(BaseModel):
    """An S3 (or S3-compatible) L2 tier shared by every agent of the pool."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    bucket: str = Field(description="Bucket name.")
    prefix: str = Field("kvpool", description="Key prefix; objects go under <prefix>/<pool>/.")
    endpoint_url: str | None = Field(
        None, description="Endpoint of an S3-compatible store (http:// or https:// URL)."
    )
    region: str | None = Field(None, description="Region; default from the credential chain.")
    max_concurrency: int = Field(16, ge=1, description="Requests in flight at once.")
    connect_timeout_seconds: float = Field(2.0, gt=0, description="TCP connect timeout.")
    read_timeout_seconds: float = Field(10.0, gt=0, description="Socket read timeout.")
    max_attempts: int = Field(
        3, ge=1, description="Attempts per request (exponential backoff with jitter)."
    )
    breaker_failures: int = Field(
        5, ge=1, description="Consecutive failures that open the circuit breaker."
    )
    breaker_reset_seconds: float = Field(
        30.0, gt=0, description="How long an open breaker turns requests into misses."
    )
    multipart_threshold: Size = Field(
        8 << 20, description="Objects from this size move in parallel parts."
    )
    part_size: Size = Field(8 << 20, description="Size of one part.")
    encryption: bool = Field(
        True,
        description=(
            "Seal each object with AES-GCM under the pool's key. Off: objects are plaintext "
            "but still authenticated with the key (a forged or renamed object is a miss)."
        ),
    )
    server_side_encryption: Literal["AES256", "aws:kms", "aws:kms:dsse"] | None = Field(
        None,
        description="S3 server-side encryption asked for on every put (independent of sealing).",
    )
    sse_kms_key_id: str | None = Field(
        None, description="KMS key of server_side_encryption aws:kms or aws:kms:dsse."
    )

    @field_validator("endpoint_url")
    @classmethod
    def _check_endpoint(cls, url: str | None) -> str | None:
        if url is not None:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError("must be an http:// or https:// URL with a host")
        return url

    @field_validator("region")
    @classmethod
    def _check_region(cls, region: str | None) -> str | None:
        if region is not None and not _REGION.fullmatch(region):
            raise ValueError("must be a region name such as us-east-1 (letters, digits, -)")
        return region

    @model_validator(mode="after")
    def _check_sse(self) -> Self:
        if self.sse_kms_key_id is not None and not (self.server_side_encryption or "").startswith(
            "aws:kms"
        ):
            raise SettingError(
                "sse_kms_key_id needs server_side_encryption aws:kms or aws:kms:dsse",
                sse_kms_key_id=self.sse_kms_key_id,
                server_side_encryption=self.server_side_encryption,
            )
        return self


PEER_AGENT = re.compile(r"^([^=\s]+)=([^\s:]+|\[[0-9a-fA-F:.]+\]):([0-9]{1,5})$")
"""A static peer, ``NODE=HOST:PORT`` (an IPv6 host in brackets)."""


class PeersConfig(BaseModel):
    """The pool's other agents as a tier between NVMe and S3: this agent serves its L1 and
    NVMe chunks to them on ``port`` and pulls from them what it misses."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    port: int = Field(
        DEFAULT_PEER_PORT, ge=1, le=65535, description="TCP port this agent serves peers on."
    )
    key_dir: Path = Field(
        description=(
            "Directory of the pool's peer credential (a mounted Secret the operator makes): "
            "one file per key, named by its id, as l2_key_dir. Peers prove they hold a common "
            "key and seal or authenticate every chunk they send with it; reread every 30 s."
        )
    )
    wire_protection: Literal["sealed", "integrity"] = Field(
        "sealed",
        description=(
            "What the chunks this agent sends its peers carry: sealed, AEGIS-128L "
            "ciphertext (AES-256-GCM to agents of an older build; the link learns nothing); "
            "integrity, the plaintext under an authentication tag (the link may read chunks, "
            "never alter or misroute one unseen), for trusted fabrics where the cipher's pass "
            "costs the rate. Either way the receiver opens a chunk only as its tenant and key."
        ),
    )
    transport: Literal["tcp", "nixl"] = Field(
        "tcp",
        description=(
            "What carries chunk bodies between agents: tcp, the peer port's connection; nixl, "
            "the NIXL transfer engine (UCX: RDMA or NVLink where the hardware has them, else "
            "TCP or shared memory), its control frames still on the peer port. An agent whose "
            "NIXL cannot start uses tcp and says why; either way only proven peers learn a "
            "landing's descriptor and every chunk opens only as its tenant's and key's."
        ),
    )
    node: str | None = Field(
        None,
        description="This agent's name among its peers; default $NODE_NAME, else the host name.",
    )
    discovery: Literal["static", "kubernetes"] = Field(
        "static",
        description=(
            "Where the other agents are: the static list in agents, or the pool's agent pods "
            "(list and watch pods in namespace)."
        ),
    )
    agents: list[str] = Field(
        default_factory=list,
        description="Static peers, NODE=HOST:PORT each (this node's own entry is skipped).",
    )
    namespace: str | None = Field(
        None,
        description="The pool's namespace, for kubernetes discovery (default: the pod's own).",
    )
    index_url: str | None = Field(
        None,
        description=(
            "The pool's prefix index (http://HOST:PORT): asked first which peers hold a "
            "prefix, with a token derived from the peer credential (the index mounts it "
            "too); without one, or while it fails, every peer is asked."
        ),
    )
    max_transfers: int = Field(
        4, ge=1, description="Chunk transfers this agent serves at once; more are refused (busy)."
    )
    max_bytes_in_flight: Size = Field(
        256 << 20, description="Bytes of chunks being served at once; more are refused (busy)."
    )
    bandwidth: Size = Field(
        0, description="Bytes per second this agent serves to peers at most; 0: no cap."
    )
    connect_timeout_seconds: float = Field(1.0, gt=0, description="TCP connect timeout.")
    io_timeout_seconds: float = Field(
        5.0, gt=0, description="A peer that sends or takes nothing for this long is cut off."
    )

    @field_validator("index_url")
    @classmethod
    def _check_index_url(cls, url: str | None) -> str | None:
        if url is not None:
            parts = urlsplit(url)
            if parts.scheme != "http" or not parts.hostname or parts.path not in ("", "/"):
                raise ValueError("must be http://HOST:PORT, the index's address")
        return url

    @field_validator("agents")
    @classmethod
    def _check_agents(cls, agents: list[str]) -> list[str]:
        for agent in agents:
            if not PEER_AGENT.fullmatch(agent):
                raise ValueError(
                    f"expected NODE=HOST:PORT (e.g. gpu-2=10.0.0.6:7404), got {agent!r}"
                )
        return agents


class AgentConfig(FileSettings):
    """Configuration of one node agent (and the pool it serves)."""

    model_config = SettingsConfigDict(
        env_prefix=AGENT_ENV_PREFIX, env_nested_delimiter="__", frozen=True, extra="forbid"
    )
    config_file_env: ClassVar[str] = AGENT_CONFIG_FILE_ENV
    other_variables: ClassVar[tuple[str, ...]] = SHARED_VARIABLES
    foreign_prefixes: ClassVar[tuple[str, ...]] = (INDEX_ENV_PREFIX,)

    pool: str = Field(
        DEFAULT_POOL,
        pattern=POOL_NAME_PATTERN,
        description=(
            "Pool name (a DNS label); names the shared-memory segment and the pool's Kubernetes "
            "objects."
        ),
    )
    segment_path: Path | None = Field(
        None,
        description="Shared-memory file of the L1 segment; default /dev/shm/kvpool-<pool>/segment.",
    )
    l1_size: Size = Field(
        1 << 30, description="Bytes of chunk data in the L1 segment (e.g. 1Gi, 64Gi)."
    )
    page_size: Size = Field(
        64 << 10,
        description=(
            "Allocation granularity (a power of two, >= 4Ki); a chunk occupies whole pages."
        ),
    )
    eviction_policy: str = Field(
        "lru", description=f"Eviction policy within a tenant; one of {', '.join(POLICY_NAMES)}."
    )
    high_watermark: float = Field(
        0.90, gt=0, le=1, description="Eviction starts when this fraction of the segment is used."
    )
    low_watermark: float = Field(
        0.80, gt=0, lt=1, description="Eviction stops once usage falls to this fraction."
    )
    default_tenant_quota: Size | None = Field(
        None,
        description=(
            "Quota of tenants without their own: bytes, 0 = no caching, null = no limit; also "
            "the most a tenant's own token may set where no KVCacheTenant ceiling applies."
        ),
    )
    default_pin_budget: Size = Field(
        0,
        description=(
            "Bytes of L1 a tenant's pinned chunks may hold where no shared space's pinBudget "
            "(tenants_configmap) sets it; 0 = pinning refused. Admins and shared spaces' "
            "owners pin through the HTTP API; pins live in memory (the operator sets them "
            "again after a restart)."
        ),
    )
    lease_seconds: float = Field(
        30.0,
        gt=0,
        description=(
            "Lifetime of read and write locks; a crashed client's locks expire (an expired "
            "store's pages stay quarantined up to 10 x this)."
        ),
    )
    shutdown_grace_seconds: float = Field(
        10.0,
        ge=0,
        description="On SIGTERM, how long stores in flight may still commit before exiting.",
    )
    maintenance_interval_seconds: float = Field(
        1.0, gt=0, description="Period of the background watermark check and lease expiry."
    )
    handover_seconds: float = Field(
        30.0,
        ge=0,
        description=(
            "At start, how long to wait for another live agent of the same segment, or of the "
            "same pool in the same state_dir or nvme.path, to exit (a rollout's old pod, still "
            "stopping) before refusing to start; it then adopts the segment."
        ),
    )
    host: str = Field(
        "127.0.0.1", description="Address the ZMQ and HTTP servers bind (0.0.0.0 in a pod)."
    )
    zmq_port: int = Field(
        DEFAULT_ZMQ_PORT,
        ge=0,
        le=65535,
        description="Port of the ZMQ protocol for vLLM (0 picks a free one).",
    )
    http_port: int = Field(
        DEFAULT_HTTP_PORT,
        ge=0,
        le=65535,
        description="Port of the HTTP API and /metrics (0 picks a free one).",
    )
    events_port: int = Field(
        DEFAULT_EVENTS_PORT,
        ge=0,
        le=65535,
        description="Port of the chunk-event PUB socket for the prefix index (0 picks a free one).",
    )
    http_limits: HttpLimits = Field(
        default_factory=HttpLimits,
        description="What one HTTP client may cost: body size, read timeouts, connections.",
    )
    zmq_limits: ZmqLimits = Field(
        default_factory=ZmqLimits,
        description="What the ZMQ port's clients may cost: connections, hello time, bytes.",
    )
    max_inline_bytes: Size = Field(
        64 << 20,
        description=(
            "Largest payload of one inline (bytes over ZMQ) store or retrieve; a ZMQ message may "
            "hold this and 1 MiB more (its header), or the agent closes its connection."
        ),
    )
    tokens_file: Path | None = Field(
        None,
        description=(
            "YAML/JSON file of bearer tokens {admins: [...], tenants: {tenant-id: [...]}, "
            "engines: [...], indexes: [...]}; without one, an admin, an engine and an index "
            "token are generated into state_dir at start (<role>-token-<pool>, mode 0600)."
        ),
    )
    state_dir: Path = Field(
        DEFAULT_STATE_DIR,
        description=(
            "Directory of the quota file and the generated tokens; created 0700, and an "
            "existing one must belong to the agent's user or root."
        ),
    )
    quota_file: Path | None = Field(
        None,
        description=(
            "JSON file of durable tenant quotas (mode 0600) where no quota_configmap is set; "
            "default <state_dir>/quotas-<pool>.json."
        ),
    )
    quota_configmap: str | None = Field(
        None,
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?/[a-z0-9]([-.a-z0-9]*[a-z0-9])?$",
        description=(
            "Keep tenant quotas in this ConfigMap ('namespace/name', the pool's quota "
            "ConfigMap) through the Kubernetes API instead of quota_file: quotas written "
            "through any agent reach every agent within seconds; an agent keeps its last known "
            "quotas while the API server is unreachable (set by the operator)."
        ),
    )
    tenants_configmap: str | None = Field(
        None,
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?/[a-z0-9]([-.a-z0-9]*[a-z0-9])?$",
        description=(
            "Watch this ConfigMap ('namespace/name', the pool's tenants ConfigMap, written by "
            "the operator from KVCacheTenants) for tenant token digests and quota ceilings, "
            "beside tokens_file; applied at every change, malformed entries logged and skipped "
            "(set by the operator)."
        ),
    )
    metrics_top_tenants: int = Field(
        20,
        ge=0,
        description="Tenants with their own metrics label, largest first; the rest are 'other'.",
    )
    l2_key_dir: Path | None = Field(
        None,
        description=(
            "Directory of the pool's L2 master keys, one file per key (a mounted Secret): the "
            "file's name is the key id (a positive integer), its content the key (at least 32 "
            "bytes, e.g. `openssl rand -hex 32`). The highest id seals new objects, every id "
            "present opens old ones; reread every 30 s. Where it holds no key, key 1 is "
            "generated (mode 0600). Default <state_dir>/l2-keys."
        ),
    )
    nvme: NvmeTierConfig | None = Field(None, description="Local NVMe L2 tier, if any.")
    s3: S3TierConfig | None = Field(None, description="S3 L2 tier, if any.")
    peers: PeersConfig | None = Field(
        None,
        description=(
            "The pool's other agents as a tier between NVMe and S3 (this agent serves them too); "
            "none: no peer traffic."
        ),
    )
    store_policy: Literal["all", "reused"] = Field(
        "all",
        description="Which chunks go to L2: all, or those hit at least store_min_hits times.",
    )
    store_min_hits: int = Field(1, ge=1, description="Hits before a chunk goes to L2 (reused).")
    writeback_queue_chunks: int = Field(
        256,
        ge=1,
        description=(
            "Chunks waiting for L2 at most (and a quarter of l1_size in bytes); past that, "
            "write-backs are shed (counted)."
        ),
    )

    @field_validator("segment_path")
    @classmethod
    def _check_segment_path(cls, path: Path | None) -> Path | None:
        if path is not None and not (path.is_absolute() and path.name):
            raise ValueError("must be an absolute path to a file, such as /dev/shm/kvpool-a/seg")
        return path

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.low_watermark >= self.high_watermark:
            raise SettingError(
                f"low_watermark ({self.low_watermark}) must be below "
                f"high_watermark ({self.high_watermark})",
                low_watermark=self.low_watermark,
                high_watermark=self.high_watermark,
            )
        page = self.page_size
        if page < MIN_PAGE_SIZE or page & (page - 1):
            raise SettingError(
                f"page_size must be a power of two >= {MIN_PAGE_SIZE}, got {page}", page_size=page
            )
        if self.l1_size < MIN_PAGES * page:
            raise SettingError(
                f"l1_size must hold at least {MIN_PAGES} pages of {page} bytes",
                l1_size=self.l1_size,
                page_size=page,
            )
        if self.eviction_policy not in POLICY_NAMES:
            raise SettingError(
                f"unknown eviction_policy {self.eviction_policy!r}; "
                f"known policies are {', '.join(POLICY_NAMES)}",
                eviction_policy=self.eviction_policy,
            )
        return self

    @property
    def resolved_segment_path(self) -> Path:
        return self.segment_path or segment_path(self.pool)

    @property
    def resolved_l2_key_dir(self) -> Path:
        return self.l2_key_dir or self.state_dir / "l2-keys"

    @property
    def resolved_quota_file(self) -> Path:
        return self.quota_file or self.state_dir / f"quotas-{self.pool}.json"

    @property
    def generated_token_files(self) -> dict[str, Path]:
        """Without a tokens file: the files of the admin, engine and index tokens the agent
        generates at start (keys as in a tokens file)."""
        return {
            key: generated_token_path(self.state_dir, role, self.pool)
            for key, role in (("admins", "admin"), ("engines", "engine"), ("indexes", "index"))
        }
