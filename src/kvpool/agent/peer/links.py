"""The asking half: one :class:`PeerLink` per other agent of the pool.

A link keeps a few proven connections to its peer and asks it, on the calling
thread (the adapter runs links on its own threads, never on the event loop):
how much of a prefix it holds (:meth:`PeerLink.held`), and for one chunk
(:meth:`PeerLink.fetch`) or a run of a prefix's chunks in one pipelined request
(:meth:`PeerLink.fetch_run`), each received straight into the memory the caller reserves
for it (L1 pages) and opened there (:meth:`~kvpool.agent.l2.codec.ObjectCodec.open`, in
place); and it offers the peer a prefix this agent holds (:meth:`PeerLink.offer`: a
disaggregated prefill's, for its decode's node). A chunk that
does not open as the tenant's key asked for (another tenant's, flipped bytes, a
forged peer) is an :class:`~kvpool.agent.l2.codec.IntegrityError`: never bytes.
Every failure closes the connection it happened on and is counted by reason.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, TypeVar

from kvpool.agent.l2.base import Destination, ObjectKey
from kvpool.agent.l2.codec import (
    MAX_HEADER_SIZE,
    PREFIX_SIZE,
    IntegrityError,
    ObjectCodec,
    header_size,
    opens_in_one_read,
    payload_length,
)
from kvpool.agent.peer.session import open_session
from kvpool.agent.peer.transport import PeerChannel, PeerTransport
from kvpool.agent.peer.wire import (
    IDLE_SECONDS,
    Accepted,
    Busy,
    Exists,
    Get,
    Have,
    Missing,
    Object,
    Offer,
    WireError,
)
from kvpool.common.handshake import NotProven
from kvpool.common.keyring import Keyring

_IDLE = 8
"""Connections kept open per peer (the prefetch asks for up to 8 runs of chunks at once)."""
REUSE_SECONDS = IDLE_SECONDS / 2
"""A kept connection unused for longer is closed, not reused: the peer may have closed it
(it waits :data:`~kvpool.agent.peer.wire.IDLE_SECONDS` for a request)."""
T = TypeVar("T")


Fetched = Literal["filled", "missing", "unwanted"]


class PeerBusy(Exception):
    """The peer is at its transfer cap: a miss here, not a failure."""


@dataclass(frozen=True)
class _Aside:
    """A chunk received before its turn: its header and its sealed body, in a buffer."""

    header: memoryview
    body: memoryview


class _Unwanted(Exception):
    """The receiver has no room for the chunk (present already, or refused)."""


StopReason = Literal["missing", "busy", "unwanted", "integrity", "failed"]


class RunStop(NamedTuple):
    """How a pipelined run (:meth:`PeerLink.fetch_run`) ended: the leading chunks it filled
    and their bytes, and why it stopped before the next (None: it filled them all)."""

    filled: int
    nbytes: int
    reason: StopReason | None


class _Abandoned(Exception):
    """A run stopped (``reason``) with answers to its later requests still on their way:
    the connection goes."""

    def __init__(self, reason: StopReason) -> None:
        super().__init__(reason)
        self.reason: StopReason = reason


def _stop(reason: StopReason, pending: bool) -> StopReason:
    """A run stops for ``reason``: the connection goes if answers are ``pending``."""
    if pending:
        raise _Abandoned(reason)
    return reason


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
    transport: Literal["tcp", "nixl"] | None = None
    """What carried the last request's bodies."""


