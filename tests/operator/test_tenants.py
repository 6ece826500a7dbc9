"""KVCacheTenants through the real operator (``kvpool-operator`` for every namespace, in a
subprocess, shared with the other modules: ``conftest.py``) against the emulated API server,
driven with kubectl as a team would. Each test's tenants are in namespaces of its own.

The module's pool, ``inference-<n>/shared``, admits the namespaces labelled ``kvpool.io/team-access:
shared`` with at most 16Gi of L1 per tenant. Its agents are two real ``kvpool-agent``
processes (on 127.0.0.1 and 127.0.0.2, each with an NVMe tier, at the pool's http port),
watching the pool's tenants and quota ConfigMaps on the same API server; two agent pods
carry their addresses in ``status.podIP``, which is how the operator finds them.
"""

from __future__ import annotations

import base64
import json
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from kvpool.client import AgentClient
from kvpool.common.keys import tenant_id
from kvpool.common.quotas import TierLimits, as_limits, quota_from_configmap
from kvpool.common.tenants_configmap import token_digest
from kvpool.operator.agents import Agents
from kvpool.operator.apply import Cluster
from kvpool.operator.bearer import OperatorToken
from kvpool.operator.events import PoolEvents, TenantEvents
from kvpool.operator.render import Pool
from kvpool.operator.spaces import SpaceReconciler
from kvpool.operator.tenants import TenantReconciler
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
from tests.operator.pool_agents import pool_agents
from tests.operator.shared_operator import running, unique
from tests.support.agent_process import ADMIN_TOKEN, AgentProcess
from tests.support.chunks import data, key
from tests.support.kube_api import ServedApi
from tests.support.metrics import metric
from tests.support.operator_process import Kubectl, OperatorProcess
from tests.support.polling import eventually
from tests.support.ports import free_port

pytestmark = pytest.mark.process

POOL_NAMESPACE = "inference"
TEAM = "team-a"
OUTSIDER = "team-b"
ACCESS = {"kvpool.io/team-access": "shared"}
TENANTS_CM = "kvpool-shared-tenants"
QUOTAS_CM = "kvpool-shared-quotas"
GiB = 1 << 30
AGENT_ADDRESSES = ("127.0.0.1", "127.0.0.2")


def _pool(name: str, http_port: int) -> dict[str, Any]:
    return {
        "apiVersion": "kvpool.io/v1alpha1",
        "kind": "KVCachePool",
        "metadata": {"name": name, "namespace": POOL_NAMESPACE},
        "spec": {
            "ports": {"http": http_port},
            "tenants": {
                "allowedNamespaces": {"matchLabels": ACCESS},
                "maxQuota": {"l1": "16Gi"},
            },
        },
    }


@pytest.fixture(scope="module")
def http_port() -> int:
    """The pool's http port, where the operator calls every agent."""
    return free_port()


@pytest.fixture(scope="module")
def pool(
    served_api: ServedApi,
    kubectl: Kubectl,
    operator_process: OperatorProcess,
    http_port: int,
) -> Iterator[Pool]:
    """The module's pool, ``inference-<n>/shared`` (POOL_NAMESPACE while the module runs), and
    its two agent pods, on the operator that every module shares (``conftest.py``)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(globals(), "POOL_NAMESPACE", unique("inference"))
        running(operator_process, served_api)
        apply(kubectl, namespace(POOL_NAMESPACE, {}))
        apply(kubectl, _pool("shared", http_port))
        made = Pool("shared", POOL_NAMESPACE, "")
        for number, address in enumerate(AGENT_ADDRESSES, 1):
            agent_pod(kubectl, made, f"kvpool-shared-agent-x{number}", address)
        yield made
        served_api.remove_namespace(POOL_NAMESPACE)


@pytest.fixture(autouse=True)
def _own_namespaces(
    pool: Pool,
    operator: OperatorProcess,
    kubectl: Kubectl,
    namespaces: Callable[[str], str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each test's own namespaces: TEAM (the pool admits it) and OUTSIDER (not yet)."""
    monkeypatch.setitem(globals(), "TEAM", namespaces("team-a"))
    monkeypatch.setitem(globals(), "OUTSIDER", namespaces("team-b"))
    apply(kubectl, namespace(TEAM, ACCESS))
    apply(kubectl, namespace(OUTSIDER, {}))


