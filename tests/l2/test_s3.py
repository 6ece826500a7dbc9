"""S3 tier over real HTTP: sharing between agents, layout, parallel parts, faults, the breaker."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from kvpool.agent.l2 import L2Object
from kvpool.agent.l2.base import TierUnavailable
from kvpool.agent.l2.breaker import BreakerState
from kvpool.agent.l2.codec import HEADER, MAGIC
from kvpool.agent.l2.s3 import S3Adapter

from .conftest import POOL, MiB, chunk, object_codec, payload, raw_client, s3_config
from .faults import Fault, FaultProxy

pytestmark = [pytest.mark.process, pytest.mark.asyncio]

Factory = Callable[..., S3Adapter]


@pytest_asyncio.fixture
async def make(s3_endpoint: str, bucket: str, tmp_path: Path) -> AsyncIterator[Factory]:
    """Adapters on the test's bucket (through ``endpoint``, default: straight to the server)."""
    made: list[S3Adapter] = []

    def factory(endpoint: str = s3_endpoint, pool: str = POOL, **overrides: Any) -> S3Adapter:
        codec = object_codec(tmp_path / "keys", pool)
        made.append(S3Adapter(s3_config(endpoint, bucket, **overrides), pool, codec))
        return made[-1]

    yield factory
    for adapter in made:
        await adapter.close()


async def test_a_chunk_stored_by_one_agent_is_served_by_another(make: Factory) -> None:
    node_1, node_2 = make(), make()
    names = [chunk(i, tenant) for i in range(4) for tenant in ("tenant-a", "tenant-b")]
    data = [payload(2 * MiB + i, n.tenant) for i, n in enumerate(names)]
    assert await node_1.put([L2Object(n, d) for n, d in zip(names, data, strict=True)])
    assert await node_2.get(names) == data
    assert await node_2.delete(names[:2]) == [True, True]
    assert await node_1.get(names[:2]) == [None, None]


async def test_objects_live_under_prefix_pool_tenant_and_a_2_hex_shard(
    make: Factory, s3_endpoint: str, bucket: str
) -> None:
    adapter, other_pool = make(prefix="/kv/"), make(prefix="kv", pool="other")
    name = chunk(0, "0123456789abcdef0123456789abcdef")
    await adapter.put([L2Object(name, b"payload")])
    digest = name.key.hex()
    key = f"kv/{POOL}/{name.tenant}/{digest[:2]}/{digest}"
    listed = raw_client(s3_endpoint).list_objects_v2(Bucket=bucket)["Contents"]
    assert [entry["Key"] for entry in listed] == [key]
    body = raw_client(s3_endpoint).get_object(Bucket=bucket, Key=key)["Body"].read()
    assert body.startswith(MAGIC) and body.endswith(b"payload")
    assert await other_pool.get([name]) == [None]  # pools do not share objects


async def test_a_small_object_is_one_request_and_a_large_one_moves_in_parallel_parts(
    make: Factory, proxy: FaultProxy, s3_endpoint: str, bucket: str
) -> None:
    adapter = make(proxy.url)
    small, large = chunk("small"), chunk("large")
    await adapter.put([L2Object(small, payload(2 * MiB)), L2Object(large, payload(20 * MiB))])
    parts = [r for r in proxy.seen if r.method == "PUT" and "partNumber" in r.path]
    assert len(parts) == 5  # 20 MiB + header in 5 MiB parts
    etag = raw_client(s3_endpoint).head_object(Bucket=bucket, Key=adapter.object_key(large))
    assert etag["ETag"].endswith('-5"')

    proxy.seen.clear()
    assert await adapter.get([small]) == [payload(2 * MiB)]
    assert [r.method for r in proxy.seen] == ["GET"]
    proxy.seen.clear()
    assert await adapter.get([large]) == [payload(20 * MiB)]
    # The first 8 MiB, then the other 12 MiB + header in 5 MiB ranges; no HEAD.
    assert [r.method for r in proxy.seen] == ["GET"] * 4
    assert {r.range for r in proxy.seen} == {
        f"bytes=0-{8 * MiB - 1}",
        f"bytes={8 * MiB}-{13 * MiB - 1}",
        f"bytes={13 * MiB}-{18 * MiB - 1}",
        f"bytes={18 * MiB}-{20 * MiB + HEADER.size - 1}",
    }


