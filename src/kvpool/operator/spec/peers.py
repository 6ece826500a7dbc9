"""A pool's peer tier (``spec.peers``): its agents pull KV chunks from each other over TCP,
proving the pool's peer credential (a Secret the operator mints and rotates), each chunk
sealed or authenticated with it (``wireProtection``)."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, WithJsonSchema

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
        description="What the chunks the agents send each other carry: sealed, AES-256-GCM "
        "ciphertext (whoever reads the link learns nothing), or integrity, the plaintext under "
        "the same authentication tag (whoever reads the link reads chunks, but no one can "
        "alter, forge or misroute one unseen), for a trusted fabric where the cipher's pass "
        "would cost the transfer rate. Either way a chunk opens only as its tenant's and key's.",
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
