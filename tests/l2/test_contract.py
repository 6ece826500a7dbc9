"""The L2 contract, run against every registered adapter and a fault-injecting wrapper,
each with its objects sealed and with them authenticated plaintext.

Expectations are per key: a key the wrapper fails must come back as a per-key
failure (False / None) while the rest of its batch behaves as with any adapter.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio

from kvpool.agent.l2 import ADAPTER_NAMES, L2Adapter, L2Object, ObjectKey, adapter_class
from kvpool.agent.l2.codec import HEADER
from kvpool.agent.l2.nvme import NvmeAdapter

from .conftest import POOL, MiB, chunk, nvme_config, object_codec, payload, raw_client, s3_config
from .faults import FaultyAdapter

pytestmark = pytest.mark.asyncio

SIZES = [0, 1, 4095, 4096, 4097, MiB + 3, 20 * MiB]  # 20 MiB: a multipart object on S3


@dataclass
class Tier:
    adapter: L2Adapter
    read: Callable[[ObjectKey], bytes]
    """The stored object's bytes, read behind the adapter's back."""
    write: Callable[[ObjectKey, bytes], None]
    """Replace the stored object's bytes behind the adapter's back."""
    stored: Callable[[ObjectKey], bool]
    """Whether the backend holds the object, asked behind the adapter's back."""
    fails: Callable[[ObjectKey], bool]
    """Keys the adapter is built to fail."""
    drops_bad_objects: bool
    """NVMe deletes an object that does not open; S3 leaves it (the bucket is shared)."""

    def corrupt(self, name: ObjectKey) -> None:
        """Flip the first payload byte (or, of an empty payload, the tag's last)."""
        blob = bytearray(self.read(name))
        blob[min(HEADER.size, len(blob) - 1)] ^= 0xFF
        self.write(name, bytes(blob))


def _nvme(tmp_path: Path, seal: bool) -> Tier:
    codec = object_codec(tmp_path / "keys", seal=seal)
    adapter = adapter_class("nvme")(nvme_config(tmp_path / "l2"), POOL, lambda tenant: None, codec)  # type: ignore[call-arg]

    def read(name: ObjectKey) -> bytes:
        return bytes(adapter.path_of(name).read_bytes())  # type: ignore[attr-defined]

    def write(name: ObjectKey, blob: bytes) -> None:
        adapter.path_of(name).write_bytes(blob)  # type: ignore[attr-defined]

    def stored(name: ObjectKey) -> bool:
        return bool(adapter.path_of(name).exists())  # type: ignore[attr-defined]

    return Tier(adapter, read, write, stored, lambda name: False, drops_bad_objects=True)


def _s3(request: pytest.FixtureRequest, tmp_path: Path, seal: bool) -> Tier:
    endpoint: str = request.getfixturevalue("s3_endpoint")
    bucket: str = request.getfixturevalue("bucket")
    codec = object_codec(tmp_path / "keys", seal=seal)
    adapter = adapter_class("s3")(s3_config(endpoint, bucket), POOL, codec)  # type: ignore[call-arg]
    raw = raw_client(endpoint)

    def read(name: ObjectKey) -> bytes:
        key = adapter.object_key(name)  # type: ignore[attr-defined]
        return raw.get_object(Bucket=bucket, Key=key)["Body"].read()

    def write(name: ObjectKey, blob: bytes) -> None:
        raw.put_object(Bucket=bucket, Key=adapter.object_key(name), Body=blob)  # type: ignore[attr-defined]

    def stored(name: ObjectKey) -> bool:
        key = adapter.object_key(name)  # type: ignore[attr-defined]
        return bool(raw.list_objects_v2(Bucket=bucket, Prefix=key).get("KeyCount"))

    return Tier(adapter, read, write, stored, lambda name: False, drops_bad_objects=False)


@pytest_asyncio.fixture(
    params=[
        pytest.param((name, seal), marks=pytest.mark.process if name == "s3" else ())
        for name in (*ADAPTER_NAMES, "faulty")
        for seal in (False, True)
    ],
    ids=lambda param: f"{param[0]}-{'sealed' if param[1] else 'plain'}",
)
async def tier(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Tier]:
    name, seal = request.param
    if name == "nvme":
        tier = _nvme(tmp_path, seal)
    elif name == "s3":
        tier = _s3(request, tmp_path, seal)
    else:
        inner = _nvme(tmp_path, seal)
        faulty = FaultyAdapter(inner.adapter)
        tier = Tier(faulty, inner.read, inner.write, inner.stored, faulty.fails, True)
    yield tier
    await tier.adapter.close()


