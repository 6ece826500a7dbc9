"""The index's HTTP API in process (FastAPI's test client): access, validation, answers."""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from kvpool.common.auth import TokenAuthority
from kvpool.common.index_config import Fingerprint
from kvpool.common.keys import chunk_keys, root_key, tenant_id
from kvpool.common.kube.discovery import AgentEndpoint
from kvpool.common.routing import RoutingPolicy
from kvpool.index.http_api import create_app
from kvpool.index.metrics import IndexMetrics
from kvpool.index.service import IndexService
from kvpool.index.subscriber import AgentStatus
from kvpool.index.tracker import PrefixTracker

GATEWAY = "gateway-token-Qw3"
ADMIN = "admin-token-Zx9"
TENANT = "tenant-token-Pk2"
FINGERPRINT = Fingerprint(model="m", dtype="bfloat16", kv_layout="NHD", chunk_tokens=4)
SALT = "s3cret-salt-of-alice"
TOKENS = list(range(18))  # four full chunks of four, and two tokens more


class Api:
    def __init__(self, default_fingerprint: Fingerprint | None = FINGERPRINT) -> None:
        self.ready = True
        self.tracker = PrefixTracker()
        self.agents = [
            AgentStatus(
                AgentEndpoint("n0", "tcp://127.0.0.1:1", "tcp://127.0.0.1:2"),
                "agent-0",
                7,
                True,
                True,
                7,
                {"connected": 1, "restart": 0, "gap": 0},
                0,
                None,
                0.25,
            )
        ]
        self.metrics = IndexMetrics(CollectorRegistry(), self.tracker, lambda: self.agents)
        self.service = IndexService(self.tracker, RoutingPolicy(), self.metrics)
        authority = TokenAuthority(
            {"admin": ADMIN, "gateways": [GATEWAY], "tenants": {tenant_id(SALT): TENANT}}
        )
        app = create_app(
            self.service,
            authority,
            lambda: self.agents,
            default_fingerprint=default_fingerprint,
            ready=lambda: self.ready,
            metrics=self.metrics.exposition,
        )
        self.http = TestClient(app)

    def post(self, path: str, body: dict[str, Any], token: str | None = GATEWAY) -> Any:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return self.http.post(path, json=body, headers=headers)


@pytest.fixture
def api() -> Iterator[Api]:
    api = Api()
    keys = chunk_keys(TOKENS, SALT, FINGERPRINT.fingerprint())
    api.tracker.stored("n0", keys)
    api.tracker.stored("n1", keys[:2])
    with api.http:
        yield api


def test_health_and_metrics_need_no_token(api: Api) -> None:
    assert api.http.get("/healthz").json() == {"status": "ok"}
    assert api.http.get("/readyz").json() == {"ready": True}
    api.ready = False
    assert api.http.get("/readyz").status_code == 503
    metrics = api.http.get("/metrics").text
    assert 'kvpool_index_chunks{node="n0"} 4.0' in metrics
    assert 'kvpool_index_resyncs_total{node="n0",reason="connected"} 1.0' in metrics
    assert 'kvpool_index_event_lag_seconds{node="n0"} 0.25' in metrics


@pytest.mark.parametrize(
    ("token", "status"),
    [(None, 401), ("nope", 401), (TENANT, 403), (GATEWAY, 200), (ADMIN, 200)],
)
def test_gateway_and_admin_tokens_may_ask(api: Api, token: str | None, status: int) -> None:
    answer = api.post("/v1/lookup", {"token_ids": TOKENS, "cache_salt": SALT}, token)
    assert answer.status_code == status
    nodes = api.http.get("/v1/nodes", headers={"Authorization": f"Bearer {token}"})
    assert nodes.status_code == status
    if status == 401:
        assert answer.headers["WWW-Authenticate"].startswith("Bearer")
    if status == 403:
        assert answer.json()["detail"] == (
            "tenant tokens cannot use this API (it takes gateway tokens, admin tokens)"
        )


def test_lookup_ranks_nodes_by_matched_tokens(api: Api) -> None:
    answer = api.post("/v1/lookup", {"token_ids": TOKENS, "cache_salt": SALT}).json()
    assert answer["prompt_tokens"] == 18 and answer["chunk_tokens"] == 4
    assert [(m["node"], m["chunks"], m["tokens"]) for m in answer["matches"]] == [
        ("n0", 4, 16),
        ("n1", 2, 8),
    ]
    only = api.post("/v1/lookup", {"token_ids": TOKENS, "cache_salt": SALT, "nodes": ["n1"]})
    assert [m["node"] for m in only.json()["matches"]] == ["n1"]
    keys = [k.hex() for k in chunk_keys(TOKENS, SALT, FINGERPRINT.fingerprint())]
    by_keys = api.post("/v1/lookup", {"chunk_keys": keys, "chunk_tokens": 4}).json()
    assert by_keys["matches"] == answer["matches"] and by_keys["prompt_tokens"] == 16


