"""How peer frames move: the interface a transport implements, and TCP's.

The rest of the peer code sees only :class:`PeerChannel` (a connection that
sends and receives frames, with the body of a chunk apart, so that it can come
from and go into memory the caller owns) and :class:`PeerTransport` (connect
and listen). TCP, the transport here, sends a frame (or several: a run's requests, the
answers to them) with one ``sendmsg`` straight from the caller's buffers (the kernel
gathers the frame, the chunk's header and its sealed body into full segments; they are
never joined in memory) and receives with
``recv_into`` straight into the caller's buffer, a body in one call
(``MSG_WAITALL``): the kernel's copy is the only one. An RDMA transport (NIXL,
UCX) implements the same two classes: its channel would post the body as a
one-sided read or write between registered buffers, and carry the messages on
its own queue pair (docs/platform/peers.md).

Every call is blocking with the timeout given at connect or accept: a peer
that sends or takes nothing for that long raises :class:`TimeoutError`, a
connection that ends mid-frame :class:`~kvpool.agent.peer.wire.WireError`, and one
that ends between frames :class:`~kvpool.agent.peer.wire.PeerClosed`. A
deadline (:meth:`PeerChannel.set_deadline`) bounds every call together: a peer
that trickles a byte at a time still raises :class:`TimeoutError` once it
passes (the server's handshake runs under one). Without a deadline the kernel
keeps the timeout (``SO_RCVTIMEO``, ``SO_SNDTIMEO``) and each call is one system
call; Python's own timeout would add a ``poll`` before each, and each system call
hands the interpreter lock to another thread and back (docs/platform/peers.md).
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import time
from collections.abc import Iterator, Sequence
from typing import Literal, Protocol

from kvpool.agent.peer.wire import (
    FRAME,
    MAX_META_BYTES,
    Message,
    PeerClosed,
    WireError,
    frame,
    parse_header,
    parse_message,
)

Buffer = bytes | bytearray | memoryview
Frame = tuple[Message, Sequence[Buffer]]
"""A message and the pieces of its body."""


class PeerChannel(Protocol):
    remote: str
    """The other side's address, ``HOST:PORT``."""
    transport: str
    """What carries chunk bodies on it now: ``tcp``, or ``nixl`` once a landing is agreed."""
    lands: bool
    """A server's: it can write bodies into the client's landing (its hello says so)."""

    @property
    def depth(self) -> int:
        """Requests the asking side may have on it at once, their answers not read yet (a
        pipelined run: :meth:`~kvpool.agent.peer.links.PeerLink.fetch_run`)."""
        ...

    @property
    def asks_together(self) -> int:
        """Requests of a pipelined run sent together, once that many of its answers were read
        (TCP: half its depth, so that the server finds them together and answers them
        together; NIXL: one, a slot asked for again as soon as it is read, so that the
        server's writes never wait for a request)."""
        ...

    def proven(self, node: str, peer_lands: bool) -> None:
        """Both sides proved the pool's credential (``node``: the other side's name;
        ``peer_lands``: a client's server said it lands): what the transport exchanges
        beyond frames may begin, never before."""
        ...

    def send(self, message: Message, body: Sequence[Buffer] = ()) -> None:
        """One frame: ``message``, then the pieces of ``body`` in order."""
        ...

    def send_frames(self, frames: Sequence[Frame]) -> None:
        """Several frames, in order, as :meth:`send` sends each (TCP: in one system call)."""
        ...

    def frame_ready(self) -> bool:
        """Whether a whole frame's header and message have arrived already: the next
        :meth:`receive` returns at once (a pipelined request that came with the one before)."""
        ...

    def body_memory(self, length: int) -> memoryview | None:
        """A server's: memory to build the next answer's body of ``length`` bytes in, which
        :meth:`send` then sends as it lies, with no copy, when it is the body's one piece
        (a NIXL channel's registered send buffer); None: build it anywhere."""
        ...

    def receive(self, max_meta_bytes: int = MAX_META_BYTES) -> tuple[Message, int]:
        """The next message and the length of the body that follows it (read it next); a
        message over ``max_meta_bytes`` is a :class:`~kvpool.agent.peer.wire.WireError`."""
        ...

    def receive_body(self, into: memoryview) -> None:
        """Exactly ``len(into)`` bytes of the body into ``into``."""
        ...

    def landed_body(self, length: int) -> memoryview | None:
        """A client's: the rest of the body, ``length`` bytes, where it landed (a NIXL
        landing, which the server may write again once the next request is sent: read it
        before), taken as :meth:`receive_body` would take it; None where the body comes
        over the connection (take it with :meth:`receive_body`)."""
        ...

    def wait_readable(self, timeout: float) -> bool:
        """Whether something (a frame, or the end of the connection) arrives in ``timeout``
        seconds (an idle connection waits longer than a frame in progress may take)."""
        ...

    def set_deadline(self, deadline: float | None) -> None:
        """Until set again, every call raises :class:`TimeoutError` once the monotonic clock
        passes ``deadline`` (``None``: only the I/O timeout)."""
        ...

    def close(self) -> None:
        """Close it; a call blocked on it in another thread returns (with an error)."""
        ...


