"""The agent's end of its ZMQ port, framed by the agent itself: ZMTP 3.0 with bounded messages.

libzmq reads every frame of a multipart message into its own memory before the socket
shows the first one, and it bounds a frame (``MAXMSGSIZE``), never a message: a peer
that sent 60 MiB frames flagged MORE and never a last one held 660 MiB of the agent until
it disconnected, and one message of 2 million empty frames (4 MB on the wire) cost
127 MiB and blocked the server thread for 4.9 s. No socket option bounds a message's
frames or bytes, and no receive call sees a message before its last frame has arrived
(a ROUTER's pipe publishes only whole messages). So the agent does not serve its port
with a libzmq ROUTER but with this module: it accepts the TCP connections of libzmq
DEALERs, speaks ZMTP 3.0 (https://rfc.zeromq.org/spec/23/) with the NULL mechanism (a
DEALER's default), and reads each frame's header before its body, so that

- a message of more than ``max_frames`` frames or ``max_bytes`` bytes drops its peer as
  soon as the header of the frame over the bound arrives, before that frame is allocated;
- a peer is read only while none of its messages waits to be served and fewer than
  ``max_bytes`` of its replies are unsent: what one peer has in flight is at most one
  unfinished message (``max_bytes``), the rest of one read (:data:`READ_SIZE`, parsed
  :data:`MAX_PENDING` messages at a time), and its unsent replies (``max_bytes`` and one
  reply);
- peers are served in turn, one message each (as a ROUTER queues fairly);
- a connection that has not finished its greeting and handshake ``handshake_seconds``
  after it opened is closed (libzmq's ``ZMQ_HANDSHAKE_IVL``, 30 s by default).

Every connection gets a routing id of its own (8 bytes, never reused); an id a client
names for itself (``ZMQ_ROUTING_ID``) is ignored, so no connection can take another's.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import socket
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import count, islice
from typing import Any

import zmq

from kvpool_agent.web.rate_limited_log import RateLimitedLog

Frame = bytes | memoryview
"""One received frame: bytes, or a view of the buffer a big frame was read into."""

READ_SIZE = 256 << 10
"""Most bytes read from a connection at once, and so parsed at once."""
SMALL_FRAME = 1 << 10
"""A frame body up to this size that has not fully arrived waits in the connection's read
buffer; a bigger one gets a buffer of its own at once, read into in place, so a peer that
sends a byte at a time costs a copy of at most this much per read."""
MAX_COMMAND = 4 << 10
"""Largest ZMTP command (READY: socket type and identity, a few dozen bytes)."""
MAX_PENDING = 64
"""Whole messages of one peer parsed ahead of being served; the rest of a read stays bytes
until then (a read of tiny messages would otherwise be some 50 times its size in objects)."""
ACCEPT_PAUSE_SECONDS = 0.1
"""How long accepting waits after accept() failed for want of descriptors."""

_MORE, _LONG, _COMMAND = 0x01, 0x02, 0x04
_GREETING_SIZE = 64
_GREETING = (
    b"\xff" + bytes(8) + b"\x7f"  # signature
    + bytes([3, 0])  # version 3.0
    + b"NULL".ljust(20, b"\0")  # mechanism
    + b"\0"  # as-server (unused by NULL)
    + bytes(31)  # filler
)  # fmt: skip
_READY = b"\x05READY" + b"\x0bSocket-Type" + (6).to_bytes(4, "big") + b"ROUTER"
_IOV_MAX = 512
"""Buffers handed to one sendmsg() (Linux takes up to 1024)."""


class DropReason(enum.StrEnum):
    """Why a peer's connection was closed by the agent (a metric label)."""

    TOO_MANY_FRAMES = "too_many_frames"
    MESSAGE_TOO_LARGE = "message_too_large"
    PROTOCOL = "protocol"
    HANDSHAKE_TIMEOUT = "handshake_timeout"


_DROPPED = {
    DropReason.TOO_MANY_FRAMES: "a message of more frames than the largest request has",
    DropReason.MESSAGE_TOO_LARGE: "a message larger than the largest request",
    DropReason.PROTOCOL: "bytes that are not ZMTP 3 from a DEALER",
    DropReason.HANDSHAKE_TIMEOUT: "no ZMTP greeting and handshake in time",
}


