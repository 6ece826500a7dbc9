"""The scheduler probes a real agent's table of ready chunks instead of asking it."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

from kvpool.client import AgentClient
from kvpool.common import keys
from kvpool.common.probe_table import table_path
from kvpool.connector.counters import Counters
from kvpool.connector.discovery import AgentAddress
from kvpool.connector.layout import GroupRule
from kvpool.connector.metadata import KVPoolConnectorHandshakeMetadata
from kvpool.connector.scheduler import KVPoolConnectorScheduler
from kvpool.connector.settings import Transport
from tests.support.agent_process import ADMIN_TOKEN, AgentProcess

from .agent_link import agent_link
from .fakes import BLOCK, CHUNK, LAYOUT, FakeRequest, chain, scheduler_output, tokens

pytestmark = pytest.mark.process

TENANT = keys.tenant_id(None)


@pytest.fixture
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    process = AgentProcess(tmp_path_factory.mktemp("agent"))
    process.start()
    process.fix_ports()  # a restarted agent listens where the scheduler looks
    yield process
    process.cleanup()


def scheduler(
    agent: AgentProcess, *, prefetch_wait_s: float = 0.0, transport: Transport = "auto"
) -> KVPoolConnectorScheduler:
    counters = Counters()
    address = AgentAddress(agent.zmq, None, CHUNK, transport)
    half = KVPoolConnectorScheduler(
        model="m",
        dtype="bfloat16",
        tp_size=1,
        groups=[GroupRule("full", BLOCK)],
        link=agent_link(agent, counters, "scheduler"),
        counters=counters,
        prefetch_wait_s=prefetch_wait_s,
        segment_path=address.segment_for,
    )
    half.configure({0: KVPoolConnectorHandshakeMetadata(LAYOUT, CHUNK, True)})
    return half


def in_a_step(half: KVPoolConnectorScheduler, request: FakeRequest) -> tuple[int | None, bool]:
    """The request's match, asked in a step of its own: a step has 10 ms for questions to the
    agent, and a first one (connect, hello) may spend them all on a busy machine."""
    half.build_connector_meta(scheduler_output())
    return half.get_num_new_matched_tokens(request, 0)


def hits(agent: AgentProcess) -> tuple[int, int]:
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
        stats = client.stats()
    return int(stats["hits"]), int(stats["misses"])


def test_a_hit_is_found_without_waiting_for_the_agent(agent: AgentProcess) -> None:
    prompt = tokens(1000)
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
        client.store(TENANT, chain(prompt)[:3], [b"k" * 64] * 3)
    half = scheduler(agent, prefetch_wait_s=2.0)
    in_a_step(half, FakeRequest("warm", tokens(300, seed=9)))  # connects
    before = hits(agent)

    os.kill(agent.pid, signal.SIGSTOP)  # the agent answers nothing now
    try:
        started = time.perf_counter()
        assert in_a_step(half, FakeRequest("r", prompt)) == (3 * CHUNK, False)
        assert time.perf_counter() - started < 0.5  # the lookup timeout is 1 s
    finally:
        os.kill(agent.pid, signal.SIGCONT)
    assert half.counters.totals["local_probes"] == 1  # the warm-up missed: it asked
    # the agent still counts the request's hits and misses, once
    deadline = time.monotonic() + 5
    while hits(agent) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert hits(agent) == (before[0] + 3, before[1])


def test_a_partial_hit_asks_the_agent_for_its_prefetch(agent: AgentProcess) -> None:
    """The table cannot know what L2 holds: a run that stops short is a round trip."""
    prompt = tokens(1000)
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
        client.store(TENANT, chain(prompt)[:1], [b"k" * 64])
    half = scheduler(agent, prefetch_wait_s=2.0)
    assert in_a_step(half, FakeRequest("r", prompt)) == (CHUNK, False)
    assert half.counters.totals["local_probes"] == 0
    assert half.counters.totals["lookups"] == 1
    no_prefetch = scheduler(agent)  # without prefetch the table's answer is final
    assert in_a_step(no_prefetch, FakeRequest("s", prompt)) == (CHUNK, False)
    assert no_prefetch.counters.totals["local_probes"] == 1


def test_without_a_table_every_probe_asks_the_agent(agent: AgentProcess) -> None:
    """An agent of an older version keeps no table: nothing changes but the round trip."""
    prompt = tokens(1000)
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
        client.store(TENANT, chain(prompt)[:3], [b"k" * 64] * 3)
        assert client.info is not None
        table_path(client.info.segment_path).unlink()
    half = scheduler(agent)
    assert in_a_step(half, FakeRequest("r", prompt)) == (3 * CHUNK, False)
    assert half.counters.totals["local_probes"] == 0
    assert half.counters.totals["lookups"] == 1


def test_a_tenants_pod_reads_no_table_and_asks_the_agent(agent: AgentProcess) -> None:
    """The transport "messages" (a tenant's pod): the table beside the segment lists every
    tenant's keys, and such a pod is given neither; every probe is a lookup."""
    prompt = tokens(1000)
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
        client.store(TENANT, chain(prompt)[:3], [b"k" * 64] * 3)
    half = scheduler(agent, transport="messages")
    for name in ("r", "s"):
        assert in_a_step(half, FakeRequest(name, prompt)) == (3 * CHUNK, False)
    assert half.counters.totals["local_probes"] == 0
    assert half.counters.totals["lookups"] == 2


def test_a_dead_agents_table_is_not_read_and_a_restarted_agents_is(agent: AgentProcess) -> None:
    """A scheduler that finds every hit in the table does not talk to the agent: the table's
    lock tells it the agent died; it asks (a miss while down, a hello once back), then maps
    the new agent's table."""
    prompt = tokens(1000)
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
        client.store(TENANT, chain(prompt)[:3], [b"k" * 64] * 3)
    half = scheduler(agent)
    assert in_a_step(half, FakeRequest("r", prompt)) == (3 * CHUNK, False)
    agent.kill()
    assert in_a_step(half, FakeRequest("dead", prompt)) == (0, False)
    agent.start()  # warm restart: the chunks are adopted, and published in a new table
    time.sleep(0.2)  # the link's pause after the failure
    assert in_a_step(half, FakeRequest("s", prompt)) == (3 * CHUNK, False)
    assert half.counters.totals["local_probes"] == 2  # r, and s from the new agent's table
    assert half.counters.totals["agent_failures"] == 1
