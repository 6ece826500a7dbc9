"""The scheduler half's planning, with an in-memory agent and stand-ins for vLLM's objects."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvpool.common import keys
from kvpool.connector.counters import Counters
from kvpool.connector.layout import GroupRule
from kvpool.connector.metadata import (
    KVPoolConnectorHandshakeMetadata,
    KVPoolConnectorWorkerMetadata,
)
from kvpool.connector.scheduler import KVPoolConnectorScheduler
from kvpool.connector.scheduler_lookups import PROBE_REUSE_S

from .fakes import (
    BLOCK,
    CHUNK,
    LAYOUT,
    Clock,
    FakeAgent,
    FakeBlocks,
    FakeRequest,
    chain,
    make_link,
    new_request,
    scheduler_output,
    tokens,
)


def make(
    agent: FakeAgent,
    *,
    groups: tuple[GroupRule, ...] = (GroupRule("full", BLOCK),),
    tp: int = 1,
    stores_complete_in_step: bool = True,
    prefetch_wait_s: float = 0.0,
    clock: Clock | None = None,
    loads_per_request: bool = False,
    kv_role: str = "kv_both",
    decode_wait_s: float = 0.0,
) -> KVPoolConnectorScheduler:
    counters = Counters()
    clock = clock or Clock()
    half = KVPoolConnectorScheduler(
        model="m",
        dtype="bfloat16",
        tp_size=tp,
        groups=groups,
        link=make_link(agent, counters, clock),
        counters=counters,
        prefetch_wait_s=prefetch_wait_s,
        clock=clock,
        loads_per_request=loads_per_request,
        kv_role=kv_role,
        decode_wait_s=decode_wait_s,
    )
    half.configure(
        {
            rank: KVPoolConnectorHandshakeMetadata(LAYOUT, CHUNK, stores_complete_in_step)
            for rank in range(tp)
        }
    )
    return half


def test_nothing_happens_before_the_workers_describe_their_chunks() -> None:
    agent = FakeAgent()
    half = KVPoolConnectorScheduler(
        model="m",
        dtype="bfloat16",
        tp_size=1,
        groups=[GroupRule("full", BLOCK)],
        link=make_link(agent),
        counters=Counters(),
    )
    request = FakeRequest("r", tokens(1000))
    assert half.get_num_new_matched_tokens(request, 0) == (0, False)
    meta = half.build_connector_meta(
        scheduler_output([new_request("r", list(range(8)), computed=0)])
    )
    assert (meta.loads, meta.stores) == ([], [])
    assert agent.lookups == []


def test_hits_become_a_load_of_whole_chunks() -> None:
    agent = FakeAgent()
    prompt = tokens(1000)
    agent.put(keys.tenant_id(None), chain(prompt)[:3])
    clock = Clock()
    half = make(agent, clock=clock)
    request = FakeRequest("r", prompt)

    assert half.get_num_new_matched_tokens(request, 0) == (3 * CHUNK, False)
    assert agent.lookups[-1][2:] == (False, True)  # the scheduler never locks; it counts
    # vLLM asks again at every step while it has no room: the answer stands a while
    for _ in range(50):
        assert half.get_num_new_matched_tokens(request, 0) == (3 * CHUNK, False)
    assert len(agent.lookups) == 1
    clock.now += PROBE_REUSE_S  # then the agent is asked, and counts a request's chunks once
    assert half.get_num_new_matched_tokens(request, 0) == (3 * CHUNK, False)
    assert agent.lookups[-1][2:] == (False, False)
    assert half.counters.totals["hit_tokens"] == 0  # counted when vLLM allocates for them
    block_ids = list(range(20, 28))
    half.update_state_after_alloc(request, FakeBlocks(block_ids), 3 * CHUNK)
    meta = half.build_connector_meta(
        scheduler_output(
            [new_request("r", block_ids, computed=3 * CHUNK)], scheduled={"r": 1000 - 768}
        )
    )

    (load,) = meta.loads
    assert load.keys == (tuple(chain(prompt)[:3]),)
    assert load.block_ids == (tuple(block_ids[:6]),)
    assert load.first_tokens == 0
    assert meta.stores == []  # the loaded chunks are not stored again; chunk 3 is not full
    assert half.counters.totals["hit_tokens"] == 3 * CHUNK


def test_a_preempted_request_looks_again_when_it_resumes() -> None:
    """It stored its own chunks before it was preempted: the answer from before is stale."""
    agent = FakeAgent()
    prompt = tokens(1000)
    half = make(agent)
    request = FakeRequest("r", prompt)
    assert half.get_num_new_matched_tokens(request, 0) == (0, False)
    agent.put(keys.tenant_id(None), chain(prompt))
    half.build_connector_meta(scheduler_output(preempted={"r"}))
    assert half.get_num_new_matched_tokens(request, 0) == (3 * CHUNK, False)


def test_a_local_hit_mid_chunk_loads_the_rest_of_the_chunk() -> None:
    agent = FakeAgent()
    prompt = tokens(1000)
    agent.put(keys.tenant_id(None), chain(prompt))
    half = make(agent)
    request = FakeRequest("r", prompt)

    # vLLM's own prefix cache has 3 blocks (384 tokens): chunk 1 is half there
    assert half.get_num_new_matched_tokens(request, 384) == (3 * CHUNK - 384, False)
    assert agent.lookups[-1][1] == chain(prompt)[1:3]
    block_ids = list(range(40, 48))
    half.update_state_after_alloc(request, FakeBlocks(block_ids), 3 * CHUNK - 384)
    (load,) = half.build_connector_meta(scheduler_output()).loads
    assert load.keys == (tuple(chain(prompt)[1:3]),)
    assert load.first_tokens == BLOCK
    assert load.block_ids == (tuple(block_ids[3:6]),)


def test_vllm_always_computes_the_last_token() -> None:
    agent = FakeAgent()
    prompt = tokens(2 * CHUNK)
    agent.put(keys.tenant_id(None), chain(prompt))
    half = make(agent)
    assert half.get_num_new_matched_tokens(FakeRequest("r", prompt), 0) == (CHUNK, False)
    short = tokens(CHUNK - 10, seed=1)
    assert half.get_num_new_matched_tokens(FakeRequest("s", short), 0) == (0, False)


def test_salts_are_tenants_and_never_share() -> None:
    agent = FakeAgent()
    prompt = tokens(600)
    agent.put(keys.tenant_id("alice"), chain(prompt, "alice"))
    half = make(agent)

    assert half.get_num_new_matched_tokens(FakeRequest("a", prompt, "alice"), 0)[0] == 2 * CHUNK
    assert half.get_num_new_matched_tokens(FakeRequest("b", prompt, "bob"), 0)[0] == 0
    assert half.get_num_new_matched_tokens(FakeRequest("c", prompt), 0)[0] == 0
    tenants = {tenant for tenant, *_ in agent.lookups}
    assert tenants == {keys.tenant_id(salt) for salt in ("alice", "bob", None)}
    assert all(b"alice" not in key for _, wanted, *_ in agent.lookups for key in wanted)


def test_every_rank_must_hit() -> None:
    agent = FakeAgent()
    prompt = tokens(1000)
    tenant = keys.tenant_id(None)
    agent.put(tenant, chain(prompt, rank=0, tp=2)[:3])
    agent.put(tenant, chain(prompt, rank=1, tp=2)[:2])
    half = make(agent, tp=2)
    request = FakeRequest("r", prompt)
    assert half.get_num_new_matched_tokens(request, 0) == (2 * CHUNK, False)
    half.update_state_after_alloc(request, FakeBlocks(list(range(8))), 2 * CHUNK)
    (load,) = half.build_connector_meta(scheduler_output()).loads
    assert load.keys == (
        tuple(chain(prompt, rank=0, tp=2)[:2]),
        tuple(chain(prompt, rank=1, tp=2)[:2]),
    )


def test_an_unavailable_agent_is_a_miss() -> None:
    agent = FakeAgent(down=True)
    half = make(agent)
    prompt = tokens(1000)
    assert half.get_num_new_matched_tokens(FakeRequest("r", prompt), 0) == (0, False)
    assert half.get_num_new_matched_tokens(FakeRequest("s", prompt), 0) == (0, False)
    assert half.counters.totals["agent_failures"] == 1
    assert half.counters.totals["agent_skipped_calls"] == 1


def test_stores_follow_the_chunks_as_they_fill() -> None:
    half = make(FakeAgent())
    prompt = tokens(700)
    request = FakeRequest("r", list(prompt))
    half.get_num_new_matched_tokens(request, 0)
    block_ids = list(range(100, 106))
    # chunked prefill: 300 tokens, then the remaining 400
    first = half.build_connector_meta(
        scheduler_output([new_request("r", block_ids[:3], computed=0)], scheduled={"r": 300})
    )
    (store,) = first.stores
    assert store.keys == (tuple(chain(prompt)[:1]),)
    assert store.parents == (None,)
    assert store.block_ids == ((100, 101),)

    second = half.build_connector_meta(
        scheduler_output(cached=[("r", block_ids[3:], 300)], scheduled={"r": 400})
    )
    (store,) = second.stores
    assert store.keys == (tuple(chain(prompt)[1:2]),)
    assert store.parents == (chain(prompt)[0],)
    assert store.block_ids == ((102, 103),)

    # decoding: generated tokens fill chunk 2 (tokens 512..767)
    for step in range(700, 768):
        request.tokens.append(step)
        meta = half.build_connector_meta(
            scheduler_output(
                cached=[("r", [106] if step == 768 - 1 else None, step)], scheduled={"r": 1}
            )
        )
        if step < 767:
            assert meta.stores == []
    (store,) = meta.stores
    assert store.keys == (tuple(chain(request.tokens)[2:3]),)
    assert store.block_ids == ((104, 105),)


def test_preempted_requests_store_from_their_new_blocks() -> None:
    half = make(FakeAgent())
    prompt = tokens(600)
    request = FakeRequest("r", prompt)
    half.get_num_new_matched_tokens(request, 0)
    half.build_connector_meta(
        scheduler_output([new_request("r", [1, 2, 3], computed=0)], scheduled={"r": 300})
    )
    meta = half.build_connector_meta(scheduler_output(preempted={"r"}))
    assert meta.preempted == ["r"]
    assert half.counters.totals["preemptions_seen"] == 1

    resumed = half.build_connector_meta(
        scheduler_output(cached=[("r", [7, 8, 9, 10, 11], 0)], scheduled={"r": 600}, resumed={"r"})
    )
    (store,) = resumed.stores  # chunk 0 was stored before the preemption
    assert store.keys == (tuple(chain(prompt)[1:2]),)
    assert store.block_ids == ((9, 10),)


def test_finished_requests_keep_blocks_only_while_stores_are_in_flight() -> None:
    for in_step in (True, False):
        half = make(FakeAgent(), stores_complete_in_step=in_step)
        request = FakeRequest("r", tokens(600))
        half.get_num_new_matched_tokens(request, 0)
        (store,) = half.build_connector_meta(
            scheduler_output([new_request("r", list(range(5)), computed=0)], scheduled={"r": 600})
        ).stores

        held, params = half.request_finished(request)

        assert held is not in_step
        assert params is None  # not a prefill of a disaggregated request
        assert half.has_pending_work() is not in_step
        meta = half.build_connector_meta(scheduler_output())
        assert meta.held == ([] if in_step else ["r"])
        half.update_connector_output(KVPoolConnectorWorkerMetadata({store.job_id: 1}), {"r"} - {""})
        assert not half.has_pending_work()
        assert half.tracked_requests == 0


def test_confirmed_stores_release_nothing_twice() -> None:
    half = make(FakeAgent(), stores_complete_in_step=False)
    request = FakeRequest("r", tokens(600))
    half.get_num_new_matched_tokens(request, 0)
    (store,) = half.build_connector_meta(
        scheduler_output([new_request("r", list(range(5)), computed=0)], scheduled={"r": 600})
    ).stores
    half.update_connector_output(KVPoolConnectorWorkerMetadata({store.job_id: 1}), set())
    assert half.request_finished(request) == (False, None)  # confirmed before it finished
    assert half.tracked_requests == 0


@pytest.mark.parametrize("ranks", [{1}, {0: 128, 1: 256}])
def test_inconsistent_workers_disable_the_cache(ranks: object) -> None:
    half = KVPoolConnectorScheduler(
        model="m",
        dtype="bfloat16",
        tp_size=2,
        groups=[GroupRule("full", BLOCK)],
        link=make_link(FakeAgent()),
        counters=Counters(),
    )
    if isinstance(ranks, set):
        half.configure(
            {rank: KVPoolConnectorHandshakeMetadata(LAYOUT, CHUNK, True) for rank in ranks}
        )
    else:
        assert isinstance(ranks, dict)
        half.configure(
            {
                rank: KVPoolConnectorHandshakeMetadata(LAYOUT, size, True)
                for rank, size in ranks.items()
            }
        )
    assert not half.ready


def test_requests_wait_while_the_agent_prefetches_from_l2() -> None:
    agent = FakeAgent(prefetch_polls=1)
    prompt = tokens(1300)
    tenant = keys.tenant_id(None)
    agent.put(tenant, chain(prompt)[:1])
    agent.put_l2(tenant, chain(prompt)[1:4])
    half = make(agent, prefetch_wait_s=2.0)
    request = FakeRequest("r", prompt)

    assert half.get_num_new_matched_tokens(request, 0) == (None, False)  # started, not done
    assert half.get_num_new_matched_tokens(request, 0) == (4 * CHUNK, False)
    assert half.counters.totals["prefetches"] == 1
    assert agent.released == []  # the prefetching lookup found nothing to lock


def test_a_slow_prefetch_is_given_up() -> None:
    agent, clock = FakeAgent(prefetch_polls=100), Clock()
    prompt = tokens(1000)
    agent.put(keys.tenant_id(None), chain(prompt)[:1])
    agent.put_l2(keys.tenant_id(None), chain(prompt)[1:3])
    half = make(agent, prefetch_wait_s=2.0, clock=clock)
    request = FakeRequest("r", prompt)

    assert half.get_num_new_matched_tokens(request, 0) == (None, False)
    clock.now += 1.0
    assert half.get_num_new_matched_tokens(request, 0) == (None, False)
    clock.now += 1.5
    assert half.get_num_new_matched_tokens(request, 0) == (CHUNK, False)  # what L1 has
    assert half.counters.totals["prefetch_timeouts"] == 1
    assert half.get_num_new_matched_tokens(request, 0) == (CHUNK, False)  # asked once only


def test_a_quick_prefetch_costs_no_step() -> None:
    agent = FakeAgent(prefetch_polls=0)
    prompt = tokens(1000)
    agent.put_l2(keys.tenant_id(None), chain(prompt)[:2])
    half = make(agent, prefetch_wait_s=2.0)
    assert half.get_num_new_matched_tokens(FakeRequest("r", prompt), 0) == (2 * CHUNK, False)


def test_without_l2_nothing_waits() -> None:
    agent = FakeAgent()
    prompt = tokens(1000)
    half = make(agent, prefetch_wait_s=2.0)
    assert half.get_num_new_matched_tokens(FakeRequest("r", prompt), 0) == (0, False)
    assert half.counters.totals["prefetches"] == 0
    assert len(agent.lookups) == 1  # the probe asked for the prefetch: one round trip


def test_a_step_asks_the_agent_for_its_time_budget_at_most() -> None:
    """A burst of 100 requests whose chunks are in L2: vLLM asks every waiting one at every
    step while their prefetches load. Each answer takes 1 ms; the budget is 10 ms a step, and
    the new requests' probes (which start their prefetches) are not starved by the polls."""
    clock = Clock()
    agent = FakeAgent(prefetch_polls=1000, clock=clock, call_seconds=0.001)
    tenant = keys.tenant_id(None)
    requests = [FakeRequest(f"r{n}", tokens(600, seed=n)) for n in range(100)]
    for request in requests:
        agent.put_l2(tenant, chain(request.tokens)[:4])
    half = make(agent, prefetch_wait_s=60.0, clock=clock)

    def step() -> int:
        asked = len(agent.lookups) + agent.status_polls
        for request in requests:
            assert half.get_num_new_matched_tokens(request, 0) == (None, False)
        half.build_connector_meta(scheduler_output())
        return len(agent.lookups) + agent.status_polls - asked

    questions = [step() for _ in range(30)]
    assert max(questions) <= 11  # the budget, and the question that crossed it
    assert agent.status_polls >= 4 * 30  # prefetch questions get about half of every step
    probed = [wanted for _, wanted, *_ in agent.lookups]
    assert len(probed) == len({tuple(wanted) for wanted in probed}) == 100  # once each


