"""The connector against the installed vLLM's connector API: every supported release.

vLLM calls the connector through ``KVConnectorBase_V1``, whose hooks change between
minor releases. A hook renamed in a new release is never called, and the cache silently
stops hitting; a parameter renamed or added breaks only at the first request. These tests
fail, naming the hook, when:

* the connector no longer loads as vLLM loads it (module path, factory, base class);
* a hook vLLM declares abstract is not implemented;
* a hook the connector implements is not vLLM's any more (renamed or removed), or its
  signature differs from vLLM's: parameter names, kinds, order, defaults, and parameter
  and return annotations where vLLM states them (compared as written, module paths and
  quotes aside: ours are strings under ``from __future__ import annotations``);
  classmethods must stay classmethods, properties properties;
* vLLM has a hook the connector neither implements nor lists in :data:`INHERITED` with
  the reason vLLM's default is right for kvpool: a new hook is a decision to make;
* the halves no longer work with vLLM's own types and call sites: two engines of vLLM's
  scheduler and model-runner code (:mod:`.vllm_steps`) share a real agent; the first
  stores a prompt's chunks, the second finds them (vLLM's ``SchedulerOutput`` counts them
  as computed) and loads the same bytes into its own blocks before its forward.

They run in every venv of the matrix (``make test-vllm VLLM=<version>``), including
vLLM 0.33, which exists only as a CUDA wheel: there vLLM's Python API runs beside the CPU
torch on its CPU platform (see :func:`.vllm_steps.cpu_platform_env`).
"""

from __future__ import annotations

import inspect
import os
import random
import re
from abc import ABC
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest
import torch

from kvpool.common.disagg import DecodeParams, PrefillParams
from tests.support.agent_process import ENGINE_TOKEN, AgentProcess
from tests.support.engines import write_model

from .vllm_steps import RUNNERS, Runner, StepEngine, agent_config, cpu_platform_env, kv_cache_config

os.environ.update(cpu_platform_env())  # before vLLM's first import picks its platform

import vllm
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from kvpool.connector.facade import KvpoolConnector
from kvpool.connector.metadata import KVPoolConnectorMetadata, KVPoolConnectorWorkerMetadata

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig

pytestmark = [pytest.mark.process, pytest.mark.timeout(300)]

BASE = KVConnectorBase_V1
VLLM = f"vLLM {vllm.__version__}"

OWN: dict[str, str] = {
    "scheduler": "the scheduler half (kvpool's, not a hook)",
    "worker": "the worker half (kvpool's, not a hook)",
}
"""Public members of KvpoolConnector that are not vLLM hooks."""

INHERITED: dict[str, str] = {
    # vLLM's own machinery, called by vLLM or by the connector
    "role": "vLLM's",
    "bind_connector_metadata": "vLLM's; the halves read it with _get_connector_metadata",
    "clear_connector_metadata": "vLLM's",
    "has_connector_metadata": "vLLM's",
    "_get_connector_metadata": "vLLM's; the facade reads the step's metadata with it",
    "bind_kv_cache_manager": "kvpool needs neither the cache manager nor the block pool",
    "bind_gpu_block_pool": "kvpool needs neither the cache manager nor the block pool",
    "set_xfer_handshake_metadata_pp_aware": (
        "vLLM's default passes pipeline rank 0's handshakes to set_xfer_handshake_metadata "
        "and refuses others (kvpool does not split pipeline stages)"
    ),
    # capabilities kvpool does not claim
    "supports_divergent_local_hybrid_hits": "False: kvpool restores no recurrent state",
    "get_loaded_kv_cache_group_ids": (
        "vLLM's default, the prefix-cacheable groups: a hit restores every group kvpool "
        "caches, and an engine with a group it cannot cache gets no hits"
    ),
    "register_finished_partial_tail": "partial chunks are never stored",
    "has_pending_block_frees": "held blocks are freed by finished stores, not on demand",
    "take_events": "KV events come from the agent (the index reads them), not vLLM",
    "get_kv_connector_kv_cache_events": "KV events come from the agent, not vLLM",
    "get_finished_count": "every worker reports its held requests",
    "reset_cache": "the pool is shared by engines: not one engine's to clear",
    # how kvpool copies
    "get_mem_pool_context": "vLLM allocates the KV cache; kvpool maps its own segment",
    "set_host_xfer_buffer_ops": "kvpool copies with its own copier",
    "get_required_kvcache_layout": "any layout: kvpool reads it from shape and stride",
    "requires_piecewise_for_cudagraph": "no layer-wise hooks (loads and stores are per step)",
    "finish_forward": "loads finish in start_load_kv; stores start in wait_for_save",
    "reset_capture_state": "no state is kept while CUDA graphs are captured",
    # sleep mode (0.33)
    "supports_sleep_mode": (
        "True: vLLM's sleep keeps the KV cache's addresses (CuMem) and drains transfers "
        "first; the copier's views stay valid and the segment is not device memory"
    ),
    "unregister_kv_caches": "nothing registered with a device or NIC: nothing to drop",
    "restore_kv_caches": "nothing registered with a device or NIC: nothing to restore",
    # metrics (0.32)
    "get_external_cache_hit_sources": (
        "vLLM's default reports every hit under _cache_hit_source, which kvpool sets to HOST "
        "(test_hits_are_reported_as_host_memory)"
    ),
}
"""vLLM hooks (of any supported release) left to vLLM's default, and why that is right."""


