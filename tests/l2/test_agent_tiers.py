"""L2 through real agent processes: write-back, prefetch, restart, and sharing over S3."""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import boto3
import httpx
import pytest

from kvpool.agent.l2.codec import HEADER
from kvpool.client import AgentClient
from kvpool.common.keys import tenant_id
from tests.support.agent_process import ADMIN_TOKEN, AgentProcess
from tests.support.chunks import data, key
from tests.support.metrics import metric
from tests.support.polling import wait_until

from .faults import Fault, FaultProxy

pytestmark = pytest.mark.process

TENANT = tenant_id("l2-tenant")
CHUNK = 60_000  # one 64 KiB page each


def store_chain(client: AgentClient, names: list[int], parent: int | None = None) -> None:
    for start in range(0, len(names), 8):
        batch = names[start : start + 8]
        before = names[start - 1] if start else parent
        stored = client.store(
            TENANT,
            [key(n) for n in batch],
            [data(n) for n in batch],
            None if before is None else key(before),
        )
        assert stored == len(batch)


def load(client: AgentClient, names: list[int]) -> list[bytes]:
    """Retrieve with prefetch: what a connector does for an async load."""
    keys = [key(n) for n in names]
    hit, prefetch = client.lookup_prefetch(TENANT, keys)
    if hit.lease is not None:
        client.release(hit.lease)
    if prefetch:
        progress = client.prefetch_status(prefetch, wait_ms=4000)
        assert progress.done, progress
    return client.retrieve(TENANT, keys)


def test_chunks_pushed_out_of_l1_come_back_from_nvme(
    agents: Callable[..., AgentProcess], tmp_path: Path
) -> None:
    nvme = {"NVME__PATH": str(tmp_path / "nvme"), "NVME__CAPACITY": "64MiB"}
    agent = agents("a", L1_SIZE="8MiB", **nvme)  # 128 pages; write-back pins up to 2 MiB
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
        store_chain(client, list(range(20)))
        wait_until(lambda: metric(agent, "kvpool_writeback_written_total") >= 20)
        store_chain(client, list(range(100, 230)))  # other traffic pushes the first chain out
        assert client.lookup(TENANT, [key(0)], lock=False).count == 0
        wait_until(lambda: metric(agent, "kvpool_writeback_pending") == 0)  # pins released
        assert load(client, list(range(20))) == [data(n) for n in range(20)]
    assert metric(agent, "kvpool_prefetch_loaded_chunks_total") >= 20
    assert metric(agent, 'kvpool_l2_hits_total{tier="nvme"}') >= 20


def test_a_prefetch_of_a_prefix_no_tier_holds_ends_at_once_and_quietly(
    agents: Callable[..., AgentProcess], tmp_path: Path
) -> None:
    """The usual miss of a new prompt: the prefetch finds nothing in L2, loads nothing, and
    is not a failure (no traceback, no "a prefetch failed" line)."""
    agent = agents("a", NVME__PATH=str(tmp_path / "nvme"), NVME__CAPACITY="64MiB")
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
        hit, prefetch = client.lookup_prefetch(TENANT, [key(n) for n in range(4)])
        assert hit.count == 0 and prefetch
        progress = client.prefetch_status(prefetch, wait_ms=4000)
        assert progress.done and progress.expected == 0 and progress.loaded == 0, progress
    assert metric(agent, "kvpool_prefetch_loaded_chunks_total") == 0
    log = "".join(agent.log)
    assert "prefetch failed" not in log and "Traceback" not in log, log


