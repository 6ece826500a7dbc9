"""Shared spaces from the operator to real agents: ``kvpool-operator`` and two
``kvpool-agent`` processes on the emulated API server. What the operator writes is what the
agents act on: members' tokens reach the space's chunks over ZMQ, owners' may also read its
pins, the operator's pins land in L1 within the space's budget, and un-admitting a namespace
or removing the space takes all of it back. The operator is the one every module shares
(``conftest.py``); the pool and its teams are in namespaces of the test's own."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from kvpool.client import AgentClient, AgentError
from kvpool.common.keys import ModelFingerprint, chunk_keys, shared_salt, tenant_id
from kvpool.operator.render import Pool
from tests.operator.cluster_view import agent_pod, apply, namespace, secret_values
from tests.operator.pool_agents import pool_agents
from tests.support.agent_process import ADMIN_TOKEN, AgentProcess
from tests.support.kube_api import ServedApi
from tests.support.operator_process import Kubectl, OperatorProcess
from tests.support.polling import eventually
from tests.support.ports import free_port

pytestmark = pytest.mark.process

POOL_NAMESPACE = "inference"
POOL = Pool("shared", POOL_NAMESPACE, "")
TEAMS = ("team-a", "team-b", "team-c")
"""The namespaces of the pool and of its teams: each test's own (``_own_namespaces``)."""
ACCESS = {"kvpool.io/team-access": "shared"}
AGENT_ADDRESSES = ("127.0.0.1", "127.0.0.2")
PROMPT = list(range(500, 532))  # two chunks of 16
FINGERPRINT = {"model": "m", "dtype": "bfloat16", "kvLayout": "nhd"}


def _docs() -> dict[str, Any]:
    """The space of the first two teams, owned by the first."""
    return {
        "name": "docs",
        "quota": {"l1": "4Mi"},
        "pinBudget": "1Mi",
        "allowedNamespaces": list(TEAMS[:2]),
        "owners": [TEAMS[0]],
        "pinned": [{"name": "prompt", "tokens": PROMPT}],
    }


def _pool(http_port: int, *spaces: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "kvpool.io/v1alpha1",
        "kind": "KVCachePool",
        "metadata": {"name": "shared", "namespace": POOL_NAMESPACE},
        "spec": {
            "chunkTokens": 16,
            "blockSize": 16,
            "ports": {"http": http_port},
            "tenants": {"allowedNamespaces": {"matchLabels": ACCESS}},
            "index": {"fingerprint": FINGERPRINT},
            "sharedSpaces": list(spaces),
        },
    }


@pytest.fixture
def http_port() -> int:
    return free_port()


