"""Follow the chunk events of many agents and keep the tracker in step with each of them.

One thread serves every agent: a SUB socket on the agent's event endpoint
(:mod:`kvpool.agent.edge.events`) and, while resynchronising, a DEALER on its ZMQ
protocol endpoint. Per agent the subscriber is in one of two states::

    following ──(gap | new agent id | (re)connected)──► resyncing
        ▲                                                   │ hello → snapshot
        └──────────── snapshot applied, buffered events ◄───┘ (retried with backoff)

* **following**: an event with ``seq == last + 1`` from the same agent id is
  applied; an older ``seq`` is already reflected and skipped.
* **resync** starts when ``seq`` jumps (the subscriber fell behind and PUB
  dropped messages, or the connection was down), when the agent id changes
  (the agent restarted), and whenever the SUB socket (re)connects (a restarted
  or unreachable agent that publishes nothing is still caught up). The
  subscriber says ``hello`` and asks for a ``snapshot`` (after a (re)connection,
  ``settle`` seconds later, so that the agent has the subscription before it
  takes the snapshot); events that arrive meanwhile are buffered (bounded; what
  overflows shows up as a gap later).
  The snapshot replaces the node's keys in the tracker; buffered events of the
  same agent with a later ``seq`` are then applied in order.
* While resynchronising, queries still see the node's previous keys: stale
  for a moment, never empty.

Both connections carry the index's token (an index's or an admin's token of the pool):
in ``hello``, and as the PLAIN password of the SUB socket; an agent that refuses it is
logged once per connection attempt's failure and retried like an unreachable one.

Events are routed by their ``tier`` into one sink per tier followed: ``sink`` for L1 (what
a node serves from its segment: the lookups and routes), and ``tiers`` for the lower ones,
each keyed by the node whose agent published it:

* ``nvme``: what the node's NVMe files hold. The snapshot lists them (an agent that
  predates tier events lists none and publishes none: its NVMe stays unknown, empty).
* ``s3``: what the node's agent wrote back to the pool's bucket (which any node can load).
  Agents keep no list of the bucket, so the snapshot has none: a resync keeps what the
  events taught (the objects outlive gaps and agent restarts), and an index that restarts
  learns S3 again from new write-backs. A removal from S3 (a delete, a tenant's drop by
  any agent) removes the keys from every node's entry: the bucket is one.

Tiers not followed are skipped but still count in the sequence. Agents leave through
:meth:`EventSubscriber.follow` (discovery says the pod is gone): their keys are dropped
from every tier's sink.
"""

from __future__ import annotations

import enum
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvpool.common import protocol as p
from kvpool.common.kube.discovery import AgentEndpoint
from kvpool.common.web.rate_limited_log import RateLimitedLog
from kvpool.index.follow_loop import FollowLoop

log = logging.getLogger(__name__)
_failures = RateLimitedLog(log)
"""A failure that recurs on every poll logs one traceback a minute per node."""

TRACKED_TIER = p.TIER_L1
"""The tier of ``sink``, which lookups and routes answer from."""
LISTED_TIERS = frozenset({p.TIER_NVME})
"""Lower tiers whose keys a snapshot carries (others are learned from events only)."""
SHARED_TIERS = frozenset({p.TIER_S3})
"""Lower tiers that every node shares: a removal there is a removal for every node."""
CLIENT_NAME = "kvpool-index"
_DRAIN_BATCH = 1024
"""Events taken from one agent per loop turn, so one busy agent cannot starve the others."""


class IndexSink(Protocol):
    """Where the subscriber writes (:class:`~kvpool.index.tracker.PrefixTracker`)."""

    def stored(self, node: str, keys: Sequence[bytes]) -> None: ...

    def removed(self, node: str, keys: Iterable[bytes]) -> None: ...

    def replace(self, node: str, keys: Iterable[bytes]) -> None: ...

    def drop_node(self, node: str) -> None: ...


class ResyncReason(enum.StrEnum):
    CONNECTED = "connected"
    """The event socket connected: first contact, or back after a disconnection."""
    RESTART = "restart"
    """An event came from a new agent id."""
    GAP = "gap"
    """Sequence numbers skipped: events were lost."""


