"""The peer side of the peer bench (:mod:`benchmarks.peer`): two agents on two hosts, the
holder (host A) with a tenant's chunks in its L1 and the puller (host B) whose only lower
tier is the holder, and the time the puller takes to pull them.

Both agents are configured as a pool's agents are (the agent's ``peers:`` section): static
discovery of both, each skipping its own entry; one key directory both read, standing for
the pool's peer credential; the default peer port on each host's own address. The chunks
reach the holder as an engine's would, stored through the client with the admin token. A
pull is what a connector's lookup does on a miss: ``lookup_prefetch`` of the keys on the
puller, timed until the prefetch reports every chunk loaded into its L1. Before each pull
the puller's L1 drops the tenant's chunks (untimed), the holder's keeps them.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvpool.client import AgentClient
from kvpool.common.keyring import generate_key
from kvpool.common.keys import tenant_id
from kvpool.common.names import DEFAULT_PEER_PORT
from kvpool.tools.bench.local.hosts import Host
from kvpool.tools.bench.local.peers import LINK_ENVIRONMENT
from tests.support.agent_process import ADMIN_TOKEN, AgentProcess

POOL = "bench-peer"
HOLDER = "host-a"
PULLER = "host-b"
"""The agents' node names."""
TENANT = tenant_id("bench-peer")
BATCH = 8
"""Chunks per store on the holder, as a connector stores a step's."""
_ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
PULL_SECONDS = 300.0
"""A pull not done by then is an error (the prefetch stalled)."""


def keys(size: int, count: int) -> list[bytes]:
    """The keys of ``count`` chunks of ``size`` bytes (other sizes, other keys)."""
    return [hashlib.sha256(b"%d-%d" % (size, index)).digest() for index in range(count)]


def chunk(size: int, index: int) -> bytes:
    """Chunk ``index`` of ``size`` bytes: distinct chunks, cheap to make again for the
    check (rotations of one random block)."""
    block = _block(size)
    turn = index % size
    return block[turn:] + block[:turn]


@functools.cache
def _block(size: int) -> bytes:
    return random.Random(size).randbytes(size)


@dataclass
class PeerPair:
    """Clients (admin) of the two agents, and their pids."""

    holder: AgentClient
    puller: AgentClient
    pids: tuple[int, int]
    urls: tuple[str, str]
    """Their HTTP APIs."""
    logs: tuple[list[str], list[str]]
    """Their logs' lines so far."""

    def hold(self, size: int, count: int) -> None:
        """Store ``count`` chunks of ``size`` into the holder's L1, as one prompt's chain."""
        names = keys(size, count)
        for start in range(0, count, BATCH):
            batch = range(start, min(start + BATCH, count))
            stored = self.holder.store(
                TENANT,
                [names[index] for index in batch],
                [chunk(size, index) for index in batch],
                names[start - 1] if start else None,
            )
            if stored != len(batch):
                raise SystemExit(f"the holder (host A) stored {stored} of {len(batch)} chunks")

    def pull(self, size: int, count: int) -> float:
        """Seconds from the puller's lookup to its prefetch done, every chunk loaded."""
        names = keys(size, count)
        self.puller.clear(TENANT)
        started = time.perf_counter()
        hit, prefetch = self.puller.lookup_prefetch(TENANT, names, lock=False)
        loaded, done = 0, False
        while prefetch and not done and time.perf_counter() - started < PULL_SECONDS:
            progress = self.puller.prefetch_status(prefetch, wait_ms=4000)
            loaded, done = progress.loaded, progress.done
        seconds = time.perf_counter() - started
        if hit.count or loaded != count:
            raise SystemExit(
                f"the puller (host B) hit {hit.count} and loaded {loaded} of {count} chunks "
                f"of {size} bytes"
                + ("" if prefetch else ": it started no prefetch")
                + f"; what the agents say of their peers: {self._peers()}"
                + f"; what they logged of it: {self._warnings()}"
            )
        return seconds

    def _peers(self) -> str:
        """Both agents' ``GET /v1/peers`` (what failed, what was refused), for an error."""
        said = {}
        for who, url in zip(("holder", "puller"), self.urls, strict=True):
            try:
                answer = httpx.get(f"{url}/v1/peers", headers=_ADMIN, timeout=5)
                said[who] = answer.json()
            except (httpx.HTTPError, ValueError) as error:
                said[who] = f"unreadable: {error}"
        return json.dumps(said)

    def _warnings(self) -> str:
        """The last warnings and errors both agents logged, for an error."""
        said = {}
        for who, log in zip(("holder", "puller"), self.logs, strict=True):
            said[who] = [line.strip() for line in log if " WARNING " in line or " ERROR " in line]
        return json.dumps({who: lines[-10:] for who, lines in said.items()})

    def pulled_intact(self, size: int, count: int) -> bool:
        """Whether the chunks in the puller's L1 are the holder's, byte for byte."""
        got = self.puller.retrieve(TENANT, keys(size, count))
        return len(got) == count and all(
            data == chunk(size, index) for index, data in enumerate(got)
        )


