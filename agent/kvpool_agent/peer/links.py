"""The asking half: one :class:`PeerLink` per other agent of the pool.

A link keeps a few proven connections to its peer and asks it, on the calling
thread (the adapter runs links on its own threads, never on the event loop):
how much of a prefix it holds (:meth:`PeerLink.held`), and for one chunk
(:meth:`PeerLink.fetch`), received straight into a buffer of its own and opened
there (:meth:`~kvpool_agent.l2.codec.ObjectCodec.open`, in place). A chunk that
does not open as the tenant's key asked for (another tenant's, flipped bytes, a
forged peer) is an :class:`~kvpool_agent.l2.codec.IntegrityError`: never bytes.
Every failure closes the connection it happened on and is counted by reason.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvpool_agent.l2.base import ObjectKey
from kvpool_agent.l2.buffers import fresh
from kvpool_agent.l2.codec import HEADER, IntegrityError, ObjectCodec
from kvpool_agent.l2.keyring import Keyring
from kvpool_agent.peer.handshake import NotProven
from kvpool_agent.peer.session import open_session
from kvpool_agent.peer.transport import PeerChannel, PeerTransport
from kvpool_agent.peer.wire import Busy, Exists, Get, Have, Missing, Object, WireError

_IDLE = 8
"""Connections kept open per peer (the prefetch asks for up to 8 chunks at once)."""


class PeerBusy(Exception):
    """The peer is at its transfer cap: a miss here, not a failure."""


@dataclass(frozen=True)
class LinkSettings:
    pool: str
    node: str
    """This agent's node name."""
    keyring: Keyring
    codec: ObjectCodec
    transport: PeerTransport
    connect_timeout: float
    io_timeout: float
    max_object_bytes: int
    max_requests: int
    """Requests to one peer at once (the pool's max_transfers: more would be refused)."""


@dataclass
class LinkStats:
    fetched_chunks: int = 0
    fetched_bytes: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    """By reason: unreachable, unproven, timeout, broken, integrity."""
    reachable: bool | None = None
    error: str | None = None
    rtt_ms: float | None = None


class PeerLink:
    def __init__(self, node: str, address: str, settings: LinkSettings) -> None:
        self.node = node
        self.address = address
        self.settings = settings
        self.stats = LinkStats()
        self._idle: list[PeerChannel] = []
        self._lock = threading.Lock()
        self._requests = threading.BoundedSemaphore(settings.max_requests)

    def held(self, tenant: str, keys: list[bytes]) -> int:
        """How many of ``keys``, from the first, the peer holds for ``tenant``."""
        with self._channel() as channel:
            channel.send(Exists(tenant, keys))
            answer, length = channel.receive()
            if not isinstance(answer, Have) or length or not 0 <= answer.count <= len(keys):
                raise WireError(f"expected have for {len(keys)} keys, got {answer!r}")
            return answer.count

    def fetch(self, name: ObjectKey) -> memoryview | None:
        """The chunk's payload, None if the peer no longer holds it; :class:`PeerBusy` if it
        is at its cap; any other failure raises (and is counted)."""
        settings = self.settings
        with self._requests, self._channel() as channel:
            channel.send(Get(name.tenant, name.key))
            answer, length = channel.receive()
            if isinstance(answer, Missing | Busy) and not length:
                if isinstance(answer, Busy):
                    raise PeerBusy(self.node)
                return None
            if not isinstance(answer, Object):
                raise WireError(f"expected an object, got {type(answer).__name__}")
            if not HEADER.size <= length <= HEADER.size + settings.max_object_bytes:
                raise WireError(f"an object of {length} bytes")
            blob = fresh(length)
            channel.receive_body(blob)
            payload = settings.codec.open(
                name, blob[: HEADER.size], blob[HEADER.size :], in_place=True
            )
        self.stats.fetched_chunks += 1
        self.stats.fetched_bytes += len(payload)
        return memoryview(payload)

    def probe(self) -> None:
        """A fresh connection and handshake now (the doctor's check); its round trip."""
        started = time.perf_counter()
        with self._channel(fresh_connection=True):
            self.stats.rtt_ms = (time.perf_counter() - started) * 1e3

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for channel in idle:
            channel.close()

    @contextlib.contextmanager
    def _channel(self, *, fresh_connection: bool = False) -> Iterator[PeerChannel]:
        """A proven connection, kept for the next request if this one went well."""
        channel = None
        with self._lock:
            if self._idle and not fresh_connection:
                channel = self._idle.pop()
        try:
            if channel is None:
                channel = self._connect()
            yield channel
        except PeerBusy:
            self._keep(channel)
            raise
        except BaseException as error:
            if channel is not None:
                channel.close()
            self._failed(error)
            raise
        self.stats.reachable, self.stats.error = True, None
        self._keep(channel)

    def _connect(self) -> PeerChannel:
        settings = self.settings
        channel = settings.transport.connect(
            self.address, settings.connect_timeout, settings.io_timeout
        )
        try:
            session = open_session(channel, settings.keyring, settings.pool, settings.node)
        except BaseException:
            channel.close()
            raise
        if session.node != self.node:
            channel.close()
            raise WireError(f"{self.address} is agent {session.node!r}, not {self.node!r}")
        return channel

    def _keep(self, channel: PeerChannel | None) -> None:
        if channel is None:
            return
        with self._lock:
            if len(self._idle) < _IDLE:
                self._idle.append(channel)
                return
        channel.close()

    def _failed(self, error: BaseException) -> None:
        reason = failure_reason(error)
        if reason is None:
            return
        self.stats.failures[reason] += 1
        self.stats.error = f"{reason}: {error}"
        if reason != "integrity":
            self.stats.reachable = False


def failure_reason(error: BaseException) -> str | None:
    """The metrics' reason for a failed request (None: not the peer's failure)."""
    if isinstance(error, IntegrityError):
        return "integrity"
    if isinstance(error, NotProven):
        return "unproven"
    if isinstance(error, TimeoutError):
        return "timeout"
    if isinstance(error, ConnectionRefusedError):
        return "unreachable"
    if isinstance(error, WireError | ConnectionError):
        return "broken"
    if isinstance(error, OSError):
        return "unreachable"
    return None
