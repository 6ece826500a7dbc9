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
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvpool.agent.l2.codec import HEADER
from kvpool.agent.peer.answers import Answers
from kvpool.agent.peer.session import accept_session, open_session
from kvpool.agent.peer.transport import DEPTH, PeerChannel, TcpChannel
from kvpool.agent.peer.transport_nixl import (
    LANDING_BUDGET,
    RECENT_BODIES,
    SLOT_BYTES,
    MiB,
    NixlChannel,
    NixlTransport,
    landing_slots,
)
from kvpool.agent.peer.wire import Get, Landing, Missing, Object, PeerClosed, WireError, Written
from kvpool.common.keyring import Keyring, generate_key
from kvpool.tools.bench.local.peers import LINK_ENVIRONMENT
from tests.peer.test_answers import CountedSends
from tests.support.polling import wait_until

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
            if isinstance(channel, NixlChannel) and channel._posted and not channel._closed:
                channel.wait_readable(5)  # its answers are said as their writes end
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
    return _answered(channel)


def _answering(bodies: list[bytes]) -> Answer:
    """A server's end that answers each request with the next of ``bodies``."""

    def answer(channel: PeerChannel) -> None:
        channel.proven("client", False)
        for body in bodies:
            channel.receive()
            channel.send(Object(), [body])

    return answer


def _answered(channel: PeerChannel) -> bytes:
    """The body of the next answer, which must be a chunk (read in two pieces)."""
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


def test_a_body_is_taken_where_it_landed_and_not_where_it_crossed_tcp(
    loopback: Loopback,
) -> None:
    """A client opens a sealed chunk straight from its landing into L1 (no copy first):
    the body's view is the landing's memory, and a body larger than a slot (it crossed
    the connection) or the body's head alone is none (it is received as before)."""
    bodies = [os.urandom(size) for size in (1000, SLOT_BYTES + 5, 3000)]
    client = loopback.connect(_answering(bodies))
    client.proven("server", True)
    assert isinstance(client, NixlChannel)
    client.send(Get("tenant", KEY))
    answer, length = client.receive()
    assert isinstance(answer, Object) and length == len(bodies[0])
    landed = client.landed_body(length)
    assert landed is not None and bytes(landed) == bodies[0]
    assert client._landing is not None and landed.obj is client._landing.memory
    assert client.landed_body(length) is None  # taken: nothing is left of it
    client.send(Get("tenant", KEY))
    _, length = client.receive()
    assert client.landed_body(length) is None  # it crossed TCP
    body = memoryview(bytearray(length))
    client.receive_body(body)
    assert body == bodies[1]
    client.send(Get("tenant", KEY))
    _, length = client.receive()
    head = memoryview(bytearray(10))
    client.receive_body(head)
    assert client.landed_body(length) is None  # only the rest, as long as it is
    rest = client.landed_body(length - 10)
    assert rest is not None and bytes(head) + bytes(rest) == bodies[2]
    client.close()
    loopback.close()
    assert not loopback.errors
    left, right = socket.socketpair()
    with left, right:
        assert TcpChannel(left, "left").landed_body(10) is None


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
            assert channel.body_memory(SLOT_BYTES + 1) is None  # it would cross TCP
            built = channel.body_memory(len(body))
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


def test_a_connection_whose_chunks_got_smaller_lends_a_landing_of_more_slots(
    loopback: Loopback,
) -> None:
    """Chunks that fill a landing leave it one slot, and a smaller record among them does not
    change that; once only smaller chunks came for a while, the next landing has as many
    slots as before (a pool of two models does not lose its depth)."""
    large, small = os.urandom(LANDING_BUDGET), os.urandom(1000)
    bodies = [large, small, large, *[small] * RECENT_BODIES, small]

    client = loopback.connect(_answering(bodies))
    assert isinstance(client, NixlChannel)
    client.proven("server", True)
    depths = []
    for body in bodies:
        assert _read(client) == body
        depths.append(client._slots)  # the landing its request was sent with
    assert depths == [DEPTH, 1, 1, *[1] * RECENT_BODIES, DEPTH], depths
    assert landing_slots(2 * MiB + HEADER.size) == (DEPTH, SLOT_BYTES)  # a 2 MiB chunk's
    client.close()
    loopback.close()
    assert not loopback.errors