@pytest.fixture(scope="module")
def agents(
    served_api: ServedApi,
    pool: Pool,
    http_port: int,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[list[AgentProcess]]:
    """The pool's agents, started once the operator has made the pool's ConfigMaps."""
    with pool_agents(served_api, pool, http_port, AGENT_ADDRESSES, tmp_path_factory) as started:
        yield started


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _every_agent_answers(agents: list[AgentProcess], tenant: str, token: str, code: int) -> None:
    """Every agent answers ``code`` to ``token`` asking for the tenant's quota."""
    answers = [
        httpx.get(f"{agent.http}/v1/tenants/{tenant}/quota", headers=_bearer(token)).status_code
        for agent in agents
    ]
    assert answers == [code] * len(agents), answers


def _admitted(
    served_api: ServedApi, kubectl: Kubectl, agents: list[AgentProcess], name: str
) -> dict[str, str]:
    """Apply a tenant of the team; its Secret once it is accepted and every agent takes its
    token."""
    _tenant(kubectl, TEAM, name)
    eventually(lambda: _accepted(served_api, TEAM, name))
    secret = _secret(served_api, TEAM, name)
    eventually(lambda: _every_agent_answers(agents, secret["tenant-id"], secret["token"], 200))
    return secret


def _usage(agent: AgentProcess, tenant: str) -> dict[str, Any]:
    """The tenant's usage as the agent reports it (to its admin)."""
    response = httpx.get(f"{agent.http}/v1/tenants/{tenant}/usage", headers=_bearer(ADMIN_TOKEN))
    assert response.status_code == 200, response.text
    usage: dict[str, Any] = response.json()
    return usage


def _store(agents: list[AgentProcess], tenant: str, chunks: int) -> None:
    """``chunks`` chunks of the tenant on every agent, through ZMQ, written back to NVMe."""
    for number, agent in enumerate(agents):
        names = [f"{tenant}-{number}-{n}" for n in range(chunks)]
        with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
            stored = client.store(tenant, [key(n) for n in names], [data(n) for n in names])
            assert stored == chunks
    eventually(lambda: _written_back(agents))


def _rechecked(served_api: ServedApi, agents: list[AgentProcess], name: str, tenant: str) -> None:
    """Two periodic re-checks of the team's tenant ``name`` ran since the call, the second
    wholly after it: each counts in the tenant's ``status.usage`` a chunk stored for it after
    the one before (a tenant's passes run one at a time, admission first)."""
    _recheck_counts_a_new_chunk(served_api, agents, name, tenant)
    _recheck_counts_a_new_chunk(served_api, agents, name, tenant)


def _recheck_counts_a_new_chunk(
    served_api: ServedApi, agents: list[AgentProcess], name: str, tenant: str
) -> None:
    """Store a chunk of the tenant on the first agent; return once a re-check counted it."""

    def l1_bytes() -> int:
        counted: int = _status(served_api, TEAM, name).get("usage", {}).get("l1Bytes", 0)
        return counted

    before = l1_bytes()
    chunk = f"{tenant}-recheck-{before}"
    with AgentClient(agents[0].zmq, token=ADMIN_TOKEN) as client:
        assert client.store(tenant, [key(chunk)], [data(chunk)]) == 1

    def counted() -> None:
        assert l1_bytes() > before

    eventually(counted)


def _written_back(agents: list[AgentProcess]) -> None:
    assert [metric(agent, "kvpool_writeback_pending") for agent in agents] == [0] * len(agents)


def _tenant(
    kubectl: Kubectl, namespace: str, name: str, l1: str = "8Gi", **spec: Any
) -> dict[str, Any]:
    tenant = {
        "apiVersion": "kvpool.io/v1alpha1",
        "kind": "KVCacheTenant",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "poolRef": {"name": spec.pop("pool", "shared"), "namespace": POOL_NAMESPACE},
            "quota": {"l1": l1},
            **spec,
        },
    }
    apply(kubectl, tenant)
    return tenant


