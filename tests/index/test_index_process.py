"""``kvpool-index`` as a user runs it: a real process over real agents, asked by IndexClient."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvpool.client import AgentClient
from kvpool.common.keys import chunk_keys, tenant_id
from kvpool.index.client import IndexClient, IndexRequestError
from tests.support.agent_process import ENGINE_TOKEN, AgentProcess
from tests.support.index_process import (
    ADMIN_TOKEN,
    FINGERPRINT,
    GATEWAY_TOKEN,
    SALT,
    TENANT_TOKEN,
    IndexProcess,
)
from tests.support.polling import wait_until

from .conftest import start_all

pytestmark = pytest.mark.process

PROMPT = list(range(1000, 1101))  # six full chunks of 16 tokens, and 5 tokens more


@pytest.fixture
def index_process(
    tmp_path: Path, make_agents: Callable[..., list[AgentProcess]]
) -> Iterator[tuple[IndexProcess, dict[str, AgentProcess]]]:
    agents = dict(zip(("gpu-1", "gpu-2"), make_agents(2), strict=True))
    start_all(list(agents.values()))
    index = IndexProcess(tmp_path, agents)
    yield index, agents
    if index.process.poll() is None:
        index.process.kill()
        index.process.wait()


def test_gateways_route_through_the_index_process(
    index_process: tuple[IndexProcess, dict[str, AgentProcess]],
) -> None:
    index, agents = index_process
    keys = chunk_keys(PROMPT, SALT, FINGERPRINT)
    for node, count in (("gpu-1", 6), ("gpu-2", 2)):
        with AgentClient(agents[node].zmq, token=ENGINE_TOKEN) as agent:
            agent.store(tenant_id(SALT), keys[:count], [b"kv"] * count)

    with IndexClient(index.url, GATEWAY_TOKEN, timeout=5) as client:

        def matches() -> list[tuple[str, int]]:
            found = client.lookup(token_ids=PROMPT, cache_salt=SALT).matches
            return [(match.node, match.tokens) for match in found]

        wait_until(lambda: matches() == [("gpu-1", 96), ("gpu-2", 32)], what="the stores")
        route = client.route(loads={"gpu-1": 1, "gpu-2": 1}, token_ids=PROMPT, cache_salt=SALT)
        assert (route.node, route.reason, route.matched_tokens) == ("gpu-1", "longest_match", 96)
        assert route.prompt_tokens == 101
        busy = client.route(loads={"gpu-1": 8, "gpu-2": 0}, token_ids=PROMPT, cache_salt=SALT)
        assert (busy.node, busy.reason, busy.matched_tokens) == ("gpu-2", "overloaded", 32)
        by_keys = client.lookup(chunk_keys=keys, fingerprint=FINGERPRINT)
        assert [(m.node, m.chunks) for m in by_keys.matches] == [("gpu-1", 6), ("gpu-2", 2)]

        # tenant isolation: another salt, or none, derives other keys
        assert client.lookup(token_ids=PROMPT, cache_salt="mallory").matches == []
        assert client.lookup(token_ids=PROMPT).matches == []
        stranger = client.route(loads={"gpu-1": 1, "gpu-2": 0}, token_ids=PROMPT)
        assert (stranger.node, stranger.reason) == ("gpu-2", "low_match")

    with IndexClient(index.url, ADMIN_TOKEN) as admin:
        assert admin.lookup(token_ids=PROMPT, cache_salt=SALT).matches
    for token, status, reason in ((TENANT_TOKEN, 403, "gateway tokens"), ("unknown", 401, "")):
        with IndexClient(index.url, token) as client, pytest.raises(IndexRequestError) as refused:
            client.lookup(token_ids=PROMPT, cache_salt=SALT)
        assert refused.value.status == status and reason in refused.value.detail

    nodes = json.loads(index.get("/v1/nodes", GATEWAY_TOKEN))["nodes"]
    assert [(n["node"], n["chunks"], n["synced"]) for n in nodes] == [
        ("gpu-1", 6, True),
        ("gpu-2", 2, True),
    ]
    metrics = index.get("/metrics")
    assert 'kvpool_index_chunks{node="gpu-1"} 6.0' in metrics
    assert 'kvpool_index_agent_connected{node="gpu-2"} 1.0' in metrics
    assert 'kvpool_index_route_decisions_total{reason="overloaded"} 1.0' in metrics
    assert 'kvpool_index_query_seconds_count{op="lookup"}' in metrics
    assert index.stop() == 0
    assert SALT not in "".join(index.log)


def test_a_new_index_is_ready_once_it_holds_every_agent_or_its_warmup_is_over(
    tmp_path: Path, make_agents: Callable[..., list[AgentProcess]]
) -> None:
    (live,) = make_agents(1)
    start_all([live])
    synced = IndexProcess(tmp_path / "synced", {"gpu-1": live}, {"WARMUP_SECONDS": "60"})
    try:
        wait_until(lambda: synced.status("/readyz") == 200, what="ready after the sync")
    finally:
        assert synced.stop() == 0

    # an agent that never answers: not ready (an empty index would route without affinity)
    # until the warmup is over, then ready to route with what it has
    dead = SimpleNamespace(zmq="tcp://127.0.0.1:9", events="tcp://127.0.0.1:9")
    waiting = IndexProcess(
        tmp_path / "waiting", {"gpu-1": live, "gpu-2": dead}, {"WARMUP_SECONDS": "3"}
    )
    try:
        assert waiting.status("/readyz") == 503
        assert waiting.status("/healthz") == 200
        wait_until(lambda: waiting.status("/readyz") == 200, what="ready after the warmup")
    finally:
        assert waiting.stop() == 0
