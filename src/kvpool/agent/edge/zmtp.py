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
- a frame's body is held as its bytes arrive, never allocated at the size its header
  announces (a buffer allocated from headers let 40 connections that sent 84 KB in all
  grow the agent by 2.6 GB);
- a peer is read (and served) only while none of its messages waits to be served and
  fewer than ``max_bytes`` of its replies are unsent (before hello: the unauthenticated
  ``max_bytes``, so that a peer that reads no replies cannot pile up error replies);
- peers are served in turn, one message each (as a ROUTER queues fairly).

Until the server admits a connection (:meth:`~ZmtpRouter.admit`: its hello succeeded), it
is *unauthenticated*: of a message it holds only what fits the small ``unauthenticated``
bounds (a hello is a few dozen bytes); the rest of a larger one (up to the bounds above)
is read and discarded, and the message is handed out as :class:`Truncated`, to be
answered (a client whose connection was renewed, the agent restarted, sends a request
before its hello). Its reads hold at most such a message and 2 KiB, it is closed
unless admitted ``hello_seconds`` after it opened (ZMTP handshake and hello together), and
at most ``max_unauthenticated`` such connections are open: a new one closes the oldest.
They never take what an admitted connection needs: admitted connections are counted
apart, up to ``max_connections`` (past it a new connection is closed at once), and the
receive budget below is theirs alone.