def _patch(kubectl: Kubectl, namespace: str, name: str, spec: dict[str, Any]) -> None:
    patch = json.dumps({"spec": spec})
    kubectl("patch", "kvt", name, "-n", namespace, "--type=merge", "-p", patch)


def _token_generation(api: ServedApi, namespace: str, name: str, generation: int) -> None:
    assert _status(api, namespace, name).get("tokenGeneration") == generation


def _accepted(api: ServedApi, namespace: str, name: str, reason: str = "Accepted") -> str:
    """The Accepted condition's message, once it has ``reason``."""
    status, found, message = _condition(api, namespace, name, "Accepted")
    assert (status, found) == ("True" if reason == "Accepted" else "False", reason), message
    return message


def _status(api: ServedApi, namespace: str, name: str) -> dict[str, Any]:
    return status(api, "kvcachetenants", namespace, name)


def _condition(api: ServedApi, namespace: str, name: str, kind: str) -> tuple[str, str, str]:
    return condition(api, "kvcachetenants", namespace, name, kind)


def _secret(api: ServedApi, namespace: str, name: str) -> dict[str, str]:
    return secret_values(api, namespace, f"{name}-kvpool")


def _data(api: ServedApi, name: str) -> dict[str, str]:
    return config_map(api, POOL_NAMESPACE, name)


def _quota(served_api: ServedApi, tenant: str) -> TierLimits:
    """The tenant's limits in the pool's quota ConfigMap, read with the agents' codec."""
    return as_limits(quota_from_configmap(_data(served_api, QUOTAS_CM)[tenant]))


def _entry(api: ServedApi, tenant: str) -> dict[str, Any]:
    data = _data(api, TENANTS_CM)
    assert tenant in data, f"no entry for {tenant}"
    entry: dict[str, Any] = json.loads(data[tenant])
    return entry


def _pool_ready(kubectl: Kubectl, api: ServedApi, pool: str) -> None:
    """Report the pool's DaemonSet ready, as its controller would."""

    def daemonset() -> dict[str, Any]:
        found = api.objects("daemonsets", POOL_NAMESPACE).get(f"kvpool-{pool}-agent")
        assert found is not None
        return found

    generation = eventually(daemonset)["metadata"]["generation"]
    counts = {"desiredNumberScheduled": 1, "updatedNumberScheduled": 1, "numberReady": 1}
    status = {"observedGeneration": generation, "currentNumberScheduled": 1, **counts}
    kubectl(
        "patch",
        "daemonset",
        f"kvpool-{pool}-agent",
        "-n",
        POOL_NAMESPACE,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": status}),
    )