@pytest.mark.parametrize(
    ("proven", "landing", "refusal"),
    [
        (False, Landing("client/x", b"metadata", 4096, 4096), "before the handshake"),
        (True, Landing("other/x", b"metadata", 4096, 4096), "of agent 'other/x' from node"),
        (True, Landing("client/x", b"metadata", 1 << 20, 1 << 20, 0), "in 0 slots"),
        (True, Landing("client/x", b"metadata", 1 << 20, 1 << 20, DEPTH + 1), "slots"),
        (True, Landing("client/x", b"metadata", 1 << 20, LANDING_BUDGET + 2, 2), "in 2 slots"),
    ],
    ids=["before-the-handshake", "another-nodes-agent", "no-slots", "too-many-slots", "too-large"],
)
def test_a_landing_the_server_must_not_take_is_refused(
    loopback: Loopback, proven: bool, landing: Landing, refusal: str
) -> None:
    """Before the handshake, of an agent not named after the node that proved itself, or in
    no slots, more than an asker lends, or more bytes than it lends in several: the
    connection ends."""
    outcome: list[BaseException] = []

    def answer(channel: PeerChannel) -> None:
        if proven:
            channel.proven("client", False)
        with pytest.raises(WireError, match=refusal) as refused:
            channel.receive()
        outcome.append(refused.value)

    client = loopback.connect(answer)
    client.send(landing)
    assert client.wait_readable(5)  # the server closes it
    client.close()
    loopback.close()
    assert outcome and not loopback.errors


def test_a_landing_while_answers_are_being_made_is_refused(loopback: Loopback) -> None:
    """A client lends a landing anew only with no answer on its way; one that sends a landing
    right behind its requests (a rogue one) ends the connection, and the section the
    answers were built in is not lent to the next connection at once."""
    refused: list[str] = []

    def answer(channel: PeerChannel) -> None:
        channel.proven("client", False)
        assert isinstance(channel, NixlChannel)
        answers = Answers(channel)
        for _ in range(2):
            assert channel.receive() == (Get("tenant", KEY), 0)
            section = channel.body_memory(1000)
            assert section is not None
            answers.add(Object(), [section])  # kept: the next frame is here already
        with pytest.raises(WireError, match="while answers") as raised:
            channel.receive()
        refused.append(str(raised.value))
        outbox = channel._outbox
        channel.close()
        resting = [region for _, region in channel._engine._resting]
        assert channel._outbox is None and outbox in resting

    client = loopback.connect(answer)
    client.proven("server", True)
    late = Landing("client/x", b"metadata", 1 << 20, 1 << 20)
    client.send_frames([(Get("tenant", KEY), ()), (Get("tenant", KEY), ()), (late, ())])
    assert client.wait_readable(5)  # the server closes it
    client.close()
    loopback.close()
    assert refused and not loopback.errors


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

    client = loopback.connect(_answering(bodies))
    client.proven("server", True)
    assert client.depth > 1
    asked = 0
    for index, body in enumerate(bodies):
        while asked < len(bodies) and asked < index + client.depth:
            client.send(Get("tenant", KEY))
            asked += 1
        assert _answered(client) == body
    client.close()
    loopback.close()
    assert not loopback.errors