@pytest.fixture(autouse=True)
def _own_namespaces(namespaces: Callable[[str], str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test's own namespaces, as POOL_NAMESPACE and TEAMS (read by the helpers)."""
    pool_namespace = namespaces("inference")
    monkeypatch.setitem(globals(), "POOL_NAMESPACE", pool_namespace)
    monkeypatch.setitem(globals(), "POOL", Pool("shared", pool_namespace, ""))
    teams = tuple(namespaces(team) for team in ("team-a", "team-b", "team-c"))
    monkeypatch.setitem(globals(), "TEAMS", teams)


@pytest.fixture
def agents(
    served_api: ServedApi,
    kubectl: Kubectl,
    operator: OperatorProcess,
    http_port: int,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[list[AgentProcess]]:
    """The pool (with the space ``docs``), its namespaces and its agents."""
    apply(kubectl, namespace(POOL_NAMESPACE, {}))
    for team in TEAMS:
        apply(kubectl, namespace(team, ACCESS))
    apply(kubectl, _pool(http_port, _docs()))
    for number, address in enumerate(AGENT_ADDRESSES, 1):
        agent_pod(kubectl, POOL, f"kvpool-shared-agent-x{number}", address)
    with pool_agents(served_api, POOL, http_port, AGENT_ADDRESSES, tmp_path_factory) as started:
        yield started


def _tenant(kubectl: Kubectl, team: str, name: str) -> None:
    apply(
        kubectl,
        {
            "apiVersion": "kvpool.io/v1alpha1",
            "kind": "KVCacheTenant",
            "metadata": {"name": name, "namespace": team},
            "spec": {
                "poolRef": {"name": "shared", "namespace": POOL_NAMESPACE},
                "quota": {"l1": "4Mi"},
            },
        },
    )


def _secret(api: ServedApi, team: str, name: str) -> dict[str, str]:
    values = secret_values(api, team, f"{name}-kvpool")
    assert "token" in values, f"{team}/{name} has no token yet"
    return values


def _pins(agent: AgentProcess, space: str, token: str) -> httpx.Response:
    return httpx.get(
        f"{agent.http}/v1/tenants/{space}/pins", headers={"Authorization": f"Bearer {token}"}
    )


def _stores(agent: AgentProcess, token: str, space: str) -> bool:
    """Whether the token may store a chunk of the space (False: forbidden); a member stores
    through the agent's messages (it maps the space's file read-only)."""
    with AgentClient(agent.zmq, token=token) as client:
        try:
            client.store_inline(space, [b"k" * 32], [b"system prompt"])
        except AgentError as error:
            assert error.code == "forbidden", error
            return False
    return True


def _on_every_agent(agents: list[AgentProcess], check: Callable[[AgentProcess], None]) -> None:
    for agent in agents:
        check(agent)


def test_members_owners_and_pins_on_real_agents_and_their_revocation(
    served_api: ServedApi, kubectl: Kubectl, http_port: int, agents: list[AgentProcess]
) -> None:
    tenants = list(zip(TEAMS, ("alpha", "beta", "gamma"), strict=True))
    for team, name in tenants:
        _tenant(kubectl, team, name)
    alpha, beta, gamma = (
        eventually(lambda team=team, name=name: _secret(served_api, team, name))
        for team, name in tenants
    )
    salt = eventually(lambda: _secret(served_api, TEAMS[0], "alpha")["space-docs"])
    space = tenant_id(salt)

    def admitted(agent: AgentProcess) -> None:
        assert _stores(agent, alpha["token"], space)
        assert _stores(agent, beta["token"], space)
        assert not _stores(agent, gamma["token"], space)
        assert _pins(agent, space, alpha["token"]).status_code == 200  # an owner
        assert _pins(agent, space, beta["token"]).status_code == 403  # a member only

    eventually(lambda: _on_every_agent(agents, admitted))

    model = ModelFingerprint("m", "bfloat16", "nhd", chunk_tokens=16)
    keys = chunk_keys(PROMPT, salt, model)
    assert chunk_keys([*PROMPT, 1, 2, 3], shared_salt(salt, 32, beta["salt"]), model)[:2] == keys

    def pinned(agent: AgentProcess) -> None:
        answer = _pins(agent, space, ADMIN_TOKEN).json()
        assert answer["budget_bytes"] == 1 << 20
        assert [(pin["name"], pin["keys"]) for pin in answer["pins"]] == [("prompt", len(keys))]

    eventually(lambda: _on_every_agent(agents, pinned))

    apply(kubectl, _pool(http_port, {**_docs(), "allowedNamespaces": [TEAMS[0]]}))

    def beta_revoked(agent: AgentProcess) -> None:
        assert not _stores(agent, beta["token"], space)
        assert _stores(agent, alpha["token"], space)

    eventually(lambda: _on_every_agent(agents, beta_revoked))

    apply(kubectl, _pool(http_port))

    def removed(agent: AgentProcess) -> None:
        assert not _stores(agent, alpha["token"], space)
        assert _pins(agent, space, ADMIN_TOKEN).json()["pins"] == []
        assert "space-docs" not in secret_values(served_api, TEAMS[0], "alpha-kvpool")

    eventually(lambda: _on_every_agent(agents, removed))
