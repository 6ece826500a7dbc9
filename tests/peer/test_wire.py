"""The peer protocol's frames and handshake, over a real socket pair: what a peer that
breaks the protocol or lacks the pool's credential gets (nothing but an error)."""

from __future__ import annotations

import contextlib
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest

from kvpool.agent.l2.codec import AEGIS_FORMAT_VERSION
from kvpool.agent.peer.links import failure_reason
from kvpool.agent.peer.session import Session, accept_session, open_session
from kvpool.agent.peer.transport import READ_AHEAD, TcpChannel, TcpTransport
from kvpool.agent.peer.wire import (
    FRAME,
    MAGIC,
    MAX_META_BYTES,
    VERSION,
    Exists,
    Get,
    Have,
    Offer,
    PeerClosed,
    Prove,
    WireError,
    frame,
    parse_header,
    parse_message,
)
from kvpool.common.handshake import NotProven
from kvpool.common.keyring import Keyring

POOL = "pool-a"
KEY = bytes(32)


def keyring(directory: Path, **keys: str) -> Keyring:
    directory.mkdir()
    for key_id, material in keys.items():
        path = directory / key_id.lstrip("k")
        path.write_text(material)
        path.chmod(0o600)
    return Keyring(directory, what="peer key")


@pytest.fixture
def channels() -> Iterator[tuple[TcpChannel, TcpChannel]]:
    left, right = socket.socketpair()
    for sock in (left, right):
        sock.settimeout(5.0)
    yield TcpChannel(left, "left"), TcpChannel(right, "right")
    left.close()
    right.close()


def handshake(
    channels: tuple[TcpChannel, TcpChannel],
    server_keys: Keyring,
    client_keys: Keyring,
    formats: tuple[int, ...] = (AEGIS_FORMAT_VERSION,),
) -> tuple[Session | Exception, Session | Exception]:
    """Both halves at once (the client opening ``formats``); each side's session or the
    error it raised."""
    results: dict[str, Session | Exception] = {}

    def run(side: str, call: Callable[[], Session]) -> None:
        try:
            results[side] = call()
        except (NotProven, WireError) as error:
            results[side] = error

    server = threading.Thread(
        target=run,
        args=("server", lambda: accept_session(channels[0], server_keys, POOL, "node-a")),
    )
    server.start()
    run(
        "client",
        lambda: open_session(channels[1], client_keys, POOL, "node-b", formats=formats),
    )
    server.join(5.0)
    return results["server"], results["client"]


def test_messages_round_trip_through_frames() -> None:
    request = Exists("tenant", [bytes(32), bytes([1]) * 32])
    data = frame(request, body_length=7)
    meta_length, body_length = parse_header(data[: FRAME.size])
    assert (meta_length, body_length) == (len(data) - FRAME.size, 7)
    assert parse_message(data[FRAME.size :]) == request
    offer = Offer("tenant", [bytes(32)], bytes([2]) * 32)
    assert parse_message(frame(offer)[FRAME.size :]) == offer


@pytest.mark.parametrize(
    ("header", "reason"),
    [
        (FRAME.pack(b"HTTP", VERSION, 10, 0), "not a kvpool peer frame"),
        (FRAME.pack(MAGIC, VERSION + 1, 10, 0), "peer protocol version 2"),
        (FRAME.pack(MAGIC, VERSION, MAX_META_BYTES + 1, 0), "at most"),
    ],
)
def test_a_frame_that_is_not_ours_is_refused(header: bytes, reason: str) -> None:
    with pytest.raises(WireError, match=reason):
        parse_header(header)


@pytest.mark.parametrize(
    ("meta", "reason"),
    [
        (b"\xc1", "malformed message"),
        (frame(Get("t", b"short"))[FRAME.size :], "not 32 bytes"),
        (frame(Exists("t", [bytes(32)] * 9000))[FRAME.size :], "9000 keys"),
        (frame(Offer("t", [bytes(32)] * 9000))[FRAME.size :], "9000 keys"),
        (frame(Offer("t", [bytes(32)], b"short"))[FRAME.size :], "not 32 bytes"),
        (frame(Offer("t", [b"short"]))[FRAME.size :], "not 32 bytes"),
    ],
)
def test_a_malformed_message_is_refused(meta: bytes, reason: str) -> None:
    with pytest.raises(WireError, match=reason):
        parse_message(meta)


def test_peers_holding_the_pool_key_agree_on_the_highest_common_id(
    channels: tuple[TcpChannel, TcpChannel], tmp_path: Path
) -> None:
    old, new = secrets.token_hex(32), secrets.token_hex(32)
    server = keyring(tmp_path / "a", k1=old, k2=new)
    client = keyring(tmp_path / "b", k1=old)  # has not read the rotated Secret yet
    server_side, client_side = handshake(channels, server, client)
    assert server_side == Session("node-b", 1, opens_aegis=True)
    assert client_side == Session("node-a", 1)
    channels[1].send(Exists("t", [bytes(32)]))
    assert channels[0].receive() == (Exists("t", [bytes(32)]), 0)
    channels[0].send(Have(1))
    assert channels[1].receive() == (Have(1), 0)


