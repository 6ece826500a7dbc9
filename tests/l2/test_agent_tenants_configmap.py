"""KVCacheTenants as a real agent sees them: the pool's tenants ConfigMap on the emulated API
server grants and revokes tokens within seconds, bounds a tenant's own quota by its ceiling,
makes the operator an admin, and ``clear?tiers=all`` drops the tenant from NVMe and S3."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvpool.client import AgentClient, AgentError
from kvpool.common.keys import tenant_id
from kvpool.common.tenants_configmap import token_digest
from tests.support.agent_process import ADMIN_TOKEN, AgentProcess
from tests.support.chunks import data, key
from tests.support.kube_api import ServedApi
from tests.support.metrics import metric
from tests.support.operator_process import Kubectl
from tests.support.polling import eventually, wait_until

from .conftest import raw_client

pytestmark = pytest.mark.process

NAMESPACE = "inference"
NAME = "kvpool-main-tenants"
ALICE, BOB = tenant_id("alice"), tenant_id("bob")
ALICE_TOKEN, OPERATOR_TOKEN = "alice-token-from-the-operator", "operator-token-in-memory"
INDEX_ACCESS = "the-index-token-the-operator-minted"
MiB = 1 << 20


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture(scope="module")
def served_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedApi]:
    api = ServedApi(tmp_path_factory.mktemp("api")).start()
    yield api
    api.stop()


@pytest.fixture
def tenants(served_api: ServedApi, monkeypatch: pytest.MonkeyPatch) -> Iterator[Kubectl]:
    """The pool's tenants ConfigMap as the operator makes it (no data); kubectl patches it."""
    kubectl = Kubectl(served_api.kubeconfig())
    manifest = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": NAME}}
    kubectl("apply", "--validate=false", "-n", NAMESPACE, "-f", "-", manifest=manifest)
    monkeypatch.setenv("KUBECONFIG", str(served_api.kubeconfig()))
    yield kubectl
    kubectl("delete", "configmap", NAME, "-n", NAMESPACE, "--ignore-not-found")


def _patch(kubectl: Kubectl, data: dict[str, Any]) -> None:
    values = {k: None if v is None else json.dumps(v) for k, v in data.items()}
    patch = json.dumps({"data": values})
    kubectl("patch", "configmap", NAME, "-n", NAMESPACE, "--type=merge", "-p", patch)


def _grant(kubectl: Kubectl, ceiling: dict[str, int | None]) -> None:
    _patch(
        kubectl,
        {
            ALICE: {
                "tokens": [token_digest(ALICE_TOKEN)],
                "ceiling": ceiling,
                "tenant": "team-a/cache",
            },
            "operator": {"tokens": [token_digest(OPERATOR_TOKEN)]},
        },
    )


def _watching(agents: Callable[..., AgentProcess], **settings: str) -> AgentProcess:
    """An agent watching the tenants ConfigMap."""
    return agents("agent", TENANTS_CONFIGMAP=f"{NAMESPACE}/{NAME}", **settings)


