"""Shared helpers of the index tests: keys, waiting, real agent processes."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.agent_process import AgentProcess


def start_all(processes: list[AgentProcess]) -> None:
    """Start agents side by side (each takes a second or two to become ready)."""
    errors: list[BaseException] = []

    def start(process: AgentProcess) -> None:
        try:
            process.start()
        except BaseException as error:  # reported by the caller's thread
            errors.append(error)

    threads = [threading.Thread(target=start, args=(process,)) for process in processes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


@pytest.fixture
def make_agents(tmp_path: Path) -> Iterator[Callable[..., list[AgentProcess]]]:
    """``make_agents(n, **settings)``: n real agents, not started; cleaned up afterwards."""
    made: list[AgentProcess] = []

    def make(count: int, **settings: str) -> list[AgentProcess]:
        processes = []
        for _ in range(count):
            workdir = tmp_path / f"agent-{len(made)}"
            workdir.mkdir()
            process = AgentProcess(workdir, settings=dict(settings))
            made.append(process)
            processes.append(process)
        return processes

    yield make
    for process in made:
        process.cleanup()