@dataclass(frozen=True)
class AgentStatus:
    endpoint: AgentEndpoint
    agent_id: str | None
    seq: int
    """The last event applied (or the snapshot's)."""
    synced: bool
    """The tracker holds a snapshot of this agent plus every later event."""
    connected: bool
    events: int
    """Events applied since the agent was first followed."""
    resyncs: dict[str, int]
    """Resynchronisations started, by :class:`ResyncReason`."""
    snapshot_failures: int
    """Hello or snapshot requests that failed or timed out (each is retried)."""
    last_event: float | None
    """Unix time of the last event received."""
    event_lag: float | None = None
    """Receive time minus publish time of the last event that carried one."""


@dataclass(eq=False)
class _Follower:
    endpoint: AgentEndpoint
    sub: zmq.Socket[bytes]
    monitor: zmq.Socket[bytes]
    dealer: zmq.Socket[bytes] | None = None
    session: int | None = None
    deadline: float = 0.0
    """Monotonic time a request in flight times out, or a failed one is retried."""
    backoff: float = 0.0
    resyncing: bool = False
    buffer: list[p.ChunkEvent] = field(default_factory=list)
    agent_id: str | None = None
    seq: int = 0
    synced: bool = False
    connected: bool = False
    refused: bool = False
    """The agent's events port refused the index's token (logged once until it accepts)."""
    events: int = 0
    resyncs: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ResyncReason, 0))
    snapshot_failures: int = 0
    last_event: float | None = None
    event_lag: float | None = None

    def status(self) -> AgentStatus:
        return AgentStatus(
            self.endpoint,
            self.agent_id,
            self.seq,
            self.synced,
            self.connected,
            self.events,
            dict(self.resyncs),
            self.snapshot_failures,
            self.last_event,
            self.event_lag,
        )


