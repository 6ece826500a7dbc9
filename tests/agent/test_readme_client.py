"""The README's client library example runs, as written, against a real agent (only its
address and token file are this agent's)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvpool_agent.testing.agent_process import ENGINE_TOKEN, AgentProcess

pytestmark = pytest.mark.process

README = Path(__file__).resolve().parents[2] / "README.md"


def _example() -> str:
    section = README.read_text().split("### The client library", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None, "the README's client library section has no example"
    return match.group(1)


def test_the_readme_client_example_runs(agent_process: AgentProcess) -> None:
    agent = agent_process.start()
    code = _example()
    code, endpoints = re.subn(r'^ENDPOINT = ".*"$', f"ENDPOINT = {agent.zmq!r}", code, flags=re.M)
    code, tokens = re.subn(r"^TOKEN = .*$", f"TOKEN = {ENGINE_TOKEN!r}", code, flags=re.M)
    assert (endpoints, tokens) == (1, 1), "the example names its endpoint and token otherwise"
    exec(compile(code, str(README), "exec"), {})