def _expected(tier: Tier, name: ObjectKey, data: bytes) -> bytes | None:
    return None if tier.fails(name) else data


async def test_round_trips_are_byte_exact_for_every_size(tier: Tier) -> None:
    objects = [L2Object(chunk(size), payload(size)) for size in SIZES]
    assert await tier.adapter.put(objects) == [not tier.fails(o.name) for o in objects]
    names = [o.name for o in objects]
    got = await tier.adapter.get(names)
    for obj, data in zip(objects, got, strict=True):
        assert data == _expected(tier, obj.name, bytes(obj.payload)), len(obj.payload)
    assert await tier.adapter.exists(names) == [not tier.fails(n) for n in names]
    stored = [o for o in objects if not tier.fails(o.name)]
    assert tier.adapter.stats.hits == len(stored)
    assert tier.adapter.stats.get_bytes == sum(len(o.payload) for o in stored)


async def test_a_memoryview_payload_round_trips(tier: Tier) -> None:
    data = payload(10_000)
    names = [chunk(i) for i in range(4)]
    await tier.adapter.put([L2Object(n, memoryview(data)[1000:9000]) for n in names])
    assert await tier.adapter.get(names) == [_expected(tier, n, data[1000:9000]) for n in names]


async def test_results_are_per_key_and_in_order(tier: Tier) -> None:
    names = [chunk(i) for i in range(12)]
    present = names[::2]
    await tier.adapter.put([L2Object(n, payload(100 + i, i)) for i, n in enumerate(present)])
    got = await tier.adapter.get(names)
    for i, (n, data) in enumerate(zip(names, got, strict=True)):
        wanted = payload(100 + i // 2, i // 2) if i % 2 == 0 else None
        assert data == (None if tier.fails(n) else wanted), i
    assert await tier.adapter.exists(names) == [
        i % 2 == 0 and not tier.fails(n) for i, n in enumerate(names)
    ]


async def test_missing_keys_are_misses(tier: Tier) -> None:
    names = [chunk(f"absent-{i}") for i in range(8)]
    assert await tier.adapter.get(names) == [None] * 8
    assert await tier.adapter.exists(names) == [False] * 8
    assert await tier.adapter.delete(names) == [not tier.fails(n) for n in names]
    assert await tier.adapter.get([]) == []
    assert tier.adapter.stats.hits == 0


async def test_delete_removes_the_object(tier: Tier) -> None:
    names = [chunk(i) for i in range(8)]
    await tier.adapter.put([L2Object(n, payload(1000, i)) for i, n in enumerate(names)])
    assert await tier.adapter.delete(names[:4]) == [not tier.fails(n) for n in names[:4]]
    got = await tier.adapter.get(names)
    assert got[:4] == [None] * 4
    assert got[4:] == [_expected(tier, n, payload(1000, i + 4)) for i, n in enumerate(names[4:])]
    assert not any(tier.stored(n) for n in names[:4])


async def test_tenants_are_separate(tier: Tier) -> None:
    names = [chunk(i, tenant) for i in range(6) for tenant in ("tenant-a", "tenant-b")]
    await tier.adapter.put([L2Object(n, payload(500, n.tenant)) for n in names])
    got = await tier.adapter.get(names)
    assert got == [_expected(tier, n, payload(500, n.tenant)) for n in names]
    tenant_a = [n for n in names if n.tenant == "tenant-a"]
    await tier.adapter.delete(tenant_a)
    got = await tier.adapter.get(names)
    assert got == [
        None if n.tenant == "tenant-a" else _expected(tier, n, payload(500, n.tenant))
        for n in names
    ]


async def test_a_corrupt_object_is_a_counted_miss(tier: Tier) -> None:
    names = [n for n in (chunk(i) for i in range(20)) if not tier.fails(n)][:2]
    for size, name in zip((0, 3000), names, strict=True):
        assert await tier.adapter.put([L2Object(name, payload(size))]) == [True]
        tier.corrupt(name)
    assert await tier.adapter.get(names) == [None, None]
    assert tier.adapter.stats.integrity_failures == 2
    assert tier.adapter.stats.hits == 0
    kept = not tier.drops_bad_objects
    assert [tier.stored(n) for n in names] == [kept, kept]
    assert await tier.adapter.exists(names) == [kept, kept]


async def test_a_truncated_or_renamed_object_is_a_miss(tier: Tier) -> None:
    """Renamed: copied verbatim under another chunk key, and with its header's key rewritten
    to match (what a checksum alone would serve)."""
    source, truncated, copied, forged = [
        n for n in (chunk(i) for i in range(40)) if not tier.fails(n)
    ][:4]
    await tier.adapter.put(
        [L2Object(n, payload(5000, n.key.hex())) for n in (source, truncated, copied, forged)]
    )
    tier.write(truncated, tier.read(truncated)[:-1])
    blob = tier.read(source)
    tier.write(copied, blob)
    key_at = blob.index(source.key)
    tier.write(forged, blob[:key_at] + forged.key + blob[key_at + len(forged.key) :])
    assert await tier.adapter.get([truncated, copied, forged, source]) == [
        None,
        None,
        None,
        payload(5000, source.key.hex()),
    ]
    assert tier.adapter.stats.integrity_failures == 3
    assert [tier.stored(n) for n in (truncated, copied, forged)] == [not tier.drops_bad_objects] * 3


async def test_put_is_idempotent(tier: Tier) -> None:
    names = [chunk(i) for i in range(4)]
    objects = [L2Object(n, payload(3000, i)) for i, n in enumerate(names)]
    first = await tier.adapter.put(objects)
    used = tier.adapter.stats.used_bytes
    assert await tier.adapter.put(objects) == first == [not tier.fails(n) for n in names]
    assert tier.adapter.stats.used_bytes == used
    assert await tier.adapter.get(names) == [
        _expected(tier, n, bytes(o.payload)) for n, o in zip(names, objects, strict=True)
    ]


async def test_names_outside_the_layout_are_refused_per_key(tier: Tier) -> None:
    good = next(n for n in (chunk(i) for i in range(20)) if not tier.fails(n))
    bad = [ObjectKey("../escape", good.key), ObjectKey(".hidden", good.key), chunk(1, "x" * 33)]
    bad.append(ObjectKey(good.tenant, good.key[:16]))
    objects = [L2Object(n, b"data") for n in [*bad, good]]
    assert await tier.adapter.put(objects) == [False] * len(bad) + [True]
    assert await tier.adapter.get([*bad, good]) == [None] * len(bad) + [b"data"]


async def test_concurrent_operations(tier: Tier) -> None:
    objects = [L2Object(chunk(i), payload(1000 * (i % 7) + i, i)) for i in range(64)]
    puts = await asyncio.gather(*(tier.adapter.put([o]) for o in objects[:32]))
    puts.append(await tier.adapter.put(objects[32:]))
    assert [ok for batch in puts for ok in batch] == [not tier.fails(o.name) for o in objects]
    gets = await asyncio.gather(
        *(tier.adapter.get([o.name]) for o in objects),
        tier.adapter.get([o.name for o in objects]),
    )
    expected = [_expected(tier, o.name, bytes(o.payload)) for o in objects]
    assert [one[0] for one in gets[:-1]] == expected
    assert gets[-1] == expected


async def test_drop_tenant_deletes_that_tenant_only(tier: Tier) -> None:
    # "tenant-ab" starts with "tenant-a": the drop must stop at the tenant's own prefix
    names = [chunk(i, tenant) for i in range(7) for tenant in ("tenant-a", "tenant-ab")]
    await tier.adapter.put([L2Object(n, payload(300, n.tenant)) for n in names])
    stored_a = [n for n in names if n.tenant == "tenant-a" and not tier.fails(n)]
    assert await tier.adapter.drop_tenant("tenant-a") == len(stored_a)
    assert not any(tier.stored(n) for n in names if n.tenant == "tenant-a")
    got = await tier.adapter.get(names)
    assert got == [
        None if n.tenant == "tenant-a" else _expected(tier, n, payload(300, n.tenant))
        for n in names
    ]
    assert await tier.adapter.drop_tenant("tenant-a") == 0  # idempotent
    if isinstance(tier.adapter, NvmeAdapter):  # and no empty directory of it is left
        assert not (tier.adapter.root / "tenant-a").exists()
    assert await tier.adapter.drop_tenant("never-stored") == 0