# ------------------------------------------------------------------ signatures


def _members(*classes: type) -> dict[str, Any]:
    """Members the classes define (the later ones win), dunders and ABC's aside."""
    return {
        name: value
        for cls in classes
        for name, value in vars(cls).items()
        if not (name.startswith("__") and name.endswith("__")) and name != "_abc_impl"
    }


try:  # the hybrid KV cache manager's interface
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA

    HMA: tuple[type, ...] = (SupportsHMA,)
except ImportError:
    HMA = ()

VLLM_HOOKS = {
    **_members(*reversed([cls for cls in BASE.__mro__ if cls not in (ABC, object)]), *HMA),
    "__init__": BASE.__init__,
}
"""KVConnectorBase_V1's members, its own and those of vLLM classes it derives from, and
those of ``SupportsHMA`` where vLLM has it."""


def _kind(member: Any) -> tuple[str, Callable[..., Any] | None]:
    if isinstance(member, classmethod):
        return "classmethod", member.__func__
    if isinstance(member, staticmethod):
        return "staticmethod", member.__func__
    if isinstance(member, property):
        return "property", member.fget
    if inspect.isfunction(member):
        return "method", member
    return "attribute", None


def _annotation(value: Any) -> str | None:
    """An annotation as written, without module paths, quotes or spaces."""
    if value is inspect.Parameter.empty:
        return None
    text = value if isinstance(value, str) else inspect.formatannotation(value)
    text = re.sub(r"\b(?:[A-Za-z_]\w*\.)+([A-Za-z_]\w*)", r"\1", text.replace("'", ""))
    return re.sub(r"\s+", "", text.replace('"', ""))


def incompatibilities(name: str, ours: Any, theirs: Any) -> list[str]:
    """Why KvpoolConnector's ``name`` would not be called as vLLM calls its own."""
    our_kind, our_function = _kind(ours)
    their_kind, their_function = _kind(theirs)
    if our_kind != their_kind:
        return [f"{name}: a {our_kind} in kvpool, a {their_kind} in {VLLM}"]
    if our_function is None or their_function is None:
        if not isinstance(ours, type(theirs)):
            return [f"{name}: {type(ours).__name__} in kvpool, {type(theirs).__name__} in {VLLM}"]
        return []
    ours_sig, theirs_sig = inspect.signature(our_function), inspect.signature(their_function)
    where = f"{name}{ours_sig} in kvpool, {name}{theirs_sig} in {VLLM}"
    problems: list[str] = []
    our_params = list(ours_sig.parameters.values())
    for index, theirs_param in enumerate(theirs_sig.parameters.values()):
        if index >= len(our_params):
            problems.append(f"{name}: no parameter {theirs_param.name!r}: {where}")
            continue
        ours_param = our_params[index]
        if (ours_param.name, ours_param.kind) != (theirs_param.name, theirs_param.kind):
            problems.append(
                f"{name}: parameter {index} is {ours_param.name!r} ({ours_param.kind.name}), "
                f"vLLM's is {theirs_param.name!r} ({theirs_param.kind.name}): {where}"
            )
        elif ours_param.default != theirs_param.default:
            problems.append(f"{name}: default of {ours_param.name!r} differs: {where}")
        elif (expected := _annotation(theirs_param.annotation)) is not None and (
            _annotation(ours_param.annotation) != expected
        ):
            problems.append(f"{name}: type of {ours_param.name!r} differs: {where}")
    for extra in our_params[len(theirs_sig.parameters) :]:
        if extra.kind not in (extra.VAR_POSITIONAL, extra.VAR_KEYWORD) and extra.default is (
            extra.empty
        ):
            problems.append(f"{name}: vLLM does not pass {extra.name!r}: {where}")
    expected = _annotation(theirs_sig.return_annotation)
    if expected is not None and _annotation(ours_sig.return_annotation) != expected:
        problems.append(f"{name}: return type differs: {where}")
    return problems