@dataclass(frozen=True)
class MessageBounds:
    """The largest message a peer may send: frames (headers and data) and bytes in all."""

    max_frames: int
    max_bytes: int


class _State(enum.Enum):
    GREETING = enum.auto()
    HANDSHAKE = enum.auto()
    OPEN = enum.auto()
    CLOSED = enum.auto()


class _Drop(Exception):
    def __init__(self, reason: DropReason, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass(eq=False)
class _Connection:
    sock: socket.socket
    peer: bytes
    deadline: float
    """When the handshake must be over."""
    state: _State = _State.GREETING
    inbox: bytearray = field(default_factory=bytearray)
    """Bytes read and not yet parsed: a frame header, or a small frame not all here yet."""
    big: bytearray | None = None
    """The body of a frame bigger than :data:`SMALL_FRAME`, filled in place as it arrives."""
    big_filled: int = 0
    big_more: bool = False
    frames: list[Frame] = field(default_factory=list)
    """The frames of the message being read."""
    message_bytes: int = 0
    pending: deque[list[Frame]] = field(default_factory=deque)
    """Whole messages waiting to be served."""
    outbox: deque[bytes | memoryview] = field(default_factory=deque)
    unsent: int = 0
    polled: int = 0
    """The events this connection is registered for."""

    def fileno(self) -> int:
        return self.sock.fileno()


class ZmtpRouter:
    """A ROUTER's part of ZMTP over TCP, for DEALER peers, with :class:`MessageBounds`.

    One thread owns it: :meth:`register` puts it on that thread's poller, :meth:`handle`
    takes the poller's events, :meth:`take` hands out whole messages, :meth:`send`
    answers them.
    """

    def __init__(
        self,
        endpoint: str,
        bounds: MessageBounds,
        *,
        log: RateLimitedLog,
        on_drop: Callable[[DropReason], None] | None = None,
        handshake_seconds: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        listener: socket.socket | None = None,
    ) -> None:
        """Listen on ``endpoint``, or on ``listener`` (:func:`listen`), bound beforehand."""
        self.bounds = bounds
        self._log = log
        self._on_drop = on_drop
        self._handshake_seconds = handshake_seconds
        self._clock = clock
        self._listener = listen(endpoint) if listener is None else listener
        self._listener.setblocking(False)
        bound_host, bound_port = self._listener.getsockname()[:2]
        shown = f"[{bound_host}]" if self._listener.family == socket.AF_INET6 else bound_host
        self.bound_endpoint = f"tcp://{shown}:{bound_port}"
        self._connections: dict[bytes, _Connection] = {}
        self._by_fd: dict[int, _Connection] = {}
        """Open connections by descriptor: a poller names a plain socket by its descriptor."""
        self._handshaking: dict[_Connection, None] = {}
        """Connections in their handshake, oldest (first deadline) first."""
        self._waiting: dict[_Connection, None] = {}
        """Connections with a whole message to serve, in turn."""
        self._ids = count(1)
        self._poller: zmq.Poller | None = None
        self._accept_resumes: float | None = None

    # ------------------------------------------------------------ the poll loop

    def register(self, poller: zmq.Poller) -> None:
        self._poller = poller
        poller.register(self._listener, zmq.POLLIN)

    def handle(self, events: Mapping[Any, int]) -> None:
        """Accept, read and write as the poller's ``events`` allow."""
        listener = self._listener.fileno()
        for item, event in events.items():
            if item == listener:
                self._accept()
                continue
            connection = self._by_fd.get(item) if isinstance(item, int) else None
            if connection is None:
                continue  # not ours, or closed while handling an earlier event
            if event & zmq.POLLOUT:
                self._flush(connection)
            if event & (zmq.POLLIN | zmq.POLLERR) and connection.state is not _State.CLOSED:
                self._read(connection)

    def ready(self) -> bool:
        """Whether :meth:`take` has a message to hand out now."""
        return any(self._may_serve(connection) for connection in self._waiting)

    def take(self) -> list[tuple[bytes, list[Frame]]]:
        """One message (routing id, frames) of each peer that has one and room for replies."""
        taken = []
        for connection in list(self._waiting):
            if not self._may_serve(connection):
                continue
            taken.append((connection.peer, connection.pending.popleft()))
            if not connection.pending and connection.inbox:  # parse the rest of its last read
                try:
                    self._parse(connection)
                except _Drop as drop:
                    self._drop(connection, drop)
                    continue
            if not connection.pending:
                del self._waiting[connection]
                self._poll(connection)
        return taken

    def send(self, peer: bytes, frames: Sequence[bytes | memoryview]) -> None:
        """Queue a message to ``peer`` and write what the socket takes now; a peer that is
        gone is not an error (a ROUTER drops such messages too)."""
        connection = self._connections.get(peer)
        if connection is None:
            return
        last = len(frames) - 1
        for number, frame in enumerate(frames):
            body = frame if isinstance(frame, bytes) else memoryview(frame).cast("B")
            size, more = len(body), _MORE if number < last else 0
            if size > 255:
                connection.outbox.append(bytes([more | _LONG]) + size.to_bytes(8, "big"))
            else:
                connection.outbox.append(bytes([more, size]))
            if size:
                connection.outbox.append(body)
            connection.unsent += size + (9 if size > 255 else 2)
        self._flush(connection)

    def next_deadline(self) -> float | None:
        """When :meth:`expire` has something to do next (None: nothing due)."""
        deadlines = [self._accept_resumes] if self._accept_resumes is not None else []
        for connection in self._handshaking:
            deadlines.append(connection.deadline)
            break
        return min(deadlines, default=None)

    def expire(self) -> None:
        """Close connections past their handshake deadline; resume accepting when due."""
        now = self._clock()
        while self._handshaking:
            connection = next(iter(self._handshaking))
            if connection.deadline > now:
                break
            self._drop(connection, _Drop(DropReason.HANDSHAKE_TIMEOUT, "handshake timed out"))
        if self._accept_resumes is not None and now >= self._accept_resumes:
            self._accept_resumes = None
            if self._poller is not None:
                self._poller.register(self._listener, zmq.POLLIN)

    def close(self) -> None:
        for connection in list(self._connections.values()):
            self._close(connection)
        self._waiting.clear()
        self._listener.close()

    # ---------------------------------------------------------------- connections

    def _accept(self) -> None:
        for _ in range(64):  # then the poll loop serves others before accepting more
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as error:
                if error.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    continue  # e.g. ECONNABORTED: that client is gone already
                self._log.warning(f"ZMQ: accept() failed ({error.strerror}); retrying shortly")
                if self._poller is not None:
                    self._poller.unregister(self._listener)
                self._accept_resumes = self._clock() + ACCEPT_PAUSE_SECONDS
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            peer = next(self._ids).to_bytes(8, "big")
            connection = _Connection(sock, peer, self._clock() + self._handshake_seconds)
            self._connections[peer] = connection
            self._by_fd[sock.fileno()] = connection
            self._handshaking[connection] = None
            connection.outbox.append(_GREETING + _command_frame(_READY))
            connection.unsent = len(connection.outbox[0])
            self._flush(connection)

    def _may_serve(self, connection: _Connection) -> bool:
        return connection.state is _State.CLOSED or connection.unsent < self.bounds.max_bytes

    def _poll(self, connection: _Connection) -> None:
        """Register the connection for what it may do now: read unless it has a message
        waiting or too many unsent reply bytes, write while it has unsent bytes."""
        if connection.state is _State.CLOSED or self._poller is None:
            return
        wanted = zmq.POLLOUT if connection.outbox else 0
        if not connection.pending and connection.unsent < self.bounds.max_bytes:
            wanted |= zmq.POLLIN
        if wanted != connection.polled:
            self._poller.register(connection, wanted)  # 0 unregisters
            connection.polled = wanted

    def _flush(self, connection: _Connection) -> None:
        outbox = connection.outbox
        while outbox and connection.state is not _State.CLOSED:
            try:
                sent = connection.sock.sendmsg(list(islice(outbox, _IOV_MAX)))
            except BlockingIOError:
                break
            except OSError:
                self._close(connection)
                return
            connection.unsent -= sent
            while sent:
                size = len(outbox[0])
                if sent < size:
                    outbox[0] = memoryview(outbox[0])[sent:]
                    break
                outbox.popleft()
                sent -= size
        self._poll(connection)

    def _read(self, connection: _Connection) -> None:
        try:
            if connection.big is not None:
                with memoryview(connection.big) as whole, whole[connection.big_filled :] as rest:
                    received = connection.sock.recv_into(rest)
                if received:
                    self._fill_big(connection, received)
                    self._poll(connection)
                    return
            else:
                data = connection.sock.recv(READ_SIZE)
                if data:
                    connection.inbox += data
                    self._parse(connection)
                    self._poll(connection)
                    return
        except BlockingIOError:
            return
        except _Drop as drop:
            self._drop(connection, drop)
            return
        except OSError:
            pass
        # The peer closed its end (or reset it): serve the whole messages it sent before;
        # a message cut short goes with the connection.
        with contextlib.suppress(_Drop):
            self._parse(connection, everything=True)
        self._close(connection)

    def _fill_big(self, connection: _Connection, received: int) -> None:
        assert connection.big is not None
        connection.big_filled += received
        if connection.big_filled == len(connection.big):
            frame, more = memoryview(connection.big), connection.big_more
            connection.big = None
            self._frame(connection, frame, more)

    def _parse(self, connection: _Connection, *, everything: bool = False) -> None:
        """Take whole frames (and the start of a big one) out of the read buffer, until
        :data:`MAX_PENDING` messages wait to be served (``everything``: no such stop)."""
        inbox = connection.inbox
        view, position = memoryview(inbox), 0
        try:
            while connection.big is None and (
                everything or connection.frames or len(connection.pending) < MAX_PENDING
            ):
                after = self._parse_one(connection, view, position)
                if after == position:
                    break  # the rest of it is still on its way
                position = after
        finally:
            view.release()
            del inbox[:position]

    def _parse_one(self, connection: _Connection, view: memoryview, position: int) -> int:
        """Take the greeting, command or frame at ``position`` (or a big frame's start);
        returns the position after it, or ``position`` if it has not all arrived."""
        end = len(view)
        if connection.state is _State.GREETING:
            if end - position < _GREETING_SIZE:
                return position
            self._greeting(connection, bytes(view[position : position + _GREETING_SIZE]))
            return position + _GREETING_SIZE
        if end - position < 2:
            return position
        flags = view[position]
        if flags & ~(_MORE | _LONG | _COMMAND):
            raise _Drop(DropReason.PROTOCOL, f"frame flags {flags:#x}")
        if not flags & _LONG:
            size, start = view[position + 1], position + 2
        elif end - position < 9:
            return position
        else:
            size, start = int.from_bytes(view[position + 1 : position + 9], "big"), position + 9
        if flags & _COMMAND:
            if size > MAX_COMMAND or connection.frames:
                raise _Drop(DropReason.PROTOCOL, "a command too large or inside a message")
            if end - start < size:
                return position
            self._command(connection, bytes(view[start : start + size]))
            return start + size
        if connection.state is not _State.OPEN:
            raise _Drop(DropReason.PROTOCOL, "a message before the handshake")
        bounds = self.bounds
        if len(connection.frames) >= bounds.max_frames:
            raise _Drop(DropReason.TOO_MANY_FRAMES, f"over {bounds.max_frames} frames")
        if connection.message_bytes + size > bounds.max_bytes:
            raise _Drop(DropReason.MESSAGE_TOO_LARGE, f"over {bounds.max_bytes} bytes")
        here = end - start
        if here >= size:
            connection.message_bytes += size
            self._frame(connection, bytes(view[start : start + size]), bool(flags & _MORE))
            return start + size
        if size <= SMALL_FRAME:
            return position
        connection.message_bytes += size
        connection.big = bytearray(size)
        connection.big[:here] = view[start:end]
        connection.big_filled, connection.big_more = here, bool(flags & _MORE)
        return end

    def _frame(self, connection: _Connection, frame: Frame, more: bool) -> None:
        connection.frames.append(frame)
        if not more:
            connection.pending.append(connection.frames)
            connection.frames, connection.message_bytes = [], 0
            self._waiting[connection] = None

    def _greeting(self, connection: _Connection, greeting: bytes) -> None:
        if greeting[0] != 0xFF or not greeting[9] & 1 or greeting[10] < 3:
            raise _Drop(DropReason.PROTOCOL, "not a ZMTP 3 greeting")
        mechanism = greeting[12:32].rstrip(b"\0")
        if mechanism != b"NULL":
            raise _Drop(DropReason.PROTOCOL, f"mechanism {mechanism!r}, not NULL")
        connection.state = _State.HANDSHAKE

    def _command(self, connection: _Connection, command: bytes) -> None:
        name_size = command[0] if command else 0
        name, body = command[1 : 1 + name_size], command[1 + name_size :]
        if connection.state is _State.HANDSHAKE:
            if name != b"READY":
                raise _Drop(DropReason.PROTOCOL, f"{name!r} instead of READY")
            socket_type = _properties(body).get("socket-type")
            if socket_type != b"DEALER":
                raise _Drop(DropReason.PROTOCOL, f"socket type {socket_type!r}, not DEALER")
            connection.state = _State.OPEN
            self._handshaking.pop(connection, None)
        elif name == b"PING" and len(body) >= 2:  # ZMTP 3.1 heartbeats: answer with the context
            pong = b"\x04PONG" + body[2:18]
            connection.outbox.append(_command_frame(pong))
            connection.unsent += len(connection.outbox[-1])
        # any other command (PONG, ERROR, ...) asks nothing of a NULL-mechanism ROUTER

    def _drop(self, connection: _Connection, drop: _Drop) -> None:
        self._log.warning(
            f"ZMQ: closing connections that send {_DROPPED[drop.reason]} ({drop.reason})"
        )
        if self._on_drop is not None:
            self._on_drop(drop.reason)
        connection.pending.clear()
        self._waiting.pop(connection, None)
        self._close(connection)

    def _close(self, connection: _Connection) -> None:
        """Close the socket; whole messages already read are still served (replies to them
        are dropped), as a ROUTER delivers what a peer sent before it went away."""
        if connection.state is _State.CLOSED:
            return
        if connection.polled and self._poller is not None:
            self._poller.unregister(connection)
        self._by_fd.pop(connection.sock.fileno(), None)
        connection.sock.close()
        connection.state = _State.CLOSED
        self._connections.pop(connection.peer, None)
        self._handshaking.pop(connection, None)
        connection.inbox.clear()
        connection.outbox.clear()
        connection.big, connection.frames, connection.unsent = None, [], 0
        if not connection.pending:
            self._waiting.pop(connection, None)


def _command_frame(command: bytes) -> bytes:
    return bytes([_COMMAND, len(command)]) + command


def _properties(metadata: bytes) -> dict[str, bytes]:
    """ZMTP metadata (name size, name, 4-byte value size, value; repeated) by lowercase name."""
    found: dict[str, bytes] = {}
    position = 0
    while position < len(metadata):
        name_end = position + 1 + metadata[position]
        value_start = name_end + 4
        if value_start > len(metadata):
            raise _Drop(DropReason.PROTOCOL, "truncated metadata")
        value_end = value_start + int.from_bytes(metadata[name_end:value_start], "big")
        if value_end > len(metadata):
            raise _Drop(DropReason.PROTOCOL, "truncated metadata")
        name = metadata[position + 1 : name_end].decode("ascii", "replace").lower()
        found[name] = metadata[value_start:value_end]
        position = value_end
    return found


def listen(endpoint: str) -> socket.socket:
    """A TCP socket listening on ``endpoint`` (``tcp://HOST:PORT``), for a :class:`ZmtpRouter`."""
    host, port = _tcp_address(endpoint)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=1024)


def _tcp_address(endpoint: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` as (host, port); ``*`` is every IPv4 address or a free port."""
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"{endpoint!r}: the agent's ZMQ port is tcp://HOST:PORT")
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    return ("0.0.0.0" if host == "*" else host), (0 if port == "*" else int(port))