def test_a_chain_that_fits_in_l1_keeps_its_whole_prefix_with_an_nvme_tier(
    agents: Callable[..., AgentProcess], tmp_path: Path
) -> None:
    """A chain past the high watermark but within L1: its tails go, never its head.

    128 one-page chunks of L1 (watermarks 115 and 102 pages): 102 chunks, then 16 more
    continuing them, as a prompt stored over several steps (8 chunks a step). Without L2
    tiers this keeps chunks 0..101; with an NVMe tier it once kept 16..117, so that a
    lookup from the prompt's start found nothing while 102 chunks sat in L1.

    The periodic check evicts towards the low watermark while L1 is past the high one;
    write-back pins released between two checks can leave it anywhere in between (a
    check that freed the released tails alone, down to 115 pages or fewer, is the last),
    so what stays is a whole prefix of 102 to 115 chunks.
    """
    nvme = {"NVME__PATH": str(tmp_path / "nvme"), "NVME__CAPACITY": "64MiB"}
    agent = agents("a", L1_SIZE="8MiB", MAINTENANCE_INTERVAL_SECONDS="0.2", **nvme)
    chain = list(range(118))
    page, low, high = 64 * 1024, 102, 115

    def held(client: AgentClient) -> list[int]:
        return [n for n in chain if client.lookup(TENANT, [key(n)], lock=False).count]

    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
        for first in range(0, len(chain), 8):  # paced so that write-back sheds nothing
            store_chain(client, chain[first : first + 8], parent=first - 1 if first else None)
            wait_until(lambda: metric(agent, "kvpool_writeback_pending") == 0)
        assert metric(agent, "kvpool_writeback_shed_total") == 0
        wait_until(lambda: client.stats()["allocated_bytes"] <= high * page)  # the check
        kept = len(held(client))
        assert low <= kept <= high
        assert held(client) == chain[:kept]
        # The tails come back from NVMe up to the high watermark (so that the periodic
        # check leaves them), after the whole prefix.
        assert load(client, chain[:high]) == [data(n) for n in chain[:high]]
        assert held(client) == chain[:high]
    assert metric(agent, "kvpool_prefetch_loaded_chunks_total") == high - kept


def test_a_chain_longer_than_l1_reaches_nvme_whole_and_its_head_comes_back_first(
    agents: Callable[..., AgentProcess], tmp_path: Path
) -> None:
    """160 one-page chunks through 128 of L1: the only case that may cut a chain's head.

    Every chunk still reaches NVMe, and loading the prompt's first 60 chunks back keeps
    all of them (the prefetch takes tails of the chain to make room, never its head).

    The stores alone make room: a periodic watermark check between two of them would take
    the chain's tails down to the low watermark, and the stores would never run short (so
    the head stayed whenever a loaded machine paced the stores slower than its period).
    """
    nvme = {"NVME__PATH": str(tmp_path / "nvme"), "NVME__CAPACITY": "64MiB"}
    agent = agents("a", L1_SIZE="8MiB", MAINTENANCE_INTERVAL_SECONDS="3600", **nvme)
    chain = list(range(160))
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
        for first in range(0, len(chain), 8):  # paced so that write-back sheds nothing
            store_chain(client, chain[first : first + 8], parent=first - 1 if first else None)
            wait_until(lambda: metric(agent, "kvpool_writeback_pending") == 0)
        assert metric(agent, "kvpool_writeback_written_total") == len(chain)
        assert client.lookup(TENANT, [key(0)], lock=False).count == 0
        assert load(client, chain[:60]) == [data(n) for n in chain[:60]]
        assert client.lookup(TENANT, [key(n) for n in chain], lock=False).count >= 60


def test_nvme_outlives_the_agent_and_its_segment(
    agents: Callable[..., AgentProcess], tmp_path: Path
) -> None:
    nvme = {"NVME__PATH": str(tmp_path / "nvme"), "NVME__CAPACITY": "64MiB"}
    agent = agents("a", **nvme)
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
        store_chain(client, list(range(10)))
    wait_until(lambda: metric(agent, "kvpool_writeback_pending") == 0)
    assert agent.stop() == 0
    agent.settings["L1_SIZE"] = "8MiB"  # another size: the segment starts empty
    agent.start()
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
        assert client.lookup(TENANT, [key(0)], lock=False).count == 0
        assert load(client, list(range(10))) == [data(n) for n in range(10)]


def test_a_chunk_stored_on_one_node_is_loaded_on_another(
    agents: Callable[..., AgentProcess], s3_endpoint: str, bucket: str, tmp_path: Path
) -> None:
    s3 = {
        "S3__BUCKET": bucket,
        "S3__ENDPOINT_URL": s3_endpoint,
        "S3__REGION": "us-east-1",
        "L2_KEY_DIR": str(tmp_path / "pool-keys"),  # the pool's key Secret, on both nodes
    }
    first, second = agents("node-1", **s3), agents("node-2", **s3)
    with AgentClient(first.zmq, token=ADMIN_TOKEN) as client:
        store_chain(client, list(range(6)))
    wait_until(lambda: metric(first, "kvpool_writeback_written_total") >= 6)
    with AgentClient(second.zmq, token=ADMIN_TOKEN) as client:
        assert load(client, list(range(6))) == [data(n) for n in range(6)]
        # and a salt that differs finds nothing
        assert client.lookup_prefetch(tenant_id("other"), [key(0)])[0].count == 0


