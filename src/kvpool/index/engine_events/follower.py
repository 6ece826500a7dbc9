"""Follow every model server's vLLM KV-events stream, in one thread.

vLLM's publisher binds a PUB socket (``--kv-events-config '{"endpoint": "tcp://*:5557"}'``)
and the index connects a SUB to each server's endpoint (``picker.servers[].kv_events``, or
``picker.kv_events_port`` of each discovered pod: :func:`event_endpoints`), subscribed to
every topic (each socket reaches one server). Each message's sequence number is checked per server:

* the next one: its events are applied (:class:`.chains.ServerChains`);
* one not above the last (vLLM restarted: its counter starts at 0 again, and a restart
  sends no ``AllBlocksCleared``): the server's state is dropped and followed anew;
* a jump (messages lost: the subscriber fell behind its high-water mark): with a replay
  endpoint (``kv_events_replay``), the missed batches are asked for (a DEALER to vLLM's
  ROUTER; live messages wait, bounded, meanwhile) and applied; without one, or when the
  replay does not reach back far enough or does not answer, the server's state is dropped
  and followed anew from the next message. Dropping is the safe side: a stale GPU entry
  would send requests to a pod that lost the prefix, a missing one only costs a hit.

A disconnection drops the server's state too (the pod may have restarted meanwhile), and
the socket reconnects ``reconnect_delay`` later (ZMQ would not by itself after a message
over ``max_message_bytes``, which is how it refuses one).

**Trust.** The index connects to the pods it routes to; what comes back describes that
pod's own GPU cache and is trusted for that alone. A compromised or buggy pod can only lie
about itself: claim prefixes it lacks (attract requests it then computes, as a slow pod
would) or hide what it holds (repel them). It cannot add or remove anything for another
server (its events only ever touch its own node), cannot make another salt's keys (the
keys are hashed here from the tokens and the salt it reports, and naming a salt only
places chains under that salt's keys, where the attacker's own pod is the only holder),
and cannot grow the index's memory past ``max_message_bytes`` per message and
``max_blocks_per_server`` blocks. Malformed messages are counted, logged at most once a
minute per server and kind, and never stop the thread.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvpool.common.index_config import PickerConfig
from kvpool.common.keys import ModelFingerprint
from kvpool.common.web.rate_limited_log import RateLimitedLog
from kvpool.index.engine_events.chains import (
    DEFAULT_MAX_BLOCKS,
    ChunkBlocks,
    ChunkSink,
    ServerChains,
)
from kvpool.index.follow_loop import FollowLoop
from kvpool.index.vllm_events import (
    END_SEQ,
    SEQ_BYTES,
    UndecodableEvent,
    WireError,
    decode_batch,
    decode_seq,
)

log = logging.getLogger(__name__)
_problems = RateLimitedLog(log)

DEFAULT_MAX_MESSAGE_BYTES = 16 << 20
"""Largest ZMQ message taken from a server (a larger one disconnects it)."""
DEFAULT_RECEIVE_HWM = 10_000
"""Messages queued per server before ZMQ drops them (a drop shows as a gap)."""
RECONNECT_DELAY = 1.0
"""Seconds from a disconnection to the next connection attempt."""
REPLAY_TIMEOUT = 5.0
"""Seconds a replay may take before the server's state is dropped instead."""
MAX_WAITING = 10_000
"""Live messages kept per server while a replay runs; past that, the replay is given up."""
_DRAIN = 256
"""Messages taken from one socket per loop turn, so one busy server cannot starve others."""

Sink = TypeVar("Sink", bound=ChunkSink)


@dataclass(frozen=True)
class EventEndpoint:
    """Where one model server publishes its KV events."""

    address: str
    """Its OpenAI server's ``ip:port``: its node name in the tracker, as the picker names it."""
    events: str
    """vLLM's KV-events endpoint (``tcp://ip:port``)."""
    replay: str | None = None
    """vLLM's replay endpoint, if it has one."""


