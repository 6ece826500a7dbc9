"""The index following real agent processes: stores, evictions, restarts, a dropped subscriber.

Every agent is a real ``kvpool-agent`` on 127.0.0.1 publishing real events; the
truth the index is checked against is what each agent answers to a lookup.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import pytest

from kvpool.client import AgentClient
from kvpool.common.keys import tenant_id
from kvpool.common.kube.discovery import AgentEndpoint
from kvpool.index.subscriber import AgentStatus, EventSubscriber
from kvpool.index.tracker import PrefixTracker
from tests.support.agent_process import ADMIN_TOKEN, INDEX_TOKEN, AgentProcess
from tests.support.chunks import chain
from tests.support.polling import wait_until
from tests.support.ports import free_port

from .conftest import start_all
from .proxy import TcpProxy

pytestmark = pytest.mark.process

TENANT = tenant_id("follow")
Agents = Callable[..., list[AgentProcess]]


class Index:
    """An in-process index over some agents: the tracker and the subscriber."""

    def __init__(self) -> None:
        self.tracker = PrefixTracker()
        self.subscriber = EventSubscriber(
            self.tracker, token=INDEX_TOKEN, snapshot_timeout=2.0, max_backoff=0.5
        )
        self.subscriber.start()

    def follow(self, endpoints: Sequence[AgentEndpoint]) -> None:
        self.subscriber.follow(endpoints)
        wait_until(
            lambda: (
                len(self.statuses()) == len(endpoints) and all(s.synced for s in self.statuses())
            ),
            what="every agent synchronised",
        )

    def statuses(self) -> list[AgentStatus]:
        return self.subscriber.status()

    def status(self, node: str) -> AgentStatus:
        return next(s for s in self.statuses() if s.endpoint.node == node)

    def runs(self, keys: list[bytes]) -> dict[str, int]:
        return {n: m.chunks for n, m in self.tracker.longest_prefixes(keys).items()}

    def agrees(self, agents: dict[str, AgentProcess], *chains: list[bytes]) -> Callable[[], bool]:
        """The index's match of every chain on every node is what the node's agent holds."""

        def check() -> bool:
            return all(
                self.runs(keys).get(node, 0) == held(agent, keys)
                for keys in chains
                for node, agent in agents.items()
            )

        return check


@pytest.fixture
def index() -> Iterator[Index]:
    index = Index()
    yield index
    index.subscriber.stop()


_clients: dict[str, AgentClient] = {}


def client_of(agent: AgentProcess) -> AgentClient:
    """One client per agent endpoint (it says hello again by itself after a restart)."""
    if agent.zmq not in _clients:
        _clients[agent.zmq] = AgentClient(agent.zmq, token=ADMIN_TOKEN)
    return _clients[agent.zmq]


@pytest.fixture(autouse=True)
def _close_clients(make_agents: Agents) -> Iterator[None]:
    """Close the clients while their agents still run (closing ends the session)."""
    yield
    for client in _clients.values():
        client.close()
    _clients.clear()


def held(agent: AgentProcess, keys: list[bytes]) -> int:
    """How many leading chunks of ``keys`` the agent holds (its own lookup, no lock)."""
    return len(client_of(agent).lookup(TENANT, keys, lock=False).offsets)


def store(agent: AgentProcess, keys: list[bytes], size: int = 1000) -> None:
    client_of(agent).store_inline(TENANT, keys, [bytes(size)] * len(keys))


def endpoint(node: str, agent: AgentProcess) -> AgentEndpoint:
    return AgentEndpoint(node, agent.zmq, agent.events)


def test_the_index_follows_stores_evictions_and_clears_on_several_agents(
    index: Index, make_agents: Agents
) -> None:
    small, *others = make_agents(1, L1_SIZE="1MiB", PAGE_SIZE="64KiB") + make_agents(2)
    start_all([small, *others])
    agents = {"n0": small, "n1": others[0], "n2": others[1]}
    index.follow([endpoint(node, agent) for node, agent in agents.items()])
    prompt, other = chain("prompt", 8), chain("other", 5)
    store(small, prompt)
    store(agents["n1"], prompt[:3])
    store(agents["n2"], other)
    wait_until(
        lambda: index.runs(prompt) == {"n0": 8, "n1": 3} and index.runs(other) == {"n2": 5},
        what="stores indexed",  # each agent's events arrive on their own schedule
    )

    # 16 pages of 64 KiB on n0: these stores push it past its high watermark.
    pressure = chain("pressure", 12)
    for position in range(len(pressure)):
        store(small, pressure[: position + 1], size=60_000)
    assert held(small, prompt) < 8, "the agent evicted nothing"
    wait_until(index.agrees(agents, prompt, pressure, other), what="evictions indexed")

    assert client_of(agents["n2"]).clear(TENANT) == 5
    wait_until(lambda: index.runs(other) == {}, what="the clear indexed")
    statuses = index.statuses()
    assert all(status.resyncs["gap"] == 0 for status in statuses)
    # Events carry their publish time: the lag is measured, and small on one machine.
    assert all(s.event_lag is not None and 0 <= s.event_lag < 5 for s in statuses), statuses


def test_agent_restarts_are_resynchronised(index: Index, make_agents: Agents) -> None:
    (agent,) = make_agents(1, EVENTS_PORT=str(free_port()))
    agent.start()
    agent.fix_ports()  # a restarted agent comes back at the same endpoints
    index.follow([endpoint("n0", agent)])
    before = chain("before", 4)
    store(agent, before)
    wait_until(lambda: index.runs(before) == {"n0": 4})
    first_id = index.status("n0").agent_id

    assert agent.stop() == 0
    wait_until(lambda: not index.status("n0").connected, what="the disconnection")
    agent.start()  # warm restart: the segment and its chunks are adopted
    wait_until(
        lambda: index.status("n0").synced and index.status("n0").agent_id != first_id,
        what="a resync with the new agent",
    )
    assert index.runs(before) == {"n0": 4}
    after = chain("after", 2)
    store(agent, after)
    wait_until(lambda: index.runs(after) == {"n0": 2}, what="events of the new agent")

    assert agent.stop() == 0
    agent.segment_path.unlink()  # this time the agent starts from an empty segment
    agent.start()
    wait_until(lambda: index.runs(before) == {} and index.runs(after) == {}, what="a cold restart")
    resyncs = index.status("n0").resyncs
    assert resyncs["connected"] + resyncs["restart"] >= 3  # first contact and two restarts


def test_a_dropped_subscriber_catches_up(index: Index, make_agents: Agents) -> None:
    (agent,) = make_agents(1)
    agent.start()
    proxy = TcpProxy(agent.events)
    try:
        index.follow([AgentEndpoint("n0", agent.zmq, proxy.endpoint)])
        kept, lost = chain("kept", 4), chain("lost", 3)
        store(agent, kept)
        wait_until(lambda: index.runs(kept) == {"n0": 4})
        proxy.cut()
        wait_until(lambda: not index.status("n0").connected, what="the cut")
        store(agent, lost)  # published while the index hears nothing
        client_of(agent).clear(TENANT)
        store(agent, kept[:2])
        assert index.runs(kept) == {"n0": 4}  # stale, until the connection is back
        proxy.restore()
        wait_until(
            lambda: index.runs(kept) == {"n0": 2} and index.runs(lost) == {}, what="catching up"
        )
        assert index.status("n0").resyncs["connected"] >= 2
    finally:
        proxy.close()