@pytest.mark.parametrize("fault", [Fault.ERROR, Fault.DROP, Fault.SLOW])
@pytest.mark.parametrize("method", ["PUT", "GET"])
async def test_a_transient_fault_is_retried(
    make: Factory, proxy: FaultProxy, fault: Fault, method: str
) -> None:
    adapter = make(proxy.url, read_timeout_seconds=0.5)
    name, data = chunk(0), payload(100_000)
    proxy.inject(fault, times=1, methods=[method], delay=1.0)
    assert await adapter.put([L2Object(name, data)]) == [True]
    assert await adapter.get([name]) == [data]
    assert proxy.faults() == 1
    assert adapter.stats.put_failures == adapter.failures == 0


async def test_a_truncated_body_is_a_miss_never_wrong_bytes(
    make: Factory, proxy: FaultProxy
) -> None:
    adapter = make(proxy.url)
    names = [chunk(0), chunk(1)]
    data = [payload(100_000, 0), payload(12 * MiB, 1)]  # one request; ranged parts
    await adapter.put([L2Object(n, d) for n, d in zip(names, data, strict=True)])
    proxy.inject(Fault.TRUNCATE, methods=["GET"])
    assert await adapter.get(names) == [None, None]
    assert adapter.failures == 2
    assert adapter.stats.integrity_failures == 0
    proxy.clear()
    assert await adapter.get(names) == data  # a transport fault deletes nothing


async def test_a_consistent_but_wrong_answer_is_caught_by_the_tag(
    make: Factory, proxy: FaultProxy
) -> None:
    adapter = make(proxy.url)
    name, data = chunk(0), payload(100_000)
    await adapter.put([L2Object(name, data)])
    proxy.inject(Fault.FLIP, times=1, methods=["GET"])
    assert await adapter.get([name]) == [None]
    assert adapter.stats.integrity_failures == 1
    assert await adapter.exists([name]) == [True]  # a miss, left alone: the bucket is shared
    assert await adapter.get([name]) == [data]  # and served once the answer is right again


async def test_the_breaker_turns_a_dead_backend_into_immediate_misses(
    make: Factory, proxy: FaultProxy
) -> None:
    adapter = make(proxy.url, max_attempts=2, breaker_failures=3, breaker_reset_seconds=1.0)
    names = [chunk(i) for i in range(3)]
    await adapter.put([L2Object(n, payload(1000, i)) for i, n in enumerate(names)])
    proxy.inject(Fault.DROP)
    assert await adapter.get(names) == [None] * 3
    assert adapter.breaker.state is BreakerState.OPEN
    requests = proxy.requests()

    started = time.monotonic()
    for _ in range(20):
        assert await adapter.get(names) == [None] * 3
        assert await adapter.put([L2Object(names[0], b"x")]) == [False]
        assert await adapter.exists(names) == [False] * 3
    assert time.monotonic() - started < 0.5  # 140 refusals, no network
    assert proxy.requests() == requests
    assert adapter.breaker.refused == 140

    proxy.clear()
    await asyncio.sleep(1.0)
    # Half-open: one trial goes out, the others are still refused until it succeeds.
    assert await adapter.get(names) == [payload(1000, 0), None, None]
    assert adapter.breaker.state is BreakerState.CLOSED
    assert await adapter.get(names) == [payload(1000, i) for i in range(3)]


async def test_drop_tenant_pages_through_batches_and_reports_a_failure(
    make: Factory, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("kvpool.agent.l2.s3._BATCH", 3)  # 8 objects: 3 lists and deletes
    adapter = make(proxy.url, max_attempts=2)
    names = [chunk(i, "tenant-a") for i in range(8)]
    await adapter.put([L2Object(n, payload(100, i)) for i, n in enumerate(names)])
    proxy.inject(Fault.ERROR, methods=["POST"])  # every batch delete fails
    with pytest.raises(TierUnavailable, match="after 0 objects"):
        await adapter.drop_tenant("tenant-a")
    proxy.clear()
    before = len(proxy.seen)
    assert await adapter.drop_tenant("tenant-a") == 8
    posts = [seen for seen in proxy.seen[before:] if seen.method == "POST"]
    assert len(posts) == 3
    assert await adapter.get(names) == [None] * 8
