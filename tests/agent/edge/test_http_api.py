"""The HTTP API over real sockets: uvicorn on 127.0.0.1 in a thread, httpx as the client.

The service behind it is real too: an L1Cache and a FileQuotaStore under tmp_path.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from kvpool.agent.core.quota_book import QuotaBook
from kvpool.agent.edge.http_api import MetricsSource, create_app
from kvpool.agent.service.cache_service import CacheService
from kvpool.agent.tenancy.quota_store import FileQuotaStore
from kvpool.common.auth import TokenAuthority
from kvpool.common.keys import TENANT_ID_PATTERN, TENANT_ID_RULE, tenant_id
from tests.support.chunks import key
from tests.support.l1 import PAGE, make_cache, make_service

ALICE = tenant_id("alice")
BOB = tenant_id("bob")
CAROL = tenant_id("carol")  # has no token
SPACE = tenant_id("shared-space")  # alice owns it, bob is a member

ADMIN_TOKEN = "admin-token-Zq8vN1"
ALICE_TOKEN = "alice-token-Hx41Lp"
BOB_TOKEN = "bob-token-Wm93Rt"
UNKNOWN_TOKEN = "unknown-token-Jc55Ke"
GATEWAY_TOKEN = "gateway-token-Rb27Yu"
TOKENS = {
    "admin": ADMIN_TOKEN,
    "tenants": {ALICE: [ALICE_TOKEN], BOB: BOB_TOKEN},
    "gateways": GATEWAY_TOKEN,
    "spaces": {SPACE: {"members": [BOB], "owners": [ALICE]}},
}


class Mount:
    """The ASGI app the server hands requests to: each test mounts its own app.

    One uvicorn server serves the whole module (starting and stopping one costs
    about 0.2 s), while every test still gets a fresh service and app.
    """

    def __init__(self) -> None:
        self.app: ASGIApp | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        assert self.app is not None, "no app mounted"
        await self.app(scope, receive, send)


@dataclass
class Server:
    mount: Mount
    http: httpx.Client
    """A client of the server for the whole module (creating one costs tens of ms)."""


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    """uvicorn on a free port of 127.0.0.1, in a thread."""
    mount = Mount()
    # log_config=None leaves the uvicorn loggers propagating to the root logger (and caplog).
    config = uvicorn.Config(mount, host="127.0.0.1", port=0, log_config=None, lifespan="off")
    instance = uvicorn.Server(config)
    thread = threading.Thread(target=instance.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not instance.started:
        assert thread.is_alive(), "uvicorn failed to start"
        assert time.monotonic() < deadline, "uvicorn did not start within 10 s"
        time.sleep(0.002)
    host, port = instance.servers[0].sockets[0].getsockname()[:2]
    try:
        with httpx.Client(base_url=f"http://{host}:{port}", timeout=10) as http:
            yield Server(mount, http)
    finally:
        instance.should_exit = True
        thread.join(timeout=10)


@dataclass
class Api:
    service: CacheService
    http: httpx.Client
    quota_file: Path

    def call(
        self, method: str, path: str, token: str | None = None, **kwargs: Any
    ) -> httpx.Response:
        headers = dict(kwargs.pop("headers", {}))
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        return self.http.request(method, path, headers=headers, **kwargs)

    def store(self, tenant: str, names: range, size: int = PAGE) -> None:
        """Cache chunks for ``tenant`` the way the ZMQ server does: reserve, then commit."""
        keys = [key(f"{tenant}-{name}") for name in names]
        reservation = self.service.reserve(tenant, keys, [size] * len(keys))
        assert reservation.lease is not None and reservation.refused_reason is None
        self.service.commit(reservation.lease)


@contextmanager
def running(
    server: Server,
    tmp_path: Path,
    *,
    quota_file: Path | None = None,
    quotas: QuotaBook | None = None,
    ready: Callable[[], bool] | None = None,
    metrics: MetricsSource | None = None,
    pin_budget: int = 0,
) -> Iterator[Api]:
    quota_file = quota_file or tmp_path / "q.json"
    cache = make_cache(pages=100, quotas=quotas, pin_budget=pin_budget)
    service = make_service(cache, quota_file, tmp_path / "chunk-files")
    server.mount.app = create_app(service, TokenAuthority(TOKENS), ready=ready, metrics=metrics)
    try:
        yield Api(service, server.http, quota_file)
    finally:
        server.mount.app = None


@pytest.fixture
def api(server: Server, tmp_path: Path) -> Iterator[Api]:
    with running(server, tmp_path) as started:
        yield started


# ------------------------------------------------------------------ the auth matrix

ADMIN_ONLY = "admin only"
OWN_TENANT = "admin or own tenant"
ENDPOINTS = [
    ("GET", "/v1/status", None, ADMIN_ONLY),
    ("GET", "/v1/tenants", None, ADMIN_ONLY),
    ("POST", "/v1/clear", None, ADMIN_ONLY),
    ("GET", "/v1/spaces", None, ADMIN_ONLY),
    ("GET", f"/v1/tenants/{ALICE}/quota", None, OWN_TENANT),
    ("PUT", f"/v1/tenants/{ALICE}/quota", {"limit_bytes": 1 << 20}, OWN_TENANT),
    ("DELETE", f"/v1/tenants/{ALICE}/quota", None, OWN_TENANT),
    ("GET", f"/v1/tenants/{ALICE}/usage", None, OWN_TENANT),
    ("POST", f"/v1/tenants/{ALICE}/clear", None, OWN_TENANT),
]


@pytest.mark.parametrize(
    ("method", "path", "body", "access"),
    ENDPOINTS,
    ids=[f"{method} {path.replace(ALICE, '<alice>')}" for method, path, _, _ in ENDPOINTS],
)
def test_auth_matrix(
    api: Api, method: str, path: str, body: dict[str, int] | None, access: str
) -> None:
    missing = api.call(method, path, json=body)
    assert missing.status_code == 401
    assert missing.headers["WWW-Authenticate"].startswith("Bearer")
    assert missing.json() == {"detail": "a bearer token is required"}

    unknown = api.call(method, path, UNKNOWN_TOKEN, json=body)
    assert unknown.status_code == 401
    assert 'error="invalid_token"' in unknown.headers["WWW-Authenticate"]
    assert unknown.json() == {"detail": "unknown bearer token"}

    basic = api.call(method, path, json=body, headers={"Authorization": f"Basic {ADMIN_TOKEN}"})
    assert basic.status_code == 401  # only the Bearer scheme counts
    empty = api.call(method, path, json=body, headers={"Authorization": "Bearer"})
    assert empty.status_code == 401

    other = api.call(method, path, BOB_TOKEN, json=body)
    assert other.status_code == 403
    assert "detail" in other.json()

    gateway = api.call(method, path, GATEWAY_TOKEN, json=body)  # the index's, not the agent's
    assert gateway.status_code == 403
    assert gateway.json() == {
        "detail": "gateway tokens cannot use this API (it takes admin tokens, tenant tokens)"
    }

    own = api.call(method, path, ALICE_TOKEN, json=body)
    if access == ADMIN_ONLY:
        assert own.status_code == 403
        assert own.json() == {"detail": "this route needs an admin token"}
    else:
        assert own.status_code == 200, own.text
        assert other.json() == {"detail": "a tenant token may only access its own tenant"}

    admin = api.call(method, path, ADMIN_TOKEN, json=body)
    assert admin.status_code == 200, admin.text


def test_admin_reaches_any_tenant(api: Api) -> None:
    for tenant in (ALICE, BOB, CAROL):
        assert api.call("GET", f"/v1/tenants/{tenant}/usage", ADMIN_TOKEN).status_code == 200


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/openapi.json", "/docs"])
def test_public_routes_need_no_token(api: Api, path: str) -> None:
    assert api.call("GET", path).status_code == 200
    assert api.call("GET", path, UNKNOWN_TOKEN).status_code == 200


def test_denied_requests_change_nothing(api: Api) -> None:
    api.store(ALICE, range(3))
    assert api.call("POST", f"/v1/tenants/{ALICE}/clear", BOB_TOKEN).status_code == 403
    assert api.call("POST", "/v1/clear", ALICE_TOKEN).status_code == 403
    denied = api.call("PUT", f"/v1/tenants/{ALICE}/quota", BOB_TOKEN, json={"limit_bytes": 0})
    assert denied.status_code == 403
    assert api.service.usage(ALICE).chunks == 3
    assert not api.service.quota(ALICE).explicit
    assert not api.quota_file.exists()


# --------------------------------------------------------------------- behaviour


def test_health_and_readiness(server: Server, tmp_path: Path) -> None:
    ready = threading.Event()
    with running(server, tmp_path, ready=ready.is_set) as api:
        assert api.call("GET", "/healthz").json() == {"status": "ok"}
        not_ready = api.call("GET", "/readyz")
        assert not_ready.status_code == 503
        assert not_ready.json() == {"detail": "the agent is not ready"}
        ready.set()
        assert api.call("GET", "/readyz").json() == {"ready": True}


def test_metrics_are_mounted_when_given(server: Server, tmp_path: Path) -> None:
    def metrics() -> tuple[bytes, str]:
        return b"kvpool_up 1\n", "text/plain; version=0.0.4; charset=utf-8"

    with running(server, tmp_path, metrics=metrics) as api:
        response = api.call("GET", "/metrics")
        assert response.status_code == 200
        assert response.content == b"kvpool_up 1\n"
        assert response.headers["content-type"].startswith("text/plain; version=0.0.4")


def test_no_metrics_route_without_a_source(api: Api) -> None:
    assert api.call("GET", "/metrics").status_code == 404


def test_status(api: Api) -> None:
    api.store(ALICE, range(3))
    api.store(BOB, range(2), size=PAGE // 2)
    api.service.lookup(ALICE, [key(f"{ALICE}-0"), key("absent")], lock=False)
    body = api.call("GET", "/v1/status", ADMIN_TOKEN).json()
    assert body["capacity_bytes"] == 100 * PAGE
    assert body["allocated_bytes"] == 5 * PAGE
    assert body["stored_bytes"] == 4 * PAGE
    assert body["chunks"] == 5
    assert (body["hits"], body["misses"]) == (1, 1)
    assert (body["written_bytes"], body["read_bytes"]) == (4 * PAGE, 0)
    assert body["evictions"] == {"watermark": 0, "pressure": 0, "quota": 0}
    assert (body["lock_expiries"], body["open_leases"]) == (0, 0)
    assert body["page_waste"] == pytest.approx(0.2)
    assert 0 <= body["fragmentation"] <= 1
    assert body["free_extents"] >= 1
    assert body["tenant_count"] == 2


def test_tenant_list(api: Api) -> None:
    assert api.call("GET", "/v1/tenants", ADMIN_TOKEN).json() == {"tenants": []}
    api.store(ALICE, range(3))
    api.store(BOB, range(2), size=PAGE // 2)
    api.service.lookup(ALICE, [key(f"{ALICE}-0"), key("absent")], lock=False)
    api.service.lookup(CAROL, [key("absent")], lock=False)
    listed = api.call("GET", "/v1/tenants", ADMIN_TOKEN).json()["tenants"]
    by_tenant = {usage["tenant"]: usage for usage in listed}
    assert by_tenant.keys() == {ALICE, BOB, CAROL}
    for tenant, usage in by_tenant.items():  # the same view as each tenant's own route
        assert usage == api.call("GET", f"/v1/tenants/{tenant}/usage", ADMIN_TOKEN).json()
    assert (by_tenant[ALICE]["hits"], by_tenant[ALICE]["misses"]) == (1, 1)
    assert (by_tenant[BOB]["chunks"], by_tenant[BOB]["used_bytes"]) == (2, PAGE)
    assert (by_tenant[CAROL]["hits"], by_tenant[CAROL]["misses"]) == (0, 1)


def test_quota_round_trip_and_shrinking_evicts(api: Api) -> None:
    quota = f"/v1/tenants/{ALICE}/quota"
    usage = f"/v1/tenants/{ALICE}/usage"
    api.store(ALICE, range(10))
    api.store(BOB, range(4))
    before = api.call("GET", usage, ALICE_TOKEN).json()
    assert (before["used_bytes"], before["chunks"], before["stored_chunks"]) == (10 * PAGE, 10, 10)
    assert before["quota_bytes"] is None and before["evicted_chunks"] == 0

    assert api.call("GET", quota, ALICE_TOKEN).json() == {
        "tenant": ALICE,
        "limit_bytes": None,
        "nvme_limit_bytes": None,
        "explicit": False,
    }
    put = api.call("PUT", quota, ALICE_TOKEN, json={"limit_bytes": 3 * PAGE})
    assert put.json() == {
        "tenant": ALICE,
        "limit_bytes": 3 * PAGE,
        "nvme_limit_bytes": 3 * PAGE,
        "explicit": True,
    }
    assert api.call("GET", quota, ADMIN_TOKEN).json() == put.json()

    after = api.call("GET", usage, ALICE_TOKEN).json()
    assert after["used_bytes"] <= 3 * PAGE
    assert after["chunks"] == after["used_bytes"] // PAGE
    assert after["evicted_chunks"] == 10 - after["chunks"]
    assert after["quota_bytes"] == 3 * PAGE
    assert api.service.usage(BOB).chunks == 4  # another tenant's quota never touches Bob
    status = api.call("GET", "/v1/status", ADMIN_TOKEN).json()
    assert status["evictions"]["quota"] == after["evicted_chunks"]
    assert FileQuotaStore(api.quota_file).load() == {ALICE: 3 * PAGE}  # durable

    unlimited = api.call("PUT", quota, ALICE_TOKEN, json={"limit_bytes": None})
    assert unlimited.json() == {
        "tenant": ALICE,
        "limit_bytes": None,
        "nvme_limit_bytes": None,
        "explicit": True,
    }
    deleted = api.call("DELETE", quota, ALICE_TOKEN)
    assert deleted.json() == {
        "tenant": ALICE,
        "limit_bytes": None,
        "nvme_limit_bytes": None,
        "explicit": False,
    }
    assert FileQuotaStore(api.quota_file).load() == {}
    assert api.call("DELETE", quota, ALICE_TOKEN).status_code == 200  # idempotent


def test_zero_quota_and_the_default(server: Server, tmp_path: Path) -> None:
    with running(server, tmp_path, quotas=QuotaBook(default=50 * PAGE)) as api:
        quota = f"/v1/tenants/{ALICE}/quota"
        api.store(ALICE, range(5))
        assert api.call("GET", quota, ALICE_TOKEN).json()["limit_bytes"] == 50 * PAGE
        api.call("PUT", quota, ADMIN_TOKEN, json={"limit_bytes": 0})
        assert api.call("GET", f"/v1/tenants/{ALICE}/usage", ALICE_TOKEN).json()["chunks"] == 0
        reverted = api.call("DELETE", quota, ADMIN_TOKEN).json()
        assert reverted == {
            "tenant": ALICE,
            "limit_bytes": 50 * PAGE,
            "nvme_limit_bytes": 50 * PAGE,
            "explicit": False,
        }


def test_clear(api: Api) -> None:
    api.store(ALICE, range(4))
    api.store(BOB, range(3))
    cleared = api.call("POST", f"/v1/tenants/{ALICE}/clear", ALICE_TOKEN)
    assert cleared.json() == {"dropped_chunks": 4}
    assert api.call("GET", f"/v1/tenants/{ALICE}/usage", ALICE_TOKEN).json()["used_bytes"] == 0
    assert api.service.usage(BOB).chunks == 3
    assert api.call("POST", f"/v1/tenants/{CAROL}/clear", ADMIN_TOKEN).json() == {
        "dropped_chunks": 0
    }
    assert api.call("POST", "/v1/clear", ADMIN_TOKEN).json() == {"dropped_chunks": 3}
    assert api.call("GET", "/v1/status", ADMIN_TOKEN).json()["chunks"] == 0


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"limit_bytes": -1}, "body.limit_bytes: Input should be greater than or equal to 0"),
        ({"limit_bytes": "4096"}, "body.limit_bytes: Input should be a valid integer"),
        ({"limit_bytes": 1.5}, "body.limit_bytes: Input should be a valid integer"),
        ({"limit_bytes": True}, "body.limit_bytes: Input should be a valid integer"),
        ({"limit_bytes": 1 << 64}, "body.limit_bytes: Input should be less than or equal to"),
        ({}, "body.limit_bytes: Field required"),
        ({"limit_bytes": 1, "limit": 2}, "body.limit: Extra inputs are not permitted"),
        ([4096], "body: Input should be a valid dictionary"),
    ],
)
def test_bad_bodies(api: Api, body: object, reason: str) -> None:
    response = api.call("PUT", f"/v1/tenants/{ALICE}/quota", ALICE_TOKEN, json=body)
    assert response.status_code == 422
    detail = response.json()["detail"]
    assert isinstance(detail, str) and reason in detail, detail
    assert not api.service.quota(ALICE).explicit


def test_the_largest_quota_is_exact_as_a_double(api: Api) -> None:
    """The bound is one that a client holding numbers as doubles cannot round past."""
    update = api.call("GET", "/openapi.json").json()["components"]["schemas"]["QuotaUpdate"]
    maximum = update["properties"]["limit_bytes"]["anyOf"][0]["maximum"]
    assert int(float(maximum)) == maximum
    path = f"/v1/tenants/{ALICE}/quota"
    assert api.call("PUT", path, ALICE_TOKEN, json={"limit_bytes": maximum}).status_code == 200
    rounded = api.call("PUT", path, ALICE_TOKEN, json={"limit_bytes": float(maximum)})
    assert rounded.status_code == 200, rounded.text


def test_an_integral_float_is_an_integer(api: Api) -> None:
    """JSON Schema counts 4096.0 as an integer, so a schema-valid client may send it."""
    response = api.call(
        "PUT", f"/v1/tenants/{ALICE}/quota", ALICE_TOKEN, json={"limit_bytes": 4096.0}
    )
    assert response.status_code == 200, response.text
    assert response.json()["limit_bytes"] == 4096


@pytest.mark.parametrize(
    ("content", "headers", "reason"),
    [
        (b"{not json", {"Content-Type": "application/json"}, "body: not valid JSON (Expecting"),
        (b"", {"Content-Type": "application/json"}, "body: Field required"),
        (
            b"limit_bytes=5",
            {"Content-Type": "application/x-www-form-urlencoded"},
            "body: Input should be a valid dictionary",
        ),
    ],
)
def test_non_json_bodies(api: Api, content: bytes, headers: dict[str, str], reason: str) -> None:
    response = api.call(
        "PUT", f"/v1/tenants/{ALICE}/quota", ALICE_TOKEN, content=content, headers=headers
    )
    assert response.status_code == 422
    assert reason in response.json()["detail"]


@pytest.mark.parametrize(
    "bad",
    ["alice", ALICE.upper(), ALICE[:-1], ALICE + "0", "z" * 32, "default"],
)
@pytest.mark.parametrize("route", ["quota", "usage", "clear"])
def test_malformed_tenant_id(api: Api, bad: str, route: str) -> None:
    method = "POST" if route == "clear" else "GET"
    path = f"/v1/tenants/{bad}/{route}"
    assert api.call(method, path).status_code == 401  # who is asking comes first
    for token in (ADMIN_TOKEN, ALICE_TOKEN):
        response = api.call(method, path, token)
        assert response.status_code == 422
        assert response.json() == {"detail": TENANT_ID_RULE}
    assert "kvpool tenant-id" in TENANT_ID_RULE


def test_quota_store_failure_is_503(server: Server, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with running(server, tmp_path, quota_file=blocker / "q.json") as api:
        quota = f"/v1/tenants/{ALICE}/quota"
        api.store(ALICE, range(5))
        for method, body in (("PUT", {"limit_bytes": 0}), ("DELETE", None)):
            response = api.call(method, quota, ALICE_TOKEN, json=body)
            assert response.status_code == 503
            detail = response.json()["detail"]
            assert detail.startswith("quota store unavailable, nothing was changed")
            assert "q.json" in detail
        assert api.call("GET", quota, ALICE_TOKEN).json()["explicit"] is False  # unchanged
        assert api.service.usage(ALICE).chunks == 5  # and nothing was evicted
        assert api.call("GET", "/healthz").status_code == 200  # the rest keeps working


def test_openapi_lists_every_endpoint(api: Api) -> None:
    spec = api.call("GET", "/openapi.json").json()
    paths = spec["paths"]
    tenant = "/v1/tenants/{tenant_id}"
    expected = {
        "/healthz": {"get"},
        "/readyz": {"get"},
        "/v1/status": {"get"},
        "/v1/tenants": {"get"},
        "/v1/clear": {"post"},
        "/v1/spaces": {"get"},
        "/v1/peers": {"get"},
        f"{tenant}/quota": {"get", "put", "delete"},
        f"{tenant}/usage": {"get"},
        f"{tenant}/clear": {"post"},
        f"{tenant}/pins": {"get"},
        f"{tenant}/pins/{{name}}": {"put", "delete"},
        f"{tenant}/warm": {"post"},
    }
    assert {path: set(operations) for path, operations in paths.items()} == expected
    assert spec["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    put = paths[f"{tenant}/quota"]["put"]
    assert put["security"] == [{"HTTPBearer": []}]
    assert {"401", "403", "413", "422", "503"} <= set(put["responses"])
    assert "security" not in paths["/healthz"]["get"]
    update = spec["components"]["schemas"]["QuotaUpdate"]
    assert update["required"] == ["limit_bytes"]
    assert "null" in update["properties"]["limit_bytes"]["description"]
    for path, operations in paths.items():
        for operation in operations.values():
            assert operation.get("summary"), f"{path} has no summary"


def test_openapi_declares_the_tenant_id_pattern(api: Api) -> None:
    """A schema-valid tenant id is a valid one: generated requests never get 422 for it."""
    paths = api.call("GET", "/openapi.json").json()["paths"]
    tenant_paths = [path for path in paths if "{tenant_id}" in path]
    assert tenant_paths
    for path in tenant_paths:
        for operation in paths[path].values():
            (parameter,) = [p for p in operation["parameters"] if p["name"] == "tenant_id"]
            assert parameter["schema"]["pattern"] == TENANT_ID_PATTERN, path
    assert re.fullmatch(TENANT_ID_PATTERN, ALICE)


def test_405_names_every_method_of_the_path(api: Api) -> None:
    answer = api.call("POST", f"/v1/tenants/{ALICE}/quota", ADMIN_TOKEN)
    assert answer.status_code == 405
    assert answer.headers["Allow"] == "DELETE, GET, PUT"
    assert answer.json() == {"detail": "method POST not allowed"}


def test_tokens_never_reach_the_logs(api: Api, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(1)  # everything, uvicorn's TRACE level included
    quota = f"/v1/tenants/{ALICE}/quota"
    api.call("GET", "/v1/status", ADMIN_TOKEN)
    api.call("GET", "/v1/status", ALICE_TOKEN)
    api.call("GET", "/v1/status", UNKNOWN_TOKEN)
    api.call("PUT", quota, ALICE_TOKEN, json={"limit_bytes": 4096})
    api.call("PUT", quota, BOB_TOKEN, json={"limit_bytes": 4096})
    api.call("PUT", quota, ALICE_TOKEN, json={"limit_bytes": "x"})
    api.call("POST", "/v1/clear", ADMIN_TOKEN)
    api.call("GET", "/v1/tenants/bad/usage", ADMIN_TOKEN)
    api.call("GET", "/v1/status", headers={"Authorization": f"Basic {ADMIN_TOKEN}"})

    text = caplog.text
    assert "/v1/status" in text  # the access log was captured ...
    assert f"tenant {ALICE} set the quota of tenant {ALICE} to 4096 bytes" in text  # ... and ours
    for token in (ADMIN_TOKEN, ALICE_TOKEN, BOB_TOKEN, UNKNOWN_TOKEN):
        assert token not in text
        for record in caplog.records:
            assert token not in repr(record.args)


# ------------------------------------------------------------------ pins and warming

PINS = f"/v1/tenants/{SPACE}/pins"
PIN_ROUTES = [
    ("PUT", f"{PINS}/prefix", {"keys": [key(0).hex()]}),
    ("GET", PINS, None),
    ("POST", f"/v1/tenants/{SPACE}/warm", {"keys": [key(0).hex()]}),
    ("DELETE", f"{PINS}/prefix", None),
]


def test_pins_and_warming_take_an_admin_or_an_owner_of_the_space(
    server: Server, tmp_path: Path
) -> None:
    with running(server, tmp_path, pin_budget=8 * PAGE) as api:
        for method, path, body in PIN_ROUTES:
            assert api.call(method, path, json=body).status_code == 401
            member = api.call(method, path, BOB_TOKEN, json=body)  # a member, not an owner
            assert member.status_code == 403
            assert "owner of the shared space" in member.json()["detail"]
            assert api.call(method, path, GATEWAY_TOKEN, json=body).status_code == 403
            owner = api.call(method, path, ALICE_TOKEN, json=body)
            assert owner.status_code == 200, owner.text
        own = api.call("GET", f"/v1/tenants/{ALICE}/pins", ALICE_TOKEN)  # not a space
        assert own.status_code == 403
        assert api.call("GET", f"/v1/tenants/{CAROL}/pins", ADMIN_TOKEN).status_code == 200
        bad = api.call("GET", "/v1/tenants/not-an-id/pins", ALICE_TOKEN)
        assert (bad.status_code, bad.json()["detail"]) == (422, TENANT_ID_RULE)


def test_a_pin_reports_its_keys_and_an_unknown_one_is_404(server: Server, tmp_path: Path) -> None:
    with running(server, tmp_path, pin_budget=2 * PAGE) as api:
        keys = [key(f"{SPACE}-{n}") for n in range(3)]
        api.store(SPACE, range(2))
        put = api.call("PUT", f"{PINS}/prefix", ALICE_TOKEN, json={"keys": [k.hex() for k in keys]})
        assert put.json() == {
            "name": "prefix",
            "keys": 3,
            "resident_keys": 2,
            "pinned_keys": 2,
            "pinned_bytes": 2 * PAGE,
        }
        api.store(SPACE, range(2, 3))  # arrives past the budget: resident, not pinned
        listed = api.call("GET", PINS, ALICE_TOKEN).json()
        assert listed["budget_bytes"] == listed["pinned_bytes"] == 2 * PAGE
        assert [(p["name"], p["resident_keys"], p["pinned_keys"]) for p in listed["pins"]] == [
            ("prefix", 3, 2)
        ]
        assert api.call("DELETE", f"{PINS}/prefix", ALICE_TOKEN).json()["pins"] == []
        gone = api.call("DELETE", f"{PINS}/prefix", ALICE_TOKEN)
        assert gone.status_code == 404 and "no pin 'prefix'" in gone.json()["detail"]


def test_a_budget_of_zero_refuses_a_pin_naming_the_budget(api: Api) -> None:
    refused = api.call("PUT", f"{PINS}/p", ADMIN_TOKEN, json={"keys": [key(1).hex()]})
    assert refused.status_code == 409
    assert "pin budget" in refused.json()["detail"]
    assert "default_pin_budget" in refused.json()["detail"]


@pytest.mark.parametrize(
    ("method", "path", "body", "field"),
    [
        ("PUT", f"{PINS}/p", {"keys": ["zz"]}, "body.keys.0"),
        ("PUT", f"{PINS}/p", {"keys": [key(1).hex().upper()]}, "body.keys.0"),
        ("PUT", f"{PINS}/p", {"keys": [key(1).hex()] * 8193}, "body.keys"),
        ("PUT", f"{PINS}/p", {"names": []}, "body.keys"),
        ("PUT", f"{PINS}/Bad_Name", {"keys": []}, "path.name"),
        ("POST", f"/v1/tenants/{SPACE}/warm", {"keys": [], "timeout_s": 61}, "body.timeout_s"),
        ("POST", f"/v1/tenants/{SPACE}/warm", {"keys": ["0" * 63]}, "body.keys.0"),
    ],
)
def test_a_malformed_pin_or_warm_is_422_naming_the_field(
    api: Api, method: str, path: str, body: dict[str, Any], field: str
) -> None:
    answer = api.call(method, path, ADMIN_TOKEN, json=body)
    assert answer.status_code == 422
    assert answer.json()["detail"].startswith(f"invalid request: {field}: ")
    assert "\n" not in answer.json()["detail"]


def test_warming_without_l2_tiers_reports_what_l1_holds(api: Api) -> None:
    api.store(SPACE, range(2))
    keys = [key(f"{SPACE}-{n}").hex() for n in range(3)]
    warmed = api.call("POST", f"/v1/tenants/{SPACE}/warm", ADMIN_TOKEN, json={"keys": keys})
    assert warmed.json() == {"keys": 3, "resident": 2, "loaded": 0, "missing": 1, "done": True}


def test_an_admins_clear_drops_the_tenants_pins(server: Server, tmp_path: Path) -> None:
    with running(server, tmp_path, pin_budget=PAGE) as api:
        api.call("PUT", f"/v1/tenants/{ALICE}/pins/p", ADMIN_TOKEN, json={"keys": []})
        api.call("POST", f"/v1/tenants/{ALICE}/clear", ALICE_TOKEN)  # her own: pins stay
        assert len(api.service.pins(ALICE).pins) == 1
        api.call("POST", f"/v1/tenants/{ALICE}/clear", ADMIN_TOKEN)
        assert api.service.pins(ALICE).pins == []
