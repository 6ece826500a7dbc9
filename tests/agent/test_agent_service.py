"""The agent as a real process: clients over ZMQ, tenants over HTTP, Prometheus over /metrics."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import random
import time

import httpx
import pytest

from kvpool.client import AgentClient, AgentError, AgentUnavailable, AsyncAgentClient
from kvpool.common import protocol as p
from kvpool.common.keys import tenant_id
from tests.support.agent_process import ADMIN_TOKEN, AgentProcess
from tests.support.chunks import key
from tests.support.polling import wait_until
from tests.support.raw_zmq import RawClient

pytestmark = pytest.mark.process

TENANT = tenant_id("salt-a")
OTHER = tenant_id("salt-b")


def payload(name: int, size: int) -> bytes:
    return random.Random(name).randbytes(size)


@pytest.fixture
def agent(agent_process: AgentProcess) -> AgentProcess:
    agent_process.settings["MAX_INLINE_BYTES"] = "4MiB"
    return agent_process.start()


def test_zero_copy_store_and_retrieve_are_byte_exact(agent: AgentProcess) -> None:
    keys = [key(n) for n in range(8)]
    data = [payload(n, 1000 + n * 40_000) for n in range(8)]
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
        assert client.store(TENANT, keys, data) == 8
        assert client.retrieve(TENANT, [*keys, key(99)]) == data
        assert client.retrieve(TENANT, [key(99), *keys]) == []
        again = client.prepare_store(TENANT, keys, [len(d) for d in data])
        assert again.lease is None and again.offsets == [-1] * 8  # duplicates: no-ops


def test_inline_store_and_retrieve_are_byte_exact(agent: AgentProcess) -> None:
    keys = [key(n) for n in range(4)]
    data = [payload(n, 70_000) for n in range(4)]
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
        result = client.store_inline(TENANT, keys, data)
        assert (result.stored, result.present, result.refused) == (4, 0, None)
        assert client.retrieve_inline(TENANT, keys) == data
        assert client.retrieve(TENANT, keys) == data  # the same chunks, zero-copy


def test_async_client(agent: AgentProcess) -> None:
    async def scenario() -> None:
        client = AsyncAgentClient(agent.zmq, token=ADMIN_TOKEN)
        await client.connect()
        keys, data = [key(1), key(2)], [payload(1, 5000), payload(2, 9000)]
        assert await client.store(TENANT, keys, data) == 2
        assert await client.retrieve(TENANT, keys) == data
        assert await client.retrieve_inline(TENANT, keys) == data
        results = await asyncio.gather(*(client.ping() for _ in range(10)))
        assert len(set(results)) == 1
        await client.close()

    asyncio.run(scenario())


def test_read_locks_live_until_release_and_tenants_are_isolated(agent: AgentProcess) -> None:
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
        client.store(TENANT, [key(1)], [payload(1, 100)])
        hit = client.lookup(TENANT, [key(1)])
        assert hit.count == 1 and client.stats()["open_leases"] == 1
        assert hit.lease is not None
        client.release(hit.lease)
        assert client.stats()["open_leases"] == 0
        assert client.lookup(OTHER, [key(1)]).count == 0
        assert client.clear(TENANT) == 1
        assert client.lookup(TENANT, [key(1)], lock=False).count == 0


def test_a_release_sent_ahead_is_answered_after_other_requests(agent: AgentProcess) -> None:
    """The connector sends a load's release before vLLM's forward and reads the answer after
    it, while it makes other requests; a release that failed still says so."""
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
        client.store(TENANT, [key(1), key(2)], [payload(1, 100), payload(2, 100)])
        first, second = client.lookup(TENANT, [key(1)]), client.lookup(TENANT, [key(2)])
        assert first.lease is not None and second.lease is not None
        released = client.release_later(first.lease)
        wrong = client.release_later(first.lease + second.lease + 12345)
        assert client.lookup(TENANT, [key(1)], lock=False).count == 1  # answers kept meanwhile
        client.release(second.lease)
        assert client.stats()["open_leases"] == 0
        released()
        with pytest.raises(AgentError):
            wrong()
        lost = client.release_later(first.lease)
    with pytest.raises(AgentUnavailable):  # the connection closed before the answer was read
        lost()


def test_an_old_client_gets_a_clear_version_error(agent: AgentProcess) -> None:
    raw = RawClient(agent.zmq)
    error = raw.error(p.encode(p.Hello(7, 0, "old-connector")))
    assert error.code == p.ErrorCode.UNSUPPORTED_VERSION and error.req == 7
    assert (
        "unsupported protocol version 0" in error.message
        and f"version {p.PROTOCOL_VERSION}" in error.message
    )
    raw.close()


def test_bad_requests_get_error_replies_and_the_agent_serves_on(agent: AgentProcess) -> None:
    raw, other = RawClient(agent.zmq), RawClient(agent.zmq)
    session, other_session = raw.hello(ADMIN_TOKEN), other.hello(ADMIN_TOKEN)
    enc = p.encode
    reply, _ = other.ask(enc(p.PrepareStore(2, other_session, TENANT, [key(5)], [100])))
    assert isinstance(reply, p.PrepareStoreReply)
    foreign_lease = reply.lease
    two_keys = [key(1), key(2)]
    cases: list[tuple[list[bytes], str]] = [
        ([b"\xc1garbage"], p.ErrorCode.MALFORMED),
        ([b""], p.ErrorCode.MALFORMED),
        ([enc(p.Ping(1))[:2]], p.ErrorCode.MALFORMED),
        ([b"\x93\xa8teleport\x03\x01"], p.ErrorCode.UNKNOWN_OP),
        ([b"\x93\xa6lookup\x03\x01"], p.ErrorCode.MALFORMED),  # fields missing
        ([enc(p.Lookup(3, 999, TENANT, [key(1)]))], p.ErrorCode.UNKNOWN_SESSION),
        ([enc(p.CommitStore(4, session, 12345))], p.ErrorCode.NOT_YOUR_LEASE),  # never reserved
        ([enc(p.Release(4, session, foreign_lease))], p.ErrorCode.NOT_YOUR_LEASE),
        ([enc(p.PrepareStore(5, session, TENANT, [key(1)], [1, 2]))], p.ErrorCode.INVALID_REQUEST),
        ([enc(p.PrepareStore(5, session, TENANT, [key(1)], [0]))], p.ErrorCode.INVALID_REQUEST),
        (
            [enc(p.PrepareStore(5, session, TENANT, [key(1)], [1 << 40]))],
            p.ErrorCode.INVALID_REQUEST,
        ),
        ([enc(p.PrepareStore(5, session, TENANT, [b"short"], [10]))], p.ErrorCode.INVALID_REQUEST),
        (
            [enc(p.Lookup(6, session, TENANT, [key(n) for n in range(9000)]))],
            p.ErrorCode.TOO_LARGE,
        ),
        (
            [enc(p.StoreInline(7, session, TENANT, two_keys)), b"x"],
            p.ErrorCode.INVALID_REQUEST,
        ),
        (
            [  # above max_inline_bytes (4 MiB), within the largest message (5 MiB)
                enc(p.StoreInline(8, session, TENANT, two_keys)),
                bytes(2 << 20),
                bytes((2 << 20) + 1),
            ],
            p.ErrorCode.TOO_LARGE,
        ),
    ]
    for frames, code in cases:
        error = raw.error(*frames)
        assert error.code == code, (frames[0][:40], error)
        assert error.message
    # Double commit: the second one names a lease the session no longer holds.
    reply, _ = raw.ask(enc(p.PrepareStore(9, session, TENANT, [key(7)], [10])))
    assert isinstance(reply, p.PrepareStoreReply)
    assert isinstance(raw.ask(enc(p.CommitStore(10, session, reply.lease)))[0], p.CommitReply)
    assert (
        raw.error(enc(p.CommitStore(11, session, reply.lease))).code == p.ErrorCode.NOT_YOUR_LEASE
    )
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
        client.store(TENANT, [key(8)], [payload(8, 5000)])
        assert client.retrieve(TENANT, [key(8)]) == [payload(8, 5000)]
    raw.close()
    other.close()


def _mutations(rng: random.Random, session: int) -> list[list[bytes]]:
    valid = [
        p.encode(p.Lookup(1, session, TENANT, [key(1), key(2)])),
        p.encode(p.PrepareStore(2, session, TENANT, [key(3)], [4096])),
        p.encode(p.StoreInline(3, session, TENANT, [key(4)])),
        p.encode(p.CommitStore(4, session, 1)),
        p.encode(p.Release(5, session, 2)),
        p.encode(p.RetrieveInline(6, session, TENANT, [key(1)])),
        p.encode(p.Clear(7, session, OTHER)),
        p.encode(p.Stats(8)),
    ]
    messages = []
    for _ in range(3000):
        frame = bytearray(rng.choice(valid))
        action = rng.randrange(5)
        if action == 0:
            for _ in range(rng.randint(1, 4)):
                frame[rng.randrange(len(frame))] = rng.randrange(256)
        elif action == 1:
            del frame[rng.randrange(len(frame)) :]
        elif action == 2:
            frame += rng.randbytes(rng.randint(1, 64))
        elif action == 3:
            frame = bytearray(rng.randbytes(rng.randint(0, 200)))
        extra = [rng.randbytes(rng.randint(0, 5000)) for _ in range(rng.choice([0, 0, 1, 2]))]
        messages.append([bytes(frame), *extra])
    return messages


def test_fuzzed_frames_never_break_the_agent(agent: AgentProcess) -> None:
    stored = {n: payload(n, 30_000 + n) for n in range(100, 110)}
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
        client.store(tenant_id("keeper"), [key(n) for n in stored], list(stored.values()))
    raw = RawClient(agent.zmq)
    session = raw.hello(ADMIN_TOKEN)
    messages = _mutations(random.Random(1234), session)
    for frames in messages:
        raw.socket.send_multipart(frames)
    replies = 0
    while raw.socket.poll(5000):
        reply, *_ = raw.socket.recv_multipart()
        p.decode_reply(reply)  # every reply is a well-formed message
        replies += 1
        if replies == len(messages):
            break
    assert replies == len(messages)
    raw.close()
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
        keeper = tenant_id("keeper")
        assert client.retrieve(keeper, [key(n) for n in stored]) == list(stored.values())
        assert client.store(keeper, [key(200)], [payload(200, 1000)]) == 1
        assert client.retrieve(keeper, [key(200)]) == [payload(200, 1000)]
    assert "Traceback" not in "".join(agent.log)


def _store_and_check(endpoint: str, worker: int) -> int:
    """A client process: store shared and own chunks, read everything back; returns mismatches."""
    mismatches = 0
    with AgentClient(
        endpoint, token=ADMIN_TOKEN, client_name=f"worker-{worker}", timeout=30
    ) as client:
        for round_ in range(20):
            shared = [1000 + round_, 1001 + round_]
            own = [10_000 * (worker + 1) + round_]
            names = [*shared, *own]
            client.store(TENANT, [key(n) for n in names], [payload(n, 20_000) for n in names])
            for n in names:
                got = client.retrieve(TENANT, [key(n)])
                # A shared chunk may still be in another worker's hands (reserved, not yet
                # committed): a miss then, never other bytes. Own chunks must be there.
                if got != [payload(n, 20_000)] and (n in own or got):
                    mismatches += 1
    return mismatches


def test_concurrent_client_processes_read_exact_bytes(agent: AgentProcess) -> None:
    context = multiprocessing.get_context("spawn")
    with context.Pool(4) as pool:
        mismatches = pool.starmap(_store_and_check, [(agent.zmq, worker) for worker in range(4)])
    assert mismatches == [0, 0, 0, 0]
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
        shared = range(1000, 1021)  # committed by whichever worker reserved each first
        assert client.retrieve(TENANT, [key(n) for n in shared]) == [
            payload(n, 20_000) for n in shared
        ]
        assert client.stats()["open_leases"] == 0


def _die_holding_locks(endpoint: str) -> None:
    client = AgentClient(endpoint, token=ADMIN_TOKEN)
    client.connect()
    client.store(TENANT, [key(1)], [payload(1, 4096)])
    assert client.lookup(TENANT, [key(1)]).count == 1  # a reader that never releases
    plan = client.prepare_store(TENANT, [key(2), key(3)], [1 << 20, 1 << 20])
    assert plan.lease is not None  # a writer that never commits
    os._exit(1)


def test_locks_of_a_crashed_client_expire(agent_process: AgentProcess) -> None:
    agent_process.settings |= {"LEASE_SECONDS": "1", "MAINTENANCE_INTERVAL_SECONDS": "0.2"}
    agent = agent_process.start()
    child = multiprocessing.get_context("spawn").Process(
        target=_die_holding_locks, args=(agent.zmq,)
    )
    child.start()
    child.join(30)
    assert child.exitcode == 1
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
        assert client.stats()["open_leases"] == 2
        wait_until(lambda: client.stats()["open_leases"] == 0)
        stats = client.stats()
        assert stats["lock_expiries"] == 2
        assert stats["quarantined_bytes"] == 2 << 20  # the writer may only be stalled
        assert client.clear(TENANT) == 1  # the reader's lock is gone: the chunk can go
        # The crashed client's session is swept as idle (10 lease times): its pages are free.
        wait_until(lambda: client.stats()["quarantined_bytes"] == 0, timeout=30)
        assert client.stats()["allocated_bytes"] == 0


def test_client_recovers_from_an_agent_restart(agent_process: AgentProcess) -> None:
    agent = agent_process.start()
    agent.fix_ports()
    client = AgentClient(agent.zmq, token=ADMIN_TOKEN, timeout=2.0)
    first_agent = client.connect().agent_id
    client.store(TENANT, [key(1)], [payload(1, 100)])
    assert agent.stop() == 0
    agent.start()
    started = time.monotonic()
    assert client.ping() != first_agent  # a new agent, found without any call to connect()
    assert client.store(TENANT, [key(2)], [payload(2, 100)]) == 1
    assert client.retrieve(TENANT, [key(2)]) == [payload(2, 100)]
    assert time.monotonic() - started < 5
    client.close()


def test_client_gives_up_quickly_when_no_agent_answers() -> None:
    client = AgentClient("tcp://127.0.0.1:9", token=ADMIN_TOKEN, timeout=0.5)
    started = time.monotonic()
    with pytest.raises(AgentUnavailable):
        client.connect()
    with pytest.raises(AgentUnavailable):
        client.ping()
    assert time.monotonic() - started < 3
    client.close()


def test_closing_a_client_of_a_dead_agent_takes_a_second_not_its_timeout(
    agent_process: AgentProcess,
) -> None:
    """Close says goodbye (EndSession) but never waits a request's timeout for it: a vLLM
    engine shutting down beside a dead agent once hung 20 s per connector half."""
    agent = agent_process.start()

    async def scenario() -> float:
        client = AgentClient(agent.zmq, token=ADMIN_TOKEN, timeout=20.0)
        client.connect()
        later = AsyncAgentClient(agent.zmq, token=ADMIN_TOKEN, timeout=20.0)
        await later.connect()
        assert agent.stop() == 0
        started = time.monotonic()
        client.close()
        await later.close()
        return time.monotonic() - started

    assert asyncio.run(scenario()) < 4  # two goodbyes of a second each, at most


def test_quotas_set_over_http_survive_a_restart(agent_process: AgentProcess) -> None:
    agent = agent_process.start()
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    path = f"/v1/tenants/{TENANT}/quota"
    put = httpx.put(agent.http + path, json={"limit_bytes": 123456}, headers=admin)
    assert put.status_code == 200
    assert agent.stop() == 0
    agent.start()
    answer = httpx.get(agent.http + path, headers=admin).json()
    assert answer["limit_bytes"] == 123456 and answer["explicit"] is True
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:  # and the cache enforces it
        refused = client.prepare_store(TENANT, [key(1)], [200_000])
        assert refused.lease is None and refused.refused is not None


def test_metrics_are_exported(agent: AgentProcess) -> None:
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
        client.store(TENANT, [key(1), key(2)], [payload(1, 1000), payload(2, 1000)])
        client.retrieve(TENANT, [key(1), key(2), key(3)])
        client.retrieve_inline(TENANT, [key(9)])
    text = httpx.get(f"{agent.http}/metrics").text
    assert "kvpool_l1_hits_total 2.0" in text
    assert "kvpool_l1_misses_total 2.0" in text
    assert "kvpool_l1_written_bytes_total 2000.0" in text
    assert f'kvpool_tenant_used_bytes{{tenant="{TENANT}"}} 2000.0' in text
    assert 'kvpool_request_seconds_count{op="lookup"} 1.0' in text
    assert 'kvpool_l1_evictions_total{cause="watermark"} 0.0' in text
    assert "kvpool_l1_capacity_bytes 6.7108864e+07" in text


def test_every_operation_refuses_what_is_not_a_tenant_id(agent: AgentProcess) -> None:
    """A lookup under a 1 MiB name would leave the agent a tenant record of that size."""
    huge = "t" * (1 << 20)
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
        for call in (
            lambda: client.lookup(huge, [key(1)]),
            lambda: client.lookup("not-an-id", [key(1)], lock=False),
            lambda: client.retrieve_inline(huge, [key(1)]),
            lambda: client.clear(huge),
            lambda: client.prepare_store(huge, [key(1)], [4096]),
        ):
            with pytest.raises(AgentError) as refused:
                call()
            assert refused.value.code == "invalid_request"
        assert client.lookup(TENANT, [key(1)]).count == 0  # a well-formed id still answers
    listed = httpx.get(
        f"{agent.http}/v1/tenants", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
    ).json()["tenants"]
    assert all(len(entry["tenant"]) == 32 for entry in listed)