def test_a_tenant_in_an_allowed_namespace_gets_its_token_quota_and_usage(
    served_api: ServedApi,
    kubectl: Kubectl,
    http_port: int,
    agents: list[AgentProcess],
) -> None:
    started = time.monotonic()
    _tenant(kubectl, TEAM, "alpha")
    eventually(lambda: _accepted(served_api, TEAM, "alpha"))
    secret = _secret(served_api, TEAM, "alpha")
    tenant = tenant_id(secret["salt"])
    entry = eventually(lambda: _entry(served_api, tenant))
    published = time.monotonic() - started
    assert secret["tenant-id"] == tenant
    assert (secret["pool"], secret["namespace"]) == ("shared", POOL_NAMESPACE)
    assert secret["endpoint"] == f"http://kvpool-shared.{POOL_NAMESPACE}.svc:{http_port}"
    assert entry == {
        "tokens": [token_digest(secret["token"])],
        "ceiling": {"l1": 8 * GiB, "nvme": 8 * GiB},
        "tenant": f"{TEAM}/alpha",
    }
    assert _quota(served_api, tenant) == TierLimits(8 * GiB, 8 * GiB)
    status = _status(served_api, TEAM, "alpha")
    assert (status["tenantId"], status["secretName"], status["tokenGeneration"]) == (
        tenant,
        "alpha-kvpool",
        0,
    )
    assert status["observedGeneration"] == 1
    assert event(served_api, TEAM, "alpha", "Normal", "Accepted").endswith(tenant)
    ready = _condition(served_api, TEAM, "alpha", "Ready")
    assert ready[:2] == ("False", "PoolNotReady")  # no agent reported ready yet

    _pool_ready(kubectl, served_api, "shared")

    def ready_now() -> None:
        assert _condition(served_api, TEAM, "alpha", "Ready")[:2] == ("True", "TokenPublished")

    eventually(ready_now)

    # every agent takes the team's token, within the CR's quota (its ceiling)
    eventually(lambda: _every_agent_answers(agents, tenant, secret["token"], 200))
    for agent in agents:
        mine = httpx.get(
            f"{agent.http}/v1/tenants/{tenant}/quota", headers=_bearer(secret["token"])
        )
        assert mine.json()["limit_bytes"] == 8 * GiB

    _store(agents, tenant, 3)
    # hits and a miss, on one agent only
    with AgentClient(agents[0].zmq, token=ADMIN_TOKEN) as client:
        client.lookup(tenant, [key(f"{tenant}-0-{n}") for n in range(3)] + [key("absent")])
    on_agents = [_usage(agent, tenant) for agent in agents]
    assert all(usage["nvme_used_bytes"] > 0 for usage in on_agents), on_agents
    summed = {
        "l1Bytes": sum(usage["used_bytes"] for usage in on_agents),
        "nvmeBytes": sum(usage["nvme_used_bytes"] for usage in on_agents),
        "hits": sum(usage["hits"] for usage in on_agents),
        "misses": sum(usage["misses"] for usage in on_agents),
        "agents": 2,
    }
    assert summed["hits"] >= 3 and summed["misses"] >= 1

    def usage() -> None:
        found = _status(served_api, TEAM, "alpha").get("usage") or {}
        assert {field: found.get(field) for field in summed} == summed, found

    eventually(usage)
    print(f"apply to the token's digest in the tenants ConfigMap: {published:.2f} s")


def test_a_namespace_the_pool_does_not_select_gets_no_token_until_it_is_labelled(
    served_api: ServedApi, kubectl: Kubectl, operator: OperatorProcess
) -> None:
    _tenant(kubectl, OUTSIDER, "beta")
    message = eventually(lambda: _accepted(served_api, OUTSIDER, "beta", "NamespaceNotAllowed"))
    assert f"does not admit the namespace {OUTSIDER}" in message
    assert _condition(served_api, OUTSIDER, "beta", "Ready")[:2] == ("False", "NotAccepted")
    assert "does not admit" in event(served_api, OUTSIDER, "beta", "Warning", "NamespaceNotAllowed")
    assert "beta-kvpool" not in served_api.objects("secrets", OUTSIDER)
    holders = [json.loads(value).get("tenant") for value in _data(served_api, TENANTS_CM).values()]
    assert f"{OUTSIDER}/beta" not in holders

    # the platform team labels the namespace: the periodic re-check admits it
    apply(kubectl, namespace(OUTSIDER, ACCESS))
    eventually(lambda: _accepted(served_api, OUTSIDER, "beta"))
    tenant = _secret(served_api, OUTSIDER, "beta")["tenant-id"]
    assert _entry(served_api, tenant)["tenant"] == f"{OUTSIDER}/beta"

    # and unlabels it: the token is withdrawn from the agents and from the Secret
    apply(kubectl, namespace(OUTSIDER, {}))
    eventually(lambda: _accepted(served_api, OUTSIDER, "beta", "NamespaceNotAllowed"))

    def withdrawn() -> None:
        assert tenant not in _data(served_api, TENANTS_CM)
        assert "token" not in _secret(served_api, OUTSIDER, "beta")

    eventually(withdrawn)


