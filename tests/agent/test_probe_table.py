"""The table of ready chunks that schedulers probe without a round trip: alone, and kept by a
real agent."""

from __future__ import annotations

import mmap
import os
import random
import stat
import struct
import threading
import time
from pathlib import Path

import httpx
import pytest

from kvpool.client import AgentClient
from kvpool.common.keys import tenant_id
from kvpool.common.probe_table import (
    BUCKET_BYTES,
    HEADER_BYTES,
    MAX_PROBE,
    TABLE_MODE,
    ProbeTableReader,
    ProbeTableWriter,
    table_path,
)
from kvpool.common.segment import SEGMENT_MODE
from tests.support.agent_process import ADMIN_TOKEN, AgentProcess
from tests.support.chunks import key
from tests.support.metrics import metric

pytestmark = pytest.mark.process

AGENT_ID = "a" * 32


def random_key(rng: random.Random) -> bytes:
    return rng.randbytes(32)


def test_the_reader_sees_exactly_what_is_published(tmp_path: Path) -> None:
    rng = random.Random(1)
    writer = ProbeTableWriter(tmp_path / "t.probe", 600, AGENT_ID)
    reader = ProbeTableReader(tmp_path / "t.probe", AGENT_ID)
    published: dict[bytes, str] = {}
    for step in range(5000):
        if published and rng.random() < 0.45:
            gone = rng.choice(list(published))
            writer.withdraw(gone)
            del published[gone]
        elif len(published) < 600:
            new = random_key(rng)
            tenant = f"tenant-{step % 3}"
            writer.publish(new, tenant)
            published[new] = tenant
    for chunk, tenant in published.items():
        assert reader.run(tenant, [chunk]) == 1
        assert reader.run("someone-else", [chunk]) == 0  # never another tenant's
    keys = list(published)[:5]
    tenants = {published[chunk] for chunk in keys}
    assert reader.run(published[keys[0]], [keys[0], random_key(rng), keys[1]]) == 1
    assert len(tenants) > 1 or reader.run(published[keys[0]], keys) == 5


def test_a_withdrawal_keeps_the_keys_after_it_reachable(tmp_path: Path) -> None:
    """Keys with the same home bucket probe on; removing one must not cut the run."""
    writer = ProbeTableWriter(tmp_path / "t.probe", 64, AGENT_ID)
    reader = ProbeTableReader(tmp_path / "t.probe", AGENT_ID)
    same_home = [bytes(8) + bytes([n]) * 24 for n in range(1, 7)]
    for chunk in same_home:
        writer.publish(chunk, "t")
    writer.withdraw(same_home[1])
    writer.withdraw(same_home[3])
    assert [reader.run("t", [chunk]) for chunk in same_home] == [1, 0, 1, 0, 1, 1]


def test_a_reader_refuses_another_agents_table(tmp_path: Path) -> None:
    ProbeTableWriter(tmp_path / "t.probe", 8, AGENT_ID)
    with pytest.raises(ValueError, match="another agent"):
        ProbeTableReader(tmp_path / "t.probe", "b" * 32)
    with pytest.raises(OSError):
        ProbeTableReader(tmp_path / "missing.probe", AGENT_ID)


def test_a_reader_racing_the_writer_never_finds_an_unpublished_key(tmp_path: Path) -> None:
    writer = ProbeTableWriter(tmp_path / "t.probe", 256, AGENT_ID)
    reader = ProbeTableReader(tmp_path / "t.probe", AGENT_ID)
    rng = random.Random(2)
    never = [random_key(rng) for _ in range(200)]
    stop = threading.Event()

    def churn() -> None:
        churn_rng, live = random.Random(3), []
        while not stop.is_set():
            if len(live) > 200 or (live and churn_rng.random() < 0.5):
                writer.withdraw(live.pop(churn_rng.randrange(len(live))))
            else:
                live.append(random_key(churn_rng))
                writer.publish(live[-1], "t")

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        for _ in range(200):
            assert all(reader.run("t", [chunk]) == 0 for chunk in never)
    finally:
        stop.set()
        thread.join()


def test_the_agent_keeps_its_table_to_the_ready_chunks(agent_process: AgentProcess) -> None:
    agent_process.start()
    with AgentClient(agent_process.zmq, token=ADMIN_TOKEN) as client:
        info = client.info
        assert info is not None
        path = table_path(info.segment_path)
        # the segment is the agent's alone, the table its group's (engines' schedulers) to
        # read; the umask plays no part
        assert stat.S_IMODE(os.stat(info.segment_path).st_mode) == SEGMENT_MODE == 0o600
        assert stat.S_IMODE(os.stat(path).st_mode) == TABLE_MODE == 0o640
        reader = ProbeTableReader(path, info.agent_id)
        tenant = tenant_id("probe-tenant")
        client.store(tenant, [key(1), key(2)], [b"x" * 100, b"y" * 100])
        assert reader.run(tenant, [key(1), key(2), key(3)]) == 2
        plan = client.prepare_store(tenant, [key(3)], [100])
        assert reader.run(tenant, [key(1), key(2), key(3)]) == 2  # reserved is not ready
        assert plan.lease is not None
        client.release(plan.lease)
        client.clear(tenant)
        assert reader.run(tenant, [key(1), key(2)]) == 0
    assert agent_process.stop() == 0
    assert not path.exists()  # a stopped agent leaves no table to mislead a scheduler