def test_the_connector_loads_as_vllm_loads_it() -> None:
    from vllm.config import KVTransferConfig

    config = KVTransferConfig(
        kv_connector="KvpoolConnector",
        kv_connector_module_path="kvpool.connector",
        kv_role="kv_both",
    )
    loaded = KVConnectorFactory.get_connector_class(config)
    assert loaded is KvpoolConnector
    assert issubclass(loaded, BASE)
    assert not inspect.isabstract(loaded), sorted(getattr(loaded, "__abstractmethods__", ()))


def test_the_connector_keeps_the_hybrid_kv_cache_manager_on() -> None:
    """vLLM turns its hybrid manager off for a connector without ``SupportsHMA``: sliding
    windows then keep KV for the whole context, and state-space hybrids fail to start."""
    from vllm.config import KVTransferConfig

    assert HMA, f"{VLLM} has no SupportsHMA: update the connector's HMA import"
    config = KVTransferConfig(
        kv_connector="KvpoolConnector",
        kv_connector_module_path="kvpool.connector",
        kv_role="kv_both",
    )
    assert KVConnectorFactory.supports_hma_config(config)


def test_every_abstract_hook_is_implemented() -> None:
    abstract = sorted(
        {*BASE.__abstractmethods__, *(name for cls in HMA for name in cls.__abstractmethods__)}
    )
    assert abstract, f"{VLLM} declares no abstract hook: is this KVConnectorBase_V1?"
    missing = [name for name in abstract if name not in vars(KvpoolConnector)]
    assert not missing, f"{VLLM}'s abstract hooks kvpool does not implement: {missing}"
    problems = [
        problem
        for name in abstract
        for problem in incompatibilities(name, vars(KvpoolConnector)[name], VLLM_HOOKS[name])
    ]
    assert not problems, "\n".join(problems)


HOOKS = sorted(
    name
    for name in _members(KvpoolConnector)
    if name not in OWN and not (name.startswith("_") and name not in VLLM_HOOKS)
)
"""What KvpoolConnector implements for vLLM: its public members (but :data:`OWN`) and
those that override vLLM's private ones; its other private members are its helpers."""


@pytest.mark.parametrize("name", [*HOOKS, "__init__"])
def test_what_the_connector_implements_is_vllms_hook(name: str) -> None:
    assert name in VLLM_HOOKS, (
        f"KvpoolConnector.{name} is no hook of {VLLM}'s KVConnectorBase_V1 (renamed or "
        "removed?): vLLM never calls it"
    )
    problems = incompatibilities(name, vars(KvpoolConnector)[name], VLLM_HOOKS[name])
    assert not problems, "\n".join(problems)


def test_every_vllm_hook_is_implemented_or_knowingly_inherited() -> None:
    ours = _members(KvpoolConnector)
    undecided = {
        name: _describe(value)
        for name, value in VLLM_HOOKS.items()
        if name not in ours and name not in {**INHERITED, "__init__": ""}
    }
    assert not undecided, (
        f"{VLLM}'s KVConnectorBase_V1 has hooks kvpool neither implements nor inherits "
        "knowingly; decide, then implement them or add them to INHERITED with the reason:\n"
        + "\n".join(f"  {name}: {description}" for name, description in undecided.items())
    )
    both = sorted(set(ours) & set(INHERITED))
    assert not both, f"implemented, yet listed in INHERITED: {both}"
    clash = sorted(set(OWN) & set(VLLM_HOOKS))
    assert not clash, f"{VLLM} has hooks named as kvpool's own members: {clash}"


