"""The peer tier between real agents on two hosts (network namespaces, over veth): a chunk
cached on one host is a hit on the other, with no S3; and every fault (no credential, the
wrong tenant, wrong bytes, a peer that dies, stalls or is cut off, a tenant at its quota, a
busy or capped peer) is a miss or a slower hit, never wrong bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import get_args

import httpx
import pytest

from kvpool.agent.l2.base import ObjectKey
from kvpool.agent.l2.buffers import BufferPool
from kvpool.agent.l2.codec import SEALED, ObjectCodec
from kvpool.client import AgentClient
from kvpool.common.keyring import Keyring
from kvpool.common.keys import tenant_id
from kvpool.tools.bench.local.hosts import Hosts
from kvpool.tools.bench.local.peers import (
    LINK_ENVIRONMENT,
    TRANSPORTS,
    peer_settings,
    write_peer_key,
)
from tests.support.agent_process import ADMIN_TOKEN, AgentProcess
from tests.support.chunks import chain, data
from tests.support.index_process import ADMIN_TOKEN as INDEX_ADMIN
from tests.support.index_process import IndexProcess
from tests.support.metrics import metric
from tests.support.polling import eventually, wait_until
from tests.support.ports import free_port

from .rogue import Behaviour, RoguePeer
from .wire_reader import get_as_a_peer

pytestmark = [pytest.mark.process, pytest.mark.root, pytest.mark.netns]

TENANT = tenant_id("peer-tenant")
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
PORT = 7404
CHUNK = 60_000

Pool = Callable[..., list[AgentProcess]]


@pytest.fixture
def pool_key(tmp_path: Path) -> Path:
    """The pool's peer credential (the Secret every agent of the pool mounts)."""
    return write_peer_key(tmp_path / "pool-key")


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    """Every test here runs on each peer transport."""
    name: str = request.param
    return name


@pytest.fixture
def pool(hosts: Hosts, pool_key: Path, tmp_path: Path, transport: str) -> Iterator[Pool]:
    """``pool(*settings, extra=[...], environments=[...])``: one agent per host
    (``settings[i]`` its extra settings, ``environments[i]`` more of its environment) on
    ``transport``, each listing the others (and ``extra`` peers) as its peers."""
    started: list[AgentProcess] = []

    def start(
        *settings: dict[str, str],
        extra: tuple[str, ...] = (),
        environments: tuple[dict[str, str], ...] = (),
    ) -> list[AgentProcess]:
        entries = [f"host-{i}={host.address}:{PORT}" for i, host in enumerate(hosts.hosts)]
        agents = []
        for index, own in enumerate(settings):
            workdir = tmp_path / f"agent-{index}"
            workdir.mkdir()
            settings = peer_settings(
                f"host-{index}",
                PORT,
                pool_key,
                [*entries, *extra],
                PEERS__IO_TIMEOUT_SECONDS="2",
                PEERS__CONNECT_TIMEOUT_SECONDS="1",
                PEERS__TRANSPORT=transport,
            )
            agent = AgentProcess(
                workdir,
                {**settings, **own},
                host=hosts.hosts[index],
                environment={**LINK_ENVIRONMENT, **dict(enumerate(environments)).get(index, {})},
            )
            started.append(agent)
            agents.append(agent.start())
        return agents

    yield start
    for agent in started:
        agent.cleanup()


def store(
    agent: AgentProcess, keys: list[bytes], chunks: list[bytes], tenant: str = TENANT
) -> None:
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
        assert client.store(tenant, keys, chunks) == len(keys)


def pull(agent: AgentProcess, keys: list[bytes], tenant: str = TENANT) -> int:
    """A lookup that misses and prefetches, as the connector's; the chunks loaded into L1."""
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
        hit, prefetch = client.lookup_prefetch(tenant, keys, lock=False)
        assert hit.count == 0
        assert prefetch
        progress = client.prefetch_status(prefetch, wait_ms=20_000)
        assert progress.done
        return progress.loaded


def held(agent: AgentProcess, keys: list[bytes], tenant: str = TENANT) -> list[bytes]:
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
        return client.retrieve(tenant, keys)


def peers_of(agent: AgentProcess, probe: bool = False) -> dict[str, object]:
    answer = httpx.get(f"{agent.http}/v1/peers", params={"probe": probe}, headers=ADMIN)
    assert answer.status_code == 200, answer.text
    state: dict[str, object] = answer.json()
    return state


