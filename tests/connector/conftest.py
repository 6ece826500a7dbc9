"""Fixtures the connector's tests against a real agent share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvpool.client import AgentClient
from tests.support.agent_process import ADMIN_TOKEN, AgentProcess


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    """An agent process for the test module."""
    process = AgentProcess(tmp_path_factory.mktemp("agent"))
    process.start()
    yield process
    process.cleanup()


@pytest.fixture
def empty_agent(agent: AgentProcess) -> AgentProcess:
    """The module's agent, holding nothing."""
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
        client.clear()
    return agent
