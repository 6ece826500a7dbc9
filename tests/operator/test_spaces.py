"""Shared spaces through the real operator (``kvpool-operator`` for every namespace, in a
subprocess, shared with the other modules: ``conftest.py``) against the emulated API server,
driven with kubectl as a platform team would.

Each test has its own pool, ``inference-<n>/shared``, in namespaces of its own: it admits
the namespaces labelled ``kvpool.io/team-access: shared``; its spaces admit some of them by
name. Its two agents are stand-ins
(:class:`~tests.operator.agent_stub.AgentStub`, on 127.0.0.1 and 127.0.0.2 at the pool's
http port) that record the operator's calls: usage, clearing, pins and warming.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvpool.common.keys import ModelFingerprint, chunk_keys, tenant_id
from kvpool.common.quotas import TierLimits, as_limits, quota_from_configmap
from kvpool.common.tenants_configmap import SpaceEntry, space_key, token_digest
from kvpool.operator.render import Pool
from tests.operator.agent_stub import AgentStub, Call
from tests.operator.cluster_view import (
    agent_pod,
    apply,
    condition,
    config_map,
    event,
    namespace,
    secret_values,
    status,
)
from tests.support.kube_api import ServedApi
from tests.support.operator_process import Kubectl, OperatorProcess
from tests.support.polling import eventually
from tests.support.ports import free_port

pytestmark = pytest.mark.process

POOL_NAMESPACE = "inference"
POOL = Pool("shared", POOL_NAMESPACE, "")
TEAMS = ("team-a", "team-b", "team-c")
ACCESS = {"kvpool.io/team-access": "shared"}
TENANTS_CM = "kvpool-shared-tenants"
QUOTAS_CM = "kvpool-shared-quotas"
SPACES_SECRET = "kvpool-shared-spaces"
AGENT_ADDRESSES = ("127.0.0.1", "127.0.0.2")
GiB = 1 << 30
FINGERPRINT = {"model": "m", "dtype": "bfloat16", "kvLayout": "nhd", "tpSize": 2}


def _docs(teams: tuple[str, ...]) -> dict[str, Any]:
    """The space of the first two teams, owned by the first."""
    return {
        "name": "docs",
        "quota": {"l1": "2Gi", "nvme": "4Gi"},
        "pinBudget": "1Gi",
        "allowedNamespaces": list(teams[:2]),
        "owners": [teams[0]],
    }


DOCS = _docs(TEAMS)
"""The pool namespace, the teams, the pool and this space: each test's own (``_own_pool``)."""


def _pool(name: str, http_port: int, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "kvpool.io/v1alpha1",
        "kind": "KVCachePool",
        "metadata": {"name": name, "namespace": POOL_NAMESPACE},
        "spec": {
            "chunkTokens": 16,
            "blockSize": 16,
            "ports": {"http": http_port},
            "tenants": {"allowedNamespaces": {"matchLabels": ACCESS}},
            **spec,
        },
    }


@pytest.fixture
def http_port() -> int:
    return free_port()


@pytest.fixture
def agents(http_port: int) -> Iterator[list[AgentStub]]:
    stubs = [AgentStub(address, http_port).start() for address in AGENT_ADDRESSES]
    yield stubs
    for stub in stubs:
        stub.stop()