def test_a_chunk_stored_on_one_host_is_a_hit_on_the_other(pool: Pool, transport: str) -> None:
    first, second = pool({}, {})
    keys, chunks = chain("prompt", 6), [data(n, CHUNK) for n in range(5)] + [data(5, 3 << 20)]
    store(first, keys, chunks)
    assert pull(second, keys) == len(keys)
    assert held(second, keys) == chunks
    assert metric(second, 'kvpool_peer_fetched_chunks_total{peer="host-0"}') == len(keys)
    assert metric(first, "kvpool_peer_served_chunks_total") == len(keys)
    assert metric(second, 'kvpool_l2_hits_total{tier="peer"}') == len(keys)
    state = peers_of(second, probe=True)
    assert state["node"] == "host-1"
    (peer,) = state["peers"]  # type: ignore[misc]
    assert peer["node"] == "host-0" and peer["reachable"] is True and peer["rtt_ms"] > 0
    assert peer["transport"] == state["serving"]["transport"] == transport  # type: ignore[index]


def test_peers_that_restart_are_pulled_from_afresh(pool: Pool) -> None:
    """The serving agent restarts, then the pulling one: each time the next pull proves the
    credential again (and, on NIXL, lends a new landing to a new agent name) and hits; no
    connection, descriptor or landing of a previous process is used."""
    first, second = pool({}, {})
    chunks = [data(n, CHUNK) for n in range(2)]
    for round_, restarted in enumerate((None, first, second)):
        if restarted is not None:
            assert restarted.stop() == 0
            restarted.start()
        keys = chain(f"restart-{round_}", 2)
        store(first, keys, chunks)
        assert pull(second, keys) == len(keys)
        assert held(second, keys) == chunks


@pytest.mark.parametrize("transport", ["nixl"])
def test_an_agent_whose_nixl_cannot_start_moves_chunks_over_tcp_and_says_why(
    pool: Pool, transport: str
) -> None:
    """NIXL that fails to start (here: no plugin) is TCP's transport on that agent, named
    with the reason in ``/v1/peers``; its peers, on NIXL, still pull from it and serve it
    (their bodies cross the connection: it lends no landing and its hello offers none)."""
    first, second = pool({}, {}, environments=({"NIXL_PLUGIN_DIR": "/nonexistent"},))
    keys, chunks = chain("fallback", 2), [data(n, CHUNK) for n in range(2)]
    store(first, keys, chunks)
    assert pull(second, keys) == len(keys)
    back = chain("fallback-back", 1)
    store(second, back, chunks[:1])
    assert pull(first, back) == 1
    assert held(second, keys) == chunks and held(first, back) == chunks[:1]
    serving = peers_of(first)["serving"]
    assert serving["transport"] == "tcp"  # type: ignore[index]
    assert "NIXL did not start" in serving["transport_fallback"]  # type: ignore[index]
    assert peers_of(second)["serving"]["transport"] == "nixl"  # type: ignore[index]
    for agent in (first, second):
        assert peers_of(agent)["peers"][0]["transport"] == "tcp"  # type: ignore[index]
    assert any("peers.transport nixl: NIXL did not start" in line for line in first.log)


@pytest.mark.parametrize("protection", ["sealed", "integrity"])
def test_what_crosses_the_link_is_what_the_pool_protects(
    pool: Pool, hosts: Hosts, pool_key: Path, protection: str, transport: str
) -> None:
    """``peers.wire_protection`` of the sending agent: a proven peer asking for a chunk gets
    ciphertext (sealed) or the plaintext under its tag (integrity), in format 3 (AEGIS-128L)
    for a peer that opens it and in format 2 (AES-GCM) for one of an older build; the
    pulling agent opens each as the holder's bytes, checked against the tenant and key."""
    first, second = pool({"PEERS__WIRE_PROTECTION": protection}, {})
    keys, chunks = chain(f"wire-{protection}", 2), [data(n, CHUNK) for n in range(2)]
    store(first, keys, chunks)
    assert pull(second, keys) == len(keys)
    assert held(second, keys) == chunks
    address = f"{hosts.hosts[0].address}:{PORT}"
    sealed = protection == "sealed"
    codec = ObjectCodec(
        Keyring(pool_key, what="peer key"), "default", seal=False, buffers=BufferPool()
    )
    for formats, format_version in (("3", 3), ("none", 2)):
        header, body = _read_from_another_host(
            hosts, address, pool_key, keys[0], transport=transport, formats=formats
        )
        assert header[5] == format_version and bool(header[6] & SEALED) is sealed
        assert (body == chunks[0]) is not sealed
        assert bytes(codec.open(ObjectKey(TENANT, keys[0]), header, body)) == chunks[0]
    assert peers_of(first)["serving"]["wire_protection"] == protection  # type: ignore[index]


