"""Connection guards of an HTTP server: open connections, a request head's time, size and fields.

uvicorn arms its keep-alive timer only after a response and cancels it on the next
byte, so a client that connects and sends nothing, or half a request head, holds its
socket for ever; its ``limit_concurrency`` answers 503 once a head is in but never
closes a socket. Enough idle sockets use up the process's file descriptors, and then
the ZMQ data path of the same process cannot accept clients either.

:class:`ConnectionGate` wraps each connection's uvicorn protocol in a
:class:`GuardedConnection`, which

- is admitted only while fewer than ``max_connections`` are open; at the bound one
  connection is closed to make room, as nginx reuses keep-alive connections: one that
  has not authenticated before one that has, idle (waiting for a request head) before
  busy, the longest in that state first, and never one busy with an authenticated
  client's request: if only those are open, the new one gets 503;
- gets ``header_timeout`` to send a whole request head after it opens or after its
  last response, else a 408 and the close;
- is aborted when it leaves its responses unread for ``send_timeout``: the server's
  write buffer stays full that long (a client that pipelines requests and never reads
  the answers would otherwise hold its slot, and the socket's buffers, for ever);
- may send a request head of at most ``max_head_bytes`` and ``max_header_count`` header
  fields, else a 431 and the close (a malformed head: 400 and the close);
- has ``TCP_NODELAY`` set: a socket made by ``socket.create_server`` has protocol 0, so
  asyncio does not set it, and a response written in two parts (head, body) then waited
  for the client's delayed ACK, 40 ms per request on a kept-alive connection.

Heads are parsed by h11 (:class:`BoundedH11Protocol`, uvicorn's h11 protocol with the
bounds): h11 buffers at most ``max_head_bytes`` of an unfinished head (its
``max_incomplete_event_size``), and pauses reading while a request is served, so a
pipelined head waits in the socket. httptools, uvicorn's other parser, has no bound at
all: 16 connections each sending 32 MiB of one unfinished header cost 825 MiB.

A request's progress reaches its connection through the ASGI scope: the gate hands
each connection's protocol its own copy of the lifespan state holding the connection
(uvicorn copies that state into every request's ``scope["state"]``), and
:class:`RequestTracker`, the outermost middleware, reports when a request begins and
when its response ends. A request whose bearer token the API accepts marks its connection
authenticated (:func:`trust`, which :class:`~kvpool.common.web.common.BearerAuth` calls); it
stays so for its life. Refusals and timeouts are logged through a
:class:`~kvpool.common.web.rate_limited_log.RateLimitedLog`, not once per connection, and
counted by reason in :class:`HttpRefusals` (the metrics read them).
"""

from __future__ import annotations

import asyncio
import enum
import json
import socket
from collections import Counter, OrderedDict
from collections.abc import Callable
from functools import partial
from typing import Any

import h11
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from kvpool.common.web.rate_limited_log import RateLimitedLog

CONNECTION_KEY = "kvpool.connection"
"""Where a request's :class:`GuardedConnection` is in ``scope["state"]``."""

ProtocolFactory = Callable[..., asyncio.Protocol]
_Queue = OrderedDict["GuardedConnection", None]


class Refusal(enum.StrEnum):
    """Why the gate answered a connection itself (a metric label)."""

    HEAD_TOO_LARGE = "head_too_large"
    """431: a request head over ``max_head_bytes``."""
    TOO_MANY_HEADERS = "too_many_headers"
    """431: a request head of over ``max_header_count`` header fields."""
    MALFORMED_HEAD = "malformed_head"
    """400: a request head (or chunked framing) that is not HTTP/1.1."""
    HEAD_TIMEOUT = "head_timeout"
    """408: no whole request head within ``header_timeout``."""
    CONNECTIONS_FULL = "connections_full"
    """503: ``max_connections`` open, all busy with authenticated clients' requests."""
    SEND_TIMEOUT = "send_timeout"
    """Aborted: responses left unread for ``send_timeout``."""


class HttpRefusals:
    """How often the gate refused what, by :class:`Refusal`; read at scrape time."""

    def __init__(self) -> None:
        self.counts: Counter[Refusal] = Counter({refusal: 0 for refusal in Refusal})

    def add(self, refusal: Refusal) -> None:
        self.counts[refusal] += 1


