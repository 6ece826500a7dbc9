"""Reading one sample of a real agent's (or index's) ``/metrics``, and a process's memory."""

from __future__ import annotations

import re
from pathlib import Path

import httpx

from kvpool.tools.bench.local.agent_process import AgentProcess


def metric(agent: AgentProcess, name: str) -> float:
    """The value of the sample ``name`` (with its labels, if any) on the agent; 0 if absent."""
    return sample(agent.http, name)


def sample(url: str, name: str) -> float:
    """The value of the sample ``name`` on the server at ``url``; 0 if absent."""
    text = httpx.get(f"{url}/metrics").text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def memory_bytes(pid: int, field: str = "VmRSS") -> int:
    """``VmRSS`` (resident now) or ``VmHWM`` (peak resident) of a process, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) << 10
    raise RuntimeError(f"no {field} for process {pid}")