# ------------------------------------------------------------------ several groups

HYBRID = (GroupRule("full", BLOCK), GroupRule("window", BLOCK, BLOCK - 1))
"""A full-attention group and a 128-token window (a chunk of two blocks keeps one)."""


def test_a_hit_loads_every_groups_blocks() -> None:
    agent = FakeAgent()
    prompt = tokens(1000)
    agent.put(keys.tenant_id(None), chain(prompt)[:3])
    half = make(agent, groups=HYBRID)
    request = FakeRequest("r", prompt)
    assert half.get_num_new_matched_tokens(request, 0) == (3 * CHUNK, False)
    full, window = list(range(20, 28)), [0, 0, 0, 0, 0, 31, 32, 33]  # null outside the window
    half.update_state_after_alloc(request, FakeBlocks(full, window), 3 * CHUNK)

    (load,) = half.build_connector_meta(scheduler_output()).loads

    assert load.block_ids == (tuple(full[:6]), tuple(window[:6]))
    assert load.first_tokens == 0


def test_chunks_whose_window_vllm_freed_are_not_stored() -> None:
    """vLLM's own prefix hit gave the window group null blocks for the first chunks: those
    chunks cannot be stored whole; the first chunk whose kept block is real starts the store,
    its parent the chunk before it."""
    agent = FakeAgent()
    prompt = tokens(1000)
    half = make(agent, groups=HYBRID)
    request = FakeRequest("r", prompt)
    half.get_num_new_matched_tokens(request, 2 * CHUNK)
    full, window = list(range(20, 28)), [0, 0, 0, 41, 42, 43, 44, 45]

    meta = half.build_connector_meta(
        scheduler_output(
            [new_request("r", full, window, computed=2 * CHUNK)], scheduled={"r": 1000 - 512}
        )
    )

    (store,) = meta.stores
    # chunk 0's kept block (position 1) is null; chunk 1's (position 3) is real
    assert store.keys == (tuple(chain(prompt)[1:3]),)
    assert store.parents == (chain(prompt)[0],)
    assert store.block_ids == (tuple(full[2:6]), tuple(window[2:6]))