def test_a_run_sent_at_once_after_larger_chunks_fits_the_landing_it_lends(
    loopback: Loopback,
) -> None:
    """A chunk larger than a slot came: the next request, with none in flight, lends a
    landing of larger and fewer slots. The depth the client reads before it is already that
    landing's, so a run that sends that many requests in one go (as a pipelined run does)
    never has two bodies on their way to one slot."""
    size = 3 * MiB
    bodies = [os.urandom(size)] + [os.urandom(size - index) for index in range(1, 13)]
    client = loopback.connect(_answering(bodies))
    client.proven("server", True)
    assert client.depth == DEPTH
    assert _read(client) == bodies[0]  # larger than a slot: it crossed the connection
    slots = landing_slots(size)[0]
    assert client.depth == slots < DEPTH
    assert client.asks_together == 1  # answered one at a time: each slot asked for as read
    asked = 1
    for index, body in enumerate(bodies[1:], start=1):  # as a pipelined run asks
        if asked < len(bodies) and asked - index <= client.depth - client.asks_together:
            ahead = min(len(bodies), index + client.depth) - asked
            client.send_frames([(Get("tenant", KEY), ())] * ahead)
            asked += ahead
        assert _answered(client) == body
    assert isinstance(client, NixlChannel) and client._slots == slots
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
    """Through the real handshake (whose messages are no requests): a chunk larger than the
    landing's slots crosses the connection, and then the client asks two chunks at once. Its
    landing is lent anew before the first of them, not between the two, so each body is read
    where the server wrote it, even when both were posted before the client reads either."""
    bodies = [os.urandom(SLOT_BYTES + 5), os.urandom(100_000), os.urandom(100_001)]
    both_posted = threading.Event()

    def answer(channel: PeerChannel) -> None:
        accept_session(channel, keyring, "pool", "server")
        for body in bodies:
            channel.receive()
            channel.send(Object(), [body])
        both_posted.set()

    client = loopback.connect(answer)
    open_session(client, keyring, "pool", "client")
    assert isinstance(client, NixlChannel) and client.depth >= len(bodies) - 1
    assert _read(client) == bodies[0]  # over TCP: larger than a slot
    for _ in bodies[1:]:
        client.send(Get("tenant", KEY))
    assert both_posted.wait(5)
    for body in bodies[1:]:
        assert _answered(client) == body
    assert client._slot_bytes > SLOT_BYTES
    client.close()
    loopback.close()
    assert not loopback.errors


@dataclass
class _Held:
    """A server's WRITEs, not done (as on a slow link) until :attr:`let_go` is set."""

    let_go: threading.Event = field(default_factory=threading.Event)
    looked: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(0))
    """Released each time the server looks at a WRITE held."""

    def next_look(self) -> bool:
        """Whether the server looks at a WRITE held again, from now, within 5 s: it is
        waiting for one."""
        while self.looked.acquire(blocking=False):
            pass
        return self.looked.acquire(timeout=5)


def _hold_writes(channel: PeerChannel, monkeypatch: pytest.MonkeyPatch) -> _Held:
    """The server ``channel``'s WRITEs, held."""
    assert isinstance(channel, NixlChannel)
    engine = channel._engine
    done = engine.done
    held = _Held()

    def looked_at(prepared: Any) -> bool:
        if held.let_go.is_set():
            return done(prepared)
        held.looked.release()
        return False

    monkeypatch.setattr(engine, "done", looked_at)
    return held


