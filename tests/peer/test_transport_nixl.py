"""The NIXL transport's channels, two NIXL agents of this process over loopback (UCX held to
TCP): bodies land where the client lent, a chunk larger than a landing crosses the
connection once and the next landing holds it (lent anew only with no answer on its way),
and a landing is taken only by a server, after the handshake, from the node that proved
itself."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvpool.agent.peer.session import accept_session, open_session
from kvpool.agent.peer.transport import PeerChannel, TcpChannel
from kvpool.agent.peer.transport_nixl import MAX_SLOTS, SLOT_BYTES, NixlChannel, NixlTransport
from kvpool.agent.peer.wire import Get, Landing, Object, PeerClosed, WireError, Written
from kvpool.common.keyring import Keyring, generate_key
from kvpool.tools.bench.local.peers import LINK_ENVIRONMENT

KEY = b"k" * 32


@pytest.fixture(autouse=True)
def _link(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in LINK_ENVIRONMENT.items():
        monkeypatch.setenv(name, value)


Answer = Callable[[PeerChannel], None]


class Loopback:
    """A NIXL server on loopback; :meth:`connect` gives a client channel to it, whose
    accepted channel ``answer`` runs on (its failures kept in :attr:`errors`)."""

    def __init__(self) -> None:
        server, self.client = NixlTransport("server"), NixlTransport("client")
        assert server.name == self.client.name == "nixl", server.fallback or self.client.fallback
        self.listener = server.listen("127.0.0.1", 0, io_timeout=5.0)
        self.threads: list[threading.Thread] = []
        self.errors: list[BaseException] = []

    def connect(self, answer: Answer) -> PeerChannel:
        thread = threading.Thread(target=self._serve, args=(answer,), daemon=True)
        thread.start()
        self.threads.append(thread)
        return self.client.connect(self.listener.address, connect_timeout=2, io_timeout=5)

    def _serve(self, answer: Answer) -> None:
        channel = self.listener.accept()
        try:
            answer(channel)
        except BaseException as error:  # the test reads it
            self.errors.append(error)
        finally:
            channel.close()

    def close(self) -> None:
        self.listener.close()
        for thread in self.threads:
            thread.join(timeout=10)


@pytest.fixture
def loopback() -> Iterator[Loopback]:
    made = Loopback()
    yield made
    made.close()


@pytest.fixture
def keyring(tmp_path: Path) -> Keyring:
    generate_key(tmp_path)
    return Keyring(tmp_path, what="peer key")


def _read(channel: PeerChannel) -> bytes:
    channel.send(Get("tenant", KEY))
    answer, length = channel.receive()
    assert isinstance(answer, Object), answer
    body = bytearray(length)
    channel.receive_body(memoryview(body)[:10])
    channel.receive_body(memoryview(body)[10:])
    return bytes(body)


def test_bodies_land_where_the_client_lent_and_a_larger_chunk_grows_the_landing(
    loopback: Loopback,
) -> None:
    sizes = [1000, SLOT_BYTES + 5, SLOT_BYTES + 5]
    bodies = [os.urandom(size) for size in sizes]

    def answer(channel: PeerChannel) -> None:
        channel.proven("client", False)
        for body in bodies:
            channel.receive()
            channel.send(Object(), [body[:7], body[7:]])

    client = loopback.connect(answer)
    client.proven("server", True)
    assert client.transport == "nixl"
    for body in bodies:  # the second crosses TCP (larger than a slot), the third lands
        assert _read(client) == body
    assert isinstance(client, NixlChannel)
    landing = client._landing  # lent anew before the third request, to hold it
    assert landing is not None and len(landing.memory) >= SLOT_BYTES + 5
    client.close()
    loopback.close()
    assert not loopback.errors


def test_a_body_built_in_the_send_buffer_lands_as_it_was_built(loopback: Loopback) -> None:
    """A server builds (seals) a body where NIXL sends it from, and sends it as it lies:
    only where the client's landing takes it; on TCP there is no such memory."""
    bodies = [os.urandom(size) for size in (1000, 5000)]
    offered: list[bool] = []

    def answer(channel: PeerChannel) -> None:
        channel.proven("client", False)
        offered.append(channel.body_memory(10) is not None)  # no landing yet: none
        for body in bodies:
            channel.receive()
            built = channel.body_memory(len(body))
            assert built is not None and channel.body_memory(SLOT_BYTES + 1) is None
            built = channel.body_memory(len(body))  # the last one handed out is the one sent
            assert built is not None
            built[:] = body
            channel.send(Object(), [built])

    client = loopback.connect(answer)
    client.proven("server", True)
    assert [_read(client) for _ in bodies] == bodies
    client.close()
    loopback.close()
    assert not loopback.errors and offered == [False]
    left, right = socket.socketpair()
    with left, right:
        assert TcpChannel(left, "left").body_memory(10) is None