def event_endpoints(addresses: Iterable[str], picker: PickerConfig) -> list[EventEndpoint]:
    """The KV-event endpoints of the servers at ``addresses`` (those discovery found): as
    ``picker.servers`` lists them (static), or ``picker.kv_events_port`` (and
    ``kv_events_replay_port``) of each address's host (kubernetes). Servers without one are
    left out: they have no GPU tier."""
    if picker.discovery == "static":
        listed = {server.address: server for server in picker.servers}
        return [
            EventEndpoint(address, server.kv_events, server.kv_events_replay)
            for address in addresses
            if (server := listed.get(address)) is not None and server.kv_events
        ]
    if picker.kv_events_port is None:
        return []
    found = []
    for address in addresses:
        host = address.rpartition(":")[0]  # [v6] keeps its brackets, as ZMQ wants them
        replay = picker.kv_events_replay_port
        found.append(
            EventEndpoint(
                address,
                f"tcp://{host}:{picker.kv_events_port}",
                None if replay is None else f"tcp://{host}:{replay}",
            )
        )
    return found


@dataclass(frozen=True)
class EngineStatus:
    """One followed server, for the index's status and metrics."""

    address: str
    endpoint: str
    connected: bool
    messages: int
    """Batches applied."""
    events: int
    """Events applied (stored, removed, cleared)."""
    blocks: int
    """GPU blocks the server holds now, as far as the index followed them."""
    chunks: int
    """kvpool chunk keys those blocks hold whole."""
    last_seq: int | None
    resets: int
    """Restarts seen (the sequence went back)."""
    gaps: int
    """Jumps in the sequence (messages lost)."""
    replays: int
    """Gaps recovered by vLLM's replay."""
    drops: int
    """Times the server's state was dropped to start over (gap, restart, disconnection, an
    undecodable batch)."""
    undecodable: int
    """Messages or events that did not decode (ignored)."""
    unplaced: int
    """Blocks stored under a parent the index does not know (it joined late)."""
    skipped: int
    """Blocks not followed (LoRA, multimodal, another group or medium, ...)."""
    capped: int
    """Blocks forgotten because the server was over its cap."""
    clears: int
    """Resets of vLLM's prefix cache (``AllBlocksCleared``)."""


@dataclass(eq=False)
class _Server:
    config: EventEndpoint
    sub: zmq.Socket[bytes]
    monitor: zmq.Socket[bytes]
    chains: ServerChains
    connected: bool = False
    last_seq: int | None = None
    """The last sequence number applied; None: none yet (take the next as the start)."""
    dealer: zmq.Socket[bytes] | None = None
    """The replay request in flight."""
    replay_deadline: float = 0.0
    reconnect_at: float | None = None
    """When to connect again after a disconnection (monotonic)."""
    waiting: list[tuple[int, bytes]] = field(default_factory=list)
    messages: int = 0
    events: int = 0
    resets: int = 0
    gaps: int = 0
    replays: int = 0
    drops: int = 0
    undecodable: int = 0

    @property
    def address(self) -> str:
        return self.config.address

    @property
    def endpoint(self) -> str:
        return self.config.events

    @property
    def replay_endpoint(self) -> str | None:
        return self.config.replay

    def status(self) -> EngineStatus:
        counts = self.chains.counts
        return EngineStatus(
            self.address,
            self.endpoint,
            self.connected,
            self.messages,
            self.events,
            self.chains.blocks,
            self.chains.chunks,
            self.last_seq,
            self.resets,
            self.gaps,
            self.replays,
            self.drops,
            self.undecodable,
            counts.unplaced,
            counts.skipped,
            counts.capped,
            counts.clears,
        )


