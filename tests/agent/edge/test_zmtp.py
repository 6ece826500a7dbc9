"""The agent's ZMTP framing in-process: libzmq DEALERs served, hostile bytes dropped."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator

import pytest
import zmq

from kvpool.agent.edge.zmtp import MAX_PENDING, DropReason, MessageBounds, ZmtpRouter
from kvpool.common.config import ZmqLimits
from kvpool.common.web.rate_limited_log import RateLimitedLog
from tests.support.polling import wait_until
from tests.support.raw_zmq import ZmtpPeer, closed_by_peer

BOUNDS = MessageBounds(max_frames=8, max_bytes=1 << 20)


class Echo:
    """A router on a thread answering each message with its frames (or ``reply_size``
    zero bytes), counting messages served and peers dropped. A peer is admitted by its
    first message (the agent's by its hello), so that one is bounded by ``unauthenticated``."""

    def __init__(
        self,
        limits: ZmqLimits | None = None,
        reply_size: int | None = None,
        unauthenticated: MessageBounds = BOUNDS,
    ) -> None:
        self.dropped: Counter[DropReason] = Counter()
        self.served = 0
        self.reply_size = reply_size
        self.router = ZmtpRouter(
            "tcp://127.0.0.1:*",
            BOUNDS,
            unauthenticated=unauthenticated,
            limits=limits or ZmqLimits(),
            log=RateLimitedLog(logging.getLogger("zmtp-test")),
            on_drop=lambda reason: self.dropped.update([reason]),
        )
        self._stop = False
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        poller = zmq.Poller()
        self.router.register(poller)
        while not self._stop:
            events = dict(poller.poll(0 if self.router.ready() else 20))
            self.router.handle(events)
            self.router.expire()
            for peer, frames in self.router.take():
                self.router.admit(peer)
                self.served += 1
                reply = [bytes(self.reply_size)] if self.reply_size is not None else frames
                self.router.send(peer, reply)
        self.router.close()

    def close(self) -> None:
        self._stop = True
        self._thread.join()


@pytest.fixture
def echo() -> Iterator[Echo]:
    server = Echo()
    yield server
    server.close()


def dealer(endpoint: str) -> zmq.Socket[bytes]:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def test_a_dealer_is_answered_in_order_with_every_frame_intact(echo: Echo) -> None:
    client = dealer(echo.router.bound_endpoint)
    messages = [
        [b"", b"a"],
        [b"x" * 255, b"y" * 256],  # the largest short frame, the smallest long one
        [bytes(range(256)) * 400],  # 100 KiB: read in place as it arrives
        [b"m"] * BOUNDS.max_frames,
        [b"z" * (BOUNDS.max_bytes - 1), b"!"],  # exactly the bound
    ] + [[b"%d" % n] for n in range(3 * MAX_PENDING)]  # pipelined, more than parsed ahead
    for message in messages:
        client.send_multipart(message)
    for message in messages:
        assert client.poll(5000)
        assert client.recv_multipart() == message
    assert not echo.dropped
    client.close()


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        ([b"m"] * (BOUNDS.max_frames + 1), DropReason.TOO_MANY_FRAMES),
        ([b"z" * BOUNDS.max_bytes, b"!"], DropReason.MESSAGE_TOO_LARGE),
    ],
    ids=["frames", "bytes"],
)
def test_a_message_over_the_bounds_drops_its_peer(
    echo: Echo, frames: list[bytes], reason: DropReason
) -> None:
    client = dealer(echo.router.bound_endpoint)
    client.send_multipart(frames)
    wait_until(lambda: echo.dropped[reason] == 1)
    client.close()
    assert echo.served == 0


def test_bytes_that_are_not_zmtp_drop_the_peer(echo: Echo) -> None:
    host, port = echo.router.bound_endpoint.removeprefix("tcp://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: agent\r\n" + b"X-Padding: a\r\n" * 4 + b"\r\n")
        assert closed_by_peer(sock, timeout=5)
    assert echo.dropped == {DropReason.PROTOCOL: 1}


def test_a_peer_without_a_handshake_is_closed_at_the_deadline() -> None:
    echo = Echo(ZmqLimits(hello_seconds=0.3))
    try:
        host, port = echo.router.bound_endpoint.removeprefix("tcp://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            started = time.monotonic()
            assert closed_by_peer(sock, timeout=5)
            assert 0.25 < time.monotonic() - started < 2
        assert echo.dropped == {DropReason.HANDSHAKE_TIMEOUT: 1}
        peer = ZmtpPeer(echo.router.bound_endpoint)  # one admitted in time stays
        peer.send(ZmtpPeer.frame(b"hello", more=False))
        assert peer.sock.recv(64) == b"\x00\x05hello"
        time.sleep(0.5)
        peer.send(ZmtpPeer.frame(b"still here", more=False))
        assert peer.sock.recv(64) == b"\x00\x0astill here"
        peer.close()
    finally:
        echo.close()


def test_a_heartbeat_ping_gets_its_pong(echo: Echo) -> None:
    peer = ZmtpPeer(echo.router.bound_endpoint)
    peer.send_command(b"PING", b"\x00\x64" + b"context")
    assert peer.sock.recv(64) == b"\x04\x0c\x04PONGcontext"
    peer.close()


def test_a_peer_that_reads_no_replies_is_read_no_further() -> None:
    """Its unsent replies stay within the bound (and one reply): it is not served on."""
    echo = Echo(reply_size=256 << 10)
    try:
        peer = ZmtpPeer(echo.router.bound_endpoint)
        peer.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        request = ZmtpPeer.frame(b"more please", more=False)
        sender = threading.Thread(target=lambda: peer.send(request * 100_000), daemon=True)
        sender.start()
        time.sleep(1.0)
        served = echo.served
        time.sleep(0.5)
        assert echo.served == served < 200, "served on although its replies went unread"
        other = dealer(echo.router.bound_endpoint)  # while another peer is served at once
        other.send(b"hello")
        assert other.poll(2000)
        other.close()
        peer.close()
    finally:
        echo.close()