def peers_setting(
    node: str,
    nodes: dict[str, Host],
    key_dir: Path,
    *,
    port: int = DEFAULT_PEER_PORT,
    wire_protection: str = "sealed",
    transport: str = "tcp",
    max_transfers: int | None = None,
) -> str:
    """The ``PEERS`` setting (JSON) of agent ``node`` among ``nodes`` (node name: its host),
    each on peer port ``port`` over ``transport``, under the credential in ``key_dir``
    (``max_transfers``: the agent's default where None)."""
    agents = [f"{name}={host.address}:{port}" for name, host in nodes.items()]
    setting = {
        "key_dir": str(key_dir),
        "node": node,
        "agents": agents,
        "port": port,
        "wire_protection": wire_protection,
        "transport": transport,
    }
    if max_transfers is not None:
        setting["max_transfers"] = max_transfers
    return json.dumps(setting)


@contextlib.contextmanager
def peer_pair(
    holder: Host,
    puller: Host,
    workdir: Path,
    *,
    holder_l1: int,
    puller_l1: int,
    port: int = DEFAULT_PEER_PORT,
    wire_protection: str = "sealed",
    transport: str = "tcp",
    max_transfers: int | None = None,
) -> Iterator[PeerPair]:
    """The two agents, started (L1 sizes in bytes) on peer port ``port``, sending chunks
    with ``wire_protection`` over ``transport``, each serving ``max_transfers`` at once
    (None: the default); stopped on exit."""
    workdir.mkdir(parents=True)
    key_dir = workdir / "peer-keys"
    generate_key(key_dir)
    nodes = {HOLDER: holder, PULLER: puller}
    with contextlib.ExitStack() as stack:
        started: list[AgentProcess] = []
        for (node, host), l1 in zip(nodes.items(), (holder_l1, puller_l1), strict=True):
            peers = peers_setting(
                node,
                nodes,
                key_dir,
                port=port,
                wire_protection=wire_protection,
                transport=transport,
                max_transfers=max_transfers,
            )
            settings = {"POOL": POOL, "L1_SIZE": str(l1), "PEERS": peers}
            home = workdir / f"{node}-{transport}-{wire_protection}"  # segments: named after it
            home.mkdir()
            agent = AgentProcess(home, settings, host=host, environment=LINK_ENVIRONMENT)
            stack.callback(agent.cleanup)
            started.append(agent.start())
        holding, pulling = started
        yield PeerPair(
            stack.enter_context(AgentClient(holding.zmq, token=ADMIN_TOKEN, timeout=30)),
            stack.enter_context(AgentClient(pulling.zmq, token=ADMIN_TOKEN, timeout=30)),
            (holding.pid, pulling.pid),
            (holding.http, pulling.http),
            (holding.log, pulling.log),
        )