class PeerLink:
    def __init__(self, node: str, address: str, settings: LinkSettings) -> None:
        self.node = node
        self.address = address
        self.settings = settings
        self.stats = LinkStats()
        self._idle: list[tuple[PeerChannel, float]] = []
        """Proven connections, each with the time it was last used."""
        self._lock = threading.Lock()
        self._requests = threading.BoundedSemaphore(settings.max_requests)

    def held(self, tenant: str, keys: list[bytes]) -> int:
        """How many of ``keys``, from the first, the peer holds for ``tenant``."""

        def ask(channel: PeerChannel) -> int:
            channel.send(Exists(tenant, keys))
            answer, length = channel.receive()
            if not isinstance(answer, Have) or length or not 0 <= answer.count <= len(keys):
                raise WireError(f"expected have for {len(keys)} keys, got {answer!r}")
            return answer.count

        return self._call(ask)

    def offer(self, tenant: str, keys: list[bytes], parent: bytes | None) -> bool:
        """Tell the peer this agent holds ``keys`` of ``tenant``'s (``parent`` before them):
        True once it pulls them, False when it is busy."""

        def ask(channel: PeerChannel) -> bool:
            channel.send(Offer(tenant, keys, parent))
            answer, length = channel.receive()
            if not isinstance(answer, Accepted | Busy) or length:
                raise WireError(f"expected accepted or busy, got {answer!r}")
            return isinstance(answer, Accepted)

        return self._call(ask)

    def fetch(self, name: ObjectKey, into: Destination) -> tuple[Fetched, int]:
        """The chunk received into ``into.reserve(size)`` in ``into``'s turn and opened
        there: ``filled`` and its size; or ``missing`` (the peer no longer holds it),
        ``unwanted`` (no turn, or no memory). :class:`PeerBusy` if the peer is at its cap;
        any other failure raises (and is counted).

        The peer is asked at once and its answer always read at once: a transfer it serves
        waits on this agent. Where the chunk's turn has not come when its header arrives
        (the chunk before it is still on its way), the body is received into a buffer of
        the pool's (no page to fault in) and decrypted from there into the reserved pages
        once the turn comes (the same bytes moved as in place); else straight into
        them."""
        with contextlib.ExitStack() as buffers:

            def get(channel: PeerChannel) -> int | _Aside:
                channel.send(Get(name.tenant, name.key))
                return self._receive(channel, name, into, buffers)

            try:
                with self._requests:
                    received = self._call(get)
            except _Unwanted:
                return "unwanted", 0
            # an aside's turn is waited for with no request slot held
            size = (
                self._land_aside(name, into, received) if isinstance(received, _Aside) else received
            )
            if size is None:
                return "unwanted", 0
        if not size:
            return "missing", 0
        self._count([size])
        return "filled", size

    def fetch_run(self, names: Sequence[ObjectKey], into: Sequence[Destination]) -> RunStop:
        """Chunks of one prefix in one pipelined request on one connection: up to the
        channel's :attr:`~kvpool.agent.peer.transport.PeerChannel.depth` ``Get`` s ahead of
        the answer being read, sent a few at a time (the depth at once, then the channel's
        :attr:`~kvpool.agent.peer.transport.PeerChannel.asks_together` each time as many
        are answered: a TCP server answers those that come together together,
        :mod:`~kvpool.agent.peer.answers`), each chunk received as :meth:`fetch` receives
        it. Stops at
        the first chunk not filled: how many were filled, and why it stopped (the
        connection closes where answers are still on their way). A busy peer and a missing
        chunk stop the run; any other failure is counted (as :meth:`fetch` counts it) and
        stops it: ``integrity`` where the chunk did not open, else ``failed``.

        Until the first chunk's turn comes, the chunks are received into buffers of the
        pool's; once it has, they are placed and the rest received in place. A run whose
        turn has not come when its last chunk arrived waits for it with no connection and
        no request slot held (those are the earlier chunks' to take).

        One request and one thread for the run: a chunk costs this agent a read of its
        answer, not a request, a thread's wake-up and an answer's wait each."""
        sizes: list[int] = []
        asides: list[_Aside] = []
        """The leading chunks not placed yet (their turn had not come)."""
        with contextlib.ExitStack() as buffers:

            def get_run(channel: PeerChannel) -> StopReason | None:
                sizes.clear()
                asides.clear()
                asked = 0
                for index, name in enumerate(names):
                    waiting = asked - index  # asked for, not read yet
                    depth = channel.depth
                    if asked < len(names) and waiting <= depth - channel.asks_together:
                        ahead = names[asked : index + depth]
                        channel.send_frames(
                            [(Get(wanted.tenant, wanted.key), ()) for wanted in ahead]
                        )
                        asked += len(ahead)
                    if asides and into[len(sizes)].turn() is not None:
                        self._place(names, into, sizes, asides, wait=False)
                    pending = asked > index + 1
                    try:
                        received = self._receive(channel, name, into[index], buffers)
                    except PeerBusy:
                        return _stop("busy", pending)
                    if isinstance(received, _Aside):
                        asides.append(received)
                    elif not received:
                        return _stop("missing", pending)
                    else:
                        sizes.append(received)
                return None

            stopped: StopReason | None
            try:
                with self._requests:
                    stopped = self._call(get_run)
            except _Abandoned as abandoned:
                stopped = abandoned.reason
            except _Unwanted:
                stopped = "unwanted"
            except IntegrityError:  # counted in _call, as any failure below
                stopped = "integrity"  # of the first chunk aside, if any
            except (WireError, OSError, ValueError):
                stopped = "failed"
            if asides and stopped not in ("unwanted", "integrity"):
                try:
                    self._place(names, into, sizes, asides, wait=True)
                except _Unwanted:
                    stopped = "unwanted"
                except IntegrityError as error:
                    self._failed(error)
                    stopped = "integrity"
        self._count(sizes)
        return RunStop(len(sizes), sum(sizes), stopped)

    def _place(
        self,
        names: Sequence[ObjectKey],
        into: Sequence[Destination],
        sizes: list[int],
        asides: list[_Aside],
        *,
        wait: bool,
    ) -> None:
        """Place the run's chunks received aside (the next ``len(asides)`` after ``sizes``)
        in their reserved pages, once their turn came (``wait``: waiting for it; else it
        has): their sizes join ``sizes``. :class:`_Unwanted` where one is given no memory."""
        while asides:
            index = len(sizes)
            landed = self._land_aside(names[index], into[index], asides[0], wait=wait)
            if landed is None:
                raise _Unwanted
            asides.pop(0)
            sizes.append(landed)

    def _receive(
        self,
        channel: PeerChannel,
        name: ObjectKey,
        into: Destination,
        buffers: contextlib.ExitStack,
    ) -> int | _Aside:
        """The answer to a ``Get`` of ``name``: the size received into ``into`` and opened
        there (0: missing), or the chunk in a buffer of ``buffers`` when its turn has not
        come yet. :class:`PeerBusy`, :class:`_Unwanted`, or any failure."""
        settings = self.settings
        answer, length = channel.receive()
        if isinstance(answer, Missing | Busy) and not length:
            if isinstance(answer, Busy):
                raise PeerBusy(self.node)
            return 0
        if not isinstance(answer, Object):
            raise WireError(f"expected an object, got {type(answer).__name__}")
        if length < PREFIX_SIZE:
            raise WireError(f"an object of {length} bytes: shorter than its header")
        header = memoryview(bytearray(MAX_HEADER_SIZE))
        channel.receive_body(header[:PREFIX_SIZE])
        header = header[: header_size(header)]
        if length < len(header):
            raise WireError(f"an object of {length} bytes: shorter than its header")
        channel.receive_body(header[PREFIX_SIZE:])
        size = length - len(header)
        if size != payload_length(header) or size > settings.max_object_bytes:
            raise WireError(f"an object of {length} bytes whose header says otherwise")
        if into.turn() is None:
            aside = buffers.enter_context(settings.codec.buffers.borrow(size))
            channel.receive_body(aside)
            return _Aside(header, aside)
        memory = into.reserve(size)
        if memory is None:
            raise _Unwanted  # the body is dropped with the connection
        landed = channel.landed_body(size) if opens_in_one_read(header) else None
        if landed is not None:  # opened from the landing into L1: no copy first
            settings.codec.open(name, header, landed, out=memory)
            return size
        channel.receive_body(memory)
        settings.codec.open(name, header, memory, in_place=True)
        return size

    def _land_aside(
        self, name: ObjectKey, into: Destination, aside: _Aside, *, wait: bool = True
    ) -> int | None:
        """A chunk received before its turn, opened into its reserved pages once the turn
        comes (``wait``: waiting for it; else it has): its size; None where it gets no turn
        or no memory."""
        size = len(aside.body)
        turn = into.wait_turn() if wait else into.turn()
        memory = into.reserve(size) if turn else None
        if memory is None:
            return None
        self.settings.codec.open(name, aside.header, aside.body, out=memory)
        return size

    def _count(self, sizes: Sequence[int]) -> None:
        self.stats.fetched_chunks += len(sizes)
        self.stats.fetched_bytes += sum(sizes)

    def probe(self) -> None:
        """A fresh connection and handshake now (the doctor's check); its round trip."""
        started = time.perf_counter()
        self._call(lambda channel: None, fresh_connection=True)
        self.stats.rtt_ms = (time.perf_counter() - started) * 1e3

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for channel, _ in idle:
            channel.close()

    def _call(self, request: Callable[[PeerChannel], T], *, fresh_connection: bool = False) -> T:
        """``request`` on a proven connection, kept for the next one if it went well.

        A kept connection the peer has closed meanwhile (it restarted, or dropped it idle)
        fails at once: the request is repeated on a new one (both requests are safe to
        repeat), so a link that sat idle still pulls."""
        channel = None if fresh_connection else self._take_idle()
        reused = channel is not None
        try:
            if channel is None:
                channel = self._connect()
            result = request(channel)
        except PeerBusy:
            self._keep(channel)
            raise
        except (_Unwanted, _Abandoned):
            if channel is not None:
                channel.close()  # a body (or an answer) is still on its way
            raise
        except (WireError, ConnectionError) as error:
            if channel is not None:
                channel.close()
            if reused and failure_reason(error) == "broken":
                return self._call(request, fresh_connection=True)
            self._failed(error)
            raise
        except BaseException as error:
            if channel is not None:
                channel.close()
            self._failed(error)
            raise
        self.stats.reachable, self.stats.error = True, None
        self.stats.transport = "nixl" if channel.transport == "nixl" else "tcp"
        self._keep(channel)
        return result

    def _take_idle(self) -> PeerChannel | None:
        """The most recently used kept connection, if it was used recently enough that the
        peer still keeps it open (older ones are closed here)."""
        now = time.monotonic()
        with self._lock:
            recent = [(channel, used) for channel, used in self._idle if now - used < REUSE_SECONDS]
            stale = [channel for channel, used in self._idle if now - used >= REUSE_SECONDS]
            found = recent.pop()[0] if recent else None
            self._idle = recent
        for channel in stale:
            channel.close()
        return found

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
                self._idle.append((channel, time.monotonic()))
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
