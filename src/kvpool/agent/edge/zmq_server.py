"""The agent's ZMQ server: decodes requests, calls the cache service, encodes replies.

One thread owns the port and serves one message at a time, one of each peer in turn.
The port is framed by :class:`~kvpool.agent.edge.zmtp.ZmtpRouter` rather than a libzmq
ROUTER, so that a message is bounded while it arrives (:attr:`ZmqServer.bounds`: a
header frame and a data frame per key, ``max_inline_bytes`` and :data:`HEADER_BYTES` in
all); a peer that sends more is dropped. Before its hello succeeds the agent holds no more
of a connection's message than :data:`HELLO_BOUNDS` (a larger one is answered without being
held) and the connection must say hello within ``hello_seconds``; connections and
the bytes of large messages are bounded together (:class:`~kvpool.common.config.ZmqLimits`;
see :mod:`kvpool.agent.edge.zmtp`). Every operation on the cache is one call of
:class:`~kvpool.agent.service.cache_service.CacheService`, made by a handler of
:mod:`~kvpool.agent.edge.zmq_handlers`; sessions and lease ownership are
:mod:`~kvpool.agent.edge.zmq_sessions`; this module adds the loop, limits on a request's
size, draining, parked ``prefetch_status`` waits, and snapshots listed and encoded on a
thread of their own (:data:`MAX_SNAPSHOTS` at most in its queue), so that a large one (an
NVMe tier of a million chunks is some 35 MB of keys) does not stall every client's
requests while it is made. Any bad input becomes an
:class:`~kvpool.common.protocol.Error` reply; nothing a client sends can stop
the loop, and an unexpected failure logs one traceback a minute, however often it recurs.

Sessions: an id is 64 random bits (the widest integer msgpack carries) and
belongs to the connection that said hello (its ROUTER routing identity): from
any other connection it is unknown, so one client can neither guess nor use
another's session, and a lease is committed or released only by the session it
was granted to. A session whose write lease expired before its commit is
fenced: every later request on it fails with ``session_fenced`` (the client
says hello again) and its quarantined pages (see :mod:`kvpool.agent.core.l1`) are
freed once it is swept as idle. Idle sessions are swept on a timer, busy
socket or not.

Credentials: hello carries a bearer token, checked by the pool's token authority (the
same one as the HTTP API's: the tokens file, or the generated tokens, and the
KVCacheTenants' tokens from the tenants ConfigMap). Without a known token a hello is
refused (``unauthenticated``), and nothing else works without a session. A session may:

- with a KVCacheTenant's token: its own tenant's chunks only (lookups, stores, retrieves,
  clearing its own chunks); a request that names the default tenant (no ``cache_salt``)
  acts on the token's tenant instead;
- with an engine's token (a vLLM engine serving many tenants' salts): any tenant's chunks,
  but no snapshot and no clear;
- with an index's token: the snapshot only (the events feed takes the same token);
- with an admin's token: everything.

Every token that touches chunks may also use ``kvpool doctor``'s canary tenant
(:data:`~kvpool.common.keys.CANARY_TENANT`: random bytes, cleared at once), so the doctor
checks a deployment with the engine's own token. So that no one can use it as a store, or
to pass bytes to another tenant, its chunks are of :data:`~kvpool.common.keys.CANARY_CHUNK_BYTES`
only, without a parent, under a fixed quota (:data:`~kvpool.common.keys.CANARY_QUOTA_BYTES`),
and each session's keys are its own (:func:`~kvpool.common.keys.canary_key`): a session
finds only the canary chunks it stored. Anything else is ``forbidden``; a gateway's token
is refused at hello. A token revoked while its sessions live (a
KVCacheTenant deleted) voids them: their next request is ``unauthenticated``, and their
leases end as a fenced session's do, so a writer still copying harms no one.
"""

from __future__ import annotations

import logging
import math
import queue
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import zmq

from kvpool.agent.core.cache_types import CacheError, LeaseExpired, UnknownLease
from kvpool.agent.edge.zmq_handlers import Frames, Handled, Offer, ZmqHandlers
from kvpool.agent.edge.zmq_sessions import Peer, SessionTable
from kvpool.agent.edge.zmtp import DropReason, MessageBounds, Truncated, ZmtpRouter
from kvpool.agent.service.cache_service import CacheService
from kvpool.common import protocol as p
from kvpool.common.auth import TokenAuthority
from kvpool.common.config import ZmqLimits
from kvpool.common.segment import SharedSegment
from kvpool.common.web.rate_limited_log import RateLimitedLog

log = logging.getLogger(__name__)

