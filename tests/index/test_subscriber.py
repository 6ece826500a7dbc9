"""The event subscriber against stand-in agents: sync, gaps, restarts, retries, departures."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from kvpool.index.subscriber import AgentStatus, EventSubscriber
from kvpool.index.tracker import PrefixTracker
from tests.support.agent_process import INDEX_TOKEN
from tests.support.chunks import chain
from tests.support.polling import wait_until

from .fake_agent import FakeAgent


class Harness:
    def __init__(self) -> None:
        self.tracker = PrefixTracker()
        self.subscriber = EventSubscriber(
            self.tracker, token=INDEX_TOKEN, snapshot_timeout=0.3, max_backoff=0.5
        )
        self.fakes: list[FakeAgent] = []

    def fake(self) -> FakeAgent:
        fake = FakeAgent()
        self.fakes.append(fake)
        return fake

    def status(self, node: str) -> AgentStatus | None:
        return next((s for s in self.subscriber.status() if s.endpoint.node == node), None)

    def failures(self, node: str) -> int:
        status = self.status(node)
        return 0 if status is None else status.snapshot_failures

    def agrees(self, node: str, fake: FakeAgent) -> Callable[[], bool]:
        """The tracker holds exactly the fake's keys for ``node``, synchronised."""

        def check() -> bool:
            counts = self.tracker.counts()
            held = counts[node].chunks if node in counts else 0
            status = self.status(node)
            return (
                status is not None
                and status.synced
                and status.seq == fake.seq
                and held == len(fake.keys)
                and all(node in self.tracker.holders(k) for k in fake.keys)
            )

        return check


def status_of(harness: Harness, node: str) -> AgentStatus:
    status = harness.status(node)
    assert status is not None, f"{node} is not followed"
    return status


@pytest.fixture
def harness() -> Iterator[Harness]:
    harness = Harness()
    harness.subscriber.start()
    yield harness
    harness.subscriber.stop()
    for fake in harness.fakes:
        fake.close()


def test_first_contact_takes_a_snapshot_then_follows_events(harness: Harness) -> None:
    fake = harness.fake()
    fake.publish("stored", chain("before", 3), lost=True)  # held before the index came
    harness.subscriber.follow([fake.endpoint("n1")])
    fake.wait_for_subscriber()
    wait_until(harness.agrees("n1", fake), what="initial snapshot")
    fake.publish("stored", chain("after", 4))
    fake.publish("removed", chain("before", 3)[2:])
    wait_until(harness.agrees("n1", fake), what="events applied")
    assert harness.tracker.longest_prefixes(chain("before", 3))["n1"].chunks == 2
    status = status_of(harness, "n1")
    assert (status.agent_id, status.events, status.connected) == (fake.agent_id, 2, True)
    assert status.resyncs == {"connected": 1, "restart": 0, "gap": 0}


def test_a_sequence_gap_is_repaired_from_a_snapshot(harness: Harness) -> None:
    fake = harness.fake()
    harness.subscriber.follow([fake.endpoint("n1")])
    fake.wait_for_subscriber()
    wait_until(harness.agrees("n1", fake))
    fake.publish("stored", chain("kept", 4))
    fake.publish("stored", chain("missed", 4), lost=True)
    fake.publish("removed", chain("kept", 4)[1:], lost=True)
    fake.publish("stored", chain("seen", 2))  # seq jumps by 3: a gap
    wait_until(harness.agrees("n1", fake), what="resync after the gap")
    assert status_of(harness, "n1").resyncs["gap"] == 1
    assert harness.tracker.longest_prefixes(chain("missed", 4))["n1"].chunks == 4
    assert harness.tracker.longest_prefixes(chain("kept", 4))["n1"].chunks == 1


def test_a_new_agent_id_replaces_what_the_old_agent_held(harness: Harness) -> None:
    fake = harness.fake()
    fake.publish("stored", chain("old", 3), lost=True)
    harness.subscriber.follow([fake.endpoint("n1")])
    fake.wait_for_subscriber()
    wait_until(harness.agrees("n1", fake))
    fake.restart(keep_keys=False)  # same sockets, a new process with an empty cache
    fake.publish("stored", chain("new", 2))
    wait_until(harness.agrees("n1", fake), what="resync after the restart")
    assert status_of(harness, "n1").resyncs["restart"] == 1
    assert status_of(harness, "n1").agent_id == fake.agent_id
    assert harness.tracker.longest_prefixes(chain("old", 3)) == {}


def test_events_during_a_slow_snapshot_are_applied_after_it(harness: Harness) -> None:
    fake = harness.fake()
    fake.snapshot_delay = 0.2
    harness.subscriber.follow([fake.endpoint("n1")])
    fake.wait_for_subscriber()
    wait_until(lambda: fake.snapshots == 1, what="the snapshot request")
    fake.publish("stored", chain("during", 3))  # after the snapshot's state, before its reply
    wait_until(harness.agrees("n1", fake), what="buffered events applied")
    assert status_of(harness, "n1").events == 1
    assert status_of(harness, "n1").resyncs == {"connected": 1, "restart": 0, "gap": 0}


def test_an_unanswered_snapshot_is_retried(harness: Harness) -> None:
    fake = harness.fake()
    fake.answering = False
    fake.publish("stored", chain("held", 2), lost=True)
    harness.subscriber.follow([fake.endpoint("n1")])
    wait_until(lambda: harness.failures("n1") >= 1, what="a timeout")
    assert not status_of(harness, "n1").synced
    fake.answering = True
    wait_until(harness.agrees("n1", fake), what="the retried snapshot")


def test_only_l1_events_change_the_index(harness: Harness) -> None:
    fake = harness.fake()
    harness.subscriber.follow([fake.endpoint("n1")])
    fake.wait_for_subscriber()
    wait_until(harness.agrees("n1", fake))
    fake.publish("stored", chain("on-disk", 2), tier="nvme")
    fake.publish("stored", chain("in-memory", 2))
    wait_until(harness.agrees("n1", fake))
    assert harness.tracker.longest_prefixes(chain("on-disk", 2)) == {}
    assert status_of(harness, "n1").resyncs["gap"] == 0  # the nvme event counted in sequence


def test_agents_that_leave_lose_their_keys_and_moved_ones_resync(harness: Harness) -> None:
    first, second, replacement = harness.fake(), harness.fake(), harness.fake()
    first.publish("stored", chain("a", 2), lost=True)
    second.publish("stored", chain("b", 2), lost=True)
    replacement.publish("stored", chain("c", 2), lost=True)
    harness.subscriber.follow([first.endpoint("n1"), second.endpoint("n2")])
    wait_until(harness.agrees("n1", first))
    wait_until(harness.agrees("n2", second))
    harness.subscriber.follow([replacement.endpoint("n2")])  # n1 gone, n2 on a new pod
    wait_until(harness.agrees("n2", replacement), what="the new pod's snapshot")
    assert [s.endpoint.node for s in harness.subscriber.status()] == ["n2"]
    assert set(harness.tracker.counts()) == {"n2"}
    assert harness.tracker.longest_prefixes(chain("b", 2)) == {}