def test_a_chunk_size_no_group_divides_disables_the_cache(caplog: pytest.LogCaptureFixture) -> None:
    agent = FakeAgent()
    half = make(agent, groups=(GroupRule("full", BLOCK), GroupRule("window", 96, 95)))
    assert not half.ready
    assert "not a multiple of vLLM's block size 96" in caplog.text
    assert half.get_num_new_matched_tokens(FakeRequest("r", tokens(1000)), 0) == (0, False)


def test_an_engine_kvpool_cannot_cache_gets_no_hits_and_asks_nothing() -> None:
    agent = FakeAgent()
    prompt = tokens(1000)
    agent.put(keys.tenant_id(None), chain(prompt))
    half = KVPoolConnectorScheduler(
        model="m",
        dtype="bfloat16",
        tp_size=1,
        groups=[],
        link=make_link(agent),
        counters=Counters(),
        disabled="kvpool cannot cache MambaSpec (layer model.layers.1.mixer)",
    )
    half.configure({0: KVPoolConnectorHandshakeMetadata(LAYOUT, CHUNK, True)})
    request = FakeRequest("r", prompt)
    assert half.get_num_new_matched_tokens(request, 0) == (0, False)
    meta = half.build_connector_meta(
        scheduler_output([new_request("r", list(range(1, 9)), computed=0)], scheduled={"r": 1000})
    )
    assert (meta.loads, meta.stores, agent.lookups) == ([], [], [])


