"""What one HTTP client may cost a process: body size, read timeouts, open connections.

The agent's and the index's configurations both hold one :class:`HttpLimits`
(``http_limits``); :func:`kvpool_agent.http_serving.serve_http` and
:class:`kvpool_agent.http_body_gate.BodyGate` enforce it.
"""

from __future__ import annotations

from pydantic import BaseModel, ByteSize, ConfigDict, Field

DEFAULT_MAX_BODY_BYTES = ByteSize(1 << 20)


class HttpLimits(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    max_body_bytes: ByteSize = Field(
        DEFAULT_MAX_BODY_BYTES,
        description="Largest request body; a larger one is answered 413 before it is read.",
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
    max_connections: int = Field(
        1024,
        ge=1,
        description=(
            "Open HTTP connections at most (fewer if the file limit leaves too few descriptors "
            "for the rest of the process); at the bound the longest idle one is closed to admit "
            "a new one, and a new one is refused (503) if none is idle."
        ),
    )