An admitted connection's reads hold at most :data:`SMALL_HELD` bytes (a lookup of a few
hundred keys is some 20 KiB) unless its message outgrows that: it then takes a share of
``receive_budget`` the size of the largest message and one read, and keeps it until its
messages are served; there are as many shares as the budget holds (at least one). A
connection whose message finds no share free is not read until one is, so N connections
cannot multiply the largest message; and a share's message that has not arrived
``message_seconds`` after it took the share closes its connection, so no peer keeps a
share by stalling. In all, the port's reads hold at most ``max_unauthenticated`` x (the
largest unauthenticated message and 2 KiB) + ``max_connections`` x :data:`SMALL_HELD` +
the shares (a big frame's buffer may be an eighth larger than its bytes, as it grows).

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

from kvpool.common.config import ZmqLimits
from kvpool.common.web.rate_limited_log import RateLimitedLog

Frame = bytes | memoryview
"""One received frame: bytes, or a view of the buffer a big frame was gathered in."""

READ_SIZE = 256 << 10
"""Most bytes read from a connection at once, and so parsed at once..."""
LARGE_READ = 4 << 20
"""... unless it holds a share of the receive budget: a large message is read in fewer
turns of the poll loop."""
SMALL_FRAME = 1 << 10
"""A frame body up to this size that has not fully arrived waits in the connection's read
buffer; a bigger one moves to a buffer of its own that grows as its bytes arrive, so a peer
that sends a byte at a time costs a copy of at most this much per read."""
SMALL_HELD = 64 << 10
"""Most bytes of reads an admitted connection holds without a share of the receive budget."""
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
    MESSAGE_TIMEOUT = "message_timeout"
    UNAUTHENTICATED_EVICTED = "unauthenticated_evicted"
    TOO_MANY_CONNECTIONS = "too_many_connections"


_DROPPED = {
    DropReason.TOO_MANY_FRAMES: "send a message of more frames than the largest request has",
    DropReason.MESSAGE_TOO_LARGE: "send a message larger than the largest request",
    DropReason.PROTOCOL: "send bytes that are not ZMTP 3 from a DEALER",
    DropReason.HANDSHAKE_TIMEOUT: "finish no ZMTP handshake and hello in time",
    DropReason.MESSAGE_TIMEOUT: "send a large message (or read its replies) too slowly",
    DropReason.UNAUTHENTICATED_EVICTED: "have not said hello when max_unauthenticated newer "
    "ones came",
    DropReason.TOO_MANY_CONNECTIONS: "come or say hello while max_connections have said hello",
}


class Truncated(list[Frame]):
    """A message sent before hello over the unauthenticated bounds: the frames held of it
    (its start, up to those bounds); the rest was read and discarded."""


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
    """Unauthenticated: when its hello must be done; holding a share: when its message
    must have arrived."""
    state: _State = _State.GREETING
    admitted: bool = False
    """Its hello succeeded (:meth:`ZmtpRouter.admit`)."""
    shared: bool = False
    """It holds a share of the receive budget."""
    inbox: bytearray = field(default_factory=bytearray)
    """Bytes read and not yet parsed: a frame header, or a small frame not all here yet."""
    big: bytearray | None = None
    """The body of a frame bigger than :data:`SMALL_FRAME`, gathered as it arrives."""
    big_size: int = 0
    big_more: bool = False
    frames: list[Frame] = field(default_factory=list)
    """The frames of the message being read."""
    frames_bytes: int = 0
    message_frames: int = 0
    message_bytes: int = 0
    """The frames and bytes its frames' headers announced, for the bounds."""
    truncated: bool = False
    """Before hello, the message being read outgrew the unauthenticated bounds."""
    skip: int = 0
    """Bytes of the frame being discarded still to come."""
    skip_more: bool = False
    pending: deque[list[Frame]] = field(default_factory=deque)
    """Whole messages waiting to be served."""
    pending_bytes: int = 0
    outbox: deque[bytes | memoryview] = field(default_factory=deque)
    unsent: int = 0
    polled: int = 0
    """The events this connection is registered for."""

    def fileno(self) -> int:
        return self.sock.fileno()

    @property
    def held(self) -> int:
        """Bytes its reads hold: unparsed, the message being read, the messages waiting."""
        gathered = 0 if self.big is None else len(self.big)
        return len(self.inbox) + gathered + self.frames_bytes + self.pending_bytes


class ZmtpRouter:
    """A ROUTER's part of ZMTP over TCP, for DEALER peers, with :class:`MessageBounds`
    (``unauthenticated`` until :meth:`admit`) and :class:`~kvpool.common.config.ZmqLimits`.

    One thread owns it: :meth:`register` puts it on that thread's poller, :meth:`handle`
    takes the poller's events, :meth:`take` hands out whole messages, :meth:`send`
    answers them, :meth:`expire` closes what is late. It owns the connections and their
    reads and writes; a :class:`_FrameReader` turns what they read into messages, and a
    :class:`_ReceiveBudget` deals out the shares of the receive budget.
    """

    def __init__(
        self,
        endpoint: str,
        bounds: MessageBounds,
        *,
        unauthenticated: MessageBounds,
        limits: ZmqLimits,
        log: RateLimitedLog,
        on_drop: Callable[[DropReason], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        listener: socket.socket | None = None,
    ) -> None:
        """Listen on ``endpoint``, or on ``listener`` (:func:`listen`), bound beforehand."""
        self.bounds = bounds
        self.unauthenticated = unauthenticated
        self.limits = limits
        self._log = log
        self._on_drop = on_drop
        self._clock = clock
        self._listener = listen(endpoint) if listener is None else listener
        self._listener.setblocking(False)
        bound_host, bound_port = self._listener.getsockname()[:2]
        shown = f"[{bound_host}]" if self._listener.family == socket.AF_INET6 else bound_host
        self.bound_endpoint = f"tcp://{shown}:{bound_port}"
        self._connections: dict[bytes, _Connection] = {}
        self._by_fd: dict[int, _Connection] = {}
        """Open connections by descriptor: a poller names a plain socket by its descriptor."""
        self._unadmitted: dict[_Connection, None] = {}
        """Open connections not yet admitted, oldest (first deadline) first."""
        self._admitted = 0
        self._waiting: dict[_Connection, None] = {}
        """Connections with a whole message to serve, in turn."""
        self._budget = _ReceiveBudget(bounds, unauthenticated, limits, clock, self._poll)
        self.shares = self._budget.shares
        self._reader = _FrameReader(bounds, unauthenticated, log, self._waiting)
        self._scratch = memoryview(bytearray(LARGE_READ))
        """Where every read lands before it is added to its connection's buffers (one
        buffer, reused: a fresh one per read costs the page faults of a fresh mapping)."""
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
            message = connection.pending.popleft()
            connection.pending_bytes -= sum(len(frame) for frame in message)
            taken.append((connection.peer, message))
            if not connection.pending and connection.inbox:  # parse the rest of its last read
                try:
                    self._reader.parse(connection)
                except _Drop as drop:
                    self._drop(connection, drop)
                    continue
            if not connection.pending:
                del self._waiting[connection]
                self._budget.settle(connection)
                self._poll(connection)
        return taken

    def admit(self, peer: bytes) -> bool:
        """Count ``peer``'s connection as authenticated from now on (its hello succeeded):
        the full message bounds, no hello deadline. False if it is gone, or if
        ``max_connections`` are admitted already (it is closed then)."""
        connection = self._connections.get(peer)
        if connection is None or connection.admitted:
            return connection is not None
        if self._admitted >= self.limits.max_connections:
            self._drop(connection, _Drop(DropReason.TOO_MANY_CONNECTIONS, "hello past the cap"))
            return False
        del self._unadmitted[connection]
        connection.admitted = True
        self._admitted += 1
        self._poll(connection)
        return True

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
        for connections in (self._unadmitted, self._budget.holders):
            deadlines.extend(connection.deadline for connection in islice(connections, 1))
        return min(deadlines, default=None)

    def expire(self) -> None:
        """Close connections past their hello deadline and those whose large message is
        late; resume accepting when due."""
        now = self._clock()
        while self._unadmitted:
            connection = next(iter(self._unadmitted))
            if connection.deadline > now:
                break
            self._drop(connection, _Drop(DropReason.HANDSHAKE_TIMEOUT, "no hello in time"))
        while self._budget.holders:
            connection = next(iter(self._budget.holders))
            if connection.deadline > now:
                break
            if connection.pending and self._may_serve(connection):  # it waits for the server
                self._budget.renew(connection)
            else:
                self._drop(connection, _Drop(DropReason.MESSAGE_TIMEOUT, "message too slow"))
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
            if self._admitted >= self.limits.max_connections:
                self._report(DropReason.TOO_MANY_CONNECTIONS)
                sock.close()
                continue
            if len(self._unadmitted) >= self.limits.max_unauthenticated:
                oldest = next(iter(self._unadmitted))
                self._drop(oldest, _Drop(DropReason.UNAUTHENTICATED_EVICTED, "evicted"))
            self._open(sock)

    def _open(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = next(self._ids).to_bytes(8, "big")
        connection = _Connection(sock, peer, self._clock() + self.limits.hello_seconds)
        self._connections[peer] = connection
        self._by_fd[sock.fileno()] = connection
        self._unadmitted[connection] = None
        connection.outbox.append(_GREETING + _command_frame(_READY))
        connection.unsent = len(connection.outbox[0])
        self._flush(connection)

    def _may_serve(self, connection: _Connection) -> bool:
        if connection.state is _State.CLOSED:
            return True
        return connection.unsent < self._unsent_bound(connection)

    def _unsent_bound(self, connection: _Connection) -> int:
        """Unsent reply bytes past which a connection is neither served nor read."""
        bounds = self.bounds if connection.admitted else self.unauthenticated
        return bounds.max_bytes

    def _poll(self, connection: _Connection) -> None:
        """Register the connection for what it may do now: read while :meth:`_read_size`
        allows, write while it has unsent bytes."""
        if connection.state is _State.CLOSED or self._poller is None:
            return
        wanted = zmq.POLLOUT if connection.outbox else 0
        if self._read_size(connection):
            wanted |= zmq.POLLIN
        if wanted != connection.polled:
            self._poller.register(connection, wanted)  # 0 unregisters
            connection.polled = wanted

    def _read_size(self, connection: _Connection) -> int:
        """The most bytes a read of the connection may take now (0: not to be read): none
        while a message of it waits to be served or too many of its replies are unsent,
        else what its allowance leaves. An admitted one whose message outgrew its small
        allowance takes a share of the receive budget, or waits for one."""
        if connection.pending or connection.unsent >= self._unsent_bound(connection):
            return 0
        allowance = self._budget.allowance(connection)
        if connection.held >= allowance and connection.admitted:
            self._budget.ask(connection)
            allowance = self._budget.allowance(connection)
        most = LARGE_READ if connection.shared else READ_SIZE
        size = min(most, allowance - connection.held)
        if connection.big is not None:
            size = min(size, connection.big_size - len(connection.big))
        return max(size, 0)

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
        size = self._read_size(connection)
        if not size:
            self._poll(connection)  # registered before it lost its turn: unregister
            return
        try:
            received = connection.sock.recv_into(self._scratch, size)
        except BlockingIOError:
            return
        except OSError:
            received = 0
        if not received:
            # The peer closed its end (or reset it): serve the whole messages it sent
            # before; a message cut short goes with the connection.
            with contextlib.suppress(_Drop):
                self._reader.parse(connection, everything=True)
            self._close(connection)
            return
        try:
            with self._scratch[:received] as data:
                if connection.big is not None:
                    self._reader.gather(connection, data)
                else:
                    connection.inbox += data
            self._reader.parse(connection)
        except _Drop as drop:
            self._drop(connection, drop)
            return
        self._poll(connection)

    def _report(self, reason: DropReason) -> None:
        self._log.warning(f"ZMQ: closing connections that {_DROPPED[reason]} ({reason})")
        if self._on_drop is not None:
            self._on_drop(reason)

    def _drop(self, connection: _Connection, drop: _Drop) -> None:
        self._report(drop.reason)
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
        self._unadmitted.pop(connection, None)
        self._budget.waiters.pop(connection, None)
        if connection.admitted:
            self._admitted -= 1
        if connection.shared:
            self._budget.release(connection)
        connection.inbox.clear()
        connection.outbox.clear()
        connection.big, connection.frames, connection.unsent = None, [], 0
        if not connection.pending:
            self._waiting.pop(connection, None)


class _ReceiveBudget:
    """The receive budget's shares: which admitted connections hold one (and until when
    their message must have arrived), which wait for one, and what each connection's reads
    may hold (see the module's docstring)."""

    def __init__(
        self,
        bounds: MessageBounds,
        unauthenticated: MessageBounds,
        limits: ZmqLimits,
        clock: Callable[[], float],
        poll: Callable[[_Connection], None],
    ) -> None:
        """``poll``: registers a connection that just took a share for what it may do now."""
        self._unauthenticated_held = unauthenticated.max_bytes + 2 * SMALL_FRAME
        """Room for the largest unauthenticated message, a small frame, a frame's header."""
        self.share_size = bounds.max_bytes + READ_SIZE
        """A share holds the largest message and the start of the next."""
        self.shares = max(1, int(limits.receive_budget) // self.share_size)
        self._message_seconds = limits.message_seconds
        self._clock = clock
        self._poll = poll
        self.holders: dict[_Connection, None] = {}
        """Connections holding a share, first deadline first."""
        self.waiters: dict[_Connection, None] = {}
        """Connections waiting for a share, in turn."""

    def allowance(self, connection: _Connection) -> int:
        """The most bytes the connection's reads may hold now."""
        if connection.shared:
            return self.share_size
        return SMALL_HELD if connection.admitted else self._unauthenticated_held

    def ask(self, connection: _Connection) -> None:
        if connection.shared:
            return
        if len(self.holders) < self.shares and not self.waiters:
            self._take(connection)
        else:
            self.waiters[connection] = None

    def _take(self, connection: _Connection) -> None:
        connection.shared = True
        connection.deadline = self._clock() + self._message_seconds
        self.holders[connection] = None

    def renew(self, connection: _Connection) -> None:
        """A new deadline for the next message holding the connection's share."""
        del self.holders[connection]
        self._take(connection)

    def settle(self, connection: _Connection) -> None:
        """Once a connection's messages are served: its share goes back when its reads fit
        its small allowance again, else the next message holding it gets its full time."""
        if not connection.shared:
            return
        if connection.held > SMALL_HELD:
            self.renew(connection)
        else:
            self.release(connection)

    def release(self, connection: _Connection) -> None:
        connection.shared = False
        del self.holders[connection]
        while self.waiters and len(self.holders) < self.shares:
            waiter = next(iter(self.waiters))
            del self.waiters[waiter]
            self._take(waiter)
            self._poll(waiter)


class _FrameReader:
    """Turns the bytes read from a connection into its messages, within the bounds: the
    greeting and the handshake's commands, frames held whole or (big ones) gathered as they
    arrive, and before hello, messages over the unauthenticated bounds truncated. A
    connection with a whole message joins ``waiting``; a breach raises :class:`_Drop`."""

    def __init__(
        self,
        bounds: MessageBounds,
        unauthenticated: MessageBounds,
        log: RateLimitedLog,
        waiting: dict[_Connection, None],
    ) -> None:
        self.bounds = bounds
        self.unauthenticated = unauthenticated
        self._log = log
        self._waiting = waiting

    def gather(self, connection: _Connection, data: memoryview) -> None:
        """Add ``data`` to the big frame being read (a read takes no more than it lacks)."""
        assert connection.big is not None
        connection.big += data
        if len(connection.big) == connection.big_size:
            frame, more = memoryview(connection.big), connection.big_more
            connection.big = None
            self._frame(connection, frame, more)

    def parse(self, connection: _Connection, *, everything: bool = False) -> None:
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
        if connection.skip:
            return position + self._discard(connection, end - position)
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
            if size > MAX_COMMAND or connection.message_frames:
                raise _Drop(DropReason.PROTOCOL, "a command too large or inside a message")
            if end - start < size:
                return position
            self._command(connection, bytes(view[start : start + size]))
            return start + size
        if connection.state is not _State.OPEN:
            raise _Drop(DropReason.PROTOCOL, "a message before the handshake")
        bounds, more = self.bounds, bool(flags & _MORE)
        if connection.message_frames >= bounds.max_frames:
            raise _Drop(DropReason.TOO_MANY_FRAMES, f"over {bounds.max_frames} frames")
        if connection.message_bytes + size > bounds.max_bytes:
            raise _Drop(DropReason.MESSAGE_TOO_LARGE, f"over {bounds.max_bytes} bytes")
        here, keep = end - start, self._cut(connection, size)
        if keep is not None:  # before hello, over its bounds: hold the start, discard the rest
            if here < keep:
                return position
            self._truncate(connection, bytes(view[start : start + keep]), size - keep, more)
            return start + keep
        if here >= size:
            self._count(connection, size)
            self._frame(connection, bytes(view[start : start + size]), more)
            return start + size
        if size <= SMALL_FRAME:
            return position
        self._count(connection, size)
        connection.big = bytearray(view[start:end])
        connection.big_size, connection.big_more = size, more
        return end

    def _cut(self, connection: _Connection, size: int) -> int | None:
        """None if a frame of ``size`` bytes is held whole (always, once admitted); else
        the bytes of it held, what the unauthenticated bounds leave of its message."""
        if connection.admitted:
            return None
        bounds = self.unauthenticated
        if connection.truncated or connection.message_frames >= bounds.max_frames:
            return 0
        room = bounds.max_bytes - connection.frames_bytes
        return None if size <= room else room

    def _count(self, connection: _Connection, size: int) -> None:
        connection.message_frames += 1
        connection.message_bytes += size

    def _truncate(self, connection: _Connection, start: bytes, rest: int, more: bool) -> None:
        """Hold ``start`` of a frame as its message's last kept frame; discard its ``rest``
        (and the frames after it) as they arrive."""
        if not connection.truncated:
            self._log.warning(
                "ZMQ: read messages over the unauthenticated bound before hello without "
                "holding them, and answered them (a client whose connection was renewed "
                "sends one before its hello)"
            )
        self._count(connection, len(start) + rest)
        connection.truncated = True
        if start:
            connection.frames.append(start)
            connection.frames_bytes += len(start)
        connection.skip, connection.skip_more = rest, more
        if not rest:
            self._end_frame(connection, more)

    def _discard(self, connection: _Connection, here: int) -> int:
        """Discard what is ``here`` of the frame being skipped; the bytes discarded."""
        discarded = min(here, connection.skip)
        connection.skip -= discarded
        if not connection.skip:
            self._end_frame(connection, connection.skip_more)
        return discarded

    def _frame(self, connection: _Connection, frame: Frame, more: bool) -> None:
        connection.frames.append(frame)
        connection.frames_bytes += len(frame)
        self._end_frame(connection, more)

    def _end_frame(self, connection: _Connection, more: bool) -> None:
        if more:
            return
        frames = connection.frames
        connection.pending.append(Truncated(frames) if connection.truncated else frames)
        connection.pending_bytes += connection.frames_bytes
        connection.frames, connection.frames_bytes, connection.truncated = [], 0, False
        connection.message_frames, connection.message_bytes = 0, 0
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
        elif name == b"PING" and len(body) >= 2:  # ZMTP 3.1 heartbeats: answer with the context
            pong = b"\x04PONG" + body[2:18]
            connection.outbox.append(_command_frame(pong))
            connection.unsent += len(connection.outbox[-1])
        # any other command (PONG, ERROR, ...) asks nothing of a NULL-mechanism ROUTER


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