def test_a_failed_per_request_load_stores_its_chunks_when_recomputed() -> None:
    agent = FakeAgent()
    prompt = tokens(1000)
    agent.put(keys.tenant_id(None), chain(prompt)[:3])
    half = make(agent, groups=HYBRID, loads_per_request=True)
    request = FakeRequest("r", prompt)
    assert half.get_num_new_matched_tokens(request, 0) == (3 * CHUNK, True)  # asynchronous
    full, window = list(range(20, 28)), list(range(30, 38))
    half.update_state_after_alloc(request, FakeBlocks(full, window), 3 * CHUNK)
    (load,) = half.build_connector_meta(scheduler_output()).loads
    assert load.per_request

    half.update_connector_output(None, set(), {"r"})  # the agent lost the chunks meanwhile

    assert half.get_num_new_matched_tokens(request, 0) == (0, False)  # no more hits
    meta = half.build_connector_meta(
        scheduler_output([new_request("r", full, window, computed=0)], scheduled={"r": 1000})
    )
    (store,) = meta.stores  # computed anew: its chunks are stored again
    assert store.keys == (tuple(chain(prompt)[:3]),)


MAMBA = (GroupRule("full", BLOCK), GroupRule("state", BLOCK))
"""A full-attention group and a state-space group (vLLM's "align" mode)."""


