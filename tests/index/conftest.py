"""Shared helpers of the index tests: keys, waiting, real agent processes."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvpool_agent.testing.agent_process import AgentProcess


def key(name: str | int) -> bytes:
    return hashlib.sha256(str(name).encode()).digest()


def chain(name: str, length: int) -> list[bytes]:
    """``length`` opaque keys standing for one prompt's chain."""
    return [key(f"{name}/{position}") for position in range(length)]


def wait_until(condition: Callable[[], object], timeout: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what or condition}"
        time.sleep(0.01)


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