def test_a_tenants_object_copied_under_another_tenant_is_a_miss_for_it(
    agents: Callable[..., AgentProcess], s3_endpoint: str, bucket: str
) -> None:
    """One pool key, two tenants: A's object copied to B's name, verbatim and with its header's
    tenant rewritten to B, is never served to B."""
    agent = agents("a", S3__BUCKET=bucket, S3__ENDPOINT_URL=s3_endpoint, S3__REGION="us-east-1")
    victim = tenant_id("tenant-b")
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
        store_chain(client, [0, 1])
        wait_until(lambda: metric(agent, "kvpool_writeback_written_total") >= 2)
    raw = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    for chunk, rewrite in ((0, False), (1, True)):
        source = next(
            o["Key"]
            for o in raw.list_objects_v2(Bucket=bucket)["Contents"]
            if o["Key"].endswith(key(chunk).hex())
        )
        blob = raw.get_object(Bucket=bucket, Key=source)["Body"].read()
        if rewrite:
            blob = blob.replace(TENANT.encode(), victim.encode(), 1)
        raw.put_object(Bucket=bucket, Key=source.replace(TENANT, victim), Body=blob)
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
        for chunk in (0, 1):
            hit, prefetch = client.lookup_prefetch(victim, [key(chunk)])
            assert hit.count == 0
            progress = client.prefetch_status(prefetch, wait_ms=4000)
            assert progress.done and progress.loaded == 0, progress
            assert client.retrieve(victim, [key(chunk)]) == []
    assert metric(agent, 'kvpool_l2_integrity_failures_total{tier="s3"}') == 2


def test_prefetched_chunks_count_against_the_tenant_quota(
    agents: Callable[..., AgentProcess], tmp_path: Path
) -> None:
    agent = agents("a", NVME__PATH=str(tmp_path / "nvme"), NVME__CAPACITY="64MiB")
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
        store_chain(client, list(range(10)))
        wait_until(lambda: metric(agent, "kvpool_writeback_written_total") >= 10)
        client.clear(TENANT)
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    limit = 4 * (CHUNK + HEADER.size) + 100  # 4 chunks and their NVMe files' headers
    quota = httpx.put(
        f"{agent.http}/v1/tenants/{TENANT}/quota", json={"limit_bytes": limit}, headers=admin
    )
    assert quota.status_code == 200
    # The NVMe tier shrinks to the new quota at once, not at the tenant's next put.
    wait_until(lambda: metric(agent, 'kvpool_l2_used_bytes{tier="nvme"}') <= limit)
    assert metric(agent, 'kvpool_l2_evictions_total{tier="nvme"}') == 6
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
        _, prefetch = client.lookup_prefetch(TENANT, [key(n) for n in range(10)])
        progress = client.prefetch_status(prefetch, wait_ms=4000)
        # Only the leading run the tier kept is usable, and it fits the quota whole.
        assert progress.done and progress.loaded == progress.expected <= 4
        hits = client.lookup(TENANT, [key(n) for n in range(10)], lock=False).count
        assert hits == progress.loaded
        usage = httpx.get(f"{agent.http}/v1/tenants/{TENANT}/usage", headers=admin).json()
        assert usage["used_bytes"] <= limit


def test_a_slow_l2_sheds_write_backs_without_slowing_stores(
    agents: Callable[..., AgentProcess], proxy: FaultProxy, bucket: str
) -> None:
    agent = agents(
        "a",
        S3__BUCKET=bucket,
        S3__ENDPOINT_URL=proxy.url,
        S3__REGION="us-east-1",
        WRITEBACK_QUEUE_CHUNKS="4",
    )
    proxy.inject(Fault.SLOW, delay=1.0)
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
        started = time.monotonic()
        store_chain(client, list(range(24)))
        assert time.monotonic() - started < 3  # 24 stores, each would wait 1 s on S3
    assert metric(agent, "kvpool_writeback_shed_total") >= 24 - 4 - 4  # queue 4, 4 workers
    proxy.clear()
    wait_until(lambda: metric(agent, "kvpool_writeback_pending") == 0)