def test_a_query_without_the_right_salt_matches_nothing(api: Api) -> None:
    for salt in ("someone-else", None):
        answer = api.post("/v1/lookup", {"token_ids": TOKENS, "cache_salt": salt})
        assert answer.json()["matches"] == []
    other_model = FINGERPRINT.model_copy(update={"model": "another"}).model_dump()
    answer = api.post(
        "/v1/lookup", {"token_ids": TOKENS, "cache_salt": SALT, "fingerprint": other_model}
    )
    assert answer.json()["matches"] == []


def test_route_picks_a_candidate_within_the_load_bound(api: Api) -> None:
    body = {"token_ids": TOKENS, "cache_salt": SALT}
    route = api.post("/v1/route", {**body, "loads": {"n0": 2, "n1": 1, "n2": 1}}).json()
    assert (route["node"], route["reason"], route["matched_tokens"]) == ("n0", "longest_match", 16)
    assert [m["node"] for m in route["matches"]] == ["n0", "n1"]
    busy = api.post("/v1/route", {**body, "loads": {"n0": 9, "n1": 1, "n2": 0}}).json()
    assert (busy["node"], busy["reason"]) == ("n2", "overloaded")
    stranger = api.post("/v1/route", {"token_ids": TOKENS, "loads": {"n0": 0, "n1": 1}}).json()
    assert (stranger["node"], stranger["reason"]) == ("n0", "low_match")
    metrics = api.http.get("/metrics").text
    assert 'kvpool_index_route_decisions_total{reason="overloaded"} 1.0' in metrics
    assert 'kvpool_index_query_seconds_count{op="route"} 3.0' in metrics


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({}, "exactly one of token_ids and chunk_keys"),
        ({"token_ids": [1], "chunk_keys": ["00" * 32]}, "exactly one"),
        ({"chunk_keys": ["00" * 32], "cache_salt": "x"}, "salted already"),
        ({"chunk_keys": ["xyz"]}, "chunk_keys.0"),
        ({"token_ids": [-1]}, "token_ids.0"),
        ({"token_ids": [1], "unknown": 1}, "unknown"),
    ],
)
def test_malformed_queries_are_422_with_a_reason(
    api: Api, body: dict[str, Any], reason: str
) -> None:
    answer = api.post("/v1/lookup", body)
    assert answer.status_code == 422
    assert reason in answer.json()["detail"]


def test_route_needs_candidates(api: Api) -> None:
    answer = api.post("/v1/route", {"token_ids": TOKENS, "loads": {}})
    assert answer.status_code == 422 and "loads" in answer.json()["detail"]
    answer = api.post("/v1/route", {"token_ids": TOKENS, "loads": {"n0": -1}})
    assert answer.status_code == 422


def test_without_a_default_fingerprint_token_ids_need_one() -> None:
    api = Api(default_fingerprint=None)
    with api.http:
        answer = api.post("/v1/lookup", {"token_ids": TOKENS})
        assert answer.status_code == 422 and "fingerprint" in answer.json()["detail"]
        answer = api.post("/v1/lookup", {"chunk_keys": ["00" * 32]})
        assert answer.status_code == 422 and "chunk_tokens" in answer.json()["detail"]
        given = api.post(
            "/v1/lookup", {"token_ids": TOKENS, "fingerprint": FINGERPRINT.model_dump()}
        )
        assert given.status_code == 200


def test_nodes_reports_every_followed_agent(api: Api) -> None:
    nodes = api.http.get("/v1/nodes", headers={"Authorization": f"Bearer {ADMIN}"}).json()
    assert nodes == {
        "nodes": [
            {
                "node": "n0",
                "chunks": 4,
                "agent_id": "agent-0",
                "synced": True,
                "connected": True,
                "events": 7,
                "resyncs": {"connected": 1, "restart": 0, "gap": 0},
                "last_event_age_seconds": None,
                "event_lag_seconds": 0.25,
            }
        ]
    }


def _reachable(root: object) -> Iterator[object]:
    """Every object reachable from ``root`` through containers and instances (no modules,
    classes or functions: those lead to the whole interpreter)."""
    seen: set[int] = set()
    stack = [root]
    skip = (type, type(gc), type(_reachable), type(len))
    while stack:
        item = stack.pop()
        if id(item) in seen or isinstance(item, skip):
            continue
        seen.add(id(item))
        yield item
        stack.extend(gc.get_referents(item))


def test_the_index_keeps_no_salt_and_logs_none(api: Api, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    body = {"token_ids": TOKENS, "cache_salt": SALT}
    assert api.post("/v1/lookup", body).status_code == 200
    assert api.post("/v1/route", {**body, "loads": {"n0": 0}}).status_code == 200
    root = root_key(SALT, FINGERPRINT.fingerprint())
    kept = list(_reachable(api.service)) + list(_reachable(api.metrics))
    assert len(kept) > 20  # the walk did reach the tracker's contents
    for item in kept:
        if isinstance(item, str):
            assert SALT not in item
        elif isinstance(item, bytes | bytearray):
            assert SALT.encode() not in item and item != root
    assert SALT not in caplog.text
    assert SALT not in api.http.get("/metrics").text
