"""HTTP/1.1 over a plain socket, for tests that send half a request or hold connections."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from urllib.parse import urlsplit


@dataclass(frozen=True)
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes


def connect(url: str, timeout: float = 10.0) -> socket.socket:
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    return socket.create_connection((parts.hostname, parts.port), timeout=timeout)


def head(
    method: str, path: str, headers: dict[str, str] | None = None, *, end: bool = True
) -> bytes:
    """A request head; ``end=False`` leaves out the blank line that completes it."""
    lines = [
        f"{method} {path} HTTP/1.1",
        "Host: test",
        *(f"{k}: {v}" for k, v in (headers or {}).items()),
    ]
    return ("\r\n".join(lines) + "\r\n" + ("\r\n" if end else "")).encode()


def read_answer(sock: socket.socket) -> Answer:
    """One response (with a Content-Length body); raises TimeoutError past the socket's timeout."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a whole response head: {data!r}")
        data += chunk
    raw_head, body = data.split(b"\r\n\r\n", 1)
    status_line, *header_lines = raw_head.decode("latin-1").split("\r\n")
    headers = {}
    for line in header_lines:
        name, value = line.split(":", 1)
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return Answer(int(status_line.split()[1]), headers, body[:length])


def closed_by_peer(sock: socket.socket) -> bool:
    """True once the peer has closed (EOF or reset), False if the socket's timeout passed."""
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True
    return True