def test_a_key_with_no_free_bucket_near_its_home_is_counted_not_published(tmp_path: Path) -> None:
    writer = ProbeTableWriter(tmp_path / "t.probe", 512, AGENT_ID)  # 1024 buckets
    reader = ProbeTableReader(tmp_path / "t.probe", AGENT_ID)
    crowded = [bytes(8) + n.to_bytes(24, "big") for n in range(1, MAX_PROBE + 11)]  # one home
    assert [writer.publish(chunk, "t") for chunk in crowded] == [True] * MAX_PROBE + [False] * 10
    assert writer.full == 10
    assert [reader.run("t", [chunk]) for chunk in crowded] == [1] * MAX_PROBE + [0] * 10
    writer.withdraw(crowded[3])  # room near that home again
    assert writer.publish(crowded[-1], "t") and writer.full == 10
    assert reader.run("t", [crowded[-1]]) == 1 and reader.run("t", [crowded[3]]) == 0
    assert all(reader.run("t", [chunk]) for chunk in crowded[:MAX_PROBE] if chunk != crowded[3])
    writer.withdraw(crowded[-2])  # never published: nothing to withdraw
    assert sum(reader.run("t", [chunk]) for chunk in crowded) == MAX_PROBE


def test_crowded_homes_keep_every_published_key_reachable(tmp_path: Path) -> None:
    """Keys from a few neighbouring homes: long runs, refusals and shifts all happen; the
    reader finds exactly the keys whose publication the writer accepted, and no other."""
    rng = random.Random(4)
    writer = ProbeTableWriter(tmp_path / "t.probe", 256, AGENT_ID)  # 512 buckets
    reader = ProbeTableReader(tmp_path / "t.probe", AGENT_ID)
    held: set[bytes] = set()
    offered: set[bytes] = set()
    for _ in range(6000):
        if held and rng.random() < 0.45:
            gone = rng.choice(sorted(held))
            writer.withdraw(gone)
            held.discard(gone)
            offered.discard(gone)
        else:
            home = rng.choice((0, 3, 40, 70, 511)).to_bytes(8, "little")
            chunk = home + rng.randbytes(24)
            offered.add(chunk)
            if writer.publish(chunk, "t"):
                held.add(chunk)
    assert writer.full > 0
    assert {chunk for chunk in offered if reader.run("t", [chunk])} == held


SMALL = {"L1_SIZE": "1MiB", "PAGE_SIZE": "4096"}
"""256 pages: a table of 512 buckets (twice the pages, a power of two), MAX_PROBE of them
around any home."""
BOUND = 1.0
"""Seconds a request may take while the table is full (they take milliseconds)."""


def _store_and_ping(client: AgentClient, tenant: str, chunk: bytes) -> float:
    started = time.monotonic()
    assert client.store(tenant, [chunk], [b"k" * 100]) == 1
    assert client.ping()
    return time.monotonic() - started


def test_a_full_neighbourhood_stops_publishing_and_the_agent_still_serves(
    agent_process: AgentProcess,
) -> None:
    """Keys crafted to share a home bucket (a tenant chooses its tokens, so its keys): past
    MAX_PROBE of them, the table takes no more there; the agent says so in a metric and
    serves them through lookups."""
    agent_process.settings.update(SMALL)
    agent = agent_process.start()
    tenant = tenant_id("crowded")
    crowded = [bytes(8) + n.to_bytes(24, "big") for n in range(1, MAX_PROBE + 21)]
    with AgentClient(agent.zmq, token=ADMIN_TOKEN, timeout=2 * BOUND) as client:
        info = client.info
        assert info is not None
        reader = ProbeTableReader(table_path(info.segment_path), info.agent_id)
        slowest = max(_store_and_ping(client, tenant, chunk) for chunk in crowded)
        assert slowest < BOUND
        assert metric(agent, "kvpool_probe_table_full_total") == 20
        assert sum(reader.run(tenant, [chunk]) for chunk in crowded) == MAX_PROBE
        assert all(client.lookup(tenant, [chunk], lock=False).count == 1 for chunk in crowded)
        assert httpx.get(f"{agent.http}/healthz", timeout=BOUND).status_code == 200
        reader.close()
    assert agent_process.stop(timeout=15) == 0


def test_a_table_someone_filled_does_not_hang_the_agent(agent_process: AgentProcess) -> None:
    """Every bucket of the file holds a key the agent never published (written by whoever
    could write the file: before issue 27, any member of the group). The agent used to
    search for an empty bucket forever, holding the cache's lock: no answer on ZMQ or
    /healthz, SIGTERM ignored. Its own copy of the table decides now."""
    agent_process.settings.update(SMALL)
    agent = agent_process.start()
    tenant = tenant_id("filled")
    with AgentClient(agent.zmq, token=ADMIN_TOKEN, timeout=2 * BOUND) as client:
        info = client.info
        assert info is not None
        path = table_path(info.segment_path)
        with path.open("r+b") as handle, mmap.mmap(handle.fileno(), 0) as table:
            buckets = (len(table) - HEADER_BYTES) // BUCKET_BYTES
            assert buckets == 512
            for index in range(buckets):
                offset = HEADER_BYTES + index * BUCKET_BYTES
                table[offset : offset + BUCKET_BYTES] = struct.pack("<II32s", 0, 7, b"\xff" * 32)
        chunks = [key(f"filled-{n}") for n in range(40)]
        slowest = max(_store_and_ping(client, tenant, chunk) for chunk in chunks)
        assert slowest < BOUND
        assert all(client.lookup(tenant, [chunk], lock=False).count == 1 for chunk in chunks)
        reader = ProbeTableReader(path, info.agent_id)
        assert sum(reader.run(tenant, [chunk]) for chunk in chunks) == len(chunks)
        reader.close()
        assert metric(agent, "kvpool_probe_table_full_total") == 0
        assert httpx.get(f"{agent.http}/healthz", timeout=BOUND).status_code == 200
    assert agent_process.stop(timeout=15) == 0
