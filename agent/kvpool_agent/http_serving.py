"""Serve an ASGI app with uvicorn inside a process that owns its own signal handling."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Iterator

import uvicorn


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: the process owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@contextlib.asynccontextmanager
async def serve_http(app: object, host: str, port: int) -> AsyncIterator[str]:
    """Serve ``app`` on ``host:port`` (0: a free port) on this loop; yields the base URL.

    The socket is bound before serving starts, so the URL is known at once and a port in
    use is an error here rather than a log line later.
    """
    listener = socket.create_server((host, port))
    bound_host, bound_port = listener.getsockname()[:2]
    server = _EmbeddedUvicorn(
        uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")  # type: ignore[arg-type]
    )
    task = asyncio.create_task(server.serve(sockets=[listener]), name="http")
    try:
        yield f"http://{bound_host}:{bound_port}"
    finally:
        server.should_exit = True
        await task
        listener.close()
