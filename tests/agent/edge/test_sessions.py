"""Sessions and leases over ZMQ against a real agent: stalled writers, foreign connections,
idle sessions."""

from __future__ import annotations

import httpx
import pytest

from kvpool.client import AgentClient, AgentError, copy_in
from kvpool.common import protocol as p
from kvpool.common.keys import tenant_id
from tests.support.agent_process import ADMIN_TOKEN, AgentProcess
from tests.support.chunks import data, key
from tests.support.polling import wait_until
from tests.support.raw_zmq import RawClient

pytestmark = pytest.mark.process

TENANT = tenant_id("salt-a")
OTHER = tenant_id("salt-b")
SIZE = 100_000


@pytest.fixture
def agent(agent_process: AgentProcess) -> AgentProcess:
    """Leases of 1 s, checked every 0.1 s: sessions go idle after 10 s, swept every 2.5 s."""
    agent_process.settings |= {"LEASE_SECONDS": "1", "MAINTENANCE_INTERVAL_SECONDS": "0.1"}
    return agent_process.start()


def test_a_writer_stalled_past_its_lease_corrupts_no_other_tenant(agent: AgentProcess) -> None:
    stalled, other = (
        AgentClient(agent.zmq, token=ADMIN_TOKEN),
        AgentClient(agent.zmq, token=ADMIN_TOKEN),
    )
    with stalled, other:
        plan = stalled.prepare_store(TENANT, [key(1)], [SIZE])
        assert plan.lease is not None
        # The stall, made deterministic: the writer copies nothing until its lease expired.
        wait_until(lambda: other.stats()["lock_expiries"] == 1)
        assert other.store(OTHER, [key(2)], [data(2, SIZE)]) == 1
        copy_in(stalled.files(), plan, [data(1, SIZE)])  # the late write
        assert other.retrieve(OTHER, [key(2)]) == [data(2, SIZE)]
        with pytest.raises(AgentError) as late_commit:
            stalled.commit_store(plan.lease)
        assert late_commit.value.code == p.ErrorCode.SESSION_FENCED
        assert other.retrieve(TENANT, [key(1)]) == []  # nothing published
        stats = other.stats()
        assert (stats["quarantined_leases"], stats["fenced_sessions"]) == (1, 1)
        assert stats["quarantined_bytes"] == 128 << 10  # two 64 KiB pages, still held
        status = httpx.get(
            f"{agent.http}/v1/status", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
        ).json()
        assert (status["quarantined_leases"], status["quarantined_bytes"]) == (1, 128 << 10)
        # The fenced client said hello again and stores on with a new session.
        assert stalled.store(TENANT, [key(3)], [data(3, SIZE)]) == 1
        assert other.retrieve(TENANT, [key(3)]) == [data(3, SIZE)]
    metrics = httpx.get(f"{agent.http}/metrics").text
    assert "kvpool_l1_quarantined_leases_total 1.0" in metrics


def test_a_session_belongs_to_the_connection_that_opened_it(agent: AgentProcess) -> None:
    owner, intruder = RawClient(agent.zmq), RawClient(agent.zmq)
    session, own = owner.hello(ADMIN_TOKEN), intruder.hello(ADMIN_TOKEN)
    assert session != own and min(session, own) >= 1 << 32  # random, not sequential
    reply, _ = owner.ask(p.encode(p.PrepareStore(2, session, TENANT, [key(1)], [SIZE])))
    assert isinstance(reply, p.PrepareStoreReply) and reply.lease != p.NO_LEASE
    lease = reply.lease
    for request in (
        p.Release(3, session, lease),
        p.CommitStore(3, session, lease),
        p.EndSession(3, session),
        p.Lookup(3, session, TENANT, [key(1)]),
    ):
        assert intruder.error(p.encode(request)).code == p.ErrorCode.UNKNOWN_SESSION
    for request in (p.Release(4, own, lease), p.CommitStore(4, own, lease)):
        assert intruder.error(p.encode(request)).code == p.ErrorCode.NOT_YOUR_LEASE
    reply, _ = owner.ask(p.encode(p.CommitStore(5, session, lease)))
    assert isinstance(reply, p.CommitReply) and reply.committed == 1
    owner.close()
    intruder.close()


def test_a_connection_cannot_take_over_another_ones_routing_identity(
    agent: AgentProcess,
) -> None:
    """Clients may name their connection: the agent ignores the name (each connection has
    an identity of its own), so a second one under the same name is a stranger."""
    owner = RawClient(agent.zmq, routing_id=b"vllm-worker-0")
    session = owner.hello(ADMIN_TOKEN)
    impostor = RawClient(agent.zmq, routing_id=b"vllm-worker-0")
    refused = impostor.error(p.encode(p.Lookup(2, session, TENANT, [key(1)])))
    assert refused.code == p.ErrorCode.UNKNOWN_SESSION, "the impostor was served as the owner"
    reply, _ = owner.ask(p.encode(p.Lookup(3, session, TENANT, [key(1)])))
    assert isinstance(reply, p.LookupReply)
    owner.close()
    impostor.close()


def test_idle_sessions_are_swept_on_time_while_the_socket_stays_busy(
    agent: AgentProcess,
) -> None:
    idle = RawClient(agent.zmq)
    idle.hello(ADMIN_TOKEN)
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as busy:
        assert busy.info is not None
        session = busy.info.session

        def only_the_busy_session_is_left() -> bool:
            busy.lookup(TENANT, [key(1)], lock=False, count=False)  # keeps its session alive
            return busy.stats()["sessions"] == 1

        assert busy.stats()["sessions"] == 2
        # wait_for asks every 50 ms: the socket is never silent for a sweep period (2.5 s).
        wait_until(only_the_busy_session_is_left, timeout=20)
        assert busy.info is not None and busy.info.session == session
    idle.close()
