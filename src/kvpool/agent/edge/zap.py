"""Who may connect to a ZMQ socket that carries no requests to check: ZMQ's PLAIN mechanism,
its password a bearer token of the pool, judged by the token authority.

The events feed is a PUB socket: a subscriber sends nothing after its handshake, so the
credential is checked there, once per connection, by a ZAP handler (ZeroMQ's RFC 27) that
this module runs in a thread of its own, on a ZMQ context of its own (a context has one
ZAP handler, and the agent's other sockets must not consult this one). A refused
subscriber's connection is closed during its handshake; it receives nothing.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection

import zmq

from kvpool.common.auth import Role, TokenAuthority
from kvpool.common.web.rate_limited_log import RateLimitedLog

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
"""Where libzmq sends authentication requests (RFC 27)."""
_POLL_MS = 100


class PlainAuthenticator:
    """Admits PLAIN connections whose password is a token of one of ``roles``."""

    def __init__(self, authority: TokenAuthority, roles: Collection[Role], domain: str) -> None:
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.domain = domain
        self._authority = authority
        self._roles = frozenset(roles)
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._refusals = RateLimitedLog(log)
        self._refusal = f"refused a connection to {domain}: no token of " + " or ".join(
            sorted(self._roles)
        )

    def protect(self, socket: zmq.Socket[bytes]) -> None:
        """Make ``socket`` (of :attr:`context`) a PLAIN server judged by this authenticator."""
        socket.setsockopt(zmq.PLAIN_SERVER, 1)
        socket.setsockopt(zmq.ZAP_DOMAIN, self.domain.encode())

    def start(self) -> None:
        handler: zmq.Socket[bytes] = self.context.socket(zmq.REP)
        handler.setsockopt(zmq.LINGER, 0)
        handler.bind(ZAP_ENDPOINT)
        self._thread = threading.Thread(
            target=self._serve, args=(handler,), name="kvpool-zap", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._stopping.set()
            self._thread.join()
            self._thread = None
        self.context.term()

    def _serve(self, handler: zmq.Socket[bytes]) -> None:
        try:
            while not self._stopping.is_set():
                if handler.poll(_POLL_MS):
                    handler.send_multipart(self._answer(handler.recv_multipart()))
        finally:
            handler.close()

    def _answer(self, request: list[bytes]) -> list[bytes]:
        """The ZAP reply to one request: version, request id, status, text, user, metadata."""
        if len(request) < 6:
            return [b"1.0", b"", b"500", b"malformed ZAP request", b"", b""]
        version, request_id, domain, _, _, mechanism, *credentials = request
        if (
            version == b"1.0"
            and domain == self.domain.encode()
            and mechanism == b"PLAIN"
            and len(credentials) == 2
        ):
            principal = self._authority.authenticate(credentials[1].decode(errors="replace"))
            if principal is not None and principal.role in self._roles:
                return [b"1.0", request_id, b"200", b"OK", str(principal).encode(), b""]
        self._refusals.warning(self._refusal)  # one line a minute for a flood
        return [b"1.0", request_id, b"400", b"no valid token", b"", b""]
