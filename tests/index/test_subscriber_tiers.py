"""The subscriber's tiers, against stand-in agents over real sockets: events routed into one
tracker per tier, snapshots that list NVMe (or not), S3 learned from events only and shared
by every node, and an index that follows L1 only beside it."""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import pytest

from kvpool.common import protocol as p
from kvpool.index.subscriber import EventSubscriber
from kvpool.index.tracker import PrefixTracker, TierTrackers
from tests.support.agent_process import INDEX_TOKEN
from tests.support.chunks import chain
from tests.support.polling import wait_until

from .fake_agent import FakeAgent


class Index:
    def __init__(self, *, tiers: bool = True) -> None:
        self.trackers = TierTrackers.create()
        self.subscriber = EventSubscriber(
            self.trackers.l1,
            tiers=self.trackers.lower() if tiers else None,
            token=INDEX_TOKEN,
            snapshot_timeout=0.3,
            max_backoff=0.5,
        )
        self.subscriber.start()

    def runs(self, tracker: PrefixTracker, keys: list[bytes]) -> dict[str, int]:
        return {node: match.chunks for node, match in tracker.longest_prefixes(keys).items()}

    def synced_at(self, node: str, fake: FakeAgent) -> bool:
        status = next((s for s in self.subscriber.status() if s.endpoint.node == node), None)
        return status is not None and status.synced and status.seq == fake.seq


@pytest.fixture
def fakes() -> Iterator[list[FakeAgent]]:
    made = [FakeAgent(), FakeAgent()]
    yield made
    for fake in made:
        fake.close()


@pytest.fixture
def indexes() -> Iterator[list[Index]]:
    made: list[Index] = []
    yield made
    for index in made:
        index.subscriber.stop()


def follow(index: Index, fake: FakeAgent, node: str = "n1") -> None:
    index.subscriber.follow([fake.endpoint(node)])
    fake.wait_for_subscriber()
    wait_until(lambda: index.synced_at(node, fake), what="first snapshot")


def test_events_go_to_their_tiers_tracker_and_an_l1_only_index_skips_the_others(
    fakes: list[FakeAgent], indexes: list[Index]
) -> None:
    fake = fakes[0]
    tiered, l1_only = Index(), Index(tiers=False)
    indexes += [tiered, l1_only]
    follow(tiered, fake)
    l1_only.subscriber.follow([fake.endpoint("n1")])  # its subscription joins the first's
    wait_until(lambda: l1_only.synced_at("n1", fake), what="the L1-only index synchronised")
    in_l1, on_nvme, in_s3 = chain("l1", 3), chain("nvme", 4), chain("s3", 5)
    fake.publish("stored", in_l1)
    fake.publish("stored", on_nvme, tier="nvme")
    fake.publish("stored", in_s3, tier="s3")
    fake.publish("removed", on_nvme[2:], tier="nvme")
    fake.publish("stored", chain("later", 1), tier="ssd")  # a tier nobody follows: skipped
    wait_until(
        lambda: tiered.synced_at("n1", fake) and l1_only.synced_at("n1", fake),
        what="every event applied",
    )
    trackers = tiered.trackers
    assert tiered.runs(trackers.l1, in_l1) == {"n1": 3}
    assert tiered.runs(trackers.nvme, on_nvme) == {"n1": 2}
    assert tiered.runs(trackers.s3, in_s3) == {"n1": 5}
    assert tiered.runs(trackers.l1, on_nvme) == {} and tiered.runs(trackers.nvme, in_s3) == {}
    only = l1_only.trackers
    assert l1_only.runs(only.l1, in_l1) == {"n1": 3}
    assert l1_only.runs(only.l1, on_nvme) == {} and l1_only.runs(only.l1, in_s3) == {}
    assert only.nvme.counts() == {} and only.s3.counts() == {}
    for index in (tiered, l1_only):
        (status,) = index.subscriber.status()
        assert status.events == 5 and status.resyncs["gap"] == 0


