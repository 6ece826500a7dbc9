"""A serving connection's answers, between a real peer server (its real L1 service and codec,
no agent around them) and a client speaking the wire over loopback TCP: answers to
requests that came together go in one send; answers kept for the request behind them are
sent, not refused as busy, where the bytes they hold are all the connection may have in
flight; and they go before the server reads its NVMe for the next. And what a chunk's read
lease covers while its answer is sent: a sealed chunk goes from a buffer of its own (the
lease ended), an authenticated one from its L1 pages (the lease held until it is sent);
and answers kept before a leased chunk are sent within half that lease's lifetime.

The peer tier's tests between agents catch a wrong or missing chunk; these catch the
grouping itself, which those would not see."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import secrets
import struct
import termios
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from kvpool.agent.l2.base import ObjectKey
from kvpool.agent.l2.buffers import BufferPool
from kvpool.agent.l2.codec import ObjectCodec
from kvpool.agent.peer.serving import PeerServer
from kvpool.agent.peer.session import Session
from kvpool.agent.peer.transport import TcpChannel, TcpTransport
from kvpool.agent.peer.wire import Busy, Get, Object, WireError
from kvpool.agent.service.cache_service import CacheService
from kvpool.common.config import PeersConfig
from tests.peer.test_answers import CountedSends
from tests.peer.test_wire import POOL, keyring, tcp_pair
from tests.support.chunks import key
from tests.support.l1 import PAGE, make_cache, make_service
from tests.support.polling import wait_until

ALICE = "a" * 32
CHUNK = 16 * PAGE
"""A chunk of 64 KiB: four of them stay under a batch's byte bound."""


class Disk:
    """The serving agent's NVMe tier, holding ``chunks``; it notes what the client had been
    sent when each read began."""

    name = "nvme"

    def __init__(self, chunks: dict[bytes, bytes], sends: list[int]) -> None:
        self.chunks = chunks
        self.sends = sends
        self.sent_before_reads: list[list[int]] = []

    async def exists(self, names: Sequence[ObjectKey]) -> list[bool]:
        return [name.key in self.chunks for name in names]

    async def get(self, names: Sequence[ObjectKey]) -> list[bytes | None]:
        self.sent_before_reads.append(list(self.sends))
        return [self.chunks.get(name.key) for name in names]


@contextlib.contextmanager
def event_loop() -> Iterator[asyncio.AbstractEventLoop]:
    """The agent's event loop, on a thread of its own (the NVMe tier's home)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5.0)
        loop.close()


class Served:
    """A peer server over ``service`` (a real L1), answering each connection :meth:`answer`
    makes as a proven peer's; :attr:`sends` counts the frames of each of its sends."""

    def __init__(
        self,
        tmp_path: Path,
        service: CacheService,
        loop: asyncio.AbstractEventLoop,
        *,
        max_bytes_in_flight: int = 256 << 20,
        on_disk: dict[bytes, bytes] | None = None,
        seal: bool = True,
    ) -> None:
        key_dir = tmp_path / "keys"
        ring = keyring(key_dir, k1="the pool's peer key material, 32+ bytes")
        self.codec = ObjectCodec(ring, POOL, seal=seal, buffers=BufferPool(), aegis=True)
        config = PeersConfig(key_dir=key_dir, max_bytes_in_flight=max_bytes_in_flight)
        listener = TcpTransport().listen("127.0.0.1", 0, 5.0)
        self.disk = None
        self.sends: list[int] = []
        if on_disk is not None:
            self.disk = Disk(on_disk, self.sends)
        self.server = PeerServer(
            config,
            POOL,
            "holder",
            ring,
            self.codec,
            service,
            self.disk,  # type: ignore[arg-type]  # the two methods the server calls
            loop,
            listener,
        )
        listener.close()  # the connection below is made apart from it

    def answer(self, names: list[ObjectKey]) -> list[bytes | None]:
        """Send a ``Get`` for each of ``names`` at once from a client, serve them on the
        server's end, and read the answers: each chunk opened, or None for a busy one."""
        with self.asked(names) as client:
            return [self.read(client, name) for name in names]

    @contextlib.contextmanager
    def asked(self, names: list[ObjectKey], io_timeout: float = 5.0) -> Iterator[TcpChannel]:
        """A client that sent a ``Get`` for each of ``names`` at once, their answers being
        served on the server's end (which gives up a send that makes no progress for
        ``io_timeout`` seconds), for the client to :meth:`read`."""
        with tcp_pair(io_timeout, 5.0) as (server_end, client):
            counted = CountedSends(server_end)
            counted.sends = self.sends  # the disk sees them as they are made
            client.send_frames([(Get(name.tenant, name.key), ()) for name in names])
            serving = threading.Thread(
                target=self.server._answer,
                args=(server_end, Session("asker", 1, opens_aegis=True)),
                daemon=True,
            )
            serving.start()
            yield client
            client.close()  # the server's connection ends: it stops answering
            serving.join(10.0)
        assert not serving.is_alive()

    def read(self, client: TcpChannel, name: ObjectKey) -> bytes | None:
        message, length = client.receive()
        if isinstance(message, Busy):
            return None
        assert isinstance(message, Object), message
        body = memoryview(bytearray(length))
        client.receive_body(body)
        return bytes(self.codec.decode(name, body))


