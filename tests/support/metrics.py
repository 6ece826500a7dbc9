"""Reading one sample of a real agent's (or index's) ``/metrics``, the picker's view of a model
server, and a process's memory."""

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


def picker_gauges(index: str, server: str) -> dict[str, float]:
    """The picker's gauges ``kvpool_index_model_server_<name>`` of the model server at the
    address ``server``, by name, from one read of the index's ``/metrics`` at the URL
    ``index``."""
    prefix, label = "kvpool_index_model_server_", f'server="{server}"'
    gauges = {}
    for line in httpx.get(f"{index}/metrics").text.splitlines():
        if line.startswith(prefix) and label in line:
            gauges[line[len(prefix) :].split("{", 1)[0]] = float(line.rsplit(" ", 1)[1])
    return gauges


def stays_in_the_pick(index: str, server: str) -> bool:
    """The picker of the index at ``index`` sees the model server ``server`` ready, with at
    most one slow read in a row. A server stays ready until its third slow read in a row:
    one seen ready after two can drop out a moment later (on two loaded cores, a server busy
    with a long prompt reads slowly); after one, it takes two more reads, over a second,
    which a pick made right after this check does not wait for. (Asking for no slow read
    at all may never come true while a queue lasts.)"""
    gauges = picker_gauges(index, server)
    return gauges.get("ready") == 1 and gauges.get("slow_reads", 0.0) <= 1


def memory_bytes(pid: int, field: str = "VmRSS") -> int:
    """``VmRSS`` (resident now) or ``VmHWM`` (peak resident) of a process, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) << 10
    raise RuntimeError(f"no {field} for process {pid}")
