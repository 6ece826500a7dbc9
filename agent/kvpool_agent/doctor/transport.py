"""The transport check: how the connector in this pod would move KV.

Through the shared segment when this pod maps the agent's (copies in the pod's own memory),
else through the agent's messages over the pod network (``kvpool_agent.connector.inline``):
slower, and only for chunks that fit in one message (the agent's ``max_inline_bytes``).
"""

from __future__ import annotations

from pathlib import Path

from kvpool_agent.client import AgentInfo
from kvpool_agent.doctor.report import Check, passed, size
from kvpool_agent.segment import SharedSegment

NAME = "transport"


def check_transport(path: Path | None, mapped: SharedSegment | None, info: AgentInfo) -> Check:
    """``path``: the segment this pod would map (None: none, the transport ``messages``)."""
    if mapped is not None:
        return passed(NAME, f"the shared segment {path}: KV is copied in this pod's memory")
    unmapped = "it maps no segment" if path is None else f"it does not map {path}"
    return passed(
        NAME,
        f"the agent's messages over the network: {unmapped} (the segment line says why); "
        "slower than the shared segment, and chunks of more than "
        f"{size(info.max_inline_bytes)} (the agent's max_inline_bytes) are not cached",
    )