def _canned(status: str, detail: str) -> bytes:
    """A complete response written straight to a socket that no request is using."""
    body = json.dumps({"detail": detail}).encode()
    head = (
        f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class ConnectionGate:
    def __init__(
        self,
        *,
        max_connections: int,
        header_timeout: float,
        send_timeout: float,
        max_head_bytes: int,
        max_header_count: int,
        log: RateLimitedLog,
        refusals: HttpRefusals | None = None,
    ) -> None:
        self.max_connections = max_connections
        self.header_timeout = header_timeout
        self.send_timeout = send_timeout
        self.max_head_bytes = max_head_bytes
        self.max_header_count = max_header_count
        self.refusals = refusals or HttpRefusals()
        self._log = log
        self._open: set[GuardedConnection] = set()
        self._closable: tuple[_Queue, _Queue, _Queue] = (
            OrderedDict(),
            OrderedDict(),
            OrderedDict(),
        )
        """Who is closed first at the bound, oldest first: connections not authenticated
        and idle, then not authenticated and busy, then authenticated and idle."""
        self._timed_out = _canned(
            "408 Request Timeout", f"no complete request head within {header_timeout:g} s"
        )
        self._refused = _canned(
            "503 Service Unavailable",
            f"{max_connections} HTTP connections are busy with authenticated requests; try again",
        )
        self._answers = {
            Refusal.HEAD_TOO_LARGE: _canned(
                "431 Request Header Fields Too Large",
                f"request head larger than {max_head_bytes} bytes",
            ),
            Refusal.TOO_MANY_HEADERS: _canned(
                "431 Request Header Fields Too Large",
                f"more than {max_header_count} header fields",
            ),
            Refusal.MALFORMED_HEAD: _canned("400 Bad Request", "malformed HTTP request"),
        }

    def protocol_factory(self, inner: ProtocolFactory) -> ProtocolFactory:
        """What uvicorn calls per connection instead of ``inner`` (its protocol class)."""

        def create(*, app_state: dict[str, Any], **arguments: Any) -> asyncio.Protocol:
            connection = GuardedConnection(self)
            state = {**app_state, CONNECTION_KEY: connection}
            connection.inner = inner(app_state=state, **arguments)
            return connection

        return create

    def _admit(self, connection: GuardedConnection) -> bool:
        if len(self._open) >= self.max_connections:
            queue = next((queue for queue in self._closable if queue), None)
            if queue is None:
                self.refusals.add(Refusal.CONNECTIONS_FULL)
                self._log.warning(
                    f"HTTP: {self.max_connections} connections open, all busy with "
                    "authenticated requests: refusing new ones with 503 "
                    "(http_limits.max_connections)"
                )
                return False
            victim, _ = queue.popitem(last=False)
            self._release(victim)
            victim.abort()
            self._log.warning(
                f"HTTP: {self.max_connections} connections open: closing one for each new one "
                "(not authenticated before authenticated, idle before busy, oldest first; "
                "http_limits.max_connections)"
            )
        self._open.add(connection)
        return True

    def _release(self, connection: GuardedConnection) -> None:
        self._open.discard(connection)
        for queue in self._closable:
            queue.pop(connection, None)

    def _refile(self, connection: GuardedConnection) -> None:
        """Put an open connection in the queue of its state (or none: busy, authenticated)."""
        if connection not in self._open:
            return
        for queue in self._closable:
            queue.pop(connection, None)
        untrusted_idle, untrusted_busy, trusted_idle = self._closable
        if not connection.trusted:
            (untrusted_busy if connection.busy else untrusted_idle)[connection] = None
        elif not connection.busy:
            trusted_idle[connection] = None

    def _timed_out_send(self, connection: GuardedConnection) -> None:
        self.refusals.add(Refusal.SEND_TIMEOUT)
        self._log.warning(
            f"HTTP: aborting connections that left their responses unread for "
            f"{self.send_timeout:g} s (http_limits.send_timeout_seconds)"
        )
        connection.abort()

    def _timed_out_head(self, connection: GuardedConnection) -> None:
        self.refusals.add(Refusal.HEAD_TIMEOUT)
        self._log.warning(
            f"HTTP: closing connections that sent no complete request head within "
            f"{self.header_timeout:g} s (http_limits.header_timeout_seconds)"
        )
        connection.close(self._timed_out)

    def _refuse_head(self, refusal: Refusal) -> bytes:
        """Count and log a refused head; the answer to write before closing."""
        self.refusals.add(refusal)
        if refusal is Refusal.MALFORMED_HEAD:
            self._log.warning("HTTP: answering 400 to malformed requests and closing")
        else:
            self._log.warning(
                f"HTTP: answering 431 to request heads over {self.max_head_bytes} bytes or "
                f"{self.max_header_count} header fields and closing "
                "(http_limits.max_head_bytes, http_limits.max_header_count)"
            )
        return self._answers[refusal]


class GuardedConnection(asyncio.Protocol):
    """One HTTP connection: uvicorn's protocol (``inner``) behind the gate's checks."""

    inner: asyncio.Protocol

    def __init__(self, gate: ConnectionGate) -> None:
        self._gate = gate
        self._transport: asyncio.Transport | None = None
        self._admitted = False
        self._head_deadline = _Deadline(gate.header_timeout, partial(gate._timed_out_head, self))
        self._send_deadline = _Deadline(gate.send_timeout, partial(gate._timed_out_send, self))
        self.trusted = False
        """A request on it carried a bearer token the API accepts."""
        self.busy = False
        """A request head is in, its response not yet complete."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if not self._gate._admit(self):
            transport.write(self._gate._refused)
            transport.close()
            return
        self._admitted = True
        self.inner.connection_made(transport)
        self.awaiting_request()

    def data_received(self, data: bytes) -> None:
        if self._admitted:
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self._admitted else None

    def pause_writing(self) -> None:
        """The write buffer is full: the client must take some of it within the send timeout."""
        if self._admitted:
            self._send_deadline.arm()
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self._admitted:
            self._send_deadline.disarm()
            self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_deadline.disarm()
        self._send_deadline.disarm()
        if self._admitted:
            self._gate._release(self)
            self.inner.connection_lost(exc)

    def trust(self) -> None:
        """A request on it authenticated: close it only after every unauthenticated one."""
        self.trusted = True
        self._gate._refile(self)

    def request_started(self) -> None:
        """A request head is in: the head deadline no longer applies."""
        self._head_deadline.disarm()
        self.busy = True
        self._gate._refile(self)

    def awaiting_request(self) -> None:
        """Idle until the next request head, which must come within the header timeout."""
        self.busy = False
        self._gate._refile(self)
        if self._transport is not None and not self._transport.is_closing():
            self._head_deadline.arm()  # not for a connection closed meanwhile

    def close(self, last_words: bytes = b"") -> None:
        """Close after ``last_words`` and what is still buffered for the client."""
        if self._transport is not None and not self._transport.is_closing():
            if last_words:
                self._transport.write(last_words)
            self._transport.close()

    def abort(self) -> None:
        """Close now, dropping whatever the client has not taken."""
        if self._transport is not None:
            self._transport.abort()


class _Deadline:
    """A call ``seconds`` after :meth:`arm`, unless :meth:`disarm` comes first."""

    def __init__(self, seconds: float, expire: Callable[[], None]) -> None:
        self._seconds = seconds
        self._expire = expire
        self._handle: asyncio.TimerHandle | None = None

    def arm(self) -> None:
        self.disarm()
        self._handle = asyncio.get_running_loop().call_later(self._seconds, self._expire)

    def disarm(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


def trust(scope: Scope) -> None:
    """The request of ``scope`` authenticated: its connection (if the gate guards it) is
    closed at the bound only after every unauthenticated one."""
    connection = scope.get("state", {}).get(CONNECTION_KEY)
    if isinstance(connection, GuardedConnection):
        connection.trust()


class _BadHead(Exception):
    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal)
        self.refusal = refusal


class _BoundedH11(h11.Connection):
    """h11's server side, raising :class:`_BadHead` where h11 would raise its own error
    (which uvicorn answers 400 with a log line a connection), and for heads over the bounds
    that arrived whole (h11 bounds only a head still incomplete)."""

    def __init__(self, max_head_bytes: int, max_header_count: int) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=max_head_bytes)
        self._max_head_bytes = max_head_bytes
        self._max_header_count = max_header_count

    def next_event(self) -> Any:
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as error:
            too_large = error.error_status_hint == 431
            raise _BadHead(
                Refusal.HEAD_TOO_LARGE if too_large else Refusal.MALFORMED_HEAD
            ) from None
        if isinstance(event, h11.Request):
            if len(event.headers) > self._max_header_count:
                raise _BadHead(Refusal.TOO_MANY_HEADERS)
            size = len(event.method) + len(event.target) + 12  # " ", " HTTP/1.1\r\n"
            size += sum(len(name) + len(value) + 4 for name, value in event.headers.raw_items())
            if size > self._max_head_bytes:
                raise _BadHead(Refusal.HEAD_TOO_LARGE)
        return event


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the gate's head bounds (needs a :class:`GuardedConnection`
    in ``app_state``, as :meth:`ConnectionGate.protocol_factory` puts it there)."""

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._guarded: GuardedConnection = app_state[CONNECTION_KEY]
        gate = self._guarded._gate
        self.conn = _BoundedH11(gate.max_head_bytes, gate.max_header_count)

    def handle_events(self) -> None:
        try:
            super().handle_events()
        except _BadHead as bad:
            answer = self._guarded._gate._refuse_head(bad.refusal)
            in_flight = self.cycle is not None and not self.cycle.response_complete
            # a response under way gets no answer in its middle: the connection just ends
            self._guarded.close(b"" if in_flight else answer)


class RequestTracker:
    """ASGI middleware telling each request's connection when it begins and when it is answered."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        connection = scope.get("state", {}).get(CONNECTION_KEY)
        if scope["type"] != "http" or not isinstance(connection, GuardedConnection):
            await self.app(scope, receive, send)
            return
        connection.request_started()

        async def tracked_send(message: Message) -> None:
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                connection.awaiting_request()

        await self.app(scope, receive, tracked_send)
