"""Reading one sample of a real agent's ``/metrics``."""

from __future__ import annotations

import re

import httpx

from kvpool_agent.testing.agent_process import AgentProcess


def metric(agent: AgentProcess, name: str) -> float:
    """The value of the sample ``name`` (with its labels, if any) on the agent; 0 if absent."""
    text = httpx.get(f"{agent.http}/metrics").text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0