def _describe(member: Any) -> str:
    kind, function = _kind(member)
    if function is None:
        return f"{kind} = {member!r}"
    return f"{kind} {function.__name__}{inspect.signature(function)}"


# ------------------------------------------------------------------ both halves, two engines

SALT = "conformance"
BLOCKS_PER_CHUNK = 2
CHUNKS = 3
"""Chunks of the prompt (which has a few tokens more, a partial block never stored)."""


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory, agent: AgentProcess) -> VllmConfig:
    model = write_model(tmp_path_factory.mktemp("model"))
    token_file = tmp_path_factory.mktemp("token") / "token"
    token_file.write_text(ENGINE_TOKEN + "\n")  # as a mounted Secret
    return agent_config(model, agent.zmq, token_file, BLOCKS_PER_CHUNK)


@pytest.fixture(scope="module")
def plan(config: VllmConfig) -> KVCacheConfig:
    return kv_cache_config(config, num_blocks=48)


def prompt(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(length)]


def _halves(engine: StepEngine) -> tuple[KvpoolConnector, KvpoolConnector]:
    scheduler, worker = engine.scheduler_connector, engine.worker
    assert isinstance(scheduler, KvpoolConnector) and isinstance(worker, KvpoolConnector)
    assert scheduler.role == KVConnectorRole.SCHEDULER and worker.role == KVConnectorRole.WORKER
    return scheduler, worker


@pytest.fixture
def engines(
    config: VllmConfig, plan: KVCacheConfig, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[[Runner], StepEngine]]:
    """Start engines (each its scheduler and one worker) that share the agent."""
    started: list[StepEngine] = []

    def start(runner: Runner) -> StepEngine:
        started.append(StepEngine(config, plan, runner, monkeypatch))
        return started[-1]

    yield start
    for engine in started:
        engine.shutdown()


def compute_and_store(engine: StepEngine, tokens: list[int]) -> dict[str, torch.Tensor]:
    """Run a request whose forward writes KV for the whole prompt; return, per layer, the
    KV of the blocks of its whole chunks (what the connector stores)."""
    full_blocks = CHUNKS * BLOCKS_PER_CHUNK
    scheduler, worker = _halves(engine)
    computed: dict[str, torch.Tensor] = {}
    block_ids: list[int] = []
    engine.add("first", tokens, SALT)

    def forward(output: SchedulerOutput) -> None:
        (new,) = output.scheduled_new_reqs
        assert new.num_computed_tokens == 0, "a hit in an empty agent"
        assert not output.has_sync_kv_loads
        block_ids.extend(engine.block_ids("first"))
        generator = torch.Generator().manual_seed(1)
        for name, cache in engine.caches.items():
            values = torch.randn(cache[block_ids].shape, generator=generator)
            cache[block_ids] = values.to(cache.dtype)
            computed[name] = cache[block_ids[:full_blocks]].clone()

    step = engine.step(forward)
    assert block_ids, "vLLM ran no forward"
    assert isinstance(step.output.kv_connector_metadata, KVPoolConnectorMetadata)
    (store,) = step.output.kv_connector_metadata.stores
    assert store.block_ids == (tuple(block_ids[:full_blocks]),)
    stored = worker.worker.counters.totals["stored_chunks"]
    assert stored == CHUNKS, f"{stored} chunks stored: did vLLM call wait_for_save?"
    assert step.kv is not None and step.kv.invalid_block_ids == set()
    assert isinstance(step.kv.kv_connector_worker_meta, KVPoolConnectorWorkerMetadata)
    assert step.finished == {"first"}
    engine.step()  # the finished request reaches the worker's get_finished
    assert not scheduler.has_pending_push_work()
    assert scheduler.scheduler.tracked_requests == 0
    return computed


