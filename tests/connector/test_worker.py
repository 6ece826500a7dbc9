"""The worker half against a real agent process, with small CPU caches standing in for vLLM's."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from kvpool.client import AgentClient
from kvpool.common.segment import door_path
from kvpool.connector.jobs import LoadJob, StepJobs, StoreJob
from kvpool.connector.layout import GroupRule
from kvpool.connector.worker import KVPoolConnectorWorker
from tests.support.agent_process import ADMIN_TOKEN, AgentProcess

from .workers import (
    BLOCK_TOKENS,
    BLOCKS,
    CONTENT,
    HEADS,
    KEYS,
    LAYERS,
    TENANT,
    cpu_caches,
    make_worker,
    store,
    worker_of,
)

pytestmark = pytest.mark.process


def _agent(workdir: Path) -> Iterator[AgentProcess]:
    process = AgentProcess(workdir)
    process.start()
    process.fix_ports()
    yield process
    process.cleanup()


@pytest.fixture(scope="module")
def shared_agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    yield from _agent(tmp_path_factory.mktemp("agent"))


@pytest.fixture
def agent(shared_agent: AgentProcess) -> AgentProcess:
    """The module's agent, emptied."""
    with AgentClient(shared_agent.zmq, token=ADMIN_TOKEN) as client:
        client.clear()
    return shared_agent


@pytest.fixture
def own_agent(tmp_path: Path) -> Iterator[AgentProcess]:
    """An agent of the test's own, for killing."""
    yield from _agent(tmp_path)


def test_store_then_load_in_another_worker(agent: AgentProcess) -> None:
    source, source_caches = make_worker(agent, seed=1)
    assert source.handshake is not None
    assert source.handshake.stores_complete_in_step
    assert "content=TEST" in source.handshake.kv_layout

    store(source, 1, KEYS[:2], [3, 4, 5, 6])

    assert source.counters.totals["stored_chunks"] == 2
    meta = source.build_worker_meta()
    assert meta is not None and meta.completed_stores == {1: 1}

    target, target_caches = make_worker(agent, seed=None)
    job = LoadJob("r2", TENANT, (tuple(KEYS[:2]),), ((9, 10, 11),), first_tokens=4)
    target.start_load(StepJobs(loads=[job]))

    assert target.take_load_errors() == set()
    for before, after in zip(source_caches, target_caches, strict=True):
        assert torch.equal(after[[9, 10, 11]], before[[4, 5, 6]])
        assert after[:9].eq(0).all()
    assert target.counters.totals["loaded_chunks"] == 2


def test_a_worker_never_copies_through_another_agent_s_door(
    agent: AgentProcess, tmp_path: Path
) -> None:
    """A door path that names another agent's door (a wrong door_path): that door knows none
    of this agent's chunk files, so nothing is copied anywhere; the stores fail (counted),
    and neither agent holds a chunk of them."""
    other = AgentProcess(tmp_path)
    other.start()
    try:
        worker, _ = make_worker(agent, seed=1, door=door_path(other.segment_path))
        store(worker, 1, KEYS[:2], [3, 4, 5, 6])
        assert worker.counters.totals["stored_chunks"] == 0
        assert worker.counters.totals["failed_stores"] == 1
        for each in (agent, other):
            with AgentClient(each.zmq, token=ADMIN_TOKEN) as client:
                assert client.lookup(TENANT, KEYS[:2], lock=False).count == 0
    finally:
        other.cleanup()


def test_missing_chunks_are_reported_for_recompute(agent: AgentProcess) -> None:
    source, _ = make_worker(agent, seed=2)
    store(source, 1, KEYS[:2], [0, 1, 2, 3])
    target, _ = make_worker(agent, seed=None)

    # chunk 2 was never stored (or was evicted after the scheduler's lookup)
    job = LoadJob("r", TENANT, (tuple(KEYS[:3]),), ((8, 9, 10, 11, 12, 13),), first_tokens=0)
    target.start_load(StepJobs(loads=[job]))

    assert target.take_load_errors() == {12, 13}
    assert target.take_load_errors() == set()  # reported once
    assert target.counters.totals["load_failed_chunks"] == 1