def with_states(
    output: object, *states: tuple[str, int, int, int]
) -> object:  # (req_id, group, block, tokens) as vLLM hands them over
    handed: dict[str, list[tuple[int, int, int]]] = {}
    for req_id, group, block, boundary in states:
        handed.setdefault(req_id, []).append((group, block, boundary))
    output.kv_connector_block_state = SimpleNamespace(boundary_state_offloads=handed)  # type: ignore[attr-defined]
    return output


def test_a_state_vllm_hands_over_at_a_chunks_end_is_stored_beside_it() -> None:
    """Only a state that ends a chunk is stored (a hit ends on a chunk); its key is the
    chunk's state key, its parent the chunk, its block the one vLLM named."""
    half = make(FakeAgent(), groups=MAMBA)
    prompt = tokens(1000)
    full, state = list(range(20, 28)), [0, 0, 0, 0, 0, 0, 47, 0]
    half.get_num_new_matched_tokens(FakeRequest("r", prompt), 0)
    output = scheduler_output([new_request("r", full, state, computed=0)], scheduled={"r": 896})

    meta = half.build_connector_meta(
        with_states(output, ("r", 1, 47, 896), ("r", 1, 45, 768), ("r", 1, 44, 640))
    )

    chunks, states = meta.stores
    assert chunks.keys == (tuple(chain(prompt)[:3]),) and not chunks.state
    assert chunks.block_ids == (tuple(full[:6]),)  # the state group is not in a chunk
    # 896 and 640 end no chunk: only the state at 768 (the third chunk's end) is stored
    assert states.state and states.keys == ((keys.state_key(chain(prompt)[2]),),)
    assert states.parents == (chain(prompt)[2],)
    assert states.block_ids == ((45,),)


