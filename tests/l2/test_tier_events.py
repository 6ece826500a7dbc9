"""Tier events and snapshots of real agents with NVMe and S3 (moto's server), as an index
sees them: on the wire, then in the index's per-tier trackers.

Tier ``nvme`` tells what a node's NVMe files hold, ``s3`` what its agent wrote back to the
pool's bucket; both share L1's sequence, so an index that follows L1 only is unaffected.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq

from kvpool.client import AgentClient
from kvpool.common import protocol as p
from kvpool.common.keys import CANARY_TENANT, tenant_id
from kvpool.common.kube.discovery import AgentEndpoint
from kvpool.index.subscriber import EventSubscriber
from kvpool.index.tracker import PrefixTracker, TierTrackers
from tests.support.agent_process import ADMIN_TOKEN, INDEX_TOKEN, AgentProcess
from tests.support.chunks import chain, data
from tests.support.polling import wait_until

pytestmark = pytest.mark.process

TENANT = tenant_id("tier-events")
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
Agents = Callable[..., AgentProcess]


def nvme(tmp_path: Path, name: str, capacity: str = "64MiB") -> dict[str, str]:
    return {"NVME__PATH": str(tmp_path / f"nvme-{name}"), "NVME__CAPACITY": capacity}


def s3(endpoint: str, bucket: str) -> dict[str, str]:
    return {"S3__BUCKET": bucket, "S3__ENDPOINT_URL": endpoint, "S3__REGION": "us-east-1"}


def store(agent: AgentProcess, keys: list[bytes]) -> None:
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
        assert client.store(TENANT, keys, [data(k.hex()) for k in keys]) == len(keys)


def drop_tenant(agent: AgentProcess, tiers: str) -> None:
    answer = httpx.post(f"{agent.http}/v1/tenants/{TENANT}/clear?tiers={tiers}", headers=ADMIN)
    assert answer.status_code == 200, answer.text


class Feed:
    """A subscriber of one agent's events, as the index connects one (PLAIN, its token)."""

    def __init__(self, agent: AgentProcess) -> None:
        self.socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.PLAIN_USERNAME, b"test")
        self.socket.setsockopt(zmq.PLAIN_PASSWORD, INDEX_TOKEN.encode())
        self.socket.setsockopt(zmq.SUBSCRIBE, p.EVENTS_TOPIC)
        self.socket.connect(agent.events)
        self.events: list[p.ChunkEvent] = []

    def joined(self, agent: AgentProcess) -> None:
        """PUB/SUB joins asynchronously: store until something is heard (as the canary, whose
        chunks are never written back)."""
        with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
            while not self.socket.poll(100):
                client.store(CANARY_TENANT, [b"w" * 32], [bytes(4096)])
        while self.socket.poll(200):  # what the warm-up published
            self.socket.recv_multipart()

    def until(self, done: Callable[[], bool], what: str) -> None:
        def more() -> bool:
            while self.socket.poll(0):
                topic, body = self.socket.recv_multipart()
                assert topic == p.EVENTS_TOPIC
                self.events.append(p.decode_event(body))
            return done()

        wait_until(more, timeout=20, what=what)

    def keys(self, tier: str, kind: str, cause: str | None = None) -> set[bytes]:
        return {
            key
            for event in self.events
            if (event.tier, event.kind) == (tier, kind) and cause in (None, event.cause)
            for key in event.keys
        }

    def close(self) -> None:
        self.socket.close()


@pytest.fixture
def feeds() -> Iterator[Callable[[AgentProcess], Feed]]:
    opened: list[Feed] = []

    def open_feed(agent: AgentProcess) -> Feed:
        feed = Feed(agent)
        opened.append(feed)
        feed.joined(agent)
        return feed

    yield open_feed
    for feed in opened:
        feed.close()


def ask_snapshot(agent: AgentProcess, request: Callable[[int], bytes]) -> bytes:
    """The raw reply to the snapshot request ``request(session)`` on an index's session."""
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(agent.zmq)
    try:
        socket.send(p.encode(p.Hello(1, p.PROTOCOL_VERSION, "index", INDEX_TOKEN)))
        assert socket.poll(5000)
        hello = p.decode_reply(socket.recv())
        assert isinstance(hello, p.HelloReply)
        socket.send(request(hello.session))
        assert socket.poll(5000)
        return socket.recv()
    finally:
        socket.close()


