"""The peer port against connections that never prove the pool's credential, between real
agents on this machine (each its own peer port on 127.0.0.1; the attacker another address,
127.0.0.2, as another host of the pool's network would be): however many connect and
trickle their handshake a byte at a time, each is closed within the handshake's deadline
and the pool's own agents are served meanwhile, every request."""

from __future__ import annotations

import selectors
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvpool.agent.peer.serving import HANDSHAKE_SECONDS
from kvpool.agent.peer.wire import FRAME, MAGIC, MAX_META_BYTES, VERSION
from kvpool.tools.bench.local.peers import peer_settings, write_peer_key
from tests.support.agent_process import AgentProcess
from tests.support.chunks import chain, data
from tests.support.metrics import metric
from tests.support.polling import wait_until
from tests.support.ports import free_port

from .test_peer_tier import peers_of, pull, store

pytestmark = pytest.mark.process

ATTACKER = "127.0.0.2"
TRICKLE = FRAME.pack(MAGIC, VERSION, MAX_META_BYTES, 0) + bytes(MAX_META_BYTES)
"""What a trickling connection sends, a byte at a time: a frame header announcing the
largest message, then that message (the agent reads on while it comes)."""
SLACK = 2.0
"""Seconds a close may come after the deadline on a loaded machine."""


@dataclass
class Trickler:
    """``count`` connections to the peer port at ``port`` from :data:`ATTACKER`, each sending
    one byte every ``every`` seconds; one the agent closes is opened again at the next byte,
    as an attacker would keep up the pressure."""

    port: int
    count: int
    every: float = 2.0
    opened: int = 0
    """Connections made so far."""
    lifetimes: list[float] = field(default_factory=list)
    """Of each connection the agent closed: seconds from its connect to the close."""
    _stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> Trickler:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        opened_at: dict[socket.socket, float] = {}
        sent: dict[socket.socket, int] = {}
        while not self._stop.is_set():
            for _ in range(self.count - len(opened_at)):
                connection = self._connect()
                if connection is not None:
                    opened_at[connection], sent[connection] = time.monotonic(), 0
                    selector.register(connection, selectors.EVENT_READ)
            for connection in list(opened_at):
                try:
                    connection.send(TRICKLE[sent[connection] : sent[connection] + 1])
                    sent[connection] += 1
                except OSError:
                    self._closed(connection, selector, opened_at)
            tick = time.monotonic() + self.every
            while (left := tick - time.monotonic()) > 0 and not self._stop.is_set():
                for key, _ in selector.select(timeout=min(left, 0.2)):
                    self._read(key.fileobj, selector, opened_at)  # type: ignore[arg-type]
        for connection in opened_at:
            connection.close()

    def _connect(self) -> socket.socket | None:
        try:
            connection = socket.create_connection(
                ("127.0.0.1", self.port), timeout=1.0, source_address=(ATTACKER, 0)
            )
        except OSError:
            return None
        connection.setblocking(False)
        self.opened += 1
        return connection

    def _read(
        self,
        connection: socket.socket,
        selector: selectors.BaseSelector,
        opened_at: dict[socket.socket, float],
    ) -> None:
        """Take what the agent says (its hello); at the end of the connection, note it."""
        try:
            if connection.recv(4096):
                return
        except BlockingIOError:
            return
        except OSError:
            pass
        self._closed(connection, selector, opened_at)

    def _closed(
        self,
        connection: socket.socket,
        selector: selectors.BaseSelector,
        opened_at: dict[socket.socket, float],
    ) -> None:
        self.lifetimes.append(time.monotonic() - opened_at.pop(connection))
        selector.unregister(connection)
        connection.close()


@dataclass
class Pair:
    served: AgentProcess
    """The agent whose peer port is attacked: it holds the chunks."""
    puller: AgentProcess
    """Its peer, which pulls them."""
    port: int
    """The served agent's peer port."""


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Pair]:
    key_dir = write_peer_key(tmp_path / "pool-key")
    ports = {"node-a": free_port(), "node-b": free_port()}
    agents = []
    for node, port in ports.items():
        workdir = tmp_path / node
        workdir.mkdir()
        others = [f"{name}=127.0.0.1:{other}" for name, other in ports.items() if name != node]
        # the agents' own probes and pulls connect within 3 s, not the default 1 s: once,
        # under a CI run's other worker (the cluster bench's servers), a probe's connect took
        # over a second with the machine's two cores busy, not with the trickling held up
        settings = peer_settings(node, port, key_dir, others, PEERS__CONNECT_TIMEOUT_SECONDS="3")
        agents.append(AgentProcess(workdir, settings))
    try:
        for agent in agents:
            agent.start()
        yield Pair(agents[0], agents[1], ports["node-a"])
    finally:
        for agent in agents:
            agent.cleanup()


def test_a_connection_that_trickles_its_handshake_is_closed_at_the_deadline(pair: Pair) -> None:
    with Trickler(pair.port, count=4) as trickler:
        wait_until(
            lambda: len(trickler.lifetimes) >= 4,
            timeout=HANDSHAKE_SECONDS + 2 * SLACK,
            what="the agent to close the trickling connections",
        )
    assert max(trickler.lifetimes[:4]) < HANDSHAKE_SECONDS + SLACK
    assert metric(pair.served, 'kvpool_peer_refused_total{reason="timeout"}') >= 4


def test_a_handshake_announcing_more_than_a_few_kib_is_closed_at_once(pair: Pair) -> None:
    with socket.create_connection(("127.0.0.1", pair.port), timeout=HANDSHAKE_SECONDS) as client:
        started = time.monotonic()
        client.sendall(FRAME.pack(MAGIC, VERSION, MAX_META_BYTES, 0))
        while client.recv(4096):  # the hello, then the end
            pass
        assert time.monotonic() - started < HANDSHAKE_SECONDS / 2
    assert metric(pair.served, 'kvpool_peer_refused_total{reason="malformed"}') == 1


@pytest.mark.parametrize("count", [64, 200])
def test_trickling_connections_do_not_keep_the_pools_agents_out(pair: Pair, count: int) -> None:
    """Every pull (over a kept connection) and every probe (a fresh handshake each) gets
    through while ``count`` connections trickle, 30 of 30, spread over longer than the
    handshake's deadline (while connections are dropped, time out and open again)."""
    keys = chain(f"under-attack-{count}", 30)
    chunks = [data(n, 60_000) for n in range(30)]
    with Trickler(pair.port, count) as trickler:
        wait_until(lambda: trickler.opened >= count, timeout=30, what=f"{count} connections")
        opened = trickler.opened
        for key, chunk in zip(keys, chunks, strict=True):
            next_round = time.monotonic() + (HANDSHAKE_SECONDS + trickler.every) / 30
            store(pair.served, [key], [chunk])
            assert pull(pair.puller, [key]) == 1
            peers = peers_of(pair.puller, probe=True)["peers"]
            assert isinstance(peers, list) and [peer["reachable"] for peer in peers] == [True]
            time.sleep(max(0.0, next_round - time.monotonic()))
        assert trickler.opened > opened  # dropped ones open again: it kept up the pressure
    assert metric(pair.served, "kvpool_peer_served_chunks_total") == 30
    if count > 8:  # more than one address may hold in its handshake: the oldest dropped
        assert metric(pair.served, 'kvpool_peer_refused_total{reason="handshakes"}') >= 1