def test_tokens_and_ceilings_follow_the_configmap(
    tenants: Kubectl, agents: Callable[..., AgentProcess]
) -> None:
    http = _watching(agents).http
    quota = f"{http}/v1/tenants/{ALICE}/quota"
    assert httpx.get(quota, headers=_auth(ALICE_TOKEN)).status_code == 401

    granted = time.monotonic()
    _grant(tenants, {"l1": MiB, "nvme": None})
    eventually(lambda: _status(httpx.get(quota, headers=_auth(ALICE_TOKEN)), 200), timeout=10)
    print(f"granted to working: {time.monotonic() - granted:.2f} s")
    # no quota of its own: the default (unlimited) under its ceiling
    assert httpx.get(quota, headers=_auth(ALICE_TOKEN)).json() == {
        "tenant": ALICE,
        "limit_bytes": MiB,
        "nvme_limit_bytes": None,
        "explicit": False,
    }
    bobs = httpx.get(f"{http}/v1/tenants/{BOB}/quota", headers=_auth(ALICE_TOKEN))
    assert bobs.status_code == 403
    assert httpx.get(f"{http}/v1/status", headers=_auth(OPERATOR_TOKEN)).status_code == 200

    above = httpx.put(quota, json={"limit_bytes": 2 * MiB}, headers=_auth(ALICE_TOKEN))
    assert above.status_code == 403
    assert "ceiling of 1048576 bytes" in above.json()["detail"]
    assert "KVCacheTenant" in above.json()["detail"]
    unlimited = httpx.put(quota, json={"limit_bytes": None}, headers=_auth(ALICE_TOKEN))
    assert unlimited.status_code == 403
    within = {"limit_bytes": MiB // 2, "nvme_limit_bytes": None}  # NVMe has no ceiling
    put = httpx.put(quota, json=within, headers=_auth(ALICE_TOKEN))
    assert put.status_code == 200, put.text
    assert (put.json()["limit_bytes"], put.json()["nvme_limit_bytes"]) == (MiB // 2, None)
    by_operator = httpx.put(quota, json={"limit_bytes": 2 * MiB}, headers=_auth(OPERATOR_TOKEN))
    assert by_operator.status_code == 200  # admins are not bound by ceilings

    revoked = time.monotonic()
    _patch(tenants, {ALICE: None})
    eventually(lambda: _status(httpx.get(quota, headers=_auth(ALICE_TOKEN)), 401), timeout=10)
    print(f"key removed to revoked: {time.monotonic() - revoked:.2f} s")
    assert httpx.get(quota, headers=_auth(OPERATOR_TOKEN)).status_code == 200


def test_zmq_sessions_follow_the_configmap_and_end_with_their_token(
    tenants: Kubectl, agents: Callable[..., AgentProcess]
) -> None:
    """A team's engine says hello with its KVCacheTenant's token and works on its tenant;
    the operator's index key grants the snapshot; the key removed, the session is void."""
    process = _watching(agents)
    _grant(tenants, {"l1": None, "nvme": None})
    _patch(tenants, {"index": {"tokens": [token_digest(INDEX_ACCESS)]}})
    engine = AgentClient(process.zmq, token=ALICE_TOKEN)
    eventually(lambda: _says_hello(engine), timeout=10)
    assert engine.store_inline(ALICE, [key(1)], [b"kv"]).stored == 1
    index = AgentClient(process.zmq, token=INDEX_ACCESS)
    eventually(lambda: _says_hello(index), timeout=10)  # the index key may come later
    assert eventually(index.snapshot, timeout=10) == {ALICE: [key(1)]}
    index.close()

    _patch(tenants, {ALICE: None})

    def void() -> None:
        try:
            engine.lookup(ALICE, [key(1)], lock=False)
        except AgentError as refused:
            assert refused.code == "unauthenticated", refused
        else:
            raise AssertionError("the session outlived its token")

    eventually(void, timeout=10)
    with pytest.raises(AgentError) as again:
        AgentClient(process.zmq, token=ALICE_TOKEN).connect()
    assert again.value.code == "unauthenticated"
    engine.close()


def _says_hello(client: AgentClient) -> None:
    try:
        client.connect()
    except AgentError as error:
        raise AssertionError(f"not granted yet: {error}") from error


def test_a_malformed_entry_is_skipped_and_never_logged(
    tenants: Kubectl, agents: Callable[..., AgentProcess]
) -> None:
    process = _watching(agents)
    digest = token_digest(ALICE_TOKEN)
    _patch(tenants, {BOB: {"tokens": [digest], "ceiling": "lots"}})
    _grant(tenants, {"l1": None, "nvme": None})
    quota = f"{process.http}/v1/tenants/{ALICE}/quota"
    eventually(lambda: _status(httpx.get(quota, headers=_auth(ALICE_TOKEN)), 200), timeout=10)
    log = "".join(process.log)
    assert f"entry {BOB} skipped" in log
    assert digest not in log and ALICE_TOKEN not in log


def test_tiers_all_drops_the_tenant_from_nvme_and_s3(
    tenants: Kubectl,
    agents: Callable[..., AgentProcess],
    tmp_path: Path,
    s3_endpoint: str,
    bucket: str,
) -> None:
    _grant(tenants, {"l1": None, "nvme": None})
    nvme = tmp_path / "nvme"
    process = _watching(
        agents,
        NVME__PATH=str(nvme),
        NVME__CAPACITY="64MiB",
        S3__BUCKET=bucket,
        S3__ENDPOINT_URL=s3_endpoint,
        S3__REGION="us-east-1",
    )
    with AgentClient(process.zmq, token=ADMIN_TOKEN) as client:
        for tenant, first in ((ALICE, 0), (BOB, 100)):  # keys differ by tenant, as salts make them
            names = range(first, first + 6)
            assert client.store(tenant, [key(n) for n in names], [data(n) for n in names]) == 6
    wait_until(lambda: metric(process, "kvpool_writeback_pending") == 0)
    wait_until(lambda: len(_objects(s3_endpoint, bucket, ALICE)) == 6)
    assert len(_files(nvme, ALICE)) == 6

    clear = f"{process.http}/v1/tenants/{ALICE}/clear"
    quota = f"{process.http}/v1/tenants/{ALICE}/quota"
    eventually(lambda: _status(httpx.get(quota, headers=_auth(OPERATOR_TOKEN)), 200), timeout=10)
    usage = f"{process.http}/v1/tenants/{ALICE}/usage"
    on_disk = sum(path.stat().st_size for path in _files(nvme, ALICE))
    assert httpx.get(usage, headers=_auth(ALICE_TOKEN)).json()["nvme_used_bytes"] == on_disk
    dropped = httpx.post(clear, params={"tiers": "all"}, headers=_auth(OPERATOR_TOKEN))
    assert dropped.status_code == 200, dropped.text
    assert dropped.json() == {"dropped_chunks": 6, "l2_dropped_objects": 12}  # 6 NVMe + 6 S3
    assert httpx.get(usage, headers=_auth(ALICE_TOKEN)).json()["nvme_used_bytes"] == 0
    assert _files(nvme, ALICE) == [] and _objects(s3_endpoint, bucket, ALICE) == []
    assert list(nvme.glob(f"*/{ALICE}")) == []  # no empty directories left either
    assert len(_files(nvme, BOB)) == 6 and len(_objects(s3_endpoint, bucket, BOB)) == 6
    again = httpx.post(clear, params={"tiers": "all"}, headers=_auth(ALICE_TOKEN))
    assert again.json() == {"dropped_chunks": 0, "l2_dropped_objects": 0}  # idempotent


def _files(nvme: Path, tenant: str) -> list[Path]:
    return [path for path in nvme.glob(f"*/{tenant}/*/*") if path.is_file()]


def _objects(endpoint: str, bucket: str, tenant: str) -> list[str]:
    listed = raw_client(endpoint).list_objects_v2(Bucket=bucket)
    return [item["Key"] for item in listed.get("Contents", []) if f"/{tenant}/" in item["Key"]]


def _status(response: httpx.Response, expected: int) -> None:
    assert response.status_code == expected, response.text


def test_a_space_of_the_configmap_is_listed_with_its_usage_and_its_pin_budget(
    tenants: Kubectl, agents: Callable[..., AgentProcess]
) -> None:
    """The space's owner pins within the space's pinBudget; /v1/spaces and the metrics show
    the space under its declared name."""
    agent = _watching(agents)
    space, source, budget = tenant_id("shared-prompts"), "team-a/main/prompts", 2 * 60_000
    _grant(tenants, {"l1": None, "nvme": None})
    entry = {"space": source, "members": [BOB], "owners": [ALICE], "pinBudget": budget}
    _patch(tenants, {f"space.{space}": entry})
    pins = f"{agent.http}/v1/tenants/{space}/pins/head"
    keys = [key(f"prompt-{n}") for n in range(3)]
    body = {"keys": [k.hex() for k in keys]}
    eventually(
        lambda: _status(httpx.put(pins, json=body, headers=_auth(ALICE_TOKEN)), 200), timeout=10
    )  # once the agent knows the space and its budget (pinned before the chunks arrive)
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
        client.store(space, keys, [data(f"prompt-{n}") for n in range(3)])
        assert client.lookup(space, [*keys, key("absent")], lock=False).count == 3
    spaces = httpx.get(f"{agent.http}/v1/spaces", headers=_auth(OPERATOR_TOKEN)).json()["spaces"]
    assert len(spaces) == 1
    listed = spaces[0]
    assert (listed["space"], listed["source"], listed["members"], listed["owners"]) == (
        space,
        source,
        1,
        1,
    )
    assert (listed["pinned_bytes"], listed["pin_budget_bytes"]) == (budget, budget)
    usage = listed["usage"]
    assert (usage["tenant"], usage["chunks"], usage["used_bytes"]) == (space, 3, 3 * 60_000)
    assert (usage["hits"], usage["misses"]) == (3, 1)
    label = f'{{space="{source}"}}'
    assert metric(agent, f"kvpool_space_used_bytes{label}") == 3 * 60_000
    assert metric(agent, f"kvpool_space_pinned_bytes{label}") == budget
    assert metric(agent, f"kvpool_space_pin_budget_bytes{label}") == budget
    assert metric(agent, f"kvpool_space_hits_total{label}") == 3
    refused = httpx.get(f"{agent.http}/v1/spaces", headers=_auth(ALICE_TOKEN))
    assert refused.status_code == 403  # admins only
