"""A link from a connector half to a real agent process, with the short pauses tests want."""

from __future__ import annotations

from collections.abc import Callable

from kvpool.client import AgentInfo
from kvpool.connector.counters import Counters
from kvpool.connector.discovery import AgentAddress
from kvpool.connector.link import AgentLink
from tests.support.agent_process import ENGINE_TOKEN, AgentProcess


def agent_link(
    agent: AgentProcess,
    counters: Counters,
    role: str,
    on_new_agent: Callable[[AgentInfo], None] | None = None,
) -> AgentLink:
    return AgentLink(
        lambda: AgentAddress(agent.zmq, None, None),
        credential=lambda: ENGINE_TOKEN,
        role=role,
        timeout=1.0,
        retry_min_s=0.05,
        retry_max_s=0.1,
        counters=counters,
        on_new_agent=on_new_agent,
    )