def test_a_quota_above_the_pools_maximum_is_refused(
    served_api: ServedApi, kubectl: Kubectl, operator: OperatorProcess
) -> None:
    _tenant(kubectl, TEAM, "greedy", l1="32Gi")
    message = eventually(lambda: _accepted(served_api, TEAM, "greedy", "QuotaAboveMaximum"))
    assert message == "quota.l1 32Gi is above the pool's maximum 16Gi (spec.tenants.maxQuota.l1)"
    assert event(served_api, TEAM, "greedy", "Warning", "QuotaAboveMaximum") == message
    assert "greedy-kvpool" not in served_api.objects("secrets", TEAM)

    _patch(kubectl, TEAM, "greedy", {"quota": {"l1": "16Gi", "nvme": "100Gi"}})
    eventually(lambda: _accepted(served_api, TEAM, "greedy"))
    tenant = _secret(served_api, TEAM, "greedy")["tenant-id"]
    assert _entry(served_api, tenant)["ceiling"] == {"l1": 16 * GiB, "nvme": 100 * GiB}


def test_rotating_the_token_revokes_the_old_one(
    served_api: ServedApi, kubectl: Kubectl, agents: list[AgentProcess]
) -> None:
    before = _admitted(served_api, kubectl, agents, "rotor")
    tenant = before["tenant-id"]
    assert _entry(served_api, tenant)["tokens"] == [token_digest(before["token"])]

    _patch(kubectl, TEAM, "rotor", {"tokenGeneration": 1})

    def rotated() -> dict[str, str]:
        after = _secret(served_api, TEAM, "rotor")
        assert after["token"] != before["token"]
        assert _entry(served_api, tenant)["tokens"] == [token_digest(after["token"])]
        assert _status(served_api, TEAM, "rotor")["tokenGeneration"] == 1
        return after

    after = eventually(rotated)
    assert (after["salt"], after["tenant-id"]) == (before["salt"], tenant)  # same cache
    assert "generation 1" in event(served_api, TEAM, "rotor", "Normal", "TokenRotated")
    eventually(lambda: _every_agent_answers(agents, tenant, before["token"], 401))
    _every_agent_answers(agents, tenant, after["token"], 200)
    _rechecked(served_api, agents, "rotor", tenant)
    assert _secret(served_api, TEAM, "rotor")["token"] == after["token"]  # nothing more minted


def test_the_crs_quota_is_written_when_it_changes_and_http_sets_stand_in_between(
    served_api: ServedApi, kubectl: Kubectl, agents: list[AgentProcess]
) -> None:
    secret = _admitted(served_api, kubectl, agents, "quota")
    tenant = secret["tenant-id"]
    lower = {"l1": GiB, "nvme": 2 * GiB}
    put = httpx.put(
        f"{agents[0].http}/v1/tenants/{tenant}/quota",
        json={"limit_bytes": lower["l1"], "nvme_limit_bytes": lower["nvme"]},
        headers=_bearer(secret["token"]),
    )
    assert put.status_code == 200, put.text
    assert _quota(served_api, tenant) == TierLimits(lower["l1"], lower["nvme"])

    _patch(kubectl, TEAM, "quota", {"tokenGeneration": 1})  # not a quota change
    eventually(lambda: _token_generation(served_api, TEAM, "quota", 1))
    _rechecked(served_api, agents, "quota", tenant)
    assert _quota(served_api, tenant) == TierLimits(lower["l1"], lower["nvme"])

    _patch(kubectl, TEAM, "quota", {"quota": {"l1": "4Gi"}})

    def written() -> None:
        assert _quota(served_api, tenant) == TierLimits(4 * GiB, 4 * GiB)
        assert _entry(served_api, tenant)["ceiling"] == {"l1": 4 * GiB, "nvme": 4 * GiB}

    eventually(written)

    def applied_by_every_agent() -> None:
        for agent in agents:
            quota = f"{agent.http}/v1/tenants/{tenant}/quota"
            found = httpx.get(quota, headers=_bearer(ADMIN_TOKEN)).json()
            assert (found["limit_bytes"], found["nvme_limit_bytes"]) == (4 * GiB, 4 * GiB)

    eventually(applied_by_every_agent)


