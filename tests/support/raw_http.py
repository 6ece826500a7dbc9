"""HTTP/1.1 over a plain socket, for tests that send half a request or hold connections."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
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


def send_endless_head(url: str, size: int) -> Answer | None:
    """Send a request head whose last header never ends, up to ``size`` bytes of it; the
    server's answer, or None if it closed the connection without one."""
    with connect(url, timeout=30) as sock:
        block = b"a" * (64 << 10)
        try:
            sock.sendall(head("GET", "/healthz", end=False) + b"X-Endless: ")
            for _ in range(size // len(block)):
                sock.sendall(block)
        except OSError:  # the server closed the connection: it wants no more
            pass
        try:
            return read_answer(sock)
        except OSError:
            return None


@dataclass(frozen=True)
class Flood:
    answers: list[Answer | None]
    """What each flooding connection got (None: closed without an answer)."""
    slowest: float
    """The slowest ``GET /healthz`` of another client meanwhile, in seconds."""


def head_flood(url: str, connections: int, size: int) -> Flood:
    """``connections`` clients each send an endless head of ``size`` bytes, while another
    client asks ``/healthz`` on fresh connections until they are done."""
    answers: list[Answer | None] = []
    floods = [
        threading.Thread(target=lambda: answers.append(send_endless_head(url, size)))
        for _ in range(connections)
    ]
    for flood in floods:
        flood.start()
    slowest = 0.0
    while any(flood.is_alive() for flood in floods):
        started = time.perf_counter()
        with connect(url, timeout=30) as sock:
            sock.sendall(head("GET", "/healthz"))
            assert read_answer(sock).status == 200
        slowest = max(slowest, time.perf_counter() - started)
        time.sleep(0.02)
    for flood in floods:
        flood.join()
    return Flood(answers, slowest)


def kept_alive_seconds(url: str, path: str, headers: dict[str, str], body: bytes = b"") -> float:
    """The median time of a request on a connection kept alive after an earlier one."""
    method = "POST" if body else "GET"
    request = head(method, path, {**headers, "Content-Length": str(len(body))}) + body
    times = []
    with connect(url, timeout=10) as sock:
        for number in range(8):
            started = time.perf_counter()
            sock.sendall(request)
            answer = read_answer(sock)
            assert answer.status == 200, answer
            if number:  # the first opens the connection
                times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def unread_responses(url: str, path: str = "/openapi.json") -> socket.socket:
    """A connection that pipelines ``GET path`` and reads no answer, until the server stops
    taking its requests (its responses fill every buffer between the two) or drops the
    connection; the socket."""
    parts = urlsplit(url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window
    sock.connect((parts.hostname, parts.port))
    sock.settimeout(0.5)
    requests = head("GET", path) * 64
    try:
        while True:
            sock.sendall(requests)
    except TimeoutError:  # nothing taken for half a second: the server is stuck on this one
        return sock
    except ConnectionError:  # the server gave up on it already
        return sock


@contextlib.contextmanager
def half_heads(url: str, connections: int) -> Iterator[None]:
    """``connections`` connections, each with half a request head sent and no more, open
    while the block runs (clients that never authenticate, holding slots)."""
    opened: list[socket.socket] = []
    try:
        for _ in range(connections):
            opened.append(connect(url, timeout=5))
            opened[-1].sendall(head("GET", "/healthz", end=False))
        yield
    finally:
        for sock in opened:
            sock.close()
