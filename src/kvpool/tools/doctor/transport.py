"""The transport check: how the connector in this pod would move KV.

Through the chunk files the agent's door gives this pod (copies in the pod's own memory),
else through the agent's messages over the pod network (``kvpool.connector.inline``):
slower, and only for chunks that fit in one message (the agent's ``max_inline_bytes``).
"""

from __future__ import annotations

from pathlib import Path

from kvpool.client import AgentInfo
from kvpool.tools.doctor.report import Check, passed, size

NAME = "transport"


def check_transport(door: Path | None, mapped: bool, info: AgentInfo) -> Check:
    """``door``: the agent's door this pod would ask (None: none, the transport ``messages``);
    ``mapped``: whether it reaches it."""
    if mapped:
        return passed(
            NAME, f"chunk files from the agent's door {door}: KV is copied in this pod's memory"
        )
    unmapped = "it maps no chunk file" if door is None else f"it does not reach {door}"
    return passed(
        NAME,
        f"the agent's messages over the network: {unmapped} (the door line says why); "
        "slower than mapping chunk files, and chunks of more than "
        f"{size(info.max_inline_bytes)} (the agent's max_inline_bytes) are not cached",
    )