def test_a_resync_takes_nvme_from_the_snapshot_and_keeps_what_s3_events_taught(
    fakes: list[FakeAgent], indexes: list[Index]
) -> None:
    fake = fakes[0]
    index = Index()
    indexes.append(index)
    fake.publish("stored", chain("nvme-before", 3), tier="nvme", lost=True)
    follow(index, fake)
    trackers = index.trackers
    assert index.runs(trackers.nvme, chain("nvme-before", 3)) == {"n1": 3}  # by snapshot
    in_s3 = chain("s3", 4)
    fake.publish("stored", in_s3, tier="s3")
    fake.publish("removed", chain("nvme-before", 3)[1:], tier="nvme", lost=True)
    fake.publish("stored", chain("nvme-missed", 2), tier="nvme", lost=True)
    fake.publish("stored", chain("l1", 1))  # seq jumps: a gap
    wait_until(lambda: index.synced_at("n1", fake), what="the resync")
    assert index.subscriber.status()[0].resyncs["gap"] == 1
    assert index.runs(trackers.nvme, chain("nvme-before", 3)) == {"n1": 1}
    assert index.runs(trackers.nvme, chain("nvme-missed", 2)) == {"n1": 2}
    assert index.runs(trackers.s3, in_s3) == {"n1": 4}  # no snapshot lists S3: kept

    # An agent that predates tier snapshots lists no NVMe: what the index had stays.
    fake.lists_nvme = False
    fake.restart(keep_keys=True)
    fake.publish("stored", chain("after-restart", 1))
    wait_until(lambda: index.synced_at("n1", fake), what="the resync with the new agent")
    assert index.runs(trackers.nvme, chain("nvme-missed", 2)) == {"n1": 2}


def test_a_removal_from_s3_is_a_removal_for_every_node(
    fakes: list[FakeAgent], indexes: list[Index]
) -> None:
    index = Index()
    indexes.append(index)
    index.subscriber.follow([fakes[0].endpoint("n1"), fakes[1].endpoint("n2")])
    for fake in fakes:
        fake.wait_for_subscriber()
    wait_until(index.subscriber.caught_up, what="both synchronised")
    shared = chain("shared", 3)
    for fake in fakes:
        fake.publish("stored", shared, tier="s3")
        fake.publish("stored", shared, tier="nvme")
    wait_until(lambda: index.runs(index.trackers.s3, shared) == {"n1": 3, "n2": 3})
    fakes[0].publish("removed", shared, tier="s3")  # n1's agent dropped the tenant
    fakes[0].publish("removed", shared, tier="nvme")
    wait_until(lambda: index.runs(index.trackers.s3, shared) == {}, what="gone for both")
    wait_until(lambda: index.runs(index.trackers.nvme, shared) == {"n2": 3}, what="n1's only")

    index.subscriber.follow([fakes[1].endpoint("n2")])  # n1 left: dropped from every tier
    fakes[1].publish("stored", shared, tier="s3")
    wait_until(lambda: index.runs(index.trackers.s3, shared) == {"n2": 3})
    assert "n1" not in index.trackers.nvme.counts() and "n1" not in index.trackers.l1.counts()


def test_old_and_new_snapshot_requests_and_replies_decode_both_ways() -> None:
    """An index that predates tiers and an agent that does, and the other way round."""

    class OldSnapshot(msgspec.Struct, array_like=True, tag_field="op", tag="snapshot"):
        req: int
        session: int

    class OldReply(msgspec.Struct, array_like=True, tag_field="op", tag="snapshot_reply"):
        req: int
        agent: str
        seq: int
        tenants: dict[str, list[bytes]]

    asked = msgspec.msgpack.decode(p.encode(p.Snapshot(1, 7, ["nvme"])), type=OldSnapshot)
    assert (asked.req, asked.session) == (1, 7)
    plain = p.decode_request(msgspec.msgpack.encode(OldSnapshot(1, 7)))
    assert isinstance(plain, p.Snapshot) and plain.tiers == []
    new_reply = p.SnapshotReply(1, "a", 9, {"t": [b"k"]}, {"nvme": {"t": [b"n"]}})
    old = msgspec.msgpack.decode(p.encode(new_reply), type=OldReply)
    assert (old.seq, old.tenants) == (9, {"t": [b"k"]})
    from_old = p.decode_reply(msgspec.msgpack.encode(OldReply(1, "a", 9, {"t": [b"k"]})))
    assert isinstance(from_old, p.SnapshotReply) and from_old.tiers == {}


def test_tiers_the_index_does_not_know_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"tiers: 'l1' is not a lower tier"):
        EventSubscriber(PrefixTracker(), tiers={"l1": PrefixTracker()}, token=INDEX_TOKEN)
