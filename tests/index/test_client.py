"""IndexClient's failure handling against scripted HTTP servers on 127.0.0.1."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterator

import pytest

from kvpool.index.client import IndexClient, IndexRequestError, IndexUnavailable

ROUTE = {
    "node": "n1",
    "reason": "longest_match",
    "matched_tokens": 32,
    "prompt_tokens": 40,
    "matches": [],
}


def answer(status: int, body: bytes, *, close: bool = False) -> bytes:
    headers = (
        f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    )
    return (headers + ("Connection: close\r\n" if close else "") + "\r\n").encode() + body


def read_request(connection: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        data += connection.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(
        next(
            line.split(b":")[1]
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        )
    )
    while len(body) < length:
        body += connection.recv(65536)
    return body


Script = Callable[[socket.socket], None]


@pytest.fixture
def server() -> Iterator[Callable[[Script], str]]:
    """``server(script)``: a URL whose every accepted connection runs ``script``."""
    listeners: list[socket.socket] = []

    def serve(script: Script) -> str:
        listener = socket.create_server(("127.0.0.1", 0))
        listeners.append(listener)

        def accept() -> None:
            while True:
                try:
                    connection, _ = listener.accept()
                except OSError:
                    return
                with connection:
                    script(connection)

        threading.Thread(target=accept, daemon=True).start()
        return f"http://127.0.0.1:{listener.getsockname()[1]}"

    yield serve
    for listener in listeners:
        listener.close()


def test_a_connection_closed_while_idle_is_reopened_once(server: Callable[[Script], str]) -> None:
    bodies: list[bytes] = []

    def one_answer_per_connection(connection: socket.socket) -> None:
        bodies.append(read_request(connection))
        connection.sendall(answer(200, json.dumps(ROUTE).encode()))  # keep-alive, then gone

    with IndexClient(server(one_answer_per_connection), "token") as client:
        for _ in range(3):
            route = client.route(loads={"n1": 0}, chunk_keys=[b"\x01" * 32], chunk_tokens=8)
            assert (route.node, route.matched_tokens) == ("n1", 32)
    assert [json.loads(body) for body in bodies] == [
        {"chunk_keys": ["01" * 32], "chunk_tokens": 8, "loads": {"n1": 0}}
    ] * 3


def test_refusals_carry_status_and_detail(server: Callable[[Script], str]) -> None:
    def refuse(connection: socket.socket) -> None:
        body = read_request(connection)
        if b"plain" in body:
            connection.sendall(answer(502, b"bad gateway", close=True))
        else:
            connection.sendall(answer(401, b'{"detail": "unknown bearer token"}', close=True))

    with IndexClient(server(refuse), "token") as client:
        with pytest.raises(IndexRequestError) as refused:
            client.lookup(chunk_keys=[b"\x00" * 32], chunk_tokens=4)
        assert (refused.value.status, refused.value.detail) == (401, "unknown bearer token")
        with pytest.raises(IndexRequestError, match="502: bad gateway"):
            client.lookup(token_ids=[1], cache_salt="plain")


def test_a_silent_or_absent_index_is_unavailable(server: Callable[[Script], str]) -> None:
    def silent(connection: socket.socket) -> None:
        read_request(connection)
        connection.recv(1)  # never answers; returns when the client gives up

    with (
        IndexClient(server(silent), "token", timeout=0.2) as client,
        pytest.raises(IndexUnavailable, match=r"within 0\.2s"),
    ):
        client.route(loads={"n": 0}, token_ids=[1, 2])
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    with (
        IndexClient(f"http://127.0.0.1:{closed_port}", "t") as client,
        pytest.raises(IndexUnavailable, match="cannot reach"),
    ):
        client.lookup(token_ids=[1])
    with pytest.raises(ValueError, match="http"):
        IndexClient("tcp://127.0.0.1:1", "t")