def test_a_server_reads_the_next_request_while_a_write_is_on_its_way(
    loopback: Loopback, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server posts an answer's WRITE and goes on to the next request before it is
    done; the client learns of each answer only once its WRITE is done, in the order
    asked."""
    bodies = [os.urandom(100_000), os.urandom(100_001)]
    both_posted = threading.Event()
    writes_held: list[_Held] = []

    def answer(channel: PeerChannel) -> None:
        channel.proven("client", False)
        writes_held.append(_hold_writes(channel, monkeypatch))
        for body in bodies:
            channel.receive()
            channel.send(Object(), [body])
        both_posted.set()

    client = loopback.connect(answer)
    client.proven("server", True)
    for _ in bodies:
        client.send(Get("tenant", KEY))
    assert both_posted.wait(5)  # neither WRITE was done
    assert writes_held[0].next_look()  # the server waits for them
    assert not client.wait_readable(0)  # and has said nothing yet
    writes_held[0].let_go.set()
    for body in bodies:
        assert _answered(client) == body
    client.close()
    loopback.close()
    assert not loopback.errors


def test_an_answer_without_a_body_comes_after_the_answers_written_before_it(
    loopback: Loopback, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk the server no longer holds, asked after one whose WRITE is on its way: the
    client reads the chunk, then the miss."""
    body = os.urandom(100_000)

    def answer(channel: PeerChannel) -> None:
        channel.proven("client", False)
        held = _hold_writes(channel, monkeypatch)
        channel.receive()
        channel.send(Object(), [body])
        channel.receive()
        threading.Timer(0.3, held.let_go.set).start()
        channel.send(Missing())

    client = loopback.connect(answer)
    client.proven("server", True)
    client.send(Get("tenant", KEY))
    client.send(Get("tenant", KEY))
    assert _answered(client) == body
    assert client.receive() == (Missing(), 0)
    client.close()
    loopback.close()
    assert not loopback.errors


def test_a_send_buffer_closed_with_a_write_on_its_way_rests(
    loopback: Loopback, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server's connection that ends while a WRITE from its send buffer may still read it:
    the buffer is not lent to the next connection at once; one that ends with every WRITE
    done is."""
    outboxes: list[int] = []
    held: list[_Held] = []

    def answer(channel: PeerChannel) -> None:
        channel.proven("client", False)
        assert isinstance(channel, NixlChannel)
        if not held:
            held.append(_hold_writes(channel, monkeypatch))
        channel.receive()
        channel.send(Object(), [b"x" * 1000])
        assert channel._outbox is not None
        outboxes.append(channel._outbox.address)

    for turn in range(3):
        client = loopback.connect(answer)
        client.proven("server", True)
        if turn:
            assert _read(client) == b"x" * 1000
        else:
            client.send(Get("tenant", KEY))  # and goes before its answer is said
        client.close()
        loopback.threads[-1].join(10)  # the server closed its end
        held[0].let_go.set()
    loopback.close()
    assert not loopback.errors
    assert outboxes[1] != outboxes[0] and outboxes[2] == outboxes[1]


def test_a_server_waiting_for_its_writes_is_held_to_its_deadline(
    loopback: Loopback, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server whose WRITE is not done (a slow client) and which must say it before its
    next answer waits no longer than the deadline its send is held to (the peer server's:
    half a chunk's lease), not the I/O timeout (5 s here): :class:`TimeoutError`."""
    waited: list[float] = []

    def answer(channel: PeerChannel) -> None:
        channel.proven("client", False)
        held = _hold_writes(channel, monkeypatch)
        channel.receive()
        channel.send(Object(), [b"x" * 1000])  # its WRITE held
        channel.receive()
        started = time.monotonic()
        channel.set_deadline(started + 0.3)
        try:
            with pytest.raises(TimeoutError):
                channel.send(Missing())  # said after the chunk's WRITE
        finally:
            waited.append(time.monotonic() - started)
            channel.set_deadline(None)  # (a peer server's connection would end here)
            held.let_go.set()

    client = loopback.connect(answer)
    client.proven("server", True)
    client.send(Get("tenant", KEY))
    client.send(Get("tenant", KEY))
    loopback.threads[-1].join(10)
    client.close()
    loopback.close()
    assert not loopback.errors
    assert len(waited) == 1 and waited[0] < 2.5, waited


def test_a_server_builds_in_no_section_whose_last_write_is_on_its_way(
    loopback: Loopback, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that asks more chunks at once than its landing has slots (a rogue one): the
    server builds the next body in a section of its send buffer only once the WRITE that
    last read that section is done."""
    body = os.urandom(LANDING_BUDGET // 2)  # two slots of it
    received: list[int] = []
    posted: list[int] = []
    held: list[_Held] = []

    def answer(channel: PeerChannel) -> None:
        channel.proven("client", False)
        channel.receive()
        channel.send(Object(), [body])  # larger than a slot: over TCP, and then two slots
        held.append(_hold_writes(channel, monkeypatch))
        for count in range(1, 4):
            channel.receive()
            received.append(count)
            channel.send(Object(), [body])
            posted.append(count)

    client = loopback.connect(answer)
    client.proven("server", True)
    assert _read(client) == body
    for _ in range(3):
        client.send(Get("tenant", KEY))
    assert isinstance(client, NixlChannel) and client.depth == 2
    wait_until(lambda: len(received) == 3, what="the third request read")
    assert held[0].next_look()  # sending the third, the server waits for a WRITE
    assert posted == [1, 2]  # the first's, whose section the third would take
    held[0].let_go.set()
    wait_until(lambda: len(posted) == 3, what="the third answer posted")
    for _ in range(3):  # each said (closing before would break the server's pipe)
        assert isinstance(client.receive()[0], Object)
    client.close()
    loopback.close()
    assert not loopback.errors


def test_a_server_closed_by_another_thread_ends_its_serving_with_an_os_error(
    loopback: Loopback, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent stops: it closes a connection while the thread serving it has a WRITE on its
    way. Whatever that thread does next (say its answers, build and post the next one) ends
    with an ``OSError`` (which the serving loop takes for the peer gone), touching no NIXL
    state that was let go, and the send buffer the WRITE may still read rests."""
    posted, closed = threading.Event(), threading.Event()
    served: list[NixlChannel] = []
    ended: list[str] = []

    def answer(channel: PeerChannel) -> None:
        channel.proven("client", False)
        assert isinstance(channel, NixlChannel)
        held = _hold_writes(channel, monkeypatch)
        channel.receive()
        channel.send(Object(), [b"x" * 1000])
        served.append(channel)
        posted.set()
        assert closed.wait(5)
        held.let_go.set()  # its WRITE's state may be looked at again: not after the close
        for step in (lambda: channel.wait_readable(0), lambda: channel.send(Object(), [b"y"])):
            with pytest.raises(OSError) as raised:
                step()
            ended.append(str(raised.value))

    client = loopback.connect(answer)
    client.proven("server", True)
    client.send(Get("tenant", KEY))
    assert posted.wait(5)
    (channel,) = served
    outbox = channel._outbox
    channel.close()
    closed.set()
    loopback.threads[-1].join(10)
    assert len(ended) == 2 and not loopback.errors, (ended, loopback.errors)
    assert all("was closed" in said for said in ended), ended
    assert outbox is not None and outbox in [region for _, region in channel._engine._resting]
    client.close()
    loopback.close()


def test_with_no_landing_requests_and_answers_go_together_as_on_tcp(loopback: Loopback) -> None:
    """A NIXL agent facing one that receives over TCP (a rollout): no landing is lent, so a
    run's requests go a few at a time in one send, and the server answers those that came
    together in one send, as a TCP channel does."""
    bodies = [os.urandom(1000 + index) for index in range(DEPTH // 2)]
    counted: list[CountedSends] = []

    def answer(channel: PeerChannel) -> None:
        assert isinstance(channel, NixlChannel) and isinstance(channel._tcp, TcpChannel)
        channel.proven("client", False)
        counted.append(CountedSends(channel._tcp))
        answers = Answers(channel)
        for body in bodies:
            assert channel.receive() == (Get("tenant", KEY), 0)
            answers.add(Object(), [body])

    client = loopback.connect(answer)
    client.proven("server", False)
    assert isinstance(client, NixlChannel) and client.asks_together == DEPTH // 2
    client.send_frames([(Get("tenant", KEY), ()) for _ in bodies])
    assert [_answered(client) for _ in bodies] == bodies
    client.close()
    loopback.close()
    assert not loopback.errors
    assert counted[0].sends == [len(bodies)]


def test_chunks_asked_together_are_written_together_into_one_slot(
    loopback: Loopback, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a landing too, a run's small chunks are asked a few at a time in one send. The
    server builds the answers to those that came together one after another in one section
    of its send buffer, posts one WRITE of them into one slot, and says them in one send;
    the client reads each where it lies, after the one before."""
    bodies = [os.urandom(100_000 + index) for index in range(DEPTH // 2)]
    counted: list[CountedSends] = []
    posted: list[int] = []

    def answer(channel: PeerChannel) -> None:
        assert isinstance(channel, NixlChannel) and isinstance(channel._tcp, TcpChannel)
        channel.proven("client", False)
        counted.append(CountedSends(channel._tcp))
        held = _hold_writes(channel, monkeypatch)
        answers = Answers(channel)
        for body in bodies:
            assert channel.receive() == (Get("tenant", KEY), 0)
            section = channel.body_memory(len(body))
            assert section is not None
            section[:] = body
            posted.append(len(channel._posted))
            answers.add(Object(), [section])
        (write,) = channel._posted  # one WRITE of them all, not said yet
        assert [written.length for written in write.said] == [len(body) for body in bodies]
        held.let_go.set()  # and then they are said together, as the server waits

    client = loopback.connect(answer)
    client.proven("server", True)
    assert isinstance(client, NixlChannel) and client.asks_together == DEPTH // 2
    asked = CountedSends(client._tcp)  # type: ignore[arg-type]
    client.send_frames([(Get("tenant", KEY), ()) for _ in bodies])
    assert [_answered(client) for _ in bodies] == bodies
    assert client._writes == 1  # one slot
    assert client.asks_together == DEPTH // 2  # as many as the server answers in a batch
    client.close()
    loopback.close()
    assert not loopback.errors
    assert asked.sends == [len(bodies)]
    assert posted == [0] * len(bodies)  # each built before any was posted
    assert counted[0].sends == [len(bodies)]


def _asked_twice(loopback: Loopback, first: Written, second: Written) -> PeerChannel:
    """A client on a landing that asked two chunks of a server that says ``first`` and
    ``second`` (whatever it wrote)."""

    def answer(channel: PeerChannel) -> None:
        channel.proven("client", False)
        assert isinstance(channel, NixlChannel)
        channel.receive()
        channel.receive()
        channel._tcp.send_frames([(first, ()), (second, ())])

    client = loopback.connect(answer)
    client.proven("server", True)
    client.send_frames([(Get("tenant", KEY), ())] * 2)
    return client


@pytest.mark.parametrize(
    ("second", "refusal"),
    [
        (Written(SLOT_BYTES - 999, 1000), "past its slot"),  # follows, one byte too long
        (Written(1000, 2000), "of no landing's slot"),  # neither follows nor a slot's start
    ],
    ids=["past-its-slot", "a-gap"],
)
def test_a_body_said_to_follow_another_must_follow_it_within_its_slot(
    loopback: Loopback, second: Written, refusal: str
) -> None:
    client = _asked_twice(loopback, Written(1000, 0), second)
    assert len(_answered(client)) == 1000
    with pytest.raises(WireError, match=refusal):
        client.receive()
    client.close()
    loopback.close()
    assert not loopback.errors


def test_after_a_body_that_fills_its_slot_the_next_one_starts_the_next_slot(
    loopback: Loopback,
) -> None:
    client = _asked_twice(loopback, Written(SLOT_BYTES, 0), Written(1000, SLOT_BYTES))
    assert [len(_answered(client)) for _ in range(2)] == [SLOT_BYTES, 1000]
    assert isinstance(client, NixlChannel) and client._writes == 2
    client.close()
    loopback.close()
    assert not loopback.errors