@pytest.mark.parametrize(
    ("proven", "landing", "refusal"),
    [
        (False, Landing("client/x", b"metadata", 4096, 4096), "before the handshake"),
        (True, Landing("other/x", b"metadata", 4096, 4096), "of agent 'other/x' from node"),
        (True, Landing("client/x", b"metadata", 1 << 20, 1 << 20, 0), "in 0 slots"),
        (True, Landing("client/x", b"metadata", 1 << 20, 1 << 20, MAX_SLOTS + 1), "slots"),
    ],
    ids=["before-the-handshake", "another-nodes-agent", "no-slots", "too-many-slots"],
)
def test_a_landing_the_server_must_not_take_is_refused(
    loopback: Loopback, proven: bool, landing: Landing, refusal: str
) -> None:
    """Before the handshake, of an agent not named after the node that proved itself, or in
    no slots or more than a server keeps writes for: the connection ends."""
    outcome: list[BaseException] = []

    def answer(channel: PeerChannel) -> None:
        if proven:
            channel.proven("client", False)
        with pytest.raises(WireError, match=refusal) as refused:
            channel.receive()
        outcome.append(refused.value)

    client = loopback.connect(answer)
    client.send(landing)
    client.wait_readable(5)  # the server closes it
    client.close()
    loopback.close()
    assert outcome and not loopback.errors


@pytest.mark.parametrize(
    ("lent", "sent", "refusal"),
    [
        (False, Landing("server/x", b"metadata", 4096, 4096), "a landing from a server"),
        (True, Written(1000, SLOT_BYTES), "of no landing's slot"),  # the first body's slot is 0
    ],
    ids=["a-landing", "a-body-outside-its-slot"],
)
def test_a_client_refuses_what_its_server_may_not_say(
    loopback: Loopback, lent: bool, sent: Landing | Written, refusal: str
) -> None:
    def answer(channel: PeerChannel) -> None:
        channel.proven("client", False)
        channel.receive()
        assert isinstance(channel, NixlChannel)
        channel._tcp.send(sent)

    client = loopback.connect(answer)
    client.proven("server", lent)
    client.send(Get("tenant", KEY))
    with pytest.raises(WireError, match=refusal):
        client.receive()
    client.close()
    loopback.close()
    assert not loopback.errors


def test_requests_in_flight_land_in_slots_of_their_own(loopback: Loopback) -> None:
    """A client asks as many chunks at once as its landing has slots; each body lands in a
    slot of its own, none overwritten before it was read."""
    bodies = [os.urandom(100_000 + index) for index in range(20)]

    def answer(channel: PeerChannel) -> None:
        channel.proven("client", False)
        for body in bodies:
            channel.receive()
            channel.send(Object(), [body])

    client = loopback.connect(answer)
    client.proven("server", True)
    assert client.depth > 1
    asked = 0
    for index, body in enumerate(bodies):
        while asked < len(bodies) and asked < index + client.depth:
            client.send(Get("tenant", KEY))
            asked += 1
        answer_, length = client.receive()
        assert isinstance(answer_, Object) and length == len(body)
        received = bytearray(length)
        client.receive_body(memoryview(received))
        assert received == body
    client.close()
    loopback.close()
    assert not loopback.errors


def test_a_landing_closed_with_answers_on_their_way_is_not_lent_again_at_once(
    loopback: Loopback, keyring: Keyring
) -> None:
    """A connection closed while its server may still write answers into its landing (a run
    cut short): the next connection gets another landing; one closed with nothing in flight
    gives the next connection its own. Through the real handshake: its messages are no
    answers on their way."""
    served = threading.Event()

    def answer(channel: PeerChannel) -> None:
        accept_session(channel, keyring, "pool", "server")
        with contextlib.suppress(PeerClosed):  # a client that closes before asking
            channel.receive()  # the landing comes with the first request
            served.set()

    def landing_of(channel: PeerChannel) -> int:
        assert isinstance(channel, NixlChannel) and channel._landing is not None
        return channel._landing.address

    quiet = loopback.connect(answer)
    open_session(quiet, keyring, "pool", "client")
    quiet_landing = landing_of(quiet)
    quiet.close()
    asking = loopback.connect(answer)
    open_session(asking, keyring, "pool", "client")
    assert landing_of(asking) == quiet_landing  # nothing was on its way: lent again
    asking.send(Get("tenant", KEY))
    assert served.wait(5)
    asking.close()  # its answer still due
    after = loopback.connect(answer)
    open_session(after, keyring, "pool", "client")
    assert landing_of(after) != quiet_landing
    after.close()
    loopback.close()
    assert not loopback.errors


def test_after_the_handshake_a_landing_is_lent_anew_only_with_no_answer_on_its_way(
    loopback: Loopback, keyring: Keyring
) -> None:
    """Through the real handshake (whose messages are no requests): another connection saw
    a larger chunk, and this one asks two chunks at once. Its landing is lent anew before
    the first request, not between the two, so each body is read where the server wrote it,
    even when both were written before the client reads either."""
    bodies = [os.urandom(100_000), os.urandom(100_001)]
    both_written = threading.Event()

    def answer(channel: PeerChannel) -> None:
        accept_session(channel, keyring, "pool", "server")
        for body in bodies:
            channel.receive()
            channel.send(Object(), [body])
        both_written.set()

    client = loopback.connect(answer)
    open_session(client, keyring, "pool", "client")
    assert isinstance(client, NixlChannel) and client.depth >= len(bodies)
    client._engine.grow_slots(SLOT_BYTES + 5)
    for _ in bodies:
        client.send(Get("tenant", KEY))
    assert both_written.wait(5)
    for body in bodies:
        answer_, length = client.receive()
        assert isinstance(answer_, Object) and length == len(body)
        received = bytearray(length)
        client.receive_body(memoryview(received))
        assert received == body
    assert client._slot_bytes > SLOT_BYTES
    client.close()
    loopback.close()
    assert not loopback.errors
