"""Tenants in a real agent: new tenant ids (cache salts) cost bounded memory; a tenant's
own token sets its quota within the default."""

from __future__ import annotations

import httpx
import pytest

from kvpool.agent.core.l1 import IDLE_TENANTS
from kvpool.client import AgentClient
from kvpool.common.keys import tenant_id
from tests.support.agent_process import ADMIN_TOKEN, AgentProcess
from tests.support.chunks import key

pytestmark = pytest.mark.process

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
DEFAULT_QUOTA = 2 << 20


def tenant_count(agent: AgentProcess) -> int:
    status = httpx.get(f"{agent.http}/v1/status", headers=ADMIN).raise_for_status().json()
    return int(status["tenant_count"])


def look_up_as_new_tenants(client: AgentClient, first: int, count: int) -> None:
    for number in range(first, first + count):
        assert client.lookup(tenant_id(f"salt-{number}"), [key(number)], lock=False).count == 0


def test_lookups_by_new_tenants_leave_a_bounded_number_of_records(
    agent_process: AgentProcess,
) -> None:
    agent = agent_process.start()
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
        look_up_as_new_tenants(client, 0, IDLE_TENANTS + 1000)
        assert tenant_count(agent) <= IDLE_TENANTS + 1
        before = agent.memory_bytes()
        look_up_as_new_tenants(client, IDLE_TENANTS + 1000, 25_000)
        grown = agent.memory_bytes() - before
        assert tenant_count(agent) <= IDLE_TENANTS + 1
        stats = client.stats()
    assert stats["misses"] == IDLE_TENANTS + 26_000  # the cache-wide counters stay exact
    # 25,000 records held ~15 MiB; dropped ones leave their memory to the next.
    assert grown < 5 << 20, f"the agent grew by {grown >> 10} KiB"


def test_clearing_the_cache_drops_the_records_of_its_tenants(agent_process: AgentProcess) -> None:
    agent = agent_process.start()
    tenants = IDLE_TENANTS + 500
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
        for number in range(tenants):
            assert client.store_inline(tenant_id(f"salt-{number}"), [key(number)], [b"kv"]).stored
    assert tenant_count(agent) == tenants
    httpx.post(f"{agent.http}/v1/clear", headers=ADMIN).raise_for_status()
    assert tenant_count(agent) <= IDLE_TENANTS
    usages = httpx.get(f"{agent.http}/v1/tenants", headers=ADMIN).raise_for_status().json()
    newest = tenant_id(f"salt-{tenants - 1}")
    assert any(u["tenant"] == newest and u["stored_chunks"] == 1 for u in usages["tenants"])


def test_a_tenant_without_a_ceiling_cannot_raise_itself_above_the_default(
    agent_process: AgentProcess,
) -> None:
    """Before: ``{"limit_bytes": null}`` with the tenant's own token was 200, and the tenant
    grew past the default (2 MiB) as far as the cache let it."""
    alice = tenant_id("alice-salt")
    agent_process.settings["DEFAULT_TENANT_QUOTA"] = str(DEFAULT_QUOTA)
    agent_process.tenant_tokens = {alice: "alice-token-4c8e1f7a93b05d26e7a1"}
    agent = agent_process.start()
    quota = f"{agent.http}/v1/tenants/{alice}/quota"
    own = {"Authorization": "Bearer alice-token-4c8e1f7a93b05d26e7a1"}
    for above in (
        {"limit_bytes": None},
        {"limit_bytes": DEFAULT_QUOTA + 1},
        {"limit_bytes": DEFAULT_QUOTA, "nvme_limit_bytes": None},
    ):
        refused = httpx.put(quota, headers=own, json=above)
        assert refused.status_code == 403, above
        assert f"default tenant quota of {DEFAULT_QUOTA} bytes" in refused.json()["detail"]
    assert httpx.get(quota, headers=own).json()["limit_bytes"] == DEFAULT_QUOTA  # unchanged
    within = httpx.put(quota, headers=own, json={"limit_bytes": DEFAULT_QUOTA // 2})
    assert within.status_code == 200 and within.json()["limit_bytes"] == DEFAULT_QUOTA // 2
    assert httpx.put(quota, headers=own, json={"limit_bytes": DEFAULT_QUOTA}).status_code == 200
    by_admin = httpx.put(quota, headers=ADMIN, json={"limit_bytes": None})
    assert by_admin.status_code == 200 and by_admin.json()["limit_bytes"] is None
    with AgentClient(
        agent.zmq, token=ADMIN_TOKEN
    ) as client:  # and the admin's quota is the one in force
        chunks = 3 * DEFAULT_QUOTA // (64 << 10)
        stored = client.store_inline(alice, [key(n) for n in range(chunks)], [b"kv"] * chunks)
        assert stored.stored == chunks