def _read_from_another_host(
    hosts: Hosts, address: str, key_dir: Path, key: bytes, *, transport: str, formats: str
) -> tuple[bytes, bytes]:
    """:func:`~tests.peer.wire_reader.get_as_a_peer` run in the second host."""
    reader = hosts.hosts[1].popen(
        [
            sys.executable,
            "-m",
            "tests.peer.wire_reader",
            address,
            str(key_dir),
            TENANT,
            *[key.hex(), transport, formats],
        ],
        env={**os.environ, **LINK_ENVIRONMENT},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = reader.communicate(timeout=60)
    assert reader.returncode == 0, err
    header, body = out.split()
    return bytes.fromhex(header), bytes.fromhex(body)


def test_a_slow_peer_gets_the_plaintext_it_asked_for_while_the_pages_go(
    pool: Pool, hosts: Hosts, pool_key: Path
) -> None:
    """Under integrity, the chunk goes out as plaintext from its L1 pages, under a read
    lease held until it is sent, so that a peer that takes its time (here: reads nothing
    while the tenant's chunks are dropped and others are stored) still gets the chunk it
    asked for, whole, under its tag: the drop frees its pages only once it is sent."""
    (holder,) = pool({"PEERS__WIRE_PROTECTION": "integrity", "L1_SIZE": "128Mi"})
    key, chunk = chain("slow-reader", 1)[0], data(7, 24 << 20)  # more than the link buffers
    store(holder, [key], [chunk])

    def churn() -> None:
        time.sleep(0.5)  # the holder is blocked in its send by now
        answer = httpx.post(f"{holder.http}/v1/clear", headers=ADMIN, timeout=30)
        assert answer.status_code == 200, answer.text
        store(holder, chain("churn", 2), [data(8, 24 << 20), data(9, 24 << 20)])

    address = f"{hosts.hosts[0].address}:{PORT}"
    header, body = get_as_a_peer(address, pool_key, TENANT, key, meanwhile=churn)
    codec = ObjectCodec(
        Keyring(pool_key, what="peer key"), "default", seal=False, buffers=BufferPool()
    )
    assert bytes(codec.open(ObjectKey(TENANT, key), header, body)) == chunk
    assert held(holder, [key]) == []  # it was dropped while the peer read


def test_the_serving_agent_reads_its_nvme_when_l1_no_longer_holds_the_chunk(
    pool: Pool, tmp_path: Path
) -> None:
    nvme = {"NVME__PATH": str(tmp_path / "nvme"), "NVME__CAPACITY": "64Mi"}
    first, second = pool(nvme, {})
    keys, chunks = chain("on-disk", 3), [data(n, CHUNK) for n in range(3)]
    store(first, keys, chunks)
    deadline = time.monotonic() + 10
    while metric(first, "kvpool_writeback_written_total") < len(keys):
        assert time.monotonic() < deadline, "the write-back did not reach NVMe"
        time.sleep(0.05)
    cleared = httpx.post(f"{first.http}/v1/tenants/{TENANT}/clear", headers=ADMIN)
    assert cleared.status_code == 200, cleared.text
    assert pull(second, keys) == len(keys)
    assert held(second, keys) == chunks


def test_an_agent_without_the_pool_credential_gets_nothing(pool: Pool, tmp_path: Path) -> None:
    stranger = write_peer_key(tmp_path / "stranger-key")
    first, second = pool({}, {"PEERS__KEY_DIR": str(stranger)})
    keys = chain("secret-prompt", 2)
    store(first, keys, [data(n, CHUNK) for n in range(2)])
    assert pull(second, keys) == 0
    assert held(second, keys) == []
    assert metric(first, 'kvpool_peer_refused_total{reason="unproven"}') >= 1
    assert metric(first, "kvpool_peer_served_chunks_total") == 0
    (peer,) = peers_of(second)["peers"]  # type: ignore[misc]
    assert peer["reachable"] is False and "unproven" in peer["error"]


def test_a_peer_serves_a_chunk_only_under_the_tenant_that_stored_it(pool: Pool) -> None:
    first, second = pool({}, {})
    keys = chain("tenant-a-prompt", 2)
    store(first, keys, [data(n, CHUNK) for n in range(2)])
    other = tenant_id("another-team")
    assert pull(second, keys, tenant=other) == 0
    assert held(second, keys, tenant=other) == []
    assert metric(first, "kvpool_peer_served_chunks_total") == 0


def test_a_tenant_at_its_quota_on_the_receiving_host_pulls_no_further(pool: Pool) -> None:
    first, second = pool({}, {})
    keys = chain("long-prompt", 8)
    store(first, keys, [data(n, CHUNK) for n in range(8)])
    quota = httpx.put(
        f"{second.http}/v1/tenants/{TENANT}/quota",
        json={"limit_bytes": 3 * 65536},  # three pages: three chunks
        headers=ADMIN,
    )
    assert quota.status_code == 200, quota.text
    assert pull(second, keys) == 3
    usage = httpx.get(f"{second.http}/v1/tenants/{TENANT}/usage", headers=ADMIN).json()
    assert usage["used_bytes"] <= 3 * 65536


ROGUES = [behaviour for behaviour in get_args(Behaviour) if behaviour != "unwritten"]
"""What a rogue peer can do on either transport."""


@pytest.mark.parametrize(
    ("transport", "behaviour"),
    [
        *((transport, behaviour) for transport in TRANSPORTS for behaviour in ROGUES),
        ("nixl", "unwritten"),  # a lie about a landing: the TCP transport has none
    ],
)
def test_wrong_or_missing_bytes_from_a_peer_are_a_miss_never_a_hit(
    pool: Pool, hosts: Hosts, pool_key: Path, behaviour: Behaviour, transport: str
) -> None:
    keys = chain(f"rogue-{behaviour}", 2)
    rogue = RoguePeer(
        behaviour,
        pool_key,
        hosts.hosts[1],
        data(0, CHUNK),
        pool_key.parent / "rogue",
        transport=transport,
    )
    try:
        (victim,) = pool({"PEERS__AGENTS": json.dumps([rogue.entry])})
        started = time.monotonic()
        assert pull(victim, keys) == 0
        assert time.monotonic() - started < 10  # a stalled peer is cut off (2 s io timeout)
        assert held(victim, keys) == []
        assert rogue.gets >= 1
        failures = 'kvpool_peer_fetch_failures_total{reason="%s"}'
        if behaviour.startswith(("other-tenant", "flipped")):
            assert metric(victim, failures % "integrity") >= 1
        elif behaviour == "unwritten":  # what the landing held: no chunk, or another one
            opened = metric(victim, failures % "integrity") + metric(victim, failures % "broken")
            assert opened >= 1
        else:
            reason = "timeout" if behaviour == "stall" else "broken"
            assert metric(victim, failures % reason) >= 1
    finally:
        rogue.close()


def test_a_rogue_peer_beside_an_honest_one_costs_a_retry_not_the_hit(
    pool: Pool, hosts: Hosts, pool_key: Path, tmp_path: Path, transport: str
) -> None:
    keys, chunks = chain("two-holders", 3), [data(n, CHUNK) for n in range(3)]
    rogue = RoguePeer(
        "flipped", pool_key, hosts.hosts[1], chunks[0], tmp_path / "rogue", transport=transport
    )
    try:
        first, second = pool({}, {}, extra=(rogue.entry,))
        store(first, keys, chunks)
        assert pull(second, keys) == len(keys)
        assert held(second, keys) == chunks
    finally:
        rogue.close()


def test_a_host_cut_off_is_a_miss_and_a_hit_again_once_back(pool: Pool, hosts: Hosts) -> None:
    first, second = pool({}, {})
    keys = chain("cut-off", 2)
    chunks = [data(n, CHUNK) for n in range(2)]
    store(first, keys, chunks)
    hosts.hosts[0].link_down()
    try:
        started = time.monotonic()
        assert pull(second, keys) == 0
        assert time.monotonic() - started < 10
    finally:
        hosts.hosts[0].link_up()
    # back once the link is: the first connection may wait out the neighbour's resolution
    wait_until(lambda: peers_of(second, probe=True)["peers"][0]["reachable"], timeout=15)  # type: ignore[index]
    assert pull(second, keys) == len(keys)
    assert held(second, keys) == chunks


def test_a_busy_peer_refuses_past_its_cap_and_the_puller_waits_its_turn(pool: Pool) -> None:
    """48 chunks: the first, then 3 runs of 16 asked at once (each on a connection of its
    own), of a peer that serves one transfer at a time."""
    first, second = pool({"PEERS__MAX_TRANSFERS": "1"}, {"PEERS__MAX_TRANSFERS": "8"})
    keys = chain("many", 48)
    chunks = [data(n, 1 << 20) for n in range(48)]
    for start in range(0, 48, 16):
        store(first, keys[start : start + 16], chunks[start : start + 16])
    assert pull(second, keys) == len(keys)
    assert held(second, keys) == chunks
    assert metric(first, 'kvpool_peer_refused_total{reason="busy"}') >= 1


def test_a_long_prefix_comes_whole_in_more_runs_than_the_puller_asks_at_once(
    pool: Pool,
) -> None:
    """160 chunks of 64 KiB: the first, then 3 pipelined runs (of 64, 64 and 31 chunks), at
    most 2 asked of the peer at once: a run whose turn has not come waits for it with no
    request slot held, so no run waits on one behind it (which would stall the prefix until
    the turn's timeout, past the pull's). The server answers the requests that came
    together together, and counts their bytes out of flight once sent."""
    first, second = pool({}, {"PEERS__MAX_TRANSFERS": "2"})
    keys = chain("long", 160)
    chunks = [data(n, 64 << 10) for n in range(160)]
    store(first, keys, chunks)
    assert pull(second, keys) == len(keys)
    assert held(second, keys) == chunks
    assert metric(second, 'kvpool_peer_fetched_chunks_total{peer="host-0"}') == len(keys)

    def none_in_flight() -> None:
        assert metric(first, "kvpool_peer_bytes_in_flight") == 0

    eventually(none_in_flight, timeout=5.0)


def test_the_bandwidth_cap_paces_what_a_peer_serves(pool: Pool) -> None:
    first, second = pool({"PEERS__BANDWIDTH": str(4 << 20)}, {})
    keys = chain("paced", 8)
    chunks = [data(n, 1 << 20) for n in range(8)]  # 8 MiB at 4 MiB/s: about 2 s
    store(first, keys, chunks)
    started = time.monotonic()
    assert pull(second, keys) == len(keys)
    assert time.monotonic() - started >= 1.5


def test_the_pool_index_says_which_peers_hold_a_prefix_and_failing_every_peer_is_asked(
    pool: Pool, hosts: Hosts, pool_key: Path, tmp_path: Path
) -> None:
    """With an index, only the peers it names are asked (a rogue peer it does not follow is
    not); while it is down, every peer is asked, and the rogue's bytes cost a retry."""
    keys, chunks = chain("located", 4), [data(n, CHUNK) for n in range(4)]
    rogue = RoguePeer("flipped", pool_key, hosts.hosts[1], chunks[0], tmp_path / "rogue")
    port = free_port()
    index_url = f"http://{hosts.root_address}:{port}"
    settings = {"PEERS__INDEX_URL": index_url}
    try:
        first, second = pool(settings, settings, extra=(rogue.entry,))
        index = IndexProcess(
            tmp_path / "index",
            {"host-0": first, "host-1": second},
            {"HOST": hosts.root_address, "HTTP_PORT": str(port), "PEER_KEY_DIR": str(pool_key)},
        )
        try:
            store(first, keys, chunks)
            wait_until(lambda: '"chunks":4' in index.get("/v1/nodes", INDEX_ADMIN), timeout=15)
            assert pull(second, keys[:2]) == 2
            assert rogue.asked == 0
            assert metric(second, 'kvpool_peer_index_lookups_total{result="answered"}') >= 1
        finally:
            assert index.stop() == 0
        assert pull(second, keys[2:]) == 2  # the index is gone: every peer is asked
        assert rogue.asked >= 1
        assert metric(second, 'kvpool_peer_index_lookups_total{result="failed"}') >= 1
        assert held(second, keys) == chunks
    finally:
        rogue.close()


def push(agent: AgentProcess, keys: list[bytes], node: str, tenant: str = TENANT) -> str | None:
    """What a disaggregated prefill's connector asks of its agent once the prompt is stored."""
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
        return client.push(tenant, keys, node)


def test_a_prefill_pushed_to_its_decodes_host_lands_there_unasked(pool: Pool) -> None:
    """The prefill's agent offers the prompt; the decode's agent pulls it into its L1 before
    any lookup there, and a lookup meanwhile joins the pull instead of starting its own."""
    first, second = pool({"PEERS__BANDWIDTH": str(1 << 20)}, {})  # 360 KB: about 0.35 s
    keys, chunks = chain("pushed", 6), [data(n, CHUNK) for n in range(6)]
    store(first, keys, chunks)

    assert push(first, keys, "host-1") is None
    with AgentClient(second.zmq, token=ADMIN_TOKEN) as decode:  # the decode's lookup
        hit, prefetch = decode.lookup_prefetch(TENANT, keys, lock=False)
        assert hit.count < len(keys) and prefetch
        assert decode.prefetch_status(prefetch, wait_ms=20_000).done

    eventually(lambda: _holds(second, keys, chunks), what="the pushed prompt on the decode host")
    assert metric(second, "kvpool_prefetch_started_total") == 1
    assert metric(second, "kvpool_prefetch_joined_total") == 1
    assert metric(first, 'kvpool_peer_offers_sent_total{outcome="accepted"}') == 1
    assert metric(second, 'kvpool_peer_offers_received_total{outcome="accepted"}') == 1
    assert metric(second, 'kvpool_peer_fetched_chunks_total{peer="host-0"}') == len(keys)
    assert push(first, keys, "host-1") is None  # offered again: nothing moves twice
    eventually(lambda: _offers_received(second, "present", 1))
    assert metric(second, 'kvpool_peer_fetched_chunks_total{peer="host-0"}') == len(keys)


def _holds(agent: AgentProcess, keys: list[bytes], chunks: list[bytes]) -> None:
    assert held(agent, keys) == chunks


def _offers_received(agent: AgentProcess, outcome: str, count: int) -> None:
    assert metric(agent, f'kvpool_peer_offers_received_total{{outcome="{outcome}"}}') == count


def test_a_pushed_prompt_lands_within_the_tenants_quota_on_the_decode_host(pool: Pool) -> None:
    first, second = pool({}, {})
    keys = chain("pushed-long", 8)
    chunks = [data(n, CHUNK) for n in range(8)]
    store(first, keys, chunks)
    quota = httpx.put(
        f"{second.http}/v1/tenants/{TENANT}/quota",
        json={"limit_bytes": 3 * 65536},  # three pages: three chunks
        headers=ADMIN,
    )
    assert quota.status_code == 200, quota.text

    assert push(first, keys, "host-1") is None

    eventually(lambda: _holds(second, keys[:3], chunks[:3]), what="the quota's worth")
    time.sleep(0.5)  # the pull stopped at the quota: nothing more comes
    assert held(second, keys) == chunks[:3]
    usage = httpx.get(f"{second.http}/v1/tenants/{TENANT}/usage", headers=ADMIN).json()
    assert usage["used_bytes"] <= 3 * 65536


def test_a_push_to_no_peer_or_a_dead_one_is_lost_never_wrong(pool: Pool, hosts: Hosts) -> None:
    """An unknown node is said at once; a peer that is down costs the offer (counted), and
    the decode's own lookup pulls later, as without offers."""
    first, second = pool({}, {})
    keys, chunks = chain("pushed-nowhere", 2), [data(n, CHUNK) for n in range(2)]
    store(first, keys, chunks)
    assert push(first, keys, "host-9") == "no peer on node 'host-9'"
    assert push(first, keys, "host-0") == "the decode runs on this agent's node: nothing to send"
    assert push(first, chain("never-stored", 2), "host-1") == "none of the chunks is here"
    hosts.hosts[1].link_down()
    try:
        assert push(first, keys, "host-1") is None  # sent in the background
        eventually(
            lambda: _offers_sent(first, "failed", 1), timeout=10, what="the failed offer counted"
        )
    finally:
        hosts.hosts[1].link_up()
    assert held(second, keys) == []
    wait_until(lambda: peers_of(second, probe=True)["peers"][0]["reachable"], timeout=15)  # type: ignore[index]
    assert pull(second, keys) == len(keys)


def _offers_sent(agent: AgentProcess, outcome: str, count: int) -> None:
    assert metric(agent, f'kvpool_peer_offers_sent_total{{outcome="{outcome}"}}') == count