HEADER_BYTES = 1 << 20
"""What a message may hold beside its inline payload: its header frame (a request of
8192 keys of 32 bytes is some 300 KiB of msgpack) and the data frames' framing."""
HELLO_BOUNDS = MessageBounds(max_frames=8, max_bytes=4 << 10)
"""What the agent holds of a message before its connection's hello succeeded: a hello is a
few dozen bytes (a 64-character token, the client's name). Of a larger message (a request
of a client whose connection was renewed) the rest is discarded as it arrives, and it is
answered ``unknown_session`` (a hello: ``too_large``)."""


MAX_SNAPSHOTS = 4
"""Snapshot requests being listed or waiting to be, at most; more are refused at once
(``invalid_request``, asked again later: an index retries with backoff)."""


class RequestObserver(Protocol):
    def observe_request(self, op: str, seconds: float, error: str | None) -> None: ...

    def observe_dropped_peer(self, reason: str) -> None: ...


@dataclass(frozen=True)
class _Listed:
    """A snapshot's reply, encoded on the snapshot thread, waiting to be sent."""

    identity: bytes
    frame: bytes
    started: float
    error: str | None


@dataclass
class _Parked:
    """A prefetch_status request waiting for its prefetch (or its deadline)."""

    identity: bytes
    request: p.PrefetchStatus
    deadline: float
    op_started: float


