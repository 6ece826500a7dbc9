"""A pool's peer tier (``spec.peers``): its agents pull KV chunks from each other over TCP
or NIXL (``transport``), proving the pool's peer credential (a Secret the operator mints
and rotates), each chunk sealed or authenticated with it (``wireProtection``)."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Annotated, Literal

from pydantic import BeforeValidator, ConfigDict, Field, WithJsonSchema, model_validator

from kvpool.common.names import DEFAULT_PEER_PORT
from kvpool.operator.spec.base import PositiveBytes, SpecModel
from kvpool.operator.spec.markers import Rule, cel

DURATION_UNITS = {"s": 1, "m": 60, "h": 3600}
DURATION_PATTERN = f"^[1-9][0-9]*({'|'.join(DURATION_UNITS)})$"
MIN_ROTATION = "10m"
"""The API server's floor of credentialRotation: a mounted Secret reaches an agent within
about a minute and a half (the kubelet's sync, then the agent's 30 s reread), and an agent
that has not seen the newest key for a whole rotation can no longer talk to those that
have. The operator itself takes any period (its tests rotate in seconds)."""
ROTATION_TOO_SHORT = (
    f"peers.credentialRotation must be at least {MIN_ROTATION}: an agent sees a new key up "
    "to about a minute and a half after it is added"
)
PEER_PORT_TAKEN = (
    "spec.peers.port must differ from spec.ports.zmq, spec.ports.http and spec.ports.events"
)


def parse_duration(value: object) -> object:
    """A duration as the CRD spells it (``24h``, ``90m``, ``30s``): a timedelta; anything
    else is left to pydantic (a timedelta stays one)."""
    if isinstance(value, str):
        match = re.fullmatch(DURATION_PATTERN, value)
        if match is None:
            raise ValueError(f"expected a whole number of s, m or h, such as 24h, not {value!r}")
        return timedelta(seconds=int(value[:-1]) * DURATION_UNITS[match[1]])
    return value


Duration = Annotated[
    timedelta,
    BeforeValidator(parse_duration),
    WithJsonSchema({"type": "string", "pattern": DURATION_PATTERN, "maxLength": 16}),
]
"""A whole number of seconds, minutes or hours (``30s``, ``90m``, ``24h``)."""


NIXL_PORTS_BACKWARDS = "peers.nixl.tcpPorts: first must not be above last"
UCX_NAMES = "peers.nixl.ucx: every name is a UCX variable (UCX_ and capitals, digits, _)"
UCX_NAME_PATTERN = "^UCX_[A-Z0-9_]+$"


class NixlTcpPorts(SpecModel):
    model_config = ConfigDict(
        json_schema_extra=cel(Rule("self.first <= self.last", NIXL_PORTS_BACKWARDS))
    )

    first: int = Field(7410, ge=1, le=65535, description="The first port of the range.")
    last: int = Field(7441, ge=1, le=65535, description="The last port of the range.")

    @model_validator(mode="after")
    def _ordered(self) -> NixlTcpPorts:
        if self.first > self.last:
            raise ValueError(NIXL_PORTS_BACKWARDS)
        return self


class NixlSpec(SpecModel):
    tcp_ports: NixlTcpPorts = Field(
        NixlTcpPorts(),
        description="Where UCX listens when it moves chunks over TCP (UCX_TCP_PORT_RANGE): "
        "the pool's NetworkPolicy admits the pool's agents to these ports alone. Keep them "
        "clear of the agents' other ports.",
    )
    ucx: dict[str, str] = Field(
        default_factory=dict,
        description="More UCX variables for the agents, as is: UCX_NET_DEVICES (say "
        "mlx5_0:1) and UCX_TLS pick the RDMA devices and transports; UCX picks on its own "
        "without them.",
        json_schema_extra=cel(
            Rule(f"self.all(name, name.matches('{UCX_NAME_PATTERN}'))", UCX_NAMES)
        )
        | {"maxProperties": 32},
    )
    lock_memory: bool = Field(
        False,
        description="Give the agents the IPC_LOCK capability, which RDMA needs to pin the "
        "buffers it registers (the landings): their namespace must then admit it (Pod "
        "Security privileged; restricted and baseline forbid it).",
    )

    @model_validator(mode="after")
    def _ucx_names(self) -> NixlSpec:
        if any(re.fullmatch(UCX_NAME_PATTERN, name) is None for name in self.ucx):
            raise ValueError(UCX_NAMES)
        return self


class PeersSpec(SpecModel):
    enabled: bool = Field(
        True,
        description="The pool's agents pull the chunks they miss from each other (a tier "
        "between each node's NVMe and S3) and serve theirs. Turning it off closes the peer "
        "port and deletes the pool's peer Secret.",
    )
    port: int = Field(
        DEFAULT_PEER_PORT,
        ge=1,
        le=65535,
        description="TCP port each agent serves its peers on (the agent pods' container port "
        "named peer).",
    )
    max_bandwidth: PositiveBytes | None = Field(
        None,
        description="Bytes per second each agent serves to its peers at most (a quantity, "
        "e.g. 2Gi). Absent: no cap.",
    )
    wire_protection: Literal["sealed", "integrity"] = Field(
        "sealed",
        description="What the chunks the agents send each other carry: sealed, AEGIS-128L "
        "ciphertext (AES-256-GCM to agents of an older build; whoever reads the link learns "
        "nothing), or integrity, the plaintext under an authentication tag (whoever reads the "
        "link reads chunks, but no one can alter, forge or misroute one unseen), for a trusted "
        "fabric where the cipher's pass would cost the transfer rate. Either way a chunk opens "
        "only as its tenant's and key's.",
    )
    transport: Literal["tcp", "nixl"] = Field(
        "tcp",
        description="What carries chunk bodies between the agents: tcp, the peer port's "
        "connection (needs nothing), or nixl, the NIXL transfer engine the cluster's engines "
        "use (UCX picks RDMA or NVLink where the nodes have them: see the README for what "
        "RDMA needs). Requests, answers and the credential's proof stay on the peer port "
        "either way; an agent whose NIXL cannot start falls back to tcp and says so.",
    )
    nixl: NixlSpec = Field(
        NixlSpec(),
        description="How the agents run NIXL, with transport nixl: UCX's TCP ports, its "
        "variables, and the memory locking RDMA needs.",
    )
    max_transfers: int = Field(
        4,
        ge=1,
        description="Chunk transfers each agent serves at once; its peers' further requests "
        "are refused (busy) and fall through to the next tier.",
    )
    credential_rotation: Duration = Field(
        "24h",
        validate_default=True,
        description="How often the operator adds a new key to the pool's peer Secret "
        "(kvpool-<pool>-peer); the previous key stays until the next one, so agents that "
        f"have not reread the Secret yet still authenticate. At least {MIN_ROTATION}.",
        json_schema_extra=cel(
            Rule(f"duration(self) >= duration('{MIN_ROTATION}')", ROTATION_TOO_SHORT)
        ),
    )
