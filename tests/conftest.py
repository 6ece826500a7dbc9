"""Fixtures every test folder may use: a real agent process, the Kubernetes API server
emulator and kubectl."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool_agent.testing.agent_process import AgentProcess
from tests.support.kube_api import ServedApi
from tests.support.operator_process import Kubectl


@pytest.fixture(scope="module")
def served_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedApi]:
    api = ServedApi(tmp_path_factory.mktemp("api")).start()
    yield api
    api.stop()


@pytest.fixture(scope="module")
def kubectl(served_api: ServedApi) -> Kubectl:
    return Kubectl(served_api.kubeconfig())


@pytest.fixture
def agent_process(tmp_path: Path) -> Iterator[AgentProcess]:
    """A real agent process (not started: set ``settings`` first, then call ``start()``)."""
    process = AgentProcess(tmp_path)
    yield process
    process.cleanup()