@pytest.mark.parametrize("runner", RUNNERS)
def test_a_store_in_one_engine_is_a_load_in_another(
    empty_agent: AgentProcess, engines: Callable[[Runner], StepEngine], runner: Runner
) -> None:
    first = engines(runner)
    block = first.config.cache_config.block_size
    full_blocks = CHUNKS * BLOCKS_PER_CHUNK
    tokens = prompt(full_blocks * block + 5)
    computed = compute_and_store(first, tokens)

    second = engines(runner)
    _, worker = _halves(second)
    second.add("other-tenant", tokens, "another salt")
    step = second.step()
    (new,) = step.output.scheduled_new_reqs
    assert new.num_computed_tokens == 0, "the cache salt did not keep tenants apart"

    second.add("second", tokens, SALT)
    seen: list[list[int]] = []

    def forward(output: SchedulerOutput) -> None:
        """The loaded KV is in the blocks before attention reads them (nothing but the
        connector wrote this engine's cache: the bytes came through the agent)."""
        (new,) = output.scheduled_new_reqs
        assert new.num_computed_tokens == full_blocks * block, "no hit through the agent"
        assert output.has_sync_kv_loads
        block_ids = second.block_ids("second")[:full_blocks]
        seen.append(block_ids)
        for name, cache in second.caches.items():
            assert torch.equal(cache[block_ids], computed[name]), f"{name}: wrong bytes"

    step = second.step(forward)
    assert seen, "vLLM ran no forward"
    assert step.kv is not None and step.kv.invalid_block_ids == set()
    assert step.finished == {"second"}
    assert worker.worker.counters.totals["loaded_chunks"] == CHUNKS
    second.step()


def test_a_disaggregated_prefill_is_a_decode_of_all_but_the_last_token(
    empty_agent: AgentProcess, engines: Callable[[Runner], StepEngine]
) -> None:
    """Through vLLM's own scheduler: a prefill (kvpool's prefill params) stores its prompt's
    tail and returns what the decode needs in its output's ``kv_transfer_params``; another
    engine's decode with them takes a hit that ends inside a block (the prompt but its last
    token), loads the tail's bytes, and computes one token."""
    first = engines("v1")
    block = first.config.cache_config.block_size
    tokens = prompt(CHUNKS * BLOCKS_PER_CHUNK * block + block + 5)  # a tail of two blocks
    first.add("prefill", tokens, SALT, PrefillParams().to_json())
    written: list[int] = []
    computed: dict[str, torch.Tensor] = {}

    def forward(output: SchedulerOutput) -> None:
        written.extend(first.block_ids("prefill"))
        generator = torch.Generator().manual_seed(2)
        for name, cache in first.caches.items():
            cache[written] = torch.randn(cache[written].shape, generator=generator).to(cache.dtype)
            computed[name] = cache[written].clone()

    step = first.step(forward)
    assert isinstance(step.output.kv_connector_metadata, KVPoolConnectorMetadata)
    chunks, tail = step.output.kv_connector_metadata.stores
    assert len(chunks.keys[0]) == CHUNKS and len(tail.keys[0]) == 1
    assert step.transfer_params == {"prefill": DecodeParams(len(tokens), tail=True).to_json()}
    first.step()

    second = engines("v1")
    params = DecodeParams(len(tokens), tail=True, wait_ms=0).to_json()
    second.add("decode", tokens, SALT, params)
    seen: list[int] = []

    def check(output: SchedulerOutput) -> None:
        (new,) = output.scheduled_new_reqs
        assert new.num_computed_tokens == len(tokens) - 1, "not a hit of all but one token"
        assert output.num_scheduled_tokens["decode"] == 1
        seen.extend(second.block_ids("decode"))
        for name, cache in second.caches.items():
            assert torch.equal(cache[seen], computed[name]), f"{name}: wrong bytes"

    step = second.step(check)
    assert seen, "vLLM ran no forward"
    assert step.kv is not None and step.kv.invalid_block_ids == set()
    assert step.transfer_params == {}  # a decode returns nothing
    second.step()


def test_hits_are_reported_as_host_memory(engines: Callable[[Runner], StepEngine]) -> None:
    """vLLM (from 0.32) labels connector hits by tier in its prefix-cache metrics, and asks
    connectors to say theirs ("Subclasses must set HOST/DISK/P2P or override
    get_external_cache_hit_sources()"). kvpool's loads come from the node's shared memory.
    """
    hit_source = pytest.importorskip("vllm.v1.metrics.cache_hit_source")
    engine = engines("v1")
    request = engine.add("r", prompt(100))
    sources = engine.scheduler_connector.get_external_cache_hit_sources(request, 64)
    assert sources == {hit_source.CacheHitSource.HOST: 64}
