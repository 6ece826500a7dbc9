"""Chunk events and snapshots of a real agent, as the prefix index sees them."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from kvpool.client import AgentClient
from kvpool.common import protocol as p
from kvpool.common.keys import tenant_id
from kvpool.common.protocol import EVENTS_TOPIC, ChunkEvent, decode_event
from tests.support.agent_process import ADMIN_TOKEN, INDEX_TOKEN, AgentProcess
from tests.support.chunks import key

pytestmark = pytest.mark.process

TENANT = tenant_id("events")


def _subscribe(endpoint: str, token: str = INDEX_TOKEN) -> zmq.Socket[bytes]:
    """A subscriber as the index connects one: PLAIN, its password ``token``."""
    socket = zmq.Context.instance().socket(zmq.SUB)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.PLAIN_USERNAME, b"test")
    socket.setsockopt(zmq.PLAIN_PASSWORD, token.encode())
    socket.setsockopt(zmq.SUBSCRIBE, EVENTS_TOPIC)
    socket.connect(endpoint)
    return socket


def _next(socket: zmq.Socket[bytes]) -> ChunkEvent:
    assert socket.poll(5000), "no event"
    topic, body = socket.recv_multipart()
    assert topic == EVENTS_TOPIC
    return decode_event(body)


def test_stores_evictions_and_clears_are_published_in_sequence(
    agent_process: AgentProcess,
) -> None:
    agent_process.settings |= {"L1_SIZE": "1MiB", "PAGE_SIZE": "64KiB"}  # 16 pages
    agent = agent_process.start()
    subscriber = _subscribe(agent.events)
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
        # PUB/SUB joins asynchronously: store until the subscriber hears something.
        while not subscriber.poll(100):
            client.store(TENANT, [key("warmup")], [b"w"])
        first = _next(subscriber)
        client.clear()
        while first.kind != "removed":
            first = _next(subscriber)
        before = time.time()
        client.store(TENANT, [key(1), key(2)], [b"a" * 1000, b"b" * 1000])
        stored = _next(subscriber)
        assert before <= stored.time <= time.time()  # the publish time, for the index's lag
        assert (stored.kind, stored.tier, stored.tenant) == ("stored", "l1", TENANT)
        assert stored.keys == [key(1), key(2)] and stored.seq == first.seq + 1
        assert stored.agent == client.info.agent_id  # type: ignore[union-attr]
        for n in range(10, 25):  # past the high watermark: the oldest chunks go
            client.store(TENANT, [key(n)], [bytes(60_000)])
        events = [_next(subscriber) for _ in range(15)]
        while subscriber.poll(200):
            events.append(_next(subscriber))
        removed = [e for e in events if e.kind == "removed"]
        assert removed and all(e.cause == "watermark" for e in removed)
        assert [e.seq for e in events] == list(range(stored.seq + 1, stored.seq + 1 + len(events)))
        assert client.clear(TENANT) > 0
        cleared = _next(subscriber)
        assert (cleared.kind, cleared.cause) == ("removed", "cleared")
    subscriber.close()


def test_events_without_a_publish_time_still_decode() -> None:
    """An agent that predates ``time`` sends seven fields; the index reads time 0."""
    older = msgspec.msgpack.encode([3, "a", "stored", "l1", TENANT, [key(1)], ""])
    event = decode_event(older)
    assert (event.seq, event.keys, event.time) == (3, [key(1)], 0.0)


def test_snapshot_lists_every_key_with_the_sequence_it_matches(
    agent_process: AgentProcess,
) -> None:
    agent = agent_process.start()
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
        client.store(TENANT, [key(1), key(2)], [b"x", b"y"])
        other = tenant_id("other")
        client.store(other, [key(3)], [b"z"])
        socket = zmq.Context.instance().socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(agent.zmq)
        socket.send(p.encode(p.Hello(1, p.PROTOCOL_VERSION, "index", INDEX_TOKEN)))
        assert socket.poll(5000)
        hello = p.decode_reply(socket.recv())
        assert isinstance(hello, p.HelloReply)
        socket.send(p.encode(p.Snapshot(2, hello.session)))
        assert socket.poll(5000)
        snapshot = p.decode_reply(socket.recv())
        assert isinstance(snapshot, p.SnapshotReply)
        assert sorted(snapshot.tenants[TENANT]) == sorted([key(1), key(2)])
        assert snapshot.tenants[other] == [key(3)]
        assert snapshot.seq == 2 and snapshot.agent == hello.agent_id
        socket.close()
