"""Fixtures every test folder may use: a real agent process, the Kubernetes API server
emulator and kubectl; and the guard that keeps the ``process`` marker true."""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.support.agent_process import AgentProcess

if TYPE_CHECKING:  # imported by the fixtures: the GPU machine has no Kubernetes test stack
    from tests.support.kube_api import ServedApi
    from tests.support.operator_process import Kubectl

SHARED_MEMORY = Path("/dev/shm")

# The test now running (its fixtures' setup and teardown included), for the audit hook below.
_running: list[pytest.Item] = []
_STARTS_A_PROCESS = frozenset({"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn"})


def _only_process_tests_start_processes(event: str, _args: tuple[object, ...]) -> None:
    """``make test-fast`` leaves out the tests marked ``process``: one that starts a process
    without the mark fails here, naming the mark it lacks."""
    if event in _STARTS_A_PROCESS and _running and not _running[-1].get_closest_marker("process"):
        raise RuntimeError(
            f"{_running[-1].nodeid} starts a process ({event}) but is not marked `process`"
        )


sys.addaudithook(_only_process_tests_start_processes)


LONGEST_FIRST = (
    "e2e/test_e2e.py",
    "tests/system/test_bench_cluster.py",
    "tests/system/test_bench_cluster_pd.py",
    "tests/system/test_disaggregation.py",
)
"""Modules that take minutes each (the e2e flow about 3, each cluster bench about 5): they
are collected first, so that make test's workers take them first (Makefile: PYTEST_JOBS
keeps the collection order). A long module taken last runs alone at the end while the other
worker waits."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: not item.nodeid.startswith(LONGEST_FIRST))  # stable


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, None, None]:
    _running.append(item)
    try:
        yield
    finally:
        _running.pop()


def _left_in_shared_memory() -> list[Path]:
    """What this test process made in /dev/shm and left: its harness agents' segments, probe
    tables and locks, and the segments tests make themselves (``kvpool-<what>-<pid>...``)."""
    mine = re.compile(rf"\.?kvpool-[a-z-]+-{os.getpid()}(?:[-.]|$)")
    return sorted(path for path in SHARED_MEMORY.iterdir() if mine.match(path.name))


@pytest.fixture(scope="session", autouse=True)
def no_shared_memory_left() -> Iterator[None]:
    """A test removes what it made in /dev/shm, even for an agent it killed: a run that
    leaves anything there fails (what it left is removed, and named). Files there before
    the run are another process's that had this pid (a run that was killed)."""
    before = set(_left_in_shared_memory())
    yield
    left = [path for path in _left_in_shared_memory() if path not in before]
    for path in left:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    assert not left, f"the tests left {len(left)} files in {SHARED_MEMORY}: " + ", ".join(
        path.name for path in left
    )


@pytest.fixture(scope="module")
def served_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedApi]:
    from tests.support.kube_api import ServedApi

    api = ServedApi(tmp_path_factory.mktemp("api")).start()
    yield api
    api.stop()


@pytest.fixture(scope="module")
def kubectl(served_api: ServedApi) -> Kubectl:
    from tests.support.operator_process import Kubectl

    return Kubectl(served_api.kubeconfig())


@pytest.fixture
def agent_process(tmp_path: Path) -> Iterator[AgentProcess]:
    """A real agent process (not started: set ``settings`` first, then call ``start()``)."""
    process = AgentProcess(tmp_path)
    yield process
    process.cleanup()
