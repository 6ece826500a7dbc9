"""Serve an ASGI app with uvicorn inside a process that owns its own signal handling.

The server is guarded against clients that hold connections or descriptors, send
endless request heads, or leave their responses unread (:mod:`kvpool.common.web.connections`,
which also sets TCP_NODELAY), and over TLS against clients that hold handshakes
(:mod:`kvpool.common.web.tls`): request bodies are the app's business
(:class:`kvpool.common.web.body_gate.BodyGate`, which needs the app's tokens).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import socket
import ssl
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import uvicorn

from kvpool.common.config import HttpLimits
from kvpool.common.web.connections import (
    BoundedH11Protocol,
    ConnectionGate,
    HttpRefusals,
    RequestTracker,
)
from kvpool.common.web.rate_limited_log import RateLimitedLog
from kvpool.common.web.tls import TlsAcceptor

log = logging.getLogger(__name__)

RESERVED_DESCRIPTORS = 256
"""File descriptors kept from HTTP connections for the rest of the process (ZMQ, files)."""

_ACCEPT_EXHAUSTED = "socket.accept() out of system resource"
"""How asyncio's loop reports an accept() that failed for want of descriptors."""


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: the process owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@contextlib.asynccontextmanager
async def serve_http(
    app: Any,
    host: str,
    port: int,
    limits: HttpLimits | None = None,
    refusals: HttpRefusals | None = None,
    *,
    listener: socket.socket | None = None,
    tls: Callable[[], ssl.SSLContext] | None = None,
) -> AsyncIterator[str]:
    """Serve ``app`` on ``host:port`` (0: a free port), or on ``listener`` (:func:`listen`,
    bound beforehand), on this loop; yields the base URL.

    The socket is bound before serving starts, so the URL is known at once and a port in
    use is an error here rather than a log line later. What the connection gate refuses
    is counted in ``refusals``. With ``tls``, HTTPS: each connection's TLS context is
    ``tls()`` when it is accepted, its handshake bounded by the header timeout and the
    connection bound (:class:`~kvpool.common.web.tls.TlsAcceptor`).
    """
    limits = limits or HttpLimits()
    flood_log = RateLimitedLog(log)
    bound = connection_bound(limits.max_connections, copies=2 if tls is None else 3)
    gate = ConnectionGate(
        max_connections=bound,
        header_timeout=limits.header_timeout_seconds,
        send_timeout=limits.send_timeout_seconds,
        max_head_bytes=int(limits.max_head_bytes),
        max_header_count=limits.max_header_count,
        log=flood_log,
        refusals=refusals,
    )
    # h11, not httptools: h11 bounds an unfinished head (the gate's 431), httptools not
    protocol: Callable[..., asyncio.BaseProtocol] = gate.protocol_factory(BoundedH11Protocol)
    acceptor = None
    if tls is not None:
        acceptor = TlsAcceptor(
            tls,
            handshake_timeout=limits.header_timeout_seconds,
            max_handshakes=bound,
            log=flood_log,
        )
        protocol = acceptor.protocol_factory(protocol)
    if listener is None:
        listener = listen(host, port)
    bound_host, bound_port = listener.getsockname()[:2]
    config = uvicorn.Config(
        RequestTracker(app),
        http=protocol,  # type: ignore[arg-type]
        ws="none",
        # asyncio accepts up to `backlog` sockets at once before the gate sees any of them
        backlog=bound,
        log_level="warning",
        access_log=False,
        lifespan="off",
    )
    server = _EmbeddedUvicorn(config)
    with _quiet_accept_failures(flood_log):
        task = asyncio.create_task(server.serve(sockets=[listener]), name="http")
        try:
            yield f"{'http' if tls is None else 'https'}://{bound_host}:{bound_port}"
        finally:
            server.should_exit = True
            await task
            if acceptor is not None:
                acceptor.close()
            listener.close()


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port``, for :func:`serve_http`."""
    return socket.create_server((host, port))


def connection_bound(wanted: int, copies: int = 2) -> int:
    """``wanted``, or fewer if the descriptor limit would leave the process too few.

    The bound counts ``copies`` times: asyncio accepts up to a listen backlog (the bound,
    too) of sockets in one go before the gate can close any, and over TLS as many again
    may be in their handshake. Raises the soft limit to the hard one first (as the Go
    runtime does): the soft default of many hosts, 1024, is a relic of select().
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    if soft == resource.RLIM_INFINITY:
        return wanted
    bound = max(1, min(wanted, (soft - RESERVED_DESCRIPTORS) // copies))
    if bound < wanted:
        log.warning(
            "HTTP: at most %d connections, not %d: the file limit is %d, %d descriptors "
            "are kept for the rest of the process, and accept bursts (and TLS handshakes) "
            "may make the count %d times the bound",
            bound,
            wanted,
            soft,
            RESERVED_DESCRIPTORS,
            copies,
        )
    return bound


@contextlib.contextmanager
def _quiet_accept_failures(flood_log: RateLimitedLog) -> Iterator[None]:
    """One rate-limited line, not a traceback a second, while accept() lacks descriptors."""
    loop = asyncio.get_running_loop()
    previous = loop.get_exception_handler()

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if str(context.get("message", "")).startswith(_ACCEPT_EXHAUSTED):
            flood_log.warning(f"HTTP: {_ACCEPT_EXHAUSTED}: {context.get('exception')}")
        elif previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handle)
    try:
        yield
    finally:
        loop.set_exception_handler(previous)