class EngineEvents(FollowLoop[EventEndpoint, _Server], Generic[Sink]):
    """Keeps ``tracker`` (a :class:`~kvpool.index.tracker.PrefixTracker` of its own, whose
    nodes are the servers' addresses) in step with each followed server's GPU prefix
    cache, in kvpool chunk keys of ``fingerprint``."""

    def __init__(
        self,
        fingerprint: ModelFingerprint,
        tracker: Sink,
        *,
        max_blocks_per_server: int = DEFAULT_MAX_BLOCKS,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        receive_hwm: int = DEFAULT_RECEIVE_HWM,
        replay_timeout: float = REPLAY_TIMEOUT,
        reconnect_delay: float = RECONNECT_DELAY,
        on_chunk: ChunkBlocks | None = None,
    ) -> None:
        """``on_chunk`` hears each chunk's vLLM blocks (from the events thread)."""
        super().__init__("kvpool-engine-events")
        self.fingerprint = fingerprint
        self._on_chunk = on_chunk
        self.tracker = tracker
        self._max_blocks = max_blocks_per_server
        self._max_message_bytes = max_message_bytes
        self._receive_hwm = receive_hwm
        self._replay_timeout = replay_timeout
        self._reconnect_delay = reconnect_delay

    # ------------------------------------------------------------- interface

    def follow(self, servers: Iterable[EventEndpoint]) -> None:
        """Follow exactly these servers from now on (any thread; discovery calls it with
        :func:`event_endpoints`): a server no longer named has its chunks dropped, one
        whose endpoints changed is followed anew."""
        self._want({server.address: server for server in servers})

    def status(self) -> list[EngineStatus]:
        return [server.status() for server in self._followed.values()]

    # ------------------------------------------------------------------ loop

    def _config(self, state: _Server) -> EventEndpoint:
        return state.config

    def _deadlines(self, state: _Server) -> list[float]:
        deadlines = [state.replay_deadline] if state.dealer is not None else []
        if state.reconnect_at is not None:
            deadlines.append(state.reconnect_at)
        return deadlines

    def _serve_failed(self, name: str, state: _Server) -> None:
        _problems.exception(f"model server {name}: failed to follow")
        self._drop(state)

    def _forget(self, name: str, *, still_named: bool) -> None:
        self.tracker.drop_node(name)  # reopened elsewhere too: a new server, known anew
        log.info("no longer following the KV events of model server %s", name)

    def _serve(self, server: _Server, ready: dict[zmq.Socket[bytes], int]) -> None:
        if server.monitor in ready:
            self._on_monitor(server)
        if server.dealer is not None and server.dealer in ready:
            self._on_replay(server)
        if server.sub in ready:
            self._drain(server)
        now = time.monotonic()
        if server.dealer is not None and now > server.replay_deadline:
            self._replay_failed(server, "no answer in time")
        if server.reconnect_at is not None and now >= server.reconnect_at:
            server.reconnect_at = None
            with contextlib.suppress(zmq.ZMQError):  # not connected now: connect below
                server.sub.disconnect(server.endpoint)
            server.sub.connect(server.endpoint)

    def _open(self, config: EventEndpoint) -> _Server | None:
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, self._receive_hwm)
        sub.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
        sub.setsockopt(zmq.RECONNECT_IVL, 100)
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.IPV6, 1)  # a pod's IPv6 address too
        monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        try:
            sub.connect(config.events)
        except zmq.ZMQError as error:
            log.error(
                "model server %s: kv_events %r is not a ZMQ endpoint (%s); its GPU tier is "
                "not followed",
                config.address,
                config.events,
                error,
            )
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)
            return None
        log.info("following the KV events of model server %s at %s", config.address, config.events)
        chains = ServerChains(
            config.address,
            self.fingerprint,
            self.tracker,
            max_blocks=self._max_blocks,
            on_chunk=self._on_chunk,
        )
        return _Server(config, sub, monitor, chains)

    def _close(self, server: _Server) -> None:
        self._end_replay(server)
        server.sub.disable_monitor()
        server.monitor.close(linger=0)
        server.sub.close(linger=0)

    # --------------------------------------------------------------- messages

    def _on_monitor(self, server: _Server) -> None:
        while server.monitor.poll(0):
            event = recv_monitor_message(server.monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                server.connected = True
            elif event == zmq.EVENT_DISCONNECTED:
                server.connected = False
                self._end_replay(server)
                server.waiting = []
                self._drop(server)
                if server.reconnect_at is None:
                    server.reconnect_at = time.monotonic() + self._reconnect_delay

    def _drain(self, server: _Server) -> None:
        for _ in range(_DRAIN):
            try:
                frames = server.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3:
                self._undecodable(server, "a message not of 3 frames", f"{len(frames)} frames")
                continue
            try:
                seq = decode_seq(frames[1])
            except WireError as error:
                self._undecodable(server, "a bad sequence number", str(error))
                continue
            if server.dealer is None:
                self._on_message(server, seq, frames[2])
                continue
            server.waiting.append((seq, frames[2]))
            if len(server.waiting) > MAX_WAITING:
                self._replay_failed(server, "too many live messages meanwhile")

    def _on_message(self, server: _Server, seq: int, payload: bytes) -> None:
        last = server.last_seq
        if last is not None and seq <= last:
            server.resets += 1
            _problems.info(
                f"model server {server.address} restarted (its event numbers started over): "
                "following it anew"
            )
            self._drop(server)
            last = server.last_seq = -1  # the new process's first message is 0
        if last is not None and seq > last + 1:
            server.gaps += 1
            if server.replay_endpoint is not None:
                self._start_replay(server, last + 1)
                server.waiting.append((seq, payload))
                return
            _problems.warning(
                f"model server {server.address}: KV events lost (no replay endpoint); "
                "following it anew"
            )
            self._drop(server)
        self._apply(server, seq, payload)

    def _apply(self, server: _Server, seq: int, payload: bytes) -> None:
        server.last_seq = seq
        try:
            events = decode_batch(payload)
        except WireError as error:
            self._undecodable(server, "a batch that did not decode", str(error))
            self._drop(server)  # what it said is unknown: start over
            server.last_seq = seq
            return
        server.messages += 1
        for event in events:
            if isinstance(event, UndecodableEvent):
                self._undecodable(server, "an event that did not decode", event.error)
                continue
            server.events += 1
            server.chains.apply(event)

    def _undecodable(self, server: _Server, kind: str, detail: str) -> None:
        """Count and log (one line a minute per server and ``kind``: a fixed text, so that a
        pod cannot grow the log's memory of what it logged; the detail is logged at DEBUG)."""
        server.undecodable += 1
        _problems.warning(f"model server {server.address}: {kind}; ignored")
        log.debug("model server %s: %s: %s", server.address, kind, detail[:500])

    def _drop(self, server: _Server) -> None:
        """Forget the server's state: follow it anew from its next message."""
        server.drops += 1
        server.chains.clear()
        server.last_seq = None

    # ----------------------------------------------------------------- replay

    def _start_replay(self, server: _Server, start: int) -> None:
        assert server.replay_endpoint is not None
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
        dealer.setsockopt(zmq.IPV6, 1)
        try:
            dealer.connect(server.replay_endpoint)
        except zmq.ZMQError as error:
            dealer.close(linger=0)
            _problems.warning(
                f"model server {server.address}: kv_events_replay "
                f"{server.replay_endpoint!r} is not a ZMQ endpoint ({error})"
            )
            self._drop(server)
            return
        dealer.send_multipart([b"", start.to_bytes(SEQ_BYTES, "big")])
        server.dealer = dealer
        server.replay_deadline = time.monotonic() + self._replay_timeout

    def _on_replay(self, server: _Server) -> None:
        for _ in range(_DRAIN):
            dealer = server.dealer
            if dealer is None:
                return
            try:
                frames = dealer.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 4 or frames[0] != b"" or len(frames[2]) != SEQ_BYTES:
                self._replay_failed(server, "a malformed replay message")
                return
            if frames[2] == END_SEQ:
                self._replay_done(server)
                return
            seq = int.from_bytes(frames[2], "big")
            last = server.last_seq
            if last is None:
                continue  # given up meanwhile
            if seq <= last:
                continue
            if seq > last + 1:
                self._replay_failed(server, "the replay does not reach back to the gap")
                return
            self._apply(server, seq, frames[3])

    def _replay_done(self, server: _Server) -> None:
        last = server.last_seq
        if last is None or (server.waiting and server.waiting[0][0] > last + 1):
            # vLLM no longer has what was lost: asking again would get the same answer
            self._replay_failed(server, "the replay ended before the gap was filled")
            return
        server.replays += 1
        self._end_replay(server)
        self._flush(server)

    def _replay_failed(self, server: _Server, why: str) -> None:
        _problems.warning(
            f"model server {server.address}: replay of lost KV events failed ({why}); "
            "following it anew"
        )
        self._end_replay(server)
        self._drop(server)
        self._flush(server)

    def _flush(self, server: _Server) -> None:
        """Apply the live messages that waited for the replay (those it did not cover)."""
        waiting, server.waiting = server.waiting, []
        for seq, payload in waiting:
            if server.last_seq is None or seq > server.last_seq:
                self._on_message(server, seq, payload)
            if server.dealer is not None:  # another gap: the rest waits again
                server.waiting.extend(item for item in waiting if item[0] > seq)
                return

    def _end_replay(self, server: _Server) -> None:
        if server.dealer is not None:
            server.dealer.close(linger=0)
            server.dealer = None
