"""Requests and answers that go together, over loopback TCP: a serving connection's
answers (:mod:`kvpool.agent.peer.answers`) to requests that came together go out in one
send, a lone request's at once, a batch stops at its byte bound, and answers a dead
connection never sent let go of what they held; a pipelined run asks for its chunks a
few at a time (:meth:`~kvpool.agent.peer.links.PeerLink.fetch_run`)."""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from kvpool.agent.l2.base import ObjectKey
from kvpool.agent.l2.buffers import BufferPool
from kvpool.agent.l2.codec import ObjectCodec
from kvpool.agent.peer.answers import BATCH_BYTES, Answers
from kvpool.agent.peer.links import LinkSettings, PeerLink
from kvpool.agent.peer.transport import DEPTH, Frame, TcpChannel, TcpTransport
from kvpool.agent.peer.wire import Get, Missing, Object, PeerClosed
from tests.peer.test_wire import POOL, keyring, tcp_pair

KEY = bytes(32)


class CountedSends:
    """The server's channel, its sends counted (each is one system call on TCP)."""

    def __init__(self, channel: TcpChannel) -> None:
        self.channel = channel
        self.sends: list[int] = []
        """The frames of each send, in order."""
        real = channel.send_frames

        def send_frames(frames: Sequence[Frame]) -> None:
            self.sends.append(len(frames))
            real(frames)

        channel.send_frames = send_frames  # type: ignore[method-assign]


@contextlib.contextmanager
def served() -> Iterator[tuple[CountedSends, TcpChannel]]:
    """A server's channel (sends counted) and its client's."""
    with tcp_pair(5.0, 5.0) as (server, client):
        yield CountedSends(server), client


def read_answers(client: TcpChannel, count: int, into: list[bytes]) -> threading.Thread:
    """A thread reading ``count`` answers' bodies into ``into`` (the answers outgrow the
    socket's buffers: the client reads while the server sends)."""

    def read() -> None:
        for _ in range(count):
            message, length = client.receive()
            assert isinstance(message, Object)
            body = memoryview(bytearray(length))
            client.receive_body(body)
            into.append(bytes(body))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return reader


def answer_each(server: TcpChannel, answers: Answers, bodies: list[bytes]) -> None:
    for body in bodies:
        assert server.receive() == (Get("t", KEY), 0)
        answers.add(Object(), [body])


@pytest.mark.parametrize(
    ("size", "sends"),
    [(64 << 10, [4]), (300 << 10, [4, 4]), (BATCH_BYTES, [1, 1, 1])],
    ids=["4-small-answers-in-one-send", "batches-stop-past-1-MiB", "large-answers-alone"],
)
def test_answers_to_requests_that_came_together_go_out_together(
    size: int, sends: list[int]
) -> None:
    count = sum(sends)
    bodies = [secrets.token_bytes(size) for _ in range(count)]
    with served() as (counted, client):
        client.send_frames([(Get("t", KEY), ()) for _ in range(count)])
        received: list[bytes] = []
        reader = read_answers(client, count, received)
        answer_each(counted.channel, Answers(counted.channel), bodies)
        reader.join(10.0)
    assert received == bodies  # each whole, in order
    assert counted.sends == sends


def test_a_lone_request_is_answered_at_once() -> None:
    """No request waits behind it: its answer goes now, though the batch is small."""
    with served() as (counted, client):
        answers = Answers(counted.channel)
        for _ in range(3):
            client.send(Get("t", KEY))
            assert counted.channel.receive() == (Get("t", KEY), 0)
            answers.add(Missing())
            assert client.receive() == (Missing(), 0)  # it came: nothing else was asked
    assert counted.sends == [1, 1, 1]


def test_answers_a_dead_connection_never_sent_let_go_of_what_they_held() -> None:
    """An answer kept for the request behind it is not sent when the connection ends: what
    it held (its body's buffer) is given back, and what was to follow its send (the bytes in
    flight counted down) is done."""
    let_go: list[str] = []

    @contextlib.contextmanager
    def buffer() -> Iterator[bytes]:
        yield bytes(100)
        let_go.append("buffer")

    with served() as (counted, client):
        client.send_frames([(Get("t", KEY), ()), (Get("t", KEY), ())])
        answers = Answers(counted.channel)
        assert counted.channel.receive() == (Get("t", KEY), 0)
        body = answers.hold(buffer())
        answers.once_sent(lambda: let_go.append("counted down"))
        answers.add(Object(), [body])
        assert counted.sends == [] and let_go == []  # kept: the next request is here
        answers.drop()
        counted.channel.close()
        with pytest.raises(PeerClosed):
            client.receive()
    assert sorted(let_go) == ["buffer", "counted down"]
    assert counted.sends == []


class Memory:
    """A chunk's destination whose turn has come: memory of its own."""

    def __init__(self) -> None:
        self.memory: memoryview | None = None

    def turn(self) -> bool:
        return True

    def wait_turn(self) -> bool:
        return True

    def reserve(self, size: int) -> memoryview:
        self.memory = memoryview(bytearray(size))
        return self.memory


def test_a_run_asks_for_its_chunks_a_few_at_a_time(tmp_path: Path) -> None:
    """A pipelined run's ``Get`` s go out together on TCP, as many as the channel's depth
    first, then half a depth each time half of them are answered: the server finds them together
    (and answers them together), and each chunk comes whole, in order."""
    ring = keyring(tmp_path / "keys", k1="the pool's peer key material, 32+ bytes")
    codec = ObjectCodec(ring, POOL, seal=True, buffers=BufferPool())
    names = [ObjectKey("t", bytes([index]) * 32) for index in range(2 * DEPTH)]
    chunks = [secrets.token_bytes(4096) for _ in names]
    settings = LinkSettings(
        POOL, "asker", ring, codec, TcpTransport(), 5.0, 5.0, 1 << 20, max_requests=4
    )
    with served() as (counted, client):
        asked = CountedSends(client)
        link = PeerLink("holder", "unused:1", settings)
        link._idle.append((client, time.monotonic()))  # as if proven: the handshake is apart

        def serve() -> None:
            for name, chunk in zip(names, chunks, strict=True):
                assert counted.channel.receive() == (Get(name.tenant, name.key), 0)
                with codec.encode(name, chunk, 1) as (header, body):
                    counted.channel.send(Object(), [header, body])

        server = threading.Thread(target=serve, daemon=True)
        server.start()
        into = [Memory() for _ in names]
        assert link.fetch_run(names, into) == (len(names), sum(map(len, chunks)), None)
        server.join(5.0)
    assert asked.sends == [DEPTH, DEPTH // 2, DEPTH // 2]
    assert [bytes(memory.memory or b"") for memory in into] == chunks