def snapshot(agent: AgentProcess, tiers: list[str]) -> p.SnapshotReply:
    reply = p.decode_reply(ask_snapshot(agent, lambda s: p.encode(p.Snapshot(2, s, tiers))))
    assert isinstance(reply, p.SnapshotReply), reply
    return reply


class OldSnapshotReply(msgspec.Struct, array_like=True, tag_field="op", tag="snapshot_reply"):
    """The reply as an index that predates tiers decodes it."""

    req: int
    agent: str
    seq: int
    tenants: dict[str, list[bytes]]


def files_on_disk(root: Path) -> set[bytes]:
    """The chunk keys of the NVMe tree's files (their names are the keys in hex)."""
    return {
        bytes.fromhex(path.name)
        for path in root.rglob("*")
        if path.is_file() and re.fullmatch("[0-9a-f]{64}", path.name)
    }


def test_write_backs_to_nvme_and_s3_and_their_drops_are_published_in_one_sequence(
    agents: Agents,
    feeds: Callable[[AgentProcess], Feed],
    tmp_path: Path,
    s3_endpoint: str,
    bucket: str,
) -> None:
    agent = agents("a", L1_SIZE="8MiB", **nvme(tmp_path, "a"), **s3(s3_endpoint, bucket))
    feed = feeds(agent)
    prompt = chain("written-back", 6)
    store(agent, prompt)
    feed.until(
        lambda: feed.keys("nvme", "stored") == set(prompt) == feed.keys("s3", "stored"),
        what="the write-backs published",
    )
    assert feed.keys("l1", "stored") == set(prompt)
    assert {event.tier for event in feed.events} == {"l1", "nvme", "s3"}
    assert all(event.tenant == TENANT for event in feed.events)
    first = feed.events[0].seq  # one sequence for every tier: an index sees each gap
    assert [event.seq for event in feed.events] == list(range(first, first + len(feed.events)))

    drop_tenant(agent, "all")
    feed.until(
        lambda: (
            feed.keys("nvme", "removed", "deleted") >= set(prompt)
            and feed.keys("s3", "removed", "deleted") >= set(prompt)
        ),
        what="the drop published, tier by tier",
    )
    assert feed.keys("l1", "removed", "cleared") >= set(prompt)


def test_nvme_evictions_are_published_and_a_snapshot_lists_what_nvme_holds(
    agents: Agents, feeds: Callable[[AgentProcess], Feed], tmp_path: Path
) -> None:
    # Room for 8 files of one 60,000-byte chunk each: 12 chunks written back evict 4 or more.
    agent = agents("a", L1_SIZE="8MiB", **nvme(tmp_path, "a", capacity="512KiB"))
    feed = feeds(agent)
    prompt = chain("evicted", 12)
    store(agent, prompt)
    feed.until(
        lambda: (
            feed.keys("nvme", "stored") == set(prompt) and len(feed.keys("nvme", "removed")) >= 4
        ),
        what="the write-backs and the evictions published",
    )
    assert feed.keys("nvme", "removed") == feed.keys("nvme", "removed", "pressure")
    # Each key was stored once, and some removed after: what is left is what the disk has.
    held = feed.keys("nvme", "stored") - feed.keys("nvme", "removed")
    assert held == files_on_disk(tmp_path / "nvme-a") and len(held) <= 8

    listed = snapshot(agent, ["nvme", "s3"])
    assert set(listed.tiers) == {"nvme"}  # S3 is not listed (nor configured here)
    assert set(listed.tiers["nvme"][TENANT]) == held
    assert set(listed.tenants[TENANT]) >= set(prompt)  # L1 as ever
    assert listed.seq >= max(event.seq for event in feed.events)

    # An index that predates tiers asks without them, and decodes its reply as it always did.
    old = ask_snapshot(agent, lambda session: msgspec.msgpack.encode(["snapshot", 3, session]))
    reply = msgspec.msgpack.decode(old, type=OldSnapshotReply)
    assert set(reply.tenants[TENANT]) == set(listed.tenants[TENANT])
    current = p.decode_reply(old)
    assert isinstance(current, p.SnapshotReply) and current.tiers == {}