def test_the_reused_policy_writes_back_after_enough_counted_hits(
    agents: Callable[..., AgentProcess], tmp_path: Path
) -> None:
    nvme = {"NVME__PATH": str(tmp_path / "nvme"), "NVME__CAPACITY": "64MiB"}
    agent = agents("a", STORE_POLICY="reused", STORE_MIN_HITS="2", **nvme)
    written = "kvpool_writeback_written_total"
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
        store_chain(client, [1, 2])
        client.lookup(TENANT, [key(1), key(2)], lock=False)  # one use
        for _ in range(3):  # repeated looks at the same use count nothing
            client.lookup(TENANT, [key(1), key(2)], lock=False, count=False)
        time.sleep(0.5)
        assert metric(agent, written) == 0, "written back before its second use"
        client.lookup(TENANT, [key(1)], lock=False)  # a second use of chunk 1 only
        wait_until(lambda: metric(agent, written) == 1)
        time.sleep(0.5)
        assert metric(agent, written) == 1  # chunk 2 was used once
    usage = httpx.get(
        f"{agent.http}/v1/tenants/{TENANT}/usage",
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
    ).json()
    assert (usage["hits"], usage["misses"]) == (3, 0)


@pytest.fixture
def own_agent(tmp_path: Path) -> Iterator[AgentProcess]:
    """An agent not started yet (set ``settings`` and ``umask`` first)."""
    workdir = tmp_path / "agent"
    workdir.mkdir()
    agent = AgentProcess(workdir, {"L1_SIZE": "4MiB"})
    yield agent
    agent.cleanup()


def test_the_nvme_tree_and_its_generated_key_are_the_agents_alone(
    own_agent: AgentProcess, tmp_path: Path
) -> None:
    """Under a umask of 0, as much as any: no other user lists the tree (tenant ids, chunk
    keys) or reads a file of it, nor the key beside it."""
    nvme = tmp_path / "nvme"
    keys = nvme / ".kvpool-keys" / "default"  # where the operator puts a node's own key
    own_agent.settings.update(
        {"NVME__PATH": str(nvme), "NVME__CAPACITY": "64MiB", "L2_KEY_DIR": str(keys)}
    )
    own_agent.umask = 0
    agent = own_agent.start()
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
        store_chain(client, list(range(6)))
    wait_until(lambda: metric(agent, "kvpool_writeback_written_total") >= 6)
    tree = nvme / "default"
    directories = [tree, *(p for p in tree.rglob("*") if p.is_dir()), keys, keys.parent]
    files = [p for p in tree.rglob("*") if p.is_file()]
    assert len(files) == 6
    assert {f"{stat.S_IMODE(p.stat().st_mode):04o}" for p in directories} == {"0700"}
    assert {f"{stat.S_IMODE(p.stat().st_mode):04o}" for p in [*files, keys / "1"]} == {"0600"}


def test_a_key_file_others_may_write_stops_the_agent_and_a_readable_one_is_warned_about(
    own_agent: AgentProcess, tmp_path: Path
) -> None:
    keys = tmp_path / "keys"
    keys.mkdir()
    key_file = keys / "1"
    key_file.write_bytes(b"k" * 64)
    key_file.chmod(0o664)  # the group could choose the pool's key
    nvme = {"NVME__PATH": str(tmp_path / "nvme"), "NVME__CAPACITY": "64MiB"}
    own_agent.settings.update({**nvme, "L2_KEY_DIR": str(keys)})
    own_agent.launch()
    assert own_agent.wait_refused() == 1
    (refusal,) = [line for line in own_agent.log if line.startswith("kvpool-agent:")]
    assert refusal.startswith(f"kvpool-agent: refusing L2 key file {key_file}:")
    assert f"(owner uid {os.geteuid()}, mode 0664)" in refusal
    assert "Traceback" not in "".join(own_agent.log)

    key_file.chmod(0o644)  # readable by every user: used, and said
    agent = own_agent.start()
    warnings = [line for line in agent.log if "is readable by every user" in line]
    assert len(warnings) == 1 and " WARNING " in warnings[0] and str(key_file) in warnings[0]
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
        store_chain(client, [0])
    wait_until(lambda: metric(agent, "kvpool_writeback_written_total") >= 1)
