"""The index process has the agent's HTTP guards (one implementation: kvpool.http_*)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.support.index_process import GATEWAY_TOKEN, TENANT_TOKEN, IndexProcess
from tests.support.metrics import memory_bytes, sample
from tests.support.raw_http import (
    closed_by_peer,
    connect,
    half_heads,
    head,
    head_flood,
    kept_alive_seconds,
    read_answer,
)

pytestmark = pytest.mark.process

MAX_BODY = 4096
HEADER_TIMEOUT = 1.0
JSON = {"Content-Type": "application/json"}
HEAD_MEMORY_BOUND = 16 << 20
"""Peak RSS growth allowed while 16 connections send endless heads (before: +413 MiB for 8
connections of 32 MiB each)."""
HEALTH_BOUND = 1.0
KEPT_ALIVE_BOUND = 0.010
"""A request on a kept-alive connection (before TCP_NODELAY: /v1/route took 44 ms)."""


def _running(directory: Path, settings: dict[str, str]) -> Iterator[IndexProcess]:
    """An index of one node whose agent is nowhere, with these settings."""
    nowhere = SimpleNamespace(zmq="tcp://127.0.0.1:9", events="tcp://127.0.0.1:9")
    process = IndexProcess(directory, {"gpu-1": nowhere}, settings)
    yield process
    process.process.kill()
    process.process.wait()


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> Iterator[IndexProcess]:
    yield from _running(
        tmp_path_factory.mktemp("index"),
        {
            "HTTP_LIMITS__MAX_BODY_BYTES": str(MAX_BODY),
            "HTTP_LIMITS__HEADER_TIMEOUT_SECONDS": str(HEADER_TIMEOUT),
        },
    )


FEW_CONNECTIONS = 4


@pytest.fixture(scope="module")
def crowded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[IndexProcess]:
    """An index of few connections, whose timeouts do not free them during a test."""
    yield from _running(
        tmp_path_factory.mktemp("crowded"),
        {
            "HTTP_LIMITS__MAX_CONNECTIONS": str(FEW_CONNECTIONS),
            "HTTP_LIMITS__HEADER_TIMEOUT_SECONDS": "60",
        },
    )


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


def test_endless_request_heads_are_answered_431_at_the_bound(index: IndexProcess) -> None:
    counter = 'kvpool_index_http_refused_total{reason="head_too_large"}'
    before, counted = memory_bytes(index.process.pid, "VmHWM"), sample(index.url, counter)
    flood = head_flood(index.url, connections=16, size=4 << 20)
    grown = memory_bytes(index.process.pid, "VmHWM") - before
    statuses = [answer.status if answer else None for answer in flood.answers]
    assert set(statuses) <= {431, None} and statuses.count(431) >= 8, statuses
    assert grown < HEAD_MEMORY_BOUND, f"peak RSS grew by {grown / 2**20:.0f} MiB"
    assert flood.slowest < HEALTH_BOUND, f"/healthz took {flood.slowest:.2f} s"
    assert sample(index.url, counter) == counted + 16


def test_a_kept_alive_gateway_connection_answers_at_once(index: IndexProcess) -> None:
    body = b'{"loads": {"gpu-1": 0}, "chunk_keys": []}'
    gateway = {"Authorization": f"Bearer {GATEWAY_TOKEN}", **JSON}
    for path, headers, payload in (("/healthz", {}, b""), ("/v1/route", gateway, body)):
        seconds = kept_alive_seconds(index.url, path, headers, payload)
        assert seconds < KEPT_ALIVE_BOUND, f"{path}: {seconds * 1000:.1f} ms"


def test_unauthenticated_connections_leave_a_gateway_connection_open(
    crowded: IndexProcess,
) -> None:
    """Before: at the bound the longest idle connection was closed, whoever held it, so
    connections sending half a head closed a gateway's kept-alive one."""
    body = b'{"loads": {"gpu-1": 0}, "chunk_keys": []}'
    gateway = {"Authorization": f"Bearer {GATEWAY_TOKEN}", **JSON}
    route = head("POST", "/v1/route", {**gateway, "Content-Length": str(len(body))}) + body
    with connect(crowded.url, timeout=5) as kept:
        kept.sendall(route)
        assert read_answer(kept).status == 200
        with half_heads(crowded.url, 3 * FEW_CONNECTIONS):
            kept.sendall(route)
            assert read_answer(kept).status == 200
