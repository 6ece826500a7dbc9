"""``kvpool doctor``'s canary tenant, which every chunk token may use, is no store for anyone:
against a real agent, a tenant that floods it holds at most its fixed quota and evicts no
other tenant's chunks, and no other session (another tenant's, or its own next one) finds
what it stored there."""

from __future__ import annotations

import httpx
import pytest

from kvpool.client import AgentClient, AgentError
from kvpool.common import protocol as p
from kvpool.common.keys import CANARY_CHUNK_BYTES, CANARY_QUOTA_BYTES, CANARY_TENANT, tenant_id
from tests.support.agent_process import ADMIN_TOKEN, ENGINE_TOKEN, AgentProcess
from tests.support.chunks import chain, data, key

pytestmark = pytest.mark.process

ALICE, MALLORY = tenant_id("alice-salt"), tenant_id("mallory-salt")
ALICE_TOKEN = "alice-token-4c8e1f7a93b05d26e7a1"
MALLORY_TOKEN = "mallory-token-b7f2a60d4e9c13587cd0"
CANARY_CHUNK = b"c" * CANARY_CHUNK_BYTES


@pytest.fixture
def agent(agent_process: AgentProcess) -> AgentProcess:
    agent_process.tenant_tokens = {ALICE: ALICE_TOKEN, MALLORY: MALLORY_TOKEN}
    agent_process.settings.update(L1_SIZE="8Mi", DEFAULT_TENANT_QUOTA="2Mi")
    return agent_process.start()


def _used_bytes(agent: AgentProcess, tenant: str) -> int:
    response = httpx.get(
        f"{agent.http}/v1/tenants/{tenant}/usage",
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
    )
    response.raise_for_status()
    return int(response.json()["used_bytes"])


def test_a_tenant_flooding_the_canary_holds_its_quota_and_evicts_no_one(
    agent: AgentProcess,
) -> None:
    alices = chain("alice", 32)  # 2 MiB of pages: her quota
    with AgentClient(agent.zmq, token=ALICE_TOKEN) as alice:
        assert alice.store(ALICE, alices, [data(name) for name in alices]) == 32
    with AgentClient(agent.zmq, token=MALLORY_TOKEN) as mallory:
        # 256 canary chunks: 16 MiB of 64 KiB pages, twice the whole L1
        for batch in range(8):
            mallory.store_inline(CANARY_TENANT, chain(f"flood-{batch}", 32), [CANARY_CHUNK] * 32)
            assert _used_bytes(agent, CANARY_TENANT) <= CANARY_QUOTA_BYTES
        # a run longer than the quota is refused past it, in one line naming the quota
        run = mallory.store_inline(CANARY_TENANT, chain("run", 128), [CANARY_CHUNK] * 128)
        assert run.stored <= CANARY_QUOTA_BYTES // CANARY_CHUNK_BYTES
        assert f"quota of {CANARY_QUOTA_BYTES} bytes" in (run.refused or ""), run
        with pytest.raises(AgentError) as refused:  # the 60 MiB of the finding, in big chunks
            mallory.store_inline(CANARY_TENANT, [key("big")], [data("big", 1 << 20)])
        assert refused.value.code == p.ErrorCode.INVALID_REQUEST
        assert f"chunks of {CANARY_CHUNK_BYTES} bytes only, not {1 << 20}" in str(refused.value)
    with AgentClient(agent.zmq, token=ALICE_TOKEN) as alice:
        assert alice.lookup(ALICE, alices, lock=False).count == 32


def test_no_other_session_finds_what_one_stored_under_the_canary(agent: AgentProcess) -> None:
    secret = [key("message")]
    with AgentClient(agent.zmq, token=MALLORY_TOKEN) as mallory:
        assert mallory.store_inline(CANARY_TENANT, secret, [CANARY_CHUNK]).stored == 1
        assert mallory.retrieve_inline(CANARY_TENANT, secret) == [CANARY_CHUNK]  # its own
        assert mallory.retrieve(CANARY_TENANT, secret) == [CANARY_CHUNK]
        for token in (ALICE_TOKEN, ENGINE_TOKEN, ADMIN_TOKEN, MALLORY_TOKEN):
            with AgentClient(agent.zmq, token=token) as other:
                assert other.retrieve_inline(CANARY_TENANT, secret) == [], token
                assert other.lookup(CANARY_TENANT, secret, lock=False).count == 0, token
        assert mallory.retrieve_inline(CANARY_TENANT, secret) == [CANARY_CHUNK]
