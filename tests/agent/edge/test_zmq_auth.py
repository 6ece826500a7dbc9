"""The data plane takes only the pool's tokens, each for what its role may do: against a real
agent, every operation without a token, and with each role's token beyond its scope, is
refused; within its scope it works. The events feed admits only an index's (or an
admin's) token."""

from __future__ import annotations

import pytest
import zmq

from kvpool.client import AgentClient, AgentError
from kvpool.common import protocol as p
from kvpool.common.keys import CANARY_CHUNK_BYTES, CANARY_TENANT, tenant_id
from tests.support.agent_process import (
    ADMIN_TOKEN,
    ENGINE_TOKEN,
    INDEX_TOKEN,
    AgentProcess,
)
from tests.support.chunks import key
from tests.support.raw_zmq import RawClient

pytestmark = pytest.mark.process

ALICE, BOB = tenant_id("alice-salt"), tenant_id("bob-salt")
SPACE = tenant_id("space-salt")
DEFAULT = tenant_id(None)
ALICE_TOKEN = "alice-token-4c8e1f7a93b05d26e7a1"
BOB_TOKEN = "bob-token-0e6d9b3a51f8c2470a9e5c"
GATEWAY_TOKEN = "gateway-token-d91c5a2e8f0b7463a0e5"
CANARY_CHUNK = b"c" * CANARY_CHUNK_BYTES


@pytest.fixture
def agent(agent_process: AgentProcess) -> AgentProcess:
    agent_process.tenant_tokens = {ALICE: ALICE_TOKEN, BOB: BOB_TOKEN}
    agent_process.spaces = {SPACE: {"members": [ALICE]}}
    return agent_process.start()


def _every_operation(session: int) -> list[p.Request]:
    return [
        p.Ping(2, session),
        p.Stats(3, session),
        p.Lookup(4, session, ALICE, [key(1)]),
        p.PrepareStore(5, session, ALICE, [key(1)], [10]),
        p.CommitStore(6, session, 1),
        p.Release(7, session, 1),
        p.StoreInline(8, session, ALICE, [key(1)]),
        p.RetrieveInline(9, session, ALICE, [key(1)]),
        p.EndSession(10, session),
        p.Clear(11, session, None),
        p.Snapshot(12, session),
        p.PrefetchStatus(13, session, 1),
        p.Push(14, session, ALICE, [key(1)], "node-b"),
    ]


def test_without_a_known_token_nothing_but_hellos_refusal(agent: AgentProcess) -> None:
    raw = RawClient(agent.zmq)
    for token, code in (("", "unauthenticated"), ("guess", "unauthenticated")):
        error = raw.error(p.encode(p.Hello(1, p.PROTOCOL_VERSION, "intruder", token)))
        assert (error.code, error.req) == (code, 1), error
        assert "hello needs a token of this pool" in error.message
    for request in _every_operation(0):  # no session: every request is refused
        frames = [p.encode(request)] + ([b"x"] if isinstance(request, p.StoreInline) else [])
        error = raw.error(*frames)
        assert error.code == p.ErrorCode.UNKNOWN_SESSION, (request, error)
    raw.close()
    with pytest.raises(AgentError) as refused:
        AgentClient(agent.zmq, token="guess").connect()
    assert refused.value.code == p.ErrorCode.UNAUTHENTICATED


def test_a_gateway_token_is_refused_at_hello(agent_process: AgentProcess) -> None:
    agent_process.settings["TOKENS_FILE"] = str(agent_process.workdir / "gateway-tokens.yaml")
    (agent_process.workdir / "gateway-tokens.yaml").write_text(
        f"admins: {ADMIN_TOKEN}\ngateways: {GATEWAY_TOKEN}\n"
    )
    agent = agent_process.start()
    with pytest.raises(AgentError) as refused:
        AgentClient(agent.zmq, token=GATEWAY_TOKEN).connect()
    assert refused.value.code == p.ErrorCode.FORBIDDEN
    assert "routing API" in str(refused.value)


def _forbidden(call: object) -> None:
    assert callable(call)
    with pytest.raises(AgentError) as refused:
        call()
    assert refused.value.code == p.ErrorCode.FORBIDDEN, refused.value


def test_a_tenants_token_acts_on_its_own_tenant_only(agent: AgentProcess) -> None:
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as admin:
        admin.store(BOB, [key("b")], [b"bob's"])
    with AgentClient(agent.zmq, token=ALICE_TOKEN) as alice:
        assert alice.info is not None and alice.info.tenant == ALICE
        alice.store(ALICE, [key("a")], [b"alice's"])
        assert alice.retrieve(ALICE, [key("a")]) == [b"alice's"]
        # bob's id and key are known: still nothing
        _forbidden(lambda: alice.lookup(BOB, [key("b")]))
        _forbidden(lambda: alice.retrieve_inline(BOB, [key("b")]))
        _forbidden(lambda: alice.store_inline(BOB, [key("x")], [b"poison"]))
        _forbidden(lambda: alice.prepare_store(BOB, [key("x")], [6], None))
        _forbidden(lambda: alice.clear(BOB))
        _forbidden(alice.clear)  # everyone's
        _forbidden(alice.snapshot)
        # no salt: the default tenant means hers
        alice.store_inline(DEFAULT, [key("unsalted")], [b"hers"])
        assert alice.retrieve_inline(DEFAULT, [key("unsalted")]) == [b"hers"]
        assert alice.clear(ALICE) == 2
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as admin:
        assert admin.retrieve_inline(BOB, [key("b")]) == [b"bob's"]
        assert admin.lookup(DEFAULT, [key("unsalted")], lock=False).count == 0