def test_a_teams_own_salt_and_a_salt_in_use(
    served_api: ServedApi, kubectl: Kubectl, operator: OperatorProcess
) -> None:
    _tenant(kubectl, TEAM, "own", saltSecretRef={"name": "own-salt"})
    message = eventually(lambda: _accepted(served_api, TEAM, "own", "SaltSecretMissing"))
    assert message == "the Secret own-salt does not exist (spec.saltSecretRef)"

    salt = f"{TEAM}-own-salt-4a1f0c"
    apply(kubectl, _salt_secret(TEAM, "own-salt", "salt", ""))
    eventually(lambda: _accepted(served_api, TEAM, "own", "InvalidSalt"))
    apply(kubectl, _salt_secret(TEAM, "own-salt", "salt", salt))
    eventually(lambda: _accepted(served_api, TEAM, "own"))
    generated = _secret(served_api, TEAM, "own")
    assert generated["tenant-id"] == tenant_id(salt)
    assert "salt" not in generated  # the team keeps its own

    # another tenant of the pool with the same salt gets nothing
    apply(kubectl, _salt_secret(OUTSIDER, "copy-salt", "s", salt))
    apply(kubectl, namespace(OUTSIDER, ACCESS))
    _tenant(kubectl, OUTSIDER, "copycat", saltSecretRef={"name": "copy-salt", "key": "s"})
    message = eventually(lambda: _accepted(served_api, OUTSIDER, "copycat", "TenantIdInUse"))
    assert f"{TEAM}/own already has tenant id {tenant_id(salt)}" in message
    assert _entry(served_api, tenant_id(salt))["tenant"] == f"{TEAM}/own"
    assert "token" not in _secret_or_empty(served_api, OUTSIDER, "copycat")
    apply(kubectl, namespace(OUTSIDER, {}))


def _fail() -> bool:
    raise AssertionError("not yet")


def _salt_secret(namespace: str, name: str, key: str, salt: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": namespace},
        "data": {key: base64.b64encode(salt.encode()).decode()},
    }


def _secret_or_empty(api: ServedApi, namespace: str, name: str) -> dict[str, Any]:
    found: dict[str, Any] = api.objects("secrets", namespace).get(f"{name}-kvpool") or {}
    return found.get("data") or {}


def test_deleting_a_tenant_revokes_its_token_and_frees_its_space(
    served_api: ServedApi, kubectl: Kubectl, agents: list[AgentProcess]
) -> None:
    secret = _admitted(served_api, kubectl, agents, "leaving")
    tenant = secret["tenant-id"]
    assert tenant in _data(served_api, QUOTAS_CM)
    _store(agents, tenant, 3)
    held = [_usage(agent, tenant) for agent in agents]
    assert [(usage["chunks"], usage["nvme_used_bytes"] > 0) for usage in held] == [(3, True)] * 2

    started = time.monotonic()
    kubectl("delete", "kvt", "leaving", "-n", TEAM, "--wait=false")
    eventually(lambda: _every_agent_answers(agents, tenant, secret["token"], 401))
    revocation = time.monotonic() - started

    def gone() -> None:
        assert "leaving" not in served_api.objects("kvcachetenants", TEAM)  # finalizer released
        assert tenant not in _data(served_api, TENANTS_CM)
        assert tenant not in _data(served_api, QUOTAS_CM)
        assert "leaving-kvpool" not in served_api.objects("secrets", TEAM)  # owned: collected

    eventually(gone)
    freed = time.monotonic() - started
    for agent in agents:
        usage = _usage(agent, tenant)
        assert (usage["chunks"], usage["used_bytes"], usage["nvme_used_bytes"]) == (0, 0, 0)
    messages = [
        e["message"] for e in served_api.events(TEAM, "leaving") if e["reason"] == "Revoked"
    ]
    revoked = f"revoked the token on every agent of {POOL_NAMESPACE}/shared"
    assert any(revoked in m for m in messages)
    freed_message = "6 chunks dropped from L1 and 6 objects from L2 by 2 agents"
    assert any(freed_message in m for m in messages), messages
    print(f"delete to 401 on both agents: {revocation:.2f} s; to the tenant gone: {freed:.2f} s")


