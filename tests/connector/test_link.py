from __future__ import annotations

import pytest

from kvpool.client import AgentError, AgentInfo
from kvpool.connector.counters import Counters
from kvpool.connector.link import LinkDown

from .fakes import Clock, FakeAgent, make_link


def test_a_failure_pauses_the_link_and_doubles_the_pause() -> None:
    agent, clock, counters = FakeAgent(down=True), Clock(), Counters()
    link = make_link(agent, counters, clock)

    with pytest.raises(LinkDown):
        link.lookup("t", [b"k"], lock=True, count=True)
    assert link.is_down and not link.usable()
    with pytest.raises(LinkDown):  # skipped without waiting for a timeout
        link.lookup("t", [b"k"], lock=True, count=True)
    assert counters.totals["agent_failures"] == 1
    assert counters.totals["agent_skipped_calls"] == 1

    clock.now += 1.0
    assert link.usable()
    with pytest.raises(LinkDown):  # still down: the next pause is twice as long
        link.lookup("t", [b"k"], lock=True, count=True)
    clock.now += 1.5
    assert not link.usable()
    clock.now += 0.5
    assert link.usable()


def test_the_link_comes_back_when_the_agent_does() -> None:
    agent, clock, counters = FakeAgent(), Clock(), Counters()
    link = make_link(agent, counters, clock)
    assert link.lookup("t", [b"k"], lock=True, count=True).count == 0
    agent.down = True
    with pytest.raises(LinkDown):
        link.lookup("t", [b"k"], lock=True, count=True)

    agent.down = False
    agent.put("t", [b"k"])
    clock.now += 1.0
    assert link.lookup("t", [b"k"], lock=True, count=True).count == 1
    assert not link.is_down
    assert agent.connects == 2  # the timed-out client said hello again


def test_refusals_are_not_outages() -> None:
    agent = FakeAgent(refuse=True)
    link = make_link(agent)
    with pytest.raises(AgentError):
        link.lookup("t", [b"k"], lock=True, count=True)
    assert not link.is_down


def test_a_restarted_agent_is_reported() -> None:
    agent, counters = FakeAgent(), Counters()
    seen: list[AgentInfo] = []
    link = make_link(agent, counters, on_new_agent=seen.append)
    link.info()
    link.info()
    assert [info.agent_id for info in seen] == ["agent-1"]

    agent.agent_id = "agent-2"
    link.close()  # a new session, as after unknown_session
    link.info()
    assert [info.agent_id for info in seen] == ["agent-1", "agent-2"]
    assert counters.totals["agent_restarts_seen"] == 1


def test_unknown_counters_are_refused() -> None:
    with pytest.raises(KeyError, match="known: lookups"):
        Counters().add("lookup")