def unread(channel: TcpChannel) -> int:
    """The bytes that arrived at ``channel``'s socket and were not read yet."""
    waiting = fcntl.ioctl(channel._sock.fileno(), termios.FIONREAD, b"\0" * 4)
    return int(struct.unpack("i", waiting)[0])


def stored(
    service: CacheService, count: int, size: int = CHUNK
) -> tuple[list[ObjectKey], list[bytes]]:
    names = [ObjectKey(ALICE, key(f"chunk-{index}")) for index in range(count)]
    chunks = [secrets.token_bytes(size) for _ in names]
    result = service.store(ALICE, [name.key for name in names], chunks)
    assert result.stored == count
    return names, chunks


def test_answers_to_requests_that_came_together_go_in_one_send(tmp_path: Path) -> None:
    service = make_service(make_cache(pages=64), tmp_path / "q.json")
    names, chunks = stored(service, 4)
    with event_loop() as loop:
        served = Served(tmp_path, service, loop)
        assert served.answer(names) == chunks
    assert served.sends == [4]
    assert served.server.stats.bytes_in_flight == 0


def test_kept_answers_are_sent_rather_than_the_next_refused_for_the_bytes_they_hold(
    tmp_path: Path,
) -> None:
    """The connection may have one chunk in flight: the answer kept for the request behind
    it is sent, and that request is served, not refused as busy."""
    service = make_service(make_cache(pages=64), tmp_path / "q.json")
    names, chunks = stored(service, 2)
    with event_loop() as loop:
        served = Served(tmp_path, service, loop, max_bytes_in_flight=CHUNK)
        assert served.answer(names) == chunks
    assert served.sends == [1, 1]
    assert served.server.stats.refused["busy"] == 0
    assert served.server.stats.bytes_in_flight == 0


def test_kept_answers_go_before_the_server_reads_its_disk(tmp_path: Path) -> None:
    """The second chunk is on NVMe only: the first chunk's answer, kept for the request
    behind it, is sent before the disk is read (a read may take longer than the client
    waits for an answer)."""
    service = make_service(make_cache(pages=64), tmp_path / "q.json")
    names, chunks = stored(service, 1)
    on_disk = ObjectKey(ALICE, key("on-disk"))
    chunk = secrets.token_bytes(CHUNK)
    with event_loop() as loop:
        served = Served(tmp_path, service, loop, on_disk={on_disk.key: chunk})
        assert served.answer([*names, on_disk]) == [*chunks, chunk]
    assert served.disk is not None and served.disk.sent_before_reads == [[1]]
    assert served.sends == [1, 1]


