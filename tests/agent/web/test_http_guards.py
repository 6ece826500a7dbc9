"""What one HTTP client may cost a real agent process: bodies, slow clients, idle sockets.

Requests go over plain sockets, so a test can send half a request, or only the head of
one, and see what the agent answers before the rest arrives.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool_agent.client import AgentClient
from kvpool_agent.testing.agent_process import ADMIN_TOKEN, AgentProcess
from tests.support.raw_http import closed_by_peer, connect, head, read_answer

from .body_memory import QUOTA_PATH, body_memory_growth

MAX_BODY = 4096
TIMEOUT_SECONDS = 1.0
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    process = AgentProcess(
        tmp_path_factory.mktemp("agent"),
        settings={
            "HTTP_LIMITS__MAX_BODY_BYTES": str(MAX_BODY),
            "HTTP_LIMITS__HEADER_TIMEOUT_SECONDS": str(TIMEOUT_SECONDS),
            "HTTP_LIMITS__BODY_TIMEOUT_SECONDS": str(TIMEOUT_SECONDS),
        },
    )
    process.start()
    yield process
    process.cleanup()


@pytest.mark.parametrize("token", [{}, ADMIN], ids=["no token", "admin token"])
def test_a_body_declared_too_large_is_refused_unread(
    agent: AgentProcess, token: dict[str, str]
) -> None:
    with connect(agent.http, timeout=5) as sock:
        sock.sendall(head("PUT", QUOTA_PATH, {**token, **JSON, "Content-Length": "400000000"}))
        answer = read_answer(sock)  # while not one byte of the body was sent
    assert answer.status == 413
    assert f"larger than {MAX_BODY} bytes" in answer.body.decode()


def test_a_chunked_body_is_cut_off_at_the_bound(agent: AgentProcess) -> None:
    chunk = b"x" * 1024
    with connect(agent.http, timeout=5) as sock:
        sock.sendall(head("PUT", QUOTA_PATH, {**ADMIN, **JSON, "Transfer-Encoding": "chunked"}))
        for _ in range(MAX_BODY // len(chunk) + 1):
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        answer = read_answer(sock)
    assert answer.status == 413


@pytest.mark.parametrize(
    ("token", "reason"),
    [
        ({}, "a bearer token is required"),
        ({"Authorization": "Bearer nope"}, "unknown bearer token"),
    ],
    ids=["no token", "unknown token"],
)
def test_a_body_without_a_valid_token_is_refused_unread(
    agent: AgentProcess, token: dict[str, str], reason: str
) -> None:
    with connect(agent.http, timeout=5) as sock:
        sock.sendall(head("PUT", QUOTA_PATH, {**token, **JSON, "Content-Length": str(MAX_BODY)}))
        answer = read_answer(sock)  # the body is never sent
    assert answer.status == 401
    assert reason in answer.body.decode()
    assert answer.headers["www-authenticate"].startswith("Bearer")


def test_a_valid_body_within_the_bounds_is_served(agent: AgentProcess) -> None:
    body = b'{"limit_bytes": 4096}'
    with connect(agent.http, timeout=5) as sock:
        sock.sendall(head("PUT", QUOTA_PATH, {**ADMIN, **JSON, "Content-Length": str(len(body))}))
        sock.sendall(body)
        answer = read_answer(sock)
    assert answer.status == 200, answer.body


def test_half_a_request_head_is_answered_408_and_closed(agent: AgentProcess) -> None:
    with connect(agent.http, timeout=10 * TIMEOUT_SECONDS) as sock:
        sock.sendall(head("GET", "/healthz", end=False))
        answer = read_answer(sock)
        assert answer.status == 408
        assert closed_by_peer(sock)


def test_half_a_body_is_answered_408_and_closed(agent: AgentProcess) -> None:
    with connect(agent.http, timeout=10 * TIMEOUT_SECONDS) as sock:
        sock.sendall(head("PUT", QUOTA_PATH, {**ADMIN, **JSON, "Content-Length": "100"}))
        sock.sendall(b'{"limit_bytes":')
        answer = read_answer(sock)
        assert answer.status == 408
        assert "request body not received" in answer.body.decode()
        assert closed_by_peer(sock)


def test_an_unauthenticated_400_mb_body_costs_no_memory(agent: AgentProcess) -> None:
    """Before the body gate: +1.2 GiB of peak RSS (the agent parsed the body, then said 401)."""
    answer, growth = body_memory_growth(agent, 400_000_000)
    assert answer.status == 413
    assert growth < 32 << 20, f"peak RSS grew by {growth / 2**20:.0f} MiB"


def test_idle_connections_leave_the_zmq_path_and_new_requests_working(tmp_path: Path) -> None:
    """600 idle sockets against a 400-descriptor process: without a bound the process runs
    out of descriptors, and neither a ZMQ client nor an HTTP request gets through."""
    agent = AgentProcess(
        tmp_path, settings={"HTTP_LIMITS__MAX_CONNECTIONS": "64"}, file_limit=400
    ).start()
    idle: list[socket.socket] = []
    try:
        for _ in range(600):
            idle.append(connect(agent.http))
        with AgentClient(agent.zmq, token=ADMIN_TOKEN, timeout=5) as client:
            assert client.ping()
        with connect(agent.http, timeout=5) as sock:
            sock.sendall(head("GET", "/healthz"))
            assert read_answer(sock).status == 200
        log = "".join(agent.log)
        assert log.count("closing the longest idle ones") == 1, log[-3000:]
        assert "Traceback" not in log and "out of system resource" not in log, log[-3000:]
    finally:
        for sock in idle:
            sock.close()
        agent.cleanup()