def test_present_chunks_are_not_copied_twice(agent: AgentProcess) -> None:
    worker, _ = make_worker(agent, seed=3)
    store(worker, 1, KEYS[:2], [0, 1, 2, 3])
    store(worker, 2, KEYS[:3], [0, 1, 2, 3, 4, 5])
    assert worker.counters.totals["present_chunks"] == 2
    assert worker.counters.totals["stored_chunks"] == 3


def agent_requests(agent: AgentProcess, op: str) -> int:
    """Requests of kind ``op`` the agent has served (its /metrics)."""
    text = httpx.get(f"{agent.http}/metrics").text
    prefix = f'kvpool_request_seconds_count{{op="{op}"}} '
    line = next((line for line in text.splitlines() if line.startswith(prefix)), prefix + "0")
    return int(float(line.removeprefix(prefix)))


def test_a_hit_finds_the_chunks_it_stores_next_cached_in_its_load_lookup(
    agent: AgentProcess,
) -> None:
    """A prompt that ends on a chunk boundary: vLLM loads chunks 0-1, computes chunk 2 and
    stores it in the same step; the agent has it already, so nothing is reserved."""
    source, _ = make_worker(agent, seed=4)
    store(source, 1, KEYS[:4], list(range(8)))
    target, _ = make_worker(agent, seed=None)
    load = LoadJob("r", TENANT, (tuple(KEYS[:2]),), ((8, 9, 10, 11),), first_tokens=0)
    computed = StoreJob(2, "r", TENANT, (tuple(KEYS[2:3]),), (KEYS[1],), ((12, 13),))
    meta = StepJobs(loads=[load], stores=[computed])
    reservations = agent_requests(agent, "prepare_store")

    target.start_load(meta)
    target.save(meta)

    assert target.take_load_errors() == set()
    assert agent_requests(agent, "prepare_store") == reservations
    assert target.counters.totals["present_chunks"] == 1
    assert target.counters.totals["stored_chunks"] == 0
    built = target.build_worker_meta()
    assert built is not None and built.completed_stores == {2: 1}
    # a store that goes past what the agent has reserves the rest only, after the cached run
    other, _ = make_worker(agent, seed=5)
    load = LoadJob("s", TENANT, (tuple(KEYS[:1]),), ((14, 15),), first_tokens=0)
    new = bytes([9]) * 32
    longer = StoreJob(3, "s", TENANT, ((KEYS[1], KEYS[2], new),), (KEYS[0],), (tuple(range(2, 8)),))
    meta = StepJobs(loads=[load], stores=[longer])
    other.start_load(meta)
    other.save(meta)
    assert agent_requests(agent, "prepare_store") == reservations + 1
    assert other.counters.totals["present_chunks"] == 2
    assert other.counters.totals["stored_chunks"] == 1


def test_held_requests_are_reported_when_their_stores_are_done(agent: AgentProcess) -> None:
    worker, _ = make_worker(agent, seed=4)
    store(worker, 1, KEYS[:1], [0, 1])
    assert worker.get_finished({"r0"}) == set()  # finished, not held: nothing to report
    # the step after r1 finished: the metadata names it held, finished_req_ids carry it
    worker.start_load(StepJobs(held=["r1"]))
    assert worker.get_finished({"r1"}) == {"r1"}
    assert worker.get_finished(set()) == set()