@pytest.fixture(autouse=True)
def _own_namespaces(namespaces: Callable[[str], str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test's own namespaces (POOL_NAMESPACE and TEAMS, read by the helpers), and its
    space DOCS of them."""
    pool_namespace = namespaces("inference")
    teams = tuple(namespaces(team) for team in ("team-a", "team-b", "team-c"))
    for name, value in (
        ("POOL_NAMESPACE", pool_namespace),
        ("POOL", Pool("shared", pool_namespace, "")),
        ("TEAMS", teams),
        ("DOCS", _docs(teams)),
    ):
        monkeypatch.setitem(globals(), name, value)


@pytest.fixture(autouse=True)
def _own_pool(
    _own_namespaces: None,
    kubectl: Kubectl,
    operator: OperatorProcess,
    http_port: int,
    agents: list[AgentStub],
) -> None:
    """Each test's pool with the space DOCS, its two agents (stand-ins) and a tenant of each
    team."""
    apply(kubectl, namespace(POOL_NAMESPACE, {}))
    for team in TEAMS:
        apply(kubectl, namespace(team, ACCESS))
    apply(kubectl, _pool("shared", http_port, sharedSpaces=[DOCS]))
    for number, address in enumerate(AGENT_ADDRESSES, 1):
        agent_pod(kubectl, POOL, f"kvpool-shared-agent-x{number}", address)
    for team, name in zip(TEAMS, ("alpha", "beta", "gamma"), strict=True):
        _tenant(kubectl, team, name)


def _tenant(kubectl: Kubectl, team: str, name: str) -> None:
    apply(
        kubectl,
        {
            "apiVersion": "kvpool.io/v1alpha1",
            "kind": "KVCacheTenant",
            "metadata": {"name": name, "namespace": team},
            "spec": {
                "poolRef": {"name": "shared", "namespace": POOL_NAMESPACE},
                "quota": {"l1": "1Gi"},
            },
        },
    )


def _spaces(kubectl: Kubectl, *spaces: dict[str, Any], **spec: Any) -> None:
    """Set the pool's spaces (and other fields of its spec)."""
    patch = json.dumps({"spec": {"sharedSpaces": list(spaces), **spec}})
    kubectl("patch", "kvp", "shared", "-n", POOL_NAMESPACE, "--type=merge", "-p", patch)


def _salt(api: ServedApi, space: str = "docs") -> str:
    salts = secret_values(api, POOL_NAMESPACE, SPACES_SECRET)
    assert space in salts, f"no salt for the space {space} yet"
    return salts[space]


def _tenant_secret(api: ServedApi, team: str, name: str) -> dict[str, str]:
    return secret_values(api, team, f"{name}-kvpool")


def _space_entry(api: ServedApi, space: str) -> SpaceEntry:
    data = config_map(api, POOL_NAMESPACE, TENANTS_CM)
    assert space_key(space) in data, f"no entry for the space {space}"
    return SpaceEntry.decode(data[space_key(space)])


def _pool_spaces(api: ServedApi) -> dict[str, dict[str, Any]]:
    spaces = status(api, "kvcachepools", POOL_NAMESPACE, "shared").get("sharedSpaces") or ()
    return {space["name"]: space for space in spaces}


def _spaces_condition(api: ServedApi) -> tuple[str, str, str]:
    return condition(api, "kvcachepools", POOL_NAMESPACE, "shared", "SharedSpaces")


def _admitted_to(api: ServedApi, team: str, name: str) -> list[str]:
    spaces: list[str] = status(api, "kvcachetenants", team, name).get("sharedSpaces") or []
    return spaces


def test_a_space_gets_a_salt_and_the_tenants_it_admits_get_it(
    served_api: ServedApi, operator: OperatorProcess
) -> None:
    salt = eventually(lambda: _salt(served_api))
    space = tenant_id(salt)
    secret = served_api.objects("secrets", POOL_NAMESPACE)[SPACES_SECRET]
    assert [owner["kind"] for owner in secret["metadata"]["ownerReferences"]] == ["KVCachePool"]

    def handed_out() -> tuple[str, str]:
        alpha = _tenant_secret(served_api, TEAMS[0], "alpha")
        beta = _tenant_secret(served_api, TEAMS[1], "beta")
        assert alpha.get("space-docs") == beta.get("space-docs") == salt
        return alpha["tenant-id"], beta["tenant-id"]

    alpha, beta = eventually(handed_out)
    gamma = eventually(lambda: _tenant_secret(served_api, TEAMS[2], "gamma")["tenant-id"])
    assert "space-docs" not in _tenant_secret(served_api, TEAMS[2], "gamma")
    assert {"salt", "token", "tenant-id"} <= set(_tenant_secret(served_api, TEAMS[0], "alpha"))

    def published() -> None:
        assert _space_entry(served_api, space) == SpaceEntry(
            f"{POOL_NAMESPACE}/shared/docs", frozenset({alpha, beta}), frozenset({alpha}), GiB
        )

    eventually(published)
    quota = config_map(served_api, POOL_NAMESPACE, QUOTAS_CM)[space]
    assert as_limits(quota_from_configmap(quota)) == TierLimits(2 * GiB, 4 * GiB)
    assert gamma not in _space_entry(served_api, space).members

    eventually(lambda: _admitted_to(served_api, TEAMS[0], "alpha") == ["docs"] or _no())
    assert _admitted_to(served_api, TEAMS[2], "gamma") == []
    assert "space-docs" in event(served_api, TEAMS[0], "alpha", "Normal", "SpaceAdmitted")

    def reported() -> None:
        docs = _pool_spaces(served_api)["docs"]
        assert (docs["tenantId"], docs["members"]) == (
            space,
            [f"{TEAMS[0]}/alpha", f"{TEAMS[1]}/beta"],
        )
        assert (docs["usage"]["l1Bytes"], docs["usage"]["agents"]) == (2 * 4096, 2)
        assert _spaces_condition(served_api)[:2] == ("True", "SpacesPublished")

    eventually(reported)
    assert space in event(served_api, POOL_NAMESPACE, "shared", "Normal", "SpaceCreated")


def _no() -> bool:
    raise AssertionError("not yet")


def test_a_namespace_removed_from_a_space_is_revoked(
    served_api: ServedApi, kubectl: Kubectl, operator: OperatorProcess
) -> None:
    space = tenant_id(eventually(lambda: _salt(served_api)))
    beta = eventually(lambda: _tenant_secret(served_api, TEAMS[1], "beta")["tenant-id"])
    eventually(lambda: beta in _space_entry(served_api, space).members or _no())

    _spaces(kubectl, {**DOCS, "allowedNamespaces": [TEAMS[0]]})

    def revoked() -> None:
        assert beta not in _space_entry(served_api, space).members
        assert "space-docs" not in _tenant_secret(served_api, TEAMS[1], "beta")
        assert _admitted_to(served_api, TEAMS[1], "beta") == []

    eventually(revoked)
    assert "docs" in event(served_api, TEAMS[1], "beta", "Normal", "SpaceRevoked")
    assert _tenant_secret(served_api, TEAMS[0], "alpha")["space-docs"] == _salt(served_api)

    _spaces(kubectl, DOCS)
    eventually(lambda: beta in _space_entry(served_api, space).members or _no())


def test_a_refused_or_deleted_tenant_leaves_the_space(
    served_api: ServedApi, kubectl: Kubectl, operator: OperatorProcess
) -> None:
    space = tenant_id(eventually(lambda: _salt(served_api)))
    _tenant(kubectl, TEAMS[1], "delta")
    delta = eventually(lambda: _tenant_secret(served_api, TEAMS[1], "delta")["tenant-id"])
    eventually(lambda: delta in _space_entry(served_api, space).members or _no())

    apply(kubectl, namespace(TEAMS[1], {}))  # the pool admits the team no more: refused

    def refused() -> None:
        assert delta not in _space_entry(served_api, space).members
        assert "space-docs" not in _tenant_secret(served_api, TEAMS[1], "delta")

    eventually(refused)
    apply(kubectl, namespace(TEAMS[1], ACCESS))
    eventually(lambda: delta in _space_entry(served_api, space).members or _no())

    kubectl("delete", "kvt", "delta", "-n", TEAMS[1], "--wait=false")
    eventually(lambda: delta not in _space_entry(served_api, space).members or _no())


def _last(agent: AgentStub, method: str, path: str) -> Call:
    calls = agent.made(method, path)
    assert calls, f"no {method} {path} on an agent yet"
    return calls[-1]


def _chains(salt: str, tokens: list[int]) -> list[list[str]]:
    """The keys of a pinned prefix per rank, as the connector computes the shared chunks of
    a request with a structured cache_salt: under the space's salt."""
    return [
        [
            key.hex()
            for key in chunk_keys(
                tokens,
                salt,
                ModelFingerprint("m", "bfloat16", "nhd", tp_rank=rank, tp_size=2, chunk_tokens=16),
            )
        ]
        for rank in range(2)
    ]


def _pinned(salt: str, tokens: list[int]) -> list[str]:
    """What a pin names: every rank's keys, chunk by chunk."""
    first, second = _chains(salt, tokens)
    return [key for pair in zip(first, second, strict=True) for key in pair]


def test_pinned_prefixes_are_pinned_and_warmed_on_every_agent(
    served_api: ServedApi, kubectl: Kubectl, agents: list[AgentStub]
) -> None:
    salt = eventually(lambda: _salt(served_api))
    space = tenant_id(salt)
    prompt, greeting = list(range(1000, 1040)), list(range(7, 23))
    pinned = [
        {"name": "prompt", "tokens": prompt},
        {"name": "greeting", "tokens": greeting, "warm": False},
    ]
    _spaces(kubectl, {**DOCS, "pinned": pinned})

    def refused() -> str:
        state, reason, message = _spaces_condition(served_api)
        assert (state, reason) == ("False", "PinsNeedFingerprint")
        return message

    message = eventually(refused)
    assert message == (
        "the space docs has pinned prefixes but the pool has no spec.index.fingerprint to key "
        "them with: none is pinned"
    )
    assert not any(agent.made("PUT", f"/v1/tenants/{space}/pins/prompt") for agent in agents)

    _spaces(kubectl, {**DOCS, "pinned": pinned}, index={"fingerprint": FINGERPRINT})
    operator_digest = json.loads(config_map(served_api, POOL_NAMESPACE, TENANTS_CM)["operator"])

    def pinned_everywhere() -> None:
        for agent in agents:
            put = _last(agent, "PUT", f"/v1/tenants/{space}/pins/prompt")
            assert put.body == {"keys": _pinned(salt, prompt)}
            assert len(put.body["keys"]) == 4  # two full chunks, two ranks
            assert [token_digest(put.token)] == operator_digest["tokens"]
            warmed = [call.body for call in agent.made("POST", f"/v1/tenants/{space}/warm")]
            assert all({"keys": chain} in warmed for chain in _chains(salt, prompt))
            greet = _last(agent, "PUT", f"/v1/tenants/{space}/pins/greeting")
            assert greet.body == {"keys": _pinned(salt, greeting)}
            assert not any({"keys": chain} in warmed for chain in _chains(salt, greeting))
        assert _spaces_condition(served_api)[:2] == ("True", "SpacesPublished")
        assert _pool_spaces(served_api)["docs"]["pinned"] == ["greeting", "prompt"]

    eventually(pinned_everywhere)

    _spaces(kubectl, {**DOCS, "pinned": pinned[:1]}, index={"fingerprint": FINGERPRINT})

    def unpinned() -> None:
        for agent in agents:
            assert agent.made("DELETE", f"/v1/tenants/{space}/pins/greeting")
        assert _pool_spaces(served_api)["docs"]["pinned"] == ["prompt"]

    eventually(unpinned)


def test_an_agent_that_fails_is_named_in_the_condition(
    served_api: ServedApi, kubectl: Kubectl, agents: list[AgentStub]
) -> None:
    prompt = [{"name": "prompt", "tokens": list(range(1000, 1040))}]
    _spaces(kubectl, {**DOCS, "pinned": prompt}, index={"fingerprint": FINGERPRINT})
    eventually(lambda: _pool_spaces(served_api)["docs"]["pinned"] == ["prompt"] or _no())
    eventually(lambda: _spaces_condition(served_api)[:2] == ("True", "SpacesPublished") or _no())
    agents[1].failing = True
    try:

        def failing() -> str:
            """A whole pass with the agent down (not one it went down in the middle of)."""
            state, reason, message = _spaces_condition(served_api)
            assert (state, reason) == ("False", "PinsIncomplete"), message
            assert message.startswith("pinning prompt of the space docs failed on 1 agents: ")
            assert "warming prompt of the space docs (rank 0) failed on 1 agents" in message
            assert _pool_spaces(served_api)["docs"]["usage"]["agents"] == 1  # the pass went on
            return message

        message = eventually(failing)
        assert f"{AGENT_ADDRESSES[1]}:" in message and "503" in message
        assert "\n" not in message
    finally:
        agents[1].failing = False
    eventually(lambda: _spaces_condition(served_api)[:2] == ("True", "SpacesPublished") or _no())


def test_deleting_a_space_revokes_it_and_clears_its_chunks(
    served_api: ServedApi, kubectl: Kubectl, agents: list[AgentStub]
) -> None:
    salt = eventually(lambda: _salt(served_api))
    space = tenant_id(salt)
    eventually(lambda: "space-docs" in _tenant_secret(served_api, TEAMS[0], "alpha") or _no())

    _spaces(kubectl)

    def removed() -> None:
        data = config_map(served_api, POOL_NAMESPACE, TENANTS_CM)
        assert space_key(space) not in data
        assert space not in config_map(served_api, POOL_NAMESPACE, QUOTAS_CM)
        assert "docs" not in secret_values(served_api, POOL_NAMESPACE, SPACES_SECRET)
        assert "space-docs" not in _tenant_secret(served_api, TEAMS[0], "alpha")
        assert _admitted_to(served_api, TEAMS[0], "alpha") == []
        for agent in agents:
            assert agent.made("POST", f"/v1/tenants/{space}/clear?tiers=all")
        pool = status(served_api, "kvcachepools", POOL_NAMESPACE, "shared")
        assert "sharedSpaces" not in pool
        assert "SharedSpaces" not in [c["type"] for c in pool["conditions"]]

    eventually(removed)
    message = event(served_api, POOL_NAMESPACE, "shared", "Normal", "SpaceRemoved")
    assert message == (
        f"removed the shared space docs (tenant id {space}): its members are revoked, 4 chunks "
        "dropped from L1 and 2 objects from L2 by 2 agents, its quota dropped"
    )
    assert "docs" in event(served_api, TEAMS[0], "alpha", "Normal", "SpaceRevoked")


def test_an_invalid_space_is_reported_on_one_line(
    served_api: ServedApi, kubectl: Kubectl, operator: OperatorProcess, http_port: int
) -> None:
    space = {**DOCS, "owners": [TEAMS[2]]}
    apply(kubectl, _pool("odd", http_port, sharedSpaces=[space]))

    def reported() -> str:
        state, reason, message = condition(
            served_api, "kvcachepools", POOL_NAMESPACE, "odd", "Degraded"
        )
        assert (state, reason) == ("True", "InvalidSpec")
        return message

    assert eventually(reported) == (
        "spec.sharedSpaces.0.owners: Value error, owners must each be in allowedNamespaces; "
        f"{TEAMS[2]} is not"
    )
    assert SPACES_SECRET.replace("shared", "odd") not in served_api.objects(
        "secrets", POOL_NAMESPACE
    )


def test_space_salts_never_leave_secrets(
    served_api: ServedApi, kubectl: Kubectl, operator: OperatorProcess
) -> None:
    """The salt of a space is in no object but Secrets (nor in an earlier version of one, nor
    in a watch event) and not in the operator's log."""
    _spaces(kubectl, {**DOCS, "name": "notes"})
    salt = eventually(lambda: _salt(served_api, "notes"))
    eventually(
        lambda: _tenant_secret(served_api, TEAMS[0], "alpha").get("space-notes") == salt or _no()
    )

    async def everything_but_secrets() -> str:
        api = served_api.api
        async with api._lock:
            stored = [
                [dict(version) for version in obj.history if version is not None]
                for (resource, _, _), obj in api.objects.items()
                if resource.plural != "secrets"
            ]
            logged = [event for resource, event in api._log if resource.plural != "secrets"]
        return json.dumps([stored, logged], default=dict)

    def published() -> str:  # the space's tenant id, in the tenants ConfigMap and statuses
        text = served_api.call(everything_but_secrets())
        assert tenant_id(salt) in text and "sharedSpaces" in text
        return text

    text = eventually(published)
    assert salt not in text
    assert salt not in operator.log()
