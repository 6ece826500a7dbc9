"""Connection guards of an HTTP server: a bound on open connections, a deadline per request head.

uvicorn arms its keep-alive timer only after a response and cancels it on the next
byte, so a client that connects and sends nothing, or half a request head, holds its
socket for ever; its ``limit_concurrency`` answers 503 once a head is in but never
closes a socket. Enough idle sockets use up the process's file descriptors, and then
the ZMQ data path of the same process cannot accept clients either.

:class:`ConnectionGate` wraps each connection's uvicorn protocol in a
:class:`GuardedConnection`, which

- is admitted only while fewer than ``max_connections`` are open; at the bound the
  connection idle longest (waiting for a request head) is closed to make room, as
  nginx reuses keep-alive connections, and if none is idle the new one gets 503;
- gets ``header_timeout`` to send a whole request head after it opens or after its
  last response, else a 408 and the close.

A request's progress reaches its connection through the ASGI scope: the gate hands
each connection's protocol its own copy of the lifespan state holding the connection
(uvicorn copies that state into every request's ``scope["state"]``), and
:class:`RequestTracker`, the outermost middleware, reports when a request begins and
when its response ends. Refusals and timeouts are logged through a
:class:`~kvpool_agent.web.rate_limited_log.RateLimitedLog`, not once per connection.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvpool_agent.web.rate_limited_log import RateLimitedLog

CONNECTION_KEY = "kvpool.connection"
"""Where a request's :class:`GuardedConnection` is in ``scope["state"]``."""

ProtocolFactory = Callable[..., asyncio.Protocol]


def _canned(status: str, detail: str) -> bytes:
    """A complete response written straight to a socket that no request is using."""
    body = json.dumps({"detail": detail}).encode()
    head = (
        f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class ConnectionGate:
    def __init__(self, *, max_connections: int, header_timeout: float, log: RateLimitedLog) -> None:
        self.max_connections = max_connections
        self.header_timeout = header_timeout
        self._log = log
        self._open: set[GuardedConnection] = set()
        self._idle: OrderedDict[GuardedConnection, None] = OrderedDict()
        self._timed_out = _canned(
            "408 Request Timeout", f"no complete request head within {header_timeout:g} s"
        )
        self._refused = _canned(
            "503 Service Unavailable",
            f"{max_connections} HTTP connections are open and busy; try again",
        )

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
            if not self._idle:
                self._log.warning(
                    f"HTTP: {self.max_connections} connections open and none idle: "
                    "refusing new ones with 503 (http_limits.max_connections)"
                )
                return False
            victim, _ = self._idle.popitem(last=False)
            self._open.discard(victim)
            victim.close()
            self._log.warning(
                f"HTTP: {self.max_connections} connections open: closing the longest idle "
                "ones to admit new ones (http_limits.max_connections)"
            )
        self._open.add(connection)
        return True

    def _release(self, connection: GuardedConnection) -> None:
        self._open.discard(connection)
        self._idle.pop(connection, None)

    def _set_idle(self, connection: GuardedConnection, idle: bool) -> None:
        if not idle:
            self._idle.pop(connection, None)
        elif connection in self._open:
            self._idle[connection] = None
            self._idle.move_to_end(connection)

    def _timed_out_head(self, connection: GuardedConnection) -> None:
        self._log.warning(
            f"HTTP: closing connections that sent no complete request head within "
            f"{self.header_timeout:g} s (http_limits.header_timeout_seconds)"
        )
        connection.close(self._timed_out)


class GuardedConnection(asyncio.Protocol):
    """One HTTP connection: uvicorn's protocol (``inner``) behind the gate's checks."""

    inner: asyncio.Protocol

    def __init__(self, gate: ConnectionGate) -> None:
        self._gate = gate
        self._transport: asyncio.Transport | None = None
        self._admitted = False
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
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
        if self._admitted:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self._admitted:
            self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        if self._admitted:
            self._gate._release(self)
            self.inner.connection_lost(exc)

    def request_started(self) -> None:
        """A request head is in: the head deadline no longer applies."""
        self._cancel_timer()
        self._gate._set_idle(self, False)

    def awaiting_request(self) -> None:
        """Idle until the next request head, which must come within the header timeout."""
        self._cancel_timer()
        self._gate._set_idle(self, True)
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self._gate.header_timeout, self._gate._timed_out_head, self)

    def close(self, last_words: bytes = b"") -> None:
        if self._transport is not None and not self._transport.is_closing():
            if last_words:
                self._transport.write(last_words)
            self._transport.close()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


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