class PeerListener(Protocol):
    address: str

    def accept(self) -> PeerChannel:
        """The next connection; :class:`OSError` once closed."""
        ...

    def close(self) -> None: ...


class PeerTransport(Protocol):
    @property
    def name(self) -> Literal["tcp", "nixl"]:
        """What carries chunk bodies."""
        ...

    @property
    def fallback(self) -> str | None:
        """Why it is ``tcp`` where ``nixl`` was asked for."""
        ...

    def connect(self, address: str, connect_timeout: float, io_timeout: float) -> PeerChannel:
        """A channel to ``HOST:PORT``; :class:`OSError` if it cannot be had in time."""
        ...

    def listen(self, host: str, port: int, io_timeout: float) -> PeerListener: ...


def split_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (an IPv6 host in brackets) as ``(host, port)``."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


DEPTH = 8
"""Requests in flight on a TCP connection: the answers queue in the socket's buffers, and
the server always has the next request when it has sent an answer."""


READ_AHEAD = 4096
"""Bytes a TCP channel reads at once while it waits for a frame's header and message: one
``recv`` brings them (and a small chunk's own header), where reading each exactly would
take one each; a body is received straight into its memory, but for what came along."""


class TcpChannel:
    transport = "tcp"
    lands = False
    depth = DEPTH
    asks_together = DEPTH // 2

    def __init__(self, sock: socket.socket, remote: str) -> None:
        self._sock = sock
        self.remote = remote
        self._ahead = bytearray(READ_AHEAD)
        self._start = self._end = 0
        """What was read ahead and not taken yet: ``_ahead[_start:_end]``."""
        self._io_timeout = sock.gettimeout()
        self._deadline: float | None = None
        _kernel_timeouts(sock, self._io_timeout)

    def proven(self, node: str, peer_lands: bool) -> None:
        pass  # bodies follow their frames on this connection

    def send(self, message: Message, body: Sequence[Buffer] = ()) -> None:
        self.send_frames([(message, body)])

    def send_frames(self, frames: Sequence[Frame]) -> None:
        """The frames, as long as the peer takes some of them within each I/O timeout (the
        setting's "takes nothing for this long"): a call that times out having sent part
        of them returns that part, and the rest follows."""
        pieces = [
            memoryview(piece).cast("B")
            for message, body in frames
            for piece in (frame(message, sum(len(piece) for piece in body)), *body)
            if len(piece)
        ]
        while pieces:
            self._before_call()
            with self._timing():
                sent = self._sock.sendmsg(pieces)
            while pieces and sent >= len(pieces[0]):
                sent -= len(pieces.pop(0))
            if sent:
                pieces[0] = pieces[0][sent:]

    def body_memory(self, length: int) -> memoryview | None:
        return None  # sendmsg copies from anywhere

    def receive(self, max_meta_bytes: int = MAX_META_BYTES) -> tuple[Message, int]:
        meta_length, body_length = parse_header(
            self._take(FRAME.size, between_frames=True), max_meta_bytes
        )
        if meta_length <= READ_AHEAD:
            return parse_message(self._take(meta_length)), body_length
        meta = memoryview(bytearray(meta_length))
        self.receive_body(meta)
        return parse_message(meta), body_length

    def landed_body(self, length: int) -> memoryview | None:
        return None  # it comes over the connection

    def receive_body(self, into: memoryview) -> None:
        ready = min(len(into), self._end - self._start)
        if ready:
            into[:ready] = self._ahead[self._start : self._start + ready]
            self._start += ready
        self._read_into(into[ready:])

    def frame_ready(self) -> bool:
        ready = self._end - self._start
        if ready < FRAME.size:
            return False
        meta_length = parse_header(self._ahead[self._start : self._start + FRAME.size])[0]
        return ready >= FRAME.size + meta_length

    def wait_readable(self, timeout: float) -> bool:
        if self._end > self._start:
            return True
        try:
            readable, _, _ = select.select([self._sock], [], [], timeout)
        except ValueError:  # closed (by another thread: the agent stops): its end has come
            return True
        return bool(readable)

    def set_deadline(self, deadline: float | None) -> None:
        self._deadline = deadline
        if deadline is None:
            _kernel_timeouts(self._sock, self._io_timeout)

    def _before_call(self) -> None:
        """The socket's timeout for the next call: the I/O timeout, or less to the deadline."""
        if self._deadline is None:
            return
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{self.remote} is past its deadline")
        self._sock.settimeout(left if self._io_timeout is None else min(left, self._io_timeout))

    def _take(self, count: int, *, between_frames: bool = False) -> bytes:
        """The next ``count`` bytes (at most :data:`READ_AHEAD`), reading ahead as much as
        has arrived: :class:`PeerClosed` where the connection ends before the first of them
        and ``between_frames`` (they start a frame), else a :class:`WireError`."""
        if self._end - self._start < count:
            ahead = self._ahead
            ahead[: self._end - self._start] = ahead[self._start : self._end]
            self._end -= self._start
            self._start = 0
            view = memoryview(ahead)
            while self._end < count:
                self._before_call()
                with self._timing():
                    got = self._sock.recv_into(view[self._end :])
                if got == 0:
                    if between_frames and self._end == 0:
                        raise PeerClosed(f"{self.remote} closed the connection")
                    raise WireError(f"{self.remote} closed the connection mid-frame")
                self._end += got
        taken = bytes(self._ahead[self._start : self._start + count])
        self._start += count
        return taken

    def _read_into(self, view: memoryview) -> None:
        while view:
            self._before_call()
            with self._timing():
                count = self._sock.recv_into(view, 0, socket.MSG_WAITALL)
            if count == 0:
                raise WireError(f"{self.remote} closed the connection mid-frame")
            view = view[count:]

    @contextlib.contextmanager
    def _timing(self) -> Iterator[None]:
        """A call's timeout kept by the kernel (it fails with ``EAGAIN``) as Python's."""
        try:
            yield
        except BlockingIOError:
            raise TimeoutError(f"{self.remote} did not answer in {self._io_timeout} s") from None

    def close(self) -> None:
        # shutdown first: it wakes a thread blocked in recv(), which close() alone does not
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