@pytest.mark.parametrize("seal", [True, False], ids=["sealed", "integrity"])
def test_a_chunk_in_l1_is_leased_while_sent_only_where_it_goes_from_its_pages(
    tmp_path: Path, seal: bool
) -> None:
    """A chunk larger than the sockets hold, asked for by a client that does not read yet:
    the server is stuck sending it. Sealed, it is sent from its ciphertext's buffer and its
    lease has ended (a slow peer holds no L1 pages); with integrity it is sent from its
    pages, which stay leased (nothing can reuse them under the tag) until the client has
    read it all. Either way it opens, and no lease is left."""
    size = 16 << 20
    service = make_service(make_cache(pages=size // PAGE + 64), tmp_path / "q.json")
    names, chunks = stored(service, 1, size)
    with event_loop() as loop:
        served = Served(tmp_path, service, loop, seal=seal)
        with served.asked(names) as client:
            wait_until(lambda: unread(client) > 0)  # the answer is on its way...
            assert not served.server.stats.served_chunks  # ...and cannot all fit the sockets
            assert service.stats().open_leases == (0 if seal else 1)
            assert served.read(client, names[0]) == chunks[0]
        wait_until(lambda: served.server.stats.bytes_in_flight == 0)
    assert service.stats().open_leases == 0


def test_a_peer_that_stops_reading_an_answer_from_l1_is_cut_off_and_its_lease_ends(
    tmp_path: Path,
) -> None:
    """With integrity, a peer that asks for a chunk and never reads it holds the chunk's
    pages only until the server's send makes no progress for its I/O timeout: then the
    connection goes, and the lease and the bytes in flight with it."""
    size = 16 << 20
    service = make_service(make_cache(pages=size // PAGE + 64), tmp_path / "q.json")
    names, _ = stored(service, 1, size)
    with event_loop() as loop:
        served = Served(tmp_path, service, loop, seal=False)
        with served.asked(names, io_timeout=0.5):
            wait_until(lambda: service.stats().open_leases == 1)
            started = time.monotonic()
            wait_until(lambda: service.stats().open_leases == 0)
            assert time.monotonic() - started < 8.0  # not the lease's expiry (30 s)
            wait_until(lambda: served.server.stats.bytes_in_flight == 0)
            assert not served.server.stats.served_chunks


def test_a_peer_that_takes_an_answer_from_l1_slowly_is_cut_off_before_its_lease_ends(
    tmp_path: Path,
) -> None:
    """However steadily a peer takes an answer that goes from L1's pages, it has half the
    lease's lifetime to take it all: then the connection goes, the lease with it, before
    the lease could expire and the pages change under the tag. Here the peer reads a
    little every 0.2 s (never idle for the 5 s I/O timeout) and the lease lasts 2 s."""
    size = 16 << 20
    cache = make_cache(pages=size // PAGE + 64, lease_seconds=2.0)
    service = make_service(cache, tmp_path / "q.json")
    names, _ = stored(service, 1, size)
    with event_loop() as loop:
        served = Served(tmp_path, service, loop, seal=False)
        with served.asked(names, io_timeout=5.0) as client:
            wait_until(lambda: service.stats().open_leases == 1)
            started = time.monotonic()
            sip = memoryview(bytearray(64 << 10))
            with contextlib.suppress(OSError, WireError):
                while service.stats().open_leases and time.monotonic() - started < 4.0:
                    client._sock.recv_into(sip)  # a trickle: progress, never enough
                    time.sleep(0.2)
            assert service.stats().open_leases == 0
            assert time.monotonic() - started < 2.0  # 1 s: half the lease
            wait_until(lambda: served.server.stats.bytes_in_flight == 0)
            assert not served.server.stats.served_chunks


def test_answers_kept_before_a_leased_chunk_are_sent_before_its_lease_could_end(
    tmp_path: Path,
) -> None:
    """The connection may have one chunk in flight, and the answer kept for the request
    behind it goes before that request's chunk (leased meanwhile) can be sealed. A peer
    that takes the kept answer slowly has half the lease's lifetime to take it: then the
    connection goes, and the lease with it, before it could expire and the pages become
    another chunk's under the seal. The peer reads a little every 0.2 s (never idle for
    the 5 s I/O timeout); the lease lasts 2 s."""
    size = 12 * CHUNK  # under a batch's bytes (the first answer is kept), over the sockets'
    cache = make_cache(pages=2 * size // PAGE + 64, lease_seconds=2.0)
    service = make_service(cache, tmp_path / "q.json")
    names, _ = stored(service, 2, size)
    with event_loop() as loop:
        served = Served(tmp_path, service, loop, max_bytes_in_flight=size)
        with served.asked(names, io_timeout=5.0) as client:
            # the kept answer comes once the second chunk is leased (not the first's, sealed)
            wait_until(lambda: unread(client) > 0 and service.stats().open_leases == 1)
            started = time.monotonic()
            sip = memoryview(bytearray(16 << 10))
            with contextlib.suppress(OSError, WireError):
                while service.stats().open_leases and time.monotonic() - started < 4.0:
                    client._sock.recv_into(sip)  # a trickle: progress, never enough
                    time.sleep(0.2)
            assert service.stats().open_leases == 0
            assert time.monotonic() - started < 2.0  # 1 s: half the lease
            wait_until(lambda: served.server.stats.bytes_in_flight == 0)
            assert served.server.stats.served_chunks == 1
