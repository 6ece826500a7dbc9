"""Warm through real agents: one node stores a space's prefix and writes it back to S3 (moto's
server); another, whose L1 is empty, warms it over HTTP and then hits it over ZMQ."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from kvpool.client import AgentClient
from kvpool.common.keys import tenant_id
from tests.support.agent_process import ADMIN_TOKEN, AgentProcess
from tests.support.chunks import data, key
from tests.support.metrics import metric
from tests.support.polling import wait_until

from .faults import Fault, FaultProxy

pytestmark = pytest.mark.process

SPACE = tenant_id("warm-space")
OTHER, THIRD = tenant_id("other"), tenant_id("third")
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
CHUNK = 60_000


def test_a_second_node_warms_a_prefix_from_s3_and_pins_it_on_arrival(
    agents: Callable[..., AgentProcess], s3_endpoint: str, bucket: str, tmp_path: Path
) -> None:
    s3 = {
        "S3__BUCKET": bucket,
        "S3__ENDPOINT_URL": s3_endpoint,
        "S3__REGION": "us-east-1",
        "L2_KEY_DIR": str(tmp_path / "pool-keys"),  # the pool's key Secret, on both nodes
        "DEFAULT_PIN_BUDGET": str(8 * CHUNK),
    }
    first, second = agents("node-1", **s3), agents("node-2", **s3)
    names = list(range(6))
    keys = [key(n) for n in names]
    with AgentClient(first.zmq, token=ADMIN_TOKEN) as client:
        assert client.store(SPACE, keys, [data(n) for n in names]) == len(keys)
    wait_until(lambda: metric(first, "kvpool_writeback_written_total") >= len(keys))

    pin = httpx.put(
        f"{second.http}/v1/tenants/{SPACE}/pins/prefix",
        json={"keys": [k.hex() for k in keys]},
        headers=ADMIN,
    )
    assert pin.json()["resident_keys"] == 0  # pinned before its chunks arrive
    with AgentClient(second.zmq, token=ADMIN_TOKEN) as client:
        assert client.lookup(SPACE, keys, lock=False, count=False).count == 0
    unknown = key("never-stored")
    warmed = httpx.post(
        f"{second.http}/v1/tenants/{SPACE}/warm",
        json={"keys": [k.hex() for k in [*keys, unknown]], "timeout_s": 20},
        headers=ADMIN,
        timeout=30,
    )
    assert warmed.status_code == 200, warmed.text
    assert warmed.json() == {"keys": 7, "resident": 6, "loaded": 6, "missing": 1, "done": True}
    with AgentClient(second.zmq, token=ADMIN_TOKEN) as client:
        assert client.lookup(SPACE, keys, lock=False).count == len(keys)
        assert client.retrieve(SPACE, keys) == [data(n) for n in names]
    pins = httpx.get(f"{second.http}/v1/tenants/{SPACE}/pins", headers=ADMIN).json()
    assert pins["pinned_bytes"] == len(keys) * CHUNK  # pinned on arrival
    again = httpx.post(
        f"{second.http}/v1/tenants/{SPACE}/warm",
        json={"keys": [k.hex() for k in keys]},
        headers=ADMIN,
    )
    assert again.json() == {"keys": 6, "resident": 6, "loaded": 0, "missing": 0, "done": True}
    assert metric(second, "kvpool_warm_requests_total") == 2
    assert metric(second, "kvpool_warm_loaded_chunks_total") == len(keys)


def test_warms_never_take_the_prefetch_slots_of_another_tenants_lookups(
    agents: Callable[..., AgentProcess], proxy: FaultProxy, bucket: str
) -> None:
    """Against a slow S3 every prefetch holds its slot for as long as S3 takes to answer: 64
    warms once held all 32 slots, and another tenant's lookups prefetched nothing."""
    slow = "60"  # seconds: past the test (the agent's stop cancels the waits)
    agent = agents(
        "node",
        S3__BUCKET=bucket,
        S3__ENDPOINT_URL=proxy.url,
        S3__REGION="us-east-1",
        S3__READ_TIMEOUT_SECONDS=slow,
    )
    proxy.inject(Fault.SLOW, delay=float(slow))
    answers = [
        httpx.post(  # a prefix no tier holds: its prefetch waits for S3 to say so
            f"{agent.http}/v1/tenants/{SPACE}/warm",
            json={"keys": [key(f"warm-{n}").hex()], "timeout_s": 0},
            headers=ADMIN,
        ).status_code
        for n in range(64)
    ]
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
        asked = itertools.count()

        def prefetches(tenant: str, count: int) -> list[int]:
            """Lookups of prefixes not asked before (one of the same keys would join the
            running prefetch instead of taking a slot)."""
            names = [key(f"{tenant}-{next(asked)}") for _ in range(count)]
            return [client.lookup_prefetch(tenant, [name])[1] for name in names]

        assert all(prefetches(OTHER, 16)), "a lookup found no prefetch slot"
        assert answers.count(200) == 8, answers  # warms: a quarter of the 32 slots
        assert prefetches(OTHER, 1) == [0]  # a tenant: half of them
        assert all(prefetches(THIRD, 8)) and prefetches(THIRD, 1) == [0]  # the rest
