"""The scheduler half with structured salts: a job per tenant, split at the shared boundary."""

from __future__ import annotations

import logging

import pytest

from kvpool.common import keys
from kvpool.connector.scheduler_access import ACCESS_REUSE_S
from kvpool.connector.scheduler_lookups import PROBE_REUSE_S

from .fakes import (
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

SPACE = keys.tenant_id("space-salt")


def salt(tenant: str, shared: int = 2 * CHUNK + 10) -> str:
    return keys.shared_salt("space-salt", shared, tenant)


def test_the_shared_chunks_are_looked_up_under_the_space_then_the_rest_under_the_tenant() -> None:
    agent = FakeAgent()
    prompt = tokens(1300)  # five full chunks (the last token is always computed)
    alice = chain(prompt, salt("alice"))
    agent.put(SPACE, alice[:2])
    agent.put(keys.tenant_id("alice"), alice[2:4])
    half = make(agent)

    request = FakeRequest("a", prompt, salt("alice"))
    assert half.get_num_new_matched_tokens(request, 0) == (4 * CHUNK, False)
    assert [(tenant, len(wanted)) for tenant, wanted, *_ in agent.lookups] == [
        (SPACE, 2),
        (keys.tenant_id("alice"), 3),
    ]
    half.update_state_after_alloc(request, FakeBlocks(list(range(10, 20))), 4 * CHUNK)
    space_load, own_load = half.build_connector_meta(scheduler_output()).loads
    assert (space_load.tenant, space_load.keys, space_load.block_ids) == (
        SPACE,
        (tuple(alice[:2]),),
        ((10, 11, 12, 13),),
    )
    assert (own_load.tenant, own_load.keys, own_load.block_ids, own_load.first_tokens) == (
        keys.tenant_id("alice"),
        (tuple(alice[2:4]),),
        ((14, 15, 16, 17),),
        0,
    )


def test_another_tenant_of_the_space_hits_the_shared_chunks_only() -> None:
    agent = FakeAgent()
    prompt = tokens(1300)
    alice = chain(prompt, salt("alice"))
    agent.put(SPACE, alice[:2])
    agent.put(keys.tenant_id("alice"), alice[2:])
    half = make(agent)
    assert half.get_num_new_matched_tokens(FakeRequest("b", prompt, salt("bob")), 0) == (
        2 * CHUNK,
        False,
    )


def test_a_miss_in_the_space_asks_nothing_of_the_tenant() -> None:
    agent = FakeAgent()
    prompt = tokens(1300)
    agent.put(keys.tenant_id("alice"), chain(prompt, salt("alice"))[2:])
    half = make(agent)
    assert half.get_num_new_matched_tokens(FakeRequest("a", prompt, salt("alice")), 0)[0] == 0
    assert [tenant for tenant, *_ in agent.lookups] == [SPACE]


def test_a_hit_mid_space_loads_the_rest_of_the_space_and_the_tenants_chunks() -> None:
    """vLLM's own prefix cache holds the first chunk: the load starts at the second."""
    agent = FakeAgent()
    prompt = tokens(1300)
    alice = chain(prompt, salt("alice"))
    agent.put(SPACE, alice[:2])
    agent.put(keys.tenant_id("alice"), alice[2:3])
    half = make(agent)
    request = FakeRequest("a", prompt, salt("alice"))
    assert half.get_num_new_matched_tokens(request, CHUNK) == (2 * CHUNK, False)
    half.update_state_after_alloc(request, FakeBlocks(list(range(10, 20))), 2 * CHUNK)
    loads = half.build_connector_meta(scheduler_output()).loads
    assert [(load.tenant, load.keys[0], load.block_ids[0]) for load in loads] == [
        (SPACE, (alice[1],), (12, 13)),
        (keys.tenant_id("alice"), (alice[2],), (14, 15)),
    ]


def test_stores_split_at_the_boundary_and_the_private_chain_has_no_parent() -> None:
    half = make(FakeAgent())
    prompt = tokens(1100)  # four full chunks
    request = FakeRequest("a", prompt, salt("alice"))
    half.get_num_new_matched_tokens(request, 0)
    meta = half.build_connector_meta(
        scheduler_output(
            [new_request("a", list(range(100, 109)), computed=0)], scheduled={"a": 1100}
        )
    )
    alice = chain(prompt, salt("alice"))
    assert [
        (store.tenant, store.keys, store.parents, store.block_ids) for store in meta.stores
    ] == [
        (SPACE, (tuple(alice[:2]),), (None,), ((100, 101, 102, 103),)),
        (keys.tenant_id("alice"), (tuple(alice[2:4]),), (None,), ((104, 105, 106, 107),)),
    ]


@pytest.mark.parametrize("shared", [0, CHUNK - 1])
def test_less_than_a_chunk_shared_is_the_tenants_alone(shared: int) -> None:
    agent = FakeAgent()
    prompt = tokens(700)
    agent.put(keys.tenant_id("alice"), chain(prompt, "alice"))
    half = make(agent)
    request = FakeRequest("a", prompt, salt("alice", shared))
    assert half.get_num_new_matched_tokens(request, 0)[0] == 2 * CHUNK
    assert {tenant for tenant, *_ in agent.lookups} == {keys.tenant_id("alice")}


def test_a_malformed_salt_is_said_once_and_the_request_is_the_tenants_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    agent = FakeAgent()
    prompt = tokens(700)
    agent.put(keys.tenant_id("alice"), chain(prompt, "alice"))
    half = make(agent)
    bad = "kvpool-share-v1;space=secret-space;shared=512;tenant=alice;oops=1"
    with caplog.at_level(logging.WARNING):
        for name in ("a", "b"):
            assert half.get_num_new_matched_tokens(FakeRequest(name, prompt, bad), 0)[0] == 512
    (said,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert "unknown field 'oops'" in said and "its tenant's alone" in said
    assert "secret-space" not in said  # a salt is never logged
    assert half.counters.totals["salt_problems"] == 2


def test_a_salt_past_the_cap_gets_no_cache_and_is_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    agent = FakeAgent()
    half = make(agent)
    huge = keys.shared_salt("s" * (8 << 20), 512, "alice")
    with caplog.at_level(logging.WARNING):
        for name in ("a", "b"):
            request = FakeRequest(name, tokens(700), huge)
            assert half.get_num_new_matched_tokens(request, 0) == (0, False)
    (said,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert "cache_salt longer than 4096 characters" in said and "gets no cache" in said
    assert "sss" not in said  # a salt is never logged
    meta = half.build_connector_meta(
        scheduler_output([new_request("a", list(range(6)), computed=0)], scheduled={"a": 700})
    )
    assert (agent.lookups, meta.stores) == ([], [])


def test_a_structured_salt_without_a_tenant_gets_no_cache() -> None:
    agent = FakeAgent()
    prompt = tokens(700)
    agent.put(keys.tenant_id(None), chain(prompt))
    half = make(agent)
    request = FakeRequest("a", prompt, "kvpool-share-v1;space=s;shared=512")
    assert half.get_num_new_matched_tokens(request, 0) == (0, False)
    meta = half.build_connector_meta(
        scheduler_output([new_request("a", list(range(6)), computed=0)], scheduled={"a": 700})
    )
    assert (agent.lookups, meta.stores) == ([], [])


def test_a_prefetch_starts_in_every_span() -> None:
    agent = FakeAgent()
    prompt = tokens(1300)
    alice = chain(prompt, salt("alice"))
    agent.put_l2(SPACE, alice[:2])
    agent.put_l2(keys.tenant_id("alice"), alice[2:4])
    half = make(agent, prefetch_wait_s=5.0)
    request = FakeRequest("a", prompt, salt("alice"))
    assert half.get_num_new_matched_tokens(request, 0) == (None, False)
    assert [tenant for tenant, *_ in agent.lookups] == [SPACE, keys.tenant_id("alice")]
    while (found := half.get_num_new_matched_tokens(request, 0))[0] is None:
        pass
    assert found == (4 * CHUNK, False)


def test_a_space_the_agent_refuses_is_neither_probed_nor_stored_for_a_while() -> None:
    agent = FakeAgent(bound_tenant=keys.tenant_id("carol"), forbidden={SPACE})
    clock = Clock()
    half = make(agent, clock=clock)
    prompt = tokens(1100)
    request = FakeRequest("c", prompt, salt("carol"))
    assert half.get_num_new_matched_tokens(request, 0) == (0, False)
    meta = half.build_connector_meta(
        scheduler_output([new_request("c", list(range(9)), computed=0)], scheduled={"c": 1100})
    )
    assert [store.tenant for store in meta.stores] == [keys.tenant_id("carol")]
    assert half.counters.totals["agent_failures"] == 0  # a refused request: the link stays up
    asked = len(agent.lookups)
    clock.now += PROBE_REUSE_S
    other = FakeRequest("d", prompt, salt("carol"))
    assert half.get_num_new_matched_tokens(other, 0) == (0, False)
    assert len(agent.lookups) == asked  # refused a moment ago: not asked again
    agent.forbidden.clear()  # admitted since
    clock.now += ACCESS_REUSE_S
    assert half.get_num_new_matched_tokens(FakeRequest("e", prompt, salt("carol")), 0)[0] == 0
    assert len(agent.lookups) > asked