def test_a_dead_agent_costs_the_cache_only(own_agent: AgentProcess) -> None:
    agent = own_agent
    source, _ = make_worker(agent, seed=5)
    store(source, 1, KEYS[:2], [0, 1, 2, 3])
    target, _ = make_worker(agent, seed=None)
    agent.kill()

    job = LoadJob("r", TENANT, (tuple(KEYS[:2]),), ((4, 5, 6, 7),), first_tokens=0)
    target.start_load(StepJobs(loads=[job]))
    store(target, 9, KEYS[2:3], [0, 1])

    assert target.take_load_errors() == {4, 5, 6, 7}
    assert target.counters.totals["agent_failures"] >= 1
    meta = target.build_worker_meta()
    assert meta is not None and meta.completed_stores == {9: 1}  # given up, not left open

    agent.start()  # the segment survives: the restarted agent adopts it
    for _ in range(20):
        target.start_load(StepJobs(loads=[job]))
        if not target.take_load_errors():
            break
        time.sleep(0.05)
    else:
        pytest.fail("the worker did not reconnect")
    assert target.counters.totals["agent_restarts_seen"] == 1


class InFlight:
    """A copy still in flight (as a DMA on a side stream is) until the test lands it."""

    def __init__(self) -> None:
        self.landed = False

    def done(self) -> bool:
        return self.landed

    def wait(self) -> None:
        assert self.landed, "waited for a copy the test never landed"


def test_a_load_whose_lease_ends_before_its_release_is_recomputed(tmp_path: Path) -> None:
    """A worker that stalls past its read lease may have copied pages that the agent gave
    to another chunk meanwhile: those blocks are reported to vLLM, never used as loaded."""
    quick = {"LEASE_SECONDS": "0.5", "MAINTENANCE_INTERVAL_SECONDS": "0.1"}
    agent = AgentProcess(tmp_path / "agent", settings=quick)
    agent.workdir.mkdir()
    agent.start()
    try:
        source, _ = make_worker(agent, seed=6)
        store(source, 1, KEYS[:2], [0, 1, 2, 3])
        target, _ = make_worker(agent, seed=None)
        copier = target._parts[False].copier  # the chunks' copier
        in_flight: list[InFlight] = []

        def load_slowly(*args: object, **options: bool) -> InFlight:
            copier_load(
                *args, **options
            )  # the bytes are copied; the copy "lands" when the test says
            in_flight.append(InFlight())
            return in_flight[-1]

        copier_load = copier.load
        copier.load = load_slowly  # type: ignore[method-assign]
        job = LoadJob("r", TENANT, (tuple(KEYS[:2]),), ((8, 9, 10, 11),), first_tokens=0)
        target.start_load(StepJobs(loads=[job]))

        time.sleep(1.0)  # the stall: twice the lease, five maintenance passes
        for copy in in_flight:
            copy.landed = True

        assert target.take_load_errors() == {8, 9, 10, 11}
        assert target.counters.totals["load_failed_chunks"] == 2
    finally:
        agent.cleanup()


# ------------------------------------------------------------------ several groups

WINDOW = GroupRule("window", BLOCK_TOKENS, BLOCK_TOKENS - 1)
"""A window of ``BLOCK_TOKENS`` tokens: a chunk of two blocks keeps its last one."""


def make_hybrid_worker(
    agent: AgentProcess, seed: int | None
) -> tuple[KVPoolConnectorWorker, list[torch.Tensor]]:
    """A worker whose layer 0 is full attention and layer 1 a sliding window (two groups)."""
    caches = cpu_caches(seed)
    groups = [(GroupRule("full", BLOCK_TOKENS), LAYERS[:1]), (WINDOW, LAYERS[1:])]
    return worker_of(agent, dict(zip(LAYERS, caches, strict=True)), groups), caches