def test_a_hit_ends_on_the_last_chunk_with_its_state() -> None:
    """Chunks without a state at their end cannot be resumed from: the hit stops at the
    last chunk whose state the agent has, and loads that state into the block vLLM gives
    the state group at the hit's end, as a job of its own for the same request."""
    agent = FakeAgent()
    prompt = tokens(1000)
    tenant = keys.tenant_id(None)
    agent.put(tenant, chain(prompt)[:3])
    agent.put(tenant, [keys.state_key(chain(prompt)[1])])  # the state after two chunks
    half = make(agent, groups=MAMBA, loads_per_request=True)
    request = FakeRequest("r", prompt)
    assert half.get_num_new_matched_tokens(request, 0) == (2 * CHUNK, True)
    full, state = list(range(20, 28)), [0, 0, 0, 53, 0, 0, 0, 0]
    half.update_state_after_alloc(request, FakeBlocks(full, state), 2 * CHUNK)

    chunks, states = half.build_connector_meta(scheduler_output()).loads

    assert chunks.keys == (tuple(chain(prompt)[:2]),) and chunks.block_ids == (tuple(full[:4]),)
    assert states.state and states.per_request and chunks.per_request
    assert states.keys == ((keys.state_key(chain(prompt)[1]),),)
    assert states.block_ids == ((53,),)  # the block of the hit's last token


def test_without_a_state_a_state_model_gets_no_hit() -> None:
    agent = FakeAgent()
    prompt = tokens(1000)
    agent.put(keys.tenant_id(None), chain(prompt)[:3])
    half = make(agent, groups=MAMBA)
    assert half.get_num_new_matched_tokens(FakeRequest("r", prompt), 0) == (0, False)


def test_the_states_of_a_load_are_not_stored_again() -> None:
    """vLLM hands the state it was loaded into back over as if computed: the agent has it."""
    agent = FakeAgent()
    prompt = tokens(1000)
    tenant = keys.tenant_id(None)
    agent.put(tenant, [*chain(prompt)[:2], keys.state_key(chain(prompt)[1])])
    half = make(agent, groups=MAMBA)
    request = FakeRequest("r", prompt)
    assert half.get_num_new_matched_tokens(request, 0)[0] == 2 * CHUNK
    full, state = list(range(20, 28)), [0, 0, 0, 53, 0, 0, 0, 0]
    half.update_state_after_alloc(request, FakeBlocks(full, state), 2 * CHUNK)
    half.build_connector_meta(scheduler_output())

    output = scheduler_output(
        [new_request("r", full, state, computed=2 * CHUNK)], scheduled={"r": 1000 - 512}
    )
    meta = half.build_connector_meta(with_states(output, ("r", 1, 53, 2 * CHUNK)))

    assert [store.state for store in meta.stores] == [False]  # the chunks computed, no state