def test_a_peer_without_the_pool_key_is_refused_on_both_sides(
    channels: tuple[TcpChannel, TcpChannel], tmp_path: Path
) -> None:
    server = keyring(tmp_path / "a", k1=secrets.token_hex(32))
    stranger = keyring(tmp_path / "b", k1=secrets.token_hex(32))
    server_side, client_side = handshake(channels, server, stranger)
    assert isinstance(server_side, NotProven)
    assert "does not hold the pool's peer key" in str(server_side)
    assert isinstance(client_side, NotProven)
    assert "refused this agent's proof" in str(client_side)


def test_peers_with_no_key_id_in_common_never_prove_anything(
    channels: tuple[TcpChannel, TcpChannel], tmp_path: Path
) -> None:
    shared = secrets.token_hex(32)
    server = keyring(tmp_path / "a", k2=shared)
    client = keyring(tmp_path / "b", k1=shared)  # the same bytes under another id
    server_side, client_side = handshake(channels, server, client)
    for side in (server_side, client_side):
        assert isinstance(side, NotProven)
        assert "no peer key in common" in str(side)


def test_a_connection_that_ends_mid_frame_is_a_wire_error(
    channels: tuple[TcpChannel, TcpChannel],
) -> None:
    channels[0]._sock.sendall(frame(Have(3))[:5])
    channels[0].close()
    with pytest.raises(WireError, match="closed the connection mid-frame"):
        channels[1].receive()


def test_frames_sent_back_to_back_are_read_ahead_and_come_apart_whole(
    channels: tuple[TcpChannel, TcpChannel],
) -> None:
    """A pipelined run's answers arrive together: one read brings a frame's header, its
    message and part of its body (and the next frame's), and each comes out whole."""
    small, large = bytes(range(200)), secrets.token_bytes(3 * READ_AHEAD)
    channels[0].send(Have(1), [small])
    channels[0].send(Have(2), [large])
    channels[0].send(Have(3))
    received: list[tuple[object, bytes]] = []
    for _ in range(3):
        message, length = channels[1].receive()
        body = memoryview(bytearray(length))
        channels[1].receive_body(body)
        received.append((message, bytes(body)))
        assert channels[1].wait_readable(0) == (len(received) < 3)
    assert received == [(Have(1), small), (Have(2), large), (Have(3), b"")]


def test_a_frame_that_came_with_the_one_before_is_ready_to_be_read(
    channels: tuple[TcpChannel, TcpChannel],
) -> None:
    """Frames sent together (one ``send_frames``: a run's requests) come apart whole, and
    the reader knows while the next one is here whole (a server keeps its answers to send
    them together while it is); a frame only partly here is not ready."""
    sender, reader = channels
    body = secrets.token_bytes(100)
    sender.send_frames([(Get("t", KEY), ()), (Get("t", KEY), ()), (Have(3), [body])])
    assert reader.receive() == (Get("t", KEY), 0)
    assert reader.frame_ready()
    assert reader.receive() == (Get("t", KEY), 0)
    assert reader.frame_ready()
    assert reader.receive() == (Have(3), len(body))
    received = memoryview(bytearray(len(body)))
    reader.receive_body(received)
    assert bytes(received) == body
    assert not reader.frame_ready()
    whole, part = frame(Have(4)), frame(Have(5))
    sender._sock.sendall(whole + part[: FRAME.size + 1])
    assert reader.receive() == (Have(4), 0)
    assert not reader.frame_ready()  # its header came, not all of its message
    sender._sock.sendall(part[FRAME.size + 1 :])
    assert reader.receive() == (Have(5), 0)


def test_a_connection_closed_between_frames_is_its_end_not_a_broken_protocol(
    channels: tuple[TcpChannel, TcpChannel],
) -> None:
    """A client that stops closes its kept connections between two requests: the server's
    reader ends there, counting nothing as malformed (it catches a ``ConnectionError`` as
    the peer gone), and a client's reused connection is asked again on a fresh one."""
    channels[0].send(Have(3))
    channels[0].close()
    assert channels[1].receive() == (Have(3), 0)
    with pytest.raises(PeerClosed, match=r"closed the connection$"):
        channels[1].receive()
    assert not issubclass(PeerClosed, WireError) and failure_reason(PeerClosed()) == "broken"


def test_a_channel_closed_under_its_reader_says_its_end_has_come(
    channels: tuple[TcpChannel, TcpChannel],
) -> None:
    """The agent stops: it closes a connection whose serving thread is about to wait for the
    next request. The wait says something came, and reading it raises an ``OSError`` (which
    ends the thread quietly), not a ``ValueError`` out of ``select``."""
    channels[1].close()
    assert channels[1].wait_readable(0)
    with pytest.raises(OSError):
        channels[1].receive()


