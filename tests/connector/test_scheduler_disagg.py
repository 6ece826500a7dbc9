"""The scheduler half in a disaggregated request: vLLM's ``kv_role``, the prefill's tail
record and params, the decode's bounded wait (an in-memory agent, stand-ins for vLLM)."""

from __future__ import annotations

from typing import Any

import pytest

from kvpool.common import keys
from kvpool.common.disagg import DecodeParams, PrefillParams
from kvpool.connector.layout import GroupRule
from kvpool.connector.metadata import KVPoolConnectorWorkerMetadata
from kvpool.connector.scheduler import KVPoolConnectorScheduler

from .fakes import (
    BLOCK,
    CHUNK,
    Clock,
    FakeAgent,
    FakeBlocks,
    FakeRequest,
    chain,
    new_request,
    scheduler_output,
    tokens,
)
from .test_scheduler import make

PROMPT = 3 * CHUNK + 184  # three full chunks and a tail of two blocks (128 + 56 tokens)
DEFAULT = keys.tenant_id(None)


def tail_key(prompt: list[int], salt: str | None = None) -> bytes:
    full = len(prompt) // CHUNK
    return keys.tail_key(chain(prompt, salt)[full - 1], prompt[full * CHUNK :])


def prefill(half: KVPoolConnectorScheduler, request: FakeRequest) -> list[Any]:
    """Run the request's whole prompt in one step; the step's store jobs."""
    assert half.get_num_new_matched_tokens(request, 0) == (0, False)
    blocks = list(range(1, -(-request.num_prompt_tokens // BLOCK) + 1))
    output = scheduler_output(
        [new_request(request.request_id, blocks, computed=0)],
        scheduled={request.request_id: request.num_prompt_tokens},
    )
    return list(half.build_connector_meta(output).stores)


def test_a_producer_stores_the_prompts_tail_after_its_chunks() -> None:
    half = make(FakeAgent(), kv_role="kv_producer")
    prompt = tokens(PROMPT)
    request = FakeRequest("p", prompt)

    chunks, tail = prefill(half, request)

    assert chunks.keys == (tuple(chain(prompt)[:3]),)
    assert tail.keys == ((tail_key(prompt),),)
    assert tail.parents == (chain(prompt)[2],)
    assert tail.tenant == DEFAULT
    # blocks 7 and 8 hold the tail; the record's unused block repeats the last (its own KV)
    assert tail.block_ids == ((7, 8),)
    assert half.counters.totals["pd_tails"] == 1
    held, params = half.request_finished(request)
    assert not held
    assert params == DecodeParams(tokens=PROMPT, tail=True).to_json()


def test_a_tail_of_one_block_repeats_it() -> None:
    half = make(FakeAgent(), kv_role="kv_producer")
    prompt = tokens(3 * CHUNK + 100)
    _, tail = prefill(half, FakeRequest("p", prompt))
    assert tail.block_ids == ((7, 7),)


def test_the_tail_waits_for_the_last_prompt_step() -> None:
    half = make(FakeAgent(), kv_role="kv_producer")
    request = FakeRequest("p", tokens(PROMPT))
    half.get_num_new_matched_tokens(request, 0)
    blocks = list(range(1, 9))
    first = scheduler_output([new_request("p", blocks, computed=0)], scheduled={"p": 512})
    (chunks,) = half.build_connector_meta(first).stores
    assert len(chunks.keys[0]) == 2
    rest = scheduler_output(cached=[("p", None, 512)], scheduled={"p": PROMPT - 512})
    chunk, tail = half.build_connector_meta(rest).stores
    assert chunk.keys == (tuple(chain(request.tokens)[2:3]),)
    assert tail.keys == ((tail_key(request.tokens),),)
    # generated tokens later store nothing more of the tail
    request.tokens.append(5)
    after = scheduler_output(cached=[("p", None, PROMPT)], scheduled={"p": 1})
    assert half.build_connector_meta(after).stores == []


def test_both_stores_a_tail_only_for_a_prefill() -> None:
    half = make(FakeAgent())
    plain = FakeRequest("a", tokens(PROMPT))
    assert len(prefill(half, plain)) == 1
    assert half.request_finished(plain) == (False, None)

    asked = FakeRequest("b", tokens(PROMPT, seed=1), kv_transfer_params=PrefillParams().to_json())
    assert len(prefill(half, asked)) == 2
    assert half.request_finished(asked)[1] == DecodeParams(tokens=PROMPT, tail=True).to_json()


def test_a_finished_prefill_offers_its_prompt_to_the_decodes_node() -> None:
    agent = FakeAgent()
    half = make(agent)
    prompt = tokens(PROMPT)
    request = FakeRequest("p", prompt, kv_transfer_params=PrefillParams("node-b").to_json())
    prefill(half, request)
    assert agent.pushes == []  # once the request is done (its stores committed)

    half.request_finished(request)

    assert agent.pushes == [(DEFAULT, [*chain(prompt)[:3], tail_key(prompt)], "node-b", None)]
    assert half.counters.totals["pd_pushes"] == 1


def test_a_prefill_whose_stores_are_in_flight_offers_once_they_are_done() -> None:
    agent = FakeAgent()
    half = make(agent, stores_complete_in_step=False)  # as on CUDA
    request = FakeRequest("p", tokens(PROMPT), kv_transfer_params=PrefillParams("b").to_json())
    jobs = prefill(half, request)
    assert half.request_finished(request)[0] is True  # held
    assert agent.pushes == []
    done = KVPoolConnectorWorkerMetadata({job.job_id: 1 for job in jobs})
    half.update_connector_output(done, {"p"})
    assert len(agent.pushes) == 1


def test_a_prefill_in_a_shared_space_offers_a_run_per_tenant() -> None:
    agent = FakeAgent()
    half = make(agent)
    prompt = tokens(PROMPT)
    salt = keys.shared_salt("space", 2 * CHUNK, "team")
    params = PrefillParams("node-b").to_json()
    request = FakeRequest("p", prompt, cache_salt=salt, kv_transfer_params=params)
    prefill(half, request)
    half.request_finished(request)
    space, own = agent.pushes
    assert (space[0], len(space[1]), space[3]) == (keys.tenant_id("space"), 2, None)
    assert (own[0], len(own[1])) == (keys.tenant_id("team"), 2)  # its last chunk and tail


def test_no_push_without_a_node_or_from_a_consumer() -> None:
    for role, params in (("kv_producer", PrefillParams()), ("kv_consumer", PrefillParams("b"))):
        agent = FakeAgent()
        half = make(agent, kv_role=role)
        request = FakeRequest("p", tokens(PROMPT), kv_transfer_params=params.to_json())
        prefill(half, request)
        half.request_finished(request)
        assert agent.pushes == []


def test_a_prompt_on_a_chunk_boundary_has_no_tail() -> None:
    half = make(FakeAgent(), kv_role="kv_producer")
    request = FakeRequest("p", tokens(3 * CHUNK))
    assert len(prefill(half, request)) == 1
    assert half.request_finished(request)[1] == DecodeParams(tokens=3 * CHUNK, tail=False).to_json()


def test_a_consumer_never_stores() -> None:
    half = make(FakeAgent(), kv_role="kv_consumer")
    request = FakeRequest("d", tokens(PROMPT), kv_transfer_params=PrefillParams().to_json())
    assert prefill(half, request) == []
    assert half.request_finished(request) == (False, None)


def test_a_window_model_stores_no_tail() -> None:
    window = (GroupRule("full", BLOCK), GroupRule("window", BLOCK, tokens=128))
    half = make(FakeAgent(), kv_role="kv_producer", groups=window)
    request = FakeRequest("p", tokens(PROMPT))
    half.get_num_new_matched_tokens(request, 0)
    blocks = list(range(1, 9))
    output = scheduler_output(
        [new_request("p", blocks, blocks, computed=0)], scheduled={"p": PROMPT}
    )
    assert len(half.build_connector_meta(output).stores) == 1
    assert half.request_finished(request)[1] == DecodeParams(tokens=PROMPT, tail=False).to_json()


def decode_request(prompt: list[int], *, wait_ms: int | None = None, **params: Any) -> FakeRequest:
    decode = DecodeParams(tokens=params.pop("tokens", len(prompt)), tail=True, wait_ms=wait_ms)
    return FakeRequest("d", prompt, kv_transfer_params=decode.to_json(), **params)


def test_a_decode_loads_the_prompt_but_its_last_token() -> None:
    agent = FakeAgent()
    prompt = tokens(PROMPT)
    agent.put(DEFAULT, [*chain(prompt)[:3], tail_key(prompt)])
    half = make(agent, kv_role="kv_consumer", decode_wait_s=2.0)
    request = decode_request(prompt)

    assert half.get_num_new_matched_tokens(request, 0) == (PROMPT - 1, False)

    blocks = list(range(20, 28))
    half.update_state_after_alloc(request, FakeBlocks(blocks), PROMPT - 1)
    meta = half.build_connector_meta(
        scheduler_output([new_request("d", blocks, computed=PROMPT - 1)], scheduled={"d": 1})
    )
    (load,) = meta.loads
    assert load.keys == ((*chain(prompt)[:3], tail_key(prompt)),)
    assert load.block_ids == (tuple(blocks),)  # the tail's two blocks, the last one partly
    assert meta.stores == []
    assert half.counters.totals["pd_full_hits"] == 1


def test_a_decode_after_a_local_prefix_hit_loads_the_rest() -> None:
    agent = FakeAgent()
    prompt = tokens(PROMPT)
    agent.put(DEFAULT, [*chain(prompt)[:3], tail_key(prompt)])
    half = make(agent, kv_role="kv_consumer", decode_wait_s=2.0)
    request = decode_request(prompt)
    assert half.get_num_new_matched_tokens(request, 2 * CHUNK) == (PROMPT - 1 - 2 * CHUNK, False)


def test_a_decode_waits_for_its_tail_until_its_deadline() -> None:
    agent, clock = FakeAgent(), Clock()
    prompt = tokens(PROMPT)
    agent.put(DEFAULT, chain(prompt)[:3])
    half = make(agent, kv_role="kv_consumer", decode_wait_s=2.0, clock=clock)
    request = decode_request(prompt)

    assert half.get_num_new_matched_tokens(request, 0) == (None, False)
    clock.now += 1.0
    assert half.get_num_new_matched_tokens(request, 0) == (None, False)
    agent.put(DEFAULT, [tail_key(prompt)])  # the rest arrives: the next probe sees it
    clock.now += 0.05
    assert half.get_num_new_matched_tokens(request, 0) == (PROMPT - 1, False)
    assert half.counters.totals["pd_wait_ms"] == 1050


def test_a_decode_that_waited_enough_loads_what_is_there() -> None:
    agent, clock = FakeAgent(), Clock()
    prompt = tokens(PROMPT)
    agent.put(DEFAULT, chain(prompt)[:2])
    half = make(agent, kv_role="kv_consumer", decode_wait_s=2.0, clock=clock)
    request = decode_request(prompt)
    assert half.get_num_new_matched_tokens(request, 0) == (None, False)
    clock.now += 2.0
    assert half.get_num_new_matched_tokens(request, 0) == (2 * CHUNK, False)
    assert half.get_num_new_matched_tokens(request, 0) == (2 * CHUNK, False)  # asked again
    assert half.counters.totals["pd_partial_hits"] == 1


@pytest.mark.parametrize(("wait_ms", "waited_s"), [(500, 0.5), (60_000, 2.0), (0, 0.0)])
def test_the_params_may_shorten_the_wait_never_lengthen_it(wait_ms: int, waited_s: float) -> None:
    agent, clock = FakeAgent(), Clock()
    prompt = tokens(PROMPT)
    half = make(agent, kv_role="kv_consumer", decode_wait_s=2.0, clock=clock)
    request = decode_request(prompt, wait_ms=wait_ms)
    if waited_s:
        assert half.get_num_new_matched_tokens(request, 0) == (None, False)
        clock.now += waited_s - 0.01
        assert half.get_num_new_matched_tokens(request, 0) == (None, False)
        clock.now += 0.01
    assert half.get_num_new_matched_tokens(request, 0) == (0, False)


def test_params_of_another_prompt_are_an_ordinary_lookup() -> None:
    agent = FakeAgent()
    prompt = tokens(PROMPT)
    agent.put(DEFAULT, [*chain(prompt)[:3], tail_key(prompt)])
    half = make(agent, kv_role="kv_consumer", decode_wait_s=2.0)
    request = decode_request(prompt, tokens=PROMPT + 1)
    assert half.get_num_new_matched_tokens(request, 0) == (3 * CHUNK, False)
    assert half.counters.totals["pd_mismatched"] == 1


def test_malformed_params_are_counted_and_ignored() -> None:
    agent = FakeAgent()
    prompt = tokens(PROMPT)
    agent.put(DEFAULT, chain(prompt)[:3])
    half = make(agent, kv_role="kv_producer")
    request = FakeRequest("x", prompt, kv_transfer_params={"kvpool": {"v": 9}})
    assert half.get_num_new_matched_tokens(request, 0) == (3 * CHUNK, False)
    assert half.counters.totals["pd_bad_params"] == 1


def test_another_tenants_decode_gets_nothing_from_the_same_params() -> None:
    agent = FakeAgent()
    prompt = tokens(PROMPT)
    agent.put(DEFAULT, [*chain(prompt)[:3], tail_key(prompt)])
    half = make(agent, kv_role="kv_consumer", decode_wait_s=0.0)
    request = decode_request(prompt, cache_salt="team-b")
    assert half.get_num_new_matched_tokens(request, 0) == (0, False)


def test_a_decode_on_a_chunk_boundary_needs_no_tail() -> None:
    agent = FakeAgent()
    prompt = tokens(3 * CHUNK)
    agent.put(DEFAULT, chain(prompt))
    half = make(agent, kv_role="kv_consumer", decode_wait_s=2.0)
    request = FakeRequest(
        "d", prompt, kv_transfer_params=DecodeParams(tokens=3 * CHUNK, tail=False).to_json()
    )
    assert half.get_num_new_matched_tokens(request, 0) == (3 * CHUNK - 1, False)
