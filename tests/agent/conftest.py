"""Fixtures of the agent's tests: a clock the tests move, a real agent process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool_agent.testing.agent_process import AgentProcess
from tests.support.l1 import FakeClock


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def agent_process(tmp_path: Path) -> Iterator[AgentProcess]:
    """A real agent process (not started: set ``settings`` first, then call ``start()``)."""
    process = AgentProcess(tmp_path)
    yield process
    process.cleanup()