def _kernel_timeouts(sock: socket.socket, seconds: float | None) -> None:
    """``sock`` blocking, with ``seconds`` (None: no limit) for each call kept by the
    kernel: a call that times out fails with ``EAGAIN``."""
    sock.settimeout(None)
    whole = int(seconds or 0)
    limit = struct.pack("@ll", whole, int(((seconds or 0) - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, limit)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, limit)


class TcpListener:
    def __init__(self, sock: socket.socket, io_timeout: float) -> None:
        self._sock = sock
        self._io_timeout = io_timeout
        host, port = sock.getsockname()[:2]
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def accept(self) -> PeerChannel:
        sock, remote = self._sock.accept()
        sock.settimeout(self._io_timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        host, port = remote[:2]
        return TcpChannel(sock, f"[{host}]:{port}" if ":" in host else f"{host}:{port}")

    def close(self) -> None:
        # shutdown first: it wakes a thread blocked in accept(), which close() alone does not
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


class TcpTransport:
    name: Literal["tcp", "nixl"] = "tcp"
    fallback: str | None = None

    def connect(self, address: str, connect_timeout: float, io_timeout: float) -> PeerChannel:
        sock = socket.create_connection(split_address(address), timeout=connect_timeout)
        sock.settimeout(io_timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return TcpChannel(sock, address)

    def listen(self, host: str, port: int, io_timeout: float) -> PeerListener:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(64)
        except OSError:
            sock.close()
            raise
        return TcpListener(sock, io_timeout)