def test_a_member_of_a_shared_space_acts_for_its_chunks_and_others_do_not(
    agent: AgentProcess,
) -> None:
    with AgentClient(agent.zmq, token=ALICE_TOKEN) as alice:
        # a member stores into a space through the agent (its file is read-only to it) ...
        _forbidden(lambda: alice.store(SPACE, [key("shared")], [b"system prompt"]))
        assert alice.store_inline(SPACE, [key("shared")], [b"system prompt"]).stored == 1
        # ... and reads it zero-copy from the space's file
        assert alice.retrieve(SPACE, [key("shared")]) == [b"system prompt"]
        _forbidden(lambda: alice.clear(SPACE))  # an admin's, not a member's
        alice.store_inline(CANARY_TENANT, [key("canary")], [CANARY_CHUNK])  # kvpool doctor's
        assert alice.clear(CANARY_TENANT) == 1
    with AgentClient(agent.zmq, token=BOB_TOKEN) as bob:  # not admitted
        _forbidden(lambda: bob.lookup(SPACE, [key("shared")]))
        _forbidden(lambda: bob.store_inline(SPACE, [key("x")], [b"poison"]))
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as admin:
        assert admin.clear(SPACE) == 1


def test_an_engine_token_serves_any_tenant_but_takes_no_snapshot_and_clears_nothing(
    agent: AgentProcess,
) -> None:
    with AgentClient(agent.zmq, token=ENGINE_TOKEN) as engine:
        assert engine.info is not None and engine.info.tenant == ""
        for tenant in (ALICE, BOB, DEFAULT):
            engine.store(tenant, [key(tenant)], [tenant.encode()])
            assert engine.retrieve(tenant, [key(tenant)]) == [tenant.encode()]
        _forbidden(engine.snapshot)
        _forbidden(lambda: engine.clear(ALICE))
        _forbidden(engine.clear)
        engine.store_inline(CANARY_TENANT, [key("canary")], [CANARY_CHUNK])  # kvpool doctor's
        assert engine.clear(CANARY_TENANT) == 1


def test_an_index_token_takes_the_snapshot_and_touches_no_chunk(agent: AgentProcess) -> None:
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as admin:
        admin.store(ALICE, [key(1)], [b"x"])
    with AgentClient(agent.zmq, token=INDEX_TOKEN) as index:
        assert index.snapshot() == {ALICE: [key(1)]}
        _forbidden(lambda: index.lookup(ALICE, [key(1)]))
        _forbidden(lambda: index.store_inline(ALICE, [key(2)], [b"y"]))
        _forbidden(lambda: index.clear(CANARY_TENANT))


def _subscriber(endpoint: str, token: str | None) -> zmq.Socket[bytes]:
    socket = zmq.Context.instance().socket(zmq.SUB)
    socket.setsockopt(zmq.LINGER, 0)
    if token is not None:
        socket.setsockopt(zmq.PLAIN_USERNAME, b"test")
        socket.setsockopt(zmq.PLAIN_PASSWORD, token.encode())
    socket.setsockopt(zmq.SUBSCRIBE, p.EVENTS_TOPIC)
    socket.connect(endpoint)
    return socket


def test_the_events_feed_admits_only_an_index_or_admin_token(agent: AgentProcess) -> None:
    candidates = {
        "no mechanism": None,
        "unknown": "guess",
        "tenant": ALICE_TOKEN,
        "engine": ENGINE_TOKEN,
        "index": INDEX_TOKEN,
        "admin": ADMIN_TOKEN,
    }
    sockets = {name: _subscriber(agent.events, token) for name, token in candidates.items()}
    try:
        with AgentClient(agent.zmq, token=ADMIN_TOKEN) as admin:
            received: set[str] = set()
            for attempt in range(50):  # subscriptions take a moment to reach the agent
                admin.store_inline(ALICE, [key(f"event-{attempt}")], [b"e"])
                for name, socket in sockets.items():
                    if socket.poll(20):
                        received.add(name)
                        socket.recv_multipart()
                if received >= {"index", "admin"} and attempt >= 10:
                    break
        assert received == {"index", "admin"}
    finally:
        for socket in sockets.values():
            socket.close()


def test_a_push_offers_only_chunks_the_token_may_use_and_this_agent_holds(
    agent: AgentProcess,
) -> None:
    """A prefill's connector asks its agent to offer the prompt to the decode's node: never
    another tenant's chunks (the receiver would pull them under that tenant), never the
    doctor's canary; an agent without peers, or without the chunks, sends nothing."""
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as admin:
        admin.store(BOB, [key("pb")], [b"bob's"])
    with AgentClient(agent.zmq, token=ALICE_TOKEN) as alice:
        alice.store(ALICE, [key("pa")], [b"alice's"])
        _forbidden(lambda: alice.push(BOB, [key("pb")], "node-b"))
        _forbidden(lambda: alice.push(CANARY_TENANT, [key("pa")], "node-b"))
        assert alice.push(ALICE, [key("pa")], "node-b") == "this agent has no peers"
    with AgentClient(agent.zmq, token=INDEX_TOKEN) as index:
        _forbidden(lambda: index.push(BOB, [key("pb")], "node-b"))
    with AgentClient(agent.zmq, token=ENGINE_TOKEN) as engine:
        assert engine.push(BOB, [key("pb")], "node-b") == "this agent has no peers"
        for keys, parent in (([b"short"], None), ([key("pb")], b"short")):
            with pytest.raises(AgentError) as malformed:
                engine.push(BOB, keys, "node-b", parent)
            assert malformed.value.code == p.ErrorCode.INVALID_REQUEST