def test_a_window_group_stores_and_loads_only_its_window(agent: AgentProcess) -> None:
    source, (full, window) = make_hybrid_worker(agent, seed=6)
    assert source.format is not None and source.handshake is not None
    assert source.format.chunk_bytes == 3 * HEADS * BLOCK_TOKENS * CONTENT * 2  # 2 + 1 blocks
    assert "window3;layers=1;blocks=2;kept=1" in source.handshake.kv_layout
    job = StoreJob(1, "r1", TENANT, (tuple(KEYS[:2]),), (None,), ((1, 2, 3, 4), (5, 6, 7, 8)))
    source.save(StepJobs(stores=[job]))
    assert source.counters.totals["stored_chunks"] == 2

    target, (loaded_full, loaded_window) = make_hybrid_worker(agent, seed=None)
    # vLLM's null block (0) outside the window at the hit's end: only the last block is real
    load = LoadJob("r2", TENANT, (tuple(KEYS[:2]),), ((9, 10, 11, 12), (0, 0, 0, 13)), 0)
    target.start_load(StepJobs(loads=[load]))

    assert target.take_load_errors() == set()
    assert torch.equal(loaded_full[[9, 10, 11, 12]], full[[1, 2, 3, 4]])
    assert torch.equal(loaded_window[13], window[8])
    untouched = [block for block in range(BLOCKS) if block != 13]
    assert not loaded_window[untouched].any()  # the null block and the rest: never written


def test_a_block_the_window_did_not_keep_is_recomputed(agent: AgentProcess) -> None:
    """vLLM wants a block of the window group that the chunk does not hold (an engine that
    keeps more than the window): that chunk and the rest are reported, never half loaded."""
    source, _ = make_hybrid_worker(agent, seed=7)
    job = StoreJob(1, "r1", TENANT, (tuple(KEYS[:2]),), (None,), ((1, 2, 3, 4), (5, 6, 7, 8)))
    source.save(StepJobs(stores=[job]))
    target, (loaded_full, _) = make_hybrid_worker(agent, seed=None)

    load = LoadJob("r2", TENANT, (tuple(KEYS[:2]),), ((9, 10, 11, 12), (0, 14, 15, 13)), 0)
    target.start_load(StepJobs(loads=[load]))

    assert target.take_load_errors() == {11, 12, 15, 13}
    assert target.counters.totals["loaded_chunks"] == 1
    assert loaded_full[[9, 10]].any() and not loaded_full[[11, 12]].any()

    # a null block after a real one: never a destination (the null block is vLLM's)
    target, (_, loaded_window) = make_hybrid_worker(agent, seed=None)
    load = LoadJob("r3", TENANT, (tuple(KEYS[:1]),), ((9, 10), (13, 0)), 0)
    target.start_load(StepJobs(loads=[load]))
    assert target.take_load_errors() == {9, 10, 13}
    assert not loaded_window[0].any()


def test_only_a_load_this_steps_forward_reads_holds_the_forward(agent: AgentProcess) -> None:
    """On a GPU the compute stream waits for a load only if the forward of this step reads
    its blocks; a per-request load (vLLM runs the request once it is reported received)
    runs beside the forward. The CPU copier is synchronous, so what the worker asks of the
    copier is what is checked here."""
    source, _ = make_hybrid_worker(agent, seed=8)
    job = StoreJob(1, "r1", TENANT, (tuple(KEYS[:2]),), (None,), ((1, 2, 3, 4), (5, 6, 7, 8)))
    source.save(StepJobs(stores=[job]))

    def asked(per_request: bool) -> list[bool]:
        target, _ = make_hybrid_worker(agent, seed=None)
        copier = target._parts[False].copier  # the chunks' copier
        load, answers = copier.load, []

        def recorded(*args: object, forward_reads: bool = True) -> object:
            answers.append(forward_reads)
            return load(*args, forward_reads=forward_reads)  # type: ignore[arg-type]

        copier.load = recorded  # type: ignore[method-assign,assignment]
        blocks = ((9, 10, 11, 12), (0, 0, 0, 13))
        load_job = LoadJob("r", TENANT, (tuple(KEYS[:2]),), blocks, 0, per_request)
        target.start_load(StepJobs(loads=[load_job]))
        assert target.counters.totals["loaded_chunks"] == 2
        return answers

    assert asked(per_request=True) == [False, False]
    assert asked(per_request=False) == [True, True]
