"""Pins through a real agent: a shared space's owner pins a prefix over HTTP, and the pinned
chunks outlive the memory pressure that evicts everything else (lookups over ZMQ hit)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import yaml

from kvpool.client import AgentClient
from kvpool.common.keys import tenant_id
from tests.support.agent_process import ADMIN_TOKEN, ENGINE_TOKEN, AgentProcess
from tests.support.chunks import data, key
from tests.support.metrics import metric

pytestmark = pytest.mark.process

SPACE = tenant_id("shared-system-prompt")
OWNER, MEMBER = tenant_id("owner-team"), tenant_id("member-team")
OWNER_TOKEN = "owner-token-for-tests-5e0a3d9c7b14f268"
MEMBER_TOKEN = "member-token-for-tests-c3b8f16a2d0e9547"
PAGE = 64 << 10
CHUNK = 60_000  # one page each
PINNED = 12
BUDGET = 16 * CHUNK


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _tokens_file(workdir: Path) -> Path:
    """A tokens file that declares the space: the owner's team may pin in it."""
    path = workdir / "space-tokens.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "admins": ADMIN_TOKEN,
                "engines": ENGINE_TOKEN,
                "tenants": {OWNER: OWNER_TOKEN, MEMBER: MEMBER_TOKEN},
                "spaces": {SPACE: {"members": [MEMBER], "owners": [OWNER]}},
            }
        )
    )
    return path


def _store(client: AgentClient, tenant: str, names: list[str]) -> None:
    for first in range(0, len(names), 8):
        batch = names[first : first + 8]
        parent = key(names[first - 1]) if first else None
        client.store(tenant, [key(n) for n in batch], [data(n) for n in batch], parent)


def test_a_pinned_prefix_of_a_space_outlives_memory_pressure(agent_process: AgentProcess) -> None:
    agent_process.settings |= {
        "L1_SIZE": str(128 * PAGE),
        "DEFAULT_PIN_BUDGET": str(BUDGET),  # the tokens file's spaces have no budget of their own
        "MAINTENANCE_INTERVAL_SECONDS": "0.2",
        "TOKENS_FILE": str(_tokens_file(agent_process.workdir)),
    }
    agent = agent_process.start()
    prompt = [f"system-{n}" for n in range(16)]
    pins = f"{agent.http}/v1/tenants/{SPACE}/pins"
    body = {"keys": [key(n).hex() for n in prompt[:PINNED]]}

    refused = httpx.put(f"{pins}/system", json=body, headers=_auth(MEMBER_TOKEN))
    assert refused.status_code == 403  # a member may use the space's chunks, not pin them
    malformed = httpx.put(f"{pins}/system", json={"keys": ["00"]}, headers=_auth(OWNER_TOKEN))
    assert malformed.status_code == 422
    assert malformed.json()["detail"].startswith("invalid request: body.keys.0: ")

    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
        _store(client, SPACE, prompt)
        pinned = httpx.put(f"{pins}/system", json=body, headers=_auth(OWNER_TOKEN))
        assert pinned.status_code == 200, pinned.text
        assert pinned.json() == {
            "name": "system",
            "keys": PINNED,
            "resident_keys": PINNED,
            "pinned_keys": PINNED,
            "pinned_bytes": PINNED * CHUNK,
        }
        for tenant in ("a", "b", "c"):  # 300 pages through 128: everything else goes
            _store(client, tenant_id(f"busy-{tenant}"), [f"{tenant}-{n}" for n in range(100)])
        keys = [key(n) for n in prompt]
        assert client.lookup(SPACE, keys, lock=False).count == PINNED
        assert client.retrieve(SPACE, keys[:PINNED]) == [data(n) for n in prompt[:PINNED]]
        assert client.lookup(tenant_id("busy-a"), [key("a-0")], lock=False).count == 0
        stats = client.stats()

    assert stats["chunks"] < 300
    listed = httpx.get(pins, headers=_auth(OWNER_TOKEN)).json()
    assert (listed["budget_bytes"], listed["pinned_bytes"]) == (BUDGET, PINNED * CHUNK)
    assert metric(agent, f'kvpool_tenant_pinned_bytes{{tenant="{SPACE}"}}') == PINNED * CHUNK
    assert metric(agent, f'kvpool_tenant_pin_budget_bytes{{tenant="{SPACE}"}}') == BUDGET
    (space,) = httpx.get(f"{agent.http}/v1/spaces", headers=_auth(ADMIN_TOKEN)).json()["spaces"]
    assert (space["space"], space["source"], space["members"], space["owners"]) == (
        SPACE,
        "tokens file",
        1,
        1,
    )
    assert (space["pinned_bytes"], space["pin_budget_bytes"]) == (PINNED * CHUNK, BUDGET)

    assert httpx.delete(f"{pins}/system", headers=_auth(OWNER_TOKEN)).status_code == 200
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
        _store(client, tenant_id("busy-d"), [f"d-{n}" for n in range(130)])
        assert client.lookup(SPACE, [key(prompt[0])], lock=False).count == 0  # evictable again


def test_pinning_without_a_budget_is_refused_naming_it(agent_process: AgentProcess) -> None:
    agent_process.settings["TOKENS_FILE"] = str(_tokens_file(agent_process.workdir))
    agent = agent_process.start()
    refused = httpx.put(
        f"{agent.http}/v1/tenants/{SPACE}/pins/system",
        json={"keys": [key(0).hex()]},
        headers=_auth(OWNER_TOKEN),
    )
    assert refused.status_code == 409
    assert "default_pin_budget" in refused.json()["detail"]
