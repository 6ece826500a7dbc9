"""The index process has the agent's HTTP guards (one implementation: kvpool_agent.http_*)."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from tests.support.index_process import GATEWAY_TOKEN, TENANT_TOKEN, IndexProcess
from tests.support.raw_http import closed_by_peer, connect, head, read_answer

MAX_BODY = 4096
HEADER_TIMEOUT = 1.0
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> Iterator[IndexProcess]:
    nowhere = SimpleNamespace(zmq="tcp://127.0.0.1:9", events="tcp://127.0.0.1:9")
    process = IndexProcess(
        tmp_path_factory.mktemp("index"),
        {"gpu-1": nowhere},
        {
            "HTTP_LIMITS__MAX_BODY_BYTES": str(MAX_BODY),
            "HTTP_LIMITS__HEADER_TIMEOUT_SECONDS": str(HEADER_TIMEOUT),
        },
    )
    yield process
    process.process.kill()
    process.process.wait()


@pytest.mark.parametrize(
    ("token", "size", "code"),
    [
        ({}, 400_000_000, 413),
        ({"Authorization": f"Bearer {GATEWAY_TOKEN}"}, 400_000_000, 413),
        ({}, MAX_BODY, 401),
        ({"Authorization": f"Bearer {TENANT_TOKEN}"}, MAX_BODY, 403),
    ],
    ids=["too large, no token", "too large, gateway", "no token", "tenant token"],
)
def test_a_route_body_is_judged_before_it_is_read(
    index: IndexProcess, token: dict[str, str], size: int, code: int
) -> None:
    with connect(index.url, timeout=5) as sock:
        sock.sendall(head("POST", "/v1/route", {**token, **JSON, "Content-Length": str(size)}))
        assert read_answer(sock).status == code  # not one byte of the body was sent


def test_half_a_request_head_is_answered_408_and_closed(index: IndexProcess) -> None:
    with connect(index.url, timeout=10 * HEADER_TIMEOUT) as sock:
        sock.sendall(head("GET", "/healthz", end=False))
        assert read_answer(sock).status == 408
        assert closed_by_peer(sock)


def test_a_gateway_route_within_the_bounds_is_served(index: IndexProcess) -> None:
    body = b'{"loads": {"gpu-1": 0}, "chunk_keys": []}'
    headers = {"Authorization": f"Bearer {GATEWAY_TOKEN}", **JSON}
    with connect(index.url, timeout=5) as sock:
        sock.sendall(head("POST", "/v1/route", {**headers, "Content-Length": str(len(body))}))
        sock.sendall(body)
        answer = read_answer(sock)
    assert answer.status == 200, answer.body