@contextlib.contextmanager
def tcp_pair(
    reader_timeout: float, sender_timeout: float
) -> Iterator[tuple[TcpChannel, TcpChannel]]:
    """A reader's and a sender's channel over loopback TCP (what the kernel's timeouts do
    differs between TCP and a socket pair's Unix sockets), their buffers small both ways
    (a reader may answer: a peer server reads requests and sends chunks)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        sender = socket.create_connection(listener.getsockname())
        reader, _ = listener.accept()
    for end in (sender, reader):
        end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 16)
        end.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
    reader.settimeout(reader_timeout)
    sender.settimeout(sender_timeout)
    try:
        yield TcpChannel(reader, "reader"), TcpChannel(sender, "sender")
    finally:
        reader.close()
        sender.close()


def test_a_peer_that_says_nothing_is_a_timeout_the_kernel_keeps() -> None:
    """Without a deadline the socket blocks and the kernel keeps its timeout (no ``poll``
    before each call): a silent peer is a :class:`TimeoutError` (counted as ``timeout``),
    between frames, mid-body and on a send it does not take, as with Python's timeout."""
    with tcp_pair(0.3, 0.3) as (quiet, asking):
        assert asking._sock.gettimeout() is None
        with pytest.raises(TimeoutError) as silent:
            asking.receive()
        assert failure_reason(silent.value) == "timeout"
        quiet._sock.sendall(frame(Have(1), 1000) + bytes(10))
        assert asking.receive() == (Have(1), 1000)
        with pytest.raises(TimeoutError):
            asking.receive_body(memoryview(bytearray(1000)))
        with pytest.raises(TimeoutError):
            asking.send(Have(2), [bytes(8 << 20)])


def test_a_frame_in_pieces_goes_out_whole_past_partial_sends() -> None:
    """A frame is one ``sendmsg`` of its pieces; where the kernel takes only part of them
    (under a deadline each call sends what the socket's buffer holds) the rest follow."""
    with tcp_pair(2.0, 2.0) as (reader, sender):
        sender.set_deadline(time.monotonic() + 5.0)
        header, body = secrets.token_bytes(100), secrets.token_bytes(3 << 20)
        sending = threading.Thread(target=sender.send, args=(Have(7), [header, body]))
        sending.start()
        assert reader.receive() == (Have(7), len(header) + len(body))
        received = memoryview(bytearray(len(header) + len(body)))
        for start in range(0, len(received), 1 << 20):
            threading.Event().wait(0.1)
            reader.receive_body(received[start : start + (1 << 20)])
        sending.join(5.0)
        assert bytes(received) == header + body


def test_a_peer_that_takes_a_frame_slowly_gets_all_of_it() -> None:
    """On TCP the kernel ends a send that waited its whole timeout with what it sent; a peer
    that takes some of the frame within each timeout is not cut off (``io_timeout_seconds``:
    one that takes *nothing* for that long is), and the rest follows in order."""
    with tcp_pair(5.0, 0.3) as (reader, sender):
        body = secrets.token_bytes(2 << 20)
        sending = threading.Thread(target=sender.send, args=(Have(7), [body]))
        sending.start()
        assert reader.receive() == (Have(7), len(body))
        received = memoryview(bytearray(len(body)))
        for start in range(0, len(received), 64 << 10):  # 1.6 s in all: several timeouts
            threading.Event().wait(0.05)
            reader.receive_body(received[start : start + (64 << 10)])
        sending.join(5.0)
        assert bytes(received) == body


def test_the_tcp_transport_connects_to_its_listener() -> None:
    transport = TcpTransport()
    listener = transport.listen("127.0.0.1", 0, io_timeout=5.0)
    try:
        client = transport.connect(listener.address, connect_timeout=2.0, io_timeout=5.0)
        server = listener.accept()
        client.send(Have(2))
        assert server.receive() == (Have(2), 0)
        client.close()
        server.close()
    finally:
        listener.close()


class _ProveOfAnOlderBuild(msgspec.Struct, tag="prove", frozen=True):
    """:class:`~kvpool.agent.peer.wire.Prove` as builds before object format 3 sent it."""

    node: str
    nonce: bytes
    key_id: int
    proof: bytes


def test_a_server_seals_in_format_3_only_for_a_client_that_opens_it(
    channels: tuple[TcpChannel, TcpChannel], tmp_path: Path
) -> None:
    """In a rolling upgrade each side of a connection may be of either build: a proof
    without the formats (an older client's) decodes as opening format 2 alone, and an
    older server reads a newer client's proof (msgspec skips the field it does not know)."""
    key = secrets.token_hex(32)
    server, client = keyring(tmp_path / "a", k1=key), keyring(tmp_path / "b", k1=key)
    server_side, _ = handshake(channels, server, client, formats=())
    assert server_side == Session("node-b", 1, opens_aegis=False)
    older = msgspec.msgpack.encode(_ProveOfAnOlderBuild("n", bytes(32), 1, bytes(32)))
    assert parse_message(older) == Prove("n", bytes(32), 1, bytes(32), formats=[])
    newer = frame(Prove("n", bytes(32), 1, bytes(32), [AEGIS_FORMAT_VERSION]))[FRAME.size :]
    assert msgspec.msgpack.decode(newer, type=_ProveOfAnOlderBuild).node == "n"
