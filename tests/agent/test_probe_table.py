"""The table of ready chunks that schedulers probe without a round trip: alone, and kept by a
real agent."""

from __future__ import annotations

import os
import random
import stat
import threading
from pathlib import Path

import pytest

from kvpool_agent.client import AgentClient
from kvpool_agent.keys import tenant_id
from kvpool_agent.probe_table import TABLE_MODE, ProbeTableReader, ProbeTableWriter, table_path
from kvpool_agent.segment import SEGMENT_MODE
from kvpool_agent.testing.agent_process import AgentProcess
from tests.support.chunks import key

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
    with AgentClient(agent_process.zmq) as client:
        info = client.info
        assert info is not None
        path = table_path(info.segment_path)
        # the connectors' group maps the segment read-write and reads the table; the umask
        # plays no part
        assert stat.S_IMODE(os.stat(info.segment_path).st_mode) == SEGMENT_MODE == 0o660
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
