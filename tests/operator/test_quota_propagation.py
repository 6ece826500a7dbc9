"""Quota propagation between real agents: a quota set over one agent's HTTP API applies in
another agent of the pool, through the pool's quota ConfigMap on the emulated API server."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvpool.common.keys import tenant_id
from tests.support.agent_process import ADMIN_TOKEN, AgentProcess
from tests.support.kube_api import ServedApi
from tests.support.operator_process import Kubectl
from tests.support.polling import eventually

pytestmark = pytest.mark.process

NAME = "kvpool-main-quotas"
ALICE = tenant_id("alice")
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture
def agents(
    served_api: ServedApi,
    kubectl: Kubectl,
    namespaces: Callable[[str], str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[list[AgentProcess]]:
    """Two agents of a pool in a namespace of the test's own."""
    namespace = namespaces("inference")
    manifest = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": NAME}}
    kubectl("apply", "--validate=false", "-n", namespace, "-f", "-", manifest=manifest)
    monkeypatch.setenv("KUBECONFIG", str(served_api.kubeconfig()))
    processes = []
    for index in range(2):
        workdir = tmp_path / f"agent-{index}"
        workdir.mkdir()
        processes.append(AgentProcess(workdir, {"QUOTA_CONFIGMAP": f"{namespace}/{NAME}"}))
    try:
        yield [process.start() for process in processes]
    finally:
        for process in processes:
            process.cleanup()


def _quota(agent: AgentProcess) -> dict[str, Any]:
    response = httpx.get(f"{agent.http}/v1/tenants/{ALICE}/quota", headers=ADMIN, timeout=5)
    response.raise_for_status()
    quota: dict[str, Any] = response.json()
    return quota


def test_a_quota_set_through_one_agent_applies_in_the_other(agents: list[AgentProcess]) -> None:
    first, second = agents
    assert _quota(second)["explicit"] is False
    url = f"{first.http}/v1/tenants/{ALICE}/quota"
    httpx.put(url, json={"limit_bytes": 1 << 20}, headers=ADMIN, timeout=5).raise_for_status()

    def applied() -> None:
        quota = _quota(second)
        assert (quota["limit_bytes"], quota["explicit"]) == (1 << 20, True)

    eventually(applied, timeout=5)
    httpx.delete(f"{second.http}/v1/tenants/{ALICE}/quota", headers=ADMIN, timeout=5)
    eventually(lambda: _quota(first)["explicit"] is False or _fail(), timeout=5)


def test_a_restarted_agent_has_the_pools_quotas(agents: list[AgentProcess]) -> None:
    first, second = agents
    url = f"{first.http}/v1/tenants/{ALICE}/quota"
    httpx.put(url, json={"limit_bytes": 4096}, headers=ADMIN, timeout=5).raise_for_status()
    assert second.stop() == 0
    second.start()
    assert _quota(second)["limit_bytes"] == 4096


def _fail() -> bool:
    raise AssertionError("not yet")
