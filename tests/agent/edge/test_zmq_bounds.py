"""What one ZMQ peer may cost a real agent: frames and bytes of a message, nesting depth.

The hostile peers speak ZMTP by hand (:class:`~tests.support.raw_zmq.ZmtpPeer`): a message
of millions of empty frames, big frames flagged MORE without a last one. Each test also
has a well-behaved client ping the agent meanwhile and measures how long it waits.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from kvpool.client import AgentClient, AgentError
from kvpool.common import protocol as p
from kvpool.common.keys import tenant_id
from tests.support.agent_process import ADMIN_TOKEN, AgentProcess
from tests.support.chunks import key
from tests.support.metrics import metric
from tests.support.raw_zmq import RawClient, ZmtpPeer

pytestmark = pytest.mark.process

MAX_INLINE = 4 << 20
MESSAGE_BOUND = MAX_INLINE + (1 << 20)
"""The largest message the agent takes: an inline store of max_inline_bytes and its header."""
MAX_KEYS = 8192
MEMORY_BOUND = 24 << 20
"""Peak RSS growth allowed per test: one message's bound (5 MiB) and the read buffers."""
PING_BOUND = 0.5
"""The longest a well-behaved client's ping may wait while a hostile peer floods."""
TENANT = tenant_id("bounds")


def dropped(reason: str) -> str:
    return f'kvpool_zmq_dropped_peers_total{{reason="{reason}"}}'


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    process = AgentProcess(
        tmp_path_factory.mktemp("agent"), settings={"MAX_INLINE_BYTES": str(MAX_INLINE)}
    )
    process.start()
    yield process
    process.cleanup()


def flood_while_pinging(agent: AgentProcess, peer: ZmtpPeer, flood: Iterator[bytes]) -> float:
    """Send ``flood`` from ``peer`` while another client pings; the slowest ping, in seconds."""
    with AgentClient(agent.zmq, token=ADMIN_TOKEN, timeout=30) as other:
        other.ping()
        done = threading.Event()

        def send() -> None:
            for data in flood:
                if not peer.send(data):
                    break
            done.set()

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        slowest = 0.0
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline or not done.is_set():
            started = time.perf_counter()
            other.ping()
            slowest = max(slowest, time.perf_counter() - started)
            assert time.monotonic() < deadline + 30, "the flood never ended"
        sender.join(30)
        return slowest


def test_a_message_of_two_million_frames_is_cut_off(agent: AgentProcess) -> None:
    """Before the bound: +127 MiB, and the server thread blocked for 4.9 s on this message."""
    peer = ZmtpPeer(agent.zmq)
    before = agent.memory_bytes("VmHWM")
    empty_frames = b"\x01\x00" * 2_000_000 + b"\x00\x00"  # 4 MB on the wire
    slowest = flood_while_pinging(agent, peer, iter([empty_frames]))
    grown = agent.memory_bytes("VmHWM") - before
    assert peer.dropped(timeout=5)
    peer.close()
    assert grown < MEMORY_BOUND, f"peak RSS grew by {grown / 2**20:.0f} MiB"
    assert slowest < PING_BOUND, f"a ping waited {slowest:.2f} s"
    assert metric(agent, dropped("too_many_frames")) == 1


def test_a_peer_that_never_ends_its_message_is_dropped(agent: AgentProcess) -> None:
    """4 MiB frames flagged MORE, 160 MiB of them: libzmq held all of them, unseen."""
    peer = ZmtpPeer(agent.zmq)
    before = agent.memory_bytes("VmHWM")
    frame = ZmtpPeer.frame(b"x" * MAX_INLINE, more=True)
    slowest = flood_while_pinging(agent, peer, iter([frame] * 40))
    grown = agent.memory_bytes("VmHWM") - before
    assert peer.dropped(timeout=5)
    peer.close()
    assert grown < MEMORY_BOUND, f"peak RSS grew by {grown / 2**20:.0f} MiB"
    assert slowest < PING_BOUND, f"a ping waited {slowest:.2f} s"
    assert metric(agent, dropped("message_too_large")) == 1


def test_a_client_over_the_bound_is_dropped_and_the_library_refuses_to_send(
    agent: AgentProcess,
) -> None:
    """Up to max_inline_bytes and the header a message is answered (``too_large`` above
    max_inline_bytes); past that it costs its connection."""
    before = metric(agent, dropped("message_too_large"))
    raw = RawClient(agent.zmq)
    session = raw.hello(ADMIN_TOKEN)
    header = p.encode(p.StoreInline(2, session, TENANT, [key(1), key(2)]))
    raw.socket.send_multipart([header, bytes(3 << 20), bytes(3 << 20)])
    assert not raw.socket.poll(1000), "a message over the bound was served"
    raw.close()
    assert metric(agent, dropped("message_too_large")) == before + 1
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
        with pytest.raises(AgentError) as refused:
            client.store_inline(TENANT, [key(1), key(2)], [bytes(3 << 20), bytes(3 << 20)])
        assert refused.value.code == p.ErrorCode.TOO_LARGE
        assert client.ping()
    assert metric(agent, dropped("message_too_large")) == before + 1


def test_the_largest_legitimate_messages_are_served(agent: AgentProcess) -> None:
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
        payload = b"y" * MAX_INLINE
        assert client.store_inline(TENANT, [key(1)], [payload]).stored == 1
        assert client.retrieve(TENANT, [key(1)]) == [payload]
        keys = [key(n) for n in range(10, 10 + MAX_KEYS)]  # one data frame per key
        answer = client.store_inline(TENANT, keys, [b"z"] * MAX_KEYS)
        assert answer.stored + answer.present > 0
    assert metric(agent, dropped("too_many_frames")) <= 1  # only the flood's, if it ran


def test_deeply_nested_msgpack_is_malformed_and_logs_nothing(agent: AgentProcess) -> None:
    """Before: RecursionError, answered ``internal`` with one traceback in the log each.
    (After hello: before it, a message of over 4 KiB costs the connection.)"""
    raw = RawClient(agent.zmq)
    raw.hello(ADMIN_TOKEN)
    logged = len(agent.log)
    nested = b"\x91" * 5000 + b"\xc0"
    for frame in (nested, b"\x93\xa6lookup\x01" + nested):
        error = raw.error(frame)
        assert error.code == p.ErrorCode.MALFORMED, error
        assert "nested" in error.message
    burst = 500
    for _ in range(burst):
        raw.socket.send(nested)
    for _ in range(burst):
        assert raw.socket.poll(5000)
        reply = p.decode_reply(raw.socket.recv())
        assert isinstance(reply, p.Error) and reply.code == p.ErrorCode.MALFORMED
    raw.close()
    new_lines = agent.log[logged:]
    assert len(new_lines) <= 2, "".join(new_lines[:20])
    assert "Traceback" not in "".join(new_lines)
