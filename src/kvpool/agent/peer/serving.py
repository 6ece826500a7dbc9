"""The serving half: this agent's L1 and NVMe chunks, for the pool's other agents.

One thread accepts, one thread per connection serves it. A connection first
proves the pool's peer credential (:mod:`kvpool.agent.peer.session`); nothing
is said before that but the hello. Until it has, a connection holds little and
cannot keep a peer out: the whole handshake has :data:`HANDSHAKE_SECONDS` from
accept (however its bytes trickle in) and reads at most
:data:`~kvpool.agent.peer.wire.MAX_HANDSHAKE_BYTES`; at most :data:`MAX_HANDSHAKES`
connections are in their handshake at once, :data:`MAX_HANDSHAKES_PER_HOST` from one
address, and a new one past either drops the oldest (from that address first), so
that connections which never prove anything cannot outlast a peer's handshake,
which takes one round trip. The :data:`MAX_CONNECTIONS` serving slots are taken
only by connections that proved the credential. Each handshake runs on its
connection's thread: none waits on another, nor the accept loop on any.

Then each request names a tenant id, and
only that tenant's chunks answer it (the L1 and the NVMe tier are keyed by
tenant): :class:`~kvpool.agent.peer.wire.Exists` counts the leading run of the
keys held in L1, then NVMe; :class:`~kvpool.agent.peer.wire.Get` sends one
chunk, sealed with the connection's peer key for that tenant (or, with
``wire_protection: integrity``, authenticated with it: plaintext under its tag);
:class:`~kvpool.agent.peer.wire.Offer` (a peer holds a prefix a request here is about
to want) starts pulling the chunks L1 lacks, exactly as a lookup's prefetch: the
pulled bytes are checked against the tenant and key, land within the tenant's quota on
this node, and commit in prompt order; a peer only says where to look, never what to
store. At most ``max_transfers`` offers pull at once from one connection's requests
(the prefetch's own slots bound them further: a tenant holds at most half).

A chunk in L1 is read under a read lease (its pages cannot be evicted or
reused meanwhile). A sealed chunk's lease is held only while it is sealed into a send
buffer; the network then sends from that buffer, so a slow peer holds no lease. With
``wire_protection: integrity`` the plaintext is tagged where it lies and sent from there
(no copy; on NIXL, where it does not go from the registered send buffer), its lease held
until it is sent: a slow peer then holds that chunk's pages (and, as any read lease does,
keeps its prefix from eviction), at most ``max_bytes_in_flight`` of them at once, until it
is cut off: ``io_timeout_seconds`` without progress, or half of ``lease_seconds`` however
it progresses, before the lease could expire. Answers kept for a request behind them and
sent while that request's chunk is leased (to free the bytes they count, or before a paced
answer) are held to the same half. Under a ``bandwidth`` cap it is copied first, as
before, so that the pace's wait holds no pages. Serving never
blocks this node's own clients: past ``max_transfers`` transfers or
``max_bytes_in_flight`` bytes at once a request is answered
:class:`~kvpool.agent.peer.wire.Busy` (the asking agent goes to its next
tier), and ``bandwidth`` paces what is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvpool.agent.l2.base import L2Adapter, ObjectKey
from kvpool.agent.l2.codec import ObjectCodec
from kvpool.agent.peer.answers import Answers
from kvpool.agent.peer.session import Session, accept_session
from kvpool.agent.peer.transport import Buffer, PeerChannel, PeerListener, split_address
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
from kvpool.agent.service.data_service import DataService
from kvpool.common.config import PeersConfig
from kvpool.common.handshake import NotProven
from kvpool.common.keyring import Keyring
from kvpool.common.web.rate_limited_log import RateLimitedLog

log = logging.getLogger(__name__)
_refusals = RateLimitedLog(log)

T = TypeVar("T")
MAX_CONNECTIONS = 64
"""Connections that proved the pool's credential, served at once; a proven peer past these
is closed (``connections``)."""
MAX_HANDSHAKES = 128
"""Connections in their handshake at once; a new one past these drops the oldest."""
MAX_HANDSHAKES_PER_HOST = 8
"""Connections in their handshake at once from one address; a new one past these drops that
address's oldest (a peer opens at most one per request it has in flight: max_transfers, 4 by
default, and its handshake takes a round trip)."""
HANDSHAKE_SECONDS = 5.0
"""From accept to proven, the whole handshake: a connection not proven by then is closed."""
_NVME_SECONDS = 10.0
_REFUSALS = {
    "unproven": "refused a connection on the peer port: it did not prove the pool's credential",
    "malformed": "closed a connection on the peer port: it broke the peer protocol",
    "timeout": (
        "closed a connection on the peer port: not proven within "
        f"{HANDSHAKE_SECONDS:g} s of its accept"
    ),
    "handshakes": (
        "dropped the oldest connection in its handshake on the peer port for a new one (at "
        f"most {MAX_HANDSHAKES} at once, {MAX_HANDSHAKES_PER_HOST} from one address)"
    ),
    "connections": f"closed a proven peer's connection: {MAX_CONNECTIONS} served at once already",
}
"""The log line of each refusal by reason: one each, whoever is refused (who and why at
DEBUG), so that a flood of them is one line a minute."""


@dataclass
class ServingStats:
    served_chunks: int = 0
    served_bytes: int = 0
    offers: Counter[str] = field(default_factory=Counter)
    """Offers from peers by outcome: accepted (a pull started), present (L1 holds them
    all), busy (no prefetch slot)."""
    transfers_in_flight: int = 0
    bytes_in_flight: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    """By reason: busy, unproven (no credential), malformed, timeout (not proven in time),
    handshakes (dropped for a newer one), connections (too many proven)."""


class Pacer:
    """A byte rate over every connection (``rate`` 0: none): a send waits its turn."""

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self._next = time.monotonic()
        self._lock = threading.Lock()

    def wait(self, nbytes: int) -> None:
        if not self.rate:
            return
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next)
            self._next = start + nbytes / self.rate
        if start > now:
            time.sleep(start - now)


@dataclass
class PeerServer:
    config: PeersConfig
    pool: str
    node: str
    keyring: Keyring
    codec: ObjectCodec
    """What it seals with for clients that open all it writes (AEGIS-128L where sealed)."""
    service: DataService
    nvme: L2Adapter | None
    loop: asyncio.AbstractEventLoop
    listener: PeerListener
    stats: ServingStats = field(default_factory=ServingStats)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        codec = self.codec
        self._format_2 = ObjectCodec(
            self.keyring, self.pool, seal=codec.seal, buffers=codec.buffers
        )
        """For clients that open only format 2 (agents of an older build, in a rollout)."""
        self._pacer = Pacer(int(self.config.bandwidth))
        self._handshakes: dict[PeerChannel, str] = {}
        """Connections in their handshake, oldest first, each with its remote address."""
        self._channels: set[PeerChannel] = set()
        """Proven connections (each holds one of the :data:`MAX_CONNECTIONS` slots)."""
        self._threads: list[threading.Thread] = []
        self._stopping = False

    def start(self) -> None:
        self._spawn(self._accept, "kvpool-peer-accept")

    def stop(self) -> None:
        self._stopping = True
        self.listener.close()
        with self._lock:
            channels = [*self._handshakes, *self._channels]
        for channel in channels:
            channel.close()
        for thread in list(self._threads):
            thread.join(timeout=5.0)

    def _spawn(self, target: Callable[..., None], name: str, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        self._threads = [t for t in self._threads if t.is_alive()]
        self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while not self._stopping:
            try:
                channel = self.listener.accept()
            except OSError:
                return  # closed: the agent is stopping
            channel.set_deadline(time.monotonic() + HANDSHAKE_SECONDS)
            dropped = self._admit(channel)
            if dropped is not None:
                self._refuse("handshakes", dropped, "a newer connection came")
                dropped.close()
            self._spawn(self._serve, f"kvpool-peer-{channel.remote}", channel)

    def _admit(self, channel: PeerChannel) -> PeerChannel | None:
        """Count ``channel`` among the handshakes; the one it drops to stay in bounds."""
        host = split_address(channel.remote)[0]
        with self._lock:
            handshakes = self._handshakes
            same_host = [other for other, address in handshakes.items() if address == host]
            dropped = None
            if len(same_host) >= MAX_HANDSHAKES_PER_HOST:
                dropped = same_host[0]
            elif len(handshakes) >= MAX_HANDSHAKES:
                dropped = next(iter(handshakes))
            if dropped is not None:
                del handshakes[dropped]
            handshakes[channel] = host
            return dropped

    def _serve(self, channel: PeerChannel) -> None:
        try:
            session = self._handshake(channel)
            if session is not None and self._take_slot(channel):
                channel.set_deadline(None)
                self._answer(channel, session)
        finally:
            channel.close()
            with self._lock:
                self._handshakes.pop(channel, None)
                self._channels.discard(channel)

    def _handshake(self, channel: PeerChannel) -> Session | None:
        """The proven session; None (and the refusal counted) if there is none."""
        try:
            return accept_session(channel, self.keyring, self.pool, self.node)
        except NotProven as error:
            reason, detail = "unproven", str(error)
        except WireError as error:
            reason, detail = "malformed", str(error)
        except TimeoutError:
            reason, detail = "timeout", f"{HANDSHAKE_SECONDS:g} s passed"
        except OSError:
            return None  # it went away (or was dropped for a newer one: counted then)
        with self._lock:
            dropped = channel not in self._handshakes
        if not dropped:
            self._refuse(reason, channel, detail)
        return None

    def _take_slot(self, channel: PeerChannel) -> bool:
        """Move a proven ``channel`` from the handshakes to a serving slot, if one is free."""
        with self._lock:
            if self._handshakes.pop(channel, None) is None:
                return False  # dropped for a newer one meanwhile (and closed): counted then
            crowded = len(self._channels) >= MAX_CONNECTIONS
            if not crowded:
                self._channels.add(channel)
        if crowded:
            self._refuse("connections", channel, "no free slot")
        return not crowded

    def _answer(self, channel: PeerChannel, session: Session) -> None:
        """Answer the proven peer's requests until it goes quiet or breaks the protocol
        (those that came together, together: :mod:`~kvpool.agent.peer.answers`)."""
        answers = Answers(channel)
        try:
            while not self._stopping and channel.wait_readable(IDLE_SECONDS):
                request, body_length = channel.receive()
                if body_length:
                    raise WireError("a request with a body")
                if isinstance(request, Exists):
                    answers.add(Have(self._held(answers, request.tenant, request.keys)))
                elif isinstance(request, Get):
                    codec = self.codec if session.opens_aegis else self._format_2
                    self._send(
                        answers, codec, session.key_id, ObjectKey(request.tenant, request.key)
                    )
                elif isinstance(request, Offer):
                    answers.add(self._pull(request))
                else:
                    raise WireError(f"unexpected {type(request).__name__}")
        except WireError as error:
            with self._lock:
                self.stats.refused["malformed"] += 1
            _refusals.warning(f"closed the connection of peer {session.node}: {error}")
        except OSError:
            pass  # the peer went away or stalled (TimeoutError): its next request reconnects
        finally:
            answers.drop()

    def _refuse(self, reason: str, channel: PeerChannel, detail: str) -> None:
        with self._lock:
            self.stats.refused[reason] += 1
        _refusals.warning(_REFUSALS[reason])
        log.debug("peer port: %s from %s: %s", reason, channel.remote, detail)

    def _pull(self, offer: Offer) -> Accepted | Busy:
        """Start pulling the offered chunks L1 lacks (a lookup's prefetch: the peer tier
        finds who holds them, the offering peer among them)."""
        hit = self.service.lookup(
            offer.tenant, offer.keys, lock=False, count=False, prefetch=True, parent=offer.parent
        )
        outcome = (
            "present" if hit.count == len(offer.keys) else "accepted" if hit.prefetch else "busy"
        )
        with self._lock:
            self.stats.offers[outcome] += 1
        return Busy() if outcome == "busy" else Accepted()

    def _held(self, answers: Answers, tenant: str, keys: list[bytes]) -> int:
        """The leading run of ``keys`` held in L1, then on NVMe (the answers kept go before
        the disk is asked)."""
        count = self.service.lookup(tenant, keys, lock=False, count=False).count
        if count == len(keys) or self.nvme is None:
            return count
        answers.send()
        rest = [ObjectKey(tenant, key) for key in keys[count:]]
        found = self._on_loop(self.nvme.exists(rest))
        return count + next((i for i, has in enumerate(found) if not has), len(found))

    def _send(self, answers: Answers, codec: ObjectCodec, key_id: int, name: ObjectKey) -> None:
        with self._transfer() as admitted:
            if not admitted:
                answers.add(Busy())
                return
            hit = self.service.lookup(name.tenant, [name.key], lock=True, count=False)
            if hit.lease is not None:
                view = self.service.chunk_view(name.tenant)
                payload = view[hit.offsets[0] : hit.offsets[0] + hit.sizes[0]]
                self._send_object(answers, codec, key_id, name, payload, lease=hit.lease)
                return
            if self.nvme is None:
                answers.add(Missing())
                return
            answers.send()  # the answers it holds go before the disk is read
            (stored,) = self._on_loop(self.nvme.get([name]))
            if stored is None:
                answers.add(Missing())
                return
            self._send_object(answers, codec, key_id, name, stored, lease=None)

    def _send_object(
        self,
        answers: Answers,
        codec: ObjectCodec,
        key_id: int,
        name: ObjectKey,
        payload: bytes | memoryview,
        *,
        lease: int | None,
    ) -> None:
        """Seal or authenticate ``payload`` into a buffer of its own (the channel's send
        buffer where it has one), ending ``lease`` as soon as it is there, and send it (a
        slow peer holds no lease); or authenticate it where it lies and send it from there,
        ``lease`` held until it is sent (:meth:`_send_apart`). Its bytes count in flight
        until it is sent.

        Whatever is sent while ``lease`` holds the pages is sent by half its lifetime from
        now (the lease was just taken), however the peer progresses: then the connection
        goes, before the lease could expire and the pages become another chunk's while
        they are read (sealed, tagged or sent)."""
        leases = [] if lease is None else [lease]
        deadline = None if lease is None else time.monotonic() + self.service.lease_seconds / 2
        size = len(payload)
        try:
            claimed = self._claim_bytes(size)
            if not claimed and answers.holding:
                self._send_kept(answers, deadline)  # what it holds counts in flight until sent
                claimed = self._claim_bytes(size)
            if not claimed:
                with self._lock:
                    self.stats.refused["busy"] += 1
                self.service.release_all(leases)  # the "busy" may be sent with those kept
                leases.clear()
                answers.add(Busy())
                return
            if self._pacer.rate:  # a paced answer waits its turn with none kept before it
                self._send_kept(answers, deadline)
            answers.once_sent(lambda: self._sent_bytes(size))
            built = answers.channel.body_memory(codec.header_size + size)
            if built is not None:  # the object made where it is sent from: no copy
                codec.encode_into(name, payload, built, key_id)
                self._send_detached(answers, [built], size, leases)
            else:
                self._send_apart(
                    answers, codec, key_id, name, payload, leases=leases, deadline=deadline
                )
            self.stats.served_chunks += 1
            self.stats.served_bytes += size
        finally:
            self.service.release_all(leases)

    @staticmethod
    def _send_kept(answers: Answers, deadline: float | None) -> None:
        """Send the answers kept so far, by ``deadline`` where the next chunk's pages are
        leased meanwhile (:meth:`_send_object`)."""
        if deadline is not None:
            answers.send_by(deadline)
        answers.send()

    def _send_apart(
        self,
        answers: Answers,
        codec: ObjectCodec,
        key_id: int,
        name: ObjectKey,
        payload: bytes | memoryview,
        *,
        leases: list[int],
        deadline: float | None,
    ) -> None:
        """Seal ``payload`` into a buffer of the pool's and send it. Plaintext that lies in L1
        (its ``leases``) is authenticated where it lies and sent from there, the leases held
        until it is sent, by ``deadline``: half their lifetime (its pages cannot change under
        the tag meanwhile, nor a slow peer hold them longer); under a bandwidth cap it is
        copied first, so that the pace's wait holds no pages."""
        size = len(payload)
        plaintext_in_l1 = bool(leases) and not codec.seal
        from_pages = plaintext_in_l1 and not self._pacer.rate
        if plaintext_in_l1 and not from_pages:
            copy = answers.hold(codec.buffers.borrow(size))
            copy[:] = payload
            payload = copy
        header, body = answers.hold(codec.encode(name, payload, key_id))
        if not from_pages:
            self._send_detached(answers, [header, body], size, leases)
            return
        held = leases.copy()
        leases.clear()  # the answers own them now: they end once it is sent
        answers.once_sent(lambda: self.service.release_all(held))
        assert deadline is not None  # leased
        answers.send_by(deadline)
        answers.add(Object(), [header, body])

    def _send_detached(
        self, answers: Answers, body: list[Buffer], size: int, leases: list[int]
    ) -> None:
        """Send an object whose ``body`` no longer lies in L1: ``leases`` end first."""
        self.service.release_all(leases)  # out of the pages: they may go
        leases.clear()
        self._pacer.wait(size)
        answers.add(Object(), body)

    def _sent_bytes(self, size: int) -> None:
        with self._lock:
            self.stats.bytes_in_flight -= size

    @contextlib.contextmanager
    def _transfer(self) -> Iterator[bool]:
        with self._lock:
            admitted = self.stats.transfers_in_flight < self.config.max_transfers
            if admitted:
                self.stats.transfers_in_flight += 1
            else:
                self.stats.refused["busy"] += 1
        try:
            yield admitted
        finally:
            if admitted:
                with self._lock:
                    self.stats.transfers_in_flight -= 1

    def _claim_bytes(self, size: int) -> bool:
        with self._lock:
            if self.stats.bytes_in_flight + size > self.config.max_bytes_in_flight:
                return False
            self.stats.bytes_in_flight += size
            return True

    def _on_loop(self, work: Coroutine[Any, Any, T]) -> T:
        """Run an NVMe operation on the agent's event loop (the tier's home) and wait."""
        return asyncio.run_coroutine_threadsafe(work, self.loop).result(_NVME_SECONDS)
