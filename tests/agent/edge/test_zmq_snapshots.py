"""Snapshots are listed off the ZMQ server's thread: a large one (an NVMe tier of a million
chunks) never holds up the other clients' requests, and a flood of them is bounded."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest
import zmq

from kvpool.agent.edge.zmq_server import MAX_SNAPSHOTS, ZmqServer
from kvpool.common import protocol as p
from kvpool.common.auth import TokenAuthority
from kvpool.common.segment import SegmentLayout, SharedSegment
from tests.support.agent_process import INDEX_TOKEN
from tests.support.chunks import chain
from tests.support.l1 import make_cache, make_service


class _Events:
    """The events' sequence as the service reads it (nothing is published here)."""

    seq = 41

    def stored(self, tenant: str, keys: list[bytes]) -> None: ...

    def removed(self, tenant: str, keys: list[bytes], cause: str) -> None: ...


class Listing:
    """An NVMe listing that waits until the test lets it answer."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.calls = 0

    def __call__(self) -> dict[str, list[bytes]]:
        self.calls += 1
        assert self.go.wait(10)
        return {"t": chain("nvme", 2)}


@pytest.fixture
def listing() -> Listing:
    return Listing()


@pytest.fixture
def server(tmp_path: Path, listing: Listing) -> Iterator[ZmqServer]:
    service = make_service(make_cache(), tmp_path / "quotas.yaml")
    service.publish_events(_Events(), {"nvme": listing})
    segment = SimpleNamespace(
        layout=SegmentLayout(page_size=4096, data_offset=4096, data_size=4096 * 100),
        path=tmp_path / "segment",
        identity=(1, 2),
    )
    server = ZmqServer(
        service,
        cast(SharedSegment, segment),
        "tcp://127.0.0.1:*",
        authority=TokenAuthority({"indexes": [INDEX_TOKEN]}),
        agent_id="agent",
        max_inline_bytes=1 << 20,
    )
    server.start()
    yield server
    listing.go.set()
    server.stop()


class Index:
    """One connection with an index's session, as the subscriber opens one."""

    def __init__(self, endpoint: str) -> None:
        self.socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(endpoint)
        self.socket.send(p.encode(p.Hello(1, p.PROTOCOL_VERSION, "index", INDEX_TOKEN)))
        hello = self.reply()
        assert isinstance(hello, p.HelloReply), hello
        self.session = hello.session

    def ask(self, req: int, tiers: list[str]) -> None:
        self.socket.send(p.encode(p.Snapshot(req, self.session, tiers)))

    def reply(self, timeout_ms: int = 5000) -> p.Reply:
        assert self.socket.poll(timeout_ms), "no answer"
        return p.decode_reply(self.socket.recv())

    def close(self) -> None:
        self.socket.close()


def test_a_snapshot_being_listed_holds_up_no_other_request(
    server: ZmqServer, listing: Listing
) -> None:
    slow, other = Index(server.bound_endpoint), Index(server.bound_endpoint)
    try:
        slow.ask(2, ["nvme"])
        while listing.calls == 0:
            assert not slow.socket.poll(10)  # not answered while its listing waits
        other.ask(3, [])  # L1 only, but behind the one being listed on its thread
        pong = Index(server.bound_endpoint)  # a hello is served meanwhile
        pong.close()
        listing.go.set()
        answer = slow.reply()
        assert isinstance(answer, p.SnapshotReply)
        assert (answer.req, answer.seq, answer.tiers) == (2, 41, {"nvme": {"t": chain("nvme", 2)}})
        plain = other.reply()
        assert isinstance(plain, p.SnapshotReply) and (plain.req, plain.tiers) == (3, {})
    finally:
        slow.close()
        other.close()


def test_snapshots_past_the_bound_are_refused_until_some_are_sent(
    server: ZmqServer, listing: Listing
) -> None:
    index = Index(server.bound_endpoint)
    try:
        for req in range(MAX_SNAPSHOTS):
            index.ask(req, ["nvme"])
        index.ask(99, ["nvme"])
        refused = index.reply()
        assert isinstance(refused, p.Error) and refused.req == 99
        assert refused.code == p.ErrorCode.INVALID_REQUEST and "ask again later" in refused.message
        listing.go.set()
        answered = sorted(
            reply.req
            for reply in (index.reply() for _ in range(MAX_SNAPSHOTS))
            if isinstance(reply, p.SnapshotReply)
        )
        assert answered == list(range(MAX_SNAPSHOTS))
        index.ask(100, ["nvme"])
        again = index.reply()
        assert isinstance(again, p.SnapshotReply) and again.req == 100
    finally:
        index.close()