def test_a_recheck_after_the_deletion_publishes_nothing(
    served_api: ServedApi,
    kubectl: Kubectl,
    agents: list[AgentProcess],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The usage daemon's pass runs in a thread that kopf cannot cancel, so one may go on
    after the tenant's deletion was handled. It must leave the token revoked: a pass that
    reconciled the body its daemon started with published the deleted tenant's token again,
    and every agent took it (found as a flaky CI failure). Another controller's finalizer
    holds the tenant in deletion, after the operator's deletion handler ran, while an
    in-process reconciler (on the same API server) makes the pass."""
    secret = _admitted(served_api, kubectl, agents, "racing")
    tenant = secret["tenant-id"]
    hold = json.dumps({"metadata": {"finalizers": ["example.com/hold", "kvpool.io/finalizer"]}})
    kubectl("patch", "kvt", "racing", "-n", TEAM, "--type=merge", "-p", hold)
    kubectl("delete", "kvt", "racing", "-n", TEAM, "--wait=false")

    def handled() -> None:
        held = served_api.objects("kvcachetenants", TEAM)["racing"]["metadata"]
        assert held["finalizers"] == ["example.com/hold"]  # the operator's deletion is done
        assert tenant not in _data(served_api, TENANTS_CM)

    eventually(handled)
    monkeypatch.setenv("KUBECONFIG", str(served_api.kubeconfig()))
    cluster, lock, token = Cluster.connect(), threading.Lock(), OperatorToken()
    agents_ = Agents(cluster, token)
    spaces = SpaceReconciler(cluster, agents_, PoolEvents(), lock)
    reconciler = TenantReconciler(cluster, TenantEvents(), agents_, token, spaces=spaces, lock=lock)

    reconciler.recheck(TEAM, "racing")

    assert tenant not in _data(served_api, TENANTS_CM)
    assert tenant not in _data(served_api, QUOTAS_CM)
    _every_agent_answers(agents, tenant, secret["token"], 401)
    kubectl(
        "patch", "kvt", "racing", "-n", TEAM, "--type=merge", "-p", '{"metadata":{"finalizers":[]}}'
    )
    eventually(lambda: _tenant_gone(served_api, "racing"))


def test_apply_to_a_working_token_and_delete_to_401(
    served_api: ServedApi, kubectl: Kubectl, agents: list[AgentProcess]
) -> None:
    """The issue's two figures, five times each, on real agents: from ``kubectl apply`` to the
    generated token working on every agent, and from ``kubectl delete`` to every agent
    answering it 401."""
    to_working, to_revoked = zip(
        *(_apply_and_delete(served_api, kubectl, agents, f"timed-{n}") for n in range(5)),
        strict=True,
    )
    for what, seconds in (("apply to a working token", to_working), ("delete to 401", to_revoked)):
        figures = (
            f"{what}: median {statistics.median(seconds):.2f} s, "
            f"range {min(seconds):.2f}-{max(seconds):.2f} s over {len(seconds)} runs"
        )
        print(figures)
        # The README: well under a second, one watch event (medians 0.2-0.3 s). Ten times
        # that is a bound a loaded machine keeps; past it, the figures are a regression.
        assert max(seconds) < 5.0, figures


def _apply_and_delete(
    served_api: ServedApi, kubectl: Kubectl, agents: list[AgentProcess], name: str
) -> tuple[float, float]:
    """Seconds from apply to the token working on every agent, from delete to 401 on every
    agent; returns once the tenant is gone."""
    started = time.monotonic()
    _tenant(kubectl, TEAM, name)

    def working() -> dict[str, str]:
        encoded = _secret_or_empty(served_api, TEAM, name)
        assert "token" in encoded and "tenant-id" in encoded
        secret = {key: base64.b64decode(value).decode() for key, value in encoded.items()}
        _every_agent_answers(agents, secret["tenant-id"], secret["token"], 200)
        return secret

    secret = eventually(working)
    to_working = time.monotonic() - started
    started = time.monotonic()
    kubectl("delete", "kvt", name, "-n", TEAM, "--wait=false")
    eventually(lambda: _every_agent_answers(agents, secret["tenant-id"], secret["token"], 401))
    to_revoked = time.monotonic() - started
    eventually(lambda: _tenant_gone(served_api, name))
    return to_working, to_revoked


def _tenant_gone(api: ServedApi, name: str) -> None:
    held = api.objects("kvcachetenants", TEAM).get(name)
    assert held is None, f"{name} is still there: {held['metadata']}"


def test_deleting_the_pool_marks_its_tenants_pool_not_found(
    served_api: ServedApi, kubectl: Kubectl, operator: OperatorProcess, http_port: int
) -> None:
    apply(kubectl, _pool("doomed", http_port))
    _tenant(kubectl, TEAM, "orphan", pool="doomed")
    eventually(lambda: _accepted(served_api, TEAM, "orphan"))

    kubectl("delete", "kvp", "doomed", "-n", POOL_NAMESPACE)
    message = eventually(lambda: _accepted(served_api, TEAM, "orphan", "PoolNotFound"))
    assert message == f"there is no KVCachePool {POOL_NAMESPACE}/doomed"
    assert "orphan" in served_api.objects("kvcachetenants", TEAM)  # not deleted
    assert "token" not in _secret(served_api, TEAM, "orphan")
    event(served_api, TEAM, "orphan", "Warning", "PoolNotFound")


def test_salts_never_leave_secrets(
    served_api: ServedApi, kubectl: Kubectl, operator: OperatorProcess, agents: list[AgentProcess]
) -> None:
    """The salts of this test's tenants, generated or the team's (one of a tenant kept, one
    rotated, one deleted, a team's own and its copy refused), are in no object but Secrets
    (nor in any earlier version of one, nor in a watch event) and not in the operator's log."""
    kept, rotated, deleted = (
        _admitted(served_api, kubectl, agents, name) for name in ("kept", "rotated", "deleted")
    )
    _patch(kubectl, TEAM, "rotated", {"tokenGeneration": 1})
    eventually(lambda: _token_generation(served_api, TEAM, "rotated", 1))
    kubectl("delete", "kvt", "deleted", "-n", TEAM, "--wait=false")
    gone = deleted["tenant-id"]
    eventually(lambda: _every_agent_answers(agents, gone, deleted["token"], 401))
    eventually(lambda: gone not in _data(served_api, TENANTS_CM) or _fail())
    eventually(lambda: gone not in _data(served_api, QUOTAS_CM) or _fail())
    own = f"{TEAM}-own-salt-9c2e71"
    apply(kubectl, _salt_secret(TEAM, "own-salt", "salt", own))
    _tenant(kubectl, TEAM, "own", saltSecretRef={"name": "own-salt"})
    eventually(lambda: _accepted(served_api, TEAM, "own"))
    apply(kubectl, _salt_secret(OUTSIDER, "copy-salt", "s", own))
    apply(kubectl, namespace(OUTSIDER, ACCESS))
    _tenant(kubectl, OUTSIDER, "copycat", saltSecretRef={"name": "copy-salt", "key": "s"})
    eventually(lambda: _accepted(served_api, OUTSIDER, "copycat", "TenantIdInUse"))
    salts = [kept["salt"], _secret(served_api, TEAM, "rotated")["salt"], deleted["salt"], own]
    assert rotated["salt"] == salts[1] and len(set(salts)) == 4, salts

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

    text = served_api.call(everything_but_secrets())
    log = operator.log()
    assert "tenantId" in text and "kvpool-shared-tenants" in text and "tenant_changed" in log
    for salt in salts:
        assert salt not in text
        assert salt not in log