class ZmqServer:
    def __init__(
        self,
        service: CacheService,
        segment: SharedSegment,
        endpoint: str,
        *,
        authority: TokenAuthority,
        agent_id: str,
        max_inline_bytes: int,
        max_keys: int = 8192,
        session_idle_seconds: float = 300.0,
        limits: ZmqLimits | None = None,
        observer: RequestObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
        listener: socket.socket | None = None,
        offer: Offer | None = None,
    ) -> None:
        """Serves on ``endpoint``, or on ``listener`` (:func:`~kvpool.agent.edge.zmtp.listen`)
        bound beforehand; ``offer``: the peer tier's offers (``push``; None: no peers)."""
        self.agent_id = agent_id
        self._listener = listener
        self._parked: list[_Parked] = []
        self._notifier: zmq.Socket[bytes] | None = None
        self._service = service
        self._segment = segment
        self._authority = authority
        self._endpoint = endpoint
        self._max_inline = max_inline_bytes
        self._max_keys = max_keys
        self._idle = session_idle_seconds
        self._limits = limits or ZmqLimits()
        self._observer = observer
        self._clock = clock
        self._sessions = SessionTable(
            service, authority, agent_id=agent_id, idle_seconds=session_idle_seconds, clock=clock
        )
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._router: ZmtpRouter | None = None
        self._flood_log = RateLimitedLog(log)
        self._wake_endpoint = f"inproc://kvpool-wake-{self.agent_id}"
        self._thread: threading.Thread | None = None
        self.bound_endpoint = ""
        self._draining = False
        self.drained = threading.Event()
        """Set once draining and no store is in flight (see :meth:`drain`)."""
        self._snapshots = ThreadPoolExecutor(1, thread_name_prefix="kvpool-zmq-snapshot")
        self._listing = 0
        """Snapshot requests submitted to the snapshot thread and not yet sent."""
        self._listed: queue.SimpleQueue[_Listed] = queue.SimpleQueue()
        self._handler = ZmqHandlers(
            service,
            self._sessions,
            segment,
            authority=authority,
            agent_id=agent_id,
            max_inline_bytes=max_inline_bytes,
            max_keys=max_keys,
            admit=self._admit,
            draining=lambda: self._draining,
            offer=offer,
        )
        self._handlers = self._handler.by_request()

    # ---------------------------------------------------------------- running

    @property
    def bounds(self) -> MessageBounds:
        """The largest message a peer may send: an inline store of ``max_keys`` keys
        (a header frame, a data frame per key) and ``max_inline_bytes`` of data."""
        return MessageBounds(self._max_keys + 1, self._max_inline + HEADER_BYTES)

    def start(self) -> None:
        # Each connection gets a routing identity of its own: one that names itself like
        # another cannot take over the other's, and with it the other's session.
        router = ZmtpRouter(
            self._endpoint,
            self.bounds,
            unauthenticated=HELLO_BOUNDS,
            limits=self._limits,
            log=self._flood_log,
            on_drop=self._dropped_peer,
            listener=self._listener,
        )
        self.bound_endpoint = router.bound_endpoint
        self._router = router
        wake = self._context.socket(zmq.PULL)
        wake.bind(self._wake_endpoint)
        self._thread = threading.Thread(
            target=self._serve, args=(router, wake), name="kvpool-zmq", daemon=True
        )
        self._thread.start()
        log.info("ZMQ protocol v%d on %s", p.PROTOCOL_VERSION, self.bound_endpoint)

    def drain(self) -> None:
        """Refuse new stores from now on; :attr:`drained` is set once in-flight ones ended.

        Lookups and retrieves are still served, and so are the commits of
        stores already reserved, so a rolling restart loses no committed chunk.
        """
        self._signal(b"drain")

    def stop(self) -> None:
        if self._thread is None:
            return
        self._signal(b"stop")
        self._thread.join()
        self._thread = None
        self._snapshots.shutdown(cancel_futures=True)  # waits for one being listed
        if self._notifier is not None:
            self._notifier.close(linger=0)

    def _signal(self, command: bytes) -> None:
        waker = self._context.socket(zmq.PUSH)
        waker.connect(self._wake_endpoint)
        waker.send(command)
        waker.close(linger=1000)

    def prefetch_changed(self) -> None:
        """Wake the server to answer parked prefetch_status requests (event loop thread only)."""
        if self._notifier is None:
            self._notifier = self._context.socket(zmq.PUSH)
            self._notifier.connect(self._wake_endpoint)
        self._notifier.send(b"prefetch", zmq.NOBLOCK)

    def _check_drained(self) -> None:
        if self._draining and self._service.open_write_leases == 0:
            self.drained.set()

    def _admit(self, peer: Peer) -> bool:
        assert self._router is not None
        return self._router.admit(peer)

    def _dropped_peer(self, reason: DropReason) -> None:
        if self._observer is not None:
            self._observer.observe_dropped_peer(reason)

    def _serve(self, router: ZmtpRouter, wake: zmq.Socket[bytes]) -> None:
        poller = zmq.Poller()
        router.register(poller)
        poller.register(wake, zmq.POLLIN)
        sweep_period = self._idle / 4
        next_sweep = self._clock() + sweep_period
        try:
            while True:
                timeout = max(0.0, next_sweep - self._clock())
                deadlines = [parked.deadline for parked in self._parked]
                deadlines.extend(d for d in [router.next_deadline()] if d is not None)
                if deadlines:
                    timeout = max(0.0, min(timeout, min(deadlines) - time.monotonic()))
                if router.ready():
                    timeout = 0.0
                events = dict(poller.poll(math.ceil(timeout * 1000)))
                if wake in events:
                    command = wake.recv()
                    if command == b"stop":
                        return
                    self._draining |= command == b"drain"
                router.handle(events)
                router.expire()
                for identity, body in router.take():
                    self._serve_one(identity, body)
                if self._clock() >= next_sweep:  # on time even while requests keep coming
                    self._sessions.drop_idle()
                    next_sweep = self._clock() + sweep_period
                self._answer_parked()
                self._send_listed()
                self._check_drained()
        finally:
            router.close()
            wake.close()

    def _serve_one(self, identity: Peer, body: Frames) -> None:
        started = time.perf_counter()
        op, req = "invalid", 0
        try:
            if not body:
                raise p.ProtocolError(p.ErrorCode.MALFORMED, "empty message")
            if isinstance(body, Truncated):
                raise _cut_off(body)
            request = p.decode_request(body[0])
            op, req = p.op_name(request), request.req
            self._sessions.fence_expired_writers()
            self._sessions.void_revoked()
            if isinstance(request, p.PrefetchStatus):
                handled = self._prefetch_status(request, identity, started)
            elif isinstance(request, p.Snapshot):
                handled = self._snapshot(request, identity, started)
            else:
                handled = self._handlers[type(request)](request, body[1:], identity)
            if handled is None:
                return  # parked (answered when the prefetch moves), or being listed
            reply, data = handled
        except p.ProtocolError as error:
            req = error.req or req
            reply, data = p.Error(req, error.code, str(error)), []
        except UnknownLease as error:
            reply, data = p.Error(req, p.ErrorCode.UNKNOWN_LEASE, str(error)), []
        except LeaseExpired as error:
            reply, data = p.Error(req, p.ErrorCode.LEASE_EXPIRED, str(error)), []
        except CacheError as error:
            reply, data = p.Error(req, p.ErrorCode.INVALID_REQUEST, str(error)), []
        except Exception as error:
            self._flood_log.exception(f"internal error serving {op}: {type(error).__name__}")
            reply, data = (
                p.Error(req, p.ErrorCode.INTERNAL, "internal error; see the agent log"),
                [],
            )
        self._send(identity, reply, data, op=op, started=started)

    def _send(
        self, identity: bytes, reply: p.Reply, data: list[bytes], *, op: str, started: float
    ) -> None:
        error_code = reply.code if isinstance(reply, p.Error) else None
        self._send_frames(identity, [p.encode(reply), *data], op, started, error_code)

    def _send_frames(
        self, identity: bytes, frames: list[bytes], op: str, started: float, error: str | None
    ) -> None:
        assert self._router is not None
        self._router.send(identity, frames)
        if self._observer is not None:
            self._observer.observe_request(op, time.perf_counter() - started, error)

    # ------------------------------------------------------------- snapshots

    def _snapshot(self, request: p.Snapshot, identity: bytes, started: float) -> Handled:
        """Check it here, list and encode it on the snapshot thread; the loop sends it."""
        self._handler.check_snapshot(request, identity)
        if self._listing >= MAX_SNAPSHOTS:
            raise p.ProtocolError(
                p.ErrorCode.INVALID_REQUEST,
                f"{MAX_SNAPSHOTS} snapshots are being listed already: ask again later",
            )
        self._listing += 1
        self._snapshots.submit(self._list, request, identity, started)
        return None

    def _list(self, request: p.Snapshot, identity: bytes, started: float) -> None:
        """The snapshot thread: the reply, encoded, for the loop to send."""
        reply: p.Reply
        try:
            reply = self._handler.snapshot_reply(request)
        except Exception as error:
            self._flood_log.exception(f"internal error serving snapshot: {type(error).__name__}")
            reply = p.Error(request.req, p.ErrorCode.INTERNAL, "internal error; see the agent log")
        error_code = reply.code if isinstance(reply, p.Error) else None
        self._listed.put(_Listed(identity, p.encode(reply), started, error_code))
        self._signal(b"listed")

    def _send_listed(self) -> None:
        while True:
            try:
                listed = self._listed.get_nowait()
            except queue.Empty:
                return
            self._listing -= 1
            self._send_frames(
                listed.identity, [listed.frame], "snapshot", listed.started, listed.error
            )

    # ------------------------------------------------------------- handlers

    def _prefetch_status(
        self, request: p.PrefetchStatus, identity: bytes, started: float
    ) -> Handled:
        self._sessions.get(request.session, identity)
        prefetch = self._service.prefetch_status(request.prefetch)
        if prefetch is None:
            raise p.ProtocolError(
                p.ErrorCode.INVALID_REQUEST,
                f"prefetch {request.prefetch} is unknown or long finished",
                request.req,
            )
        if prefetch.done or request.wait_ms <= 0:
            return self._prefetch_reply(request), []
        deadline = time.monotonic() + request.wait_ms / 1000
        self._parked.append(_Parked(identity, request, deadline, started))
        return None

    def _prefetch_reply(self, request: p.PrefetchStatus) -> p.PrefetchStatusReply:
        prefetch = self._service.prefetch_status(request.prefetch)
        if prefetch is None:  # forgotten while parked: report it finished with nothing
            return p.PrefetchStatusReply(request.req, True, 0, 0)
        return p.PrefetchStatusReply(request.req, prefetch.done, prefetch.expected, prefetch.loaded)

    def _answer_parked(self) -> None:
        if not self._parked:
            return
        now = time.monotonic()
        waiting = []
        for parked in self._parked:
            prefetch = self._service.prefetch_status(parked.request.prefetch)
            if prefetch is None or prefetch.done or parked.deadline <= now:
                reply = self._prefetch_reply(parked.request)
                self._send(
                    parked.identity, reply, [], op="prefetch_status", started=parked.op_started
                )
            else:
                waiting.append(parked)
        self._parked = waiting


def _cut_off(message: Truncated) -> p.ProtocolError:
    """The answer to a message sent before hello over :data:`HELLO_BOUNDS`, of which only
    the start was held: a hello is too large; anything else finds no session (so a client
    whose connection was renewed says hello and sends it again)."""
    most = HELLO_BOUNDS.max_bytes
    peeked = p.peek_request(bytes(message[0][:64]))
    if peeked is None:
        return p.ProtocolError(p.ErrorCode.MALFORMED, f"not a request, and over {most} bytes")
    op, req = peeked
    if op == "hello":
        return p.ProtocolError(p.ErrorCode.TOO_LARGE, f"a hello holds {most} bytes at most", req)
    return p.ProtocolError(
        p.ErrorCode.UNKNOWN_SESSION,
        f"no session on this connection: send hello (before it a message holds {most} bytes "
        "at most)",
        req,
    )
