"""Fixtures every test folder may use: the Kubernetes API server emulator and kubectl."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

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