class EventSubscriber(FollowLoop[AgentEndpoint, _Follower]):
    def __init__(
        self,
        sink: IndexSink,
        *,
        token: str,
        tiers: Mapping[str, IndexSink] | None = None,
        snapshot_timeout: float = 10.0,
        max_backoff: float = 30.0,
        settle: float = 0.2,
        receive_hwm: int = 100_000,
        max_buffered_events: int = 100_000,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``sink`` follows L1; ``tiers`` the lower tiers by name (``nvme``, ``s3``), if any."""
        super().__init__("kvpool-index-events")
        lower = dict(tiers or {})
        unknown = sorted(set(lower) - set(p.TIERS) | set(lower) & {TRACKED_TIER})
        if unknown:
            raise ValueError(
                f"tiers: {', '.join(map(repr, unknown))} is not a lower tier; "
                f"they are {', '.join(t for t in p.TIERS if t != TRACKED_TIER)}"
            )
        self._sink = sink
        self._sinks: dict[str, IndexSink] = {TRACKED_TIER: sink, **lower}
        self._listed = sorted(LISTED_TIERS & set(lower))
        """The tiers a snapshot is asked to list."""
        self._token = token
        self._snapshot_timeout = snapshot_timeout
        self._max_backoff = max_backoff
        self._settle = settle
        self._receive_hwm = receive_hwm
        self._max_buffered = max_buffered_events
        self._clock = clock
        self._requests = itertools.count(1)

    # ------------------------------------------------------------- interface

    def follow(self, endpoints: Iterable[AgentEndpoint]) -> None:
        """Follow exactly these agents from now on (any thread; discovery calls this).

        One agent per node: of two endpoints for one node, the last one counts.
        """
        self._want({endpoint.node: endpoint for endpoint in endpoints})

    def caught_up(self) -> bool:
        """Whether the agents to follow have been named (by discovery) and the index holds a
        synchronised copy of every one of them."""
        return self._all_applied() and all(f.synced for f in self._followed.values())

    def status(self) -> list[AgentStatus]:
        return [follower.status() for follower in self._followed.values()]

    # ------------------------------------------------------------------ loop

    def _config(self, state: _Follower) -> AgentEndpoint:
        return state.endpoint

    def _deadlines(self, state: _Follower) -> list[float]:
        return [state.deadline] if state.resyncing else []

    def _serve_failed(self, name: str, state: _Follower) -> None:
        _failures.exception(f"node {name}: failed to handle its sockets")

    def _forget(self, name: str, *, still_named: bool) -> None:
        if still_named:
            return  # its new endpoint's snapshot replaces its chunks
        for sink in self._sinks.values():
            sink.drop_node(name)
        log.info("agent of node %s is gone; its chunks are dropped", name)

    def _serve(self, follower: _Follower, ready: dict[zmq.Socket[bytes], int]) -> None:
        if follower.monitor in ready:
            self._on_monitor(follower)
        if follower.sub in ready:
            self._drain(follower)
        if follower.dealer is not None and follower.dealer in ready:
            self._on_reply(follower)
        if follower.resyncing and follower.deadline <= time.monotonic():
            if follower.dealer is not None:
                self._failed(follower, f"no answer within {self._snapshot_timeout}s")
            else:
                self._send_hello(follower)

    def _open(self, endpoint: AgentEndpoint) -> _Follower:
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, self._receive_hwm)
        sub.setsockopt(zmq.RECONNECT_IVL, 100)
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        sub.setsockopt(zmq.SUBSCRIBE, p.EVENTS_TOPIC)
        sub.setsockopt(zmq.PLAIN_USERNAME, CLIENT_NAME.encode())
        sub.setsockopt(zmq.PLAIN_PASSWORD, self._token.encode())
        monitor = sub.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        )
        sub.connect(endpoint.events)
        log.info("following agent of node %s at %s", endpoint.node, endpoint.events)
        return _Follower(endpoint, sub, monitor)

    def _close(self, follower: _Follower) -> None:
        self._end_request(follower)
        follower.sub.disable_monitor()
        follower.monitor.close(linger=0)
        follower.sub.close(linger=0)

    # ---------------------------------------------------------------- events

    def _on_monitor(self, follower: _Follower) -> None:
        while follower.monitor.poll(0):
            event = recv_monitor_message(follower.monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                follower.connected, follower.refused = True, False
                self._resync(follower, ResyncReason.CONNECTED)
            elif event == zmq.EVENT_DISCONNECTED:
                follower.connected = False
            elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH and not follower.refused:
                follower.refused = True  # logged once, until a handshake succeeds
                log.error(
                    "node %s refused the index's token on its events port %s: give the index "
                    "an index token of the pool (agent_token_file)",
                    follower.endpoint.node,
                    follower.endpoint.events,
                )

    def _drain(self, follower: _Follower) -> None:
        for _ in range(_DRAIN_BATCH):
            try:
                topic, body = follower.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except ValueError:
                log.warning("node %s: an event not in two frames, ignored", follower.endpoint.node)
                continue
            if topic != p.EVENTS_TOPIC:
                continue
            try:
                event = p.decode_event(body)
            except msgspec.MsgspecError as error:
                log.warning("node %s: undecodable event ignored: %s", follower.endpoint.node, error)
                continue
            follower.last_event = now = self._clock()
            if event.time:
                follower.event_lag = max(0.0, now - event.time)
            self._on_event(follower, event)

    def _on_event(self, follower: _Follower, event: p.ChunkEvent) -> None:
        if follower.resyncing:
            if len(follower.buffer) < self._max_buffered:
                follower.buffer.append(event)
            return
        if event.agent != follower.agent_id:
            first = follower.agent_id is None
            self._resync(follower, ResyncReason.CONNECTED if first else ResyncReason.RESTART)
            follower.buffer.append(event)
        elif event.seq > follower.seq + 1:
            self._resync(follower, ResyncReason.GAP)
            follower.buffer.append(event)
        elif event.seq == follower.seq + 1:
            self._apply(follower, event)

    def _apply(self, follower: _Follower, event: p.ChunkEvent) -> None:
        follower.seq = event.seq
        follower.events += 1
        sink = self._sinks.get(event.tier)
        if sink is None:
            return
        if event.kind == "stored":
            sink.stored(follower.endpoint.node, event.keys)
        elif event.kind == "removed" and event.tier in SHARED_TIERS:
            for node in self._followed:
                sink.removed(node, event.keys)
        elif event.kind == "removed":
            sink.removed(follower.endpoint.node, event.keys)
        else:
            log.warning(
                "node %s: unknown event kind %r ignored", follower.endpoint.node, event.kind
            )

    # ---------------------------------------------------------------- resync

    def _resync(self, follower: _Follower, reason: ResyncReason) -> None:
        if follower.resyncing:
            return
        log.info("resynchronising with node %s: %s", follower.endpoint.node, reason)
        follower.resyncs[reason] += 1
        follower.resyncing = True
        follower.synced = False
        follower.buffer = []
        follower.backoff = 0.0
        if reason == ResyncReason.CONNECTED:
            # The subscription travels after the connection: a snapshot taken before the
            # agent has it could miss the events in between, unnoticed while the agent is quiet.
            follower.deadline = time.monotonic() + self._settle
        else:
            self._send_hello(follower)

    def _send_hello(self, follower: _Follower) -> None:
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(follower.endpoint.zmq)
        dealer.send(
            p.encode(p.Hello(next(self._requests), p.PROTOCOL_VERSION, CLIENT_NAME, self._token))
        )
        follower.dealer = dealer
        follower.session = None
        follower.deadline = time.monotonic() + self._snapshot_timeout

    def _on_reply(self, follower: _Follower) -> None:
        assert follower.dealer is not None
        try:
            reply = p.decode_reply(follower.dealer.recv())
        except p.ProtocolError as error:
            self._failed(follower, str(error))
            return
        if isinstance(reply, p.HelloReply) and follower.session is None:
            follower.session = reply.session
            request = p.Snapshot(next(self._requests), reply.session, self._listed)
            follower.dealer.send(p.encode(request))
            follower.deadline = time.monotonic() + self._snapshot_timeout
        elif isinstance(reply, p.SnapshotReply) and follower.session is not None:
            self._end_request(follower)
            self._synced(follower, reply)
        elif isinstance(reply, p.Error):
            self._failed(follower, f"{reply.code}: {reply.message}")
        else:
            self._failed(follower, f"unexpected reply {type(reply).__name__}")

    def _synced(self, follower: _Follower, snapshot: p.SnapshotReply) -> None:
        node = follower.endpoint.node
        self._sink.replace(node, itertools.chain.from_iterable(snapshot.tenants.values()))
        listed = {tier: snapshot.tiers[tier] for tier in self._listed if tier in snapshot.tiers}
        for tier, by_tenant in listed.items():  # a tier not listed keeps what events taught
            self._sinks[tier].replace(node, itertools.chain.from_iterable(by_tenant.values()))
        log.info(
            "node %s synchronised: agent %s, %d chunks at event %d%s",
            node,
            snapshot.agent,
            sum(len(keys) for keys in snapshot.tenants.values()),
            snapshot.seq,
            "".join(
                f", {tier} {sum(len(keys) for keys in by_tenant.values())}"
                for tier, by_tenant in listed.items()
            ),
        )
        follower.agent_id = snapshot.agent
        follower.seq = snapshot.seq
        follower.resyncing = False
        follower.synced = True
        buffered, follower.buffer = follower.buffer, []
        for event in buffered:
            if event.agent == snapshot.agent:  # others predate the agent that answered
                self._on_event(follower, event)

    def _failed(self, follower: _Follower, why: str) -> None:
        follower.snapshot_failures += 1
        self._end_request(follower)
        follower.backoff = min(self._max_backoff, max(0.5, follower.backoff * 2))
        follower.deadline = time.monotonic() + follower.backoff
        log.warning(
            "node %s: snapshot failed (%s); retrying in %.1fs",
            follower.endpoint.node,
            why,
            follower.backoff,
        )

    def _end_request(self, follower: _Follower) -> None:
        if follower.dealer is not None:
            follower.dealer.close(linger=0)
            follower.dealer = None
