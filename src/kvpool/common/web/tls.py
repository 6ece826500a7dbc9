"""TLS in front of an HTTP server's connections, with the handshake bounded.

asyncio's own TLS (``create_server(ssl=...)``, what uvicorn uses) gives a client 60 s to
finish its handshake, out of sight of the connection gate (:mod:`kvpool.common.web.connections`
sees a connection only once TLS is up), and keeps a 256 KiB read buffer for each
connection from its accept on: a client that opens connections and sends nothing costs the
server a quarter of a MiB each for a minute, as many as the file limit allows.

:class:`TlsAcceptor` wraps each accepted connection in TLS itself (asyncio's TLS protocol,
:class:`asyncio.sslproto.SSLProtocol`, around the server's protocol), and

- gives the handshake ``handshake_timeout`` seconds, then aborts the connection;
- lets at most ``max_handshakes`` connections be in their handshake at once: at the bound
  the one in its handshake longest is aborted for the new one (a real client finishes its
  handshake in a round trip or two, so it is never the oldest for long);
- reads the socket into a buffer of :data:`READ_BUFFER_BYTES` (a TLS record), not 256 KiB;
- takes the certificate from ``context()`` at each accept, so a renewed certificate is
  served from the next connection on, without a restart.

Once the handshake is done, the server's protocol (the gate's) has the connection.
"""

from __future__ import annotations

import asyncio
import ssl
from asyncio import sslproto
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from kvpool.common.web.rate_limited_log import RateLimitedLog

ProtocolFactory = Callable[..., asyncio.BaseProtocol]

READ_BUFFER_BYTES = 16 << 10
"""The socket is read in chunks of this many bytes: the largest TLS record's payload."""


class TlsAcceptor:
    def __init__(
        self,
        context: Callable[[], ssl.SSLContext],
        *,
        handshake_timeout: float,
        max_handshakes: int,
        log: RateLimitedLog,
    ) -> None:
        self.context = context
        self.handshake_timeout = handshake_timeout
        self.max_handshakes = max_handshakes
        self._log = log
        self._handshaking: OrderedDict[_TlsConnection, asyncio.TimerHandle] = OrderedDict()
        """Connections in their handshake, the oldest first, and their deadlines."""

    def protocol_factory(self, inner: ProtocolFactory) -> ProtocolFactory:
        """What the server calls per accepted connection instead of ``inner``: TLS around it."""

        def create(**arguments: Any) -> asyncio.BaseProtocol:
            return _TlsConnection(self, inner(**arguments))

        return create

    def close(self) -> None:
        """Abort every connection still in its handshake (the server stops)."""
        while self._handshaking:
            connection, deadline = self._handshaking.popitem(last=False)
            deadline.cancel()
            connection.abort()

    def _admit(self, connection: _TlsConnection) -> None:
        if len(self._handshaking) >= self.max_handshakes:
            oldest, deadline = self._handshaking.popitem(last=False)
            deadline.cancel()
            oldest.abort()
            self._log.warning(
                f"TLS: {self.max_handshakes} connections in their handshake: aborting the "
                "oldest for each new one"
            )
        loop = asyncio.get_running_loop()
        self._handshaking[connection] = loop.call_later(
            self.handshake_timeout, self._timed_out, connection
        )

    def _timed_out(self, connection: _TlsConnection) -> None:
        self._handshaking.pop(connection, None)
        connection.abort()
        self._log.warning(
            f"TLS: aborting connections that did not finish their handshake within "
            f"{self.handshake_timeout:g} s"
        )

    def _handshake_over(self, connection: _TlsConnection) -> None:
        deadline = self._handshaking.pop(connection, None)
        if deadline is not None:
            deadline.cancel()


class _TlsConnection(sslproto.SSLProtocol):
    """asyncio's server-side TLS of one connection, which tells ``acceptor`` when its
    handshake begins and ends (however it ends: done, failed, timed out, connection lost)."""

    max_size = READ_BUFFER_BYTES

    def __init__(self, acceptor: TlsAcceptor, app_protocol: asyncio.BaseProtocol) -> None:
        loop = asyncio.get_running_loop()
        handshake: asyncio.Future[None] = loop.create_future()
        super().__init__(loop, app_protocol, acceptor.context(), handshake, server_side=True)
        self._acceptor = acceptor
        handshake.add_done_callback(self._handshake_over)
        self._socket: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._socket = transport
        self._acceptor._admit(self)
        super().connection_made(transport)

    def _handshake_over(self, outcome: asyncio.Future[None]) -> None:
        if not outcome.cancelled():
            outcome.exception()  # retrieved: a failed handshake is no error of the server's
        self._acceptor._handshake_over(self)

    def abort(self) -> None:
        if self._socket is not None:
            self._socket.abort()