def test_the_index_tracks_each_tier_and_gets_nvme_back_by_snapshot(
    agents: Agents, tmp_path: Path, s3_endpoint: str, bucket: str
) -> None:
    shared = s3(s3_endpoint, bucket)
    a = agents("a", L1_SIZE="8MiB", **nvme(tmp_path, "a"), **shared)
    b = agents("b", L1_SIZE="8MiB", **nvme(tmp_path, "b"), **shared)
    endpoints = [AgentEndpoint("a", a.zmq, a.events), AgentEndpoint("b", b.zmq, b.events)]
    first = TierTrackers.create()
    index = EventSubscriber(first.l1, tiers=first.lower(), token=INDEX_TOKEN, max_backoff=0.5)
    index.start()
    try:
        index.follow(endpoints)
        wait_until(index.caught_up, what="both agents synchronised")
        x, y = chain("x", 6), chain("y", 4)
        store(a, x)
        store(b, y)

        def indexed() -> bool:
            return all(
                runs(tracker, x) == {"a": 6} and runs(tracker, y) == {"b": 4}
                for tracker in (first.l1, first.nvme, first.s3)
            )

        wait_until(indexed, timeout=20, what="every tier indexed")

        with AgentClient(a.zmq, token=ADMIN_TOKEN) as client:
            client.clear(TENANT)  # L1 only: the NVMe files and S3 objects stay
        wait_until(lambda: runs(first.l1, x) == {}, what="the clear indexed")
        assert runs(first.nvme, x) == {"a": 6} and runs(first.s3, x) == {"a": 6}

        # A fresh index gets L1 and NVMe back by snapshot; S3 it learns from events only.
        second = TierTrackers.create()
        fresh = EventSubscriber(second.l1, tiers=second.lower(), token=INDEX_TOKEN)
        fresh.start()
        try:
            fresh.follow(endpoints)
            wait_until(fresh.caught_up, what="the fresh index synchronised")
            assert runs(second.l1, x) == {} and runs(second.l1, y) == {"b": 4}
            assert runs(second.nvme, x) == {"a": 6} and runs(second.nvme, y) == {"b": 4}
            assert second.s3.counts() == {}
            store(b, x)
            wait_until(lambda: runs(second.s3, x) == {"b": 6}, what="b's write-back learned")
        finally:
            fresh.stop()
        wait_until(lambda: runs(first.s3, x) == {"a": 6, "b": 6}, what="both wrote x back")

        # One agent's drop empties the shared bucket: gone for every node that wrote it.
        drop_tenant(a, "all")
        wait_until(
            lambda: runs(first.s3, x) == {} and runs(first.s3, y) == {},
            what="the bucket's drop indexed for every node",
        )
        assert runs(first.nvme, x) == {"b": 6} and runs(first.nvme, y) == {"b": 4}
        assert runs(first.l1, x) == {"b": 6}
        assert all(status.resyncs["gap"] == 0 for status in index.status())
    finally:
        index.stop()


def test_an_index_that_follows_l1_only_sees_l1_only(agents: Agents, tmp_path: Path) -> None:
    agent = agents("a", L1_SIZE="8MiB", **nvme(tmp_path, "a"))
    tracker = PrefixTracker()
    index = EventSubscriber(tracker, token=INDEX_TOKEN)  # as every index did before tiers
    index.start()
    try:
        index.follow([AgentEndpoint("a", agent.zmq, agent.events)])
        wait_until(index.caught_up, what="synchronised")
        prompt = chain("l1-only", 5)
        store(agent, prompt)
        wait_until(lambda: runs(tracker, prompt) == {"a": 5}, what="the store indexed")
        wait_until(lambda: len(files_on_disk(tmp_path / "nvme-a")) >= 5, what="the write-back")
        with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
            client.clear(TENANT)
        wait_until(lambda: runs(tracker, prompt) == {}, what="the clear indexed")
        # NVMe's events reach it too, one per write-back batch (their number depends on
        # timing), and change nothing it follows
        wait_until(lambda: index.status()[0].events >= 2 + 1, what="the NVMe events")
        (status,) = index.status()
        assert status.resyncs["gap"] == 0 and runs(tracker, prompt) == {}
    finally:
        index.stop()


def test_an_unknown_tier_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="'ssd' is not a lower tier"):
        EventSubscriber(PrefixTracker(), tiers={"ssd": PrefixTracker()}, token="t")


def runs(tracker: PrefixTracker, keys: list[bytes]) -> dict[str, int]:
    return {node: match.chunks for node, match in tracker.longest_prefixes(keys).items()}
